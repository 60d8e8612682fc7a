//! `dormant shell` on the `ec2` provider: the instance from the emulator, SSH
//! to the loopback sshd through `ec2.connect_address` with the environment's
//! own key (delivered through user-data, as on a real instance). The same
//! scenarios as on `local` and `ssh` (shell.rs), plus the instance's state:
//! started for the shell, stopped again after it, terminated by `--release`.

use aws_sdk_ec2::types::InstanceStateName;

use crate::ec2_rig::{block_on, Ec2Env};
use crate::moto::direct_client;
use crate::shell;

/// The states of every instance moto has, by id.
fn states(moto_url: &str) -> Vec<InstanceStateName> {
    block_on(async {
        let c = direct_client(moto_url);
        let out = c.describe_instances().send().await.unwrap();
        out.reservations()
            .iter()
            .flat_map(|r| r.instances())
            .map(|i| i.state().unwrap().name().unwrap().clone())
            .collect()
    })
}

#[test]
fn shell_on_ec2_through_connect_address() {
    let env = Ec2Env::start();
    let moto = &env.moto;
    let rig = env.rig(
        "68",
        "s_68aa68aa68aa",
        &env.settings(&env.connect_address(), ""),
    );
    let stopped_after = |what: &str| {
        let s = states(&moto.url());
        assert!(
            s.iter().all(|s| matches!(
                s,
                InstanceStateName::Stopped | InstanceStateName::Terminated
            )),
            "{what}: every instance stopped again: {s:?}"
        );
    };
    shell::command_mode_passes_the_exit_code_and_suspends_again(&rig);
    stopped_after("command mode");
    shell::interactive_shell_runs_what_is_typed(&rig);
    stopped_after("interactive");
    shell::sighup_leaves_it_suspended_even_with_release(&rig);
    shell::a_resume_is_refused_while_the_shell_holds_it(&rig);
    stopped_after("resume refused");
    let before = states(&moto.url())
        .iter()
        .filter(|s| **s == InstanceStateName::Terminated)
        .count();
    shell::release_releases(&rig);
    let after = states(&moto.url())
        .iter()
        .filter(|s| {
            matches!(
                s,
                InstanceStateName::Terminated | InstanceStateName::ShuttingDown
            )
        })
        .count();
    assert_eq!(after, before + 1, "--release terminated the instance");
}

/// Beside a running job on EC2 (issue 32): a watcher follows the stage from
/// its first byte, a joined `dormant shell` runs in the job's project dir on
/// the instance while the job runs, and the job's exit code is its own.
#[test]
fn attach_and_a_joined_shell_beside_a_running_ec2_job() {
    use std::io::{BufRead, BufReader, Read};
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};

    use crate::harness::*;

    let env = Ec2Env::start();
    let rig = env.rig(
        "69",
        "s_69aa69aa69aa",
        &env.settings(&env.connect_address(), ""),
    );
    let j = job(69);
    let job_id = j.id.to_string();
    let sim = j.script(
        "echo started-on-ec2; i=0; while [ ! -e joined ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done\n\
         echo saw-the-joined-shell; exit 3",
    );
    let env_id = dormant::identity::new_env_id(&rig.runner.runner_id, sim.id);
    let stage = rig
        .state_dir
        .join(format!("environments/{env_id}/output/stage.json"));
    std::thread::scope(|s| {
        let running = s.spawn(|| rig.run(&sim));
        let deadline = Instant::now() + Duration::from_secs(120);
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
        assert_eq!(first, "started-on-ec2\n", "the stage from its first byte");

        let out = rig.dormant(&["shell", &job_id, "--", "pwd; touch joined"]);
        let said = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(0), "{said}");
        let pwd = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(pwd.trim_end().ends_with("/group/project"), "{pwd}\n{said}");

        let report = running.join().unwrap();
        assert_result(&report, JobResult::BuildFailure(Some(3)));
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
        assert!(
            report
                .log()
                .contains("started-on-ec2\nsaw-the-joined-shell\n"),
            "{}",
            report.log()
        );
    });
}
