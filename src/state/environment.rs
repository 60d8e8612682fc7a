//! The registry entry of one environment, and where its files are.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::store::{self, FileLock, ENV_LOCK_TIMEOUT, FORMAT_VERSION};
use crate::provider::Machine;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EnvStatus {
    /// A job is using it.
    Active,
    /// Stopped, disk kept, waiting for a job with its key.
    Suspended,
    /// A job claimed it and is starting it.
    Resuming,
    /// Being deleted; a sweep finishes what a failed release left.
    Releasing,
}

impl EnvStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            EnvStatus::Active => "active",
            EnvStatus::Suspended => "suspended",
            EnvStatus::Resuming => "resuming",
            EnvStatus::Releasing => "releasing",
        }
    }
}

/// `environments/<id>/record.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EnvironmentRecord {
    pub version: u32,
    pub id: Uuid,
    /// The environment key, once the machine exists.
    pub key: Option<String>,
    pub provider: String,
    pub machine: Option<Machine>,
    pub runner_id: String,
    pub system_id: String,
    pub project_id: u64,
    pub project_path: Option<String>,
    pub status: EnvStatus,
    /// The job using it (active / resuming).
    pub current_job: Option<u64>,
    /// The job that made it.
    pub created_by_job: u64,
    pub created_at: u64,
    pub suspended_at: Option<u64>,
    pub resumed_at: Option<u64>,
    /// Jobs that have run in it.
    pub job_count: u32,
    /// Why the last suspend did not finish cleanly, if it did not.
    #[serde(default)]
    pub last_error: Option<String>,
}

impl EnvironmentRecord {
    pub fn new(
        id: Uuid,
        provider: &str,
        runner_id: &str,
        system_id: &str,
        project_id: u64,
        job_id: u64,
    ) -> Self {
        EnvironmentRecord {
            version: FORMAT_VERSION,
            id,
            key: None,
            provider: provider.to_string(),
            machine: None,
            runner_id: runner_id.to_string(),
            system_id: system_id.to_string(),
            project_id,
            project_path: None,
            status: EnvStatus::Active,
            current_job: Some(job_id),
            created_by_job: job_id,
            created_at: super::now_unix(),
            suspended_at: None,
            resumed_at: None,
            job_count: 1,
            last_error: None,
        }
    }
}

/// The files of one environment under `environments/<id>/`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvPaths {
    pub id: Uuid,
    /// `environments/<id>/` (0700).
    pub dir: PathBuf,
    pub record: PathBuf,
    pub lock: PathBuf,
    /// The environment's own SSH private key (0600); `.pub` beside it.
    pub ssh_key: PathBuf,
    /// Host keys pinned on first connect.
    pub known_hosts: PathBuf,
    /// Short directory for the SSH control socket (Unix socket paths are short).
    pub control_dir: PathBuf,
}

impl EnvPaths {
    pub fn new(root: &Path, id: Uuid) -> Self {
        let dir = root.join("environments").join(id.to_string());
        let short = id.simple().to_string();
        EnvPaths {
            id,
            record: dir.join("record.json"),
            lock: dir.join("record.lock"),
            ssh_key: dir.join("id_ed25519"),
            known_hosts: dir.join("known_hosts"),
            control_dir: root.join("ctl").join(&short[..12]),
            dir,
        }
    }

    pub fn exists(&self) -> bool {
        self.dir.exists()
    }

    /// Creates the environment directory (0700).
    pub fn create(&self) -> Result<()> {
        store::ensure_private_dir(&self.dir)
    }

    /// Locks the record (short holds only: never across a cloud call).
    pub fn lock(&self) -> Result<LockedEnv> {
        let lock = FileLock::acquire(
            &self.lock,
            ENV_LOCK_TIMEOUT,
            &format!("environment {}", self.id),
        )?;
        Ok(LockedEnv {
            paths: self.clone(),
            _lock: lock,
        })
    }

    pub fn try_lock(&self) -> Result<Option<LockedEnv>> {
        Ok(FileLock::try_acquire(&self.lock)?.map(|lock| LockedEnv {
            paths: self.clone(),
            _lock: lock,
        }))
    }

    /// Reads the record without the lock (listing, config).
    pub fn peek(&self) -> Result<Option<EnvironmentRecord>> {
        store::read_json(&self.record)
    }

    /// Deletes the environment's directory and control dir: the last step of a release.
    pub fn remove_all(&self) -> Result<()> {
        for dir in [&self.control_dir, &self.dir] {
            match std::fs::remove_dir_all(dir) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(e).with_context(|| format!("removing {}", dir.display())),
            }
        }
        Ok(())
    }
}

/// An environment record held under its lock.
pub struct LockedEnv {
    paths: EnvPaths,
    _lock: FileLock,
}

impl LockedEnv {
    pub fn load(&self) -> Result<Option<EnvironmentRecord>> {
        store::read_json(&self.paths.record)
    }

    pub fn save(&self, record: &EnvironmentRecord) -> Result<()> {
        store::write_json(&self.paths.record, record)
    }

    pub fn paths(&self) -> &EnvPaths {
        &self.paths
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_dir_is_short_enough_for_a_unix_socket() {
        // A socket path must fit in 108 bytes; openssh adds a socket name of up
        // to ~40 bytes, so the directory must stay well under 61 bytes for a
        // typical state dir.
        let p = EnvPaths::new(Path::new("/var/lib/dormant"), Uuid::new_v4());
        assert!(
            p.control_dir.as_os_str().len() <= 40,
            "{}",
            p.control_dir.display()
        );
    }
}
