//! EC2 volume mode under SIGKILL and its clean-up paths: every generic crash
//! point of `crash.rs` and every volume step (create, attach, detach, delete
//! the machine, delete the volume) killed on `ec2` in volume mode (moto
//! behind the proxy, the loopback sshd, the provider's guest seam), each
//! followed by the runner's next move, a later resume or `dormant sweep`.
//! After each: the file the first job wrote survives, a suspended
//! environment is its `available` volume alone (no instance), and no
//! instance or volume is left that no environment owns. Also: `sweep`
//! reports and (`--delete-orphans`) deletes a data volume no record knows,
//! TTL expiry and `release` delete the volume, `list` and `inspect` show it.

use crate::crash::*;
use crate::ec2_rig::{data_volumes, instances, is_live, key_field, volume, Ec2Env};
use crate::harness::*;

/// Every environment is in volume mode; a suspended one has no machine, its
/// volume detached and `available`; every data volume in the emulator
/// belongs to an environment with a record.
fn assert_volumes_settled(env: &Ec2Env, rig: &Rig, what: &str) {
    let envs = rig.state_dir.join("environments");
    let mut owned = Vec::new();
    for e in entries(envs.clone()) {
        let rec: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(envs.join(&e).join("record.json")).unwrap(),
        )
        .unwrap_or_else(|err| panic!("{what}: {e}: {err}"));
        assert_eq!(rec["storage"], "volume", "{what}: {rec}");
        if let Some(id) = rec["volume"]["volume"]["id"].as_str() {
            owned.push(id.to_string());
        }
        if rec["status"] == "suspended" {
            assert!(rec["machine"].is_null(), "{what}: {rec}");
            assert_eq!(rec["volume"]["step"], "detached", "{what}: {rec}");
            let id = rec["volume"]["volume"]["id"].as_str().unwrap();
            let v = volume(env, id).unwrap_or_else(|| panic!("{what}: volume {id} lost"));
            assert_eq!(v.state().map(|s| s.as_str()), Some("available"), "{what}");
        }
    }
    for v in data_volumes(env) {
        let id = v.volume_id().unwrap();
        assert!(
            owned.iter().any(|o| o == id),
            "{what}: volume {id} leaked (environments own {owned:?})"
        );
    }
}

fn ec2_volume_rig(env: &Ec2Env, runner: &str) -> Rig {
    env.volume_rig(runner, "s_0123456789ab", &env.volume_settings("", GRACE))
}

#[test]
fn every_crash_point_on_ec2_volume_mode() {
    let env = Ec2Env::start();
    let mut rig = ec2_volume_rig(&env, "36");
    let machines = Instances(env.moto.url());
    every_crash_point(&mut rig, &machines);
    assert_volumes_settled(&env, &rig, "generic scenarios");

    // A new job's prepare killed at each volume step; the runner cleans up
    // and retries: the job succeeds, suspended, its file kept.
    for point in [
        "volume:create-intent",
        "volume:created",
        "volume:attach-intent",
        "volume:attached",
    ] {
        arm(&mut rig, Some(point), true);
        let r = rig.run(&keeper());
        assert_result(&r, JobResult::Success);
        assert_eq!(r.prepare_attempts, 2, "{point}: killed once, retried once");
        assert_killed_at(&rig, &r.calls, point, 1);
        let key = r.key.clone().unwrap();
        assert_eq!(rig.status(&key).as_deref(), Some("suspended"), "{point}");
        assert_settled(&rig, &machines, point);
        assert_volumes_settled(&env, &rig, point);
        resume_and_release(&mut rig, &key, point);
        assert_settled(&rig, &machines, point);
        assert_volumes_settled(&env, &rig, point);
    }

    // The suspend killed at each volume step, then a sweep: suspended, the
    // instance terminated, the volume available, the file kept.
    for point in [
        "volume:detach-intent",
        "volume:detached",
        "volume:delete-machine-intent",
        "volume:machine-deleted",
    ] {
        arm(&mut rig, Some(point), true);
        let r = rig.run(&keeper());
        assert_killed_at(&rig, &r.calls, point, 1);
        let key = r.key.clone().unwrap();
        arm(&mut rig, None, false);
        let text = sweep(&rig);
        assert_eq!(
            rig.status(&key).as_deref(),
            Some("suspended"),
            "{point}: {text}"
        );
        assert!(
            machines.alive().is_empty(),
            "{point}: {:?}",
            machines.alive()
        );
        assert_volumes_settled(&env, &rig, point);
        resume_and_release(&mut rig, &key, point);
        assert_settled(&rig, &machines, point);
    }

    // A resume killed at each volume step; the runner cleans up (the new
    // instance is terminated again) and retries: resumed, the file there.
    for point in ["volume:attach-intent", "volume:attached"] {
        arm(&mut rig, None, false);
        let key = rig.run(&keeper()).key.unwrap();
        arm(&mut rig, Some(point), true);
        let r = rig.run(
            &job(5)
                .resume(&key)
                .suspend_on(true, false)
                .script("test \"$(cat kept.txt)\" = precious || exit 9"),
        );
        assert_result(&r, JobResult::Success);
        assert_eq!(r.prepare_attempts, 2, "{point}");
        assert_killed_at(&rig, &r.calls, point, 1);
        assert_eq!(rig.status(&key).as_deref(), Some("suspended"), "{point}");
        assert!(
            machines.alive().is_empty(),
            "{point}: {:?}",
            machines.alive()
        );
        assert_volumes_settled(&env, &rig, point);
        resume_and_release(&mut rig, &key, point);
        assert_settled(&rig, &machines, point);
    }

    // A resume killed after launching, before recording its instance, on
    // every attempt: each cleanup finds the instance by its tags and
    // terminates it; suspended, nothing left running.
    arm(&mut rig, None, false);
    let key = rig.run(&keeper()).key.unwrap();
    arm(&mut rig, Some("resume:started"), false);
    let r = rig.run(&job(5).resume(&key));
    assert_eq!(r.prepare_attempts, 3, "{}", r.log());
    assert_killed_at(&rig, &r.calls, "resume:started", 3);
    assert_eq!(rig.status(&key).as_deref(), Some("suspended"));
    assert!(machines.alive().is_empty(), "{:?}", machines.alive());
    assert_volumes_settled(&env, &rig, "resume killed after its launch");
    resume_and_release(&mut rig, &key, "resume killed after its launch");

    // A resumed job's suspend killed half-way, no sweep: a later resume, past
    // the grace, recovers it (detach, terminate) and runs with the file.
    for point in ["volume:detach-intent", "volume:machine-deleted"] {
        arm(&mut rig, None, false);
        let key = rig.run(&keeper()).key.unwrap();
        arm(&mut rig, Some(point), true);
        let r = rig.run(&job(5).resume(&key).suspend_on(true, false));
        assert_killed_at(&rig, &r.calls, point, 1);
        assert_eq!(rig.status(&key).as_deref(), Some("suspending"), "{point}");
        std::thread::sleep(PAST_GRACE);
        resume_and_release(&mut rig, &key, point);
        assert_settled(&rig, &machines, point);
        assert_volumes_settled(&env, &rig, point);
    }

    // A release killed between the instance and the volume, or after both:
    // a sweep finishes it; no volume is left.
    for point in ["release:deleted", "release:volume-deleted"] {
        arm(&mut rig, Some(point), true);
        let r = rig.run(&job(5));
        assert_killed_at(&rig, &r.calls, point, 1);
        let key = r.key.clone().unwrap();
        assert_eq!(rig.status(&key).as_deref(), Some("releasing"), "{point}");
        arm(&mut rig, None, false);
        let text = sweep(&rig);
        assert!(rig.status(&key).is_none(), "{point}: {text}");
        assert_settled(&rig, &machines, point);
        assert_volumes_settled(&env, &rig, point);
    }
    assert!(entries(rig.state_dir.join("environments")).is_empty());
    assert!(data_volumes(&env).is_empty(), "no volume left");
    assert!(
        instances(&env).iter().all(|i| !is_live(i)),
        "no instance left"
    );
}

/// `dormant sweep` reports a data volume of this runner manager that no
/// record knows and deletes it with `--delete-orphans`, leaving the volume of
/// a suspended environment alone; `list` and `inspect` show the mode and the
/// volume; `dormant release` deletes the volume; TTL expiry too.
#[test]
fn sweep_release_and_ttl_delete_volumes_and_orphans_are_found() {
    let env = Ec2Env::start();
    let rig = env.volume_rig("37", "s_0123456789ab", &env.volume_settings("", ""));
    let kept = rig.run(&keeper());
    assert_result(&kept, JobResult::Success);
    let key = kept.key.clone().unwrap();
    let vol = key_field(&key, "volume").unwrap();

    let list = String::from_utf8_lossy(&rig.dormant(&["list"]).stdout).to_string();
    assert!(list.contains(" volume "), "{list}");
    let inspect: serde_json::Value =
        serde_json::from_slice(&rig.dormant(&["inspect", &key]).stdout).unwrap();
    assert_eq!(inspect["storage"], "volume");
    assert_eq!(inspect["volume"]["volume"]["id"], vol.as_str(), "{inspect}");

    // An orphan: a data volume of this runner manager whose record is lost.
    let zone = volume(&env, &vol)
        .unwrap()
        .availability_zone()
        .unwrap()
        .to_string();
    let orphan_env = uuid::Uuid::new_v4();
    let orphan = crate::ec2_rig::block_on(async {
        let c = crate::moto::direct_client(&env.moto.url());
        let tag = |k: &str, v: &str| aws_sdk_ec2::types::Tag::builder().key(k).value(v).build();
        c.create_volume()
            .availability_zone(zone)
            .size(1)
            .tag_specifications(
                aws_sdk_ec2::types::TagSpecification::builder()
                    .resource_type(aws_sdk_ec2::types::ResourceType::Volume)
                    .tags(tag("dormant:managed-by", "dormant"))
                    .tags(tag("dormant:system", "s_0123456789ab"))
                    .tags(tag("dormant:volume", "data"))
                    .tags(tag("dormant:env", &orphan_env.to_string()))
                    .build(),
            )
            .send()
            .await
            .unwrap()
            .volume_id()
            .unwrap()
            .to_string()
    });
    let out = rig.dormant(&["sweep"]);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains(&format!("data volume {orphan}"))
            && text.contains("belongs to no environment")
            && !text.contains(&format!("data volume {vol}")),
        "{text}"
    );
    assert!(volume(&env, &orphan).is_some(), "only reported");
    let out = rig.dormant(&["sweep", "--delete-orphans"]);
    assert!(out.status.success(), "{out:?}");
    assert!(volume(&env, &orphan).is_none(), "deleted");
    // The event log says so.
    let out = rig.dormant(&["events", "--json"]);
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(
        lines.iter().any(|e| e["event"] == "released"
            && e["cause"] == "orphan"
            && e["reason"].as_str().is_some_and(|r| r.contains(&orphan))
            // The environment its tag names.
            && e["env"] == orphan_env.to_string().as_str()),
        "{lines:?}"
    );
    assert!(
        volume(&env, &vol).is_some(),
        "the suspended environment's volume is kept"
    );

    // release deletes the volume.
    let out = rig.dormant(&["release", &key]);
    assert!(out.status.success(), "{out:?}");
    assert!(volume(&env, &vol).is_none(), "released: volume deleted");
    assert!(rig.status(&key).is_none());

    // TTL: a suspended environment past suspend.ttl is released by the sweep.
    let r = rig.run(&keeper());
    let key = r.key.clone().unwrap();
    let vol = key_field(&key, "volume").unwrap();
    let store = dormant::state::StateStore::open(&rig.state_dir).unwrap();
    let id = dormant::envkey::EnvironmentKey::parse(&key).unwrap().env_id;
    // Suspended eight days ago (the default TTL is seven).
    dormant::state::testing::backdate(&store, id, 8 * 86400).unwrap();
    let out = rig.dormant(&["sweep"]);
    assert!(out.status.success(), "{out:?}");
    assert!(rig.status(&key).is_none(), "expired");
    assert!(volume(&env, &vol).is_none(), "expired: volume deleted");
    assert!(instances(&env).iter().all(|i| !is_live(i)));
}
