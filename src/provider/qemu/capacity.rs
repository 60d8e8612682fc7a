//! `qemu.max_environments`: how many VMs of this state dir run at once (a
//! suspended environment holds disk only and does not count). The count is
//! the live QEMU processes, taken under a lock that is held until the new
//! QEMU runs, so two prepares cannot both take the last slot; a prepare that
//! finds no slot waits with progress lines (the one wait helper), within its deadline;
//! a ready warm VM gives its slot up to a waiting job (`yield_slot`).

use std::future::Future;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};

use super::process::{self, Pid};
use crate::context::Ctx;
use crate::state::pool::{Pool, WarmStatus};
use crate::state::store::ensure_private_dir;
use crate::state::FileLock;
use crate::wait::{Poll, Schedule, Wait};

/// A look is a lock and a scan of this host's /proc, nothing remote: a VM
/// that exits frees its slot for a waiter within this much.
const SLOT_POLL: Duration = Duration::from_millis(250);

/// Who waits for a slot: a job's VM, which a ready warm VM makes room for
/// (warm VMs must never starve a job), or a warm VM, which does not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Waiter {
    Job,
    Warm,
}

/// Runs `start` once fewer than `max` VMs run (0: no limit); returns its pid.
pub async fn start_when_free<F, Fut>(
    state_root: &Path,
    max: u32,
    waiter: Waiter,
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
            if waiter == Waiter::Job {
                if let Some(id) = yield_slot(state_root) {
                    ctx.log.info(format!(
                        "warm VM {id} gives up its slot for this job (it is retired)"
                    ));
                }
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

/// A job waits for a VM slot: the oldest ready warm VM gives its slot up.
/// Its entry is marked `retiring` (under its lock, so no prepare takes it
/// meanwhile) and its QEMU killed (a warm VM holds nothing to keep); the
/// next refill or sweep deletes its files and records it retired.
pub fn yield_slot(state_root: &std::path::Path) -> Option<uuid::Uuid> {
    let pool = Pool::at(state_root);
    let mut ready: Vec<_> = pool
        .entries()
        .ok()?
        .into_iter()
        .filter_map(|(_, e)| e.ok().flatten())
        .filter(|e| e.status == WarmStatus::Ready && e.provider == "qemu")
        .collect();
    ready.sort_by_key(|e| e.launched_at);
    for mut entry in ready {
        let Ok(Some(lock)) = pool.try_lock(entry.id) else {
            continue;
        };
        if pool.peek(entry.id).ok().flatten().map(|e| e.status) != Some(WarmStatus::Ready) {
            continue;
        }
        entry.status = WarmStatus::Retiring {
            why: "a job needed its VM slot".into(),
        };
        if pool.set(&lock, &entry).is_err() {
            continue;
        }
        let vm = super::vm::VmDir::new(&pool.paths(entry.id).paths);
        if let Some(pid) = process::find(&vm) {
            let _ = process::kill(&vm, pid);
        }
        return Some(entry.id);
    }
    None
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
        let pid = start_when_free(dir.path(), 1, Waiter::Job, &ctx, || async {
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
        let err = start_when_free(dir.path(), 1, Waiter::Job, &ctx, || async { Ok(Pid(1)) })
            .await
            .unwrap_err();
        assert!(
            format!("{err:#}").contains("raise it, suspend or release"),
            "{err:#}"
        );
        // No limit: starts at once whatever runs.
        assert_eq!(
            start_when_free(dir.path(), 0, Waiter::Job, &ctx, || async { Ok(Pid(7)) })
                .await
                .unwrap(),
            Pid(7)
        );
    }

    #[tokio::test]
    async fn a_ready_warm_vm_gives_its_slot_to_a_waiting_job_and_not_to_a_warm_one() {
        use crate::state::pool::{Pool, WarmStatus};
        let dir = tempfile::tempdir().unwrap();
        let pool = Pool::at(dir.path());
        let (wp, mut entry, lock) = pool.begin_launch("qemu", "fp", "default", None).unwrap();
        entry.status = WarmStatus::Ready;
        pool.set(&lock, &entry).unwrap();
        drop(lock);
        let warm = FakeQemu::start(dir.path(), &VmDir::new(&wp.paths));
        assert_eq!(running(dir.path()), 1, "a warm VM counts");
        let (log, captured) = JobLog::capture();
        let ctx = Ctx::new(log, Default::default(), Duration::from_secs(2));
        // A warm VM waiting for a slot does not take another warm VM's.
        let err = start_when_free(dir.path(), 1, Waiter::Warm, &ctx, || async { Ok(Pid(1)) })
            .await
            .unwrap_err();
        assert!(format!("{err:#}").contains("no free VM slot"), "{err:#}");
        assert_eq!(pool.peek(wp.id).unwrap().unwrap().status, WarmStatus::Ready);
        // A job's does.
        let ctx = Ctx::new(ctx.log.clone(), Default::default(), Duration::from_secs(30));
        let pid = start_when_free(dir.path(), 1, Waiter::Job, &ctx, || async { Ok(Pid(9)) })
            .await
            .unwrap();
        assert_eq!(pid, Pid(9));
        assert!(matches!(
            pool.peek(wp.id).unwrap().unwrap().status,
            WarmStatus::Retiring { .. }
        ));
        let text = String::from_utf8(captured.lock().unwrap().clone()).unwrap();
        assert!(
            text.contains(&format!("warm VM {} gives up its slot", wp.id)),
            "{text}"
        );
        drop(warm);
    }
}
