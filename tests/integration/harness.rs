//! The harness: a state dir, a settings file and a simulated GitLab Runner
//! (`dormant::runner_sim`, the same code `dormant try` uses) that calls the
//! built binary with the runner's temp dir, environment, stage order, retries,
//! `CI_JOB_STATUS` and signals.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

pub use dormant::runner_sim::{JobReport, JobResult};
use dormant::runner_sim::{Runner, SimJob};

pub const BIN: &str = env!("CARGO_BIN_EXE_dormant");

/// The start of the job token a rig's payloads carry. Each rig's token is
/// unique (this prefix, the test process, a counter), so a test looking for
/// its token in files, logs or other processes' environments finds only its
/// own job's, not another test's running at the same time on this host.
pub const SECRET_TOKEN_PREFIX: &str = "glcbt-SIMULATED-SECRET-TOKEN";

/// One runner manager: its own state dir, settings and identity.
pub struct Rig {
    pub dir: tempfile::TempDir,
    pub runner: Runner,
    pub settings_path: PathBuf,
    pub state_dir: PathBuf,
}

impl Rig {
    /// A runner with `runner_id` and `system_id`, the `local` provider and `extra` settings.
    pub fn new(runner_id: &str, system_id: &str, extra: &str) -> Rig {
        let dir = tempfile::tempdir().unwrap();
        let state_dir = dir.path().join("state");
        let settings_path = dir.path().join("dormant.toml");
        Rig::write_settings(&settings_path, system_id, extra);
        let mut runner = Runner::new(PathBuf::from(BIN), dir.path().join("tmp"), runner_id);
        runner.retry_pause = Duration::from_millis(50);
        runner.job_token = format!("{SECRET_TOKEN_PREFIX}-{}-{}", std::process::id(), job_id());
        runner.env = [
            ("PATH", std::env::var("PATH").unwrap_or_default()),
            ("HOME", std::env::var("HOME").unwrap_or_default()),
            ("DORMANT_CONFIG", settings_path.display().to_string()),
            ("DORMANT_STATE_DIR", state_dir.display().to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        Rig {
            dir,
            runner,
            settings_path,
            state_dir,
        }
    }

    pub fn local(runner_id: &str, system_id: &str) -> Rig {
        Rig::new(runner_id, system_id, "")
    }

    pub fn write_settings(path: &Path, system_id: &str, extra: &str) {
        std::fs::write(
            path,
            format!("system_id = \"{}\"\nrunner_system_id_file = \"/nonexistent/.runner_system_id\"\n{extra}\n", system_id.replace('"', "\\\"")),
        )
        .unwrap();
    }

    /// The job token this rig's jobs carry; it must never leak.
    pub fn secret_token(&self) -> &str {
        &self.runner.job_token
    }

    pub fn run(&self, job: &SimJob) -> JobReport {
        self.runner.run_job(job).unwrap()
    }

    /// Runs `job`, running the shell command `cmd` on this host just before
    /// the runner calls `stage` (to kill a connection between two stages, or
    /// look at every process at that moment).
    pub fn run_with_command_before(&self, job: &SimJob, stage: &str, cmd: &str) -> JobReport {
        let mut ran = false;
        let report = self
            .runner
            .run_job_with(job, &mut |name| {
                if name == stage {
                    // Its exit status is the test's business (a `pkill` may
                    // also signal this very shell, whose command line matches).
                    Command::new("sh").arg("-c").arg(cmd).status().unwrap();
                    ran = true;
                }
            })
            .unwrap();
        assert!(ran, "the job never reached {stage}: {}", report.log());
        report
    }

    /// Runs `dormant <args>` as an operator would, with this rig's settings.
    pub fn dormant(&self, args: &[&str]) -> Output {
        Command::new(BIN)
            .args(args)
            .env_clear()
            .envs(&self.runner.env)
            .output()
            .unwrap()
    }

    /// The warm pool as `dormant list --json` shows it: (id, status) of each
    /// warm machine.
    pub fn warm_pool(&self) -> Vec<(String, String)> {
        let out = self.dormant(&["list", "--json"]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["warm"] == true)
            .map(|v| {
                (
                    v["entry"]["id"].as_str().unwrap_or("?").to_string(),
                    v["entry"]["status"].as_str().unwrap_or("?").to_string(),
                )
            })
            .collect()
    }

    pub fn env_dir(&self, key: &str) -> PathBuf {
        let id = dormant::envkey::EnvironmentKey::parse(key).unwrap().env_id;
        self.state_dir.join("environments").join(id.to_string())
    }

    pub fn record(&self, key: &str) -> Option<serde_json::Value> {
        let text = std::fs::read_to_string(self.env_dir(key).join("record.json")).ok()?;
        Some(serde_json::from_str(&text).unwrap())
    }

    pub fn status(&self, key: &str) -> Option<String> {
        self.record(key)
            .map(|r| r["status"].as_str().unwrap().to_string())
    }
}

/// Job ids unique across the test binary (tests run in parallel in one process).
pub fn job_id() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(1000);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

pub fn job(project: u64) -> SimJob {
    SimJob::new(job_id(), project)
}

/// Asserts with the job log in the message.
#[track_caller]
pub fn assert_result(r: &JobReport, want: JobResult) {
    assert_eq!(
        r.result,
        want,
        "job log:\n{}\ncleanup:\n{}",
        r.log(),
        r.cleanup_output()
    );
}

/// Whether a process exists and is not a zombie (a killed child may linger as
/// a zombie until it is reaped; it runs nothing).
pub fn process_running(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(") ")
            .and_then(|(_, rest)| rest.chars().next())
            .is_some_and(|state| state != 'Z' && state != 'X'),
        Err(_) => false,
    }
}

/// A free TCP port on loopback for a test server.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Asserts that `text` reached the job log well before `call` ended: the
/// script printed it before sleeping 3 s, so buffered output would arrive last.
#[track_caller]
pub fn assert_line_arrived_early(call: &dormant::runner_sim::Call, text: &str) {
    let arrived = call
        .arrived(text)
        .unwrap_or_else(|| panic!("{text:?} never arrived: {}", call.output));
    assert!(
        call.elapsed.saturating_sub(arrived) >= Duration::from_millis(1500),
        "{text:?} arrived at {arrived:?}, only at the end of a {:?} stage",
        call.elapsed
    );
}
