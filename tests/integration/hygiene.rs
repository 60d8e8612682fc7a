//! What a stage leaves behind, on the `local` provider and over SSH:
//! - no stage script (it exports the job token) lands on disk — not in the
//!   state dir, not in the host's temp dir — while it runs or after dormant is
//!   SIGKILLed mid-stage; every state file is 0600 and every dir 0700;
//! - over SSH, the stage's output kept on the host for a re-attach is in a
//!   0700 directory, its files 0600, and nothing of it remains once dormant
//!   has read the stage's end — nor after a SIGKILLed stage's cleanup;
//! - nothing dormant starts holds the runner's output pipe once dormant is
//!   gone: a script that starts an escaped background process (`setsid cmd &`
//!   keeping the job's output open) is cancelled, and the runner's pipe still
//!   reaches end of file (bounded waits: hang detectors, not speed checks).

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::harness::*;
use crate::ssh::ssh_rig;
use crate::sshd::Sshd;
use dormant::runner_sim::SimJob;

/// How long a cancelled job may take, from its script's start to the end of
/// cleanup, before the test calls it hung (the cancel comes 2 s in).
const HANG: Duration = Duration::from_secs(30);

/// The two places a stage runs: this host, and the test sshd on loopback.
enum Where {
    Local(Rig),
    Ssh(Sshd, Rig),
}

impl Where {
    fn local() -> Where {
        Where::Local(Rig::local("61", "s_61aa61aa61aa"))
    }

    fn ssh() -> Where {
        let sshd = Sshd::start();
        let (rig, _) = ssh_rig(&sshd);
        Where::Ssh(sshd, rig)
    }

    fn rig(&self) -> &Rig {
        match self {
            Where::Local(rig) | Where::Ssh(_, rig) => rig,
        }
    }

    /// The state dir, and for SSH the host's temp dir.
    fn scan(&self, needles: &[&str]) -> Vec<String> {
        let mut found = Vec::new();
        scan(&self.rig().state_dir, needles, true, &mut found);
        if let Where::Ssh(sshd, _) = self {
            scan(&sshd.tmp_dir(), needles, false, &mut found);
            // The kept output: private, like the state dir.
            let kept = sshd.kept_dir();
            if let Ok(meta) = std::fs::metadata(&kept) {
                let mode = meta.permissions().mode() & 0o777;
                if mode != 0o700 {
                    found.push(format!("{} is a dir with mode {mode:o}", kept.display()));
                }
                scan(&kept, &[], true, &mut found);
            }
        }
        found
    }

    /// Over SSH: nothing of any stage is kept on the host any more.
    fn assert_nothing_kept(&self) {
        if let Where::Ssh(sshd, _) = self {
            crate::reattach::assert_nothing_kept(sshd);
        }
    }
}

/// Walks `root`: files holding any of `needles`, and (with `modes`) files
/// not 0600 (the pause tools: not 0700) or dirs not 0700 — except inside an
/// environment's `work` dir, the job's own tree.
fn scan(root: &Path, needles: &[&str], modes: bool, found: &mut Vec<String>) {
    let Ok(entries) = std::fs::read_dir(root) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        let mode = meta.permissions().mode() & 0o777;
        if meta.is_dir() {
            if modes && mode != 0o700 {
                found.push(format!("{} is a dir with mode {mode:o}", path.display()));
            }
            let job_tree = path.file_name().is_some_and(|n| n == "work");
            scan(&path, needles, modes && !job_tree, found);
            continue;
        }
        // dormant-ask and dormant-continue (docs/pause.md) are programs:
        // 0700, the user's own like everything here.
        let tool = root
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("bin-"));
        let private = if meta.file_type().is_socket() {
            mode & 0o077 == 0
        } else if tool {
            mode == 0o700
        } else {
            mode == 0o600
        };
        if modes && !private {
            found.push(format!("{} has mode {mode:o}", path.display()));
        }
        if meta.is_file() {
            let bytes = std::fs::read(&path).unwrap_or_default();
            for needle in needles {
                if bytes.windows(needle.len()).any(|w| w == needle.as_bytes()) {
                    found.push(format!("{} holds {needle:?}", path.display()));
                }
            }
        }
    }
}

/// A script that marks `ready`, then waits (at most a minute) for `gate`.
fn waiting_script(probe: &str, ready: &Path, gate: &Path, before: &str) -> String {
    format!(
        ": {probe}\n{before}\ntouch '{}'\nfor i in $(seq 600); do [ -e '{}' ] && break; sleep 0.1; done\necho finished",
        ready.display(),
        gate.display()
    )
}

#[track_caller]
fn wait_until(what: &str, limit: Duration, done: impl Fn() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < limit, "waited {limit:?} for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs `job` on `place` in a thread; `during` runs once `ready` exists.
/// The job must end within [`HANG`] of that; then `gate` is opened in any
/// case (if `during` did not), so nothing the test started outlives it for long.
fn run_guarded(
    place: &Where,
    job: &SimJob,
    ready: &Path,
    gate: &Path,
    during: impl FnOnce(),
) -> JobReport {
    run_guarded_with(place, job, None, ready, gate, during)
}

/// [`run_guarded`], running the shell command `before.1` just before the
/// runner calls stage `before.0`.
fn run_guarded_with(
    place: &Where,
    job: &SimJob,
    before: Option<(&str, &str)>,
    ready: &Path,
    gate: &Path,
    during: impl FnOnce(),
) -> JobReport {
    std::thread::scope(|s| {
        let (tx, rx) = mpsc::channel();
        s.spawn(move || {
            let rig = place.rig();
            let _ = tx.send(match before {
                Some((stage, cmd)) => rig.run_with_command_before(job, stage, cmd),
                None => rig.run(job),
            });
        });
        let started = Instant::now();
        let outcome = (|| {
            while !ready.exists() {
                if started.elapsed() > Duration::from_secs(60) {
                    return Err("the script never started".to_string());
                }
                if let Ok(r) = rx.try_recv() {
                    return Ok(r);
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            during();
            rx.recv_timeout(HANG).map_err(|_| {
                format!(
                    "the job had not ended {HANG:?} after its script started: the runner's \
                     output pipe is still held open (or a stage hangs)"
                )
            })
        })();
        std::fs::write(gate, "").unwrap();
        outcome.unwrap_or_else(|e| panic!("{e}"))
    })
}

fn probe() -> String {
    format!("dormant-probe-{}", job_id())
}

fn running_stage_leaves_nothing_at_rest(place: Where) {
    let dir = tempfile::tempdir().unwrap();
    let (ready, gate) = (dir.path().join("ready"), dir.path().join("gate"));
    let probe = probe();
    let j = job(61)
        .suspend_on(true, false)
        .script(&waiting_script(&probe, &ready, &gate, ""));
    let mut found = Vec::new();
    let mut kept_while_running = 0;
    let r = run_guarded(&place, &j, &ready, &gate, || {
        found = place.scan(&[place.rig().secret_token(), &probe]);
        if let Where::Ssh(sshd, _) = &place {
            kept_while_running = sshd.kept_files().len();
        }
        std::fs::write(&gate, "").unwrap();
    });
    assert_result(&r, JobResult::Success);
    assert!(r.log().contains("finished"), "{}", r.log());
    assert!(
        found.is_empty(),
        "while the stage ran:\n{}",
        found.join("\n")
    );
    if matches!(place, Where::Ssh(..)) {
        assert!(
            kept_while_running > 0,
            "the running stage keeps its output on the host"
        );
    }
    // And after the job, with the environment suspended.
    let after = place.scan(&[place.rig().secret_token(), &probe]);
    assert!(after.is_empty(), "after the job:\n{}", after.join("\n"));
    place.assert_nothing_kept();
}

#[test]
fn a_running_local_stage_keeps_its_script_and_secrets_off_disk_and_state_private() {
    running_stage_leaves_nothing_at_rest(Where::local());
}

#[test]
fn a_running_ssh_stage_keeps_its_script_and_secrets_off_disk_and_state_private() {
    running_stage_leaves_nothing_at_rest(Where::ssh());
}

fn killed_stage_leaves_no_script(place: Where) {
    let dir = tempfile::tempdir().unwrap();
    let (ready, gate) = (dir.path().join("ready"), dir.path().join("gate"));
    let probe = probe();
    let found_file = dir.path().join("found");
    let mut j = job(62)
        .suspend_on(true, true)
        .script(&waiting_script(&probe, &ready, &gate, ""));
    j.after_script = Some("echo after".into());
    j.cancel = Some(("build_script".into(), Duration::from_secs(2)));
    // SIGKILL right behind the SIGTERM: dormant gets no chance to tidy up.
    j.force_kill = Some(Duration::ZERO);
    // Right after the killed stage, before the runner's next call.
    let mut roots = vec![place.rig().state_dir.clone()];
    if let Where::Ssh(sshd, _) = &place {
        roots.push(sshd.tmp_dir());
    }
    let scan = format!(
        "grep -rlF -e '{}' -e '{probe}' {} > '{}' 2>&1; true",
        place.rig().secret_token(),
        roots
            .iter()
            .map(|r| format!("'{}'", r.display()))
            .collect::<Vec<_>>()
            .join(" "),
        found_file.display()
    );
    let r = run_guarded_with(
        &place,
        &j,
        Some(("after_script", &scan)),
        &ready,
        &gate,
        || {},
    );
    assert_result(&r, JobResult::Canceled);
    let build = r.call("build_script").unwrap();
    assert_eq!(build.exit_code, 128 + 9, "{}", build.output);
    assert!(r.ran("after_script"));
    let found = std::fs::read_to_string(&found_file).unwrap();
    assert!(
        found.trim().is_empty(),
        "after dormant was SIGKILLed mid-stage:\n{found}"
    );
    let after = place.scan(&[place.rig().secret_token(), &probe]);
    assert!(after.is_empty(), "after cleanup:\n{}", after.join("\n"));
    // The SIGKILLed stage's script ran on (its connection looked lost); the
    // job's cleanup stopped it and removed what was kept of it.
    place.assert_nothing_kept();
}

#[test]
fn a_sigkilled_local_stage_leaves_no_script_behind() {
    killed_stage_leaves_no_script(Where::local());
}

#[test]
fn a_sigkilled_ssh_stage_leaves_no_script_behind() {
    killed_stage_leaves_no_script(Where::ssh());
}

/// A cancelled script whose escaped background process keeps the job's
/// output open; `force_kill`: SIGKILL that long after the SIGTERM.
///
/// The job must end although that process lives on: dormant ends the
/// script's process group, and a process that left it (`setsid`) is out of
/// its reach (docs/guide/keys.md: SIGTERM kills the script's process group; docs/ssh.md,
/// "Limits"). So the test proves the escape was real: the process wrote its
/// pid, and it still ran, its output still open, when the job had ended.
/// Without that the test would pass just as well with no process holding
/// anything.
fn escaped_process_does_not_hold_the_runners_pipe(place: Where, force_kill: Option<Duration>) {
    let dir = tempfile::tempdir().unwrap();
    let (ready, gate) = (dir.path().join("ready"), dir.path().join("gate"));
    let pidfile: PathBuf = dir.path().join("escaped.pid");
    let escape = format!(
        "setsid sh -c 'echo $$ > \"{}\"; exec sleep 1000' &",
        pidfile.display()
    );
    let mut j = job(63).script(&waiting_script(&probe(), &ready, &gate, &escape));
    j.cancel = Some(("build_script".into(), Duration::from_secs(2)));
    j.force_kill = force_kill;
    let r = run_guarded(&place, &j, &ready, &gate, || {});
    let pid = std::fs::read_to_string(&pidfile)
        .ok()
        .and_then(|p| p.trim().parse::<i32>().ok());
    let output = pid.map(|pid| std::fs::read_link(format!("/proc/{pid}/fd/1")));
    let running = pid.is_some_and(process_running);
    // The test's own tidy-up: the escaped process is the script's doing.
    if let Some(pid) = pid {
        // SAFETY: kill(2) on the escaped process this test's script started.
        unsafe {
            libc::kill(pid, libc::SIGKILL);
        }
    }
    let pid = pid.unwrap_or_else(|| {
        panic!(
            "the escaped process never wrote its pid to {}: nothing escaped\n{}",
            pidfile.display(),
            r.log()
        )
    });
    assert!(
        running,
        "the escaped process {pid} was gone when the job ended: nothing held the \
         job's output open\n{}",
        r.log()
    );
    let output = output
        .unwrap()
        .unwrap_or_else(|e| panic!("its stdout: {e}"));
    assert_ne!(
        output,
        PathBuf::from("/dev/null"),
        "the escaped process {pid} did not hold the job's output"
    );
    assert_result(&r, JobResult::Canceled);
    let build = r.call("build_script").unwrap();
    assert!(!build.output.contains("finished"), "{}", build.output);
    if force_kill.is_none() {
        // dormant ended the stage itself, not the runner's SIGKILL.
        assert_eq!(build.exit_code, 2, "{}", build.output);
        assert!(
            build.elapsed < Duration::from_secs(15),
            "run outlived SIGTERM: {:?}\n{}",
            build.elapsed,
            build.output
        );
    }
    wait_until(
        "the escaped process to be gone",
        Duration::from_secs(10),
        || !process_running(pid),
    );
}

#[test]
fn an_escaped_process_does_not_hold_the_runners_pipe_after_sigterm_locally() {
    escaped_process_does_not_hold_the_runners_pipe(Where::local(), None);
}

#[test]
fn an_escaped_process_does_not_hold_the_runners_pipe_after_sigkill_locally() {
    escaped_process_does_not_hold_the_runners_pipe(Where::local(), Some(Duration::ZERO));
}

#[test]
fn an_escaped_process_does_not_hold_the_runners_pipe_after_sigterm_over_ssh() {
    escaped_process_does_not_hold_the_runners_pipe(Where::ssh(), None);
}

#[test]
fn an_escaped_process_does_not_hold_the_runners_pipe_after_sigkill_over_ssh() {
    escaped_process_does_not_hold_the_runners_pipe(Where::ssh(), Some(Duration::from_millis(100)));
}
