//! The event history: every lifecycle event of every environment — created,
//! resumed, suspended, released, a failed step, a recovered stale claim, a
//! sweep, a refused resume, a failed notify hook — appended as one JSON line to the event log under
//! `<state dir>/events/`, so an operator can ask what *happened* long after
//! the stage processes that did it have exited (`dormant events`, the last
//! events in `dormant inspect`, the counters and histograms of
//! `dormant metrics`).
//!
//! This module is the one owner of the log: the line (here), the vocabulary
//! of events and causes (`vocabulary.rs`), appending and rotation
//! (`append.rs`), reading and following (`read.rs`), and the metrics folded
//! from it (`tally.rs`) and printed for Prometheus (`exposition.rs`). Events are
//! written from the places where the transitions happen — the lifecycle's
//! suspend, release, recover and sweep (`crate::lifecycle`), and prepare's
//! activation of a new or resumed environment (`crate::stages`) — never from
//! copies elsewhere. docs/guide/events.md and docs/architecture.md say what each
//! event means.
//!
//! The log is for operators: writing it never fails or holds up a job
//! ([`EventLog::record`] warns and carries on).

mod append;
mod exposition;
pub mod read;
pub mod tally;
mod vocabulary;

use std::time::Duration;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

pub use append::EventLog;
pub use vocabulary::{
    known_causes, Kind, RefuseCause, ReleaseCause, Step, SuspendCause, JOINED_CAUSES,
    NOTIFY_EVENTS, RECOVERED_CAUSES, SWEEP_SCOPES, WARM_CAUSES,
};

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
    /// Hot windows that had passed, ended (docs/pause.md).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cooled: u64,
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
    /// `joined`: the local user who ran the command (`alice`; under sudo
    /// `root (sudo by alice)`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// `suspended` (cause `paused`) into a hot window: when the window ends,
    /// RFC 3339 UTC; the machine runs until then (docs/pause.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hot_until: Option<String>,
    /// `resumed` of an environment with a paused script: a continue, served
    /// hot (`true`: the running machine taken, cause `hot`) or cold.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hot: Option<bool>,
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
            user: None,
            hot_until: None,
            hot: None,
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

    /// Who did it, in words, when it is not a holder (`dormant attach (pid 9)`).
    pub fn by_text(mut self, by: &str) -> Event {
        self.by = Some(by.to_string());
        self
    }

    /// The local user who did it.
    pub fn user(mut self, user: &str) -> Event {
        self.user = Some(cut(user, REASON_MAX));
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

fn is_zero(n: &u64) -> bool {
    *n == 0
}
