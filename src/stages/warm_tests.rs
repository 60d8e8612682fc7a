//! The warm pool's rules (`lifecycle/warm.rs`) against an in-memory provider: what is taken, what
//! is retired and why, what a killed process leaves and who finishes it.
//! (The real-VM side: `tests/integration/qemu_warm.rs`.)

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Result;
use async_trait::async_trait;

use crate::context::Ctx;
use crate::events::read::{read_from, Line};
use crate::lifecycle::warm::take;
use crate::lifecycle::warm_refill::{refill, OpenTransport, RefillReport};
use crate::lifecycle::World;
use crate::model::{EnvPaths, Machine, Target};
use crate::provider::warm::{WarmKind, WarmMachines};
use crate::provider::MachineSpec;
use crate::stages::fakes::{FakeProvider, FakeTransports};
use crate::state::pool::{Pool, WarmEntry, WarmPaths, WarmStatus};
use crate::state::{FileLock, StateStore};
use crate::transport::Transport;

/// Warm machines as names in a map: `running`, `handed to <env>`, `deleted`.
#[derive(Clone, Default)]
struct FakeWarm {
    wanted: u32,
    fingerprint: Arc<Mutex<String>>,
    machines: Arc<Mutex<BTreeMap<String, String>>>,
    fail_launch: bool,
}

impl FakeWarm {
    fn new(wanted: u32) -> Self {
        let f = FakeWarm {
            wanted,
            ..Default::default()
        };
        *f.fingerprint.lock().unwrap() = "image-1".into();
        f
    }
    fn state(&self, id: uuid::Uuid) -> Option<String> {
        self.machines.lock().unwrap().get(&id.to_string()).cloned()
    }
    fn set(&self, id: uuid::Uuid, s: &str) {
        self.machines
            .lock()
            .unwrap()
            .insert(id.to_string(), s.into());
    }
}

#[async_trait]
impl WarmMachines for FakeWarm {
    fn wanted(&self) -> u32 {
        self.wanted
    }
    fn max_age(&self) -> Duration {
        Duration::from_secs(3600)
    }
    fn kind(&self) -> Result<WarmKind> {
        let f = self.fingerprint.lock().unwrap().clone();
        Ok(WarmKind {
            made_from: f.clone(),
            fingerprint: f,
        })
    }
    fn fits(&self, spec: &MachineSpec) -> bool {
        spec.image.is_none()
    }
    async fn launch(
        &self,
        warm: &WarmPaths,
        _zone: Option<&str>,
        key: &str,
        _ctx: &Ctx,
    ) -> Result<Machine> {
        assert!(key.starts_with("ssh-ed25519 "), "{key}");
        if self.fail_launch {
            self.set(warm.id, "running");
            anyhow::bail!("fake boot failure");
        }
        self.set(warm.id, "running");
        Ok(Machine::new(warm.id.to_string()))
    }
    async fn find_launched(&self, warm: &WarmPaths, _ctx: &Ctx) -> Result<Option<Machine>> {
        Ok(self
            .state(warm.id)
            .filter(|s| s == "running")
            .map(|_| Machine::new(warm.id.to_string())))
    }
    async fn hand_over(
        &self,
        warm: &WarmPaths,
        _m: &Machine,
        env: &EnvPaths,
        _ctx: &Ctx,
    ) -> Result<Machine> {
        self.set(warm.id, &format!("handed to {}", env.id));
        Ok(Machine::new(format!("dormant-{}", env.id)).with("warm", warm.id.to_string()))
    }
    async fn handed_over(&self, warm: &WarmPaths, env: &EnvPaths, _ctx: &Ctx) -> Result<bool> {
        Ok(self.state(warm.id) == Some(format!("handed to {}", env.id)))
    }
    async fn retire(&self, warm: &WarmPaths, _m: Option<&Machine>, _ctx: &Ctx) -> Result<()> {
        assert!(
            !self
                .state(warm.id)
                .unwrap_or_default()
                .starts_with("handed"),
            "a handed-over machine is never retired"
        );
        self.set(warm.id, "deleted");
        Ok(())
    }
    async fn alive(&self, warm: &WarmPaths, _m: &Machine, _ctx: &Ctx) -> Result<bool> {
        Ok(self.state(warm.id).as_deref() == Some("running"))
    }
}

/// Pins by writing known_hosts, as a first SSH connection does.
struct FakeOpen(FakeTransports);

impl OpenTransport for FakeOpen {
    fn open(&self, _t: &Target, paths: &EnvPaths) -> Result<Box<dyn Transport>> {
        std::fs::write(&paths.known_hosts, "[fake]:22 ssh-ed25519 AAAA\n")?;
        use crate::stages::Transports;
        self.0.open(_t, paths)
    }
}

struct Rig {
    _dir: tempfile::TempDir,
    store: StateStore,
    provider: FakeProvider,
    events: crate::events::EventLog,
}

impl Rig {
    fn new() -> Rig {
        let dir = tempfile::tempdir().unwrap();
        let store = StateStore::open(dir.path()).unwrap();
        let events = crate::events::EventLog::new(store.root(), &Default::default());
        Rig {
            _dir: dir,
            store,
            provider: FakeProvider::default(),
            events,
        }
    }
    fn w(&self) -> World<'_> {
        World {
            store: &self.store,
            provider: &self.provider,
            events: &self.events,
        }
    }
    fn pool(&self) -> Pool {
        Pool::new(&self.store)
    }
    fn entries(&self) -> Vec<WarmEntry> {
        self.pool()
            .entries()
            .unwrap()
            .into_iter()
            .map(|(_, e)| e.unwrap().unwrap())
            .collect()
    }
    fn events(&self) -> Vec<String> {
        let mut out = Vec::new();
        read_from(&crate::events::dir(self.store.root()), None, &mut |l| {
            if let Line::Event(e, _) = l {
                out.push(format!("{}/{}", e.event, e.cause));
            }
        })
        .unwrap();
        out
    }
    fn env(&self) -> EnvPaths {
        let env = self.store.env_paths(uuid::Uuid::new_v4());
        std::fs::create_dir_all(&env.dir).unwrap();
        env
    }
    async fn refill(&self, warm: &FakeWarm, launch: bool) -> RefillReport {
        refill(
            self.w(),
            warm,
            &FakeOpen(FakeTransports::default()),
            launch,
            &ctx(),
        )
        .await
        .unwrap()
    }
}

/// What a prepare killed right after `taken` leaves: the entry taken for
/// `env`, its lock free.
fn mark_taken(pool: &Pool, id: uuid::Uuid, env: uuid::Uuid) {
    let lock = pool.try_lock(id).unwrap().unwrap();
    let mut e = pool.peek(id).unwrap().unwrap();
    e.status = WarmStatus::Taken { env };
    pool.set(&lock, &e).unwrap();
}

fn ctx() -> Ctx {
    Ctx::new(
        crate::context::JobLog::stderr(),
        Default::default(),
        Duration::from_secs(60),
    )
}

fn spec(env: &EnvPaths) -> MachineSpec {
    MachineSpec {
        env_id: env.id,
        name: MachineSpec::machine_name(env.id),
        runner_id: "1".into(),
        system_id: "s".into(),
        project_id: 1,
        job_id: 1,
        image: None,
        variables: Default::default(),
        ssh_public_key: None,
        paths: env.clone(),
        volume: None,
    }
}

#[tokio::test]
async fn a_refill_boots_what_is_wanted_pinned_and_a_prepare_takes_it_with_its_key() {
    let rig = Rig::new();
    let warm = FakeWarm::new(2);
    let r = rig.refill(&warm, true).await;
    assert_eq!(r.launched.len(), 2, "{r:?}");
    let entries = rig.entries();
    assert!(entries.iter().all(|e| e.status == WarmStatus::Ready));
    let first = entries
        .iter()
        .min_by_key(|e| e.launched_at)
        .unwrap()
        .clone();
    let wp = rig.pool().paths(first.id);
    assert!(wp.paths.known_hosts.is_file(), "pinned before it is ready");
    let public = std::fs::read_to_string(wp.paths.ssh_key.with_extension("pub")).unwrap();

    let env = rig.env();
    let taken = take(rig.w(), &warm, &spec(&env), &env, &ctx())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        warm.state(taken.warm_id),
        Some(format!("handed to {}", env.id))
    );
    assert_eq!(
        std::fs::read_to_string(env.ssh_key.with_extension("pub")).unwrap(),
        public,
        "the machine's own key moved with it"
    );
    assert!(env.known_hosts.is_file() && env.ssh_key.is_file());
    assert_eq!(rig.entries().len(), 1, "its entry is gone, the other stays");
    // A second refill boots one to replace it; nothing more.
    assert_eq!(rig.refill(&warm, true).await.launched.len(), 1);
    assert_eq!(rig.refill(&warm, true).await.launched.len(), 0);
    let ev = rig.events();
    assert_eq!(
        ev.iter().filter(|e| *e == "warm/launched").count(),
        3,
        "{ev:?}"
    );
    assert_eq!(
        ev.iter().filter(|e| *e == "warm/ready").count(),
        3,
        "{ev:?}"
    );
    assert_eq!(
        ev.iter().filter(|e| *e == "warm/taken").count(),
        1,
        "{ev:?}"
    );
}

#[tokio::test]
async fn nothing_is_taken_that_does_not_fit_or_is_stale_and_a_miss_is_recorded() {
    let rig = Rig::new();
    let warm = FakeWarm::new(1);
    let env = rig.env();
    assert!(take(rig.w(), &warm, &spec(&env), &env, &ctx())
        .await
        .unwrap()
        .is_none());
    assert_eq!(rig.events(), vec!["warm/missed"]);
    rig.refill(&warm, true).await;
    // Another image asked for.
    let mut other = spec(&env);
    other.image = Some("ubuntu".into());
    assert!(take(rig.w(), &warm, &other, &env, &ctx())
        .await
        .unwrap()
        .is_none());
    // The settings changed since it booted: not handed out, and retired.
    *warm.fingerprint.lock().unwrap() = "image-2".into();
    assert!(take(rig.w(), &warm, &spec(&env), &env, &ctx())
        .await
        .unwrap()
        .is_none());
    let id = rig.entries()[0].id;
    let r = rig.refill(&warm, false).await;
    assert_eq!(r.retired.len(), 1);
    assert!(r.retired[0].1.contains("settings that changed"), "{r:?}");
    assert_eq!(warm.state(id).as_deref(), Some("deleted"));
    // A dead one is skipped by a prepare and retired by the next refill.
    rig.refill(&warm, true).await;
    let id = rig.entries()[0].id;
    warm.set(id, "stopped");
    assert!(take(rig.w(), &warm, &spec(&env), &env, &ctx())
        .await
        .unwrap()
        .is_none());
    let r = rig.refill(&warm, false).await;
    assert!(
        r.retired
            .iter()
            .any(|(i, why)| *i == id && why.contains("stopped running")),
        "{r:?}"
    );
}

#[tokio::test]
async fn warm_zero_retires_every_warm_machine_and_takes_none() {
    let rig = Rig::new();
    rig.refill(&FakeWarm::new(2), true).await;
    let off = FakeWarm {
        wanted: 0,
        ..FakeWarm::new(0)
    };
    *off.machines.lock().unwrap() = Default::default();
    for e in rig.entries() {
        off.set(e.id, "running");
    }
    let env = rig.env();
    assert!(take(rig.w(), &off, &spec(&env), &env, &ctx())
        .await
        .unwrap()
        .is_none());
    let r = rig.refill(&off, false).await;
    assert_eq!(r.retired.len(), 2, "{r:?}");
    assert!(rig.entries().is_empty());
    assert!(off
        .machines
        .lock()
        .unwrap()
        .values()
        .all(|s| s == "deleted"));
}

#[tokio::test]
async fn what_a_killed_process_left_is_finished_by_the_next_one() {
    let rig = Rig::new();
    let warm = FakeWarm::new(1);
    let pool = rig.pool();
    // A launch killed after its machine booted: `launching`, lock free.
    let (wp, mut entry, lock) = pool
        .begin_launch("fake", "image-1", "image-1", None)
        .unwrap();
    warm.set(wp.id, "running");
    entry.machine = Some(Machine::new(wp.id.to_string()));
    pool.set(&lock, &entry).unwrap();
    drop(lock);
    // While its launcher lives (lock held), nobody touches it.
    let held = pool.try_lock(wp.id).unwrap().unwrap();
    let r = rig.refill(&warm, false).await;
    assert!(r.retired.is_empty(), "{r:?}");
    drop(held);
    let r = rig.refill(&warm, false).await;
    assert_eq!(r.retired.len(), 1, "{r:?}");
    assert!(r.retired[0].1.contains("launch was killed"));
    assert_eq!(warm.state(wp.id).as_deref(), Some("deleted"), "not leaked");

    // A prepare killed after `taken`, before the hand-over: its retry finishes it.
    rig.refill(&warm, true).await;
    let id = rig.entries()[0].id;
    let env = rig.env();
    mark_taken(&pool, id, env.id);
    let taken = take(rig.w(), &warm, &spec(&env), &env, &ctx())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(taken.warm_id, id, "the retry finished the same hand-over");
    assert!(rig.entries().is_empty());

    // ... or, if no retry comes, the next refill retires it (not handed over).
    rig.refill(&warm, true).await;
    let id = rig.entries()[0].id;
    let gone_env = rig.env();
    mark_taken(&pool, id, gone_env.id);
    // Another environment's prepare does not take a machine taken for another.
    let env3 = rig.env();
    assert!(take(rig.w(), &warm, &spec(&env3), &env3, &ctx())
        .await
        .unwrap()
        .is_none());
    let r = rig.refill(&warm, false).await;
    assert!(
        r.retired
            .iter()
            .any(|(i, why)| *i == id && why.contains("died before the hand-over")),
        "{r:?}"
    );
    assert_eq!(warm.state(id).as_deref(), Some("deleted"));

    // A prepare killed after the hand-over: the machine is the
    // environment's; the refill only forgets the entry.
    rig.refill(&warm, true).await;
    let id = rig.entries()[0].id;
    let env4 = rig.env();
    mark_taken(&pool, id, env4.id);
    warm.set(id, &format!("handed to {}", env4.id));
    let r = rig.refill(&warm, false).await;
    assert!(r.retired.is_empty(), "{r:?}");
    assert!(rig.entries().is_empty());
    assert_eq!(warm.state(id), Some(format!("handed to {}", env4.id)));
}

#[tokio::test]
async fn a_failed_launch_is_retired_at_once_and_two_refills_never_run_together() {
    let rig = Rig::new();
    let warm = FakeWarm {
        fail_launch: true,
        ..FakeWarm::new(1)
    };
    let r = rig.refill(&warm, true).await;
    assert_eq!(r.errors.len(), 1, "{r:?}");
    assert!(rig.entries().is_empty());
    assert!(warm
        .machines
        .lock()
        .unwrap()
        .values()
        .all(|s| s == "deleted"));
    let held = FileLock::try_acquire(&rig.pool().refill_lock())
        .unwrap()
        .unwrap();
    let r = rig.refill(&FakeWarm::new(1), true).await;
    assert!(r.skipped.is_some() && r.launched.is_empty(), "{r:?}");
    drop(held);
}

#[tokio::test]
async fn a_hand_over_whose_environment_was_released_meanwhile_is_dropped_and_the_retry_boots() {
    let rig = Rig::new();
    let warm = FakeWarm::new(1);
    rig.refill(&warm, true).await;
    let id = rig.entries()[0].id;
    let env = rig.env();
    let pool = rig.pool();
    // Killed after the machine moved into the environment; the runner's
    // cleanup released the environment, and the machine with it.
    mark_taken(&pool, id, env.id);
    warm.set(id, "deleted");
    // The retried prepare (same environment id): nothing to take; the
    // entry is dropped, and no other machine is harmed.
    assert!(take(rig.w(), &warm, &spec(&env), &env, &ctx())
        .await
        .unwrap()
        .is_none());
    assert!(rig.entries().is_empty());
    assert!(
        rig.events().iter().any(|e| e == "warm/retired"),
        "{:?}",
        rig.events()
    );
}

/// A new volume-mode environment takes its warm machine before its volume
/// (`For::NewBeforeVolume`): a retried prepare whose killed attempt already
/// got a machine (handed over, its volume not recorded; the runner's cleanup
/// did not run) takes no second one — its launch path adopts the first — but
/// still finishes a hand-over that the killed attempt left half done.
#[tokio::test]
async fn a_new_volume_environment_that_already_has_a_machine_takes_no_second_one() {
    use crate::lifecycle::warm::{take_for, For};
    use crate::provider::MachineState;
    let rig = Rig::new();
    let warm = FakeWarm::new(2);
    rig.refill(&warm, true).await;
    let env = rig.env();
    // The killed attempt's machine, found by the provider.
    rig.provider
        .cloud
        .lock()
        .unwrap()
        .machines
        .insert(format!("dormant-{}", env.id), MachineState::Running);
    let before = rig.entries();
    let t = take_for(
        rig.w(),
        &warm,
        &spec(&env),
        &env,
        For::NewBeforeVolume,
        &ctx(),
    )
    .await
    .unwrap();
    assert!(t.is_none(), "a second machine for the environment");
    assert_eq!(rig.entries(), before, "the pool is untouched");
    assert!(
        before
            .iter()
            .all(|e| warm.state(e.id).as_deref() == Some("running")),
        "none handed over"
    );

    // A hand-over the killed attempt began (its entry `taken` for this
    // environment) is finished first, whatever the provider finds.
    let id = before[0].id;
    mark_taken(&rig.pool(), id, env.id);
    let t = take_for(
        rig.w(),
        &warm,
        &spec(&env),
        &env,
        For::NewBeforeVolume,
        &ctx(),
    )
    .await
    .unwrap()
    .expect("the begun hand-over finished");
    assert_eq!(t.warm_id, id);

    // Another environment without a machine takes the other one.
    let other = rig.env();
    let t = take_for(
        rig.w(),
        &warm,
        &spec(&other),
        &other,
        For::NewBeforeVolume,
        &ctx(),
    )
    .await
    .unwrap()
    .expect("a warm machine");
    assert_eq!(
        warm.state(t.warm_id),
        Some(format!("handed to {}", other.id))
    );
    assert!(rig.entries().is_empty());
}
