//! The job a simulated runner runs: what GitLab would send (the payload written
//! to `JOB_RESPONSE_FILE`, the job variables) and the stages the job has.

use serde_json::Value;

use super::payload::{self, RunnerVersion, SuspendOptions};

/// When the simulated runner signals a call.
#[derive(Debug, Clone)]
pub enum When {
    After(std::time::Duration),
    FileExists(std::path::PathBuf),
}

/// One job: its identity, its suspend options, variables and stages. The
/// runner skips a stage with nothing to do, so only the stages set here run.
#[derive(Debug, Clone, Default)]
pub struct SimJob {
    pub id: u64,
    pub project_id: u64,
    /// `namespace/project`, so `CI_PROJECT_DIR = <builds_dir>/<path>`.
    pub project_path: String,
    /// What GitLab set in the job's suspend options (`suspend_on`, `resume`);
    /// the payload carries them as the simulated runner's release writes them.
    pub suspend: SuspendOptions,
    /// Written as the payload's `suspend_options` instead of the runner's own
    /// encoding: for tests of a payload no runner writes (`[true]`, ...).
    pub suspend_options_override: Option<Value>,
    /// Job variables (become `CUSTOM_ENV_*` and are exported by every script but prepare_script's).
    pub variables: Vec<(String, String)>,
    /// Names of `variables` that are masked (the payload marks them so).
    pub masked: Vec<String>,
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
        self.suspend.on_success = success;
        self.suspend.on_failure = failure;
        self
    }

    pub fn resume(mut self, key: &str) -> Self {
        self.suspend.key = Some(key.to_string());
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

    /// A masked job variable (a CI/CD variable with "Mask variable" set).
    pub fn masked_var(mut self, k: &str, v: &str) -> Self {
        self.masked.push(k.into());
        self.var(k, v)
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

    /// The job payload as the simulated runner writes it (`payload.rs`):
    /// what dormant reads, the token and masked variables that must never
    /// leak, and every struct the runner's encoder always writes.
    pub(super) fn payload(&self, runner_id: &str, token: &str, version: RunnerVersion) -> Value {
        let mut vars = vec![
            payload::variable("CI_JOB_ID", &self.id.to_string(), true, false),
            payload::variable("CI_RUNNER_ID", runner_id, true, false),
            payload::variable("CI_JOB_TOKEN", token, false, true),
        ];
        for (k, v) in &self.variables {
            let masked = self.masked.contains(k);
            vars.push(payload::variable(k, v, !masked, masked));
        }
        let mut p = payload::encode(
            &payload::PayloadJob {
                id: self.id,
                token,
                project_id: self.project_id,
                project_path: &self.project_path,
                image: self.image.as_deref(),
                variables: vars,
                suspend: &self.suspend,
            },
            version,
        );
        if let Some(o) = &self.suspend_options_override {
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
        v
    }
}
