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
use crate::state::StateStore;
use crate::transport::Transport;

/// Called with the warm id each time a refill asks whether a machine is alive.
type AliveHook = Box<dyn FnMut(uuid::Uuid) + Send>;

/// Warm machines as names in a map: `running`, `handed to <env>`, `deleted`.
#[derive(Clone, Default)]
struct FakeWarm {
    wanted: u32,
    fingerprint: Arc<Mutex<String>>,
    machines: Arc<Mutex<BTreeMap<String, String>>>,
    fail_launch: bool,
    /// Run (once) when `alive` is first asked: what another process does
    /// meanwhile.
    on_alive: Arc<Mutex<Option<AliveHook>>>,
    /// Warm ids whose retire fails, and whose `handed_over` cannot be answered.
    fail_retire: Arc<Mutex<Vec<uuid::Uuid>>>,
    fail_handed_over: Arc<Mutex<Vec<uuid::Uuid>>>,
    /// The machines cannot be counted (`no_room` fails).
    cannot_count: bool,
    /// The provider's cloud: a hand-over makes the machine the
    /// environment's there (its `find` sees it), as a real one does.
    cloud: Option<Arc<Mutex<crate::stages::fakes::FakeCloud>>>,
    /// Holds every launch here (the machine not yet made) until opened.
    launch_gate: Option<Arc<Gate>>,
    /// Holds every hand-over here (the entry `taken`, its lock held) until opened.
    hand_over_gate: Option<Arc<Gate>>,
    /// A job's own machine would wait for a slot (`job_must_wait`).
    full: bool,
}

/// A step where a test holds a fake: the caller says it arrived, then waits
/// until the test opens the gate; meanwhile the test runs something else.
#[derive(Default)]
struct Gate {
    arrived: tokio::sync::Notify,
    open: tokio::sync::Notify,
}

impl Gate {
    async fn pass(&self) {
        self.arrived.notify_one();
        self.open.notified().await;
    }
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
        if let Some(gate) = &self.launch_gate {
            gate.pass().await;
        }
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
    async fn job_must_wait(&self, _ctx: &Ctx) -> Result<bool> {
        Ok(self.full)
    }
    async fn no_room(&self, _ctx: &Ctx) -> Result<Option<String>> {
        if self.cannot_count {
            anyhow::bail!("fake: not allowed to count the machines");
        }
        Ok(None)
    }
    async fn hand_over(
        &self,
        warm: &WarmPaths,
        _m: &Machine,
        env: &EnvPaths,
        _ctx: &Ctx,
    ) -> Result<Machine> {
        if let Some(gate) = &self.hand_over_gate {
            gate.pass().await;
        }
        self.set(warm.id, &format!("handed to {}", env.id));
        let name = format!("dormant-{}", env.id);
        if let Some(cloud) = &self.cloud {
            cloud
                .lock()
                .unwrap()
                .machines
                .insert(name.clone(), crate::provider::MachineState::Running);
        }
        Ok(Machine::new(name).with("warm", warm.id.to_string()))
    }
    async fn handed_over(&self, warm: &WarmPaths, env: &EnvPaths, _ctx: &Ctx) -> Result<bool> {
        if self.fail_handed_over.lock().unwrap().contains(&warm.id) {
            anyhow::bail!("fake: cannot tell whether {} was handed over", warm.id);
        }
        Ok(self.state(warm.id) == Some(format!("handed to {}", env.id)))
    }
    async fn retire(&self, warm: &WarmPaths, _m: Option<&Machine>, _ctx: &Ctx) -> Result<()> {
        if self.fail_retire.lock().unwrap().contains(&warm.id) {
            anyhow::bail!("fake: deleting {} failed", warm.id);
        }
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
        let hook = self.on_alive.lock().unwrap().take();
        if let Some(mut hook) = hook {
            hook(warm.id);
        }
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
async fn a_failed_launch_is_retired_at_once() {
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
}

/// Real refills and takes run at once (one held at a step by a [`Gate`]
/// while the other runs): a second refill while one boots does nothing and
/// says so; a take while a refill boots gets the ready machine, never the
/// booting one; a refill while a take hands a machine over leaves that
/// machine alone and boots what the pool then lacks. Each machine goes to
/// one environment, none is retired or lost.
#[tokio::test]
async fn refills_and_takes_at_once_hand_nothing_out_twice_and_two_refills_never_run_together() {
    let rig = Rig::new();
    let warm = FakeWarm::new(2);
    assert_eq!(rig.refill(&warm, true).await.launched.len(), 2);
    let env0 = rig.env();
    let t0 = take(rig.w(), &warm, &spec(&env0), &env0, &ctx())
        .await
        .unwrap()
        .unwrap();
    let ready = rig.entries();
    assert_eq!(ready.len(), 1);
    let ready_id = ready[0].id;

    // 1. A refill held in its launch (it holds the pool's refill lock and the
    //    booting entry's lock); meanwhile another refill and a take.
    let gate = Arc::new(Gate::default());
    let booting = FakeWarm {
        launch_gate: Some(gate.clone()),
        ..warm.clone()
    };
    let env1 = rig.env();
    let (a, (b, t1)) = tokio::join!(rig.refill(&booting, true), async {
        gate.arrived.notified().await;
        let b = rig.refill(&warm, true).await;
        let t1 = take(rig.w(), &warm, &spec(&env1), &env1, &ctx())
            .await
            .unwrap();
        gate.open.notify_one();
        (b, t1)
    });
    assert!(
        b.skipped.as_deref() == Some("another refill of this pool is running")
            && b.launched.is_empty()
            && b.retired.is_empty(),
        "{b:?}"
    );
    assert_eq!(a.launched.len(), 1, "{a:?}");
    assert!(a.errors.is_empty() && a.retired.is_empty(), "{a:?}");
    let t1 = t1.expect("the ready machine is taken while another boots");
    assert_eq!(t1.warm_id, ready_id, "never the booting one");
    assert_eq!(
        rig.entries()
            .iter()
            .map(|e| (e.id, e.status.clone()))
            .collect::<Vec<_>>(),
        vec![(a.launched[0], WarmStatus::Ready)]
    );

    // 2. A take held in its hand-over (the entry `taken`, its lock held);
    //    meanwhile a refill.
    let gate = Arc::new(Gate::default());
    let handing = FakeWarm {
        hand_over_gate: Some(gate.clone()),
        ..warm.clone()
    };
    let env2 = rig.env();
    let (spec2, ctx2) = (spec(&env2), ctx());
    let (t2, r) = tokio::join!(take(rig.w(), &handing, &spec2, &env2, &ctx2), async {
        gate.arrived.notified().await;
        let r = rig.refill(&warm, true).await;
        gate.open.notify_one();
        r
    });
    let t2 = t2.unwrap().expect("the hand-over finishes");
    assert_eq!(t2.warm_id, a.launched[0]);
    assert!(
        r.retired.is_empty() && r.errors.is_empty(),
        "the machine being handed over is left alone: {r:?}"
    );
    assert_eq!(r.launched.len(), 2, "the pool lacks two: {r:?}");

    // Each taken machine is its own environment's; the pool holds the two
    // new ones; nothing was deleted.
    for (t, env) in [(&t0, &env0), (&t1, &env1), (&t2, &env2)] {
        assert_eq!(warm.state(t.warm_id), Some(format!("handed to {}", env.id)));
    }
    let mut pool: Vec<_> = rig.entries().iter().map(|e| e.id).collect();
    pool.sort();
    let mut fresh = r.launched.clone();
    fresh.sort();
    assert_eq!(pool, fresh);
    assert!(fresh
        .iter()
        .all(|id| warm.state(*id).as_deref() == Some("running")));
    assert_eq!(warm.machines.lock().unwrap().len(), 5);
    let ev = rig.events();
    assert_eq!(
        ev.iter().filter(|e| *e == "warm/taken").count(),
        3,
        "{ev:?}"
    );
    assert!(!ev.iter().any(|e| e == "warm/retired"), "{ev:?}");
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

/// The refill decides each entry on what it says under the entry's lock: a
/// prepare that took a machine (and was killed after the hand-over) while
/// the refill was busy with another entry leaves it `taken` and handed
/// over, and the refill only forgets the entry. (Acting on what it had read
/// before, `ready`, it would find the machine not running as a warm one and
/// delete the environment's machine.)
#[tokio::test]
async fn a_refill_acts_on_what_an_entry_says_under_its_lock() {
    let rig = Rig::new();
    let warm = FakeWarm::new(2);
    rig.refill(&warm, true).await;
    let mut ids: Vec<uuid::Uuid> = rig.entries().iter().map(|e| e.id).collect();
    ids.sort();
    let (first, second) = (ids[0], ids[1]);
    let env = rig.env();
    // While the refill asks about the first, a prepare takes the second,
    // hands it over and is killed (its entry left `taken`, lock free).
    let (pool, w2) = (rig.pool(), warm.clone());
    *warm.on_alive.lock().unwrap() = Some(Box::new(move |asked| {
        assert_eq!(asked, first, "the refill visits the entries in id order");
        mark_taken(&pool, second, env.id);
        w2.set(second, &format!("handed to {}", env.id));
    }));
    let r = rig.refill(&warm, false).await;
    assert!(r.retired.is_empty() && r.errors.is_empty(), "{r:?}");
    assert_eq!(
        warm.state(second),
        Some(format!("handed to {}", env.id)),
        "the environment keeps its machine"
    );
    let left: Vec<uuid::Uuid> = rig.entries().iter().map(|e| e.id).collect();
    assert_eq!(left, vec![first], "the handed-over entry is forgotten");
}

/// A `ready` entry whose lock someone holds is being taken by a prepare (or
/// retired): it will not stay in the pool, so it does not count, and the
/// refill boots its replacement now rather than a refill later.
#[tokio::test]
async fn a_ready_machine_being_taken_does_not_count_toward_the_pool() {
    let rig = Rig::new();
    let warm = FakeWarm::new(2);
    rig.refill(&warm, true).await;
    let ids: Vec<uuid::Uuid> = rig.entries().iter().map(|e| e.id).collect();
    let taking = rig.pool().try_lock(ids[0]).unwrap().unwrap();
    let r = rig.refill(&warm, true).await;
    assert_eq!(r.launched.len(), 1, "{r:?}");
    assert_eq!(r.ready, 1, "{r:?}");
    drop(taking);
}

/// One entry that cannot be dealt with (an unreadable warm.json, a
/// hand-over whose state cannot be read, a retire that fails) is reported,
/// and the rest of the pool is still served.
#[tokio::test]
async fn one_bad_entry_is_reported_and_the_rest_of_the_pool_is_served() {
    let rig = Rig::new();
    let warm = FakeWarm::new(1);
    let pool = rig.pool();
    // An entry whose warm.json is not JSON.
    let (bad, _e, lock) = pool
        .begin_launch("fake", "image-1", "image-1", None)
        .unwrap();
    drop(lock);
    std::fs::write(&bad.entry, "{ not json").unwrap();
    // A prepare killed mid hand-over, whose machine's state cannot be read now.
    let (unknown, mut entry, lock) = pool
        .begin_launch("fake", "image-1", "image-1", None)
        .unwrap();
    warm.set(unknown.id, "running");
    entry.machine = Some(Machine::new(unknown.id.to_string()));
    entry.status = WarmStatus::Taken {
        env: uuid::Uuid::new_v4(),
    };
    pool.set(&lock, &entry).unwrap();
    drop(lock);
    warm.fail_handed_over.lock().unwrap().push(unknown.id);
    // One being retired whose delete fails.
    let (stuck, mut entry, lock) = pool
        .begin_launch("fake", "image-1", "image-1", None)
        .unwrap();
    warm.set(stuck.id, "running");
    entry.status = WarmStatus::Retiring {
        why: "too old".into(),
    };
    pool.set(&lock, &entry).unwrap();
    drop(lock);
    warm.fail_retire.lock().unwrap().push(stuck.id);

    let r = rig.refill(&warm, true).await;
    assert_eq!(r.launched.len(), 1, "the pool is still served: {r:?}");
    assert_eq!(r.errors.len(), 3, "{r:?}");
    for id in [bad.id, unknown.id, stuck.id] {
        assert!(
            r.errors.iter().any(|e| e.contains(&id.to_string())),
            "{id} named: {r:?}"
        );
    }
    assert!(
        r.errors.iter().any(|e| e.contains("warm.json")),
        "the unreadable file named: {r:?}"
    );
    assert!(bad.entry.is_file(), "an unreadable entry is never deleted");
}

/// Not knowing whether there is room (the machines could not be counted)
/// is an error the operator hears of, not a quiet "no room".
#[tokio::test]
async fn machines_that_cannot_be_counted_are_an_error_not_a_skip() {
    let rig = Rig::new();
    let warm = FakeWarm {
        cannot_count: true,
        ..FakeWarm::new(1)
    };
    let r = rig.refill(&warm, true).await;
    assert!(r.launched.is_empty() && r.skipped.is_none(), "{r:?}");
    assert!(
        r.errors.iter().any(|e| e.contains("not allowed to count")),
        "{r:?}"
    );
}

/// Machine mode: a prepare that took a warm machine, finished the
/// hand-over (the entry gone) and was killed before recording it, whose
/// cleanup died too, is retried: the retry finds the machine the provider
/// already has for the environment and takes no second one (the caller's
/// create adopts the first). A second would be left out of the record.
#[tokio::test]
async fn a_retried_new_environment_that_already_has_its_warm_machine_takes_no_second_one() {
    let rig = Rig::new();
    let warm = FakeWarm {
        cloud: Some(rig.provider.cloud.clone()),
        ..FakeWarm::new(2)
    };
    rig.refill(&warm, true).await;
    let env = rig.env();
    let first = take(rig.w(), &warm, &spec(&env), &env, &ctx())
        .await
        .unwrap()
        .expect("the first attempt takes one");
    let before = rig.entries();
    assert_eq!(before.len(), 1);
    // The retry of the same prepare (same environment id).
    let again = take(rig.w(), &warm, &spec(&env), &env, &ctx())
        .await
        .unwrap();
    assert!(
        again.is_none(),
        "a second warm machine taken for environment {}",
        env.id
    );
    assert_eq!(rig.entries(), before, "the other stays in the pool");
    assert_eq!(warm.state(before[0].id).as_deref(), Some("running"));
    use crate::provider::Provider;
    assert_eq!(
        rig.provider
            .find(env.id, &ctx())
            .await
            .unwrap()
            .map(|m| m.id),
        Some(first.machine.id),
        "what the retry's create adopts"
    );
}

/// A job that fits and finds no slot for a machine of its own waits for the
/// warm machine that is booting and takes it once ready (qemu's case: its
/// own VM would wait for a slot, and the warm VM, once ready, would give its
/// slot up and be killed); with room, it never waits.
#[tokio::test]
async fn a_job_without_a_free_slot_takes_the_warm_machine_that_becomes_ready() {
    let rig = Rig::new();
    let gate = Arc::new(Gate::default());
    let booting = FakeWarm {
        launch_gate: Some(gate.clone()),
        full: true,
        ..FakeWarm::new(1)
    };
    let env = rig.env();
    // The take starts while the refill is held in the launch (the entry
    // `launching`, its lock held); the gate opens only after the take has
    // looked once (`join!` polls the take first, and it does not finish
    // while it waits).
    let (refilled, taken) = tokio::join!(rig.refill(&booting, true), async {
        gate.arrived.notified().await;
        let (job, c) = (spec(&env), ctx());
        let (taken, ()) = tokio::join!(take(rig.w(), &booting, &job, &env, &c), async {
            gate.open.notify_one()
        });
        taken
    });
    assert_eq!(refilled.launched.len(), 1, "{refilled:?}");
    let taken = taken
        .unwrap()
        .expect("the machine that became ready is taken");
    assert_eq!(taken.warm_id, refilled.launched[0]);
    assert!(rig.entries().is_empty(), "{:?}", rig.entries());
    assert!(
        rig.events().iter().any(|e| e.contains("taken")),
        "{:?}",
        rig.events()
    );
}

/// A job that cannot take a warm machine (another image) and would wait for
/// a slot makes the oldest ready one give its slot up (retired through the
/// pool, with its event); with a free slot it leaves it alone. The decision
/// is the lifecycle's, on the provider's report (`job_must_wait`).
#[tokio::test]
async fn a_job_that_cannot_take_one_retires_a_ready_warm_machine_only_without_a_free_slot() {
    let rig = Rig::new();
    let room = FakeWarm::new(1);
    rig.refill(&room, true).await;
    let id = rig.entries()[0].id;
    let env = rig.env();
    let other_image = MachineSpec {
        image: Some("ubuntu".into()),
        ..spec(&env)
    };
    assert!(take(rig.w(), &room, &other_image, &env, &ctx())
        .await
        .unwrap()
        .is_none());
    assert_eq!(room.state(id).as_deref(), Some("running"), "a free slot");
    assert_eq!(rig.entries().len(), 1);

    let full = FakeWarm {
        full: true,
        ..room.clone()
    };
    assert!(take(rig.w(), &full, &other_image, &env, &ctx())
        .await
        .unwrap()
        .is_none());
    assert_eq!(full.state(id).as_deref(), Some("deleted"));
    assert!(rig.entries().is_empty(), "{:?}", rig.entries());
    assert!(
        rig.events().iter().any(|e| e == "warm/retired"),
        "{:?}",
        rig.events()
    );
}

/// A job that can take a warm machine never makes one give its slot up: at
/// the limit, with one ready, it takes it.
#[tokio::test]
async fn a_job_that_fits_takes_the_ready_warm_machine_at_the_limit() {
    let rig = Rig::new();
    let full = FakeWarm {
        full: true,
        ..FakeWarm::new(1)
    };
    rig.refill(&full, true).await;
    let id = rig.entries()[0].id;
    let env = rig.env();
    let taken = take(rig.w(), &full, &spec(&env), &env, &ctx())
        .await
        .unwrap()
        .expect("taken");
    assert_eq!(taken.warm_id, id);
    assert_eq!(full.state(id), Some(format!("handed to {}", env.id)));
}
