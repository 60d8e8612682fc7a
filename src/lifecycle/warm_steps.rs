//! The warm pool's shared steps, used by a prepare taking a machine
//! (`warm.rs`), a job that makes one give its slot up (`warm_give_way.rs`)
//! and the refill (`warm_refill.rs`): the pool as listed, the wait for a
//! booting machine, a retirement, and the events they log. Here, below
//! all three, so that none imports another's (docs/architecture.md, "Warm
//! machines").

use std::time::Duration;

use anyhow::Result;

use super::World;
use crate::context::Ctx;
use crate::events::{Event, Kind};
use crate::provider::warm::WarmMachines;
use crate::state::pool::{Pool, WarmEntry, WarmStatus};
use crate::state::FileLock;

pub(super) fn event(w: World<'_>, cause: &str, entry: Option<&WarmEntry>) -> Event {
    let mut e = Event::new(Kind::Warm, cause, w.provider.name());
    if let Some(entry) = entry {
        e.warm = Some(entry.id);
    }
    e
}

/// The pool's entries as listed (not locked: each is read again under its
/// lock before anything is done to it); unreadable ones are the refill's.
pub(super) fn listed(pool: &Pool) -> Result<impl Iterator<Item = WarmEntry>> {
    Ok(pool
        .entries()?
        .into_iter()
        .filter_map(|(_, e)| e.ok().flatten()))
}

/// Waits until warm machine `id` is no longer booting: ready (the caller
/// takes it), or anything else — retired, taken by another job, or its
/// launcher gone (its entry lock free: the next refill finishes it).
pub(super) async fn wait_while_booting(pool: &Pool, id: uuid::Uuid, ctx: &Ctx) -> Result<()> {
    use crate::wait::{Poll, Schedule, Wait};
    let mut wait = Wait::new(
        ctx,
        format!("warm machine {id} to finish booting"),
        Schedule::fixed(BOOTING_POLL),
    );
    wait.until(|| async {
        let booting = pool
            .peek(id)?
            .is_some_and(|e| e.status == WarmStatus::Launching);
        // Its launcher holds the entry's lock while it boots.
        if booting && pool.try_lock(id)?.is_none() {
            return Ok(Poll::Pending("it is booting".to_string()));
        }
        Ok(Poll::Ready(()))
    })
    .await
}

/// A booting warm machine is looked at this often by a job waiting for it
/// (a local file read and a lock attempt).
const BOOTING_POLL: Duration = Duration::from_millis(250);

/// `retiring` (written first), the machine deleted, the entry removed.
pub(super) async fn retire(
    w: World<'_>,
    warm: &dyn WarmMachines,
    pool: &Pool,
    lock: FileLock,
    mut entry: WarmEntry,
    why: &str,
    ctx: &Ctx,
) -> Result<()> {
    if !matches!(entry.status, WarmStatus::Retiring { .. }) {
        entry.status = WarmStatus::Retiring {
            why: why.to_string(),
        };
        pool.set(&lock, &entry)?;
    }
    crate::failpoint!("warm:retiring");
    let wp = pool.paths(entry.id);
    let machine = match &entry.machine {
        Some(m) => Some(m.clone()),
        None => warm.find_launched(&wp, ctx).await?,
    };
    warm.retire(&wp, machine.as_ref(), ctx).await?;
    crate::failpoint!("warm:retired");
    w.events
        .record(event(w, "retired", Some(&entry)).reason(why), ctx)
        .await;
    pool.remove(w.store, lock, entry.id)
}
