//! Two claims of a hot environment (docs/pause.md, "The hot window") other
//! than a plain continue, on the `ec2` provider (moto, the loopback sshd as
//! the instance), in `stop` mode, where a stop would end the paused script:
//! `dormant shell KEY` on a hot environment takes the running instance (no
//! StartInstances) and leaves it hot until the same time (no StopInstances),
//! and a continue afterwards answers the paused script; and a prepare killed
//! right after its hot claim (`resume:claimed`) is cleaned up by the runner
//! back to hot, without a stop, so its retried prepare takes the running
//! instance and the paused script answers — unless the instance was
//! stopped meanwhile: then it is put back to suspended and the retry
//! starts it.

use crate::crash::{arm, GRACE};
use crate::ec2_hot::{events, kill, starts, stops, KillsScript};
use crate::ec2_rig::Ec2Env;
use crate::harness::*;
use crate::pause::{asking, pid_in};

/// `stop` mode with a 10 min window: a pause is kept for the window only.
fn stop_mode(env: &Ec2Env) -> String {
    env.settings(
        &env.connect_address(),
        &format!("{GRACE}hot_for = \"10m\"\n"),
    )
}

#[test]
fn ec2_a_shell_on_a_hot_environment_leaves_it_hot_and_the_paused_script_answers() {
    let env = Ec2Env::start();
    let rig = env.rig("94", "s_94aa94aa94aa", &stop_mode(&env));
    let d = tempfile::tempdir().unwrap();
    let _script = KillsScript(d.path().join("pid"));
    let r = rig.run(&job(94).script(&asking(d.path(), "Look first?")));
    assert_result(&r, JobResult::Success);
    let key = r.key.clone().unwrap();
    let pid = pid_in(&d.path().join("pid"));
    let until = rig.record(&key).unwrap()["hot_until"].as_u64().unwrap();

    let out = rig.dormant(&["shell", &key, "--", "echo in-the-shell; exit 3"]);
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.status.code(), Some(3), "{said}");
    assert!(said.contains("in-the-shell"), "{said}");
    assert!(said.contains("is hot again"), "{said}");
    let rec = rig.record(&key).unwrap();
    assert_eq!(rec["status"], "suspended", "{rec}");
    assert_eq!(
        rec["hot_until"].as_u64(),
        Some(until),
        "the same window: {rec}"
    );
    assert!(rec["paused"]["lost"].is_null(), "{rec}");
    assert_eq!(starts(&env), 0, "the running instance was not started");
    assert!(stops(&env).is_empty(), "nor stopped: {:?}", stops(&env));

    // The paused script still waits: a continue answers it, hot.
    let r2 = rig.run(&job(94).resume(&key).script("dormant-continue yes"));
    assert_result(&r2, JobResult::BuildFailure(Some(7)));
    let log2 = r2.log();
    assert!(
        log2.contains("is hot: taking its running machine"),
        "{log2}"
    );
    assert!(log2.contains("answer=[yes] v="), "{log2}");
    assert!(log2.contains(&format!("pid={pid}")), "{log2}");
    assert_eq!(starts(&env), 0);
    kill(pid);
}

#[test]
fn ec2_a_prepare_killed_after_its_hot_claim_is_retried_on_the_running_instance() {
    let env = Ec2Env::start();
    let mut rig = env.rig("95", "s_95aa95aa95aa", &stop_mode(&env));
    let d = tempfile::tempdir().unwrap();
    let _script = KillsScript(d.path().join("pid"));
    let r = rig.run(&job(95).script(&asking(d.path(), "Retry?")));
    assert_result(&r, JobResult::Success);
    let key = r.key.clone().unwrap();
    let pid = pid_in(&d.path().join("pid"));

    arm(&mut rig, Some("resume:claimed"), true);
    let r2 = rig.run(&job(95).resume(&key).script("dormant-continue yes"));
    arm(&mut rig, None, false);
    assert_eq!(r2.prepare_attempts, 2, "killed once, retried once");
    assert_result(&r2, JobResult::BuildFailure(Some(7)));
    let log2 = r2.log();
    assert!(log2.contains("answer=[yes] v="), "{log2}");
    assert!(
        log2.contains(&format!("pid={pid}")),
        "the same process: {log2}"
    );
    assert!(
        log2.contains("is hot: taking its running machine"),
        "{log2}"
    );
    assert_eq!(starts(&env), 0, "nothing started");
    assert!(
        stops(&env).is_empty(),
        "the runner's cleanup between the attempts stopped nothing: {:?}",
        stops(&env)
    );
    let ev = events(&rig, &key);
    assert!(
        ev.iter().any(|e| e["event"] == "suspended"
            && e["cause"] == "unused"
            && e["hot_until"].is_string()),
        "the failed attempt's cleanup put it back hot: {ev:?}"
    );
    kill(pid);
}

/// A hot instance stopped behind dormant's back (a spot interruption, a
/// person) is not kept hot by the cleanup of a prepare killed after its
/// claim: the environment goes back to suspended as any resume, and the
/// retry starts the instance. (On EC2 the paused script is gone with the
/// stop; the emulator stops nothing on the loopback host.)
#[test]
fn ec2_a_hot_instance_stopped_meanwhile_is_not_kept_hot_after_a_killed_prepare() {
    let env = Ec2Env::start();
    let mut rig = env.rig("97", "s_97aa97aa97aa", &stop_mode(&env));
    let d = tempfile::tempdir().unwrap();
    let _script = KillsScript(d.path().join("pid"));
    let r = rig.run(&job(97).script(&asking(d.path(), "Still there?")));
    assert_result(&r, JobResult::Success);
    let key = r.key.clone().unwrap();
    let pid = pid_in(&d.path().join("pid"));
    let instance = rig.record(&key).unwrap()["machine"]["id"]
        .as_str()
        .unwrap()
        .to_string();
    crate::ec2_rig::block_on(async {
        let c = crate::moto::direct_client(&env.moto.url());
        c.stop_instances()
            .instance_ids(&instance)
            .send()
            .await
            .unwrap();
    });

    arm(&mut rig, Some("resume:claimed"), true);
    let r2 = rig.run(
        &job(97)
            .resume(&key)
            .script("dormant-continue yes || echo \"rc=$?\""),
    );
    arm(&mut rig, None, false);
    assert_eq!(r2.prepare_attempts, 2, "killed once, retried once");
    let ev = events(&rig, &key);
    assert!(
        !ev.iter().any(|e| e["event"] == "suspended"
            && e["cause"] == "unused"
            && e["hot_until"].is_string()),
        "not back hot: {ev:?}"
    );
    assert_eq!(starts(&env), 1, "the retry started the stopped instance");
    kill(pid);
}
