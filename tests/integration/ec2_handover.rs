//! What a replacement runner-manager host needs to take an environment over
//! is kept in the cloud (`provider/ec2/handover.rs`), proven through the
//! built binary against moto behind the test proxy, SSH to the loopback
//! sshd: a machine-mode instance carries the host key its first connection
//! pinned and its suspension time; a volume-mode data volume carries its
//! ownership epoch and suspension time.
//!
//! Network rule: the instance addresses moto hands out are never contacted.

use std::collections::BTreeMap;

use crate::ec2_rig::{instance_tags, instances, key_field, volume, Ec2Env};
use crate::harness::{self, assert_result, JobResult};

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// `dormant:suspended-at` as a number within `[from, to]`.
fn assert_suspended_within(tags: &BTreeMap<String, String>, from: u64, to: u64) {
    let at: u64 = tags
        .get("dormant:suspended-at")
        .unwrap_or_else(|| panic!("dormant:suspended-at is set: {tags:?}"))
        .parse()
        .unwrap_or_else(|_| panic!("dormant:suspended-at is unix seconds: {tags:?}"));
    assert!(
        (from..=to).contains(&at),
        "suspended at {at}, not within the job ({from}..={to})"
    );
}

#[test]
fn a_machine_mode_instance_keeps_its_pinned_host_key_and_suspension_time() {
    let env = Ec2Env::start();
    let rig = env.rig(
        "7",
        "s_0123456789ab",
        &env.settings(&env.connect_address(), ""),
    );
    let before = now();
    let r = rig.run(
        &harness::job(5)
            .suspend_on(true, false)
            .script("echo 'agent state' > progress.txt"),
    );
    assert_result(&r, JobResult::Success);
    let after = now();
    let key = r.key.clone().expect("the key is printed");
    let id = key_field(&key, "instance").unwrap_or_else(|| panic!("{key}"));
    let tags = instance_tags(&env, &id);

    // The key the first connection pinned is the loopback sshd's (the machine's).
    let host = env.sshd.host_public_key();
    let mut f = host.split_whitespace();
    let pinned = format!("{} {}", f.next().unwrap(), f.next().unwrap());
    assert_eq!(
        tags.get("dormant:host-key"),
        Some(&pinned),
        "the pinned host key is kept on the instance: {tags:?}"
    );
    let recorded = std::fs::read_to_string(rig.env_dir(&key).join("known_hosts")).unwrap();
    assert!(recorded.contains(&pinned), "{recorded}");
    assert_suspended_within(&tags, before, after);
    assert_eq!(tags.get("dormant:epoch").map(String::as_str), Some("1"));
    let public = std::fs::read_to_string(rig.env_dir(&key).join("id_ed25519.pub")).unwrap();
    assert_eq!(
        tags.get("dormant:authorized-key").map(String::as_str),
        Some(public.trim()),
        "the boot hook's key is the environment's"
    );
}

#[test]
fn a_data_volume_keeps_its_epoch_and_suspension_time() {
    let env = Ec2Env::start();
    let rig = env.volume_rig("7", "s_0123456789ab", &env.volume_settings("", ""));
    let before = now();
    let r = rig.run(
        &harness::job(5)
            .suspend_on(true, false)
            .script("echo 'agent state' > progress.txt"),
    );
    assert_result(&r, JobResult::Success);
    let after = now();
    let key = r.key.clone().expect("a key");
    let vol = key_field(&key, "volume").unwrap_or_else(|| panic!("{key}"));
    let v = volume(&env, &vol).expect("the data volume is kept");
    let tags: BTreeMap<String, String> = v
        .tags()
        .iter()
        .map(|t| (t.key().unwrap().to_string(), t.value().unwrap().to_string()))
        .collect();
    assert_eq!(tags.get("dormant:epoch").map(String::as_str), Some("1"));
    assert_suspended_within(&tags, before, after);
    // A volume-mode machine is never entered by another host: no way back in.
    for i in instances(&env) {
        let t: Vec<_> = i.tags().iter().filter_map(|t| t.key()).collect();
        assert!(
            !t.contains(&"dormant:entry") && !t.contains(&"dormant:authorized-key"),
            "{t:?}"
        );
    }
}
