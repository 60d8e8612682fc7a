//! The sweep: deletes suspended environments past the TTL, recovers claims
//! whose holder is gone, finishes releases and deletes that were killed
//! half-way, and removes what a killed process left (a directory without a
//! record, a staging or trash entry, a dead job's state and lock files). Run
//! by `dormant sweep` and, within a small time bound, at the end of every
//! cleanup. Never waits on a busy environment: one whose lock is held is left
//! for the next sweep, and one another process is releasing is skipped.

use std::path::PathBuf;

use anyhow::Result;
use uuid::Uuid;

use super::recover::{self, Found};
use super::World;
use crate::context::Ctx;
use crate::notify::{self, Audience, Event, Notification};
use crate::settings::SuspendSettings;
use crate::state::registry;
use crate::state::{now_unix, store, EnvStatus, JobState};

/// A staging or trash entry younger than this may belong to a create or delete
/// in progress (they take milliseconds).
const STRAY_AGE_SECS: u64 = 60;

#[derive(Debug, Default)]
pub struct SweepReport {
    /// Past the TTL, deleted.
    pub released: Vec<Uuid>,
    /// Held by a holder that is gone; settled.
    pub recovered: Vec<Uuid>,
    /// Directories and files a killed process left.
    pub removed: Vec<PathBuf>,
    pub kept: usize,
    pub errors: Vec<anyhow::Error>,
    /// Environments not looked at because the time bound ran out.
    pub unvisited: usize,
}

pub async fn sweep(w: World<'_>, policy: &SuspendSettings, ctx: &Ctx) -> Result<SweepReport> {
    let mut report = SweepReport::default();
    let me = recover::operator("dormant sweep");
    let ttl = policy.ttl.as_secs();
    let ids = w.store.environment_ids()?;
    for (i, id) in ids.iter().enumerate() {
        if ctx.remaining().is_zero() {
            report.unvisited = ids.len() - i;
            break;
        }
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
        match super::release(w, &paths, &me, None, ctx).await {
            Ok(()) => {
                report.released.push(*id);
                let (event, reason) = if expired {
                    let ttl = format!("suspended longer than the TTL ({})", policy.ttl);
                    (Event::Expire, ttl)
                } else {
                    let retried = "a release that had failed, finished by the sweep";
                    (Event::Release, retried.to_string())
                };
                let n = Notification::for_record(event, &rec).reason(reason);
                notify::announce(policy, &n, &ctx.log, Audience::Operator).await;
            }
            Err(e) => report.errors.push(e),
        }
    }
    sweep_strays(w, &mut report);
    sweep_jobs(w, policy, &mut report);
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
    super::suspend(w, paths, me, false, None, ctx)
        .await
        .map(drop)
}

/// Staging directories of killed creates, trash of killed deletes.
fn sweep_strays(w: World<'_>, report: &mut SweepReport) {
    match w.store.stray_entries() {
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
