//! `dormant attach` and `dormant shell` beside a running job on a real qemu
//! VM (one boot): a watcher follows the stage from its first byte while the
//! script runs in the guest, a shell joins the job's machine in its project
//! dir and does what the script waits for, the job's exit code is its own,
//! and the watcher ends when the job does. The ssh and local providers'
//! byte-for-byte checks are in `attach.rs` and `join.rs`.

use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::harness::*;
use crate::qemu::{env_paths, one_vm, qemu_pids, qemu_rig_full};

/// A TCG boot on a loaded machine takes minutes (`boot_timeout` is 400 s).
const STAGE_STARTS_WITHIN: Duration = Duration::from_secs(20 * 60);

#[test]
fn qemu_a_watcher_follows_the_stage_and_a_joined_shell_runs_beside_the_job() {
    let _one = one_vm();
    let rig = qemu_rig_full("shutdown", "", "");
    let j = job(97);
    let job_id = j.id.to_string();
    // Waits (at most 5 min) for the file the joined shell makes, then exits 3
    // so the job's own exit code shows.
    let sim = j.script(
        "echo started-in-vm; i=0; while [ ! -e joined ] && [ $i -lt 3000 ]; do sleep 0.1; i=$((i+1)); done\n\
         echo saw-the-joined-shell; exit 3",
    );
    let env = env_paths(&rig, &sim);
    std::thread::scope(|s| {
        let running = s.spawn(|| rig.run(&sim));
        // The build stage runs once its copy of the job log names it.
        let stage = env.dir.join("output/stage.json");
        let deadline = Instant::now() + STAGE_STARTS_WITHIN;
        while !std::fs::read_to_string(&stage).is_ok_and(|t| t.contains("build_script")) {
            assert!(Instant::now() < deadline, "the build stage never started");
            std::thread::sleep(Duration::from_millis(200));
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
        assert_eq!(first, "started-in-vm\n", "the stage from its first byte");

        // A command beside the job, in its project dir on the VM.
        let out = rig.dormant(&["shell", &job_id, "--", "pwd; touch joined"]);
        let said = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(0), "{said}");
        let pwd = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(pwd.trim_end().ends_with("/group/project"), "{pwd}\n{said}");

        let report = running.join().unwrap();
        assert_result(&report, JobResult::BuildFailure(Some(3)));
        assert!(
            report
                .log()
                .contains("started-in-vm\nsaw-the-joined-shell\n"),
            "{}",
            report.log()
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
        let log = report.log();
        let mut at = 0;
        for line in format!("{first}{rest}").lines() {
            let found = log[at..].find(line);
            assert!(
                found.is_some(),
                "{line:?} is not in the job log after byte {at}:\n{log}"
            );
            at += found.unwrap() + line.len();
        }
    });
    // No trigger: released, nothing left running.
    assert!(qemu_pids(&env).is_empty());
    assert!(!env.dir.exists());
}
