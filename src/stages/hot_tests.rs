//! The hot window's give-way (`lifecycle::hot::give_way`): a job that needs
//! a slot cools the hot environment whose window ends first, and nothing
//! when a slot is free (against the fake provider).

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
    assert_eq!(hot::give_way(w, &ctx()).await, None);
    assert!(provider.calls().is_empty(), "{:?}", provider.calls());

    provider.cloud.lock().unwrap().slots_full = true;
    assert_eq!(hot::give_way(w, &ctx()).await, Some(first));
    assert_eq!(provider.calls(), ["stop m-first"]);
    let rec = registry::peek(&store.env_paths(first)).unwrap().unwrap();
    assert_eq!(rec.status(), EnvStatus::Suspended);
    assert_eq!(rec.hot_until(), None);
    let still = registry::peek(&store.env_paths(later)).unwrap().unwrap();
    assert!(still.hot_until().is_some(), "the later window runs on");
}
