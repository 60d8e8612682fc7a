//! The job as GitLab Runner hands it to a custom executor: the driver's
//! environment (read once, at the edge) and the trusted `JOB_RESPONSE_FILE`.
//!
//! `CUSTOM_ENV_*` variables are the job's variables and therefore untrusted: a
//! job can set any of them. The job's identity (job id, project id) is taken
//! from the response file first. The response file holds secrets (the job
//! token, masked variables): only the fields below are read, and nothing from
//! it is written to state or logs.

mod payload;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

pub use payload::{parse_bool, JobInput, SuspendRequest};

use crate::contract::var;
use crate::exit::ExitCodes;

/// The driver's environment, as the runner composed it.
#[derive(Debug, Clone, Default)]
pub struct Job {
    env: BTreeMap<String, String>,
}

impl Job {
    /// The only place dormant reads its process environment.
    pub fn from_env() -> Self {
        Job::from_map(
            std::env::vars_os()
                .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?))),
        )
    }

    pub fn from_map<K: Into<String>, V: Into<String>>(
        vars: impl IntoIterator<Item = (K, V)>,
    ) -> Self {
        Job {
            env: vars
                .into_iter()
                .map(|(k, v)| (k.into(), v.into()))
                .collect(),
        }
    }

    /// A variable of the driver's own environment (runner process, `job_env`).
    pub fn driver_var(&self, name: &str) -> Option<&str> {
        self.env.get(name).map(String::as_str)
    }

    /// A job variable (`CUSTOM_ENV_<name>`). Untrusted.
    pub fn var(&self, name: &str) -> Option<&str> {
        self.env
            .get(&format!("{}{name}", var::CUSTOM_ENV_PREFIX))
            .map(String::as_str)
    }

    /// The job's `DORMANT_*` variables (an instance type a job may pick through
    /// an allow-list, ...). Only these reach providers: other variables may be secret.
    pub fn job_variables(&self) -> BTreeMap<String, String> {
        self.env
            .iter()
            .filter_map(|(k, v)| k.strip_prefix(var::CUSTOM_ENV_PREFIX).map(|k| (k, v)))
            .filter(|(k, _)| k.starts_with("DORMANT_"))
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect()
    }

    pub fn exit_codes(&self) -> ExitCodes {
        ExitCodes::from_lookup(|k| self.driver_var(k).map(str::to_string))
    }

    pub fn build_exit_code_file(&self) -> Option<PathBuf> {
        self.driver_var(var::BUILD_EXIT_CODE_FILE)
            .filter(|s| !s.is_empty())
            .map(PathBuf::from)
    }

    /// The runner's per-job temp dir: deleted after cleanup, never durable storage.
    pub fn runner_tmpdir(&self) -> Option<PathBuf> {
        self.driver_var(var::TMPDIR)
            .filter(|s| !s.is_empty())
            .map(PathBuf::from)
    }

    /// Reads and parses `JOB_RESPONSE_FILE`.
    pub fn input(&self) -> Result<JobInput> {
        let path = self
            .driver_var(var::JOB_RESPONSE_FILE)
            .filter(|s| !s.is_empty())
            .context(
                "JOB_RESPONSE_FILE is not set: dormant must be called by GitLab Runner as a \
             custom executor (see examples/config.toml), or through `dormant try`",
            )?;
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the job payload JOB_RESPONSE_FILE {path}"))?;
        JobInput::from_payload(&text, self)
            .with_context(|| format!("in the job payload JOB_RESPONSE_FILE {path}"))
    }

    /// `CI_JOB_STATUS` as the runner last set it (`running`, `success`, `failed`, ...).
    pub fn job_status(&self) -> Option<&str> {
        self.var(var::CI_JOB_STATUS).filter(|s| !s.is_empty())
    }
}

/// Reads a file the runner placed next to its config (e.g. `.runner_system_id`).
pub fn read_trimmed(path: &Path) -> Result<Option<String>> {
    match std::fs::read_to_string(path) {
        Ok(s) => Ok(Some(s.trim().to_string()).filter(|s| !s.is_empty())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}
