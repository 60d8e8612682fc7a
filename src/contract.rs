//! GitLab Runner's custom-executor contract, as data: the variable names the
//! runner sets for a driver, the default exit codes, the shape of `config`'s
//! JSON output, the run stages with their order and skip rules, and the job
//! statuses. The driver side (`stages::config`, `exit`, `job`) and the
//! simulated runner (`runner_sim`) both use this one module, so the two cannot
//! drift apart. The prose version is `docs/runner-contract.md`.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

/// Environment variables the runner sets for every call of the driver.
pub mod var {
    /// Exit code for "the job's script failed" (today `1`).
    pub const BUILD_FAILURE_EXIT_CODE: &str = "BUILD_FAILURE_EXIT_CODE";
    /// Exit code for "the environment broke, not the job" (today `2`).
    pub const SYSTEM_FAILURE_EXIT_CODE: &str = "SYSTEM_FAILURE_EXIT_CODE";
    /// File whose first line the runner reports as the job's exit code after
    /// a build failure (the runner does not create it).
    pub const BUILD_EXIT_CODE_FILE: &str = "BUILD_EXIT_CODE_FILE";
    /// The job payload as GitLab sent it (JSON; holds secrets).
    pub const JOB_RESPONSE_FILE: &str = "JOB_RESPONSE_FILE";
    /// The runner's private per-job temp dir, deleted after cleanup.
    pub const TMPDIR: &str = "TMPDIR";
    /// Prefix of every job variable (`CUSTOM_ENV_CI_JOB_ID`, ...). Jobs can set
    /// variables with any name, so what follows the prefix is untrusted.
    pub const CUSTOM_ENV_PREFIX: &str = "CUSTOM_ENV_";
    /// Job variables (after the prefix) the runner itself maintains.
    pub const CI_JOB_STATUS: &str = "CI_JOB_STATUS";
    pub const CI_BUILDS_DIR: &str = "CI_BUILDS_DIR";
    pub const CI_PROJECT_DIR: &str = "CI_PROJECT_DIR";
}

/// The exit codes the runner has always passed; used when a variable is
/// missing (dormant run by hand) or garbled.
pub const DEFAULT_BUILD_FAILURE_EXIT_CODE: i32 = 1;
pub const DEFAULT_SYSTEM_FAILURE_EXIT_CODE: i32 = 2;

/// The runner tries prepare this many times when it fails with a system failure.
pub const PREPARE_ATTEMPTS: u32 = 3;
/// The runner's pause between two prepare attempts.
pub const PREPARE_RETRY_PAUSE: Duration = Duration::from_secs(3);

/// Names of the files the runner keeps in its per-job temp dir.
pub const TEMP_DIR_PREFIX: &str = "custom-executor";
pub const RESPONSE_FILE_NAME: &str = "response.json";
pub const BUILD_EXIT_CODE_FILE_NAME: &str = "build_exit_code";

/// What `config_exec` prints on stdout: one JSON object, every field optional,
/// unknown fields ignored by the runner.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConfigOutput {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub builds_dir: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_dir: Option<String>,
    /// `false`: `CI_PROJECT_DIR = <builds_dir>/<namespace>/<project>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub builds_dir_is_shared: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver: Option<DriverInfo>,
    /// Variables the runner passes, unprefixed, to the driver's later calls
    /// (not to the job's script).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub job_env: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shell: Option<String>,
}

/// Shown by the runner in the job log ("Using Custom executor with driver ...").
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriverInfo {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
}

impl ConfigOutput {
    /// The object as one line, as the driver must print it.
    pub fn to_line(&self) -> String {
        // Serializing a struct of strings, bools and a string map cannot fail.
        serde_json::to_string(self).expect("ConfigOutput serializes")
    }

    /// Parses `config_exec`'s stdout with the runner's rules: zero bytes mean
    /// "no config" (all defaults); otherwise exactly one JSON object, and
    /// whitespace-only output or text after the object is an error (which the
    /// runner treats like a failed prepare and retries).
    pub fn parse(stdout: &str) -> Result<ConfigOutput> {
        if stdout.is_empty() {
            return Ok(ConfigOutput::default());
        }
        if stdout.trim().is_empty() {
            bail!("config printed only whitespace");
        }
        let mut de = serde_json::Deserializer::from_str(stdout).into_iter::<serde_json::Value>();
        let value = de
            .next()
            .context("config printed nothing")?
            .context("config printed invalid JSON")?;
        let rest = &stdout[de.byte_offset()..];
        if !rest.trim().is_empty() {
            bail!("config printed text after its JSON: {rest:?}");
        }
        if !value.is_object() {
            bail!("config printed JSON that is not an object");
        }
        serde_json::from_value(value).context("config printed a field of the wrong type")
    }
}

/// Names of the run stages the runner calls `run_exec` with (any other name
/// must be accepted and run like the rest).
pub mod stage {
    pub const PREPARE_SCRIPT: &str = "prepare_script";
    pub const GET_SOURCES: &str = "get_sources";
    pub const CLEAR_WORKTREE: &str = "clear_worktree";
    pub const RESTORE_CACHE: &str = "restore_cache";
    pub const DOWNLOAD_ARTIFACTS: &str = "download_artifacts";
    /// The first user step (`step_script` renamed); later ones are `step_<name>`.
    pub const BUILD_SCRIPT: &str = "build_script";
    pub const STEP_PREFIX: &str = "step_";
    pub const AFTER_SCRIPT: &str = "after_script";
    pub const ARCHIVE_CACHE: &str = "archive_cache";
    pub const ARCHIVE_CACHE_ON_FAILURE: &str = "archive_cache_on_failure";
    pub const UPLOAD_ARTIFACTS_ON_SUCCESS: &str = "upload_artifacts_on_success";
    pub const UPLOAD_ARTIFACTS_ON_FAILURE: &str = "upload_artifacts_on_failure";
    pub const CLEANUP_FILE_VARIABLES: &str = "cleanup_file_variables";

    /// Whether `name` is one of the job's own steps (`script:` and `run:` steps).
    pub fn is_user_step(name: &str) -> bool {
        name == BUILD_SCRIPT || name.starts_with(STEP_PREFIX)
    }

    /// Whether the runner exports the job's variables in this stage's script
    /// (every stage but `prepare_script`).
    pub fn exports_job_variables(name: &str) -> bool {
        name != PREPARE_SCRIPT
    }
}

/// How one run stage ended, as the runner classifies the driver's exit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StageExit {
    Ok,
    /// `BUILD_FAILURE_EXIT_CODE`: the job's script failed.
    BuildFailure,
    /// `SYSTEM_FAILURE_EXIT_CODE`, any other code, or death by a signal.
    SystemFailure,
    /// The job was canceled (or timed out) while this stage ran.
    Canceled,
}

/// How the job ended, as the runner reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobEnd {
    Success,
    BuildFailure,
    SystemFailure,
    Canceled,
}

impl JobEnd {
    /// `CI_JOB_STATUS` from `after_script` on, and for cleanup.
    pub fn status(self) -> JobStatus {
        match self {
            JobEnd::Success => JobStatus::Success,
            JobEnd::Canceled => JobStatus::Canceled,
            JobEnd::BuildFailure | JobEnd::SystemFailure => JobStatus::Failed,
        }
    }
}

/// The run stages of one job, which the runner calls in this order. A stage
/// with nothing to do is left out (the runner skips it without a call); a
/// minimal job has `prepare_script`, `get_sources`, `build_script` and
/// `cleanup_file_variables`.
#[derive(Debug, Clone, Default)]
pub struct StageSequence {
    /// `prepare_script`, `get_sources`, `restore_cache`, `download_artifacts`:
    /// the first failure stops everything up to `after_script`.
    pub setup: Vec<String>,
    /// The job's steps (`build_script`, `step_<name>`), stopping at the first failure.
    pub steps: Vec<String>,
    /// Runs only if a step ran, with the final status; its result is ignored.
    pub after_script: bool,
    /// After a success (e.g. `archive_cache`, `upload_artifacts_on_success`,
    /// `cleanup_file_variables`); results ignored.
    pub finish_on_success: Vec<String>,
    /// After a failure (the `_on_failure` variants and `cleanup_file_variables`).
    pub finish_on_failure: Vec<String>,
}

impl StageSequence {
    /// Runs the stages with the runner's skip rules: `call(stage, status)`
    /// makes one call. A failure, a system failure or a cancel stops the setup
    /// stages and the steps; `after_script` (if a step ran) and the finishing
    /// stages for the outcome run all the same. This is a soft cancel; after a
    /// timeout or hard cancel the runner goes straight to cleanup.
    pub fn run<E>(
        &self,
        mut call: impl FnMut(&str, JobStatus) -> Result<StageExit, E>,
    ) -> Result<JobEnd, E> {
        let mut end = JobEnd::Success;
        let mut steps_ran = false;
        'groups: for (group, user) in [(&self.setup, false), (&self.steps, true)] {
            for stage in group {
                steps_ran |= user;
                end = match call(stage, JobStatus::Running)? {
                    StageExit::Ok => continue,
                    StageExit::BuildFailure => JobEnd::BuildFailure,
                    StageExit::SystemFailure => JobEnd::SystemFailure,
                    StageExit::Canceled => JobEnd::Canceled,
                };
                break 'groups;
            }
        }
        let status = end.status();
        if steps_ran && self.after_script {
            call(stage::AFTER_SCRIPT, status)?;
        }
        let finish = if end == JobEnd::Success {
            &self.finish_on_success
        } else {
            &self.finish_on_failure
        };
        for stage in finish {
            call(stage, status)?;
        }
        Ok(end)
    }
}

/// `CI_JOB_STATUS` as the runner sets it: `running` until just before
/// `after_script`, then the job's final status (also seen by cleanup).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobStatus {
    Running,
    Success,
    Failed,
    Canceled,
    TimedOut,
}

impl JobStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            JobStatus::Running => "running",
            JobStatus::Success => "success",
            JobStatus::Failed => "failed",
            JobStatus::Canceled => "canceled",
            JobStatus::TimedOut => "timedout",
        }
    }

    /// Reads the variable's value; `cancelled` is accepted as a spelling of
    /// `canceled`. Unknown values are `None`.
    pub fn parse(text: &str) -> Option<JobStatus> {
        Some(match text {
            "running" => JobStatus::Running,
            "success" => JobStatus::Success,
            "failed" => JobStatus::Failed,
            "canceled" | "cancelled" => JobStatus::Canceled,
            "timedout" => JobStatus::TimedOut,
            _ => return None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_output_round_trips_and_omits_unset_fields() {
        let out = ConfigOutput {
            builds_dir: Some("/b".into()),
            cache_dir: Some("/c".into()),
            builds_dir_is_shared: Some(false),
            driver: Some(DriverInfo {
                name: Some("dormant".into()),
                version: Some("1".into()),
            }),
            ..Default::default()
        };
        let line = out.to_line();
        assert!(
            !line.contains("hostname") && !line.contains("job_env"),
            "{line}"
        );
        assert_eq!(ConfigOutput::parse(&format!("{line}\n")).unwrap(), out);
    }

    #[test]
    fn config_output_is_parsed_with_the_runners_rules() {
        assert_eq!(ConfigOutput::parse("").unwrap(), ConfigOutput::default());
        for bad in [" \n", "{} x", "[1]", "{", r#"{"builds_dir": 3}"#] {
            assert!(ConfigOutput::parse(bad).is_err(), "{bad:?} accepted");
        }
        let c =
            ConfigOutput::parse(r#"{"builds_dir":"/b","unknown":1,"job_env":{"A":"1"}}"#).unwrap();
        assert_eq!(c.builds_dir.as_deref(), Some("/b"));
        assert_eq!(c.job_env.get("A").map(String::as_str), Some("1"));
    }

    fn sequence() -> StageSequence {
        let v = |s: &[&str]| s.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        StageSequence {
            setup: v(&["prepare_script", "get_sources"]),
            steps: v(&["build_script", "step_two"]),
            after_script: true,
            finish_on_success: v(&["archive_cache", "cleanup_file_variables"]),
            finish_on_failure: v(&["archive_cache_on_failure", "cleanup_file_variables"]),
        }
    }

    /// Runs the sequence with `exits` for the named stages (others succeed);
    /// returns the calls made (stage:status) and the end.
    fn run(exits: &[(&str, StageExit)]) -> (Vec<String>, JobEnd) {
        let mut calls = Vec::new();
        let end = sequence()
            .run::<()>(|stage, status| {
                calls.push(format!("{stage}:{}", status.as_str()));
                Ok(exits
                    .iter()
                    .find(|(s, _)| *s == stage)
                    .map(|(_, e)| *e)
                    .unwrap_or(StageExit::Ok))
            })
            .unwrap();
        (calls, end)
    }

    #[test]
    fn a_successful_job_runs_every_stage_in_order() {
        let (calls, end) = run(&[]);
        assert_eq!(end, JobEnd::Success);
        assert_eq!(
            calls,
            [
                "prepare_script:running",
                "get_sources:running",
                "build_script:running",
                "step_two:running",
                "after_script:success",
                "archive_cache:success",
                "cleanup_file_variables:success"
            ]
        );
    }

    #[test]
    fn a_failed_setup_stage_skips_the_steps_and_after_script() {
        let (calls, end) = run(&[("get_sources", StageExit::BuildFailure)]);
        assert_eq!(end, JobEnd::BuildFailure);
        assert_eq!(
            calls,
            [
                "prepare_script:running",
                "get_sources:running",
                "archive_cache_on_failure:failed",
                "cleanup_file_variables:failed"
            ]
        );
    }

    #[test]
    fn a_system_failure_in_a_step_still_runs_after_script_and_the_failure_stages() {
        let (calls, end) = run(&[("build_script", StageExit::SystemFailure)]);
        assert_eq!(end, JobEnd::SystemFailure);
        assert!(
            !calls.iter().any(|c| c.starts_with("step_two")),
            "{calls:?}"
        );
        assert!(
            calls.contains(&"after_script:failed".to_string()),
            "{calls:?}"
        );
        assert!(calls.contains(&"archive_cache_on_failure:failed".to_string()));
    }

    #[test]
    fn a_cancel_runs_after_script_and_the_failure_stages_as_canceled() {
        let (calls, end) = run(&[("build_script", StageExit::Canceled)]);
        assert_eq!(end, JobEnd::Canceled);
        assert_eq!(
            calls[3..],
            [
                "after_script:canceled",
                "archive_cache_on_failure:canceled",
                "cleanup_file_variables:canceled"
            ]
        );
    }

    #[test]
    fn stage_names_the_runner_treats_specially() {
        assert!(stage::is_user_step("build_script"));
        assert!(stage::is_user_step("step_lint"));
        assert!(!stage::is_user_step("after_script"));
        assert!(!stage::exports_job_variables("prepare_script"));
        assert!(stage::exports_job_variables("get_sources"));
    }

    #[test]
    fn job_status_reads_both_spellings_of_canceled() {
        for s in ["running", "success", "failed", "canceled", "timedout"] {
            assert_eq!(JobStatus::parse(s).unwrap().as_str(), s);
        }
        assert_eq!(JobStatus::parse("cancelled"), Some(JobStatus::Canceled));
        assert_eq!(JobStatus::parse("weird"), None);
    }
}
