//! `dormant adopt` SIGKILLed at every step of a take-over (`adopt:staged`
//! before the tag write, `adopt:tagged` before the record, `adopt:recorded`
//! after it, `adopt:announced` after its event), then run again (killed
//! after the tag write, the next run finishes that take-over with the staged
//! key and epoch, writing no tag again; before it, nothing changed): every
//! environment ends with exactly one record whose ownership epoch is the one
//! its tags carry (so it resumes) and exactly one `adopted` event of that
//! epoch, a third run adopts nothing, and the machine-mode environment still
//! resumes with the key printed before the loss.
//!
//! And the old host SIGKILLed in the middle of a suspension, at every step
//! of it (`suspend:*`, and the `volume:*` steps in volume mode), then a new
//! host with an empty state dir adopts: what the old host finished is
//! adopted at once; what it left running is left alone with the one command
//! that settles it, and once the operator ran it, adopt takes it over; the
//! key printed before resumes it with its file either way.
//!
//! Moto behind the proxy, the loopback sshd for every instance, the guest
//! seam for data volumes.

use crate::crash::{arm, assert_killed_at};
use crate::ec2_adopt::{adopt, resume_finds_the_file, suspend_one, SYSTEM};
use crate::ec2_rig::{block_on, instance_tags, instances, is_live};
use crate::ec2_rig::{key_field, volume, Ec2Env};
use crate::harness::{self, Rig};
use crate::moto::direct_client;
use aws_sdk_ec2::types::InstanceStateName;

/// The `adopted` events of `rig`'s log for environment key `key`: (reason).
fn adopted_events(rig: &Rig, key: &str) -> Vec<String> {
    let env_id = dormant::envkey::EnvironmentKey::parse(key)
        .unwrap()
        .env_id
        .to_string();
    let out = rig.dormant(&["events", "--json"]);
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|e| e["event"] == "adopted" && e["env"] == env_id.as_str())
        .map(|e| e["reason"].as_str().unwrap_or_default().to_string())
        .collect()
}

use std::os::unix::process::ExitStatusExt;

/// The epoch tags of the instance and the data volume, as EC2 shows them.
fn epochs(env: &Ec2Env, instance: &str, vol: &str) -> (Option<String>, Option<String>) {
    let v = volume(env, vol)
        .unwrap()
        .tags()
        .iter()
        .find(|t| t.key() == Some("dormant:epoch"))
        .and_then(|t| t.value().map(str::to_string));
    (
        instance_tags(env, instance).get("dormant:epoch").cloned(),
        v,
    )
}

#[test]
fn adopt_killed_at_every_step_then_run_again_takes_each_environment_over_once() {
    let env = Ec2Env::start();
    let settings = env.settings(&env.connect_address(), "");
    let machine_key = suspend_one(&env.rig("7", SYSTEM, &settings));
    let volume_key = suspend_one(&env.volume_rig("7", SYSTEM, &env.volume_settings("", "")));
    let instance = key_field(&machine_key, "instance").unwrap();
    let vol = key_field(&volume_key, "volume").unwrap();

    let mut last = None;
    for point in [
        "adopt:staged",
        "adopt:tagged",
        "adopt:recorded",
        "adopt:announced",
    ] {
        // A new host each time (a fresh state dir), killed in its first take-over.
        let mut new = env.rig("7", SYSTEM, &settings);
        arm(&mut new, Some(point), false);
        let epochs_before = epochs(&env, &instance, &vol);
        let out = new.dormant(&["adopt"]);
        assert_eq!(out.status.signal(), Some(9), "{point}: {out:?}");
        let epochs_killed = epochs(&env, &instance, &vol);
        arm(&mut new, None, false);
        let again = adopt(&new);
        let epochs_after = epochs(&env, &instance, &vol);
        match point {
            // Killed before the tag write: nothing changed in EC2.
            "adopt:staged" => assert_eq!(epochs_killed, epochs_before, "{point}"),
            // Killed after it: the next run finishes that take-over (the
            // staged key and epoch), no second write.
            "adopt:tagged" => {
                // The one the killed run wrote keeps that value (the other
                // one is adopted by this run, with a new epoch).
                let kept = |b: &Option<String>, k: &Option<String>, a: &Option<String>| {
                    (b != k).then_some(k == a)
                };
                let written: Vec<bool> = [
                    kept(&epochs_before.0, &epochs_killed.0, &epochs_after.0),
                    kept(&epochs_before.1, &epochs_killed.1, &epochs_after.1),
                ]
                .into_iter()
                .flatten()
                .collect();
                assert_eq!(
                    written,
                    [true],
                    "{point}: {epochs_before:?} {epochs_killed:?} {epochs_after:?}: {again}"
                );
                assert!(
                    again.contains("finishing the take-over of"),
                    "{point}: {again}"
                );
            }
            _ => {}
        }
        assert!(
            !new.state_dir.join("adopting").exists()
                || std::fs::read_dir(new.state_dir.join("adopting"))
                    .unwrap()
                    .count()
                    == 0,
            "{point}: no staged take-over left: {again}"
        );
        let third = adopt(&new);
        assert!(
            third.contains("adopted 0, left alone 2"),
            "{point}: nothing adopted twice: {third}"
        );
        let m = new
            .record(&machine_key)
            .unwrap_or_else(|| panic!("{point}: {again}"));
        let v = new
            .record(&volume_key)
            .unwrap_or_else(|| panic!("{point}: {again}"));
        assert_eq!(
            (&m["status"], &v["status"]),
            (&"suspended".into(), &"suspended".into())
        );
        assert_eq!(m["key"], machine_key.as_str(), "{point}");
        assert_eq!(v["key"], volume_key.as_str(), "{point}");
        // The record's epoch is the tags': the record can act on it.
        let tags = instance_tags(&env, &instance);
        assert_eq!(
            m["machine"]["fields"]["epoch"].as_str(),
            tags.get("dormant:epoch").map(String::as_str),
            "{point}: {m}"
        );
        let public =
            std::fs::read_to_string(new.env_dir(&machine_key).join("id_ed25519.pub")).unwrap();
        assert_eq!(
            tags.get("dormant:authorized-key").map(String::as_str),
            Some(public.trim()),
            "{point}: the tag holds the key of the record that stands"
        );
        let vtag = volume(&env, &vol)
            .unwrap()
            .tags()
            .iter()
            .find(|t| t.key() == Some("dormant:epoch"))
            .and_then(|t| t.value().map(str::to_string));
        assert_eq!(
            v["volume"]["volume"]["fields"]["epoch"].as_str(),
            vtag.as_deref(),
            "{point}: {v}"
        );
        // One `adopted` event each, of the take-over that stands.
        for (key, rec) in [(&machine_key, &m), (&volume_key, &v)] {
            let epoch = rec["machine"]["fields"]["epoch"]
                .as_str()
                .or(rec["volume"]["volume"]["fields"]["epoch"].as_str())
                .unwrap();
            let events = adopted_events(&new, key);
            assert_eq!(events.len(), 1, "{point}: {events:?}");
            assert!(
                events[0].contains(&format!("(ownership epoch {epoch})")),
                "{point}: {events:?}"
            );
            assert!(
                !new.env_dir(key).join("adopted.pending").exists(),
                "{point}: the marker goes once the event is written"
            );
        }
        if point == "adopt:recorded" {
            assert!(
                again.contains("recorded the adopted event of environment"),
                "{point}: {again}"
            );
        }
        last = Some(new);
    }
    // Nothing lost: the last host resumes it with the key printed before the loss.
    resume_finds_the_file(last.as_ref().unwrap(), &machine_key);
}

/// Stops (`stop`) or terminates an instance straight in the emulator, as the
/// operator's `aws ec2 ...` the adopt line names would.
fn operator_does(env: &Ec2Env, id: &str, stop: bool) {
    block_on(async {
        let c = direct_client(&env.moto.url());
        if stop {
            c.stop_instances().instance_ids(id).send().await.unwrap();
        } else {
            c.terminate_instances()
                .instance_ids(id)
                .send()
                .await
                .unwrap();
        }
    });
}

/// The running instances of environment `env_id`.
fn running_instances_of(env: &Ec2Env, env_id: &str) -> Vec<String> {
    instances(env)
        .into_iter()
        .filter(|i| i.state().and_then(|s| s.name()) == Some(&InstanceStateName::Running))
        .filter(|i| {
            i.tags()
                .iter()
                .any(|t| t.key() == Some("dormant:env") && t.value() == Some(env_id))
        })
        .filter_map(|i| i.instance_id().map(str::to_string))
        .collect()
}

#[test]
fn an_environment_left_mid_suspension_by_a_killed_host_is_adopted_consistently() {
    let env = Ec2Env::start();
    let machine = env.settings(&env.connect_address(), "");
    let volumes = env.volume_settings("", "");
    let mut cases: Vec<(&str, bool)> = vec![("suspend:intent", false), ("suspend:stopped", false)];
    for point in [
        "suspend:intent",
        "volume:detach-intent",
        "volume:detached",
        "volume:delete-machine-intent",
        "volume:machine-deleted",
        "suspend:stopped",
    ] {
        cases.push((point, true));
    }
    for (n, (point, volume_mode)) in cases.into_iter().enumerate() {
        // A system id of its own: each case is one old host and its replacement.
        let system = format!("s_{:012x}", 0xb0 + n);
        let rig = |s: &str| {
            if volume_mode {
                env.volume_rig("7", s, &volumes)
            } else {
                env.rig("7", s, &machine)
            }
        };
        let what = format!(
            "{point} ({})",
            if volume_mode {
                "volume mode"
            } else {
                "machine mode"
            }
        );
        let mut old = rig(&system);
        arm(&mut old, Some(point), true);
        let r = old.run(
            &harness::job(5)
                .suspend_on(true, false)
                .script("echo 'agent state' > progress.txt"),
        );
        assert_killed_at(&old, &r.calls, point, 1);
        let key = r
            .key
            .clone()
            .unwrap_or_else(|| panic!("{what}: {}", r.log()));
        let env_id = dormant::envkey::EnvironmentKey::parse(&key)
            .unwrap()
            .env_id
            .to_string();

        let new = rig(&system);
        let first = adopt(&new);
        let live = running_instances_of(&env, &env_id);
        let out = if let [instance] = live.as_slice() {
            // Left running by the old host: left alone, saying what to do.
            let (stop, command) = if volume_mode {
                (
                    false,
                    format!("aws ec2 terminate-instances --instance-ids {instance}"),
                )
            } else {
                (
                    true,
                    format!("aws ec2 stop-instances --instance-ids {instance}"),
                )
            };
            assert!(
                first.contains("adopted 0, left alone 1") && first.contains(&command),
                "{what}: {first}"
            );
            assert!(new.record(&key).is_none(), "{what}");
            operator_does(&env, instance, stop);
            adopt(&new)
        } else {
            assert!(live.is_empty(), "{what}: {live:?}");
            first
        };
        assert!(out.contains("adopted 1, left alone 0"), "{what}: {out}");
        assert!(out.contains(&format!("key {key}")), "{what}: {out}");
        // Which points leave it running is the old host's order of steps:
        // before the stop (machine) or before the instance is deleted (volume).
        let left_running = matches!(
            point,
            "suspend:intent"
                | "volume:detach-intent"
                | "volume:detached"
                | "volume:delete-machine-intent"
        );
        assert_eq!(live.len(), usize::from(left_running), "{what}: {live:?}");
        let rec = new.record(&key).unwrap();
        assert_eq!(rec["status"], "suspended", "{what}: {rec}");
        resume_finds_the_file(&new, &key);
        assert!(
            adopt(&new).contains("adopted 0, left alone 1"),
            "{what}: once"
        );
        if volume_mode {
            let vol = key_field(&key, "volume").unwrap();
            assert_eq!(
                volume(&env, &vol).unwrap().state().unwrap().as_str(),
                "available",
                "{what}"
            );
            let left: Vec<_> = instances(&env)
                .into_iter()
                .filter(is_live)
                .filter(|i| {
                    i.tags().iter().any(|t| {
                        t.key() == Some("dormant:env") && t.value() == Some(env_id.as_str())
                    })
                })
                .filter_map(|i| i.instance_id().map(str::to_string))
                .collect();
            assert!(left.is_empty(), "{what}: no instance left: {left:?}");
        }
    }
}
