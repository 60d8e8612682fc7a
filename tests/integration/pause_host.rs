//! `dormant pause` from the runner host (docs/pause.md, "Pausing from the
//! host") on the `ssh` provider against the test sshd: a running script is
//! frozen, its stage ends successfully with what it printed so far, the
//! environment suspends keeping it, and a resumed job's `dormant-continue`
//! wakes it and prints the rest — every line exactly once across the two
//! job logs, the same process, its exit code. The refusals, each with its
//! exit code; a `dormant pause` killed right after recording its request;
//! a pause of a job that relays the paused script (`dormant-continue`).

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use crate::harness::*;
use crate::ssh::ssh_rig_with;
use crate::sshd::{alive, Sshd};

pub fn wait_for(path: &Path) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !path.exists() {
        assert!(
            Instant::now() < deadline,
            "{} never appeared",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A script that prints `line <n>` every 10 ms from its start until it has
/// printed 20 and `release` exists, then `end` and exit 3.
pub fn counter(d: &Path) -> String {
    format!(
        "echo $BASHPID > '{pid}'; i=0; while :; do i=$((i+1)); echo \"line $i\"; \
         [ $i -eq 20 ] && : > '{started}'; [ $i -ge 20 ] && [ -e '{release}' ] && break; sleep 0.01; done; \
         echo end; exit 3",
        pid = d.join("pid").display(),
        started = d.join("started").display(),
        release = d.join("release").display(),
    )
}

/// The numbers of the `line <n>` lines of a job log, in order.
pub fn numbers(log: &str) -> Vec<u64> {
    log.lines()
        .filter_map(|l| l.strip_prefix("line ")?.parse().ok())
        .collect()
}

pub fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The process's state letter (`T`: stopped).
pub fn state_of(pid: u32) -> String {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    rest[..1].to_string()
}

/// `dormant pause` with `extra` variables in its environment.
pub fn pause_cmd(rig: &Rig, args: &[&str], extra: &[(&str, &str)]) -> Output {
    Command::new(BIN)
        .arg("pause")
        .args(args)
        .env_clear()
        .envs(&rig.runner.env)
        .envs(extra.iter().copied())
        .output()
        .unwrap()
}

/// Runs the counter job, pauses it with `pause` once it printed 20 lines,
/// and checks the first half; returns (key, pid, first job's log).
pub fn paused_counter(rig: &Rig, d: &Path, pause: &dyn Fn(u64)) -> (String, u32, String) {
    let j = job(91);
    let job_id = j.id;
    // No trigger: the pause alone keeps the environment.
    let sim = j.script(&counter(d));
    let r = std::thread::scope(|s| {
        let running = s.spawn(|| rig.run(&sim));
        wait_for(&d.join("started"));
        // A failed pause must not leave the job running for ever.
        let paused = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| pause(job_id)));
        if let Err(e) = paused {
            std::fs::write(d.join("release"), "").unwrap();
            let _ = running.join();
            std::panic::resume_unwind(e);
        }
        running.join().unwrap()
    });
    assert_result(&r, JobResult::Success);
    let key = r.key.clone().expect("the pause suspends the environment");
    assert_eq!(rig.status(&key).as_deref(), Some("suspended"));
    let log = r.log();
    let pid: u32 = std::fs::read_to_string(d.join("pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(alive(pid), "the paused script is kept");
    assert_eq!(state_of(pid), "T", "the paused script is frozen");
    assert!(!log.contains("end\n"), "{log}");
    (key, pid, log)
}

#[test]
fn a_job_paused_from_the_host_continues_with_every_line_once() {
    let sshd = Sshd::start();
    let (rig, _) = ssh_rig_with(&sshd, "");
    let d = tempfile::tempdir().unwrap();
    let (key, pid, log) = paused_counter(&rig, d.path(), &|job_id| {
        let out = pause_cmd(&rig, &[&job_id.to_string(), "--reason", "look at it"], &[]);
        assert!(out.status.success(), "{}", text(&out));
    });
    let want =
        format!("dormant-ask: paused key={key} question=\"paused by dormant pause: look at it\"");
    assert!(log.lines().any(|l| l == want), "{want}\n{log}");
    assert_eq!(
        rig.record(&key).unwrap()["paused"]["question"],
        "paused by dormant pause: look at it"
    );
    let list = rig.dormant(&["list"]);
    assert!(
        text(&list).contains("paused by dormant pause: look at it"),
        "{}",
        text(&list)
    );
    // Frozen: it does not go on (nor end) while it waits.
    std::fs::write(d.path().join("release"), "").unwrap();
    let first = numbers(&log);

    let r2 = rig.run(&job(91).resume(&key).script("dormant-continue"));
    assert_result(&r2, JobResult::BuildFailure(Some(3)));
    let log2 = r2.log();
    assert!(log2.contains("end\n"), "{log2}");
    let second = numbers(&log2);
    assert!(!second.is_empty(), "the woken script printed on:\n{log2}");
    let all: Vec<u64> = first.iter().chain(second.iter()).copied().collect();
    let want: Vec<u64> = (1..=all.len() as u64).collect();
    assert_eq!(
        all, want,
        "every line exactly once across the two job logs:\n--- first\n{log}\n--- second\n{log2}"
    );
    let t = Instant::now();
    while alive(pid) {
        assert!(t.elapsed() < Duration::from_secs(10), "the script ended");
        std::thread::sleep(Duration::from_millis(20));
    }
    crate::reattach::assert_nothing_kept(&sshd);
}

#[test]
fn pause_refuses_what_it_cannot_pause_each_with_its_code() {
    let sshd = Sshd::start();
    let (rig, _) = ssh_rig_with(&sshd, "");
    let d = tempfile::tempdir().unwrap();
    let out = pause_cmd(&rig, &["424242"], &[]);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));

    // In after_script: not a user script stage.
    let j = job(92);
    let job_id = j.id;
    let mut sim = j.suspend_on(true, false).script("echo hi");
    sim.after_script = Some(format!(
        ": > '{inside}'; while [ ! -e '{go}' ]; do sleep 0.02; done",
        inside = d.path().join("after").display(),
        go = d.path().join("go").display()
    ));
    let r = std::thread::scope(|s| {
        let running = s.spawn(|| rig.run(&sim));
        wait_for(&d.path().join("after"));
        let out = pause_cmd(&rig, &[&job_id.to_string()], &[]);
        std::fs::write(d.path().join("go"), "").unwrap();
        (running.join().unwrap(), out)
    });
    let (r, out) = r;
    assert_eq!(out.status.code(), Some(8), "{}", text(&out));
    assert!(text(&out).contains("after_script"), "{}", text(&out));
    assert_result(&r, JobResult::Success);
    let key = r.key.clone().unwrap();
    assert!(
        rig.record(&key)
            .unwrap()
            .get("paused")
            .is_none_or(|p| p.is_null()),
        "a refused pause leaves nothing"
    );
    // Suspended: no job runs in it.
    let out = pause_cmd(&rig, &[&key], &[]);
    assert_eq!(out.status.code(), Some(5), "{}", text(&out));
}

#[test]
fn pause_refuses_naming_the_setting_where_a_script_cannot_be_kept() {
    let sshd = Sshd::start();
    let (rig, _) = ssh_rig_with(&sshd, "");
    let mut settings = std::fs::read_to_string(&rig.settings_path).unwrap();
    settings.push_str("\n[suspend]\nenabled = false\n");
    std::fs::write(&rig.settings_path, settings).unwrap();
    let d = tempfile::tempdir().unwrap();
    let j = job(93);
    let job_id = j.id;
    let sim = j.script(&counter(d.path()));
    let r = std::thread::scope(|s| {
        let running = s.spawn(|| rig.run(&sim));
        wait_for(&d.path().join("started"));
        let out = pause_cmd(&rig, &[&job_id.to_string()], &[]);
        std::fs::write(d.path().join("release"), "").unwrap();
        (running.join().unwrap(), out)
    });
    let (r, out) = r;
    assert_eq!(out.status.code(), Some(7), "{}", text(&out));
    assert!(
        text(&out).contains("suspend.enabled = false"),
        "{}",
        text(&out)
    );
    // The job ran on to its own end.
    assert_result(&r, JobResult::BuildFailure(Some(3)));
    assert!(r.log().contains("end\n"), "{}", r.log());
}

/// `dormant pause` SIGKILLed right after it recorded its request
/// (`pause:requested`): the stage pauses all the same, and continues.
#[cfg(feature = "testing")]
#[test]
fn a_pause_killed_after_recording_its_request_still_pauses() {
    let sshd = Sshd::start();
    let (rig, _) = ssh_rig_with(&sshd, "");
    let d = tempfile::tempdir().unwrap();
    let (key, pid, _) = paused_counter(&rig, d.path(), &|job_id| {
        let out = pause_cmd(
            &rig,
            &[&job_id.to_string()],
            &[("DORMANT_FAILPOINT", "pause:requested")],
        );
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(out.status.signal(), Some(9), "{}", text(&out));
    });
    assert_eq!(
        rig.record(&key).unwrap()["paused"]["question"],
        "paused by dormant pause"
    );
    std::fs::write(d.path().join("release"), "").unwrap();
    let r2 = rig.run(&job(91).resume(&key).script("dormant-continue"));
    assert_result(&r2, JobResult::BuildFailure(Some(3)));
    assert!(r2.log().contains("end\n"), "{}", r2.log());
    assert!(!alive(pid) || state_of(pid) != "T");
}

/// A job whose `dormant-continue` relays the paused script is paused from
/// the host: the script it relays is what freezes (not the relay), the job
/// ends paused, and a third job continues it — every line exactly once
/// across the three job logs.
#[test]
fn a_continued_script_paused_from_the_host_again_freezes_the_script_not_its_relay() {
    let sshd = Sshd::start();
    let (rig, _) = ssh_rig_with(&sshd, "");
    let d = tempfile::tempdir().unwrap();
    let (key, pid, log) = paused_counter(&rig, d.path(), &|job_id| {
        let out = pause_cmd(&rig, &[&job_id.to_string()], &[]);
        assert!(out.status.success(), "{}", text(&out));
    });
    let j2 = job(91).resume(&key);
    let job2 = j2.id;
    let sim2 = j2.script("dormant-continue");
    let r2 = std::thread::scope(|s| {
        let running = s.spawn(|| rig.run(&sim2));
        // Woken by the relay: the counter runs again (and never ends: no
        // `release` yet).
        let t = Instant::now();
        while state_of(pid) == "T" {
            if t.elapsed() > Duration::from_secs(60) {
                std::fs::write(d.path().join("release"), "").unwrap();
                panic!("never woken: {}", running.join().unwrap().log());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let out = pause_cmd(&rig, &[&job2.to_string(), "--reason", "again"], &[]);
        if !out.status.success() {
            std::fs::write(d.path().join("release"), "").unwrap();
        }
        assert!(out.status.success(), "{}", text(&out));
        running.join().unwrap()
    });
    assert_result(&r2, JobResult::Success);
    assert_eq!(r2.key.as_deref(), Some(key.as_str()));
    let log2 = r2.log();
    let want = format!("dormant-ask: paused key={key} question=\"paused by dormant pause: again\"");
    assert!(log2.lines().any(|l| l == want), "{want}\n{log2}");
    assert!(alive(pid), "the paused script is kept");
    assert_eq!(state_of(pid), "T", "the relayed script is frozen");

    std::fs::write(d.path().join("release"), "").unwrap();
    let r3 = rig.run(&job(91).resume(&key).script("dormant-continue"));
    assert_result(&r3, JobResult::BuildFailure(Some(3)));
    let log3 = r3.log();
    assert!(log3.contains("end\n"), "{log3}");
    let all: Vec<u64> = [&log, &log2, &log3]
        .iter()
        .flat_map(|l| numbers(l))
        .collect();
    let want: Vec<u64> = (1..=all.len() as u64).collect();
    assert_eq!(
        all, want,
        "every line exactly once across the three job logs:\n--- 1\n{log}\n--- 2\n{log2}\n--- 3\n{log3}"
    );
    let t = Instant::now();
    while alive(pid) {
        assert!(t.elapsed() < Duration::from_secs(10), "the script ended");
        std::thread::sleep(Duration::from_millis(20));
    }
    crate::reattach::assert_nothing_kept(&sshd);
}
