//! A whole job, and its resume, through the built binary with EC2 from the
//! emulator and SSH to a loopback sshd: GitLab Runner's calls (runner_sim) →
//! dormant → moto (through the recording proxy) for the instance, and →
//! `ec2.connect_address` (127.0.0.1:<sshd>) for the scripts. The environment's
//! key reaches the sshd the way it reaches a real instance: from the instance's
//! user-data (the `CloudInit` stand-in copies it into `authorized_keys`).
//!
//! Network rule: the instance addresses moto hands out are never contacted.

use aws_sdk_ec2::types::InstanceStateName;

use crate::ec2_rig::{block_on, instance_state, Ec2Env};
use crate::harness::{self, assert_result, JobResult};
use crate::moto::{direct_client, REGION};
use crate::reattach::{assert_every_line_once, assert_nothing_kept, counting, wait_lines};

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

/// The running instances moto knows (each test has its own moto).
fn running_instances(moto_url: &str) -> Vec<String> {
    block_on(async {
        let out = direct_client(moto_url)
            .describe_instances()
            .send()
            .await
            .unwrap();
        out.reservations()
            .iter()
            .flat_map(|r| r.instances())
            .filter(|i| i.state().and_then(|s| s.name()) == Some(&InstanceStateName::Running))
            .filter_map(|i| i.instance_id().map(str::to_string))
            .collect()
    })
}

/// A dropped connection mid-stage through the EC2 provider: the stage runs
/// on on the instance (the loopback sshd), `dormant run` re-attaches through
/// the instance's pinned host key, and the job log has every line once.
#[test]
fn through_ec2_a_stage_survives_a_cut_connection() {
    let env = Ec2Env::start();
    let rig = env.rig(
        "7",
        "s_0123456789ab",
        &env.settings(&env.connect_address(), ""),
    );
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("lines");
    let j = harness::job(5).script(&counting(30, &marker, None));
    let r = std::thread::scope(|s| {
        let run = s.spawn(|| rig.run(&j));
        wait_lines(&marker, 10);
        assert!(env.sshd.cut_connections() > 0);
        run.join().unwrap()
    });
    assert_result(&r, JobResult::BuildFailure(Some(3)));
    assert_every_line_once(&r.call("build_script").unwrap().output, 30, 1);
    assert_nothing_kept(&env.sshd);
}

/// An instance terminated while its connection is lost will not come back:
/// the run stage's check (EC2 DescribeInstances) ends the reconnect at once,
/// a system failure naming the instance (a machine lost), not the end of
/// reconnect_timeout (2m).
#[test]
fn a_terminated_instance_ends_the_reconnect_at_once() {
    let mut env = Ec2Env::start();
    let rig = env.rig(
        "7",
        "s_0123456789ab",
        &env.settings(&env.connect_address(), ""),
    );
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("lines");
    let pids = dir.path().join("pids");
    let j = harness::job(5).script(&format!(
        "echo $BASHPID > '{}'; {}",
        pids.display(),
        counting(900, &marker, None)
    ));
    let moto_url = env.moto.url();
    let r = std::thread::scope(|s| {
        let run = s.spawn(|| rig.run(&j));
        wait_lines(&marker, 5);
        let instances = running_instances(&moto_url);
        assert_eq!(instances.len(), 1, "{instances:?}");
        env.sshd.stop();
        block_on(async {
            direct_client(&moto_url)
                .terminate_instances()
                .instance_ids(&instances[0])
                .send()
                .await
                .unwrap();
        });
        run.join().unwrap()
    });
    // The "instance" is this host's sshd: its script is this test's to stop.
    if let Ok(pid) = std::fs::read_to_string(&pids)
        .unwrap()
        .trim()
        .parse::<i32>()
    {
        // SAFETY: kill(2) on the process group of the script this test started.
        unsafe {
            libc::kill(-pid, libc::SIGKILL);
        }
    }
    assert_result(&r, JobResult::SystemFailure);
    // Ended by the check (the reconnect's own words), not by reconnect_timeout
    // ("did not come back within ssh.reconnect_timeout", after 2 min).
    let build = r.call("build_script").unwrap();
    assert!(
        build
            .output
            .contains("was lost during build_script; dormant stopped reconnecting after")
            && build.output.contains("machine lost: machine i-")
            && build.output.contains(" is gone"),
        "{}",
        build.output
    );
    assert!(
        !build.output.contains("did not come back within"),
        "{}",
        build.output
    );
    // The stage after it met the gone machine too, and said so at once
    // (rather than after the whole ready_timeout).
    let after = r.call("cleanup_file_variables").unwrap();
    assert!(
        after.output.contains("machine lost: machine i-") && after.output.contains(" is gone"),
        "{}",
        after.output
    );
    // A machine mode environment: released (nothing to keep of a machine
    // that is gone), and no warning about what its stages left running.
    assert!(
        !rig.env_dir(r.key.as_ref().unwrap()).exists(),
        "{}",
        r.log()
    );
    assert!(
        !r.cleanup_output().contains("could not be stopped"),
        "{}",
        r.cleanup_output()
    );
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
