//! Deleting environments that nobody will resume: ones untouched for longer
//! than the TTL (suspended, or active with a runner that died mid-job), and
//! releases that failed half-way. Run by `dormant sweep` and, within a
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
            // Untouched for longer than the TTL, whatever its status: a suspended
            // environment nobody resumed, or an active one whose runner died
            // before its cleanup ran (it would otherwise leak forever).
            let last_activity = [Some(rec.created_at), rec.suspended_at, rec.resumed_at]
                .into_iter()
                .flatten()
                .max()
                .unwrap_or(0);
            let expired = rec.status != EnvStatus::Releasing
                && now_unix().saturating_sub(last_activity) >= ttl;
            let failed_release = rec.status == EnvStatus::Releasing && rec.current_job.is_none();
            if expired {
                ctx.log.info(format!(
                    "environment {id} ({}) has been untouched longer than the TTL ({}): releasing it",
                    rec.status.as_str(),
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
    let machine = match machine {
        Some(m) => Some(m),
        None => provider.find(id, ctx).await.with_context(|| {
            format!("looking up the machine of environment {id} before releasing it")
        })?,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::context::JobLog;
    use crate::provider::local::LocalProvider;
    use crate::state::EnvironmentRecord;

    fn record(store: &StateStore, status: EnvStatus, age: u64, job: Option<u64>) -> EnvPaths {
        let paths = store.env_paths(Uuid::new_v4());
        paths.create().unwrap();
        let mut rec = EnvironmentRecord::new(paths.id, "local", "1", "s", 5, 9);
        rec.status = status;
        rec.current_job = job;
        rec.created_at = now_unix() - age;
        if status == EnvStatus::Suspended {
            rec.suspended_at = Some(now_unix() - age);
        }
        paths.lock().unwrap().save(&rec).unwrap();
        paths
    }

    #[tokio::test]
    async fn sweeps_what_is_past_the_ttl_whatever_its_status_and_keeps_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let store = StateStore::open(dir.path()).unwrap();
        let settings = Settings::default();
        let week = settings.suspend.ttl.as_secs();
        let old_suspended = record(&store, EnvStatus::Suspended, week + 10, None);
        let abandoned_active = record(&store, EnvStatus::Active, week + 10, Some(3));
        let young_suspended = record(&store, EnvStatus::Suspended, 60, None);
        let busy = record(&store, EnvStatus::Active, 60, Some(4));
        let failed_release = record(&store, EnvStatus::Releasing, 60, None);
        let ctx = Ctx::new(
            JobLog::capture().0,
            Default::default(),
            std::time::Duration::from_secs(5),
        );
        let report = expired(&store, &LocalProvider::new(store.clone()), &settings, &ctx)
            .await
            .unwrap();
        for gone in [&old_suspended, &abandoned_active, &failed_release] {
            assert!(!gone.exists(), "{} should be released", gone.id);
        }
        for kept in [&young_suspended, &busy] {
            assert!(kept.exists(), "{} should be kept", kept.id);
        }
        assert_eq!(report.released.len(), 3);
        assert_eq!(report.kept, 2);
    }

    #[tokio::test]
    async fn a_locked_environment_is_skipped_not_waited_for() {
        let dir = tempfile::tempdir().unwrap();
        let store = StateStore::open(dir.path()).unwrap();
        let settings = Settings::default();
        let old = record(
            &store,
            EnvStatus::Suspended,
            settings.suspend.ttl.as_secs() + 1,
            None,
        );
        let held = old.lock().unwrap();
        let ctx = Ctx::new(
            JobLog::capture().0,
            Default::default(),
            std::time::Duration::from_secs(5),
        );
        let report = expired(&store, &LocalProvider::new(store.clone()), &settings, &ctx)
            .await
            .unwrap();
        assert!(report.released.is_empty());
        drop(held);
        assert!(old.exists());
    }
}
