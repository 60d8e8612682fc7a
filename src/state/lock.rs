//! The one lock API: exclusive file locks that wait without blocking the async
//! runtime (bounded by the caller's deadline, ended by SIGTERM), liveness locks
//! that prove a holder process is alive, and the one rule for deleting a lock
//! file.
//!
//! Why lock files may be deleted at all: a job's lock and liveness files would
//! otherwise pile up forever (one per job). Deleting a lock file is safe only
//! because every acquire checks, after it got the lock, that the file it
//! locked is still the one at the path (same inode); a waiter that locked a
//! file someone unlinked meanwhile lets go and tries again on the new file.
//! So: delete a lock file only while holding it ([`FileLock::remove`]).

use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};

use crate::context::Ctx;
use crate::wait::{Poll, Schedule, Wait};

/// How often a waiter tries a held lock again. Record locks are held for
/// milliseconds; a job's lock for one stage's bookkeeping.
const LOCK_POLL: Duration = Duration::from_millis(20);
/// A lock wait says nothing in the job log unless it lasts this long.
const LOCK_QUIET: Duration = Duration::from_secs(5);

/// An exclusive lock on a lock file kept beside the data it guards. Dropping
/// the guard unlocks; the kernel also unlocks when the process dies.
#[derive(Debug)]
pub struct FileLock {
    file: File,
    path: PathBuf,
}

/// Why a lock could not be taken now.
enum Attempt {
    Locked(FileLock),
    Busy,
    /// The directory the lock file lives in does not exist (anymore).
    NoDir,
}

impl FileLock {
    /// Takes the lock, waiting without blocking the runtime; bounded by `ctx`
    /// (its deadline and SIGTERM). The error names the lock file and `what`.
    /// `Ok(None)`: the lock file's directory does not exist (e.g. an
    /// environment that was released while we waited).
    pub async fn acquire(path: &Path, ctx: &Ctx, what: &str) -> Result<Option<FileLock>> {
        // `what` reads "waiting for X"; the wait helper says "waiting for" itself.
        let waited_for = what.strip_prefix("waiting for ").unwrap_or(what);
        let mut wait = Wait::new(ctx, waited_for, Schedule::fixed(LOCK_POLL)).quiet_for(LOCK_QUIET);
        wait.until(|| async {
            Ok(match Self::attempt(path)? {
                Attempt::Locked(lock) => Poll::Ready(Some(lock)),
                Attempt::NoDir => Poll::Ready(None),
                Attempt::Busy => Poll::Pending("held by another dormant process".into()),
            })
        })
        .await
        .with_context(|| format!("lock file {}", path.display()))
    }

    /// Takes the lock only if it is free now. `Ok(None)` if it is held, or if
    /// its directory does not exist.
    pub fn try_acquire(path: &Path) -> Result<Option<FileLock>> {
        Ok(match Self::attempt(path)? {
            Attempt::Locked(lock) => Some(lock),
            Attempt::Busy | Attempt::NoDir => None,
        })
    }

    fn attempt(path: &Path) -> Result<Attempt> {
        // A file unlinked between our open and our lock is retried: see the
        // module comment. Bounded: each round needs another process to delete
        // the file in between.
        for _ in 0..100 {
            let file = match OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .mode(0o600)
                .open(path)
            {
                Ok(f) => f,
                // Never create the directory: a lock must not resurrect a
                // directory a release removed.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Attempt::NoDir),
                Err(e) => {
                    return Err(e).with_context(|| format!("opening lock file {}", path.display()))
                }
            };
            match file.try_lock() {
                Ok(()) => {}
                Err(fs::TryLockError::WouldBlock) => return Ok(Attempt::Busy),
                Err(fs::TryLockError::Error(e)) => {
                    return Err(e).with_context(|| format!("locking {}", path.display()))
                }
            }
            if same_file(&file, path)? {
                return Ok(Attempt::Locked(FileLock {
                    file,
                    path: path.to_path_buf(),
                }));
            }
        }
        anyhow::bail!(
            "lock file {} keeps being replaced by other processes",
            path.display()
        )
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Deletes the lock file while holding it: the only way dormant deletes a
    /// lock file (see the module comment).
    pub fn remove(self) -> Result<()> {
        super::store::remove_file(&self.path)
        // `self` drops here, unlocking the now unlinked file.
    }
}

impl Drop for FileLock {
    fn drop(&mut self) {
        let _ = self.file.unlock();
    }
}

/// Whether `file` (open) is what `path` names now.
fn same_file(file: &File, path: &Path) -> Result<bool> {
    let open = file.metadata().context("reading an open lock file")?;
    match fs::metadata(path) {
        Ok(now) => Ok(now.ino() == open.ino() && now.dev() == open.dev()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}

/// A shared lock held for a process's whole life on a liveness file: while any
/// holder lives, nobody can take the file exclusively, so [`is_live`] tells a
/// claim whose holder is alive from one whose holder died — without the holder
/// writing anything, and without trusting a pid that may have been reused.
#[derive(Debug)]
pub struct LiveLock {
    _file: File,
}

impl LiveLock {
    /// Holds `path` shared (creating it; its directory must exist).
    pub fn hold(path: &Path) -> Result<LiveLock> {
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(path)
            .with_context(|| format!("opening liveness file {}", path.display()))?;
        file.lock_shared()
            .with_context(|| format!("locking {}", path.display()))?;
        Ok(LiveLock { _file: file })
    }
}

/// Whether some live process holds the liveness file `path`.
pub fn is_live(path: &Path) -> Result<bool> {
    let file = match OpenOptions::new().write(true).open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => {
            return Err(e).with_context(|| format!("opening liveness file {}", path.display()))
        }
    };
    match file.try_lock() {
        Ok(()) => {
            let _ = file.unlock();
            Ok(false)
        }
        Err(fs::TryLockError::WouldBlock) => Ok(true),
        Err(fs::TryLockError::Error(e)) => {
            Err(e).with_context(|| format!("locking {}", path.display()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::context::JobLog;
    use tokio_util::sync::CancellationToken;

    fn ctx(ms: u64) -> Ctx {
        Ctx::new(
            JobLog::capture().0,
            CancellationToken::new(),
            Duration::from_millis(ms),
        )
    }

    #[tokio::test]
    async fn waits_are_bounded_cancellable_and_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.lock");
        let held = FileLock::acquire(&path, &ctx(1000), "test")
            .await
            .unwrap()
            .unwrap();
        assert!(FileLock::try_acquire(&path).unwrap().is_none());
        let err = FileLock::acquire(&path, &ctx(60), "waiting for job 1")
            .await
            .unwrap_err();
        let text = format!("{err:#}");
        assert!(
            text.contains("a.lock") && text.contains("timed out"),
            "{text}"
        );
        let c = ctx(60_000);
        let cancel = c.cancel.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            cancel.cancel();
        });
        let err = FileLock::acquire(&path, &c, "waiting").await.unwrap_err();
        assert!(format!("{err:#}").contains("cancelled"), "{err:#}");
        drop(held);
        assert!(FileLock::try_acquire(&path).unwrap().is_some());
    }

    #[tokio::test]
    async fn a_lock_never_creates_its_directory() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("gone/record.lock");
        assert!(FileLock::acquire(&path, &ctx(100), "x")
            .await
            .unwrap()
            .is_none());
        assert!(FileLock::try_acquire(&path).unwrap().is_none());
        assert!(!dir.path().join("gone").exists());
    }

    #[tokio::test]
    async fn a_waiter_on_a_removed_lock_file_takes_the_new_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("job.lock");
        let held = FileLock::try_acquire(&path).unwrap().unwrap();
        let p = path.clone();
        let waiter = tokio::spawn(async move {
            let lock = FileLock::acquire(&p, &ctx(5_000), "w")
                .await
                .unwrap()
                .unwrap();
            // What the waiter holds is the file at the path, not the unlinked one.
            let at_path = fs::metadata(&p).unwrap().ino();
            (lock.file.metadata().unwrap().ino(), at_path)
        });
        tokio::time::sleep(Duration::from_millis(60)).await;
        held.remove().unwrap();
        let (locked, at_path) = waiter.await.unwrap();
        assert_eq!(locked, at_path);
    }

    #[test]
    fn liveness_follows_the_holder() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j.live");
        assert!(!is_live(&path).unwrap(), "no file: nobody holds it");
        let a = LiveLock::hold(&path).unwrap();
        let b = LiveLock::hold(&path).unwrap();
        assert!(is_live(&path).unwrap());
        drop(a);
        assert!(is_live(&path).unwrap(), "one holder left");
        drop(b);
        assert!(!is_live(&path).unwrap());
    }
}
