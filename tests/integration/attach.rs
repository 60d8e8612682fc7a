//! `dormant attach`: watchers of a running job, on `local` and on `ssh`
//! against the test sshd. Every byte of a stage reaches each watcher in
//! order, the job's own log is byte for byte what its script printed, two
//! watchers at once, a watcher killed with SIGKILL and (ssh) every connection
//! cut under the watchers change nothing for the job, and no watcher opens a
//! connection to the machine. A suspended environment shows its last stage
//! and exits 5; bad input has its own exit codes.

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

fn wait_for(path: &Path) {
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

/// A watcher: `dormant attach` with its stdout and stderr in files.
struct Watcher {
    child: Child,
    out: PathBuf,
    err: PathBuf,
}

impl Watcher {
    fn start(rig: &Rig, target: &str, extra: &[&str], name: &str) -> Watcher {
        let out = rig.dir.path().join(format!("{name}.out"));
        let err = rig.dir.path().join(format!("{name}.err"));
        let child = Command::new(BIN)
            .arg("attach")
            .arg(target)
            .args(extra)
            .env_clear()
            .envs(&rig.runner.env)
            .stdout(std::fs::File::create(&out).unwrap())
            .stderr(std::fs::File::create(&err).unwrap())
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        Watcher { child, out, err }
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

/// Two watchers from the first byte (one started before the stage printed
/// anything, one half-way), one `--from-now`, one killed with SIGKILL
/// mid-stage; `mid` runs half-way through the stage (ssh: cut every
/// connection). Returns the job's report and what each watcher saw.
fn watched_job(
    rig: &Rig,
    by_job_id: bool,
    mid: &dyn Fn(),
) -> (JobReport, Vec<(Option<i32>, String, String)>) {
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
        // Both are following before the stage prints (a watcher says so on
        // stderr as it starts following the stage).
        for w in [&first, &killed] {
            let deadline = Instant::now() + Duration::from_secs(30);
            while !std::fs::read_to_string(&w.err)
                .unwrap()
                .contains("build_script of job")
            {
                assert!(
                    Instant::now() < deadline,
                    "the watcher never followed: {}",
                    std::fs::read_to_string(&w.err).unwrap()
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        std::fs::write(flags.join("go"), "").unwrap();
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
            let deadline = Instant::now() + Duration::from_secs(30);
            while !std::fs::read_to_string(&w.err)
                .unwrap()
                .contains("build_script of job")
            {
                assert!(
                    Instant::now() < deadline,
                    "the watcher never followed: {}",
                    std::fs::read_to_string(&w.err).unwrap()
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        std::fs::write(flags.join("go2"), "").unwrap();
        let report = running.join().unwrap();
        let seen = vec![first.finish(), late.finish(), from_now.finish()];
        (report, seen)
    })
}

fn check(report: &JobReport, seen: &[(Option<i32>, String, String)], cut: bool) {
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
}

fn attach_on(rig: &Rig, by_job_id: bool) {
    let (report, seen) = watched_job(rig, by_job_id, &|| {});
    check(&report, &seen, false);
    suspended_shows_its_last_stage(rig, report.key.as_deref().unwrap());
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
    let (report, seen) = watched_job(&rig, true, &|| {});
    check(&report, &seen, false);
}

fn ssh_rig(sshd: &Sshd) -> Rig {
    Rig::new(
        "71",
        "s_71aa71aa71aa",
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
    let rig = ssh_rig(&sshd);
    let before = sshd.connections();
    let (report, seen) = watched_job(&rig, false, &|| {});
    check(&report, &seen, false);
    // The job's one login (its master): the watchers none.
    assert_eq!(sshd.connections() - before, 1, "{}", sshd.log());
    // Each stage's files go once dormant has read its end: waited for, bounded.
    crate::reattach::assert_nothing_kept(&sshd);
    suspended_shows_its_last_stage(&rig, report.key.as_deref().unwrap());
}

#[test]
fn ssh_a_cut_under_the_watchers_changes_nothing_for_the_job() {
    let sshd = Sshd::start();
    let rig = ssh_rig(&sshd);
    let (report, seen) = watched_job(&rig, true, &|| {
        assert!(sshd.cut_connections() > 0);
    });
    check(&report, &seen, true);
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
