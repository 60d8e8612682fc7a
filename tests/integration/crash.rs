//! Crash points: a dormant process SIGKILLed at every step of prepare, run and
//! cleanup — for new and resumed environments, and for an operator's release —
//! then the runner's next move (its cleanup, its retried prepare, a later
//! resume, `dormant sweep`). After each: no environment lost (a suspended one
//! stays resumable, its file intact), none stuck beyond what `sweep` clears,
//! no directory or machine leaked, no job state or lock left.
//!
//! The kill is dormant's own `failpoint!` (the `testing` cargo feature),
//! armed through `DORMANT_FAILPOINT` in the runner's environment; with
//! `DORMANT_FAILPOINT_ONCE` it fires once, so the runner's retry gets past it.
//! Every scenario proves its process died at the named point
//! ([`assert_killed_at`]: the failpoint's last words in a call that ended by
//! SIGKILL, its once-marker made): many scenarios end the same way with no
//! kill at all, so a renamed or unreachable failpoint would otherwise pass.
//! The same scenarios run on `local`, on `ssh` (a loopback sshd) and on `ec2`
//! (moto behind the recording proxy, SSH to the loopback sshd).

use std::path::PathBuf;
use std::time::Duration;

use crate::harness::*;
use dormant::runner_sim::Call;

/// `suspend.claim_grace` in these tests: a dead holder counts as gone after it.
pub(crate) const GRACE: &str = "[suspend]\nclaim_grace = \"1s\"\n";
pub(crate) const PAST_GRACE: Duration = Duration::from_millis(2100);

/// Where the environments' machines live, to count what leaked.
pub trait Machines {
    /// Machines that exist (not deleted), by whatever the backend calls them.
    fn alive(&self) -> Vec<String>;
}

/// Nothing beyond the environment directories (the `local` provider).
pub struct NoMachines;
impl Machines for NoMachines {
    fn alive(&self) -> Vec<String> {
        Vec::new()
    }
}

/// Workspaces on the `ssh` provider's host.
pub struct Workspaces(pub PathBuf);
impl Machines for Workspaces {
    fn alive(&self) -> Vec<String> {
        std::fs::read_dir(&self.0)
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default()
    }
}

pub(crate) fn arm(rig: &mut Rig, point: Option<&str>, once: bool) {
    rig.runner.env.remove("DORMANT_FAILPOINT");
    rig.runner.env.remove("DORMANT_FAILPOINT_ONCE");
    if let Some(p) = point {
        rig.runner.env.insert("DORMANT_FAILPOINT".into(), p.into());
        if once {
            let marker = rig.dir.path().join(format!("fired-{}", job_id()));
            rig.runner.env.insert(
                "DORMANT_FAILPOINT_ONCE".into(),
                marker.display().to_string(),
            );
        }
    }
}

/// What dormant prints as an armed failpoint kills it (`src/failpoint.rs`).
fn last_words(point: &str) -> String {
    format!("dormant: failpoint {point}: SIGKILL")
}

/// Proves the process died at `point`, `times` times: exactly that many of
/// `calls` printed the failpoint's last words and ended by SIGKILL, and the
/// once-marker of a failpoint armed once exists (the failpoint makes it just
/// before the kill). Without this a renamed or unreachable failpoint goes
/// unnoticed: most scenarios end the same way with no kill at all.
#[track_caller]
pub(crate) fn assert_killed_at(rig: &Rig, calls: &[Call], point: &str, times: usize) {
    assert_eq!(
        rig.runner.env.get("DORMANT_FAILPOINT").map(String::as_str),
        Some(point),
        "{point}: not the armed failpoint"
    );
    let said = last_words(point);
    let killed: Vec<&Call> = calls.iter().filter(|c| c.output.contains(&said)).collect();
    let every: Vec<String> = calls
        .iter()
        .map(|c| format!("{} (exit {})", c.name, c.exit_code))
        .collect();
    let all_output: String = calls.iter().map(|c| c.output.as_str()).collect();
    assert_eq!(
        killed.len(),
        times,
        "{point}: the process was not killed there {times} time(s) (calls: {every:?}):\n{all_output}"
    );
    for c in killed {
        assert_eq!(
            c.exit_code,
            128 + libc::SIGKILL,
            "{point}: {} printed the failpoint but was not SIGKILLed:\n{}",
            c.name,
            c.output
        );
    }
    if let Some(marker) = rig.runner.env.get("DORMANT_FAILPOINT_ONCE") {
        assert!(
            std::path::Path::new(marker).exists(),
            "{point}: armed once, but its marker {marker} was never made"
        );
    }
}

/// An operator's command as a call, for [`assert_killed_at`].
pub(crate) fn operator_call(name: &str, out: &std::process::Output) -> Call {
    use std::os::unix::process::ExitStatusExt;
    Call {
        name: name.to_string(),
        exit_code: out
            .status
            .code()
            .unwrap_or_else(|| 128 + out.status.signal().unwrap_or(0)),
        elapsed: Duration::ZERO,
        output: format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
        arrivals: Vec::new(),
        raw: [out.stdout.as_slice(), &out.stderr].concat(),
    }
}

pub(crate) fn sweep(rig: &Rig) -> String {
    std::thread::sleep(PAST_GRACE);
    let out = rig.dormant(&["sweep"]);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "sweep failed: {text}");
    text
}

pub(crate) fn entries(dir: PathBuf) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// Every environment directory has a readable record in one of `statuses`;
/// no job state, lock, staging or trash entry is left; the machines alive are
/// exactly the environments'.
pub(crate) fn assert_settled(rig: &Rig, machines: &dyn Machines, what: &str) -> Vec<String> {
    let jobs = entries(rig.state_dir.join("jobs"));
    assert!(jobs.is_empty(), "{what}: job files left: {jobs:?}");
    let trash = entries(rig.state_dir.join("trash"));
    assert!(trash.is_empty(), "{what}: trash left: {trash:?}");
    let envs = entries(rig.state_dir.join("environments"));
    let mut statuses = Vec::new();
    for e in &envs {
        assert!(
            uuid::Uuid::parse_str(e).is_ok(),
            "{what}: stray entry environments/{e}"
        );
        let rec = std::fs::read_to_string(
            rig.state_dir
                .join("environments")
                .join(e)
                .join("record.json"),
        )
        .unwrap_or_else(|err| panic!("{what}: environments/{e} has no record: {err}"));
        let rec: serde_json::Value = serde_json::from_str(&rec).unwrap();
        statuses.push(rec["status"].as_str().unwrap().to_string());
    }
    let alive = machines.alive();
    assert!(
        alive.len() <= envs.len(),
        "{what}: machines leaked: {alive:?} for environments {envs:?}"
    );
    statuses
}

/// Resumes `key` with a job that checks the file job 1 wrote, then releases it.
pub(crate) fn resume_and_release(rig: &mut Rig, key: &str, what: &str) {
    arm(rig, None, false);
    let r =
        rig.run(&job(5).resume(key).script(
            "test \"$(cat kept.txt)\" = precious || { echo 'kept.txt lost' >&2; exit 9; }",
        ));
    assert_result(&r, JobResult::Success);
    assert!(
        !r.ran("get_sources") || r.log().contains("skipping get_sources"),
        "{what}: get_sources ran on a resumed environment"
    );
    assert!(rig.status(key).is_none(), "{what}: released after the job");
}

/// A new job that keeps its environment on success, writing kept.txt.
pub(crate) fn keeper() -> dormant::runner_sim::SimJob {
    job(5)
        .suspend_on(true, false)
        .script("echo precious > kept.txt")
}

/// Runs every scenario on one backend; collects nothing: the first broken
/// invariant fails the test naming the scenario.
pub fn every_crash_point(rig: &mut Rig, machines: &dyn Machines) {
    // 1. A new job's prepare killed at each step; the runner cleans up and
    //    retries: the job succeeds, its environment is suspended and resumable.
    for point in [
        "prepare:claiming",
        "prepare:claimed",
        "prepare:created",
        "prepare:recorded",
        "prepare:activated",
        "prepare:ready",
    ] {
        arm(rig, Some(point), true);
        let r = rig.run(&keeper());
        assert_result(&r, JobResult::Success);
        assert_eq!(r.prepare_attempts, 2, "{point}: killed once, retried once");
        assert_killed_at(rig, &r.calls, point, 1);
        let key = r.key.clone().unwrap();
        assert_eq!(rig.status(&key).as_deref(), Some("suspended"), "{point}");
        assert_settled(rig, machines, point);
        resume_and_release(rig, &key, point);
        assert_settled(rig, machines, point);
    }

    // 2. A resume's prepare killed at each step, the runner retries: the
    //    environment goes back to suspended in between, the retry resumes it.
    for point in [
        "resume:claiming",
        "resume:claimed",
        "resume:started",
        "resume:activated",
        "resume:ready",
    ] {
        arm(rig, None, false);
        let key = rig.run(&keeper()).key.unwrap();
        arm(rig, Some(point), true);
        let r = rig.run(
            &job(5)
                .resume(&key)
                .suspend_on(true, false)
                .script("test \"$(cat kept.txt)\" = precious || exit 9"),
        );
        assert_result(&r, JobResult::Success);
        assert_eq!(r.prepare_attempts, 2, "{point}: killed once, retried once");
        assert_killed_at(rig, &r.calls, point, 1);
        assert_eq!(rig.status(&key).as_deref(), Some("suspended"), "{point}");
        assert_settled(rig, machines, point);
        resume_and_release(rig, &key, point);
        assert_settled(rig, machines, point);
    }

    // 3. A resume killed at its last step on every attempt (the runner gives
    //    up after three): the environment is never released, a later job
    //    resumes it.
    arm(rig, None, false);
    let key = rig.run(&keeper()).key.unwrap();
    arm(rig, Some("resume:ready"), false);
    let r = rig.run(&job(5).resume(&key));
    assert_eq!(r.prepare_attempts, 3, "{}", r.log());
    assert_killed_at(rig, &r.calls, "resume:ready", 3);
    assert_eq!(rig.status(&key).as_deref(), Some("suspended"));
    assert_settled(rig, machines, "resume killed three times");
    resume_and_release(rig, &key, "resume killed three times");

    // 4. run killed at its first stage: a system failure; the job's
    //    environment is released (no failure trigger), nothing left.
    arm(rig, Some("run:first-stage"), false);
    let r = rig.run(&job(5).suspend_on(true, false));
    assert_ne!(r.result, JobResult::Success);
    // Armed for every call: the first stage, and `cleanup_file_variables`,
    // which the runner still calls after it.
    assert_killed_at(rig, &r.calls, "run:first-stage", 2);
    let key = r.key.clone().unwrap();
    assert!(
        rig.status(&key).is_none(),
        "released: {}",
        r.cleanup_output()
    );
    assert_settled(rig, machines, "run killed");

    // 5. A suspending cleanup killed at each step, then `dormant sweep`
    //    (the runner never retries cleanup): settled as the rules say —
    //    a stop in progress finishes (suspended); a new job's environment with
    //    no failure trigger whose cleanup had not begun its stop is released.
    for (point, want) in [
        ("cleanup:decided", None),
        ("suspend:intent", Some("suspended")),
        ("suspend:stopped", Some("suspended")),
        ("cleanup:settled", Some("suspended")),
    ] {
        arm(rig, Some(point), true);
        let r = rig.run(&keeper());
        assert_killed_at(rig, &r.calls, point, 1);
        let key = r.key.clone().unwrap();
        arm(rig, None, false);
        let text = sweep(rig);
        assert_eq!(rig.status(&key).as_deref(), want, "{point}: {text}");
        assert_settled(rig, machines, point);
        if want.is_some() {
            resume_and_release(rig, &key, point);
        }
        assert_settled(rig, machines, point);
    }

    // 6. A releasing cleanup killed at each step, then a sweep: released.
    for point in ["cleanup:decided", "release:intent", "release:deleted"] {
        arm(rig, Some(point), true);
        let r = rig.run(&job(5));
        assert_killed_at(rig, &r.calls, point, 1);
        let key = r.key.clone().unwrap();
        arm(rig, None, false);
        let text = sweep(rig);
        assert!(rig.status(&key).is_none(), "{point}: {text}");
        assert_settled(rig, machines, point);
    }

    // 7. A resumed job's cleanup killed before it settled; a later resume of
    //    the same key (past the grace) recovers the environment (back to
    //    suspended) and resumes it. (Refusal within the grace: lifecycle.rs.)
    arm(rig, None, false);
    let key = rig.run(&keeper()).key.unwrap();
    arm(rig, Some("cleanup:decided"), true);
    let r = rig.run(&job(5).resume(&key).suspend_on(true, false));
    assert_killed_at(rig, &r.calls, "cleanup:decided", 1);
    assert_eq!(
        rig.status(&key).as_deref(),
        Some("active"),
        "cleanup was killed"
    );
    std::thread::sleep(PAST_GRACE);
    resume_and_release(rig, &key, "later resume recovers");
    assert_settled(rig, machines, "later resume recovers");

    // 8. An operator's release killed half-way; a sweep finishes it.
    arm(rig, None, false);
    let key = rig.run(&keeper()).key.unwrap();
    arm(rig, Some("release:intent"), true);
    let out = rig.dormant(&["release", &key]);
    assert_killed_at(rig, &[operator_call("release", &out)], "release:intent", 1);
    assert_eq!(rig.status(&key).as_deref(), Some("releasing"));
    arm(rig, None, false);
    let text = sweep(rig);
    assert!(rig.status(&key).is_none(), "{text}");
    let statuses = assert_settled(rig, machines, "operator release");
    assert!(statuses.is_empty(), "{statuses:?}");
    assert!(machines.alive().is_empty(), "{:?}", machines.alive());
}

#[test]
fn every_crash_point_on_local() {
    let mut rig = Rig::new("31", "s_0123456789ab", GRACE);
    every_crash_point(&mut rig, &NoMachines);
}

#[test]
fn every_crash_point_on_ssh() {
    let sshd = crate::sshd::Sshd::start();
    let ws_root = sshd.dir.path().join("ws");
    let mut rig = Rig::new(
        "32",
        "s_55aa55aa55aa",
        &format!(
            "provider = \"ssh\"\n[ssh]\nworkspace_root = \"{}\"\nready_timeout = \"20s\"\n\
             [[ssh.hosts]]\nname = \"test-host\"\naddress = \"127.0.0.1\"\nport = {}\nuser = \"root\"\n\
             identity_file = \"{}\"\nslots = 8\n{GRACE}",
            ws_root.display(),
            sshd.port,
            sshd.client_key.display()
        ),
    );
    every_crash_point(&mut rig, &Workspaces(ws_root));
}

/// Instances in the emulator that are not terminated.
#[cfg(feature = "ec2")]
pub struct Instances(pub String);

#[cfg(feature = "ec2")]
impl Machines for Instances {
    fn alive(&self) -> Vec<String> {
        use aws_sdk_ec2::types::InstanceStateName;
        let url = self.0.clone();
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(async move {
                let c = crate::moto::direct_client(&url);
                let out = c.describe_instances().send().await.unwrap();
                out.reservations()
                    .iter()
                    .flat_map(|r| r.instances())
                    .filter(|i| {
                        !matches!(
                            i.state().and_then(|s| s.name()),
                            Some(InstanceStateName::Terminated | InstanceStateName::ShuttingDown)
                        )
                    })
                    .filter_map(|i| i.instance_id().map(str::to_string))
                    .collect()
            })
    }
}

#[cfg(feature = "ec2")]
#[test]
fn every_crash_point_on_ec2() {
    let env = crate::ec2_rig::Ec2Env::start();
    let mut rig = env.rig(
        "33",
        "s_0123456789ab",
        &env.settings(&env.connect_address(), GRACE),
    );
    every_crash_point(&mut rig, &Instances(env.moto.url()));
}
