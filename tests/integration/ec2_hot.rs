//! The hot window (docs/pause.md, "The hot window") on the `ec2` provider,
//! with the emulator and the loopback sshd standing in for the instance: a
//! job that ends paused leaves its instance running (no StopInstances), the
//! record says suspended and hot until a time, and a continue within the
//! window takes the running instance (no StartInstances); a window that
//! passes with no job hibernates the instance once, by the detached `dormant
//! cool` waiter, without a job; in `stop` mode a pause is allowed for the
//! window only, and its end marks the paused script lost. The kill tests
//! kill each step of a window's end (the waiter's claim, the suspension's
//! intent and its stop, and the paused job's cleanup between its intent and
//! the hot record) and prove the next sweep stops the instance, once.

use std::time::{Duration, Instant};

use crate::crash::{arm, GRACE, PAST_GRACE};
use crate::ec2_rig::Ec2Env;
use crate::harness::*;
use crate::pause::{asking, assert_paused_line, pid_in};

/// `hibernate` mode with a hot window of `hot_for`, a claim grace of 1 s.
pub(crate) fn hot(env: &Ec2Env, mode: &str, hot_for: &str) -> String {
    env.settings(
        &format!(
            "{}suspend_mode = \"{mode}\"\nroot_volume_encrypted = true\nroot_volume_size_gb = 30\n",
            env.connect_address()
        ),
        &format!("{GRACE}hot_for = \"{hot_for}\"\n"),
    )
}

/// The StopInstances calls so far (their bodies).
pub(crate) fn stops(env: &Ec2Env) -> Vec<String> {
    env.proxy
        .calls()
        .into_iter()
        .filter(|c| c.action == "StopInstances")
        .map(|c| c.body)
        .collect()
}

pub(crate) fn starts(env: &Ec2Env) -> usize {
    env.proxy
        .calls()
        .iter()
        .filter(|c| c.action == "StartInstances")
        .count()
}

/// Waits (bounded: 90 s, far past any window here) until `done` holds.
#[track_caller]
pub(crate) fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(
            start.elapsed() < Duration::from_secs(90),
            "never happened: {what}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

pub(crate) fn events(rig: &Rig, key: &str) -> Vec<serde_json::Value> {
    let out = rig.dormant(&["events", "--json", key]);
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Kills the paused script whose pid `asking` wrote when the test ends,
/// however it ends: one that fails an assertion must not leave the script
/// waiting on this host for ever (its instance is moto's, its processes
/// are real).
pub(crate) struct KillsScript(pub(crate) std::path::PathBuf);

impl Drop for KillsScript {
    fn drop(&mut self) {
        let pid = std::fs::read_to_string(&self.0)
            .ok()
            .and_then(|t| t.trim().parse::<u32>().ok());
        if let Some(pid) = pid {
            kill(pid);
        }
    }
}

pub(crate) fn kill(pid: u32) {
    // The script may have ended (continued): then there is nothing to kill.
    let _ = std::process::Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .stderr(std::process::Stdio::null())
        .status();
}

#[test]
fn ec2_a_continue_within_the_hot_window_takes_the_running_instance() {
    let env = Ec2Env::start();
    let rig = env.rig("81", "s_81aa81aa81aa", &hot(&env, "hibernate", "10m"));
    let d = tempfile::tempdir().unwrap();
    let _script = KillsScript(d.path().join("pid"));
    let r = rig.run(&job(81).script(&asking(d.path(), "Ship it?")));
    assert_result(&r, JobResult::Success);
    let key = r.key.clone().expect("the ask suspends the environment");
    let log = r.log();
    assert_paused_line(&log, &key, "\"Ship it?\"");
    assert!(
        log.lines().any(|l| l
            == "dormant-ask: the machine stays running 10m after this job (suspend.hot_for), \
                then it hibernates with the paused script; kept until continued or released \
                (suspend.ttl = \"7d\")"),
        "dormant-ask says how long it is kept, on one line:\n{log}"
    );
    let pid = pid_in(&d.path().join("pid"));

    // Suspended as far as GitLab and the key are concerned; the instance runs.
    assert!(
        stops(&env).is_empty(),
        "no StopInstances: {:?}",
        stops(&env)
    );
    let rec = rig.record(&key).unwrap();
    assert_eq!(rec["status"], "suspended", "{rec}");
    assert!(rec["hot_until"].as_u64().is_some(), "{rec}");
    assert_eq!(rec["paused"]["question"], "Ship it?", "{rec}");
    let id = rec["id"].as_str().unwrap().to_string();
    let table = String::from_utf8_lossy(&rig.dormant(&["list"]).stdout).into_owned();
    let row = table.lines().find(|l| l.starts_with(&id)).unwrap();
    assert!(
        row.contains(" paused ") && row.contains("hot until "),
        "{row}"
    );
    let ev = events(&rig, &key);
    assert!(
        ev.iter().any(|e| e["event"] == "suspended"
            && e["cause"] == "paused"
            && e["hot_until"].is_string()),
        "{ev:?}"
    );

    let metrics = String::from_utf8_lossy(&rig.dormant(&["metrics"]).stdout).into_owned();
    assert!(
        metrics
            .lines()
            .any(|l| l == "dormant_hot_environments{provider=\"ec2\"} 1"),
        "{metrics}"
    );

    // The continue: no start, the same process, the answer.
    let r2 = rig.run(&job(81).resume(&key).script("dormant-continue yes"));
    assert_result(&r2, JobResult::BuildFailure(Some(7)));
    let log2 = r2.log();
    assert!(
        log2.contains("is hot: taking its running machine"),
        "{log2}"
    );
    assert!(log2.contains("answer=[yes] v="), "{log2}");
    assert!(log2.contains(&format!("pid={pid}")), "{log2}");
    assert_eq!(starts(&env), 0, "the hot instance was not started again");
    assert!(stops(&env).is_empty(), "nor stopped: {:?}", stops(&env));
    let ev = events(&rig, &key);
    assert!(
        ev.iter()
            .any(|e| e["event"] == "resumed" && e["cause"] == "hot" && e["hot"] == true),
        "{ev:?}"
    );
    let metrics = String::from_utf8_lossy(&rig.dormant(&["metrics"]).stdout).into_owned();
    for want in [
        "dormant_hot_environments{provider=\"ec2\"} 0",
        "dormant_continues_total{provider=\"ec2\",path=\"hot\"} 1",
    ] {
        assert!(
            metrics.lines().any(|l| l == want),
            "{want}:
{metrics}"
        );
    }
    kill(pid);
}

#[test]
fn ec2_a_hot_window_that_passes_hibernates_the_instance_once_without_a_job() {
    let env = Ec2Env::start();
    let rig = env.rig("82", "s_82aa82aa82aa", &hot(&env, "hibernate", "2s"));
    let d = tempfile::tempdir().unwrap();
    let _script = KillsScript(d.path().join("pid"));
    let r = rig.run(&job(82).script(&asking(d.path(), "Merge?")));
    assert_result(&r, JobResult::Success);
    let key = r.key.clone().unwrap();
    let pid = pid_in(&d.path().join("pid"));
    // The detached `dormant cool` ends the window: no job, no sweep.
    wait_until("the window's end", || {
        rig.record(&key)
            .is_some_and(|r| r["status"] == "suspended" && r["hot_until"].is_null())
    });
    let s = stops(&env);
    assert_eq!(s.len(), 1, "one StopInstances: {s:?}");
    assert!(s[0].contains("Hibernate=true"), "{}", s[0]);
    let ev = events(&rig, &key);
    assert!(
        ev.iter().any(|e| e["event"] == "suspended"
            && e["cause"] == "cooled"
            && e["by"]
                .as_str()
                .is_some_and(|b| b.starts_with("dormant cool"))),
        "{ev:?}"
    );
    // A sweep after it stops nothing more.
    let out = rig.dormant(&["sweep"]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(stops(&env).len(), 1);
    // The cold continue starts the instance and answers as before.
    let r2 = rig.run(&job(82).resume(&key).script("dormant-continue ok"));
    assert_result(&r2, JobResult::BuildFailure(Some(7)));
    assert!(r2.log().contains("answer=[ok]"), "{}", r2.log());
    assert_eq!(starts(&env), 1);
    let ev = events(&rig, &key);
    assert!(
        ev.iter()
            .any(|e| e["event"] == "resumed" && e["cause"] == "job" && e["hot"] == false),
        "{ev:?}"
    );
    kill(pid);
}

/// `stop` mode cannot keep a process across a suspension: with a window, a
/// pause is allowed for the window only; its end stops the instance and the
/// record says the paused script is lost, so the next continue fails at once.
#[test]
fn ec2_stop_mode_pauses_for_the_window_only_and_then_says_the_script_is_lost() {
    let env = Ec2Env::start();
    let rig = env.rig(
        "83",
        "s_83aa83aa83aa",
        &env.settings(
            &env.connect_address(),
            &format!("{GRACE}hot_for = \"2s\"\n"),
        ),
    );
    let d = tempfile::tempdir().unwrap();
    let _script = KillsScript(d.path().join("pid"));
    let r = rig.run(&job(83).script(&asking(d.path(), "Go?")));
    assert_result(&r, JobResult::Success);
    let key = r.key.clone().unwrap();
    let log = r.log();
    assert!(
        log.contains("dormant-ask: the paused script is kept for 2s after this job"),
        "{log}"
    );
    let pid = pid_in(&d.path().join("pid"));
    wait_until("the window's end", || {
        rig.record(&key)
            .is_some_and(|r| r["status"] == "suspended" && r["hot_until"].is_null())
    });
    let rec = rig.record(&key).unwrap();
    assert!(rec["paused"]["lost"].is_string(), "{rec}");
    let r2 = rig.run(
        &job(83)
            .resume(&key)
            .script("dormant-continue yes || echo \"rc=$?\""),
    );
    assert_result(&r2, JobResult::Success);
    let log2 = r2.log();
    assert!(
        log2.contains("the script paused there is gone") && log2.contains("rc=125\n"),
        "{log2}"
    );
    kill(pid);
}

/// kill -9 at each step of a window's end: the waiter's claim
/// (`hot:claimed`), the suspension's intent (`suspend:intent`) and its
/// stop (`suspend:stopped`); and the paused job's cleanup between its
/// intent and the hot record (`hot:intent`). Each leaves the record
/// `suspending` under a dead holder (never hot for ever, never lost); the
/// next sweep stops the instance: one StopInstances in all.
#[test]
fn ec2_a_hot_windows_end_killed_at_each_step_is_finished_by_the_next_sweep() {
    for (point, stops_before) in [
        ("hot:intent", 0),
        ("hot:claimed", 0),
        ("suspend:intent", 0),
        ("suspend:stopped", 1),
    ] {
        let env = Ec2Env::start();
        let mut rig = env.rig("84", "s_84aa84aa84aa", &hot(&env, "hibernate", "2s"));
        let d = tempfile::tempdir().unwrap();
        let _script = KillsScript(d.path().join("pid"));
        arm(&mut rig, Some(point), false);
        let r = rig.run(&job(84).script(&asking(d.path(), "Now?")));
        let key = r.key.clone().expect("a key");
        let said = format!("dormant: failpoint {point}: SIGKILL");
        if point == "hot:intent" {
            // The paused job's own cleanup died there.
            assert!(
                r.log().contains(&said) || runner_output(&r).contains(&said),
                "{point}"
            );
        } else {
            let cool_log = rig.env_dir(&key).join("cool.log");
            wait_until(point, || {
                std::fs::read_to_string(&cool_log).is_ok_and(|t| t.contains(&said))
            });
        }
        arm(&mut rig, None, false);
        assert_eq!(rig.status(&key).as_deref(), Some("suspending"), "{point}");
        assert_eq!(stops(&env).len(), stops_before, "{point}");
        std::thread::sleep(PAST_GRACE);
        let out = rig.dormant(&["sweep"]);
        assert!(out.status.success(), "{point}: {out:?}");
        let rec = rig.record(&key).unwrap();
        assert_eq!(rec["status"], "suspended", "{point}: {rec}");
        assert!(rec["hot_until"].is_null(), "{point}: {rec}");
        assert_eq!(rec["paused"]["question"], "Now?", "{point}: {rec}");
        let s = stops(&env);
        assert!(
            s.iter().all(|b| b.contains("Hibernate=true")),
            "{point}: {s:?}"
        );
        // Hibernated exactly once: after `suspend:stopped` the recovery
        // finds the instance stopped and sends no second StopInstances.
        assert_eq!(s.len(), 1, "{point}: {s:?}");
        // A second look finds nothing to do.
        std::thread::sleep(PAST_GRACE);
        assert!(rig.dormant(&["sweep"]).status.success());
        assert_eq!(stops(&env).len(), 1, "{point}");
        kill(pid_in(&d.path().join("pid")));
    }
}

/// The waiter killed before it looked (`hot:waiting`; as one that never
/// started, or died with its host): the record stays hot, and the first
/// sweep after the window cools it, once.
#[test]
fn ec2_a_hot_window_whose_waiter_died_is_ended_by_the_sweep() {
    let env = Ec2Env::start();
    let mut rig = env.rig("85", "s_85aa85aa85aa", &hot(&env, "hibernate", "2s"));
    let d = tempfile::tempdir().unwrap();
    let _script = KillsScript(d.path().join("pid"));
    arm(&mut rig, Some("hot:waiting"), false);
    let r = rig.run(&job(85).script(&asking(d.path(), "Later?")));
    assert_result(&r, JobResult::Success);
    let key = r.key.clone().unwrap();
    let said = "dormant: failpoint hot:waiting: SIGKILL";
    let cool_log = rig.env_dir(&key).join("cool.log");
    wait_until("the waiter's death", || {
        std::fs::read_to_string(&cool_log).is_ok_and(|t| t.contains(said))
    });
    arm(&mut rig, None, false);
    let until = rig.record(&key).unwrap()["hot_until"].as_u64().unwrap();
    wait_until("the window's end", || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs()
            > until
    });
    assert!(stops(&env).is_empty(), "still hot: nobody stopped it");
    assert!(rig.record(&key).unwrap()["hot_until"].is_u64());
    let out = rig.dormant(&["sweep"]);
    assert!(out.status.success(), "{out:?}");
    let rec = rig.record(&key).unwrap();
    assert_eq!(rec["status"], "suspended", "{rec}");
    assert!(rec["hot_until"].is_null(), "{rec}");
    let s = stops(&env);
    assert_eq!(s.len(), 1, "{s:?}");
    assert!(s[0].contains("Hibernate=true"), "{}", s[0]);
    assert!(
        events(&rig, &key).iter().any(|e| e["event"] == "suspended"
            && e["cause"] == "cooled"
            && e["by"]
                .as_str()
                .is_some_and(|b| b.starts_with("dormant sweep"))),
        "the sweep cooled it"
    );
    kill(pid_in(&d.path().join("pid")));
}

/// What the runner's calls printed (the cleanup's stderr reaches the
/// runner's log, not the job log).
fn runner_output(r: &JobReport) -> String {
    r.calls.iter().map(|c| c.output.as_str()).collect()
}

/// `dormant try` on EC2 with a hot window: job 1 asks, job 2 continues the
/// running instance, and the summary says its timing is a hot one.
#[test]
fn ec2_try_shows_a_hot_continue() {
    let env = Ec2Env::start();
    let rig = env.rig("86", "s_86aa86aa86aa", &hot(&env, "hibernate", "10m"));
    let out = rig.dormant(&["try"]);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("job 2: resume with the key in the payload, hot (job 1's machine still ran"),
        "{text}"
    );
    assert!(
        text.contains("ok    job 2 took job 1's running machine"),
        "{text}"
    );
    assert!(
        text.contains("after job 2's first call (a hot continue)"),
        "{text}"
    );
    assert_eq!(starts(&env), 0, "{text}");
}
