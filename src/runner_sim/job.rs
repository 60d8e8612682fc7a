//! The job a simulated runner runs: what GitLab would send (the payload written
//! to `JOB_RESPONSE_FILE`, the job variables) and the stages the job has.

use serde_json::{json, Value};

/// When the simulated runner signals a call.
#[derive(Debug, Clone)]
pub enum When {
    After(std::time::Duration),
    FileExists(std::path::PathBuf),
}

/// One job: its identity, its `suspend_options`, variables and stages. The
/// runner skips a stage with nothing to do, so only the stages set here run.
#[derive(Debug, Clone, Default)]
pub struct SimJob {
    pub id: u64,
    pub project_id: u64,
    /// `namespace/project`, so `CI_PROJECT_DIR = <builds_dir>/<path>`.
    pub project_path: String,
    /// `suspend_options` as the payload carries it (`None`: field absent).
    pub suspend_options: Option<Value>,
    /// Job variables (become `CUSTOM_ENV_*` and are exported by every script but prepare_script's).
    pub variables: Vec<(String, String)>,
    pub image: Option<String>,
    /// Body of `get_sources` (after `mkdir -p` and `cd` into the project dir).
    pub get_sources: String,
    /// User steps in order: (`build_script` or `step_<name>`, body).
    pub steps: Vec<(String, String)>,
    pub after_script: Option<String>,
    /// Also run `restore_cache` (before the user steps) and `archive_cache` /
    /// `archive_cache_on_failure` (after them).
    pub cache_stages: bool,
    /// Send SIGTERM to the process group of this stage's call after a delay,
    /// as the runner does when the job is canceled or times out.
    pub cancel: Option<(String, std::time::Duration)>,
    /// After that SIGTERM, SIGKILL the call's process group this much later
    /// (the runner's `graceful_kill_timeout`); `None`: SIGTERM only. Zero:
    /// the call never runs between the two (it is stopped first).
    pub force_kill: Option<std::time::Duration>,
    /// Cancel this stage (as `cancel` does) once this file exists: for a test
    /// that cancels at a moment it makes, not after a guessed delay.
    pub cancel_on_file: Option<(String, std::path::PathBuf)>,
    /// SIGKILL this stage's call, without a SIGTERM first, once this file
    /// exists (the OOM killer, an operator's `kill -9`).
    pub kill_on_file: Option<(String, std::path::PathBuf)>,
    /// Variables GitLab masks in the job log (`masked`, not `public` in the
    /// payload); the job exports them like any other. Secrets, as the job
    /// token is: nothing dormant keeps may hold them.
    pub masked_variables: Vec<(String, String)>,
}

impl SimJob {
    pub fn new(id: u64, project_id: u64) -> Self {
        SimJob {
            id,
            project_id,
            project_path: "group/project".into(),
            get_sources: "echo 'fetching sources (simulated)'; touch .fetched-by-get-sources"
                .into(),
            steps: vec![("build_script".into(), "echo hello from the build".into())],
            ..Default::default()
        }
    }

    pub fn suspend_on(mut self, success: bool, failure: bool) -> Self {
        let mut o = self.suspend_options.take().unwrap_or_else(|| json!({}));
        o["suspend_on_success"] = json!(success);
        o["suspend_on_failure"] = json!(failure);
        self.suspend_options = Some(o);
        self
    }

    pub fn resume(mut self, key: &str) -> Self {
        let mut o = self.suspend_options.take().unwrap_or_else(|| json!({}));
        o["runtime_environment_key"] = json!(key);
        self.suspend_options = Some(o);
        self
    }

    pub fn script(mut self, body: &str) -> Self {
        self.steps = vec![("build_script".into(), body.into())];
        self
    }

    pub fn var(mut self, k: &str, v: &str) -> Self {
        self.variables.push((k.into(), v.into()));
        self
    }

    /// A masked variable (see [`SimJob::masked_variables`]).
    pub fn masked_var(mut self, k: &str, v: &str) -> Self {
        self.masked_variables.push((k.into(), v.into()));
        self
    }

    /// [`SimJob::payload`] with the masked variables added to its `variables`.
    pub(super) fn payload_with_masked_variables(&self, runner_id: &str, token: &str) -> Value {
        let mut p = self.payload(runner_id, token);
        if let Some(vars) = p["variables"].as_array_mut() {
            for (k, v) in &self.masked_variables {
                vars.push(json!({"key": k, "value": v, "public": false, "masked": true}));
            }
        }
        p
    }

    /// When `stage`'s call gets SIGTERM, if this job is canceled there.
    pub(super) fn cancel_after(&self, stage: &str) -> Option<When> {
        let after = self
            .cancel
            .as_ref()
            .filter(|(s, _)| s == stage)
            .map(|(_, d)| When::After(*d));
        after.or_else(|| {
            self.cancel_on_file
                .as_ref()
                .filter(|(s, _)| s == stage)
                .map(|(_, f)| When::FileExists(f.clone()))
        })
    }

    /// When `stage`'s call gets a SIGKILL alone.
    pub(super) fn kill_at(&self, stage: &str) -> Option<When> {
        self.kill_on_file
            .as_ref()
            .filter(|(s, _)| s == stage)
            .map(|(_, f)| When::FileExists(f.clone()))
    }

    /// The job payload as GitLab sends it (a subset: what dormant reads, plus
    /// the token, which must never leak).
    pub(super) fn payload(&self, runner_id: &str, token: &str) -> Value {
        let mut vars: Vec<Value> = vec![
            json!({"key": "CI_JOB_ID", "value": self.id.to_string(), "public": true}),
            json!({"key": "CI_RUNNER_ID", "value": runner_id, "public": true}),
            json!({"key": "CI_JOB_TOKEN", "value": token, "public": false, "masked": true}),
        ];
        for (k, v) in &self.variables {
            vars.push(json!({"key": k, "value": v, "public": true}));
        }
        let mut p = json!({
            "id": self.id,
            "token": token,
            "job_info": {"name": "sim", "stage": "test", "project_id": self.project_id,
                         "project_name": "project", "project_full_path": self.project_path},
            "git_info": {"repo_url": format!("https://gitlab-ci-token:{token}@example.invalid/x.git")},
            "runner_info": {"timeout": 3600},
            "variables": vars,
            "steps": [],
        });
        if let Some(image) = &self.image {
            p["image"] = json!({"name": image});
        }
        if let Some(o) = &self.suspend_options {
            p["suspend_options"] = o.clone();
        }
        p
    }

    /// The job's variables (without the `CUSTOM_ENV_` prefix): the predefined
    /// `CI_*` ones the runner adds, then the job's own.
    pub(super) fn variables(&self, runner_id: &str, token: &str) -> Vec<(String, String)> {
        let mut v = vec![
            ("CI".to_string(), "true".to_string()),
            ("CI_JOB_ID".into(), self.id.to_string()),
            ("CI_PROJECT_ID".into(), self.project_id.to_string()),
            ("CI_PROJECT_PATH".into(), self.project_path.clone()),
            ("CI_RUNNER_ID".into(), runner_id.to_string()),
            ("CI_JOB_TOKEN".into(), token.to_string()),
            (
                "CI_SERVER_URL".into(),
                "https://gitlab.example.invalid".into(),
            ),
        ];
        if let Some(image) = &self.image {
            v.push(("CI_JOB_IMAGE".into(), image.clone()));
        }
        v.extend(self.variables.iter().cloned());
        v.extend(self.masked_variables.iter().cloned());
        v
    }
}
