//! Warm machines' effects: a prepare **takes** a ready warm machine for a
//! new environment or a volume-mode resume, and hands it over; a machine that
//! must go is **retired**. The refill that retires what must go and boots
//! what is missing is `lifecycle::warm_refill`. Every pool status is
//! written before its effect (`state::pool`), and each step has a crash
//! point, so a process killed at any line leaves an entry the next refill or
//! sweep finishes: a machine is handed to one environment at most, and none
//! is leaked or lost from the books.
//! See docs/architecture.md, "Warm machines".

use std::time::Duration;

use anyhow::{Context, Result};

use super::World;
use crate::context::Ctx;
use crate::events::{Event, Kind};
use crate::model::{EnvPaths, Machine};
use crate::provider::warm::WarmMachines;
use crate::provider::MachineSpec;
use crate::state::pool::{self, Pool, WarmEntry, WarmStatus};
use crate::state::{now_unix, FileLock};

pub(super) fn event(w: World<'_>, cause: &str, entry: Option<&WarmEntry>) -> Event {
    let mut e = Event::new(Kind::Warm, cause, w.provider.name());
    if let Some(entry) = entry {
        e.warm = Some(entry.id);
    }
    e
}

/// A taken warm machine, as the new environment's.
pub struct Taken {
    pub machine: Machine,
    pub warm_id: uuid::Uuid,
    pub age_secs: u64,
}

/// Takes a ready warm machine for environment `env` (whose record exists,
/// held by the caller), or finishes the hand-over a killed attempt of the
/// same prepare began. `None`: there is none that fits (the caller boots a
/// machine as usual). Waits for one that is still booting only when the
/// provider says a machine of the job's own would wait for a slot
/// (`WarmMachines::job_must_wait`): then that one is the job's quickest.
pub async fn take(
    w: World<'_>,
    warm: &dyn WarmMachines,
    spec: &MachineSpec,
    env: &EnvPaths,
    ctx: &Ctx,
) -> Result<Option<Taken>> {
    take_for(w, warm, spec, env, For::New, ctx).await
}

/// What a machine is taken for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum For {
    /// A new environment's first machine. As for [`For::NewBeforeVolume`],
    /// a machine of the environment that a killed attempt of the same
    /// prepare already has is kept: none is taken, and the caller's
    /// `create_or_reclaim` adopts that one.
    New,
    /// A volume-mode resume's new machine (its volume exists).
    Resume,
    /// A new volume-mode environment's first machine, taken before its
    /// volume is made (`WarmMachines::takes_before_volume`: the volume
    /// follows the machine's zone). A machine of the environment that a
    /// killed attempt of the same prepare already has (handed over, its
    /// volume not yet recorded) is kept instead: none is taken, and the
    /// caller's launch path adopts that one (found by the provider).
    NewBeforeVolume,
}

/// [`take`], for a new environment or a volume-mode resume.
pub async fn take_for(
    w: World<'_>,
    warm: &dyn WarmMachines,
    spec: &MachineSpec,
    env: &EnvPaths,
    purpose: For,
    ctx: &Ctx,
) -> Result<Option<Taken>> {
    let pool = Pool::new(w.store);
    // A hand-over to this environment that a killed attempt began.
    let taken_for_env = WarmStatus::Taken { env: env.id };
    for (id, entry) in pool.entries()? {
        let Ok(Some(entry)) = entry else { continue };
        if entry.status != taken_for_env {
            continue;
        }
        let Some(lock) = pool.try_lock(id)? else {
            continue;
        };
        // Read again under the lock: a refill may have retired it since.
        let Some(entry) = pool.peek(id)?.filter(|e| e.status == taken_for_env) else {
            continue;
        };
        if let Some(t) = finish(w, warm, &pool, lock, entry, env, ctx).await? {
            return Ok(Some(t));
        }
    }
    let fits = match purpose {
        For::New | For::NewBeforeVolume => warm.fits(spec),
        For::Resume => warm.fits_resume(spec),
    };
    if warm.wanted() == 0 || !fits {
        return Ok(None);
    }
    let kind = match warm.kind() {
        Ok(k) => k,
        Err(e) => {
            ctx.log.warn(format!("warm machines: {e:#}"));
            return Ok(None);
        }
    };
    let max_age = warm.max_age().as_secs();
    let zone = warm.zone_for(spec);
    let mut waited = false;
    loop {
        let now = now_unix();
        let mut ready: Vec<WarmEntry> = pool
            .entries()?
            .into_iter()
            .filter_map(|(_, e)| e.ok().flatten())
            .filter(|e| {
                e.status == WarmStatus::Ready
                    && e.fingerprint == kind.fingerprint
                    && e.age_secs(now) < max_age
                    && e.machine.is_some()
                    && (zone.is_none() || e.zone == zone)
            })
            .collect();
        // The oldest first: it is the next to be retired otherwise.
        ready.sort_by_key(|e| e.launched_at);
        if purpose != For::Resume && !ready.is_empty() {
            // A new environment whose earlier attempt already has a machine (it
            // took a warm one, finished the hand-over and was killed before
            // recording it, and the runner's cleanup died too): that machine
            // is adopted by the caller's create, found by its tags or
            // directory. A second one would be left out of the record (EC2:
            // leaked; qemu: its move onto the first's directory fails on every
            // retry). Asked only when there is one to take (no call otherwise).
            if let Some(m) = w.provider.find(env.id, ctx).await.with_context(|| {
                format!(
                    "looking for a machine an earlier attempt made for environment {}",
                    env.id
                )
            })? {
                ctx.log.info(format!(
                "environment {} already has machine {} (an earlier attempt of this prepare took or made it): \
                 no warm machine taken",
                env.id, m.id
            ));
                return Ok(None);
            }
        }
        for candidate in ready {
            let Some(lock) = pool.try_lock(candidate.id)? else {
                continue; // a refill retiring it, or another prepare taking it
            };
            let Some(mut entry) = pool.peek(candidate.id)? else {
                continue;
            };
            if entry.status != WarmStatus::Ready {
                continue;
            }
            let wp = pool.paths(entry.id);
            let machine = entry
                .machine
                .clone()
                .context("a ready warm machine without its machine")?;
            match warm.alive(&wp, &machine, ctx).await {
                Ok(true) => {}
                Ok(false) => {
                    entry.status = WarmStatus::Retiring {
                        why: "it stopped running while it waited".into(),
                    };
                    pool.set(&lock, &entry)?;
                    continue; // the next refill deletes it
                }
                Err(e) => {
                    // Neither handed out on a guess nor retired: it stays ready
                    // for the next job, and the next refill asks again.
                    ctx.log.warn(format!(
                    "warm machine {} not taken: could not tell whether it still runs ({e:#}); it stays \
                     in the pool",
                    entry.id
                ));
                    continue;
                }
            }
            entry.status = WarmStatus::Taken { env: env.id };
            pool.set(&lock, &entry)?;
            crate::failpoint!("warm:taken");
            return finish(w, warm, &pool, lock, entry, env, ctx).await;
        }
        if waited || !warm.job_must_wait(ctx).await? {
            break;
        }
        // No slot for a machine of its own: rather than wait for one (and make
        // the warm machine booting now give its slot up once ready, qemu's
        // `yield_slot`), wait for that machine and take it.
        let Some(booting) = pool
            .entries()?
            .into_iter()
            .filter_map(|(_, e)| e.ok().flatten())
            .find(|e| {
                e.status == WarmStatus::Launching
                    && e.fingerprint == kind.fingerprint
                    && (zone.is_none() || e.zone == zone)
            })
        else {
            break;
        };
        waited = true;
        ctx.log.info(format!(
        "no free slot for a machine of its own: waiting for warm machine {}, which is booting, to take it",
        booting.id
    ));
        wait_while_booting(&pool, booting.id, ctx).await?;
    }
    if warm.wanted() > 0 {
        w.events
            .record(
                event(w, "missed", None).reason("no ready warm machine fit"),
                ctx,
            )
            .await;
    }
    Ok(None)
}

/// Waits until warm machine `id` is no longer booting: ready (the caller
/// takes it), or anything else — retired, taken by another job, or its
/// launcher gone (its entry lock free: the next refill finishes it).
async fn wait_while_booting(pool: &Pool, id: uuid::Uuid, ctx: &Ctx) -> Result<()> {
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

/// Gives a taken machine to the environment: its key pair and pinned host
/// key, then the provider's part; then the entry goes. `None`: a killed
/// attempt had moved it into this environment, which was released since.
async fn finish(
    w: World<'_>,
    warm: &dyn WarmMachines,
    pool: &Pool,
    lock: FileLock,
    entry: WarmEntry,
    env: &EnvPaths,
    ctx: &Ctx,
) -> Result<Option<Taken>> {
    let wp = pool.paths(entry.id);
    let machine = entry
        .machine
        .clone()
        .context("a taken warm machine without its machine")?;
    if !warm.handed_over(&wp, env, ctx).await? && warm.find_launched(&wp, ctx).await?.is_none() {
        // It was moved into this environment by a killed attempt, and the
        // runner's cleanup released the environment (and the machine with
        // it) before this retry: nothing is left to take.
        let why = format!(
            "it was handed to environment {} and deleted with it before the hand-over finished",
            env.id
        );
        w.events
            .record(event(w, "retired", Some(&entry)).reason(&why), ctx)
            .await;
        pool.remove(w.store, lock, entry.id)?;
        return Ok(None);
    }
    pool::give_identity(&wp.paths, env)?;
    crate::failpoint!("warm:identity-given");
    let machine = warm.hand_over(&wp, &machine, env, ctx).await?;
    crate::failpoint!("warm:handed-over");
    let age_secs = entry.age_secs(now_unix());
    w.events
        .record(
            event(w, "taken", Some(&entry))
                .reason(&format!("for environment {}", env.id))
                .duration(Duration::from_secs(age_secs)),
            ctx,
        )
        .await;
    pool.remove(w.store, lock, entry.id)?;
    Ok(Some(Taken {
        machine,
        warm_id: entry.id,
        age_secs,
    }))
}

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
