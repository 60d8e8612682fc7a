//! The job payload (`JOB_RESPONSE_FILE`) read into [`JobInput`], with the
//! `DORMANT_*` / `CI_SUSPEND*` job variables filling in the suspension
//! triggers and the key where the payload leaves them unset.
//!
//! [`JobInput::from_payload`] is pure (text and variables in, typed input out),
//! so tests and the fuzz targets feed it directly. GitLab Runner writes the
//! payload from typed Go structs: the root is an object, ids are numbers,
//! `suspend_options` is an object of two booleans and a string. Anything else
//! was not written by GitLab Runner and is refused naming the field, instead
//! of being read as something the job never asked for (`[true]` is not
//! "suspend on success"). Messages name fields and types, never the payload's
//! values: the file holds the job token and masked variables.
//!
//! Go's `omitempty` never omits a struct, so every payload a real runner writes
//! carries `"suspend_options": {}` even when nothing is set: an empty object
//! sets nothing, and each trigger and the key are taken field by field (see
//! [`suspend_request`] and docs/guide/keys.md).
//!
//! The job's identity (job id, project id, runner id) comes from the payload
//! only: a job can set any `CI_*` variable itself, and the project id is what
//! stops another project's job from resuming an environment.

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
    /// Where the request came from, for the job log ("the job payload's
    /// suspend_options", "the DORMANT_* job variables", or both).
    pub source: String,
    /// Where the key came from (`suspend_options.runtime_environment_key`,
    /// `DORMANT_ENVIRONMENT_KEY`, ...), for a refusal that names it.
    pub key_from: &'static str,
    /// Trigger variables the payload's own field made unused while they said
    /// otherwise, one line each for the job log.
    pub overridden: Vec<String>,
    /// A trigger variable that is not a boolean: job input, so prepare refuses
    /// the job with this message (a build failure, never retried). Kept here
    /// instead of failing the parse so that config and cleanup still run.
    pub invalid: Option<String>,
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

        let job_id = root.id("id")?;
        let project_id = info.as_ref().map(|i| i.id("project_id")).transpose()?;
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
        let suspend = suspend_request(options.as_ref(), job)?;
        // Only from the payload (after every field's type is checked): a job
        // can set CI_JOB_ID and CI_PROJECT_ID itself, and the project id says
        // whose environments a key may resume.
        let job_id = job_id.with_context(|| {
            format!("the job payload has no job id (`id`): {NOT_FROM_THE_RUNNER}")
        })?;
        let project_id = project_id.flatten().with_context(|| {
            format!(
                "the job payload has no project id (`job_info.project_id`): {NOT_FROM_THE_RUNNER}"
            )
        })?;
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

/// One trigger or the key: its payload field, its `DORMANT_*` variable and
/// the name GitLab Runner's first implementation used.
struct Field {
    payload: &'static [&'static str],
    dormant: &'static str,
    legacy: &'static str,
}

const ON_SUCCESS: Field = Field {
    payload: &["suspend_on_success"],
    dormant: DORMANT_VARS[0],
    legacy: LEGACY_VARS[0],
};
const ON_FAILURE: Field = Field {
    payload: &["suspend_on_failure"],
    dormant: DORMANT_VARS[1],
    legacy: LEGACY_VARS[1],
};
/// `environment_key` is the spelling of runner releases 19.0–19.3.
const KEY: Field = Field {
    payload: &["runtime_environment_key", "environment_key"],
    dormant: DORMANT_VARS[2],
    legacy: LEGACY_VARS[2],
};

const FROM_PAYLOAD: &str = "the job payload's suspend_options";
const FROM_DORMANT_VARS: &str = "the DORMANT_* job variables";
const FROM_LEGACY_VARS: &str = "the CI_SUSPEND* job variables";

/// What the job asks for, field by field: each trigger and the key from the
/// payload's `suspend_options` where it sets them, else from the variables
/// (`DORMANT_*` first, then the legacy names). A runner writes
/// `"suspend_options": {}` when nothing is set, and false or empty inner
/// fields are left out, so an empty object sets nothing. A field the payload
/// carries wins over a variable that says otherwise (noted in `overridden`).
///
/// Every trigger variable that is set must be a boolean, used or not: a
/// typo is refused by prepare rather than silently read as "no".
fn suspend_request(options: Option<&Obj<'_>>, job: &Job) -> Result<SuspendRequest> {
    let var = |name: &'static str| {
        job.var(name)
            .map(str::trim)
            .filter(|v| !v.is_empty())
            .map(|v| (name, v))
    };
    let from_vars = |f: &Field| var(f.dormant).or_else(|| var(f.legacy));
    let mut used = Vec::new();
    let mut note = |from: &'static str| {
        if !used.contains(&from) {
            used.push(from);
        }
    };
    let var_origin = |name: &str| {
        if name.starts_with("CI_") {
            FROM_LEGACY_VARS
        } else {
            FROM_DORMANT_VARS
        }
    };

    let mut problems = Vec::new();
    let mut overridden = Vec::new();
    let mut flag = |f: &Field| -> Result<bool> {
        // Validate every variable of this trigger, even one that goes unused.
        let mut from_var = None;
        for name in [f.dormant, f.legacy] {
            if let Some((name, v)) = var(name) {
                match parse_bool(name, v) {
                    Ok(b) => from_var = from_var.or(Some((name, b))),
                    Err(e) => problems.push(format!("{e:#}")),
                }
            }
        }
        let from_payload = match options {
            Some(o) => o.boolean(f.payload[0])?,
            None => None,
        };
        Ok(match (from_payload, from_var) {
            (Some(p), var) => {
                note(FROM_PAYLOAD);
                if let Some((name, b)) = var.filter(|(_, b)| *b != p) {
                    overridden.push(format!(
                        "job variable {name}={b} is not used: the job payload's \
                         suspend_options.{} says {p}, and the payload wins",
                        f.payload[0]
                    ));
                }
                p
            }
            (None, Some((name, b))) => {
                note(var_origin(name));
                b
            }
            (None, None) => false,
        })
    };
    let on_success = flag(&ON_SUCCESS)?;
    let on_failure = flag(&ON_FAILURE)?;

    let mut payload_key = None;
    if let Some(o) = options {
        for name in KEY.payload {
            let k = o.string(name)?.map(str::trim).filter(|k| !k.is_empty());
            if payload_key.is_none() {
                payload_key = k.map(|k| (*name, k));
            }
        }
    }
    let (resume_key, key_from) = match (payload_key, from_vars(&KEY)) {
        (Some((name, k)), _) => {
            note(FROM_PAYLOAD);
            let from = if name == "environment_key" {
                "suspend_options.environment_key"
            } else {
                "suspend_options.runtime_environment_key"
            };
            (Some(k.to_string()), from)
        }
        (None, Some((name, k))) => {
            note(var_origin(name));
            (Some(k.to_string()), name)
        }
        (None, None) => (None, ""),
    };
    let source = if used.is_empty() {
        "nothing (no trigger or key in the job payload or the job variables)".to_string()
    } else {
        used.join(" and ")
    };
    Ok(SuspendRequest {
        on_success,
        on_failure,
        resume_key,
        source,
        key_from,
        overridden,
        // One line each: every line of a message stays short.
        invalid: (!problems.is_empty()).then(|| problems.join("\n")),
    })
}

/// Parses a boolean job variable the way GitLab users write them.
pub fn parse_bool(name: &str, value: &str) -> Result<bool> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" | "" => Ok(false),
        _ => bail!(
            "job variable {name}={} is not a boolean: set it to true or false \
             (1/0, yes/no and on/off are read too), or remove it",
            quoted(value.trim())
        ),
    }
}

#[cfg(test)]
mod tests;
