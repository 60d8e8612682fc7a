//! A simulated GitLab Runner: drives the dormant binary exactly the way the
//! runner drives a custom executor (see `docs/runner-contract.md`), so `dormant
//! try` and the integration tests exercise the binary the way production does.
//!
//! One job is: prepare with retries (a private `custom-executor*` temp dir
//! with `response.json`, config, prepare, cleanup after a failed attempt; up
//! to three attempts) → the run stages in the runner's order with its skip
//! rules → cleanup. Every call gets the environment in the runner's order,
//! `CI_JOB_STATUS` as the runner sets it, its own process group, and SIGTERM
//! to that group when the job is canceled.
//!
//! - `prepare.rs`: the attempts (config, prepare, cleanup in between)
//! - `stages.rs`: the run stages and their scripts
//! - `attempt.rs`: a temp dir's context and each call's environment
//! - `process.rs`: spawning one call and collecting its output
//! - `job.rs`, `report.rs`: the job going in, the report coming out
//! - `payload.rs`: the job payload as the runner's Go encoder writes it
//!
//! The names, exit codes, config output and stage order come from
//! [`crate::contract`], which the driver side uses too.

mod attempt;
mod job;
mod payload;
mod prepare;
mod process;
mod report;
mod stages;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Result;

pub use job::SimJob;
pub use payload::{RunnerVersion, SuspendOptions};
pub use report::{Call, JobReport, JobResult};

use prepare::Prepared;

/// A runner process: the binary it calls and the runner's own environment.
#[derive(Debug, Clone)]
pub struct Runner {
    pub binary: PathBuf,
    /// Arguments before the stage name (`config_args` etc. put `--config X` here).
    pub args: Vec<String>,
    /// The runner process's own environment (systemd unit etc.).
    pub env: BTreeMap<String, String>,
    /// Where the per-job temp dirs go.
    pub tmp_root: PathBuf,
    /// Leave every attempt's temp dir in place (the runner deletes each after
    /// its cleanup); for looking at scripts and payloads afterwards.
    pub keep_temp_dirs: bool,
    /// The runner waits 3 s between prepare attempts; tests shorten it.
    pub retry_pause: Duration,
    pub runner_id: String,
    /// The job token the payload and `CI_JOB_TOKEN` carry. Random by default;
    /// a test sets a known one to look for leaks.
    pub job_token: String,
    /// Start every call with SIGHUP ignored: a runner started under `nohup`.
    pub ignore_sighup: bool,
    /// The release simulated: how its payload spells the resume key, and
    /// whether it has `suspend_options` at all.
    pub version: RunnerVersion,
}

impl Runner {
    pub fn new(binary: PathBuf, tmp_root: PathBuf, runner_id: &str) -> Self {
        Runner {
            binary,
            args: Vec::new(),
            env: BTreeMap::new(),
            tmp_root,
            keep_temp_dirs: false,
            retry_pause: crate::contract::PREPARE_RETRY_PAUSE,
            runner_id: runner_id.to_string(),
            job_token: format!("glcbt-simulated-{:016x}", fastrand::u64(..)),
            ignore_sighup: false,
            version: RunnerVersion::SIMULATED,
        }
    }

    /// Runs one whole job as the runner does: prepare (with retries), the run
    /// stages, cleanup always.
    pub fn run_job(&self, job: &SimJob) -> Result<JobReport> {
        self.run_job_with(job, &mut |_| {})
    }

    /// [`Runner::run_job`] with `before_stage(stage)` called just before the
    /// runner calls each run stage, and with `"cleanup"` before the job's
    /// cleanup: the seam tests use to disturb a job between two stages (kill
    /// a connection, look at the processes, bring a host back).
    pub fn run_job_with(
        &self,
        job: &SimJob,
        before_stage: &mut dyn FnMut(&str),
    ) -> Result<JobReport> {
        let mut calls = Vec::new();
        let attempt = match self.prepare_with_retries(job, &mut calls)? {
            Prepared::Ready(attempt) => attempt,
            Prepared::Failed {
                result,
                attempts,
                config,
            } => return Ok(JobReport::new(result, calls, config, attempts)),
        };
        let (result, status) = self.run_stages(job, &attempt, &mut calls, before_stage)?;
        self.cleanup(&attempt, job, status, &mut calls, before_stage)?;
        Ok(JobReport::new(
            result,
            calls,
            Some(attempt.config),
            attempt.number,
        ))
    }
}
