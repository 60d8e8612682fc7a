//! EC2 volume mode (`[ec2] storage = "volume"`) through the built binary,
//! against moto behind the test proxy, SSH to the loopback sshd, and the
//! provider's guest seam standing in for the instance's EBS device (the
//! loopback host has none: `provider/ec2/guest_seam.rs`). What is proven
//! here: a suspend terminates the instance and leaves the data volume
//! `available` with its tags; a resume launches a new instance from the
//! image configured *now*, in the volume's zone, and attaches it; a release
//! deletes the volume; a resume needs capacity in the volume's zone (the
//! next instance type there, never another zone).
//!
//! Network rule: the instance addresses moto hands out are never contacted.

use aws_sdk_ec2::types::{Filter, Volume};

use crate::ec2_rig::{block_on, instances, is_live, key_field, volume, Ec2Env};
use crate::harness::{self, assert_result, JobResult};
use crate::moto::{direct_client, Shortage, CANONICAL, UBUNTU_PATTERN};

fn tag<'a>(v: &'a Volume, k: &str) -> Option<&'a str> {
    v.tags()
        .iter()
        .find(|t| t.key() == Some(k))
        .and_then(|t| t.value())
}

/// Another image of moto's catalogue than `env.image`.
fn other_image(env: &Ec2Env) -> String {
    block_on(async {
        let c = direct_client(&env.moto.url());
        let out = c
            .describe_images()
            .owners(CANONICAL)
            .filters(
                Filter::builder()
                    .name("name")
                    .values(UBUNTU_PATTERN)
                    .build(),
            )
            .send()
            .await
            .unwrap();
        out.images()
            .iter()
            .filter_map(|i| i.image_id())
            .find(|id| *id != env.image)
            .expect("two ubuntu images in moto's catalogue")
            .to_string()
    })
}

#[test]
fn a_suspend_keeps_only_the_volume_and_a_resume_attaches_it_to_a_new_instance() {
    let env = Ec2Env::start();
    let rig = env.volume_rig("7", "s_0123456789ab", &env.volume_settings("", ""));

    // Job 1: a new environment in volume mode, suspended on success.
    let r1 = rig.run(
        &harness::job(5)
            .suspend_on(true, false)
            .script("pwd; echo 'agent state' > progress.txt"),
    );
    assert_result(&r1, JobResult::Success);
    let key = r1.key.clone().expect("a key");
    let vol =
        key_field(&key, "volume").unwrap_or_else(|| panic!("the key names the volume: {key}"));
    assert!(
        key.contains("storage=volume")
            && key_field(&key, "zone").is_some()
            && key_field(&key, "region").is_some(),
        "{key}"
    );
    assert!(
        key_field(&key, "instance").is_none(),
        "never an instance: {key}"
    );
    let mnt = env.mountpoint().display().to_string();
    assert!(
        r1.log().contains(&format!("{mnt}/builds/")),
        "CI_PROJECT_DIR is on the volume: {}",
        r1.log()
    );
    // Suspended: the instance terminated, the volume available with its tags.
    let first = instances(&env);
    assert_eq!(first.len(), 1, "one launch");
    assert!(!is_live(&first[0]), "the instance was terminated");
    let v = volume(&env, &vol).expect("the volume is kept");
    assert_eq!(v.state().map(|s| s.as_str()), Some("available"));
    assert_eq!(
        v.availability_zone(),
        first[0].placement().and_then(|p| p.availability_zone())
    );
    assert_eq!(key_field(&key, "zone").as_deref(), v.availability_zone());
    for (k, want) in [
        ("dormant:volume", "data"),
        ("dormant:managed-by", "dormant"),
        ("dormant:system", "s_0123456789ab"),
        ("dormant:runner", "7"),
    ] {
        assert_eq!(tag(&v, k), Some(want), "volume tag {k}: {v:?}");
    }
    assert_eq!(v.size(), Some(20));
    assert_eq!(v.encrypted(), Some(true));
    let rec: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(rig.env_dir(&key).join("record.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(rec["status"], "suspended");
    assert!(rec["machine"].is_null(), "{rec}");
    assert_eq!(rec["volume"]["step"], "detached", "{rec}");
    assert!(
        env.volume_files(&vol).join("builds").exists(),
        "the job's files are on the volume"
    );
    assert!(
        !env.mountpoint().exists(),
        "detached: the mount point shows nothing"
    );

    // The operator moves to a newer image; the resume uses it.
    let newer = other_image(&env);
    let text = std::fs::read_to_string(&rig.settings_path).unwrap();
    std::fs::write(&rig.settings_path, text.replace(&env.image, &newer)).unwrap();
    env.proxy.clear_calls();
    let mut second = harness::job(5)
        .resume(&key)
        .script("cat progress.txt; test ! -e .fetched-again");
    second.get_sources = "touch .fetched-again".into();
    let r2 = rig.run(&second);
    assert_result(&r2, JobResult::Success);
    assert!(r2.log().contains("agent state"), "{}", r2.log());
    assert!(r2.log().contains("skipping get_sources"), "{}", r2.log());
    assert_eq!(
        r1.config.as_ref().unwrap().builds_dir,
        r2.config.as_ref().unwrap().builds_dir
    );
    let all = instances(&env);
    assert_eq!(all.len(), 2, "a new instance for the resume");
    let second_instance = &all[1];
    assert_ne!(second_instance.instance_id(), first[0].instance_id());
    assert_eq!(
        second_instance.image_id(),
        Some(newer.as_str()),
        "the image configured now"
    );
    assert_eq!(
        second_instance
            .placement()
            .and_then(|p| p.availability_zone()),
        v.availability_zone(),
        "in the volume's zone"
    );
    let calls = env.proxy.actions();
    // A launch and an attach; at the release a terminate and the volume's
    // delete (its detach is the instance's termination).
    for (action, n) in [
        ("RunInstances", 1),
        ("AttachVolume", 1),
        ("TerminateInstances", 1),
        ("DeleteVolume", 1),
        ("CreateVolume", 0),
        ("DetachVolume", 0),
        ("StartInstances", 0),
    ] {
        assert_eq!(
            calls.iter().filter(|a| *a == action).count(),
            n,
            "{action}: {calls:?}"
        );
    }
    // Released at the end of job 2: instance and volume gone, nothing left.
    assert!(instances(&env).iter().all(|i| !is_live(i)));
    assert!(volume(&env, &vol).is_none(), "the volume was deleted");
    assert!(!env.volume_files(&vol).exists());
    assert!(!rig.env_dir(&key).exists());
}

#[test]
fn a_resume_needs_capacity_in_the_volumes_zone_and_tries_the_next_type_there() {
    let env = Ec2Env::start();
    let zones = block_on(async {
        let c = direct_client(&env.moto.url());
        let out = c.describe_subnets().send().await.unwrap();
        let mut v: Vec<(String, String)> = out
            .subnets()
            .iter()
            .filter(|s| s.default_for_az() == Some(true))
            .map(|s| {
                (
                    s.availability_zone().unwrap().to_string(),
                    s.subnet_id().unwrap().to_string(),
                )
            })
            .collect();
        v.sort();
        v
    });
    let ((za, sa), (zb, sb)) = (zones[0].clone(), zones[1].clone());
    let rig = env.volume_rig(
        "7",
        "s_0123456789ab",
        &env.volume_settings(
            &format!(
                "subnet_ids = [\"{sa}\", \"{sb}\"]\nfallback_instance_types = [\"t3a.medium\"]\nprepare_timeout = \"2m\"\n"
            ),
            "",
        ),
    );
    let r1 = rig.run(
        &harness::job(5)
            .suspend_on(true, false)
            .script("echo kept > kept.txt"),
    );
    assert_result(&r1, JobResult::Success);
    let key = r1.key.clone().unwrap();
    assert_eq!(
        key_field(&key, "zone").as_deref(),
        Some(za.as_str()),
        "the first subnet's zone"
    );

    // No t3.medium in the volume's zone, though the other zone has some: the
    // next type in the volume's zone, never the other zone.
    env.proxy
        .no_capacity(Shortage::default().of_type("t3.medium").in_zone(&za));
    env.proxy.clear_calls();
    let r2 = rig.run(
        &harness::job(5)
            .resume(&key)
            .suspend_on(true, false)
            .script("cat kept.txt"),
    );
    assert_result(&r2, JobResult::Success);
    let launched = instances(&env).last().cloned().unwrap();
    assert_eq!(
        launched.instance_type().map(|t| t.as_str()),
        Some("t3a.medium")
    );
    assert_eq!(launched.subnet_id(), Some(sa.as_str()));
    let runs: Vec<String> = env
        .proxy
        .calls()
        .into_iter()
        .filter(|c| c.action == "RunInstances")
        .map(|c| c.body)
        .collect();
    assert!(
        runs.iter()
            .all(|b| b.contains(&format!("SubnetId={sa}")) && !b.contains(&sb)),
        "only the volume's zone was tried: {runs:?}"
    );
    assert!(
        r2.log().contains("trying t3a.medium on-demand in"),
        "{}",
        r2.log()
    );

    // No capacity in the volume's zone at all: the resume waits within its
    // bound, says what for, fails as a system failure, and the environment
    // stays suspended with its volume (a later resume gets it).
    // (A short bound for this resume only: the ones that must succeed keep
    // room for a slow machine.)
    let settings = std::fs::read_to_string(&rig.settings_path).unwrap();
    let short = settings.replace("prepare_timeout = \"2m\"", "prepare_timeout = \"8s\"");
    assert_ne!(short, settings);
    std::fs::write(&rig.settings_path, short).unwrap();
    env.proxy.no_capacity(Shortage::default().in_zone(&za));
    let r3 = rig.run(&harness::job(5).resume(&key).script("cat kept.txt"));
    std::fs::write(&rig.settings_path, settings).unwrap();
    assert_eq!(r3.result, JobResult::SystemFailure, "{}", r3.log());
    assert!(
        r3.log()
            .contains("waiting for capacity: no capacity for any of the 2 choices")
            && r3.log().contains(&za),
        "{}",
        r3.log()
    );
    assert!(
        !r3.log().contains(&zb),
        "the other zone is never tried: {}",
        r3.log()
    );
    assert_eq!(rig.status(&key).as_deref(), Some("suspended"));
    let vol = key_field(&key, "volume").unwrap();
    assert_eq!(
        volume(&env, &vol).and_then(|v| v.state().map(|s| s.as_str().to_string())),
        Some("available".to_string())
    );
    env.proxy.capacity_back();
    let r4 = rig.run(&harness::job(5).resume(&key).script("cat kept.txt"));
    assert_result(&r4, JobResult::Success);
    assert!(r4.log().contains("kept"), "{}", r4.log());
    assert!(volume(&env, &vol).is_none(), "released");
}

/// The user-data of an instance for a volume-mode environment is the one
/// shared function's (`provider::cloud_init`) and valid for `cloud-init
/// schema`. It carries no mount: an EBS volume attaches only once the
/// instance runs, so the core's guest command mounts it after the attach.
#[test]
fn the_user_data_of_a_volume_mode_instance_is_valid_cloud_config() {
    use dormant::provider::MachineSpec;
    let id = uuid::Uuid::new_v4();
    let public =
        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIJb5kG0r9Yd7m1t8j1oT0p9H2l9mX0c6w2k8b0a1c2d3 x";
    let settings = dormant::settings::ec2::Ec2Settings {
        storage: dormant::model::StorageMode::Volume,
        ..Default::default()
    };
    let spec = MachineSpec {
        env_id: id,
        name: MachineSpec::machine_name(id),
        runner_id: "1".into(),
        system_id: "s".into(),
        project_id: 1,
        job_id: 1,
        image: None,
        variables: Default::default(),
        ssh_public_key: Some(public.into()),
        paths: dormant::model::EnvPaths::new(std::path::Path::new("/nonexistent"), id),
        volume: Some(
            dormant::model::Volume::new("vol-0123456789abcdef0").with("zone", "us-east-1a"),
        ),
    };
    let encoded = dormant::provider::ec2::launch::user_data(&spec, &settings).unwrap();
    let text = String::from_utf8(aws_smithy_types::base64::decode(&encoded).unwrap()).unwrap();
    assert_eq!(
        text,
        dormant::provider::cloud_init::user_data(id, Some(public), &settings.ssh_user).unwrap()
    );
    crate::qemu::cloud_init_schema(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
}
