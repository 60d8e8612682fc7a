//! What `dormant adopt` adopts and what it leaves alone, over the states a
//! lost host can leave an environment in.

use std::collections::BTreeMap;

use super::*;

const ED: &str = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIJb5kG0r9Yd7m1t8j1oT0p9H2l9mX0c6w2k8b0a1c2d3";

fn env() -> Uuid {
    Uuid::from_u128(0x1234)
}

fn base_tags(runner: &str) -> BTreeMap<String, String> {
    [
        (tag::MANAGED_BY, tag::MANAGED_BY_VALUE),
        (tag::ENV, &env().to_string()),
        (tag::RUNNER, runner),
        (tag::SYSTEM, "s_1"),
        (tag::PROJECT, "5"),
        (tag::JOB, "77"),
        (handover::tag::EPOCH, "1"),
        (handover::tag::SUSPENDED_AT, "1700000000"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect()
}

fn instance(state: MachineState, name: &str, tags: BTreeMap<String, String>) -> InstanceInfo {
    InstanceInfo {
        id: "i-1".into(),
        state,
        state_name: name.into(),
        tags,
        private_ip: Some("10.0.0.5".into()),
        public_ip: None,
        launched_at: Some(1_600_000_000),
        state_reason: None,
        state_reason_code: None,
        instance_type: Some("t3.medium".into()),
        zone: Some("us-east-1a".into()),
        subnet_id: None,
        spot: false,
    }
}

fn enterable(runner: &str) -> BTreeMap<String, String> {
    let mut t = base_tags(runner);
    t.insert(
        handover::tag::ENTRY.into(),
        handover::tag::ENTRY_IMDS_KEY.into(),
    );
    t.insert(handover::tag::HOST_KEY.into(), ED.into());
    t
}

fn data_volume(state: &str, attached_to: Option<&str>) -> VolumeInfo {
    let mut tags = base_tags("7");
    tags.insert(tag::VOLUME.into(), tag::VOLUME_DATA.into());
    VolumeInfo {
        id: "vol-1".into(),
        state: state.into(),
        zone: "us-east-1a".into(),
        size_gb: Some(20),
        tags,
        attachments: attached_to
            .map(|i| vec![(i.to_string(), "attached".to_string())])
            .unwrap_or_default(),
        created_at: Some(1_600_000_000),
    }
}

fn left_why(f: &Found) -> String {
    assert!(f.adoptable.is_empty(), "{:?}", f.adoptable);
    assert_eq!(f.left.len(), 1, "{:?}", f.left);
    f.left[0].why.clone()
}

#[test]
fn a_stopped_enterable_instance_is_adopted_with_its_tags() {
    let f = classify(
        "us-east-1",
        vec![instance(MachineState::Stopped, "stopped", enterable("7"))],
        vec![],
        None,
    );
    assert!(f.left.is_empty(), "{:?}", f.left);
    let a = &f.adoptable[0];
    assert_eq!(
        (
            a.env_id,
            a.runner_id.as_str(),
            a.project_id,
            a.job_id,
            a.epoch
        ),
        (env(), "7", 5, 77, 1)
    );
    assert_eq!(a.suspended_at, Some(1_700_000_000));
    let Held::Machine { entry, info, .. } = &a.what else {
        panic!("{:?}", a.what)
    };
    assert_eq!(entry.host_key, ED);
    assert_eq!(info.id, "i-1");
}

#[test]
fn an_instance_in_use_or_in_between_is_left_alone_saying_what_to_do() {
    for (state, name, says) in [
        (MachineState::Running, "running", "aws ec2 stop-instances"),
        (
            MachineState::Pending,
            "pending",
            "being started or stopped right now",
        ),
        (
            MachineState::Stopping,
            "stopping",
            "being started or stopped right now",
        ),
    ] {
        let f = classify(
            "r",
            vec![instance(state, name, enterable("7"))],
            vec![],
            None,
        );
        let why = left_why(&f);
        assert!(why.contains(says), "{name}: {why}");
    }
    let mut hibernated = instance(MachineState::Stopped, "stopped", enterable("7"));
    hibernated.state_reason =
        Some("Client.UserInitiatedHibernate: User initiated hibernate".into());
    let why = left_why(&classify("r", vec![hibernated], vec![], None));
    assert!(why.contains("hibernated"), "{why}");
}

#[test]
fn an_instance_made_before_the_hand_over_tags_is_reported_not_enterable() {
    let f = classify(
        "r",
        vec![instance(MachineState::Stopped, "stopped", base_tags("7"))],
        vec![],
        None,
    );
    let why = left_why(&f);
    assert!(
        why.contains("instance i-1")
            && why.contains("made before dormant could hand environments over"),
        "{why}"
    );
    assert_eq!(f.left[0].env_id, Some(env()));
}

#[test]
fn another_runners_environment_and_bad_tags_are_left_alone() {
    let f = classify(
        "r",
        vec![instance(MachineState::Stopped, "stopped", enterable("8"))],
        vec![],
        Some("7"),
    );
    assert!(left_why(&f).contains("runner \"8\""), "{:?}", f.left);
    // Without runner_id every runner of this system id is this host's.
    let f = classify(
        "r",
        vec![instance(MachineState::Stopped, "stopped", enterable("8"))],
        vec![],
        None,
    );
    assert_eq!(f.adoptable.len(), 1);

    for (k, v, says) in [
        (
            tag::PROJECT,
            "five",
            "dormant:project is \"five\", not a number",
        ),
        (handover::tag::EPOCH, "x", "dormant:epoch is \"x\""),
        (handover::tag::SUSPENDED_AT, "", "dormant:suspended-at"),
        (tag::RUNNER, "7/8", "not a runner id"),
        (tag::ENV, "not-a-uuid", "not an environment id"),
    ] {
        let mut t = enterable("7");
        t.insert(k.to_string(), v.to_string());
        let why = left_why(&classify(
            "r",
            vec![instance(MachineState::Stopped, "stopped", t)],
            vec![],
            None,
        ));
        assert!(why.contains(says), "{k}: {why}");
    }
}

#[test]
fn a_volume_is_adopted_only_when_available_and_alone() {
    let f = classify(
        "us-east-1",
        vec![],
        vec![data_volume("available", None)],
        None,
    );
    assert!(f.left.is_empty(), "{:?}", f.left);
    let Held::Volume { volume } = &f.adoptable[0].what else {
        panic!()
    };
    assert_eq!(volume.id, "vol-1");
    assert_eq!(volume.field("zone"), Some("us-east-1a"));
    assert_eq!(volume.field("region"), Some("us-east-1"));

    let why = left_why(&classify(
        "r",
        vec![],
        vec![data_volume("in-use", Some("i-1"))],
        None,
    ));
    assert!(why.contains("in-use, not available"), "{why}");
    // Detached, but an instance of it is left: a suspension or a resume cut short.
    let why = left_why(&classify(
        "r",
        vec![instance(MachineState::Running, "running", base_tags("7"))],
        vec![data_volume("available", None)],
        None,
    ));
    assert!(
        why.contains("instance i-1 (running) of it still exists")
            && why.contains("terminate-instances"),
        "{why}"
    );
}
