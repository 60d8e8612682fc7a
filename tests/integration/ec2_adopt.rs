//! `dormant adopt`: a replacement runner-manager host (same system id, an
//! empty state dir) takes over the suspended environments of the host it
//! replaces, and the keys printed before the loss resume them there. Through
//! the built binary against moto behind the test proxy, SSH to the loopback
//! sshd (the `CloudInit` stand-in plays the boot hook: at every boot after the
//! first it makes the key of the `dormant:authorized-key` tag the one authorized).
//!
//! Network rule: the instance addresses moto hands out are never contacted.

use std::process::Output;

use crate::ec2_rig::{
    instance_state, instance_tags, instances, is_live, key_field, volume, Ec2Env,
};
use crate::harness::{self, assert_result, JobResult, Rig};

pub(crate) const SYSTEM: &str = "s_0123456789ab";

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

pub(crate) fn adopt(rig: &Rig) -> String {
    let out = rig.dormant(&["adopt"]);
    let t = text(&out);
    assert!(out.status.success(), "dormant adopt failed: {t}");
    t
}

/// Whether the loopback sshd (every instance) lets `private_key` log in as
/// root, as the old host's own `ssh` would try it.
pub(crate) fn ssh_logs_in(port: u16, private_key: &std::path::Path) -> bool {
    let out = std::process::Command::new("ssh")
        .args([
            "-F",
            "/dev/null",
            "-o",
            "BatchMode=yes",
            "-o",
            "IdentitiesOnly=yes",
            "-o",
            "IdentityAgent=none",
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
            "-o",
            "ConnectTimeout=20",
            "-i",
        ])
        .arg(private_key)
        .args(["-p", &port.to_string(), "root@127.0.0.1", "true"])
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    match out.status.code() {
        Some(0) => true,
        Some(255) if String::from_utf8_lossy(&out.stderr).contains("Permission denied") => false,
        _ => panic!("ssh neither logged in nor was refused: {out:?}"),
    }
}

pub(crate) fn suspend_one(rig: &Rig) -> String {
    let r = rig.run(
        &harness::job(5)
            .suspend_on(true, false)
            .script("echo 'agent state' > progress.txt"),
    );
    assert_result(&r, JobResult::Success);
    r.key.clone().expect("the key is printed")
}

/// A resume with the key printed before the loss: the file is there and
/// `get_sources` is skipped; suspended again afterwards.
pub(crate) fn resume_finds_the_file(rig: &Rig, key: &str) {
    let mut job = harness::job(5)
        .resume(key)
        .suspend_on(true, false)
        .script("cat progress.txt; test ! -e .fetched-again");
    job.get_sources = "touch .fetched-again".into();
    let r = rig.run(&job);
    assert_result(&r, JobResult::Success);
    assert!(r.log().contains("agent state"), "{}", r.log());
    assert!(r.log().contains("skipping get_sources"), "{}", r.log());
}

#[test]
fn a_new_host_adopts_a_machine_mode_environment_and_the_old_key_resumes_it() {
    let env = Ec2Env::start();
    let settings = env.settings(&env.connect_address(), "");
    let old = env.rig("7", SYSTEM, &settings);
    let key = suspend_one(&old);
    let id = key_field(&key, "instance").unwrap();
    let old_rec = old.record(&key).unwrap();
    // Another runner manager's environment in the same account and region.
    let other = env.rig("7", "s_other", &settings);
    let other_key = suspend_one(&other);
    let other_id = key_field(&other_key, "instance").unwrap();
    let old_key_file = old.env_dir(&key).join("id_ed25519");
    assert!(
        ssh_logs_in(env.sshd.port, &old_key_file),
        "before the take-over the old host's key logs in"
    );

    // The host is replaced: same settings, same system id, empty state dir.
    let new = env.rig("7", SYSTEM, &settings);
    let out = adopt(&new);
    let env_id = dormant::envkey::EnvironmentKey::parse(&key).unwrap().env_id;
    assert!(
        out.contains(&format!(
            "adopted environment {env_id} (machine mode, instance {id}"
        )) && out.contains(&format!("key {key}")),
        "the key printed before the loss, rebuilt exactly: {out}"
    );
    assert!(out.contains("adopted 1, left alone 0"), "{out}");
    assert!(
        !out.contains(&other_id),
        "another system id's is never looked at: {out}"
    );
    assert_eq!(
        instance_tags(&env, &other_id)
            .get("dormant:epoch")
            .map(String::as_str),
        Some("1")
    );
    let rec = new.record(&key).expect("the record is rebuilt");
    assert_eq!(rec["status"], "suspended", "{rec}");
    assert_eq!(rec["key"], key.as_str(), "{rec}");
    assert_eq!(rec["project_id"], 5, "{rec}");
    // The TTL counts from the original suspension (the tag, written just before the stop).
    let (was, is) = (
        old_rec["suspended_at"].as_u64().unwrap(),
        rec["suspended_at"].as_u64().unwrap(),
    );
    assert!(is <= was && was - is <= 60, "original {was}, adopted {is}");
    let tags = instance_tags(&env, &id);
    // Epoch 2 with this run's owner id, the record's own value.
    let epoch = tags.get("dormant:epoch").cloned().unwrap_or_default();
    assert!(epoch.starts_with("2/") && epoch.len() > 2, "{tags:?}");
    assert_eq!(
        rec["machine"]["fields"]["epoch"].as_str(),
        Some(epoch.as_str()),
        "{rec}"
    );
    let public = std::fs::read_to_string(new.env_dir(&key).join("id_ed25519.pub")).unwrap();
    assert_eq!(
        tags.get("dormant:authorized-key").map(String::as_str),
        Some(public.trim()),
        "the new host's key, for the boot hook"
    );
    let pinned = std::fs::read_to_string(new.env_dir(&key).join("known_hosts")).unwrap();
    assert!(
        pinned.contains(tags.get("dormant:host-key").unwrap()),
        "pinned from the tag: {pinned}"
    );
    let events = text(&new.dormant(&["events", "--json"]));
    assert!(
        events.contains("\"event\":\"adopted\"") && events.contains(&env_id.to_string()),
        "{events}"
    );

    // Idempotent: a second run adopts nothing and says why.
    let again = adopt(&new);
    assert!(
        again.contains("adopted 0, left alone 1")
            && again.contains("a record on this host knows it"),
        "{again}"
    );
    assert_eq!(
        instance_tags(&env, &id).get("dormant:epoch"),
        Some(&epoch),
        "not taken again"
    );

    // The key the orchestrator held resumes it on the new host.
    resume_finds_the_file(&new, &key);
    // That boot replaced the old host's key: sshd itself refuses it now, the
    // new host's logs in.
    assert!(
        !ssh_logs_in(env.sshd.port, &old_key_file),
        "the old host's key is revoked by the boot after the take-over"
    );
    assert!(ssh_logs_in(
        env.sshd.port,
        &new.env_dir(&key).join("id_ed25519")
    ));

    // The old host comes back with its stale record: refused before any start.
    let stale = old.run(&harness::job(5).resume(&key).script("true"));
    assert!(
        stale.result != JobResult::Success
            && stale
                .log()
                .contains("another runner-manager host has taken this environment over"),
        "{}",
        stale.log()
    );
    assert_eq!(instance_state(&env.moto.url(), &id).as_str(), "stopped");

    // A third host adopts it, and the machine's host key has changed meanwhile:
    // the first resume checks it against the key pinned at creation, never
    // trusting the new one.
    let third = env.rig("7", SYSTEM, &settings);
    let out = adopt(&third);
    assert!(out.contains("adopted 1"), "{out}");
    let mut sshd = env.sshd;
    sshd.swap_host_key();
    let moto_url = env.moto.url();
    let r = third.run(&harness::job(5).resume(&key).script("true"));
    assert!(
        r.result != JobResult::Success && r.log().contains("host key"),
        "{}",
        r.log()
    );
    assert_eq!(third.status(&key).as_deref(), Some("suspended"));
    // `release` works on an adopted environment: the instance is terminated.
    let out = third.dormant(&["release", &key]);
    assert!(out.status.success(), "{}", text(&out));
    let gone = instance_state(&moto_url, &id);
    let gone = gone.as_str();
    assert!(gone == "terminated" || gone == "shutting-down", "{gone}");
}

#[test]
fn a_new_host_adopts_a_volume_mode_environment_and_the_old_key_resumes_it() {
    let env = Ec2Env::start();
    let settings = env.volume_settings("", "");
    let old = env.volume_rig("7", SYSTEM, &settings);
    let key = suspend_one(&old);
    let vol = key_field(&key, "volume").unwrap();

    let new = env.volume_rig("7", SYSTEM, &settings);
    let out = adopt(&new);
    let env_id = dormant::envkey::EnvironmentKey::parse(&key).unwrap().env_id;
    assert!(
        out.contains(&format!(
            "adopted environment {env_id} (volume mode, data volume {vol}"
        )) && out.contains(&format!("key {key}")),
        "{out}"
    );
    let v = volume(&env, &vol).unwrap();
    let epoch = v
        .tags()
        .iter()
        .find(|t| t.key() == Some("dormant:epoch"))
        .and_then(|t| t.value());
    assert!(epoch.is_some_and(|e| e.starts_with("2/")), "{epoch:?}");
    assert!(adopt(&new).contains("adopted 0, left alone 1"));

    resume_finds_the_file(&new, &key);

    // The old host's stale record: refused at the volume, which stays the new host's.
    let launched_before = instances(&env).len();
    let stale = old.run(&harness::job(5).resume(&key).script("true"));
    assert!(
        stale.result != JobResult::Success
            && stale
                .log()
                .contains("another runner-manager host has taken this environment over"),
        "{}",
        stale.log()
    );
    assert_eq!(
        volume(&env, &vol).unwrap().state().unwrap().as_str(),
        "available"
    );
    // The instance its refused attempt launched before the refusal is
    // terminated: nothing of the old host's runs on.
    assert!(
        instances(&env).len() > launched_before,
        "the refused resume launched an instance before the attach was refused"
    );
    let live: Vec<_> = instances(&env)
        .into_iter()
        .filter(is_live)
        .filter_map(|i| i.instance_id().map(str::to_string))
        .collect();
    assert!(live.is_empty(), "leaked by the refused resume: {live:?}");
    assert_eq!(old.status(&key).as_deref(), Some("suspended"));
    // The new host still resumes it.
    resume_finds_the_file(&new, &key);
}

/// A record here that cannot be read (a damaged disk, a half-restored
/// backup) is moved into `quarantine/` — never deleted nor overwritten —
/// and rebuilt from the cloud; the key printed before resumes it. Both modes.
#[test]
fn an_unreadable_record_is_moved_aside_and_rebuilt_from_the_cloud() {
    let env = Ec2Env::start();
    let machine = env.settings(&env.connect_address(), "");
    let volumes = env.volume_settings("", "");
    for (mode, system, settings, volume_mode) in [
        ("machine mode", "s_0000000000a1", &machine, false),
        ("volume mode", "s_0000000000a2", &volumes, true),
    ] {
        let rig = |s: &str| {
            if volume_mode {
                env.volume_rig("7", s, settings)
            } else {
                env.rig("7", s, settings)
            }
        };
        let old = rig(system);
        let key = suspend_one(&old);
        let env_id = dormant::envkey::EnvironmentKey::parse(&key).unwrap().env_id;
        // The new host's state dir holds a copy of the old one's directory of
        // it, with a damaged record.
        let new = rig(system);
        let dir = new.state_dir.join("environments").join(env_id.to_string());
        std::fs::create_dir_all(&dir).unwrap();
        for f in std::fs::read_dir(old.env_dir(&key)).unwrap().flatten() {
            if f.file_type().unwrap().is_file() {
                std::fs::copy(f.path(), dir.join(f.file_name())).unwrap();
            }
        }
        let damaged = b"{\"v\": 2, \"id\": \"trunc";
        std::fs::write(dir.join("record.json"), damaged).unwrap();
        if !volume_mode {
            // A process holds its record lock: nothing is moved, the take-over fails.
            let held = std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(dir.join("record.lock"))
                .unwrap();
            held.lock().unwrap();
            let out = new.dormant(&["adopt"]);
            let t = text(&out);
            assert_eq!(out.status.code(), Some(2), "{mode}: {t}");
            assert!(
                t.contains("holds its lock") && t.contains("not adopted"),
                "{mode}: {t}"
            );
            assert_eq!(std::fs::read(dir.join("record.json")).unwrap(), damaged);
            assert!(!new.state_dir.join("quarantine").exists(), "{mode}: {t}");
            drop(held);
        }

        let out = adopt(&new);
        assert!(
            out.contains(&format!("adopted environment {env_id} ({mode}"))
                && out.contains(&format!("key {key}"))
                && out.contains("could not be read")
                && out.contains("adopted 1, left alone 0"),
            "{mode}: {out}"
        );
        let kept: Vec<_> = std::fs::read_dir(new.state_dir.join("quarantine"))
            .unwrap_or_else(|e| panic!("{mode}: no quarantine dir: {e}: {out}"))
            .flatten()
            .map(|e| e.path())
            .collect();
        assert_eq!(kept.len(), 1, "{mode}: {kept:?}");
        let name = kept[0].file_name().unwrap().to_string_lossy().to_string();
        assert!(name.starts_with(&format!("{env_id}-")), "{mode}: {name}");
        assert!(
            out.contains(&kept[0].display().to_string()),
            "{mode}: {out}"
        );
        assert_eq!(
            std::fs::read(kept[0].join("record.json")).unwrap(),
            damaged,
            "{mode}: the unreadable record is kept as it was"
        );
        let rec = new.record(&key).expect("rebuilt");
        assert_eq!(rec["status"], "suspended", "{mode}: {rec}");
        let events = text(&new.dormant(&["events", "--json"]));
        assert!(
            events.contains("\"event\":\"adopted\"") && events.contains(&name),
            "{mode}: the event says where the record went: {events}"
        );
        assert!(
            adopt(&new).contains("adopted 0, left alone 1"),
            "{mode}: once"
        );
        resume_finds_the_file(&new, &key);
    }
}

/// Credentials the region refuses (UnauthorizedOperation, as EC2 answers an
/// identity without the permission): adopt fails with the operator's exit
/// code for a system failure, names the action's IAM permission and what it
/// was doing, and changes nothing; granted, the same adopt takes it over.
#[test]
fn adopt_without_permissions_names_the_permission_and_changes_nothing() {
    let env = Ec2Env::start();
    let settings = env.settings(&env.connect_address(), "");
    let key = suspend_one(&env.rig("7", SYSTEM, &settings));
    let id = key_field(&key, "instance").unwrap();
    let new = env.rig("7", SYSTEM, &settings);
    let nothing_changed = |what: &str| {
        assert_eq!(
            instance_tags(&env, &id)
                .get("dormant:epoch")
                .map(String::as_str),
            Some("1"),
            "{what}"
        );
        let left: Vec<_> = std::fs::read_dir(new.state_dir.join("environments"))
            .map(|d| d.flatten().map(|e| e.file_name()).collect())
            .unwrap_or_default();
        assert!(left.is_empty(), "{what}: {left:?}");
        assert!(new.record(&key).is_none(), "{what}");
    };
    for (action, doing) in [
        (
            "DescribeInstances",
            format!("listing the instances of system {SYSTEM} in us-east-1"),
        ),
        (
            "DescribeVolumes",
            format!("listing the data volumes of system {SYSTEM} in us-east-1"),
        ),
        ("CreateTags", format!("tagging {id} with dormant:epoch")),
    ] {
        env.proxy
            .fail(action, 0, 1000, 403, "UnauthorizedOperation");
        let tags_before = env.proxy.count("CreateTags");
        let out = new.dormant(&["adopt"]);
        let t = text(&out);
        // The operator commands' code for a system failure (no runner: 2).
        assert_eq!(out.status.code(), Some(2), "{action}: {t}");
        assert!(
            t.contains(&format!("ec2:{action}")) && t.contains(&doing),
            "{action}: {t}"
        );
        if action == "CreateTags" {
            assert!(t.contains("adopted 0"), "{t}");
        } else {
            assert_eq!(env.proxy.count("CreateTags"), tags_before, "{action}");
        }
        nothing_changed(action);
        env.proxy.clear_faults();
    }
    assert!(adopt(&new).contains("adopted 1, left alone 0"));
}
