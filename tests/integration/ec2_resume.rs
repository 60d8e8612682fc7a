//! Resume and suspend under slow transitions, through the built binary: the
//! recording proxy holds every start (stop) `pending` (`stopping`) for H
//! seconds, and the loopback sshd standing in for the instance comes up D
//! seconds after StartInstances. The tests check what happens (the resume
//! logs in as soon as sshd answers, polls stay at one a second by the
//! proxy's count); `bench_resume_and_suspend` (ignored, run by
//! `scripts/bench-resume.sh`) measures how long it takes.
//!
//! Network rule: loopback only; moto's instance addresses are never contacted
//! (`connect_address`, or the proxy reporting 127.0.0.1 as the public IP).

use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::ec2_rig::Ec2Env;
use crate::harness::{self, assert_result, JobReport, JobResult, Rig};

/// One suspended environment on moto + a loopback sshd, resumed again and again.
pub struct ResumeRig {
    pub rig: Rig,
    /// Moto behind the proxy, the loopback sshd standing in for the instance.
    pub env: Ec2Env,
    /// `ec2.address = "public"` (re-read after every start) instead of a fixed `connect_address`.
    pub public: bool,
    /// The proxy shows the public IP only once the start is no longer held
    /// `pending` (so the resume must wait for `running` to learn it).
    pub ip_once_running: bool,
    pub key: String,
    pub instance: String,
    stamp: PathBuf,
}

/// One resume: times relative to the proxy receiving StartInstances.
pub struct Resumed {
    pub report: JobReport,
    /// When sshd accepted logins again.
    pub sshd_up: Duration,
    /// When prepare had finished.
    pub ready: Duration,
    /// When SSH could first log in: sshd up and, if the address must be re-read, shown.
    pub limit: Duration,
    /// DescribeInstances calls about the instance from StartInstances to the end of the hold.
    pub polls_in_hold: usize,
}

impl ResumeRig {
    /// A bare `ssh host true` to the sshd (fresh connection, known host key):
    /// what one SSH login costs on this machine right now, the floor of any resume.
    pub fn bare_login(&self) -> Duration {
        let t = Instant::now();
        let out = std::process::Command::new("ssh")
            .args([
                "-F",
                "/dev/null",
                "-o",
                "BatchMode=yes",
                "-o",
                "IdentitiesOnly=yes",
            ])
            .args([
                "-o",
                "StrictHostKeyChecking=no",
                "-o",
                "UserKnownHostsFile=/dev/null",
            ])
            .args([
                "-o",
                "LogLevel=ERROR",
                "-p",
                &self.env.sshd.port.to_string(),
                "-i",
            ])
            // The environment's own key: the cloud-init stand-in authorizes only those.
            .arg(self.rig.env_dir(&self.key).join("id_ed25519"))
            .args(["root@127.0.0.1", "true"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        t.elapsed()
    }
}

impl ResumeRig {
    /// Makes the environment and suspends it (no hold yet).
    pub fn new(public: bool) -> ResumeRig {
        let env = Ec2Env::start();
        let reach = if public {
            env.proxy.public_ip("127.0.0.1");
            format!("address = \"public\"\nssh_port = {}\n", env.sshd.port)
        } else {
            env.connect_address()
        };
        let rig = env.rig("7", "s_0123456789ab", &env.settings(&reach, ""));
        let first = harness::job(5)
            .suspend_on(true, false)
            .script("echo 'agent state' > progress.txt");
        let r = rig.run(&first);
        assert_result(&r, JobResult::Success);
        let key = r.key.clone().expect("the key is printed");
        let instance = key
            .split('&')
            .find_map(|f| f.strip_prefix("instance="))
            .unwrap()
            .to_string();
        let stamp = rig.dir.path().join("prepare-done");
        ResumeRig {
            rig,
            env,
            public,
            ip_once_running: false,
            key,
            instance,
            stamp,
        }
    }

    /// From now on the new public IP is shown only once the instance runs.
    pub fn ip_once_running(mut self) -> ResumeRig {
        self.env.proxy.public_ip_once_running(true);
        self.ip_once_running = true;
        self
    }

    /// Resumes with sshd down until `sshd_after` past StartInstances, with
    /// starts held `hold` and stops `stop_hold`; the job suspends again.
    pub fn resume(&mut self, hold: Duration, stop_hold: Duration, sshd_after: Duration) -> Resumed {
        self.env.sshd.stop();
        self.env.proxy.hold_transitions(hold, stop_hold);
        let job = harness::job(5)
            .resume(&self.key)
            .suspend_on(true, false)
            .script("cat progress.txt");
        // The runner calls prepare_script right after prepare exits: stamp that moment.
        let stamp_cmd = format!("date +%s%N > {}", self.stamp.display());
        let since = Instant::now();
        let wall0 = SystemTime::now();
        let (report, started, sshd_up) = std::thread::scope(|s| {
            let proxy = &self.env.proxy;
            let sshd = &mut self.env.sshd;
            let starter = s.spawn(move || {
                let started = proxy
                    .await_call("StartInstances", since, Duration::from_secs(120))
                    .expect("the resume called StartInstances");
                std::thread::sleep(
                    (started + sshd_after).saturating_duration_since(Instant::now()),
                );
                sshd.restart();
                (started, Instant::now())
            });
            let report = self
                .rig
                .run_with_command_before(&job, "prepare_script", &stamp_cmd);
            let (started, up) = starter.join().unwrap();
            (report, started, up)
        });
        assert_result(&report, JobResult::Success);
        assert!(report.log().contains("agent state"), "{}", report.log());
        let ns: u128 = std::fs::read_to_string(&self.stamp)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let wall0_ns = wall0.duration_since(UNIX_EPOCH).unwrap().as_nanos();
        let done = since + Duration::from_nanos((ns - wall0_ns) as u64);
        let sshd_up = sshd_up - started;
        // A public IP shown while pending is known from the first poll, right
        // after StartInstances; one shown only once running is known then.
        let limit = if self.public && self.ip_once_running {
            sshd_up.max(hold)
        } else {
            sshd_up
        };
        let polls_in_hold = self
            .env
            .proxy
            .describes_of(&self.instance)
            .into_iter()
            .filter(|at| *at >= started && *at <= started + hold)
            .count();
        Resumed {
            report,
            sshd_up,
            ready: done.saturating_duration_since(started),
            limit,
            polls_in_hold,
        }
    }
}

/// What a job's cleanup (the suspend) added over the provider's own stop:
/// from the stop call (its "stopping instance" line) to the end, less the
/// `stop_hold` the proxy holds the instance `stopping`. A job shorter than
/// the start hold ends while EC2 still says `pending`, and EC2 cannot stop a
/// pending instance: the wait for `running` before the stop call is the
/// machine's time, not dormant's. Also says whether there was such a wait.
pub fn suspend_added(r: &JobReport, stop_hold: Duration) -> (Duration, bool) {
    let mut added = Duration::ZERO;
    let mut waited = false;
    for c in r.calls.iter().filter(|c| c.name.starts_with("cleanup#")) {
        let stop_call = c
            .arrivals
            .iter()
            .find(|(_, l)| l.contains("stopping instance") || l.contains("hibernating instance"))
            .map(|(at, _)| *at)
            .unwrap_or_default();
        waited |= c.output.contains("to be running");
        added += c
            .elapsed
            .saturating_sub(stop_call)
            .saturating_sub(stop_hold);
    }
    (added, waited)
}

#[test]
fn a_resume_logs_in_when_sshd_answers_while_ec2_still_says_pending() {
    let mut rig = ResumeRig::new(false);
    // EC2 reports running only after 10 s; sshd answers after 1 s. The
    // address (connect_address) is known, so the resume must not wait for
    // the state. Not a timing check: a resume that waited for the state
    // would log the instance running, which this one must not.
    let r = rig.resume(
        Duration::from_secs(10),
        Duration::from_secs(2),
        Duration::from_secs(1),
    );
    let log = r.report.log();
    assert!(
        log.contains("answers SSH") && log.contains("before EC2 reports it running"),
        "{log}"
    );
    assert!(
        !log.contains(&format!("instance {} running after", rig.instance)),
        "{log}"
    );
    assert!(r.report.log().contains("skipping get_sources"), "{log}");
}

#[test]
fn a_new_public_address_shown_while_pending_is_probed_at_once() {
    // EC2 shows the new public IP while the start is held pending for 10 s;
    // sshd answers after 1 s: the resume logs in then, without waiting for
    // running (it would log the instance running, which it must not).
    let mut rig = ResumeRig::new(true);
    let r = rig.resume(
        Duration::from_secs(10),
        Duration::from_secs(2),
        Duration::from_secs(1),
    );
    let log = r.report.log();
    assert!(
        log.contains("answers SSH at its new address 127.0.0.1:")
            && log.contains("while EC2 still says pending: logging in now"),
        "{log}"
    );
    assert!(
        !log.contains(&format!("instance {} running after", rig.instance)),
        "{log}"
    );
    assert!(log.contains("skipping get_sources"), "{log}");
}

#[test]
fn state_polls_during_a_transition_are_at_most_one_a_second() {
    let mut rig = ResumeRig::new(true).ip_once_running();
    // A public address shown only once running must be re-read: the resume
    // waits for running (4 s), polling; sshd is up at once. Then the job
    // suspends with a 3 s stop hold.
    rig.env.proxy.clear_calls();
    let r = rig.resume(
        Duration::from_secs(4),
        Duration::from_secs(3),
        Duration::ZERO,
    );
    let log = r.report.log();
    assert!(
        log.contains(&format!("instance {} running after", rig.instance)),
        "{log}"
    );
    // By the proxy's count: one call at the start, then one a second.
    assert!(
        (2..=5).contains(&r.polls_in_hold),
        "{} DescribeInstances in a 4 s hold: {:?}",
        r.polls_in_hold,
        rig.env.proxy.actions()
    );
    let stop = rig
        .env
        .proxy
        .calls()
        .into_iter()
        .find(|c| c.action == "StopInstances")
        .expect("the job suspended")
        .at;
    let during_stop = rig
        .env
        .proxy
        .describes_of(&rig.instance)
        .into_iter()
        .filter(|at| *at >= stop && *at <= stop + Duration::from_secs(3))
        .count();
    assert!(
        (2..=4).contains(&during_stop),
        "{during_stop} DescribeInstances in a 3 s stop hold: {:?}",
        rig.env.proxy.actions()
    );
    assert_eq!(rig.rig.status(&rig.key).as_deref(), Some("suspended"));
}

/// Median of durations.
fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2
    }
}

fn secs(d: Duration) -> String {
    format!("{:.2}", d.as_secs_f64())
}

/// The resume/suspend benchmark (`scripts/bench-resume.sh`): prints a table.
/// `DORMANT_BENCH_RUNS` sets the runs per row (default 5).
#[test]
#[ignore = "a benchmark: scripts/bench-resume.sh runs it"]
fn bench_resume_and_suspend() {
    let runs: usize = std::env::var("DORMANT_BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    let stop_hold = Duration::from_secs(5);
    let mut rows = Vec::new();
    let mut suspends = Vec::new();
    let mut pending_at_cleanup = 0;
    // (public, IP shown only once running, H, D)
    for (public, once_running, h, d) in [
        (false, false, 6.0, 9.0),
        (false, false, 8.0, 3.0),
        (true, false, 8.0, 3.0),
        (true, true, 8.0, 3.0),
        (true, true, 8.5, 3.0),
    ] {
        let mut rig = ResumeRig::new(public);
        if once_running {
            rig = rig.ip_once_running();
        }
        let (mut ready, mut limit, mut added) = (Vec::new(), Vec::new(), Vec::new());
        let mut logins = Vec::new();
        for run in 0..runs {
            let r = rig.resume(
                Duration::from_secs_f64(h),
                stop_hold,
                Duration::from_secs_f64(d),
            );
            eprintln!(
                "run: public={public} H={h} D={d}: sshd up {} s, limit {} s, ready {} s, {} polls in the hold",
                secs(r.sshd_up),
                secs(r.limit),
                secs(r.ready),
                r.polls_in_hold
            );
            if run == 0 {
                // Where the time goes: prepare's lines with their arrival times.
                for c in r
                    .report
                    .calls
                    .iter()
                    .filter(|c| c.name.starts_with("prepare"))
                {
                    for (at, line) in &c.arrivals {
                        eprintln!("  prepare +{:.3} s: {line}", at.as_secs_f64());
                    }
                    eprintln!("  prepare exited +{:.3} s", c.elapsed.as_secs_f64());
                }
            }
            logins.push(rig.bare_login());
            added.push(r.ready.saturating_sub(r.limit));
            ready.push(r.ready);
            limit.push(r.limit);
            let (suspend, waited_for_running) = suspend_added(&r.report, stop_hold);
            if waited_for_running {
                pending_at_cleanup += 1;
            }
            if suspend > Duration::from_secs(2) {
                // A slow suspend: where its time went, line by line.
                for c in r
                    .report
                    .calls
                    .iter()
                    .filter(|c| c.name.starts_with("cleanup"))
                {
                    for (at, line) in &c.arrivals {
                        eprintln!("  slow cleanup +{:.3} s: {line}", at.as_secs_f64());
                    }
                    eprintln!("  slow cleanup exited +{:.3} s", c.elapsed.as_secs_f64());
                }
            }
            suspends.push(suspend);
        }
        let max_added = *added.iter().max().unwrap();
        rows.push(format!(
            "| {:<31} | {h:>4} | {d:>4} | {:>7} | {:>7} | {:>7} | {:>11} | {:>13} |",
            if once_running {
                "public IP, shown once running"
            } else if public {
                "public IP, shown while pending"
            } else {
                "known address (connect_address)"
            },
            secs(median(limit)),
            secs(median(ready)),
            secs(median(added)),
            secs(max_added),
            secs(median(logins)),
        ));
    }
    println!();
    println!("dormant resume/suspend benchmark ({runs} runs per row; EC2 from moto behind the holding proxy, sshd on loopback)");
    println!();
    println!("Resume: times in s after StartInstances; the limit is when SSH could first log in (sshd up, and the new public address shown: while pending, as EC2 usually does, or only once running). Goal: added ≤ 0.5 s (median).");
    println!();
    println!("The last column is a bare `ssh host true` (a fresh login) measured right after each resume: the floor of `added` on this machine at that moment.");
    println!();
    println!("| address                         |  H s |  D s | limit s | ready s | added s | max added s | bare login s  |");
    println!("|---------------------------------|-----:|-----:|--------:|--------:|--------:|------------:|--------------:|");
    for r in rows {
        println!("{r}");
    }
    let max_s = *suspends.iter().max().unwrap();
    println!();
    println!(
        "Suspend (stop held {} s): cleanup from its stop call to its end, minus the hold. Goal: ≤ 1 s (median). \
         In {pending_at_cleanup} of {} runs the job ended while EC2 still said pending (it logged in before): \
         cleanup first waited for running, since EC2 cannot stop a pending instance; that wait is the machine's.",
        stop_hold.as_secs(),
        suspends.len()
    );
    println!();
    println!("| suspend | runs | added s (median) | max s |");
    println!("|---------|-----:|-----------------:|------:|");
    println!(
        "| H = {}   | {:>4} | {:>16} | {:>5} |",
        stop_hold.as_secs(),
        suspends.len(),
        secs(median(suspends)),
        secs(max_s)
    );
}
