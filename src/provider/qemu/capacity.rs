//! `qemu.max_environments`: how many VMs of this state dir run at once (a
//! suspended environment holds disk only and does not count). The count is
//! the live QEMU processes, taken under a lock that is held until the new
//! QEMU runs, so two prepares cannot both take the last slot; a prepare that
//! finds no slot waits with a progress line per check, within its deadline.

use std::future::Future;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use super::process::{self, Pid};
use crate::context::{Backoff, Ctx};
use crate::state::store::{ensure_private_dir, FileLock};

const FIRST_CHECK: Duration = Duration::from_secs(2);
const MAX_CHECK: Duration = Duration::from_secs(15);

/// Runs `start` once fewer than `max` VMs run (0: no limit); returns its pid.
pub async fn start_when_free<F, Fut>(
    state_root: &Path,
    max: u32,
    ctx: &Ctx,
    mut start: F,
) -> Result<Pid>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Pid>>,
{
    if max == 0 {
        return start().await;
    }
    let dir = state_root.join("qemu");
    ensure_private_dir(&dir)?;
    let lock_path = dir.join("capacity.lock");
    let environments = state_root.join("environments");
    let started = Instant::now();
    let mut backoff = Backoff::new(FIRST_CHECK, MAX_CHECK);
    loop {
        {
            let _lock = lock(&lock_path, ctx).await?;
            let running = process::scan(&environments).len();
            if running < max as usize {
                return start().await;
            }
            ctx.log.info(format!(
                "waiting for a free VM slot: {running} of qemu.max_environments = {max} running, {} s",
                started.elapsed().as_secs()
            ));
        }
        ctx.sleep(backoff.next_delay(), "waiting for a free VM slot")
            .await
            .with_context(|| {
                format!(
                    "no free VM slot after {} s: qemu.max_environments = {max} VMs run; raise it, suspend or \
                     release environments (`dormant list`), or raise prepare_timeout",
                    started.elapsed().as_secs()
                )
            })?;
    }
}

/// The capacity lock, waited for within `ctx` (held only while counting and
/// starting one QEMU, never while sleeping between checks).
async fn lock(path: &Path, ctx: &Ctx) -> Result<FileLock> {
    loop {
        if let Some(l) = FileLock::try_acquire(path)? {
            return Ok(l);
        }
        ctx.sleep(
            Duration::from_millis(50),
            "waiting for the VM capacity lock",
        )
        .await
        .with_context(|| format!("lock file {}", path.display()))?;
    }
}
