//! `qemu.max_environments`: how many VMs of this state dir run at once (a
//! suspended environment holds disk only and does not count). The count is
//! the live QEMU processes, taken under a lock that is held until the new
//! QEMU runs, so two prepares cannot both take the last slot; a prepare that
//! finds no slot waits with progress lines (the one wait helper), within its deadline.

use std::future::Future;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};

use super::process::{self, Pid};
use crate::context::Ctx;
use crate::state::store::ensure_private_dir;
use crate::state::FileLock;
use crate::wait::{Poll, Schedule, Wait};

/// A look is a lock and a scan of this host's /proc, nothing remote: a VM
/// that exits frees its slot for a waiter within this much.
const SLOT_POLL: Duration = Duration::from_millis(250);

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
    // One look: a slot (then QEMU is started under the lock, so two prepares
    // cannot both take the last one), or how many run.
    let mut wait = Wait::new(ctx, "a free VM slot", Schedule::fixed(SLOT_POLL));
    let _lock = wait
        .until(|| async {
            let lock = FileLock::acquire(&lock_path, ctx, "waiting for the VM capacity lock")
                .await?
                .with_context(|| format!("{} vanished", lock_path.display()))?;
            let running = running(state_root);
            if running < max as usize {
                // Kept until the new QEMU runs.
                return Ok(Poll::Ready(lock));
            }
            Ok(Poll::Pending(format!(
                "{running} of qemu.max_environments = {max} running"
            )))
        })
        .await
        .with_context(|| {
            format!(
                "no free VM slot: qemu.max_environments = {max} VMs run; raise it, suspend or \
                 release environments (`dormant list`), or raise prepare_timeout"
            )
        })?;
    start().await
}

/// The VMs of this state dir that run now: environments' and warm ones
/// (a warm VM counts toward `max_environments`; one handed to an
/// environment still runs under the pool's name, and is counted once).
pub fn running(state_root: &Path) -> usize {
    process::scan(&state_root.join("environments")).len()
        + process::scan(&state_root.join("warm")).len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::context::JobLog;
    use crate::provider::qemu::process::fake::FakeQemu;
    use crate::provider::qemu::vm::VmDir;
    use crate::state::EnvPaths;

    #[tokio::test]
    async fn a_full_host_waits_with_progress_until_a_vm_exits() {
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir::new(&EnvPaths::new(dir.path(), uuid::Uuid::new_v4()));
        let running = FakeQemu::start(dir.path(), &vm);
        let (log, captured) = JobLog::capture();
        let ctx = Ctx::new(log, Default::default(), Duration::from_secs(30));
        let stopper = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(3));
            drop(running);
        });
        let started = std::sync::atomic::AtomicUsize::new(0);
        let pid = start_when_free(dir.path(), 1, &ctx, || async {
            started.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Ok(Pid(42))
        })
        .await
        .unwrap();
        stopper.join().unwrap();
        assert_eq!(pid, Pid(42));
        assert_eq!(started.load(std::sync::atomic::Ordering::SeqCst), 1);
        let text = String::from_utf8(captured.lock().unwrap().clone()).unwrap();
        assert!(
            text.contains("waiting for a free VM slot: 1 of qemu.max_environments = 1 running"),
            "{text}"
        );
    }

    #[tokio::test]
    async fn the_wait_ends_at_the_deadline_saying_what_to_do() {
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir::new(&EnvPaths::new(dir.path(), uuid::Uuid::new_v4()));
        let _running = FakeQemu::start(dir.path(), &vm);
        let ctx = Ctx::new(
            JobLog::capture().0,
            Default::default(),
            Duration::from_secs(1),
        );
        let err = start_when_free(dir.path(), 1, &ctx, || async { Ok(Pid(1)) })
            .await
            .unwrap_err();
        assert!(
            format!("{err:#}").contains("raise it, suspend or release"),
            "{err:#}"
        );
        // No limit: starts at once whatever runs.
        assert_eq!(
            start_when_free(dir.path(), 0, &ctx, || async { Ok(Pid(7)) })
                .await
                .unwrap(),
            Pid(7)
        );
    }
}
