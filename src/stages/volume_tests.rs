//! Unit tests of volume mode through the stages (prepare, run, cleanup)
//! against the in-memory provider and transports: what each step calls, what
//! the record says after it, and how a lost machine is settled.

use std::sync::{Arc, Mutex};

use crate::exit::Failure;
use crate::job::SuspendRequest;
use crate::model::StorageMode;
use crate::provider::{MachineSpec, MachineState};
use crate::stages::fakes::{session, FakeProvider, FakeTransports};
use crate::state::{registry, EnvStatus, EnvironmentRecord, StateStore, VolumeStep};

use super::cleanup::cleanup;
use super::prepare::prepare;

fn volume_provider() -> FakeProvider {
    let p = FakeProvider::default();
    p.cloud.lock().unwrap().storage = StorageMode::Volume;
    p
}

fn triggers(on_success: bool, on_failure: bool, key: Option<&str>) -> SuspendRequest {
    SuspendRequest {
        on_success,
        on_failure,
        resume_key: key.map(str::to_string),
        source: "test".into(),
        ..Default::default()
    }
}

fn record(store: &StateStore, job: u64) -> Option<EnvironmentRecord> {
    registry::peek(&store.env_paths(crate::identity::new_env_id("1", job))).unwrap()
}

fn text(buf: &Arc<Mutex<Vec<u8>>>) -> String {
    String::from_utf8_lossy(&buf.lock().unwrap()).into_owned()
}

/// Runs one stage script through the run stage.
async fn run_stage(s: &super::Session) -> Result<(), Failure> {
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("script");
    std::fs::write(&script, "true\n").unwrap();
    super::run::run(s, &script, "build_script").await
}

#[tokio::test]
async fn suspended_it_is_its_volume_alone_and_a_resume_makes_a_new_machine() {
    let dir = tempfile::tempdir().unwrap();
    let store = StateStore::open(dir.path()).unwrap();
    let p = volume_provider();
    let t = FakeTransports::default();
    let name = MachineSpec::machine_name(crate::identity::new_env_id("1", 1));

    let (s, _) = session(
        &store,
        &p,
        t.clone(),
        1,
        triggers(true, false, None),
        "success",
    );
    prepare(&s).await.unwrap();
    let rec = record(&store, 1).unwrap();
    let key = rec.key.clone().unwrap();
    let vol = rec.volume.as_ref().unwrap().volume.clone().unwrap().id;
    assert!(
        key.contains("storage=volume") && key.contains(&format!("volume={vol}")),
        "the key names the volume: {key}"
    );
    assert!(!key.contains("machine="), "never the machine: {key}");
    assert_eq!(rec.storage, StorageMode::Volume);
    let v = rec.volume.as_ref().unwrap();
    assert_eq!((v.step(), v.initialized), (VolumeStep::Attached, true));
    assert_eq!(
        p.calls(),
        vec![
            format!("create_volume {vol}"),
            format!("create {name}"),
            format!("attach {vol} {name}")
        ]
    );
    run_stage(&s).await.unwrap();
    cleanup(&s).await.unwrap();
    let rec = record(&store, 1).unwrap();
    assert_eq!(rec.status(), EnvStatus::Suspended);
    assert_eq!(rec.machine, None, "no machine while suspended");
    assert_eq!(rec.volume.as_ref().unwrap().step(), VolumeStep::Detached);
    assert_eq!(p.state(&name), Some(MachineState::Gone));
    assert_eq!(p.volume(&vol).as_deref(), Some("available"));
    assert_eq!(
        p.calls()[3..],
        [
            format!("detach {vol} {name} unmounted=true"),
            format!("delete {name}")
        ]
    );
    assert_eq!(*t.execs.lock().unwrap(), vec!["mount", "unmount"]);

    // A pin of the machine that is gone: set aside for the new machine's key.
    let paths = store.env_paths(rec.id);
    std::fs::write(&paths.known_hosts, "dormant-x ssh-ed25519 AAAA\n").unwrap();
    let (s2, log2) = session(
        &store,
        &p,
        t.clone(),
        2,
        triggers(false, false, Some(&key)),
        "success",
    );
    prepare(&s2).await.unwrap();
    assert!(
        p.calls()[5..].starts_with(&[format!("create {name}"), format!("attach {vol} {name}")]),
        "a new machine, not a start: {:?}",
        p.calls()
    );
    let rec = record(&store, 1).unwrap();
    assert!(!rec.volume.as_ref().unwrap().repin(), "pinned");
    assert!(
        !paths.known_hosts.exists()
            || std::fs::read_to_string(&paths.known_hosts)
                .unwrap()
                .is_empty()
    );
    assert!(!crate::transport::ssh::repin::replaced(&paths).exists());
    assert!(
        text(&log2).contains("fresh from the image"),
        "{}",
        text(&log2)
    );
    assert_eq!(
        *t.execs.lock().unwrap(),
        vec!["mount", "unmount", "mount"],
        "mounted on the new machine"
    );
    run_stage(&s2).await.unwrap();
    // No trigger: released, the volume with it.
    cleanup(&s2).await.unwrap();
    assert!(record(&store, 1).is_none());
    assert_eq!(p.volume(&vol).as_deref(), Some("deleted"));
    assert_eq!(p.state(&name), Some(MachineState::Gone));
}

#[tokio::test]
async fn a_machine_lost_under_a_job_keeps_the_volume_as_the_triggers_or_a_resume_say() {
    let dir = tempfile::tempdir().unwrap();
    let store = StateStore::open(dir.path()).unwrap();
    let p = volume_provider();
    let ok = FakeTransports::default();
    let lost = FakeTransports {
        fail_run: true,
        ..Default::default()
    };
    let lose = |job: u64| {
        let name = MachineSpec::machine_name(crate::identity::new_env_id("1", job));
        p.cloud
            .lock()
            .unwrap()
            .machines
            .insert(name, MachineState::Gone);
    };

    // A new job without a failure trigger: released (nothing asked to keep it).
    let (s, _) = session(
        &store,
        &p,
        lost.clone(),
        1,
        triggers(true, false, None),
        "failed",
    );
    prepare(&s).await.unwrap();
    lose(1);
    let e = run_stage(&s).await.unwrap_err();
    assert!(
        matches!(&e, Failure::System(e) if format!("{e:#}").contains("machine lost: machine dormant-")),
        "{e:?}"
    );
    cleanup(&s).await.unwrap();
    assert!(record(&store, 1).is_none());

    // With the failure trigger: kept, nothing asked of the gone machine.
    let (s, log) = session(
        &store,
        &p,
        lost.clone(),
        2,
        triggers(false, true, None),
        "failed",
    );
    prepare(&s).await.unwrap();
    let vol = record(&store, 2)
        .unwrap()
        .volume
        .unwrap()
        .volume
        .unwrap()
        .id;
    lose(2);
    run_stage(&s).await.unwrap_err();
    cleanup(&s).await.unwrap();
    let rec = record(&store, 2).unwrap();
    assert_eq!(rec.status(), EnvStatus::Suspended);
    assert_eq!(p.volume(&vol).as_deref(), Some("available"));
    assert!(text(&log).contains("(machine lost)"), "{}", text(&log));
    assert!(
        p.calls().iter().any(|c| c.ends_with("unmounted=false")),
        "{:?}",
        p.calls()
    );
    assert!(!lost.execs.lock().unwrap().contains(&"unmount".to_string()));
    let key = rec.key.unwrap();

    // A resumed job without any trigger whose machine is lost: kept too.
    let (s, _) = session(
        &store,
        &p,
        lost.clone(),
        3,
        triggers(false, false, Some(&key)),
        "failed",
    );
    prepare(&s).await.unwrap();
    lose(2);
    run_stage(&s).await.unwrap_err();
    cleanup(&s).await.unwrap();
    assert_eq!(record(&store, 2).unwrap().status(), EnvStatus::Suspended);

    // And a later job resumes it on a new machine.
    let (s, _) = session(
        &store,
        &p,
        ok,
        4,
        triggers(false, false, Some(&key)),
        "success",
    );
    prepare(&s).await.unwrap();
    run_stage(&s).await.unwrap();
    cleanup(&s).await.unwrap();
    assert!(record(&store, 2).is_none(), "released by its last job");
}

#[tokio::test]
async fn a_failed_detach_keeps_the_volume_suspended_and_the_sweep_finishes_it() {
    let dir = tempfile::tempdir().unwrap();
    let store = StateStore::open(dir.path()).unwrap();
    let p = volume_provider();
    let t = FakeTransports::default();
    p.cloud.lock().unwrap().fail_detach = true;
    let (s, _) = session(&store, &p, t, 1, triggers(true, false, None), "success");
    prepare(&s).await.unwrap();
    run_stage(&s).await.unwrap();
    let e = cleanup(&s).await.unwrap_err();
    assert!(format!("{e:?}").contains("fake detach failure"), "{e:?}");
    let rec = record(&store, 1).unwrap();
    assert_eq!(rec.status(), EnvStatus::Suspended);
    assert!(rec.machine.is_some(), "the machine is left, recorded");
    assert_eq!(rec.volume.as_ref().unwrap().step(), VolumeStep::Detaching);
    assert!(crate::lifecycle::volume::has_leftovers(&rec));

    p.cloud.lock().unwrap().fail_detach = false;
    let ctx = crate::context::Ctx::new(
        s.log.clone(),
        Default::default(),
        std::time::Duration::from_secs(30),
    );
    let report = crate::lifecycle::sweep::sweep(
        s.world(),
        &s.settings.suspend,
        crate::lifecycle::sweep::Scope::Full,
        &ctx,
    )
    .await
    .unwrap();
    assert_eq!(report.recovered, vec![rec.id], "{:?}", report.errors);
    let after = record(&store, 1).unwrap();
    assert_eq!(after.status(), EnvStatus::Suspended);
    assert_eq!(after.machine, None);
    assert_eq!(after.volume.as_ref().unwrap().step(), VolumeStep::Detached);
    assert_eq!(
        after.suspended_at, rec.suspended_at,
        "its TTL is not restarted"
    );
}

#[test]
fn a_volume_key_puts_config_on_the_volume_whatever_the_setting_is_now() {
    let settings = crate::settings::Settings::parse_str(
        "provider = \"qemu\"\n[qemu]\nimage = \"/i/b.qcow2\"\nvolume_mount = \"/data\"\n",
    )
    .unwrap();
    let paths = crate::state::EnvPaths::new(std::path::Path::new("/s"), uuid::Uuid::nil());
    let key = crate::envkey::EnvironmentKey::parse(
        "1/s_x/env=00000000-0000-0000-0000-000000000000&provider=qemu&storage=volume",
    )
    .unwrap();
    let storage = crate::envkey::storage_of(&key);
    assert_eq!(storage, StorageMode::Volume);
    let dirs = crate::provider::dirs(&settings, &paths, storage).unwrap();
    assert_eq!(
        (dirs.builds.as_str(), dirs.cache.as_str()),
        ("/data/builds", "/data/cache")
    );
    let machine_key = crate::envkey::EnvironmentKey::parse(
        "1/s_x/env=00000000-0000-0000-0000-000000000000&provider=qemu",
    )
    .unwrap();
    let dirs =
        crate::provider::dirs(&settings, &paths, crate::envkey::storage_of(&machine_key)).unwrap();
    assert_eq!(
        dirs.builds, "/home/debian/builds",
        "a machine-mode key keeps its dirs"
    );
}

#[tokio::test]
async fn a_key_stripped_of_its_volume_fields_is_refused_as_altered() {
    let dir = tempfile::tempdir().unwrap();
    let store = StateStore::open(dir.path()).unwrap();
    let p = volume_provider();
    let t = FakeTransports::default();
    let (s, _) = session(
        &store,
        &p,
        t.clone(),
        1,
        triggers(true, false, None),
        "success",
    );
    prepare(&s).await.unwrap();
    run_stage(&s).await.unwrap();
    cleanup(&s).await.unwrap();
    let key = record(&store, 1).unwrap().key.unwrap();
    // Without `storage=volume` config would give the job machine mode's
    // builds dir, an empty one: refused, never run there.
    let stripped = key.replace("&storage=volume", "");
    assert_ne!(stripped, key);
    let (s2, _) = session(
        &store,
        &p,
        t,
        2,
        triggers(false, false, Some(&stripped)),
        "success",
    );
    let e = prepare(&s2).await.unwrap_err();
    assert!(
        matches!(&e, Failure::Refused(e) if format!("{e:#}").contains("the key was altered")),
        "{e:?}"
    );
    assert_eq!(record(&store, 1).unwrap().status(), EnvStatus::Suspended);
}
