//! A job that cannot take a warm machine (another image, instance type)
//! and finds no slot for its own must not wait behind an idle warm one: the
//! lifecycle decides to retire one (here), the provider only reports that a
//! job's machine would wait (`WarmMachines::job_must_wait`). A job that can
//! take one never gives one up: it takes it, or waits for the one booting
//! (`warm.rs`). See docs/architecture.md, "Warm machines".

use anyhow::{Context, Result};

use super::warm_steps::{listed, retire, wait_while_booting};
use super::World;
use crate::context::Ctx;
use crate::provider::warm::WarmMachines;
use crate::state::pool::{Pool, WarmEntry, WarmStatus};

/// Why a warm machine was retired for a job that could not take it (its
/// `retired` event's reason).
pub(crate) const GAVE_WAY: &str = "a job that cannot take it needed its slot";

/// A job that cannot take a warm machine (another image, instance type)
/// must not wait behind an idle one for a slot: when the provider says its
/// own machine would wait (`job_must_wait`), the oldest ready warm machine
/// of this provider is retired (its entry marked `retiring` under its lock
/// first, so no prepare takes it meanwhile and a killed process leaves an
/// entry the next refill or sweep finishes). With none ready, one that is
/// booting is waited for first: it would hold the slot once ready. Best
/// effort: whatever fails is logged, and the job waits for a slot as usual.
pub(super) async fn give_way(w: World<'_>, warm: &dyn WarmMachines, pool: &Pool, ctx: &Ctx) {
    let ours = |e: &WarmEntry| e.provider == w.provider.name();
    let result: Result<Option<String>> = async {
        if !warm.job_must_wait(ctx).await? {
            return Ok(None);
        }
        let ready = || -> Result<Vec<WarmEntry>> {
            let mut ready: Vec<WarmEntry> = listed(pool)?
                .filter(|e| e.status == WarmStatus::Ready && ours(e))
                .collect();
            ready.sort_by_key(|e| e.launched_at);
            Ok(ready)
        };
        let mut candidates = ready()?;
        if candidates.is_empty() {
            let Some(booting) = listed(pool)?.find(|e| e.status == WarmStatus::Launching && ours(e))
            else {
                return Ok(None);
            };
            ctx.log.info(format!(
                "no free slot, and warm machine {} is booting: waiting for it, to make it give its slot \
                 up once ready",
                booting.id
            ));
            wait_while_booting(pool, booting.id, ctx).await?;
            candidates = ready()?;
        }
        for candidate in candidates {
            let Some(lock) = pool.try_lock(candidate.id)? else {
                continue; // a prepare taking it, or a refill retiring it
            };
            // Read again under the lock: it may have been taken meanwhile.
            let Some(entry) = pool.peek(candidate.id)?.filter(|e| e.status == WarmStatus::Ready)
            else {
                continue;
            };
            let what = entry
                .machine
                .as_ref()
                .map(|m| format!("warm machine {} ({})", entry.id, m.id))
                .unwrap_or_else(|| format!("warm machine {}", entry.id));
            retire(w, warm, pool, lock, entry, GAVE_WAY, ctx)
                .await
                .with_context(|| format!("{what} gives its slot up, but retiring it failed (the next refill or `dormant sweep` finishes it)"))?;
            return Ok(Some(format!("{what} gives its slot up for this job (retired)")));
        }
        Ok(None)
    }
    .await;
    match result {
        Ok(Some(line)) => ctx.log.info(line),
        Ok(None) => {}
        Err(e) => ctx.log.warn(format!("warm machines: {e:#}")),
    }
}
