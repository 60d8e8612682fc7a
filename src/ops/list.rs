//! `list`, `inspect`, `release` and `sweep`: the operator's view of the registry.

use std::io::Write;

use anyhow::{bail, Context, Result};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::context::{Ctx, JobLog};
use crate::envkey::EnvironmentKey;
use crate::job::Job;
use crate::settings::Settings;
use crate::state::{now_unix, EnvStatus, StateStore};

/// How long `release` and `sweep` may take.
const OPERATOR_BUDGET: std::time::Duration = std::time::Duration::from_secs(30 * 60);

fn store(settings: &Settings, job: &Job) -> Result<StateStore> {
    StateStore::open(&settings.state_dir(job)?)
}

/// An environment id from a key or a bare id.
fn env_id(text: &str) -> Result<Uuid> {
    if let Ok(id) = Uuid::parse_str(text.trim()) {
        return Ok(id);
    }
    EnvironmentKey::parse(text)
        .map(|k| k.env_id)
        .map_err(|e| anyhow::anyhow!("{text:?} is neither an environment id nor a key: {e}"))
}

pub fn list(settings: &Settings, job: &Job, json: bool, out: &mut dyn Write) -> Result<()> {
    let store = store(settings, job)?;
    if !json {
        writeln!(
            out,
            "{:<36}  {:<9}  {:<8}  {:>7}  {:>10}  {:>4}  KEY",
            "ENVIRONMENT", "STATUS", "PROVIDER", "PROJECT", "SUSPENDED", "JOBS"
        )?;
    }
    for id in store.environment_ids()? {
        let paths = store.env_paths(id);
        match paths.peek() {
            Ok(Some(rec)) => {
                if json {
                    writeln!(out, "{}", serde_json::to_string(&rec)?)?;
                } else {
                    let age = rec
                        .suspended_at
                        .filter(|_| rec.status == EnvStatus::Suspended)
                        .map(|t| crate::stages::prepare::human_age(now_unix().saturating_sub(t)))
                        .unwrap_or_else(|| "-".into());
                    writeln!(
                        out,
                        "{:<36}  {:<9}  {:<8}  {:>7}  {:>10}  {:>4}  {}",
                        rec.id,
                        rec.status.as_str(),
                        rec.provider,
                        rec.project_id,
                        age,
                        rec.job_count,
                        rec.key.as_deref().unwrap_or("-")
                    )?;
                }
            }
            Ok(None) => {}
            Err(e) => writeln!(out, "{id}  unreadable: {e:#}")?,
        }
    }
    Ok(())
}

pub fn inspect(settings: &Settings, job: &Job, key: &str, out: &mut dyn Write) -> Result<()> {
    let store = store(settings, job)?;
    let id = env_id(key)?;
    let rec = store.env_paths(id).peek()?.with_context(|| {
        format!(
            "environment {id} is not in the registry under {}",
            store.root().display()
        )
    })?;
    writeln!(out, "{}", serde_json::to_string_pretty(&rec)?)?;
    Ok(())
}

pub async fn release(
    settings: &Settings,
    job: &Job,
    key: &str,
    log: JobLog,
    cancel: CancellationToken,
) -> Result<()> {
    let store = store(settings, job)?;
    let id = env_id(key)?;
    let paths = store.env_paths(id);
    let rec = paths
        .peek()?
        .with_context(|| format!("environment {id} is not in the registry"))?;
    if rec.status != EnvStatus::Suspended && rec.status != EnvStatus::Releasing {
        bail!(
            "environment {id} is {} (job {:?}): only a suspended environment can be released by hand",
            rec.status.as_str(),
            rec.current_job
        );
    }
    let provider = crate::provider::from_settings(settings, &store)?;
    let ctx = Ctx::new(log.clone(), cancel, OPERATOR_BUDGET);
    crate::ops::sweep::release_environment(provider.as_ref(), &paths, &ctx).await?;
    log.info(format!("environment {id} released"));
    Ok(())
}

pub async fn sweep(
    settings: &Settings,
    job: &Job,
    delete_orphans: bool,
    log: JobLog,
    cancel: CancellationToken,
) -> Result<()> {
    let store = store(settings, job)?;
    let provider = crate::provider::from_settings(settings, &store)?;
    let ctx = Ctx::new(log.clone(), cancel, OPERATOR_BUDGET);
    let report = crate::ops::sweep::expired(&store, provider.as_ref(), settings, &ctx).await?;
    log.info(format!(
        "sweep: {} released, {} kept, {} errors",
        report.released.len(),
        report.kept,
        report.errors.len()
    ));
    // Machines the provider manages that no record knows: a lost state dir.
    let known = store.environment_ids()?;
    let mut orphans = 0;
    for m in provider.list(&ctx).await? {
        if m.env_id.is_some_and(|id| known.contains(&id)) {
            continue;
        }
        orphans += 1;
        if delete_orphans {
            log.info(format!(
                "deleting orphan machine {} (environment {:?})",
                m.machine.id, m.env_id
            ));
            provider.delete(&m.machine, &ctx).await?;
        } else {
            log.warn(format!(
                "machine {} ({:?}) belongs to no environment in {}; `dormant sweep --delete-orphans` deletes it",
                m.machine.id,
                m.state,
                store.root().display()
            ));
        }
    }
    if orphans > 0 {
        log.info(format!("{orphans} orphan machine(s)"));
    }
    if let Some(e) = report.errors.into_iter().next() {
        return Err(e);
    }
    Ok(())
}
