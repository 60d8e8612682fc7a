//! Pausing a job on the `local` provider (docs/pause.md, "On the local
//! provider"): its stages run kept in a local bash, so a script that asks
//! (`dormant-ask`) or is paused from the host (`dormant pause`) waits on this
//! host, alive, after its `dormant run` has exited, and a later job that
//! resumed the environment continues it (`dormant-continue`): the same
//! process, what it held in memory, nothing before the ask run again, the
//! exit code; two rounds; every line of a host-paused counter once; a
//! release leaves no process; a `dormant run` killed after it recorded the
//! pause still leaves a script to continue. Where the environment cannot
//! keep one (`suspend.enabled = false`), both commands refuse at once.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::harness::*;
use crate::pause::{asking, assert_paused_line, assert_refused_naming, pid_in, BOTH};
use crate::pause_host::{numbers, pause_cmd, paused_counter, text};
use crate::sshd::alive;

fn json_lines(rig: &Rig, args: &[&str]) -> Vec<serde_json::Value> {
    let out = rig.dormant(args);
    assert!(out.status.success(), "{args:?}: {out:?}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The environment's kept-stage directory (`environments/<id>/kept`).
fn kept_dir(rig: &Rig, key: &str) -> PathBuf {
    rig.env_dir(key).join("kept")
}

/// The wrappers (`.pid`'s first field) of the stages kept under `dir`.
fn wrappers(dir: &Path) -> Vec<u32> {
    let mut out = Vec::new();
    let Ok(users) = std::fs::read_dir(dir) else {
        return out;
    };
    for user in users.flatten() {
        for f in std::fs::read_dir(user.path())
            .into_iter()
            .flatten()
            .flatten()
        {
            if f.path().extension().is_some_and(|e| e == "pid") {
                let text = std::fs::read_to_string(f.path()).unwrap_or_default();
                if let Some(m) = text.split_whitespace().next().and_then(|m| m.parse().ok()) {
                    out.push(m);
                }
            }
        }
    }
    out
}

#[track_caller]
fn wait_gone(pid: u32, what: &str) {
    let t = Instant::now();
    while alive(pid) {
        assert!(t.elapsed() < Duration::from_secs(15), "{what} (pid {pid})");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn on_local_a_script_that_asks_waits_alive_and_a_resumed_job_continues_it() {
    let rig = Rig::local("93", "s_93aa93aa93aa");
    let d = tempfile::tempdir().unwrap();
    // No trigger: the ask alone keeps the environment.
    let r = rig.run(&job(93).script(&asking(d.path(), "Deploy to prod?")));
    assert_result(&r, JobResult::Success);
    let key = r.key.clone().expect("the ask suspends the environment");
    assert_eq!(rig.status(&key).as_deref(), Some("suspended"));
    let log = r.log();
    assert_paused_line(&log, &key, "\"Deploy to prod?\"");
    assert!(log.contains("line before\n"), "{log}");
    assert!(!log.contains("answer="), "{log}");
    let pid = pid_in(&d.path().join("pid"));
    assert!(alive(pid), "the asking script waits on the host");

    // The record, `list --json`, `inspect` and the event log show it.
    let rec = rig.record(&key).unwrap();
    assert_eq!(rec["paused"]["question"], "Deploy to prod?", "{rec}");
    let id = rec["id"].as_str().unwrap().to_string();
    let listed = json_lines(&rig, &["list", "--json"]);
    let mine = listed.iter().find(|e| e["id"] == id.as_str()).unwrap();
    assert_eq!(mine["paused"]["question"], "Deploy to prod?", "{mine}");
    let inspected: serde_json::Value =
        serde_json::from_slice(&rig.dormant(&["inspect", &key]).stdout).unwrap();
    assert_eq!(inspected["paused"]["question"], "Deploy to prod?");
    let events = json_lines(&rig, &["events", "--json", &key]);
    assert!(
        events
            .iter()
            .any(|e| e["event"] == "suspended" && e["cause"] == "paused"),
        "{events:?}"
    );

    let r2 = rig.run(
        &job(93)
            .resume(&key)
            .script("dormant-continue \"$(printf 'yes\\n second line')\""),
    );
    let log2 = r2.log();
    assert_result(&r2, JobResult::BuildFailure(Some(7)));
    let rest = log2
        .split("answer=[yes\n second line] v=")
        .nth(1)
        .unwrap_or_else(|| panic!("the answer byte for byte:\n{log2}"));
    let (v, p) = rest.lines().next().unwrap().split_once(" pid=").unwrap();
    let held = std::fs::read_to_string(d.path().join("mem")).unwrap();
    assert_eq!(v, held.trim(), "the value the process held in memory");
    assert_eq!(p, pid.to_string(), "the same process");
    assert!(!log2.contains("line before"), "nothing twice:\n{log2}");
    assert_eq!(
        std::fs::read_to_string(d.path().join("runs")).unwrap(),
        "before the ask\n",
        "nothing before the ask ran again"
    );
    wait_gone(pid, "the continued script ended");
    // Job 2 had no trigger: released, nothing of it left.
    assert!(!rig.env_dir(&key).exists());
}

#[test]
fn on_local_two_rounds_in_one_process_then_its_end() {
    let rig = Rig::local("94", "s_94aa94aa94aa");
    let d = tempfile::tempdir().unwrap();
    let script = format!(
        "echo $BASHPID > '{pid}'; n=41; a=$(dormant-ask 'first?'); n=$((n+1)); echo \"got [$a] n=$n\"; \
         b=$(dormant-ask 'second?'); echo \"got [$b] n=$((n+1)) pid=$BASHPID\"; exit 0",
        pid = d.path().join("pid").display()
    );
    let r = rig.run(&job(94).script(&script));
    assert_result(&r, JobResult::Success);
    let key = r.key.clone().unwrap();
    assert_paused_line(&r.log(), &key, "\"first?\"");
    let pid = pid_in(&d.path().join("pid"));

    let r2 = rig.run(
        &job(94)
            .resume(&key)
            .script("dormant-continue one; echo 'not reached'"),
    );
    assert_result(&r2, JobResult::Success);
    let log2 = r2.log();
    assert!(log2.contains("got [one] n=42\n"), "{log2}");
    assert_paused_line(&log2, &key, "\"second?\"");
    assert!(!log2.contains("not reached"), "{log2}");
    assert_eq!(rig.status(&key).as_deref(), Some("suspended"));
    assert!(alive(pid));

    let r3 = rig.run(&job(94).resume(&key).script("printf two | dormant-continue"));
    assert_result(&r3, JobResult::Success);
    let log3 = r3.log();
    assert!(
        log3.contains(&format!("got [two] n=43 pid={pid}\n")),
        "{log3}"
    );
    assert!(!log3.contains("got [one]"), "nothing twice:\n{log3}");
}

#[test]
fn on_local_a_job_paused_from_the_host_continues_with_every_line_once() {
    let rig = Rig::local("95", "s_95aa95aa95aa");
    let d = tempfile::tempdir().unwrap();
    let (key, pid, log) = paused_counter(&rig, d.path(), &|job_id| {
        let out = pause_cmd(&rig, &[&job_id.to_string()], &[]);
        assert!(out.status.success(), "{}", text(&out));
    });
    assert_paused_line(&log, &key, "\"paused by dormant pause\"");
    std::fs::write(d.path().join("release"), "").unwrap();
    let first = numbers(&log);
    let r2 = rig.run(&job(91).resume(&key).script("dormant-continue"));
    assert_result(&r2, JobResult::BuildFailure(Some(3)));
    let log2 = r2.log();
    assert!(log2.contains("end\n"), "{log2}");
    let all: Vec<u64> = first.iter().chain(&numbers(&log2)).copied().collect();
    let want: Vec<u64> = (1..=all.len() as u64).collect();
    assert!(first.len() >= 20, "{log}");
    assert_eq!(all, want, "every line once, in order:\n{log}\n---\n{log2}");
    wait_gone(pid, "the continued script ended");
}

#[test]
fn on_local_continue_with_nothing_paused_fails_at_once_and_a_release_leaves_no_process() {
    let rig = Rig::local("96", "s_96aa96aa96aa");
    let d = tempfile::tempdir().unwrap();
    let r = rig.run(
        &job(96)
            .suspend_on(true, true)
            .script("dormant-continue x || echo \"rc=$?\""),
    );
    assert_result(&r, JobResult::Success);
    let log = r.log();
    assert!(
        log.contains("dormant-continue: nothing is paused in this environment"),
        "{log}"
    );
    assert!(log.contains("rc=125\n"), "its own failure's code: {log}");

    let r = rig.run(&job(97).script(&asking(d.path(), "q")));
    assert_result(&r, JobResult::Success);
    let key = r.key.clone().unwrap();
    let pid = pid_in(&d.path().join("pid"));
    assert!(alive(pid));
    let kept = kept_dir(&rig, &key);
    let held = wrappers(&kept);
    assert!(
        !held.is_empty() && held.iter().all(|w| alive(*w)),
        "{held:?}"
    );
    let out = rig.dormant(&["release", &key]);
    assert!(out.status.success(), "{}", text(&out));
    wait_gone(pid, "the release ended the paused script");
    for w in held {
        wait_gone(w, "the paused stage's wrapper ended with the release");
    }
    assert!(!kept.exists() && !rig.env_dir(&key).exists());

    // A resumed job with no trigger that does not continue it releases the
    // environment, and the paused script with it.
    let r = rig.run(&job(97).script(&asking(d.path(), "again")));
    let key = r.key.clone().unwrap();
    let pid = pid_in(&d.path().join("pid"));
    assert!(alive(pid));
    let r2 = rig.run(&job(97).resume(&key).script("echo not continued"));
    assert_result(&r2, JobResult::Success);
    wait_gone(
        pid,
        "releasing by a job without trigger ended the paused script",
    );
    assert!(!rig.env_dir(&key).exists());
}

/// The runner's own stages run as before (not kept) where the environment
/// can pause: there the two tools refuse at once, naming the stage.
#[test]
fn on_local_a_runner_stage_cannot_pause_and_says_so() {
    let rig = Rig::local("99", "s_99aa99aa99aa");
    let mut j = job(99).script("echo built");
    j.get_sources = BOTH.into();
    let r = rig.run(&j);
    assert_result(&r, JobResult::Success);
    assert_refused_naming(
        &r.log(),
        "get_sources is one of the runner's own stages on provider = \"local\"",
    );
}

#[test]
fn on_local_ask_and_continue_refuse_at_once_where_suspension_is_off() {
    let rig = Rig::new("87", "s_87aa87aa87aa", "[suspend]\nenabled = false\n");
    let r = rig.run(&job(87).script(BOTH));
    assert_result(&r, JobResult::Success);
    assert_refused_naming(&r.log(), "suspend.enabled = false");
}

/// `dormant run` SIGKILLed right after it recorded the pause: the script is
/// kept (its wrapper is not dormant's to take along), cleanup suspends, and a
/// resumed job continues it.
#[cfg(feature = "testing")]
#[test]
fn on_local_a_run_killed_after_recording_the_pause_leaves_a_script_to_continue() {
    let mut rig = Rig::local("98", "s_98aa98aa98aa");
    let d = tempfile::tempdir().unwrap();
    crate::crash::arm(&mut rig, Some("pause:recorded"), true);
    let r = rig.run(&job(98).script(&asking(d.path(), "kept?")));
    crate::crash::assert_killed_at(&rig, &r.calls, "pause:recorded", 1);
    let key = r.key.clone().expect("suspended: the pause was recorded");
    assert_eq!(rig.status(&key).as_deref(), Some("suspended"));
    assert_eq!(rig.record(&key).unwrap()["paused"]["question"], "kept?");
    let pid = pid_in(&d.path().join("pid"));
    assert!(
        alive(pid),
        "the paused script outlived its killed dormant run"
    );
    crate::crash::arm(&mut rig, None, false);
    let r2 = rig.run(&job(98).resume(&key).script("dormant-continue ok"));
    assert_result(&r2, JobResult::BuildFailure(Some(7)));
    let log2 = r2.log();
    assert!(log2.contains("answer=[ok]"), "{log2}");
    assert!(log2.contains(&format!("pid={pid}")), "{log2}");
}

/// The TTL's sweep releases a paused environment as `dormant release` does:
/// the paused script ends with it.
#[test]
fn on_local_the_ttl_sweep_ends_a_paused_script() {
    let rig = Rig::local("90", "s_90aa90aa90aa");
    let d = tempfile::tempdir().unwrap();
    let r = rig.run(&job(90).script(&asking(d.path(), "q")));
    assert_result(&r, JobResult::Success);
    let key = r.key.clone().unwrap();
    let pid = pid_in(&d.path().join("pid"));
    assert!(alive(pid));
    let store = dormant::state::StateStore::open(&rig.state_dir).unwrap();
    let id = dormant::envkey::EnvironmentKey::parse(&key).unwrap().env_id;
    dormant::state::testing::backdate(&store, id, 2 * 3600).unwrap();
    Rig::write_settings(
        &rig.settings_path,
        "s_90aa90aa90aa",
        "[suspend]\nttl = \"1h\"\n",
    );
    let out = rig.dormant(&["sweep"]);
    assert!(out.status.success(), "{}", text(&out));
    wait_gone(pid, "the sweep ended the paused script");
    assert!(!rig.env_dir(&key).exists());
}
