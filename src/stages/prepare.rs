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
use crate::events::{Event, Kind, Step};
use crate::exit::Failure;
use crate::lifecycle::warm::{take_for, For, Taken};
use crate::lifecycle::{update_error, volume};
use crate::model::{StorageMode, Volume};
use crate::provider::{Machine, MachineSpec, Refusal, VolumeSpec};
use crate::state::job::{hold_job_alive, LockedJob};
use crate::state::registry::{self, UpdateError};
use crate::state::{EnvPaths, EnvironmentRecord, Holder, Mode, NewEnvironment, Phase};

use super::prep::{announce, connect, job_state, record_failure, refill_in_background};
use super::Session;

pub async fn prepare(s: &Session) -> Result<(), Failure> {
    let ctx = Ctx::new(
        s.log.clone(),
        s.cancel.clone(),
        s.settings.prepare_timeout.get(),
    );
    // A trigger variable that is not a boolean is the job's own input: refused
    // before anything is claimed or made (a build failure, so the runner does
    // not retry it), naming the variable and the values it takes.
    if let Some(problem) = &s.input.suspend.invalid {
        return Err(Failure::refused(problem));
    }
    for line in &s.input.suspend.overridden {
        s.log.info(line);
    }
    let _alive = hold_job_alive(&s.store, &s.runner_id, s.job_id())?;
    let locked = LockedJob::lock(&s.store, &s.runner_id, s.job_id(), &ctx).await?;
    let started = Instant::now();
    let result = match s.input.suspend.resume_key.clone() {
        Some(key) => super::resume::prepare_resume(s, &locked, &key, started, &ctx).await,
        None => prepare_new(s, &locked, started, &ctx).await,
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

async fn prepare_new(
    s: &Session,
    locked: &LockedJob,
    started: Instant,
    ctx: &Ctx,
) -> Result<(), Failure> {
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
    let mut spec = MachineSpec {
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
        volume: None,
    };
    let storage = registry::peek(&paths)?
        .map(|r| r.storage)
        .unwrap_or_default();
    s.log.info(format!(
        "creating a new {} environment {env_id}{}",
        s.provider.name(),
        if storage == StorageMode::Volume {
            " (volume mode: its builds and cache dirs on a data volume of their own)"
        } else {
            ""
        }
    ));
    let mut volume_key = None;
    // EC2: an EBS volume attaches only in its zone, so a warm instance is
    // taken before the volume is made, and the volume made in its zone.
    let warm_first = storage == StorageMode::Volume
        && s.provider.warm().is_some_and(|w| w.takes_before_volume());
    let mut taken = None;
    if storage == StorageMode::Volume {
        if warm_first && !volume_recorded(&paths)? {
            // A retry whose first attempt recorded the volume takes none: its
            // machine (taken or launched then) is adopted by create_or_reclaim.
            taken = take_warm(s, &spec, &paths, For::NewBeforeVolume, ctx).await?;
            if taken.is_some() {
                // Its host key was pinned when it booted: the first
                // connection checks it (`lifecycle::volume::connect`).
                crate::transport::ssh::repin::pinned_at_launch(&paths)?;
                crate::failpoint!("prepare:warm-taken");
            }
        }
        let vspec = VolumeSpec {
            env_id,
            name: spec.name.clone(),
            runner_id: spec.runner_id.clone(),
            system_id: spec.system_id.clone(),
            project_id: spec.project_id,
            job_id: spec.job_id,
            paths: paths.clone(),
            // No machine is launched for the volume when a warm one was taken.
            machine: taken.is_none().then(|| spec.clone()),
            beside: taken.as_ref().map(|t| t.machine.clone()),
        };
        let make_key = |v: &Volume| volume_environment_key(s, &system_id, env_id, v);
        let volume = match volume::create(s.world(), &paths, &holder, &vspec, make_key, ctx).await {
            Ok(v) => v,
            Err(e) => {
                record_failure(s, &paths, Step::Create, &e, ctx).await;
                return Err(refused_or_system(e));
            }
        };
        volume_key = Some(volume_environment_key(s, &system_id, env_id, &volume));
        spec.volume = Some(volume::begin_attach(&paths, &holder, ctx).await?);
    }
    if !warm_first {
        taken = take_warm(s, &spec, &paths, For::New, ctx).await?;
    }
    let warm_id = taken.as_ref().map(|t| t.warm_id);
    if taken.is_none() {
        // No waiting behind a machine kept hot for a paused script.
        crate::lifecycle::hot::give_way(s.world(), Some(s), ctx).await;
    }
    let made = match taken {
        Some(t) => Ok(t.machine),
        None => s
            .provider
            .create_or_reclaim(&spec, ctx)
            .await
            .with_context(|| format!("creating {} environment {env_id}", s.provider.name())),
    };
    let machine = match made {
        Ok(m) => m,
        Err(e) => {
            record_failure(s, &paths, Step::Create, &e, ctx).await;
            return Err(refused_or_system(e));
        }
    };
    crate::failpoint!("prepare:created");
    let key = volume_key.unwrap_or_else(|| environment_key(s, &system_id, env_id, &machine));
    registry::update(&paths, ctx, |r| {
        r.machine_made(&holder, machine.clone(), key.clone())
    })
    .await
    .map_err(update_error)?;
    crate::failpoint!("prepare:recorded");
    if let Some(v) = &spec.volume {
        if let Err(e) = volume::attach(s.world(), &paths, &holder, v, &machine, ctx).await {
            record_failure(s, &paths, Step::Create, &e, ctx).await;
            return Err(refused_or_system(e));
        }
    }

    if let Err(e) = connect(s, &paths, &holder, &machine, ctx).await {
        record_failure(s, &paths, Step::Connect, &e, ctx).await;
        return Err(e.into());
    }
    if storage == StorageMode::Machine {
        keep_host_key(s, &paths, &machine, ctx).await;
    }
    let (rec, ()) = registry::update(&paths, ctx, |r| r.activate(&holder))
        .await
        .map_err(update_error)?;
    let mut created = Event::about(Kind::Created, "job", &rec)
        .by(&holder)
        .duration(started.elapsed());
    created.warm = warm_id;
    s.events.record(created, ctx).await;
    crate::failpoint!("prepare:activated");
    state.phase = Phase::Ready;
    locked.save(&state)?;
    crate::failpoint!("prepare:ready");
    announce(s, &key, env_id, false);
    refill_in_background(s);
    Ok(())
}

/// A ready warm machine for this new environment, if the provider keeps
/// them and one fits (docs/architecture.md, "Warm machines"); then the pool
/// is refilled in the background. An error is the hand-over's (the retried
/// prepare finishes it), recorded as the create's failure.
async fn take_warm(
    s: &Session,
    spec: &MachineSpec,
    paths: &EnvPaths,
    purpose: For,
    ctx: &Ctx,
) -> Result<Option<Taken>, Failure> {
    let Some(warm) = s.provider.warm() else {
        return Ok(None);
    };
    let taken = match take_for(s.world(), warm, spec, paths, purpose, ctx).await {
        Ok(t) => t,
        Err(e) => {
            record_failure(s, paths, Step::Create, &e, ctx).await;
            return Err(refused_or_system(e));
        }
    };
    if let Some(t) = &taken {
        s.log.info(format!(
            "took warm machine {} (booted {} s before this job asked): no boot to wait for{}",
            t.warm_id,
            t.age_secs,
            if purpose == For::NewBeforeVolume {
                "; the data volume is made where it runs and attached to it"
            } else {
                ""
            }
        ));
    }
    Ok(taken)
}

/// Whether an earlier attempt of this prepare recorded the data volume.
fn volume_recorded(paths: &EnvPaths) -> anyhow::Result<bool> {
    Ok(registry::peek(paths)?
        .and_then(|r| r.volume)
        .is_some_and(|v| v.volume.is_some()))
}

/// The host key the first connection pinned, kept with the machine for a
/// runner-manager host that may take the environment over. A failure costs
/// only that (the job runs), so it is a warning that says so.
async fn keep_host_key(s: &Session, paths: &EnvPaths, machine: &Machine, ctx: &Ctx) {
    let known_hosts = std::fs::read_to_string(&paths.known_hosts).unwrap_or_default();
    if let Err(e) = s.provider.keep_host_key(machine, &known_hosts, ctx).await {
        s.log.warn(format!(
            "could not keep the pinned host key with machine {} ({e:#}): if this runner-manager host \
             is lost, another one cannot take this environment over",
            machine.id
        ));
    }
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
            storage: s.provider.storage(),
            image: s.input.image.clone(),
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

/// A provider's [`Refusal`] (an allow-list said no) is the job's fault and is
/// not retried; anything else is a system failure.
pub(super) fn refused_or_system(e: anyhow::Error) -> Failure {
    if e.downcast_ref::<Refusal>().is_some() {
        Failure::Refused(e)
    } else {
        Failure::System(e)
    }
}

/// A volume-mode environment's key: it names the volume (what the
/// environment is while suspended), never a machine, which changes.
fn volume_environment_key(
    s: &Session,
    system_id: &str,
    env_id: uuid::Uuid,
    volume: &Volume,
) -> String {
    let mut key = EnvironmentKey::new(&s.runner_id, system_id, env_id)
        .with_field("provider", s.provider.name())
        .with_field(crate::envkey::STORAGE_FIELD, StorageMode::Volume.as_str());
    if let Some(vols) = s.provider.volumes() {
        for (k, v) in vols.key_fields(volume) {
            key = key.with_field(&k, &v);
        }
    }
    key.encode()
}

fn environment_key(s: &Session, system_id: &str, env_id: uuid::Uuid, machine: &Machine) -> String {
    let mut key = EnvironmentKey::new(&s.runner_id, system_id, env_id)
        .with_field("provider", s.provider.name());
    for (k, v) in s.provider.key_fields(machine) {
        key = key.with_field(&k, &v);
    }
    key.encode()
}
