//! The hot window in volume mode (`storage = "volume"`, docs/pause.md, "The
//! hot window") on the `ec2` provider: moto behind the proxy, the loopback
//! sshd as every instance, the provider's guest seam as the data volume's
//! device. A job that ends paused leaves its instance running with the
//! volume attached (no DetachVolume, no TerminateInstances; a sweep within
//! the window leaves it so); a continue within the window takes that
//! instance (no launch, the same process answered). At the window's end the
//! waiter suspends it as volume mode does, over dormant's own connection
//! (the guest unmounts, then DetachVolume, then the instance is
//! terminated), and marks the paused script lost: the next continue fails
//! at once (125). Killed at each step of that end, the next sweep finishes
//! it: suspended once, the volume kept with the job's files, no instance
//! left running. A `dormant shell` and a retried prepare (killed after its
//! claim) take the hot instance too, as in machine mode (`ec2_hot_claims.rs`).

use crate::crash::{arm, GRACE, PAST_GRACE};
use crate::ec2_hot::{events, kill, wait_until, KillsScript};
use crate::ec2_rig::{data_volumes, instances, is_live, key_field, volume, Ec2Env};
use crate::harness::*;
use crate::pause::{asking, pid_in};

/// Volume mode with a hot window of `hot_for`, a claim grace of 1 s.
fn rig(env: &Ec2Env, runner: &str, hot_for: &str) -> Rig {
    env.volume_rig(
        runner,
        "s_0123456789ab",
        &env.volume_settings("", &format!("{GRACE}hot_for = \"{hot_for}\"\n")),
    )
}

/// The actions of the EC2 calls so far, in order.
fn actions(env: &Ec2Env) -> Vec<String> {
    env.proxy.calls().into_iter().map(|c| c.action).collect()
}

fn count(env: &Ec2Env, action: &str) -> usize {
    env.proxy.count(action)
}

/// The paused job: asks (its script on the volume), ends paused and hot.
fn paused_job(rig: &Rig, d: &std::path::Path, job_id: u64) -> String {
    let r = rig.run(&job(job_id).script(&format!(
        "echo kept > on-the-volume.txt; {}",
        asking(d, "Deploy?")
    )));
    assert_result(&r, JobResult::Success);
    r.key.clone().expect("the ask suspends the environment")
}

/// Suspended as volume mode keeps it: no machine, the volume detached and
/// `available` with the job's file, and no instance running.
#[track_caller]
fn assert_cold(env: &Ec2Env, rig: &Rig, key: &str, what: &str) {
    let rec = rig.record(key).unwrap();
    assert_eq!(rec["status"], "suspended", "{what}: {rec}");
    assert!(rec["hot_until"].is_null(), "{what}: {rec}");
    assert!(rec["machine"].is_null(), "{what}: {rec}");
    assert_eq!(rec["volume"]["step"], "detached", "{what}: {rec}");
    assert!(
        rec["paused"]["lost"]
            .as_str()
            .is_some_and(|l| l.contains("storage = \"volume\"")),
        "{what}: the paused script is marked lost: {rec}"
    );
    let vol = key_field(key, "volume").unwrap();
    let v = volume(env, &vol).unwrap_or_else(|| panic!("{what}: the volume was lost"));
    assert_eq!(v.state().map(|s| s.as_str()), Some("available"), "{what}");
    assert_eq!(data_volumes(env).len(), 1, "{what}");
    assert!(
        env.volume_files(&vol)
            .join("builds")
            .read_dir()
            .is_ok_and(|mut d| d.next().is_some()),
        "{what}: the job's files are on the volume"
    );
    assert!(
        instances(env).iter().all(|i| !is_live(i)),
        "{what}: no instance left running"
    );
    let suspended = events(rig, key)
        .into_iter()
        .filter(|e| e["event"] == "suspended" && e["cause"] != "paused")
        .count();
    assert_eq!(suspended, 1, "{what}: suspended exactly once");
}

#[test]
fn ec2_volume_mode_keeps_a_paused_script_hot_and_a_continue_takes_the_running_instance() {
    let env = Ec2Env::start();
    let rig = rig(&env, "91", "10m");
    let d = tempfile::tempdir().unwrap();
    let _script = KillsScript(d.path().join("pid"));
    let r = rig.run(&job(91).script(&asking(d.path(), "Deploy?")));
    assert_result(&r, JobResult::Success);
    let key = r.key.clone().expect("volume mode may pause now: a key");
    let log = r.log();
    assert!(
        log.contains("dormant-ask: the paused script is kept for 10m after this job")
            && log.contains("the script is lost: answer within 10m"),
        "dormant-ask says how long, and that the script is then lost:\n{log}"
    );
    let pid = pid_in(&d.path().join("pid"));
    let rec = rig.record(&key).unwrap();
    assert_eq!(rec["status"], "suspended", "{rec}");
    assert!(rec["hot_until"].is_u64(), "{rec}");
    assert!(rec["machine"].is_object(), "the instance is kept: {rec}");
    assert_eq!(rec["volume"]["step"], "attached", "{rec}");
    assert_eq!(instances(&env).iter().filter(|i| is_live(i)).count(), 1);
    for a in ["DetachVolume", "TerminateInstances"] {
        assert_eq!(count(&env, a), 0, "{a}: {:?}", actions(&env));
    }
    // A sweep within the window leaves the volume on its running instance
    // (it is not a suspension's leftovers).
    let out = rig.dormant(&["sweep"]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(count(&env, "DetachVolume"), 0, "{:?}", actions(&env));
    assert!(rig.record(&key).unwrap()["hot_until"].is_u64());

    let launches = count(&env, "RunInstances");
    let r2 = rig.run(&job(91).resume(&key).script("dormant-continue yes"));
    assert_result(&r2, JobResult::BuildFailure(Some(7)));
    let log2 = r2.log();
    assert!(
        log2.contains("is hot: taking its running machine"),
        "{log2}"
    );
    assert!(log2.contains("answer=[yes] v="), "{log2}");
    assert!(
        log2.contains(&format!("pid={pid}")),
        "the same process: {log2}"
    );
    assert_eq!(count(&env, "RunInstances"), launches, "no new instance");
    assert_eq!(count(&env, "AttachVolume"), 1, "attached once, by job 1");
    assert!(
        events(&rig, &key)
            .iter()
            .any(|e| e["event"] == "resumed" && e["cause"] == "hot" && e["hot"] == true),
        "a hot continue"
    );
    kill(pid);
}

#[test]
fn ec2_volume_modes_window_ends_with_the_volume_unmounted_and_the_script_marked_lost() {
    let env = Ec2Env::start();
    let rig = rig(&env, "92", "2s");
    let d = tempfile::tempdir().unwrap();
    let _script = KillsScript(d.path().join("pid"));
    let key = paused_job(&rig, d.path(), 92);
    let pid = pid_in(&d.path().join("pid"));
    let logins = env.sshd.connections();
    wait_until("the window's end", || {
        rig.record(&key)
            .is_some_and(|r| r["status"] == "suspended" && r["hot_until"].is_null())
    });
    assert_cold(&env, &rig, &key, "the waiter");
    assert_eq!(
        env.sshd.connections(),
        logins,
        "the waiter's unmount went over the paused job's SSH master: no new login"
    );
    // Over dormant's own connection: the guest unmounted the volume, so it
    // was detached from the running instance before its termination (the
    // way without a guest terminates first and sends no DetachVolume).
    let a = actions(&env);
    let detach = a.iter().position(|a| a == "DetachVolume");
    let terminate = a.iter().position(|a| a == "TerminateInstances");
    assert!(
        detach.is_some() && detach < terminate,
        "DetachVolume, then TerminateInstances: {a:?}"
    );
    let cool_log = std::fs::read_to_string(rig.env_dir(&key).join("cool.log")).unwrap();
    assert!(cool_log.contains("unmounted"), "{cool_log}");
    assert!(
        events(&rig, &key).iter().any(|e| e["event"] == "suspended"
            && e["cause"] == "cooled"
            && e["reason"]
                .as_str()
                .is_some_and(|r| r.contains("the paused script is gone"))),
        "the cooled event says the script is gone"
    );
    // The next continue fails at once, saying so; the job runs on a new
    // instance with the volume's files.
    let r2 = rig.run(
        &job(92)
            .resume(&key)
            .script("cat on-the-volume.txt; dormant-continue yes || echo \"rc=$?\""),
    );
    assert_result(&r2, JobResult::Success);
    let log2 = r2.log();
    assert!(
        log2.contains("the script paused there is gone") && log2.contains("rc=125\n"),
        "{log2}"
    );
    assert!(log2.contains("kept\n"), "the volume's file: {log2}");
    kill(pid);
}

/// kill -9 at each step of a volume-mode window's end: the paused job's
/// cleanup between its intent and the hot record (`hot:intent`), the
/// waiter's claim, the suspension's intent, each volume step (detach,
/// delete the machine) and after them (`suspend:stopped`). Each leaves the
/// record `suspending` under a dead holder; the next sweep finishes it:
/// suspended once, the paused script marked lost, the volume kept with the
/// job's files, no instance left running.
#[test]
fn ec2_volume_modes_window_end_killed_at_each_step_is_finished_by_the_next_sweep() {
    for point in [
        "hot:intent",
        "hot:claimed",
        "suspend:intent",
        "volume:detach-intent",
        "volume:detached",
        "volume:delete-machine-intent",
        "volume:machine-deleted",
        "suspend:stopped",
    ] {
        let env = Ec2Env::start();
        let mut rig = rig(&env, "93", "2s");
        let d = tempfile::tempdir().unwrap();
        let _script = KillsScript(d.path().join("pid"));
        arm(&mut rig, Some(point), false);
        let r = rig.run(&job(93).script(&format!(
            "echo kept > on-the-volume.txt; {}",
            asking(d.path(), "Now?")
        )));
        let key = r.key.clone().expect("a key");
        let said = format!("dormant: failpoint {point}: SIGKILL");
        if point == "hot:intent" {
            let out: String = r.calls.iter().map(|c| c.output.as_str()).collect();
            assert!(r.log().contains(&said) || out.contains(&said), "{point}");
        } else {
            let cool_log = rig.env_dir(&key).join("cool.log");
            wait_until(point, || {
                std::fs::read_to_string(&cool_log).is_ok_and(|t| t.contains(&said))
            });
        }
        arm(&mut rig, None, false);
        assert_eq!(rig.status(&key).as_deref(), Some("suspending"), "{point}");
        std::thread::sleep(PAST_GRACE);
        let out = rig.dormant(&["sweep"]);
        assert!(out.status.success(), "{point}: {out:?}");
        assert_cold(&env, &rig, &key, point);
        // A second look finds nothing to do.
        let calls = env.proxy.calls().len();
        std::thread::sleep(PAST_GRACE);
        assert!(rig.dormant(&["sweep"]).status.success());
        let again: Vec<String> = env.proxy.calls()[calls..]
            .iter()
            .map(|c| c.action.clone())
            .filter(|a| !a.starts_with("Describe"))
            .collect();
        assert!(again.is_empty(), "{point}: {again:?}");
        kill(pid_in(&d.path().join("pid")));
    }
}

/// The other two claims of a hot volume-mode environment: `dormant shell`
/// takes the running instance (no launch, no detach) and leaves it hot; a
/// continue whose prepare is killed right after its claim is put back hot
/// by the runner's cleanup, and the retry takes the same instance.
#[test]
fn ec2_volume_mode_a_shell_and_a_retried_prepare_take_the_hot_instance() {
    let env = Ec2Env::start();
    let mut rig = rig(&env, "96", "10m");
    let d = tempfile::tempdir().unwrap();
    let _script = KillsScript(d.path().join("pid"));
    let key = paused_job(&rig, d.path(), 96);
    let pid = pid_in(&d.path().join("pid"));
    let until = rig.record(&key).unwrap()["hot_until"].as_u64().unwrap();

    let out = rig.dormant(&["shell", &key, "--", "cat on-the-volume.txt"]);
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.status.code(), Some(0), "{said}");
    assert!(
        said.contains("kept") && said.contains("is hot again"),
        "{said}"
    );
    let rec = rig.record(&key).unwrap();
    assert_eq!(rec["hot_until"].as_u64(), Some(until), "{rec}");
    assert_eq!(rec["volume"]["step"], "attached", "{rec}");
    for a in ["DetachVolume", "TerminateInstances", "StartInstances"] {
        assert_eq!(count(&env, a), 0, "{a}: {:?}", actions(&env));
    }
    assert_eq!(count(&env, "RunInstances"), 1, "{:?}", actions(&env));

    arm(&mut rig, Some("resume:claimed"), true);
    let r2 = rig.run(&job(96).resume(&key).script("dormant-continue yes"));
    arm(&mut rig, None, false);
    assert_eq!(r2.prepare_attempts, 2, "killed once, retried once");
    assert_result(&r2, JobResult::BuildFailure(Some(7)));
    let log2 = r2.log();
    assert!(log2.contains("answer=[yes] v="), "{log2}");
    assert!(
        log2.contains(&format!("pid={pid}")),
        "the same process: {log2}"
    );
    assert_eq!(count(&env, "RunInstances"), 1, "{:?}", actions(&env));
    kill(pid);
}
