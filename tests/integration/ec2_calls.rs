//! The EC2 API calls a suspend and a resume cost in each storage mode
//! (machine mode with stop and with hibernate, volume mode),
//! counted by the recording proxy while whole jobs run through the built
//! binary (moto behind the proxy, the loopback sshd standing in for every
//! instance). `bench_api_calls` (ignored; `scripts/bench-ec2-calls.sh`)
//! prints the table of the README.
//!
//! moto's transitions are instant, so each wait makes one poll: on real EC2
//! add one DescribeInstances (or DescribeVolumes) per second of transition.

use std::collections::BTreeMap;
use std::time::Instant;

use crate::ec2_rig::Ec2Env;
use crate::harness::{self, assert_result, JobResult, Rig};
use crate::moto::Call;

/// The proxy's calls of one job, split at its first run stage: prepare's
/// before it, cleanup's after it (the stages make no EC2 call).
struct JobCalls {
    prepare: Vec<Call>,
    cleanup: Vec<Call>,
    key: String,
}

fn run_counted(env: &Ec2Env, rig: &Rig, job: &dormant::runner_sim::SimJob) -> JobCalls {
    env.proxy.clear_calls();
    let mut first_stage: Option<Instant> = None;
    let report = rig
        .runner
        .run_job_with(job, &mut |_| {
            first_stage.get_or_insert_with(Instant::now);
        })
        .unwrap();
    assert_result(&report, JobResult::Success);
    let split = first_stage.expect("a stage ran");
    let (prepare, cleanup) = env.proxy.calls().into_iter().partition(|c| c.at < split);
    JobCalls {
        prepare,
        cleanup,
        key: report.key.clone().expect("a key"),
    }
}

/// "3 (DescribeInstances 2, StopInstances 1)".
fn tally(calls: &[Call]) -> String {
    let mut by: BTreeMap<&str, usize> = BTreeMap::new();
    for c in calls {
        *by.entry(c.action.as_str()).or_default() += 1;
    }
    let parts: Vec<String> = by.iter().map(|(a, n)| format!("{a} {n}")).collect();
    format!("{} ({})", calls.len(), parts.join(", "))
}

/// How a row's runner is set up.
enum Mode {
    Machine(&'static str),
    Volume,
}

/// One mode's row: a new environment suspended, resumed and suspended again,
/// resumed and released.
fn measure(name: &str, mode: Mode) -> [String; 6] {
    let env = Ec2Env::start();
    let rig = match mode {
        Mode::Machine(ec2_lines) => env.rig(
            "7",
            "s_0123456789ab",
            &env.settings(&format!("{}{ec2_lines}", env.connect_address()), ""),
        ),
        Mode::Volume => env.volume_rig("7", "s_0123456789ab", &env.volume_settings("", "")),
    };
    let first = run_counted(
        &env,
        &rig,
        &harness::job(5)
            .suspend_on(true, false)
            .script("echo kept > kept.txt"),
    );
    let again = run_counted(
        &env,
        &rig,
        &harness::job(5)
            .resume(&first.key)
            .suspend_on(true, false)
            .script("cat kept.txt"),
    );
    let last = run_counted(
        &env,
        &rig,
        &harness::job(5).resume(&first.key).script("cat kept.txt"),
    );
    assert!(rig.status(&first.key).is_none(), "released");
    [
        name.to_string(),
        tally(&first.prepare),
        tally(&first.cleanup),
        tally(&again.prepare),
        tally(&again.cleanup),
        tally(&last.cleanup),
    ]
}

#[test]
#[ignore = "a benchmark: scripts/bench-ec2-calls.sh runs it"]
fn bench_api_calls() {
    let rows = [
        measure("machine, stop", Mode::Machine("")),
        measure(
            "machine, hibernate",
            Mode::Machine(
                "suspend_mode = \"hibernate\"\nroot_volume_encrypted = true\nroot_volume_size_gb = 30\n",
            ),
        ),
        measure("volume", Mode::Volume),
    ];
    println!();
    println!("EC2 API calls per transition (counted by the test proxy; moto's transitions are instant, so every wait polls once: on EC2 add one describe per second of transition)");
    println!();
    println!("| mode | create | suspend | resume | suspend again | release |");
    println!("|---|---|---|---|---|---|");
    for r in rows {
        println!("| {} |", r.join(" | "));
    }
}
