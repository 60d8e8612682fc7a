//! The job payload (`JOB_RESPONSE_FILE`) exactly as GitLab Runner writes it:
//! the runner JSON-encodes its Go job struct, so the shape follows Go's rules,
//! not what a job happens to set. A simulator that writes a tidier payload
//! hides bugs about "absent" versus "empty" (issue: `suspend_options` was left
//! out when nothing was set, so dormant's variable fallback, which waited for
//! an absent field, passed here and failed under a real runner).
//!
//! Go's encoder, field by field (docs/runner-contract.md, "The job payload"):
//! - a struct-valued field is always written, `omitempty` or not: `job_info`,
//!   `git_info`, `runner_info`, `image`, `features`, `policy_options` and,
//!   from 19.0 on, `suspend_options` (`{}` when nothing is set);
//! - a nil slice is `null` (`services`, `artifacts`, `cache`, `credentials`,
//!   `dependencies`, `git_info.refspecs` when empty), unless the field is
//!   `omitempty`, then it is left out (`hooks`, `run`, `image.command`, ...);
//! - an `omitempty` bool, string or number that is false, empty or zero is
//!   left out (the fields inside `suspend_options`); a nil map with
//!   `omitempty` too (`secrets`); a nil pointer without it is `null`
//!   (`git_info.protected`).

use serde_json::{json, Map, Value};

/// A GitLab Runner release, for what its payload carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct RunnerVersion {
    pub major: u32,
    pub minor: u32,
}

impl RunnerVersion {
    /// The release the simulator stands in for by default.
    pub const SIMULATED: RunnerVersion = RunnerVersion::new(19, 4);

    pub const fn new(major: u32, minor: u32) -> Self {
        RunnerVersion { major, minor }
    }

    /// The payload's name for the resume key: releases 19.0–19.3 call it
    /// `environment_key`, 19.4 and later `runtime_environment_key`. Releases
    /// before 19.0 have no `suspend_options` at all.
    pub fn key_field(self) -> Option<&'static str> {
        if self < RunnerVersion::new(19, 0) {
            None
        } else if self < RunnerVersion::new(19, 4) {
            Some("environment_key")
        } else {
            Some("runtime_environment_key")
        }
    }
}

/// What GitLab set in a job's suspend options.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SuspendOptions {
    pub on_success: bool,
    pub on_failure: bool,
    pub key: Option<String>,
}

impl SuspendOptions {
    /// `suspend_options` as the runner encodes it: every inner field is
    /// `omitempty`, the struct itself always there. `None`: this release has
    /// no such field.
    pub fn encode(&self, version: RunnerVersion) -> Option<Value> {
        let key_field = version.key_field()?;
        let mut o = Map::new();
        if self.on_success {
            o.insert("suspend_on_success".into(), json!(true));
        }
        if self.on_failure {
            o.insert("suspend_on_failure".into(), json!(true));
        }
        if let Some(k) = self.key.as_deref().filter(|k| !k.is_empty()) {
            o.insert(key_field.into(), json!(k));
        }
        Some(Value::Object(o))
    }
}

/// One entry of `variables` (`{key, value, public, file, masked, raw}`: none
/// of them `omitempty`).
pub fn variable(key: &str, value: &str, public: bool, masked: bool) -> Value {
    json!({"key": key, "value": value, "public": public, "file": false,
           "masked": masked, "raw": false})
}

/// What a job contributes to its payload; the rest is what the runner's
/// struct holds for any job.
pub struct PayloadJob<'a> {
    pub id: u64,
    pub token: &'a str,
    pub project_id: u64,
    pub project_path: &'a str,
    pub image: Option<&'a str>,
    pub variables: Vec<Value>,
    pub suspend: &'a SuspendOptions,
}

/// The whole payload, as `json.Marshal` of the runner's job struct writes it.
pub fn encode(job: &PayloadJob<'_>, version: RunnerVersion) -> Value {
    let project_name = job.project_path.rsplit('/').next().unwrap_or("");
    let sha = "0".repeat(40);
    let mut p = json!({
        "id": job.id,
        "token": job.token,
        "allow_git_fetch": false,
        "job_info": {
            "name": "sim", "stage": "test",
            "project_id": job.project_id, "project_name": project_name,
            "project_full_path": job.project_path,
            "namespace_id": 0, "root_namespace_id": 0, "organization_id": 0,
            "instance_id": "", "instance_uuid": "", "user_id": 0,
            "time_in_queue_seconds": 0.0,
            "project_jobs_running_on_instance_runners_count": "0",
            "queue_size": 0, "queue_depth": 0,
        },
        "git_info": {
            "repo_url": format!("https://gitlab-ci-token:{}@example.invalid/{}.git",
                                job.token, job.project_path),
            "repo_object_format": "sha1", "ref": "main", "sha": sha, "before_sha": sha,
            "ref_type": "branch", "refspecs": null, "depth": 20, "protected": null,
        },
        "runner_info": {"timeout": 3600},
        "variables": job.variables,
        "steps": [{"name": "script", "script": ["echo simulated"], "timeout": 3600,
                   "when": "on_success", "allow_failure": false}],
        // A struct: there even for a job without `image:`, its name empty.
        "image": {
            "name": job.image.unwrap_or(""),
            "executor_opts": {"docker": {"platform": "", "user": ""},
                              "kubernetes": {"user": ""}},
        },
        "services": null,
        "artifacts": null,
        "cache": null,
        "credentials": null,
        "dependencies": null,
        "features": {"trace_sections": true, "token_mask_prefixes": null,
                     "failure_reasons": null},
        "policy_options": {"execution_policy_job": false, "policy_name": ""},
    });
    if let Some(o) = job.suspend.encode(version) {
        p["suspend_options"] = o;
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    fn payload(suspend: &SuspendOptions, version: RunnerVersion) -> Value {
        encode(
            &PayloadJob {
                id: 7,
                token: "glcbt-x",
                project_id: 5,
                project_path: "group/project",
                image: None,
                variables: vec![variable("CI_JOB_ID", "7", true, false)],
                suspend,
            },
            version,
        )
    }

    #[test]
    fn a_job_that_sets_nothing_still_carries_an_empty_suspend_options() {
        // Go's `omitempty` never omits a struct: the runner writes `{}`.
        let p = payload(&SuspendOptions::default(), RunnerVersion::SIMULATED);
        assert_eq!(p["suspend_options"], json!({}));
        assert!(p.as_object().unwrap().contains_key("suspend_options"));
        // Other structs are there too, and nil slices are null, not [].
        assert_eq!(p["image"]["name"], "");
        assert!(p["services"].is_null() && p.as_object().unwrap().contains_key("services"));
        assert!(p["git_info"]["refspecs"].is_null());
        // `omitempty` fields that are empty are left out.
        for absent in ["secrets", "hooks", "run"] {
            assert!(p.get(absent).is_none(), "{absent}");
        }
    }

    #[test]
    fn set_options_carry_only_their_true_and_non_empty_fields() {
        let s = SuspendOptions {
            on_success: false,
            on_failure: true,
            key: Some("12/s_x/env=1".into()),
        };
        let p = payload(&s, RunnerVersion::SIMULATED);
        assert_eq!(
            p["suspend_options"],
            json!({"suspend_on_failure": true, "runtime_environment_key": "12/s_x/env=1"})
        );
    }

    #[test]
    fn the_key_is_spelled_as_the_runner_release_spells_it() {
        let s = SuspendOptions {
            key: Some("k".into()),
            ..Default::default()
        };
        for (v, field) in [
            (RunnerVersion::new(19, 0), Some("environment_key")),
            (RunnerVersion::new(19, 3), Some("environment_key")),
            (RunnerVersion::new(19, 4), Some("runtime_environment_key")),
            (RunnerVersion::new(20, 1), Some("runtime_environment_key")),
            (RunnerVersion::new(18, 11), None),
        ] {
            let p = payload(&s, v);
            match field {
                Some(f) => assert_eq!(p["suspend_options"], json!({ f: "k" }), "{v:?}"),
                None => assert!(p.get("suspend_options").is_none(), "{v:?}"),
            }
        }
    }
}
