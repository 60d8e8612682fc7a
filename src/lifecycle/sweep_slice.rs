//! Which environments a cleanup's sweep looks at: the next [`SLICE`]
//! entries of `environments/` in directory order, after where the previous
//! cleanup's slice stopped, remembered in `<state dir>/sweep-cursor.json` as
//! the directory position (`telldir`) to go on from.
//!
//! Why: the sweep at the end of every cleanup used to read every record, so
//! with 10,000 suspended environments each cleanup paid for 10,000 records.
//! A slice reads [`SLICE`] directory entries from the saved position
//! (`seekdir`) and their records, and nothing else: its cost is the same
//! whatever the registry holds — not even the list of ids is read whole.
//! Successive cleanups still visit every environment in turn (a round ends at
//! the end of the directory and the next starts at its beginning), every one
//! within about `environments / SLICE` cleanups; environments created during
//! a round may wait for the next. `dormant sweep` (the package's hourly timer)
//! still visits all of them at once. Entries of the slice that are not an
//! environment (a staging directory a killed create left) are its strays.
//!
//! The cursor is read and advanced under its lock, so cleanups running at
//! the same time take successive slices instead of the same one. A lost,
//! damaged or stale cursor (the directory was replaced) only restarts the
//! round; a damaged one is moved aside with a warning.

use std::ffi::{CStr, CString, OsStr};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
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
    /// The directory position after the previous slice (0: the beginning).
    position: i64,
    /// The inode of `environments/` it is a position in.
    dir_inode: u64,
}

/// One slice of `environments/`.
#[derive(Debug, Default)]
pub struct Slice {
    pub ids: Vec<Uuid>,
    /// Entries of the slice that are not an environment directory.
    pub strays: Vec<PathBuf>,
}

/// The next slice, and the cursor moved past it.
pub async fn next(store: &StateStore, ctx: &Ctx) -> Result<Slice> {
    let dir = store.environments_dir();
    let inode = std::fs::metadata(&dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .ino();
    let lock_ctx = Ctx::new(ctx.log.clone(), Default::default(), CURSOR_WAIT);
    let lock = FileLock::acquire(
        &store.root().join(CURSOR_LOCK),
        &lock_ctx,
        "waiting for the sweep cursor's lock",
    )
    .await;
    let _lock = match lock {
        Ok(lock) => lock,
        // Held by a stopped process: this cleanup still sweeps a slice, from
        // the beginning, and leaves the cursor to the next one.
        Err(e) => {
            ctx.log
                .warn(format!("{e:#}; sweeping a slice from the beginning"));
            return Ok(read_slice(&dir, 0, SLICE)?.0);
        }
    };
    let path = store.root().join(CURSOR);
    let position = match store::read_json::<Cursor>(&path) {
        Ok(c) => c.filter(|c| c.dir_inode == inode).map_or(0, |c| c.position),
        Err(e) => {
            let aside = store.root().join(format!("{CURSOR}.damaged"));
            let _ = std::fs::rename(&path, &aside);
            ctx.log.warn(format!(
                "{e:#}; moved to {}: the sweep's round starts again",
                aside.display()
            ));
            0
        }
    };
    let (slice, after) = read_slice(&dir, position, SLICE)?;
    let cursor = Cursor {
        version: FORMAT_VERSION,
        position: after,
        dir_inode: inode,
    };
    // Unsynced: after a power loss a slice is merely looked at twice.
    store::write_json_unsynced(&path, &cursor)?;
    Ok(slice)
}

/// Reads up to `n` environment entries of `dir` from `position` (0: the
/// beginning); returns them and the position after them (0 when the end of
/// the directory was reached: the next round starts at the beginning).
fn read_slice(dir: &Path, position: i64, n: usize) -> Result<(Slice, i64)> {
    let listing = || format!("listing {}", dir.display());
    let mut d = Dir::open(dir).with_context(listing)?;
    if position != 0 {
        d.seek(position);
    }
    let mut slice = Slice::default();
    while slice.ids.len() < n {
        let Some(name) = d.next().with_context(listing)? else {
            return Ok((slice, 0));
        };
        if name == b"." || name == b".." {
            continue;
        }
        match std::str::from_utf8(&name)
            .ok()
            .and_then(|s| Uuid::parse_str(s).ok())
        {
            Some(id) => slice.ids.push(id),
            None => slice.strays.push(dir.join(OsStr::from_bytes(&name))),
        }
    }
    Ok((slice, d.tell()))
}

/// A directory stream (`opendir`), for the positions `telldir` gives and
/// `seekdir` takes: the standard library's `ReadDir` has neither.
struct Dir(*mut libc::DIR);

impl Dir {
    fn open(path: &Path) -> std::io::Result<Dir> {
        let c = CString::new(path.as_os_str().as_bytes())?;
        // SAFETY: `c` is a valid NUL-terminated path; a null result is checked.
        let d = unsafe { libc::opendir(c.as_ptr()) };
        if d.is_null() {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Dir(d))
    }

    fn seek(&mut self, position: i64) {
        // SAFETY: `self.0` is an open stream; a position from an earlier
        // telldir of this directory (a stale one only moves where we read).
        unsafe { libc::seekdir(self.0, position as libc::c_long) }
    }

    fn tell(&mut self) -> i64 {
        // SAFETY: `self.0` is an open stream.
        unsafe { libc::telldir(self.0) as i64 }
    }

    /// The next entry's name; `None` at the end.
    fn next(&mut self) -> std::io::Result<Option<Vec<u8>>> {
        // SAFETY: errno is thread-local; readdir's result is valid until the
        // next call on this stream, and the name is copied out before that.
        unsafe {
            *libc::__errno_location() = 0;
            let entry = libc::readdir(self.0);
            if entry.is_null() {
                let errno = *libc::__errno_location();
                return if errno == 0 {
                    Ok(None)
                } else {
                    Err(std::io::Error::from_raw_os_error(errno))
                };
            }
            Ok(Some(
                CStr::from_ptr((*entry).d_name.as_ptr()).to_bytes().to_vec(),
            ))
        }
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        // SAFETY: opened by `open`, closed once.
        unsafe {
            libc::closedir(self.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::context::JobLog;
    use std::collections::BTreeMap;

    fn ctx() -> Ctx {
        Ctx::new(JobLog::capture().0, Default::default(), CURSOR_WAIT)
    }

    /// `n` environment directories (names only: the slice reads no record).
    fn environments(store: &StateStore, n: usize) -> Vec<Uuid> {
        let ids: Vec<Uuid> = (0..n).map(|_| Uuid::new_v4()).collect();
        for id in &ids {
            std::fs::create_dir(store.env_paths(*id).dir).unwrap();
        }
        ids
    }

    #[tokio::test]
    async fn successive_cleanups_visit_every_environment_once_per_round() {
        let dir = tempfile::tempdir().unwrap();
        let store = StateStore::open(dir.path()).unwrap();
        let all = environments(&store, SLICE * 3 + 5);
        let stray = store
            .environments_dir()
            .join(".new-left-by-a-killed-create");
        std::fs::create_dir(&stray).unwrap();
        let mut seen = BTreeMap::<Uuid, u32>::new();
        let mut strays = Vec::new();
        // A round is 4 slices; the next starts at the beginning again.
        for round in 0..2 {
            for i in 0..4 {
                let slice = next(&store, &ctx()).await.unwrap();
                let want = if i < 3 { SLICE } else { 5 };
                assert_eq!(slice.ids.len(), want, "round {round}, slice {i}");
                for id in slice.ids {
                    *seen.entry(id).or_default() += 1;
                }
                strays.extend(slice.strays);
            }
        }
        assert_eq!(seen.len(), all.len(), "every environment visited");
        assert!(seen.values().all(|n| *n == 2), "once per round: {seen:?}");
        assert_eq!(strays, [stray.clone(), stray]);
    }

    #[tokio::test]
    async fn a_small_registry_is_visited_whole_by_every_cleanup() {
        let dir = tempfile::tempdir().unwrap();
        let store = StateStore::open(dir.path()).unwrap();
        let mut all = environments(&store, 10);
        all.sort();
        for _ in 0..3 {
            let mut ids = next(&store, &ctx()).await.unwrap().ids;
            ids.sort();
            assert_eq!(ids, all);
        }
    }

    #[tokio::test]
    async fn a_damaged_cursor_or_a_held_lock_still_gives_a_slice() {
        let dir = tempfile::tempdir().unwrap();
        let store = StateStore::open(dir.path()).unwrap();
        environments(&store, SLICE * 2);
        let first = next(&store, &ctx()).await.unwrap().ids;
        // Damaged: set aside, not overwritten, and the round starts again.
        std::fs::write(dir.path().join(CURSOR), "{").unwrap();
        assert_eq!(next(&store, &ctx()).await.unwrap().ids, first);
        let aside = dir.path().join(format!("{CURSOR}.damaged"));
        assert_eq!(std::fs::read_to_string(aside).unwrap(), "{");
        // A cursor lock held by a stopped process: a slice all the same,
        // and the cursor is left to whoever holds the lock.
        let held = FileLock::try_acquire(&dir.path().join(CURSOR_LOCK))
            .unwrap()
            .unwrap();
        let before = std::fs::read_to_string(dir.path().join(CURSOR)).unwrap();
        assert_eq!(next(&store, &ctx()).await.unwrap().ids.len(), SLICE);
        let after = std::fs::read_to_string(dir.path().join(CURSOR)).unwrap();
        assert_eq!(before, after);
        drop(held);
    }
}
