//! Which environments a cleanup's sweep looks at: the next [`SLICE`] after
//! where the previous cleanup's slice stopped, round robin over the sorted
//! ids, remembered in `<state dir>/sweep-cursor.json`.
//!
//! Why: the sweep at the end of every cleanup used to read every record, so
//! with 10,000 suspended environments each cleanup paid for 10,000 records.
//! A slice costs the same at any size (the directory listing of ids is all
//! that grows: names only, no record is opened), and successive cleanups
//! still visit every environment in turn — every one within
//! `environments / SLICE` cleanups. `dormant sweep` (the package's hourly
//! timer) still visits all of them at once.
//!
//! The cursor is read and advanced under its lock, so cleanups running at
//! the same time take successive slices instead of the same one. A lost or
//! damaged cursor only restarts the round at the first id (a damaged one is
//! moved aside, with a warning in the runner's log).

use std::time::Duration;

use anyhow::Result;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::context::Ctx;
use crate::state::store::{self, FORMAT_VERSION};
use crate::state::{FileLock, StateStore};

/// Environments one cleanup's sweep looks at. Each costs a record read and a
/// lock (well under a millisecond), so a slice stays within a few
/// milliseconds; at 64 a fleet of 10,000 environments is visited every ~160
/// cleanups, besides the hourly `dormant sweep`.
pub const SLICE: usize = 64;
const CURSOR: &str = "sweep-cursor.json";
const CURSOR_LOCK: &str = "sweep-cursor.lock";
/// The cursor lock is held for a read and a write (milliseconds).
const CURSOR_WAIT: Duration = Duration::from_secs(2);

#[derive(Debug, Serialize, Deserialize)]
struct Cursor {
    version: u32,
    /// The last environment the previous slice took.
    after: Uuid,
}

/// The next slice of `ids` (sorted) and the cursor moved past it.
pub async fn next(store: &StateStore, ids: &[Uuid], ctx: &Ctx) -> Result<Vec<Uuid>> {
    if ids.len() <= SLICE {
        return Ok(ids.to_vec());
    }
    let lock_ctx = Ctx::new(ctx.log.clone(), Default::default(), CURSOR_WAIT);
    let path = store.root().join(CURSOR);
    let lock = FileLock::acquire(
        &store.root().join(CURSOR_LOCK),
        &lock_ctx,
        "waiting for the sweep cursor's lock",
    )
    .await;
    let _lock = match lock {
        Ok(lock) => lock,
        // Held by a stopped process: this cleanup still sweeps a slice, from
        // a random place, and leaves the cursor to the next one.
        Err(e) => {
            ctx.log
                .warn(format!("{e:#}; sweeping a slice from a random place"));
            let start = ids[fastrand::usize(..ids.len())];
            return Ok(pick(ids, Some(start), SLICE));
        }
    };
    // Damaged or from a newer dormant: set aside (never overwritten) and the
    // round started again; it only decides where the next slice starts.
    let after = match store::read_json::<Cursor>(&path) {
        Ok(c) => c.map(|c| c.after),
        Err(e) => {
            let aside = store.root().join(format!("{CURSOR}.damaged"));
            let _ = std::fs::rename(&path, &aside);
            ctx.log.warn(format!(
                "{e:#}; moved to {}: the sweep's round starts again",
                aside.display()
            ));
            None
        }
    };
    let slice = pick(ids, after, SLICE);
    if let Some(last) = slice.last() {
        let cursor = Cursor {
            version: FORMAT_VERSION,
            after: *last,
        };
        // Unsynced: after a power loss a slice is merely looked at twice.
        store::write_json_unsynced(&path, &cursor)?;
    }
    Ok(slice)
}

/// `n` ids of `ids` (sorted) starting after `after`, wrapping around.
fn pick(ids: &[Uuid], after: Option<Uuid>, n: usize) -> Vec<Uuid> {
    if ids.len() <= n {
        return ids.to_vec();
    }
    let start = after.map_or(0, |a| ids.partition_point(|id| *id <= a));
    (0..n).map(|i| ids[(start + i) % ids.len()]).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::context::JobLog;

    fn ids(n: u128) -> Vec<Uuid> {
        (1..=n).map(Uuid::from_u128).collect()
    }

    #[test]
    fn slices_go_round_and_cover_everything() {
        let all = ids(10);
        assert_eq!(pick(&all, None, 4), ids(4));
        assert_eq!(pick(&all, Some(Uuid::from_u128(4)), 4), all[4..8]);
        let wrapped = pick(&all, Some(Uuid::from_u128(8)), 4);
        assert_eq!(wrapped, [all[8], all[9], all[0], all[1]]);
        // A cursor whose environment was released meanwhile: the next one after it.
        assert_eq!(pick(&all, Some(Uuid::from_u128(0)), 2), ids(2));
        assert_eq!(pick(&ids(3), Some(Uuid::from_u128(2)), 4), ids(3));
    }

    #[tokio::test]
    async fn successive_cleanups_visit_every_environment_once_per_round() {
        let dir = tempfile::tempdir().unwrap();
        let store = StateStore::open(dir.path()).unwrap();
        let all = ids(SLICE as u128 * 3 + 5);
        let ctx = Ctx::new(JobLog::capture().0, Default::default(), CURSOR_WAIT);
        let mut seen = std::collections::BTreeMap::<Uuid, u32>::new();
        let rounds = all.len().div_ceil(SLICE);
        for _ in 0..rounds {
            let slice = next(&store, &all, &ctx).await.unwrap();
            assert_eq!(slice.len(), SLICE, "a slice is never the whole registry");
            for id in slice {
                *seen.entry(id).or_default() += 1;
            }
        }
        assert_eq!(seen.len(), all.len(), "every environment visited");
        assert!(seen.values().all(|n| *n <= 2), "{seen:?}");
        // A damaged cursor restarts the round instead of failing the cleanup,
        // and is set aside, not overwritten.
        std::fs::write(dir.path().join(CURSOR), "{").unwrap();
        let slice = next(&store, &all, &ctx).await.unwrap();
        assert_eq!(slice, all[..SLICE]);
        let aside = dir.path().join(format!("{CURSOR}.damaged"));
        assert_eq!(std::fs::read_to_string(aside).unwrap(), "{");
        // A cursor lock held by a stopped process: a slice all the same.
        let held = FileLock::try_acquire(&dir.path().join(CURSOR_LOCK))
            .unwrap()
            .unwrap();
        let before = std::fs::read_to_string(dir.path().join(CURSOR)).unwrap();
        let slice = next(&store, &all, &ctx).await.unwrap();
        assert_eq!(slice.len(), SLICE);
        let after = std::fs::read_to_string(dir.path().join(CURSOR)).unwrap();
        assert_eq!(
            before, after,
            "the cursor is left to whoever holds its lock"
        );
        drop(held);
    }
}
