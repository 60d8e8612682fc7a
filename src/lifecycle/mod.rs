//! The lifecycle's effects: what happens to an environment's machine when it
//! is suspended, released or recovered, each step recorded as intent before
//! the side effect and as a result right after it, so a process killed at any
//! line leaves a record the next one can finish (`recover.rs`).
//!
//! Above `state` (which owns the transitions) and `provider` (which makes the
//! side effects); used by the stages and the operator commands, which do not
//! import each other. `volume` and `guest` are volume mode's effects.

pub mod guest;
pub mod recover;
pub mod sweep;
pub mod volume;

use anyhow::{Context, Result};

use crate::context::Ctx;
use crate::model::{EnvPaths, StorageMode};
use crate::provider::Provider;
use crate::state::registry::{self, UpdateError};
use crate::state::{EnvironmentRecord, Holder, StateStore};
use crate::transport::Transport;

/// What a lifecycle step needs: where state is and who makes machines.
#[derive(Clone, Copy)]
pub struct World<'a> {
    pub store: &'a StateStore,
    pub provider: &'a dyn Provider,
}

/// Turns a refused transition or a missing record into an error for a log.
pub fn update_error<E: std::fmt::Display>(e: UpdateError<E>) -> anyhow::Error {
    match e {
        UpdateError::Io(e) => e,
        other => anyhow::anyhow!("{other}"),
    }
}

/// Stops the machine and keeps the environment: `begin_suspend` (intent),
/// the stop, `suspended` (result; kept as suspended even if the stop failed,
/// with the error recorded and returned). Deaf to SIGTERM: a stop in progress
/// finishes. `fresh`: a new suspension (its TTL starts now), not a resume put back.
///
/// Volume mode: instead of the stop, the guest (reached through `guest`, when
/// the caller has a connection to it) syncs and unmounts the data volume, the
/// volume is detached and the machine deleted (`volume::settle_detached`).
pub async fn suspend(
    w: World<'_>,
    paths: &EnvPaths,
    holder: &Holder,
    fresh: bool,
    guest: Option<&dyn Transport>,
    ctx: &Ctx,
) -> Result<EnvironmentRecord> {
    let ctx = ctx.uncancellable();
    let (rec, ()) = registry::update(paths, &ctx, |r| r.begin_suspend(holder))
        .await
        .map_err(update_error)?;
    crate::failpoint!("suspend:intent");
    let stopped = match (&rec.storage, &rec.machine) {
        (StorageMode::Volume, _) => volume::settle_detached(w, paths, holder, guest, &ctx).await,
        (StorageMode::Machine, Some(m)) => w.provider.stop(m, &ctx).await,
        (StorageMode::Machine, None) => Ok(()),
    };
    crate::failpoint!("suspend:stopped");
    let error = stopped.as_ref().err().map(|e| format!("{e:#}"));
    let (rec, ()) = registry::update(paths, &ctx, |r| r.suspended(holder, error, fresh))
        .await
        .map_err(update_error)?;
    stopped.with_context(|| match rec.storage {
        StorageMode::Machine => format!(
            "stopping the machine of environment {} (it is kept as suspended; the next resume starts it)",
            paths.id
        ),
        StorageMode::Volume => format!(
            "detaching the data volume of environment {} and deleting its machine (it is kept as \
             suspended, its volume intact; the next resume or `dormant sweep` finishes this)",
            paths.id
        ),
    })?;
    Ok(rec)
}

/// Deletes the machine, then the environment's files: `begin_release`
/// (intent), the delete (a failure leaves it `releasing` for a sweep to
/// retry), the connection closed, then the directory removed atomically.
/// Already gone is success. Deaf to SIGTERM.
pub async fn release(
    w: World<'_>,
    paths: &EnvPaths,
    holder: &Holder,
    transport: Option<&dyn Transport>,
    ctx: &Ctx,
) -> Result<()> {
    let ctx = ctx.uncancellable();
    let id = paths.id;
    let rec = match registry::update(paths, &ctx, |r| r.begin_release(holder)).await {
        Ok((rec, ())) => rec,
        Err(UpdateError::Gone(_)) => {
            close(transport, id, &ctx).await;
            return Ok(());
        }
        Err(e) => return Err(update_error(e)),
    };
    crate::failpoint!("release:intent");
    let machine = match rec.machine.clone() {
        Some(m) => Some(m),
        // Prepare may have died between making the machine and recording it.
        None => w.provider.find(id, &ctx).await.with_context(|| {
            format!("looking up the machine of environment {id} before releasing it")
        })?,
    };
    let mut deleted = match &machine {
        Some(machine) => w.provider.delete(machine, &ctx).await,
        None => Ok(()),
    };
    if deleted.is_ok() && rec.storage == StorageMode::Volume {
        crate::failpoint!("release:deleted");
        deleted = delete_volume(w, paths, &rec, &ctx).await;
    }
    if let Err(e) = deleted {
        let text = format!("{e:#}");
        let _ = registry::update(paths, &ctx, |r| r.release_failed(holder, text)).await;
        close(transport, id, &ctx).await;
        return Err(e).with_context(|| {
            format!("releasing environment {id} (it stays `releasing`; a later `dormant sweep` retries)")
        });
    }
    if rec.storage == StorageMode::Volume {
        crate::failpoint!("release:volume-deleted");
    } else {
        crate::failpoint!("release:deleted");
    }
    // After the delete (the `ssh` provider removes a workspace over it), before
    // the files (which hold its control socket).
    close(transport, id, &ctx).await;
    registry::remove(w.store, paths, holder, &ctx).await
}

/// Volume mode's release: the data volume goes after the machine. Its id is
/// the record's, else it is looked up (a create killed before recording it).
async fn delete_volume(
    w: World<'_>,
    paths: &EnvPaths,
    rec: &EnvironmentRecord,
    ctx: &Ctx,
) -> Result<()> {
    let vols = volume::volumes(w)?;
    let recorded = rec.volume.as_ref().and_then(|v| v.volume.clone());
    let found = match recorded {
        Some(v) => Some(v),
        None => vols.find_volume(paths.id, ctx).await.with_context(|| {
            format!(
                "looking up the data volume of environment {} before deleting it",
                paths.id
            )
        })?,
    };
    if let Some(v) = found {
        ctx.log.info(format!(
            "deleting data volume {} of environment {}",
            v.id, paths.id
        ));
        vols.delete_volume(&v, ctx)
            .await
            .with_context(|| format!("deleting data volume {}", v.id))?;
    }
    Ok(())
}

/// Closes a connection; failures only matter to the debug log.
pub async fn close(transport: Option<&dyn Transport>, id: uuid::Uuid, ctx: &Ctx) {
    if let Some(t) = transport {
        if let Err(e) = t.close(ctx).await {
            tracing::debug!("closing the connection to {id}: {e:#}");
        }
    }
}

/// "12 s ago", "3 min ago", "2 days ago": for messages and `list`.
pub fn human_age(secs: u64) -> String {
    match secs {
        s if s < 120 => format!("{s} s ago"),
        s if s < 7200 => format!("{} min ago", s / 60),
        s if s < 172800 => format!("{} h ago", s / 3600),
        s => format!("{} days ago", s / 86400),
    }
}
