//! The lifecycle's effects: what happens to an environment's machine when it
//! is suspended, released or recovered, each step recorded as intent before
//! the side effect and as a result right after it, so a process killed at any
//! line leaves a record the next one can finish (`recover.rs`).
//!
//! Above `state` (which owns the transitions) and `provider` (which makes the
//! side effects); used by the stages and the operator commands, which do not
//! import each other. Each effect records its event in the event log
//! (`crate::events`) once its result is recorded: this is the one place a
//! suspension or a release is written there. `volume` and `guest` are volume
//! mode's effects; `lost` says whether a machine went away under a job; `warm` takes
//! and retires warm machines, `warm_refill` refills the pool; `hot` keeps a
//! paused environment's machine running for its hot window and ends it.

pub mod guest;
pub mod hot;
pub mod joined;
pub mod lost;
pub mod pause;
pub mod recover;
pub mod sweep;
mod sweep_slice;
pub mod volume;
pub mod warm;
mod warm_give_way;
pub mod warm_refill;
mod warm_steps;

use std::time::Instant;

use anyhow::{Context, Result};

use crate::context::Ctx;
use crate::events::{Event, EventLog, Kind, ReleaseCause, Step, SuspendCause};
use crate::model::{EnvPaths, StorageMode};
use crate::provider::{Provider, Suspended};
use crate::state::registry::{self, UpdateError};
use crate::state::{EnvironmentRecord, Holder, StateStore};
use crate::transport::Transport;

/// What a lifecycle step needs: where state is, who makes machines, and
/// where what happened is written down.
#[derive(Clone, Copy)]
pub struct World<'a> {
    pub store: &'a StateStore,
    pub provider: &'a dyn Provider,
    pub events: &'a EventLog,
}

/// Why a suspension or a release happens, as the event log records it: the
/// machine-readable cause, the words (as the notify hook says them), and the
/// job it is for when the holder is not that job (a recovery, a sweep).
#[derive(Debug, Clone)]
pub struct Reason<C> {
    pub cause: C,
    pub text: String,
    pub job: Option<u64>,
}

impl<C> Reason<C> {
    pub fn new(cause: C, text: impl Into<String>) -> Self {
        Reason {
            cause,
            text: text.into(),
            job: None,
        }
    }

    pub fn job(mut self, job: Option<u64>) -> Self {
        self.job = job;
        self
    }
}

/// Starts `cmd` detached (a session of its own, no terminal, stdin and
/// stdout closed, stderr into `log`): a process that outlives the dormant
/// that started it (`dormant warm`, `dormant cool`). Returns its pid.
pub(crate) fn spawn_detached(
    mut cmd: std::process::Command,
    log: std::fs::File,
    what: &str,
) -> Result<u32> {
    use std::os::unix::process::CommandExt;
    use std::process::Stdio;
    cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(log);
    // SAFETY: setsid is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd.spawn().with_context(|| format!("starting `{what}`"))?;
    Ok(child.id())
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
/// with the error recorded and returned), then its `suspended` event (and a
/// `failed` one for a failed stop). Deaf to SIGTERM: a stop in progress
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
    why: &Reason<SuspendCause>,
    ctx: &Ctx,
) -> Result<EnvironmentRecord> {
    let ctx = ctx.uncancellable();
    let (rec, ()) = registry::update(paths, &ctx, |r| r.begin_suspend(holder))
        .await
        .map_err(update_error)?;
    crate::failpoint!("suspend:intent");
    let started = Instant::now();
    let stopped = match (&rec.storage, &rec.machine) {
        (StorageMode::Volume, _) => volume::settle_detached(w, paths, holder, guest, &ctx)
            .await
            .map(|()| Suspended::lost("storage = \"volume\": the machine was deleted")),
        (StorageMode::Machine, Some(m)) => w.provider.stop(m, &ctx).await,
        (StorageMode::Machine, None) => Ok(Suspended::kept()),
    };
    let took = started.elapsed();
    crate::failpoint!("suspend:stopped");
    let error = stopped.as_ref().err().map(|e| format!("{e:#}"));
    let lost = stopped.as_ref().ok().and_then(|s| s.memory_lost.clone());
    let (rec, ()) = registry::update(paths, &ctx, |r| {
        r.suspended(holder, error.clone(), fresh, lost.clone())
    })
    .await
    .map_err(update_error)?;
    let event = Event::about(Kind::Suspended, why.cause.as_str(), &rec)
        .by(holder)
        .job(why.job)
        .reason(&paused_lost(&why.text, &rec))
        .duration(took);
    if let Some(error) = &error {
        w.events.record(event.clone().error_text(error), &ctx).await;
        let failed = Event::about(Kind::Failed, Step::Stop.as_str(), &rec)
            .by(holder)
            .job(why.job)
            .error_text(error);
        w.events.record(failed, &ctx).await;
    } else {
        w.events.record(event, &ctx).await;
    }
    stopped.map(drop).with_context(|| match rec.storage {
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

/// The words of a suspension, with what became of a paused script whose
/// machine lost its memory (the event log and the notify hook say so).
pub fn paused_lost(text: &str, rec: &EnvironmentRecord) -> String {
    match rec.paused.as_ref().and_then(|p| p.lost.as_deref()) {
        Some(lost) => format!("{text}; the paused script is gone: {lost}"),
        None => text.to_string(),
    }
}

/// Deletes the machine, then the environment's files: `begin_release`
/// (intent), the delete (a failure leaves it `releasing` for a sweep to
/// retry, and is a `failed` event), the connection closed, then the
/// directory removed atomically, then its `released` event. Already gone is
/// success (and someone else's event). Deaf to SIGTERM.
pub async fn release(
    w: World<'_>,
    paths: &EnvPaths,
    holder: &Holder,
    transport: Option<&dyn Transport>,
    why: &Reason<ReleaseCause>,
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
    let started = Instant::now();
    let failed = |e: &anyhow::Error| {
        Event::about(Kind::Failed, Step::Delete.as_str(), &rec)
            .by(holder)
            .job(why.job)
            .error(e)
    };
    let machine = match rec.machine.clone() {
        Some(m) => Some(m),
        // Prepare may have died between making the machine and recording it.
        None => match w.provider.find(id, &ctx).await {
            Ok(m) => m,
            Err(e) => {
                let e = e.context(format!(
                    "looking up the machine of environment {id} before releasing it"
                ));
                w.events.record(failed(&e), &ctx).await;
                return Err(e);
            }
        },
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
        w.events.record(failed(&e), &ctx).await;
        return Err(e).with_context(|| {
            format!("releasing environment {id} (it stays `releasing`; a later `dormant sweep` retries)")
        });
    }
    let took = started.elapsed();
    if rec.storage == StorageMode::Volume {
        crate::failpoint!("release:volume-deleted");
    } else {
        crate::failpoint!("release:deleted");
    }
    // After the delete (the `ssh` provider removes a workspace over it), before
    // the files (which hold its control socket).
    close(transport, id, &ctx).await;
    registry::remove(w.store, paths, holder, &ctx).await?;
    let event = Event::about(Kind::Released, why.cause.as_str(), &rec)
        .by(holder)
        .job(why.job)
        .reason(&why.text)
        .duration(took);
    w.events.record(event, &ctx).await;
    Ok(())
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
