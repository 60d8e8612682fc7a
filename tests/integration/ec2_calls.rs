//! The EC2 API calls a suspend and a resume cost in each storage mode
//! (machine mode with stop and with hibernate, volume mode),
//! counted by the recording proxy while whole jobs run through the built
//! binary (moto behind the proxy, the loopback sshd standing in for every
//! instance). `ec2_api_calls_per_transition_are_the_readmes` checks every
//! count, action by action, and that the table in docs/performance.md says the same: an
//! extra or a missing call fails it. It prints the table too
//! (`scripts/bench-ec2-calls.sh` shows it).
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

/// How many calls of each action.
type Tally = BTreeMap<String, usize>;

fn tally(calls: &[Call]) -> Tally {
    let mut by = Tally::new();
    for c in calls {
        *by.entry(c.action.clone()).or_default() += 1;
    }
    by
}

/// "3 (DescribeInstances 2, StopInstances 1)".
fn show(t: &Tally) -> String {
    let parts: Vec<String> = t.iter().map(|(a, n)| format!("{a} {n}")).collect();
    format!("{} ({})", t.values().sum::<usize>(), parts.join(", "))
}

/// `[("DescribeInstances", 2), ...]` as a tally.
fn want(calls: &[(&str, usize)]) -> Tally {
    calls.iter().map(|(a, n)| (a.to_string(), *n)).collect()
}

/// How a row's runner is set up.
enum Mode {
    Machine(&'static str),
    Volume,
}

/// One mode's calls: a new environment suspended, resumed and suspended
/// again, resumed and released.
struct Row {
    create: Tally,
    suspend: Tally,
    resume: Tally,
    suspend_again: Tally,
    resume_again: Tally,
    release: Tally,
}

fn measure(mode: Mode) -> Row {
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
    Row {
        create: tally(&first.prepare),
        suspend: tally(&first.cleanup),
        resume: tally(&again.prepare),
        suspend_again: tally(&again.cleanup),
        resume_again: tally(&last.prepare),
        release: tally(&last.cleanup),
    }
}

/// Every transition's calls, action by action, as docs/performance.md breaks
/// them down; its table row; the table printed.
#[test]
fn ec2_api_calls_per_transition_are_the_readmes() {
    let machine = Expected {
        // CreateTags: the hand-over tags a replacement host reads
        // (`dormant:host-key` after the first login, `dormant:suspended-at`).
        create: want(&[
            ("DescribeInstances", 2),
            ("DescribeImages", 1),
            ("RunInstances", 1),
            ("CreateTags", 1),
        ]),
        suspend: want(&[
            ("DescribeInstances", 2),
            ("CreateTags", 1),
            ("StopInstances", 1),
        ]),
        resume: want(&[("DescribeInstances", 2), ("StartInstances", 1)]),
        release: want(&[("DescribeInstances", 1), ("TerminateInstances", 1)]),
    };
    let rows = [
        ("machine, `stop`", Mode::Machine(""), machine.clone()),
        (
            "machine, `hibernate`",
            Mode::Machine(
                "suspend_mode = \"hibernate\"\nroot_volume_encrypted = true\nroot_volume_size_gb = 30\n",
            ),
            machine,
        ),
        (
            "volume",
            Mode::Volume,
            Expected {
                create: want(&[
                    ("DescribeInstances", 3),
                    ("DescribeImages", 1),
                    ("DescribeSubnets", 1),
                    ("RunInstances", 1),
                    ("DescribeVolumes", 4),
                    ("CreateVolume", 1),
                    ("AttachVolume", 1),
                ]),
                suspend: want(&[
                    ("DescribeVolumes", 2),
                    ("DetachVolume", 1),
                    ("CreateTags", 1),
                    ("DescribeInstances", 1),
                    ("TerminateInstances", 1),
                ]),
                resume: want(&[
                    ("DescribeInstances", 2),
                    ("RunInstances", 1),
                    ("DescribeVolumes", 2),
                    ("AttachVolume", 1),
                ]),
                release: want(&[
                    ("DescribeInstances", 1),
                    ("TerminateInstances", 1),
                    ("DescribeVolumes", 1),
                    ("DeleteVolume", 1),
                ]),
            },
        ),
    ];
    let documented = include_str!("../../docs/performance.md");
    let mut table = Vec::new();
    let mut wrong = Vec::new();
    for (name, mode, expected) in rows {
        let got = measure(mode);
        table.push(format!(
            "| {name} | {} | {} | {} | {} | {} | {} |",
            show(&got.create),
            show(&got.suspend),
            show(&got.resume),
            show(&got.suspend_again),
            show(&got.resume_again),
            show(&got.release)
        ));
        for (what, got, want) in [
            ("create", &got.create, &expected.create),
            ("suspend", &got.suspend, &expected.suspend),
            ("resume", &got.resume, &expected.resume),
            ("suspend again", &got.suspend_again, &expected.suspend),
            ("resume again", &got.resume_again, &expected.resume),
            ("release", &got.release, &expected.release),
        ] {
            if got != want {
                wrong.push(format!(
                    "{name}, {what}: {} (docs/performance.md says {})",
                    show(got),
                    show(want)
                ));
            }
        }
        let sum = |t: &Tally| t.values().sum::<usize>();
        let row = format!(
            "| {name} | {} | {} | {} | {} |",
            sum(&expected.create),
            sum(&expected.suspend),
            sum(&expected.resume),
            sum(&expected.release)
        );
        if !documented.lines().any(|l| l == row) {
            wrong.push(format!(
                "docs/performance.md's table of EC2 calls has no row {row:?}"
            ));
        }
    }
    println!();
    println!("EC2 API calls per transition (counted by the test proxy; moto's transitions are instant, so every wait polls once: on EC2 add one describe per second of transition)");
    println!();
    println!("| mode | create | suspend | resume | suspend again | resume again | release |");
    println!("|---|---|---|---|---|---|---|");
    for r in table {
        println!("{r}");
    }
    assert!(
        wrong.is_empty(),
        "EC2 calls per transition:\n  {}",
        wrong.join("\n  ")
    );
}

/// What one mode's transitions must cost.
#[derive(Clone)]
struct Expected {
    create: Tally,
    suspend: Tally,
    resume: Tally,
    release: Tally,
}
