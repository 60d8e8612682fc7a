//! One job's durable progress (`jobs/<runner>-<job>.json`), shared by its stage
//! processes, and the job's two lock files: `.lock` (exclusive, held while a
//! stage reads and writes the progress) and `.live` (shared, held by every
//! stage process of the job for its whole life: proof the job is alive, see
//! `registry::liveness`). Between two stages no process of the job runs; the
//! job state then names the process that runs its stages (GitLab Runner,
//! every stage's parent: [`RunnerProcess`]), which lives from prepare to
//! cleanup, so `dormant release --force` can tell a job between two stages
//! from one whose runner is gone.

use std::path::{Path, PathBuf};

use anyhow::Result;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::lock::{FileLock, LiveLock};
use super::record::Mode;
use super::store::{self, StateStore, FORMAT_VERSION};
use super::transitions::Reached;
use crate::context::Ctx;

/// Stage processes of one job wait this long for its lock. The runner never
/// runs two stages of a job at once; the wait covers a cleanup that overlaps a
/// run the runner gave up on, which holds the lock only briefly.
pub const JOB_LOCK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// How far the job got. Each phase is saved before the step it announces
/// (intent before effect), so a process killed at any line leaves a phase
/// that tells the next one what may have happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Prepare chose the environment and is about to claim it.
    Claiming,
    /// Prepare claimed it and is making or starting its machine.
    Preparing,
    /// Prepare finished: the environment is ready and its key was printed.
    Ready,
    /// A stage script started (the job reached its first stage).
    Stages,
}

impl Phase {
    pub fn reached(self) -> Reached {
        match self {
            Phase::Claiming | Phase::Preparing => Reached::Preparing,
            Phase::Ready => Reached::Ready,
            Phase::Stages => Reached::Stages,
        }
    }
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
    #[serde(default = "legacy_phase")]
    pub phase: Phase,
    /// A termination signal reached a stage of this job (cancel, timeout).
    pub terminated: bool,
    #[serde(default)]
    pub stages: Vec<StageRecord>,
    /// The reason the job's script wrote to `DORMANT_SUSPEND_FILE`, if it
    /// asked for its own suspension (`crate::job_request`).
    #[serde(default)]
    pub job_request: Option<String>,
    /// Volume mode: the environment's machine went away under a stage of
    /// this job (what the provider said of it). Cleanup keeps the volume as
    /// `transitions::at_cleanup` says, and says why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub machine_lost: Option<String>,
    /// A stage's script asked (`dormant-ask`, docs/pause.md) and waits in
    /// the environment: the question (bounded). Cleanup suspends, keeping it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused: Option<String>,
    /// The process that runs the job's stages (their parent), recorded by
    /// prepare. `None` for a job state of an older dormant, or a prepare
    /// whose parent could not be read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runner_process: Option<RunnerProcess>,
    pub created_at: u64,
    /// Format 1's booleans, read to derive `phase`.
    #[serde(default, skip_serializing)]
    claimed: bool,
    #[serde(default, skip_serializing)]
    prepare_completed: bool,
}

/// Marks a format 1 file, whose phase is derived from its booleans.
fn legacy_phase() -> Phase {
    Phase::Claiming
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
            phase: Phase::Claiming,
            terminated: false,
            stages: Vec::new(),
            job_request: None,
            machine_lost: None,
            paused: None,
            runner_process: None,
            created_at: super::now_unix(),
            claimed: false,
            prepare_completed: false,
        }
    }

    fn upgrade(mut self) -> Self {
        if self.version < 2 {
            self.phase = match (self.claimed, self.prepare_completed, self.stages.is_empty()) {
                (_, true, false) => Phase::Stages,
                (_, true, true) => Phase::Ready,
                (true, false, _) => Phase::Preparing,
                _ => Phase::Claiming,
            };
            self.version = FORMAT_VERSION;
        }
        self
    }

    pub fn prepared(&self) -> bool {
        self.phase >= Phase::Ready
    }
}

impl StateStore {
    pub fn job_file(&self, runner_id: &str, job_id: u64) -> PathBuf {
        self.root()
            .join("jobs")
            .join(format!("{}-{job_id}.json", file_safe(runner_id)))
    }

    /// The job's liveness file: held shared by each of its stage processes.
    pub fn job_live_file(&self, runner_id: &str, job_id: u64) -> PathBuf {
        self.job_file(runner_id, job_id).with_extension("live")
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

/// The process that runs a job's stages: GitLab Runner calls every stage of a
/// job as its own child and lives from the job's prepare to its cleanup. A
/// pid alone could be reused: its start time (clock ticks after boot,
/// `/proc/<pid>/stat`) makes the mark name one process only.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunnerProcess {
    pub pid: u32,
    pub started: u64,
}

impl RunnerProcess {
    /// This stage's parent. `None` when it cannot be read, or when this
    /// process was orphaned (its parent is init): then there is no runner
    /// process to name.
    pub fn parent_of_this_process() -> Option<RunnerProcess> {
        // SAFETY: getppid(2) has no preconditions and touches no memory.
        let pid = unsafe { libc::getppid() };
        let pid = u32::try_from(pid).ok().filter(|p| *p > 1)?;
        Some(RunnerProcess {
            pid,
            started: start_time(pid)?,
        })
    }

    /// Whether that very process still runs (a zombie does not).
    pub fn is_running(&self) -> bool {
        start_time(self.pid) == Some(self.started)
    }
}

/// Process `pid`'s start time (field 22 of `/proc/<pid>/stat`), `None` when
/// it is gone or a zombie.
fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: the fields
    // after it start after the last ')'.
    let mut rest = stat.get(stat.rfind(')')? + 1..)?.split_whitespace();
    let state = rest.next()?;
    if state == "Z" || state == "X" {
        return None;
    }
    // Field 3 was the state; field 22 is 19 further on.
    rest.nth(18)?.parse().ok()
}

/// The process running the stages of a job that holds a claim, when the
/// job's state names one and it still runs: the job is between two stages
/// (or its stage processes were killed while its runner lives on), not gone.
pub fn live_runner(store: &StateStore, runner_id: &str, job_id: u64) -> Option<RunnerProcess> {
    let state = store::read_json::<JobState>(&store.job_file(runner_id, job_id))
        .ok()
        .flatten()?;
    state.runner_process.filter(RunnerProcess::is_running)
}

/// Held by a stage process for its whole life: the job is alive.
pub fn hold_job_alive(store: &StateStore, runner_id: &str, job_id: u64) -> Result<LiveLock> {
    LiveLock::hold(&store.job_live_file(runner_id, job_id))
}

/// A job's state file, held under its lock for as long as this value lives.
/// Dropped without a state file on disk (the job never saved one, or its
/// cleanup removed it), it deletes its lock and liveness files too, so a job
/// that was refused or finished leaves nothing behind.
pub struct LockedJob {
    path: PathBuf,
    lock: Option<FileLock>,
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
        let what = format!(
            "waiting for job {job_id}'s lock (another dormant process of the same job holds it)"
        );
        let lock = FileLock::acquire(
            &path.with_extension("lock"),
            &ctx.within(JOB_LOCK_TIMEOUT),
            &what,
        )
        .await?
        .ok_or_else(|| anyhow::anyhow!("the state dir's jobs/ directory is missing"))?;
        Ok(LockedJob {
            path,
            lock: Some(lock),
        })
    }

    pub fn load(&self) -> Result<Option<JobState>> {
        Ok(store::read_json::<JobState>(&self.path)?.map(JobState::upgrade))
    }

    pub fn save(&self, state: &JobState) -> Result<()> {
        store::write_json(&self.path, state)
    }

    /// Saves a stage's result: atomic but not fsynced (see
    /// [`store::write_json_unsynced`]). A host that loses power loses the job
    /// with it; phases, which crash recovery reads, go through [`Self::save`].
    pub fn save_stage(&self, state: &JobState) -> Result<()> {
        store::write_json_unsynced(&self.path, state)
    }

    /// Removes the state file; the lock files go when this value is dropped.
    pub fn remove(&self) -> Result<()> {
        store::remove_file(&self.path)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for LockedJob {
    fn drop(&mut self) {
        let Some(lock) = self.lock.take() else {
            return;
        };
        if self.path.exists() {
            return;
        }
        // No progress on disk: nothing for a later stage to find, so the lock
        // and liveness files go (deleted while held: see `lock.rs`). A live
        // stage process of this job (an overlapping run) keeps its liveness
        // lock on the unlinked file; nobody needs to find it any more.
        let _ = store::remove_file(&self.path.with_extension("live"));
        let _ = lock.remove();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::context::JobLog;
    use std::time::Duration;
    use tokio_util::sync::CancellationToken;

    #[test]
    fn the_runner_process_is_this_process_parent_and_runs_only_with_its_start_time() {
        let me = RunnerProcess::parent_of_this_process().expect("a test has a parent");
        assert_eq!(me.pid, std::os::unix::process::parent_id());
        assert!(me.is_running());
        // The same pid, another start time: a process that got the pid later.
        let reused = RunnerProcess {
            started: me.started + 1,
            ..me.clone()
        };
        assert!(!reused.is_running());
        // A process that ended (and was reaped).
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let gone = RunnerProcess {
            pid: child.id(),
            started: start_time(child.id()).expect("a running child has a start time"),
        };
        assert!(gone.is_running());
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(!gone.is_running());
    }

    #[tokio::test]
    async fn a_held_job_lock_is_waited_for_within_the_deadline_and_sigterm_ends_the_wait() {
        let dir = tempfile::tempdir().unwrap();
        let store = StateStore::open(dir.path()).unwrap();
        let lock_path = store.job_file("1", 7).with_extension("lock");
        let held = FileLock::try_acquire(&lock_path).unwrap().unwrap();

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

    #[tokio::test]
    async fn a_job_that_saved_nothing_leaves_no_lock_files() {
        let dir = tempfile::tempdir().unwrap();
        let store = StateStore::open(dir.path()).unwrap();
        let ctx = Ctx::new(
            JobLog::capture().0,
            Default::default(),
            Duration::from_secs(5),
        );
        let live = hold_job_alive(&store, "1", 3).unwrap();
        drop(LockedJob::lock(&store, "1", 3, &ctx).await.unwrap());
        drop(live);
        let locked = LockedJob::lock(&store, "1", 4, &ctx).await.unwrap();
        locked
            .save(&JobState::new("1", 4, 5, Uuid::nil(), Mode::New))
            .unwrap();
        drop(locked);
        let left: Vec<_> = std::fs::read_dir(store.root().join("jobs"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(left.len(), 2, "job 4's state and lock stay: {left:?}");
        let locked = LockedJob::lock(&store, "1", 4, &ctx).await.unwrap();
        locked.remove().unwrap();
        drop(locked);
        assert_eq!(
            std::fs::read_dir(store.root().join("jobs"))
                .unwrap()
                .count(),
            0
        );
    }

    #[test]
    fn a_format_1_job_state_gets_its_phase_from_the_booleans() {
        let v1 = r#"{"version":1,"runner_id":"1","job_id":2,"project_id":3,
          "env_id":"00000000-0000-0000-0000-000000000000","mode":"resume",
          "suspend_on_success":false,"suspend_on_failure":false,"claimed":true,
          "prepare_completed":true,"terminated":false,"stages":[],"created_at":1}"#;
        let s = serde_json::from_str::<JobState>(v1).unwrap().upgrade();
        assert_eq!(s.phase, Phase::Ready);
    }
}
