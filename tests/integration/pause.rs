//! Pausing a job (docs/pause.md) on the `ssh` provider against the test
//! sshd: a script that asks (`dormant-ask`) ends its job's stage
//! successfully with the question in the job log, its environment is
//! suspended whatever the triggers say, and the script waits on the host,
//! alive; a later job that resumed the environment answers it with
//! `dormant-continue`, which prints the script's output from where the first
//! job's log stopped and exits with the script's exit code — the same
//! process, what it held in memory, nothing before the ask run again. Two
//! rounds; `dormant-continue` with nothing paused; a release ends the paused
//! script; a provider that cannot keep one makes `dormant-ask` fail at once.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::harness::*;
use crate::reattach::assert_nothing_kept;
use crate::ssh::ssh_rig_with;
use crate::sshd::{alive, Sshd};

/// The pid the script wrote into `file` (its own shell's).
pub fn pid_in(file: &Path) -> u32 {
    std::fs::read_to_string(file)
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// The script of the first job: a value only its memory holds, its pid, one
/// line that must never run again, then the ask.
pub fn asking(d: &Path, question: &str) -> String {
    format!(
        "v=mem-$RANDOM$RANDOM; echo $v > '{mem}'; echo $BASHPID > '{pid}'; echo \"before the ask\" >> '{runs}'; \
         echo 'line before'; a=$(dormant-ask '{question}'); \
         echo \"answer=[$a] v=$v pid=$BASHPID\"; exit 7",
        pid = d.join("pid").display(),
        mem = d.join("mem").display(),
        runs = d.join("runs").display(),
    )
}

#[track_caller]
pub fn assert_paused_line(log: &str, key: &str, question_json: &str) {
    let want = format!("dormant-ask: paused key={key} question={question_json}");
    assert!(
        log.lines().any(|l| l == want),
        "the job log shows the question and the key on one line ({want}):\n{log}"
    );
}

#[test]
fn a_script_that_asks_waits_alive_and_a_resumed_job_continues_it_with_the_answer() {
    let sshd = Sshd::start();
    let (rig, _) = ssh_rig_with(&sshd, "");
    let d = tempfile::tempdir().unwrap();
    // No trigger: the ask alone keeps the environment.
    let first = job(81).script(&asking(d.path(), "Deploy to prod?"));
    let r = rig.run(&first);
    assert_result(&r, JobResult::Success);
    let key = r.key.clone().expect("the ask suspends the environment");
    assert_eq!(rig.status(&key).as_deref(), Some("suspended"));
    let log = r.log();
    assert_paused_line(&log, &key, "\"Deploy to prod?\"");
    assert!(log.contains("line before\n"), "{log}");
    assert!(!log.contains("answer="), "{log}");
    let pid = pid_in(&d.path().join("pid"));
    assert!(alive(pid), "the asking script waits on the host");
    let rec = rig.record(&key).unwrap();
    assert_eq!(rec["paused"]["question"], "Deploy to prod?", "{rec}");

    let second = job(81)
        .resume(&key)
        .script("dormant-continue \"$(printf 'yes\\n second line')\"");
    let r2 = rig.run(&second);
    let log2 = r2.log();
    assert_result(&r2, JobResult::BuildFailure(Some(7)));
    // `answer=[yes\n second line] v=<value> pid=<pid>`: the answer byte for
    // byte, then what the process held in memory and its pid.
    let rest = log2
        .split("answer=[yes\n second line] v=")
        .nth(1)
        .unwrap_or_else(|| panic!("the answer byte for byte:\n{log2}"));
    let rest = rest.lines().next().unwrap();
    let (v, p) = rest.split_once(" pid=").unwrap();
    let held = std::fs::read_to_string(d.path().join("mem")).unwrap();
    assert_eq!(v, held.trim(), "the value the process held in memory");
    assert_eq!(p, pid.to_string(), "the same process");
    assert!(!log2.contains("line before"), "nothing twice:\n{log2}");
    assert_eq!(
        std::fs::read_to_string(d.path().join("runs")).unwrap(),
        "before the ask\n",
        "nothing before the ask ran again"
    );
    let t = Instant::now();
    while alive(pid) {
        assert!(t.elapsed() < Duration::from_secs(10), "the script ended");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_nothing_kept(&sshd);
}

#[test]
fn two_rounds_in_one_process_then_its_end() {
    let sshd = Sshd::start();
    let (rig, _) = ssh_rig_with(&sshd, "");
    let d = tempfile::tempdir().unwrap();
    let script = format!(
        "echo $BASHPID > '{pid}'; n=41; a=$(dormant-ask 'first?'); n=$((n+1)); echo \"got [$a] n=$n\"; \
         b=$(dormant-ask 'second?'); echo \"got [$b] n=$((n+1)) pid=$BASHPID\"; exit 0",
        pid = d.path().join("pid").display()
    );
    let r = rig.run(&job(82).script(&script));
    assert_result(&r, JobResult::Success);
    let key = r.key.clone().unwrap();
    assert_paused_line(&r.log(), &key, "\"first?\"");
    let pid = pid_in(&d.path().join("pid"));

    let r2 = rig.run(
        &job(82)
            .resume(&key)
            .script("dormant-continue one; echo 'not reached'"),
    );
    assert_result(&r2, JobResult::Success);
    let log2 = r2.log();
    assert!(log2.contains("got [one] n=42\n"), "{log2}");
    assert_paused_line(&log2, &key, "\"second?\"");
    assert!(
        !log2.contains("not reached"),
        "the resuming job ends paused:\n{log2}"
    );
    assert_eq!(rig.status(&key).as_deref(), Some("suspended"));
    assert!(alive(pid));
    assert_eq!(rig.record(&key).unwrap()["paused"]["question"], "second?");

    let r3 = rig.run(&job(82).resume(&key).script("printf two | dormant-continue"));
    assert_result(&r3, JobResult::Success);
    let log3 = r3.log();
    assert!(
        log3.contains(&format!("got [two] n=43 pid={pid}\n")),
        "{log3}"
    );
    assert!(!log3.contains("got [one]"), "nothing twice:\n{log3}");
}

#[test]
fn continue_with_nothing_paused_fails_at_once_and_a_release_ends_a_paused_script() {
    let sshd = Sshd::start();
    let (rig, _) = ssh_rig_with(&sshd, "");
    let d = tempfile::tempdir().unwrap();
    let r = rig.run(
        &job(83)
            .suspend_on(true, true)
            .script("dormant-continue x || echo \"rc=$?\""),
    );
    assert_result(&r, JobResult::Success);
    let log = r.log();
    assert!(
        log.contains("dormant-continue: nothing is paused in this environment (")
            && log.contains("\nrc=125\n"),
        "{log}"
    );

    let first = job(84).script(&asking(d.path(), "q"));
    let r = rig.run(&first);
    assert_result(&r, JobResult::Success);
    let key = r.key.clone().unwrap();
    let pid = pid_in(&d.path().join("pid"));
    assert!(alive(pid));
    let out = rig.dormant(&["release", &key]);
    assert!(out.status.success(), "{out:?}");
    let t = Instant::now();
    while alive(pid) {
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "the release ended the paused script"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_nothing_kept(&sshd);
}

/// `dormant-continue`'s own failures exit 125, not a code the continued
/// script could give: an answer over the bound is refused (125, saying so)
/// and not delivered, and the script still waits for a good one.
#[test]
fn an_answer_over_the_bound_exits_125_and_the_script_still_waits() {
    let sshd = Sshd::start();
    let (rig, _) = ssh_rig_with(&sshd, "");
    let d = tempfile::tempdir().unwrap();
    let r = rig.run(&job(89).script(&asking(d.path(), "big?")));
    assert_result(&r, JobResult::Success);
    let key = r.key.clone().unwrap();
    let r2 = rig.run(&job(89).resume(&key).script(
        "head -c 70000 /dev/zero | dormant-continue || echo \"rc=$?\"; dormant-continue small",
    ));
    assert_result(&r2, JobResult::BuildFailure(Some(7)));
    let log2 = r2.log();
    assert!(
        log2.contains("dormant-continue: the answer is over 65536 bytes: not sent")
            && log2.contains("rc=125\n")
            && log2.contains("answer=[small]"),
        "{log2}"
    );
}

#[test]
fn ask_fails_at_once_naming_the_setting_where_a_script_cannot_be_kept() {
    let sshd = Sshd::start();
    let (rig, _) = ssh_rig_with(&sshd, "");
    let mut settings = std::fs::read_to_string(&rig.settings_path).unwrap();
    settings.push_str("\n[suspend]\nenabled = false\n");
    std::fs::write(&rig.settings_path, settings).unwrap();
    let r = rig.run(&job(85).script("dormant-ask 'q?' || echo \"rc=$? went on\""));
    assert_result(&r, JobResult::Success);
    let log = r.log();
    assert!(
        log.contains("dormant-ask: cannot pause here: suspend.enabled = false")
            && log.contains("rc=125 went on"),
        "{log}"
    );
}

/// `dormant run` SIGKILLed right after it recorded the pause (`pause:recorded`):
/// the runner fails the job, but the question is not lost — cleanup still
/// suspends the environment keeping the script — and a resumed job answers it.
#[cfg(feature = "testing")]
#[test]
fn a_run_killed_after_recording_the_pause_loses_no_question() {
    let sshd = Sshd::start();
    let (mut rig, _) = ssh_rig_with(&sshd, "");
    let d = tempfile::tempdir().unwrap();
    crate::crash::arm(&mut rig, Some("pause:recorded"), true);
    let r = rig.run(&job(86).script(&asking(d.path(), "kept?")));
    crate::crash::assert_killed_at(&rig, &r.calls, "pause:recorded", 1);
    let key = r.key.clone().expect("suspended: the pause was recorded");
    assert_eq!(rig.status(&key).as_deref(), Some("suspended"));
    assert_eq!(rig.record(&key).unwrap()["paused"]["question"], "kept?");
    let pid = pid_in(&d.path().join("pid"));
    assert!(alive(pid));
    crate::crash::arm(&mut rig, None, false);
    let r2 = rig.run(&job(86).resume(&key).script("dormant-continue ok"));
    assert_result(&r2, JobResult::BuildFailure(Some(7)));
    assert!(r2.log().contains("answer=[ok]"), "{}", r2.log());
}

/// Where a script cannot pause, both commands say why at once (not a
/// missing command, exit 127), naming the setting, and the script goes on.
#[track_caller]
pub fn assert_refused_naming(log: &str, why: &str) {
    assert!(
        log.contains(&format!("dormant-ask: cannot pause here: {why}"))
            && log.contains("ask rc=125 went on")
            && log.contains(&format!(
                "dormant-continue: nothing can be paused here: {why}"
            ))
            && log.contains("continue rc=125"),
        "{log}"
    );
}

pub const BOTH: &str = "dormant-ask 'q?' || echo \"ask rc=$? went on\"; \
                    dormant-continue x || echo \"continue rc=$?\"";

#[test]
fn on_stages_run_direct_ask_and_continue_refuse_at_once_naming_the_setting() {
    let sshd = Sshd::start();
    let (rig, _) = ssh_rig_with(&sshd, "reconnect_timeout = \"0s\"");
    let r = rig.run(&job(88).script(BOTH));
    assert_result(&r, JobResult::Success);
    assert_refused_naming(&r.log(), "ssh.reconnect_timeout = \"0s\"");
}

/// A resumed job that does not run `dormant-continue` (it suspends by its
/// own trigger) leaves the script waiting, and the record still says what
/// it asks (`list`, `inspect`); the job that continues it clears that.
#[test]
fn a_resumed_job_that_does_not_continue_leaves_the_question_on_record() {
    let sshd = Sshd::start();
    let (rig, _) = ssh_rig_with(&sshd, "");
    let d = tempfile::tempdir().unwrap();
    let r = rig.run(&job(84).script(&asking(d.path(), "still there?")));
    assert_result(&r, JobResult::Success);
    let key = r.key.clone().unwrap();
    let pid = pid_in(&d.path().join("pid"));

    let r2 = rig.run(
        &job(84)
            .resume(&key)
            .suspend_on(true, true)
            .script("echo busy"),
    );
    assert_result(&r2, JobResult::Success);
    assert_eq!(rig.status(&key).as_deref(), Some("suspended"));
    assert!(alive(pid), "the script still waits");
    let rec = rig.record(&key).unwrap();
    assert_eq!(rec["paused"]["question"], "still there?", "{rec}");
    let list = rig.dormant(&["list"]);
    let listed = format!("{}", String::from_utf8_lossy(&list.stdout));
    assert!(listed.contains("still there?"), "{listed}");

    let r3 = rig.run(
        &job(84)
            .resume(&key)
            .suspend_on(true, true)
            .script("dormant-continue yes"),
    );
    assert_result(&r3, JobResult::BuildFailure(Some(7)));
    assert!(r3.log().contains("answer=[yes]"), "{}", r3.log());
    let rec = rig.record(&key).unwrap();
    assert!(
        rec.get("paused").is_none_or(|p| p.is_null()),
        "continued to its end: no longer paused: {rec}"
    );
}

/// The hot window (`suspend.hot_for`) is for machines a suspension stops
/// (qemu, EC2): on `local` and `ssh` the script waits on a host that stays
/// up, so a window keeps nothing running and costs nothing: the record is
/// not hot, no `dormant cool` waiter is started, `dormant-ask` says the
/// script is kept until it is continued, and the continue is as without it.
#[test]
fn a_hot_window_is_a_no_op_on_local_and_ssh() {
    let sshd = Sshd::start();
    let (ssh, _) = ssh_rig_with(&sshd, "[suspend]\nhot_for = \"10m\"");
    let local = Rig::new("1", "s_66aa66aa66aa", "[suspend]\nhot_for = \"10m\"\n");
    for (name, rig) in [("ssh", &ssh), ("local", &local)] {
        let d = tempfile::tempdir().unwrap();
        let r = rig.run(&job(86).script(&asking(d.path(), "Hot?")));
        assert_result(&r, JobResult::Success);
        let key = r.key.clone().unwrap();
        let log = r.log();
        assert!(
            log.lines().any(|l| l
                == "dormant-ask: the paused script is kept until it is continued, or the \
                    environment is released (suspend.ttl = \"7d\")"),
            "{name}: {log}"
        );
        let rec = rig.record(&key).unwrap();
        assert_eq!(rec["status"], "suspended", "{name}: {rec}");
        assert!(rec["hot_until"].is_null(), "{name}: not hot: {rec}");
        assert!(
            !rig.env_dir(&key).join("cool.log").exists(),
            "{name}: no waiter was started"
        );
        let r2 = rig.run(&job(86).resume(&key).script("dormant-continue hi"));
        assert_result(&r2, JobResult::BuildFailure(Some(7)));
        assert!(r2.log().contains("answer=[hi]"), "{name}: {}", r2.log());
    }
}

/// Test hygiene: a test server dropped while a script waits paused on it
/// (a test that failed before it continued the script) kills the script,
/// rather than leaving it waiting on this host.
#[test]
fn a_test_server_dropped_with_a_paused_script_kills_the_script() {
    let sshd = Sshd::start();
    let (rig, _) = ssh_rig_with(&sshd, "");
    let d = tempfile::tempdir().unwrap();
    let r = rig.run(&job(81).script(&asking(d.path(), "left?")));
    assert_result(&r, JobResult::Success);
    let pid = pid_in(&d.path().join("pid"));
    assert!(alive(pid), "paused: the script waits");
    drop(rig);
    drop(sshd);
    let t = std::time::Instant::now();
    while alive(pid) {
        assert!(
            t.elapsed() < std::time::Duration::from_secs(10),
            "the paused script {pid} outlived its test server"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}
