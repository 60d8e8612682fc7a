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
//! `dormant:env`. A refill killed before its launch or after `ready`, and a
//! retire killed before or after its terminate, leave an entry the next
//! refill finishes; meanwhile no job gets a retiring instance.
//!
//! The same for a new volume-mode environment, which takes the warm
//! instance before its data volume is made (in the instance's zone): a
//! prepare killed at each step from the take to the attach is retried by the
//! runner and the job runs; the instance is used by that job or terminated
//! by the cleanup of the killed attempt, never returned to the pool or
//! handed out twice, and no data volume outlives its environment.
//!
//! Network rule: the instance addresses moto hands out are never contacted.

use crate::crash::{arm, assert_killed_at, operator_call};
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
    killed_at(&mut rig, "warm:launched", &["warm"]);
    let killed = live_warm(&env);
    assert_eq!(killed.len(), 1);
    let t = warm_now(&rig);
    assert!(t.contains("its launch was killed"), "{t}");
    let mut warm = live_warm(&env);
    assert_eq!(warm.len(), 1, "{t}");
    assert_ne!(
        warm[0], killed[0],
        "the killed launch's instance is not kept"
    );

    // 2-5. A prepare killed at each step of the hand-over; the runner retries.
    let mut taken: Vec<String> = Vec::new();
    for (n, point) in [
        "warm:taken",
        "warm:identity-given",
        "warm:ec2-tagged",
        "warm:handed-over",
    ]
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

/// Runs `dormant <args>` as an operator would with failpoint `point` armed,
/// and proves it died there; disarms it.
fn killed_at(rig: &mut Rig, point: &str, args: &[&str]) {
    arm(rig, Some(point), false);
    let out = rig.dormant(args);
    let call = operator_call(&format!("dormant {}", args.join(" ")), &out);
    assert_killed_at(rig, &[call], point, 1);
    arm(rig, None, false);
}

/// The statuses of the pool's entries.
fn statuses(rig: &Rig) -> Vec<String> {
    rig.warm_pool().into_iter().map(|(_, s)| s).collect()
}

/// kill -9 at the refill's other steps and in the retire path, each followed
/// by what an operator's timer or the next job runs next:
/// - `warm:launching` (the entry written, no RunInstances yet): the next
///   refill retires the entry (nothing to terminate) and boots one;
/// - `warm:ready` (`ready` written, its event not): the next refill boots
///   nothing, and a job takes that very instance;
/// - `warm:retiring` and `warm:retired` (a sweep under `warm = 0` killed
///   before and after its TerminateInstances): a job meanwhile (`warm = 1`
///   again) does not get that instance, and the refill its prepare starts
///   finishes the retire (the instance terminated, the entry gone) and boots
///   a new one.
///
/// At the end `warm = 0` and a sweep leave no instance and no entry.
#[test]
fn a_refill_or_a_retire_killed_at_any_other_step_is_finished_by_the_next_run() {
    let env = Ec2Env::start();
    let settings =
        |warm: u32| env.settings(&format!("{}warm = {warm}\n", env.connect_address()), "");
    let mut rig = env.rig("7", SYSTEM, &settings(1));

    // warm:launching: no instance yet, an entry `launching`.
    env.proxy.clear_calls();
    killed_at(&mut rig, "warm:launching", &["warm"]);
    assert_eq!(env.proxy.count("RunInstances"), 0);
    let p = rig.warm_pool();
    assert_eq!(statuses(&rig), ["launching"], "{p:?}");
    let launching = p[0].0.clone();

    // The next refill retires it and boots one, and is killed at warm:ready.
    killed_at(&mut rig, "warm:ready", &["warm"]);
    assert_eq!(
        env.proxy.count("RunInstances"),
        1,
        "{:?}",
        env.proxy.actions()
    );
    let p = rig.warm_pool();
    assert_eq!(statuses(&rig), ["ready"], "{p:?}");
    assert_ne!(p[0].0, launching, "the killed launch's entry is gone");
    let ready = p[0].0.clone();
    let warm = live_warm(&env);
    assert_eq!(warm.len(), 1);

    // warm:ready: the next refill boots nothing; a job takes that instance.
    let t = warm_now(&rig);
    assert_eq!(env.proxy.count("RunInstances"), 1, "{t}");
    let r = rig.run(&harness::job(70).script("echo on-warm"));
    assert_result(&r, JobResult::Success);
    assert!(
        r.log().contains(&format!("took warm machine {ready}")),
        "{}",
        r.log()
    );
    let key = r.key.clone().expect("a key");
    assert_eq!(
        key_field(&key, "instance").as_deref(),
        Some(warm[0].as_str())
    );
    warm_now(&rig);

    // warm:retiring and warm:retired: a sweep under warm = 0 killed there.
    for (n, point) in ["warm:retiring", "warm:retired"].into_iter().enumerate() {
        let p = rig.warm_pool();
        let warm = live_warm(&env);
        assert!(p.len() == 1 && warm.len() == 1, "{point}: {p:?} {warm:?}");
        let (entry, instance) = (p[0].0.clone(), warm[0].clone());
        Rig::write_settings(&rig.settings_path, SYSTEM, &settings(0));
        killed_at(&mut rig, point, &["sweep"]);
        assert_eq!(statuses(&rig), ["retiring"], "{point}");
        assert_eq!(
            live_warm(&env).len(),
            usize::from(point == "warm:retiring"),
            "{point}: terminated only after warm:retiring"
        );

        // A job meanwhile does not get it; its prepare's refill finishes the retire.
        Rig::write_settings(&rig.settings_path, SYSTEM, &settings(1));
        let r = rig.run(&harness::job(71 + n as u64).script("echo cold"));
        assert_result(&r, JobResult::Success);
        assert!(
            !r.log().contains("took warm machine"),
            "{point}: {}",
            r.log()
        );
        let got = key_field(&r.key.clone().expect("a key"), "instance").unwrap_or_default();
        assert!(!got.is_empty() && got != instance, "{point}: ran on {got}");
        let t = warm_now(&rig);
        let p = rig.warm_pool();
        assert!(
            p.len() == 1 && p[0].0 != entry && p[0].1 == "ready",
            "{point}: the entry finished and a new one booted: {p:?}\n{t}"
        );
        assert!(
            instances(&env)
                .iter()
                .filter(|i| i.instance_id() == Some(instance.as_str()))
                .all(|i| !is_live(i)),
            "{point}: {instance} terminated"
        );
    }

    // Nothing left once warm = 0 and a sweep ran.
    Rig::write_settings(&rig.settings_path, SYSTEM, &settings(0));
    let out = rig.dormant(&["sweep"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(rig.warm_pool().is_empty());
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
/// leaves once the runner's retry ran the job on `got`: at `warm:taken` and
/// `warm:identity-given` (not yet the environment's: no tag written) the
/// retry finished the same hand-over; at
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
    if matches!(point, "warm:taken" | "warm:identity-given") {
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
