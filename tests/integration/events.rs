//! The event log through the binary: a lifecycle read back with `dormant
//! events --json`, `inspect`'s last events, 16 jobs and sweeps appending at
//! once (with rotation), a writer SIGKILLed at every point of an append, and
//! `--follow` through rotations. (`dormant metrics` from the log: `metrics.rs`.)

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::harness::*;

pub const RUNNER: &str = "15";
pub const SYSTEM: &str = "s_0123456789ab";

pub fn text(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// `dormant events --json [args]`, every line parsed.
pub fn events_json(rig: &Rig, args: &[&str]) -> Vec<Value> {
    let mut argv = vec!["events", "--json"];
    argv.extend_from_slice(args);
    let out = rig.dormant(&argv);
    assert!(out.status.success(), "{}", text(&out));
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?}: {e}")))
        .collect()
}

fn kinds(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .map(|e| {
            format!(
                "{}/{}",
                e["event"].as_str().unwrap(),
                e["cause"].as_str().unwrap()
            )
        })
        .collect()
}

/// Every line of every file of the log parses, and every file ends on a newline.
fn assert_every_line_whole(state: &Path) -> usize {
    let dir = state.join("events");
    let mut lines = 0;
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no event log in {}", dir.display());
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        assert!(
            text.is_empty() || text.ends_with('\n'),
            "{} ends in a torn line: {:?}",
            f.display(),
            text.lines().last()
        );
        for line in text.lines() {
            let v: Value = serde_json::from_str(line)
                .unwrap_or_else(|e| panic!("{}: damaged line {line:?}: {e}", f.display()));
            assert!(v["event"].is_string() && v["time"].is_string(), "{line}");
            lines += 1;
        }
    }
    lines
}

#[test]
fn suspend_resume_release_reads_back_through_dormant_events() {
    let rig = Rig::local(RUNNER, SYSTEM);
    let first = job(5).suspend_on(true, false);
    let r = rig.run(&first);
    assert_result(&r, JobResult::Success);
    let key = r.key.clone().unwrap();
    let second = job(5).resume(&key).suspend_on(true, false);
    assert_result(&rig.run(&second), JobResult::Success);

    // inspect: the record and its last events, one JSON document.
    let out = rig.dormant(&["inspect", &key]);
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["status"], "suspended");
    assert_eq!(
        kinds(doc["last_events"].as_array().unwrap()),
        [
            "created/job",
            "suspended/triggers",
            "resumed/job",
            "suspended/triggers"
        ]
    );

    let third = job(5).resume(&key);
    assert_result(&rig.run(&third), JobResult::Success);
    let all = events_json(&rig, &[&key]);
    assert_eq!(
        kinds(&all),
        [
            "created/job",
            "suspended/triggers",
            "resumed/job",
            "suspended/triggers",
            "resumed/job",
            "released/no_trigger"
        ]
    );
    let jobs: Vec<u64> = all.iter().map(|e| e["job"].as_u64().unwrap()).collect();
    assert_eq!(
        jobs,
        [first.id, first.id, second.id, second.id, third.id, third.id]
    );
    let env = rig
        .env_dir(&key)
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    for e in &all {
        assert_eq!(e["env"], env.as_str());
        assert_eq!(e["key"], key.as_str());
        assert_eq!(e["project"], 5);
        assert_eq!(e["provider"], "local");
        assert!(e["duration_s"].as_f64().is_some(), "{e}");
    }
    assert!(all[2]["suspended_s"].as_f64().is_some());

    // The same by id, as a table; --since; a bad --since.
    let out = rig.dormant(&["events", &env]);
    let table = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(table.lines().count(), 7, "{table}");
    assert!(
        table.starts_with("TIME") && table.contains("no_trigger"),
        "{table}"
    );
    assert_eq!(events_json(&rig, &["--since", "1h"]).len(), 6);
    let out = rig.dormant(&["events", "--since", "soon"]);
    assert!(!out.status.success());
    assert!(text(&out).contains("--since"), "{}", text(&out));
    // Another environment's id shows nothing of this one's.
    let other = uuid::Uuid::new_v4().to_string();
    assert!(events_json(&rig, &[&other]).is_empty());
}

#[test]
fn sixteen_jobs_and_sweeps_at_once_append_whole_lines_and_lose_none() {
    // Small files: the log rotates many times while they race; nothing is
    // dropped (keep_files is large), so every event must be there.
    let rig = Rig::new(
        RUNNER,
        SYSTEM,
        "[events]\nmax_file_size = \"4KiB\"\nkeep_files = 1000\n",
    );
    const JOBS: usize = 16;
    const SWEEPS: usize = 4;
    let jobs: Vec<_> = (0..JOBS).map(|_| job(5).suspend_on(true, false)).collect();
    std::thread::scope(|s| {
        let runs: Vec<_> = jobs.iter().map(|j| s.spawn(|| rig.run(j))).collect();
        let sweeps: Vec<_> = (0..SWEEPS)
            .map(|_| s.spawn(|| rig.dormant(&["sweep"])))
            .collect();
        for r in runs {
            assert_result(&r.join().unwrap(), JobResult::Success);
        }
        for out in sweeps {
            let out = out.join().unwrap();
            assert!(out.status.success(), "{}", text(&out));
        }
    });
    let lines = assert_every_line_whole(&rig.state_dir);
    let files = std::fs::read_dir(rig.state_dir.join("events"))
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".jsonl"))
        .count();
    assert!(files > 2, "the log never rotated ({files} files)");
    let all = events_json(&rig, &[]);
    assert_eq!(all.len(), lines);
    let mut count: BTreeMap<(String, u64), usize> = BTreeMap::new();
    for e in &all {
        if let Some(job) = e["job"].as_u64() {
            *count
                .entry((kinds(std::slice::from_ref(e))[0].clone(), job))
                .or_default() += 1;
        }
    }
    for j in &jobs {
        for kind in ["created/job", "suspended/triggers"] {
            assert_eq!(
                count.get(&(kind.to_string(), j.id)),
                Some(&1),
                "job {}: {kind} {count:?}",
                j.id
            );
        }
    }
    let kinds = kinds(&all);
    assert_eq!(kinds.iter().filter(|k| *k == "created/job").count(), JOBS);
    assert_eq!(
        kinds.iter().filter(|k| *k == "suspended/triggers").count(),
        JOBS
    );
    assert_eq!(kinds.iter().filter(|k| *k == "sweep/full").count(), SWEEPS);
}

#[cfg(feature = "testing")]
#[test]
fn a_writer_killed_at_every_point_of_an_append_leaves_the_log_readable() {
    // The first append of the killed process is prepare's `created`; the
    // runner retries prepare (the failpoint fires once), and later writers
    // find whatever the kill left.
    for point in [
        "events:locked",
        "events:file-created",
        "events:torn",
        "events:written",
    ] {
        for rotating in [false, true] {
            let rig = Rig::new(RUNNER, SYSTEM, "[events]\nmax_file_size = \"4KiB\"\n");
            if rotating {
                // A current file so full that the next line starts a new one.
                let dir = rig.state_dir.join("events");
                std::fs::create_dir_all(&dir).unwrap();
                let line = r#"{"v":1,"time":"2026-01-01T00:00:00.000Z","ts_ms":1767225600000,"event":"sweep","cause":"full","env":null,"key":null,"job":null,"project":null,"provider":"local","duration_s":0.001}"#;
                let mut text = String::new();
                while text.len() + line.len() < 4000 {
                    text.push_str(line);
                    text.push('\n');
                }
                std::fs::write(dir.join("events-0000000001.jsonl"), text).unwrap();
            }
            let mut rig = rig;
            let marker = rig.dir.path().join("fired");
            rig.runner
                .env
                .insert("DORMANT_FAILPOINT".into(), point.into());
            rig.runner.env.insert(
                "DORMANT_FAILPOINT_ONCE".into(),
                marker.display().to_string(),
            );
            let killed = job(5).suspend_on(true, false);
            let r = rig.run(&killed);
            let what = format!("{point} (rotating: {rotating})");
            assert!(marker.exists(), "{what}: the failpoint never fired");
            assert_result(&r, JobResult::Success);
            assert!(r.prepare_attempts >= 2, "{what}: prepare was not killed");
            rig.runner.env.remove("DORMANT_FAILPOINT");
            assert_result(
                &rig.run(&job(5).suspend_on(true, false)),
                JobResult::Success,
            );
            assert_every_line_whole(&rig.state_dir);
            let all = events_json(&rig, &[]);
            let mine: Vec<String> = all
                .iter()
                .filter(|e| e["job"].as_u64() == Some(killed.id))
                .map(|e| e["event"].as_str().unwrap().to_string())
                .collect();
            // Killed before its line was whole: only the retry's `created`.
            // Killed after: the line stands, and the retry writes its own.
            let created = if point == "events:written" { 2 } else { 1 };
            assert_eq!(
                mine.iter().filter(|k| *k == "created").count(),
                created,
                "{what}: {mine:?}"
            );
            assert_eq!(mine.last().map(String::as_str), Some("suspended"), "{what}");
            let out = rig.dormant(&["metrics"]);
            let metrics = String::from_utf8_lossy(&out.stdout);
            assert!(
                metrics.contains("dormant_event_lines_damaged_total 0"),
                "{what}: {metrics}"
            );
        }
    }
}

#[test]
fn follow_prints_every_new_event_once_through_rotations_and_ends_on_sigterm() {
    let rig = Rig::new(
        RUNNER,
        SYSTEM,
        "[events]\nmax_file_size = \"4KiB\"\nkeep_files = 1000\n",
    );
    let out_path = rig.dir.path().join("followed.jsonl");
    let mut follower = std::process::Command::new(BIN)
        .args(["events", "--follow", "--json"])
        .env_clear()
        .envs(&rig.runner.env)
        .stdout(std::fs::File::create(&out_path).unwrap())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Started before the log exists; jobs then rotate it several times.
    for _ in 0..10 {
        assert_result(
            &rig.run(&job(5).suspend_on(true, false)),
            JobResult::Success,
        );
    }
    let expected: Vec<String> = {
        let out = rig.dormant(&["events", "--json"]);
        String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(str::to_string)
            .collect()
    };
    assert_eq!(expected.len(), 20);
    let files = std::fs::read_dir(rig.state_dir.join("events"))
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".jsonl"))
        .count();
    assert!(files >= 2, "no rotation to follow through ({files} file)");
    // Bounded wait for the follower to catch up (it looks every 0.5 s).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let followed = loop {
        let text = std::fs::read_to_string(&out_path).unwrap();
        if text.lines().count() >= expected.len() || std::time::Instant::now() > deadline {
            break text;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    // SAFETY: kill(2) on the follower's pid (our own child, not yet reaped).
    unsafe {
        libc::kill(follower.id() as i32, libc::SIGTERM);
    }
    let status = follower.wait().unwrap();
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut follower.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(status.success(), "{status:?}: {stderr}");
    let followed: Vec<&str> = followed.lines().collect();
    assert_eq!(followed, expected, "{stderr}");
}

/// A refused resume is a `refused` event naming its cause, the environment
/// the key names and the job: another project's job, an environment in use,
/// a malformed key (no environment), a released environment.
#[test]
fn refused_resumes_are_events_with_their_cause() {
    use dormant::state::{Claim, EnvStatus, Holder, Mode, StateStore};
    let rig = Rig::new(RUNNER, SYSTEM, "[suspend]\nclaim_grace = \"10m\"\n");
    let r = rig.run(&job(5).suspend_on(true, false));
    assert_result(&r, JobResult::Success);
    let key = r.key.clone().unwrap();
    let id = dormant::envkey::EnvironmentKey::parse(&key).unwrap().env_id;
    let refused = |j: dormant::runner_sim::SimJob, says: &str| {
        let job_id = j.id;
        let r = rig.run(&j);
        assert_result(&r, JobResult::BuildFailure(None));
        assert!(r.log().contains(says), "{}", r.log());
        job_id
    };
    let other_project = refused(job(6).resume(&key), "belongs to project 5");
    // Held by a job within its claim grace (no process, active a moment ago).
    let store = StateStore::open(&rig.state_dir).unwrap();
    let holder = Holder::Job {
        runner_id: RUNNER.into(),
        job_id: 78,
        mode: Mode::New,
        suspend_on_failure: false,
    };
    dormant::state::testing::rewrite(&store, id, |status, claim, _| {
        *status = EnvStatus::Active;
        *claim = Some(Claim::new(holder.clone()));
    })
    .unwrap();
    let in_use = refused(job(5).resume(&key), "in use by job 78");
    dormant::state::testing::rewrite(&store, id, |status, claim, _| {
        *status = EnvStatus::Suspended;
        *claim = None;
    })
    .unwrap();
    let malformed = refused(job(5).resume("not-a-key"), "is malformed");
    assert!(rig.dormant(&["release", &key]).status.success());
    let not_found = refused(job(5).resume(&key), "is not in this runner's registry");

    let events: Vec<Value> = events_json(&rig, &[])
        .into_iter()
        .filter(|e| e["event"] == "refused")
        .collect();
    let got: Vec<(String, Value, Value)> = events
        .iter()
        .map(|e| {
            (
                e["cause"].as_str().unwrap().to_string(),
                e["env"].clone(),
                e["job"].clone(),
            )
        })
        .collect();
    let env = Value::from(id.to_string());
    assert_eq!(
        got,
        [
            ("other_project".into(), env.clone(), other_project.into()),
            ("in_use".into(), env.clone(), in_use.into()),
            ("malformed_key".into(), Value::Null, malformed.into()),
            ("not_found".into(), env, not_found.into()),
        ],
        "{events:?}"
    );
    assert!(
        events[0]["error"]
            .as_str()
            .is_some_and(|e| e.contains("belongs to project 5")),
        "{events:?}"
    );
    assert_eq!(events[0]["project"], 6, "{events:?}");
    assert_eq!(events[0]["key"], key.as_str(), "{events:?}");
}
