//! A whole job, and its resume, through the built binary with EC2 from the
//! emulator and SSH to a loopback sshd: GitLab Runner's calls (runner_sim) →
//! dormant → moto (through the recording proxy) for the instance, and →
//! `ec2.connect_address` (127.0.0.1:<sshd>) for the scripts. The environment's
//! key reaches the sshd the way it reaches a real instance: from the instance's
//! user-data (the `CloudInit` stand-in copies it into `authorized_keys`).
//!
//! Network rule: the instance addresses moto hands out are never contacted.

use aws_sdk_ec2::types::InstanceStateName;

use crate::ec2_rig::{block_on, Ec2Env};
use crate::harness::{self, assert_result, JobResult};
use crate::moto::{direct_client, REGION};

fn instance_state(moto_url: &str, id: &str) -> InstanceStateName {
    block_on(async {
        let c = direct_client(moto_url);
        let out = c
            .describe_instances()
            .instance_ids(id)
            .send()
            .await
            .unwrap();
        out.reservations()[0].instances()[0]
            .state()
            .unwrap()
            .name()
            .unwrap()
            .clone()
    })
}

#[test]
fn a_job_suspends_its_instance_and_a_later_job_resumes_it_then_releases_it() {
    let env = Ec2Env::start();
    let (moto, proxy, sshd) = (&env.moto, &env.proxy, &env.sshd);
    let rig = env.rig(
        "7",
        "s_0123456789ab",
        &env.settings(&env.connect_address(), ""),
    );

    // Job 1: a fresh instance, suspended on success.
    let handshakes = sshd.connections();
    let first = harness::job(5)
        .suspend_on(true, false)
        .script("echo 'agent state' > progress.txt; echo \"key: $DORMANT_ENVIRONMENT_KEY\"");
    let r1 = rig.run(&first);
    assert_result(&r1, JobResult::Success);
    let job1_calls = proxy.actions();
    let key = r1.key.clone().expect("the key is printed");
    let instance = key
        .split('&')
        .find_map(|f| f.strip_prefix("instance="))
        .unwrap_or_else(|| panic!("the key names the instance: {key}"))
        .to_string();
    assert!(
        key.contains("provider=ec2") && key.contains(&format!("region={REGION}")),
        "{key}"
    );
    assert!(r1.log().contains(&format!("key: {key}")), "{}", r1.log());
    assert_eq!(
        sshd.connections() - handshakes,
        1,
        "one SSH handshake for the whole job"
    );
    assert_eq!(
        instance_state(&moto.url(), &instance),
        InstanceStateName::Stopped
    );
    assert_eq!(rig.status(&key).as_deref(), Some("suspended"));
    assert_eq!(
        job1_calls.iter().filter(|a| *a == "RunInstances").count(),
        1,
        "{job1_calls:?}"
    );
    assert_eq!(
        job1_calls.iter().filter(|a| *a == "StopInstances").count(),
        1,
        "{job1_calls:?}"
    );
    assert!(
        !job1_calls.iter().any(|a| a == "TerminateInstances"),
        "{job1_calls:?}"
    );

    // Job 2: resumes the same instance, finds the file, skips get_sources, releases.
    proxy.clear_calls();
    let handshakes = sshd.connections();
    let mut second = harness::job(5)
        .resume(&key)
        .script("cat progress.txt; test ! -e .fetched-again");
    second.get_sources = "touch .fetched-again".into();
    let r2 = rig.run(&second);
    assert_result(&r2, JobResult::Success);
    assert!(r2.log().contains("agent state"), "{}", r2.log());
    assert!(r2.log().contains("skipping get_sources"), "{}", r2.log());
    assert_eq!(
        r1.config.as_ref().unwrap().builds_dir,
        r2.config.as_ref().unwrap().builds_dir
    );
    assert_eq!(
        sshd.connections() - handshakes,
        1,
        "one SSH handshake for the resumed job"
    );
    let job2_calls = proxy.actions();
    assert!(
        !job2_calls.iter().any(|a| a == "RunInstances"),
        "the same instance, not a new one: {job2_calls:?}"
    );
    assert_eq!(
        job2_calls.iter().filter(|a| *a == "StartInstances").count(),
        1,
        "{job2_calls:?}"
    );
    assert_eq!(
        job2_calls
            .iter()
            .filter(|a| *a == "TerminateInstances")
            .count(),
        1,
        "{job2_calls:?}"
    );
    assert!(matches!(
        instance_state(&moto.url(), &instance),
        InstanceStateName::Terminated | InstanceStateName::ShuttingDown
    ));
    assert!(
        !rig.env_dir(&key).exists(),
        "released: nothing left in the registry"
    );
    println!("job 1 EC2 calls: {job1_calls:?}\njob 2 EC2 calls: {job2_calls:?}");
}

/// Spot on a runner without suspension: the job's prepare finds no spot
/// capacity, launches on-demand (the fallback is on), says so in the job log,
/// runs, and its cleanup terminates the instance.
#[test]
fn a_spot_job_falls_back_to_on_demand_when_spot_has_no_capacity() {
    let env = Ec2Env::start();
    let rig = env.rig(
        "7",
        "s_0123456789ab",
        &env.settings(
            &format!(
                "{}market = \"spot\"\non_demand_fallback = true\n",
                env.connect_address()
            ),
            "[suspend]\nenabled = false\n",
        ),
    );
    env.proxy.no_capacity(crate::moto::Shortage::spot());
    let r = rig.run(&harness::job(5).script("echo ran on ec2"));
    assert_result(&r, JobResult::Success);
    let log = r.log();
    assert!(log.contains("ran on ec2"), "{log}");
    assert!(
        log.contains("no capacity for t3.medium spot in")
            && log.contains("(ec2.on_demand_fallback)"),
        "{log}"
    );
    let runs: Vec<String> = env
        .proxy
        .calls()
        .into_iter()
        .filter(|c| c.action == "RunInstances")
        .map(|c| c.body)
        .collect();
    assert_eq!(runs.len(), 2, "spot, then on-demand");
    assert!(runs[0].contains("InstanceMarketOptions.MarketType=spot"));
    assert!(!runs[1].contains("InstanceMarketOptions"));
    assert_eq!(env.proxy.count("TerminateInstances"), 1, "released");
    assert!(!rig.env_dir(r.key.as_ref().unwrap()).exists());
}
