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
/// the instance while the job runs, and the job's exit code is its own
/// (`join::watched_and_joined`, shared with qemu_attach).
#[test]
fn attach_and_a_joined_shell_beside_a_running_ec2_job() {
    use crate::harness::job;
    use crate::join::{beside_script, watched_and_joined};

    let env = Ec2Env::start();
    let rig = env.rig(
        "69",
        "s_69aa69aa69aa",
        &env.settings(&env.connect_address(), ""),
    );
    let sim = job(69).script(&beside_script("started-on-ec2"));
    watched_and_joined(
        &rig,
        &sim,
        "started-on-ec2",
        std::time::Duration::from_secs(120),
    );
}
