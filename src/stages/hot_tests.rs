//! The hot window's give-way (`lifecycle::hot::give_way`): a job that needs
//! a slot cools the hot environment whose window ends first, and nothing
//! when a slot is free; and a volume-mode window's end, with and without a
//! connection to the guest (against the fake provider and transports).

use crate::context::{Ctx, JobLog};
use crate::lifecycle::{hot, World};
use crate::model::Machine;
use crate::stages::fakes::FakeProvider;
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
