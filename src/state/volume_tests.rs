//! Unit tests of volume mode's steps in the state machine (`volume.rs`).
use super::*;
use crate::model::StorageMode;
use crate::state::record::{Mode, NewEnvironment};

fn job(id: u64, mode: Mode) -> Holder {
    Holder::Job {
        runner_id: "1".into(),
        job_id: id,
        mode,
        suspend_on_failure: false,
    }
}

fn record(storage: StorageMode) -> EnvironmentRecord {
    EnvironmentRecord::new(
        NewEnvironment {
            id: uuid::Uuid::nil(),
            provider: "local",
            runner_id: "1",
            system_id: "s",
            project_id: 5,
            project_path: None,
            job_id: 1,
            storage,
            image: Some("debian".into()),
        },
        job(1, Mode::New),
    )
}

fn step(r: &EnvironmentRecord) -> VolumeStep {
    r.volume.as_ref().unwrap().step()
}

#[test]
fn a_volume_mode_life_goes_through_every_step() {
    let j1 = job(1, Mode::New);
    let j2 = job(2, Mode::Resume);
    let mut r = record(StorageMode::Volume);
    assert_eq!(r.version, crate::state::store::VOLUME_FORMAT_VERSION);
    assert_eq!(step(&r), VolumeStep::Creating);
    assert!(r.begin_attach(&j1, false).is_err(), "no volume yet");
    r.volume_created(&j1, Volume::new("vol-1"), "key".into())
        .unwrap();
    assert_eq!(r.key.as_deref(), Some("key"));
    r.begin_attach(&j1, false).unwrap();
    assert!(r.volume_attached(&j1).is_err(), "no machine recorded yet");
    r.machine_made(&j1, Machine::new("m1"), "key".into())
        .unwrap();
    r.volume_attached(&j1).unwrap();
    r.volume_initialized(&j1).unwrap();
    r.activate(&j1).unwrap();
    assert!(r.begin_detach(&j1).is_err(), "only while suspending");

    r.begin_suspend(&j1).unwrap();
    r.begin_detach(&j1).unwrap();
    assert_eq!(step(&r), VolumeStep::Detaching);
    r.volume_detached(&j1).unwrap();
    assert_eq!(step(&r), VolumeStep::DeletingMachine);
    r.machine_deleted(&j1).unwrap();
    assert_eq!((step(&r), r.machine.clone()), (VolumeStep::Detached, None));
    r.suspended(&j1, None, true, None).unwrap();

    r.claim_for_resume(&j2).unwrap();
    r.begin_attach(&j2, true).unwrap();
    assert!(r.volume.as_ref().unwrap().repin());
    r.machine_started(&j2, Machine::new("m2")).unwrap();
    r.volume_attached(&j2).unwrap();
    r.host_key_repinned(&j2, vec!["SHA256:old".into()], vec!["SHA256:new".into()])
        .unwrap();
    assert!(!r.volume.as_ref().unwrap().repin());
    assert_eq!(r.host_key_changes.len(), 1);
    assert_eq!(r.host_key_changes[0].machine, "m2");
    r.activate(&j2).unwrap();
    assert!(
        r.volume.as_ref().unwrap().initialized,
        "kept across machines"
    );
}

#[test]
fn only_the_holder_moves_the_volume_and_only_from_its_steps() {
    let j1 = job(1, Mode::New);
    let other = job(9, Mode::New);
    let mut r = record(StorageMode::Volume);
    let e = r
        .volume_created(&other, Volume::new("v"), "k".into())
        .unwrap_err();
    assert!(e.to_string().contains("volume creating"), "{e}");
    r.volume_created(&j1, Volume::new("v"), "k".into()).unwrap();
    assert!(
        r.volume_created(&j1, Volume::new("v2"), "k".into())
            .is_err(),
        "created once"
    );
    assert!(r.machine_deleted(&j1).is_err(), "creating: not a suspend");
    // A machine-mode record has no volume steps at all.
    let mut m = record(StorageMode::Machine);
    assert!(m.volume.is_none());
    assert_eq!(m.version, crate::state::store::FORMAT_VERSION);
    assert!(m.begin_attach(&j1, false).is_err());
    let text = serde_json::to_string(&m).unwrap();
    for absent in ["storage", "volume", "host_key_changes"] {
        assert!(
            !text.contains(absent),
            "machine-mode records are unchanged: {text}"
        );
    }
}

#[test]
fn a_killed_launch_is_found_again_or_forgotten() {
    let j2 = job(2, Mode::Resume);
    let mut r = record(StorageMode::Volume);
    let j1 = job(1, Mode::New);
    r.volume_created(&j1, Volume::new("v"), "k".into()).unwrap();
    r.begin_attach(&j1, false).unwrap();
    r.machine_made(&j1, Machine::new("m1"), "k".into()).unwrap();
    r.volume_attached(&j1).unwrap();
    r.activate(&j1).unwrap();
    r.begin_suspend(&j1).unwrap();
    r.begin_detach(&j1).unwrap();
    r.volume_detached(&j1).unwrap();
    r.machine_deleted(&j1).unwrap();
    r.suspended(&j1, None, true, None).unwrap();
    // A resume launched a machine and died before recording it.
    r.claim_for_resume(&j2).unwrap();
    r.begin_attach(&j2, true).unwrap();
    r.begin_suspend(&j2).unwrap();
    r.machine_found(&j2, Machine::new("m2")).unwrap();
    assert!(
        r.machine_found(&j2, Machine::new("m3")).is_err(),
        "one machine"
    );
    r.begin_detach(&j2).unwrap();
    r.volume_detached(&j2).unwrap();
    r.machine_deleted(&j2).unwrap();
    // Or none was launched: the step goes back to detached.
    r.suspended(&j2, None, false, None).unwrap();
    r.claim_for_resume(&j2).unwrap();
    r.begin_attach(&j2, true).unwrap();
    r.machine_deleted(&j2).unwrap();
    assert_eq!((step(&r), r.machine.clone()), (VolumeStep::Detached, None));
    assert!(
        r.volume.as_ref().unwrap().repin(),
        "still pending: no new key was pinned"
    );
}

#[test]
fn host_key_changes_are_bounded() {
    let j1 = job(1, Mode::New);
    let mut r = record(StorageMode::Volume);
    r.volume_created(&j1, Volume::new("v"), "k".into()).unwrap();
    r.begin_attach(&j1, true).unwrap();
    for i in 0..25 {
        r.host_key_repinned(&j1, vec![format!("old{i}")], vec![format!("new{i}")])
            .unwrap();
    }
    assert_eq!(r.host_key_changes.len(), HOST_KEY_CHANGES_KEPT);
    assert_eq!(r.host_key_changes.last().unwrap().new, vec!["new24"]);
    // Pinning the same key again records no change.
    r.host_key_repinned(&j1, vec!["x".into()], vec!["x".into()])
        .unwrap();
    assert_eq!(r.host_key_changes.last().unwrap().new, vec!["new24"]);
}
