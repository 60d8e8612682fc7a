//! Core scenarios on the `local` provider.

use crate::harness::*;

#[test]
fn a_successful_job_runs_every_stage_and_releases() {
    let rig = Rig::local("12", "s_0123456789ab");
    let r = rig.run(&job(5));
    assert_result(&r, JobResult::Success);
    for stage in [
        "prepare#1",
        "prepare_script",
        "get_sources",
        "build_script",
        "cleanup_file_variables",
        "cleanup#1",
    ] {
        assert_eq!(r.call(stage).unwrap().exit_code, 0, "{stage}");
    }
    assert!(r.log().contains("hello from the build"));
    let key = r.key.clone().expect("the key is printed in prepare");
    assert!(
        !rig.env_dir(&key).exists(),
        "released: the environment directory is gone"
    );
}
