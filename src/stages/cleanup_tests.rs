//! Unit tests of cleanup against the in-memory provider and transports.
use super::*;
use crate::job::SuspendRequest;
use crate::stages::fakes::{session, FakeProvider, FakeTransports};
use crate::state::{registry, EnvStatus, EnvironmentRecord, StateStore};

/// Reads a record (tests only).
trait Peek {
    fn peek(&self) -> Result<Option<EnvironmentRecord>>;
}
impl Peek for EnvPaths {
    fn peek(&self) -> Result<Option<EnvironmentRecord>> {
        registry::peek(self)
    }
}

fn ok() -> FakeTransports {
    FakeTransports {
        exit_code: 0,
        fail_connect: false,
        ..Default::default()
    }
}

fn suspend_on_success() -> SuspendRequest {
    SuspendRequest {
        on_success: true,
        source: "test".into(),
        ..Default::default()
    }
}

/// Runs a new job that suspends; returns its key.
async fn suspended(store: &StateStore, p: &FakeProvider, job: u64) -> String {
    let (s, _) = session(store, p, ok(), job, suspend_on_success(), "success");
    crate::stages::prepare::prepare(&s).await.unwrap();
    s.log.info("build");
    cleanup(&s).await.unwrap();
    store
        .env_paths(crate::identity::new_env_id("1", job))
        .peek()
        .unwrap()
        .unwrap()
        .key
        .unwrap()
}

fn status(store: &StateStore, key: &str) -> Option<EnvStatus> {
    let id = crate::envkey::EnvironmentKey::parse(key).unwrap().env_id;
    store.env_paths(id).peek().unwrap().map(|r| r.status())
}

fn resume(key: &str, on_success: bool) -> SuspendRequest {
    SuspendRequest {
        on_success,
        resume_key: Some(key.into()),
        source: "test".into(),
        ..Default::default()
    }
}

#[tokio::test]
async fn a_resume_whose_start_fails_goes_back_to_suspended() {
    let dir = tempfile::tempdir().unwrap();
    let store = StateStore::open(dir.path()).unwrap();
    let p = FakeProvider::default();
    let key = suspended(&store, &p, 1).await;
    p.cloud.lock().unwrap().fail_start = true;
    let (s, _) = session(&store, &p, ok(), 2, resume(&key, false), "running");
    assert!(matches!(
        crate::stages::prepare::prepare(&s).await,
        Err(Failure::System(_))
    ));
    assert_eq!(status(&store, &key), Some(EnvStatus::Resuming));
    cleanup(&s).await.unwrap();
    assert_eq!(
        status(&store, &key),
        Some(EnvStatus::Suspended),
        "never released"
    );
    assert!(
        !p.calls().iter().any(|c| c.starts_with("delete")),
        "{:?}",
        p.calls()
    );
}

#[tokio::test]
async fn a_resume_whose_connection_fails_is_stopped_again_and_kept() {
    let dir = tempfile::tempdir().unwrap();
    let store = StateStore::open(dir.path()).unwrap();
    let p = FakeProvider::default();
    let key = suspended(&store, &p, 1).await;
    let broken = FakeTransports {
        exit_code: 0,
        fail_connect: true,
        ..Default::default()
    };
    let (s, _) = session(&store, &p, broken, 2, resume(&key, false), "running");
    assert!(crate::stages::prepare::prepare(&s).await.is_err());
    cleanup(&s).await.unwrap();
    assert_eq!(status(&store, &key), Some(EnvStatus::Suspended));
    let name = crate::provider::MachineSpec::machine_name(crate::identity::new_env_id("1", 1));
    let expected: Vec<String> = ["create", "stop", "start", "stop"]
        .iter()
        .map(|c| format!("{c} {name}"))
        .collect();
    assert_eq!(
        p.calls(),
        expected,
        "the machine started for the resume is stopped again"
    );
}

#[tokio::test]
async fn a_failed_stop_keeps_the_environment_as_suspended_and_reports_it() {
    let dir = tempfile::tempdir().unwrap();
    let store = StateStore::open(dir.path()).unwrap();
    let p = FakeProvider::default();
    p.cloud.lock().unwrap().fail_stop = true;
    let (s, _) = session(&store, &p, ok(), 1, suspend_on_success(), "success");
    crate::stages::prepare::prepare(&s).await.unwrap();
    let err = cleanup(&s).await.unwrap_err();
    assert!(
        matches!(&err, Failure::System(e) if format!("{e:#}").contains("kept as suspended")),
        "{err:?}"
    );
    let rec = store
        .env_paths(crate::identity::new_env_id("1", 1))
        .peek()
        .unwrap()
        .unwrap();
    assert_eq!(rec.status(), EnvStatus::Suspended);
    assert!(rec.last_error.unwrap().contains("fake stop failure"));
    assert!(!p.calls().iter().any(|c| c.starts_with("delete")));
}

#[tokio::test]
async fn sigterm_during_suspension_finishes_the_stop_then_releases() {
    let dir = tempfile::tempdir().unwrap();
    let store = StateStore::open(dir.path()).unwrap();
    let p = FakeProvider::default();
    let (s, _) = session(&store, &p, ok(), 1, suspend_on_success(), "success");
    p.cloud.lock().unwrap().cancel_during_stop = Some(s.cancel.clone());
    crate::stages::prepare::prepare(&s).await.unwrap();
    cleanup(&s).await.unwrap();
    let calls = p.calls();
    let name = crate::provider::MachineSpec::machine_name(crate::identity::new_env_id("1", 1));
    assert_eq!(
        calls,
        vec![
            format!("create {name}"),
            format!("stop {name}"),
            format!("delete {name}")
        ]
    );
    assert_eq!(p.state(&name), Some(crate::provider::MachineState::Gone));
    assert!(!store
        .env_paths(crate::identity::new_env_id("1", 1))
        .exists());
}

#[tokio::test]
async fn a_failed_release_is_retried_by_the_sweep() {
    let dir = tempfile::tempdir().unwrap();
    let store = StateStore::open(dir.path()).unwrap();
    let p = FakeProvider::default();
    p.cloud.lock().unwrap().fail_delete = true;
    let (s, _) = session(&store, &p, ok(), 1, SuspendRequest::default(), "success");
    crate::stages::prepare::prepare(&s).await.unwrap();
    assert!(cleanup(&s).await.is_err());
    let paths = store.env_paths(crate::identity::new_env_id("1", 1));
    assert_eq!(
        paths.peek().unwrap().unwrap().status(),
        EnvStatus::Releasing
    );
    p.cloud.lock().unwrap().fail_delete = false;
    let ctx = Ctx::new(s.log.clone(), s.cancel.clone(), Duration::from_secs(5));
    let report = sweep::sweep(s.world(), &s.settings.suspend, sweep::Scope::Full, &ctx)
        .await
        .unwrap();
    assert_eq!(report.released, vec![paths.id], "{:?}", report.errors);
    assert!(!paths.exists());
}

#[tokio::test]
async fn a_failed_job_with_suspend_on_failure_is_kept_and_a_canceled_one_released() {
    let dir = tempfile::tempdir().unwrap();
    let store = StateStore::open(dir.path()).unwrap();
    let p = FakeProvider::default();
    let on_failure = SuspendRequest {
        on_failure: true,
        source: "test".into(),
        ..Default::default()
    };
    let (s, _) = session(&store, &p, ok(), 1, on_failure.clone(), "failed");
    crate::stages::prepare::prepare(&s).await.unwrap();
    cleanup(&s).await.unwrap();
    assert_eq!(
        store
            .env_paths(crate::identity::new_env_id("1", 1))
            .peek()
            .unwrap()
            .unwrap()
            .status(),
        EnvStatus::Suspended
    );
    let (s, _) = session(&store, &p, ok(), 2, on_failure, "canceled");
    crate::stages::prepare::prepare(&s).await.unwrap();
    cleanup(&s).await.unwrap();
    assert!(!store
        .env_paths(crate::identity::new_env_id("1", 2))
        .exists());
}

#[tokio::test]
async fn cleanup_is_idempotent() {
    let dir = tempfile::tempdir().unwrap();
    let store = StateStore::open(dir.path()).unwrap();
    let p = FakeProvider::default();
    let (s, _) = session(&store, &p, ok(), 1, suspend_on_success(), "success");
    crate::stages::prepare::prepare(&s).await.unwrap();
    cleanup(&s).await.unwrap();
    let calls = p.calls().len();
    cleanup(&s).await.unwrap();
    assert_eq!(p.calls().len(), calls, "a second cleanup does nothing");
}

#[tokio::test]
async fn a_machine_made_before_prepare_died_is_found_and_deleted() {
    let dir = tempfile::tempdir().unwrap();
    let store = StateStore::open(dir.path()).unwrap();
    let p = FakeProvider::default();
    p.cloud.lock().unwrap().fail_after_create = true;
    let (s, _) = session(&store, &p, ok(), 1, suspend_on_success(), "running");
    assert!(crate::stages::prepare::prepare(&s).await.is_err());
    let name = crate::provider::MachineSpec::machine_name(crate::identity::new_env_id("1", 1));
    assert_eq!(p.state(&name), Some(crate::provider::MachineState::Running));
    cleanup(&s).await.unwrap();
    assert_eq!(
        p.state(&name),
        Some(crate::provider::MachineState::Gone),
        "no leaked machine: {:?}",
        p.calls()
    );
}

#[tokio::test]
async fn a_retried_prepare_adopts_its_half_released_environment() {
    let dir = tempfile::tempdir().unwrap();
    let store = StateStore::open(dir.path()).unwrap();
    let p = FakeProvider::default();
    let broken = FakeTransports {
        exit_code: 0,
        fail_connect: true,
        ..Default::default()
    };
    let (s, _) = session(&store, &p, broken, 1, suspend_on_success(), "running");
    assert!(crate::stages::prepare::prepare(&s).await.is_err());
    p.cloud.lock().unwrap().fail_delete = true;
    assert!(cleanup(&s).await.is_err(), "the release failed");
    p.cloud.lock().unwrap().fail_delete = false;
    let (s, _) = session(&store, &p, ok(), 1, suspend_on_success(), "running");
    crate::stages::prepare::prepare(&s)
        .await
        .expect("the retry adopts the environment");
    let rec = store
        .env_paths(crate::identity::new_env_id("1", 1))
        .peek()
        .unwrap()
        .unwrap();
    assert_eq!(rec.status(), EnvStatus::Active);
}
