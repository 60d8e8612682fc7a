//! One job's durable progress, shared by its stage processes.

use std::path::PathBuf;

use anyhow::Result;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::store::{self, FileLock, StateStore, FORMAT_VERSION, JOB_LOCK_TIMEOUT};
use crate::context::Ctx;

/// Whether the job made a fresh environment or resumed a suspended one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    New,
    Resume,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "result")]
pub enum StageResult {
    Ok,
    /// The script exited with this code.
    Build {
        code: i32,
    },
    /// The environment or the connection broke.
    System,
    /// A termination signal stopped the stage.
    Terminated,
    /// Skipped on purpose (a resumed environment's `get_sources`).
    Skipped,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageRecord {
    pub name: String,
    #[serde(flatten)]
    pub result: StageResult,
}

/// `jobs/<runner>-<job>.json`. Holds no secret: no token, no variables.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobState {
    pub version: u32,
    pub runner_id: String,
    pub job_id: u64,
    pub project_id: u64,
    pub env_id: Uuid,
    pub mode: Mode,
    pub suspend_on_success: bool,
    pub suspend_on_failure: bool,
    /// This job holds the environment record (`current_job` is this job). Until
    /// then cleanup must not touch the environment: it may be another job's.
    pub claimed: bool,
    /// Prepare finished: the environment is ready and the key was printed.
    pub prepare_completed: bool,
    /// A termination signal reached a stage of this job (cancel, timeout).
    pub terminated: bool,
    #[serde(default)]
    pub stages: Vec<StageRecord>,
    pub created_at: u64,
}

impl JobState {
    pub fn new(runner_id: &str, job_id: u64, project_id: u64, env_id: Uuid, mode: Mode) -> Self {
        JobState {
            version: FORMAT_VERSION,
            runner_id: runner_id.to_string(),
            job_id,
            project_id,
            env_id,
            mode,
            suspend_on_success: false,
            suspend_on_failure: false,
            claimed: false,
            prepare_completed: false,
            terminated: false,
            stages: Vec::new(),
            created_at: super::now_unix(),
        }
    }
}

/// A job's state file, held under its lock for as long as this value lives.
pub struct LockedJob {
    path: PathBuf,
    _lock: FileLock,
}

impl LockedJob {
    /// Takes the job's lock, waiting at most [`JOB_LOCK_TIMEOUT`] and no longer
    /// than `ctx` allows; the wait does not block the runtime, so SIGTERM is
    /// handled during it.
    pub async fn lock(
        store: &StateStore,
        runner_id: &str,
        job_id: u64,
        ctx: &Ctx,
    ) -> Result<LockedJob> {
        let path = store.job_file(runner_id, job_id);
        let lock = FileLock::acquire_async(
            &path.with_extension("lock"),
            &ctx.within(JOB_LOCK_TIMEOUT),
            &format!("waiting for job {job_id}'s lock (another dormant process of the same job holds it)"),
        )
        .await?;
        Ok(LockedJob { path, _lock: lock })
    }

    pub fn load(&self) -> Result<Option<JobState>> {
        store::read_json(&self.path)
    }

    pub fn save(&self, state: &JobState) -> Result<()> {
        store::write_json(&self.path, state)
    }

    /// Removes the state file (the lock file stays until the lock is dropped).
    pub fn remove(self) -> Result<()> {
        store::remove_file(&self.path)?;
        let lock_path = self._lock.path().to_path_buf();
        drop(self._lock);
        // Another process may be waiting on this lock file; removing it is still
        // safe because a job's stages never overlap once cleanup has run.
        store::remove_file(&lock_path)
    }

    pub fn path(&self) -> &std::path::Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::context::JobLog;
    use std::time::Duration;
    use tokio_util::sync::CancellationToken;

    #[tokio::test]
    async fn a_held_job_lock_is_waited_for_within_the_deadline_and_sigterm_ends_the_wait() {
        let dir = tempfile::tempdir().unwrap();
        let store = StateStore::open(dir.path()).unwrap();
        let lock_path = store.job_file("1", 7).with_extension("lock");
        let held = FileLock::acquire(&lock_path, Duration::from_secs(1), "test").unwrap();

        let ctx = Ctx::new(
            JobLog::capture().0,
            CancellationToken::new(),
            Duration::from_millis(200),
        );
        let err = LockedJob::lock(&store, "1", 7, &ctx).await.err().unwrap();
        let text = format!("{err:#}");
        assert!(
            text.contains("timed out") && text.contains("job 7's lock"),
            "{text}"
        );
        assert!(text.contains(lock_path.to_str().unwrap()), "{text}");

        let cancel = CancellationToken::new();
        let ctx = Ctx::new(JobLog::capture().0, cancel.clone(), Duration::from_secs(60));
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            cancel.cancel();
        });
        let err = LockedJob::lock(&store, "1", 7, &ctx).await.err().unwrap();
        assert!(format!("{err:#}").contains("cancelled"), "{err:#}");

        drop(held);
        let locked = LockedJob::lock(&store, "1", 7, &ctx.uncancellable())
            .await
            .unwrap();
        assert_eq!(locked.load().unwrap(), None);
    }
}
