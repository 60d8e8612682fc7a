//! Every transition writes exactly its event: the stages and the lifecycle
//! against the in-memory provider, each test reading back the whole event
//! log (`crate::events`).

use std::time::Duration;

use crate::context::Ctx;
use crate::events::read::{read_from, Line};
use crate::events::Event;
use crate::job::SuspendRequest;
use crate::lifecycle::{recover, sweep};
use crate::stages::cleanup::cleanup;
use crate::stages::fakes::{session, FakeProvider, FakeTransports};
use crate::stages::prepare::prepare;
use crate::state::{EnvStatus, Holder, Mode, StateStore};

fn ok() -> FakeTransports {
    FakeTransports {
        exit_code: 0,
        fail_connect: false,
        ..Default::default()
    }
}

fn on_success() -> SuspendRequest {
    SuspendRequest {
        on_success: true,
        source: "test".into(),
        ..Default::default()
    }
}

fn resume(key: &str, on_success: bool) -> SuspendRequest {
    SuspendRequest {
        on_success,
        resume_key: Some(key.into()),
        source: "test".into(),
        ..Default::default()
    }
}

/// Every event in the log, oldest first.
fn log(store: &StateStore) -> Vec<Event> {
    let mut out = Vec::new();
    read_from(&crate::events::dir(store.root()), None, &mut |l| match l {
        Line::Event(e, _) => out.push(*e),
        Line::Damaged(t) => panic!("damaged line {t:?}"),
    })
    .unwrap();
    out
}

/// `event/cause` of every event after the first `skip`.
fn kinds(store: &StateStore, skip: usize) -> Vec<String> {
    log(store)
        .iter()
        .skip(skip)
        .map(|e| format!("{}/{}", e.event, e.cause))
        .collect()
}

/// A new job of `job` that suspends on success; returns its key.
async fn suspended(store: &StateStore, p: &FakeProvider, job: u64) -> String {
    let (s, _) = session(store, p, ok(), job, on_success(), "success");
    prepare(&s).await.unwrap();
    cleanup(&s).await.unwrap();
    let id = crate::identity::new_env_id("1", job);
    crate::state::registry::peek(&store.env_paths(id))
        .unwrap()
        .unwrap()
        .key
        .unwrap()
}

fn setup() -> (tempfile::TempDir, StateStore, FakeProvider) {
    let dir = tempfile::tempdir().unwrap();
    let store = StateStore::open(dir.path()).unwrap();
    (dir, store, FakeProvider::default())
}

#[tokio::test]
async fn a_new_job_that_suspends_writes_created_then_suspended() {
    let (_d, store, p) = setup();
    let key = suspended(&store, &p, 1).await;
    assert_eq!(kinds(&store, 0), ["created/job", "suspended/triggers"]);
    let events = log(&store);
    let id = crate::identity::new_env_id("1", 1);
    for e in &events {
        assert_eq!(e.env, Some(id));
        assert_eq!(e.job, Some(1));
        assert_eq!(e.project, Some(5));
        assert_eq!(e.provider, "fake");
        assert!(e.duration_s.is_some(), "{e:?}");
    }
    assert_eq!(events[1].key.as_deref(), Some(key.as_str()));
    assert_eq!(events[1].reason.as_deref(), Some("job succeeded"));
    assert_eq!(events[1].by.as_deref(), Some("job 1"));
}

#[tokio::test]
async fn a_job_request_suspends_with_its_reason() {
    let (_d, store, p) = setup();
    let (s, _) = session(&store, &p, ok(), 1, SuspendRequest::default(), "success");
    prepare(&s).await.unwrap();
    let ctx = Ctx::new(s.log.clone(), s.cancel.clone(), Duration::from_secs(5));
    let locked = crate::state::job::LockedJob::lock(&store, "1", 1, &ctx)
        .await
        .unwrap();
    let mut state = locked.load().unwrap().unwrap();
    state.job_request = Some("which schema?".into());
    locked.save(&state).unwrap();
    drop(locked);
    cleanup(&s).await.unwrap();
    assert_eq!(kinds(&store, 0), ["created/job", "suspended/job_request"]);
    let reason = log(&store)[1].reason.clone().unwrap();
    assert_eq!(reason, "requested by the job: which schema?");
}

/// What the run stage records when a stage script starts (a resumed job
/// that reached none is put back as it was).
async fn ran_a_stage(s: &crate::stages::Session) {
    let ctx = Ctx::new(s.log.clone(), s.cancel.clone(), Duration::from_secs(5));
    let locked = crate::state::job::LockedJob::lock(&s.store, "1", s.job_id(), &ctx)
        .await
        .unwrap();
    let mut state = locked.load().unwrap().unwrap();
    state.phase = crate::state::Phase::Stages;
    locked.save(&state).unwrap();
}

#[tokio::test]
async fn a_resume_writes_resumed_with_how_long_it_was_suspended() {
    let (_d, store, p) = setup();
    let key = suspended(&store, &p, 1).await;
    let (s, _) = session(&store, &p, ok(), 2, resume(&key, true), "success");
    prepare(&s).await.unwrap();
    ran_a_stage(&s).await;
    cleanup(&s).await.unwrap();
    assert_eq!(kinds(&store, 2), ["resumed/job", "suspended/triggers"]);
    let resumed = &log(&store)[2];
    assert_eq!(resumed.job, Some(2));
    assert!(resumed.suspended_s.is_some() && resumed.duration_s.is_some());
    // Without a trigger the resumed environment is released after its job.
    let (s, _) = session(&store, &p, ok(), 3, resume(&key, false), "success");
    prepare(&s).await.unwrap();
    ran_a_stage(&s).await;
    cleanup(&s).await.unwrap();
    assert_eq!(kinds(&store, 4), ["resumed/job", "released/no_trigger"]);
    assert_eq!(log(&store)[5].job, Some(3));
}

#[tokio::test]
async fn a_canceled_job_is_released_as_canceled() {
    let (_d, store, p) = setup();
    let (s, _) = session(&store, &p, ok(), 1, on_success(), "canceled");
    prepare(&s).await.unwrap();
    cleanup(&s).await.unwrap();
    assert_eq!(kinds(&store, 0), ["created/job", "released/canceled"]);
}

#[tokio::test]
async fn suspension_disabled_releases_as_such() {
    let (_d, store, p) = setup();
    let (mut s, _) = session(&store, &p, ok(), 1, on_success(), "success");
    s.settings.suspend.enabled = false;
    prepare(&s).await.unwrap();
    cleanup(&s).await.unwrap();
    assert_eq!(
        kinds(&store, 0),
        ["created/job", "released/suspend_disabled"]
    );
}

#[tokio::test]
async fn a_failed_connection_in_prepare_is_a_failed_step_then_a_release() {
    let (_d, store, p) = setup();
    let broken = FakeTransports {
        exit_code: 0,
        fail_connect: true,
        ..Default::default()
    };
    let (s, _) = session(&store, &p, broken, 1, on_success(), "running");
    assert!(prepare(&s).await.is_err());
    cleanup(&s).await.unwrap();
    assert_eq!(
        kinds(&store, 0),
        ["failed/connect", "released/prepare_failed"]
    );
    assert!(log(&store)[0].error.as_deref().unwrap().contains("connect"));
}

#[tokio::test]
async fn a_failed_create_is_a_failed_step() {
    let (_d, store, p) = setup();
    p.cloud.lock().unwrap().fail_after_create = true;
    let (s, _) = session(&store, &p, ok(), 1, on_success(), "running");
    assert!(prepare(&s).await.is_err());
    cleanup(&s).await.unwrap();
    assert_eq!(
        kinds(&store, 0),
        ["failed/create", "released/prepare_failed"]
    );
    let failed = &log(&store)[0];
    assert!(
        failed.error.as_deref().unwrap().contains("fake failure"),
        "{failed:?}"
    );
}

#[tokio::test]
async fn a_failed_start_is_a_failed_step_and_the_environment_put_back() {
    let (_d, store, p) = setup();
    let key = suspended(&store, &p, 1).await;
    p.cloud.lock().unwrap().fail_start = true;
    let (s, _) = session(&store, &p, ok(), 2, resume(&key, false), "running");
    assert!(prepare(&s).await.is_err());
    cleanup(&s).await.unwrap();
    assert_eq!(kinds(&store, 2), ["failed/start", "suspended/unused"]);
    assert_eq!(log(&store)[2].job, Some(2));
}

#[tokio::test]
async fn a_failed_stop_is_kept_suspended_and_is_a_failed_step() {
    let (_d, store, p) = setup();
    p.cloud.lock().unwrap().fail_stop = true;
    let (s, _) = session(&store, &p, ok(), 1, on_success(), "success");
    prepare(&s).await.unwrap();
    assert!(cleanup(&s).await.is_err());
    assert_eq!(
        kinds(&store, 0),
        ["created/job", "suspended/triggers", "failed/stop"]
    );
    let events = log(&store);
    assert!(events[1]
        .error
        .as_deref()
        .unwrap()
        .contains("fake stop failure"));
    assert!(events[2]
        .error
        .as_deref()
        .unwrap()
        .contains("fake stop failure"));
}

#[tokio::test]
async fn a_failed_delete_is_a_failed_step_and_the_sweep_finishes_it() {
    let (_d, store, p) = setup();
    p.cloud.lock().unwrap().fail_delete = true;
    let (s, _) = session(&store, &p, ok(), 1, SuspendRequest::default(), "success");
    prepare(&s).await.unwrap();
    assert!(cleanup(&s).await.is_err());
    // Cleanup's own slice of the sweep retries the release at once.
    assert_eq!(
        kinds(&store, 0),
        [
            "created/job",
            "failed/delete",
            "failed/delete",
            "sweep/slice"
        ]
    );
    assert_eq!(log(&store)[3].sweep.as_ref().map(|s| s.errors), Some(1));
    p.cloud.lock().unwrap().fail_delete = false;
    let ctx = Ctx::new(s.log.clone(), s.cancel.clone(), Duration::from_secs(5));
    sweep::sweep(s.world(), &s.settings.suspend, sweep::Scope::Full, &ctx)
        .await
        .unwrap();
    assert_eq!(kinds(&store, 4), ["released/retried", "sweep/full"]);
    let summary = log(&store)[5].sweep.clone().unwrap();
    assert_eq!((summary.visited, summary.released), (1, 1));
}

#[tokio::test]
async fn sigterm_during_a_suspension_releases_as_canceled() {
    let (_d, store, p) = setup();
    let (s, _) = session(&store, &p, ok(), 1, on_success(), "success");
    p.cloud.lock().unwrap().cancel_during_stop = Some(s.cancel.clone());
    prepare(&s).await.unwrap();
    cleanup(&s).await.unwrap();
    assert_eq!(
        kinds(&store, 0),
        ["created/job", "suspended/triggers", "released/canceled"]
    );
}

#[tokio::test]
async fn a_stale_claim_is_recovered_then_settled() {
    let (_d, store, p) = setup();
    let (s, _) = session(&store, &p, ok(), 1, on_success(), "success");
    let gone = |mode, suspend_on_failure| Holder::Job {
        runner_id: "1".into(),
        job_id: 9,
        mode,
        suspend_on_failure,
    };
    let machine = Some(crate::provider::Machine::new("m"));
    let cases = [
        (
            Mode::Resume,
            false,
            "recovered/resuspend",
            "suspended/recovered",
        ),
        (Mode::New, true, "recovered/suspend", "suspended/recovered"),
        (Mode::New, false, "recovered/release", "released/recovered"),
    ];
    let mut seen = 0;
    for (mode, on_failure, recovered, settled) in cases {
        let id = uuid::Uuid::new_v4();
        let holder = Some(gone(mode, on_failure));
        crate::state::testing::place(&store, id, EnvStatus::Active, holder, 3600, machine.clone())
            .unwrap();
        let ctx = Ctx::new(s.log.clone(), s.cancel.clone(), Duration::from_secs(5));
        let me = recover::operator("test");
        recover::recover(
            s.world(),
            &store.env_paths(id),
            &me,
            &s.settings.suspend,
            false,
            &ctx,
        )
        .await
        .unwrap();
        assert_eq!(kinds(&store, seen), [recovered, settled]);
        let events = log(&store);
        assert_eq!(events[seen].from.as_deref(), Some("job 9"));
        assert_eq!(events[seen + 1].job, Some(9), "the job it was for");
        seen = events.len();
    }
}

#[tokio::test]
async fn a_ttl_sweep_releases_as_ttl_and_a_quiet_slice_writes_nothing() {
    let (_d, store, p) = setup();
    let (s, _) = session(&store, &p, ok(), 1, on_success(), "success");
    let ctx = Ctx::new(s.log.clone(), s.cancel.clone(), Duration::from_secs(5));
    let fresh = uuid::Uuid::new_v4();
    crate::state::testing::place(&store, fresh, EnvStatus::Suspended, None, 0, None).unwrap();
    sweep::sweep(s.world(), &s.settings.suspend, sweep::Scope::Slice, &ctx)
        .await
        .unwrap();
    assert!(
        log(&store).is_empty(),
        "a slice that did nothing: {:?}",
        log(&store)
    );
    let old = uuid::Uuid::new_v4();
    let ttl = s.settings.suspend.ttl.as_secs();
    crate::state::testing::place(&store, old, EnvStatus::Suspended, None, ttl + 10, None).unwrap();
    sweep::sweep(s.world(), &s.settings.suspend, sweep::Scope::Slice, &ctx)
        .await
        .unwrap();
    assert_eq!(kinds(&store, 0), ["released/ttl", "sweep/slice"]);
    assert_eq!(log(&store)[0].env, Some(old));
    sweep::sweep(s.world(), &s.settings.suspend, sweep::Scope::Full, &ctx)
        .await
        .unwrap();
    assert_eq!(
        kinds(&store, 2),
        ["sweep/full"],
        "a full sweep always says so"
    );
    let counts = log(&store)[2].sweep.clone().unwrap();
    assert_eq!((counts.visited, counts.environments), (1, Some(1)));
}
