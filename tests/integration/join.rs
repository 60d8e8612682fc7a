//! `dormant shell` beside a running job (ssh, against the test sshd): a
//! joined shell runs while the job runs (the job waits for what the shell
//! does), claims nothing, and leaves the job's exit code as it was; a job
//! that ends with a shell joined has its cleanup end it (told first) and
//! nothing of it is left on the machine. On `local` it says where the job's
//! directory is, exit 6.

use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::attach::wait_for;
use crate::harness::*;
use crate::sshd::{alive, Sshd};

/// The job: says it started, waits for the joined shell's flag, then for
/// `go`; exits 3 (so the job's own exit code is visible).
fn script(f: &Path) -> String {
    let f = f.display();
    format!(
        "echo job-file > job-file; touch {f}/started\n\
         i=0; while [ ! -e {f}/joined ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done\n\
         echo saw-the-joined-shell\n\
         i=0; while [ ! -e {f}/go ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done\n\
         exit 3\n"
    )
}

#[test]
fn ssh_a_shell_beside_the_job_runs_with_it_and_ends_with_it() {
    let sshd = Sshd::start();
    let rig = crate::attach::ssh_rig(&sshd, "73", "s_73aa73aa73aa");
    let flags = rig.dir.path().join("flags");
    std::fs::create_dir_all(&flags).unwrap();
    let f = flags.display().to_string();
    let j = job(73);
    let job_id = j.id;
    let sim = j.suspend_on(false, true).script(&script(&flags));
    std::thread::scope(|s| {
        let running = s.spawn(|| rig.run(&sim));
        wait_for(&flags.join("started"));
        let env = dormant::identity::new_env_id(&rig.runner.runner_id, job_id);
        // A command beside the job: in its project dir, while it runs.
        let line = format!("pwd; cat job-file; touch {f}/joined");
        let out = rig.dormant(&["shell", &job_id.to_string(), "--", &line]);
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
        assert!(
            stdout.contains("/group/project") && stdout.contains("job-file"),
            "{stdout}"
        );
        let rec = rig
            .state_dir
            .join(format!("environments/{env}/record.json"));
        let rec: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&rec).unwrap()).unwrap();
        assert_eq!(rec["status"], "active", "{rec}");
        assert_eq!(
            rec["claim"]["holder"]["job_id"], job_id,
            "still the job's: {rec}"
        );
        // A second one stays open (a process in the background too) until
        // the job ends: the job's cleanup ends it.
        let joined = rig.dir.path().join("joined.out");
        let mut child = Command::new(BIN)
            .args(["shell", &env.to_string(), "--"])
            .arg(format!("sleep 300 & echo $! > {f}/sleeper; wait"))
            .env_clear()
            .envs(&rig.runner.env)
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&joined).unwrap())
            .stderr(std::fs::File::create(rig.dir.path().join("joined.err")).unwrap())
            .spawn()
            .unwrap();
        wait_for(&flags.join("sleeper"));
        let sleeper: u32 = std::fs::read_to_string(flags.join("sleeper"))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert!(alive(sleeper));
        std::fs::write(flags.join("go"), "").unwrap();
        let report = running.join().unwrap();
        // The job's own exit code and log, as without the shells.
        assert_result(&report, JobResult::BuildFailure(Some(3)));
        assert!(
            report.log().contains("saw-the-joined-shell"),
            "{}",
            report.log()
        );
        // Its cleanup ended the shell (bounded wait here: it is over already).
        let deadline = Instant::now() + Duration::from_secs(30);
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            assert!(
                Instant::now() < deadline,
                "the joined shell outlived the job"
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        let said = std::fs::read_to_string(rig.dir.path().join("joined.err")).unwrap();
        assert_ne!(status.code(), Some(0), "{said}");
        assert!(said.contains(&format!("job {job_id} ended")), "{said}");
        assert!(
            !alive(sleeper),
            "the shell's background process was left running"
        );
        // Each stage's files go once dormant has read its end: waited for, bounded.
        crate::reattach::assert_nothing_kept(&sshd);
        // No mark is left (what stays says the job's joins are closed).
        let left: Vec<_> =
            std::fs::read_dir(rig.state_dir.join(format!("environments/{env}/joined")))
                .unwrap()
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect();
        assert_eq!(left, ["closed"]);
        assert_eq!(
            rig.status(report.key.as_deref().unwrap()).as_deref(),
            Some("suspended"),
            "the job's failure trigger decided, not the shells"
        );
        // Each join is an event naming who, and counted.
        crate::attach::each_join_is_an_event_and_counted(&rig, "shell", 2);
    });
}

/// The form people type: `dormant shell JOB` at a terminal opens a login
/// shell beside the job that runs what is typed, in the job's project dir
/// (the wrapper on the machine once gave it /dev/null for stdin: it ended at
/// once). Then the job's exit code is its own.
#[test]
fn ssh_an_interactive_shell_beside_the_job_runs_what_is_typed() {
    let sshd = Sshd::start();
    let rig = crate::attach::ssh_rig(&sshd, "76", "s_76aa76aa76aa");
    let flags = rig.dir.path().join("flags");
    std::fs::create_dir_all(&flags).unwrap();
    let f = flags.display().to_string();
    let j = job(76);
    let job_id = j.id;
    let sim = j.script(&script(&flags));
    std::thread::scope(|s| {
        let running = s.spawn(|| rig.run(&sim));
        wait_for(&flags.join("started"));
        let typed = interactive_beside(&rig, job_id, &format!("touch {f}/joined; "));
        assert!(typed.contains("/group/project"), "{typed}");
        std::fs::write(flags.join("go"), "").unwrap();
        let report = running.join().unwrap();
        assert_result(&report, JobResult::BuildFailure(Some(3)));
        assert!(
            report.log().contains("saw-the-joined-shell"),
            "{}",
            report.log()
        );
    });
}

/// `dormant shell JOB` at a pseudo-terminal beside running job `job_id`:
/// types `echo typed-$((6*7)) in $PWD`, then `more` (more to type) and
/// `exit`; checks the shell ran it (the terminal echoes what is typed, so
/// only the shell's output says `typed-42`) and exited 0. Returns what the
/// terminal showed.
pub(crate) fn interactive_beside(rig: &Rig, job_id: u64, more: &str) -> String {
    let line = format!("echo typed-$((6*7)) in $PWD; {more}exit\n");
    let s = crate::shell::in_pty(rig, "send", &line, &["shell", &job_id.to_string()]);
    assert!(s.output.contains("typed-42 in /"), "{}", s.output);
    assert_eq!(s.code, 0, "{}", s.output);
    s.output
}

/// A join that saw the job running and then lost the race with the job's
/// cleanup (which came between the join's look at the record and its mark:
/// a pause point holds the join there while the job ends) never runs beside
/// a job that ended: it finds the job's joins closed, and leaves no mark.
#[test]
fn ssh_a_join_losing_the_race_with_the_cleanup_does_not_outlive_the_job() {
    let sshd = Sshd::start();
    let rig = crate::attach::ssh_rig(&sshd, "77", "s_77aa77aa77aa");
    let point = "shell:join-checked";
    let flags = rig.dir.path().join("flags");
    std::fs::create_dir_all(&flags).unwrap();
    let f = flags.display().to_string();
    let j = job(77);
    let job_id = j.id;
    // Kept (suspended): on an ssh host the workspace stays, so a join that
    // got through would run there.
    let sim = j.suspend_on(true, true).script(&format!(
        "touch {f}/started; i=0; while [ ! -e {f}/go ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done"
    ));
    std::thread::scope(|s| {
        let running = s.spawn(|| rig.run(&sim));
        wait_for(&flags.join("started"));
        let joining = Command::new(BIN)
            .args(["shell", &job_id.to_string(), "--"])
            .arg(format!("touch {f}/ran"))
            .env_clear()
            .envs(&rig.runner.env)
            .env("DORMANT_FAILPOINT", point)
            .env("DORMANT_FAILPOINT_PAUSE", &flags)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        wait_for(&flags.join(format!("{point}.reached")));
        // The job ends and its cleanup runs to its end; then the join goes on.
        std::fs::write(flags.join("go"), "").unwrap();
        let report = running.join().unwrap();
        assert_result(&report, JobResult::Success);
        std::fs::write(flags.join(format!("{point}.go")), "").unwrap();
        let out = joining.wait_with_output().unwrap();
        let said = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(
            !flags.join("ran").exists(),
            "the join ran beside a job that had ended: {said}"
        );
        assert_eq!(out.status.code(), Some(5), "{said}");
        assert!(
            said.contains("ended while this shell was joining it"),
            "{said}"
        );
        let env = dormant::identity::new_env_id(&rig.runner.runner_id, job_id);
        let left: Vec<_> =
            std::fs::read_dir(rig.state_dir.join(format!("environments/{env}/joined")))
                .unwrap()
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect();
        assert_eq!(left, ["closed"], "no mark is left");
        assert_eq!(
            rig.status(report.key.as_deref().unwrap()).as_deref(),
            Some("suspended")
        );
    });
}

/// The window after the join's mark, before its wrapper registers on the
/// machine (one SSH connect): the cleanup sees the mark but nothing on the
/// machine to end. It leaves word there for that nonce; the wrapper arriving
/// late finds it, runs nothing and leaves nothing behind.
#[test]
fn ssh_a_join_registering_after_the_cleanup_ended_the_joins_runs_nothing() {
    let sshd = Sshd::start();
    let rig = crate::attach::ssh_rig(&sshd, "78", "s_78aa78aa78aa");
    let point = "shell:join-marked";
    let flags = rig.dir.path().join("flags");
    std::fs::create_dir_all(&flags).unwrap();
    let f = flags.display().to_string();
    let j = job(78);
    let job_id = j.id;
    // Kept (suspended): the workspace and the host stay, so the late
    // connection gets through and its shell would run there.
    let sim = j.suspend_on(true, true).script(&format!(
        "touch {f}/started; i=0; while [ ! -e {f}/go ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done"
    ));
    std::thread::scope(|s| {
        let running = s.spawn(|| rig.run(&sim));
        wait_for(&flags.join("started"));
        let joining = Command::new(BIN)
            .args(["shell", &job_id.to_string(), "--"])
            .arg(format!("touch {f}/ran"))
            .env_clear()
            .envs(&rig.runner.env)
            .env("DORMANT_FAILPOINT", point)
            .env("DORMANT_FAILPOINT_PAUSE", &flags)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        wait_for(&flags.join(format!("{point}.reached")));
        // The job ends and its cleanup (which sees the mark) runs to its
        // end; then the join connects.
        std::fs::write(flags.join("go"), "").unwrap();
        let report = running.join().unwrap();
        assert_result(&report, JobResult::Success);
        std::fs::write(flags.join(format!("{point}.go")), "").unwrap();
        let out = joining.wait_with_output().unwrap();
        let said = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(
            !flags.join("ran").exists(),
            "the join ran beside a job that had ended: {said}"
        );
        assert!(
            said.contains("the job ended before this shell could join it"),
            "{said}"
        );
        assert_ne!(out.status.code(), Some(0), "{said}");
        assert_eq!(sshd.kept_files(), Vec::<String>::new(), "left on the host");
        assert_eq!(
            rig.status(report.key.as_deref().unwrap()).as_deref(),
            Some("suspended")
        );
    });
}

#[test]
fn local_a_shell_beside_the_job_says_where_its_directory_is() {
    let rig = Rig::local("74", "s_74aa74aa74aa");
    let flags = rig.dir.path().join("flags");
    std::fs::create_dir_all(&flags).unwrap();
    let f = flags.display();
    let j = job(74);
    let job_id = j.id;
    let sim = j.script(&format!(
        "touch {f}/started; i=0; while [ ! -e {f}/go ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done"
    ));
    std::thread::scope(|s| {
        let running = s.spawn(|| rig.run(&sim));
        wait_for(&flags.join("started"));
        let out = rig.dormant(&["shell", &job_id.to_string(), "--", "true"]);
        std::fs::write(flags.join("go"), "").unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(6), "{stderr}");
        assert!(
            stderr.contains("runs on this host, in ") && stderr.contains("/group/project"),
            "{stderr}"
        );
        assert_result(&running.join().unwrap(), JobResult::Success);
    });
}

/// A script for [`watched_and_joined`]: prints `first_line`, waits (at most
/// 5 min) for the file `joined` the joined shell makes in the project dir,
/// then exits 3 so the job's own exit code shows.
pub(crate) fn beside_script(first_line: &str) -> String {
    format!(
        "echo {first_line}; i=0; while [ ! -e joined ] && [ $i -lt 3000 ]; do sleep 0.1; i=$((i+1)); done\n\
         echo saw-the-joined-shell; exit 3"
    )
}

/// On a provider whose machine is not the test host (EC2, qemu): once the
/// job's build stage (a [`beside_script`] printing `first_line`) has begun
/// (within `stage_within`), a watcher attached by job id prints the stage
/// from its first byte; `dormant shell JOB -- ...` runs in the job's project
/// dir on the machine and makes what the script waits for; the job's exit
/// code (3) is its own; the watcher gets the rest, every line in the job
/// log's order, and exits 0 with the job. Returns the job's report.
pub(crate) fn watched_and_joined(
    rig: &Rig,
    sim: &dormant::runner_sim::SimJob,
    first_line: &str,
    stage_within: Duration,
) -> JobReport {
    let job_id = sim.id.to_string();
    let env_id = dormant::identity::new_env_id(&rig.runner.runner_id, sim.id);
    let stage = rig
        .state_dir
        .join(format!("environments/{env_id}/output/stage.json"));
    std::thread::scope(|s| {
        let running = s.spawn(|| rig.run(sim));
        // The build stage runs once its copy of the job log names it.
        let deadline = Instant::now() + stage_within;
        while !std::fs::read_to_string(&stage).is_ok_and(|t| t.contains("build_script")) {
            assert!(Instant::now() < deadline, "the build stage never started");
            std::thread::sleep(Duration::from_millis(50));
        }
        let mut watcher = Command::new(BIN)
            .args(["attach", &job_id])
            .env_clear()
            .envs(&rig.runner.env)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut seen = BufReader::new(watcher.stdout.take().unwrap());
        let mut first = String::new();
        seen.read_line(&mut first).unwrap();
        assert_eq!(
            first,
            format!("{first_line}\n"),
            "the stage from its first byte"
        );

        // The form people type: a login shell at a terminal, beside the job.
        let typed = interactive_beside(rig, sim.id, "");
        assert!(typed.contains("/group/project"), "{typed}");
        // A command beside the job, in its project dir on the machine.
        let out = rig.dormant(&["shell", &job_id, "--", "pwd; touch joined"]);
        let said = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(0), "{said}");
        let pwd = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(pwd.trim_end().ends_with("/group/project"), "{pwd}\n{said}");

        let report = running.join().unwrap();
        assert_result(&report, JobResult::BuildFailure(Some(3)));
        let log = report.log();
        assert!(
            log.contains(&format!("{first_line}\nsaw-the-joined-shell\n")),
            "{log}"
        );
        // The watcher saw the rest and ended with the job, exit 0.
        let mut rest = String::new();
        seen.read_to_string(&mut rest).unwrap();
        let status = watcher.wait().unwrap();
        let mut err = String::new();
        watcher
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut err)
            .unwrap();
        assert_eq!(status.code(), Some(0), "{err}");
        assert!(rest.starts_with("saw-the-joined-shell\n"), "{rest}\n{err}");
        // Every line the watcher printed is the job log's, in its order.
        let mut at = 0;
        for line in format!("{first}{rest}").lines() {
            let found = log[at..].find(line);
            assert!(
                found.is_some(),
                "{line:?} is not in the job log after byte {at}:\n{log}"
            );
            at += found.unwrap() + line.len();
        }
        report
    })
}

/// Who may: only a user who can read the state dir (the runner's own user or
/// root). Another user's `attach` and `shell` are refused naming what it
/// cannot read, and leave no mark, no event and no process.
#[test]
fn another_user_cannot_attach_or_join() {
    use std::os::unix::process::CommandExt;
    let rig = Rig::local("75", "s_75aa75aa75aa");
    let flags = rig.dir.path().join("flags");
    std::fs::create_dir_all(&flags).unwrap();
    let f = flags.display();
    let j = job(75);
    let job_id = j.id;
    let sim = j.script(&format!(
        "touch {f}/started; i=0; while [ ! -e {f}/go ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done"
    ));
    // SAFETY: getuid has no preconditions.
    assert_eq!(
        unsafe { libc::getuid() },
        0,
        "this test switches to another user: run it as root"
    );
    // The flags dir is the job's and the test's; `nobody` only needs to be refused.
    std::thread::scope(|s| {
        let running = s.spawn(|| rig.run(&sim));
        wait_for(&flags.join("started"));
        for args in [
            &["attach", &job_id.to_string()][..],
            &["shell", &job_id.to_string(), "--", "true"],
        ] {
            let out = Command::new(BIN)
                .args(args)
                .env_clear()
                .envs(&rig.runner.env)
                .uid(65534)
                .gid(65534)
                .output()
                .unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
            assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
            assert!(
                stderr.contains("ermission denied"),
                "{args:?}: the refusal names the permission: {stderr}"
            );
        }
        std::fs::write(flags.join("go"), "").unwrap();
        assert_result(&running.join().unwrap(), JobResult::Success);
    });
    let out = rig.dormant(&["events", "--json"]);
    let events = String::from_utf8_lossy(&out.stdout);
    assert!(!events.contains("\"joined\""), "{events}");
}
