//! Input checked at the edge, through the built binary: settings no clock can
//! hold, job payloads GitLab Runner never writes, and messages that quote
//! untrusted input only briefly.

use std::process::{Command, Output};

use serde_json::json;

use crate::harness::*;

const RUNNER: &str = "12";
const SYSTEM: &str = "s_0123456789ab";

/// `dormant config` with `payload` as JOB_RESPONSE_FILE, beside id variables
/// a job could set itself (never read: the ids come from the payload only).
fn config_with_payload(rig: &Rig, payload: &str) -> (Output, String) {
    let path = rig.dir.path().join("response.json");
    std::fs::write(&path, payload).unwrap();
    let out = Command::new(BIN)
        .arg("config")
        .env_clear()
        .envs(&rig.runner.env)
        .env("JOB_RESPONSE_FILE", &path)
        .env("CUSTOM_ENV_CI_JOB_ID", "7")
        .env("CUSTOM_ENV_CI_PROJECT_ID", "5")
        .env("CUSTOM_ENV_CI_RUNNER_ID", RUNNER)
        .output()
        .unwrap();
    (out, path.display().to_string())
}

#[test]
fn durations_no_clock_can_hold_fail_config_naming_the_key() {
    // These passed `dormant config`; then every prepare (or cleanup) panicked
    // "overflow when adding duration to instant".
    for (extra, key) in [
        (
            "prepare_timeout = \"18446744073709551615s\"\n",
            "prepare_timeout",
        ),
        (
            "[suspend]\ncleanup_sweep_budget = \"200000000000000d\"\n",
            "suspend.cleanup_sweep_budget",
        ),
        (
            "[ssh]\nready_timeout = \"99999999d\"\n",
            "ssh.ready_timeout",
        ),
    ] {
        let rig = Rig::new(RUNNER, SYSTEM, extra);
        let r = rig.run(&job(5));
        assert_result(&r, JobResult::SystemFailure);
        let config = r.call("config#1").unwrap();
        assert_eq!(config.exit_code, 2, "{}", config.output);
        assert!(
            config.output.contains(&format!("{key}: must be at most")),
            "{key}: {}",
            config.output
        );
        assert!(!r.log().contains("overflow"), "{}", r.log());
    }
}

#[test]
fn a_payload_that_is_not_an_object_is_a_system_failure_naming_the_file() {
    // `[]` used to be accepted, with the job and project ids taken from the
    // job's own (untrusted) variables.
    let rig = Rig::local(RUNNER, SYSTEM);
    let (out, path) = config_with_payload(&rig, "[]\n");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(2),
        "stdout: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(err.contains(&path), "{err}");
    assert!(err.contains("it is an array, not a JSON object"), "{err}");
    assert!(err.contains("GitLab Runner never writes that"), "{err}");
    assert!(out.stdout.is_empty(), "no config on stdout");
}

#[test]
fn suspend_options_of_the_wrong_type_fail_the_job_instead_of_suspending() {
    // `[true]` used to read as suspend_on_success.
    let rig = Rig::local(RUNNER, SYSTEM);
    let mut j = job(5);
    j.suspend_options_override = Some(json!([true]));
    let r = rig.run(&j);
    assert_result(&r, JobResult::SystemFailure);
    let config = r.call("config#1").unwrap();
    assert!(
        config
            .output
            .contains("`suspend_options` is an array, not an object"),
        "{}",
        config.output
    );
    assert!(r.key.is_none(), "no environment was made: {:?}", r.key);
}

#[test]
fn a_huge_job_variable_is_quoted_briefly() {
    let rig = Rig::local(RUNNER, SYSTEM);
    let huge = format!("{}\u{1b}[2J", "y".repeat(65_536));
    let r = rig.run(&job(5).var("DORMANT_SUSPEND_ON_SUCCESS", &huge));
    // Job input: refused once by prepare, never retried.
    assert_result(&r, JobResult::BuildFailure(None));
    assert_eq!(r.prepare_attempts, 1);
    let out = &r.call("prepare#1").unwrap().output;
    assert!(out.contains("DORMANT_SUSPEND_ON_SUCCESS"), "{out}");
    assert!(
        out.len() < 1000,
        "{} bytes of output: {}",
        out.len(),
        &out[..200]
    );
    assert!(
        !out.contains('\u{1b}'),
        "a control character reached the log"
    );
}

#[test]
fn a_huge_settings_value_is_quoted_briefly() {
    let huge = "x/".repeat(32_768);
    let rig = Rig::new(RUNNER, SYSTEM, &format!("runner_id = \"{huge}\"\n"));
    let out = rig.dormant(&["config"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("runner_id:"), "{}", &err[..err.len().min(300)]);
    assert!(err.len() < 1000, "{} bytes", err.len());
}

#[test]
fn a_payload_without_the_jobs_identity_is_refused_not_filled_from_job_variables() {
    // `config_with_payload` sets CI_JOB_ID, CI_PROJECT_ID and CI_RUNNER_ID as
    // job variables: a job can set those itself, so none of them may stand in
    // for the payload's own fields (the project id decides who may resume).
    let rig = Rig::local(RUNNER, SYSTEM);
    let runner_var = r#"[{"key": "CI_RUNNER_ID", "value": "12", "public": true}]"#;
    for (payload, missing) in [
        (
            format!(r#"{{"job_info": {{"project_id": 5}}, "variables": {runner_var}}}"#),
            "no job id (`id`)",
        ),
        (
            format!(r#"{{"id": 7, "job_info": {{}}, "variables": {runner_var}}}"#),
            "no project id (`job_info.project_id`)",
        ),
        (
            r#"{"id": 7, "job_info": {"project_id": 5}, "variables": null}"#.to_string(),
            "a job's own CI_RUNNER_ID variable is never used",
        ),
    ] {
        let (out, path) = config_with_payload(&rig, &payload);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{payload}: {err}");
        assert!(err.contains(missing), "{payload}: {err}");
        assert!(out.stdout.is_empty(), "no config on stdout");
        if !missing.contains("CI_RUNNER_ID") {
            assert!(err.contains(&path), "{err}");
        }
    }
    // With the runner id in the settings, the payload's variables need not carry it.
    let rig = Rig::new(RUNNER, SYSTEM, "runner_id = \"12\"\n");
    let (out, _) = config_with_payload(
        &rig,
        r#"{"id": 7, "job_info": {"project_id": 5}, "variables": null}"#,
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
