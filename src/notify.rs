//! The notify hook: `[suspend] notify_command` runs on the runner host on every
//! suspend, resume, release and TTL expiry of an environment, with one JSON
//! document on its stdin, so an orchestrator (a chat bot, an agent platform, a
//! merge-request comment) learns the key without scraping job logs.
//!
//! The hook must never fail or delay a job beyond `notify_timeout`: it runs in
//! its own process group, and when the bound passes the whole group is killed.
//! Its stdout is discarded and its stderr kept only for the error message, so
//! nothing it prints reaches the job log (prepare's stderr is the job log).
//! A failure is logged ([`NotifyError::short`] in the job log) and written to
//! the event log as a `notify_failed` event; the caller carries on.

use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use uuid::Uuid;

use crate::model::{Machine, StorageMode, Volume};

/// How much of the hook's stderr an error message quotes.
const STDERR_KEPT: usize = 2048;
/// After the group is killed, how long reaping the hook may take (SIGKILL
/// cannot be ignored, so this is only a guard against a wedged kernel).
const REAP_GRACE: Duration = Duration::from_secs(1);

/// What happened to the environment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Event {
    Suspend,
    Resume,
    Release,
    /// Released by the TTL sweep (`suspend.ttl`).
    Expire,
}

impl Event {
    /// As the document says it (`suspend`, `resume`, `release`, `expire`).
    pub fn as_str(self) -> &'static str {
        match self {
            Event::Suspend => "suspend",
            Event::Resume => "resume",
            Event::Release => "release",
            Event::Expire => "expire",
        }
    }
}

/// The JSON document on the hook's stdin. Fields dormant does not know are
/// `null`. `version` changes only when a field changes meaning or goes away.
#[derive(Debug, Clone, Serialize)]
pub struct Notification {
    pub version: u32,
    pub event: Event,
    /// The environment key (what a later job passes to resume).
    pub key: Option<String>,
    pub environment_id: Uuid,
    pub project_id: Option<u64>,
    pub project_path: Option<String>,
    pub job_id: Option<u64>,
    /// `CI_JOB_URL` of the job that caused the event.
    pub job_url: Option<String>,
    /// `local`, `ssh`, `ec2`, ...
    pub provider: String,
    /// The provider's handle: instance id, directory or workspace, and its fields.
    /// `null` for a volume-mode environment while it is suspended (it has no machine).
    pub machine: Option<Machine>,
    /// `machine` or `volume` (`storage` of the provider's settings when the
    /// environment was made): whether a suspension keeps the machine or only
    /// its data volume.
    pub storage: StorageMode,
    /// Volume mode: the data volume (EBS volume id with its region and zone,
    /// the qemu or local volume's path), which is where the environment lives
    /// while it is suspended. `null` in machine mode.
    pub volume: Option<Volume>,
    /// Why, in words: "job success (suspend_on_success)", "requested by the job: ...".
    pub reason: Option<String>,
    /// When, as RFC 3339 UTC (`2026-11-23T13:40:00Z`).
    pub time: String,
}

impl Notification {
    /// A notification stamped now; the caller fills in what it knows.
    pub fn new(event: Event, environment_id: Uuid, provider: impl Into<String>) -> Self {
        Notification {
            version: 1,
            event,
            key: None,
            environment_id,
            project_id: None,
            project_path: None,
            job_id: None,
            job_url: None,
            provider: provider.into(),
            machine: None,
            storage: StorageMode::Machine,
            volume: None,
            reason: None,
            time: rfc3339(crate::state::now_unix()),
        }
    }
}

impl Notification {
    /// What the registry knows about the environment: key, project, provider, machine.
    pub fn for_record(event: Event, rec: &crate::state::EnvironmentRecord) -> Self {
        let mut n = Notification::new(event, rec.id, rec.provider.clone());
        n.key = rec.key.clone();
        n.project_id = Some(rec.project_id);
        n.project_path = rec.project_path.clone();
        n.machine = rec.machine.clone();
        n.storage = rec.storage;
        n.volume = rec.volume.as_ref().and_then(|v| v.volume.clone());
        n
    }

    /// The job that caused the event.
    pub fn job(mut self, input: &crate::job::JobInput) -> Self {
        self.job_id = Some(input.job_id);
        self.job_url = input.job_url.clone();
        if self.project_path.is_none() {
            self.project_path = input.project_path.clone();
        }
        self
    }

    pub fn reason(mut self, reason: impl Into<String>) -> Self {
        self.reason = Some(reason.into());
        self
    }
}

/// Where a failure of the hook is said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Audience {
    /// The runner's log (cleanup) or the operator's terminal: the whole error.
    Operator,
    /// The job log (prepare): one short line, without the hook's output.
    Job,
}

/// Runs the hook, if one is set, and says a failure on `log` and in the
/// event log (a `notify_failed` event: the operator learns that whoever
/// waits for this environment was not told, also long after the job log is
/// gone). Never fails: the job goes on whatever the hook does.
pub async fn announce(
    settings: &crate::settings::SuspendSettings,
    events: &crate::events::EventLog,
    n: &Notification,
    log: &crate::context::JobLog,
    audience: Audience,
) {
    let Some(hook) = Notifier::from_settings(settings) else {
        return;
    };
    if let Err(e) = hook.send(n).await {
        let event = n.event.as_str();
        match audience {
            Audience::Operator => {
                log.warn(format!("{event} of environment {}: {e}", n.environment_id))
            }
            Audience::Job => log.warn(format!("{} (the job goes on)", e.short())),
        }
        // The event log is the operator's: the whole error, the hook's
        // stderr included.
        let ctx = crate::context::Ctx::new(log.clone(), Default::default(), EVENT_BUDGET);
        events.record(failed_event(n, &e), &ctx).await;
    }
}

/// How long writing the `notify_failed` event may take (the event log has
/// its own bound on its lock; this is only the context it needs).
const EVENT_BUDGET: Duration = Duration::from_secs(10);

/// The `notify_failed` event of a failed hook, about what it was told.
fn failed_event(n: &Notification, e: &NotifyError) -> crate::events::Event {
    use crate::events::{Event as Line, Kind};
    let mut line = Line::new(Kind::NotifyFailed, n.event.as_str(), &n.provider)
        .job(n.job_id)
        .error_text(&e.to_string());
    line.env = Some(n.environment_id);
    line.key = n.key.clone();
    line.project = n.project_id;
    line.project_path = n.project_path.clone();
    if let Some(reason) = &n.reason {
        line = line.reason(reason);
    }
    line
}

/// Why the hook failed.
#[derive(Debug, thiserror::Error)]
pub enum NotifyError {
    #[error("notify command {program} could not be started: {source}")]
    Spawn {
        program: String,
        source: std::io::Error,
    },
    #[error("notify command {program} did not finish within {} s: its process group was killed", timeout.as_secs_f64())]
    Timeout { program: String, timeout: Duration },
    #[error("notify command {program} {status}{}", stderr_suffix(stderr))]
    Failed {
        program: String,
        status: String,
        stderr: String,
    },
    #[error("notify command {program}: {source}")]
    Io {
        program: String,
        source: std::io::Error,
    },
}

fn stderr_suffix(stderr: &str) -> String {
    if stderr.trim().is_empty() {
        String::new()
    } else {
        format!("; its stderr: {}", stderr.trim())
    }
}

impl NotifyError {
    /// One line without the hook's own output, for a log other people read
    /// (prepare's job log): what the hook printed may not be theirs to see.
    pub fn short(&self) -> String {
        match self {
            NotifyError::Spawn { .. } => "the notify command could not be started".into(),
            NotifyError::Timeout { timeout, .. } => format!(
                "the notify command did not finish within {} s and was stopped",
                timeout.as_secs_f64()
            ),
            NotifyError::Failed { status, .. } => format!("the notify command {status}"),
            NotifyError::Io { .. } => "the notify command failed".into(),
        }
    }
}

/// Runs the operator's hook.
#[derive(Debug, Clone)]
pub struct Notifier {
    argv: Vec<String>,
    timeout: Duration,
}

impl Notifier {
    /// `None` when no `notify_command` is set.
    pub fn from_settings(settings: &crate::settings::SuspendSettings) -> Option<Notifier> {
        Notifier::new(
            settings.notify_command.clone(),
            settings.notify_timeout.get(),
        )
    }

    pub fn new(argv: Vec<String>, timeout: Duration) -> Option<Notifier> {
        (!argv.is_empty()).then_some(Notifier { argv, timeout })
    }

    fn program(&self) -> String {
        PathBuf::from(&self.argv[0]).display().to_string()
    }

    /// Runs the hook with `n` on stdin, within the timeout. Never panics and
    /// never takes longer than the timeout plus a moment to reap the killed group.
    pub async fn send(&self, n: &Notification) -> Result<(), NotifyError> {
        let program = self.program();
        let doc = serde_json::to_vec(n).expect("a notification always serializes");
        let mut child = tokio::process::Command::new(&self.argv[0])
            .args(&self.argv[1..])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            // Its own group: on timeout everything it started goes too, and the
            // runner's signals to dormant's group do not reach it half-way.
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| NotifyError::Spawn {
                program: program.clone(),
                source,
            })?;
        let pgid = child.id().map(|p| p as i32);
        let mut stdin = child.stdin.take();
        let mut stderr = child.stderr.take();
        let work = async {
            if let Some(mut stdin) = stdin.take() {
                // A hook that does not read its stdin is not an error.
                let _ = stdin.write_all(&doc).await;
                let _ = stdin.write_all(b"\n").await;
                drop(stdin);
            }
            let mut kept = Vec::new();
            if let Some(err) = stderr.as_mut() {
                let mut buf = [0u8; 1024];
                loop {
                    match err.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => {
                            let room = STDERR_KEPT.saturating_sub(kept.len());
                            kept.extend_from_slice(&buf[..n.min(room)]);
                        }
                    }
                }
            }
            let status = child.wait().await;
            (status, kept)
        };
        let result = tokio::time::timeout(self.timeout, work).await;
        match result {
            Ok((Ok(status), kept)) => {
                if status.success() {
                    return Ok(());
                }
                let status = match (status.code(), status.signal()) {
                    (Some(c), _) => format!("exited with {c}"),
                    (None, Some(s)) => format!("was killed by signal {s}"),
                    (None, None) => format!("ended with {status}"),
                };
                Err(NotifyError::Failed {
                    program,
                    status,
                    stderr: String::from_utf8_lossy(&kept).into_owned(),
                })
            }
            Ok((Err(source), _)) => Err(NotifyError::Io { program, source }),
            Err(_elapsed) => {
                if let Some(pgid) = pgid {
                    // SAFETY: kill(2) on a negative pid signals a process group
                    // (the hook's own, made by process_group(0)); no memory is touched.
                    unsafe {
                        libc::kill(-pgid, libc::SIGKILL);
                    }
                }
                let _ = tokio::time::timeout(REAP_GRACE, child.wait()).await;
                Err(NotifyError::Timeout {
                    program,
                    timeout: self.timeout,
                })
            }
        }
    }
}

/// RFC 3339 UTC, as every time dormant writes for others reads.
pub use crate::state::rfc3339;

#[cfg(test)]
#[path = "notify_tests.rs"]
mod tests;
