//! Suspension asked for through job variables, through a simulated runner
//! that writes its payload as GitLab Runner does: `"suspend_options": {}` when
//! GitLab set nothing (Go's `omitempty` never omits a struct), the key spelled
//! as the runner's release spells it. Each trigger and the key come from the
//! payload where it sets them, else from the variables (docs/guide/keys.md).

use dormant::runner_sim::RunnerVersion;

use crate::harness::*;

const RUNNER: &str = "12";
const SYSTEM: &str = "s_0123456789ab";

fn rig() -> Rig {
    Rig::local(RUNNER, SYSTEM)
}

/// The environment's key, its status, and that the job had it suspended.
#[track_caller]
fn assert_suspended(rig: &Rig, r: &JobReport) -> String {
    let key = r.key.clone().expect("a key is printed");
    assert_eq!(
        rig.status(&key).as_deref(),
        Some("suspended"),
        "job log:\n{}\ncleanup:\n{}",
        r.log(),
        r.cleanup_output()
    );
    key
}

/// A resume: the file the first job wrote is there and get_sources was skipped.
#[track_caller]
fn assert_resumed(r: &JobReport) {
    assert_result(r, JobResult::Success);
    assert!(r.log().contains("skipping get_sources"), "{}", r.log());
    assert!(r.log().contains("kept-by-job-one"), "{}", r.log());
}

#[test]
fn dormant_variables_suspend_and_resume_under_an_empty_suspend_options() {
    let rig = rig();
    assert_eq!(rig.runner.version, RunnerVersion::SIMULATED);
    let r = rig.run(
        &job(5)
            .var("DORMANT_SUSPEND_ON_SUCCESS", "true")
            .script("echo kept-by-job-one > keep.txt"),
    );
    assert_result(&r, JobResult::Success);
    assert!(
        r.log()
            .contains("triggers from the DORMANT_* job variables"),
        "{}",
        r.log()
    );
    let key = assert_suspended(&rig, &r);

    let r = rig.run(
        &job(5)
            .var("DORMANT_ENVIRONMENT_KEY", &key)
            .script("cat keep.txt"),
    );
    assert_resumed(&r);
    assert_eq!(r.key.as_deref(), Some(key.as_str()));
    assert!(
        rig.record(&key).is_none(),
        "a resume without triggers releases the environment"
    );
}

#[test]
fn the_legacy_variable_names_suspend_and_resume_too() {
    let rig = rig();
    // CI_SUSPEND_ON_FAILURE keeps a failing job's environment ...
    let r = rig.run(
        &job(5)
            .var("CI_SUSPEND_ON_FAILURE", "yes")
            .script("echo kept-by-job-one > keep.txt; exit 4"),
    );
    assert_result(&r, JobResult::BuildFailure(Some(4)));
    assert!(
        r.log()
            .contains("triggers from the CI_SUSPEND* job variables"),
        "{}",
        r.log()
    );
    let key = assert_suspended(&rig, &r);
    // ... CI_SUSPENDABLE_ENVIRONMENT_RESUME_KEY resumes it, and
    // CI_SUSPEND_ON_SUCCESS suspends it again.
    let r = rig.run(
        &job(5)
            .var("CI_SUSPENDABLE_ENVIRONMENT_RESUME_KEY", &key)
            .var("CI_SUSPEND_ON_SUCCESS", "true")
            .script("cat keep.txt"),
    );
    assert_resumed(&r);
    assert_eq!(assert_suspended(&rig, &r), key);
}

#[test]
fn a_payload_trigger_beats_a_variable_that_says_otherwise() {
    let rig = rig();
    let r = rig.run(
        &job(5)
            .suspend_on(true, false)
            .var("DORMANT_SUSPEND_ON_SUCCESS", "false")
            .script("echo kept-by-job-one > keep.txt"),
    );
    assert_result(&r, JobResult::Success);
    let key = assert_suspended(&rig, &r);
    assert!(
        r.log().contains(
            "job variable DORMANT_SUSPEND_ON_SUCCESS=false is not used: the job payload's \
             suspend_options.suspend_on_success says true"
        ),
        "{}",
        r.log()
    );

    // The payload's key beats a variable's: the variable's would be refused.
    let r = rig.run(
        &job(5)
            .resume(&key)
            .var("DORMANT_ENVIRONMENT_KEY", "not-a-key")
            .script("cat keep.txt"),
    );
    assert_resumed(&r);

    // A variable that says false where the payload says nothing is read.
    let r = rig.run(&job(5).var("DORMANT_SUSPEND_ON_SUCCESS", "false"));
    assert_result(&r, JobResult::Success);
    assert!(rig.record(r.key.as_deref().unwrap()).is_none());
}

#[test]
fn a_bad_trigger_value_fails_the_job_once_naming_the_variable() {
    let rig = rig();
    let r = rig.run(&job(5).var("DORMANT_SUSPEND_ON_SUCCESS", "maybe"));
    // Job input: a build failure, so the runner does not try prepare again.
    assert_result(&r, JobResult::BuildFailure(None));
    assert_eq!(r.prepare_attempts, 1, "{}", r.log());
    let prepare = r.call("prepare#1").unwrap();
    assert_eq!(prepare.exit_code, 1, "{}", prepare.output);
    assert!(
        prepare.output.contains(
            "job variable DORMANT_SUSPEND_ON_SUCCESS=\"maybe\" is not a boolean: set it to true or false"
        ),
        "{}",
        prepare.output
    );
    assert!(!r.ran("get_sources") && !r.ran("build_script"));
    assert!(r.key.is_none(), "no environment was made: {:?}", r.key);
    let cleanup = r.call("cleanup#1").unwrap();
    assert_eq!(cleanup.exit_code, 0, "{}", cleanup.output);
    let envs = rig.state_dir.join("environments");
    let left = std::fs::read_dir(&envs).map(|d| d.count()).unwrap_or(0);
    assert_eq!(left, 0, "nothing is left in {}", envs.display());
}

#[test]
fn a_runner_before_19_0_writes_no_suspend_options_and_the_variables_serve() {
    let mut rig = rig();
    rig.runner.version = RunnerVersion::new(18, 11);
    let r = rig.run(
        &job(5)
            .var("DORMANT_SUSPEND_ON_SUCCESS", "on")
            .script("echo kept-by-job-one > keep.txt"),
    );
    assert_result(&r, JobResult::Success);
    let key = assert_suspended(&rig, &r);
    let r = rig.run(
        &job(5)
            .var("DORMANT_ENVIRONMENT_KEY", &key)
            .script("cat keep.txt"),
    );
    assert_resumed(&r);
}

#[test]
fn a_runner_19_3_spells_the_key_environment_key() {
    let mut rig = rig();
    rig.runner.version = RunnerVersion::new(19, 3);
    let r = rig.run(
        &job(5)
            .suspend_on(true, false)
            .script("echo kept-by-job-one > keep.txt"),
    );
    let key = assert_suspended(&rig, &r);
    let r = rig.run(&job(5).resume(&key).script("cat keep.txt"));
    assert_resumed(&r);
    assert!(rig.record(&key).is_none());
}

#[test]
fn a_job_cannot_borrow_another_projects_identity_through_ci_variables() {
    let rig = rig();
    let r = rig.run(
        &job(5)
            .suspend_on(true, false)
            .script("echo kept-by-job-one > keep.txt"),
    );
    let key = assert_suspended(&rig, &r);
    // Project 6's job claims to be project 5: the payload's id is the one read.
    let r = rig.run(
        &job(6)
            .var("CI_PROJECT_ID", "5")
            .var("DORMANT_ENVIRONMENT_KEY", &key),
    );
    assert_result(&r, JobResult::BuildFailure(None));
    assert_eq!(r.prepare_attempts, 1);
    assert!(
        r.log()
            .contains("belongs to project 5, not to this job's project 6"),
        "{}",
        r.log()
    );
    assert_eq!(rig.status(&key).as_deref(), Some("suspended"));
}
