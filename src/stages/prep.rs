//! What the two paths of `dormant prepare` (a new environment in
//! `prepare.rs`, a resume in `resume.rs`) share: the job state they continue,
//! waiting for the machine to run commands, and announcing the key.

use anyhow::Result;

use crate::context::Ctx;
use crate::events::{Event, Kind, Step};
use crate::provider::Machine;
use crate::state::job::{LockedJob, RunnerProcess};
use crate::state::{registry, EnvPaths, Holder, JobState, Mode, Phase};
use crate::transport::MachineLost;

use super::Session;

/// The job state to continue: the one a previous attempt left, or a new one;
/// saved in phase `Claiming` before anything is claimed (intent), so cleanup
/// knows which environment to look at.
pub(super) fn job_state(
    s: &Session,
    locked: &LockedJob,
    env_id: uuid::Uuid,
    mode: Mode,
) -> Result<JobState> {
    let mut state = match locked.load()? {
        Some(prev) if prev.env_id == env_id && prev.mode == mode => prev,
        _ => JobState::new(&s.runner_id, s.job_id(), s.input.project_id, env_id, mode),
    };
    state.suspend_on_success = s.input.suspend.on_success;
    state.suspend_on_failure = s.input.suspend.on_failure;
    // Who runs the job's stages: between two of them, `release --force`
    // takes this job's environment only once that process is gone.
    state.runner_process = RunnerProcess::parent_of_this_process();
    state.phase = Phase::Claiming;
    locked.save(&state)?;
    Ok(state)
}

/// Waits for the environment to run commands (SSH readiness, tool probes);
/// in volume mode also pins a new machine's host key and mounts the volume
/// (`lifecycle::volume::connect`).
pub(super) async fn connect(
    s: &Session,
    paths: &EnvPaths,
    holder: &Holder,
    machine: &Machine,
    ctx: &Ctx,
) -> Result<()> {
    let target = s.provider.target(machine)?;
    let transport = s.transports.open(&target, paths)?;
    crate::lifecycle::volume::connect(paths, holder, transport.as_ref(), s.provider.volumes(), ctx)
        .await
}

/// [`connect`] for a hot environment (docs/pause.md, "The hot window"): its
/// machine never stopped, so the connection the paused job left is taken
/// as it is (`Transport::take_live`: no login, no probe) when that job's
/// cleanup finished with its stages (no `stages_left`: nothing of them runs
/// on). Otherwise the provider is asked first whether the machine still
/// runs: one that stopped or was killed during the window is said at once
/// (a [`MachineLost`] error), not after a wait for SSH; one that runs gets
/// the full [`connect`].
pub(super) async fn connect_hot(
    s: &Session,
    paths: &EnvPaths,
    holder: &Holder,
    machine: &Machine,
    ctx: &Ctx,
) -> Result<()> {
    let target = s.provider.target(machine)?;
    let transport = s.transports.open(&target, paths)?;
    if !paths.stages_left.exists() && transport.take_live(ctx).await? {
        return Ok(());
    }
    if let Some(words) =
        crate::lifecycle::lost::machine_lost(s.provider.as_ref(), machine, ctx).await
    {
        return Err(anyhow::Error::new(MachineLost(words)).context(format!(
            "environment {} was hot, but its machine is not running any more",
            paths.id
        )));
    }
    crate::lifecycle::volume::connect(paths, holder, transport.as_ref(), s.provider.volumes(), ctx)
        .await
}

/// Records in the event log that `step` of this job's prepare failed (the
/// error itself is the stage's, said in the job log by the caller).
pub(super) async fn record_failure(
    s: &Session,
    paths: &EnvPaths,
    step: Step,
    e: &anyhow::Error,
    ctx: &Ctx,
) {
    let event = match registry::peek(paths) {
        Ok(Some(rec)) => Event::about(Kind::Failed, step.as_str(), &rec),
        // Unreadable now: what the job knows is enough to say it.
        _ => {
            let mut e = Event::new(Kind::Failed, step.as_str(), s.provider.name());
            e.env = Some(paths.id);
            e.project = Some(s.input.project_id);
            e
        }
    };
    let event = event.job(Some(s.job_id())).error(e);
    s.events.record(event, ctx).await;
}

pub(super) fn announce(s: &Session, key: &str, env_id: uuid::Uuid, resumed: bool) {
    s.log.info(format!("environment key: {key}"));
    let t = &s.input.suspend;
    let when = match (t.on_success, t.on_failure) {
        (true, true) => Some("when the job ends (success or failure)"),
        (true, false) => Some("if the job succeeds"),
        (false, true) => Some("if the job fails"),
        (false, false) => None,
    };
    match (when, s.settings.suspend.enabled) {
        (Some(when), true) => s.log.info(format!(
            "environment {env_id} will be suspended {when} (triggers from {}); resume it with the key above. \
             Job scripts see it as DORMANT_ENVIRONMENT_KEY",
            t.source
        )),
        (Some(_), false) => s.log.warn(format!(
            "the job asks to suspend its environment, but suspension is disabled on this runner \
             (suspend.enabled = false): environment {env_id} will be released at the end of the job"
        )),
        (None, _) if resumed => s.log.info(format!(
            "no suspension trigger is set: environment {env_id} will be released at the end of this job, \
             unless its script asks again (dormant-ask) or is paused (dormant pause)"
        )),
        (None, _) => {}
    }
}

/// Once the job's environment is ready: a refill of the warm pool, detached
/// (it boots while the job runs, never before its prepare is done).
pub(super) fn refill_in_background(s: &Session) {
    if s.provider.warm().is_none_or(|w| w.wanted() == 0) {
        return;
    }
    match crate::lifecycle::warm_refill::start_refill(&s.store) {
        Ok(pid) => s.log.info(format!(
            "refilling the warm pool in the background (dormant warm, pid {pid})"
        )),
        Err(e) => s.log.warn(format!(
            "could not start a refill of the warm pool ({e:#}); the timer's `dormant warm` will"
        )),
    }
}
