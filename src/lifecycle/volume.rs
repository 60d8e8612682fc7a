//! Volume mode's effects (`storage = "volume"`): creating the data volume,
//! launching a machine for it and attaching it, detaching it and deleting the
//! machine, and connecting to a new machine (its host key, the mount). Each
//! effect is one `Volumes` or `Provider` call between a step recorded as
//! intent and its result (`state/volume.rs`), with a crash point on each
//! side, so a process killed anywhere leaves a step the next one finishes:
//! [`settle_detached`] takes an environment from any step back to "volume
//! detached, no machine", which is what a suspended volume-mode environment is.
//!
//! Crash points: `volume:create-intent`, `volume:created`,
//! `volume:attach-intent`, `volume:attached`, `volume:detach-intent`,
//! `volume:detached`, `volume:delete-machine-intent`, `volume:machine-deleted`.

use std::collections::BTreeMap;

use anyhow::{anyhow, Context, Result};

use super::{guest, update_error, World};
use crate::context::Ctx;
use crate::model::{EnvPaths, Machine, Volume};
use crate::provider::{MachineSpec, VolumeSpec, Volumes};
use crate::state::registry;
use crate::state::{EnvStatus, EnvironmentRecord, Holder, VolumeStep};
use crate::transport::Transport;

/// The provider's volume operations, or why there are none.
pub fn volumes<'a>(w: World<'a>) -> Result<&'a dyn Volumes> {
    w.provider.volumes().ok_or_else(|| {
        anyhow!(
            "the {} provider has no volume mode, but this environment's record says storage = \"volume\"",
            w.provider.name()
        )
    })
}

/// The record, which must exist.
fn load(paths: &EnvPaths) -> Result<EnvironmentRecord> {
    registry::peek(paths)?
        .with_context(|| format!("environment {} has no record any more", paths.id))
}

/// A new environment (`creating`): makes its volume, or finds the one an
/// earlier attempt made, and records it with the environment's key.
pub async fn create(
    w: World<'_>,
    paths: &EnvPaths,
    holder: &Holder,
    spec: &VolumeSpec,
    key: impl FnOnce(&Volume) -> String,
    ctx: &Ctx,
) -> Result<Volume> {
    let vols = volumes(w)?;
    let rec = load(paths)?;
    if let Some(v) = rec.volume.as_ref().and_then(|v| v.volume.clone()) {
        return Ok(v); // a retried prepare: already recorded
    }
    // The intent is the record itself: it was made with the step `creating`.
    crate::failpoint!("volume:create-intent");
    let volume = vols
        .create_volume(spec, ctx)
        .await
        .with_context(|| format!("creating the data volume of environment {}", paths.id))?;
    crate::failpoint!("volume:created");
    let key = key(&volume);
    registry::update(paths, ctx, |r| {
        r.volume_created(holder, volume.clone(), key)
    })
    .await
    .map_err(update_error)?;
    Ok(volume)
}

/// Intent to launch a machine for the volume and attach it. Returns the
/// volume. A machine replacing one whose host key is pinned gets its own key
/// pinned on its first connection ([`connect`]).
pub async fn begin_attach(paths: &EnvPaths, holder: &Holder, ctx: &Ctx) -> Result<Volume> {
    let repin = std::fs::metadata(&paths.known_hosts).is_ok_and(|m| m.len() > 0);
    let (rec, ()) = registry::update(paths, ctx, |r| r.begin_attach(holder, repin))
        .await
        .map_err(update_error)?;
    crate::failpoint!("volume:attach-intent");
    rec.volume
        .and_then(|v| v.volume)
        .context("the record lost its volume")
}

/// Attaches the volume to the recorded machine (or checks the launch did).
pub async fn attach(
    w: World<'_>,
    paths: &EnvPaths,
    holder: &Holder,
    volume: &Volume,
    machine: &Machine,
    ctx: &Ctx,
) -> Result<()> {
    volumes(w)?
        .attach(volume, machine, ctx)
        .await
        .with_context(|| {
            format!(
                "attaching data volume {} to machine {} of environment {}",
                volume.id, machine.id, paths.id
            )
        })?;
    crate::failpoint!("volume:attached");
    registry::update(paths, ctx, |r| r.volume_attached(holder))
        .await
        .map_err(update_error)?;
    Ok(())
}

/// What a resume needs to launch a new machine for a volume-mode environment.
#[derive(Debug, Clone, Default)]
pub struct Relaunch {
    /// The job resuming it (0 for `dormant shell`): for the machine's tags.
    pub job_id: u64,
    /// The resuming job's variables (an allowed instance type, ...).
    pub variables: BTreeMap<String, String>,
}

/// The spec of a new machine for an existing environment: from its record
/// (its image, project), the volume and the resuming job.
pub fn relaunch_spec(
    w: World<'_>,
    paths: &EnvPaths,
    rec: &EnvironmentRecord,
    volume: Volume,
    relaunch: &Relaunch,
) -> Result<MachineSpec> {
    let ssh_public_key = if w.provider.needs_ssh_key() {
        Some(crate::transport::keys::ensure_keypair(paths)?)
    } else {
        None
    };
    Ok(MachineSpec {
        env_id: rec.id,
        name: MachineSpec::machine_name(rec.id),
        runner_id: rec.runner_id.clone(),
        system_id: rec.system_id.clone(),
        project_id: rec.project_id,
        job_id: relaunch.job_id,
        image: rec.volume.as_ref().and_then(|v| v.image.clone()),
        variables: relaunch.variables.clone(),
        ssh_public_key,
        paths: paths.clone(),
        volume: Some(volume),
    })
}

/// Resume (`resuming`): finishes what an earlier process left (a machine not
/// deleted), then launches a new machine from the image configured now,
/// records it, and attaches the volume. The provider's errors are returned
/// as they are (a `Refusal`, a `VolumeGone`), for the caller to classify.
pub async fn relaunch(
    w: World<'_>,
    paths: &EnvPaths,
    holder: &Holder,
    relaunch: &Relaunch,
    ctx: &Ctx,
) -> Result<Relaunched> {
    settle_detached(w, paths, holder, None, ctx).await?;
    let volume = begin_attach(paths, holder, ctx).await?;
    let rec = load(paths)?;
    let spec = relaunch_spec(w, paths, &rec, volume.clone(), relaunch)?;
    let taken = match w.provider.warm() {
        Some(warm) => {
            // The replaced machine's pin goes aside before a warm machine's
            // (pinned at its own boot) is written in its place.
            crate::transport::ssh::repin::set_aside(paths)?;
            super::warm::take_for(w, warm, &spec, paths, super::warm::For::Resume, ctx).await?
        }
        None => None,
    };
    let (machine, warm) = match taken {
        Some(t) => {
            crate::transport::ssh::repin::pinned_at_launch(paths)?;
            ctx.log.info(format!(
                "took warm machine {} (booted {} s before this job asked) for environment {}: its \
                 data volume {} is attached to it",
                t.warm_id, t.age_secs, paths.id, volume.id
            ));
            (t.machine, Some(t.warm_id))
        }
        None => {
            ctx.log.info(format!(
                "making a new machine for environment {} (volume mode: its data volume {} is attached to it)",
                paths.id, volume.id
            ));
            (w.provider.create_or_reclaim(&spec, ctx).await?, None)
        }
    };
    crate::failpoint!("resume:started");
    registry::update(paths, ctx, |r| r.machine_started(holder, machine.clone()))
        .await
        .map_err(update_error)?;
    attach(w, paths, holder, &volume, &machine, ctx).await?;
    Ok(Relaunched { machine, warm })
}

/// A volume-mode resume's new machine; `warm`: the warm machine it was.
#[derive(Debug, Clone)]
pub struct Relaunched {
    pub machine: Machine,
    pub warm: Option<uuid::Uuid>,
}

/// Takes the environment from whatever step it is at back to "volume
/// detached, no machine": the guest unmounts the volume (when `guest` can
/// reach it and the volume is attached), the volume is detached, the machine
/// deleted — each step recorded before and after. A machine launched but
/// not recorded is found by the provider first. Used by the suspend of a
/// volume-mode environment and before a resume launches a new machine.
pub async fn settle_detached(
    w: World<'_>,
    paths: &EnvPaths,
    holder: &Holder,
    guest: Option<&dyn Transport>,
    ctx: &Ctx,
) -> Result<()> {
    let vols = volumes(w)?;
    let id = paths.id;
    let rec = load(paths)?;
    let state = rec
        .volume
        .clone()
        .with_context(|| format!("environment {id} is in volume mode but has no volume state"))?;
    let mut machine = rec.machine.clone();
    if state.step() == VolumeStep::Attaching && machine.is_none() {
        // A launch may have happened whose result was never recorded.
        match w.provider.find(id, ctx).await.with_context(|| {
            format!("looking for a machine launched for environment {id} but not recorded")
        })? {
            Some(m) => {
                ctx.log.info(format!(
                    "found machine {} launched for environment {id} by a process that did not finish",
                    m.id
                ));
                registry::update(paths, ctx, |r| r.machine_found(holder, m.clone()))
                    .await
                    .map_err(update_error)?;
                machine = Some(m);
            }
            None => {
                registry::update(paths, ctx, |r| r.machine_deleted(holder))
                    .await
                    .map_err(update_error)?;
                return Ok(());
            }
        }
    }
    let Some(machine) = machine else {
        return Ok(()); // detached, no machine: nothing to do
    };
    let volume = state.volume.clone();
    if matches!(
        state.step(),
        VolumeStep::Attaching | VolumeStep::Attached | VolumeStep::Detaching
    ) {
        let volume = volume
            .clone()
            .with_context(|| format!("environment {id} has a machine but no volume id"))?;
        let unmounted = match (guest, state.step()) {
            (Some(t), VolumeStep::Attached) => {
                let m = vols.guest_mount(&volume);
                match guest::unmount(t, &m, &ctx.within(guest::UNMOUNT_LIMIT)).await {
                    Ok(()) => true,
                    Err(e) => {
                        ctx.log.warn(format!(
                            "the machine of environment {id} did not unmount its data volume ({e:#}): \
                             detaching it the safe way (the machine shuts down first)"
                        ));
                        false
                    }
                }
            }
            _ => false,
        };
        registry::update(paths, ctx, |r| r.begin_detach(holder))
            .await
            .map_err(update_error)?;
        crate::failpoint!("volume:detach-intent");
        vols.detach(&volume, &machine, unmounted, ctx)
            .await
            .with_context(|| {
                format!(
                    "detaching data volume {} from machine {} of environment {id}",
                    volume.id, machine.id
                )
            })?;
        crate::failpoint!("volume:detached");
    }
    registry::update(paths, ctx, |r| r.volume_detached(holder))
        .await
        .map_err(update_error)?;
    crate::failpoint!("volume:delete-machine-intent");
    w.provider
        .delete(&machine, ctx)
        .await
        .with_context(|| format!("deleting machine {} of environment {id}", machine.id))?;
    crate::failpoint!("volume:machine-deleted");
    registry::update(paths, ctx, |r| r.machine_deleted(holder))
        .await
        .map_err(update_error)?;
    ctx.log.info(format!(
        "environment {id} is its data volume{} alone now: machine {} deleted",
        volume.map(|v| format!(" {}", v.id)).unwrap_or_default(),
        machine.id
    ));
    Ok(())
}

/// Connects to the environment's machine (volume mode: pinning a new
/// machine's host key, then mounting the volume). The host key rule is in
/// docs/ssh.md: the first connection to a machine dormant launched to
/// replace the one pinned pins its key, recording old and new fingerprints;
/// any other change of key is refused by the transport, as always.
pub async fn connect(
    paths: &EnvPaths,
    holder: &Holder,
    transport: &dyn Transport,
    vols: Option<&dyn Volumes>,
    ctx: &Ctx,
) -> Result<()> {
    let rec = load(paths)?;
    let Some(state) = rec.volume.clone() else {
        return transport.connect(ctx).await;
    };
    let repin = state.repin();
    if repin {
        crate::transport::ssh::repin::set_aside(paths)?;
    }
    transport.connect(ctx).await?;
    if repin {
        let (old, new) = crate::transport::ssh::repin::finish(paths);
        let machine = rec.machine.as_ref().map(|m| m.id.as_str()).unwrap_or("?");
        if !old.is_empty() {
            ctx.log.info(format!(
                "host key of the new machine {machine} of environment {} pinned: {} (it replaces a \
                 machine that had {}; dormant launched this one in this prepare, see docs/ssh.md)",
                paths.id,
                new.join(", "),
                old.join(", ")
            ));
        }
        registry::update(paths, ctx, |r| r.host_key_repinned(holder, old, new))
            .await
            .map_err(update_error)?;
        crate::transport::ssh::repin::forget_old(paths)?;
    }
    let vols = vols.context("volume mode without the provider's volume operations")?;
    let volume = state
        .volume
        .context("a volume-mode environment without a volume")?;
    guest::mount(
        transport,
        &vols.guest_mount(&volume),
        paths.id,
        !state.initialized,
        ctx,
    )
    .await
    .with_context(|| {
        format!(
            "mounting data volume {} in environment {}",
            volume.id, paths.id
        )
    })?;
    if !state.initialized {
        registry::update(paths, ctx, |r| r.volume_initialized(holder))
            .await
            .map_err(update_error)?;
    }
    Ok(())
}

/// Whether a suspended volume-mode environment still has a machine (a
/// detach or delete that failed): the sweep finishes it. Not a hot one: its
/// machine runs with the volume on purpose until its window ends.
pub fn has_leftovers(rec: &EnvironmentRecord) -> bool {
    rec.status() == EnvStatus::Suspended
        && rec.hot_until().is_none()
        && rec.volume.is_some()
        && (rec.machine.is_some()
            || rec
                .volume
                .as_ref()
                .is_some_and(|v| v.step() != VolumeStep::Detached))
}
