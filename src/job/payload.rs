//! The job payload (`JOB_RESPONSE_FILE`) read into [`JobInput`], with the
//! `DORMANT_*` / `CI_SUSPEND*` job variables as the fallback GitLab versions
//! without `suspend_options` need.
//!
//! [`JobInput::from_payload`] is pure (text and variables in, typed input out),
//! so tests and the fuzz targets feed it directly. GitLab Runner writes the
//! payload from typed Go structs: the root is an object, ids are numbers,
//! `suspend_options` is an object of two booleans and a string. Anything else
//! was not written by GitLab Runner and is refused naming the field, instead
//! of being read as something the job never asked for (`[true]` is not
//! "suspend on success"). Messages name fields and types, never the payload's
//! values: the file holds the job token and masked variables.

use anyhow::{bail, Context, Result};
use serde_json::{Map, Value};

use super::Job;
use crate::text::quoted;

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

/// Says what to do about a payload GitLab Runner would not have written.
const NOT_FROM_THE_RUNNER: &str = "GitLab Runner never writes that: dormant must be called by \
     GitLab Runner as a custom executor (or through `dormant try`), which writes this file";

/// One JSON object of the payload and where it sits (`suspend_options`).
struct Obj<'a> {
    path: &'a str,
    map: &'a Map<String, Value>,
}

/// The JSON type of a value, for messages (never the value: it may be a secret).
fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

impl<'a> Obj<'a> {
    fn field_name(&self, name: &str) -> String {
        if self.path.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.path)
        }
    }

    /// The field's value; absent and `null` are the same (Go writes nil as null).
    fn get(&self, name: &str) -> Option<&'a Value> {
        self.map.get(name).filter(|v| !v.is_null())
    }

    fn wrong(&self, name: &str, want: &str, got: &Value) -> anyhow::Error {
        anyhow::anyhow!(
            "`{}` is {}, not {want}: {NOT_FROM_THE_RUNNER}",
            self.field_name(name),
            type_name(got)
        )
    }

    fn obj(&self, name: &str, path: &'a str) -> Result<Option<Obj<'a>>> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Object(map)) => Ok(Some(Obj { path, map })),
            Some(v) => Err(self.wrong(name, "an object", v)),
        }
    }

    fn id(&self, name: &str) -> Result<Option<u64>> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(Some)
                .ok_or_else(|| self.wrong(name, "a whole number of at least 0", v)),
        }
    }

    fn string(&self, name: &str) -> Result<Option<&'a str>> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.wrong(name, "a string", v)),
        }
    }

    fn boolean(&self, name: &str) -> Result<Option<bool>> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.wrong(name, "true or false", v)),
        }
    }

    fn array(&self, name: &str) -> Result<&'a [Value]> {
        match self.get(name) {
            None => Ok(&[]),
            Some(Value::Array(a)) => Ok(a),
            Some(v) => Err(self.wrong(name, "an array", v)),
        }
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
            bail!("the file is empty: {NOT_FROM_THE_RUNNER}");
        }
        // serde_json's syntax errors say where, never quote the text, so no
        // secret can leak through them.
        let value: Value = serde_json::from_str(text)
            .map_err(|e| anyhow::anyhow!("not a valid job payload: {e}"))?;
        let Value::Object(map) = &value else {
            bail!(
                "not a valid job payload: it is {}, not a JSON object: {NOT_FROM_THE_RUNNER}",
                type_name(&value)
            );
        };
        let root = Obj { path: "", map };
        let info = root.obj("job_info", "job_info")?;
        let image = root.obj("image", "image")?;
        let options = root.obj("suspend_options", "suspend_options")?;

        let job_id = match root.id("id")? {
            Some(id) => id,
            None => parse_id(job.var("CI_JOB_ID"), "CI_JOB_ID")?
                .context("no job id: neither the payload's `id` nor CI_JOB_ID is set")?,
        };
        let project_id = match info.as_ref().map(|i| i.id("project_id")).transpose()?.flatten() {
            Some(id) => id,
            None => parse_id(job.var("CI_PROJECT_ID"), "CI_PROJECT_ID")?.context(
                "no project id: neither the payload's `job_info.project_id` nor CI_PROJECT_ID is set",
            )?,
        };
        let project_path = match &info {
            Some(i) => i.string("project_full_path")?,
            None => None,
        };
        let (payload_runner_id, job_url) = known_variables(root.array("variables")?)?;
        let job_url = job_url.or_else(|| {
            job.var("CI_JOB_URL")
                .filter(|v| !v.is_empty())
                .map(String::from)
        });
        let image = match &image {
            Some(i) => i.string("name")?,
            None => None,
        };
        let suspend = match options {
            Some(opts) => {
                let key = |name| -> Result<Option<String>> {
                    Ok(opts
                        .string(name)?
                        .filter(|k| !k.trim().is_empty())
                        .map(str::to_string))
                };
                let runtime_key = key("runtime_environment_key")?;
                // The spelling of runner releases 19.0–19.3.
                let older_key = key("environment_key")?;
                SuspendRequest {
                    on_success: opts.boolean("suspend_on_success")?.unwrap_or(false),
                    on_failure: opts.boolean("suspend_on_failure")?.unwrap_or(false),
                    resume_key: runtime_key.or(older_key),
                    source: "the job payload's suspend_options",
                }
            }
            None => suspend_from_variables(job)?,
        };
        Ok(JobInput {
            job_id,
            project_id,
            project_path: project_path.filter(|p| !p.is_empty()).map(str::to_string),
            payload_runner_id,
            image: image.filter(|n| !n.trim().is_empty()).map(str::to_string),
            suspend,
            job_url,
        })
    }
}

/// `CI_RUNNER_ID` and `CI_JOB_URL` from the payload's `variables`, each
/// checked to be the `{key, value, ...}` object GitLab Runner writes.
fn known_variables(variables: &[Value]) -> Result<(Option<String>, Option<String>)> {
    let mut found = None;
    let mut url = None;
    for (i, v) in variables.iter().enumerate() {
        let path = format!("variables[{i}]");
        let Value::Object(map) = v else {
            bail!(
                "`{path}` is {}, not an object: {NOT_FROM_THE_RUNNER}",
                type_name(v)
            );
        };
        let var = Obj { path: &path, map };
        let key = var.string("key")?;
        let value = var.string("value")?;
        let value = value.filter(|v| !v.is_empty()).map(str::to_string);
        match key {
            Some("CI_RUNNER_ID") if found.is_none() => found = value,
            Some("CI_JOB_URL") if url.is_none() => url = value,
            _ => {}
        }
    }
    Ok((found, url))
}

fn parse_id(value: Option<&str>, name: &str) -> Result<Option<u64>> {
    match value.map(str::trim).filter(|v| !v.is_empty()) {
        None => Ok(None),
        Some(v) => v
            .parse()
            .map(Some)
            .map_err(|_| anyhow::anyhow!("job variable {name}={} is not a number", quoted(v))),
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
        _ => bail!(
            "job variable {name}={} is not a boolean: use true or false",
            quoted(value.trim())
        ),
    }
}

#[cfg(test)]
mod tests;
