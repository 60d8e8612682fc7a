//! The pause benchmark (`scripts/bench-pause.sh`; an ignored test, not part
//! of the suite): what pausing a job (docs/pause.md) costs on the `ssh`
//! provider (the test sshd) and on EC2 in `hibernate` mode (moto behind the
//! test proxy, the loopback sshd standing in for the instance). Numbers are
//! printed as a table, never asserted.
//!
//! Each run of a row is two jobs through the built binary, as GitLab Runner
//! runs them:
//! - job A pauses: its script asks (`dormant-ask`), or `dormant pause` from
//!   the host freezes it (a counter script). Measured: *pause* — for an ask,
//!   from the arrival of the line the script prints just before it asks to
//!   the end of its stage; for a host pause, the `dormant pause` command's
//!   wall time (it returns once the job state says the stage ended paused) —
//!   and *suspend*, the paused job's cleanup call (the suspension keeping the
//!   script: on EC2 the hibernating StopInstances, no `stopping` hold).
//! - job B resumes A's environment by its key and runs `dormant-continue`.
//!   On EC2 the proxy holds the StartInstances `pending` for P seconds
//!   (default 20 s, the public figure for resuming a hibernated small Linux
//!   instance) and the loopback sshd is down until then. Measured: *prepare*
//!   (the resume's prepare call) and *to first byte*: from the start of the
//!   first prepare call to the arrival, in job B's log, of the first line
//!   the continued script prints after the answer (the sum of the calls'
//!   wall times in between plus the line's arrival in its stage: the
//!   simulated runner's own work between two calls, well under a millisecond,
//!   is not counted). *added* = to first byte − the hold: dormant's own part.
//!
//! A row `not paused` times job A's suspension when its script does not
//! pause (`suspend_on_success`), beside the paused one.
//!
//! Network rule: the instance addresses moto hands out are never contacted.

use std::path::Path;
use std::time::{Duration, Instant};

use dormant::runner_sim::SimJob;

use crate::harness::*;
use crate::pause_host::{counter, pause_cmd, text, wait_for};
use crate::ssh::ssh_rig_with;
use crate::sshd::Sshd;

#[cfg(feature = "ec2")]
use crate::ec2_rig::Ec2Env;

/// How job A pauses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum By {
    /// The script runs `dormant-ask`.
    Ask,
    /// `dormant pause JOB_ID` from the runner host.
    Host,
    /// It does not: `suspend_on_success`, the baseline of the suspension.
    NotPaused,
}

impl By {
    fn label(self) -> &'static str {
        match self {
            By::Ask => "`dormant-ask`",
            By::Host => "`dormant pause`",
            By::NotPaused => "not paused",
        }
    }
}

/// One measured run (seconds).
#[derive(Debug, Default, Clone, Copy)]
struct Run {
    pause: Option<Duration>,
    suspend: Duration,
    prepare: Option<Duration>,
    first_byte: Option<Duration>,
}

/// Where the jobs run (the sshd is held only to keep it running).
enum Place {
    Ssh(#[allow(dead_code)] Sshd, Rig),
    #[cfg(feature = "ec2")]
    Ec2(Box<Ec2Env>, Rig),
    /// The same with a hot window (`suspend.hot_for = "10m"`): the continue
    /// takes the running instance (no StartInstances, so no hold; the
    /// loopback sshd stays up as the running instance's would).
    #[cfg(feature = "ec2")]
    Ec2Hot(Box<Ec2Env>, Rig),
}

impl Place {
    fn ssh() -> Place {
        let sshd = Sshd::start();
        let (rig, _) = ssh_rig_with(&sshd, "");
        Place::Ssh(sshd, rig)
    }

    #[cfg(feature = "ec2")]
    fn ec2() -> Place {
        let env = Ec2Env::start();
        let rig = env.rig("74", "s_74aa74aa74aa", &crate::ec2_pause::hibernating(&env));
        Place::Ec2(Box::new(env), rig)
    }

    #[cfg(feature = "ec2")]
    fn ec2_hot() -> Place {
        let env = Ec2Env::start();
        let settings = crate::ec2_pause::hibernating(&env) + "[suspend]\nhot_for = \"10m\"\n";
        let rig = env.rig("75", "s_75aa75aa75aa", &settings);
        Place::Ec2Hot(Box::new(env), rig)
    }

    fn name(&self) -> &'static str {
        match self {
            Place::Ssh(..) => "ssh (loopback sshd)",
            #[cfg(feature = "ec2")]
            Place::Ec2(..) => "ec2 `hibernate` (moto)",
            #[cfg(feature = "ec2")]
            Place::Ec2Hot(..) => "ec2 `hibernate`, hot window (moto)",
        }
    }

    fn rig(&self) -> &Rig {
        match self {
            Place::Ssh(_, rig) => rig,
            #[cfg(feature = "ec2")]
            Place::Ec2(_, rig) => rig,
            #[cfg(feature = "ec2")]
            Place::Ec2Hot(_, rig) => rig,
        }
    }

    /// The hold a resume sits through here.
    fn hold(&self, pending: Duration) -> Duration {
        match self {
            Place::Ssh(..) => Duration::ZERO,
            #[cfg(feature = "ec2")]
            Place::Ec2(..) => pending,
            #[cfg(feature = "ec2")]
            Place::Ec2Hot(..) => Duration::ZERO,
        }
    }

    /// Runs a resuming job: on EC2 with its StartInstances held `pending`
    /// and the "instance" answering SSH only after the hold.
    fn resume(&mut self, job: &SimJob, pending: Duration) -> JobReport {
        match self {
            Place::Ssh(_, rig) => rig.run(job),
            #[cfg(feature = "ec2")]
            Place::Ec2(env, rig) => {
                env.proxy.hold_transitions(pending, Duration::ZERO);
                let r = crate::ec2_bench::run_booting(env, rig, job, pending, true, &mut |_| {});
                env.proxy.hold_transitions(Duration::ZERO, Duration::ZERO);
                r
            }
            // The same hold is set: a StartInstances (there is none) would sit it out.
            #[cfg(feature = "ec2")]
            Place::Ec2Hot(env, rig) => {
                env.proxy.hold_transitions(pending, Duration::ZERO);
                let r = crate::ec2_bench::run_booting(env, rig, job, pending, false, &mut |_| {});
                env.proxy.hold_transitions(Duration::ZERO, Duration::ZERO);
                r
            }
        }
    }
}

/// From the start of the job's first prepare call to the arrival of the
/// first line containing `marker` in `stage`: the wall times of the calls
/// in between (prepare, the stages before `stage`) plus the line's arrival
/// in `stage`.
pub fn prepare_to_line(r: &JobReport, stage: &str, marker: &str) -> Option<Duration> {
    let start = r
        .calls
        .iter()
        .position(|c| c.name.starts_with("prepare#"))?;
    let mut t = Duration::ZERO;
    for c in &r.calls[start..] {
        if c.name == stage {
            return c.arrived(marker).map(|a| t + a);
        }
        t += c.elapsed;
    }
    None
}

fn call_time(r: &JobReport, f: impl Fn(&dormant::runner_sim::Call) -> bool) -> Duration {
    r.calls.iter().filter(|c| f(c)).map(|c| c.elapsed).sum()
}

/// Job A of a row; returns the run's pause and suspend, and A's key.
fn pause_job(place: &Place, by: By, d: &Path) -> (Run, String) {
    let rig = place.rig();
    let (r, pause) = match by {
        By::Ask => {
            let r = rig.run(
                &job(74).script("echo asking; a=$(dormant-ask 'Go on?'); echo \"answer=[$a]\""),
            );
            let stage = r
                .calls
                .iter()
                .find(|c| c.name == "build_script")
                .expect("a build_script");
            let asked = stage.arrived("asking").expect("the line before the ask");
            let pause = stage.elapsed.saturating_sub(asked);
            (r, Some(pause))
        }
        By::Host => {
            let j = job(74);
            let id = j.id.to_string();
            let sim = j.script(&counter(d));
            std::thread::scope(|s| {
                let running = s.spawn(|| rig.run(&sim));
                wait_for(&d.join("started"));
                let t = Instant::now();
                let out = pause_cmd(rig, &[&id], &[]);
                let took = t.elapsed();
                if !out.status.success() {
                    std::fs::write(d.join("release"), "").unwrap();
                    let _ = running.join();
                    panic!("dormant pause: {}", text(&out));
                }
                (running.join().unwrap(), Some(took))
            })
        }
        By::NotPaused => (
            rig.run(&job(74).suspend_on(true, false).script("echo not asking")),
            None,
        ),
    };
    assert_result(&r, JobResult::Success);
    let key = r.key.clone().expect("the environment was kept");
    assert_eq!(
        rig.status(&key).as_deref(),
        Some("suspended"),
        "{}",
        r.log()
    );
    let run = Run {
        pause,
        suspend: call_time(&r, |c| c.is_cleanup()),
        ..Run::default()
    };
    (run, key)
}

/// Job B: resumes `key` and continues the paused script; the first line
/// it prints after the answer is timed.
fn continue_job(place: &mut Place, by: By, key: &str, d: &Path, pending: Duration, run: &mut Run) {
    let (script, marker, want) = match by {
        By::Ask => ("dormant-continue yes", "answer=[yes]", JobResult::Success),
        By::Host => {
            // The counter ends after its next line once `release` exists.
            std::fs::write(d.join("release"), "").unwrap();
            (
                "dormant-continue",
                "line ",
                JobResult::BuildFailure(Some(3)),
            )
        }
        By::NotPaused => return,
    };
    let r = place.resume(&job(74).resume(key).script(script), pending);
    assert_result(&r, want);
    assert_eq!(r.prepare_attempts, 1, "{}", r.log());
    run.prepare = Some(call_time(&r, |c| c.name.starts_with("prepare#")));
    // Where the time went: the resume's lines as they arrived.
    for c in r.calls.iter().filter(|c| c.name.starts_with("prepare#")) {
        for (at, line) in &c.arrivals {
            eprintln!("  prepare +{:.3} s: {line}", at.as_secs_f64());
        }
    }
    run.first_byte = Some(
        prepare_to_line(&r, "build_script", marker)
            .unwrap_or_else(|| panic!("no {marker:?} in the resumed job's log:\n{}", r.log())),
    );
}

fn median(mut v: Vec<Duration>) -> Option<Duration> {
    v.sort();
    v.get(v.len() / 2).copied()
}

fn secs(d: Option<Duration>) -> String {
    d.map(|d| format!("{:.2}", d.as_secs_f64()))
        .unwrap_or_else(|| "—".into())
}

/// The benchmark: `DORMANT_BENCH_RUNS` (default 3), `DORMANT_BENCH_PENDING`
/// (seconds EC2's start is held; default 20), `DORMANT_BENCH_PROVIDERS`
/// (`ssh`, `ec2`, `ec2-hot`, comma-separated; default ssh,ec2,ec2-hot).
/// Prints a table.
#[test]
#[ignore = "a benchmark: scripts/bench-pause.sh runs it"]
fn bench_pause() {
    let runs: usize = std::env::var("DORMANT_BENCH_RUNS")
        .ok()
        .map(|v| v.parse().expect("DORMANT_BENCH_RUNS is a number"))
        .unwrap_or(3)
        .max(1);
    let pending = Duration::from_secs_f64(
        std::env::var("DORMANT_BENCH_PENDING")
            .ok()
            .map(|v| v.parse().expect("DORMANT_BENCH_PENDING is seconds"))
            .unwrap_or(20.0),
    );
    let providers =
        std::env::var("DORMANT_BENCH_PROVIDERS").unwrap_or_else(|_| "ssh,ec2,ec2-hot".into());
    let mut rows = Vec::new();
    for p in providers
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
    {
        let mut place = match p {
            "ssh" => Place::ssh(),
            #[cfg(feature = "ec2")]
            "ec2" => Place::ec2(),
            #[cfg(feature = "ec2")]
            "ec2-hot" => Place::ec2_hot(),
            other => panic!("no provider {other:?} here: ssh, ec2, ec2-hot (with the ec2 feature)"),
        };
        for by in [By::Ask, By::Host, By::NotPaused] {
            let mut measured = Vec::new();
            for n in 0..runs {
                let d = tempfile::tempdir().unwrap();
                let (mut run, key) = pause_job(&place, by, d.path());
                continue_job(&mut place, by, &key, d.path(), pending, &mut run);
                eprintln!("{} {} run {n}: {run:?}", place.name(), by.label());
                measured.push(run);
            }
            let col = |f: &dyn Fn(&Run) -> Option<Duration>| {
                median(measured.iter().filter_map(f).collect())
            };
            let hold = place.hold(pending);
            let first = col(&|r| r.first_byte);
            rows.push(format!(
                "| {} | {} | {} | {} | {} | {} | {} | {} |",
                place.name(),
                by.label(),
                secs(col(&|r| r.pause)),
                secs(col(&|r| Some(r.suspend))),
                if by == By::NotPaused {
                    "—".into()
                } else {
                    secs(Some(hold))
                },
                secs(col(&|r| r.prepare)),
                secs(first),
                secs(first.map(|f| f.saturating_sub(hold))),
            ));
        }
    }
    println!();
    println!(
        "dormant pause benchmark: {runs} run(s) per row, the median shown (s); EC2's start held pending {} s.",
        pending.as_secs_f64()
    );
    println!();
    println!("| provider | paused by | pause | suspend | resume hold | resume prepare | prepare → first continued byte | added |");
    println!("|---|---|---:|---:|---:|---:|---:|---:|");
    for r in rows {
        println!("{r}");
    }
}
