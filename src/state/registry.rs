//! The registry of environments on disk: reading records, the record lock,
//! the one update function every transition goes through, creating an
//! environment's directory atomically with its record, removing it
//! atomically, and telling a live claim from a stale one.
//!
//! Lock order (never the reverse): a job's lock → an environment's record lock
//! → a provider's own locks (slots, capacity). The record lock is held only
//! around read-check-write, never across a provider call.

use std::fs;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};

use super::lock::{is_live, FileLock};
use super::record::{EnvironmentRecord, Holder};
use super::store::{self, StateStore};
use crate::context::Ctx;
use crate::model::EnvPaths;

/// Record locks are held for milliseconds (read-check-write, never a cloud
/// call); this bounds a wait behind a process that hangs while holding one.
pub const ENV_LOCK_TIMEOUT: Duration = Duration::from_secs(30);

/// Reads a record without its lock (listing, config, providers' accounting).
/// `Ok(None)`: no record (no such environment, or a directory without one).
pub fn peek(paths: &EnvPaths) -> Result<Option<EnvironmentRecord>> {
    Ok(store::read_json::<EnvironmentRecord>(&paths.record)?.map(EnvironmentRecord::upgrade))
}

/// An environment record held under its lock.
pub struct LockedEnv {
    paths: EnvPaths,
    lock: FileLock,
}

impl LockedEnv {
    /// The record; `None` if the environment was removed (a release finished
    /// while we waited for the lock).
    pub fn load(&self) -> Result<Option<EnvironmentRecord>> {
        peek(&self.paths)
    }

    fn save(&self, rec: &EnvironmentRecord) -> Result<()> {
        store::write_json(&self.paths.record, rec)
    }

    pub fn paths(&self) -> &EnvPaths {
        &self.paths
    }
}

/// Takes an environment's record lock. `Ok(None)`: the environment does not
/// exist (or was removed while we waited).
pub async fn lock(paths: &EnvPaths, ctx: &Ctx) -> Result<Option<LockedEnv>> {
    let what = format!("waiting for environment {}'s record lock", paths.id);
    let lock = FileLock::acquire(&paths.lock, &ctx.within(ENV_LOCK_TIMEOUT), &what).await?;
    Ok(lock.map(|lock| LockedEnv {
        paths: paths.clone(),
        lock,
    }))
}

/// Takes the record lock only if it is free now (sweeps never wait).
pub fn try_lock(paths: &EnvPaths) -> Result<Option<LockedEnv>> {
    Ok(FileLock::try_acquire(&paths.lock)?.map(|lock| LockedEnv {
        paths: paths.clone(),
        lock,
    }))
}

/// Why an update did not happen.
#[derive(Debug, thiserror::Error)]
pub enum UpdateError<E> {
    /// The environment has no record (released, or never created).
    #[error("environment {0} is not in the registry")]
    Gone(uuid::Uuid),
    /// The change refused itself (a transition not allowed now).
    #[error(transparent)]
    Refused(E),
    #[error(transparent)]
    Io(#[from] anyhow::Error),
}

/// The one way to change a record: under its lock, load it, let `change`
/// check and apply a transition, and save it if `change` succeeded.
pub async fn update<T, E>(
    paths: &EnvPaths,
    ctx: &Ctx,
    change: impl FnOnce(&mut EnvironmentRecord) -> Result<T, E>,
) -> Result<(EnvironmentRecord, T), UpdateError<E>> {
    let env = lock(paths, ctx).await?.ok_or(UpdateError::Gone(paths.id))?;
    let mut rec = env.load()?.ok_or(UpdateError::Gone(paths.id))?;
    let out = change(&mut rec).map_err(UpdateError::Refused)?;
    env.save(&rec)?;
    Ok((rec, out))
}

/// [`update`] for callers already holding the lock.
pub fn update_locked<T, E>(
    env: &LockedEnv,
    change: impl FnOnce(&mut EnvironmentRecord) -> Result<T, E>,
) -> Result<(EnvironmentRecord, T), UpdateError<E>> {
    let mut rec = env.load()?.ok_or(UpdateError::Gone(env.paths.id))?;
    let out = change(&mut rec).map_err(UpdateError::Refused)?;
    env.save(&rec)?;
    Ok((rec, out))
}

/// Creates an environment's directory with its record in one step: the
/// record is written in a private staging directory which is then renamed into
/// place, so `environments/<id>/` never exists without a record. `Ok(false)`:
/// the environment already exists (left as it is).
pub fn create(store: &StateStore, rec: &EnvironmentRecord) -> Result<bool> {
    let paths = store.env_paths(rec.id);
    if paths.exists() {
        return Ok(false);
    }
    let staging = store.staging_dir(rec.id)?;
    create_staged(store, rec, staging)
}

/// [`create`] from a staging directory (`StateStore::staging_dir`) the
/// caller has already put more of the environment's files in (`dormant
/// adopt`: its key and known_hosts): they appear with the record, or not at
/// all. The staging directory is gone afterwards either way.
pub fn create_staged(
    store: &StateStore,
    rec: &EnvironmentRecord,
    staging: PathBuf,
) -> Result<bool> {
    let paths = store.env_paths(rec.id);
    let staged = EnvPaths::new(store.root(), rec.id);
    let inside = |p: &std::path::Path| staging.join(p.file_name().unwrap_or_default());
    let result = (|| {
        store::write_json(&inside(&staged.record), rec)?;
        match fs::rename(&staging, &paths.dir) {
            // The record inside was fsynced; its directory's entry in
            // `environments/` must survive a power loss too, or the machine
            // made next would have no record (only sweep's tag search).
            Ok(()) => {
                let parent = paths.dir.parent().unwrap_or(store.root());
                store::sync_dir(parent).with_context(|| format!("syncing {}", parent.display()))?;
                Ok(true)
            }
            // Someone else created it first (a racing retry): theirs stands.
            Err(e)
                if e.kind() == std::io::ErrorKind::DirectoryNotEmpty
                    || e.kind() == std::io::ErrorKind::AlreadyExists =>
            {
                Ok(false)
            }
            Err(e) => Err(e).with_context(|| {
                format!("moving {} to {}", staging.display(), paths.dir.display())
            }),
        }
    })();
    if !matches!(result, Ok(true)) {
        let _ = store::remove_tree(&staging);
    }
    result
}

/// Removes a released environment: under its lock, checks the record says
/// `holder` is releasing it, then moves its directory to the trash and deletes
/// it (see [`StateStore::delete_dir`]); its SSH control directory too. Already
/// gone is success.
pub async fn remove(
    store: &StateStore,
    paths: &EnvPaths,
    holder: &Holder,
    ctx: &Ctx,
) -> Result<()> {
    let Some(env) = lock(paths, ctx).await? else {
        return store::remove_tree(&paths.control_dir);
    };
    if let Some(rec) = env.load()? {
        rec.may_remove(holder)?;
    }
    // Renamed while locked: a waiter for this lock then finds no record, and
    // nobody can open (and so re-create) a lock file in the old directory.
    store.delete_dir(&paths.dir)?;
    let _ = env.lock.remove();
    store::remove_tree(&paths.control_dir)
}

/// Removes an environment directory that has no record (a leftover of an
/// older dormant), if nobody holds its lock. `Ok(false)`: busy, or it has a
/// record after all.
pub fn remove_recordless(store: &StateStore, paths: &EnvPaths) -> Result<bool> {
    let Some(env) = try_lock(paths)? else {
        return Ok(false);
    };
    if env.load()?.is_some() {
        return Ok(false);
    }
    store.delete_dir(&paths.dir)?;
    store::remove_tree(&paths.control_dir)?;
    Ok(true)
}

/// How alive a claim's holder is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Liveness {
    /// A process of the holder is running.
    Live,
    /// No process of it runs, but it was active `idle` seconds ago, within the
    /// grace (the gap between two stages of a job is milliseconds).
    Idle { idle: u64 },
    /// No process of it runs and it has been idle past the grace: stale.
    Gone { idle: u64 },
}

/// Whether the holder of `rec`'s claim is alive. `grace`: how long a holder
/// with no process running still counts as present.
pub fn liveness(
    store: &StateStore,
    paths: &EnvPaths,
    rec: &EnvironmentRecord,
    grace: Duration,
) -> Result<Liveness> {
    let Some(claim) = rec.claim() else {
        return Ok(Liveness::Gone { idle: 0 });
    };
    let (live_file, job_file) = match &claim.holder {
        Holder::Job {
            runner_id, job_id, ..
        } => (
            store.job_live_file(runner_id, *job_id),
            Some(store.job_file(runner_id, *job_id)),
        ),
        Holder::Shell { .. } | Holder::Operator { .. } => (paths.holder_live.clone(), None),
    };
    if is_live(&live_file)? {
        return Ok(Liveness::Live);
    }
    // A job's state file is written at the end of every stage: its last
    // activity even when the record was not touched.
    let job_activity = job_file
        .and_then(|f| fs::metadata(f).ok())
        .and_then(|m| m.modified().ok())
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| d.as_secs())
        .unwrap_or(0);
    // The holder's own activity: its claim's, or its job's last stage. (Not
    // the record's other times: a suspension moments ago says nothing about
    // whether the job that claimed it since is alive.)
    let last = claim.last_activity.max(job_activity);
    let idle = super::now_unix().saturating_sub(last);
    Ok(if idle >= grace.as_secs() {
        Liveness::Gone { idle }
    } else {
        Liveness::Idle { idle }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::context::JobLog;
    use crate::state::record::{Mode, NewEnvironment};

    fn ctx() -> Ctx {
        Ctx::new(
            JobLog::capture().0,
            Default::default(),
            Duration::from_secs(5),
        )
    }

    fn job(id: u64) -> Holder {
        Holder::Job {
            runner_id: "1".into(),
            job_id: id,
            mode: Mode::New,
            suspend_on_failure: false,
        }
    }

    fn new_record(id: uuid::Uuid) -> EnvironmentRecord {
        EnvironmentRecord::new(
            NewEnvironment {
                id,
                provider: "local",
                runner_id: "1",
                system_id: "s",
                project_id: 5,
                project_path: None,
                job_id: 1,
                storage: crate::model::StorageMode::Machine,
                image: None,
            },
            job(1),
        )
    }

    #[tokio::test]
    async fn create_is_atomic_and_remove_leaves_nothing_a_lock_can_resurrect() {
        let dir = tempfile::tempdir().unwrap();
        let store = StateStore::open(dir.path()).unwrap();
        let id = uuid::Uuid::new_v4();
        let paths = store.env_paths(id);
        assert!(create(&store, &new_record(id)).unwrap());
        assert!(!create(&store, &new_record(id)).unwrap(), "exists already");
        assert!(peek(&paths).unwrap().is_some());
        assert!(store.stray_entries().unwrap().is_empty(), "no staging left");

        // A sweep that opened the lock before the removal...
        let (rec, ()) = update(&paths, &ctx(), |r| r.begin_release(&job(1)))
            .await
            .unwrap();
        assert_eq!(rec.status().as_str(), "releasing");
        remove(&store, &paths, &job(1), &ctx()).await.unwrap();
        assert!(!paths.dir.exists());
        // ...and one that tries after it: neither brings the directory back.
        assert!(try_lock(&paths).unwrap().is_none());
        assert!(lock(&paths, &ctx()).await.unwrap().is_none());
        assert!(!paths.dir.exists());
        assert!(matches!(
            update(&paths, &ctx(), |r| r.touch(&job(1))).await,
            Err(UpdateError::Gone(_))
        ));
        assert!(store.stray_entries().unwrap().is_empty(), "trash emptied");
        remove(&store, &paths, &job(1), &ctx()).await.unwrap();
    }

    #[tokio::test]
    async fn remove_refuses_what_is_not_being_released_by_the_caller() {
        let dir = tempfile::tempdir().unwrap();
        let store = StateStore::open(dir.path()).unwrap();
        let id = uuid::Uuid::new_v4();
        create(&store, &new_record(id)).unwrap();
        let paths = store.env_paths(id);
        let err = remove(&store, &paths, &job(1), &ctx()).await.unwrap_err();
        assert!(format!("{err:#}").contains("cannot be removed"), "{err:#}");
        assert!(paths.dir.exists());
    }

    #[test]
    fn a_claim_is_live_while_its_job_holds_the_liveness_file_then_idle_then_gone() {
        let dir = tempfile::tempdir().unwrap();
        let store = StateStore::open(dir.path()).unwrap();
        let id = uuid::Uuid::new_v4();
        let mut rec = new_record(id);
        let paths = store.env_paths(id);
        let held = super::super::lock::LiveLock::hold(&store.job_live_file("1", 1)).unwrap();
        let grace = Duration::from_secs(60);
        assert_eq!(
            liveness(&store, &paths, &rec, grace).unwrap(),
            Liveness::Live
        );
        drop(held);
        assert!(matches!(
            liveness(&store, &paths, &rec, grace).unwrap(),
            Liveness::Idle { .. }
        ));
        rec.created_at -= 120;
        rec.claim.as_mut().unwrap().last_activity -= 120;
        assert!(matches!(
            liveness(&store, &paths, &rec, grace).unwrap(),
            Liveness::Gone { idle } if idle >= 120
        ));
    }
}
