//! The job as GitLab Runner hands it to a custom executor: the driver's
//! environment (read once, at the edge) and the trusted `JOB_RESPONSE_FILE`.
//!
//! `CUSTOM_ENV_*` variables are the job's variables and therefore untrusted: a
//! job can set any of them. The job's identity (job id, project id) is taken
//! from the response file first. The response file holds secrets (the job
//! token, masked variables): only the fields below are read, and nothing from
//! it is written to state or logs.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::Deserialize;

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
            .get(&format!("CUSTOM_ENV_{name}"))
            .map(String::as_str)
    }

    /// The job's `DORMANT_*` variables (an instance type a job may pick through
    /// an allow-list, ...). Only these reach providers: other variables may be secret.
    pub fn job_variables(&self) -> BTreeMap<String, String> {
        self.env
            .iter()
            .filter_map(|(k, v)| k.strip_prefix("CUSTOM_ENV_").map(|k| (k, v)))
            .filter(|(k, _)| k.starts_with("DORMANT_"))
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect()
    }

    pub fn exit_codes(&self) -> ExitCodes {
        ExitCodes::from_lookup(|k| self.driver_var(k).map(str::to_string))
    }

    pub fn build_exit_code_file(&self) -> Option<PathBuf> {
        self.driver_var("BUILD_EXIT_CODE_FILE")
            .filter(|s| !s.is_empty())
            .map(PathBuf::from)
    }

    /// The runner's per-job temp dir: deleted after cleanup, never durable storage.
    pub fn runner_tmpdir(&self) -> Option<PathBuf> {
        self.driver_var("TMPDIR")
            .filter(|s| !s.is_empty())
            .map(PathBuf::from)
    }

    /// Reads and parses `JOB_RESPONSE_FILE`.
    pub fn input(&self) -> Result<JobInput> {
        let path = self
            .driver_var("JOB_RESPONSE_FILE")
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
        self.var("CI_JOB_STATUS").filter(|s| !s.is_empty())
    }
}

/// What dormant needs to know about the job, from the payload and the variables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobInput {
    pub job_id: u64,
    pub project_id: u64,
    pub project_path: Option<String>,
    /// `CI_RUNNER_ID` as GitLab sent it in the payload's variables.
    pub payload_runner_id: Option<String>,
    /// The job's `image:`, if any.
    pub image: Option<String>,
    pub suspend: SuspendRequest,
    /// `CI_JOB_URL` (for the notify hook): from the payload's variables, else the job's.
    pub job_url: Option<String>,
}

/// What the job asks for: suspension triggers and a key to resume.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SuspendRequest {
    pub on_success: bool,
    pub on_failure: bool,
    pub resume_key: Option<String>,
    /// Where the request came from, for the job log.
    pub source: &'static str,
}

impl SuspendRequest {
    pub fn any_trigger(&self) -> bool {
        self.on_success || self.on_failure
    }
}

#[derive(Deserialize, Default)]
struct Payload {
    #[serde(default, deserialize_with = "lenient_u64")]
    id: Option<u64>,
    #[serde(default)]
    job_info: Option<JobInfo>,
    #[serde(default)]
    image: Option<Image>,
    #[serde(default)]
    suspend_options: Option<SuspendOptions>,
    #[serde(default)]
    variables: Option<Vec<Variable>>,
}

#[derive(Deserialize, Default)]
struct JobInfo {
    #[serde(default, deserialize_with = "lenient_u64")]
    project_id: Option<u64>,
    #[serde(default)]
    project_full_path: Option<String>,
}

#[derive(Deserialize, Default)]
struct Image {
    #[serde(default)]
    name: Option<String>,
}

#[derive(Deserialize, Default)]
struct SuspendOptions {
    #[serde(default)]
    suspend_on_success: Option<bool>,
    #[serde(default)]
    suspend_on_failure: Option<bool>,
    #[serde(default)]
    runtime_environment_key: Option<String>,
    /// The spelling of runner releases 19.0–19.3.
    #[serde(default)]
    environment_key: Option<String>,
}

#[derive(Deserialize)]
struct Variable {
    #[serde(default)]
    key: Option<String>,
    #[serde(default)]
    value: Option<String>,
}

/// GitLab sends ids as numbers; accept strings of digits too, and null.
fn lenient_u64<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Num {
        N(u64),
        S(String),
    }
    match Option::<Num>::deserialize(d)? {
        None => Ok(None),
        Some(Num::N(n)) => Ok(Some(n)),
        Some(Num::S(s)) => s
            .trim()
            .parse()
            .map(Some)
            .map_err(|_| serde::de::Error::custom(format!("{s:?} is not a number"))),
    }
}

const DORMANT_VARS: [&str; 3] = [
    "DORMANT_SUSPEND_ON_SUCCESS",
    "DORMANT_SUSPEND_ON_FAILURE",
    "DORMANT_ENVIRONMENT_KEY",
];
/// The names GitLab Runner's first implementation used; orchestrators may still set them.
const LEGACY_VARS: [&str; 3] = [
    "CI_SUSPEND_ON_SUCCESS",
    "CI_SUSPEND_ON_FAILURE",
    "CI_SUSPENDABLE_ENVIRONMENT_RESUME_KEY",
];

impl JobInput {
    /// Parses the payload text; `job` supplies the variables used as fallbacks.
    pub fn from_payload(text: &str, job: &Job) -> Result<JobInput> {
        if text.trim().is_empty() {
            bail!("the file is empty");
        }
        let payload: Payload = serde_json::from_str(text).map_err(|e| {
            // serde_json's message quotes no values, so no secret can leak here.
            anyhow::anyhow!("not a valid job payload: {e}")
        })?;
        let job_id = match payload.id {
            Some(id) => id,
            None => parse_id(job.var("CI_JOB_ID"), "CI_JOB_ID")?
                .context("no job id: neither the payload's `id` nor CI_JOB_ID is set")?,
        };
        let info = payload.job_info.unwrap_or_default();
        let project_id = match info.project_id {
            Some(id) => id,
            None => parse_id(job.var("CI_PROJECT_ID"), "CI_PROJECT_ID")?.context(
                "no project id: neither the payload's `job_info.project_id` nor CI_PROJECT_ID is set",
            )?,
        };
        let payload_var = |name: &str| {
            payload
                .variables
                .as_deref()
                .unwrap_or_default()
                .iter()
                .find(|v| v.key.as_deref() == Some(name))
                .and_then(|v| v.value.clone())
                .filter(|v| !v.is_empty())
        };
        let payload_runner_id = payload_var("CI_RUNNER_ID");
        let job_url = payload_var("CI_JOB_URL").or_else(|| {
            job.var("CI_JOB_URL")
                .filter(|v| !v.is_empty())
                .map(String::from)
        });
        let suspend = match payload.suspend_options {
            Some(opts) => SuspendRequest {
                on_success: opts.suspend_on_success.unwrap_or(false),
                on_failure: opts.suspend_on_failure.unwrap_or(false),
                resume_key: opts
                    .runtime_environment_key
                    .filter(|k| !k.trim().is_empty())
                    .or(opts.environment_key.filter(|k| !k.trim().is_empty())),
                source: "the job payload's suspend_options",
            },
            None => suspend_from_variables(job)?,
        };
        Ok(JobInput {
            job_id,
            project_id,
            project_path: info.project_full_path.filter(|p| !p.is_empty()),
            payload_runner_id,
            image: payload
                .image
                .and_then(|i| i.name)
                .filter(|n| !n.trim().is_empty()),
            suspend,
            job_url,
        })
    }
}

fn parse_id(value: Option<&str>, name: &str) -> Result<Option<u64>> {
    match value.map(str::trim).filter(|v| !v.is_empty()) {
        None => Ok(None),
        Some(v) => v
            .parse()
            .map(Some)
            .map_err(|_| anyhow::anyhow!("{name}={v:?} is not a number")),
    }
}

/// The variable fallback for GitLab versions that send no `suspend_options`:
/// `DORMANT_*` first, then the names of GitLab Runner's first implementation.
fn suspend_from_variables(job: &Job) -> Result<SuspendRequest> {
    let pick = |i: usize| -> Option<(&'static str, &str)> {
        [DORMANT_VARS[i], LEGACY_VARS[i]]
            .into_iter()
            .find_map(|name| {
                job.var(name)
                    .filter(|v| !v.trim().is_empty())
                    .map(|v| (name, v))
            })
    };
    let flag = |i: usize| -> Result<(bool, Option<&'static str>)> {
        match pick(i) {
            None => Ok((false, None)),
            Some((name, v)) => Ok((parse_bool(name, v)?, Some(name))),
        }
    };
    let (on_success, s1) = flag(0)?;
    let (on_failure, s2) = flag(1)?;
    let key = pick(2);
    let used_legacy = [s1, s2, key.map(|k| k.0)]
        .iter()
        .flatten()
        .any(|n| n.starts_with("CI_"));
    let used_any = s1.is_some() || s2.is_some() || key.is_some();
    Ok(SuspendRequest {
        on_success,
        on_failure,
        resume_key: key.map(|(_, v)| v.trim().to_string()),
        source: match (used_any, used_legacy) {
            (false, _) => "nothing (no suspend_options, no variables)",
            (true, false) => "the DORMANT_* job variables",
            (true, true) => "the CI_SUSPEND* job variables",
        },
    })
}

/// Parses a boolean job variable the way GitLab users write them.
pub fn parse_bool(name: &str, value: &str) -> Result<bool> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" | "" => Ok(false),
        other => bail!("job variable {name}={other:?} is not a boolean: use true or false"),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn job(vars: &[(&str, &str)]) -> Job {
        Job::from_map(
            vars.iter()
                .map(|(k, v)| (format!("CUSTOM_ENV_{k}"), v.to_string())),
        )
    }

    #[test]
    fn payload_fields_are_read() {
        let text = r#"{"id": 77, "token": "glcbt-secret", "job_info": {"project_id": 5, "project_full_path": "g/p"},
            "image": {"name": "ubuntu:24.04"},
            "variables": [{"key": "CI_RUNNER_ID", "value": "12", "public": true},
                          {"key": "CI_JOB_URL", "value": "https://gitlab.example.com/g/p/-/jobs/77", "public": true}],
            "suspend_options": {"suspend_on_success": true, "suspend_on_failure": null,
                                "runtime_environment_key": "12/s_x/env=abc"}}"#;
        let input = JobInput::from_payload(text, &Job::default()).unwrap();
        assert_eq!(input.job_id, 77);
        assert_eq!(input.project_id, 5);
        assert_eq!(input.payload_runner_id.as_deref(), Some("12"));
        assert_eq!(input.image.as_deref(), Some("ubuntu:24.04"));
        assert_eq!(
            input.job_url.as_deref(),
            Some("https://gitlab.example.com/g/p/-/jobs/77")
        );
        assert!(input.suspend.on_success && !input.suspend.on_failure);
        assert_eq!(input.suspend.resume_key.as_deref(), Some("12/s_x/env=abc"));
        assert!(!format!("{input:?}").contains("glcbt-secret"));
    }

    #[test]
    fn older_key_field_is_read() {
        let text = r#"{"id": 1, "job_info": {"project_id": 2}, "suspend_options": {"environment_key": "k/s/env=x"}}"#;
        let input = JobInput::from_payload(text, &Job::default()).unwrap();
        assert_eq!(input.suspend.resume_key.as_deref(), Some("k/s/env=x"));
        assert!(!input.suspend.any_trigger());
    }

    #[test]
    fn payload_options_win_over_variables() {
        let text = r#"{"id": 1, "job_info": {"project_id": 2}, "suspend_options": {}}"#;
        let j = job(&[("DORMANT_SUSPEND_ON_SUCCESS", "true")]);
        let input = JobInput::from_payload(text, &j).unwrap();
        assert!(!input.suspend.on_success);
    }

    #[test]
    fn variables_serve_without_suspend_options_dormant_names_first() {
        let text = r#"{"id": 1, "job_info": {"project_id": 2}, "suspend_options": null}"#;
        let j = job(&[
            ("DORMANT_SUSPEND_ON_FAILURE", "yes"),
            ("CI_SUSPEND_ON_SUCCESS", "true"),
            ("DORMANT_ENVIRONMENT_KEY", "a/b/env=1"),
            ("CI_SUSPENDABLE_ENVIRONMENT_RESUME_KEY", "legacy/b/env=2"),
        ]);
        let s = JobInput::from_payload(text, &j).unwrap().suspend;
        assert!(s.on_failure && s.on_success);
        assert_eq!(s.resume_key.as_deref(), Some("a/b/env=1"));
        let j = job(&[("CI_SUSPENDABLE_ENVIRONMENT_RESUME_KEY", "legacy/b/env=2")]);
        let s = JobInput::from_payload(text, &j).unwrap().suspend;
        assert_eq!(s.resume_key.as_deref(), Some("legacy/b/env=2"));
        assert_eq!(s.source, "the CI_SUSPEND* job variables");
    }

    #[test]
    fn bad_boolean_names_the_variable() {
        let text = r#"{"id": 1, "job_info": {"project_id": 2}}"#;
        let err = JobInput::from_payload(text, &job(&[("DORMANT_SUSPEND_ON_SUCCESS", "maybe")]))
            .unwrap_err();
        assert!(
            format!("{err:#}").contains("DORMANT_SUSPEND_ON_SUCCESS"),
            "{err:#}"
        );
    }

    #[test]
    fn ids_fall_back_to_variables_and_garbage_is_an_error() {
        let j = job(&[("CI_JOB_ID", "9"), ("CI_PROJECT_ID", "3")]);
        let input = JobInput::from_payload(r#"{"id": null, "job_info": null}"#, &j).unwrap();
        assert_eq!((input.job_id, input.project_id), (9, 3));
        assert!(JobInput::from_payload("{}", &Job::default()).is_err());
        let err = JobInput::from_payload("{not json", &Job::default()).unwrap_err();
        assert!(format!("{err:#}").contains("not a valid job payload"));
        assert!(JobInput::from_payload("  \n", &Job::default()).is_err());
        assert!(JobInput::from_payload(
            r#"{"id": "12", "job_info": {"project_id": "4"}}"#,
            &Job::default()
        )
        .is_ok());
    }
}
