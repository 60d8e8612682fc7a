//! Drives the dormant binary exactly the way GitLab Runner drives a custom
//! executor (see `../shared/runner-contract.md`): a private `custom-executor*`
//! temp dir with `response.json`, the environment composed in the runner's
//! order, config → prepare (retried with cleanup in between) → run stages in
//! order with the runner's skip rules → cleanup, `CI_JOB_STATUS`, the exit-code
//! file, and SIGTERM to the process group of the running call.
//!
//! Used by `dormant try` and by the integration tests, so both exercise the
//! binary the way production does.

use std::collections::BTreeMap;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

/// The runner's exit codes for drivers (today's values).
pub const BUILD_FAILURE_EXIT_CODE: i32 = 1;
pub const SYSTEM_FAILURE_EXIT_CODE: i32 = 2;

/// A runner process: the binary and the runner's own environment.
#[derive(Debug, Clone)]
pub struct Runner {
    pub binary: PathBuf,
    /// Arguments before the stage name (`config_args` etc. put `--config X` here).
    pub args: Vec<String>,
    /// The runner process's own environment (systemd unit etc.).
    pub env: BTreeMap<String, String>,
    /// Where the per-job temp dirs go.
    pub tmp_root: PathBuf,
    /// The runner waits 3 s between prepare attempts; tests shorten it.
    pub retry_pause: Duration,
    pub runner_id: String,
}

/// Optional stages a job may have; the runner skips a stage with nothing to do.
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
    /// Extra stages that run as usual (e.g. `restore_cache`), before the user steps.
    pub cache_stages: bool,
    /// Send SIGTERM to the process group of this stage's call after a delay.
    pub cancel: Option<(String, Duration)>,
    /// After that SIGTERM, SIGKILL the call's process group this much later
    /// (the runner's `graceful_kill_timeout`); `None`: SIGTERM only.
    pub force_kill: Option<Duration>,
    /// Test hooks: (stage, local shell command) run by the simulated runner
    /// just before it calls that stage (e.g. kill an SSH master between stages).
    pub before_stage: Vec<(String, String)>,
}

/// What happened to one call.
#[derive(Debug, Clone)]
pub struct Call {
    pub name: String,
    pub exit_code: i32,
    pub elapsed: Duration,
    /// stdout and stderr as the job log would show them (one pipe, in order).
    pub output: String,
    /// Each output line with the time it arrived, from the start of the call.
    pub arrivals: Vec<(Duration, String)>,
}

impl Call {
    /// When the first line containing `text` arrived.
    pub fn arrived(&self, text: &str) -> Option<Duration> {
        self.arrivals
            .iter()
            .find(|(_, l)| l.contains(text))
            .map(|(t, _)| *t)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobResult {
    Success,
    /// Script failure with the job's exit code (from `BUILD_EXIT_CODE_FILE`).
    BuildFailure(Option<i32>),
    SystemFailure,
    Canceled,
}

#[derive(Debug, Clone)]
pub struct JobReport {
    pub result: JobResult,
    pub calls: Vec<Call>,
    /// config's JSON of the last attempt.
    pub config: Option<Value>,
    /// The key dormant printed in the job log, if any.
    pub key: Option<String>,
    pub prepare_attempts: u32,
}

impl JobReport {
    /// The job log: every prepare and run call's output, in order (not cleanup's).
    pub fn log(&self) -> String {
        self.calls
            .iter()
            .filter(|c| !c.name.starts_with("cleanup") && !c.name.starts_with("config"))
            .map(|c| c.output.as_str())
            .collect()
    }

    pub fn cleanup_output(&self) -> String {
        self.calls
            .iter()
            .filter(|c| c.name.starts_with("cleanup"))
            .map(|c| c.output.as_str())
            .collect()
    }

    pub fn call(&self, name: &str) -> Option<&Call> {
        self.calls.iter().find(|c| c.name == name)
    }

    pub fn ran(&self, name: &str) -> bool {
        self.call(name).is_some()
    }
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

    fn payload(&self, runner_id: &str) -> Value {
        let mut vars: Vec<Value> = vec![
            json!({"key": "CI_JOB_ID", "value": self.id.to_string(), "public": true}),
            json!({"key": "CI_RUNNER_ID", "value": runner_id, "public": true}),
            json!({"key": "CI_JOB_TOKEN", "value": SECRET_TOKEN, "public": false, "masked": true}),
        ];
        for (k, v) in &self.variables {
            vars.push(json!({"key": k, "value": v, "public": true}));
        }
        let mut p = json!({
            "id": self.id,
            "token": SECRET_TOKEN,
            "job_info": {"name": "sim", "stage": "test", "project_id": self.project_id,
                         "project_name": "project", "project_full_path": self.project_path},
            "git_info": {"repo_url": format!("https://gitlab-ci-token:{SECRET_TOKEN}@example.invalid/x.git")},
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
}

/// A job token the simulated payload carries; tests check it never reaches state or logs.
pub const SECRET_TOKEN: &str = "glcbt-SIMULATED-SECRET-TOKEN-0123456789";

struct Attempt {
    dir: PathBuf,
    builds_dir: String,
    job_env: BTreeMap<String, String>,
    runner_id: String,
}

impl Runner {
    pub fn new(binary: PathBuf, tmp_root: PathBuf, runner_id: &str) -> Self {
        Runner {
            binary,
            args: Vec::new(),
            env: BTreeMap::new(),
            tmp_root,
            retry_pause: Duration::from_secs(3),
            runner_id: runner_id.to_string(),
        }
    }

    /// Runs one whole job, like the runner: up to 3 prepare attempts, the run
    /// stages, cleanup always.
    pub fn run_job(&self, job: &SimJob) -> Result<JobReport> {
        let mut calls = Vec::new();
        let mut attempts = 0;
        let mut last_builds: Option<(String, String)> = None;
        let (attempt, config) = loop {
            attempts += 1;
            let attempt_no = attempts;
            let dir = self.temp_dir()?;
            std::fs::write(
                dir.join("response.json"),
                format!("{}\n", job.payload(&self.runner_id)),
            )?;
            // config
            let mut env = self.stage_env(&dir, job, &BTreeMap::new(), "running");
            env.insert(
                "CUSTOM_ENV_CI_BUILDS_DIR".into(),
                last_builds
                    .as_ref()
                    .map(|b| b.0.clone())
                    .unwrap_or_default(),
            );
            env.insert(
                "CUSTOM_ENV_CI_PROJECT_DIR".into(),
                last_builds
                    .as_ref()
                    .map(|b| b.1.clone())
                    .unwrap_or_default(),
            );
            let (cfg_call, stdout) = self.call(
                &format!("config#{attempt_no}"),
                &["config"],
                &dir,
                &env,
                None,
            )?;
            let cfg_ok = cfg_call.exit_code == 0;
            calls.push(cfg_call);
            let parsed = if cfg_ok {
                parse_config(&stdout)
            } else {
                Err(anyhow::anyhow!("config failed"))
            };
            let failed_system = match &parsed {
                Ok(cfg) => {
                    let builds_dir = cfg
                        .get("builds_dir")
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .to_string();
                    if builds_dir.is_empty() {
                        bail!("config printed no builds_dir: the runner fails the job as a configuration error");
                    }
                    let job_env: BTreeMap<String, String> = cfg
                        .get("job_env")
                        .and_then(Value::as_object)
                        .map(|m| {
                            m.iter()
                                .map(|(k, v)| (k.clone(), v.as_str().unwrap_or("").to_string()))
                                .collect()
                        })
                        .unwrap_or_default();
                    let project_dir = format!("{builds_dir}/{}", job.project_path);
                    last_builds = Some((builds_dir.clone(), project_dir));
                    let attempt = Attempt {
                        dir: dir.clone(),
                        builds_dir,
                        job_env,
                        runner_id: self.runner_id.clone(),
                    };
                    let env = self.stage_env(&dir, job, &attempt.job_env, "running");
                    let env = with_dirs(env, &attempt, job);
                    let (call, _) = self.call(
                        &format!("prepare#{attempt_no}"),
                        &["prepare"],
                        &dir,
                        &env,
                        cancel_for(job, "prepare").map(|after| (after, job.force_kill)),
                    )?;
                    let code = call.exit_code;
                    calls.push(call);
                    if code == 0 {
                        break (attempt, parsed.ok());
                    }
                    if code == BUILD_FAILURE_EXIT_CODE {
                        self.cleanup(&attempt, job, "running", &mut calls, attempt_no)?;
                        return Ok(report(
                            JobResult::BuildFailure(read_exit_code(&dir)),
                            calls,
                            parsed.ok(),
                            attempts,
                        ));
                    }
                    self.cleanup(&attempt, job, "running", &mut calls, attempt_no)?;
                    if was_cancelled(job, "prepare") {
                        return Ok(report(JobResult::Canceled, calls, parsed.ok(), attempts));
                    }
                    true
                }
                Err(_) => {
                    let attempt = Attempt {
                        dir: dir.clone(),
                        builds_dir: String::new(),
                        job_env: BTreeMap::new(),
                        runner_id: self.runner_id.clone(),
                    };
                    self.cleanup(&attempt, job, "running", &mut calls, attempt_no)?;
                    true
                }
            };
            if failed_system && attempts >= 3 {
                return Ok(report(JobResult::SystemFailure, calls, None, attempts));
            }
            std::thread::sleep(self.retry_pause);
        };

        // The run stages, with the runner's order and skip rules.
        let mut status = "running";
        let mut result = JobResult::Success;
        let mut system_failed = false;
        let stage = |name: &str,
                     body: &str,
                     export_vars: bool,
                     status: &str,
                     calls: &mut Vec<Call>|
         -> Result<i32> {
            for (_, cmd) in job.before_stage.iter().filter(|(s, _)| s == name) {
                let status = Command::new("sh").arg("-c").arg(cmd).status()?;
                tracing::debug!(stage = name, %status, "before-stage hook");
            }
            let script = attempt.dir.join(format!("script-{name}"));
            std::fs::write(
                &script,
                stage_script(job, &attempt, body, export_vars, name != "prepare_script"),
            )?;
            let env = with_dirs(
                self.stage_env(&attempt.dir, job, &attempt.job_env, status),
                &attempt,
                job,
            );
            let args = [
                "run".to_string(),
                script.display().to_string(),
                name.to_string(),
            ];
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let cancel = cancel_for(job, name).map(|after| (after, job.force_kill));
            let (call, _) = self.call(name, &args, &attempt.dir, &env, cancel)?;
            let code = call.exit_code;
            calls.push(call);
            Ok(code)
        };
        let classify = |code: i32, result: &mut JobResult, system_failed: &mut bool| -> bool {
            match code {
                0 => true,
                BUILD_FAILURE_EXIT_CODE => {
                    if *result == JobResult::Success {
                        *result = JobResult::BuildFailure(read_exit_code(&attempt.dir));
                    }
                    false
                }
                _ => {
                    *system_failed = true;
                    false
                }
            }
        };
        let mut canceled = false;
        let mut ok = classify(
            stage("prepare_script", "true", false, status, &mut calls)?,
            &mut result,
            &mut system_failed,
        );
        if ok {
            ok = classify(
                stage("get_sources", &job.get_sources, true, status, &mut calls)?,
                &mut result,
                &mut system_failed,
            );
        }
        if ok && job.cache_stages {
            ok = classify(
                stage(
                    "restore_cache",
                    "echo restoring cache (simulated)",
                    true,
                    status,
                    &mut calls,
                )?,
                &mut result,
                &mut system_failed,
            );
        }
        let mut steps_ran = false;
        if ok {
            for (name, body) in &job.steps {
                steps_ran = true;
                let code = stage(name, body, true, status, &mut calls)?;
                if was_cancelled(job, name) {
                    canceled = true;
                    break;
                }
                if !classify(code, &mut result, &mut system_failed) {
                    break;
                }
            }
        }
        if canceled {
            result = JobResult::Canceled;
            status = "canceled";
        } else {
            if system_failed {
                result = JobResult::SystemFailure;
            }
            status = if result == JobResult::Success {
                "success"
            } else {
                "failed"
            };
        }
        if steps_ran {
            if let Some(after) = &job.after_script {
                let _ = stage("after_script", after, true, status, &mut calls)?;
            }
        }
        if !canceled {
            if job.cache_stages {
                let name = if result == JobResult::Success {
                    "archive_cache"
                } else {
                    "archive_cache_on_failure"
                };
                let _ = stage(
                    name,
                    "echo archiving cache (simulated)",
                    true,
                    status,
                    &mut calls,
                )?;
            }
            let _ = stage("cleanup_file_variables", "true", true, status, &mut calls)?;
        }
        self.cleanup(&attempt, job, status, &mut calls, attempts)?;
        let _ = std::fs::remove_dir_all(&attempt.dir);
        Ok(report(result, calls, config, attempts))
    }

    fn cleanup(
        &self,
        attempt: &Attempt,
        job: &SimJob,
        status: &str,
        calls: &mut Vec<Call>,
        n: u32,
    ) -> Result<()> {
        let env = with_dirs(
            self.stage_env(&attempt.dir, job, &attempt.job_env, status),
            attempt,
            job,
        );
        let (call, _) = self.call(
            &format!("cleanup#{n}"),
            &["cleanup"],
            &attempt.dir,
            &env,
            None,
        )?;
        calls.push(call);
        Ok(())
    }

    fn temp_dir(&self) -> Result<PathBuf> {
        std::fs::create_dir_all(&self.tmp_root)?;
        for _ in 0..100 {
            let dir = self
                .tmp_root
                .join(format!("custom-executor{}", fastrand::u64(..)));
            if std::fs::create_dir(&dir).is_ok() {
                std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))?;
                return Ok(dir);
            }
        }
        bail!("cannot make a temp dir under {}", self.tmp_root.display())
    }

    /// The environment of a call, in the runner's order (later entries win).
    fn stage_env(
        &self,
        dir: &Path,
        job: &SimJob,
        job_env: &BTreeMap<String, String>,
        status: &str,
    ) -> BTreeMap<String, String> {
        let mut env = self.env.clone();
        env.insert("TMPDIR".into(), dir.display().to_string());
        env.insert(
            "BUILD_FAILURE_EXIT_CODE".into(),
            BUILD_FAILURE_EXIT_CODE.to_string(),
        );
        env.insert(
            "SYSTEM_FAILURE_EXIT_CODE".into(),
            SYSTEM_FAILURE_EXIT_CODE.to_string(),
        );
        env.insert(
            "BUILD_EXIT_CODE_FILE".into(),
            dir.join("build_exit_code").display().to_string(),
        );
        env.insert(
            "JOB_RESPONSE_FILE".into(),
            dir.join("response.json").display().to_string(),
        );
        env.extend(job_env.clone());
        for (k, v) in job_vars(job, &self.runner_id) {
            env.insert(format!("CUSTOM_ENV_{k}"), v);
        }
        env.insert("CUSTOM_ENV_CI_JOB_STATUS".into(), status.into());
        env
    }

    /// Spawns one call in its own process group with stdin /dev/null and the
    /// temp dir as working dir. Returns the call (stdout+stderr in order) and stdout alone.
    fn call(
        &self,
        name: &str,
        args: &[&str],
        dir: &Path,
        env: &BTreeMap<String, String>,
        cancel: Option<(Duration, Option<Duration>)>,
    ) -> Result<(Call, String)> {
        let started = Instant::now();
        let mut cmd = Command::new(&self.binary);
        cmd.args(&self.args)
            .args(args)
            .current_dir(dir)
            .env_clear()
            .envs(env)
            .stdin(Stdio::null())
            .process_group(0);
        let is_config = args.first() == Some(&"config");
        let (reader, writer) = std::io::pipe()?;
        let mut stdout_reader = None;
        if is_config {
            let (r, w) = std::io::pipe()?;
            cmd.stdout(w);
            stdout_reader = Some(r);
        } else {
            cmd.stdout(writer.try_clone()?);
        }
        cmd.stderr(writer);
        let mut child = cmd
            .spawn()
            .with_context(|| format!("starting {}", self.binary.display()))?;
        drop(cmd);
        let pid = child.id() as i32;
        let out_thread = stdout_reader.map(|mut r| {
            std::thread::spawn(move || {
                let mut s = String::new();
                let _ = r.read_to_string(&mut s);
                s
            })
        });
        let killer = cancel.map(|(after, force_kill)| {
            std::thread::spawn(move || {
                std::thread::sleep(after);
                // SAFETY: signals the call's process group, as the runner does.
                unsafe {
                    libc::kill(-pid, libc::SIGTERM);
                }
                if let Some(grace) = force_kill {
                    std::thread::sleep(grace);
                    // SAFETY: as above; the runner's escalation after its grace.
                    unsafe {
                        libc::kill(-pid, libc::SIGKILL);
                    }
                }
            })
        });
        // Read line by line, noting when each line arrived, so tests can tell
        // live output from output that only appears when the call ends.
        let mut output = String::new();
        let mut arrivals = Vec::new();
        let mut lines = std::io::BufReader::new(reader);
        let mut buf = Vec::new();
        while std::io::BufRead::read_until(&mut lines, b'\n', &mut buf)? > 0 {
            let line = String::from_utf8_lossy(&buf).into_owned();
            arrivals.push((started.elapsed(), line.trim_end_matches('\n').to_string()));
            output.push_str(&line);
            buf.clear();
        }
        let status = child.wait()?;
        if let Some(k) = killer {
            let _ = k.join();
        }
        let stdout = out_thread
            .map(|t| t.join().unwrap_or_default())
            .unwrap_or_default();
        let exit_code = status
            .code()
            .unwrap_or_else(|| 128 + status.signal().unwrap_or(0));
        Ok((
            Call {
                name: name.to_string(),
                exit_code,
                elapsed: started.elapsed(),
                output,
                arrivals,
            },
            stdout,
        ))
    }
}

fn report(result: JobResult, calls: Vec<Call>, config: Option<Value>, attempts: u32) -> JobReport {
    let mut r = JobReport {
        result,
        calls,
        config,
        key: None,
        prepare_attempts: attempts,
    };
    r.key = r
        .log()
        .lines()
        .filter_map(|l| {
            l.split_once("environment key: ")
                .map(|(_, k)| k.trim().to_string())
        })
        .next_back();
    r
}

fn cancel_for(job: &SimJob, stage: &str) -> Option<Duration> {
    job.cancel
        .as_ref()
        .filter(|(s, _)| s == stage)
        .map(|(_, d)| *d)
}

fn was_cancelled(job: &SimJob, stage: &str) -> bool {
    cancel_for(job, stage).is_some()
}

fn read_exit_code(dir: &Path) -> Option<i32> {
    std::fs::read_to_string(dir.join("build_exit_code"))
        .ok()?
        .lines()
        .next()?
        .trim()
        .parse()
        .ok()
}

/// Parses config's stdout as the runner does: zero bytes = no config, one JSON
/// object otherwise; whitespace-only or trailing text is an error.
pub fn parse_config(stdout: &str) -> Result<Value> {
    if stdout.is_empty() {
        return Ok(json!({}));
    }
    if stdout.trim().is_empty() {
        bail!("config printed only whitespace");
    }
    let mut de = serde_json::Deserializer::from_str(stdout).into_iter::<Value>();
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
    Ok(value)
}

fn job_vars(job: &SimJob, runner_id: &str) -> Vec<(String, String)> {
    let mut v = vec![
        ("CI".to_string(), "true".to_string()),
        ("CI_JOB_ID".into(), job.id.to_string()),
        ("CI_PROJECT_ID".into(), job.project_id.to_string()),
        ("CI_PROJECT_PATH".into(), job.project_path.clone()),
        ("CI_RUNNER_ID".into(), runner_id.to_string()),
        ("CI_JOB_TOKEN".into(), SECRET_TOKEN.to_string()),
        (
            "CI_SERVER_URL".into(),
            "https://gitlab.example.invalid".into(),
        ),
    ];
    if let Some(image) = &job.image {
        v.push(("CI_JOB_IMAGE".into(), image.clone()));
    }
    v.extend(job.variables.iter().cloned());
    v
}

fn with_dirs(
    mut env: BTreeMap<String, String>,
    attempt: &Attempt,
    job: &SimJob,
) -> BTreeMap<String, String> {
    env.insert(
        "CUSTOM_ENV_CI_BUILDS_DIR".into(),
        attempt.builds_dir.clone(),
    );
    env.insert(
        "CUSTOM_ENV_CI_PROJECT_DIR".into(),
        format!("{}/{}", attempt.builds_dir, job.project_path),
    );
    env
}

/// A stage script shaped like the runner's: self-contained bash that traps
/// TERM, exports the job variables (not in prepare_script), works in the
/// project dir, and ends with `exit 0`.
fn stage_script(
    job: &SimJob,
    attempt: &Attempt,
    body: &str,
    export_vars: bool,
    in_project: bool,
) -> String {
    let project_dir = format!("{}/{}", attempt.builds_dir, job.project_path);
    let mut s = String::from("#!/usr/bin/env bash\ntrap 'exit 1' TERM\nset -eo pipefail\n");
    if export_vars {
        for (k, v) in job_vars(job, &attempt.runner_id) {
            s.push_str(&format!("export {k}={}\n", shell_quote(&v)));
        }
        s.push_str(&format!(
            "export CI_PROJECT_DIR={}\n",
            shell_quote(&project_dir)
        ));
    }
    if in_project {
        s.push_str(&format!(
            "mkdir -p {0}\ncd {0}\n",
            shell_quote(&project_dir)
        ));
    }
    s.push_str(body);
    s.push_str("\nexit 0\n");
    s
}

pub fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}
