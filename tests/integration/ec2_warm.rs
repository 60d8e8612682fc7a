//! Warm instances on the EC2 provider (`[ec2] warm = N`), against moto
//! behind the test proxy, SSH to the loopback sshd (the `CloudInit`
//! stand-in authorizes each instance's key from its user-data). What is
//! proven here: `dormant warm` launches a warm instance per zone, tagged
//! `dormant:warm` and no environment's; a new environment's prepare takes
//! it without a RunInstances and retags it as the environment's, and the
//! refill the prepare starts launches the next; a volume's zone picks the
//! warm instance of that zone; a new volume-mode environment takes a warm
//! instance of any zone and makes its volume there; a volume-mode resume
//! takes the warm instance and attaches its volume to it; `max_environments` leaves the last slot to a
//! job; a warm spot instance interrupted while idle is retired and replaced;
//! `sweep` reports and deletes warm instances no pool knows (and `adopt`
//! leaves them alone); `warm = 0` and a sweep terminate every warm instance.
//!
//! Network rule: the instance addresses moto hands out are never contacted.

use std::time::{Duration, Instant};

use async_trait::async_trait;
use aws_sdk_ec2::types::{Instance, InstanceLifecycleType};
use dormant::context::{Ctx, JobLog};
use dormant::events::EventLog;
use dormant::lifecycle::warm::take;
use dormant::lifecycle::warm_refill::{refill, OverSsh};
use dormant::lifecycle::World;
use dormant::model::{EnvPaths, Machine, Volume};
use dormant::provider::ec2::Ec2Provider;
use dormant::provider::warm::{WarmKind, WarmMachines};
use dormant::provider::MachineSpec;
use dormant::settings::Settings;
use dormant::state::pool::{Pool, WarmPaths};
use dormant::state::StateStore;
use tokio_util::sync::CancellationToken;

use crate::ec2_rig::{
    block_on, data_volumes, instance_tags, instances, is_live, key_field, volume, Ec2Env,
};
use crate::harness::{self, assert_result, JobResult, Rig};
use crate::moto::{direct_client, ACCESS_KEY, REGION, SECRET_KEY};

const SYSTEM: &str = "s_0123456789ab";

pub(crate) fn tag<'a>(i: &'a Instance, k: &str) -> Option<&'a str> {
    i.tags()
        .iter()
        .find(|t| t.key() == Some(k))
        .and_then(|t| t.value())
}

/// Live instances tagged `dormant:warm` and no environment's.
fn warm_instances(env: &Ec2Env) -> Vec<Instance> {
    instances(env)
        .into_iter()
        .filter(|i| {
            is_live(i) && tag(i, "dormant:warm").is_some() && tag(i, "dormant:env").is_none()
        })
        .collect()
}

fn text(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// `dormant warm`, once no other refill runs (a prepare that took a warm
/// instance starts one detached): returns its output.
pub(crate) fn warm_now(rig: &Rig) -> String {
    let end = Instant::now() + Duration::from_secs(180);
    loop {
        let out = rig.dormant(&["warm"]);
        let t = text(&out);
        if t.contains("another refill of this pool is running") && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(200));
            continue;
        }
        assert!(out.status.success(), "dormant warm failed: {t}");
        return t;
    }
}

/// The rig's `[ec2]` lines: SSH to the loopback sshd, and `lines`.
fn settings(env: &Ec2Env, lines: &str, tail: &str) -> String {
    env.settings(&format!("{}{lines}", env.connect_address()), tail)
}

#[test]
fn a_new_environment_takes_the_warm_instance_without_a_launch_and_the_pool_is_refilled() {
    let env = Ec2Env::start();
    let rig = env.rig("7", SYSTEM, &settings(&env, "warm = 1\n", ""));

    let out = warm_now(&rig);
    let warm = warm_instances(&env);
    assert_eq!(warm.len(), 1, "one warm instance: {out}");
    let warm_id = warm[0].instance_id().unwrap().to_string();
    let tags = instance_tags(&env, &warm_id);
    assert_eq!(tags.get("dormant:system").map(String::as_str), Some(SYSTEM));
    assert_eq!(
        tags.get("dormant:managed-by").map(String::as_str),
        Some("dormant")
    );
    assert!(
        !tags.contains_key("dormant:env") && !tags.contains_key("dormant:epoch"),
        "no environment's yet: {tags:?}"
    );

    // The job: its prepare takes the warm instance; no RunInstances before its first stage.
    env.proxy.clear_calls();
    let mut first_stage: Option<Instant> = None;
    let report = rig
        .runner
        .run_job_with(
            &harness::job(5)
                .suspend_on(true, false)
                .script("echo on the warm one"),
            &mut |_| {
                first_stage.get_or_insert_with(Instant::now);
            },
        )
        .unwrap();
    assert_result(&report, JobResult::Success);
    let split = first_stage.expect("a stage ran");
    let prepare_launches = env
        .proxy
        .calls()
        .into_iter()
        .filter(|c| c.at < split && c.action == "RunInstances")
        .count();
    assert_eq!(prepare_launches, 0, "{}", report.log());
    assert!(
        report.log().contains("took warm machine"),
        "{}",
        report.log()
    );
    let key = report.key.clone().expect("a key");
    assert_eq!(
        key_field(&key, "instance").as_deref(),
        Some(warm_id.as_str()),
        "{key}"
    );
    let env_id = dormant::envkey::EnvironmentKey::parse(&key).unwrap().env_id;

    // Handed over: the environment's tags, the warm tag gone.
    let tags = instance_tags(&env, &warm_id);
    for (k, v) in [
        ("dormant:env", env_id.to_string()),
        ("dormant:epoch", "1".to_string()),
        ("dormant:project", "5".to_string()),
        ("dormant:runner", "7".to_string()),
        ("Name", format!("dormant-{env_id}")),
    ] {
        assert_eq!(tags.get(k), Some(&v), "{k}: {tags:?}");
    }
    assert!(!tags.contains_key("dormant:warm"), "{tags:?}");
    assert!(
        tags.contains_key("dormant:host-key"),
        "the pin kept for a new host: {tags:?}\n{}",
        report.log()
    );
    assert_eq!(rig.status(&key).as_deref(), Some("suspended"));

    // The refill the prepare started launched the next one (and only one).
    warm_now(&rig);
    let next = warm_instances(&env);
    assert_eq!(next.len(), 1, "refilled");
    assert_ne!(next[0].instance_id(), Some(warm_id.as_str()));
    assert_eq!(
        env.proxy.count("RunInstances"),
        1,
        "{:?}",
        env.proxy.actions()
    );
}

#[test]
fn max_environments_leaves_the_last_slot_to_a_job() {
    let env = Ec2Env::start();
    let rig = env.rig(
        "7",
        SYSTEM,
        &format!(
            "runner_id = \"7\"\n{}",
            settings(&env, "warm = 1\nmax_environments = 2\n", "")
        ),
    );
    // One suspended environment holds a slot: a warm instance would take the last.
    let r = rig.run(&harness::job(5).suspend_on(true, false).script("true"));
    assert_result(&r, JobResult::Success);
    // That job found no warm instance: its prepare's refill may run now.
    let out = warm_now(&rig);
    env.proxy.clear_calls();
    let out2 = warm_now(&rig);
    assert!(
        out2.contains(
            "1 of ec2.max_environments = 2 instances: a warm instance would take the last slot"
        ),
        "{out}\n---\n{out2}"
    );
    assert_eq!(env.proxy.count("RunInstances"), 0, "{out2}");
    assert!(warm_instances(&env).is_empty());

    // warm x zones must stay below max_environments.
    let bad = env.rig(
        "7",
        SYSTEM,
        &format!(
            "runner_id = \"7\"\n{}",
            settings(&env, "warm = 2\nmax_environments = 2\n", "")
        ),
    );
    let t = text(&bad.dormant(&["warm"]));
    assert!(
        t.contains("ec2.warm: 2 warm instances in each of 1 zone(s) leave no room"),
        "{t}"
    );
}

/// At `max_environments`, a job that cannot take the warm instance (it asks
/// for another instance type) does not wait behind it until its prepare
/// timeout: the idle warm instance gives its slot up (terminated, its entry
/// retired through the pool) and the job launches its own instance.
#[test]
fn a_job_that_cannot_take_the_warm_instance_gets_its_slot_at_max_environments() {
    let env = Ec2Env::start();
    let rig = env.rig(
        "7",
        SYSTEM,
        &format!(
            "runner_id = \"7\"\n{}",
            settings(
                &env,
                "warm = 1\nmax_environments = 2\nallowed_instance_types = [\"t3.large\"]\n\
                 prepare_timeout = \"40s\"\n",
                ""
            )
        ),
    );
    warm_now(&rig);
    let warm = warm_instances(&env);
    assert_eq!(warm.len(), 1);
    let warm_id = warm[0].instance_id().unwrap().to_string();
    let own_type = |script: &str| {
        harness::job(5)
            .suspend_on(true, false)
            .var("DORMANT_EC2_INSTANCE_TYPE", "t3.large")
            .script(script)
    };
    // A suspended environment of its own type: with the warm one, both slots.
    let first = rig.run(&own_type("true"));
    assert_result(&first, JobResult::Success);
    assert!(
        !first.log().contains("took warm machine"),
        "{}",
        first.log()
    );
    warm_now(&rig);
    assert_eq!(
        warm_instances(&env).len(),
        1,
        "no room for another warm one"
    );

    let second = rig.run(&own_type("echo on its own type"));
    assert_result(&second, JobResult::Success);
    assert!(
        second
            .log()
            .contains(&format!("({warm_id}) gives its slot up for this job")),
        "{}",
        second.log()
    );
    let key = second.key.clone().expect("a key");
    assert_ne!(
        key_field(&key, "instance").as_deref(),
        Some(warm_id.as_str())
    );
    assert!(
        instances(&env)
            .iter()
            .filter(|i| i.instance_id() == Some(warm_id.as_str()))
            .all(|i| !is_live(i)),
        "the warm instance is terminated"
    );
    // The next refill finishes the retire (event, entry gone) and boots none:
    // two environments hold both slots.
    warm_now(&rig);
    assert!(warm_instances(&env).is_empty());
    let events = text(&rig.dormant(&["events", "--json"]));
    assert!(
        events.lines().any(|l| l.contains("\"retired\"")
            && l.contains("a job that cannot take it needed its slot")),
        "{events}"
    );
    assert!(
        std::fs::read_dir(rig.state_dir.join("warm"))
            .unwrap()
            .flatten()
            .all(|e| !e.path().join("warm.json").exists()),
        "the entry is gone"
    );
}

/// At `max_environments`, a job that *can* take the warm instance, arriving
/// while it boots, waits for it and takes it: it never makes it give its
/// slot up and boots its own (what a job that cannot take it does, above).
/// "Booting" is the pool's `launching` with its launcher's lock held, which
/// the test holds, then lets go once the job asked how many slots are used
/// (the count that, before, came only from its own launch's capacity wait,
/// which then made the instance give its slot up once ready).
#[test]
fn a_job_that_can_take_the_booting_warm_instance_at_max_environments_waits_and_takes_it() {
    let env = Ec2Env::start();
    let rig = env.rig(
        "7",
        SYSTEM,
        &format!(
            "runner_id = \"7\"\n{}",
            settings(
                &env,
                "warm = 1\nmax_environments = 2\nallowed_instance_types = [\"t3.large\"]\n\
                 prepare_timeout = \"60s\"\n",
                ""
            )
        ),
    );
    warm_now(&rig);
    let warm = warm_instances(&env);
    assert_eq!(warm.len(), 1);
    let warm_id = warm[0].instance_id().unwrap().to_string();
    // A suspended environment of another type takes the other slot.
    let first = rig.run(
        &harness::job(5)
            .suspend_on(true, false)
            .var("DORMANT_EC2_INSTANCE_TYPE", "t3.large")
            .script("true"),
    );
    assert_result(&first, JobResult::Success);
    warm_now(&rig);
    assert_eq!(warm_instances(&env).len(), 1);

    // The warm instance is booting again, as far as the pool says.
    let pool = Pool::at(&rig.state_dir);
    let (entry_id, entry) = pool.entries().unwrap().pop().expect("one entry");
    let mut entry = entry.unwrap().expect("readable");
    let lock = pool.try_lock(entry_id).unwrap().expect("no refill runs");
    let ready = entry.status.clone();
    entry.status = dormant::state::pool::WarmStatus::Launching;
    pool.set(&lock, &entry).unwrap();

    env.proxy.clear_calls();
    let since = Instant::now();
    let job = std::thread::scope(|scope| {
        let job = scope.spawn(|| {
            rig.run(
                &harness::job(5)
                    .suspend_on(true, false)
                    .script("echo on the default type"),
            )
        });
        // The job looked at the pool and asked how many slots are used
        // (before, with no ready one, it went on to launch its own).
        env.proxy
            .await_call("DescribeInstances", since, Duration::from_secs(60))
            .expect("the job counts the slots");
        entry.status = ready;
        pool.set(&lock, &entry).unwrap();
        drop(lock);
        job.join().unwrap()
    });
    assert_result(&job, JobResult::Success);
    // Whether it waited for the boot ("which is booting, to take it") or
    // looked again after the count and found it ready depends on when the
    // flip lands; either way it is taken (the wait itself: the fakes'
    // `a_job_without_a_free_slot_takes_the_warm_machine_that_becomes_ready`).
    assert!(job.log().contains("took warm machine"), "{}", job.log());
    assert!(!job.log().contains("gives its slot up"), "{}", job.log());
    assert_eq!(
        key_field(job.key.as_deref().expect("a key"), "instance").as_deref(),
        Some(warm_id.as_str()),
        "the job's environment is the warm instance"
    );
    assert_eq!(env.proxy.count("RunInstances"), 0, "no launch of its own");
    assert_eq!(env.proxy.count("TerminateInstances"), 0);
}

#[test]
fn a_warm_spot_instance_interrupted_while_idle_is_retired_and_replaced() {
    let env = Ec2Env::start();
    let rig = env.rig(
        "7",
        SYSTEM,
        &settings(
            &env,
            "warm = 1\nmarket = \"spot\"\n",
            "[suspend]\nenabled = false\n",
        ),
    );
    warm_now(&rig);
    let warm = warm_instances(&env);
    assert_eq!(warm.len(), 1);
    assert_eq!(
        warm[0].instance_lifecycle(),
        Some(&InstanceLifecycleType::Spot)
    );
    let first = warm[0].instance_id().unwrap().to_string();

    // EC2 reclaims it while it waits.
    block_on(async {
        direct_client(&env.moto.url())
            .terminate_instances()
            .instance_ids(&first)
            .send()
            .await
            .unwrap();
    });
    let out = warm_now(&rig);
    assert!(
        out.contains("it stopped running while it waited") && out.contains("1 booted"),
        "{out}"
    );
    let now = warm_instances(&env);
    assert_eq!(now.len(), 1, "{out}");
    assert_ne!(now[0].instance_id(), Some(first.as_str()));
    assert_eq!(
        now[0].instance_lifecycle(),
        Some(&InstanceLifecycleType::Spot)
    );
}

#[test]
fn sweep_finds_warm_instances_no_pool_knows_and_adopt_leaves_them_alone() {
    let env = Ec2Env::start();
    let text_a = settings(&env, "warm = 1\n", "");
    let a = env.rig("7", SYSTEM, &text_a);
    warm_now(&a);
    let warm = warm_instances(&env);
    assert_eq!(warm.len(), 1);
    let id = warm[0].instance_id().unwrap().to_string();

    // Another state dir of the same system (the first host's was lost):
    // warm = 0 there, so it keeps no pool of its own.
    let b = env.rig("7", SYSTEM, &settings(&env, "", ""));
    // Just launched: within the grace, not called an orphan.
    let t = text(&b.dormant(&["sweep"]));
    assert!(!t.contains(&id), "{t}");

    env.proxy.launched_long_ago(true);
    // Its own pool's: never an orphan, however old.
    let t = text(&a.dormant(&["sweep"]));
    assert!(!t.contains(&format!("machine {id}")), "{t}");
    let t = text(&b.dormant(&["sweep"]));
    assert!(
        t.contains(&format!("machine {id} (warm machine ")) && t.contains("in no warm pool here"),
        "{t}"
    );
    assert!(is_live(
        &instances(&env)
            .into_iter()
            .find(|i| i.instance_id() == Some(&id))
            .unwrap()
    ));

    // adopt does not take it for an environment.
    let out = b.dormant(&["adopt"]);
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(t.contains("adopted 0, left alone 0"), "{t}");

    let out = b.dormant(&["sweep", "--delete-orphans"]);
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(t.contains(&format!("deleting orphan machine {id}")), "{t}");
    let gone = instances(&env)
        .into_iter()
        .find(|i| i.instance_id() == Some(&id))
        .unwrap();
    assert!(!is_live(&gone), "terminated");
}

#[test]
fn warm_zero_and_a_sweep_terminate_every_warm_instance() {
    let env = Ec2Env::start();
    let rig = env.rig("7", SYSTEM, &settings(&env, "warm = 2\n", ""));
    warm_now(&rig);
    assert_eq!(warm_instances(&env).len(), 2);
    Rig::write_settings(
        &rig.settings_path,
        SYSTEM,
        &settings(&env, "warm = 0\n", ""),
    );
    let out = rig.dormant(&["sweep"]);
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(t.contains("not wanted: warm = 0"), "{t}");
    assert!(warm_instances(&env).is_empty(), "{t}");
    assert!(
        instances(&env).iter().all(|i| !is_live(i)),
        "no instance left running"
    );
    let pool = rig.state_dir.join("warm");
    let left: Vec<_> = std::fs::read_dir(&pool)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter(|e| uuid::Uuid::parse_str(&e.file_name().to_string_lossy()).is_ok())
                .collect()
        })
        .unwrap_or_default();
    assert!(left.is_empty(), "pool entries left: {left:?}");
}

/// The EC2 provider's warm side, except that every spec fits (the
/// provider's `fits` leaves a spec with a volume to `fits_resume`) and the
/// hand-over is skipped: what is tested through it is the zone choice.
pub(crate) struct AnyFit<'a>(pub(crate) &'a Ec2Provider);

#[async_trait]
impl WarmMachines for AnyFit<'_> {
    fn wanted(&self) -> u32 {
        self.0.wanted()
    }
    fn max_age(&self) -> Duration {
        self.0.max_age()
    }
    fn kind(&self) -> anyhow::Result<WarmKind> {
        self.0.kind()
    }
    fn fits(&self, _spec: &MachineSpec) -> bool {
        true
    }
    async fn zones(&self, ctx: &Ctx) -> anyhow::Result<Vec<Option<String>>> {
        self.0.zones(ctx).await
    }
    async fn no_room(&self, ctx: &Ctx) -> anyhow::Result<Option<String>> {
        self.0.no_room(ctx).await
    }
    async fn launch(
        &self,
        warm: &WarmPaths,
        zone: Option<&str>,
        key: &str,
        ctx: &Ctx,
    ) -> anyhow::Result<Machine> {
        self.0.launch(warm, zone, key, ctx).await
    }
    async fn find_launched(&self, warm: &WarmPaths, ctx: &Ctx) -> anyhow::Result<Option<Machine>> {
        self.0.find_launched(warm, ctx).await
    }
    /// No environment record here: the hand-over is not what this tests.
    async fn hand_over(
        &self,
        _warm: &WarmPaths,
        machine: &Machine,
        _env: &EnvPaths,
        _ctx: &Ctx,
    ) -> anyhow::Result<Machine> {
        Ok(machine.clone())
    }
    async fn handed_over(
        &self,
        warm: &WarmPaths,
        env: &EnvPaths,
        ctx: &Ctx,
    ) -> anyhow::Result<bool> {
        self.0.handed_over(warm, env, ctx).await
    }
    fn zone_for(&self, spec: &MachineSpec) -> Option<String> {
        self.0.zone_for(spec)
    }
    async fn retire(
        &self,
        warm: &WarmPaths,
        machine: Option<&Machine>,
        ctx: &Ctx,
    ) -> anyhow::Result<()> {
        self.0.retire(warm, machine, ctx).await
    }
    async fn alive(&self, warm: &WarmPaths, machine: &Machine, ctx: &Ctx) -> anyhow::Result<bool> {
        self.0.alive(warm, machine, ctx).await
    }
}

#[tokio::test]
async fn a_warm_instance_per_zone_and_a_volume_takes_the_one_in_its_zone() {
    let env = tokio::task::spawn_blocking(Ec2Env::start).await.unwrap();
    let direct = direct_client(&env.moto.url());
    let zones = crate::moto::default_subnets_by_zone(&direct).await;
    let ((sa, za), (sb, zb)) = (zones[0].clone(), zones[1].clone());
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        "provider = \"ec2\"\nsystem_id = \"{SYSTEM}\"\nrunner_system_id_file = \"/nonexistent\"\n\
         [ssh]\nready_timeout = \"60s\"\n[ec2]\nregion = \"{REGION}\"\nendpoint_url = \"{}\"\n\
         subnet_ids = [\"{sa}\", \"{sb}\"]\nimage = \"{}\"\nssh_user = \"root\"\n{}warm = 1\n",
        env.proxy.url(),
        env.image,
        env.connect_address(),
    );
    let settings = Settings::parse_str(&text).unwrap_or_else(|e| panic!("{e:#}\n{text}"));
    let store = StateStore::open(&dir.path().join("state")).unwrap();
    let provider =
        Ec2Provider::with_credentials(&settings, &store, ACCESS_KEY, SECRET_KEY).unwrap();
    let events = EventLog::new(store.root(), &settings.events);
    let w = World {
        store: &store,
        provider: &provider,
        events: &events,
    };
    let (log, captured) = JobLog::capture();
    let ctx = Ctx::new(log, CancellationToken::new(), Duration::from_secs(240));
    let any = AnyFit(&provider);

    let report = refill(w, &any, &OverSsh(settings.ssh.clone()), true, &ctx)
        .await
        .unwrap();
    let logged = || String::from_utf8_lossy(&captured.lock().unwrap()).to_string();
    assert_eq!(report.launched.len(), 2, "{report:?}\n{}", logged());
    let warm = tokio::task::spawn_blocking({
        let url = env.moto.url();
        move || {
            let c = direct_client(&url);
            block_on(async move { c.describe_instances().send().await.unwrap() })
        }
    })
    .await
    .unwrap();
    let live: Vec<Instance> = warm
        .reservations()
        .iter()
        .flat_map(|r| r.instances())
        .filter(|i| is_live(i))
        .cloned()
        .collect();
    let mut subnets: Vec<&str> = live.iter().filter_map(|i| i.subnet_id()).collect();
    subnets.sort();
    let mut want = vec![sa.as_str(), sb.as_str()];
    want.sort();
    assert_eq!(subnets, want, "one warm instance in each zone");
    let in_b = live
        .iter()
        .find(|i| i.subnet_id() == Some(sb.as_str()))
        .unwrap()
        .instance_id()
        .unwrap()
        .to_string();

    // The first zone's is made the older one (both came from one refill, and
    // `launched_at` has whole seconds: their order would be chance). A take
    // tries the oldest first, so without the zone rule it would be taken.
    let pool = Pool::new(&store);
    for (id, entry) in pool.entries().unwrap() {
        let mut entry = entry.unwrap().expect("an entry");
        if entry.machine.as_ref().map(|m| m.id.as_str()) != Some(in_b.as_str()) {
            let lock = pool.try_lock(id).unwrap().expect("no refill runs");
            entry.launched_at -= 60;
            pool.set(&lock, &entry).unwrap();
        }
    }
    let mut by_age: Vec<_> = pool
        .entries()
        .unwrap()
        .into_iter()
        .map(|(_, e)| e.unwrap().unwrap())
        .collect();
    by_age.sort_by_key(|e| e.launched_at);
    assert_ne!(
        by_age[0].machine.as_ref().map(|m| m.id.as_str()),
        Some(in_b.as_str()),
        "the other zone's is the oldest"
    );

    // A spec whose volume is in the second zone takes the warm instance there.
    let env_id = uuid::Uuid::new_v4();
    let paths = store.env_paths(env_id);
    std::fs::create_dir_all(&paths.dir).unwrap();
    let spec = MachineSpec {
        env_id,
        name: MachineSpec::machine_name(env_id),
        runner_id: "7".into(),
        system_id: SYSTEM.into(),
        project_id: 5,
        job_id: 1,
        image: None,
        variables: Default::default(),
        ssh_public_key: None,
        paths: paths.clone(),
        volume: Some(
            Volume::new("vol-1")
                .with("region", REGION)
                .with("zone", zb.as_str()),
        ),
    };
    let taken = take(w, &any, &spec, &paths, &ctx)
        .await
        .unwrap()
        .expect("a warm instance in the volume's zone");
    assert_eq!(taken.machine.id, in_b, "{}", logged());
    assert_eq!(taken.machine.field("zone"), Some(zb.as_str()));

    // None left in that zone: the next such spec finds none (never the other zone's).
    let env2 = uuid::Uuid::new_v4();
    let paths2 = store.env_paths(env2);
    std::fs::create_dir_all(&paths2.dir).unwrap();
    let spec2 = MachineSpec {
        env_id: env2,
        paths: paths2.clone(),
        ..spec.clone()
    };
    assert!(take(w, &any, &spec2, &paths2, &ctx)
        .await
        .unwrap()
        .is_none());
    let _ = za;
    drop(env);
}

/// A volume-mode resume takes the warm instance (in its volume's zone: one
/// subnet here) instead of launching one: no RunInstances before its first
/// stage, AttachVolume to the running warm instance, the file the first job
/// left is there and get_sources is skipped.
#[test]
fn a_volume_mode_resume_takes_the_warm_instance_and_attaches_its_volume_to_it() {
    let env = Ec2Env::start();
    let rig = env.volume_rig("7", SYSTEM, &env.volume_settings("warm = 1\n", ""));
    // No warm instance is ready yet: a new volume-mode environment launches
    // its own (its volume is made beside it); the refill it starts launches
    // the warm one.
    let r = rig.run(
        &harness::job(5)
            .suspend_on(true, false)
            .script("echo kept-on-volume > state.txt"),
    );
    assert_result(&r, JobResult::Success);
    assert!(!r.log().contains("took warm machine"), "{}", r.log());
    let key = r.key.clone().expect("a key");
    let volume_id = key_field(&key, "volume").expect("a volume key");
    warm_now(&rig);
    let warm = warm_instances(&env);
    assert_eq!(warm.len(), 1);
    let warm_id = warm[0].instance_id().unwrap().to_string();

    env.proxy.clear_calls();
    let mut resume = harness::job(5)
        .resume(&key)
        .script("cat state.txt; test ! -e .fetched-again");
    resume.get_sources = "touch .fetched-again".into();
    let mut first_stage: Option<Instant> = None;
    let mut attached_to = None;
    let r2 = rig
        .runner
        .run_job_with(&resume, &mut |_| {
            if first_stage.is_none() {
                first_stage = Some(Instant::now());
                attached_to = volume(&env, &volume_id).and_then(|v| {
                    v.attachments()
                        .first()
                        .and_then(|a| a.instance_id().map(str::to_string))
                });
            }
        })
        .unwrap();
    assert_result(&r2, JobResult::Success);
    let log = r2.log();
    assert!(log.contains("took warm machine"), "{log}");
    assert!(log.contains("kept-on-volume"), "{log}");
    assert!(log.contains("skipping get_sources"), "{log}");
    let split = first_stage.expect("a stage ran");
    let calls = env.proxy.calls();
    let before: Vec<&str> = calls
        .iter()
        .filter(|c| c.at < split)
        .map(|c| c.action.as_str())
        .collect();
    assert!(!before.contains(&"RunInstances"), "{before:?}");
    assert_eq!(
        before.iter().filter(|a| **a == "AttachVolume").count(),
        1,
        "{before:?}"
    );
    assert_eq!(
        attached_to.as_deref(),
        Some(warm_id.as_str()),
        "the volume went to the warm instance"
    );
}

/// Two default subnets of moto's region in two zones, by zone: `(subnet, zone)`.
fn two_zones(env: &Ec2Env) -> ((String, String), (String, String)) {
    let zones = block_on(crate::moto::default_subnets_by_zone(&direct_client(
        &env.moto.url(),
    )));
    assert!(zones.len() >= 2, "two zones: {zones:?}");
    (zones[0].clone(), zones[1].clone())
}

/// A new volume-mode environment takes a ready warm instance instead of
/// launching one: no RunInstances before its first stage, its data volume
/// made in the warm instance's zone (the second subnet's here: the first
/// zone's warm instance was terminated while it waited, so the cold path's
/// "anywhere" or the first subnet would be another zone), one AttachVolume,
/// to the warm instance; a resume finds the file and skips get_sources; a
/// release, `warm = 0` and a sweep leave no instance and no volume.
#[test]
fn a_new_volume_mode_environment_takes_the_warm_instance_and_its_volume_follows_its_zone() {
    let env = Ec2Env::start();
    let ((sa, _za), (sb, zb)) = two_zones(&env);
    let lines = |warm: u32| format!("subnet_ids = [\"{sa}\", \"{sb}\"]\nwarm = {warm}\n");
    let rig = env.volume_rig("7", SYSTEM, &env.volume_settings(&lines(1), ""));
    let out = warm_now(&rig);
    let warm = warm_instances(&env);
    assert_eq!(warm.len(), 2, "one per zone: {out}");
    let in_zone = |s: &str| {
        warm.iter()
            .find(|i| i.subnet_id() == Some(s))
            .and_then(|i| i.instance_id())
            .unwrap()
            .to_string()
    };
    let (in_a, in_b) = (in_zone(&sa), in_zone(&sb));
    // The first zone's dies while it waits: the prepare skips it.
    block_on(async {
        direct_client(&env.moto.url())
            .terminate_instances()
            .instance_ids(&in_a)
            .send()
            .await
            .unwrap();
    });

    env.proxy.clear_calls();
    let mut first_stage: Option<Instant> = None;
    let mut attached_to = None;
    let job = harness::job(5)
        .suspend_on(true, false)
        .script("echo kept-on-volume > state.txt");
    let r = rig
        .runner
        .run_job_with(&job, &mut |_| {
            if first_stage.is_none() {
                first_stage = Some(Instant::now());
                attached_to = data_volumes(&env).into_iter().find_map(|v| {
                    v.attachments()
                        .first()
                        .and_then(|a| a.instance_id().map(str::to_string))
                });
            }
        })
        .unwrap();
    assert_result(&r, JobResult::Success);
    let log = r.log();
    assert!(log.contains("took warm machine"), "{log}");
    let split = first_stage.expect("a stage ran");
    let before: Vec<String> = env
        .proxy
        .calls()
        .into_iter()
        .filter(|c| c.at < split)
        .map(|c| c.action)
        .collect();
    let count = |a: &str| before.iter().filter(|b| *b == a).count();
    assert_eq!(count("RunInstances"), 0, "{before:?}\n{log}");
    assert_eq!(count("CreateVolume"), 1, "{before:?}");
    assert_eq!(count("AttachVolume"), 1, "{before:?}");
    assert_eq!(
        attached_to.as_deref(),
        Some(in_b.as_str()),
        "the volume went to the warm instance\n{log}"
    );
    let key = r.key.clone().unwrap();
    let volume_id = key_field(&key, "volume").expect("a volume key");
    let v = volume(&env, &volume_id).expect("the data volume");
    assert_eq!(
        v.availability_zone(),
        Some(zb.as_str()),
        "made in the warm instance's zone"
    );
    let tags = instance_tags(&env, &in_b);
    assert!(
        !tags.contains_key("dormant:warm") && tags.contains_key("dormant:env"),
        "handed over: {tags:?}"
    );
    assert_eq!(rig.status(&key).as_deref(), Some("suspended"));
    assert_eq!(
        v.state().map(|s| s.as_str()),
        Some("available"),
        "detached on suspend"
    );

    // The resume finds the file and skips get_sources; no trigger: released.
    let mut resume = harness::job(5)
        .resume(&key)
        .script("cat state.txt; test ! -e .fetched-again");
    resume.get_sources = "touch .fetched-again".into();
    let r2 = rig.run(&resume);
    assert_result(&r2, JobResult::Success);
    let log2 = r2.log();
    assert!(log2.contains("kept-on-volume"), "{log2}");
    assert!(log2.contains("skipping get_sources"), "{log2}");
    assert!(
        volume(&env, &volume_id).is_none_or(|v| v.state().map(|s| s.as_str()) == Some("deleted")),
        "released with its environment"
    );

    // warm = 0 and a sweep: nothing left.
    warm_now(&rig);
    Rig::write_settings(
        &rig.settings_path,
        SYSTEM,
        &env.volume_settings(&lines(0), ""),
    );
    let out = rig.dormant(&["sweep"]);
    assert!(out.status.success(), "{}", text(&out));
    let live: Vec<_> = instances(&env)
        .into_iter()
        .filter(is_live)
        .filter_map(|i| i.instance_id().map(str::to_string))
        .collect();
    assert!(live.is_empty(), "instances left: {live:?}");
    let vols: Vec<_> = data_volumes(&env)
        .into_iter()
        .filter(|v| v.state().map(|s| s.as_str()) != Some("deleted"))
        .filter_map(|v| v.volume_id().map(str::to_string))
        .collect();
    assert!(vols.is_empty(), "volumes left: {vols:?}");
}
