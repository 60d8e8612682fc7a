//! The resume half of `dormant prepare`: checks the key against this runner
//! and the environment's record, claims the environment (recovering it first
//! if its holder is gone), starts its machine and waits until it runs
//! commands. Every refusal names the key or the environment and says what to do.

use std::time::Instant;

use anyhow::Result;

use crate::context::Ctx;
use crate::envkey::EnvironmentKey;
use crate::events::{Event, Kind, RefuseCause, Step};
use crate::exit::Failure;
use crate::lifecycle::volume::{self, Relaunch};
use crate::lifecycle::{human_age, update_error};
use crate::model::StorageMode;
use crate::notify::{self, Audience, Notification};
use crate::provider::{Machine, MachineGone, Refusal, VolumeGone};
use crate::state::job::LockedJob;
use crate::state::registry::{self, UpdateError};
use crate::state::transitions::same_holder;
use crate::state::{now_unix, EnvStatus, EnvironmentRecord, Holder, Mode, Phase};

use super::prep::{announce, connect, connect_hot, job_state, record_failure};
use super::Session;

/// A refused resume, with the cause its `refused` event says.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
struct Refused {
    cause: RefuseCause,
    message: String,
}

/// A refusal (the job fails, the runner does not retry) saying `message`.
fn refuse(cause: RefuseCause, message: impl Into<String>) -> Failure {
    Failure::Refused(
        Refused {
            cause,
            message: message.into(),
        }
        .into(),
    )
}

/// What a refusal's event names as its cause: the provider's typed answers
/// (a machine or volume gone, a start it refuses), or the cause given where
/// dormant itself refused.
fn refusal_cause(e: &anyhow::Error) -> Option<RefuseCause> {
    if let Some(r) = e.downcast_ref::<Refused>() {
        return Some(r.cause);
    }
    if e.downcast_ref::<MachineGone>().is_some() {
        return Some(RefuseCause::MachineGone);
    }
    if e.downcast_ref::<VolumeGone>().is_some() {
        return Some(RefuseCause::VolumeGone);
    }
    if e.downcast_ref::<Refusal>().is_some() {
        return Some(RefuseCause::Provider);
    }
    None
}

/// Why a resume claim was not taken.
enum NotClaimed {
    Refused(Failure),
    Held,
}

/// Resumes the environment of the key `text`; a refusal is also written to
/// the event log (a `refused` event), so an operator sees refused resumes
/// (a key of another project, an environment in use, a machine gone) beside
/// what happened to the environments.
pub(super) async fn prepare_resume(
    s: &Session,
    locked: &LockedJob,
    text: &str,
    started: Instant,
    ctx: &Ctx,
) -> Result<(), Failure> {
    let result = resume(s, locked, text, started, ctx).await;
    if let Err(Failure::Refused(e)) = &result {
        record_refusal(s, text, e, ctx).await;
    }
    result
}

/// The `refused` event of a refused resume: about the environment the key
/// names (when it parses), by this job.
async fn record_refusal(s: &Session, text: &str, e: &anyhow::Error, ctx: &Ctx) {
    let cause = refusal_cause(e).unwrap_or_else(|| {
        // Every refusal of this file is typed; an untyped one is a bug here,
        // and its event still says what the job was told.
        tracing::warn!("a refused resume without a cause: {e:#}");
        RefuseCause::Provider
    });
    let key = EnvironmentKey::parse(text).ok();
    let mut event = Event::new(Kind::Refused, cause.as_str(), s.provider.name())
        .by(&s.holder(Mode::Resume))
        .error(e);
    event.project = Some(s.input.project_id);
    event.project_path = s.input.project_path.clone();
    event.runner = Some(s.runner_id.clone());
    if let Some(key) = key {
        event.env = Some(key.env_id);
        // The key as the job passed it: it parsed, so it is dormant's syntax,
        // and at most as long as what a key can be.
        event.key = Some(text.trim().to_string());
    }
    s.events.record(event, ctx).await;
}

async fn resume(
    s: &Session,
    locked: &LockedJob,
    text: &str,
    started: Instant,
    ctx: &Ctx,
) -> Result<(), Failure> {
    let source = s.input.suspend.key_from;
    let shown = crate::text::quoted(text);
    let key = EnvironmentKey::parse(text).map_err(|e| {
        refuse(
            RefuseCause::MalformedKey,
            format!(
                "the environment key {shown} (from {source}) is malformed: {e}; \
             pass the key exactly as a suspending job printed it"
            ),
        )
    })?;
    let system_id = crate::identity::system_id(&s.settings, &s.store)?;
    if key.runner_id != s.runner_id || key.system_id != system_id {
        return Err(refuse(RefuseCause::OtherRunner, format!(
            "the environment key belongs to runner {} on system {}, but this is runner {} on system {}: \
             a key is honoured only by the runner manager that made it; route the job to that runner \
             (e.g. by tags) or run it without a key to start a new environment",
            crate::text::quoted(&key.runner_id),
            crate::text::quoted(&key.system_id),
            s.runner_id,
            system_id
        )));
    }
    if let Some(p) = key.field("provider") {
        if p != s.provider.name() {
            return Err(refuse(
                RefuseCause::OtherProvider,
                format!(
                    "the environment key is for the {} provider, but this runner uses {}",
                    crate::text::quoted(p),
                    s.provider.name()
                ),
            ));
        }
    }
    let env_id = key.env_id;
    let paths = s.store.env_paths(env_id);
    let not_found = || {
        refuse(RefuseCause::NotFound, format!(
            "environment {env_id} is not in this runner's registry ({}): it was released, expired after \
             the TTL ({}), or its state was lost; start a new environment by running the job without a key",
            s.store.environments_dir().display(),
            s.settings.suspend.ttl
        ))
    };
    if !paths.exists() {
        return Err(not_found());
    }
    let holder = s.holder(Mode::Resume);
    let mut state = job_state(s, locked, env_id, Mode::Resume)?;
    crate::failpoint!("resume:claiming");
    let mut recovered = false;
    let (machine, hot) = loop {
        let claimed = registry::update(&paths, ctx, |r| claim_resume(s, r, &key, &holder)).await;
        match claimed {
            Ok((_, claimed)) => break claimed,
            Err(UpdateError::Gone(_)) => return Err(not_found()),
            Err(UpdateError::Refused(NotClaimed::Refused(f))) => return Err(f),
            Err(UpdateError::Io(e)) => return Err(Failure::System(e)),
            Err(UpdateError::Refused(NotClaimed::Held)) if !recovered => {
                recovered = true;
                held_elsewhere(s, &paths, ctx).await?;
            }
            Err(UpdateError::Refused(NotClaimed::Held)) => {
                return Err(refuse(
                    RefuseCause::InUse,
                    format!(
                    "environment {env_id} was claimed by another job while this one recovered it; \
                     retry after that job has finished"
                ),
                ))
            }
        }
    };
    crate::failpoint!("resume:claimed");
    state.phase = Phase::Preparing;
    locked.save(&state)?;

    s.log.info(format!(
        "resuming {} environment {env_id}",
        s.provider.name()
    ));
    let gone = |e: anyhow::Error| {
        if e.downcast_ref::<MachineGone>().is_some() {
            Failure::Refused(e.context(format!(
                "environment {env_id} cannot be resumed: its machine is gone; run the job without \
                 the key to start a new environment (`dormant release {env_id}` forgets this one)"
            )))
        } else if e.downcast_ref::<VolumeGone>().is_some() {
            Failure::Refused(e.context(format!(
                "environment {env_id} cannot be resumed: its data volume is gone; run the job without \
                 the key to start a new environment (`dormant release {env_id}` forgets this one)"
            )))
        } else if e.downcast_ref::<Refusal>().is_some() {
            Failure::Refused(
                e.context(format!("resuming environment {env_id}; it stays suspended")),
            )
        } else {
            Failure::System(e.context(format!("resuming environment {env_id}; it stays suspended")))
        }
    };
    let mut warm_id = None;
    let machine = match machine {
        // The hot window (docs/pause.md): the machine never stopped. Its SSH
        // master, kept by the paused job's cleanup, is taken by `connect_hot`.
        Some(machine) if hot => {
            s.log.info(format!(
                "environment {env_id} is hot: taking its running machine {} (no start, no restore)",
                machine.id
            ));
            machine
        }
        Some(machine) => {
            // No waiting behind a machine kept hot for a paused script.
            crate::lifecycle::hot::give_way(s.world(), Some(s), ctx).await;
            let started_machine = s.provider.start(&machine, ctx).await;
            if let Err(e) = &started_machine {
                record_failure(s, &paths, Step::Start, e, ctx).await;
            }
            let machine = started_machine.map_err(gone)?;
            crate::failpoint!("resume:started");
            registry::update(&paths, ctx, |r| r.machine_started(&holder, machine.clone()))
                .await
                .map_err(update_error)?;
            machine
        }
        None => {
            let relaunch = Relaunch {
                job_id: s.job_id(),
                variables: s.job.job_variables(),
            };
            let relaunched = volume::relaunch(s.world(), &paths, &holder, &relaunch, ctx).await;
            if let Err(e) = &relaunched {
                record_failure(s, &paths, Step::Start, e, ctx).await;
            }
            let relaunched = relaunched.map_err(gone)?;
            warm_id = relaunched.warm;
            relaunched.machine
        }
    };

    let connected = if hot {
        connect_hot(s, &paths, &holder, &machine, ctx).await
    } else {
        connect(s, &paths, &holder, &machine, ctx).await
    };
    if let Err(e) = connected {
        record_failure(s, &paths, Step::Connect, &e, ctx).await;
        return Err(Failure::System(
            e.context(format!("environment {env_id} stays suspended")),
        ));
    }

    let (rec, ()) = registry::update(&paths, ctx, |r| r.activate(&holder))
        .await
        .map_err(update_error)?;
    let mut resumed = Event::about(Kind::Resumed, if hot { "hot" } else { "job" }, &rec)
        .by(&holder)
        .duration(started.elapsed())
        .suspended_for(rec.suspended_at.map_or(0, |t| now_unix().saturating_sub(t)));
    resumed.warm = warm_id;
    // A continue (a paused script waits): served hot or cold, for the metrics.
    resumed.hot = rec.paused.is_some().then_some(hot);
    s.events.record(resumed, ctx).await;
    crate::failpoint!("resume:activated");
    state.phase = Phase::Ready;
    locked.save(&state)?;
    crate::failpoint!("resume:ready");
    let key = rec.key.clone().unwrap_or_else(|| text.to_string());
    let age = rec
        .suspended_at
        .map(|t| now_unix().saturating_sub(t))
        .unwrap_or(0);
    s.log.info(format!(
        "resumed environment {env_id} (suspended {}, job {} in it); get_sources will be skipped: \
         the working tree is as the suspended job left it{}",
        human_age(age),
        rec.job_count,
        if rec.storage == StorageMode::Volume {
            " (volume mode: a new machine from the image configured now; only the builds and cache \
             dirs are kept, everything else — $HOME, /etc, installed packages — is fresh from the image)"
        } else {
            ""
        }
    ));
    announce(s, &key, env_id, true);
    if warm_id.is_some() {
        super::prep::refill_in_background(s);
    }
    // Its failure is one short line here: prepare's output is the job log.
    let n = Notification::for_record(notify::Event::Resume, &rec)
        .job(&s.input)
        .reason(format!("resumed by job {}", s.job_id()));
    notify::announce(&s.settings.suspend, &s.events, &n, &s.log, Audience::Job).await;
    Ok(())
}

/// Under the record lock: may this job resume the environment? If so, claims
/// it (`suspended` → `resuming`) and returns its machine to start — `None`
/// for a volume-mode environment, which gets a new machine, unless it is
/// hot — and whether it was hot (its machine runs: nothing to start).
fn claim_resume(
    s: &Session,
    r: &mut EnvironmentRecord,
    key: &EnvironmentKey,
    holder: &Holder,
) -> Result<(Option<Machine>, bool), NotClaimed> {
    let env_id = r.id;
    let refused = |cause, m: String| NotClaimed::Refused(refuse(cause, m));
    if r.project_id != s.input.project_id {
        return Err(refused(
            RefuseCause::OtherProject,
            format!(
                "environment {env_id} belongs to project {}, not to this job's project {}: \
             an environment is only resumed by jobs of the project that suspended it",
                r.project_id, s.input.project_id
            ),
        ));
    }
    if let Some(recorded) = r.key.as_deref().and_then(|k| EnvironmentKey::parse(k).ok()) {
        for (name, value) in &key.fields {
            if let Some(ours) = recorded.field(name) {
                if ours != value {
                    return Err(refused(RefuseCause::AlteredKey, format!(
                        "the environment key says {}={} but environment {env_id} has {name}={ours}: \
                         the key was altered; use the key exactly as it was printed",
                        crate::text::quoted(name),
                        crate::text::quoted(value)
                    )));
                }
            }
        }
    }
    if crate::envkey::storage_of(key) != r.storage {
        return Err(refused(RefuseCause::AlteredKey, format!(
            "the environment key says storage={} but environment {env_id} is in {} mode: the key was \
             altered; use the key exactly as it was printed",
            crate::envkey::storage_of(key).as_str(),
            r.storage.as_str()
        )));
    }
    let machine = match r.storage {
        StorageMode::Machine => Some(r.machine.clone().ok_or_else(|| {
            NotClaimed::Refused(Failure::System(anyhow::anyhow!(
                "environment {env_id} has no machine in its record; `dormant release {env_id}` forgets it"
            )))
        })?),
        StorageMode::Volume => {
            if r.volume.as_ref().and_then(|v| v.volume.as_ref()).is_none() {
                return Err(NotClaimed::Refused(Failure::System(anyhow::anyhow!(
                    "environment {env_id} has no data volume in its record; `dormant release {env_id}` \
                     forgets it"
                ))));
            }
            // Hot: its machine runs with the volume attached and mounted.
            r.machine.clone().filter(|_| r.hot_until().is_some())
        }
    };
    // Hot: its window is recorded. Still so under this job's own earlier
    // claim (a retried prepare): the claim keeps it until `activate`.
    let hot = r.hot_until().is_some();
    match r.holder() {
        // An earlier attempt of this job claimed it (its cleanup did not run).
        Some(h) if same_holder(h, holder) => r
            .touch(holder)
            .map_err(|e| refused(RefuseCause::InUse, e.to_string()))?,
        Some(_) => return Err(NotClaimed::Held),
        None if r.status() == EnvStatus::Suspended => r
            .claim_for_resume(holder)
            .map_err(|e| refused(RefuseCause::InUse, e.to_string()))?,
        None => return Err(NotClaimed::Held),
    }
    Ok((machine, hot))
}

// (A child module: it shares this file's `refuse`.)
#[path = "resume_held.rs"]
mod held;
use held::held_elsewhere;
