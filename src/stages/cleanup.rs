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
//! the environment is released.

use std::time::Duration;

use anyhow::Result;

use crate::context::Ctx;
use crate::exit::Failure;
use crate::lifecycle::{self, sweep};
use crate::model::EnvPaths;
use crate::notify::{self, Audience, Event, Notification};
use crate::state::job::{hold_job_alive, LockedJob};
use crate::state::transitions::{at_cleanup, same_holder};
use crate::state::{registry, EnvironmentRecord, Holder, JobState, Settle};
use crate::transport::Transport;

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
    // Opportunistic sweep, within a small bound.
    let budget = ctx
        .uncancellable()
        .within(s.settings.suspend.cleanup_sweep_budget.get());
    match sweep::sweep(s.world(), &s.settings.suspend, &budget).await {
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
        let suspends = outcome.suspends(state.suspend_on_success, state.suspend_on_failure)
            || (request.is_some() && outcome.suspends(true, true));
        let settle = at_cleanup(
            rec.status(),
            state.mode,
            state.phase.reached(),
            state.terminated,
            suspends,
            s.settings.suspend.enabled,
        );
        crate::failpoint!("cleanup:decided");
        let why = Why { outcome, request };
        settle_environment(s, &state, &paths, &rec, &holder, why, settle, ctx).await?;
    }
    crate::failpoint!("cleanup:settled");
    // Job state goes last: if anything above failed, a retried cleanup finds it.
    locked.remove()
}

/// Why cleanup does what it does: the job's outcome, and its own request.
struct Why {
    outcome: Outcome,
    /// The reason of a request the settings honour (`crate::job_request`).
    request: Option<String>,
}

impl Why {
    fn suspend_reason(&self) -> String {
        match &self.request {
            Some(r) => format!("requested by the job: {r}"),
            None => format!("job {}", self.outcome.as_str()),
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
    notify::announce(&s.settings.suspend, &n, &s.log, Audience::Operator).await;
}

#[allow(clippy::too_many_arguments)]
async fn settle_environment(
    s: &Session,
    state: &JobState,
    paths: &EnvPaths,
    rec: &EnvironmentRecord,
    holder: &Holder,
    why: Why,
    settle: Settle,
    ctx: &Ctx,
) -> Result<()> {
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
    let w = s.world();
    let result = match settle {
        Settle::Nothing => Ok(()),
        Settle::Resuspend => {
            s.log.info(format!(
                "environment {id} ({}) did not reach a stage of job {}: putting it back to suspended",
                rec.status().as_str(),
                state.job_id
            ));
            let done = lifecycle::suspend(w, paths, holder, false, ctx).await;
            if done.is_ok() {
                let reason = format!("resume by job {} did not reach a stage", state.job_id);
                announce(s, Event::Suspend, rec, reason).await;
            }
            done.map(drop)
        }
        Settle::Suspend => suspend(s, state, paths, holder, &why, rec, transport, ctx).await,
        Settle::Release => {
            let why = if state.terminated {
                "was terminated".to_string()
            } else if !state.prepared() {
                "did not finish prepare".to_string()
            } else {
                outcome.as_str().to_string()
            };
            s.log.info(format!(
                "job {} {why}: releasing environment {id}",
                state.job_id
            ));
            let done = lifecycle::release(w, paths, holder, transport, ctx).await;
            if done.is_ok() {
                announce(s, Event::Release, rec, format!("job {why}")).await;
            }
            done
        }
    };
    // Idempotent: a release already closed it before removing the files.
    lifecycle::close(transport, id, ctx).await;
    result
}

#[allow(clippy::too_many_arguments)]
async fn suspend(
    s: &Session,
    state: &JobState,
    paths: &EnvPaths,
    holder: &Holder,
    why: &Why,
    before: &EnvironmentRecord,
    transport: Option<&dyn Transport>,
    ctx: &Ctx,
) -> Result<()> {
    let id = state.env_id;
    match &why.request {
        Some(r) => s.log.info(format!(
            "job {} {}: suspending: requested by the job: {r}",
            state.job_id,
            why.outcome.as_str()
        )),
        None => s.log.info(format!(
            "job {} {}: suspending environment {id}",
            state.job_id,
            why.outcome.as_str()
        )),
    }
    // A suspension in progress finishes even if SIGTERM arrives.
    let suspended = lifecycle::suspend(s.world(), paths, holder, true, ctx).await;
    if s.cancel.is_cancelled() {
        s.log.info(format!(
            "termination arrived during the suspension of {id}: releasing it now"
        ));
        let done = lifecycle::release(s.world(), paths, holder, transport, ctx).await;
        if done.is_ok() {
            let reason = "terminated during its suspension".to_string();
            announce(s, Event::Release, before, reason).await;
        }
        return done;
    }
    let rec = suspended?;
    s.log.info(format!(
        "environment {id} suspended; key: {}",
        rec.key.as_deref().unwrap_or("(none recorded)")
    ));
    announce(s, Event::Suspend, &rec, why.suspend_reason()).await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::SuspendRequest;
    use crate::stages::fakes::{session, FakeProvider, FakeTransports};
    use crate::state::{registry, EnvStatus, EnvironmentRecord, StateStore};

    /// Reads a record (tests only).
    trait Peek {
        fn peek(&self) -> Result<Option<EnvironmentRecord>>;
    }
    impl Peek for EnvPaths {
        fn peek(&self) -> Result<Option<EnvironmentRecord>> {
            registry::peek(self)
        }
    }

    fn ok() -> FakeTransports {
        FakeTransports {
            exit_code: 0,
            fail_connect: false,
        }
    }

    fn suspend_on_success() -> SuspendRequest {
        SuspendRequest {
            on_success: true,
            source: "test",
            ..Default::default()
        }
    }

    /// Runs a new job that suspends; returns its key.
    async fn suspended(store: &StateStore, p: &FakeProvider, job: u64) -> String {
        let (s, _) = session(store, p, ok(), job, suspend_on_success(), "success");
        crate::stages::prepare::prepare(&s).await.unwrap();
        s.log.info("build");
        cleanup(&s).await.unwrap();
        store
            .env_paths(crate::identity::new_env_id("1", job))
            .peek()
            .unwrap()
            .unwrap()
            .key
            .unwrap()
    }

    fn status(store: &StateStore, key: &str) -> Option<EnvStatus> {
        let id = crate::envkey::EnvironmentKey::parse(key).unwrap().env_id;
        store.env_paths(id).peek().unwrap().map(|r| r.status())
    }

    fn resume(key: &str, on_success: bool) -> SuspendRequest {
        SuspendRequest {
            on_success,
            resume_key: Some(key.into()),
            source: "test",
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn a_resume_whose_start_fails_goes_back_to_suspended() {
        let dir = tempfile::tempdir().unwrap();
        let store = StateStore::open(dir.path()).unwrap();
        let p = FakeProvider::default();
        let key = suspended(&store, &p, 1).await;
        p.cloud.lock().unwrap().fail_start = true;
        let (s, _) = session(&store, &p, ok(), 2, resume(&key, false), "running");
        assert!(matches!(
            crate::stages::prepare::prepare(&s).await,
            Err(Failure::System(_))
        ));
        assert_eq!(status(&store, &key), Some(EnvStatus::Resuming));
        cleanup(&s).await.unwrap();
        assert_eq!(
            status(&store, &key),
            Some(EnvStatus::Suspended),
            "never released"
        );
        assert!(
            !p.calls().iter().any(|c| c.starts_with("delete")),
            "{:?}",
            p.calls()
        );
    }

    #[tokio::test]
    async fn a_resume_whose_connection_fails_is_stopped_again_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let store = StateStore::open(dir.path()).unwrap();
        let p = FakeProvider::default();
        let key = suspended(&store, &p, 1).await;
        let broken = FakeTransports {
            exit_code: 0,
            fail_connect: true,
        };
        let (s, _) = session(&store, &p, broken, 2, resume(&key, false), "running");
        assert!(crate::stages::prepare::prepare(&s).await.is_err());
        cleanup(&s).await.unwrap();
        assert_eq!(status(&store, &key), Some(EnvStatus::Suspended));
        let name = crate::provider::MachineSpec::machine_name(crate::identity::new_env_id("1", 1));
        let expected: Vec<String> = ["create", "stop", "start", "stop"]
            .iter()
            .map(|c| format!("{c} {name}"))
            .collect();
        assert_eq!(
            p.calls(),
            expected,
            "the machine started for the resume is stopped again"
        );
    }

    #[tokio::test]
    async fn a_failed_stop_keeps_the_environment_as_suspended_and_reports_it() {
        let dir = tempfile::tempdir().unwrap();
        let store = StateStore::open(dir.path()).unwrap();
        let p = FakeProvider::default();
        p.cloud.lock().unwrap().fail_stop = true;
        let (s, _) = session(&store, &p, ok(), 1, suspend_on_success(), "success");
        crate::stages::prepare::prepare(&s).await.unwrap();
        let err = cleanup(&s).await.unwrap_err();
        assert!(
            matches!(&err, Failure::System(e) if format!("{e:#}").contains("kept as suspended")),
            "{err:?}"
        );
        let rec = store
            .env_paths(crate::identity::new_env_id("1", 1))
            .peek()
            .unwrap()
            .unwrap();
        assert_eq!(rec.status(), EnvStatus::Suspended);
        assert!(rec.last_error.unwrap().contains("fake stop failure"));
        assert!(!p.calls().iter().any(|c| c.starts_with("delete")));
    }

    #[tokio::test]
    async fn sigterm_during_suspension_finishes_the_stop_then_releases() {
        let dir = tempfile::tempdir().unwrap();
        let store = StateStore::open(dir.path()).unwrap();
        let p = FakeProvider::default();
        let (s, _) = session(&store, &p, ok(), 1, suspend_on_success(), "success");
        p.cloud.lock().unwrap().cancel_during_stop = Some(s.cancel.clone());
        crate::stages::prepare::prepare(&s).await.unwrap();
        cleanup(&s).await.unwrap();
        let calls = p.calls();
        let name = crate::provider::MachineSpec::machine_name(crate::identity::new_env_id("1", 1));
        assert_eq!(
            calls,
            vec![
                format!("create {name}"),
                format!("stop {name}"),
                format!("delete {name}")
            ]
        );
        assert_eq!(p.state(&name), Some(crate::provider::MachineState::Gone));
        assert!(!store
            .env_paths(crate::identity::new_env_id("1", 1))
            .exists());
    }

    #[tokio::test]
    async fn a_failed_release_is_retried_by_the_sweep() {
        let dir = tempfile::tempdir().unwrap();
        let store = StateStore::open(dir.path()).unwrap();
        let p = FakeProvider::default();
        p.cloud.lock().unwrap().fail_delete = true;
        let (s, _) = session(&store, &p, ok(), 1, SuspendRequest::default(), "success");
        crate::stages::prepare::prepare(&s).await.unwrap();
        assert!(cleanup(&s).await.is_err());
        let paths = store.env_paths(crate::identity::new_env_id("1", 1));
        assert_eq!(
            paths.peek().unwrap().unwrap().status(),
            EnvStatus::Releasing
        );
        p.cloud.lock().unwrap().fail_delete = false;
        let ctx = Ctx::new(s.log.clone(), s.cancel.clone(), Duration::from_secs(5));
        let report = sweep::sweep(s.world(), &s.settings.suspend, &ctx)
            .await
            .unwrap();
        assert_eq!(report.released, vec![paths.id], "{:?}", report.errors);
        assert!(!paths.exists());
    }

    #[tokio::test]
    async fn a_failed_job_with_suspend_on_failure_is_kept_and_a_canceled_one_released() {
        let dir = tempfile::tempdir().unwrap();
        let store = StateStore::open(dir.path()).unwrap();
        let p = FakeProvider::default();
        let on_failure = SuspendRequest {
            on_failure: true,
            source: "test",
            ..Default::default()
        };
        let (s, _) = session(&store, &p, ok(), 1, on_failure.clone(), "failed");
        crate::stages::prepare::prepare(&s).await.unwrap();
        cleanup(&s).await.unwrap();
        assert_eq!(
            store
                .env_paths(crate::identity::new_env_id("1", 1))
                .peek()
                .unwrap()
                .unwrap()
                .status(),
            EnvStatus::Suspended
        );
        let (s, _) = session(&store, &p, ok(), 2, on_failure, "canceled");
        crate::stages::prepare::prepare(&s).await.unwrap();
        cleanup(&s).await.unwrap();
        assert!(!store
            .env_paths(crate::identity::new_env_id("1", 2))
            .exists());
    }

    #[tokio::test]
    async fn cleanup_is_idempotent() {
        let dir = tempfile::tempdir().unwrap();
        let store = StateStore::open(dir.path()).unwrap();
        let p = FakeProvider::default();
        let (s, _) = session(&store, &p, ok(), 1, suspend_on_success(), "success");
        crate::stages::prepare::prepare(&s).await.unwrap();
        cleanup(&s).await.unwrap();
        let calls = p.calls().len();
        cleanup(&s).await.unwrap();
        assert_eq!(p.calls().len(), calls, "a second cleanup does nothing");
    }

    #[tokio::test]
    async fn a_machine_made_before_prepare_died_is_found_and_deleted() {
        let dir = tempfile::tempdir().unwrap();
        let store = StateStore::open(dir.path()).unwrap();
        let p = FakeProvider::default();
        p.cloud.lock().unwrap().fail_after_create = true;
        let (s, _) = session(&store, &p, ok(), 1, suspend_on_success(), "running");
        assert!(crate::stages::prepare::prepare(&s).await.is_err());
        let name = crate::provider::MachineSpec::machine_name(crate::identity::new_env_id("1", 1));
        assert_eq!(p.state(&name), Some(crate::provider::MachineState::Running));
        cleanup(&s).await.unwrap();
        assert_eq!(
            p.state(&name),
            Some(crate::provider::MachineState::Gone),
            "no leaked machine: {:?}",
            p.calls()
        );
    }

    #[tokio::test]
    async fn a_retried_prepare_adopts_its_half_released_environment() {
        let dir = tempfile::tempdir().unwrap();
        let store = StateStore::open(dir.path()).unwrap();
        let p = FakeProvider::default();
        let broken = FakeTransports {
            exit_code: 0,
            fail_connect: true,
        };
        let (s, _) = session(&store, &p, broken, 1, suspend_on_success(), "running");
        assert!(crate::stages::prepare::prepare(&s).await.is_err());
        p.cloud.lock().unwrap().fail_delete = true;
        assert!(cleanup(&s).await.is_err(), "the release failed");
        p.cloud.lock().unwrap().fail_delete = false;
        let (s, _) = session(&store, &p, ok(), 1, suspend_on_success(), "running");
        crate::stages::prepare::prepare(&s)
            .await
            .expect("the retry adopts the environment");
        let rec = store
            .env_paths(crate::identity::new_env_id("1", 1))
            .peek()
            .unwrap()
            .unwrap();
        assert_eq!(rec.status(), EnvStatus::Active);
    }
}
