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
    // The job token where GitLab Runner puts it: the payload's `token`, the
    // masked `CI_JOB_TOKEN` variable and inside `CI_REPOSITORY_URL`, each
    // listed before the variables that are read, so a reader that takes the
    // wrong variable (or the first one) would hold it.
    let text = r#"{"id": 77, "token": "glcbt-secret", "job_info": {"project_id": 5, "project_full_path": "g/p"},
        "image": {"name": "ubuntu:24.04"},
        "variables": [{"key": "CI_JOB_TOKEN", "value": "glcbt-secret", "public": false, "masked": true},
                      {"key": "CI_REPOSITORY_URL", "value": "https://gitlab-ci-token:glcbt-secret@gitlab.example.com/g/p.git", "public": false, "masked": false},
                      {"key": "CI_RUNNER_ID", "value": "12", "public": true},
                      {"key": "CI_JOB_URL", "value": "https://gitlab.example.com/g/p/-/jobs/77", "public": true}],
        "suspend_options": {"suspend_on_success": true, "suspend_on_failure": null,
                            "runtime_environment_key": "12/s_x/env=abc"}}"#;
    let input = JobInput::from_payload(text, &Job::default()).unwrap();
    // No field holds it, whichever field a mistake would have put it in.
    assert!(!format!("{input:?}").contains("glcbt-secret"), "{input:?}");
    assert_eq!(input.job_id, 77);
    assert_eq!(input.project_id, 5);
    assert_eq!(input.project_path.as_deref(), Some("g/p"));
    assert_eq!(input.payload_runner_id.as_deref(), Some("12"));
    assert_eq!(input.image.as_deref(), Some("ubuntu:24.04"));
    assert_eq!(
        input.job_url.as_deref(),
        Some("https://gitlab.example.com/g/p/-/jobs/77")
    );
    assert!(input.suspend.on_success && !input.suspend.on_failure);
    assert_eq!(input.suspend.resume_key.as_deref(), Some("12/s_x/env=abc"));
}

#[test]
fn older_key_field_is_read() {
    let text = r#"{"id": 1, "job_info": {"project_id": 2}, "suspend_options": {"environment_key": "k/s/env=x"}}"#;
    let input = JobInput::from_payload(text, &Job::default()).unwrap();
    assert_eq!(input.suspend.resume_key.as_deref(), Some("k/s/env=x"));
    assert!(!input.suspend.any_trigger());
}

#[test]
fn an_empty_suspend_options_sets_nothing_so_the_variables_serve() {
    // Every real payload carries `"suspend_options": {}` when nothing is set
    // (Go's omitempty never omits a struct): the variables must still be read.
    let text = r#"{"id": 1, "job_info": {"project_id": 2}, "suspend_options": {}}"#;
    let j = job(&[
        ("DORMANT_SUSPEND_ON_SUCCESS", "true"),
        ("DORMANT_ENVIRONMENT_KEY", "a/b/env=1"),
    ]);
    let s = JobInput::from_payload(text, &j).unwrap().suspend;
    assert!(s.on_success && !s.on_failure);
    assert_eq!(s.resume_key.as_deref(), Some("a/b/env=1"));
    assert_eq!(s.key_from, "DORMANT_ENVIRONMENT_KEY");
    assert_eq!(s.source, "the DORMANT_* job variables");
    assert!(s.invalid.is_none() && s.overridden.is_empty());
}

#[test]
fn each_field_comes_from_the_payload_where_it_is_set_else_from_the_variables() {
    let text = r#"{"id": 1, "job_info": {"project_id": 2},
        "suspend_options": {"suspend_on_success": true}}"#;
    let j = job(&[
        ("DORMANT_SUSPEND_ON_SUCCESS", "false"),
        ("CI_SUSPEND_ON_FAILURE", "yes"),
        ("CI_SUSPENDABLE_ENVIRONMENT_RESUME_KEY", "legacy/b/env=2"),
    ]);
    let s = JobInput::from_payload(text, &j).unwrap().suspend;
    // The payload's trigger beats the variable that says otherwise ...
    assert!(s.on_success);
    assert_eq!(s.overridden.len(), 1, "{:?}", s.overridden);
    assert!(
        s.overridden[0].contains("DORMANT_SUSPEND_ON_SUCCESS=false")
            && s.overridden[0].contains("suspend_options.suspend_on_success says true"),
        "{:?}",
        s.overridden
    );
    // ... and what the payload leaves unset comes from the variables.
    assert!(s.on_failure);
    assert_eq!(s.resume_key.as_deref(), Some("legacy/b/env=2"));
    assert_eq!(
        s.source,
        "the job payload's suspend_options and the CI_SUSPEND* job variables"
    );

    // A key in the payload beats a key in a variable.
    let text = r#"{"id": 1, "job_info": {"project_id": 2},
        "suspend_options": {"environment_key": "p/s/env=9"}}"#;
    let s = JobInput::from_payload(text, &job(&[("DORMANT_ENVIRONMENT_KEY", "v/s/env=8")]))
        .unwrap()
        .suspend;
    assert_eq!(s.resume_key.as_deref(), Some("p/s/env=9"));
    assert_eq!(s.key_from, "suspend_options.environment_key");
    // A variable that agrees with the payload is no news.
    let text = r#"{"id": 1, "job_info": {"project_id": 2},
        "suspend_options": {"suspend_on_failure": true}}"#;
    let s = JobInput::from_payload(text, &job(&[("DORMANT_SUSPEND_ON_FAILURE", "1")]))
        .unwrap()
        .suspend;
    assert!(s.on_failure && s.overridden.is_empty());
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
fn a_bad_trigger_value_is_kept_for_prepare_to_refuse_naming_the_variable() {
    // Not a parse error: config and cleanup still run; prepare refuses the job.
    for options in [
        "",
        r#", "suspend_options": {}"#,
        r#", "suspend_options": {"suspend_on_success": true}"#,
    ] {
        let text = format!(r#"{{"id": 1, "job_info": {{"project_id": 2}}{options}}}"#);
        let input = JobInput::from_payload(&text, &job(&[("DORMANT_SUSPEND_ON_SUCCESS", "maybe")]))
            .unwrap();
        let problem = input.suspend.invalid.expect("a bad value is never ignored");
        assert!(
            problem.contains("DORMANT_SUSPEND_ON_SUCCESS")
                && problem.contains("\"maybe\"")
                && problem.contains("true or false"),
            "{options}: {problem}"
        );
    }
    // Every bad one is named, the legacy names too.
    let text = r#"{"id": 1, "job_info": {"project_id": 2}}"#;
    let input = JobInput::from_payload(
        text,
        &job(&[
            ("CI_SUSPEND_ON_FAILURE", "sometimes"),
            ("DORMANT_SUSPEND_ON_SUCCESS", "2"),
        ]),
    )
    .unwrap();
    let problem = input.suspend.invalid.unwrap();
    assert!(
        problem.contains("CI_SUSPEND_ON_FAILURE") && problem.contains("DORMANT_SUSPEND_ON_SUCCESS"),
        "{problem}"
    );
}

#[test]
fn ids_come_from_the_payload_only_and_garbage_is_an_error() {
    // A job can set CI_JOB_ID and CI_PROJECT_ID itself: the project id says
    // whose environments a key may resume, so it is never taken from them.
    let j = job(&[("CI_JOB_ID", "9"), ("CI_PROJECT_ID", "3")]);
    let err =
        JobInput::from_payload(r#"{"id": null, "job_info": {"project_id": 3}}"#, &j).unwrap_err();
    assert!(format!("{err:#}").contains("no job id (`id`)"), "{err:#}");
    let err = JobInput::from_payload(r#"{"id": 9, "job_info": null}"#, &j).unwrap_err();
    assert!(
        format!("{err:#}").contains("no project id (`job_info.project_id`)"),
        "{err:#}"
    );
    let input = JobInput::from_payload(r#"{"id": 9, "job_info": {"project_id": 4}}"#, &j).unwrap();
    assert_eq!((input.job_id, input.project_id), (9, 4), "the payload wins");
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
    // `false` carried by the payload is set (a runner leaves it out instead).
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
        let input = JobInput::from_payload(text, &job(&[(name, huge.as_str())])).unwrap();
        let err = input.suspend.invalid.unwrap();
        assert!(err.len() < 400, "{} bytes: {err}", err.len());
        assert!(err.contains(name) && err.contains("(65536 bytes)"), "{err}");
    }
}
