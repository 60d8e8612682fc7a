//! Deleting environments that nobody will resume: suspended ones past the TTL,
//! and releases that failed half-way. Run by `dormant sweep` and, within a
//! small time bound, at the end of every cleanup. Never waits on a busy
//! environment: one whose lock is held is left for the next sweep.

use anyhow::{Context, Result};
use uuid::Uuid;

use crate::context::Ctx;
use crate::provider::Provider;
use crate::settings::Settings;
use crate::state::{now_unix, EnvPaths, EnvStatus, StateStore};

#[derive(Debug, Default)]
pub struct SweepReport {
    pub released: Vec<Uuid>,
    pub kept: usize,
    pub errors: Vec<anyhow::Error>,
    /// Environments not looked at because the time bound ran out.
    pub unvisited: usize,
}

/// Releases suspended environments older than the TTL and finishes failed releases.
pub async fn expired(
    store: &StateStore,
    provider: &dyn Provider,
    settings: &Settings,
    ctx: &Ctx,
) -> Result<SweepReport> {
    let mut report = SweepReport::default();
    let ttl = settings.suspend.ttl.as_secs();
    let ids = store.environment_ids()?;
    for (i, id) in ids.iter().enumerate() {
        if ctx.remaining().is_zero() {
            report.unvisited = ids.len() - i;
            break;
        }
        let paths = store.env_paths(*id);
        let due = {
            let Some(env) = paths.try_lock()? else {
                continue;
            };
            let rec = match env.load() {
                Ok(Some(rec)) => rec,
                Ok(None) => continue,
                Err(e) => {
                    report.errors.push(e);
                    continue;
                }
            };
            let expired = rec.status == EnvStatus::Suspended
                && now_unix().saturating_sub(rec.suspended_at.unwrap_or(rec.created_at)) >= ttl;
            let failed_release = rec.status == EnvStatus::Releasing && rec.current_job.is_none();
            if expired {
                ctx.log.info(format!(
                    "environment {id} has been suspended longer than the TTL ({}): releasing it",
                    settings.suspend.ttl
                ));
            }
            expired || failed_release
        };
        if !due {
            report.kept += 1;
            continue;
        }
        match release_environment(provider, &paths, ctx).await {
            Ok(()) => report.released.push(*id),
            Err(e) => report.errors.push(e),
        }
    }
    Ok(report)
}

/// Releases one environment: marks it `releasing`, deletes its machine, then its
/// files. If the delete fails the record stays `releasing` for a later sweep.
pub async fn release_environment(
    provider: &dyn Provider,
    paths: &EnvPaths,
    ctx: &Ctx,
) -> Result<()> {
    delete_machine(provider, paths, ctx).await?;
    paths.remove_all()
}

/// The first half of a release: marks the record `releasing` and deletes the
/// machine, leaving the environment's files (cleanup closes the SSH connection,
/// whose socket is among them, before removing them).
pub async fn delete_machine(provider: &dyn Provider, paths: &EnvPaths, ctx: &Ctx) -> Result<()> {
    let id = paths.id;
    let machine = {
        let env = paths.lock()?;
        let Some(mut rec) = env.load()? else {
            return Ok(());
        };
        rec.status = EnvStatus::Releasing;
        rec.current_job = None;
        env.save(&rec)?;
        rec.machine
    };
    if let Some(machine) = &machine {
        if let Err(e) = provider.delete(machine, ctx).await {
            let _ = crate::stages::prepare::update_record(paths, |r| {
                r.last_error = Some(format!("{e:#}"))
            });
            return Err(e).with_context(|| {
                format!("releasing environment {id} (a later `dormant sweep` retries)")
            });
        }
    }
    Ok(())
}
