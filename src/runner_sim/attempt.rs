//! One prepare attempt's context and the environment of every call made in it,
//! composed in the runner's order (later entries win): the runner process's
//! own environment, the contract variables, config's `job_env`, then the job's
//! variables as `CUSTOM_ENV_*` with `CI_BUILDS_DIR`, `CI_PROJECT_DIR` and
//! `CI_JOB_STATUS` as the runner sets them at that point.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::contract::{self, var, ConfigOutput, JobStatus};

use super::{Runner, SimJob};

/// The per-attempt temp dir and what config told the runner in it.
pub(super) struct Attempt {
    /// 1-based attempt number, for the calls' names (`prepare#2`).
    pub number: u32,
    pub dir: PathBuf,
    pub config: ConfigOutput,
}

impl Attempt {
    pub fn builds_dir(&self) -> &str {
        self.config.builds_dir.as_deref().unwrap_or("")
    }

    /// `CI_PROJECT_DIR` for an unshared builds dir (dormant always says unshared).
    pub fn project_dir(&self, job: &SimJob) -> String {
        format!("{}/{}", self.builds_dir(), job.project_path)
    }

    pub fn response_file(&self) -> PathBuf {
        self.dir.join(contract::RESPONSE_FILE_NAME)
    }

    pub fn exit_code_file(&self) -> PathBuf {
        self.dir.join(contract::BUILD_EXIT_CODE_FILE_NAME)
    }

    /// The job's exit code the driver wrote after a build failure.
    pub fn read_exit_code(&self) -> Option<i32> {
        read_exit_code(&self.exit_code_file())
    }
}

fn read_exit_code(file: &Path) -> Option<i32> {
    std::fs::read_to_string(file)
        .ok()?
        .lines()
        .next()?
        .trim()
        .parse()
        .ok()
}

impl Runner {
    /// The environment of a call after config (prepare, run stages, cleanup).
    pub(super) fn call_env(
        &self,
        attempt: &Attempt,
        job: &SimJob,
        status: JobStatus,
    ) -> BTreeMap<String, String> {
        let mut env = self.runner_env(&attempt.dir);
        env.extend(attempt.config.job_env.clone());
        self.add_job_variables(&mut env, job, status);
        env.insert(custom(var::CI_BUILDS_DIR), attempt.builds_dir().to_string());
        env.insert(custom(var::CI_PROJECT_DIR), attempt.project_dir(job));
        env
    }

    /// The environment of config: no `job_env` yet, and the builds and project
    /// dirs of the previous attempt (empty on the first).
    pub(super) fn config_env(
        &self,
        dir: &Path,
        job: &SimJob,
        previous: Option<&Attempt>,
    ) -> BTreeMap<String, String> {
        let mut env = self.runner_env(dir);
        self.add_job_variables(&mut env, job, JobStatus::Running);
        let (builds, project) = previous
            .map(|a| (a.builds_dir().to_string(), a.project_dir(job)))
            .unwrap_or_default();
        env.insert(custom(var::CI_BUILDS_DIR), builds);
        env.insert(custom(var::CI_PROJECT_DIR), project);
        env
    }

    /// The runner process's own environment plus the contract's variables.
    fn runner_env(&self, dir: &Path) -> BTreeMap<String, String> {
        let mut env = self.env.clone();
        let path = |name: &str| dir.join(name).display().to_string();
        env.insert(var::TMPDIR.into(), dir.display().to_string());
        env.insert(
            var::BUILD_FAILURE_EXIT_CODE.into(),
            contract::DEFAULT_BUILD_FAILURE_EXIT_CODE.to_string(),
        );
        env.insert(
            var::SYSTEM_FAILURE_EXIT_CODE.into(),
            contract::DEFAULT_SYSTEM_FAILURE_EXIT_CODE.to_string(),
        );
        env.insert(
            var::BUILD_EXIT_CODE_FILE.into(),
            path(contract::BUILD_EXIT_CODE_FILE_NAME),
        );
        env.insert(
            var::JOB_RESPONSE_FILE.into(),
            path(contract::RESPONSE_FILE_NAME),
        );
        env
    }

    fn add_job_variables(
        &self,
        env: &mut BTreeMap<String, String>,
        job: &SimJob,
        status: JobStatus,
    ) {
        for (k, v) in job.variables(&self.runner_id, &self.job_token) {
            env.insert(custom(&k), v);
        }
        env.insert(custom(var::CI_JOB_STATUS), status.as_str().into());
    }
}

fn custom(name: &str) -> String {
    format!("{}{name}", var::CUSTOM_ENV_PREFIX)
}
