//! kill -9 during an EC2 warm instance's refill and during its hand-over
//! (moto behind the proxy, the loopback sshd): a refill killed after
//! RunInstances answered leaves an entry the next refill retires, and its
//! instance is terminated, not leaked; a prepare killed at each step of a
//! hand-over is retried by the runner and the job runs: killed before the
//! first tag write, the retry finishes the same hand-over; killed after it,
//! the instance already names the environment, so the runner's cleanup of
//! the killed attempt terminates it with the half-made environment and the
//! retry launches as usual. The instance is never handed to a second job,
//! none is leaked, and none is left carrying both `dormant:warm` and
//! `dormant:env`.
//!
//! The same for a new volume-mode environment, which takes the warm
//! instance before its data volume is made (in the instance's zone): a
//! prepare killed at each step from the take to the attach is retried by the
//! runner and the job runs; the instance is used by that job or terminated
//! by the cleanup of the killed attempt, never returned to the pool or
//! handed out twice, and no data volume outlives its environment.
//!
//! Network rule: the instance addresses moto hands out are never contacted.

use crate::crash::{arm, assert_killed_at};
use crate::ec2_rig::{data_volumes, instances, is_live, key_field, Ec2Env};
use crate::harness::{self, assert_result, JobReport, JobResult, Rig};

use crate::ec2_warm::{tag, warm_now};

const SYSTEM: &str = "s_0123456789ab";

fn live_warm(env: &Ec2Env) -> Vec<String> {
    instances(env)
        .into_iter()
        .filter(|i| is_live(i) && tag(i, "dormant:warm").is_some())
        .filter_map(|i| i.instance_id().map(str::to_string))
        .collect()
}

#[test]
fn a_kill_during_an_ec2_refill_or_hand_over_leaks_nothing_and_hands_out_nothing_twice() {
    let env = Ec2Env::start();
    let mut rig = env.rig(
        "7",
        SYSTEM,
        &env.settings(&format!("{}warm = 1\n", env.connect_address()), ""),
    );

    // 1. A refill killed right after its instance was launched.
    arm(&mut rig, Some("warm:launched"), false);
    let out = rig.dormant(&["warm"]);
    let err = String::from_utf8_lossy(&out.stderr);
    {
        use std::os::unix::process::ExitStatusExt;
        assert!(
            err.contains("dormant: failpoint warm:launched: SIGKILL")
                && out.status.signal() == Some(9),
            "{:?}\n{err}",
            out.status
        );
    }
    let killed = live_warm(&env);
    assert_eq!(killed.len(), 1, "{err}");
    arm(&mut rig, None, false);
    let t = warm_now(&rig);
    assert!(t.contains("its launch was killed"), "{t}");
    let mut warm = live_warm(&env);
    assert_eq!(warm.len(), 1, "{t}");
    assert_ne!(
        warm[0], killed[0],
        "the killed launch's instance is not kept"
    );

    // 2-4. A prepare killed at each step of the hand-over; the runner retries.
    let mut taken: Vec<String> = Vec::new();
    for (n, point) in ["warm:taken", "warm:ec2-tagged", "warm:handed-over"]
        .into_iter()
        .enumerate()
    {
        let instance = warm.remove(0);
        arm(&mut rig, Some(point), true);
        let r = rig
            .runner
            .run_job(&harness::job(60 + n as u64).script("echo on-warm"))
            .unwrap();
        assert_killed_at(&rig, &r.calls, point, 1);
        assert_result(&r, JobResult::Success);
        arm(&mut rig, None, false);
        let key = r.key.clone().expect("a key");
        let got = key_field(&key, "instance").unwrap_or_default();
        after_kill(&env, &r, point, &instance, &got, &mut taken);
        let t = warm_now(&rig);
        warm = live_warm(&env);
        assert_eq!(warm.len(), 1, "{point}: refilled: {t}");
        assert!(
            !taken.contains(&warm[0]),
            "{point}: a taken one back in the pool"
        );
        let both: Vec<_> = instances(&env)
            .into_iter()
            .filter(|i| {
                is_live(i) && tag(i, "dormant:warm").is_some() && tag(i, "dormant:env").is_some()
            })
            .collect();
        assert!(both.is_empty(), "{point}: half handed over: {both:?}");
    }

    // Nothing left once warm = 0 and a sweep ran.
    Rig::write_settings(
        &rig.settings_path,
        SYSTEM,
        &env.settings(&format!("{}warm = 0\n", env.connect_address()), ""),
    );
    let out = rig.dormant(&["sweep"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        instances(&env).iter().all(|i| !is_live(i)),
        "no instance left"
    );
}

/// Data volumes moto still has (not deleted).
fn live_volumes(env: &Ec2Env) -> Vec<String> {
    data_volumes(env)
        .into_iter()
        .filter(|v| v.state().map(|s| s.as_str()) != Some("deleted"))
        .filter_map(|v| v.volume_id().map(str::to_string))
        .collect()
}

#[test]
fn a_kill_while_a_new_volume_mode_environment_takes_a_warm_instance_leaks_nothing() {
    let env = Ec2Env::start();
    let lines = |warm: u32| format!("warm = {warm}\n");
    let mut rig = env.volume_rig("7", SYSTEM, &env.volume_settings(&lines(1), ""));
    warm_now(&rig);
    let mut warm = live_warm(&env);
    assert_eq!(warm.len(), 1);

    let mut taken: Vec<String> = Vec::new();
    for (n, point) in [
        "warm:taken",
        "warm:ec2-tagged",
        "warm:handed-over",
        "prepare:warm-taken",
        "volume:create-intent",
        "volume:created",
        "volume:attach-intent",
        "prepare:recorded",
        "volume:attached",
    ]
    .into_iter()
    .enumerate()
    {
        let instance = warm.remove(0);
        arm(&mut rig, Some(point), true);
        let mut ran_on = None;
        let r = rig
            .runner
            .run_job_with(
                &harness::job(80 + n as u64).script("echo on-warm > f; cat f"),
                &mut |_| {
                    if ran_on.is_none() {
                        ran_on = data_volumes(&env).into_iter().find_map(|v| {
                            v.attachments()
                                .first()
                                .and_then(|a| a.instance_id().map(str::to_string))
                        });
                    }
                },
            )
            .unwrap();
        assert_killed_at(&rig, &r.calls, point, 1);
        assert_result(&r, JobResult::Success);
        arm(&mut rig, None, false);
        let got = ran_on.unwrap_or_default();
        let cleanups = after_kill(&env, &r, point, &instance, &got, &mut taken);
        // Its volume is gone too.
        let vols = live_volumes(&env);
        assert!(
            vols.is_empty(),
            "{point}: volumes left {vols:?}\n{cleanups}"
        );
        let t = warm_now(&rig);
        warm = live_warm(&env);
        assert_eq!(warm.len(), 1, "{point}: refilled: {t}");
        assert!(
            !taken.contains(&warm[0]),
            "{point}: a taken one back in the pool"
        );
        let live: Vec<String> = instances(&env)
            .into_iter()
            .filter(is_live)
            .filter_map(|i| i.instance_id().map(str::to_string))
            .collect();
        assert_eq!(live, warm, "{point}: only the pool's instance runs");
    }

    // Nothing left once warm = 0 and a sweep ran.
    Rig::write_settings(
        &rig.settings_path,
        SYSTEM,
        &env.volume_settings(&lines(0), ""),
    );
    let out = rig.dormant(&["sweep"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        instances(&env).iter().all(|i| !is_live(i)),
        "no instance left"
    );
    assert!(live_volumes(&env).is_empty(), "no volume left");
}

/// What a prepare killed at `point` while taking warm instance `instance`
/// leaves once the runner's retry ran the job on `got`: at `warm:taken`
/// (not yet the environment's) the retry finished the same hand-over; at
/// any later point the instance already named the environment, so the
/// runner's cleanup of the killed attempt terminated it with the half-made
/// environment, and the retry ran elsewhere. Never handed out twice
/// (`taken` gains it); released at the job's end. Returns the cleanups' output.
fn after_kill(
    env: &Ec2Env,
    r: &JobReport,
    point: &str,
    instance: &str,
    got: &str,
    taken: &mut Vec<String>,
) -> String {
    let cleanups: String = r
        .calls
        .iter()
        .filter(|c| c.name.starts_with("cleanup"))
        .map(|c| format!("{}:\n{}", c.name, c.output))
        .collect();
    if point == "warm:taken" {
        assert_eq!(got, instance, "{point}: the same hand-over\n{}", r.log());
    } else {
        assert!(
            cleanups.contains(&format!("terminating instance {instance}")),
            "{point}: released with the half-made environment\n{cleanups}"
        );
        assert!(
            got != instance && !taken.iter().any(|t| t == got) && !got.is_empty(),
            "{point}: ran on {got:?}\n{}",
            r.log()
        );
    }
    assert!(
        !taken.iter().any(|t| t == instance),
        "{point}: handed out twice"
    );
    taken.push(instance.to_string());
    assert!(
        instances(env)
            .iter()
            .filter(|i| i.instance_id() == Some(instance))
            .all(|i| !is_live(i)),
        "{point}: released"
    );
    cleanups
}

/// Machine mode: a prepare killed after it took a warm instance and finished
/// the hand-over (its pool entry gone) but before the environment recorded
/// the instance, whose cleanup was killed too, is retried by the runner with
/// another warm instance ready. The retry adopts the instance the killed
/// attempt took (found by its `dormant:env` tag) and takes no second one: a
/// second would be recorded instead, and the first, tagged as the
/// environment's, would never be terminated (no release knows it, and
/// `sweep` takes it for the environment's).
#[test]
fn a_retried_prepare_whose_killed_attempt_took_a_warm_instance_takes_no_second_one() {
    let env = Ec2Env::start();
    let mut rig = env.rig(
        "7",
        SYSTEM,
        &env.settings(&format!("{}warm = 2\n", env.connect_address()), ""),
    );
    warm_now(&rig);
    let before = live_warm(&env);
    assert_eq!(before.len(), 2);

    let points = ["prepare:created", "cleanup:decided"];
    arm(&mut rig, Some(&points.join(",")), true);
    let r = rig
        .runner
        .run_job(&harness::job(90).script("echo on-warm"))
        .unwrap();
    // Each process died where it was meant to, once (failpoint.rs: the
    // second listed point's once-marker is `<file>.2`).
    for (n, point) in points.iter().enumerate() {
        let said = format!("dormant: failpoint {point}: SIGKILL");
        let killed: Vec<_> = r
            .calls
            .iter()
            .filter(|c| c.output.contains(&said))
            .collect();
        assert_eq!(killed.len(), 1, "{point}: killed once\n{}", r.log());
        assert_eq!(killed[0].exit_code, 128 + libc::SIGKILL, "{point}");
        let marker = rig.runner.env["DORMANT_FAILPOINT_ONCE"].clone();
        let marker = if n == 0 {
            marker
        } else {
            format!("{marker}.{}", n + 1)
        };
        assert!(std::path::Path::new(&marker).exists(), "{point}: {marker}");
    }
    assert!(
        r.calls[1].name.starts_with("prepare") && r.calls[2].name.starts_with("cleanup"),
        "the first prepare, then its cleanup, were killed: {:?}",
        r.calls.iter().map(|c| &c.name).collect::<Vec<_>>()
    );
    assert_result(&r, JobResult::Success);
    arm(&mut rig, None, false);
    let got = key_field(&r.key.clone().expect("a key"), "instance").unwrap_or_default();
    assert!(
        before.contains(&got),
        "ran on {got:?}, not a warm instance\n{}",
        r.log()
    );
    assert!(
        r.log().contains("no warm machine taken"),
        "the retry adopted the first\n{}",
        r.log()
    );
    let other = before.iter().find(|i| **i != got).unwrap();
    warm_now(&rig);
    assert!(
        live_warm(&env).contains(other),
        "the other warm instance stays in the pool (not taken by the retry)"
    );
    // Released at the job's end; nothing carries the environment's tag.
    let leaked: Vec<_> = instances(&env)
        .into_iter()
        .filter(|i| is_live(i) && tag(i, "dormant:env").is_some())
        .filter_map(|i| i.instance_id().map(str::to_string))
        .collect();
    assert!(leaked.is_empty(), "leaked {leaked:?}\n{}", r.log());

    Rig::write_settings(
        &rig.settings_path,
        SYSTEM,
        &env.settings(&format!("{}warm = 0\n", env.connect_address()), ""),
    );
    let out = rig.dormant(&["sweep"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        instances(&env).iter().all(|i| !is_live(i)),
        "no instance left"
    );
}
