//! `dormant shell` on the `ec2` provider: the instance from the emulator, SSH
//! to the loopback sshd through `ec2.connect_address` with the environment's
//! own key (delivered through user-data, as on a real instance). The same
//! scenarios as on `local` and `ssh` (shell.rs), plus the instance's state:
//! started for the shell, stopped again after it, terminated by `--release`.

use aws_sdk_ec2::types::InstanceStateName;

use crate::harness::Rig;
use crate::moto::{
    catalogue_image, default_subnet, direct_client, CloudInit, Moto, ACCESS_KEY, REGION, SECRET_KEY,
};
use crate::shell;
use crate::sshd::Sshd;

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(f)
}

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
    let moto = Moto::start();
    let sshd = Sshd::start();
    let _cloud_init = CloudInit::start(moto.url(), sshd.dir.path().join("authorized_keys"));
    let (subnet, image) = block_on(async {
        let c = direct_client(&moto.url());
        (
            default_subnet(&c).await,
            catalogue_image(&c, "ubuntu").await,
        )
    });
    let host_dir = tempfile::tempdir().unwrap();
    let settings = format!(
        "provider = \"ec2\"\n[ssh]\nready_timeout = \"60s\"\n[ec2]\nregion = \"{REGION}\"\nendpoint_url = \"{}\"\n\
         subnet_id = \"{subnet}\"\nimage = \"{image}\"\nssh_user = \"root\"\n\
         connect_address = \"127.0.0.1:{}\"\nbuilds_dir = \"{}/builds\"\ncache_dir = \"{}/cache\"\n",
        moto.url(),
        sshd.port,
        host_dir.path().display(),
        host_dir.path().display(),
    );
    let mut rig = Rig::new("68", "s_68aa68aa68aa", &settings);
    for (k, v) in [
        ("AWS_ACCESS_KEY_ID", ACCESS_KEY),
        ("AWS_SECRET_ACCESS_KEY", SECRET_KEY),
        // Keeps the credential chain off the instance-metadata address: loopback only.
        ("AWS_EC2_METADATA_DISABLED", "true"),
    ] {
        rig.runner.env.insert(k.into(), v.into());
    }
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
