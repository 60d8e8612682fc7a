//! Signals and a job's script, however the runner was started:
//! - the script starts with every signal at its default, under a runner that
//!   ignores SIGHUP (`nohup`, some CI agents) too, locally and over SSH;
//! - a `dormant run` SIGKILLed on `local` takes the script's whole process
//!   group with it, not only the script's shell.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::harness::*;
use crate::ssh::ssh_rig;
use crate::sshd::Sshd;

/// The SigIgn mask the script's first command started with.
fn sigign(output: &str) -> u64 {
    let line = output
        .lines()
        .find_map(|l| l.strip_prefix("SigIgn:"))
        .unwrap_or_else(|| panic!("no SigIgn line in:\n{output}"));
    u64::from_str_radix(line.trim(), 16).unwrap()
}

fn dispositions(rig: &mut Rig) {
    rig.runner.ignore_sighup = true;
    let r = rig.run(&job(81).script("grep SigIgn /proc/self/status"));
    assert_result(&r, JobResult::Success);
    let build = r.call("build_script").unwrap();
    assert_eq!(
        sigign(&build.output),
        0,
        "the script's commands start with no signal ignored:\n{}",
        build.output
    );
}

#[test]
fn a_local_script_starts_with_default_signals_under_a_runner_that_ignores_sighup() {
    dispositions(&mut Rig::local("81", "s_81aa81aa81aa"));
}

#[test]
fn an_ssh_script_starts_with_default_signals_under_a_runner_that_ignores_sighup() {
    let sshd = Sshd::start();
    let (mut rig, _) = ssh_rig(&sshd);
    dispositions(&mut rig);
}

fn pids(file: &Path) -> Vec<i32> {
    std::fs::read_to_string(file)
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

#[test]
fn a_sigkilled_local_run_leaves_no_member_of_the_scripts_process_group_alive() {
    let rig = Rig::local("82", "s_82aa82aa82aa");
    let dir = tempfile::tempdir().unwrap();
    let (file, ready) = (dir.path().join("pids"), dir.path().join("ready"));
    // Members that never write (their output would fail once dormant is
    // gone), one of them deaf to TERM and HUP.
    let mut j = job(82).script(&format!(
        "sleep 300 >/dev/null 2>&1 & echo $! >> '{f}'\n\
         (trap '' TERM HUP; exec sleep 301) >/dev/null 2>&1 & echo $! >> '{f}'\n\
         echo $BASHPID >> '{f}'\ntouch '{r}'\nwait",
        f = file.display(),
        r = ready.display()
    ));
    // SIGKILL alone, to dormant's own group: no SIGTERM for it to act on.
    j.kill_on_file = Some(("build_script".into(), ready.clone()));
    let r = rig.run(&j);
    assert_eq!(r.call("build_script").unwrap().exit_code, 128 + 9);
    let left = pids(&file);
    assert_eq!(left.len(), 3, "{left:?}");
    let t = Instant::now();
    while left.iter().any(|p| process_running(*p)) {
        if t.elapsed() > Duration::from_secs(10) {
            let alive: Vec<_> = left.iter().filter(|p| process_running(**p)).collect();
            for p in &alive {
                // SAFETY: kill(2) on a process this test's script started.
                unsafe {
                    libc::kill(**p, libc::SIGKILL);
                }
            }
            panic!("members of the script's group outlived dormant: {alive:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
