//! The hot window against the fake provider: the give-way
//! (`lifecycle::hot::give_way`: a job that needs a slot cools the hot
//! environment whose window ends first, and nothing when a slot is free),
//! a volume-mode window's end, with and without a connection to the guest,
//! and a hot resume's connection (`prep::connect_hot`: the live one taken
//! without a probe; a probe when stages were left; a machine that stopped
//! said at once).

use crate::context::{Ctx, JobLog};
use crate::job::SuspendRequest;
use crate::lifecycle::{hot, World};
use crate::model::{EnvPaths, Machine, MachineState};
use crate::stages::cleanup::cleanup;
use crate::stages::fakes::{session, FakeProvider, FakeTransports};
use crate::stages::prepare::prepare;
use crate::state::registry;
use crate::state::testing::{place, rewrite};
use crate::state::{now_unix, EnvStatus, Holder, Mode, StateStore};

fn ctx() -> Ctx {
    Ctx::new(
        JobLog::discard(),
        tokio_util::sync::CancellationToken::new(),
        std::time::Duration::from_secs(30),
    )
}

/// A hot environment of the fake provider, its window ending `in_secs` from now.
async fn hot_env(store: &StateStore, machine: &str, in_secs: u64) -> uuid::Uuid {
    let id = uuid::Uuid::new_v4();
    let job = Holder::Job {
        runner_id: "1".into(),
        job_id: 9,
        mode: Mode::New,
        suspend_on_failure: false,
    };
    place(
        store,
        id,
        EnvStatus::Active,
        Some(job.clone()),
        0,
        Some(Machine::new(machine)),
    )
    .unwrap();
    rewrite(store, id, |_, _, rec| rec.provider = "fake".into()).unwrap();
    let paths = store.env_paths(id);
    let until = now_unix() + in_secs;
    registry::update(&paths, &ctx(), |r| {
        r.begin_suspend(&job)?;
        r.suspended_hot(&job, until)
    })
    .await
    .unwrap();
    id
}

#[tokio::test]
async fn a_job_needing_a_slot_cools_the_hot_environment_whose_window_ends_first() {
    let dir = tempfile::tempdir().unwrap();
    let store = StateStore::open(dir.path()).unwrap();
    let events = crate::events::EventLog::new(store.root(), &Default::default());
    let provider = FakeProvider::default();
    let w = World {
        store: &store,
        provider: &provider,
        events: &events,
    };
    let later = hot_env(&store, "m-later", 600).await;
    let first = hot_env(&store, "m-first", 60).await;

    // A slot is free: nothing is cooled.
    assert_eq!(hot::give_way(w, None, &ctx()).await, None);
    assert!(provider.calls().is_empty(), "{:?}", provider.calls());

    provider.cloud.lock().unwrap().slots_full = true;
    assert_eq!(hot::give_way(w, None, &ctx()).await, Some(first));
    assert_eq!(provider.calls(), ["stop m-first"]);
    let rec = registry::peek(&store.env_paths(first)).unwrap().unwrap();
    assert_eq!(rec.status(), EnvStatus::Suspended);
    assert_eq!(rec.hot_until(), None);
    let still = registry::peek(&store.env_paths(later)).unwrap().unwrap();
    assert!(still.hot_until().is_some(), "the later window runs on");
}

/// A volume-mode environment kept hot (its machine runs, the volume
/// attached): a sweep within the window leaves it; its window's end with a
/// connection (`guests`) has the guest unmount the volume, then detaches it
/// as unmounted and deletes the machine, marking the paused script lost;
/// without one (a sweep) the provider detaches it the way needing no guest.
#[tokio::test]
async fn a_volume_mode_window_ends_unmounted_over_a_connection_or_the_safe_way_without() {
    use crate::model::StorageMode;
    use crate::stages::fakes::{session, FakeTransports};
    use crate::state::VolumeStep;
    for with_guest in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let store = StateStore::open(dir.path()).unwrap();
        let p = FakeProvider::default();
        p.cloud.lock().unwrap().storage = StorageMode::Volume;
        let t = FakeTransports::default();
        let (s, _) = session(&store, &p, t.clone(), 1, Default::default(), "success");
        super::prepare::prepare(&s).await.unwrap();
        let id = crate::identity::new_env_id("1", 1);
        let paths = store.env_paths(id);
        let rec = registry::peek(&paths).unwrap().unwrap();
        let job = rec.holder().unwrap().clone();
        let (vol, machine) = (
            rec.volume.as_ref().unwrap().volume.clone().unwrap().id,
            rec.machine.clone().unwrap().id,
        );
        registry::update(&paths, &ctx(), |r| {
            r.paused = Some(crate::state::Paused {
                question: "Deploy?".into(),
                job_id: 1,
                at: now_unix(),
                lost: None,
                ended: None,
            });
            r.begin_suspend(&job)?;
            r.suspended_hot(&job, now_unix() + 600)
        })
        .await
        .unwrap();
        let before = p.calls().len();
        let report = crate::lifecycle::sweep::sweep(
            s.world(),
            &s.settings.suspend,
            crate::lifecycle::sweep::Scope::Full,
            &ctx(),
        )
        .await
        .unwrap();
        assert!(report.errors.is_empty(), "{:?}", report.errors);
        assert_eq!(p.calls().len(), before, "left hot: {:?}", p.calls());
        assert!(registry::peek(&paths)
            .unwrap()
            .unwrap()
            .hot_until()
            .is_some());

        let me = crate::lifecycle::recover::operator("test");
        let guests: Option<&dyn crate::lifecycle::warm_refill::OpenTransport> =
            with_guest.then_some(&s as _);
        let cooled = hot::cool(s.world(), &paths, &me, "test", guests, &ctx())
            .await
            .unwrap()
            .expect("it was hot");
        assert_eq!(cooled.status(), EnvStatus::Suspended);
        assert_eq!(cooled.machine, None);
        assert_eq!(cooled.volume.as_ref().unwrap().step(), VolumeStep::Detached);
        assert!(cooled.paused.as_ref().unwrap().lost.is_some(), "lost");
        assert_eq!(
            p.calls()[before..],
            [
                format!("detach {vol} {machine} unmounted={with_guest}"),
                format!("delete {machine}")
            ]
        );
        let unmounted = t.execs.lock().unwrap().iter().any(|e| e == "unmount");
        assert_eq!(unmounted, with_guest, "{:?}", t.execs.lock().unwrap());
    }
}

/// A suspended environment of job 1 (fake provider), then hot with its
/// machine running, as a paused job's cleanup leaves it (job 2 resumed it
/// and paused); its key, paths and machine.
async fn hot_by_cleanup(store: &StateStore, p: &FakeProvider) -> (String, EnvPaths, String) {
    let trigger = SuspendRequest {
        on_success: true,
        source: "test".into(),
        ..Default::default()
    };
    let (s, _) = session(store, p, FakeTransports::default(), 1, trigger, "success");
    prepare(&s).await.unwrap();
    cleanup(&s).await.unwrap();
    let paths = store.env_paths(crate::identity::new_env_id("1", 1));
    let rec = registry::peek(&paths).unwrap().unwrap();
    let machine = rec.machine.clone().unwrap().id;
    let paused = Holder::Job {
        runner_id: "1".into(),
        job_id: 2,
        mode: Mode::Resume,
        suspend_on_failure: false,
    };
    let until = now_unix() + 600;
    registry::update(&paths, &ctx(), |r| {
        r.claim_for_resume(&paused)?;
        r.activate(&paused)?;
        r.begin_suspend(&paused)?;
        r.suspended_hot(&paused, until)
    })
    .await
    .unwrap();
    p.cloud
        .lock()
        .unwrap()
        .machines
        .insert(machine.clone(), MachineState::Running);
    (rec.key.unwrap(), paths, machine)
}

/// A job resuming `key` (no trigger) with `transports`: its prepare.
async fn resume_with(
    store: &StateStore,
    p: &FakeProvider,
    transports: FakeTransports,
    key: &str,
) -> (Result<(), crate::exit::Failure>, String) {
    let request = SuspendRequest {
        resume_key: Some(key.into()),
        source: "test".into(),
        ..Default::default()
    };
    let (s, log) = session(store, p, transports, 3, request, "running");
    let done = prepare(&s).await;
    let log = String::from_utf8_lossy(&log.lock().unwrap()).into_owned();
    (done, log)
}

#[tokio::test]
async fn a_hot_resume_takes_the_live_connection_without_a_login_or_a_probe() {
    let dir = tempfile::tempdir().unwrap();
    let store = StateStore::open(dir.path()).unwrap();
    let p = FakeProvider::default();
    let (key, paths, _) = hot_by_cleanup(&store, &p).await;
    let before = p.calls().len();
    let t = FakeTransports {
        live: true,
        ..Default::default()
    };
    let (done, log) = resume_with(&store, &p, t.clone(), &key).await;
    done.unwrap();
    assert!(log.contains("is hot"), "{log}");
    assert_eq!(*t.connects.lock().unwrap(), ["take"]);
    assert_eq!(p.calls().len(), before, "no start: {:?}", p.calls());
    let rec = registry::peek(&paths).unwrap().unwrap();
    assert_eq!(rec.status(), EnvStatus::Active);
}

#[tokio::test]
async fn a_hot_resume_whose_job_left_stages_running_probes_the_machine() {
    let dir = tempfile::tempdir().unwrap();
    let store = StateStore::open(dir.path()).unwrap();
    let p = FakeProvider::default();
    let (key, paths, _) = hot_by_cleanup(&store, &p).await;
    // The paused job's cleanup could not stop what its stages left: the
    // probe (its leftovers command) must.
    std::fs::write(&paths.stages_left, "").unwrap();
    let t = FakeTransports {
        live: true,
        ..Default::default()
    };
    let (done, _) = resume_with(&store, &p, t.clone(), &key).await;
    done.unwrap();
    assert_eq!(*t.connects.lock().unwrap(), ["connect"]);
}

#[tokio::test]
async fn a_hot_machine_that_stopped_in_its_window_is_said_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let store = StateStore::open(dir.path()).unwrap();
    let p = FakeProvider::default();
    let (key, paths, machine) = hot_by_cleanup(&store, &p).await;
    // Killed (QEMU gone) during the window: its SSH master went with it.
    p.cloud
        .lock()
        .unwrap()
        .machines
        .insert(machine.clone(), MachineState::Stopped);
    let t = FakeTransports::default();
    let (done, _) = resume_with(&store, &p, t.clone(), &key).await;
    let crate::exit::Failure::System(err) = done.unwrap_err() else {
        panic!("a system failure (the environment stays suspended)");
    };
    let err = format!("{err:#}");
    assert!(
        err.contains(&format!(
            "was hot, but its machine is not running any more: machine lost: machine {machine} is stopped"
        )),
        "{err}"
    );
    assert!(
        t.connects.lock().unwrap().is_empty(),
        "no wait for SSH on a machine that is not running"
    );
    let rec = registry::peek(&paths).unwrap().unwrap();
    assert_eq!(rec.status(), EnvStatus::Resuming, "cleanup settles it");
}
