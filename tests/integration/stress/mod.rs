//! Concurrency stress: many jobs at once in ONE state dir, driven through the
//! built binary exactly as GitLab Runner drives it (`runner_sim`, `local`
//! provider), with `dormant sweep` looping concurrently (one loop with a tiny
//! TTL, so it really releases things), `dormant release` by hand, and several
//! jobs racing to resume one key. After each round the state dir is checked
//! from the outside (files on disk, the binary's exit codes and output):
//! every state file parses, what should be suspended is suspended and
//! resumable, what was released is gone, and nothing leaked.
//!
//! The driver knows nothing of dormant's internals beyond the key format and
//! the on-disk layout docs/guide/state.md documents (`environments/<id>/record.json`
//! with its `status` and `key`, `jobs/`). CI runs `DORMANT_STRESS_ROUNDS`
//! rounds (default 2); `scripts/stress.sh ROUNDS` runs many and prints the table.
//! `DORMANT_STRESS_SWEEP_LOOPS` (0–2, default 2) and `DORMANT_STRESS_TTL`
//! (default `2s`) turn the sweep loops and the short TTL down for plain runs.
//!
//! A sweep may legitimately release a suspended environment idle past the
//! TTL, so the checks accept "gone" for such an environment when a sweep (or
//! another job's cleanup) named it; a live job's environment, though, must
//! never be taken from under it (`job_broken_by_sweep`).
//!
//! - `storm.rs`: one round's jobs, releases and sweep loops
//! - `checks.rs`: what the round must have left, from the outside

mod checks;
mod storm;

use std::collections::BTreeMap;
use std::time::Duration;

/// Failure kinds and what each means; every one must stay at 0.
pub const FAILURES: &[(&str, &str)] = &[
    (
        "unparsable_state",
        "a *.json under the state dir does not parse",
    ),
    (
        "orphan_env_dir",
        "environments/<id>/ without record.json (e.g. only record.lock)",
    ),
    (
        "job_state_left",
        "jobs/*.json left after every cleanup completed",
    ),
    (
        "job_lock_left",
        "jobs/*.lock left after every cleanup completed",
    ),
    (
        "stray_temp_file",
        "a temp file (*.tmp) left in the state dir",
    ),
    (
        "torn_event_line",
        "an event log file (events/*.jsonl) that does not end on a newline",
    ),
    (
        "damaged_event_line",
        "a line of the event log that does not parse (torn or interleaved)",
    ),
    (
        "stuck_status",
        "a record neither suspended nor gone once every process ended",
    ),
    (
        "lost_environment",
        "expected suspended, gone, and no sweep or cleanup said it released it",
    ),
    (
        "not_released",
        "released (by its job or `dormant release`) yet still on disk",
    ),
    (
        "race_winners",
        "a key race with a number of winners other than one (and no sweep took it)",
    ),
    (
        "race_loser",
        "a race loser not refused as a build failure saying \"in use\"",
    ),
    ("cleanup_failed", "a cleanup exited non-zero"),
    ("sweep_failed", "a `dormant sweep` exited non-zero"),
    (
        "release_failed",
        "`dormant release` failed for another reason than losing to a job or sweep",
    ),
    (
        "unexpected_job_result",
        "a job ended otherwise than its script says, with no sweep to blame",
    ),
    (
        "job_broken_by_sweep",
        "a sweep released a live job's environment under it",
    ),
    (
        "not_resumable",
        "a suspended environment left by the round could not be resumed",
    ),
    (
        "leaked_after_verify",
        "files left under environments/, jobs/ or ctl/ after resuming and releasing everything",
    ),
];

/// What one round found: failures by kind (with examples) and what happened.
#[derive(Debug, Default)]
pub struct RoundReport {
    pub failures: BTreeMap<&'static str, Vec<String>>,
    pub jobs: usize,
    pub max_concurrent_jobs: usize,
    pub sweeps: usize,
    pub swept: usize,
    pub races_preempted: usize,
    pub elapsed: Duration,
}

impl RoundReport {
    fn fail(&mut self, kind: &'static str, detail: impl Into<String>) {
        assert!(
            FAILURES.iter().any(|(k, _)| *k == kind),
            "unknown kind {kind}"
        );
        self.failures.entry(kind).or_default().push(detail.into());
    }

    pub fn count(&self, kind: &str) -> usize {
        self.failures.get(kind).map_or(0, Vec::len)
    }
}

/// Runs one round and checks it.
pub fn round() -> RoundReport {
    let started = std::time::Instant::now();
    let storm = storm::run();
    let mut rep = checks::check(&storm);
    rep.elapsed = started.elapsed();
    rep
}

/// Prints one line per round and a table of failure kinds over all rounds.
pub fn print_table(reports: &[RoundReport]) {
    eprintln!(
        "\n{:>5}  {:>4}  {:>8}  {:>6}  {:>5}  {:>9}  {:>7}  failures",
        "round", "jobs", "at once", "sweeps", "swept", "preempted", "secs"
    );
    for (i, r) in reports.iter().enumerate() {
        let fails: Vec<String> = r
            .failures
            .iter()
            .map(|(k, v)| format!("{k}={}", v.len()))
            .collect();
        eprintln!(
            "{:>5}  {:>4}  {:>8}  {:>6}  {:>5}  {:>9}  {:>7.1}  {}",
            i + 1,
            r.jobs,
            r.max_concurrent_jobs,
            r.sweeps,
            r.swept,
            r.races_preempted,
            r.elapsed.as_secs_f64(),
            if fails.is_empty() {
                "-".into()
            } else {
                fails.join(" ")
            }
        );
    }
    eprintln!("\n| failure kind | rounds with it | total | meaning |\n|---|---:|---:|---|");
    for (kind, meaning) in FAILURES {
        let rounds = reports.iter().filter(|r| r.count(kind) > 0).count();
        let total: usize = reports.iter().map(|r| r.count(kind)).sum();
        eprintln!(
            "| {kind} | {rounds}/{} | {total} | {meaning} |",
            reports.len()
        );
    }
    let mut causes: BTreeMap<(&str, String), usize> = BTreeMap::new();
    for (kind, details) in reports.iter().flat_map(|r| &r.failures) {
        for d in details {
            *causes.entry((kind, normalize(d))).or_default() += 1;
        }
    }
    if !causes.is_empty() {
        eprintln!(
            "\n| failure kind | count | detail (ids, numbers, paths blanked) |\n|---|---:|---|"
        );
        for ((kind, cause), n) in &causes {
            eprintln!("| {kind} | {n} | {} |", cause.replace('|', "\\|"));
        }
    }
    eprintln!();
}

/// A message with ids, numbers and paths blanked, to count distinct causes.
fn normalize(msg: &str) -> String {
    msg.split_whitespace()
        .map(|w| {
            if w.contains('/') {
                "<path>".to_string()
            } else if w.chars().any(|c| c.is_ascii_digit()) {
                "<n>".to_string()
            } else {
                w.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[test]
fn many_jobs_at_once_with_sweeps_releases_and_key_races_leave_consistent_state() {
    let rounds: usize = std::env::var("DORMANT_STRESS_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    let reports: Vec<RoundReport> = (0..rounds).map(|_| round()).collect();
    print_table(&reports);
    for r in &reports {
        assert!(
            r.max_concurrent_jobs >= 16,
            "only {} jobs ran at once",
            r.max_concurrent_jobs
        );
    }
    let failed: Vec<String> = reports
        .iter()
        .enumerate()
        .flat_map(|(i, r)| {
            r.failures
                .iter()
                .map(move |(k, v)| format!("round {}: {k} ×{}: e.g. {}", i + 1, v.len(), v[0]))
        })
        .collect();
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}
