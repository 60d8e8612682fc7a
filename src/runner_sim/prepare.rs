//! The runner's preparation: config then prepare, in a fresh temp dir per
//! attempt, up to three attempts. After every failed attempt the runner calls
//! cleanup (so the driver must cope with a half-done prepare), then waits and
//! starts over; a build failure or a cancel stops at once.

use anyhow::{bail, Result};

use crate::contract::{self, ConfigOutput, JobStatus};

use super::attempt::Attempt;
use super::process::{self, CallSpec};
use super::report::{Call, JobResult};
use super::{Runner, SimJob};

/// How the preparation ended.
pub(super) enum Prepared {
    /// prepare succeeded in this attempt: the stages run next.
    Ready(Attempt),
    /// The job ends here (cleanup of the last attempt already ran).
    Failed {
        result: JobResult,
        attempts: u32,
        config: Option<ConfigOutput>,
    },
}

impl Runner {
    pub(super) fn prepare_with_retries(
        &self,
        job: &SimJob,
        calls: &mut Vec<Call>,
    ) -> Result<Prepared> {
        let mut previous: Option<Attempt> = None;
        for number in 1..=contract::PREPARE_ATTEMPTS {
            if number > 1 {
                std::thread::sleep(self.retry_pause);
            }
            let mut attempt = Attempt {
                number,
                dir: process::temp_dir(&self.tmp_root)?,
                config: ConfigOutput::default(),
            };
            std::fs::write(
                attempt.response_file(),
                format!(
                    "{}\n",
                    job.payload_with_masked_variables(&self.runner_id, &self.job_token)
                ),
            )?;
            let config = self.config(job, number, &attempt.dir, previous.as_ref(), calls)?;
            attempt.config = config.clone().unwrap_or_default();
            let Some(config) = config else {
                // Bad config output counts as a failed attempt, like a failed prepare.
                // The next config still sees the last valid attempt's dirs.
                self.cleanup(&attempt, job, JobStatus::Running, calls, &mut |_| {})?;
                continue;
            };
            if config.builds_dir.as_deref().unwrap_or("").is_empty() {
                bail!("config printed no builds_dir: the runner fails the job as a configuration error");
            }
            let code = self.prepare(job, &attempt, calls)?;
            if code == 0 {
                return Ok(Prepared::Ready(attempt));
            }
            let failed = |result| Prepared::Failed {
                result,
                attempts: number,
                config: Some(config.clone()),
            };
            if code == contract::DEFAULT_BUILD_FAILURE_EXIT_CODE {
                let code = attempt.read_exit_code();
                self.cleanup(&attempt, job, JobStatus::Running, calls, &mut |_| {})?;
                return Ok(failed(JobResult::BuildFailure(code)));
            }
            self.cleanup(&attempt, job, JobStatus::Running, calls, &mut |_| {})?;
            if job.cancel_after("prepare").is_some() {
                return Ok(failed(JobResult::Canceled));
            }
            previous = Some(attempt);
        }
        Ok(Prepared::Failed {
            result: JobResult::SystemFailure,
            attempts: contract::PREPARE_ATTEMPTS,
            config: None,
        })
    }

    /// Calls config; its parsed output, or `None` if it failed or printed
    /// something the runner rejects.
    fn config(
        &self,
        job: &SimJob,
        number: u32,
        dir: &std::path::Path,
        previous: Option<&Attempt>,
        calls: &mut Vec<Call>,
    ) -> Result<Option<ConfigOutput>> {
        let env = self.config_env(dir, job, previous);
        let mut args = self.args.clone();
        args.push("config".into());
        let (call, stdout) = process::call(
            &format!("config#{number}"),
            CallSpec {
                binary: &self.binary,
                args,
                dir,
                env: &env,
                capture_stdout: true,
                cancel_after: None,
                force_kill: None,
                kill_at: None,
                ignore_sighup: self.ignore_sighup,
            },
        )?;
        let ok = call.exit_code == 0;
        calls.push(call);
        Ok(ok.then(|| ConfigOutput::parse(&stdout).ok()).flatten())
    }

    /// Calls prepare; returns its exit code.
    fn prepare(&self, job: &SimJob, attempt: &Attempt, calls: &mut Vec<Call>) -> Result<i32> {
        let env = self.call_env(attempt, job, JobStatus::Running);
        let mut args = self.args.clone();
        args.push("prepare".into());
        let (call, _) = process::call(
            &format!("prepare#{}", attempt.number),
            CallSpec {
                binary: &self.binary,
                args,
                dir: &attempt.dir,
                env: &env,
                capture_stdout: false,
                cancel_after: job.cancel_after("prepare"),
                force_kill: job.force_kill,
                kill_at: job.kill_at("prepare"),
                ignore_sighup: self.ignore_sighup,
            },
        )?;
        let code = call.exit_code;
        calls.push(call);
        Ok(code)
    }

    /// Calls cleanup (always, after every attempt that got past config's
    /// start), then deletes the attempt's temp dir as the runner does.
    pub(super) fn cleanup(
        &self,
        attempt: &Attempt,
        job: &SimJob,
        status: JobStatus,
        calls: &mut Vec<Call>,
        before_cleanup: &mut dyn FnMut(&str),
    ) -> Result<()> {
        before_cleanup("cleanup");
        let env = self.call_env(attempt, job, status);
        let mut args = self.args.clone();
        args.push("cleanup".into());
        let (call, _) = process::call(
            &format!("cleanup#{}", attempt.number),
            CallSpec {
                binary: &self.binary,
                args,
                dir: &attempt.dir,
                env: &env,
                capture_stdout: false,
                cancel_after: None,
                force_kill: None,
                kill_at: None,
                ignore_sighup: self.ignore_sighup,
            },
        )?;
        calls.push(call);
        if !self.keep_temp_dirs {
            let _ = std::fs::remove_dir_all(&attempt.dir);
        }
        Ok(())
    }
}
