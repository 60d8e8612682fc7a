//! The warm pool's errors on the EC2 provider are reported, never
//! swallowed (moto behind the test proxy, which injects the errors): a
//! `dormant warm` that cannot count the instances it must keep under
//! `max_environments` (a missing ec2:DescribeInstances permission) exits
//! non-zero saying so, instead of skipping in silence; an entry of the pool
//! that cannot be read makes `sweep` and `dormant warm` fail at the end, and
//! the rest of the pool is still served.
//!
//! Network rule: the instance addresses moto hands out are never contacted.

use crate::ec2_rig::{instances, is_live, Ec2Env};
use crate::ec2_warm::tag;
use crate::harness::Rig;

const SYSTEM: &str = "s_0123456789ab";

fn text(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn live_warm(env: &Ec2Env) -> usize {
    instances(env)
        .iter()
        .filter(|i| is_live(i) && tag(i, "dormant:warm").is_some())
        .count()
}

#[test]
fn warm_pool_errors_fail_dormant_warm_and_sweep_and_the_rest_is_served() {
    let env = Ec2Env::start();
    let rig = env.rig(
        "7",
        SYSTEM,
        &format!(
            "runner_id = \"7\"\n{}",
            env.settings(
                &format!("{}warm = 1\nmax_environments = 4\n", env.connect_address()),
                "",
            )
        ),
    );
    // 1. The instances cannot be counted: an error, not "no room".
    env.proxy
        .fail("DescribeInstances", 0, 1000, 403, "UnauthorizedOperation");
    let out = rig.dormant(&["warm"]);
    let t = text(&out);
    assert!(!out.status.success(), "exit 0 without counting: {t}");
    assert!(
        t.contains("cannot count") && t.contains("UnauthorizedOperation"),
        "names the problem: {t}"
    );
    env.proxy.clear_faults();
    assert_eq!(live_warm(&env), 0, "nothing launched blind: {t}");

    // 2. An entry whose warm.json cannot be read: sweep runs the rest and
    // fails naming it; `dormant warm` serves the pool and fails naming it.
    let bad = uuid::Uuid::new_v4();
    let dir = rig.state_dir.join("warm").join(bad.to_string());
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("warm.json"), "{ not json").unwrap();
    let out = rig.dormant(&["sweep"]);
    let t = text(&out);
    assert!(!out.status.success(), "sweep ignored the pool's error: {t}");
    assert!(t.contains(&bad.to_string()), "names the entry: {t}");
    let out = rig.dormant(&["warm"]);
    let t = text(&out);
    assert!(!out.status.success(), "{t}");
    assert!(t.contains(&bad.to_string()), "names the entry: {t}");
    assert_eq!(live_warm(&env), 1, "the pool is still served: {t}");
    assert!(dir.join("warm.json").is_file(), "never deleted");

    // Tidy: the bad entry moved aside, warm = 0, a sweep retires the rest.
    std::fs::remove_dir_all(&dir).unwrap();
    Rig::write_settings(
        &rig.settings_path,
        SYSTEM,
        &format!(
            "runner_id = \"7\"\n{}",
            env.settings(&format!("{}warm = 0\n", env.connect_address()), "")
        ),
    );
    let out = rig.dormant(&["sweep"]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(instances(&env).iter().all(|i| !is_live(i)));
}
