//! Volume mode on EC2 when the machine goes away: an instance terminated
//! under a running job (as a spot reclaim does) is a machine lost — a system
//! failure that keeps the environment's volume — and spot in volume mode,
//! with and without the on-demand fallback. Through the built binary,
//! against moto behind the test proxy, SSH to the loopback sshd, and the
//! provider's guest seam (`provider/ec2/guest_seam.rs`).
//!
//! Network rule: the instance addresses moto hands out are never contacted.

use crate::ec2_rig::{block_on, data_volumes, instances, is_live, key_field, volume, Ec2Env};
use crate::harness::{self, assert_result, JobResult};
use crate::moto::{direct_client, Shortage};

/// A hook appending each notification to `<dir>/docs.jsonl`.
fn recorder(dir: &std::path::Path) -> (String, std::path::PathBuf) {
    use std::os::unix::fs::PermissionsExt;
    let out = dir.join("docs.jsonl");
    let hook = dir.join("record.sh");
    std::fs::write(&hook, format!("#!/bin/sh\ncat >> {}\n", out.display())).unwrap();
    std::fs::set_permissions(&hook, std::fs::Permissions::from_mode(0o755)).unwrap();
    (hook.display().to_string(), out)
}

/// Spot reclaims the instance under a running job (here: the test
/// terminates it in the emulator and cuts the SSH connections, as the
/// instance's disappearance would): the job ends as a system failure, the
/// environment is kept as its volume (the job's failure trigger is set), the
/// hook says `machine lost`, and a later job resumes it on a new instance.
#[test]
fn an_instance_terminated_under_a_job_is_a_machine_lost_and_its_volume_is_kept() {
    let env = Ec2Env::start();
    let (hook, docs) = recorder(env.host_dir.path());
    let rig = env.volume_rig(
        "7",
        "s_0123456789ab",
        &env.volume_settings(
            "market = \"spot\"\n",
            &format!("[suspend]\nnotify_command = [\"{hook}\"]\n"),
        ),
    );
    let started = env.host_dir.path().join("started");
    let job = harness::job(5).suspend_on(false, true).script(&format!(
        "echo precious > kept.txt; sync; touch {}; sleep 60",
        started.display()
    ));
    let r = std::thread::scope(|s| {
        s.spawn(|| {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
            while !started.exists() {
                assert!(
                    std::time::Instant::now() < deadline,
                    "the job never started"
                );
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            let live: Vec<String> = instances(&env)
                .iter()
                .filter(|i| is_live(i))
                .filter_map(|i| i.instance_id().map(str::to_string))
                .collect();
            assert_eq!(live.len(), 1, "{live:?}");
            block_on(async {
                direct_client(&env.moto.url())
                    .terminate_instances()
                    .instance_ids(&live[0])
                    .send()
                    .await
                    .unwrap();
            });
            env.sshd.cut_connections();
        });
        rig.run(&job)
    });
    assert_eq!(r.result, JobResult::SystemFailure, "{}", r.log());
    let key = r.key.clone().unwrap();
    let log = r.log();
    assert!(
        log.contains("machine lost: machine i-") && log.contains("is gone"),
        "{log}"
    );
    assert!(
        r.cleanup_output().contains("went away under it"),
        "{}",
        r.cleanup_output()
    );
    assert_eq!(rig.status(&key).as_deref(), Some("suspended"), "{log}");
    let vol = key_field(&key, "volume").unwrap();
    let v = volume(&env, &vol).expect("the volume is kept");
    assert_eq!(v.state().map(|s| s.as_str()), Some("available"));
    let notes = std::fs::read_to_string(&docs).unwrap_or_default();
    let suspend: serde_json::Value = notes
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .find(|d| d["event"] == "suspend")
        .unwrap_or_else(|| panic!("a suspend notification: {notes}"));
    assert_eq!(suspend["reason"], "machine lost", "{suspend}");
    // And the event log: suspended, cause machine_lost.
    let out = rig.dormant(&["events", "--json", &key]);
    let events: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(
        events
            .iter()
            .any(|e| e["event"] == "suspended" && e["cause"] == "machine_lost"),
        "{events:?}"
    );

    let r2 = rig.run(
        &harness::job(5)
            .resume(&key)
            .script("test \"$(cat kept.txt)\" = precious || exit 9"),
    );
    assert_result(&r2, JobResult::Success);
    assert!(
        volume(&env, &vol).is_none(),
        "released after the resumed job"
    );
}

/// Spot in volume mode: no spot capacity and no fallback is a visible wait
/// that names the setting, and nothing is left (not even a volume: the
/// volume is made beside the first machine); with the fallback the job runs
/// on-demand; a later resume with spot capacity back gets a spot instance.
#[test]
fn spot_in_volume_mode_waits_or_falls_back_to_on_demand_as_allowed() {
    let env = Ec2Env::start();
    let rig = env.volume_rig(
        "7",
        "s_0123456789ab",
        &env.volume_settings("market = \"spot\"\nprepare_timeout = \"5s\"\n", ""),
    );
    env.proxy.no_capacity(Shortage::spot());
    let r = rig.run(&harness::job(5).suspend_on(true, false).script("true"));
    assert_eq!(r.result, JobResult::SystemFailure, "{}", r.log());
    assert!(
        r.log()
            .contains("waiting for capacity: EC2 InsufficientInstanceCapacity")
            && r.log()
                .contains("ec2.on_demand_fallback = true would launch on-demand"),
        "{}",
        r.log()
    );
    assert!(
        instances(&env).iter().all(|i| !is_live(i)),
        "no instance left"
    );
    assert!(
        data_volumes(&env).is_empty(),
        "no volume made without a machine"
    );
    assert!(
        env.proxy
            .calls()
            .iter()
            .filter(|c| c.action == "RunInstances")
            .all(|c| c.body.contains("InstanceMarketOptions.MarketType=spot")),
        "spot only"
    );

    // The fallback on, and room for a slow machine in the prepares that must
    // succeed (the short bound was for the wait above only).
    let text = std::fs::read_to_string(&rig.settings_path).unwrap();
    let next = text
        .replace(
            "market = \"spot\"\n",
            "market = \"spot\"\non_demand_fallback = true\n",
        )
        .replace("prepare_timeout = \"5s\"", "prepare_timeout = \"2m\"");
    assert!(next.contains("on_demand_fallback") && next.contains("\"2m\""));
    std::fs::write(&rig.settings_path, next).unwrap();
    let r = rig.run(
        &harness::job(5)
            .suspend_on(true, false)
            .script("echo kept > kept.txt"),
    );
    assert_result(&r, JobResult::Success);
    assert!(r.log().contains("(ec2.on_demand_fallback)"), "{}", r.log());
    let first = instances(&env).last().cloned().unwrap();
    assert_eq!(first.instance_lifecycle(), None, "on-demand");
    let key = r.key.clone().unwrap();

    env.proxy.capacity_back();
    let r = rig.run(&harness::job(5).resume(&key).script("cat kept.txt"));
    assert_result(&r, JobResult::Success);
    let second = instances(&env).last().cloned().unwrap();
    assert_eq!(
        second.instance_lifecycle(),
        Some(&aws_sdk_ec2::types::InstanceLifecycleType::Spot),
        "a resume launches anew: spot again"
    );
}
