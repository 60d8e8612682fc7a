//! Capacity: `ec2.max_environments` (running plus suspended instances of this
//! runner — in volume mode plus the data volumes without an instance —
//! counted under a lock so two prepares cannot both take the last slot) and EC2's own capacity errors (InsufficientInstanceCapacity,
//! InstanceLimitExceeded, ...) are waited out inside the prepare timeout
//! through `crate::wait`; a release on this runner manager wakes the waiters.
//! Warm instances count here like any other; whether a job makes one give
//! its slot up is the lifecycle's decision (`lifecycle/warm_give_way.rs`),
//! told by `job_must_wait` (`used`), never this wait's.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use aws_sdk_ec2::Client;
use serde::{Deserialize, Serialize};

use super::errors::capacity_reason;
use super::instance::{self, tag, tag_filter, LIVE_STATES};
use super::placement::Launched;
use super::volume;
use crate::context::Ctx;
use crate::state::store::{read_json, write_json, FORMAT_VERSION};
use crate::state::FileLock;
use crate::state::{now_unix, StateStore};
use crate::wait::{Poll, Schedule, Wait};

/// A slot freed by this runner manager (a release, a failed prepare's
/// clean-up) is noticed within this: the release marker is a local file.
pub const CAPACITY_TICK: Duration = Duration::from_millis(250);
/// Capacity freed elsewhere (EC2 capacity in a zone, an operator terminating
/// an instance) comes back in seconds to minutes: ask EC2 again after 2 s,
/// backing off to every 15 s (one DescribeInstances or RunInstances per
/// waiting prepare and attempt).
pub const CAPACITY_FIRST: Duration = Duration::from_secs(2);
pub const CAPACITY_MAX: Duration = Duration::from_secs(15);
/// DescribeInstances may not list an instance for a while after its launch
/// (eventual consistency): launches this recent are counted from our own ledger.
const LEDGER_WINDOW_SECS: u64 = 300;

#[derive(Debug, Default, Serialize, Deserialize)]
struct Ledger {
    version: u32,
    /// (instance id, unix seconds of its launch)
    launches: Vec<(String, u64)>,
}

pub struct Capacity<'a> {
    pub client: &'a Client,
    pub store: &'a StateStore,
    pub runner_id: &'a str,
    pub system_id: &'a str,
    /// 0: no limit.
    pub max: u32,
    /// Volume mode: a suspended environment is a data volume without an
    /// instance, and counts too.
    pub count_volumes: bool,
}

impl Capacity<'_> {
    fn paths(&self) -> (PathBuf, PathBuf) {
        let safe: String = self
            .runner_id
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        let dir = self.store.root().join("ec2");
        (
            dir.join(format!("capacity-{safe}.json")),
            dir.join(format!("capacity-{safe}.lock")),
        )
    }

    /// Live instances of this runner (pending, running, stopping, stopped),
    /// plus launches from the ledger that DescribeInstances does not show yet.
    async fn in_use(&self, ledger: &Ledger, ctx: &Ctx) -> Result<usize> {
        // No state filter: terminated instances stay listed for a while, which
        // tells a finished launch from one not visible yet.
        let found = instance::find(
            self.client,
            vec![
                tag_filter(tag::MANAGED_BY, tag::MANAGED_BY_VALUE),
                tag_filter(tag::RUNNER, self.runner_id),
                tag_filter(tag::SYSTEM, self.system_id),
            ],
            ctx,
        )
        .await?;
        let live = found
            .iter()
            .filter(|i| LIVE_STATES.contains(&i.state_name.as_str()))
            .count();
        let not_visible_yet = ledger
            .launches
            .iter()
            .filter(|(id, _)| !found.iter().any(|i| &i.id == id))
            .count();
        let mut volumes_alone = 0;
        if self.count_volumes {
            let with_instance: Vec<&str> = found
                .iter()
                .filter(|i| LIVE_STATES.contains(&i.state_name.as_str()))
                .filter_map(|i| i.tag(tag::ENV))
                .collect();
            volumes_alone = volume::find(
                self.client,
                vec![
                    tag_filter(tag::MANAGED_BY, tag::MANAGED_BY_VALUE),
                    tag_filter(tag::RUNNER, self.runner_id),
                    tag_filter(tag::SYSTEM, self.system_id),
                    tag_filter(tag::VOLUME, tag::VOLUME_DATA),
                ],
                ctx,
            )
            .await?
            .iter()
            .filter(|v| !v.is_gone())
            .filter(|v| v.tag(tag::ENV).is_none_or(|e| !with_instance.contains(&e)))
            .count();
        }
        Ok(live + not_visible_yet + volumes_alone)
    }

    /// Calls `launch` (one round over the placement choices: `Ok(Err(reason))`
    /// when none had capacity) once a slot is free, until it launches.
    pub async fn launch_when_free<F, Fut>(&self, ctx: &Ctx, launch: F) -> Result<Launched>
    where
        F: Fn() -> Fut,
        Fut: Future<Output = Result<Result<Launched, String>>>,
    {
        let marker = released_marker(self.store, self.runner_id);
        wait_for_capacity(ctx, Some(&marker), || self.try_launch(ctx, &launch)).await
    }

    /// How many slots are in use now (`max_environments` counts these).
    pub async fn used(&self, ctx: &Ctx) -> Result<usize> {
        let (ledger_path, _) = self.paths();
        let mut ledger = read_json::<Ledger>(&ledger_path)
            .ok()
            .flatten()
            .unwrap_or_default();
        let now = now_unix();
        ledger
            .launches
            .retain(|(_, at)| now.saturating_sub(*at) < LEDGER_WINDOW_SECS);
        self.in_use(&ledger, ctx).await
    }

    /// One attempt without waiting (a warm instance: nobody waits for it):
    /// `Ok(Err(reason))` when there is no slot or no capacity now.
    pub async fn launch_once<F, Fut>(
        &self,
        ctx: &Ctx,
        launch: F,
    ) -> Result<Result<Launched, String>>
    where
        F: Fn() -> Fut,
        Fut: Future<Output = Result<Result<Launched, String>>>,
    {
        self.try_launch(ctx, &launch).await
    }

    /// One attempt: `Ok(Err(reason))` when there is no slot or no capacity now.
    async fn try_launch<F, Fut>(&self, ctx: &Ctx, launch: &F) -> Result<Result<Launched, String>>
    where
        F: Fn() -> Fut,
        Fut: Future<Output = Result<Result<Launched, String>>>,
    {
        if self.max == 0 {
            return launch().await;
        }
        let (ledger_path, lock_path) = self.paths();
        crate::state::store::ensure_private_dir(ledger_path.parent().expect("ec2 dir"))?;
        // Held from the count through RunInstances only; never while sleeping.
        let _lock = FileLock::acquire(&lock_path, ctx, "waiting for the capacity lock")
            .await?
            .with_context(|| format!("{} vanished", lock_path.display()))?;
        let mut ledger = read_json::<Ledger>(&ledger_path)?.unwrap_or_default();
        let now = now_unix();
        ledger
            .launches
            .retain(|(_, at)| now.saturating_sub(*at) < LEDGER_WINDOW_SECS);
        let used = self.in_use(&ledger, ctx).await?;
        if used >= self.max as usize {
            let reason = format!("{used} of {} environments in use", self.max);
            return Ok(Err(reason));
        }
        let launched = launch().await?;
        if let Ok(l) = &launched {
            ledger.version = FORMAT_VERSION;
            ledger.launches.push((l.id.clone(), now_unix()));
            write_json(&ledger_path, &ledger)?;
        }
        Ok(launched)
    }
}

/// Retries `op` (a StartInstances) while EC2 reports no capacity.
pub async fn retry_capacity<F, Fut>(ctx: &Ctx, op: F) -> Result<()>
where
    F: Fn() -> Fut,
    Fut: Future<Output = Result<()>>,
{
    wait_out(ctx, || async {
        match op().await {
            Ok(()) => Ok(Ok(())),
            Err(e) => capacity_reason(e).map(Err),
        }
    })
    .await
}

/// Repeats `attempt` (`Ok(Err(reason))`: no capacity now) until it succeeds,
/// backing off as every capacity wait does (a resume trying several instance
/// types in one attempt).
pub async fn wait_out<T, F, Fut>(ctx: &Ctx, attempt: F) -> Result<T>
where
    F: Fn() -> Fut,
    Fut: Future<Output = Result<Result<T, String>>>,
{
    wait_for_capacity(ctx, None, attempt).await
}

/// When the next attempt of a capacity wait is due, and what the last one said.
struct Gate {
    attempts: u32,
    next_attempt: Instant,
    /// The release marker's content when the last attempt found no slot.
    marker_seen: Option<String>,
    last_reason: Option<String>,
}

/// Repeats `attempt` (`Ok(Err(reason))`: no capacity now) until it succeeds.
/// The local release marker is looked at every [`CAPACITY_TICK`] and an
/// attempt made as soon as it changes (a slot was freed on this runner);
/// without a release, attempts back off from [`CAPACITY_FIRST`] to
/// [`CAPACITY_MAX`] (capacity freed elsewhere: an operator, EC2 itself).
async fn wait_for_capacity<T, F, Fut>(ctx: &Ctx, marker: Option<&Path>, attempt: F) -> Result<T>
where
    F: Fn() -> Fut,
    Fut: Future<Output = Result<Result<T, String>>>,
{
    let schedule = Schedule::backoff(CAPACITY_FIRST, CAPACITY_MAX);
    let gate = Mutex::new(Gate {
        attempts: 0,
        next_attempt: Instant::now(),
        marker_seen: None,
        last_reason: None,
    });
    let mut wait = Wait::new(ctx, "capacity", Schedule::fixed(CAPACITY_TICK));
    let result = wait
        .until(|| async {
            {
                let g = gate.lock().unwrap();
                if let Some(reason) = &g.last_reason {
                    let released = marker.is_some_and(|m| read_marker(m) != g.marker_seen);
                    if !released && Instant::now() < g.next_attempt {
                        return Ok(Poll::Pending(reason.clone()));
                    }
                    if released {
                        ctx.log.info(
                            "an instance of this runner manager was terminated: looking again for capacity",
                        );
                    }
                }
            }
            // Read before the attempt: a release during it is not missed.
            let marker_now = marker.and_then(read_marker);
            match attempt().await? {
                Ok(v) => Ok(Poll::Ready(v)),
                Err(reason) => {
                    let mut g = gate.lock().unwrap();
                    g.next_attempt = Instant::now() + schedule.delay(g.attempts);
                    g.attempts += 1;
                    g.marker_seen = marker_now;
                    g.last_reason = Some(reason.clone());
                    Ok(Poll::Pending(reason))
                }
            }
        })
        .await;
    let last_reason = gate.into_inner().unwrap().last_reason;
    result.map_err(|e| match last_reason {
        // An error after capacity waits (usually the deadline) says what was waited for.
        Some(reason) => e.context(format!(
            "no capacity after {} s: {reason}; raise ec2.max_environments, release suspended environments \
             (`dormant list`, `dormant release KEY`), add instance types (ec2.fallback_instance_types) or \
             zones (ec2.subnet_ids), allow on-demand (ec2.on_demand_fallback) with spot, or raise \
             prepare_timeout",
            wait.elapsed().as_secs()
        )),
        None => e,
    })
}

/// `<state>/ec2/capacity-<runner>.released`: rewritten whenever this runner
/// manager terminates an instance, so a prepare waiting for a slot under
/// `max_environments` looks again at once instead of at its next backoff.
pub fn released_marker(store: &StateStore, runner_id: &str) -> PathBuf {
    let safe: String = runner_id
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    store
        .root()
        .join("ec2")
        .join(format!("capacity-{safe}.released"))
}

/// Says "a slot may be free now" to waiting prepares (best effort: without
/// it they notice at their next backoff).
pub fn note_release(store: &StateStore, runner_id: &str) {
    let path = released_marker(store, runner_id);
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    let written = crate::state::store::ensure_private_dir(path.parent().expect("ec2 dir"))
        .and_then(|()| {
            Ok(std::fs::write(
                &path,
                format!("{stamp} {}\n", std::process::id()),
            )?)
        });
    if let Err(e) = written {
        tracing::debug!("noting a release in {}: {e:#}", path.display());
    }
}

fn read_marker(path: &Path) -> Option<String> {
    std::fs::read_to_string(path).ok()
}
