//! The counters and histograms of `dormant metrics`, folded from the event
//! log: events by kind and cause, failures by step, prepare time of new and
//! resumed environments, suspend time, time suspended before a resume, the
//! sweeps, and the machine-seconds warm machines waited in the pool (from
//! each one's `warm`/`ready` event to its `taken` or `retired`) — per
//! provider. How they are printed for Prometheus is `exposition.rs`.
//!
//! **Why a metrics run stays cheap as the log grows:** a checkpoint,
//! `events/metrics.json`, holds the totals so far and the position (file,
//! byte offset) up to which they count. A run loads it, reads only the lines
//! appended since, folds them in, and saves it again: its cost is the number
//! of new events since the last run (the package's timer runs it every
//! minute), not the size of the log. The checkpoint also keeps the counters
//! monotonic across rotations: a file deleted by rotation was already counted.
//! It is derived data: a damaged or foreign one is set aside
//! (`metrics.json.damaged`) and rebuilt from the log, with a warning.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Result;
use serde::{Deserialize, Serialize};

use super::read::{read_from, Line, Position};
use super::Event;
use crate::state::store::{self, FORMAT_VERSION};

/// The checkpoint's name in the log's directory.
pub const CHECKPOINT: &str = "metrics.json";
/// Changes when what is counted changes: an older checkpoint is rebuilt.
/// 2: warm machines' idle time.
const TALLY_FORMAT: u32 = 3;
/// At most this many warm machines waiting for their `taken` or `retired`
/// line are remembered (a pool is a handful; one whose last line a killed
/// process never wrote must not grow the checkpoint for ever): the oldest
/// is forgotten first, its idle time not counted.
const WARM_WAITING_MAX: usize = 1000;

/// Histogram buckets (upper bounds, seconds) from a tenth of a second to 30
/// days: a resume takes seconds, a new VM minutes, a suspension days.
pub const BUCKETS: [f64; 22] = [
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 10800.0,
    21600.0, 43200.0, 86400.0, 172800.0, 604800.0, 1209600.0, 2592000.0,
];

/// One histogram's counts: per bucket (not cumulative; the last is `+Inf`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Histogram {
    pub counts: Vec<u64>,
    pub sum: f64,
    pub count: u64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            counts: vec![0; BUCKETS.len() + 1],
            sum: 0.0,
            count: 0,
        }
    }
}

impl Histogram {
    fn observe(&mut self, v: f64) {
        if !v.is_finite() || v < 0.0 {
            return;
        }
        let i = BUCKETS
            .iter()
            .position(|b| v <= *b)
            .unwrap_or(BUCKETS.len());
        if self.counts.len() != BUCKETS.len() + 1 {
            self.counts = vec![0; BUCKETS.len() + 1];
        }
        self.counts[i] += 1;
        self.sum += v;
        self.count += 1;
    }
}

/// Everything counted so far, and where the count stopped. Keys are label
/// values joined by tabs (JSON objects need string keys).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Tally {
    pub version: u32,
    pub tally_format: u32,
    pub pos: Option<Position>,
    /// provider, event, cause
    pub events: BTreeMap<String, u64>,
    /// provider, step
    pub failures: BTreeMap<String, u64>,
    /// metric, provider, extra label value (mode or scope; empty if none)
    pub histograms: BTreeMap<String, Histogram>,
    /// provider, scope
    pub sweep_unvisited: BTreeMap<String, u64>,
    /// provider: seconds warm machines waited ready in the pool, counted
    /// when each left it (taken or retired).
    #[serde(default)]
    pub warm_idle_s: BTreeMap<String, f64>,
    /// provider, warm machine id: when it became ready (ms), until its
    /// `taken` or `retired` line.
    #[serde(default)]
    pub warm_waiting: BTreeMap<String, u64>,
    /// provider: machine-seconds paused environments' machines ran hot (the
    /// hot window), counted when each window ends (taken by a resume,
    /// cooled, or released).
    #[serde(default)]
    pub hot_s: BTreeMap<String, f64>,
    /// provider, environment id: when its hot window began (ms), until it ends.
    #[serde(default)]
    pub hot_waiting: BTreeMap<String, u64>,
    /// provider, path (`hot` or `cold`): continues, i.e. resumes of an
    /// environment whose script waits paused, by whether the machine ran.
    #[serde(default)]
    pub continues: BTreeMap<String, u64>,
    pub damaged: u64,
    pub missed_files: u64,
    pub last_full_sweep_ms: u64,
}

impl Default for Tally {
    fn default() -> Self {
        Tally {
            version: FORMAT_VERSION,
            tally_format: TALLY_FORMAT,
            pos: None,
            events: BTreeMap::new(),
            failures: BTreeMap::new(),
            histograms: BTreeMap::new(),
            sweep_unvisited: BTreeMap::new(),
            warm_idle_s: BTreeMap::new(),
            warm_waiting: BTreeMap::new(),
            hot_s: BTreeMap::new(),
            hot_waiting: BTreeMap::new(),
            continues: BTreeMap::new(),
            damaged: 0,
            missed_files: 0,
            last_full_sweep_ms: 0,
        }
    }
}

/// A label value as written: lines are dormant's own, but a damaged or
/// foreign one must not add a label that breaks the exposition format or
/// multiplies the series.
pub(super) fn label(v: &str) -> &str {
    let ok = !v.is_empty()
        && v.len() <= 64
        && v.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.');
    if ok {
        v
    } else {
        "other"
    }
}

pub(super) fn key(parts: &[&str]) -> String {
    parts
        .iter()
        .map(|p| label(p))
        .collect::<Vec<_>>()
        .join("\t")
}

impl Tally {
    /// Counts one event.
    pub fn fold(&mut self, e: &Event) {
        let provider = label(&e.provider);
        *self
            .events
            .entry(key(&[provider, &e.event, &e.cause]))
            .or_default() += 1;
        self.fold_hot(e);
        let mut observe = |metric: &str, extra: &str, v: Option<f64>| {
            if let Some(v) = v {
                let extra = if extra.is_empty() { "" } else { label(extra) };
                self.histograms
                    .entry(format!("{metric}\t{provider}\t{extra}"))
                    .or_default()
                    .observe(v);
            }
        };
        match e.event.as_str() {
            "created" => {
                let mode = if e.warm.is_some() { "new_warm" } else { "new" };
                observe("prepare", mode, e.duration_s)
            }
            "resumed" => {
                let mode = match (e.cause.as_str(), e.warm.is_some()) {
                    ("shell", _) => "shell",
                    (_, true) => "resume_warm",
                    _ => "resume",
                };
                observe("prepare", mode, e.duration_s);
                observe("suspended_before_resume", "", e.suspended_s);
            }
            "suspended" => observe("suspend", "", e.duration_s),
            "sweep" => {
                observe("sweep", &e.cause, e.duration_s);
                if let Some(s) = &e.sweep {
                    *self
                        .sweep_unvisited
                        .entry(key(&[provider, &e.cause]))
                        .or_default() += s.unvisited;
                }
                if e.cause == "full" {
                    self.last_full_sweep_ms = self.last_full_sweep_ms.max(e.ts_ms);
                }
            }
            "failed" => *self.failures.entry(key(&[provider, &e.cause])).or_default() += 1,
            "warm" => self.fold_warm(e),
            _ => {}
        }
    }

    /// The hot window's machine-seconds (from the `suspended` line that
    /// made it hot to the `resumed` (cause `hot`), `suspended` (cause
    /// `cooled`) or `released` line of the same environment) and the
    /// continues served hot or cold (`resumed` lines with `hot`).
    fn fold_hot(&mut self, e: &Event) {
        let provider = label(&e.provider).to_string();
        if e.event == "resumed" {
            if let Some(hot) = e.hot {
                let path = if hot { "hot" } else { "cold" };
                *self.continues.entry(key(&[&provider, path])).or_default() += 1;
            }
        }
        let Some(env) = e.env else { return };
        let k = format!("{provider}\t{env}");
        let ends = matches!(
            (e.event.as_str(), e.cause.as_str()),
            ("resumed", "hot") | ("suspended", "cooled") | ("released", _)
        );
        if e.event == "suspended" && e.hot_until.is_some() {
            self.hot_waiting.insert(k, e.ts_ms);
            while self.hot_waiting.len() > WARM_WAITING_MAX {
                let oldest = self
                    .hot_waiting
                    .iter()
                    .min_by_key(|(_, ts)| **ts)
                    .map(|(k, _)| k.clone());
                if let Some(oldest) = oldest {
                    self.hot_waiting.remove(&oldest);
                }
            }
        } else if ends {
            if let Some(since) = self.hot_waiting.remove(&k) {
                let secs = e.ts_ms.saturating_sub(since) as f64 / 1000.0;
                *self.hot_s.entry(provider).or_default() += secs;
            }
        }
    }

    /// A warm machine's idle time: from its `ready` line to its `taken` or
    /// `retired` one (a machine retired before it was ready never waited).
    fn fold_warm(&mut self, e: &Event) {
        let provider = label(&e.provider);
        let Some(id) = e.warm else { return };
        let k = format!("{provider}\t{id}");
        match e.cause.as_str() {
            "ready" => {
                self.warm_waiting.insert(k, e.ts_ms);
                while self.warm_waiting.len() > WARM_WAITING_MAX {
                    let oldest = self
                        .warm_waiting
                        .iter()
                        .min_by_key(|(_, ts)| **ts)
                        .map(|(k, _)| k.clone());
                    if let Some(oldest) = oldest {
                        self.warm_waiting.remove(&oldest);
                    }
                }
            }
            "taken" | "retired" => {
                if let Some(since) = self.warm_waiting.remove(&k) {
                    let secs = e.ts_ms.saturating_sub(since) as f64 / 1000.0;
                    *self.warm_idle_s.entry(provider.to_string()).or_default() += secs;
                }
            }
            _ => {}
        }
    }

    /// Loads the checkpoint in `dir`, folds in what was appended since, and
    /// saves it. Warnings (a checkpoint rebuilt, or not saved) are returned
    /// for the caller to print; the numbers are right either way.
    pub fn update(dir: &Path) -> Result<(Tally, Vec<String>)> {
        let mut warnings = Vec::new();
        let path = dir.join(CHECKPOINT);
        let loaded = match store::read_json::<Tally>(&path) {
            Ok(t) => t.filter(|t| t.tally_format == TALLY_FORMAT),
            Err(e) => {
                let aside = dir.join(format!("{CHECKPOINT}.damaged"));
                let _ = std::fs::rename(&path, &aside);
                warnings.push(format!(
                    "{e:#}; moved to {} and counted again from the event log",
                    aside.display()
                ));
                None
            }
        };
        let existed = loaded.is_some();
        let mut tally = loaded.unwrap_or_default();
        let before = tally.pos;
        let progress = read_from(dir, tally.pos, &mut |line| {
            if let Line::Event(e, _) = line {
                tally.fold(&e);
            }
        })?;
        tally.pos = progress.pos;
        tally.damaged += progress.damaged;
        tally.missed_files += progress.missed_files;
        if tally.pos.is_some() && (tally.pos != before || !existed) {
            // Unsynced: a power loss only means the next run counts again
            // from the previous checkpoint.
            if let Err(e) = store::write_json_unsynced(&path, &tally) {
                warnings.push(format!(
                    "{e:#}; the counts are right, but the next run reads the log again from where \
                     the last saved checkpoint stopped"
                ));
            }
        }
        Ok((tally, warnings))
    }
}

/// The `N` label values of a key (missing ones empty).
pub(super) fn split<const N: usize>(k: &str) -> [&str; N] {
    let mut out = [""; N];
    for (slot, part) in out.iter_mut().zip(k.split('\t')) {
        *slot = part;
    }
    out
}
