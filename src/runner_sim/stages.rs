//! The run stages of a prepared job: the sequence comes from the contract
//! ([`StageSequence`]); this writes each stage's script the way the runner
//! does and calls `run_exec <script> <stage>` for it.

use anyhow::Result;

use crate::contract::{stage, JobEnd, JobStatus, StageExit, StageSequence};
use crate::text::shell_quote;

use super::attempt::Attempt;
use super::process::{self, CallSpec};
use super::report::{Call, JobResult};
use super::{Runner, SimJob};

impl Runner {
    /// Runs the job's stages; returns its result and the status cleanup sees.
    pub(super) fn run_stages(
        &self,
        job: &SimJob,
        attempt: &Attempt,
        calls: &mut Vec<Call>,
        before_stage: &mut dyn FnMut(&str),
    ) -> Result<(JobResult, JobStatus)> {
        let mut exit_code = None;
        let end = sequence(job).run(|name, status| {
            before_stage(name);
            let call = self.run_stage(job, attempt, name, status)?;
            let exit = if job.cancel_after(name).is_some() {
                StageExit::Canceled
            } else if call.exit_code == 0 {
                StageExit::Ok
            } else if call.exit_code == crate::contract::DEFAULT_BUILD_FAILURE_EXIT_CODE {
                // The job's exit code is the one of its first failure.
                if exit_code.is_none() {
                    exit_code = Some(attempt.read_exit_code());
                }
                StageExit::BuildFailure
            } else {
                StageExit::SystemFailure
            };
            calls.push(call);
            anyhow::Ok(exit)
        })?;
        let result = match end {
            JobEnd::Success => JobResult::Success,
            JobEnd::BuildFailure => JobResult::BuildFailure(exit_code.flatten()),
            JobEnd::SystemFailure => JobResult::SystemFailure,
            JobEnd::Canceled => JobResult::Canceled,
        };
        Ok((result, end.status()))
    }

    fn run_stage(
        &self,
        job: &SimJob,
        attempt: &Attempt,
        name: &str,
        status: JobStatus,
    ) -> Result<Call> {
        let script = attempt.dir.join(format!("script-{name}"));
        std::fs::write(&script, self.stage_script(job, attempt, name))?;
        let env = self.call_env(attempt, job, status);
        let mut args = self.args.clone();
        args.extend(["run".into(), script.display().to_string(), name.into()]);
        let (call, _) = process::call(
            name,
            CallSpec {
                binary: &self.binary,
                args,
                dir: &attempt.dir,
                env: &env,
                capture_stdout: false,
                cancel_after: job.cancel_after(name),
                force_kill: job.force_kill,
                kill_at: job.kill_at(name),
                ignore_sighup: self.ignore_sighup,
            },
        )?;
        Ok(call)
    }

    /// A stage script shaped like the runner's: self-contained bash that
    /// traps TERM, exports the job variables (not in prepare_script), works in
    /// the project dir (not prepare_script), and ends with `exit 0`.
    fn stage_script(&self, job: &SimJob, attempt: &Attempt, name: &str) -> String {
        let project_dir = attempt.project_dir(job);
        let mut s = String::from("#!/usr/bin/env bash\ntrap 'exit 1' TERM\nset -eo pipefail\n");
        if stage::exports_job_variables(name) {
            for (k, v) in job.variables(&self.runner_id, &self.job_token) {
                s.push_str(&format!("export {k}={}\n", shell_quote(&v)));
            }
            s.push_str(&format!(
                "export CI_PROJECT_DIR={}\n",
                shell_quote(&project_dir)
            ));
        }
        if name != stage::PREPARE_SCRIPT {
            s.push_str(&format!(
                "mkdir -p {0}\ncd {0}\n",
                shell_quote(&project_dir)
            ));
        }
        s.push_str(&body(job, name));
        s.push_str("\nexit 0\n");
        s
    }
}

/// The stages this job has, in the runner's order.
fn sequence(job: &SimJob) -> StageSequence {
    let names = |list: &[&str]| list.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let mut setup = names(&[stage::PREPARE_SCRIPT, stage::GET_SOURCES]);
    let mut on_success = Vec::new();
    let mut on_failure = Vec::new();
    if job.cache_stages {
        setup.push(stage::RESTORE_CACHE.into());
        on_success.push(stage::ARCHIVE_CACHE.to_string());
        on_failure.push(stage::ARCHIVE_CACHE_ON_FAILURE.to_string());
    }
    on_success.push(stage::CLEANUP_FILE_VARIABLES.to_string());
    on_failure.push(stage::CLEANUP_FILE_VARIABLES.to_string());
    StageSequence {
        setup,
        steps: job.steps.iter().map(|(name, _)| name.clone()).collect(),
        after_script: job.after_script.is_some(),
        finish_on_success: on_success,
        finish_on_failure: on_failure,
    }
}

/// What a stage does: the job's own body for its steps, `get_sources` and
/// `after_script`; a line saying it is simulated for cache stages.
fn body(job: &SimJob, name: &str) -> String {
    match name {
        stage::GET_SOURCES => job.get_sources.clone(),
        stage::AFTER_SCRIPT => job.after_script.clone().unwrap_or_default(),
        stage::RESTORE_CACHE => "echo restoring cache (simulated)".into(),
        stage::ARCHIVE_CACHE | stage::ARCHIVE_CACHE_ON_FAILURE => {
            "echo archiving cache (simulated)".into()
        }
        _ => job
            .steps
            .iter()
            .find(|(step, _)| step == name)
            .map(|(_, body)| body.clone())
            .unwrap_or_else(|| "true".into()),
    }
}
