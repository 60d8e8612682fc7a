//! `dormant prepare`: makes a new environment or resumes a suspended one, waits
//! until it runs commands, and prints its key in the job log.
//!
//! Prepare is retried by the runner (cleanup in between, fresh process, same
//! job id), so every step is idempotent: the environment id of a new job is
//! derived from runner and job id, the machine is created or reclaimed by name,
//! and state is saved right after every side effect. Refusals of the job's own
//! input (a malformed or foreign key, an unknown environment, another project's
//! environment, one in use) are build failures, so the runner does not retry
//! what can never succeed; see `exit.rs`.

use std::time::Instant;

use anyhow::{Context, Result};

use crate::context::Ctx;
use crate::envkey::EnvironmentKey;
use crate::exit::Failure;
use crate::provider::{Machine, MachineGone, MachineSpec, Refusal};
use crate::state::job::LockedJob;
use crate::state::{now_unix, EnvPaths, EnvStatus, EnvironmentRecord, JobState, Mode};

use super::Session;

pub async fn prepare(s: &Session) -> Result<(), Failure> {
    let ctx = Ctx::new(
        s.log.clone(),
        s.cancel.clone(),
        s.settings.prepare_timeout.get(),
    );
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

/// The job state to continue: the one a previous attempt left, or a new one.
fn job_state(s: &Session, locked: &LockedJob, env_id: uuid::Uuid, mode: Mode) -> Result<JobState> {
    let mut state = match locked.load()? {
        Some(prev) if prev.env_id == env_id && prev.mode == mode => prev,
        _ => JobState::new(&s.runner_id, s.job_id(), s.input.project_id, env_id, mode),
    };
    state.suspend_on_success = s.input.suspend.on_success;
    state.suspend_on_failure = s.input.suspend.on_failure;
    state.prepare_completed = false;
    locked.save(&state)?;
    Ok(state)
}

async fn prepare_new(s: &Session, locked: &LockedJob, ctx: &Ctx) -> Result<(), Failure> {
    let env_id = crate::identity::new_env_id(&s.runner_id, s.job_id());
    let system_id = crate::identity::system_id(&s.settings, &s.store)?;
    let paths = s.store.env_paths(env_id);
    let mut state = job_state(s, locked, env_id, Mode::New)?;

    paths.create()?;
    {
        let env = paths.lock()?;
        match env.load()? {
            None => {
                let mut rec = EnvironmentRecord::new(
                    env_id,
                    s.provider.name(),
                    &s.runner_id,
                    &system_id,
                    s.input.project_id,
                    s.job_id(),
                );
                rec.project_path = s.input.project_path.clone();
                env.save(&rec)?;
            }
            Some(rec) if rec.current_job == Some(s.job_id()) => {}
            // This job made it and an earlier attempt's cleanup could not finish
            // releasing it: adopt it; create_or_reclaim finds its machine.
            Some(mut rec) if rec.created_by_job == s.job_id() => {
                rec.status = EnvStatus::Active;
                rec.current_job = Some(s.job_id());
                env.save(&rec)?;
            }
            Some(rec) => {
                return Err(anyhow::anyhow!(
                    "environment {env_id} for job {} already exists and belongs to job {:?} ({}); \
                     inspect it with `dormant list`",
                    s.job_id(),
                    rec.current_job,
                    paths.record.display()
                )
                .into())
            }
        }
    }
    state.claimed = true;
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
    let key = environment_key(s, &system_id, env_id, &machine);
    update_record(&paths, |rec| {
        rec.machine = Some(machine.clone());
        rec.key = Some(key.clone());
    })?;

    connect(s, &paths, &machine, ctx).await?;

    state.prepare_completed = true;
    locked.save(&state)?;
    announce(s, &key, env_id, false);
    Ok(())
}

async fn prepare_resume(
    s: &Session,
    locked: &LockedJob,
    text: &str,
    ctx: &Ctx,
) -> Result<(), Failure> {
    let source = s.input.suspend.source;
    let key = EnvironmentKey::parse(text).map_err(|e| {
        Failure::refused(format!(
            "the environment key {text:?} (from {source}) is malformed: {e}; \
             pass the key exactly as a suspending job printed it"
        ))
    })?;
    let system_id = crate::identity::system_id(&s.settings, &s.store)?;
    if key.runner_id != s.runner_id || key.system_id != system_id {
        return Err(Failure::refused(format!(
            "the environment key belongs to runner {} on system {:?}, but this is runner {} on system {:?}: \
             a key is honoured only by the runner manager that made it; route the job to that runner \
             (e.g. by tags) or run it without a key to start a new environment",
            key.runner_id, key.system_id, s.runner_id, system_id
        )));
    }
    if let Some(p) = key.field("provider") {
        if p != s.provider.name() {
            return Err(Failure::refused(format!(
                "the environment key is for the {p} provider, but this runner uses {}",
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
            s.store.root().join("environments").display(),
            s.settings.suspend.ttl
        ))
    };
    if !paths.exists() {
        return Err(not_found());
    }
    let mut state = job_state(s, locked, env_id, Mode::Resume)?;
    let machine = {
        let env = paths.lock()?;
        let mut rec = env.load()?.ok_or_else(not_found)?;
        if rec.project_id != s.input.project_id {
            return Err(Failure::refused(format!(
                "environment {env_id} belongs to project {}, not to this job's project {}: \
                 an environment is only resumed by jobs of the project that suspended it",
                rec.project_id, s.input.project_id
            )));
        }
        if let Some(recorded) = rec
            .key
            .as_deref()
            .and_then(|k| EnvironmentKey::parse(k).ok())
        {
            for (name, value) in &key.fields {
                if let Some(ours) = recorded.field(name) {
                    if ours != value {
                        return Err(Failure::refused(format!(
                            "the environment key says {name}={value} but environment {env_id} has {name}={ours}: \
                             the key was altered; use the key exactly as it was printed"
                        )));
                    }
                }
            }
        }
        match rec.status {
            EnvStatus::Suspended => {}
            EnvStatus::Active | EnvStatus::Resuming if rec.current_job == Some(s.job_id()) => {}
            EnvStatus::Active | EnvStatus::Resuming => {
                return Err(Failure::refused(format!(
                    "environment {env_id} is in use by job {}: one environment runs one job at a time; \
                     retry after that job has finished",
                    rec.current_job.map(|j| j.to_string()).unwrap_or_else(|| "?".into())
                )))
            }
            EnvStatus::Releasing => {
                return Err(Failure::refused(format!("environment {env_id} is being released")));
            }
        }
        let machine = rec.machine.clone().with_context(|| {
            format!(
                "environment {env_id} has no machine in {}",
                paths.record.display()
            )
        })?;
        rec.status = EnvStatus::Resuming;
        rec.current_job = Some(s.job_id());
        env.save(&rec)?;
        machine
    };
    state.claimed = true;
    locked.save(&state)?;

    s.log.info(format!(
        "resuming {} environment {env_id}",
        s.provider.name()
    ));
    let machine = s
        .provider
        .start(&machine, ctx)
        .await
        .map_err(|e| {
            if e.downcast_ref::<MachineGone>().is_some() {
                Failure::Refused(e.context(format!(
                    "environment {env_id} cannot be resumed: its machine is gone; run the job without \
                     the key to start a new environment (`dormant release {env_id}` forgets this one)"
                )))
            } else {
                Failure::System(e.context(format!("resuming environment {env_id}; it stays suspended")))
            }
        })?;
    update_record(&paths, |rec| rec.machine = Some(machine.clone()))?;

    connect(s, &paths, &machine, ctx)
        .await
        .map_err(|e| Failure::System(e.context(format!("environment {env_id} stays suspended"))))?;

    let rec = update_record(&paths, |rec| {
        rec.status = EnvStatus::Active;
        rec.resumed_at = Some(now_unix());
        rec.job_count += 1;
        rec.last_error = None;
    })?;
    state.prepare_completed = true;
    locked.save(&state)?;
    let key = rec.key.unwrap_or_else(|| text.to_string());
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
    Ok(())
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

/// Applies a change to an environment record under its lock; returns the result.
pub(crate) fn update_record(
    paths: &EnvPaths,
    change: impl FnOnce(&mut EnvironmentRecord),
) -> Result<EnvironmentRecord> {
    let env = paths.lock()?;
    let mut rec = env
        .load()?
        .with_context(|| format!("environment record {} disappeared", paths.record.display()))?;
    change(&mut rec);
    env.save(&rec)?;
    Ok(rec)
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

pub(crate) fn human_age(secs: u64) -> String {
    match secs {
        s if s < 120 => format!("{s} s ago"),
        s if s < 7200 => format!("{} min ago", s / 60),
        s if s < 172800 => format!("{} h ago", s / 3600),
        s => format!("{} days ago", s / 86400),
    }
}
