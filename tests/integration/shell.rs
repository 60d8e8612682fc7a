//! `dormant shell` through a real pseudo-terminal (Python's `pty` drives the
//! built binary as a person at a terminal would): command mode passes the exit
//! code through; an interactive shell runs what is typed in the job's project
//! directory; a job's resume is refused while a shell holds the environment;
//! afterwards it is suspended again; SIGHUP leaves it suspended; `--release`
//! releases; an environment a job holds on `local` is not entered (the job's
//! directory is named; joining beside a job on ssh: join.rs). On `local` and on `ssh`
//! against the test sshd (`ec2` in ec2_shell.rs).

#![allow(dead_code)]

use std::path::Path;
use std::process::{Command, Output};

use crate::harness::*;
use crate::sshd::Sshd;

/// Runs argv in a new pseudo-terminal (its session leader, like a login).
/// `send`: text typed once "opening a shell" appeared; `hangup`: instead close
/// the terminal (the kernel sends SIGHUP). Prints everything the terminal
/// showed, then `EXIT <code>`. Bounded: 60 s, then it kills the child.
const PTY_DRIVER: &str = r#"
import os, pty, select, sys, time, signal
mode, arg, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
pid, fd = pty.fork()
if pid == 0:
    os.execvp(argv[0], argv)
out, sent, deadline = b"", False, time.time() + 60
while time.time() < deadline:
    r, _, _ = select.select([fd], [], [], 0.1)
    if r:
        try:
            data = os.read(fd, 4096)
        except OSError:
            break
        if not data:
            break
        out += data
    if not sent and b"opening a shell" in out:
        sent = True
        if mode == "send":
            os.write(fd, arg.encode())
        elif mode == "hangup":
            time.sleep(float(arg))
            os.close(fd)
            break
        elif mode == "send-hangup":
            os.write(fd, arg.encode())
            os.close(fd)
            break
else:
    os.kill(pid, signal.SIGKILL)
_, status = os.waitpid(pid, 0)
sys.stdout.write(out.decode(errors="replace"))
code = os.waitstatus_to_exitcode(status)
sys.stdout.write("\nEXIT %d\n" % code)
"#;

/// The output of a pty session and dormant's exit code.
pub struct Session {
    pub output: String,
    pub code: i32,
}

pub(crate) fn in_pty(rig: &Rig, mode: &str, arg: &str, args: &[&str]) -> Session {
    let driver = rig.dir.path().join("pty_driver.py");
    std::fs::write(&driver, PTY_DRIVER).unwrap();
    let out = Command::new("python3")
        .arg(&driver)
        .arg(mode)
        .arg(arg)
        .arg(BIN)
        .args(args)
        .env_clear()
        .envs(&rig.runner.env)
        .env("TERM", "dumb")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let code = text
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix("EXIT "))
        .unwrap_or_else(|| panic!("the pty driver failed: {out:?}"))
        .trim()
        .parse()
        .unwrap();
    Session { output: text, code }
}

/// A suspended environment whose job left `marker` in its project directory.
fn suspended(rig: &Rig) -> String {
    let r = rig.run(
        &job(61)
            .suspend_on(true, false)
            .script("echo MARKER-CONTENT-61 > marker"),
    );
    assert_result(&r, JobResult::Success);
    let key = r.key.clone().unwrap();
    assert_eq!(rig.status(&key).as_deref(), Some("suspended"));
    key
}

fn show(o: &Output) -> String {
    format!(
        "exit {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

pub fn command_mode_passes_the_exit_code_and_suspends_again(rig: &Rig) {
    let key = suspended(rig);
    let out = rig.dormant(&["shell", &key, "--", "cat marker; pwd; exit 7"]);
    assert_eq!(out.status.code(), Some(7), "{}", show(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("MARKER-CONTENT-61"), "{}", show(&out));
    assert!(
        stdout.contains("/group/project"),
        "runs in the job's CI_PROJECT_DIR: {}",
        show(&out)
    );
    assert_eq!(
        rig.status(&key).as_deref(),
        Some("suspended"),
        "{}",
        show(&out)
    );
    // Again, now successful: 0.
    let out = rig.dormant(&["shell", &key, "--", "test -e marker"]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
}

pub fn interactive_shell_runs_what_is_typed(rig: &Rig) {
    let key = suspended(rig);
    let s = in_pty(rig, "send", "cat marker; exit\n", &["shell", &key]);
    assert!(s.output.contains("MARKER-CONTENT-61"), "{}", s.output);
    assert_eq!(s.code, 0, "{}", s.output);
    assert_eq!(
        rig.status(&key).as_deref(),
        Some("suspended"),
        "{}",
        s.output
    );
}

pub fn sighup_leaves_it_suspended_even_with_release(rig: &Rig) {
    let key = suspended(rig);
    let s = in_pty(rig, "hangup", "1", &["shell", "--release", &key]);
    assert_ne!(s.code, 0, "{}", s.output);
    assert_eq!(
        rig.status(&key).as_deref(),
        Some("suspended"),
        "a hang-up suspends, never releases: {}",
        s.output
    );
    // And it can be resumed by a job afterwards.
    let r = rig.run(&job(61).resume(&key).script("cat marker"));
    assert_result(&r, JobResult::Success);
}

/// The terminal closes as the shell exits by itself (status 0): the shell
/// may be reaped before dormant's SIGHUP is handled; it is still a hang-up.
pub fn a_hangup_racing_the_exit_still_suspends(rig: &Rig) {
    let key = suspended(rig);
    let s = in_pty(rig, "send-hangup", "exit\n", &["shell", "--release", &key]);
    assert_eq!(
        rig.status(&key).as_deref(),
        Some("suspended"),
        "a hang-up suspends, never releases: {}",
        s.output
    );
}

pub fn release_releases(rig: &Rig) {
    let key = suspended(rig);
    let out = rig.dormant(&["shell", "--release", &key, "--", "true"]);
    assert!(out.status.success(), "{}", show(&out));
    assert_eq!(rig.status(&key), None, "released: {}", show(&out));
}

pub fn a_resume_is_refused_while_the_shell_holds_it(rig: &Rig) {
    let key = suspended(rig);
    let flags = rig.dir.path().join("flags");
    std::fs::create_dir_all(&flags).unwrap();
    let f = flags.display();
    // The command holds the shell open until the test says go (bounded).
    let line = format!(
        "touch {f}/started; i=0; while [ ! -e {f}/go ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done"
    );
    let mut child = Command::new(BIN)
        .args(["shell", &key, "--", &line])
        .env_clear()
        .envs(&rig.runner.env)
        .spawn()
        .unwrap();
    wait_for(&flags.join("started"));
    let r = rig.run(&job(61).resume(&key).script("echo should-not-run"));
    std::fs::write(flags.join("go"), "").unwrap();
    let status = child.wait().unwrap();
    assert!(
        matches!(r.result, JobResult::BuildFailure(_)),
        "refused as the job's input: {:?}\n{}",
        r.result,
        r.log()
    );
    assert!(r.log().contains("in use by a shell"), "{}", r.log());
    assert!(!r.log().contains("should-not-run"));
    assert!(status.success());
    assert_eq!(rig.status(&key).as_deref(), Some("suspended"));
}

fn a_shell_refuses_an_environment_a_job_holds(rig: &Rig) {
    let j = job(62);
    let id = dormant::identity::new_env_id(&rig.runner.runner_id, j.id);
    let out = rig.dir.path().join("shell-during-job");
    let env: String = rig
        .runner
        .env
        .iter()
        .map(|(k, v)| format!("{k}='{v}' "))
        .collect();
    let cmd = format!(
        "env -i {env} {BIN} shell {id} -- 'echo entered' > {o} 2>&1; echo \"rc=$?\" >> {o}",
        o = out.display()
    );
    let r = rig.run_with_command_before(&j.suspend_on(true, false), "build_script", &cmd);
    assert_result(&r, JobResult::Success);
    let said = std::fs::read_to_string(&out).unwrap();
    assert!(!said.contains("entered"), "{said}");
    // A local job has no machine to join beside it: where its directory is.
    assert!(said.contains("runs on this host, in"), "{said}");
    assert!(said.contains("rc=6"), "{said}");
    assert_eq!(
        rig.status(r.key.as_deref().unwrap()).as_deref(),
        Some("suspended")
    );
}

fn wait_for(path: &Path) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !path.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "{} never appeared",
            path.display()
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

fn ssh_rig(sshd: &Sshd, runner: &str) -> Rig {
    crate::attach::ssh_rig(sshd, runner, "s_66aa66aa66aa")
}

#[test]
fn local_command_mode() {
    command_mode_passes_the_exit_code_and_suspends_again(&Rig::local("60", "s_60aa60aa60aa"));
}

#[test]
fn local_interactive() {
    interactive_shell_runs_what_is_typed(&Rig::local("60", "s_60aa60aa60aa"));
}

#[test]
fn local_sighup() {
    sighup_leaves_it_suspended_even_with_release(&Rig::local("60", "s_60aa60aa60aa"));
}

#[test]
fn local_hangup_racing_the_exit() {
    a_hangup_racing_the_exit_still_suspends(&Rig::local("60", "s_60aa60aa60aa"));
}

#[test]
fn local_release() {
    release_releases(&Rig::local("60", "s_60aa60aa60aa"));
}

#[test]
fn local_resume_refused_while_in_a_shell() {
    a_resume_is_refused_while_the_shell_holds_it(&Rig::local("60", "s_60aa60aa60aa"));
}

#[test]
fn local_refuses_what_a_job_holds() {
    a_shell_refuses_an_environment_a_job_holds(&Rig::local("60", "s_60aa60aa60aa"));
}

#[test]
fn ssh_command_mode() {
    let sshd = Sshd::start();
    command_mode_passes_the_exit_code_and_suspends_again(&ssh_rig(&sshd, "66"));
}

#[test]
fn ssh_interactive() {
    let sshd = Sshd::start();
    interactive_shell_runs_what_is_typed(&ssh_rig(&sshd, "66"));
}

#[test]
fn ssh_sighup() {
    let sshd = Sshd::start();
    sighup_leaves_it_suspended_even_with_release(&ssh_rig(&sshd, "66"));
}

#[test]
fn ssh_resume_refused_while_in_a_shell() {
    let sshd = Sshd::start();
    a_resume_is_refused_while_the_shell_holds_it(&ssh_rig(&sshd, "66"));
}

#[test]
fn ssh_release() {
    let sshd = Sshd::start();
    release_releases(&ssh_rig(&sshd, "66"));
}
