//! The sweep: deletes suspended environments past the TTL, recovers claims
//! whose holder is gone, finishes releases and deletes that were killed
//! half-way, and removes what a killed process left (a directory without a
//! record, a staging or trash entry, a dead job's state and lock files). Run
//! by `dormant sweep` over every environment ([`Scope::Full`]) and, within a
//! small time bound, at the end of every cleanup over the next slice of them
//! ([`Scope::Slice`], `sweep_slice.rs`): a cleanup's share of the sweep costs
//! the same however many environments exist. Never waits on a busy
//! environment: one whose lock is held is left for the next sweep, and one
//! another process is releasing is skipped. Each sweep's summary is a `sweep`
//! event (a slice's only when it did something, so cleanups do not flood the
//! log).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Result;
use uuid::Uuid;

use super::recover::{self, Found};
use super::{Reason, World};
use crate::context::Ctx;
use crate::events::{self, Kind, ReleaseCause, SweepCounts};
use crate::notify::{self, Audience, Event, Notification};
use crate::settings::SuspendSettings;
use crate::state::registry;
use crate::state::{now_unix, store, EnvStatus, JobState};

pub use super::sweep_slice::SLICE;

/// A staging or trash entry younger than this may belong to a create or delete
/// in progress (they take milliseconds).
const STRAY_AGE_SECS: u64 = 60;

#[derive(Debug, Default)]
pub struct SweepReport {
    /// Past the TTL, deleted.
    pub released: Vec<Uuid>,
    /// Held by a holder that is gone; settled.
    pub recovered: Vec<Uuid>,
    /// Hot windows that had passed: their machines suspended.
    pub cooled: Vec<Uuid>,
    /// Directories and files a killed process left.
    pub removed: Vec<PathBuf>,
    pub kept: usize,
    pub errors: Vec<anyhow::Error>,
    /// Environments not looked at because the time bound ran out.
    pub unvisited: usize,
    /// Environments looked at.
    pub visited: usize,
    /// Environments in the registry (a full sweep's count).
    pub environments: Option<usize>,
}

/// How much of the registry a sweep looks at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// Every environment: `dormant sweep`.
    Full,
    /// The next [`SLICE`] environments in directory order after where the
    /// previous slice stopped: a cleanup's sweep.
    Slice,
}

impl Scope {
    fn as_str(self) -> &'static str {
        match self {
            Scope::Full => "full",
            Scope::Slice => "slice",
        }
    }
}

pub async fn sweep(
    w: World<'_>,
    policy: &SuspendSettings,
    scope: Scope,
    ctx: &Ctx,
) -> Result<SweepReport> {
    let started = Instant::now();
    let mut report = SweepReport::default();
    let me = recover::operator("dormant sweep");
    let ttl = policy.ttl.as_secs();
    // A slice reads only its own entries of `environments/`: how many there
    // are in all is then not known (and not worth a listing).
    let (ids, strays) = match scope {
        Scope::Full => {
            let all = w.store.environment_ids()?;
            report.environments = Some(all.len());
            (all, None)
        }
        Scope::Slice => {
            let slice = super::sweep_slice::next(w.store, ctx).await?;
            (slice.ids, Some(slice.strays))
        }
    };
    for (i, id) in ids.iter().enumerate() {
        if ctx.remaining().is_zero() {
            report.unvisited = ids.len() - i;
            break;
        }
        report.visited += 1;
        let paths = w.store.env_paths(*id);
        let rec = {
            let Some(env) = registry::try_lock(&paths)? else {
                report.kept += 1;
                continue;
            };
            match env.load() {
                Ok(Some(rec)) => rec,
                Ok(None) => {
                    drop(env);
                    // Records are created atomically with their directory, so a
                    // directory without one is what an older dormant left.
                    match registry::remove_recordless(w.store, &paths) {
                        Ok(true) => report.removed.push(paths.dir.clone()),
                        Ok(false) => report.kept += 1,
                        Err(e) => report.errors.push(e),
                    }
                    continue;
                }
                Err(e) => {
                    // Never deleted: a record we cannot read may be a suspended
                    // environment someone needs. Reported for a human.
                    report.errors.push(e);
                    continue;
                }
            }
        };
        if rec.claim().is_some() {
            match recover::recover(w, &paths, &me, policy, false, ctx).await {
                Ok(Found::Recovered { .. }) => report.recovered.push(*id),
                Ok(_) => report.kept += 1,
                Err(e) => report.errors.push(e),
            }
            continue;
        }
        let expired = rec.status() == EnvStatus::Suspended
            && now_unix().saturating_sub(rec.last_activity()) >= ttl;
        let failed_release = rec.status() == EnvStatus::Releasing;
        if !expired && super::hot::expired(&rec, now_unix()) {
            let until = rec.hot_until().unwrap_or_default();
            let why = format!("its window passed at {}", crate::state::rfc3339(until));
            // No connection here: a volume-mode machine's shutdown unmounts its
            // volume (`hot::cool`).
            match super::hot::cool(w, &paths, &me, &why, None, ctx).await {
                Ok(Some(_)) => report.cooled.push(*id),
                Ok(None) => report.kept += 1,
                Err(e) => report.errors.push(e),
            }
            continue;
        }
        if !expired && super::volume::has_leftovers(&rec) {
            match finish_volume_suspend(w, &paths, &me, &rec, ctx).await {
                Ok(()) => report.recovered.push(*id),
                Err(e) => report.errors.push(e),
            }
            continue;
        }
        if expired {
            ctx.log.info(format!(
                "environment {id} has been suspended longer than the TTL ({}): releasing it",
                policy.ttl
            ));
        } else if failed_release {
            ctx.log.info(format!(
                "environment {id}: retrying a release that failed ({})",
                rec.last_error.as_deref().unwrap_or("no error recorded")
            ));
        } else {
            report.kept += 1;
            continue;
        }
        let (event, why) = if expired {
            let ttl = format!("suspended longer than the TTL ({})", policy.ttl);
            (Event::Expire, Reason::new(ReleaseCause::Ttl, ttl))
        } else {
            let retried = "a release that had failed, finished by the sweep";
            (Event::Release, Reason::new(ReleaseCause::Retried, retried))
        };
        match super::release(w, &paths, &me, None, &why, ctx).await {
            Ok(()) => {
                report.released.push(*id);
                let n = Notification::for_record(event, &rec).reason(why.text);
                notify::announce(policy, w.events, &n, &ctx.log, Audience::Operator).await;
            }
            Err(e) => report.errors.push(e),
        }
    }
    sweep_strays(w, strays, &mut report);
    sweep_jobs(w, policy, &mut report);
    sweep_job_leftovers(w, policy, &mut report);
    record_summary(w, scope, &report, started, ctx).await;
    Ok(report)
}

/// A suspended volume-mode environment whose machine a suspend did not
/// delete (its detach or delete failed, the error recorded): claimed like a
/// resume would, its volume detached and its machine deleted, then
/// suspended again as it was (its TTL unchanged).
async fn finish_volume_suspend(
    w: World<'_>,
    paths: &crate::model::EnvPaths,
    me: &crate::state::Holder,
    rec: &crate::state::EnvironmentRecord,
    ctx: &Ctx,
) -> Result<()> {
    ctx.log.info(format!(
        "environment {}: its suspension left machine {} (volume {}; {}): finishing it",
        rec.id,
        rec.machine
            .as_ref()
            .map(|m| m.id.as_str())
            .unwrap_or("(not recorded)"),
        rec.volume
            .as_ref()
            .map(|v| v.step().as_str())
            .unwrap_or("-"),
        rec.last_error.as_deref().unwrap_or("no error recorded")
    ));
    let _alive = crate::state::lock::LiveLock::hold(&paths.holder_live)?;
    registry::update(paths, ctx, |r| r.claim_for_resume(me))
        .await
        .map_err(super::update_error)?;
    let why = super::Reason::new(
        crate::events::SuspendCause::Unused,
        "finishing a suspension whose detach or delete had failed",
    );
    super::suspend(w, paths, me, false, None, &why, ctx)
        .await
        .map(drop)
}

/// The sweep's `sweep` event: always for a full sweep; for a cleanup's slice
/// only when it did something (every cleanup runs one).
async fn record_summary(
    w: World<'_>,
    scope: Scope,
    report: &SweepReport,
    started: Instant,
    ctx: &Ctx,
) {
    let counts = SweepCounts {
        visited: report.visited as u64,
        released: report.released.len() as u64,
        recovered: report.recovered.len() as u64,
        removed: report.removed.len() as u64,
        errors: report.errors.len() as u64,
        unvisited: report.unvisited as u64,
        cooled: report.cooled.len() as u64,
        environments: report.environments.map(|n| n as u64),
    };
    let idle = counts.released
        + counts.recovered
        + counts.removed
        + counts.errors
        + counts.unvisited
        + counts.cooled
        == 0;
    if scope == Scope::Slice && idle {
        return;
    }
    let event = events::Event::new(Kind::Sweep, scope.as_str(), w.provider.name())
        .by(&recover::operator("dormant sweep"))
        .duration(started.elapsed())
        .sweep(counts);
    w.events.record(event, ctx).await;
}

/// Staging directories of killed creates, trash of killed deletes: every
/// entry that is not an environment (a slice: those of its own entries), and
/// everything in `trash/`.
fn sweep_strays(w: World<'_>, slice_strays: Option<Vec<PathBuf>>, report: &mut SweepReport) {
    let entries = match slice_strays {
        None => w.store.stray_entries(),
        Some(strays) => w.store.trash_entries().map(|mut trash| {
            trash.extend(strays.into_iter().map(|p| {
                let age = store::age_secs(&p);
                (p, age)
            }));
            trash
        }),
    };
    match entries {
        Ok(entries) => {
            for (path, age) in entries {
                if age < STRAY_AGE_SECS {
                    continue;
                }
                match store::remove_tree(&path).or_else(|_| store::remove_file(&path)) {
                    Ok(()) => report.removed.push(path),
                    Err(e) => report.errors.push(e),
                }
            }
        }
        Err(e) => report.errors.push(e),
    }
}

/// Job files whose job is gone: no stage process alive, idle past the grace,
/// and holding no environment (a cleanup killed before it finished).
fn sweep_jobs(w: World<'_>, policy: &SuspendSettings, report: &mut SweepReport) {
    let dir = w.store.root().join("jobs");
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return;
    };
    let grace = policy.claim_grace.as_secs();
    for entry in entries.flatten() {
        let path = entry.path();
        let idle = entry
            .metadata()
            .ok()
            .and_then(|m| m.modified().ok())
            .and_then(|t| t.elapsed().ok())
            .map(|d| d.as_secs())
            .unwrap_or(0);
        if idle < grace || path.extension().is_none_or(|e| e != "json") {
            continue;
        }
        let live = path.with_extension("live");
        if crate::state::lock::is_live(&live).unwrap_or(true) {
            continue;
        }
        let Ok(Some(lock)) = crate::state::FileLock::try_acquire(&path.with_extension("lock"))
        else {
            continue;
        };
        let holds_an_environment = match store::read_json::<JobState>(&path) {
            Ok(Some(state)) => registry::peek(&w.store.env_paths(state.env_id))
                .ok()
                .flatten()
                .and_then(|rec| rec.holder().cloned())
                .is_some_and(|h| h.is_job(&state.runner_id, state.job_id)),
            // Unreadable: left for a human (the error names it elsewhere).
            Ok(None) | Err(_) => true,
        };
        if holds_an_environment {
            continue;
        }
        let removed = store::remove_file(&path)
            .and_then(|()| store::remove_file(&live))
            .and_then(|()| lock.remove());
        match removed {
            Ok(()) => report.removed.push(path),
            Err(e) => report.errors.push(e),
        }
    }
}

/// What a killed process left of a job besides its state: the temp file of
/// a state write it never renamed (`.<job>.json.<pid>.tmp`, older than a
/// write takes), and the lock and liveness files of a job with no state left
/// (refused or cleaned up, but killed before it removed them) that no
/// process holds and that have been idle past the claim grace.
fn sweep_job_leftovers(w: World<'_>, policy: &SuspendSettings, report: &mut SweepReport) {
    let Ok(entries) = std::fs::read_dir(w.store.root().join("jobs")) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        let idle = entry
            .metadata()
            .ok()
            .and_then(|m| m.modified().ok())
            .and_then(|t| t.elapsed().ok())
            .map_or(0, |d| d.as_secs());
        if name.starts_with('.') && name.ends_with(".tmp") {
            if idle >= STRAY_AGE_SECS {
                match store::remove_file(&path) {
                    Ok(()) => report.removed.push(path),
                    Err(e) => report.errors.push(e),
                }
            }
            continue;
        }
        if !name.ends_with(".lock")
            || idle < policy.claim_grace.as_secs()
            || path.with_extension("json").exists()
        {
            continue;
        }
        let live = path.with_extension("live");
        if crate::state::lock::is_live(&live).unwrap_or(true) {
            continue;
        }
        let Ok(Some(lock)) = crate::state::FileLock::try_acquire(&path) else {
            continue;
        };
        // Re-checked under the lock: a prepare of this job may have saved
        // its state since.
        if path.with_extension("json").exists() {
            continue;
        }
        match store::remove_file(&live).and_then(|()| lock.remove()) {
            Ok(()) => report.removed.push(path),
            Err(e) => report.errors.push(e),
        }
    }
}
