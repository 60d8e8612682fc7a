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

use super::warm_steps::{event, listed, wait_while_booting};
use super::World;
use crate::context::Ctx;
use crate::model::{EnvPaths, Machine};
use crate::provider::warm::WarmMachines;
use crate::provider::MachineSpec;
use crate::state::pool::{self, Pool, WarmEntry, WarmStatus};
use crate::state::{now_unix, FileLock};

/// A taken warm machine, as the new environment's.
pub struct Taken {
    pub machine: Machine,
    pub warm_id: uuid::Uuid,
    pub age_secs: u64,
}

/// Takes a ready warm machine for environment `env` (whose record exists,
/// held by the caller), or finishes the hand-over a killed attempt of the
/// same prepare began. `None`: there is none that fits (the caller boots a
/// machine as usual). When the provider says a machine of the job's own
/// would wait for a slot (`WarmMachines::job_must_wait`), a job that fits
/// waits for a warm machine still booting and takes it (its quickest
/// machine), and a job that cannot take one makes the oldest ready warm
/// machine give its slot up ([`give_way`]).
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

/// [`take`], for a new environment or a volume-mode resume: a hand-over a
/// killed attempt began is finished; a job that cannot take a warm machine
/// gives way; else the ready machines that fit are tried, oldest first, and
/// when the job would wait for a slot, once more after waiting for the one
/// booting (if any).
pub async fn take_for(
    w: World<'_>,
    warm: &dyn WarmMachines,
    spec: &MachineSpec,
    env: &EnvPaths,
    purpose: For,
    ctx: &Ctx,
) -> Result<Option<Taken>> {
    let pool = Pool::new(w.store);
    if let Some(t) = finish_killed_take(w, warm, &pool, env, ctx).await? {
        return Ok(Some(t));
    }
    if warm.wanted() == 0 {
        return Ok(None);
    }
    let fits = match purpose {
        For::New | For::NewBeforeVolume => warm.fits(spec),
        For::Resume => warm.fits_resume(spec),
    };
    if !fits {
        super::warm_give_way::give_way(w, warm, &pool, ctx).await;
        return Ok(None);
    }
    let wanted = match warm.kind() {
        Ok(kind) => Wanted {
            fingerprint: kind.fingerprint,
            max_age: warm.max_age().as_secs(),
            zone: warm.zone_for(spec),
        },
        Err(e) => {
            ctx.log.warn(format!("warm machines: {e:#}"));
            return Ok(None);
        }
    };
    let mut waited = false;
    loop {
        let ready = wanted.ready(&pool)?;
        if purpose != For::Resume
            && !ready.is_empty()
            && earlier_attempt_has_machine(w, env, ctx).await?
        {
            return Ok(None);
        }
        if let Some(t) = take_first_alive(w, warm, &pool, ready, env, ctx).await? {
            return Ok(Some(t));
        }
        if waited || !warm.job_must_wait(ctx).await? {
            break;
        }
        waited = true;
        // No slot for a machine of its own: rather than wait for one (and make
        // the warm machine booting now give its slot up once ready), wait for
        // that machine and take it. The pool is looked at once more either
        // way: one may have become ready since the look above.
        if let Some(booting) = wanted.booting(&pool)? {
            ctx.log.info(format!(
                "no free slot for a machine of its own: waiting for warm machine {booting}, which is \
                 booting, to take it"
            ));
            wait_while_booting(&pool, booting, ctx).await?;
        }
    }
    w.events
        .record(
            event(w, "missed", None).reason("no ready warm machine fit"),
            ctx,
        )
        .await;
    Ok(None)
}

/// Finishes a hand-over to this environment that a killed attempt of the
/// same prepare began (an entry `taken` for it whose lock is free).
async fn finish_killed_take(
    w: World<'_>,
    warm: &dyn WarmMachines,
    pool: &Pool,
    env: &EnvPaths,
    ctx: &Ctx,
) -> Result<Option<Taken>> {
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
        if let Some(t) = finish(w, warm, pool, lock, entry, env, ctx).await? {
            return Ok(Some(t));
        }
    }
    Ok(None)
}

/// Which warm machines a job may take: made from today's settings, young
/// enough, in the zone its volume needs (if any).
struct Wanted {
    fingerprint: String,
    max_age: u64,
    zone: Option<String>,
}

impl Wanted {
    fn of_kind(&self, e: &WarmEntry) -> bool {
        e.fingerprint == self.fingerprint && (self.zone.is_none() || e.zone == self.zone)
    }

    /// The ready ones, the oldest first: it is the next to be retired otherwise.
    fn ready(&self, pool: &Pool) -> Result<Vec<WarmEntry>> {
        let now = now_unix();
        let mut ready: Vec<WarmEntry> = listed(pool)?
            .filter(|e| {
                e.status == WarmStatus::Ready
                    && self.of_kind(e)
                    && e.age_secs(now) < self.max_age
                    && e.machine.is_some()
            })
            .collect();
        ready.sort_by_key(|e| e.launched_at);
        Ok(ready)
    }

    /// One that is booting now.
    fn booting(&self, pool: &Pool) -> Result<Option<uuid::Uuid>> {
        Ok(listed(pool)?
            .find(|e| e.status == WarmStatus::Launching && self.of_kind(e))
            .map(|e| e.id))
    }
}

/// A new environment whose earlier attempt already has a machine (it took a
/// warm one, finished the hand-over and was killed before recording it, and
/// the runner's cleanup died too): that machine is adopted by the caller's
/// create, found by its tags or directory. A second one would be left out of
/// the record (EC2: leaked; qemu: its move onto the first's directory fails
/// on every retry). Asked only when there is one to take (no call otherwise).
async fn earlier_attempt_has_machine(w: World<'_>, env: &EnvPaths, ctx: &Ctx) -> Result<bool> {
    let found = w.provider.find(env.id, ctx).await.with_context(|| {
        format!(
            "looking for a machine an earlier attempt made for environment {}",
            env.id
        )
    })?;
    if let Some(m) = &found {
        ctx.log.info(format!(
            "environment {} already has machine {} (an earlier attempt of this prepare took or made it): \
             no warm machine taken",
            env.id, m.id
        ));
    }
    Ok(found.is_some())
}

/// Takes the first of `ready` that is still ready under its lock and still
/// runs, and hands it over. One that stopped running is marked retiring
/// (the next refill deletes it); one whose state cannot be told stays.
async fn take_first_alive(
    w: World<'_>,
    warm: &dyn WarmMachines,
    pool: &Pool,
    ready: Vec<WarmEntry>,
    env: &EnvPaths,
    ctx: &Ctx,
) -> Result<Option<Taken>> {
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
                continue;
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
        return finish(w, warm, pool, lock, entry, env, ctx).await;
    }
    Ok(None)
}

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
