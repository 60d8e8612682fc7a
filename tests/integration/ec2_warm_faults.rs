//! A warm instance is retired only on a definite answer (gone, terminated,
//! stopped, made from other settings), never because EC2 did not answer:
//! DescribeInstances failing past dormant's retries (HTTP 503, four times in
//! a row: `call.rs` gives a transient fault four attempts) in the refill's
//! look and in a prepare's take leaves the ready instance running and in
//! the pool; the refill reports it (and boots none in its place), the take
//! skips it; the next refill keeps it and the next take hands it out.
//! Moto behind the test proxy (which injects the errors); the take and the
//! refill are called as a prepare and `dormant warm` call them.

use std::time::Duration;

use dormant::context::{Ctx, JobLog};
use dormant::events::EventLog;
use dormant::lifecycle::warm::take;
use dormant::lifecycle::warm_refill::{refill, OverSsh};
use dormant::lifecycle::World;
use dormant::provider::ec2::Ec2Provider;
use dormant::provider::MachineSpec;
use dormant::settings::Settings;
use dormant::state::pool::{Pool, WarmStatus};
use dormant::state::StateStore;
use tokio_util::sync::CancellationToken;

use crate::ec2_rig::{is_live, Ec2Env};
use crate::ec2_warm::AnyFit;
use crate::moto::{direct_client, ACCESS_KEY, SECRET_KEY};

/// One call of dormant's to DescribeInstances fails: every attempt
/// `call.rs` makes of it (a transient fault is tried four times).
fn one_describe_fails(env: &Ec2Env) {
    env.proxy
        .fail("DescribeInstances", 0, 4, 503, "Unavailable");
}

/// The live instances, asked of moto directly (not through the proxy).
async fn live(env: &Ec2Env) -> Vec<String> {
    let out = direct_client(&env.moto.url())
        .describe_instances()
        .send()
        .await
        .unwrap();
    out.reservations()
        .iter()
        .flat_map(|r| r.instances())
        .filter(|i| is_live(i))
        .filter_map(|i| i.instance_id().map(str::to_string))
        .collect()
}

#[tokio::test]
async fn describe_errors_never_retire_a_ready_warm_instance_in_the_refill_or_the_take() {
    let env = tokio::task::spawn_blocking(Ec2Env::start).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        "system_id = \"s_0123456789ab\"\nrunner_system_id_file = \"/nonexistent\"\n{}",
        env.settings(&env.connect_address(), "")
            .replace("[ec2]\n", "[ec2]\nwarm = 1\n")
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
    let logged = || String::from_utf8_lossy(&captured.lock().unwrap()).to_string();
    let ctx = Ctx::new(log, CancellationToken::new(), Duration::from_secs(240));
    let ssh = OverSsh(settings.ssh.clone());
    let pool = Pool::new(&store);
    let first = refill(w, &provider, &ssh, true, &ctx).await.unwrap();
    assert_eq!(first.launched.len(), 1, "{first:?}\n{}", logged());
    let warm_id = first.launched[0];
    let instance = live(&env).await;
    assert_eq!(instance.len(), 1);
    let ready = || pool.peek(warm_id).unwrap().map(|e| e.status);

    // The refill: its look at the instance fails. Kept, reported, none booted.
    env.proxy.clear_calls();
    one_describe_fails(&env);
    let r = refill(w, &provider, &ssh, true, &ctx).await.unwrap();
    assert!(r.retired.is_empty(), "{r:?}");
    assert!(r.launched.is_empty(), "none booted in its place: {r:?}");
    assert_eq!(r.ready, 1, "{r:?}");
    assert!(
        r.errors.iter().any(
            |e| e.contains(&format!("warm machine {warm_id} kept as it is"))
                && e.contains("Unavailable")
        ),
        "the error is reported: {r:?}"
    );
    assert_eq!(ready(), Some(WarmStatus::Ready));
    assert_eq!(env.proxy.count("TerminateInstances"), 0);
    assert_eq!(
        env.proxy.count("DescribeInstances"),
        4,
        "the fault was used"
    );

    // The next refill (EC2 answers again) keeps it: nothing to do.
    let r = refill(w, &provider, &ssh, true, &ctx).await.unwrap();
    assert!(
        r.retired.is_empty() && r.launched.is_empty() && r.errors.is_empty(),
        "{r:?}"
    );
    assert_eq!(r.ready, 1);

    // A prepare's take: its look at the warm instance fails (the take's first
    // DescribeInstances, `Provider::find` asking whether the environment
    // already has a machine, answers). Not taken, not retired.
    let env_id = uuid::Uuid::new_v4();
    let paths = store.env_paths(env_id);
    std::fs::create_dir_all(&paths.dir).unwrap();
    let spec = MachineSpec {
        env_id,
        name: MachineSpec::machine_name(env_id),
        runner_id: "7".into(),
        system_id: "s_0123456789ab".into(),
        project_id: 5,
        job_id: 1,
        image: None,
        variables: Default::default(),
        ssh_public_key: None,
        paths: paths.clone(),
        volume: None,
    };
    let any = AnyFit(&provider);
    env.proxy.clear_calls();
    env.proxy
        .fail("DescribeInstances", 1, 4, 503, "Unavailable");
    let taken = take(w, &any, &spec, &paths, &ctx).await.unwrap();
    assert!(taken.is_none(), "not handed out on a guess");
    assert_eq!(
        env.proxy.count("DescribeInstances"),
        5,
        "the find, then the fault used on the look at the warm instance"
    );
    assert_eq!(ready(), Some(WarmStatus::Ready), "{}", logged());
    assert!(
        logged().contains(&format!("warm machine {warm_id} not taken: could not tell")),
        "{}",
        logged()
    );
    assert_eq!(live(&env).await, instance, "still running");

    // The next take (EC2 answers again) hands it out.
    let taken = take(w, &any, &spec, &paths, &ctx)
        .await
        .unwrap()
        .expect("the warm instance, once EC2 answers");
    assert_eq!(taken.machine.id, instance[0]);
    assert_eq!(env.proxy.count("TerminateInstances"), 0);
    drop(env);
}
