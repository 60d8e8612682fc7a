//! `dormant cleanup`: suspends or releases the environment, then removes the
//! job's state. Best effort, idempotent, bounded: every step is tried, errors
//! are reported together at the end, job state goes last. Its output reaches
//! only the runner's log, never the job log.
//!
//! The decision:
//! - a resume whose prepare did not complete → back to suspended (a failed
//!   resume must never destroy what it tried to resume);
//! - prepare completed, suspension enabled, not terminated, a trigger matches
//!   the outcome → suspend; a SIGTERM during the suspension lets it finish,
//!   then releases (termination wins, without a half-suspended machine);
//! - otherwise → release.

use std::time::Duration;

use anyhow::{Context, Result};

use crate::context::Ctx;
use crate::exit::Failure;
use crate::ops::sweep;
use crate::state::job::LockedJob;
use crate::state::{now_unix, EnvPaths, EnvStatus, EnvironmentRecord, JobState, Mode};
use crate::transport::Transport;

use super::outcome::Outcome;
use super::prepare::update_record;
use super::Session;

/// Upper bound for cleanup's provider calls (a stop waits for the machine to
/// stop; a terminate for it to go). The runner's own cleanup timeout is 1 h.
const CLEANUP_BUDGET: Duration = Duration::from_secs(15 * 60);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Suspend,
    /// A resume that failed in prepare: the environment goes back to suspended.
    Resuspend,
    Release,
}

pub fn decide(state: &JobState, outcome: Outcome, suspend_enabled: bool) -> Decision {
    if state.mode == Mode::Resume && !state.prepare_completed {
        return Decision::Resuspend;
    }
    if state.prepare_completed
        && suspend_enabled
        && !state.terminated
        && outcome.suspends(state.suspend_on_success, state.suspend_on_failure)
    {
        return Decision::Suspend;
    }
    Decision::Release
}

pub async fn cleanup(s: &Session) -> Result<(), Failure> {
    let ctx = Ctx::new(s.log.clone(), s.cancel.clone(), CLEANUP_BUDGET);
    let mut errors: Vec<anyhow::Error> = Vec::new();
    if let Err(e) = cleanup_job(s, &ctx).await {
        errors.push(e);
    }
    // Opportunistic TTL sweep, within a small bound.
    let budget = ctx
        .uncancellable()
        .within(s.settings.suspend.cleanup_sweep_budget.get());
    match sweep::expired(&s.store, s.provider.as_ref(), &s.settings, &budget).await {
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
    let locked = LockedJob::lock(&s.store, &s.runner_id, s.job_id())?;
    let Some(state) = locked.load()? else {
        // Prepare never saved anything (config failed, or cleanup already ran).
        return Ok(());
    };
    let paths = s.store.env_paths(state.env_id);
    if state.claimed {
        let owned = paths
            .peek()?
            .filter(|rec| rec.current_job == Some(state.job_id));
        if let Some(rec) = owned {
            let outcome = Outcome::of(&state, s.job.job_status());
            let decision = decide(&state, outcome, s.settings.suspend.enabled);
            settle(s, &state, &paths, rec, outcome, decision, ctx).await?;
        }
    }
    // Job state goes last: if anything above failed, a retried cleanup finds it.
    locked.remove()
}

async fn settle(
    s: &Session,
    state: &JobState,
    paths: &EnvPaths,
    rec: EnvironmentRecord,
    outcome: Outcome,
    decision: Decision,
    ctx: &Ctx,
) -> Result<()> {
    let id = state.env_id;
    // The connection is closed after the provider's stop or delete, not
    // before: the `ssh` provider removes a released workspace over it, so a
    // job costs one SSH handshake. Closing a master whose machine is already
    // stopped is still immediate (`ssh -O exit` talks to the local master).
    let transport = rec
        .machine
        .as_ref()
        .and_then(|m| s.provider.target(m).ok())
        .and_then(|t| s.transports.open(&t, paths).ok());
    let result = settle_machine(s, state, &rec, outcome, decision, transport.as_deref(), ctx).await;
    // Idempotent: a release already closed it before removing the files.
    close(transport.as_deref(), id, ctx).await;
    result
}

async fn close(transport: Option<&dyn Transport>, id: uuid::Uuid, ctx: &Ctx) {
    if let Some(t) = transport {
        if let Err(e) = t.close(ctx).await {
            tracing::debug!("closing the connection to {id}: {e:#}");
        }
    }
}

async fn settle_machine(
    s: &Session,
    state: &JobState,
    rec: &EnvironmentRecord,
    outcome: Outcome,
    decision: Decision,
    transport: Option<&dyn Transport>,
    ctx: &Ctx,
) -> Result<()> {
    let id = state.env_id;
    let paths = &s.store.env_paths(id);
    match decision {
        Decision::Resuspend => {
            s.log.info(format!(
                "resume of environment {id} did not complete: putting it back to suspended"
            ));
            let stopped = match &rec.machine {
                Some(m) => s.provider.stop(m, &ctx.uncancellable()).await,
                None => Ok(()),
            };
            update_record(paths, |r| {
                r.status = EnvStatus::Suspended;
                r.current_job = None;
                r.last_error = stopped.as_ref().err().map(|e| format!("{e:#}"));
                if r.suspended_at.is_none() {
                    r.suspended_at = Some(now_unix());
                }
            })?;
            stopped.with_context(|| {
                format!(
                    "stopping environment {id} after its failed resume (it is kept as suspended)"
                )
            })
        }
        Decision::Suspend => {
            s.log.info(format!(
                "job {} {}: suspending environment {id}",
                state.job_id,
                outcome.as_str()
            ));
            // A suspension in progress finishes even if SIGTERM arrives.
            let stopped = match &rec.machine {
                Some(m) => s.provider.stop(m, &ctx.uncancellable()).await,
                None => Err(anyhow::anyhow!(
                    "environment {id} has no machine to suspend"
                )),
            };
            update_record(paths, |r| {
                r.status = EnvStatus::Suspended;
                r.current_job = None;
                r.suspended_at = Some(now_unix());
                r.last_error = stopped.as_ref().err().map(|e| format!("{e:#}"));
            })?;
            if s.cancel.is_cancelled() {
                s.log.info(format!(
                    "termination arrived during the suspension of {id}: releasing it now"
                ));
                return release(s, paths, transport, ctx).await;
            }
            match stopped {
                Ok(()) => {
                    s.log.info(format!(
                        "environment {id} suspended; key: {}",
                        rec.key.as_deref().unwrap_or("?")
                    ));
                    Ok(())
                }
                // Kept as suspended all the same: its disk holds the job's work; the
                // next resume starts it, or the TTL sweep deletes it.
                Err(e) => {
                    Err(e.context(format!("suspending environment {id} (kept as suspended)")))
                }
            }
        }
        Decision::Release => {
            let why = if state.terminated {
                "was terminated".to_string()
            } else if !state.prepare_completed {
                "did not finish prepare".to_string()
            } else {
                outcome.as_str().to_string()
            };
            s.log.info(format!(
                "job {} {why}: releasing environment {id}",
                state.job_id
            ));
            release(s, paths, transport, ctx).await
        }
    }
}

/// Deletes the machine, then the environment's files. A failed delete leaves
/// the record as `releasing` for the sweep to retry.
/// The connection is closed between the two: after the delete (which may use
/// it) and before the files (which hold its control socket) go.
pub(crate) async fn release(
    s: &Session,
    paths: &EnvPaths,
    transport: Option<&dyn Transport>,
    ctx: &Ctx,
) -> Result<()> {
    let deleted = sweep::delete_machine(s.provider.as_ref(), paths, &ctx.uncancellable()).await;
    close(transport, paths.id, ctx).await;
    deleted?;
    paths.remove_all()
}
