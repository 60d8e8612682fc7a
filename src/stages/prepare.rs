//! `dormant prepare`: makes a new environment or resumes a suspended one, waits
//! until it runs commands, and prints its key in the job log.
//!
//! Prepare is retried by the runner (cleanup in between, fresh process, same
//! job id), so every step is idempotent: the environment id of a new job is
//! derived from runner and job id, the machine is created or reclaimed by name,
//! and every step is recorded as intent before its side effect (the job's
//! phase, the record's status) and as a result right after. Refusals of the
//! job's own input (a malformed or foreign key, an unknown environment,
//! another project's environment, one in use) are build failures, so the
//! runner does not retry what can never succeed; see `exit.rs`.

use std::time::Instant;

use anyhow::{Context, Result};

use crate::context::Ctx;
use crate::envkey::EnvironmentKey;
use crate::exit::Failure;
use crate::lifecycle::recover::{self, Found};
use crate::lifecycle::{human_age, update_error, World};
use crate::notify::{self, Audience, Event, Notification};
use crate::provider::{Machine, MachineGone, MachineSpec, Refusal};
use crate::state::job::{hold_job_alive, LockedJob};
use crate::state::registry::{self, UpdateError};
use crate::state::{
    now_unix, EnvPaths, EnvStatus, EnvironmentRecord, Holder, JobState, Mode, NewEnvironment, Phase,
};

use super::Session;

pub async fn prepare(s: &Session) -> Result<(), Failure> {
    let ctx = Ctx::new(
        s.log.clone(),
        s.cancel.clone(),
        s.settings.prepare_timeout.get(),
    );
    let _alive = hold_job_alive(&s.store, &s.runner_id, s.job_id())?;
    let locked = LockedJob::lock(&s.store, &s.runner_id, s.job_id(), &ctx).await?;
    let started = Instant::now();
    let result = match s.input.suspend.resume_key.clone() {
        Some(key) => prepare_resume(s, &locked, &key, &ctx).await,
        None => prepare_new(s, &locked, &ctx).await,
    };
    if result.is_err() && s.cancel.is_cancelled() {
        // Cleanup must know a termination (cancel, timeout) stopped prepare.
        if let Ok(Some(mut state)) = locked.load() {
            state.terminated = true;
            let _ = locked.save(&state);
        }
    }
    if result.is_ok() {
        s.log.info(format!(
            "prepare took {:.1} s",
            started.elapsed().as_secs_f64()
        ));
    }
    result
}

/// The job state to continue: the one a previous attempt left, or a new one;
/// saved in phase `Claiming` before anything is claimed (intent), so cleanup
/// knows which environment to look at.
fn job_state(s: &Session, locked: &LockedJob, env_id: uuid::Uuid, mode: Mode) -> Result<JobState> {
    let mut state = match locked.load()? {
        Some(prev) if prev.env_id == env_id && prev.mode == mode => prev,
        _ => JobState::new(&s.runner_id, s.job_id(), s.input.project_id, env_id, mode),
    };
    state.suspend_on_success = s.input.suspend.on_success;
    state.suspend_on_failure = s.input.suspend.on_failure;
    state.phase = Phase::Claiming;
    locked.save(&state)?;
    Ok(state)
}

async fn prepare_new(s: &Session, locked: &LockedJob, ctx: &Ctx) -> Result<(), Failure> {
    let env_id = crate::identity::new_env_id(&s.runner_id, s.job_id());
    let system_id = crate::identity::system_id(&s.settings, &s.store)?;
    let paths = s.store.env_paths(env_id);
    let holder = s.holder(Mode::New);
    let mut state = job_state(s, locked, env_id, Mode::New)?;
    crate::failpoint!("prepare:claiming");
    claim_new(s, &paths, &system_id, &holder, ctx).await?;
    crate::failpoint!("prepare:claimed");
    state.phase = Phase::Preparing;
    locked.save(&state)?;

    let ssh_public_key = if s.provider.needs_ssh_key() {
        Some(crate::transport::keys::ensure_keypair(&paths)?)
    } else {
        None
    };
    let spec = MachineSpec {
        env_id,
        name: MachineSpec::machine_name(env_id),
        runner_id: s.runner_id.clone(),
        system_id: system_id.clone(),
        project_id: s.input.project_id,
        job_id: s.job_id(),
        image: s.input.image.clone(),
        variables: s.job.job_variables(),
        ssh_public_key,
        paths: paths.clone(),
    };
    s.log.info(format!(
        "creating a new {} environment {env_id}",
        s.provider.name()
    ));
    let machine = s
        .provider
        .create_or_reclaim(&spec, ctx)
        .await
        .with_context(|| format!("creating {} environment {env_id}", s.provider.name()))
        .map_err(refused_or_system)?;
    crate::failpoint!("prepare:created");
    let key = environment_key(s, &system_id, env_id, &machine);
    registry::update(&paths, ctx, |r| {
        r.machine_made(&holder, machine.clone(), key.clone())
    })
    .await
    .map_err(update_error)?;
    crate::failpoint!("prepare:recorded");

    connect(s, &paths, &machine, ctx).await?;
    registry::update(&paths, ctx, |r| r.activate(&holder))
        .await
        .map_err(update_error)?;
    crate::failpoint!("prepare:activated");
    state.phase = Phase::Ready;
    locked.save(&state)?;
    crate::failpoint!("prepare:ready");
    announce(s, &key, env_id, false);
    Ok(())
}

/// Creates the new environment's record, held by this job — or takes it back
/// if an earlier attempt of this job made it.
async fn claim_new(
    s: &Session,
    paths: &EnvPaths,
    system_id: &str,
    holder: &Holder,
    ctx: &Ctx,
) -> Result<(), Failure> {
    let rec = EnvironmentRecord::new(
        NewEnvironment {
            id: paths.id,
            provider: s.provider.name(),
            runner_id: &s.runner_id,
            system_id,
            project_id: s.input.project_id,
            project_path: s.input.project_path.clone(),
            job_id: s.job_id(),
        },
        holder.clone(),
    );
    for _ in 0..2 {
        if registry::create(&s.store, &rec)? {
            return Ok(());
        }
        let retaken = registry::update(paths, ctx, |r| match r.holder() {
            Some(h) if crate::state::transitions::same_holder(h, holder) => r.touch(holder),
            _ => r.retake_for_retry(holder),
        })
        .await;
        match retaken {
            Ok(_) => return Ok(()),
            // A directory without a record (an older dormant's leftover).
            Err(UpdateError::Gone(_)) => {
                registry::remove_recordless(&s.store, paths)?;
            }
            Err(e) => {
                return Err(Failure::System(update_error(e).context(format!(
                    "environment {} for job {} already exists and is not this job's to take ({}); \
                     inspect it with `dormant inspect {}`",
                    paths.id,
                    s.job_id(),
                    paths.record.display(),
                    paths.id
                ))))
            }
        }
    }
    Err(Failure::System(anyhow::anyhow!(
        "could not create environment {} in {}",
        paths.id,
        paths.dir.display()
    )))
}

/// Why a resume claim was not taken.
enum NotClaimed {
    Refused(Failure),
    Held,
}

async fn prepare_resume(
    s: &Session,
    locked: &LockedJob,
    text: &str,
    ctx: &Ctx,
) -> Result<(), Failure> {
    let source = s.input.suspend.source;
    let shown = crate::text::excerpt(text);
    let key = EnvironmentKey::parse(text).map_err(|e| {
        Failure::refused(format!(
            "the environment key {shown} (from {source}) is malformed: {e}; \
             pass the key exactly as a suspending job printed it"
        ))
    })?;
    let system_id = crate::identity::system_id(&s.settings, &s.store)?;
    if key.runner_id != s.runner_id || key.system_id != system_id {
        return Err(Failure::refused(format!(
            "the environment key belongs to runner {} on system {}, but this is runner {} on system {}: \
             a key is honoured only by the runner manager that made it; route the job to that runner \
             (e.g. by tags) or run it without a key to start a new environment",
            crate::text::excerpt(&key.runner_id),
            crate::text::excerpt(&key.system_id),
            s.runner_id,
            system_id
        )));
    }
    if let Some(p) = key.field("provider") {
        if p != s.provider.name() {
            return Err(Failure::refused(format!(
                "the environment key is for the {} provider, but this runner uses {}",
                crate::text::excerpt(p),
                s.provider.name()
            )));
        }
    }
    let env_id = key.env_id;
    let paths = s.store.env_paths(env_id);
    let not_found = || {
        Failure::refused(format!(
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
    let machine = loop {
        let claimed = registry::update(&paths, ctx, |r| claim_resume(s, r, &key, &holder)).await;
        match claimed {
            Ok((_, machine)) => break machine,
            Err(UpdateError::Gone(_)) => return Err(not_found()),
            Err(UpdateError::Refused(NotClaimed::Refused(f))) => return Err(f),
            Err(UpdateError::Io(e)) => return Err(Failure::System(e)),
            Err(UpdateError::Refused(NotClaimed::Held)) if !recovered => {
                recovered = true;
                held_elsewhere(s, &paths, ctx).await?;
            }
            Err(UpdateError::Refused(NotClaimed::Held)) => {
                return Err(Failure::refused(format!(
                    "environment {env_id} was claimed by another job while this one recovered it; \
                     retry after that job has finished"
                )))
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
    let machine = s.provider.start(&machine, ctx).await.map_err(|e| {
        if e.downcast_ref::<MachineGone>().is_some() {
            Failure::Refused(e.context(format!(
                "environment {env_id} cannot be resumed: its machine is gone; run the job without \
                 the key to start a new environment (`dormant release {env_id}` forgets this one)"
            )))
        } else {
            Failure::System(e.context(format!("resuming environment {env_id}; it stays suspended")))
        }
    })?;
    crate::failpoint!("resume:started");
    registry::update(&paths, ctx, |r| r.machine_started(&holder, machine.clone()))
        .await
        .map_err(update_error)?;

    connect(s, &paths, &machine, ctx)
        .await
        .map_err(|e| Failure::System(e.context(format!("environment {env_id} stays suspended"))))?;

    let (rec, ()) = registry::update(&paths, ctx, |r| r.activate(&holder))
        .await
        .map_err(update_error)?;
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
         the working tree is as the suspended job left it",
        human_age(age),
        rec.job_count
    ));
    announce(s, &key, env_id, true);
    // Its failure is one short line here: prepare's output is the job log.
    let n = Notification::for_record(Event::Resume, &rec)
        .job(&s.input)
        .reason(format!("resumed by job {}", s.job_id()));
    notify::announce(&s.settings.suspend, &n, &s.log, Audience::Job).await;
    Ok(())
}

/// Under the record lock: may this job resume the environment? If so, claims
/// it (`suspended` → `resuming`) and returns its machine.
fn claim_resume(
    s: &Session,
    r: &mut EnvironmentRecord,
    key: &EnvironmentKey,
    holder: &Holder,
) -> Result<Machine, NotClaimed> {
    let env_id = r.id;
    let refuse = |m: String| NotClaimed::Refused(Failure::refused(m));
    if r.project_id != s.input.project_id {
        return Err(refuse(format!(
            "environment {env_id} belongs to project {}, not to this job's project {}: \
             an environment is only resumed by jobs of the project that suspended it",
            r.project_id, s.input.project_id
        )));
    }
    if let Some(recorded) = r.key.as_deref().and_then(|k| EnvironmentKey::parse(k).ok()) {
        for (name, value) in &key.fields {
            if let Some(ours) = recorded.field(name) {
                if ours != value {
                    return Err(refuse(format!(
                        "the environment key says {}={} but environment {env_id} has {name}={ours}: \
                         the key was altered; use the key exactly as it was printed",
                        crate::text::excerpt(name),
                        crate::text::excerpt(value)
                    )));
                }
            }
        }
    }
    let machine = r.machine.clone().ok_or_else(|| {
        NotClaimed::Refused(Failure::System(anyhow::anyhow!(
            "environment {env_id} has no machine in its record; `dormant release {env_id}` forgets it"
        )))
    })?;
    match r.holder() {
        // An earlier attempt of this job claimed it (its cleanup did not run).
        Some(h) if crate::state::transitions::same_holder(h, holder) => {
            r.touch(holder).map_err(|e| refuse(e.to_string()))?
        }
        Some(_) => return Err(NotClaimed::Held),
        None if r.status() == EnvStatus::Suspended => r
            .claim_for_resume(holder)
            .map_err(|e| refuse(e.to_string()))?,
        None => return Err(NotClaimed::Held),
    }
    Ok(machine)
}

/// The environment is held by someone else: recover it if its holder is gone,
/// else refuse saying who holds it and what to do.
async fn held_elsewhere(s: &Session, paths: &EnvPaths, ctx: &Ctx) -> Result<(), Failure> {
    let id = paths.id;
    let w = World {
        store: &s.store,
        provider: s.provider.as_ref(),
    };
    let me = recover::operator(&format!("job {}'s prepare", s.job_id()));
    let found = recover::recover(w, paths, &me, &s.settings.suspend, false, ctx)
        .await
        .map_err(|e| Failure::System(e.context(format!("recovering environment {id}"))))?;
    match found {
        Found::NoEnvironment | Found::NotHeld | Found::Recovered { .. } => Ok(()),
        Found::Live(holder) => Err(Failure::refused(match holder {
            Holder::Shell { .. } => format!(
                "environment {id} is in use by a shell ({}) on the runner host: retry after it exits",
                holder.describe()
            ),
            Holder::Operator { .. } => format!(
                "environment {id} is being changed by {}: retry in a moment",
                holder.describe()
            ),
            Holder::Job { .. } => format!(
                "environment {id} is in use by {}: one environment runs one job at a time; \
                 retry after that job has finished",
                holder.describe()
            ),
        })),
        Found::Idle { holder, idle } => Err(Failure::refused(format!(
            "environment {id} is held by {}, which has no process running (idle {idle} s): if it is \
             gone, the environment is recovered automatically once it has been idle for \
             suspend.claim_grace ({}); retry then",
            holder.describe(),
            s.settings.suspend.claim_grace
        ))),
    }
}

/// A provider's [`Refusal`] (an allow-list said no) is the job's fault and is
/// not retried; anything else is a system failure.
fn refused_or_system(e: anyhow::Error) -> Failure {
    if e.downcast_ref::<Refusal>().is_some() {
        Failure::Refused(e)
    } else {
        Failure::System(e)
    }
}

/// Waits for the environment to run commands (SSH readiness, tool probes).
async fn connect(s: &Session, paths: &EnvPaths, machine: &Machine, ctx: &Ctx) -> Result<()> {
    let target = s.provider.target(machine)?;
    let transport = s.transports.open(&target, paths)?;
    transport.connect(ctx).await
}

fn environment_key(s: &Session, system_id: &str, env_id: uuid::Uuid, machine: &Machine) -> String {
    let mut key = EnvironmentKey::new(&s.runner_id, system_id, env_id)
        .with_field("provider", s.provider.name());
    for (k, v) in s.provider.key_fields(machine) {
        key = key.with_field(&k, &v);
    }
    key.encode()
}

fn announce(s: &Session, key: &str, env_id: uuid::Uuid, resumed: bool) {
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
            "no suspension trigger is set: environment {env_id} will be released at the end of this job"
        )),
        (None, _) => {}
    }
}
