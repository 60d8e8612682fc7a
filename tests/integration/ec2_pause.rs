//! Pausing a job (docs/pause.md) on the `ec2` provider, with the emulator and
//! the loopback sshd standing in for the instance (`ec2_rig.rs`). With
//! `suspend_mode = "hibernate"` a script that asks ends its stage
//! successfully, cleanup hibernates the instance (StopInstances with
//! `Hibernate=true`), the record, `list --json`, `inspect` and the event log
//! show the pause, and a resumed job answers with `dormant-continue`. What
//! this proves is dormant's bookkeeping on EC2: the loopback host is not
//! stopped by the emulator, so the script stays alive there as a real
//! hibernated instance would keep it in its memory (qemu_pause.rs shows a
//! hibernation keeping one for real). `dormant pause` from the host is
//! taken the same way. With `suspend_mode = "stop"` `dormant-ask`,
//! `dormant-continue` and `dormant pause` refuse at once, naming the setting.

use aws_sdk_ec2::types::InstanceStateName;

use crate::ec2_rig::{instances, is_live, Ec2Env};
use crate::harness::*;
use crate::pause::{asking, assert_paused_line, assert_refused_naming, pid_in, BOTH};
use crate::pause_host::{counter, numbers, pause_cmd, paused_counter, text, wait_for};
use crate::sshd::alive;

/// `ec2` settings in `hibernate` mode (which needs an encrypted root volume
/// big enough for the RAM), SSH to the loopback sshd.
pub fn hibernating(env: &Ec2Env) -> String {
    env.settings(
        &format!(
            "{}suspend_mode = \"hibernate\"\nroot_volume_encrypted = true\nroot_volume_size_gb = 30\n",
            env.connect_address()
        ),
        "",
    )
}

/// The one StopInstances the suspension sent asked to hibernate.
#[track_caller]
fn assert_hibernated(env: &Ec2Env) {
    let stops: Vec<_> = env
        .proxy
        .calls()
        .into_iter()
        .filter(|c| c.action == "StopInstances")
        .collect();
    assert_eq!(stops.len(), 1, "one StopInstances");
    assert!(
        stops[0].body.contains("Hibernate=true"),
        "{}",
        stops[0].body
    );
}

/// The JSON lines `dormant <args>` printed.
fn json_lines(rig: &Rig, args: &[&str]) -> Vec<serde_json::Value> {
    let out = rig.dormant(args);
    assert!(out.status.success(), "{args:?}: {out:?}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn ec2_hibernate_keeps_a_paused_script_and_a_resumed_job_continues_it() {
    let env = Ec2Env::start();
    let rig = env.rig("71", "s_71aa71aa71aa", &hibernating(&env));
    let d = tempfile::tempdir().unwrap();
    // No trigger: the ask alone keeps the environment.
    let r = rig.run(&job(71).script(&asking(d.path(), "Deploy to prod?")));
    assert_result(&r, JobResult::Success);
    let key = r.key.clone().expect("the ask suspends the environment");
    let log = r.log();
    assert_paused_line(&log, &key, "\"Deploy to prod?\"");
    assert!(log.contains("line before\n"), "{log}");
    assert!(!log.contains("answer="), "{log}");
    assert_eq!(rig.status(&key).as_deref(), Some("suspended"));
    let pid = pid_in(&d.path().join("pid"));
    assert!(alive(pid), "the asking script waits on the (loopback) host");

    // The instance was hibernated, not stopped.
    assert_hibernated(&env);
    let live: Vec<_> = instances(&env).into_iter().filter(is_live).collect();
    assert_eq!(live.len(), 1);
    assert_eq!(
        live[0].state().and_then(|s| s.name()),
        Some(&InstanceStateName::Stopped)
    );
    assert_eq!(
        live[0].hibernation_options().and_then(|h| h.configured()),
        Some(true),
        "launched with hibernation configured"
    );

    // The record, `list --json`, `inspect` and the event log show the pause.
    let rec = rig.record(&key).unwrap();
    assert_eq!(rec["paused"]["question"], "Deploy to prod?", "{rec}");
    let id = rec["id"].as_str().unwrap().to_string();
    let listed = json_lines(&rig, &["list", "--json"]);
    let mine = listed
        .iter()
        .find(|e| e["id"] == id.as_str())
        .unwrap_or_else(|| panic!("{id} in list --json: {listed:?}"));
    assert_eq!(mine["paused"]["question"], "Deploy to prod?", "{mine}");
    assert_eq!(mine["status"], "suspended", "{mine}");
    let inspected: serde_json::Value =
        serde_json::from_slice(&rig.dormant(&["inspect", &key]).stdout).unwrap();
    assert_eq!(
        inspected["paused"]["question"], "Deploy to prod?",
        "{inspected}"
    );
    let events = json_lines(&rig, &["events", "--json", &key]);
    assert!(
        events
            .iter()
            .any(|e| e["event"] == "suspended" && e["cause"] == "paused"),
        "{events:?}"
    );

    // A resumed job answers: the same process, the answer byte for byte, what
    // it held in memory, the script's exit code; nothing before the ask twice.
    let r2 = rig.run(
        &job(71)
            .resume(&key)
            .script("dormant-continue \"$(printf 'yes\\n second line')\""),
    );
    let log2 = r2.log();
    assert_result(&r2, JobResult::BuildFailure(Some(7)));
    let held = std::fs::read_to_string(d.path().join("mem")).unwrap();
    assert!(
        log2.contains(&format!(
            "answer=[yes\n second line] v={} pid={pid}\n",
            held.trim()
        )),
        "the answer byte for byte, the value held in memory, the same process:\n{log2}"
    );
    assert!(!log2.contains("line before"), "nothing twice:\n{log2}");
    assert_eq!(
        std::fs::read_to_string(d.path().join("runs")).unwrap(),
        "before the ask\n",
        "nothing before the ask ran again"
    );
    assert!(
        env.proxy
            .calls()
            .iter()
            .any(|c| c.action == "StartInstances"),
        "the resume started the instance again"
    );
}

/// `dormant pause` from the host on EC2 in `hibernate` mode: the running
/// script is frozen, the instance hibernated, and a resumed job's
/// `dormant-continue` wakes it: every line once, its exit code.
#[test]
fn ec2_hibernate_takes_a_pause_from_the_host() {
    let env = Ec2Env::start();
    let rig = env.rig("73", "s_73aa73aa73aa", &hibernating(&env));
    let d = tempfile::tempdir().unwrap();
    let (key, _pid, log) = paused_counter(&rig, d.path(), &|job_id| {
        let out = pause_cmd(&rig, &[&job_id.to_string()], &[]);
        assert!(out.status.success(), "{}", text(&out));
    });
    assert_paused_line(&log, &key, "\"paused by dormant pause\"");
    assert_hibernated(&env);
    std::fs::write(d.path().join("release"), "").unwrap();
    let r2 = rig.run(&job(91).resume(&key).script("dormant-continue"));
    assert_result(&r2, JobResult::BuildFailure(Some(3)));
    let log2 = r2.log();
    assert!(log2.contains("end\n"), "{log2}");
    let all: Vec<u64> = numbers(&log).into_iter().chain(numbers(&log2)).collect();
    let want: Vec<u64> = (1..=all.len() as u64).collect();
    assert_eq!(all, want, "every line once:\n{log}\n---\n{log2}");
}

#[test]
fn ec2_stop_mode_refuses_to_ask_naming_the_setting() {
    let env = Ec2Env::start();
    let rig = env.rig(
        "72",
        "s_72aa72aa72aa",
        &env.settings(&env.connect_address(), ""),
    );
    let r = rig.run(&job(72).script(BOTH));
    assert_result(&r, JobResult::Success);
    assert_refused_naming(&r.log(), "ec2.suspend_mode = \"stop\"");

    // `dormant pause` refuses too (exit 7), and the job runs on to its end.
    let d = tempfile::tempdir().unwrap();
    let j = job(72);
    let job_id = j.id;
    let sim = j.script(&counter(d.path()));
    let (r, out) = std::thread::scope(|s| {
        let running = s.spawn(|| rig.run(&sim));
        wait_for(&d.path().join("started"));
        let out = pause_cmd(&rig, &[&job_id.to_string()], &[]);
        std::fs::write(d.path().join("release"), "").unwrap();
        (running.join().unwrap(), out)
    });
    assert_eq!(out.status.code(), Some(7), "{}", text(&out));
    assert!(
        text(&out).contains("ec2.suspend_mode = \"stop\""),
        "{}",
        text(&out)
    );
    assert_result(&r, JobResult::BuildFailure(Some(3)));
    assert!(r.log().contains("end\n"), "{}", r.log());
}

/// A hibernation EC2 refuses (`UnsupportedHibernationConfiguration`) falls
/// back to a plain stop, which on a real instance ends the paused script
/// (the emulator leaves the loopback host's running: what is proven here is
/// that dormant says so). The record keeps the question with why the script
/// is lost (`list` no longer says paused), the `suspended` event says it, the
/// resumed job's `dormant-continue` fails at once with 125 naming the
/// environment and the fallback, and after that job the record no longer
/// claims the environment is paused.
#[test]
fn ec2_a_hibernation_that_falls_back_to_a_stop_says_the_paused_script_is_gone() {
    let env = Ec2Env::start();
    let rig = env.rig("74", "s_74aa74aa74aa", &hibernating(&env));
    let d = tempfile::tempdir().unwrap();
    env.proxy.fail(
        "StopInstances",
        0,
        1,
        400,
        "UnsupportedHibernationConfiguration",
    );
    let r = rig.run(&job(74).script(&asking(d.path(), "Deploy?")));
    assert_result(&r, JobResult::Success);
    let key = r.key.clone().expect("the ask suspends the environment");
    let pid = pid_in(&d.path().join("pid"));
    let stops: Vec<_> = env
        .proxy
        .calls()
        .into_iter()
        .filter(|c| c.action == "StopInstances")
        .collect();
    assert_eq!(stops.len(), 2, "a refused hibernation, then a plain stop");
    assert!(
        stops[1].body.contains("Hibernate=false"),
        "{}",
        stops[1].body
    );

    let rec = rig.record(&key).unwrap();
    assert_eq!(rec["paused"]["question"], "Deploy?", "{rec}");
    let lost = rec["paused"]["lost"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        lost.contains("could not hibernate (UnsupportedHibernationConfiguration)"),
        "the record says the paused script is lost, and why: {rec}"
    );
    let id = rec["id"].as_str().unwrap().to_string();
    let table = String::from_utf8_lossy(&rig.dormant(&["list"]).stdout).into_owned();
    let row = table
        .lines()
        .find(|l| l.starts_with(&id))
        .unwrap_or_else(|| panic!("{id} in list:\n{table}"));
    assert!(
        row.contains(" suspended ") && row.contains("paused script lost: "),
        "{row}"
    );
    let events = json_lines(&rig, &["events", "--json", &key]);
    assert!(
        events.iter().any(|e| e["event"] == "suspended"
            && e["cause"] == "paused"
            && e["reason"]
                .as_str()
                .is_some_and(|r| r.contains("the paused script is gone"))),
        "{events:?}"
    );

    // The resumed job is told at once, even though the emulator left the
    // loopback host's script waiting.
    let r2 = rig.run(
        &job(74)
            .resume(&key)
            .suspend_on(true, true)
            .script("dormant-continue yes || echo \"rc=$?\""),
    );
    assert_result(&r2, JobResult::Success);
    let log2 = r2.log();
    assert!(
        log2.contains(&format!(
            "dormant-continue: environment {key}: the script paused there is gone: instance "
        )) && log2.contains("UnsupportedHibernationConfiguration")
            && log2.contains("rc=125\n")
            && !log2.contains("answer="),
        "{log2}"
    );
    let rec = rig.record(&key).unwrap();
    assert!(rec["paused"].is_null(), "no longer paused: {rec}");
    let _ = std::process::Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status();
}
