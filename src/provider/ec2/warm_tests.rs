//! What a warm instance may serve and be made from (no EC2 call), and the
//! tag check before a warm instance is handed over or terminated.

use std::collections::BTreeMap;

use super::*;
use crate::settings::Settings;
use crate::state::pool::Pool;
use crate::state::StateStore;

fn provider(extra: &str) -> (tempfile::TempDir, Ec2Provider) {
    provider_from("ami-0abc", extra)
}

fn provider_from(image: &str, extra: &str) -> (tempfile::TempDir, Ec2Provider) {
    let dir = tempfile::tempdir().unwrap();
    let store = StateStore::open(&dir.path().join("s")).unwrap();
    let settings = Settings::parse_str(&format!(
        "provider = \"ec2\"\nsystem_id = \"s_test\"\n[ec2]\nregion = \"us-east-1\"\nsubnet_id = \"subnet-1\"\n\
         image = \"{image}\"\nwarm = 1\n{extra}"
    ))
    .unwrap();
    let p = Ec2Provider::new(&settings, &store).unwrap();
    (dir, p)
}

fn spec(p: &Ec2Provider) -> MachineSpec {
    let id = uuid::Uuid::new_v4();
    MachineSpec {
        env_id: id,
        name: MachineSpec::machine_name(id),
        runner_id: "1".into(),
        system_id: "s_test".into(),
        project_id: 5,
        job_id: 7,
        image: None,
        variables: BTreeMap::new(),
        ssh_public_key: None,
        paths: p.store.env_paths(id),
        volume: None,
    }
}

#[test]
fn only_a_job_asking_for_the_default_image_and_types_takes_a_warm_instance() {
    let (_d, p) = provider(
        "allowed_images = [\"ami-0abc\", \"ami-0def\"]\nallowed_instance_types = [\"t3.large\"]\n",
    );
    let mut s = spec(&p);
    assert!(p.fits(&s));
    s.image = Some("ami-0abc".into());
    assert!(p.fits(&s), "the default image named");
    s.image = Some("ami-0def".into());
    assert!(!p.fits(&s), "an allowed image of its own");
    s.image = None;
    s.variables
        .insert(INSTANCE_TYPE_VARIABLE.into(), "t3.large".into());
    assert!(!p.fits(&s), "an instance type of its own");
    s.variables.clear();
    s.volume = Some(crate::model::Volume::new("vol-1").with("zone", "us-east-1a"));
    assert!(!p.fits(&s), "volume mode: not yet");
    assert_eq!(p.zone_for(&s).as_deref(), Some("us-east-1a"));

    // Without an allow-list a job's image is ignored: the default it gets fits.
    let (_d, p) = provider("");
    let mut s = spec(&p);
    s.image = Some("debian:12".into());
    assert!(p.fits(&s));
}

#[test]
fn the_fingerprint_changes_with_what_an_instance_is_made_from() {
    let (_d, p) = provider("");
    let base = p.kind().unwrap();
    assert_eq!(p.kind().unwrap(), base, "stable");
    for extra in [
        "instance_type = \"t3.large\"\n",
        "fallback_instance_types = [\"t3a.medium\"]\n",
        "ssh_user = \"debian\"\n",
        "security_group_ids = [\"sg-1\"]\n",
        "root_volume_size_gb = 40\n",
        "tags = { team = \"ci\" }\n",
        "storage = \"volume\"\n",
    ] {
        let (_d, other) = provider(extra);
        assert_ne!(
            other.kind().unwrap().fingerprint,
            base.fingerprint,
            "{extra}"
        );
    }
    let (_d, other_image) = provider_from("ami-0def", "");
    assert_ne!(other_image.kind().unwrap().fingerprint, base.fingerprint);
    // Not what a warm instance is made from: the number kept, their age.
    let (_d, same) = provider("warm_max_age = \"1h\"\n");
    assert_eq!(same.kind().unwrap().fingerprint, base.fingerprint);
}

fn info(tags: &[(&str, &str)]) -> InstanceInfo {
    let mut i = InstanceInfo::from_sdk(
        &aws_sdk_ec2::types::Instance::builder()
            .instance_id("i-1")
            .build(),
    );
    i.tags = tags
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    i
}

#[test]
fn only_this_warm_instance_is_handed_over_or_terminated() {
    let (_d, p) = provider("");
    let pool = Pool::new(&p.store);
    let w = pool.paths(uuid::Uuid::new_v4());
    let env = p.store.env_paths(uuid::Uuid::new_v4());
    let (wid, eid) = (w.id.to_string(), env.id.to_string());
    let ours = [(tag::MANAGED_BY, "dormant"), (tag::SYSTEM, "s_test")];
    let with = |more: &[(&str, &str)]| {
        let mut t = ours.to_vec();
        t.extend_from_slice(more);
        info(&t)
    };
    let warm_only = with(&[(tag::WARM, &wid)]);
    assert!(p
        .verify_warm(&w, &warm_only, Some(&env), "hand over")
        .is_ok());
    assert!(p.verify_warm(&w, &warm_only, None, "terminate").is_ok());
    // Killed between the two tag writes: the retry and a retirement go on.
    let both = with(&[(tag::WARM, &wid), (tag::ENV, &eid)]);
    assert!(p.verify_warm(&w, &both, Some(&env), "hand over").is_ok());
    assert!(p.verify_warm(&w, &both, None, "terminate").is_ok());
    // Handed over: the retry's second write is a no-op; never terminated as warm.
    let handed = with(&[(tag::ENV, &eid)]);
    assert!(p.verify_warm(&w, &handed, Some(&env), "hand over").is_ok());
    assert!(p.verify_warm(&w, &handed, None, "terminate").is_err());
    // Another warm instance, another environment's, another system's.
    let other = uuid::Uuid::new_v4().to_string();
    for bad in [
        with(&[(tag::WARM, &other)]),
        with(&[(tag::WARM, &wid), (tag::ENV, &other)]),
        info(&[
            (tag::MANAGED_BY, "dormant"),
            (tag::SYSTEM, "s_else"),
            (tag::WARM, &wid),
        ]),
    ] {
        let e = p
            .verify_warm(&w, &bad, Some(&env), "hand over")
            .unwrap_err();
        assert!(
            format!("{e:#}").contains("refusing to hand over instance i-1"),
            "{e:#}"
        );
    }
    // An orphan is terminated only while it is still an untaken warm instance.
    let m = Machine::new("i-1").with(field::WARM, &wid);
    assert!(p.verify_orphan_warm(&m, &warm_only).is_ok());
    assert!(p.verify_orphan_warm(&m, &both).is_err());
    assert!(p
        .verify_orphan_warm(&m, &with(&[(tag::WARM, &other)]))
        .is_err());
}
