//! Capacity: `ec2.max_environments` (running plus suspended instances of this
//! runner, counted under a lock so two prepares cannot both take the last
//! slot) and EC2's own capacity errors (InsufficientInstanceCapacity,
//! InstanceLimitExceeded, ...) are waited out with backoff inside the prepare
//! timeout, one progress line per wait.

use std::future::Future;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use aws_sdk_ec2::Client;
use serde::{Deserialize, Serialize};

use super::errors::{api_error, ErrorKind};
use super::instance::{self, tag, tag_filter, LIVE_STATES};
use crate::context::{Backoff, Ctx};
use crate::state::store::{read_json, write_json, FORMAT_VERSION};
use crate::state::FileLock;
use crate::state::{now_unix, StateStore};

/// Capacity comes back in seconds (a slot freed by another job) to minutes
/// (EC2 capacity in a zone): check after 2 s, then back off to every 15 s
/// (a freed slot is noticed within ~18 s; one DescribeInstances per waiting prepare).
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
        Ok(live + not_visible_yet)
    }

    /// Calls `launch` once a slot is free and EC2 has capacity; returns its result.
    pub async fn launch_when_free<F, Fut>(&self, ctx: &Ctx, mut launch: F) -> Result<String>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<String>>,
    {
        let mut wait = CapacityWait::new();
        loop {
            let attempt = async {
                wait.pause(ctx).await?;
                self.try_launch(ctx, &mut launch).await
            }
            .await;
            match attempt {
                Ok(Ok(id)) => return Ok(id),
                Ok(Err(reason)) => wait.no_capacity(ctx, reason),
                Err(e) => return Err(wait.failed(e)),
            }
        }
    }

    /// One attempt: `Ok(Err(reason))` when there is no capacity now.
    async fn try_launch<F, Fut>(&self, ctx: &Ctx, launch: &mut F) -> Result<Result<String, String>>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<String>>,
    {
        if self.max == 0 {
            return match launch().await {
                Ok(id) => Ok(Ok(id)),
                Err(e) => capacity_reason(e).map(Err),
            };
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
            return Ok(Err(format!("{used} of {} environments in use", self.max)));
        }
        match launch().await {
            Ok(id) => {
                ledger.version = FORMAT_VERSION;
                ledger.launches.push((id.clone(), now_unix()));
                write_json(&ledger_path, &ledger)?;
                Ok(Ok(id))
            }
            Err(e) => capacity_reason(e).map(Err),
        }
    }
}

/// Retries `op` (a StartInstances) while EC2 reports no capacity.
pub async fn retry_capacity<F, Fut>(ctx: &Ctx, mut op: F) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<()>>,
{
    let mut wait = CapacityWait::new();
    loop {
        let attempt = async {
            wait.pause(ctx).await?;
            match op().await {
                Ok(()) => Ok(None),
                Err(e) => capacity_reason(e).map(Some),
            }
        }
        .await;
        match attempt {
            Ok(None) => return Ok(()),
            Ok(Some(reason)) => wait.no_capacity(ctx, reason),
            Err(e) => return Err(wait.failed(e)),
        }
    }
}

/// The bookkeeping of one capacity wait: backoff between attempts, a progress
/// line per refusal, and the last reason attached to the final error.
struct CapacityWait {
    started: Instant,
    backoff: Backoff,
    last_reason: Option<String>,
}

impl CapacityWait {
    fn new() -> Self {
        CapacityWait {
            started: Instant::now(),
            backoff: Backoff::new(CAPACITY_FIRST, CAPACITY_MAX),
            last_reason: None,
        }
    }

    /// Sleeps before every attempt but the first.
    async fn pause(&mut self, ctx: &Ctx) -> Result<()> {
        if self.last_reason.is_some() {
            ctx.sleep(self.backoff.next_delay(), "waiting for capacity")
                .await?;
        }
        Ok(())
    }

    fn no_capacity(&mut self, ctx: &Ctx, reason: String) {
        ctx.log.info(format!(
            "waiting for capacity: {reason}, {} s",
            self.started.elapsed().as_secs()
        ));
        self.last_reason = Some(reason);
    }

    /// An error after capacity waits (usually the deadline) says what was waited for.
    fn failed(&self, e: anyhow::Error) -> anyhow::Error {
        match &self.last_reason {
            Some(reason) => e.context(format!(
                "no capacity after {} s: {reason}; raise ec2.max_environments, release suspended environments \
                 (`dormant list`, `dormant release KEY`), pick another instance type or subnet, or raise \
                 prepare_timeout",
                self.started.elapsed().as_secs()
            )),
            None => e,
        }
    }
}

/// The capacity error as a line for the job log; any other error is passed on.
fn capacity_reason(e: anyhow::Error) -> Result<String> {
    match api_error(&e) {
        Some(a) if a.kind == ErrorKind::Capacity => Ok(format!(
            "EC2 {}: {}",
            a.code.as_deref().unwrap_or("capacity"),
            a.message
        )),
        _ => Err(e),
    }
}
