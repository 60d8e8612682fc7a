//! The EC2 prepare benchmark (`scripts/bench-ec2.sh`; an ignored test, not
//! part of the suite): how long a job's prepare takes, and which EC2 calls
//! it makes, when EC2 takes the time it takes. moto behind the test proxy,
//! which holds every new or started instance `pending` for P seconds
//! (`hold_launches`, `hold_transitions`) and every attached volume
//! `attaching` for A seconds (`hold_attaches`); the loopback sshd standing
//! in for the instance is down while a machine boots and answers when the
//! `pending` hold ends (EC2 says `running`). Defaults: the public figures
//! for small Linux instances, P = 20 s, A = 2 s.
//!
//! Each row is one [`Case`]: a setup run without holds (a resume row first
//! makes and suspends its environment), then RUNS measured jobs with the
//! holds on. Columns: `holds s`, the part of the holds the row's path must
//! sit through (its floor: a booting machine waits P, an attach A);
//! `prepare s`, the prepare call's wall time (the dormant process, as the
//! runner sees it; median of the runs); `added s` = prepare − holds; the
//! EC2 calls prepare made (counted by the proxy, of the median run).
//!
//! A new row is a new `Case`: its id (for `--rows`), its labels, its floor,
//! whether a machine boots in it (the sshd gate), and its setup and job. A
//! row taking an already-running machine (a warm one) boots nothing: its
//! floor is the attach hold alone. A warm row's measured job must have taken
//! a warm instance (one more `warm`/`taken` event; otherwise the row would
//! time a launch and is an error), and the refill its prepare starts
//! detached finds the pool's refill lock held by the benchmark and returns
//! without a call, so the row counts the prepare's calls only (the next
//! run's `dormant warm` refills).
//!
//! Network rule: the instance addresses moto hands out are never contacted.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use dormant::runner_sim::SimJob;

use crate::ec2_rig::Ec2Env;
use crate::harness::{self, assert_result, JobReport, JobResult, Rig};
use crate::moto::Call;

/// One row of the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Case {
    /// A job without a key: a new environment, machine mode.
    NewMachine,
    /// A job without a key: a new environment, volume mode (an instance, then its volume).
    NewVolume,
    /// A resume of a suspended (stopped) instance: StartInstances.
    ResumeMachine,
    /// A resume in volume mode: a new instance, AttachVolume, mount.
    ResumeVolume,
    /// A new environment, machine mode, taking a warm instance (`warm = 1`).
    NewMachineWarm,
    /// A resume in volume mode taking a warm instance: AttachVolume, mount.
    ResumeVolumeWarm,
    /// A new environment, volume mode, taking a warm instance: its volume
    /// created in the instance's zone, AttachVolume, format and mount.
    NewVolumeWarm,
}

impl Case {
    const ALL: [Case; 7] = [
        Case::NewMachine,
        Case::NewVolume,
        Case::ResumeMachine,
        Case::ResumeVolume,
        Case::NewMachineWarm,
        Case::ResumeVolumeWarm,
        Case::NewVolumeWarm,
    ];

    /// The row's name on the command line (`--rows`).
    fn id(self) -> &'static str {
        match self {
            Case::NewMachine => "new-machine",
            Case::NewVolume => "new-volume",
            Case::ResumeMachine => "resume-machine",
            Case::ResumeVolume => "resume-volume",
            Case::NewMachineWarm => "new-machine-warm",
            Case::ResumeVolumeWarm => "resume-volume-warm",
            Case::NewVolumeWarm => "new-volume-warm",
        }
    }

    /// (what, storage, the machine it gets)
    fn labels(self) -> (&'static str, &'static str, &'static str) {
        match self {
            Case::NewMachine => ("new environment", "machine", "launched"),
            Case::NewVolume => ("new environment", "volume", "launched"),
            Case::ResumeMachine => ("resume", "machine", "started"),
            Case::ResumeVolume => ("resume", "volume", "launched"),
            Case::NewMachineWarm => ("new environment", "machine", "warm"),
            Case::ResumeVolumeWarm => ("resume", "volume", "warm"),
            Case::NewVolumeWarm => ("new environment", "volume", "warm"),
        }
    }

    /// Whether a machine boots during the row's prepare (sshd is down
    /// until its `pending` hold ends).
    fn boots(self) -> bool {
        !self.warm()
    }

    /// Whether it takes a warm instance (`[ec2] warm = 1`).
    fn warm(self) -> bool {
        matches!(
            self,
            Case::NewMachineWarm | Case::ResumeVolumeWarm | Case::NewVolumeWarm
        )
    }

    /// The holds the row's path must sit through.
    fn floor(self, h: Holds) -> Duration {
        match self {
            Case::NewMachine | Case::ResumeMachine => h.pending,
            Case::NewVolume | Case::ResumeVolume => h.pending + h.attaching,
            Case::NewMachineWarm => Duration::ZERO,
            Case::ResumeVolumeWarm | Case::NewVolumeWarm => h.attaching,
        }
    }

    fn volume_mode(self) -> bool {
        matches!(
            self,
            Case::NewVolume | Case::ResumeVolume | Case::ResumeVolumeWarm | Case::NewVolumeWarm
        )
    }

    /// The runner for this row (no holds yet) and, for a resume, the job
    /// that made and suspended the environment it resumes: its key.
    fn setup(self, env: &Ec2Env) -> (Rig, Option<String>) {
        let warm = if self.warm() { "warm = 1\n" } else { "" };
        let rig = if self.volume_mode() {
            env.volume_rig("7", "s_0123456789ab", &env.volume_settings(warm, ""))
        } else {
            env.rig(
                "7",
                "s_0123456789ab",
                &env.settings(&format!("{}{warm}", env.connect_address()), ""),
            )
        };
        let key = match self {
            Case::NewMachine | Case::NewVolume => None,
            Case::NewMachineWarm | Case::NewVolumeWarm => None,
            Case::ResumeMachine | Case::ResumeVolume | Case::ResumeVolumeWarm => {
                let r = rig.run(
                    &harness::job(5)
                        .suspend_on(true, false)
                        .script("echo kept > kept.txt"),
                );
                assert_result(&r, JobResult::Success);
                Some(r.key.clone().expect("a key"))
            }
        };
        (rig, key)
    }

    /// The measured job: a resume suspends again (the next run resumes the
    /// same environment); a new environment is released at its end.
    fn job(self, key: Option<&str>) -> SimJob {
        match key {
            Some(k) => harness::job(5)
                .resume(k)
                .suspend_on(true, false)
                .script("cat kept.txt"),
            None => harness::job(5).script("true"),
        }
    }
}

/// The proxy's holds.
#[derive(Debug, Clone, Copy)]
pub struct Holds {
    pub pending: Duration,
    pub attaching: Duration,
}

/// One measured job: prepare's wall time and the EC2 calls it made.
struct Measured {
    prepare: Duration,
    calls: Vec<Call>,
    report: JobReport,
}

/// `warm`/`taken` events in the rig's event log.
fn warm_taken(rig: &Rig) -> usize {
    crate::events::events_json(rig, &[])
        .iter()
        .filter(|e| e["event"] == "warm" && e["cause"] == "taken")
        .count()
}

/// Holds the pool's refill lock (`warm/refill.lock`) while it lives: the
/// refill a warm row's prepare starts detached returns at once, without an
/// EC2 call that the row would count as the prepare's.
fn hold_refill(rig: &Rig) -> std::fs::File {
    let path = rig.state_dir.join("warm/refill.lock");
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    f.try_lock()
        .unwrap_or_else(|e| panic!("a refill still holds {}: {e}", path.display()));
    f
}

/// Runs `job` with the holds on; with `boots`, sshd is down until the
/// `pending` hold of the first RunInstances or StartInstances has passed.
/// With `warm`, the job must take a warm instance, and no refill runs
/// meanwhile.
fn measure(
    env: &mut Ec2Env,
    rig: &Rig,
    job: &SimJob,
    holds: Holds,
    boots: bool,
    warm: bool,
) -> Measured {
    let taken_before = warm.then(|| warm_taken(rig));
    let refill_lock = warm.then(|| hold_refill(rig));
    env.proxy.hold_launches(holds.pending);
    env.proxy.hold_transitions(holds.pending, Duration::ZERO);
    env.proxy.hold_attaches(holds.attaching);
    env.proxy.clear_calls();
    let mut first_stage = None;
    let report = run_booting(env, rig, job, holds.pending, boots, &mut |_| {
        first_stage.get_or_insert_with(Instant::now);
    });
    assert_result(&report, JobResult::Success);
    let split = first_stage.expect("a stage ran");
    drop(refill_lock);
    if let Some(before) = taken_before {
        let after = warm_taken(rig);
        assert_eq!(
            after,
            before + 1,
            "a warm row's job took {} warm instance(s), not 1: it timed something else\n{}",
            after - before,
            report.log()
        );
    }
    let calls = env
        .proxy
        .calls()
        .into_iter()
        .filter(|c| c.at < split)
        .collect();
    let prepare = report
        .calls
        .iter()
        .filter(|c| c.name.starts_with("prepare#"))
        .map(|c| c.elapsed)
        .sum();
    Measured {
        prepare,
        calls,
        report,
    }
}

/// Runs `job` through `rig` (`before_stage` as for
/// [`dormant::runner_sim::Runner::run_job_with`]); with `boots`, the
/// loopback sshd standing in for the instance is down until `pending` has
/// passed since the job's first RunInstances or StartInstances, as a booting
/// (or resuming) instance answers SSH only once EC2 says `running`. The
/// proxy's holds are the caller's.
pub fn run_booting(
    env: &mut Ec2Env,
    rig: &Rig,
    job: &SimJob,
    pending: Duration,
    boots: bool,
    before_stage: &mut dyn FnMut(&str),
) -> JobReport {
    if boots {
        env.sshd.stop();
    }
    let since = Instant::now();
    std::thread::scope(|s| {
        let proxy = &env.proxy;
        let sshd = &mut env.sshd;
        let gate = boots.then(|| {
            s.spawn(move || {
                // The machine boots: SSH answers once EC2 says running.
                let end = Instant::now() + Duration::from_secs(300);
                let booted = loop {
                    let seen = proxy.calls().into_iter().find(|c| {
                        c.at >= since
                            && matches!(c.action.as_str(), "RunInstances" | "StartInstances")
                    });
                    if let Some(c) = seen {
                        break Some(c.at);
                    }
                    if Instant::now() >= end {
                        break None;
                    }
                    std::thread::sleep(Duration::from_millis(5));
                };
                if let Some(at) = booted {
                    std::thread::sleep((at + pending).saturating_duration_since(Instant::now()));
                }
                sshd.restart();
                booted.is_some()
            })
        });
        let report = rig.runner.run_job_with(job, before_stage).unwrap();
        if let Some(g) = gate {
            assert!(g.join().unwrap(), "the job launched or started no instance");
        }
        report
    })
}

/// A warm row's run starts with a warm instance ready: `dormant warm`
/// (without holds) until no other refill runs and one is there.
fn ready_warm(env: &mut Ec2Env, rig: &Rig) {
    env.proxy.hold_launches(Duration::ZERO);
    env.proxy.hold_transitions(Duration::ZERO, Duration::ZERO);
    env.proxy.hold_attaches(Duration::ZERO);
    let end = Instant::now() + Duration::from_secs(180);
    loop {
        let out = rig.dormant(&["warm"]);
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if !text.contains("another refill of this pool is running") {
            assert!(out.status.success(), "dormant warm: {text}");
            return;
        }
        assert!(Instant::now() < end, "a refill still runs after 3 min");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// "9 | DescribeInstances 4, RunInstances 1, ..."
fn show_calls(calls: &[Call]) -> (usize, String) {
    let mut by: BTreeMap<&str, usize> = BTreeMap::new();
    for c in calls {
        *by.entry(c.action.as_str()).or_default() += 1;
    }
    let parts: Vec<String> = by.iter().map(|(a, n)| format!("{a} {n}")).collect();
    (calls.len(), parts.join(", "))
}

fn secs(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64())
}

fn env_secs(name: &str, default: f64) -> Duration {
    let s = std::env::var(name)
        .ok()
        .map(|v| {
            v.parse::<f64>()
                .unwrap_or_else(|_| panic!("{name}={v:?} is not a number of seconds"))
        })
        .unwrap_or(default);
    Duration::from_secs_f64(s)
}

/// The benchmark: `DORMANT_BENCH_ROWS` (ids, comma-separated; default all),
/// `DORMANT_BENCH_PENDING` and `DORMANT_BENCH_ATTACHING` (seconds; default
/// 20 and 2), `DORMANT_BENCH_RUNS` (default 1). Prints a table.
#[test]
#[ignore = "a benchmark: scripts/bench-ec2.sh runs it"]
fn bench_ec2_prepare() {
    let holds = Holds {
        pending: env_secs("DORMANT_BENCH_PENDING", 20.0),
        attaching: env_secs("DORMANT_BENCH_ATTACHING", 2.0),
    };
    let runs: usize = std::env::var("DORMANT_BENCH_RUNS")
        .ok()
        .map(|v| v.parse().expect("DORMANT_BENCH_RUNS is a number"))
        .unwrap_or(1)
        .max(1);
    let cases: Vec<Case> = match std::env::var("DORMANT_BENCH_ROWS") {
        Ok(ids) if !ids.trim().is_empty() => ids
            .split(',')
            .map(|id| {
                Case::ALL
                    .into_iter()
                    .find(|c| c.id() == id.trim())
                    .unwrap_or_else(|| {
                        panic!(
                            "no row {id:?}: the rows are {}",
                            Case::ALL.map(Case::id).join(", ")
                        )
                    })
            })
            .collect(),
        _ => Case::ALL.to_vec(),
    };
    let mut rows = Vec::new();
    for case in cases {
        let mut env = Ec2Env::start();
        let (rig, key) = case.setup(&env);
        let mut measured: Vec<Measured> = (0..runs)
            .map(|run| {
                if case.warm() {
                    ready_warm(&mut env, &rig);
                }
                let m = measure(
                    &mut env,
                    &rig,
                    &case.job(key.as_deref()),
                    holds,
                    case.boots(),
                    case.warm(),
                );
                eprintln!(
                    "run {run}: {}: prepare {} s, {} EC2 calls",
                    case.id(),
                    secs(m.prepare),
                    m.calls.len()
                );
                if run == 0 {
                    // Where the time went: prepare's lines as they arrived.
                    for c in m
                        .report
                        .calls
                        .iter()
                        .filter(|c| c.name.starts_with("prepare#"))
                    {
                        for (at, line) in &c.arrivals {
                            eprintln!("  prepare +{:.3} s: {line}", at.as_secs_f64());
                        }
                    }
                }
                m
            })
            .collect();
        measured.sort_by_key(|m| m.prepare);
        let median = &measured[measured.len() / 2];
        let floor = case.floor(holds);
        let (n, by) = show_calls(&median.calls);
        let (what, storage, machine) = case.labels();
        rows.push(format!(
            "| {:<18} | {what:<15} | {storage:<7} | {machine:<8} | {:>7} | {:>9} | {:>7} | {n:>9} | {by} |",
            case.id(),
            secs(floor),
            secs(median.prepare),
            secs(median.prepare.saturating_sub(floor)),
        ));
    }
    println!();
    println!(
        "dormant EC2 prepare benchmark: moto behind the test proxy holding new and started instances pending {} s \
         and attachments attaching {} s; sshd (the instance) answers when its pending hold ends. {runs} run(s) per row, \
         the median shown.",
        secs(holds.pending),
        secs(holds.attaching)
    );
    println!();
    println!("| row                | job             | storage | machine  | holds s | prepare s | added s | EC2 calls | calls by action |");
    println!("|--------------------|-----------------|---------|----------|--------:|----------:|--------:|----------:|-----------------|");
    for r in rows {
        println!("{r}");
    }
}
