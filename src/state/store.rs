//! The state store's mechanics: directories with 0700, atomic writes of
//! versioned JSON (0600), refusal to overwrite what cannot be read, and the
//! staging and trash directories that make creating and deleting an
//! environment's directory atomic. Locks are in `lock.rs`.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::de::DeserializeOwned;
use serde::Serialize;
use uuid::Uuid;

use crate::model::EnvPaths;

/// The format version every state file carries; a newer one is refused.
/// 2: environment records hold a claim (who holds it, provably) instead of a
/// job number, and job state a phase instead of booleans. Version 1 files are
/// still read (see `record.rs` and `job.rs`).
pub const FORMAT_VERSION: u32 = 2;
/// 3: the record of a volume-mode environment (`storage = "volume"`): its
/// files are on a data volume, its machine is deleted while it is suspended.
/// Only those records carry it, so a dormant that predates volume mode
/// refuses them by name and still reads every other file.
pub const VOLUME_FORMAT_VERSION: u32 = 3;
/// The newest format this dormant reads.
pub const NEWEST_FORMAT_VERSION: u32 = VOLUME_FORMAT_VERSION;

/// The state dir.
#[derive(Debug, Clone)]
pub struct StateStore {
    root: PathBuf,
}

impl StateStore {
    /// Opens (and creates, 0700) the state dir.
    /// Root may use another user's state dir (an operator's `sudo dormant
    /// list`): what it creates there is given to the state dir's owner, or
    /// the runner, running as that user, could not use it.
    pub fn open(root: &Path) -> Result<Self> {
        refuse_another_users(root)?;
        ensure_private_dir(root)?;
        for dir in ["jobs", "environments", "trash"] {
            ensure_owned_dir(&root.join(dir), root)?;
        }
        Ok(StateStore {
            root: root.to_path_buf(),
        })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn env_paths(&self, id: Uuid) -> EnvPaths {
        EnvPaths::new(&self.root, id)
    }

    /// `environments/`: one directory per environment, named by its id.
    pub fn environments_dir(&self) -> PathBuf {
        self.root.join("environments")
    }

    /// `trash/`: directories being deleted (renamed here first, atomically).
    pub fn trash_dir(&self) -> PathBuf {
        self.root.join("trash")
    }

    /// Every environment directory in the registry (by id; other names are
    /// staging directories of a create in progress, see [`Self::stray_entries`]).
    pub fn environment_ids(&self) -> Result<Vec<Uuid>> {
        let dir = self.environments_dir();
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

    /// Everything in `trash/` (a delete that was killed half-way), with its
    /// age in seconds.
    pub fn trash_entries(&self) -> Result<Vec<(PathBuf, u64)>> {
        let dir = self.trash_dir();
        let entries = match fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e).with_context(|| format!("listing {}", dir.display())),
        };
        let mut out = Vec::new();
        for entry in entries {
            let path = entry?.path();
            let age = age_secs(&path);
            out.push((path, age));
        }
        Ok(out)
    }

    /// Entries under `environments/` that are not an environment (a staging
    /// directory a killed create left), and everything in `trash/` (a delete
    /// that was killed half-way), with their age in seconds.
    pub fn stray_entries(&self) -> Result<Vec<(PathBuf, u64)>> {
        let mut out = Vec::new();
        for dir in [self.environments_dir(), self.trash_dir()] {
            let entries = match fs::read_dir(&dir) {
                Ok(e) => e,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e).with_context(|| format!("listing {}", dir.display())),
            };
            for entry in entries {
                let entry = entry?;
                let name = entry.file_name();
                if dir == self.environments_dir()
                    && name.to_str().is_some_and(|n| Uuid::parse_str(n).is_ok())
                {
                    continue;
                }
                let age = entry
                    .metadata()
                    .ok()
                    .and_then(|m| m.modified().ok())
                    .and_then(|t| t.elapsed().ok())
                    .map(|d| d.as_secs())
                    .unwrap_or(0);
                out.push((entry.path(), age));
            }
        }
        Ok(out)
    }

    /// A fresh, private staging directory beside `environments/<id>/`, to be
    /// filled and then renamed into place (so an environment directory never
    /// exists without its record).
    pub fn staging_dir(&self, id: Uuid) -> Result<PathBuf> {
        let dir = self.environments_dir().join(format!(
            ".new-{id}-{}-{:08x}",
            std::process::id(),
            fastrand::u32(..)
        ));
        fs::create_dir(&dir).with_context(|| format!("creating {}", dir.display()))?;
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o700))
            .with_context(|| format!("setting 0700 on {}", dir.display()))?;
        Ok(dir)
    }

    /// Deletes a directory in a way no other process can race: renames it into
    /// `trash/` (atomic; afterwards nothing can reach it under its old name,
    /// nor re-create a lock file in it), then deletes it there. A delete killed
    /// half-way leaves only an entry in `trash/`, which `sweep` finishes.
    pub fn delete_dir(&self, dir: &Path) -> Result<()> {
        let name = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let doomed = self.trash_dir().join(format!(
            "{name}-{}-{:08x}",
            std::process::id(),
            fastrand::u32(..)
        ));
        match fs::rename(dir, &doomed) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => {
                return Err(e)
                    .with_context(|| format!("moving {} to {}", dir.display(), doomed.display()))
            }
        }
        remove_tree(&doomed)
    }
}

/// Seconds since `path` was last modified (0 if that cannot be read).
pub fn age_secs(path: &Path) -> u64 {
    fs::symlink_metadata(path)
        .ok()
        .and_then(|m| m.modified().ok())
        .and_then(|t| t.elapsed().ok())
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// `rm -rf`; already gone is fine.
pub fn remove_tree(dir: &Path) -> Result<()> {
    match fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).with_context(|| format!("removing {}", dir.display())),
    }
}

/// Creates a directory (and parents) and makes it 0700.
/// Who may use a state dir: its owner (the runner's user) and root. Its
/// files are 0600 and its directories 0700, so anyone else would fail on the
/// first file; say so at once, naming both users and what to run.
fn refuse_another_users(root: &Path) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    let owner = match fs::metadata(root) {
        Ok(m) => m.uid(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            bail!(
                "the state dir {} cannot be read by uid {me} (permission denied): only the runner's \
                 own user and root may use it; run dormant as that user (`sudo -u <runner user> dormant …`)",
                root.display()
            )
        }
        Err(e) => return Err(e).with_context(|| format!("reading state dir {}", root.display())),
    };
    if me != 0 && owner != me {
        bail!(
            "the state dir {} belongs to uid {owner}, and dormant runs as uid {me}: only the runner's \
             own user and root may use it (permission denied for anyone else); run dormant as that \
             user (`sudo -u <runner user> dormant …`)",
            root.display()
        );
    }
    Ok(())
}

/// [`ensure_private_dir`], and when it had to be made by root inside a
/// directory `like` that belongs to someone else, given to `like`'s owner.
pub fn ensure_owned_dir(dir: &Path, like: &Path) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    if dir.is_dir() {
        return ensure_private_dir(dir);
    }
    ensure_private_dir(dir)?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Ok(());
    }
    let owner = fs::metadata(like).with_context(|| format!("reading {}", like.display()))?;
    if owner.uid() != 0 {
        std::os::unix::fs::chown(dir, Some(owner.uid()), Some(owner.gid())).with_context(|| {
            format!(
                "giving {} to uid {}, the owner of {}",
                dir.display(),
                owner.uid(),
                like.display()
            )
        })?;
    }
    Ok(())
}

pub fn ensure_private_dir(dir: &Path) -> Result<()> {
    fs::create_dir_all(dir)
        .with_context(|| format!("creating state directory {}", dir.display()))?;
    fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
        .with_context(|| format!("setting 0700 on {}", dir.display()))
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
    if version > NEWEST_FORMAT_VERSION {
        bail!(
            "state file {} has format version {version}, newer than this dormant understands ({NEWEST_FORMAT_VERSION}): \
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
    write_json_as(path, value, true)
}

/// As [`write_json`] without the fsyncs: still atomic against a killed
/// process (a reader sees the old file or the new one), but a power loss may
/// lose it. Only for files whose last write may be lost: a run stage's result
/// (it dies with the runner's job anyway, and the fsyncs would cost 1–10 ms on
/// every stage), the sweep cursor and the metrics checkpoint (a lost write
/// only repeats work). docs/guide/state.md lists which files are which.
pub fn write_json_unsynced<T: Serialize>(path: &Path, value: &T) -> Result<()> {
    write_json_as(path, value, false)
}

fn write_json_as<T: Serialize>(path: &Path, value: &T, durable: bool) -> Result<()> {
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
        if durable {
            f.sync_all()?;
        }
        fs::rename(&tmp, path)?;
        if durable {
            sync_dir(dir)?;
        }
        Ok(())
    };
    write()
        .with_context(|| format!("writing state file {}", path.display()))
        .inspect_err(|_| {
            let _ = fs::remove_file(&tmp);
        })
}

/// Makes a rename or a new entry in `dir` durable (the entry lives in the
/// directory, not in the file it names).
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Writes `path` with mode 0600, also when it existed with a wider mode: state
/// files are for dormant's user only.
pub fn write_private(path: &std::path::Path, data: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    f.write_all(data)
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
}
