//! `dormant metrics` from the event log, through the binary: its output
//! parsed by the Prometheus client library's own text parser
//! (`prometheus_client`, pinned in the test venv by
//! `scripts/install-test-deps.sh`), its counters equal to the events counted
//! by hand from `dormant events --json`.

use std::collections::BTreeMap;
use std::path::PathBuf;

use crate::events::{events_json, text, RUNNER, SYSTEM};
use crate::harness::*;

/// The Python interpreter of the test venv (`scripts/install-test-deps.sh`
/// installs `prometheus_client` there).
fn python() -> PathBuf {
    if let Ok(p) = std::env::var("DORMANT_TEST_PYTHON") {
        if !p.is_empty() {
            return PathBuf::from(p);
        }
    }
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python");
    assert!(
        p.exists(),
        "the test venv's Python is not at {}: run scripts/install-test-deps.sh \
         (or point DORMANT_TEST_PYTHON at a Python with prometheus_client)",
        p.display()
    );
    p
}

/// Parses Prometheus text with `prometheus_client`'s own parser; returns
/// every sample as (name, labels, value).
fn parse_with_prometheus_client(exposition: &str) -> Vec<(String, BTreeMap<String, String>, f64)> {
    const SCRIPT: &str = r#"
import json, sys
from prometheus_client.parser import text_string_to_metric_families
out = []
for family in text_string_to_metric_families(sys.stdin.read()):
    for s in family.samples:
        out.append([s.name, s.labels, s.value])
print(json.dumps(out))
"#;
    use std::io::Write;
    let mut child = std::process::Command::new(python())
        .args(["-c", SCRIPT])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(exposition.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "prometheus_client could not parse it: {}\n{exposition}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn metrics_parse_with_prometheus_client_and_equal_the_events_counted_by_hand() {
    let rig = Rig::local(RUNNER, SYSTEM);
    let r = rig.run(&job(5).suspend_on(true, false));
    let key = r.key.clone().unwrap();
    assert_result(
        &rig.run(&job(5).resume(&key).suspend_on(true, false)),
        JobResult::Success,
    );
    // A metrics run in between: the next one counts only what came after.
    let out = rig.dormant(&["metrics"]);
    assert!(out.status.success(), "{}", text(&out));
    assert_result(&rig.run(&job(5).resume(&key)), JobResult::Success);
    assert_result(&rig.run(&job(5)), JobResult::Success);
    let r = rig.run(&job(5).script("exit 3").suspend_on(false, true));
    assert!(
        matches!(r.result, JobResult::BuildFailure(_)),
        "{}",
        r.log()
    );
    assert!(rig.dormant(&["sweep"]).status.success());
    let out = rig.dormant(&["metrics"]);
    assert!(out.status.success(), "{}", text(&out));
    let samples = parse_with_prometheus_client(&String::from_utf8(out.stdout).unwrap());

    let mut by_hand: BTreeMap<(String, String), f64> = BTreeMap::new();
    let events = events_json(&rig, &[]);
    for e in &events {
        let k = (
            e["event"].as_str().unwrap().into(),
            e["cause"].as_str().unwrap().into(),
        );
        *by_hand.entry(k).or_default() += 1.0;
    }
    let mut counted: BTreeMap<(String, String), f64> = BTreeMap::new();
    for (name, labels, value) in &samples {
        if name == "dormant_events_total" {
            assert_eq!(labels["provider"], "local");
            counted.insert((labels["event"].clone(), labels["cause"].clone()), *value);
        }
    }
    // Every known (event, cause) is printed, the ones that did not happen as 0.
    assert!(
        counted.len() > by_hand.len() && counted.values().any(|v| *v == 0.0),
        "{counted:?}"
    );
    counted.retain(|_, v| *v > 0.0);
    assert_eq!(counted, by_hand);
    assert_eq!(by_hand.get(&("created".into(), "job".into())), Some(&3.0));
    let sample = |name: &str, label: (&str, &str)| {
        samples
            .iter()
            .find(|(n, l, _)| n == name && l.get(label.0).map(String::as_str) == Some(label.1))
            .map(|(_, _, v)| *v)
    };
    assert_eq!(
        sample("dormant_prepare_seconds_count", ("mode", "new")),
        Some(3.0)
    );
    assert_eq!(
        sample("dormant_prepare_seconds_count", ("mode", "resume")),
        Some(2.0)
    );
    assert_eq!(
        sample(
            "dormant_suspended_before_resume_seconds_count",
            ("provider", "local")
        ),
        Some(2.0)
    );
    let suspends = by_hand[&("suspended".to_string(), "triggers".to_string())];
    assert_eq!(
        sample("dormant_suspend_seconds_count", ("provider", "local")),
        Some(suspends)
    );
    let last_sweep = samples
        .iter()
        .find(|(n, _, _)| n == "dormant_last_full_sweep_timestamp_seconds")
        .unwrap()
        .2;
    assert!(last_sweep > 1.7e9, "{last_sweep}");
    assert_eq!(
        sample("dormant_environments", ("status", "suspended")),
        Some(1.0),
        "the failed job's environment"
    );
}

/// A fresh install: `dormant metrics` on an empty state dir prints, for the
/// configured provider, a zero for every environment status, (event, cause),
/// failed step and sweep scope, and an empty histogram for every mode, in
/// text `prometheus_client` parses — so a dashboard has every series from
/// the first scrape.
#[test]
fn a_fresh_install_prints_zeros_for_every_known_series() {
    let rig = Rig::local(RUNNER, SYSTEM);
    let out = rig.dormant(&["metrics"]);
    assert!(out.status.success(), "{}", text(&out));
    let samples = parse_with_prometheus_client(&String::from_utf8(out.stdout).unwrap());
    let value = |name: &str, labels: &[(&str, &str)]| {
        samples
            .iter()
            .find(|(n, l, _)| {
                n == name
                    && labels
                        .iter()
                        .all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v))
            })
            .map(|(_, _, v)| *v)
    };
    let local = ("provider", "local");
    for status in [
        "creating",
        "resuming",
        "active",
        "suspending",
        "suspended",
        "releasing",
    ] {
        assert_eq!(
            value("dormant_environments", &[local, ("status", status)]),
            Some(0.0),
            "{status}"
        );
    }
    for step in ["create", "start", "connect", "stop", "delete"] {
        assert_eq!(
            value("dormant_failures_total", &[local, ("step", step)]),
            Some(0.0),
            "{step}"
        );
    }
    for (event, cause) in [("created", "job"), ("resumed", "job"), ("released", "ttl")] {
        assert_eq!(
            value(
                "dormant_events_total",
                &[local, ("event", event), ("cause", cause)]
            ),
            Some(0.0),
            "{event} {cause}"
        );
    }
    for mode in ["new", "resume", "shell"] {
        assert_eq!(
            value(
                "dormant_prepare_seconds_bucket",
                &[local, ("mode", mode), ("le", "+Inf")]
            ),
            Some(0.0),
            "{mode}"
        );
    }
    assert_eq!(value("dormant_suspend_seconds_count", &[local]), Some(0.0));
    for scope in ["full", "slice"] {
        assert_eq!(
            value("dormant_sweep_seconds_count", &[local, ("scope", scope)]),
            Some(0.0)
        );
        assert_eq!(
            value("dormant_sweep_unvisited_total", &[local, ("scope", scope)]),
            Some(0.0)
        );
    }
}

/// One sample's value in `dormant metrics`' text.
fn metric(rig: &Rig, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let out = rig.dormant(&["metrics"]);
    assert!(out.status.success(), "{}", text(&out));
    parse_with_prometheus_client(&String::from_utf8(out.stdout).unwrap())
        .into_iter()
        .find(|(n, l, _)| {
            n == name
                && labels
                    .iter()
                    .all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|(_, _, v)| v)
}

/// What suspended EC2 environments keep and what the warm pool spent, on
/// moto: a machine-mode environment keeps its root volume (the size it was
/// launched with: `root_volume_size_gb`, else the image's root volume), a
/// volume-mode one its data volume
/// (`volume_size_gb`), in bytes by storage mode; a released one keeps
/// nothing. The warm instance the volume-mode job took waited from its
/// `ready` event to its `taken` one: exactly that many machine-seconds.
#[cfg(feature = "ec2")]
#[test]
fn suspended_ec2_storage_and_warm_idle_seconds_are_what_the_records_and_events_say() {
    use crate::ec2_rig::Ec2Env;
    const GIB: f64 = (1u64 << 30) as f64;
    let env = Ec2Env::start();
    let storage = |storage: &'static str| [("provider", "ec2"), ("storage", storage)];

    let machine = env.rig(
        "7",
        "s_0123456789ab",
        &env.settings(
            &format!("{}root_volume_size_gb = 12\n", env.connect_address()),
            "",
        ),
    );
    assert_eq!(
        metric(
            &machine,
            "dormant_suspended_storage_bytes",
            &storage("machine")
        ),
        Some(0.0),
        "nothing suspended yet"
    );
    let kept = machine.run(&job(5).suspend_on(true, false));
    assert_result(&kept, JobResult::Success);
    assert_result(&machine.run(&job(6)), JobResult::Success); // released
                                                              // What it was launched with counts, not what the settings say now.
    Rig::write_settings(
        &machine.settings_path,
        "s_0123456789ab",
        &env.settings(
            &format!(
                "{}root_volume_size_gb = 20
",
                env.connect_address()
            ),
            "",
        ),
    );
    assert_eq!(
        metric(
            &machine,
            "dormant_suspended_storage_bytes",
            &storage("machine")
        ),
        Some(12.0 * GIB)
    );
    assert_eq!(
        metric(
            &machine,
            "dormant_suspended_storage_unknown",
            &storage("machine")
        ),
        Some(0.0)
    );
    // Without the setting: the image's root volume size, as DescribeImages says it.
    let image_gib = crate::ec2_rig::block_on(async {
        crate::moto::direct_client(&env.moto.url())
            .describe_images()
            .image_ids(&env.image)
            .send()
            .await
            .unwrap()
            .images()[0]
            .block_device_mappings()[0]
            .ebs()
            .and_then(|e| e.volume_size())
            .expect("moto's image has a root volume size")
    });
    let image_default = env.rig(
        "9",
        "s_0123456789ad",
        &env.settings(&env.connect_address(), ""),
    );
    let r = image_default.run(&job(5).suspend_on(true, false));
    assert_result(&r, JobResult::Success);
    assert_eq!(
        metric(
            &image_default,
            "dormant_suspended_storage_bytes",
            &storage("machine")
        ),
        Some(f64::from(image_gib) * GIB)
    );

    let volume = env.volume_rig(
        "8",
        "s_0123456789ac",
        &env.volume_settings("volume_size_gb = 3\nwarm = 1\n", ""),
    );
    crate::ec2_warm::warm_now(&volume);
    let r = volume.run(&job(7).suspend_on(true, false));
    assert_result(&r, JobResult::Success);
    Rig::write_settings(
        &volume.settings_path,
        "s_0123456789ac",
        &env.volume_settings(
            "volume_size_gb = 5
warm = 1
",
            "",
        ),
    );
    assert_eq!(
        metric(
            &volume,
            "dormant_suspended_storage_bytes",
            &storage("volume")
        ),
        Some(3.0 * GIB)
    );
    let events = events_json(&volume, &[]);
    let at = |cause: &str| {
        events
            .iter()
            .find(|e| e["event"] == "warm" && e["cause"] == cause)
            .unwrap_or_else(|| panic!("no warm {cause} event: {events:?}"))["ts_ms"]
            .as_u64()
            .unwrap()
    };
    let idle = (at("taken") - at("ready")) as f64 / 1000.0;
    assert!(idle > 0.0, "{idle}");
    assert_eq!(
        metric(
            &volume,
            "dormant_warm_idle_seconds_total",
            &[("provider", "ec2")]
        ),
        Some(idle)
    );
}

/// A job paused on the `ssh` provider (its script asks, docs/pause.md) is
/// visible to an operator: `dormant_paused_environments{provider="ssh"}` is 1
/// while its environment waits suspended, with `dormant_oldest_paused_seconds`
/// its question's age, and both drop back to 0 once a resumed job has
/// continued the script to its end (the environment released).
#[test]
fn a_paused_job_shows_in_the_paused_gauges_until_it_is_continued() {
    let sshd = crate::sshd::Sshd::start();
    let (rig, _) = crate::ssh::ssh_rig_with(&sshd, "");
    let ssh = [("provider", "ssh")];
    assert_eq!(metric(&rig, "dormant_paused_environments", &ssh), Some(0.0));
    let r = rig.run(&job(83).script("a=$(dormant-ask 'Merge it?'); echo \"got $a\""));
    assert_result(&r, JobResult::Success);
    let key = r.key.clone().expect("the ask keeps the environment");
    assert_eq!(rig.status(&key).as_deref(), Some("suspended"));
    assert_eq!(metric(&rig, "dormant_paused_environments", &ssh), Some(1.0));
    let at = rig.record(&key).unwrap()["paused"]["at"].as_u64().unwrap();
    let age = metric(&rig, "dormant_oldest_paused_seconds", &[]).unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    assert!(
        age >= 0.0 && age as u64 <= now - at + 1,
        "the oldest question's age {age} s, asked at {at}, now {now}"
    );
    let r2 = rig.run(&job(83).resume(&key).script("dormant-continue yes"));
    assert_result(&r2, JobResult::Success);
    assert!(r2.log().contains("got yes\n"), "{}", r2.log());
    assert_eq!(metric(&rig, "dormant_paused_environments", &ssh), Some(0.0));
    assert_eq!(
        metric(&rig, "dormant_oldest_paused_seconds", &[]),
        Some(0.0)
    );
}
