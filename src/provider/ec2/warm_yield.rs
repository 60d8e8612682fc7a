//! A job that finds no slot under `ec2.max_environments` must not wait
//! behind an idle warm instance it cannot take (it asks for another image or
//! instance type): the oldest ready warm instance of this state dir's pool
//! gives its slot up, as a ready warm VM does for a qemu job
//! (`provider/qemu/capacity.rs`). Crash-safe through the pool's retire
//! path: the entry is marked `retiring` under its lock first (no prepare
//! takes it meanwhile, and a process killed after that leaves an entry the
//! next refill or sweep finishes), then its instance is terminated (which
//! notes a release, so the waiting job looks again at once); the next
//! refill records it retired and removes the entry.

use super::Ec2Provider;
use crate::context::Ctx;
use crate::provider::warm::WarmMachines;
use crate::provider::Provider;
use crate::state::pool::{Pool, WarmStatus};

/// Why a warm instance was retired for a job (its `retired` event's reason).
pub const YIELDED: &str = "a job needed its slot under ec2.max_environments";

impl Ec2Provider {
    /// Retires the oldest ready warm instance for a job waiting for a slot:
    /// one line saying which, or `None` when there is none to give.
    pub async fn yield_warm_slot(&self, ctx: &Ctx) -> Option<String> {
        let pool = Pool::new(&self.store);
        let mut ready: Vec<_> = pool
            .entries()
            .ok()?
            .into_iter()
            .filter_map(|(_, e)| e.ok().flatten())
            .filter(|e| e.status == WarmStatus::Ready && e.provider == self.name())
            .collect();
        ready.sort_by_key(|e| e.launched_at);
        for candidate in ready {
            let Ok(Some(lock)) = pool.try_lock(candidate.id) else {
                continue; // a prepare taking it, or a refill retiring it
            };
            // Read again under the lock: it may have been taken meanwhile.
            let Some(mut entry) = pool
                .peek(candidate.id)
                .ok()
                .flatten()
                .filter(|e| e.status == WarmStatus::Ready)
            else {
                continue;
            };
            entry.status = WarmStatus::Retiring {
                why: YIELDED.into(),
            };
            if let Err(e) = pool.set(&lock, &entry) {
                ctx.log.warn(format!(
                    "warm instance {} could not be marked retiring ({e:#}): it keeps its slot",
                    entry.id
                ));
                continue;
            }
            let wp = pool.paths(entry.id);
            let what = entry
                .machine
                .as_ref()
                .map(|m| format!("warm instance {}", m.id))
                .unwrap_or_else(|| format!("warm machine {}", entry.id));
            return Some(
                match WarmMachines::retire(self, &wp, entry.machine.as_ref(), ctx).await {
                    Ok(()) => format!("{what} gives its slot up for this job (terminated)"),
                    Err(e) => {
                        // Marked retiring: the next refill or sweep terminates it.
                        format!(
                        "{what} gives its slot up for this job, but terminating it failed ({e:#}); the next \
                         refill or `dormant sweep` terminates it"
                    )
                    }
                },
            );
        }
        None
    }
}
