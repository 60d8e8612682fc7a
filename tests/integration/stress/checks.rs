//! What a round must have left, judged from the outside: exit codes and
//! output of every call, and the files under the state dir.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Output;

use crate::harness::*;

use super::storm::{dormant_cmd, env_id, own_env, Finished, Role, Setup, Storm, PROJECT};
use super::RoundReport;

/// Checks a finished storm.
pub(super) fn check(storm: &Storm) -> RoundReport {
    let Storm {
        setup,
        pool,
        finished,
        releases: release_outs,
        sweeps: sweep_outs,
        max_concurrent_jobs,
    } = storm;
    let mut rep = RoundReport {
        jobs: pool.len() + finished.len(),
        max_concurrent_jobs: *max_concurrent_jobs,
        sweeps: sweep_outs.len(),
        ..Default::default()
    };

    // Who said it released what: sweeps, and cleanups of other jobs (their
    // TTL sweep). A job's own cleanup naming its environment proves nothing.
    let mut sweep_text = String::new();
    for o in sweep_outs.iter() {
        sweep_text.push_str(&text(o));
        if !o.status.success() {
            rep.fail("sweep_failed", first_error(&text(o)));
        }
    }
    let cleanups: Vec<(Option<String>, String)> = finished
        .iter()
        .map(|f| (own_env(f, pool), f.report.cleanup_output()))
        .collect();
    for f in finished.iter() {
        for c in f.report.calls.iter().filter(|c| c.is_cleanup()) {
            if c.exit_code != 0 {
                rep.fail("cleanup_failed", first_error(&c.output));
            }
        }
    }
    let swept = |id: &str| {
        sweep_text.contains(id)
            || cleanups
                .iter()
                .any(|(own, out)| own.as_deref() != Some(id) && out.contains(id))
    };
    // A run stage the runner would count as a system failure: dormant broke
    // mid-job (e.g. its environment's directory vanished under it), even if
    // the job's result hides it (`cleanup_file_variables` does not count).
    for f in finished.iter() {
        let own = own_env(f, pool).unwrap_or_default();
        // A system-failed or canceled job is judged by its result above.
        let hidden = !matches!(
            f.report.result,
            JobResult::SystemFailure | JobResult::Canceled
        );
        for c in f.report.calls.iter().filter(|c| c.is_stage()) {
            if c.exit_code != 0 && c.exit_code != 1 && hidden {
                let kind = if swept(&own) {
                    "job_broken_by_sweep"
                } else {
                    "unexpected_job_result"
                };
                rep.fail(
                    kind,
                    format!(
                        "{} exit {}: {}",
                        c.name,
                        c.exit_code,
                        first_error(&c.output)
                    ),
                );
            }
        }
    }

    // What each environment should be now: true = suspended, false = gone,
    // None = either (its fate was decided by a race with a sweep).
    let mut expect: BTreeMap<String, Option<bool>> = BTreeMap::new();
    for f in finished.iter() {
        let r = &f.report;
        let id = own_env(f, pool);
        let want = match f.role {
            Role::NewSuspend | Role::NewRelease => JobResult::Success,
            Role::NewFailSuspend => JobResult::BuildFailure(Some(3)),
            Role::Resume { .. } => continue,
        };
        let Some(id) = id else {
            rep.fail(
                "unexpected_job_result",
                format!("{:?}: no environment: {}", f.role, r.log()),
            );
            continue;
        };
        if r.result != want {
            let kind = if swept(&id) {
                "job_broken_by_sweep"
            } else {
                "unexpected_job_result"
            };
            rep.fail(
                kind,
                format!(
                    "{:?} {id}: {:?}: {}",
                    f.role,
                    r.result,
                    last_lines(&r.log())
                ),
            );
            expect.insert(id, None);
            continue;
        }
        expect.insert(id, Some(f.role != Role::NewRelease));
    }
    check_pool(&mut rep, pool, finished, release_outs, &swept, &mut expect);

    // The state dir once every process has ended.
    let on_disk = scan(&mut rep, setup.state());
    for (id, status) in &on_disk {
        if status != "suspended" {
            rep.fail("stuck_status", format!("{id} is {status}"));
        }
    }
    for (id, want) in &expect {
        let present = on_disk.contains_key(id);
        match want {
            Some(true) if !present && swept(id) => rep.swept += 1,
            Some(true) if !present => rep.fail("lost_environment", id.clone()),
            Some(false) if present => rep.fail("not_released", format!("{id} is {}", on_disk[id])),
            _ => {}
        }
    }
    verify_resumable(&mut rep, setup, &on_disk);
    rep
}

/// The races and hand releases on the pool.
fn check_pool(
    rep: &mut RoundReport,
    pool: &[String],
    finished: &[Finished],
    releases: &[(usize, Output)],
    swept: &dyn Fn(&str) -> bool,
    expect: &mut BTreeMap<String, Option<bool>>,
) {
    for (p, key) in pool.iter().enumerate() {
        let id = env_id(key).unwrap();
        let jobs: Vec<&Finished> = finished
            .iter()
            .filter(|f| matches!(f.role, Role::Resume { pool, .. } if pool == p))
            .collect();
        let release = releases.iter().find(|(r, _)| *r == p).map(|(_, o)| o);
        let released_by_hand = release.is_some_and(|o| o.status.success());
        let winners: Vec<&&Finished> = jobs
            .iter()
            .filter(|f| f.report.result == JobResult::Success)
            .collect();
        let keep = jobs
            .iter()
            .any(|f| matches!(f.role, Role::Resume { keep: true, .. }));
        let race = jobs
            .iter()
            .any(|f| matches!(f.role, Role::Resume { race: true, .. }));
        let preempted = swept(&id) || released_by_hand;
        if race {
            if winners.len() > 1 || (winners.is_empty() && !preempted) {
                rep.fail(
                    "race_winners",
                    format!("{id}: {} winners of {}", winners.len(), jobs.len()),
                );
            }
            if winners.is_empty() && preempted {
                rep.races_preempted += 1;
            }
        }
        for f in jobs
            .iter()
            .filter(|f| f.report.result != JobResult::Success)
        {
            let log = f.report.log();
            let refused = matches!(f.report.result, JobResult::BuildFailure(_));
            let why_ok = log.contains("in use")
                || (preempted
                    && (log.contains("not in this runner's registry")
                        || log.contains("being released")));
            if refused && why_ok && (race || preempted) {
                continue;
            }
            let kind = if swept(&id) {
                "job_broken_by_sweep"
            } else if race {
                "race_loser"
            } else {
                "unexpected_job_result"
            };
            rep.fail(
                kind,
                format!(
                    "resume of {id}: {:?}: {}",
                    f.report.result,
                    last_lines(&log)
                ),
            );
        }
        if let Some(o) = release {
            let t = text(o);
            // Losing to a job that resumed it, or to a sweep, is fine.
            let lost_fairly = !winners.is_empty() || swept(&id);
            if !o.status.success() && !lost_fairly {
                rep.fail("release_failed", format!("{id}: {}", first_error(&t)));
            }
        }
        let want = if released_by_hand {
            Some(false)
        } else if release.is_some() && winners.is_empty() {
            // A release that failed may still have deleted it (a sweep finishing
            // the release it took for a failed one): counted as release_failed.
            None
        } else if let [w] = winners.as_slice() {
            Some(matches!(w.role, Role::Resume { keep: true, .. }) && keep)
        } else if winners.is_empty() && !preempted {
            // Untouched (pool 7), or every resume and release failed.
            Some(true)
        } else {
            None
        };
        expect.insert(id, want);
    }
}

/// Walks the state dir: parses every JSON file, finds orphan environment
/// dirs, job files and temp files. Returns each record's status by env id.
fn scan(rep: &mut RoundReport, state: &Path) -> BTreeMap<String, String> {
    let mut statuses = BTreeMap::new();
    let mut stack = vec![state.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            if path.is_dir() {
                // The local provider's work dirs hold the jobs' own files.
                if name != "work" {
                    stack.push(path);
                }
                continue;
            }
            if name.ends_with(".tmp") {
                rep.fail("stray_temp_file", path.display().to_string());
            }
            if name.ends_with(".json") {
                let parsed = std::fs::read_to_string(&path)
                    .ok()
                    .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok());
                if parsed.is_none() {
                    rep.fail("unparsable_state", path.display().to_string());
                }
            }
            if name.ends_with(".jsonl") {
                // The event log: 19 jobs and the sweeps append at once.
                let text = std::fs::read_to_string(&path).unwrap_or_default();
                if !text.is_empty() && !text.ends_with('\n') {
                    rep.fail("torn_event_line", path.display().to_string());
                }
                for line in text.lines() {
                    if serde_json::from_str::<serde_json::Value>(line).is_err() {
                        rep.fail("damaged_event_line", format!("{}: {line}", path.display()));
                    }
                }
            }
            let in_jobs = dir.file_name().is_some_and(|d| d == "jobs");
            if in_jobs && name.ends_with(".json") {
                rep.fail("job_state_left", name.clone());
            }
            if in_jobs && name.ends_with(".lock") {
                rep.fail("job_lock_left", name.clone());
            }
        }
    }
    for dir in subdirs(&state.join("environments")) {
        let id = dir.file_name().unwrap().to_string_lossy().into_owned();
        let record = std::fs::read_to_string(dir.join("record.json"))
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok());
        match record {
            Some(r) => {
                let status = r["status"].as_str().unwrap_or("?").to_string();
                statuses.insert(id, status);
            }
            None => rep.fail("orphan_env_dir", format!("{id}: {:?}", names(&dir))),
        }
    }
    statuses
}

/// Resumes (without a trigger, so released) every environment the round left
/// suspended, then checks that nothing at all is left.
fn verify_resumable(rep: &mut RoundReport, setup: &Setup, on_disk: &BTreeMap<String, String>) {
    let keys: Vec<(String, String)> = on_disk
        .iter()
        .filter(|(_, s)| *s == "suspended")
        .filter_map(|(id, _)| {
            let path = setup
                .state()
                .join("environments")
                .join(id)
                .join("record.json");
            let rec: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()?;
            Some((id.clone(), rec["key"].as_str()?.to_string()))
        })
        .collect();
    let results: Vec<(String, JobReport)> = std::thread::scope(|s| {
        let handles: Vec<_> = keys
            .iter()
            .map(|(id, key)| {
                s.spawn(move || (id.clone(), setup.rig.run(&job(PROJECT).resume(key))))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (id, r) in &results {
        if r.result != JobResult::Success {
            rep.fail(
                "not_resumable",
                format!("{id}: {:?}: {}", r.result, last_lines(&r.log())),
            );
        }
    }
    let out = dormant_cmd(&setup.rig.runner.env, &["sweep"]);
    if !out.status.success() {
        rep.fail("sweep_failed", first_error(&text(&out)));
    }
    // What was already reported before the verification is not counted twice.
    let reported: Vec<String> = rep.failures.values().flatten().cloned().collect();
    for sub in ["environments", "jobs", "ctl"] {
        for p in subdirs(&setup.state().join(sub))
            .into_iter()
            .chain(files(&setup.state().join(sub)))
        {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            if !reported.iter().any(|r| r.starts_with(&name)) {
                rep.fail(
                    "leaked_after_verify",
                    format!("{sub}/{name} {:?}", names(&p)),
                );
            }
        }
    }
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The line that says what went wrong, shortened, to group failures by kind
/// (a line ending in `:` introduces the cause on the next line).
fn first_error(text: &str) -> String {
    // dormant prints its error last; cleanup lists its errors after a
    // "finished with errors:" line.
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    let line = lines
        .iter()
        .position(|l| l.ends_with("finished with errors:"))
        .and_then(|i| lines.get(i + 1))
        .or(lines.last())
        .copied()
        .unwrap_or("");
    line.chars().take(300).collect()
}

fn last_lines(log: &str) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(3)..].join(" | ")
}

/// The environment id in config's builds_dir (`.../<uuid>/...`), for a job
/// that ended before printing its key.
pub(super) fn builds_dir_env_id(r: &JobReport) -> Option<String> {
    let dir = r.config.as_ref()?.builds_dir.clone()?;
    dir.split('/')
        .find(|c| uuid::Uuid::parse_str(c).is_ok())
        .map(str::to_string)
}

fn subdirs(dir: &Path) -> Vec<PathBuf> {
    entries(dir).into_iter().filter(|p| p.is_dir()).collect()
}

fn files(dir: &Path) -> Vec<PathBuf> {
    entries(dir).into_iter().filter(|p| !p.is_dir()).collect()
}

fn entries(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default()
}

fn names(dir: &Path) -> Vec<String> {
    entries(dir)
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect()
}
