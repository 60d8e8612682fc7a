//! Tests of the payload reader: what GitLab Runner writes is read, anything
//! else is refused naming the field, and no message quotes a secret or more
//! than an excerpt of a job variable.

use super::*;

fn job(vars: &[(&str, &str)]) -> Job {
    Job::from_map(
        vars.iter()
            .map(|(k, v)| (format!("CUSTOM_ENV_{k}"), v.to_string())),
    )
}

#[test]
fn payload_fields_are_read() {
    let text = r#"{"id": 77, "token": "glcbt-secret", "job_info": {"project_id": 5, "project_full_path": "g/p"},
        "image": {"name": "ubuntu:24.04"},
        "variables": [{"key": "CI_RUNNER_ID", "value": "12", "public": true},
                      {"key": "CI_JOB_URL", "value": "https://gitlab.example.com/g/p/-/jobs/77", "public": true}],
        "suspend_options": {"suspend_on_success": true, "suspend_on_failure": null,
                            "runtime_environment_key": "12/s_x/env=abc"}}"#;
    let input = JobInput::from_payload(text, &Job::default()).unwrap();
    assert_eq!(input.job_id, 77);
    assert_eq!(input.project_id, 5);
    assert_eq!(input.payload_runner_id.as_deref(), Some("12"));
    assert_eq!(input.image.as_deref(), Some("ubuntu:24.04"));
    assert_eq!(
        input.job_url.as_deref(),
        Some("https://gitlab.example.com/g/p/-/jobs/77")
    );
    assert!(input.suspend.on_success && !input.suspend.on_failure);
    assert_eq!(input.suspend.resume_key.as_deref(), Some("12/s_x/env=abc"));
    assert!(!format!("{input:?}").contains("glcbt-secret"));
}

#[test]
fn older_key_field_is_read() {
    let text = r#"{"id": 1, "job_info": {"project_id": 2}, "suspend_options": {"environment_key": "k/s/env=x"}}"#;
    let input = JobInput::from_payload(text, &Job::default()).unwrap();
    assert_eq!(input.suspend.resume_key.as_deref(), Some("k/s/env=x"));
    assert!(!input.suspend.any_trigger());
}

#[test]
fn payload_options_win_over_variables() {
    let text = r#"{"id": 1, "job_info": {"project_id": 2}, "suspend_options": {}}"#;
    let j = job(&[("DORMANT_SUSPEND_ON_SUCCESS", "true")]);
    let input = JobInput::from_payload(text, &j).unwrap();
    assert!(!input.suspend.on_success);
}

#[test]
fn variables_serve_without_suspend_options_dormant_names_first() {
    let text = r#"{"id": 1, "job_info": {"project_id": 2}, "suspend_options": null}"#;
    let j = job(&[
        ("DORMANT_SUSPEND_ON_FAILURE", "yes"),
        ("CI_SUSPEND_ON_SUCCESS", "true"),
        ("DORMANT_ENVIRONMENT_KEY", "a/b/env=1"),
        ("CI_SUSPENDABLE_ENVIRONMENT_RESUME_KEY", "legacy/b/env=2"),
    ]);
    let s = JobInput::from_payload(text, &j).unwrap().suspend;
    assert!(s.on_failure && s.on_success);
    assert_eq!(s.resume_key.as_deref(), Some("a/b/env=1"));
    let j = job(&[("CI_SUSPENDABLE_ENVIRONMENT_RESUME_KEY", "legacy/b/env=2")]);
    let s = JobInput::from_payload(text, &j).unwrap().suspend;
    assert_eq!(s.resume_key.as_deref(), Some("legacy/b/env=2"));
    assert_eq!(s.source, "the CI_SUSPEND* job variables");
}

#[test]
fn bad_boolean_names_the_variable() {
    let text = r#"{"id": 1, "job_info": {"project_id": 2}}"#;
    let err =
        JobInput::from_payload(text, &job(&[("DORMANT_SUSPEND_ON_SUCCESS", "maybe")])).unwrap_err();
    assert!(
        format!("{err:#}").contains("DORMANT_SUSPEND_ON_SUCCESS"),
        "{err:#}"
    );
}

#[test]
fn ids_fall_back_to_variables_and_garbage_is_an_error() {
    let j = job(&[("CI_JOB_ID", "9"), ("CI_PROJECT_ID", "3")]);
    let input = JobInput::from_payload(r#"{"id": null, "job_info": null}"#, &j).unwrap();
    assert_eq!((input.job_id, input.project_id), (9, 3));
    assert!(JobInput::from_payload("{}", &Job::default()).is_err());
    let err = JobInput::from_payload(r#"{"id": 1e400}"#, &Job::default()).unwrap_err();
    assert!(
        format!("{err:#}").contains("number out of range"),
        "{err:#}"
    );
    let err = JobInput::from_payload("{not json", &Job::default()).unwrap_err();
    assert!(format!("{err:#}").contains("not a valid job payload"));
    assert!(JobInput::from_payload("  \n", &Job::default()).is_err());
}

fn refusal(text: &str) -> String {
    let j = job(&[("CI_JOB_ID", "9"), ("CI_PROJECT_ID", "3")]);
    match JobInput::from_payload(text, &j) {
        Ok(input) => panic!("accepted {text}: {input:?}"),
        Err(e) => format!("{e:#}"),
    }
}

#[test]
fn a_payload_that_is_not_an_object_is_refused() {
    // `[]` used to be accepted, the ids then taken from job variables.
    for (text, kind) in [
        ("[]", "an array"),
        ("[77, {\"project_id\": 5}]", "an array"),
        ("null", "null"),
        ("42", "a number"),
        ("\"{}\"", "a string"),
        ("true", "a boolean"),
    ] {
        let err = refusal(text);
        assert!(
            err.contains(&format!("it is {kind}, not a JSON object")),
            "{text}: {err}"
        );
        assert!(err.contains("GitLab Runner never writes that"), "{err}");
    }
}

#[test]
fn fields_of_the_wrong_type_are_refused_naming_the_field() {
    for (text, field, kind) in [
        // `[true]` used to read as suspend_on_success.
        (
            r#"{"suspend_options": [true]}"#,
            "suspend_options",
            "an array",
        ),
        (
            r#"{"suspend_options": true}"#,
            "suspend_options",
            "a boolean",
        ),
        (
            r#"{"suspend_options": {"suspend_on_success": "true"}}"#,
            "suspend_options.suspend_on_success",
            "a string",
        ),
        (
            r#"{"suspend_options": {"suspend_on_failure": 1}}"#,
            "suspend_options.suspend_on_failure",
            "a number",
        ),
        (
            r#"{"suspend_options": {"runtime_environment_key": ["k"]}}"#,
            "suspend_options.runtime_environment_key",
            "an array",
        ),
        (
            r#"{"suspend_options": {"environment_key": {}}}"#,
            "suspend_options.environment_key",
            "an object",
        ),
        (r#"{"id": "12"}"#, "id", "a string"),
        (r#"{"id": -1}"#, "id", "a number"),
        (r#"{"id": 1.5}"#, "id", "a number"),
        (r#"{"job_info": [5]}"#, "job_info", "an array"),
        (
            r#"{"job_info": {"project_id": "4"}}"#,
            "job_info.project_id",
            "a string",
        ),
        (
            r#"{"job_info": {"project_full_path": 7}}"#,
            "job_info.project_full_path",
            "a number",
        ),
        (r#"{"image": "ubuntu"}"#, "image", "a string"),
        (r#"{"image": {"name": false}}"#, "image.name", "a boolean"),
        (
            r#"{"variables": {"CI_RUNNER_ID": "1"}}"#,
            "variables",
            "an object",
        ),
        (
            r#"{"variables": ["CI_RUNNER_ID"]}"#,
            "variables[0]",
            "a string",
        ),
        (
            r#"{"variables": [{"key": "A", "value": "1"}, {"key": "CI_RUNNER_ID", "value": 12}]}"#,
            "variables[1].value",
            "a number",
        ),
    ] {
        let err = refusal(text);
        assert!(
            err.contains(&format!("`{field}` is {kind}, not ")),
            "{text}: {err}"
        );
    }
}

#[test]
fn what_gitlab_runner_writes_is_accepted_nulls_included() {
    let text = r#"{"id": 77, "job_info": {"project_id": 5, "project_full_path": null},
        "image": null, "variables": null,
        "suspend_options": {"suspend_on_success": null, "suspend_on_failure": false,
                            "runtime_environment_key": null, "environment_key": null}}"#;
    let input = JobInput::from_payload(text, &Job::default()).unwrap();
    assert_eq!((input.job_id, input.project_id), (77, 5));
    assert!(!input.suspend.any_trigger() && input.suspend.resume_key.is_none());
    assert_eq!(input.suspend.source, "the job payload's suspend_options");
}

#[test]
fn refusals_never_quote_the_payload() {
    let secret = "glcbt-secret-token-value";
    for text in [
        format!(
            r#"{{"id": 1, "job_info": {{"project_id": 2}}, "suspend_options": {{"suspend_on_success": "{secret}"}}}}"#
        ),
        format!(r#"{{"token": "{secret}", "id": ["{secret}"]}}"#),
        format!(r#"{{"token": "{secret}", "id": 1, "#),
    ] {
        let err = format!(
            "{:#}",
            JobInput::from_payload(&text, &Job::default()).unwrap_err()
        );
        assert!(!err.contains(secret), "{err}");
    }
}

#[test]
fn a_huge_job_variable_is_quoted_briefly() {
    let text = r#"{"id": 1, "job_info": {"project_id": 2}}"#;
    let huge = "y".repeat(65_536);
    for name in ["DORMANT_SUSPEND_ON_SUCCESS", "CI_SUSPEND_ON_FAILURE"] {
        let err = format!(
            "{:#}",
            JobInput::from_payload(text, &job(&[(name, huge.as_str())])).unwrap_err()
        );
        assert!(err.len() < 400, "{} bytes: {err}", err.len());
        assert!(err.contains(name) && err.contains("(65536 bytes)"), "{err}");
    }
    let err = format!(
        "{:#}",
        JobInput::from_payload("{}", &job(&[("CI_JOB_ID", huge.as_str())])).unwrap_err()
    );
    assert!(err.len() < 400 && err.contains("CI_JOB_ID"), "{err}");
}
