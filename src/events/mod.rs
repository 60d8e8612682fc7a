//! The event history: every lifecycle event of every environment — created,
//! resumed, suspended, released, a failed step, a recovered stale claim, a
//! sweep, a refused resume, a failed notify hook — appended as one JSON line to the event log under
//! `<state dir>/events/`, so an operator can ask what *happened* long after
//! the stage processes that did it have exited (`dormant events`, the last
//! events in `dormant inspect`, the counters and histograms of
//! `dormant metrics`).
//!
//! This module is the one owner of the log: the vocabulary and the line
//! (here), appending and rotation (`append.rs`), reading and following
//! (`read.rs`), and the metrics folded from it (`tally.rs`). Events are
//! written from the places where the transitions happen — the lifecycle's
//! suspend, release, recover and sweep (`crate::lifecycle`), and prepare's
//! activation of a new or resumed environment (`crate::stages`) — never from
//! copies elsewhere. README "Event log" and docs/architecture.md say what each
//! event means.
//!
//! The log is for operators: writing it never fails or holds up a job
//! ([`EventLog::record`] warns and carries on).

mod append;
pub mod read;
pub mod tally;

use std::time::Duration;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

pub use append::EventLog;

/// The event log's directory in a state dir.
pub fn dir(state_root: &std::path::Path) -> std::path::PathBuf {
    state_root.join(append::DIR)
}

use crate::state::{EnvironmentRecord, Holder};

/// The version every line carries (`"v"`); it changes only when a field
/// changes meaning or goes away. Readers skip lines of a newer version.
pub const LINE_VERSION: u32 = 1;

/// How much of an error a line keeps: enough for a provider's whole message,
/// and a line stays far below the smallest file size (4 KiB).
const ERROR_MAX: usize = 2048;
/// How much of a reason (a job's own words, from its suspend request) a line keeps.
const REASON_MAX: usize = 400;

/// What happened. The strings are the `event` field of a line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A new environment is ready for its job (prepare finished).
    Created,
    /// A suspended environment runs again, for a job or a shell.
    Resumed,
    /// The machine was stopped, the environment kept (a failed stop keeps it too).
    Suspended,
    /// The machine and the environment's files are deleted.
    Released,
    /// A step on the machine failed.
    Failed,
    /// A claim whose holder was gone was taken over and settled.
    Recovered,
    /// A sweep's summary.
    Sweep,
    /// A job's resume was refused (its cause: [`RefuseCause`]); the
    /// environment is as it was.
    Refused,
    /// The notify hook failed (its cause: the hook's event, `suspend`,
    /// `resume`, `release`, `expire`); whatever it was told of happened.
    NotifyFailed,
    /// A suspended environment whose record was lost with its runner-manager
    /// host, taken over by this one (`dormant adopt`).
    Adopted,
    /// A warm machine (booted ahead of any job) was launched, became ready,
    /// was taken by an environment, or retired; or a prepare found none
    /// (`missed`). Its cause says which ([`WARM_CAUSES`]).
    Warm,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Created => "created",
            Kind::Resumed => "resumed",
            Kind::Suspended => "suspended",
            Kind::Released => "released",
            Kind::Failed => "failed",
            Kind::Recovered => "recovered",
            Kind::Sweep => "sweep",
            Kind::Refused => "refused",
            Kind::NotifyFailed => "notify_failed",
            Kind::Adopted => "adopted",
            Kind::Warm => "warm",
        }
    }
}

/// Why an environment was suspended (the `cause` of a `suspended` line).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SuspendCause {
    /// The job's outcome matched its `suspend_on_success` / `suspend_on_failure`.
    Triggers,
    /// The job asked through `DORMANT_SUSPEND_FILE`.
    JobRequest,
    /// A `dormant shell` ended.
    Shell,
    /// The machine was lost under a running job (an instance gone, a host
    /// down) and the environment's disk kept for a later resume.
    MachineLost,
    /// Put back as it was: a resume whose job never reached a stage, or whose
    /// start or connection failed, or a stop that had not finished.
    Unused,
    /// A stale claim (its holder gone) settled to suspended.
    Recovered,
    /// A job's script asked (`dormant-ask`) and waits, kept alive.
    Paused,
}

impl SuspendCause {
    pub const ALL: [SuspendCause; 7] = [
        SuspendCause::Triggers,
        SuspendCause::JobRequest,
        SuspendCause::Shell,
        SuspendCause::MachineLost,
        SuspendCause::Unused,
        SuspendCause::Recovered,
        SuspendCause::Paused,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            SuspendCause::Triggers => "triggers",
            SuspendCause::JobRequest => "job_request",
            SuspendCause::Shell => "shell",
            SuspendCause::MachineLost => "machine_lost",
            SuspendCause::Unused => "unused",
            SuspendCause::Recovered => "recovered",
            SuspendCause::Paused => "paused",
        }
    }
}

/// Why an environment was released (the `cause` of a `released` line).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReleaseCause {
    /// The job ended and no trigger (nor a request) matched its outcome.
    NoTrigger,
    /// The job was canceled, timed out, or terminated (also during its suspension).
    Canceled,
    /// A new environment whose prepare did not finish.
    PrepareFailed,
    /// The job asked to suspend, but `suspend.enabled = false`.
    SuspendDisabled,
    /// Suspended longer than `suspend.ttl`.
    Ttl,
    /// `dormant release`, or `dormant shell --release`.
    Operator,
    /// `dormant sweep --delete-orphans`: a machine no record knew.
    Orphan,
    /// A stale claim (its holder gone) settled to released.
    Recovered,
    /// A release that had failed, finished by a sweep.
    Retried,
}

impl ReleaseCause {
    pub const ALL: [ReleaseCause; 9] = [
        ReleaseCause::NoTrigger,
        ReleaseCause::Canceled,
        ReleaseCause::PrepareFailed,
        ReleaseCause::SuspendDisabled,
        ReleaseCause::Ttl,
        ReleaseCause::Operator,
        ReleaseCause::Orphan,
        ReleaseCause::Recovered,
        ReleaseCause::Retried,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ReleaseCause::NoTrigger => "no_trigger",
            ReleaseCause::Canceled => "canceled",
            ReleaseCause::PrepareFailed => "prepare_failed",
            ReleaseCause::SuspendDisabled => "suspend_disabled",
            ReleaseCause::Ttl => "ttl",
            ReleaseCause::Operator => "operator",
            ReleaseCause::Orphan => "orphan",
            ReleaseCause::Recovered => "recovered",
            ReleaseCause::Retried => "retried",
        }
    }
}

/// Which step failed (the `cause` of a `failed` line).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Making a new machine (prepare).
    Create,
    /// Starting a suspended machine (a resume, a shell).
    Start,
    /// Reaching a made or started machine (SSH readiness, probes).
    Connect,
    /// Stopping a machine to suspend it (kept as suspended all the same).
    Stop,
    /// Deleting a machine (the environment stays `releasing`; a sweep retries).
    Delete,
}

impl Step {
    pub const ALL: [Step; 5] = [
        Step::Create,
        Step::Start,
        Step::Connect,
        Step::Stop,
        Step::Delete,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Step::Create => "create",
            Step::Start => "start",
            Step::Connect => "connect",
            Step::Stop => "stop",
            Step::Delete => "delete",
        }
    }
}

/// Why a job's resume was refused (the `cause` of a `refused` line).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefuseCause {
    /// The key does not parse.
    MalformedKey,
    /// The key is another runner manager's (runner id or system id).
    OtherRunner,
    /// The key is for another provider than this runner's.
    OtherProvider,
    /// No such environment in the registry (released, expired, state lost).
    NotFound,
    /// The environment belongs to another project.
    OtherProject,
    /// The key's fields differ from the environment's record.
    AlteredKey,
    /// Held by a live job or shell, within its claim grace, or being released.
    InUse,
    /// The environment's machine no longer exists.
    MachineGone,
    /// The environment's data volume (volume mode) no longer exists.
    VolumeGone,
    /// The provider refused the start (what it says is in `error`).
    Provider,
}

impl RefuseCause {
    pub const ALL: [RefuseCause; 10] = [
        RefuseCause::MalformedKey,
        RefuseCause::OtherRunner,
        RefuseCause::OtherProvider,
        RefuseCause::NotFound,
        RefuseCause::OtherProject,
        RefuseCause::AlteredKey,
        RefuseCause::InUse,
        RefuseCause::MachineGone,
        RefuseCause::VolumeGone,
        RefuseCause::Provider,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RefuseCause::MalformedKey => "malformed_key",
            RefuseCause::OtherRunner => "other_runner",
            RefuseCause::OtherProvider => "other_provider",
            RefuseCause::NotFound => "not_found",
            RefuseCause::OtherProject => "other_project",
            RefuseCause::AlteredKey => "altered_key",
            RefuseCause::InUse => "in_use",
            RefuseCause::MachineGone => "machine_gone",
            RefuseCause::VolumeGone => "volume_gone",
            RefuseCause::Provider => "provider",
        }
    }
}

/// The causes of a `notify_failed` line: the event the hook was told of.
pub const NOTIFY_EVENTS: [&str; 4] = ["suspend", "resume", "release", "expire"];

/// The causes a `recovered` line can carry: what the stale claim was settled to.
pub const RECOVERED_CAUSES: [&str; 3] = ["release", "suspend", "resuspend"];
/// The causes of a `warm` line.
pub const WARM_CAUSES: [&str; 5] = ["launched", "ready", "taken", "missed", "retired"];
/// The scopes of a `sweep` line (its cause).
pub const SWEEP_SCOPES: [&str; 2] = ["full", "slice"];

/// Every (event, cause) pair dormant writes. `dormant metrics` prints a zero
/// for each one not seen yet, so a dashboard has a series to plot from the
/// first scrape (a counter that appears only at its first increment makes
/// `rate` and `increase` miss that increment, and a panel say "No data").
pub fn known_causes() -> Vec<(&'static str, &'static str)> {
    let mut out = vec![
        (Kind::Created.as_str(), "job"),
        (Kind::Resumed.as_str(), "job"),
        (Kind::Resumed.as_str(), "shell"),
    ];
    out.extend(
        SuspendCause::ALL
            .iter()
            .map(|c| (Kind::Suspended.as_str(), c.as_str())),
    );
    out.extend(
        ReleaseCause::ALL
            .iter()
            .map(|c| (Kind::Released.as_str(), c.as_str())),
    );
    out.extend(
        Step::ALL
            .iter()
            .map(|c| (Kind::Failed.as_str(), c.as_str())),
    );
    out.extend(
        RECOVERED_CAUSES
            .iter()
            .map(|c| (Kind::Recovered.as_str(), *c)),
    );
    out.extend(SWEEP_SCOPES.iter().map(|c| (Kind::Sweep.as_str(), *c)));
    out.extend(
        RefuseCause::ALL
            .iter()
            .map(|c| (Kind::Refused.as_str(), c.as_str())),
    );
    out.extend(
        NOTIFY_EVENTS
            .iter()
            .map(|c| (Kind::NotifyFailed.as_str(), *c)),
    );
    // `dormant adopt` is the one source of adoptions.
    out.push((Kind::Adopted.as_str(), "operator"));
    out.extend(WARM_CAUSES.iter().map(|c| (Kind::Warm.as_str(), *c)));
    out
}

/// A sweep's counts (the `sweep` field of a `sweep` line).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SweepCounts {
    /// Environments looked at.
    pub visited: u64,
    /// Released past the TTL, or a failed release finished.
    pub released: u64,
    /// Stale claims recovered.
    pub recovered: u64,
    /// Leftovers of killed processes removed.
    pub removed: u64,
    pub errors: u64,
    /// Not looked at because the time bound ran out.
    pub unvisited: u64,
    /// Environments in the registry when it started (a full sweep; a
    /// cleanup's slice reads only its own entries and does not know).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub environments: Option<u64>,
}

/// One line of the event log. Fields a reader does not know are ignored,
/// so a newer dormant may add some without breaking an older reader.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    pub v: u32,
    /// When, RFC 3339 UTC with milliseconds.
    pub time: String,
    /// The same instant in milliseconds since the Unix epoch.
    pub ts_ms: u64,
    /// `created`, `resumed`, `suspended`, `released`, `failed`, `recovered`,
    /// `sweep`, `refused`, `notify_failed`.
    pub event: String,
    /// The machine-readable why (see the enums above); for `failed` the step.
    pub cause: String,
    /// The environment (`null` for a sweep, and an orphan without its tag).
    pub env: Option<Uuid>,
    pub key: Option<String>,
    /// The job that caused it, if a job did.
    pub job: Option<u64>,
    pub project: Option<u64>,
    /// `local`, `ssh`, `ec2`, `qemu`.
    pub provider: String,
    /// How long it took, where it has a duration: prepare (created,
    /// resumed), the stop (suspended), the delete (released), the sweep.
    pub duration_s: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub project_path: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runner: Option<String>,
    /// Who did it: "job 12", "a shell (dormant shell, pid 3)", "dormant sweep (pid 9)".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by: Option<String>,
    /// Why, in words (as the notify hook says it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// `resumed`: how long the environment had been suspended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suspended_s: Option<f64>,
    /// `failed`, and a `suspended` whose stop failed: the error.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// `recovered`: the holder that was gone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sweep: Option<SweepCounts>,
    /// `warm`: the warm machine's id (`dormant list` shows it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warm: Option<uuid::Uuid>,
}

impl Event {
    /// An event stamped now; the builders below fill in what is known.
    pub fn new(kind: Kind, cause: &str, provider: &str) -> Event {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let ts_ms = now.as_millis() as u64;
        let time = crate::state::rfc3339(now.as_secs());
        Event {
            v: LINE_VERSION,
            // `2026-11-23T13:40:00Z` → `2026-11-23T13:40:00.123Z`
            time: format!("{}.{:03}Z", time.trim_end_matches('Z'), ts_ms % 1000),
            ts_ms,
            event: kind.as_str().to_string(),
            cause: cause.to_string(),
            env: None,
            key: None,
            job: None,
            project: None,
            provider: provider.to_string(),
            duration_s: None,
            project_path: None,
            runner: None,
            by: None,
            reason: None,
            suspended_s: None,
            error: None,
            from: None,
            sweep: None,
            warm: None,
        }
    }

    /// An event about the environment `rec`: its id, key, project, provider
    /// and runner; by its holder's job when a job holds it.
    pub fn about(kind: Kind, cause: &str, rec: &EnvironmentRecord) -> Event {
        let mut e = Event::new(kind, cause, &rec.provider);
        e.env = Some(rec.id);
        e.key = rec.key.clone();
        e.project = Some(rec.project_id);
        e.project_path = rec.project_path.clone();
        e.runner = Some(rec.runner_id.clone());
        if let Some(h) = rec.holder() {
            e = e.by(h);
        }
        e
    }

    /// Who did it; a job holder also sets `job`.
    pub fn by(mut self, holder: &Holder) -> Event {
        self.by = Some(holder.describe());
        if let Some(job) = holder.job_id() {
            self.job = Some(job);
        }
        self
    }

    pub fn job(mut self, job: Option<u64>) -> Event {
        if job.is_some() {
            self.job = job;
        }
        self
    }

    pub fn duration(mut self, d: Duration) -> Event {
        self.duration_s = Some(round_ms(d.as_secs_f64()));
        self
    }

    pub fn reason(mut self, reason: &str) -> Event {
        self.reason = Some(cut(reason, REASON_MAX));
        self
    }

    /// The error, as its chain reads (`a: b: c`), cut at 2 KiB.
    pub fn error(mut self, e: &anyhow::Error) -> Event {
        self.error = Some(cut(&format!("{e:#}"), ERROR_MAX));
        self
    }

    pub fn error_text(mut self, e: &str) -> Event {
        self.error = Some(cut(e, ERROR_MAX));
        self
    }

    pub fn suspended_for(mut self, secs: u64) -> Event {
        self.suspended_s = Some(secs as f64);
        self
    }

    pub fn from_holder(mut self, holder: &Holder) -> Event {
        self.from = Some(holder.describe());
        self
    }

    pub fn sweep(mut self, counts: SweepCounts) -> Event {
        self.sweep = Some(counts);
        self
    }

    /// The line as written, without its newline.
    pub fn to_line(&self) -> String {
        serde_json::to_string(self).expect("an event always serializes")
    }
}

/// Milliseconds are all a latency needs; shorter lines.
fn round_ms(secs: f64) -> f64 {
    (secs * 1000.0).round() / 1000.0
}

/// At most `max` bytes of `s`, cut on a character boundary, with `…` when cut.
fn cut(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

#[cfg(test)]
#[path = "events_tests.rs"]
mod tests;
