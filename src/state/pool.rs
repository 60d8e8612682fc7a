//! The warm pool's books: machines booted ahead of any job (issue "warm
//! machines", docs/architecture.md "Warm machines"), which a new environment
//! or a volume-mode resume takes instead of booting one.
//!
//! Layout under the state dir:
//! - `warm/<id>/warm.json`: one warm machine's entry ([`WarmEntry`]), beside
//!   its own SSH key pair and known_hosts (the same file names an
//!   environment's directory uses, so they can be moved into one) and the
//!   provider's files (qemu: `vm/`).
//! - `warm/<id>/warm.lock`: held by whoever acts on that machine (its
//!   launcher for the whole boot, a hand-out, a retirement). A free lock on
//!   an entry that is still `launching` means its launcher died.
//! - `warm/refill.lock`: held by the one refill (or sweep) that runs.
//!
//! Every status is written (durably) before its effect:
//!
//! | status | written by | effect after it |
//! |---|---|---|
//! | launching | a refill, in a new entry dir | the provider boots the machine, its host key is pinned |
//! | ready | the refill, with the machine | — (a prepare may take it) |
//! | taken (by env) | a prepare, under the entry lock | the key, known_hosts and the machine move into the environment; then the entry is removed |
//! | retiring | a refill or sweep (too old, settings changed, not wanted, launcher died) | the machine is deleted; then the entry is removed |
//!
//! This module owns the entries: nothing else writes `warm.json`.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::lock::FileLock;
use super::store::{self, StateStore};
use crate::model::{EnvPaths, Machine};

/// What a warm machine is doing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "status")]
pub enum WarmStatus {
    Launching,
    Ready,
    Taken { env: Uuid },
    Retiring { why: String },
}

impl WarmStatus {
    pub fn as_str(&self) -> &'static str {
        match self {
            WarmStatus::Launching => "launching",
            WarmStatus::Ready => "ready",
            WarmStatus::Taken { .. } => "taken",
            WarmStatus::Retiring { .. } => "retiring",
        }
    }
}

/// One warm machine's entry (`warm/<id>/warm.json`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WarmEntry {
    pub version: u32,
    pub id: Uuid,
    /// The provider that made it (`qemu`, `ec2`).
    pub provider: String,
    /// What it was made from (image, size, user-data, network), as the
    /// provider summarises today's settings: a machine whose fingerprint is
    /// not today's is retired, never handed out.
    pub fingerprint: String,
    /// A readable form of the same, for `dormant list` (e.g. the image).
    pub made_from: String,
    /// Where it runs (an EC2 availability zone); `None` on a single host.
    pub zone: Option<String>,
    #[serde(flatten)]
    pub status: WarmStatus,
    pub launched_at: u64,
    pub ready_at: Option<u64>,
    /// Set once the provider made it (launching may not have got that far).
    pub machine: Option<Machine>,
}

impl WarmEntry {
    pub fn age_secs(&self, now: u64) -> u64 {
        now.saturating_sub(self.launched_at)
    }
}

/// The pool's directory and file names.
#[derive(Debug, Clone)]
pub struct Pool {
    dir: PathBuf,
}

/// One entry's files. `paths` has the shape of an environment's paths (key,
/// known_hosts, a `dir`), rooted in the entry's directory, so the code that
/// makes and pins an environment's machine makes a warm one unchanged.
#[derive(Debug, Clone)]
pub struct WarmPaths {
    pub id: Uuid,
    pub dir: PathBuf,
    pub entry: PathBuf,
    pub lock: PathBuf,
    pub paths: EnvPaths,
}

impl Pool {
    pub fn new(store: &StateStore) -> Pool {
        Pool::at(store.root())
    }

    /// The pool of the state dir at `state_root`.
    pub fn at(state_root: &Path) -> Pool {
        Pool {
            dir: state_root.join("warm"),
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn refill_lock(&self) -> PathBuf {
        self.dir.join("refill.lock")
    }

    pub fn paths(&self, id: Uuid) -> WarmPaths {
        let dir = self.dir.join(id.to_string());
        let mut paths = EnvPaths::new(&self.dir, id);
        // EnvPaths::new puts the directory under `environments/`: a warm
        // machine's lives in the pool; its control socket dir stays short.
        paths.dir = dir.clone();
        paths.record = dir.join("no-record.json");
        paths.lock = dir.join("warm.lock");
        paths.holder_live = dir.join("holder.live");
        paths.ssh_key = dir.join("id_ed25519");
        paths.known_hosts = dir.join("known_hosts");
        paths.stages_left = dir.join("stages-left");
        WarmPaths {
            id,
            entry: dir.join("warm.json"),
            lock: dir.join("warm.lock"),
            dir,
            paths,
        }
    }

    /// Every entry id in the pool (directories named by a UUID).
    pub fn ids(&self) -> Result<Vec<Uuid>> {
        let entries = match fs::read_dir(&self.dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e).with_context(|| format!("listing {}", self.dir.display())),
        };
        let mut ids: Vec<Uuid> = entries
            .filter_map(Result::ok)
            .filter_map(|e| e.file_name().to_str().and_then(|n| Uuid::parse_str(n).ok()))
            .collect();
        ids.sort();
        Ok(ids)
    }

    /// Reads an entry without its lock (for `list` and choosing).
    pub fn peek(&self, id: Uuid) -> Result<Option<WarmEntry>> {
        store::read_json(&self.paths(id).entry)
    }

    /// Every readable entry; unreadable ones are returned as errors beside.
    pub fn entries(&self) -> Result<Vec<(Uuid, Result<Option<WarmEntry>>)>> {
        Ok(self
            .ids()?
            .into_iter()
            .map(|id| (id, self.peek(id)))
            .collect())
    }

    /// Starts a new entry, `launching`, with its lock held by the caller for
    /// the whole launch. The directory appears with its entry in one rename,
    /// so an entry dir never lacks its `warm.json`.
    pub fn begin_launch(
        &self,
        provider: &str,
        fingerprint: &str,
        made_from: &str,
        zone: Option<String>,
    ) -> Result<(WarmPaths, WarmEntry, FileLock)> {
        store::ensure_private_dir(&self.dir)?;
        let id = Uuid::new_v4();
        let wp = self.paths(id);
        let staging = self.dir.join(format!(".new-{id}"));
        store::ensure_private_dir(&staging)?;
        let entry = WarmEntry {
            version: store::FORMAT_VERSION,
            id,
            provider: provider.to_string(),
            fingerprint: fingerprint.to_string(),
            made_from: made_from.to_string(),
            zone,
            status: WarmStatus::Launching,
            launched_at: super::now_unix(),
            ready_at: None,
            machine: None,
        };
        store::write_json(&staging.join("warm.json"), &entry)?;
        // Locked before it is visible: nobody may take a free lock on a
        // `launching` entry for a dead launcher's.
        fs::File::create(staging.join("warm.lock"))
            .with_context(|| format!("creating the lock of {}", staging.display()))?;
        let lock = FileLock::try_acquire(&staging.join("warm.lock"))?
            .context("a new warm entry's lock was held by someone else")?;
        fs::rename(&staging, &wp.dir)
            .with_context(|| format!("renaming {} into the pool", staging.display()))?;
        store::sync_dir(&self.dir).with_context(|| format!("syncing {}", self.dir.display()))?;
        Ok((wp, entry, lock))
    }

    /// Takes an entry's lock if it is free now.
    pub fn try_lock(&self, id: Uuid) -> Result<Option<FileLock>> {
        FileLock::try_acquire(&self.paths(id).lock)
    }

    /// Writes an entry's new status; the caller holds its lock.
    pub fn set(&self, _lock: &FileLock, entry: &WarmEntry) -> Result<()> {
        let wp = self.paths(entry.id);
        if !wp.dir.exists() {
            bail!("warm machine {} is no longer in the pool", entry.id);
        }
        store::write_json(&wp.entry, entry)
    }

    /// Removes an entry (its machine moved into an environment or was
    /// deleted): renamed into the state dir's trash, then deleted, with its
    /// lock held until the directory is gone from the pool (the rule for
    /// every lock file: deleted only by its holder). Released earlier, the
    /// lock could be taken by a refill or a prepare that then reads and acts
    /// on an entry being deleted; taken after the rename, an acquire finds no
    /// file at the path and reports the entry gone (`FileLock`'s re-check).
    pub fn remove(&self, store: &StateStore, lock: FileLock, id: Uuid) -> Result<()> {
        let wp = self.paths(id);
        let removed = if wp.dir.exists() {
            store.delete_dir(&wp.dir)
        } else {
            Ok(())
        };
        drop(lock);
        removed
    }

    /// Staging directories of launches killed before their rename (nothing
    /// was booted from them yet: the provider is called only after it).
    pub fn stray_staging(&self) -> Vec<PathBuf> {
        let Ok(entries) = fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        entries
            .filter_map(Result::ok)
            .filter(|e| {
                e.file_name()
                    .to_str()
                    .is_some_and(|n| n.starts_with(".new-"))
            })
            .map(|e| e.path())
            .collect()
    }
}

/// Gives an environment a warm machine's key pair and known_hosts: copied
/// (each to a temporary name, synced, renamed over whatever the environment
/// had), the pool keeping its own until the entry is removed. A copy, not a
/// move: if the environment is released before the hand-over finishes (the
/// runner's cleanup between two attempts of a prepare), the retry copies
/// them again into the new directory; nothing is lost with the old one.
pub fn give_identity(from: &EnvPaths, to: &EnvPaths) -> Result<()> {
    let files = [
        (from.ssh_key.clone(), to.ssh_key.clone()),
        (
            from.ssh_key.with_extension("pub"),
            to.ssh_key.with_extension("pub"),
        ),
        (from.known_hosts.clone(), to.known_hosts.clone()),
    ];
    for (a, b) in files {
        let mut bytes = fs::read(&a).with_context(|| format!("reading {}", a.display()))?;
        if a == from.known_hosts {
            bytes = repin(&bytes, from.id, to.id);
        }
        let tmp = b.with_extension("warm-tmp");
        let write = || -> std::io::Result<()> {
            store::write_private(&tmp, &bytes)?;
            fs::File::open(&tmp)?.sync_all()?;
            fs::rename(&tmp, &b)
        };
        write().with_context(|| format!("writing {}", b.display()))?;
    }
    store::sync_dir(&to.dir).with_context(|| format!("syncing {}", to.dir.display()))?;
    Ok(())
}

/// A known_hosts file's pins under the environment's name: ssh looks a
/// host key up by the alias `dormant-<id>` of the machine's owner
/// (`transport::ssh::master`, `HostKeyAlias`), so a pin made for warm
/// machine `from` would not be found for environment `to`, and its first
/// connection would pin whatever key it met (trust on first use again).
fn repin(known_hosts: &[u8], from: Uuid, to: Uuid) -> Vec<u8> {
    let (old, new) = (format!("dormant-{from}"), format!("dormant-{to}"));
    let text = String::from_utf8_lossy(known_hosts);
    let mut out = String::new();
    for line in text.split_inclusive('\n') {
        match line.split_once(' ') {
            Some((host, rest)) if host == old => {
                out.push_str(&new);
                out.push(' ');
                out.push_str(rest);
            }
            _ => out.push_str(line),
        }
    }
    out.into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool() -> (tempfile::TempDir, StateStore, Pool) {
        let tmp = tempfile::tempdir().unwrap();
        let store = StateStore::open(tmp.path()).unwrap();
        let pool = Pool::new(&store);
        (tmp, store, pool)
    }

    #[test]
    fn a_launch_appears_with_its_entry_and_its_lock_held() {
        let (_t, _s, pool) = pool();
        let (wp, entry, lock) = pool.begin_launch("qemu", "fp", "default", None).unwrap();
        assert_eq!(pool.ids().unwrap(), vec![wp.id]);
        assert_eq!(pool.peek(wp.id).unwrap().unwrap(), entry);
        assert_eq!(entry.status, WarmStatus::Launching);
        assert!(
            pool.try_lock(wp.id).unwrap().is_none(),
            "the launcher holds it"
        );
        drop(lock);
        assert!(
            pool.try_lock(wp.id).unwrap().is_some(),
            "free once the launcher is gone"
        );
        assert!(pool.stray_staging().is_empty());
    }

    #[test]
    fn statuses_round_trip_and_removal_empties_the_pool() {
        let (_t, store, pool) = pool();
        let (wp, mut entry, lock) = pool.begin_launch("qemu", "fp", "default", None).unwrap();
        for status in [
            WarmStatus::Ready,
            WarmStatus::Taken {
                env: Uuid::new_v4(),
            },
            WarmStatus::Retiring {
                why: "too old".into(),
            },
        ] {
            entry.status = status;
            pool.set(&lock, &entry).unwrap();
            assert_eq!(pool.peek(wp.id).unwrap().unwrap(), entry);
        }
        pool.remove(&store, lock, wp.id).unwrap();
        assert!(pool.ids().unwrap().is_empty());
        assert!(!wp.dir.exists());
    }

    /// A lock file is deleted only by its holder (docs/architecture.md,
    /// "Locks"): while an entry is removed, another process trying its lock
    /// finds it held, then gone, never free with the entry still there.
    /// (Released before the directory went, a contender could lock it and
    /// act on an entry being deleted.)
    #[test]
    fn an_entry_being_removed_is_never_locked_by_anyone_else() {
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
        use std::sync::Arc;
        let (_t, store, pool) = pool();
        let got_it = Arc::new(AtomicUsize::new(0));
        for _ in 0..300 {
            let (wp, _entry, lock) = pool.begin_launch("qemu", "fp", "default", None).unwrap();
            let done = Arc::new(AtomicBool::new(false));
            let tried = Arc::new(AtomicBool::new(false));
            let contender = {
                let (pool, done, tried, got_it) =
                    (pool.clone(), done.clone(), tried.clone(), got_it.clone());
                std::thread::spawn(move || {
                    while !done.load(Ordering::SeqCst) {
                        if pool.try_lock(wp.id).unwrap().is_some() {
                            got_it.fetch_add(1, Ordering::SeqCst);
                        }
                        tried.store(true, Ordering::SeqCst);
                    }
                })
            };
            while !tried.load(Ordering::SeqCst) {
                std::thread::yield_now();
            }
            pool.remove(&store, lock, wp.id).unwrap();
            done.store(true, Ordering::SeqCst);
            contender.join().unwrap();
        }
        assert_eq!(
            got_it.load(Ordering::SeqCst),
            0,
            "an entry's lock was taken while it was being removed"
        );
        assert!(pool.ids().unwrap().is_empty());
    }

    #[test]
    fn the_identity_is_given_to_the_environment_and_a_retry_gives_it_again() {
        let (_tmp, store, pool) = pool();
        let (wp, _entry, _lock) = pool.begin_launch("qemu", "fp", "default", None).unwrap();
        fs::write(&wp.paths.ssh_key, "private").unwrap();
        fs::write(wp.paths.ssh_key.with_extension("pub"), "public").unwrap();
        fs::write(
            &wp.paths.known_hosts,
            format!("dormant-{} ssh-ed25519 AAAApinned\n", wp.id),
        )
        .unwrap();
        let env = store.env_paths(Uuid::new_v4());
        let pinned = format!("dormant-{} ssh-ed25519 AAAApinned\n", env.id);
        fs::create_dir_all(&env.dir).unwrap();
        fs::write(&env.ssh_key, "a key of a killed attempt").unwrap();
        give_identity(&wp.paths, &env).unwrap();
        assert_eq!(fs::read_to_string(&env.ssh_key).unwrap(), "private");
        assert_eq!(
            fs::read_to_string(env.ssh_key.with_extension("pub")).unwrap(),
            "public"
        );
        assert_eq!(
            fs::read_to_string(&env.known_hosts).unwrap(),
            pinned,
            "the pin under the environment's alias"
        );
        // The environment released (its directory gone) and made again by
        // the retried prepare, with a key of its own: given again.
        fs::remove_dir_all(&env.dir).unwrap();
        fs::create_dir_all(&env.dir).unwrap();
        fs::write(&env.ssh_key, "another attempt's key").unwrap();
        give_identity(&wp.paths, &env).unwrap();
        assert_eq!(fs::read_to_string(&env.ssh_key).unwrap(), "private");
        assert_eq!(fs::read_to_string(&env.known_hosts).unwrap(), pinned);
    }

    #[test]
    fn the_warm_paths_are_in_the_pool_not_among_environments() {
        let (_t, _s, pool) = pool();
        let wp = pool.paths(Uuid::new_v4());
        for p in [
            &wp.paths.dir,
            &wp.paths.ssh_key,
            &wp.paths.known_hosts,
            &wp.entry,
        ] {
            assert!(p.starts_with(pool.dir()), "{}", p.display());
        }
        assert!(wp.paths.control_dir.as_os_str().len() < 80);
    }
}
