//! The test proxy's benchmark holds (`Proxy::hold_launches`,
//! `hold_transitions`, `hold_attaches`: new and started instances `pending`,
//! attached volumes `attaching`, for seconds after the call, as on EC2),
//! through the built binary: a new environment and a resume in each storage
//! mode still work when EC2 takes its time, and each hold was really seen
//! by dormant's polls (the proxy counts the describes that showed it). No
//! timing is asserted: `scripts/bench-ec2.sh` measures.
//!
//! Network rule: the instance addresses moto hands out are never contacted.

use std::time::{Duration, Instant};

use crate::ec2_rig::{key_field, Ec2Env};
use crate::harness::{self, assert_result, JobResult};
use crate::moto::{show_attaching, Call};

/// Short holds: long enough that dormant's first poll (right after the
/// call) lands inside them, short enough for the suite.
const PENDING: Duration = Duration::from_secs(3);
const ATTACHING: Duration = Duration::from_secs(1);

#[test]
fn a_volume_mode_resume_waits_through_a_held_launch_and_attach() {
    let env = Ec2Env::start();
    let rig = env.volume_rig("7", "s_0123456789ab", &env.volume_settings("", ""));
    let first = rig.run(
        &harness::job(5)
            .suspend_on(true, false)
            .script("echo 'kept on the volume' > kept.txt"),
    );
    assert_result(&first, JobResult::Success);
    let key = first.key.clone().expect("a key");
    let vol = key_field(&key, "volume").expect("the key names the volume");
    // Off by default: nothing was held so far.
    assert_eq!(env.proxy.shown_held("pending"), 0);
    assert_eq!(env.proxy.shown_held("attaching"), 0);

    env.proxy.hold_launches(PENDING);
    env.proxy.hold_attaches(ATTACHING);
    env.proxy.clear_calls();
    let mut first_stage = None;
    let r = rig
        .runner
        .run_job_with(
            &harness::job(5).resume(&key).script("cat kept.txt"),
            &mut |_| {
                first_stage.get_or_insert_with(Instant::now);
            },
        )
        .unwrap();
    assert_result(&r, JobResult::Success);
    let log = r.log();
    assert!(log.contains("kept on the volume"), "{log}");
    assert!(
        log.contains(&format!("data volume {vol} attached to instance")),
        "{log}"
    );
    // The holds were real, and dormant waited them out: before the attach
    // it saw the new instance pending and went on only once it saw it
    // running; after the attach it saw the attachment attaching and went on
    // (to the job) only once it saw it attached.
    let split = first_stage.expect("a stage ran");
    let prepare: Vec<Call> = env
        .proxy
        .calls()
        .into_iter()
        .filter(|c| c.at < split)
        .collect();
    let at = prepare
        .iter()
        .position(|c| c.action == "AttachVolume")
        .expect("the resume attached the volume");
    let (before, after) = prepare.split_at(at);
    for (calls, action, held) in [
        (before, "DescribeInstances", "pending"),
        (after, "DescribeVolumes", "attaching"),
    ] {
        let seen: Vec<Option<&str>> = calls
            .iter()
            .filter(|c| c.action == action)
            .map(|c| c.held)
            .collect();
        assert!(
            seen.contains(&Some(held)),
            "no {action} of the resume showed the hold ({held}): {seen:?}"
        );
        assert_eq!(
            seen.last(),
            Some(&None),
            "the resume went on while {action} still showed {held}: {seen:?}"
        );
    }
}

#[test]
fn a_machine_mode_launch_and_resume_wait_through_held_pending_states() {
    let env = Ec2Env::start();
    let rig = env.rig(
        "7",
        "s_0123456789ab",
        &env.settings(&env.connect_address(), ""),
    );
    env.proxy.hold_launches(PENDING);
    let first = rig.run(
        &harness::job(5)
            .suspend_on(true, false)
            .script("echo 'kept on the machine' > kept.txt"),
    );
    assert_result(&first, JobResult::Success);
    let launched = env.proxy.shown_held("pending");
    assert!(
        launched >= 1,
        "no DescribeInstances showed the held launch pending: {:?}",
        env.proxy.actions()
    );
    let key = first.key.clone().expect("a key");

    env.proxy.hold_transitions(PENDING, Duration::ZERO);
    let r = rig.run(&harness::job(5).resume(&key).script("cat kept.txt"));
    assert_result(&r, JobResult::Success);
    assert!(r.log().contains("kept on the machine"), "{}", r.log());
    assert!(
        env.proxy.shown_held("pending") > launched,
        "no DescribeInstances showed the held start pending: {:?}",
        env.proxy.actions()
    );
}

#[test]
fn an_attach_hold_shows_only_that_volumes_attachment_attaching() {
    let xml = "<volumeSet><item><volumeId>vol-1</volumeId><status>in-use</status><attachmentSet><item>\
               <volumeId>vol-1</volumeId><instanceId>i-1</instanceId><status>attached</status></item>\
               </attachmentSet></item><item><volumeId>vol-2</volumeId><status>in-use</status><attachmentSet>\
               <item><volumeId>vol-2</volumeId><status>attached</status></item></attachmentSet></item></volumeSet>";
    let shown = show_attaching(xml, "vol-1");
    assert_eq!(
        shown,
        xml.replacen(
            "<instanceId>i-1</instanceId><status>attached</status>",
            "<instanceId>i-1</instanceId><status>attaching</status>",
            1
        )
    );
    assert_eq!(show_attaching(xml, "vol-3"), xml);
}
