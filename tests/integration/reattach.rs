//! Re-attaching to a stage whose SSH connection was lost (the `ssh` provider
//! against the test sshd). A connection that comes back within
//! `ssh.reconnect_timeout` does not end the stage: its script keeps running on
//! the machine and `dormant run` re-attaches, with every line of output once and
//! the script's exit code — after one cut, three cuts, and a cut between the
//! script's end and dormant reading it. One that does not come back in time
//! is a system failure naming the lost connection; a cancel while
//! disconnected ends `run` promptly; in both, cleanup stops the script left
//! on the host, and a script cleanup could not reach is stopped by the
//! resuming job's prepare before its first stage. Connections are cut by
//! SIGKILLing the test sshd's own per-connection processes, frozen with
//! SIGSTOP, or the whole test sshd is stopped (the machine gone); never
//! another sshd on this machine. The helpers at the top serve `ec2_job.rs`
//! and `qemu_reattach.rs` too.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::harness::*;
use crate::ssh::ssh_rig_with;
use crate::sshd::{alive, Sshd};

/// A stage printing `line 1` .. `line n` every 100 ms, its line count in
/// `marker` as it goes, then (after `gate` exists, if given) one unfinished
/// line, and `exit 3`.
pub fn counting(n: u32, marker: &Path, gate: Option<&Path>) -> String {
    let wait = gate.map_or(String::new(), |g| {
        format!("while [ ! -e '{}' ]; do sleep 0.05; done; ", g.display())
    });
    format!(
        "for i in $(seq 1 {n}); do echo \"line $i\"; echo $i > '{m}.tmp'; mv '{m}.tmp' '{m}'; sleep 0.1; done; \
         {wait}printf 'the end, unfinished'; exit 3",
        m = marker.display()
    )
}

/// What the marker says (0 before the first line).
pub fn count(marker: &Path) -> u32 {
    std::fs::read_to_string(marker)
        .ok()
        .and_then(|t| t.trim().parse().ok())
        .unwrap_or(0)
}

/// Polls until the script has printed `n` lines (a hang detector: 60 s).
#[track_caller]
pub fn wait_lines(marker: &Path, n: u32) {
    let t = Instant::now();
    while count(marker) < n {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the script never printed {n} lines"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Asserts the stage's output has `line 1` .. `line n` each exactly once, in
/// order, then the unfinished last line whole, and dormant's line about the
/// lost connection `cuts` times, each on a line of its own.
#[track_caller]
pub fn assert_every_line_once(output: &str, n: u32, cuts: usize) {
    let lines: Vec<&str> = output.lines().filter(|l| l.starts_with("line ")).collect();
    let want: Vec<String> = (1..=n).map(|i| format!("line {i}")).collect();
    assert_eq!(lines, want, "every line once, in order:\n{output}");
    let notes: Vec<&str> = output
        .lines()
        .filter(|l| l.contains("was gone for"))
        .collect();
    assert_eq!(notes.len(), cuts, "one line per lost connection:\n{output}");
    for note in notes {
        assert!(
            note.starts_with("dormant: the SSH connection to ")
                && note.contains("@127.0.0.1:")
                && note.contains("during build_script; re-attached"),
            "{note}"
        );
    }
    assert!(
        output.lines().any(|l| l == "the end, unfinished"),
        "the unfinished last line, whole:\n{output}"
    );
}

/// Waits (a hang detector, 10 s) until nothing of any stage is kept on the
/// host: each stage's files go once dormant has read its end, within
/// milliseconds; a lost ACK would leave them for minutes.
#[track_caller]
pub fn assert_nothing_kept(sshd: &Sshd) {
    let t = Instant::now();
    while !sshd.kept_files().is_empty() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "kept on the host after the job: {:?}",
            sshd.kept_files()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn dir() -> (tempfile::TempDir, PathBuf) {
    let d = tempfile::tempdir().unwrap();
    let marker = d.path().join("lines");
    (d, marker)
}

/// The owner line of the counting stage kept on the host (`<owner pid>
/// <follower pid>`; the follower is `-` while a re-attach takes over), once
/// there is one (a hang detector: 60 s). The stage is the one whose output
/// starts with `line 1` (an earlier stage's files may not be gone yet).
#[track_caller]
fn kept_owner(sshd: &Sshd) -> String {
    let t = Instant::now();
    let dir = sshd.kept_dir();
    loop {
        // The job's own stage, by its name: what the job log has of its
        // output is punched out of the file (its start is zeros then).
        let own = sshd.kept_files().into_iter().find_map(|n| {
            let stage = n.strip_suffix(".out")?;
            stage
                .contains(".build_script.")
                .then(|| format!("{stage}.own"))
        });
        if let Some(line) = own
            .and_then(|n| std::fs::read_to_string(dir.join(n)).ok())
            .map(|t| t.trim().to_string())
            .filter(|l| l.split_whitespace().count() == 2 && !l.ends_with(" -"))
        {
            return line;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "no owner of the stage on the host: {:?}",
            sshd.kept_files()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits (a hang detector: 60 s) until dormant has re-attached after a cut:
/// the stage has a new owner, with its follower started. (Cuts that come
/// while dormant is still reconnecting are one lost connection, and the job
/// log rightly says so once: on a loaded machine the next cut came before
/// the re-attach when cuts were timed by the script's lines alone.)
#[track_caller]
fn wait_reattached(sshd: &Sshd, cut_owner: &str) {
    let t = Instant::now();
    while kept_owner(sshd) == cut_owner {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "dormant never re-attached after the cut (owner {cut_owner})"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Makes the gate file when dropped.
struct OpenGate<'a>(&'a Path);

impl Drop for OpenGate<'_> {
    fn drop(&mut self) {
        let _ = std::fs::write(self.0, "");
    }
}

fn cut_mid_stage(cuts: usize) {
    let sshd = Sshd::start();
    let (rig, _) = ssh_rig_with(&sshd, "");
    let (d, marker) = dir();
    // The stage ends only once the gate exists, after the last re-attach:
    // every cut comes mid-stage, however slow the machine.
    let gate = d.path().join("gate");
    let j = job(71).script(&counting(40, &marker, Some(&gate)));
    let before = sshd.connections();
    let r = std::thread::scope(|s| {
        let run = s.spawn(|| rig.run(&j));
        // A failed wait below still lets the script end (the scope waits for
        // the job before the failure is told): the gate opens as it unwinds.
        let _opens = OpenGate(&gate);
        for k in 0..cuts {
            wait_lines(&marker, 8 + 8 * k as u32);
            let owner = kept_owner(&sshd);
            assert!(sshd.cut_connections() > 0, "a connection to cut");
            wait_reattached(&sshd, &owner);
        }
        std::fs::write(&gate, "").unwrap();
        run.join().unwrap()
    });
    assert_result(&r, JobResult::BuildFailure(Some(3)));
    let build = r.call("build_script").unwrap();
    assert_every_line_once(&build.output, 40, cuts);
    assert!(
        sshd.connections() - before > cuts,
        "a new connection after each cut (sshd log):\n{}",
        sshd.log()
    );
    assert_nothing_kept(&sshd);
}

#[test]
fn a_stage_survives_a_cut_connection_with_every_line_once_and_its_exit_code() {
    cut_mid_stage(1);
}

#[test]
fn a_stage_survives_three_cut_connections() {
    cut_mid_stage(3);
}

/// The cut comes between the script's end and dormant reading it: the
/// connection is frozen before the script's last line, the script ends, and
/// only then is the connection killed. The end comes from the machine.
#[test]
fn a_cut_between_the_scripts_end_and_dormant_reading_it_loses_nothing() {
    let sshd = Sshd::start();
    let (rig, _) = ssh_rig_with(&sshd, "");
    let (d, marker) = dir();
    let gate = d.path().join("gate");
    let j = job(72).script(&counting(10, &marker, Some(&gate)));
    let r = std::thread::scope(|s| {
        let run = s.spawn(|| rig.run(&j));
        wait_lines(&marker, 10);
        let frozen = sshd.freeze_connections();
        assert!(!frozen.is_empty());
        std::fs::write(&gate, "").unwrap();
        // The script's end is recorded on the machine, not yet read by dormant.
        let t = Instant::now();
        while !sshd.kept_files().iter().any(|f| f.ends_with(".exit")) {
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "{:?}",
                sshd.kept_files()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        sshd.kill(&frozen);
        run.join().unwrap()
    });
    assert_result(&r, JobResult::BuildFailure(Some(3)));
    assert_every_line_once(&r.call("build_script").unwrap().output, 10, 1);
    assert_nothing_kept(&sshd);
}

/// The script's pid and its background child's, as it wrote them.
fn script_pids(file: &Path) -> Vec<u32> {
    std::fs::read_to_string(file)
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// A script that records its pids, then prints a line every 100 ms for five
/// minutes: far longer than any of these tests takes on a loaded machine, so
/// only dormant stops it (one that ended by itself would pass for stopped).
fn long_script(pids: &Path, marker: &Path) -> String {
    format!(
        "sleep 600 & echo \"$BASHPID $!\" > '{}'; {}",
        pids.display(),
        counting(3000, marker, None)
    )
}

#[test]
fn a_machine_that_does_not_come_back_in_time_is_a_system_failure_naming_the_lost_connection() {
    let sshd = Mutex::new(Sshd::start());
    let (rig, _) = ssh_rig_with(&sshd.lock().unwrap(), "reconnect_timeout = \"3s\"");
    let (d, marker) = dir();
    let pids = d.path().join("pids");
    let j = job(73).script(&long_script(&pids, &marker));
    let (r, stopped) = std::thread::scope(|s| {
        let run = s.spawn(|| {
            rig.runner
                .run_job_with(&j, &mut |stage| {
                    if stage == "cleanup" {
                        // The host comes back in time for cleanup.
                        sshd.lock().unwrap().restart();
                    }
                })
                .unwrap()
        });
        wait_lines(&marker, 5);
        sshd.lock().unwrap().stop();
        let stopped = Instant::now();
        (run.join().unwrap(), stopped)
    });
    assert_result(&r, JobResult::SystemFailure);
    let build = r.call("build_script").unwrap();
    assert_eq!(build.exit_code, 2, "{}", build.output);
    assert!(
        build.output.contains(
            "the SSH connection to root@127.0.0.1:"
        ) && build.output.contains(
            "was lost during build_script and did not come back within ssh.reconnect_timeout = 3s (dormant tried to reconnect for"
        ),
        "{}",
        build.output
    );
    assert!(
        stopped.elapsed() < Duration::from_secs(60),
        "bounded by the timeout, not the script's five minutes: {:?}",
        stopped.elapsed()
    );
    // Cleanup stopped the script the lost connection left on the host.
    let left = script_pids(&pids);
    assert_eq!(left.len(), 2);
    for pid in left {
        assert!(!alive(pid), "{pid} outlived the job's cleanup");
    }
    assert_nothing_kept(&sshd.lock().unwrap());
    assert!(
        !r.cleanup_output().contains("could not be stopped"),
        "{}",
        r.cleanup_output()
    );
}

#[test]
fn a_cancel_while_disconnected_ends_run_promptly_and_cleanup_stops_the_script() {
    let sshd = Mutex::new(Sshd::start());
    let (rig, _) = ssh_rig_with(&sshd.lock().unwrap(), "reconnect_timeout = \"10m\"");
    let (d, marker) = dir();
    let pids = d.path().join("pids");
    let cancel = d.path().join("cancel");
    let mut j = job(74).script(&long_script(&pids, &marker));
    j.cancel_on_file = Some(("build_script".into(), cancel.clone()));
    let r = std::thread::scope(|s| {
        let run = s.spawn(|| {
            rig.runner
                .run_job_with(&j, &mut |stage| {
                    if stage == "cleanup" {
                        sshd.lock().unwrap().restart();
                    }
                })
                .unwrap()
        });
        wait_lines(&marker, 5);
        sshd.lock().unwrap().stop();
        // dormant is reconnecting now (sequencing only: a cancel that came
        // before it noticed would take the session's own path, as promptly).
        std::thread::sleep(Duration::from_millis(500));
        std::fs::write(&cancel, "").unwrap();
        run.join().unwrap()
    });
    assert_result(&r, JobResult::Canceled);
    let build = r.call("build_script").unwrap();
    assert!(
        build
            .output
            .contains("termination while the SSH connection to root@127.0.0.1:")
            && build.output.contains("the job's cleanup stops it"),
        "{}",
        build.output
    );
    assert!(
        build.elapsed < Duration::from_secs(40),
        "run ended promptly, not after the script's minute or the 10 min timeout: {:?}",
        build.elapsed
    );
    let left = script_pids(&pids);
    assert_eq!(left.len(), 2);
    for pid in left {
        assert!(!alive(pid), "{pid} outlived the job's cleanup");
    }
    assert_nothing_kept(&sshd.lock().unwrap());
}

#[test]
fn a_stage_cleanup_could_not_stop_is_stopped_by_the_resumes_prepare_before_any_stage() {
    // The machine went away mid-stage and stayed away through cleanup: the
    // job failed (system failure), its environment was suspended (the
    // failure trigger) with the script still running on the host, which
    // cleanup could not reach — as with a hibernated machine, whose memory
    // keeps it. The resume's prepare stops it before the next job's first
    // stage. Keepalives every 60 s make the host keep the stage for minutes
    // (reconnect_timeout + 3 x server_alive_interval + 60 s): nothing else
    // would stop it in the time this test takes.
    let sshd = Mutex::new(Sshd::start());
    let (rig, _) = ssh_rig_with(
        &sshd.lock().unwrap(),
        "reconnect_timeout = \"3s\"\nserver_alive_interval = \"60s\"",
    );
    let (d, marker) = dir();
    let pids = d.path().join("pids");
    let first = job(75)
        .suspend_on(false, true)
        .script(&long_script(&pids, &marker));
    let r = std::thread::scope(|s| {
        let run = s.spawn(|| rig.run(&first));
        wait_lines(&marker, 5);
        sshd.lock().unwrap().stop();
        run.join().unwrap()
    });
    assert_result(&r, JobResult::SystemFailure);
    assert!(
        r.cleanup_output()
            .contains("what the job's stages left running could not be stopped"),
        "{}",
        r.cleanup_output()
    );
    let key = r.key.clone().expect("suspended on failure: a key");
    assert_eq!(rig.status(&key).as_deref(), Some("suspended"));
    let left = script_pids(&pids);
    assert_eq!(left.len(), 2);
    assert!(
        left.iter().all(|p| alive(*p)),
        "the script runs on on the host, unreachable for cleanup"
    );

    sshd.lock().unwrap().restart();
    let mut stopped_first = None;
    let second = job(75).resume(&key).script("echo resumed");
    let r2 = rig
        .runner
        .run_job_with(&second, &mut |stage| {
            // The first stage after prepare: what runs of the job before?
            if stopped_first.is_none() && stage != "prepare" {
                stopped_first = Some(left.iter().filter(|p| alive(**p)).count());
            }
        })
        .unwrap();
    assert_result(&r2, JobResult::Success);
    assert_eq!(
        stopped_first,
        Some(0),
        "the suspended job's script was still running when the next job's stages began"
    );
    assert_nothing_kept(&sshd.lock().unwrap());
}
