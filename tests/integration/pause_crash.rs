//! Kill tests of the pause steps that run on the machine, in shell
//! (docs/pause.md, "Crash points and what a kill leaves"): the scripts'
//! `: failpoint NAME` lines, armed in `testing` builds
//! (`dormant::failpoint::in_script`), SIGKILL the shell that reaches them
//! (or, with `DORMANT_FAILPOINT_NAP`, hold it there: a race window held
//! open).
//! Each test proves the kill happened there (the last words in the job log,
//! the once-marker made), then that nothing is lost, delivered twice or stuck:
//! on the `ssh` provider against the test sshd. Also the cleanup of a paused
//! job killed before its suspension, settled by a sweep.

use std::path::Path;

use crate::crash::arm;
use crate::harness::*;
use crate::pause_host::{numbers, pause_cmd, paused_counter, state_of, text};
use crate::ssh::ssh_rig_with;
use crate::sshd::{alive, Sshd};

/// Proves a script's crash point `point` fired once: its last words are in
/// `output` and the once-marker exists (made just before the kill).
#[track_caller]
fn assert_script_killed_at(rig: &Rig, output: &str, point: &str) {
    let said = format!("dormant: failpoint {point}: SIGKILL");
    assert_eq!(
        output.matches(&said).count(),
        1,
        "{point}: killed there once:\n{output}"
    );
    let marker = rig.runner.env.get("DORMANT_FAILPOINT_ONCE").unwrap();
    assert!(Path::new(marker).exists(), "{point}: once-marker {marker}");
}

/// [`paused_counter`] paused by `dormant pause` of its job: (key, pid, log).
fn paused_from_host(rig: &Rig, d: &Path) -> (String, u32, String) {
    paused_counter(rig, d, &|job_id| {
        let out = pause_cmd(rig, &[&job_id.to_string()], &[]);
        assert!(out.status.success(), "{}", text(&out));
    })
}

/// `dormant-continue` SIGKILLed right after it woke a script paused from the
/// host (`continue:woken`: after its SIGCONT, before it removed `.stop` and
/// `.ask`): the job that ran it gets 137 and nothing of the script's output;
/// the script runs on (woken), still paused for dormant (`.paused`). A later job's
/// `dormant-continue` takes the leftovers (SIGCONT again, harmless; the files
/// go) and prints the rest from where the first job's log stopped: every line
/// exactly once, the script's own exit code, nothing left behind.
#[test]
fn a_continue_killed_after_waking_the_script_is_retried_with_every_line_once() {
    let sshd = Sshd::start();
    let (mut rig, _) = ssh_rig_with(&sshd, "");
    let d = tempfile::tempdir().unwrap();
    let (key, pid, log) = paused_from_host(&rig, d.path());
    arm(&mut rig, Some("continue:woken"), true);
    let r2 = rig.run(
        &job(91)
            .resume(&key)
            .suspend_on(true, true)
            .script("dormant-continue || echo \"rc=$?\""),
    );
    assert_result(&r2, JobResult::Success);
    let log2 = r2.log();
    assert_script_killed_at(&rig, &log2, "continue:woken");
    assert!(log2.contains("rc=137\n"), "{log2}");
    assert!(numbers(&log2).is_empty(), "nothing streamed yet:\n{log2}");
    assert_eq!(rig.status(&key).as_deref(), Some("suspended"));
    assert!(alive(pid), "the woken script runs on");
    assert_ne!(state_of(pid), "T", "woken");

    // The retry; the script may end once it has taken the pause's leftovers
    // (`.stop` gone). (Ended before a retry, its output's tail and exit
    // code are not continued: docs/pause.md.)
    let r3 = rig.run(&job(91).resume(&key).script(&format!(
        "dormant-continue & c=$!; i=0; while ls \"${{DORMANT_STAGE%/*}}\"/*.stop >/dev/null 2>&1 && [ $((i += 1)) -le 600 ]; do \
         sleep 0.05; done; \
         : > '{}'; wait $c",
        d.path().join("release").display()
    )));
    assert_result(&r3, JobResult::BuildFailure(Some(3)));
    let log3 = r3.log();
    assert!(log3.contains("end\n"), "{log3}");
    let all: Vec<u64> = numbers(&log).into_iter().chain(numbers(&log3)).collect();
    let want: Vec<u64> = (1..=all.len() as u64).collect();
    assert_eq!(all, want, "every line once:\n{log}\n---\n{log3}");
    crate::reattach::assert_nothing_kept(&sshd);
}

/// The relaying stage's pump (kept.sh) SIGKILLed right after it wrote a
/// piece of the paused script's output into the stage (`pump:pieced`: the
/// piece noted in `.map` before it was written, `.spliced` not yet moved):
/// the job's log has the piece and its `dormant-continue` ends (nothing more
/// can reach that stage's output) instead of waiting for ever; the next
/// job's `dormant-continue` starts right after the piece: every line once.
#[test]
fn a_pump_killed_after_a_piece_leaves_the_next_continue_at_the_byte() {
    let sshd = Sshd::start();
    let (mut rig, _) = ssh_rig_with(&sshd, "");
    let d = tempfile::tempdir().unwrap();
    let (key, _pid, log) = paused_from_host(&rig, d.path());
    arm(&mut rig, Some("pump:pieced"), true);
    let r2 = rig.run(
        &job(91)
            .resume(&key)
            .suspend_on(true, true)
            .script("dormant-continue"),
    );
    let log2 = r2.log();
    let marker = rig.runner.env.get("DORMANT_FAILPOINT_ONCE").unwrap();
    assert!(
        Path::new(marker).exists(),
        "pump:pieced: once-marker {marker}:\n{log2}"
    );
    assert!(
        matches!(r2.result, JobResult::BuildFailure(_)),
        "{}\n{log2}",
        r2.result
    );
    assert!(
        !numbers(&log2).is_empty(),
        "the piece is in the log:\n{log2}"
    );
    arm(&mut rig, None, false);
    std::fs::write(d.path().join("release"), "").unwrap();
    let r3 = rig.run(&job(91).resume(&key).script("dormant-continue"));
    assert_result(&r3, JobResult::BuildFailure(Some(3)));
    let log3 = r3.log();
    assert!(log3.contains("end\n"), "{log3}");
    let all: Vec<u64> = numbers(&log)
        .into_iter()
        .chain(numbers(&log2))
        .chain(numbers(&log3))
        .collect();
    let want: Vec<u64> = (1..=all.len() as u64).collect();
    assert_eq!(
        all, want,
        "every line once:\n{log}\n---\n{log2}\n---\n{log3}"
    );
    crate::reattach::assert_nothing_kept(&sshd);
}

/// A relaying stage's pump slow to start (held at `pump:starting`, before
/// its output is the stage's file): the script's `dormant-continue` takes
/// it for starting, not gone, and continues the script (soak seed ssh
/// 8842125980182280928: under load the continue got there first and
/// stopped at once, "its pump on the machine is gone").
#[test]
fn a_continue_waits_for_a_pump_slow_to_start() {
    let sshd = Sshd::start();
    let (mut rig, _) = ssh_rig_with(&sshd, "");
    let d = tempfile::tempdir().unwrap();
    let (key, _pid, log) = paused_from_host(&rig, d.path());
    // (Every relaying stage of the job is held, the build script's too.)
    arm(&mut rig, Some("pump:starting"), false);
    rig.runner
        .env
        .insert("DORMANT_FAILPOINT_NAP".into(), "2".into());
    std::fs::write(d.path().join("release"), "").unwrap();
    let r2 = rig.run(&job(91).resume(&key).script("dormant-continue"));
    let log2 = r2.log();
    assert_result(&r2, JobResult::BuildFailure(Some(3)));
    assert!(log2.contains("end\n"), "{log2}");
    let all: Vec<u64> = numbers(&log).into_iter().chain(numbers(&log2)).collect();
    let want: Vec<u64> = (1..=all.len() as u64).collect();
    assert_eq!(all, want, "every line once:\n{log}\n---\n{log2}");
    crate::reattach::assert_nothing_kept(&sshd);
}

/// The stage's owner SIGKILLed in `halt` after `$o.stop` and the SIGSTOP,
/// before `$o.ask` (`owner:halted`): the stage is not paused yet; its
/// session breaks, `dormant run` follows the stage again and sends the
/// pause again, a new owner halts the (already frozen) group and the stage
/// ends paused. No question lost, no stuck environment: a resumed job
/// continues the script with every line once.
#[test]
fn an_owner_killed_between_freezing_and_asking_still_pauses_the_job() {
    let sshd = Sshd::start();
    let (mut rig, _) = ssh_rig_with(&sshd, "");
    let d = tempfile::tempdir().unwrap();
    arm(&mut rig, Some("owner:halted"), true);
    let (key, _pid, log) = paused_from_host(&rig, d.path());
    let marker = rig.runner.env.get("DORMANT_FAILPOINT_ONCE").unwrap();
    assert!(
        Path::new(marker).exists(),
        "owner:halted: once-marker {marker} (the owner was killed there):\n{log}"
    );
    assert_eq!(
        rig.record(&key).unwrap()["paused"]["question"],
        "paused by dormant pause"
    );
    arm(&mut rig, None, false);
    std::fs::write(d.path().join("release"), "").unwrap();
    let r2 = rig.run(&job(91).resume(&key).script("dormant-continue"));
    assert_result(&r2, JobResult::BuildFailure(Some(3)));
    let log2 = r2.log();
    let all: Vec<u64> = numbers(&log).into_iter().chain(numbers(&log2)).collect();
    let want: Vec<u64> = (1..=all.len() as u64).collect();
    assert_eq!(all, want, "every line once:\n{log}\n---\n{log2}");
    crate::reattach::assert_nothing_kept(&sshd);
}

/// A `dormant pause` that reaches the owner after the script ended but
/// before the wrapper recorded its end (`.exit`): `halt`'s first look finds
/// no end, so only its look after the freeze (the script's shell is gone)
/// keeps it from recording a question for a script that no longer runs.
/// The wrapper is held there (`wrapper:ended`, `DORMANT_FAILPOINT_NAP`)
/// while the test sends the pause: the job ends with the script's own code
/// and its last line, `dormant pause` says the stage ended before it could
/// be paused, and nothing is kept. (Without that look the job ended as a
/// successful pause: the exit code lost, issue 37's defect 4b.)
#[test]
fn a_pause_arriving_as_the_script_ends_keeps_its_exit_code() {
    let sshd = Sshd::start();
    let (mut rig, _) = ssh_rig_with(&sshd, "");
    let d = tempfile::tempdir().unwrap();
    arm(&mut rig, Some("wrapper:ended"), true);
    rig.runner
        .env
        .insert("DORMANT_FAILPOINT_NAP".into(), "4".into());
    // Every kept stage passes the point: the once-marker, made here, spares
    // the stages before; the script removes it just before its end, so the
    // point fires (and remakes it) at the end of this script's stage only.
    let marker = std::path::PathBuf::from(rig.runner.env["DORMANT_FAILPOINT_ONCE"].clone());
    std::fs::write(&marker, "").unwrap();
    let j = job(91);
    let job_id = j.id;
    let unarmed = d.path().join("unarmed");
    let sim = j.script(&crate::pause_host::counter(d.path()).replace(
        "echo end;",
        &format!(
            "rm -f '{}'; : > '{}'; echo end;",
            marker.display(),
            unarmed.display()
        ),
    ));
    let (r, paused) = std::thread::scope(|s| {
        let running = s.spawn(|| rig.run(&sim));
        crate::pause_host::wait_for(&d.path().join("started"));
        std::fs::write(d.path().join("release"), "").unwrap();
        // The script ended; its wrapper is held before `.exit`.
        crate::pause_host::wait_for(&unarmed);
        crate::pause_host::wait_for(&marker);
        let paused = pause_cmd(&rig, &[&job_id.to_string()], &[]);
        (running.join().unwrap(), paused)
    });
    let log = r.log();
    assert_result(&r, JobResult::BuildFailure(Some(3)));
    assert!(log.contains("end\n"), "{log}");
    let got = numbers(&log);
    let want: Vec<u64> = (1..=got.len() as u64).collect();
    assert_eq!(got, want, "every line once:\n{log}");
    assert!(!paused.status.success(), "{}", text(&paused));
    assert!(
        text(&paused).contains("ended before it could be paused"),
        "{}",
        text(&paused)
    );
    crate::reattach::assert_nothing_kept(&sshd);
}

/// `dormant run` SIGKILLed after the stage that continued a paused script to
/// its end said `DONE` and the owner confirmed (`run:relayed`): the machine
/// has let the script's files go, and the runner never had the stage's exit
/// code (the job is a system failure, its log has the script's whole
/// output). The code was noted on the runner host before `DONE`
/// (`relayed_end`): the job's cleanup keeps the environment paused with it,
/// and the next job's `dormant-continue` gives the script's own code (7),
/// showing nothing twice; its cleanup then drops the pause. (Before the
/// note, that continue said "nothing is paused": the code was lost.)
#[test]
fn a_run_killed_after_its_continue_ended_leaves_the_exit_code_to_the_next_continue() {
    let sshd = Sshd::start();
    let (mut rig, _) = ssh_rig_with(&sshd, "");
    let d = tempfile::tempdir().unwrap();
    let r = rig.run(&job(95).script(&crate::pause::asking(d.path(), "which?")));
    assert_result(&r, JobResult::Success);
    let key = r.key.clone().unwrap();
    arm(&mut rig, Some("run:relayed"), true);
    let r2 = rig.run(&job(95).resume(&key).script("dormant-continue first"));
    crate::crash::assert_killed_at(&rig, &r2.calls, "run:relayed", 1);
    assert_result(&r2, JobResult::SystemFailure);
    let log2 = r2.log();
    assert!(log2.contains("answer=[first]"), "{log2}");
    arm(&mut rig, None, false);
    let rec = rig
        .record(&key)
        .unwrap_or_else(|| panic!("released:\n{log2}\n{}", r2.cleanup_output()));
    assert_eq!(rec["status"], "suspended", "{rec}");
    assert_eq!(rec["paused"]["ended"], 7, "{rec}");
    assert_eq!(rec["paused"]["question"], "which?", "{rec}");
    let list = text(&rig.dormant(&["list"]));
    assert!(
        list.contains("ended with exit code 7: the next dormant-continue gives it"),
        "{list}"
    );

    let r3 = rig.run(
        &job(95)
            .resume(&key)
            .suspend_on(true, true)
            .script("dormant-continue || echo \"rc=$?\""),
    );
    assert_result(&r3, JobResult::Success);
    let log3 = r3.log();
    assert!(log3.contains("rc=7\n"), "{log3}");
    assert!(!log3.contains("answer="), "nothing shown twice:\n{log3}");
    let rec = rig.record(&key).unwrap();
    assert!(rec["paused"].is_null(), "{rec}");
    crate::reattach::assert_nothing_kept(&sshd);
}

/// `dormant run` SIGKILLed after a round's output, a prompt with no newline,
/// reached the job log and before the question's line (`run:paused-line`):
/// the job log ends with the prompt as the script wrote it. The newline
/// that starts the question's line on a line of its own is dormant's and
/// goes in the same write as that line; written at the round's end, it was
/// left alone in the log, a byte the script never wrote (soak seed
/// 1282249999024437585).
#[test]
fn a_run_killed_before_the_question_line_leaves_the_prompt_as_written() {
    let sshd = Sshd::start();
    let (mut rig, _) = ssh_rig_with(&sshd, "");
    arm(&mut rig, Some("run:paused-line"), true);
    let r = rig.run(&job(96).script("printf 'prompt> '; a=$(dormant-ask 'q?'); echo \"got=[$a]\""));
    crate::crash::assert_killed_at(&rig, &r.calls, "run:paused-line", 1);
    let call = r.call("build_script").unwrap();
    let raw = String::from_utf8_lossy(&call.raw).into_owned();
    assert!(
        raw.contains("prompt> dormant: failpoint run:paused-line: SIGKILL"),
        "the prompt as written, then the failpoint's words:\n{raw:?}"
    );
}

/// `dormant-continue` SIGKILLed mid-frame (`continue:mid-frame`: the
/// frame's header is in the FIFO, the answer is not): `dormant-ask` drops
/// the short frame and waits on, so no partial answer is delivered, the
/// question is not lost, and a retry in a later job delivers its own answer
/// once: the same process, nothing before the ask run again.
#[test]
fn a_continue_killed_mid_frame_delivers_nothing_and_a_retry_answers() {
    let sshd = Sshd::start();
    let (mut rig, _) = ssh_rig_with(&sshd, "");
    let d = tempfile::tempdir().unwrap();
    let r = rig.run(&job(94).script(&crate::pause::asking(d.path(), "which?")));
    assert_result(&r, JobResult::Success);
    let key = r.key.clone().unwrap();
    let pid = crate::pause::pid_in(&d.path().join("pid"));
    arm(&mut rig, Some("continue:mid-frame"), true);
    let r2 = rig.run(
        &job(94)
            .resume(&key)
            .suspend_on(true, true)
            .script("dormant-continue first || echo \"rc=$?\""),
    );
    assert_result(&r2, JobResult::Success);
    let log2 = r2.log();
    assert_script_killed_at(&rig, &log2, "continue:mid-frame");
    assert!(
        log2.contains("rc=137\n") && !log2.contains("answer="),
        "{log2}"
    );
    assert!(alive(pid), "the script still waits for its answer");
    // (The record drops `paused` after a resumed job that ran stages and did
    // not end paused, by design (stages/cleanup.rs `keep_question`); the
    // question stays asked on the machine, as the retry shows.)

    let r3 = rig.run(&job(94).resume(&key).script("dormant-continue second"));
    assert_result(&r3, JobResult::BuildFailure(Some(7)));
    let log3 = r3.log();
    assert!(
        log3.contains("answer=[second] v=") && log3.contains(&format!("pid={pid}")),
        "{log3}"
    );
    assert!(!log3.contains("first"), "{log3}");
    assert_eq!(
        std::fs::read_to_string(d.path().join("runs")).unwrap(),
        "before the ask\n"
    );
    crate::reattach::assert_nothing_kept(&sshd);
}

/// The cleanup of a job whose script asked, SIGKILLed at each step before
/// and during its suspension (the runner never retries a cleanup), then
/// `dormant sweep`: the environment is suspended with the question on its
/// record, never released with the waiting script (the job had no
/// trigger: without the pause a sweep releases it), and a resumed job
/// continues the same process.
#[test]
fn a_paused_jobs_cleanup_killed_at_each_step_keeps_the_script_for_the_sweep() {
    let sshd = Sshd::start();
    let (mut rig, _) = ssh_rig_with(&sshd, crate::crash::GRACE);
    for point in ["cleanup:decided", "suspend:intent", "suspend:stopped"] {
        let d = tempfile::tempdir().unwrap();
        arm(&mut rig, Some(point), true);
        let r = rig.run(&job(86).script(&crate::pause::asking(d.path(), "kept?")));
        crate::crash::assert_killed_at(&rig, &r.calls, point, 1);
        let key = r.key.clone().unwrap();
        let pid = crate::pause::pid_in(&d.path().join("pid"));
        arm(&mut rig, None, false);
        let swept = crate::crash::sweep(&rig);
        assert_eq!(
            rig.status(&key).as_deref(),
            Some("suspended"),
            "{point}: {swept}"
        );
        assert_eq!(
            rig.record(&key).unwrap()["paused"]["question"],
            "kept?",
            "{point}"
        );
        assert!(alive(pid), "{point}: the paused script waits");
        let r2 = rig.run(&job(86).resume(&key).script("dormant-continue yes"));
        assert_result(&r2, JobResult::BuildFailure(Some(7)));
        assert!(
            r2.log().contains("answer=[yes] v=") && r2.log().contains(&format!("pid={pid}")),
            "{point}: {}",
            r2.log()
        );
        assert!(
            rig.status(&key).is_none(),
            "{point}: released after its end"
        );
    }
    crate::reattach::assert_nothing_kept(&sshd);
}
