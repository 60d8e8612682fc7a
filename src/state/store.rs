//! The state store's mechanics: directories with 0700, lock files kept beside
//! the data, atomic writes of versioned JSON, and refusal to overwrite what
//! cannot be read (modelled on nextest's `record/store.rs`).

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::de::DeserializeOwned;
use serde::Serialize;
use uuid::Uuid;

use super::environment::EnvPaths;

/// The format version every state file carries; a newer one is refused.
pub const FORMAT_VERSION: u32 = 1;

/// Stage processes of one job wait this long for its lock. The runner never runs
/// two stages of a job at once; the wait covers a cleanup that overlaps a run the
/// runner gave up on (it waits 5 min for it), which holds the lock only briefly.
pub const JOB_LOCK_TIMEOUT: Duration = Duration::from_secs(60);
/// An environment record is locked only around read-check-write, never across
/// cloud calls, so other jobs wait milliseconds at most.
pub const ENV_LOCK_TIMEOUT: Duration = Duration::from_secs(30);

/// The state dir.
#[derive(Debug, Clone)]
pub struct StateStore {
    root: PathBuf,
}

impl StateStore {
    /// Opens (and creates, 0700) the state dir.
    pub fn open(root: &Path) -> Result<Self> {
        for dir in [
            root.to_path_buf(),
            root.join("jobs"),
            root.join("environments"),
        ] {
            ensure_private_dir(&dir)?;
        }
        Ok(StateStore {
            root: root.to_path_buf(),
        })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn job_file(&self, runner_id: &str, job_id: u64) -> PathBuf {
        self.root
            .join("jobs")
            .join(format!("{}-{job_id}.json", file_safe(runner_id)))
    }

    pub fn env_paths(&self, id: Uuid) -> EnvPaths {
        EnvPaths::new(&self.root, id)
    }

    /// Every environment directory in the registry (by id; unreadable names skipped).
    pub fn environment_ids(&self) -> Result<Vec<Uuid>> {
        let dir = self.root.join("environments");
        let mut ids = Vec::new();
        for entry in fs::read_dir(&dir).with_context(|| format!("listing {}", dir.display()))? {
            let entry = entry?;
            if let Some(id) = entry
                .file_name()
                .to_str()
                .and_then(|n| Uuid::parse_str(n).ok())
            {
                ids.push(id);
            }
        }
        ids.sort();
        Ok(ids)
    }
}

/// Runner ids are numbers in practice; anything else is made safe for a file name.
fn file_safe(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// Creates a directory (and parents) and makes it 0700.
pub fn ensure_private_dir(dir: &Path) -> Result<()> {
    fs::create_dir_all(dir)
        .with_context(|| format!("creating state directory {}", dir.display()))?;
    fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
        .with_context(|| format!("setting 0700 on {}", dir.display()))
}

/// An exclusive lock on a lock file kept permanently beside the data it guards.
/// Dropping the guard unlocks; the kernel also unlocks when the process dies.
#[derive(Debug)]
pub struct FileLock {
    file: File,
    path: PathBuf,
}

impl FileLock {
    /// Takes the lock, retrying until `timeout`; the error names the lock file.
    /// Blocking: for sync callers and short waits (record locks are held for
    /// milliseconds). Async code that may wait long uses [`FileLock::acquire_async`].
    pub fn acquire(path: &Path, timeout: Duration, what: &str) -> Result<FileLock> {
        let start = Instant::now();
        let mut pause = Duration::from_millis(2);
        loop {
            if let Some(lock) = FileLock::try_acquire(path)? {
                return Ok(lock);
            }
            if start.elapsed() >= timeout {
                bail!(
                    "{what} is locked by another dormant process (lock file {}); gave up after {} s",
                    path.display(),
                    timeout.as_secs()
                );
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(100));
        }
    }

    /// Takes the lock without blocking the async runtime, bounded by `ctx`
    /// (its deadline and SIGTERM).
    pub async fn acquire_async(
        path: &Path,
        ctx: &crate::context::Ctx,
        what: &str,
    ) -> Result<FileLock> {
        loop {
            if let Some(lock) = FileLock::try_acquire(path)? {
                return Ok(lock);
            }
            ctx.sleep(Duration::from_millis(50), what)
                .await
                .with_context(|| format!("lock file {}", path.display()))?;
        }
    }

    /// Takes the lock only if it is free now.
    pub fn try_acquire(path: &Path) -> Result<Option<FileLock>> {
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(path)
            .with_context(|| format!("opening lock file {}", path.display()))?;
        match file.try_lock() {
            Ok(()) => Ok(Some(FileLock {
                file,
                path: path.to_path_buf(),
            })),
            Err(fs::TryLockError::WouldBlock) => Ok(None),
            Err(fs::TryLockError::Error(e)) => {
                Err(e).with_context(|| format!("locking {}", path.display()))
            }
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for FileLock {
    fn drop(&mut self) {
        let _ = self.file.unlock();
    }
}

#[derive(serde::Deserialize)]
struct VersionOnly {
    version: Option<u32>,
}

/// Reads a versioned JSON state file. `Ok(None)` if it does not exist. A file
/// that cannot be parsed, or that a newer dormant wrote, is an error naming it.
pub fn read_json<T: DeserializeOwned>(path: &Path) -> Result<Option<T>> {
    let text = match fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("reading state file {}", path.display())),
    };
    let version = serde_json::from_str::<VersionOnly>(&text)
        .map_err(|e| corrupt(path, &e.to_string()))?
        .version
        .ok_or_else(|| corrupt(path, "it has no format version"))?;
    if version > FORMAT_VERSION {
        bail!(
            "state file {} has format version {version}, newer than this dormant understands ({FORMAT_VERSION}): \
             a newer dormant wrote it; upgrade dormant on this host (the file is left untouched)",
            path.display()
        );
    }
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| corrupt(path, &e.to_string()))
}

fn corrupt(path: &Path, why: &str) -> anyhow::Error {
    anyhow::anyhow!(
        "state file {} is corrupt ({why}); it was left untouched: inspect it, then move it aside \
         (dormant never overwrites a state file it cannot read)",
        path.display()
    )
}

/// Writes JSON atomically (temp file in the same dir, fsync, rename), mode 0600.
pub fn write_json<T: Serialize>(path: &Path, value: &T) -> Result<()> {
    let dir = path
        .parent()
        .context("state file has no parent directory")?;
    let tmp = dir.join(format!(
        ".{}.{}.tmp",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("state"),
        std::process::id()
    ));
    let mut text = serde_json::to_vec_pretty(value).context("serializing state")?;
    text.push(b'\n');
    let write = || -> std::io::Result<()> {
        let mut f = OpenOptions::new()
            .create(true)
            .truncate(true)
            .write(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(&text)?;
        f.sync_all()?;
        fs::rename(&tmp, path)?;
        File::open(dir)?.sync_all()
    };
    write()
        .with_context(|| format!("writing state file {}", path.display()))
        .inspect_err(|_| {
            let _ = fs::remove_file(&tmp);
        })
}

/// Removes a file; already gone is fine.
pub fn remove_file(path: &Path) -> Result<()> {
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).with_context(|| format!("removing {}", path.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Serialize, serde::Deserialize, PartialEq, Debug)]
    struct Doc {
        version: u32,
        value: String,
    }

    #[test]
    fn round_trip_is_private_and_atomic() {
        let dir = tempfile::tempdir().unwrap();
        let store = StateStore::open(&dir.path().join("s")).unwrap();
        let mode = fs::metadata(store.root()).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
        let path = store.root().join("jobs/x.json");
        let doc = Doc {
            version: FORMAT_VERSION,
            value: "v".into(),
        };
        write_json(&path, &doc).unwrap();
        assert_eq!(read_json::<Doc>(&path).unwrap(), Some(doc));
        assert_eq!(
            fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
        let leftovers: Vec<_> = fs::read_dir(store.root().join("jobs")).unwrap().collect();
        assert_eq!(leftovers.len(), 1, "no temp file is left behind");
    }

    #[test]
    fn corrupt_and_newer_files_are_refused_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("record.json");
        fs::write(&path, "{ garbage").unwrap();
        let err = read_json::<Doc>(&path).unwrap_err();
        assert!(format!("{err:#}").contains("is corrupt"), "{err:#}");
        assert!(format!("{err:#}").contains(&path.display().to_string()));
        assert_eq!(fs::read_to_string(&path).unwrap(), "{ garbage");
        fs::write(&path, r#"{"version": 99, "value": "x"}"#).unwrap();
        let err = read_json::<Doc>(&path).unwrap_err();
        assert!(format!("{err:#}").contains("newer"), "{err:#}");
        assert_eq!(
            read_json::<Doc>(&dir.path().join("missing.json")).unwrap(),
            None
        );
    }

    #[test]
    fn lock_waits_are_bounded_and_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.lock");
        let held = FileLock::acquire(&path, Duration::from_secs(1), "job 1").unwrap();
        assert!(FileLock::try_acquire(&path).unwrap().is_none());
        let err = FileLock::acquire(&path, Duration::from_millis(50), "job 1").unwrap_err();
        assert!(format!("{err:#}").contains("a.lock"), "{err:#}");
        drop(held);
        assert!(FileLock::try_acquire(&path).unwrap().is_some());
    }
}
