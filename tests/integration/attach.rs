//! `dormant attach`: watchers of a running job, on `local` and on `ssh`
//! against the test sshd. Every byte of a stage reaches each watcher in
//! order, the job's own log is byte for byte what its script printed, two
//! watchers at once, a watcher killed with SIGKILL, one detached by Ctrl-C
//! (SIGINT to its process group, ignored on entry; and one whose SIGINT came
//! before dormant listened) and (ssh) every connection cut under the
//! watchers change nothing for the job, and no watcher opens a connection to
//! the machine. A suspended environment shows its last stage
//! and exits 5; bad input has its own exit codes.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::harness::*;
use crate::sshd::Sshd;

/// What the build stage prints once the test says `go`: 1,000 numbered lines
/// and a line written in two pieces a moment apart.
fn build_output() -> String {
    let mut s = String::new();
    for i in 0..1000 {
        s.push_str(&format!(
            "line {i} of the build, some text to make it longer\n"
        ));
    }
    s.push_str("partial line\n");
    s.push_str("build done\n");
    s
}

fn build_script(flags: &Path) -> String {
    let f = flags.display();
    format!(
        "touch {f}/started; i=0; while [ ! -e {f}/go ] && [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done\n\
         i=0; while [ $i -lt 1000 ]; do echo \"line $i of the build, some text to make it longer\"; i=$((i+1)); done\n\
         printf 'partial'; sleep 0.3; printf ' line\\n'\n\
         touch {f}/half; i=0; while [ ! -e {f}/go2 ] && [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done\n\
         echo 'build done'\n"
    )
}

const AFTER: &str = "echo after-script-ran\n";

/// Waits (bounded) for `path` to appear.
pub(crate) fn wait_for(path: &Path) {
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

/// What a watcher's signals are when dormant starts.
#[derive(Clone, Copy)]
enum Signals {
    /// The test's own.
    Inherited,
    /// Alone in its process group (Ctrl-C in a terminal signals the whole
    /// foreground group), with SIGINT ignored on entry.
    TerminalGroupIgnoring,
    /// A SIGINT already pending (blocked) when dormant starts: a Ctrl-C that
    /// came before dormant listens for it.
    PendingAtStart,
}

/// A watcher: `dormant attach` with its stdout and stderr in files.
struct Watcher {
    child: Child,
    out: PathBuf,
    err: PathBuf,
}

impl Watcher {
    fn start(rig: &Rig, target: &str, extra: &[&str], name: &str) -> Watcher {
        Watcher::start_as(rig, target, extra, name, Signals::Inherited)
    }

    fn start_as(rig: &Rig, target: &str, extra: &[&str], name: &str, how: Signals) -> Watcher {
        let out = rig.dir.path().join(format!("{name}.out"));
        let err = rig.dir.path().join(format!("{name}.err"));
        let mut cmd = Command::new(BIN);
        cmd.arg("attach")
            .arg(target)
            .args(extra)
            .env_clear()
            .envs(&rig.runner.env)
            .stdout(std::fs::File::create(&out).unwrap())
            .stderr(std::fs::File::create(&err).unwrap())
            .stdin(Stdio::null());
        match how {
            Signals::Inherited => {}
            Signals::TerminalGroupIgnoring => {
                // Its own process group, as a shell puts a command it runs
                // in a terminal; SIGINT ignored on entry, as a background
                // `&` of a non-interactive shell (or a test suite run that
                // way) passes it on.
                cmd.process_group(0);
                // SAFETY: signal(2) is async-signal-safe.
                unsafe {
                    cmd.pre_exec(|| {
                        libc::signal(libc::SIGINT, libc::SIG_IGN);
                        Ok(())
                    });
                }
            }
            Signals::PendingAtStart => {
                // SAFETY: sigprocmask and raise are async-signal-safe; the
                // set is ours. A blocked signal stays pending across exec.
                unsafe {
                    cmd.pre_exec(|| {
                        let mut set: libc::sigset_t = std::mem::zeroed();
                        libc::sigemptyset(&mut set);
                        libc::sigaddset(&mut set, libc::SIGINT);
                        libc::sigprocmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
                        libc::raise(libc::SIGINT);
                        Ok(())
                    });
                }
            }
        }
        let child = cmd.spawn().unwrap();
        Watcher { child, out, err }
    }

    /// Waits (bounded) until it follows the build stage: a watcher says so
    /// on stderr as it starts following it.
    fn wait_following(&self) {
        self.wait_until("followed the stage", |_, err| {
            err.contains("build_script of job")
        });
    }

    /// Waits (bounded) until `done(stdout, stderr)`.
    fn wait_until(&self, what: &str, done: impl Fn(&str, &str) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let out = std::fs::read_to_string(&self.out).unwrap();
            let err = std::fs::read_to_string(&self.err).unwrap();
            if done(&out, &err) {
                return;
            }
            assert!(Instant::now() < deadline, "the watcher never {what}: {err}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits (bounded) for it to end by itself; its exit code, stdout, stderr.
    fn finish(mut self) -> (Option<i32>, String, String) {
        let deadline = Instant::now() + Duration::from_secs(60);
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                break self.child.wait().unwrap();
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        (
            status.code(),
            std::fs::read_to_string(&self.out).unwrap(),
            std::fs::read_to_string(&self.err).unwrap(),
        )
    }
}

/// What a watcher ended with: exit code, stdout, stderr.
type Seen = (Option<i32>, String, String);

/// Two watchers from the first byte (one started before the stage printed
/// anything, one half-way), one `--from-now`, one killed with SIGKILL
/// mid-stage, one Ctrl-C'd once it printed the stage's first bytes, one
/// Ctrl-C'd before dormant listened; `mid` runs half-way through the stage
/// (ssh: cut every connection). Returns the job's report, what the
/// followers saw, and what the two Ctrl-C'd ones saw.
fn watched_job(rig: &Rig, by_job_id: bool, mid: &dyn Fn()) -> (JobReport, Vec<Seen>, Vec<Seen>) {
    let flags = rig.dir.path().join("flags");
    std::fs::create_dir_all(&flags).unwrap();
    let j = job(70);
    let job_id = j.id;
    let mut sim = j.suspend_on(true, false).script(&build_script(&flags));
    sim.after_script = Some(AFTER.to_string());
    std::thread::scope(|s| {
        let running = s.spawn(|| rig.run(&sim));
        wait_for(&flags.join("started"));
        let env = dormant::identity::new_env_id(&rig.runner.runner_id, job_id).to_string();
        let id_text = job_id.to_string();
        let target = if by_job_id {
            id_text.as_str()
        } else {
            env.as_str()
        };
        let first = Watcher::start(rig, target, &[], "first");
        let killed = Watcher::start(rig, target, &[], "killed");
        let ctrl_c = Watcher::start_as(rig, target, &[], "ctrl-c", Signals::TerminalGroupIgnoring);
        let early = Watcher::start_as(rig, target, &[], "early", Signals::PendingAtStart);
        // All are following before the stage prints.
        for w in [&first, &killed, &ctrl_c] {
            w.wait_following();
        }
        std::fs::write(flags.join("go"), "").unwrap();
        // Ctrl-C once the watcher has printed the stage's first bytes: to
        // its process group, as a terminal does.
        ctrl_c.wait_until("printed the stage", |out, _| out.starts_with("line 0 of"));
        // SAFETY: killpg(2) on the group of our own child, which leads it.
        unsafe { libc::killpg(ctrl_c.child.id() as i32, libc::SIGINT) };
        let interrupted = vec![ctrl_c.finish(), early.finish()];
        for (name, (code, _, err)) in ["ctrl-c", "early"].iter().zip(&interrupted) {
            assert!(
                *code == Some(0) && err.contains("detached; job"),
                "{name}: Ctrl-C did not detach the watcher (exit {code:?}): {err}"
            );
        }
        wait_for(&flags.join("half"));
        let late = Watcher::start(rig, target, &[], "late");
        let from_now = Watcher::start(rig, target, &["--from-now"], "from-now");
        let mut killed = killed;
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(killed.child.id() as i32, libc::SIGKILL) };
        killed.child.wait().unwrap();
        mid();
        // The late ones are following too before the stage goes on.
        for w in [&late, &from_now] {
            w.wait_following();
        }
        std::fs::write(flags.join("go2"), "").unwrap();
        let report = running.join().unwrap();
        let seen = vec![first.finish(), late.finish(), from_now.finish()];
        (report, seen, interrupted)
    })
}

fn check(report: &JobReport, seen: &[Seen], interrupted: &[Seen], cut: bool) {
    assert_result(report, JobResult::Success);
    let build = report.call("build_script").unwrap().output.clone();
    let after = report.call("after_script").unwrap().output.clone();
    if !cut {
        // The job's own log: exactly what the script printed.
        assert_eq!(build, build_output(), "the job log changed");
    } else {
        // One line of dormant's about the cut, the script's bytes unchanged.
        let script_only: String = build
            .lines()
            .filter(|l| !l.starts_with("dormant: "))
            .map(|l| format!("{l}\n"))
            .collect();
        assert_eq!(script_only, build_output(), "the job log lost bytes");
    }
    assert!(after.contains("after-script-ran"), "{after}");
    let whole = format!("{build}{after}");
    let [first, late, from_now] = seen else {
        panic!("three watchers")
    };
    for (name, (code, out, err)) in [("first", first), ("late", late)] {
        assert_eq!(*code, Some(0), "{name}: {err}");
        assert!(out == &whole, "{name} saw other bytes than the job log:\n--- job log:\n{whole}\n--- {name}:\n{out}\n--- stderr:\n{err}");
        assert!(err.contains("ended"), "{name}: {err}");
    }
    let (code, out, err) = from_now;
    assert_eq!(*code, Some(0), "{err}");
    assert!(
        !out.contains("line 0 of"),
        "--from-now starts at the end: {out}"
    );
    assert!(
        whole.ends_with(out.as_str()),
        "from-now sees the job log's tail: {out}"
    );
    assert!(out.ends_with("build done\nafter-script-ran\n"), "{out}");
    // Ctrl-C detached them (exit 0, checked as they ended) while the job
    // ran on, unchanged (above); what they printed is the job log's start.
    let [ctrl_c, early] = interrupted else {
        panic!("two Ctrl-C'd watchers")
    };
    for (name, (_, out, err)) in [("ctrl-c", ctrl_c), ("early", early)] {
        assert!(whole.starts_with(out.as_str()), "{name}: {out}\n{err}");
    }
    assert!(ctrl_c.1.starts_with("line 0 of"), "{}", ctrl_c.2);
}

fn attach_on(rig: &Rig, by_job_id: bool) {
    let (report, seen, interrupted) = watched_job(rig, by_job_id, &|| {});
    check(&report, &seen, &interrupted, false);
    suspended_shows_its_last_stage(rig, report.key.as_deref().unwrap());
    each_attach_is_an_event_and_counted(rig, 6);
}

/// Each of the job's `n` watchers wrote a `joined` event (cause `attach`)
/// naming the local user, and `metrics` counts them; a look at a suspended
/// environment is no join.
fn each_attach_is_an_event_and_counted(rig: &Rig, n: usize) {
    each_join_is_an_event_and_counted(rig, "attach", n);
}

/// `n` `joined` events of `cause` (`attach`, `shell`), each naming the local
/// user (root here), and `metrics` counting them.
pub(crate) fn each_join_is_an_event_and_counted(rig: &Rig, cause: &str, n: usize) {
    let out = rig.dormant(&["events", "--json"]);
    let events = String::from_utf8_lossy(&out.stdout).into_owned();
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    let user = if uid == 0 {
        "root".to_string()
    } else {
        format!("uid {uid}")
    };
    let joins: Vec<&str> = events
        .lines()
        .filter(|l| l.contains("\"joined\"") && l.contains(&format!("\"{cause}\"")))
        .collect();
    assert_eq!(joins.len(), n, "{events}");
    if uid == 0 {
        assert!(
            joins
                .iter()
                .all(|l| l.contains(&format!("\"user\":\"{user}\""))),
            "{events}"
        );
    }
    let out = rig.dormant(&["metrics"]);
    let metrics = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        metrics.lines().any(|l| l.contains("event=\"joined\"")
            && l.contains(&format!("cause=\"{cause}\""))
            && l.ends_with(&format!(" {n}"))),
        "{metrics}"
    );
}

/// After the job: a suspended environment prints its last stage, says it is
/// not running, exit 5.
fn suspended_shows_its_last_stage(rig: &Rig, key: &str) {
    assert_eq!(rig.status(key).as_deref(), Some("suspended"));
    let out = rig.dormant(&["attach", key]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(5), "{stdout}\n{stderr}");
    assert_eq!(stdout, "after-script-ran\n", "{stderr}");
    assert!(
        stderr.contains("is not running (it is suspended)"),
        "{stderr}"
    );
    assert!(stderr.contains("after_script of job"), "{stderr}");
}

#[test]
fn local_watchers_see_every_byte_and_change_nothing() {
    attach_on(&Rig::local("70", "s_70aa70aa70aa"), false);
}

#[test]
fn local_attach_by_job_id() {
    let rig = Rig::local("70", "s_70aa70aa70aa");
    let (report, seen, interrupted) = watched_job(&rig, true, &|| {});
    check(&report, &seen, &interrupted, false);
}

/// A rig on the `ssh` provider with the test sshd as its one host.
pub(crate) fn ssh_rig(sshd: &Sshd, runner_id: &str, token: &str) -> Rig {
    Rig::new(
        runner_id,
        token,
        &format!(
            "provider = \"ssh\"\n[ssh]\nworkspace_root = \"{}\"\nready_timeout = \"20s\"\n\
             [[ssh.hosts]]\nname = \"h\"\naddress = \"127.0.0.1\"\nport = {}\nuser = \"root\"\n\
             identity_file = \"{}\"\nslots = 4\n",
            sshd.dir.path().join("ws").display(),
            sshd.port,
            sshd.client_key.display()
        ),
    )
}

#[test]
fn ssh_watchers_see_every_byte_and_open_no_connection() {
    let sshd = Sshd::start();
    let rig = ssh_rig(&sshd, "71", "s_71aa71aa71aa");
    let before = sshd.connections();
    let (report, seen, interrupted) = watched_job(&rig, false, &|| {});
    check(&report, &seen, &interrupted, false);
    // The job's one login (its master): the watchers none.
    assert_eq!(sshd.connections() - before, 1, "{}", sshd.log());
    // Each stage's files go once dormant has read its end: waited for, bounded.
    crate::reattach::assert_nothing_kept(&sshd);
    suspended_shows_its_last_stage(&rig, report.key.as_deref().unwrap());
    each_attach_is_an_event_and_counted(&rig, 6);
}

#[test]
fn ssh_a_cut_under_the_watchers_changes_nothing_for_the_job() {
    let sshd = Sshd::start();
    let rig = ssh_rig(&sshd, "71", "s_71aa71aa71aa");
    let (report, seen, interrupted) = watched_job(&rig, true, &|| {
        assert!(sshd.cut_connections() > 0);
    });
    check(&report, &seen, &interrupted, true);
    assert!(
        report.log().contains("re-attached, the script ran on"),
        "{}",
        report.log()
    );
}

#[test]
fn bad_input_has_its_own_exit_codes() {
    let rig = Rig::local("72", "s_72aa72aa72aa");
    let code = |args: &[&str]| {
        let out = rig.dormant(args);
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (c, e) = code(&["attach", "987654"]);
    assert_eq!(c, Some(3), "{e}");
    assert!(
        e.contains("job 987654 is not running on this runner manager"),
        "{e}"
    );
    let (c, e) = code(&["attach", "not a key"]);
    assert_eq!(c, Some(3), "{e}");
    assert!(e.contains("neither an environment key"), "{e}");
    let (c, e) = code(&["attach", "5e5c1c3e-0000-4000-8000-000000000001"]);
    assert_eq!(c, Some(3), "{e}");
    assert!(e.contains("not in this runner manager's registry"), "{e}");
    let other = "72/s_other000000/env=5e5c1c3e-0000-4000-8000-000000000001&provider=local";
    let (c, e) = code(&["attach", other]);
    assert_eq!(c, Some(4), "{e}");
    assert!(
        e.contains("run this command on the runner manager that made the key"),
        "{e}"
    );
}
