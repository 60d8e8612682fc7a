//! The copy of a stage's output for `dormant attach` (`state/stage_output.rs`)
//! failing to be written: the job runs on, its log says nothing of it (the
//! job log is the job's people's, not the operator's), and `dormant inspect`
//! says why the copy stopped.

use crate::harness::{self, assert_result, JobResult, Rig};

#[test]
fn a_copy_that_cannot_be_written_is_reported_to_inspect_and_not_in_the_job_log() {
    let mut rig = Rig::local("1", "s_copy");
    rig.runner
        .env
        .insert("DORMANT_FAILPOINT".into(), "output-copy:write".into());
    let r = rig.run(
        &harness::job(5)
            .suspend_on(true, false)
            .script("echo the job own line"),
    );
    assert_result(&r, JobResult::Success);
    let log = r.log();
    assert!(log.contains("the job own line"), "{log}");
    assert!(
        !log.contains("dormant attach"),
        "the job log tells the copy's trouble: {log}"
    );
    let key = r.key.clone().expect("a key");
    rig.runner.env.remove("DORMANT_FAILPOINT");
    let out = rig.dormant(&["inspect", &key]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
    let stopped = doc["output_copy_stopped"].as_str().unwrap_or_default();
    assert!(
        stopped.contains("stopped at byte 0: writing")
            && stopped.contains("failpoint output-copy:write"),
        "{text}"
    );
}
