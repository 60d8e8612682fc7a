//! The hot window (docs/pause.md, "The hot window"): a job that ends paused
//! on a provider with a machine (qemu, EC2) leaves the machine running for
//! `suspend.hot_for`; the record says `suspended` (GitLab's job is over, the
//! key resumes it) with `hot_until`. A resume within the window takes the
//! running machine (`stages/resume.rs`); at the window's end, or when a job
//! needs its slot, [`cool`] suspends it as its mode does.
//!
//! Each step is intent, effect, result, as [`super::suspend`]: the cooler
//! claims the record (`begin_cool`: `suspending`, held by it), then stops the
//! machine through `suspend`. Killed after the claim, the claim is stale and
//! the next look's recovery stops the machine (`on_stale`: `Resuspend`);
//! killed before, the record is still hot and the next look cools it. So a
//! hot machine is stopped exactly once, never lost, never hot for ever.
//! The looks: every sweep (and each cleanup's slice), and one detached
//! waiter per hot window that cleanup starts (`dormant cool`), which sleeps
//! until `hot_until` and cools it then.

use std::time::Duration;

use anyhow::{Context, Result};

use super::warm_refill::OpenTransport;
use super::{update_error, Reason, World};
use crate::context::Ctx;
use crate::events::{Event, Kind, SuspendCause};
use crate::model::{EnvPaths, StorageMode};
use crate::settings::{ProviderKind, Settings};
use crate::state::registry::{self, UpdateError};
use crate::state::{now_unix, EnvStatus, EnvironmentRecord, Holder};

/// How long a paused environment's machine is kept running after its job,
/// `None` where there is no window: off (`hot_for = "0s"`), a provider
/// without a machine to keep (`local`, `ssh`: the script waits on a host
/// that stays up anyway, so a window would cost nothing and save nothing),
/// or no machine recorded. Volume mode has one too: its machine runs on
/// with the volume attached and mounted, and the window's end detaches the
/// volume and deletes the machine ([`cool`]).
pub fn window(settings: &Settings, rec: &EnvironmentRecord) -> Option<Duration> {
    let hot_for = settings.suspend.hot_for;
    let keeps_a_machine = matches!(settings.provider, ProviderKind::Qemu | ProviderKind::Ec2);
    (!hot_for.is_zero() && keeps_a_machine && rec.machine.is_some()).then(|| hot_for.get())
}

/// Whether a suspended record's hot window has passed (at `now`).
pub fn expired(rec: &EnvironmentRecord, now: u64) -> bool {
    rec.status() == EnvStatus::Suspended
        && rec.claim().is_none()
        && rec.hot_until().is_some_and(|t| t <= now)
}

/// The suspension of a paused job's environment into its hot window:
/// `begin_suspend` (intent), no stop, `suspended_hot` (result: hot until
/// `until`, Unix seconds), then its `suspended` event (cause as `why`,
/// `hot_until` set). Killed between the two, the record is `suspending`
/// under a dead job: its recovery stops the machine (the window is lost;
/// in `hibernate` mode the paused script is not). Also a failed resume of a
/// hot environment going back hot for the rest of its window.
pub async fn keep_hot(
    w: World<'_>,
    paths: &EnvPaths,
    holder: &Holder,
    until: u64,
    why: &Reason<SuspendCause>,
    ctx: &Ctx,
) -> Result<EnvironmentRecord> {
    let ctx = ctx.uncancellable();
    registry::update(paths, &ctx, |r| r.begin_suspend(holder))
        .await
        .map_err(update_error)?;
    crate::failpoint!("hot:intent");
    let (rec, ()) = registry::update(paths, &ctx, |r| r.suspended_hot(holder, until))
        .await
        .map_err(update_error)?;
    let mut event = Event::about(Kind::Suspended, why.cause.as_str(), &rec)
        .by(holder)
        .job(why.job)
        .reason(&format!("{}; hot until {}", why.text, until_text(until)));
    // No duration: nothing was stopped (the suspend histogram times stops).
    event.hot_until = Some(crate::state::rfc3339(until));
    w.events.record(event, &ctx).await;
    Ok(rec)
}

/// "2026-11-28T20:10:00Z (in 10 min)": for logs, `list` and events.
pub fn until_text(until: u64) -> String {
    let left = until.saturating_sub(now_unix());
    format!("{} (in {} s)", crate::state::rfc3339(until), left)
}

/// Ends a hot window now: claims the record (`begin_cool`, intent), and
/// suspends it as its mode does (`super::suspend`: the stop, its result, a
/// `suspended` event with cause `cooled`; in a mode that loses memory the
/// paused script is marked lost). The SSH masters the paused job left are
/// closed, before the stop in machine mode; in volume mode after it, for
/// the guest to sync and unmount the volume over them first (through
/// `guests`, dormant's own connection: the paused job's master while it
/// lives, else a new login). Without `guests`, or when the guest cannot be
/// reached, the volume is detached the way that needs no guest (the
/// machine's own shutdown unmounts it: `Volumes::detach`).
/// `Ok(None)`: it was not hot any more (a resume or another cooler took it).
pub async fn cool(
    w: World<'_>,
    paths: &EnvPaths,
    me: &Holder,
    why: &str,
    guests: Option<&dyn OpenTransport>,
    ctx: &Ctx,
) -> Result<Option<EnvironmentRecord>> {
    let ctx = ctx.uncancellable();
    // Proof we live, taken before the claim is ours (as a recovery's): a
    // sweep meanwhile sees a live holder, not a stale claim to take over.
    let _alive = crate::state::lock::LiveLock::hold(&paths.holder_live)?;
    let rec = match registry::update(paths, &ctx, |r| r.begin_cool(me)).await {
        Ok((rec, ())) => rec,
        Err(UpdateError::Refused(_)) | Err(UpdateError::Gone(_)) => return Ok(None),
        Err(e) => return Err(update_error(e)),
    };
    crate::failpoint!("hot:claimed");
    ctx.log.info(format!(
        "environment {}: its hot window ends ({why}): suspending its machine",
        paths.id
    ));
    let guest = match (&rec.storage, &rec.machine, guests) {
        (StorageMode::Volume, Some(m), Some(open)) => {
            match w.provider.target(m).and_then(|t| open.open(&t, paths)) {
                Ok(t) => Some(t),
                Err(e) => {
                    ctx.log.warn(format!(
                        "environment {}: no connection to its machine to unmount the data \
                         volume ({e:#}): its shutdown unmounts it",
                        paths.id
                    ));
                    None
                }
            }
        }
        _ => None,
    };
    if rec.storage == StorageMode::Machine {
        close_masters(paths).await;
    }
    let reason = Reason::new(SuspendCause::Cooled, why);
    let done = super::suspend(w, paths, me, false, guest.as_deref(), &reason, &ctx).await;
    if rec.storage == StorageMode::Volume {
        super::close(guest.as_deref(), paths.id, &ctx).await;
        close_masters(paths).await;
    }
    let rec = done.with_context(|| format!("ending the hot window of environment {}", paths.id))?;
    Ok(Some(rec))
}

/// Closes every SSH master of the environment: none may outlive its
/// machine's stop (a resume would attach to a dead connection).
async fn close_masters(paths: &EnvPaths) {
    if let Err(e) = crate::transport::ssh::close_masters(paths).await {
        tracing::debug!("closing the SSH masters of {}: {e:#}", paths.id);
    }
}

/// Why a hot window ended early for a job (the `cooled` event's reason).
pub const GAVE_WAY: &str = "a job needed its slot (max_environments)";

/// A job that needs a slot must not wait behind a hot machine (the warm
/// pool's give-way rule, `warm_give_way.rs`): when the provider says a job's
/// machine would wait (`running_slots_full`), the hot environment whose
/// window ends first is cooled now. Best effort: whatever fails is logged,
/// and the job waits for a slot as usual. Returns the environment cooled.
/// `guests`: how to reach a volume-mode machine to unmount its volume.
pub async fn give_way(
    w: World<'_>,
    guests: Option<&dyn OpenTransport>,
    ctx: &Ctx,
) -> Option<uuid::Uuid> {
    let result: Result<Option<uuid::Uuid>> = async {
        if !w.provider.running_slots_full(ctx).await? {
            return Ok(None);
        }
        let mut hot: Vec<(u64, uuid::Uuid)> = Vec::new();
        for id in w.store.environment_ids()? {
            if let Ok(Some(rec)) = registry::peek(&w.store.env_paths(id)) {
                if let (Some(until), None) = (rec.hot_until(), rec.claim()) {
                    if rec.provider == w.provider.name() {
                        hot.push((until, id));
                    }
                }
            }
        }
        hot.sort();
        let me = super::recover::operator("a job's prepare");
        for (_, id) in hot {
            let paths = w.store.env_paths(id);
            if cool(w, &paths, &me, GAVE_WAY, guests, ctx).await?.is_some() {
                return Ok(Some(id));
            }
        }
        Ok(None)
    }
    .await;
    match result {
        Ok(Some(id)) => {
            ctx.log.info(format!(
                "no free slot: hot environment {id} (its window ending first) was suspended for this job"
            ));
            Some(id)
        }
        Ok(None) => None,
        Err(e) => {
            ctx.log.warn(format!("hot window: {e:#}"));
            None
        }
    }
}

/// How long the detached waiter sleeps at most between two looks at the
/// record: a window moved later (the environment resumed and paused again)
/// is followed; the sweep cools it anyway if the waiter dies.
const WAIT_STEP: Duration = Duration::from_secs(60);

/// `dormant cool ID`: waits until the environment's hot window has passed,
/// then cools it. Returns when it is cooled, not hot any more, or gone.
pub async fn wait_and_cool(
    w: World<'_>,
    paths: &EnvPaths,
    guests: &dyn OpenTransport,
    ctx: &Ctx,
) -> Result<()> {
    let me = super::recover::operator("dormant cool");
    // A waiter that dies here (or never started) leaves the record hot: the
    // first sweep after the window cools it.
    crate::failpoint!("hot:waiting");
    loop {
        let Some(rec) = registry::peek(paths)? else {
            return Ok(());
        };
        let Some(until) = rec.hot_until() else {
            return Ok(());
        };
        if rec.status() != EnvStatus::Suspended || rec.claim().is_some() {
            return Ok(());
        }
        let now = now_unix();
        if until <= now {
            let why = format!("its window passed at {}", crate::state::rfc3339(until));
            cool(w, paths, &me, &why, Some(guests), ctx).await?;
            return Ok(());
        }
        let wait = Duration::from_secs(until - now).min(WAIT_STEP);
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = ctx.cancel.cancelled() => return Ok(()),
        }
    }
}

/// Starts `dormant cool ID` detached, as `warm_refill::start_refill` starts
/// `dormant warm` (its own session, no stdin or stdout, which would hold the
/// runner's stage open); its errors go to `environments/<id>/cool.log`.
pub fn start_waiter(paths: &EnvPaths) -> Result<u32> {
    use std::process::Command;
    let exe = std::env::current_exe().context("finding dormant's own executable")?;
    let mut cmd = Command::new(exe);
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    for (i, a) in args.iter().enumerate() {
        if a == "--config" {
            if let Some(v) = args.get(i + 1) {
                cmd.arg("--config").arg(v);
            }
        } else if a.to_str().is_some_and(|s| s.starts_with("--config=")) {
            cmd.arg(a);
        }
    }
    cmd.arg("cool").arg(paths.id.to_string());
    use std::os::unix::fs::OpenOptionsExt;
    let log = std::fs::OpenOptions::new()
        .mode(0o600)
        .create(true)
        .append(true)
        .open(paths.dir.join("cool.log"))
        .context("opening the hot window waiter's log")?;
    super::spawn_detached(cmd, log, "dormant cool")
}
