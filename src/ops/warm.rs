//! `dormant warm`: tops the warm pool up (docs/architecture.md, "Warm
//! machines"): retires warm machines that are too old, made from settings
//! that changed, dead, or not wanted, and boots what is missing. Started
//! detached by a prepare that took a warm machine, and every minute by the
//! Debian package's timer; a second one while one runs returns at once.

use anyhow::{bail, Result};
use tokio_util::sync::CancellationToken;

use crate::context::{Ctx, JobLog};
use crate::events::EventLog;
use crate::job::Job;
use crate::lifecycle::{warm_refill, World};
use crate::settings::Settings;

use super::{open_store, OPERATOR_BUDGET};

pub async fn warm(
    settings: &Settings,
    job: &Job,
    log: JobLog,
    cancel: CancellationToken,
) -> Result<()> {
    let store = open_store(settings, job)?;
    let provider = crate::provider::from_settings(settings, &store)?;
    let events = EventLog::new(store.root(), &settings.events);
    let w = World {
        store: &store,
        provider: provider.as_ref(),
        events: &events,
    };
    let Some(pool) = provider.warm() else {
        log.info(format!(
            "the {} provider keeps no warm machines here (its `warm` setting is 0 and the pool is empty)",
            provider.name()
        ));
        return Ok(());
    };
    let ctx = Ctx::new(log.clone(), cancel, OPERATOR_BUDGET);
    let report = warm_refill::refill(
        w,
        pool,
        &warm_refill::OverSsh(settings.ssh.clone()),
        true,
        &ctx,
    )
    .await?;
    print(&log, &report);
    if !report.errors.is_empty() {
        bail!(
            "the warm pool was not fully refilled: {}",
            report.errors.join("; ")
        );
    }
    Ok(())
}

/// The report's lines (also `sweep`'s, which retires without booting).
pub fn print(log: &JobLog, report: &warm_refill::RefillReport) {
    if let Some(why) = &report.skipped {
        log.info(format!("warm pool: {why}"));
    }
    for (id, why) in &report.retired {
        log.info(format!("warm pool: retired {id}: {why}"));
    }
    for id in &report.launched {
        log.info(format!("warm pool: booted {id}"));
    }
    for e in &report.errors {
        log.warn(format!("warm pool: {e}"));
    }
    log.info(format!(
        "warm pool: {} ready or booting before this run, {} booted, {} retired",
        report.ready,
        report.launched.len(),
        report.retired.len()
    ));
}
