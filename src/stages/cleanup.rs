//! `dormant cleanup`: suspends or releases the environment its job holds, then
//! removes the job's state. Best effort, idempotent, bounded: every step is
//! tried, errors are reported together at the end, job state goes last. Its
//! output reaches only the runner's log, never the job log.
//!
//! Cleanup acts on an environment only if the record says this job holds it
//! (not on what the job state says: prepare may have been killed between
//! claiming and recording that it did). What it does is
//! `state::transitions::at_cleanup`: a resume that never reached a stage goes
//! back to suspended; a job whose triggers match its outcome (not terminated)
//! is suspended, and a SIGTERM during the suspension lets the stop finish, then
//! releases (termination wins, without a half-suspended machine); otherwise
//! the environment is released. Before either, what the job's stages left
//! on the machine is dealt with (`cleanup_left.rs`).

use std::time::Duration;

use anyhow::Result;

use crate::context::Ctx;
use crate::events::{ReleaseCause, SuspendCause};
use crate::exit::Failure;
use crate::lifecycle::lost::MACHINE_LOST;
use crate::lifecycle::{self, sweep, Reason};
use crate::model::EnvPaths;
use crate::notify::{self, Audience, Event, Notification};
use crate::state::job::{hold_job_alive, LockedJob};
use crate::state::transitions::{at_cleanup, same_holder};
use crate::state::{registry, EnvironmentRecord, Holder, JobState, Settle};
use crate::transport::Transport;

use super::cleanup_left::{keep_question, stop_leftovers};
use super::outcome::Outcome;
use super::Session;

/// Upper bound for cleanup's provider calls (a stop waits for the machine to
/// stop; a terminate for it to go). The runner's own cleanup timeout is 1 h.
const CLEANUP_BUDGET: Duration = Duration::from_secs(15 * 60);

pub async fn cleanup(s: &Session) -> Result<(), Failure> {
    let ctx = Ctx::new(s.log.clone(), s.cancel.clone(), CLEANUP_BUDGET);
    let mut errors: Vec<anyhow::Error> = Vec::new();
    if let Err(e) = cleanup_job(s, &ctx).await {
        errors.push(e);
    }
    // Opportunistic sweep of the next slice of environments, within a small
    // bound: its cost does not grow with the registry (`dormant sweep` does
    // the whole of it).
    let budget = ctx
        .uncancellable()
        .within(s.settings.suspend.cleanup_sweep_budget.get());
    let scope = sweep::Scope::Slice;
    match sweep::sweep(s.world(), &s.settings.suspend, scope, &budget).await {
        Ok(report) => errors.extend(report.errors),
        Err(e) => errors.push(e.context("sweeping expired environments")),
    }
    if errors.is_empty() {
        return Ok(());
    }
    let text = errors
        .iter()
        .map(|e| format!("{e:#}"))
        .collect::<Vec<_>>()
        .join("\n  ");
    Err(Failure::System(anyhow::anyhow!(
        "cleanup of job {} finished with errors:\n  {text}",
        s.job_id()
    )))
}

async fn cleanup_job(s: &Session, ctx: &Ctx) -> Result<()> {
    let _alive = hold_job_alive(&s.store, &s.runner_id, s.job_id())?;
    // Cleanup is never cancelled with the job: a SIGTERM must not stop it here.
    let locked = LockedJob::lock(&s.store, &s.runner_id, s.job_id(), &ctx.uncancellable()).await?;
    let Some(state) = locked.load()? else {
        // Prepare never saved anything (config failed, or cleanup already ran).
        return Ok(());
    };
    let paths = s.store.env_paths(state.env_id);
    let holder = s.holder(state.mode);
    let ours =
        registry::peek(&paths)?.filter(|rec| rec.holder().is_some_and(|h| same_holder(h, &holder)));
    if let Some(rec) = ours {
        let outcome = Outcome::of(&state, s.job.job_status());
        let request = honoured_request(s, &state, outcome);
        // A job's own request suspends on any outcome but a cancel or timeout.
        // So does a script that asked (`dormant-ask`): it waits for its answer.
        // A relayed script's exit code that only this host has: its stage's
        // `dormant run` was killed after the machine let the script go
        // (`crate::state::relayed_end`). Kept, as a script that asked is.
        let relayed = match crate::state::relayed_end::read(&paths) {
            Ok(r) => r.filter(|_| state.paused.is_none()),
            Err(e) => {
                s.log.warn(format!(
                    "environment {}: the exit code a continued script gave could not be read                      ({e:#}): the next dormant-continue cannot give it",
                    state.env_id
                ));
                None
            }
        };
        let suspends = outcome.suspends(state.suspend_on_success, state.suspend_on_failure)
            || ((request.is_some() || state.paused.is_some() || relayed.is_some())
                && outcome.suspends(true, true));
        let settle = at_cleanup(
            rec.status(),
            state.mode,
            state.phase.reached(),
            state.terminated,
            suspends,
            s.settings.suspend.enabled,
            state.machine_lost.is_some(),
        );
        crate::failpoint!("cleanup:decided");
        let why = Why {
            outcome,
            request,
            machine_lost: state.machine_lost.clone(),
            paused: state.paused.clone(),
            relayed,
            suspends,
        };
        let held = Held {
            s,
            state: &state,
            paths: &paths,
            rec: &rec,
            holder: &holder,
            ctx,
        };
        settle_environment(held, why, settle).await?;
    }
    crate::failpoint!("cleanup:settled");
    // Job state goes last: if anything above failed, a retried cleanup finds it.
    locked.remove()
}

/// The environment the job holds, as cleanup settles it: the job's state,
/// the environment's files and record, the holder the record names.
#[derive(Clone, Copy)]
struct Held<'a> {
    s: &'a Session,
    state: &'a JobState,
    paths: &'a EnvPaths,
    rec: &'a EnvironmentRecord,
    holder: &'a Holder,
    ctx: &'a Ctx,
}

/// Why cleanup does what it does: the job's outcome, and its own request.
struct Why {
    outcome: Outcome,
    /// The reason of a request the settings honour (`crate::job_request`).
    request: Option<String>,
    /// Volume mode: what became of the machine that went away under a stage.
    machine_lost: Option<String>,
    /// The question of a script that asked and waits (docs/pause.md).
    paused: Option<String>,
    /// A continued script's end whose exit code the runner never had.
    relayed: Option<crate::state::relayed_end::RelayedEnd>,
    /// Whether the outcome matched a trigger or the request.
    suspends: bool,
}

impl Why {
    fn suspend_reason(&self) -> Reason<SuspendCause> {
        if let (None, Some(q)) = (&self.machine_lost, &self.paused) {
            return Reason::new(
                SuspendCause::Paused,
                format!("paused: {}", crate::lifecycle::pause::summary(q)),
            );
        }
        if let (None, Some(end)) = (&self.machine_lost, &self.relayed) {
            return Reason::new(
                SuspendCause::Paused,
                format!(
                    "paused: the continued script ended with exit code {}, which this job did \
                     not give (its dormant run was killed): the next dormant-continue gives it",
                    end.code
                ),
            );
        }
        match (&self.machine_lost, &self.request) {
            (Some(_), _) => Reason::new(SuspendCause::MachineLost, MACHINE_LOST),
            (None, Some(r)) => Reason::new(
                SuspendCause::JobRequest,
                format!("requested by the job: {r}"),
            ),
            (None, None) => Reason::new(
                SuspendCause::Triggers,
                format!("job {}", self.outcome.as_str()),
            ),
        }
    }

    /// Why a job's environment is released, for the event log.
    fn release_cause(&self, state: &JobState, enabled: bool) -> ReleaseCause {
        let stopped = matches!(self.outcome, Outcome::Canceled | Outcome::TimedOut);
        if state.terminated || stopped {
            ReleaseCause::Canceled
        } else if !state.prepared() {
            ReleaseCause::PrepareFailed
        } else if self.suspends && !enabled {
            ReleaseCause::SuspendDisabled
        } else {
            ReleaseCause::NoTrigger
        }
    }
}

/// The job's request, if it made one the settings honour; says in the
/// runner's log when they do not.
fn honoured_request(s: &Session, state: &JobState, outcome: Outcome) -> Option<String> {
    use crate::job_request::{verdict, Verdict};
    let reason = state.job_request.clone()?;
    match verdict(&s.settings) {
        Verdict::Honoured => {
            if !outcome.suspends(true, true) {
                s.log.info(format!(
                    "job {} asked to be suspended ({reason}) but was {}: its environment is released",
                    state.job_id,
                    outcome.as_str()
                ));
            }
            Some(reason)
        }
        Verdict::NotAllowed => {
            s.log.warn(format!(
                "job {} asked to be suspended ({reason}); ignored: suspend.allow_job_request = false",
                state.job_id
            ));
            None
        }
        Verdict::SuspendDisabled => None,
    }
}

/// Runs the notify hook (if set) for what happened to `rec`.
async fn announce(s: &Session, event: Event, rec: &EnvironmentRecord, reason: String) {
    let n = Notification::for_record(event, rec)
        .job(&s.input)
        .reason(reason);
    notify::announce(
        &s.settings.suspend,
        &s.events,
        &n,
        &s.log,
        Audience::Operator,
    )
    .await;
}

/// Does what `settle` says, after stopping what the job's stages left and
/// the shells joined beside it, and closes the connection.
async fn settle_environment(held: Held<'_>, why: Why, settle: Settle) -> Result<()> {
    let Held {
        s,
        state,
        paths,
        rec,
        holder,
        ctx,
    } = held;
    let id = state.env_id;
    let outcome = why.outcome;
    // The connection is closed after the provider's stop or delete, not
    // before: the `ssh` provider removes a released workspace over it, so a
    // job costs one SSH handshake. Closing a master whose machine is already
    // stopped is still immediate (`ssh -O exit` talks to the local master).
    let transport = rec
        .machine
        .as_ref()
        .and_then(|m| s.provider.target(m).ok())
        .and_then(|t| s.transports.open(&t, paths).ok());
    let transport = transport.as_deref();
    if settle != Settle::Nothing && paths.stages_left.exists() {
        if state.machine_lost.is_some() {
            // Nothing of the job runs on a machine that went away.
            let _ = std::fs::remove_file(&paths.stages_left);
        } else {
            stop_leftovers(s, rec, paths, transport, ctx).await;
        }
    }
    if settle != Settle::Nothing {
        // Shells joined beside the job (`dormant shell`) end with it.
        lifecycle::joined::end_all(paths, transport, state.job_id, ctx).await;
    }
    let w = s.world();
    // A hot window keeps the job's SSH master for the resume (no new login).
    let mut keep_master = false;
    let result = match settle {
        Settle::Nothing => Ok(()),
        Settle::Resuspend => {
            s.log.info(format!(
                "environment {id} ({}) did not reach a stage of job {}: putting it back to suspended",
                rec.status().as_str(),
                state.job_id
            ));
            let reason = format!("resume by job {} did not reach a stage", state.job_id);
            if let Some(done) = back_hot(held, &reason).await {
                keep_master = matches!(done, Ok(true));
                done.map(drop)
            } else {
                let unused = Reason::new(SuspendCause::Unused, &reason);
                let done =
                    lifecycle::suspend(w, paths, holder, false, transport, &unused, ctx).await;
                if done.is_ok() {
                    announce(s, Event::Suspend, rec, reason).await;
                }
                done.map(drop)
            }
        }
        Settle::Suspend => {
            keep_question(state, why.relayed.as_ref(), paths, rec, transport, ctx).await;
            match hot_window(held, &why) {
                Some(window) => {
                    let done = keep_hot(held, &why, window, transport).await;
                    keep_master = matches!(done, Ok(true));
                    done.map(drop)
                }
                None => suspend(held, &why, transport).await,
            }
        }
        Settle::Release => {
            let words = if state.terminated {
                "was terminated".to_string()
            } else if !state.prepared() {
                "did not finish prepare".to_string()
            } else if let Some(lost) = &state.machine_lost {
                // Nothing asked to keep it: a new job without a failure trigger.
                format!("{} ({MACHINE_LOST}: {lost})", outcome.as_str())
            } else {
                outcome.as_str().to_string()
            };
            s.log.info(format!(
                "job {} {words}: releasing environment {id}",
                state.job_id
            ));
            let reason = Reason::new(
                why.release_cause(state, s.settings.suspend.enabled),
                format!("job {words}"),
            );
            let done = lifecycle::release(w, paths, holder, transport, &reason, ctx).await;
            if done.is_ok() {
                announce(s, Event::Release, rec, reason.text).await;
            }
            done
        }
    };
    // Idempotent: a release already closed it before removing the files.
    if !keep_master {
        lifecycle::close(transport, id, ctx).await;
    }
    result
}

/// Suspends the environment (the data volume kept, for a machine lost);
/// a termination during the suspension releases it once the stop is done.
async fn suspend(held: Held<'_>, why: &Why, transport: Option<&dyn Transport>) -> Result<()> {
    let Held {
        s,
        state,
        paths,
        rec: before,
        holder,
        ctx,
    } = held;
    let id = state.env_id;
    match (&why.machine_lost, &why.request) {
        (Some(lost), _) => s.log.info(format!(
            "job {} {}: its machine went away under it ({lost}): keeping environment {id}'s \
             data volume (machine lost); a job with its key resumes it on a new machine",
            state.job_id,
            why.outcome.as_str()
        )),
        (None, Some(r)) => s.log.info(format!(
            "job {} {}: suspending: requested by the job: {r}",
            state.job_id,
            why.outcome.as_str()
        )),
        (None, None) => s.log.info(format!(
            "job {} {}: suspending environment {id}",
            state.job_id,
            why.outcome.as_str()
        )),
    }
    // A lost machine cannot be asked to unmount anything.
    let guest = transport.filter(|_| why.machine_lost.is_none());
    // A suspension in progress finishes even if SIGTERM arrives.
    let reason = why.suspend_reason();
    let suspended = lifecycle::suspend(s.world(), paths, holder, true, guest, &reason, ctx).await;
    if s.cancel.is_cancelled() {
        s.log.info(format!(
            "termination arrived during the suspension of {id}: releasing it now"
        ));
        let reason = Reason::new(ReleaseCause::Canceled, "terminated during its suspension");
        let done = lifecycle::release(s.world(), paths, holder, transport, &reason, ctx).await;
        if done.is_ok() {
            announce(s, Event::Release, before, reason.text).await;
        }
        return done;
    }
    let rec = suspended?;
    s.log.info(format!(
        "environment {id} suspended; key: {}",
        rec.key.as_deref().unwrap_or("(none recorded)")
    ));
    if let Some(lost) = rec.paused.as_ref().and_then(|p| p.lost.as_deref()) {
        s.log.warn(format!(
            "environment {id}: the paused script is gone ({lost}); the next dormant-continue says so"
        ));
    }
    announce(
        s,
        Event::Suspend,
        &rec,
        lifecycle::paused_lost(&reason.text, &rec),
    )
    .await;
    Ok(())
}

// (A child module: it shares this file's `Held`, `Why`, `suspend`.)
#[path = "cleanup_hot.rs"]
mod hot;
use hot::{back_hot, hot_window, keep_hot};

#[cfg(test)]
#[path = "cleanup_tests.rs"]
mod tests;
