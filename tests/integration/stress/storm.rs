//! One round's storm: a pool of suspended environments, then every job of the
//! round at once (new ones that suspend, release or fail; several resumes
//! racing for one key; resumes racing `dormant release`) while two `dormant
//! sweep` loops run, one with a TTL short enough to expire the pool.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Output};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use dormant::runner_sim::Runner;

use crate::harness::*;

const RUNNER: &str = "91";
const SYSTEM: &str = "s_stress000001";
pub(super) const PROJECT: u64 = 17;
/// The TTL of one sweep loop and of half the jobs' cleanups: short enough
/// that environments suspended early in a round expire during it.
/// `DORMANT_STRESS_TTL` overrides it (e.g. `7d`: no sweep ever expires anything).
fn short_ttl() -> String {
    std::env::var("DORMANT_STRESS_TTL").unwrap_or_else(|_| "2s".into())
}
/// Environments suspended before the storm; the storm resumes, races for and
/// releases them by index.
const POOL: usize = 8;

/// The runners of one round: A with default settings, B whose cleanups sweep
/// with the short TTL; both one runner manager (same ids, same state dir), so
/// either can resume the other's keys.
pub(super) struct Setup {
    pub rig: Rig,
    short: Runner,
    short_env: BTreeMap<String, String>,
}

impl Setup {
    fn new() -> Setup {
        let rig = Rig::local(RUNNER, SYSTEM);
        let short_settings = rig.dir.path().join("short-ttl.toml");
        Rig::write_settings(
            &short_settings,
            SYSTEM,
            &format!("[suspend]\nttl = \"{}\"\n", short_ttl()),
        );
        let mut short = rig.runner.clone();
        short.env.insert(
            "DORMANT_CONFIG".into(),
            short_settings.display().to_string(),
        );
        let short_env = short.env.clone();
        Setup {
            rig,
            short,
            short_env,
        }
    }

    fn runner(&self, i: usize) -> &Runner {
        if i.is_multiple_of(2) {
            &self.rig.runner
        } else {
            &self.short
        }
    }

    pub fn state(&self) -> &Path {
        &self.rig.state_dir
    }
}

/// One job of the storm and what its script and triggers make of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Role {
    /// New environment, suspends on success.
    NewSuspend,
    /// New environment, no trigger: released at cleanup.
    NewRelease,
    /// New environment, script exits 3, suspends on failure.
    NewFailSuspend,
    /// Resumes pool[i]; `keep` = suspend again on success (else released);
    /// `race` = several jobs resume the same key at once.
    Resume { pool: usize, keep: bool, race: bool },
}

pub(super) struct Finished {
    pub role: Role,
    pub report: JobReport,
}

/// Counts the jobs running at once.
struct Gauge {
    now: Mutex<(usize, usize)>,
}

impl Gauge {
    fn run<T>(&self, f: impl FnOnce() -> T) -> T {
        {
            let mut g = self.now.lock().unwrap();
            g.0 += 1;
            g.1 = g.1.max(g.0);
        }
        let out = f();
        self.now.lock().unwrap().0 -= 1;
        out
    }
}

/// The environment a storm job worked on: the pool key it resumed (if it got
/// it), or the key it printed, or the one in its builds dir.
pub(super) fn own_env(f: &Finished, pool: &[String]) -> Option<String> {
    match f.role {
        // A refused resume (a build failure without a script exit code) never
        // held the environment: what its cleanup says of it is a sweep's doing.
        Role::Resume { .. } if f.report.result == JobResult::BuildFailure(None) => None,
        Role::Resume { pool: p, .. } => env_id(&pool[p]),
        _ => f
            .report
            .key
            .as_deref()
            .and_then(env_id)
            .or_else(|| super::checks::builds_dir_env_id(&f.report)),
    }
}

pub(super) fn env_id(key: &str) -> Option<String> {
    dormant::envkey::EnvironmentKey::parse(key)
        .ok()
        .map(|k| k.env_id.to_string())
}

/// How many `dormant sweep` loops run during the storm: the short-TTL one,
/// then one with the default TTL. `DORMANT_STRESS_SWEEP_LOOPS=0` leaves only
/// the sweeps every cleanup makes.
fn sweep_loops() -> usize {
    std::env::var("DORMANT_STRESS_SWEEP_LOOPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2)
}

/// Everything the storm produced, for the checks.
pub(super) struct Storm {
    pub setup: Setup,
    /// Keys of the environments suspended before the storm.
    pub pool: Vec<String>,
    pub finished: Vec<Finished>,
    /// `dormant release` of pool[i]: (i, what it did).
    pub releases: Vec<(usize, Output)>,
    pub sweeps: Vec<Output>,
    pub max_concurrent_jobs: usize,
}

/// Sets up the pool, then runs the storm to its end.
pub(super) fn run() -> Storm {
    let setup = Setup::new();

    // Before the storm: a pool of suspended environments (no sweep yet).
    let pool: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..POOL)
            .map(|_| s.spawn(|| setup.rig.run(&job(PROJECT).suspend_on(true, false))))
            .collect();
        handles
            .into_iter()
            .filter_map(|h| h.join().unwrap().key)
            .collect()
    });
    assert_eq!(pool.len(), POOL, "the pool could not be set up");

    let gauge = Gauge {
        now: Mutex::new((0, 0)),
    };
    let stop = AtomicBool::new(false);
    let mut roles: Vec<Role> = Vec::new();
    roles.extend([Role::NewSuspend; 4]);
    roles.extend([Role::NewRelease; 3]);
    roles.extend([Role::NewFailSuspend; 2]);
    let resume = |pool, keep, race| Role::Resume { pool, keep, race };
    roles.extend([resume(0, true, true); 4]);
    roles.extend([resume(1, false, true); 3]);
    roles.extend([resume(2, true, false), resume(3, false, false)]);
    // pool 6: a resume (no trigger) racing `dormant release`.
    roles.push(resume(6, false, false));
    // pool 4, 5: released by hand; pool 7: left alone for the sweep.
    let releases = [4usize, 5, 6];
    // A race's winner holds its environment until every other racer for the
    // key has been answered, not for however long its job happens to take: its
    // script waits for a gate the last of them opens (bounded: two winners,
    // both waiting, go on after 2 min and are reported). Without it, a racer
    // started late on a loaded machine found the key free again.
    let racers = |p: usize| {
        roles
            .iter()
            .filter(|r| matches!(r, Role::Resume { pool, race: true, .. } if *pool == p))
            .count()
    };
    let answered: Vec<AtomicUsize> = (0..POOL).map(|_| AtomicUsize::new(0)).collect();
    let gate = |p: usize| setup.rig.dir.path().join(format!("race-gate-{p}"));

    let (finished, release_outs, sweep_outs) = std::thread::scope(|s| {
        let sweepers: Vec<_> = [setup.short_env.clone(), setup.rig.runner.env.clone()]
            .into_iter()
            .take(sweep_loops())
            .map(|env| {
                let stop = &stop;
                s.spawn(move || {
                    let mut outs = Vec::new();
                    while !stop.load(Ordering::Relaxed) {
                        outs.push(dormant_cmd(&env, &["sweep"]));
                    }
                    outs
                })
            })
            .collect();
        let jobs: Vec<_> = roles
            .iter()
            .enumerate()
            .map(|(i, &role)| {
                let (setup, pool, gauge) = (&setup, &pool, &gauge);
                let (racers, answered, gate) = (&racers, &answered, &gate);
                s.spawn(move || {
                    let j = match role {
                        Role::NewSuspend => job(PROJECT).suspend_on(true, false),
                        Role::NewRelease => job(PROJECT),
                        Role::NewFailSuspend => {
                            job(PROJECT).suspend_on(false, true).script("exit 3")
                        }
                        Role::Resume { pool: p, keep, race } => {
                            let j = job(PROJECT).suspend_on(keep, false).resume(&pool[p]);
                            if race {
                                j.script(&format!(
                                    "for i in $(seq 1200); do [ -e '{}' ] && break; sleep 0.1; done; echo won",
                                    gate(p).display()
                                ))
                            } else {
                                j
                            }
                        }
                    };
                    let report = gauge.run(|| setup.runner(i).run_job(&j).unwrap());
                    if let Role::Resume { pool: p, race: true, .. } = role {
                        let n = answered[p].fetch_add(1, Ordering::SeqCst) + 1;
                        if n + 1 >= racers(p) {
                            std::fs::write(gate(p), "").unwrap();
                        }
                    }
                    Finished { role, report }
                })
            })
            .collect();
        let rels: Vec<_> = releases
            .iter()
            .map(|&p| {
                let (setup, pool) = (&setup, &pool);
                s.spawn(move || {
                    (
                        p,
                        dormant_cmd(&setup.rig.runner.env, &["release", &pool[p]]),
                    )
                })
            })
            .collect();
        let finished: Vec<Finished> = jobs.into_iter().map(|h| h.join().unwrap()).collect();
        let rels: Vec<(usize, Output)> = rels.into_iter().map(|h| h.join().unwrap()).collect();
        stop.store(true, Ordering::Relaxed);
        let sweeps: Vec<Output> = sweepers
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect();
        (finished, rels, sweeps)
    });
    let max_concurrent_jobs = gauge.now.lock().unwrap().1;
    Storm {
        setup,
        pool,
        finished,
        releases: release_outs,
        sweeps: sweep_outs,
        max_concurrent_jobs,
    }
}

pub(super) fn dormant_cmd(env: &BTreeMap<String, String>, args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env_clear()
        .envs(env)
        .output()
        .unwrap()
}
