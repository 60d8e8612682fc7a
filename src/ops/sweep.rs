//! `dormant sweep [--delete-orphans]`: the lifecycle's sweep (TTL, stale
//! claims, leftovers of killed processes; see `lifecycle/sweep.rs`) with a
//! report, plus machines and data volumes the provider manages that no
//! record knows (a lost state dir), reported or deleted.

use anyhow::Result;
use tokio_util::sync::CancellationToken;

use crate::context::{Ctx, JobLog};
use crate::events::{Event, EventLog, Kind, ReleaseCause};
use crate::job::Job;
use crate::lifecycle::{recover, sweep, World};
use crate::settings::Settings;

use super::{open_store, OPERATOR_BUDGET};

/// A warm machine in no pool entry is an orphan only once it is this old.
/// A pool entry is written before its machine is launched, so one without
/// an entry was left by a lost state dir; the grace keeps the sweep off a
/// machine whose listing raced its launch or hand-over (a cloud's listing
/// is eventually consistent).
const WARM_ORPHAN_GRACE_SECS: u64 = 15 * 60;

/// `listed` without the warm machines the pool here knows or that are too
/// young to call orphans; a warm machine that looks orphaned is looked up
/// again (listed anew) so one handed to an environment since is not taken
/// for one.
async fn warm_orphans_only(
    provider: &dyn crate::provider::Provider,
    store: &crate::state::StateStore,
    listed: Vec<crate::model::ManagedMachine>,
    ctx: &Ctx,
) -> Result<Vec<crate::model::ManagedMachine>> {
    // Read after the listing: an entry is made before its machine.
    let pooled: Vec<uuid::Uuid> = crate::state::pool::Pool::new(store)
        .entries()?
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    let now = crate::state::now_unix();
    let suspect = |m: &crate::model::ManagedMachine| {
        m.warm.is_some_and(|w| !pooled.contains(&w))
            && m.launched_at
                .is_none_or(|at| now.saturating_sub(at) >= WARM_ORPHAN_GRACE_SECS)
    };
    let (warm, mut out): (Vec<_>, Vec<_>) = listed.into_iter().partition(|m| m.warm.is_some());
    let suspects: Vec<_> = warm.into_iter().filter(|m| suspect(m)).collect();
    if suspects.is_empty() {
        return Ok(out);
    }
    let again = provider.list(ctx).await?;
    out.extend(suspects.into_iter().filter(|m| {
        again
            .iter()
            .any(|a| a.machine.id == m.machine.id && a.warm == m.warm && a.env_id.is_none())
    }));
    Ok(out)
}

pub async fn sweep(
    settings: &Settings,
    job: &Job,
    delete_orphans: bool,
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
    let ctx = Ctx::new(log.clone(), cancel, OPERATOR_BUDGET);
    let mut report = sweep::sweep(w, &settings.suspend, sweep::Scope::Full, &ctx).await?;
    for path in &report.removed {
        log.info(format!(
            "removed {} (left by a killed process)",
            path.display()
        ));
    }
    log.info(format!(
        "sweep: {} released (TTL), {} recovered (holder gone), {} leftovers removed, {} kept, {} errors",
        report.released.len(),
        report.recovered.len(),
        report.removed.len(),
        report.kept,
        report.errors.len()
    ));
    // Warm machines: too old, settings changed, dead, or not wanted (warm =
    // 0 removes them all). Booting is `dormant warm`'s, not the sweep's.
    // Its errors are reported with the sweep's own, after the rest ran.
    let mut warm_errors: Vec<String> = Vec::new();
    if let Some(pool) = provider.warm() {
        match crate::lifecycle::warm_refill::refill(
            w,
            pool,
            &crate::lifecycle::warm_refill::OverSsh(settings.ssh.clone()),
            false,
            &ctx,
        )
        .await
        {
            Ok(r) => {
                super::warm::print(&log, &r);
                warm_errors = r.errors;
            }
            Err(e) => {
                log.warn(format!("warm pool: {e:#}"));
                warm_errors.push(format!("{e:#}"));
            }
        }
    }
    // After the pool's retirements, which may leave a pin unused.
    match provider.tidy(&ctx).await {
        Ok(removed) => {
            for path in removed {
                log.info(format!("removed {} (no machine uses it)", path.display()));
            }
        }
        Err(e) => report
            .errors
            .push(e.context(format!("tidying the {} provider's files", provider.name()))),
    }
    // Machines the provider manages that no record knows: a lost state dir.
    // The records are read after the listing: an environment's record is
    // made before its machine, so a machine a prepare made while this sweep
    // listed has its record by then and is not taken for an orphan.
    let listed = provider.list(&ctx).await?;
    let known = store.environment_ids()?;
    let listed = warm_orphans_only(provider.as_ref(), &store, listed, &ctx).await?;
    let mut orphans = 0;
    for m in listed {
        if m.env_id.is_some_and(|id| known.contains(&id)) {
            continue;
        }
        orphans += 1;
        let env = match (m.env_id, m.warm) {
            (Some(id), _) => format!("environment {id}"),
            (None, Some(w)) => format!("warm machine {w}, in no warm pool here"),
            (None, None) => "no environment tag".into(),
        };
        if delete_orphans {
            log.info(format!("deleting orphan machine {} ({env})", m.machine.id));
            let started = std::time::Instant::now();
            provider.delete(&m.machine, &ctx).await?;
            // An orphan has no record: the event says what the machine's tags say.
            let what = format!("machine {}", m.machine.id);
            let event = orphan_released(provider.name(), &what, m.env_id, started);
            events.record(event, &ctx).await;
        } else {
            log.warn(format!(
                "machine {} ({env}, {}) belongs to no environment in {}; \
                 `dormant sweep --delete-orphans` deletes it",
                m.machine.id,
                m.state,
                store.root().display()
            ));
        }
    }
    if orphans > 0 {
        log.info(format!("{orphans} orphan machine(s)"));
    }
    // Data volumes (volume mode) no record knows.
    if let Some(vols) = provider.volumes() {
        // Listed first, as the machines above: a record is made before its volume.
        let listed = vols.list_volumes(&ctx).await?;
        let mut orphans = 0;
        for v in listed {
            // Known means a record: a directory left without one (a killed
            // create) does not own its volume.
            if v.env_id
                .is_some_and(|id| store.env_paths(id).record.exists())
            {
                continue;
            }
            orphans += 1;
            if delete_orphans {
                log.info(format!("deleting orphan data volume {}", v.volume.id));
                let started = std::time::Instant::now();
                vols.delete_volume(&v.volume, &ctx).await?;
                // As for an orphan machine: no record, so the event says what
                // the volume's tags say (its environment) and names the volume.
                let what = format!("data volume {}", v.volume.id);
                let event = orphan_released(provider.name(), &what, v.env_id, started);
                events.record(event, &ctx).await;
            } else {
                log.warn(format!(
                    "data volume {} ({}) belongs to no environment in {}; \
                     `dormant sweep --delete-orphans` deletes it (and the files on it)",
                    v.volume.id,
                    v.state,
                    store.root().display()
                ));
            }
        }
        if orphans > 0 {
            log.info(format!("{orphans} orphan data volume(s)"));
        }
    }
    let count = report.errors.len() + warm_errors.len();
    if let Some(first) = report.errors.into_iter().next() {
        return Err(first.context(format!("sweep finished with {count} error(s); the first")));
    }
    if let Some(first) = warm_errors.first() {
        anyhow::bail!(
            "sweep finished with {count} error(s), in the warm pool; the first: {first} \
             (the rest of the sweep ran; `dormant warm` shows the pool's errors too)"
        );
    }
    Ok(())
}

/// The `released` event of an orphan `sweep --delete-orphans` deleted: no
/// record, so it names the thing and the environment its tags name.
fn orphan_released(
    provider: &str,
    what: &str,
    env: Option<uuid::Uuid>,
    started: std::time::Instant,
) -> Event {
    let mut event = Event::new(Kind::Released, ReleaseCause::Orphan.as_str(), provider)
        .by(&recover::operator("dormant sweep --delete-orphans"))
        .duration(started.elapsed())
        .reason(&format!("{what} belongs to no environment in the registry"));
    event.env = env;
    event
}
