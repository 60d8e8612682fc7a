//! Volume mode (`storage = "volume"`) on the `local` provider: its lifecycle
//! without a VM (the volume is a directory, the "machine" a work directory
//! deleted on every suspend), and every crash point of it — each of the
//! generic scenarios of `crash.rs` in volume mode, then a process SIGKILLed at
//! each volume step (create, attach, detach, delete the machine, delete the
//! volume) followed by the runner's next move or `dormant sweep`. After each:
//! the file the first job wrote survives, a suspended environment is its
//! volume alone (no work directory), and nothing is left after a release.

use std::path::PathBuf;

use crate::crash::*;
use crate::harness::*;

const LOCAL_VOLUME: &str = "[local]\nstorage = \"volume\"\n";

/// Local volume mode's machines: the environments' work directories.
pub struct WorkDirs(pub PathBuf);

impl Machines for WorkDirs {
    fn alive(&self) -> Vec<String> {
        entries(self.0.join("environments"))
            .into_iter()
            .filter(|e| self.0.join("environments").join(e).join("work").exists())
            .collect()
    }
}

/// Every suspended environment is its volume alone: no work directory, the
/// volume detached and no machine in its record; every volume directory
/// belongs to an environment with a record.
fn assert_volume_settled(rig: &Rig, what: &str) {
    let envs = rig.state_dir.join("environments");
    for e in entries(envs.clone()) {
        let dir = envs.join(&e);
        let rec: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("record.json")).unwrap())
                .unwrap_or_else(|err| panic!("{what}: {e}: {err}"));
        assert_eq!(rec["storage"], "volume", "{what}: {rec}");
        if rec["status"] == "suspended" {
            assert!(
                !dir.join("work").exists(),
                "{what}: suspended {e} kept its work directory: {rec}"
            );
            assert!(dir.join("volume").is_dir(), "{what}: {e} lost its volume");
            assert_eq!(rec["volume"]["step"], "detached", "{what}: {rec}");
            assert!(rec["machine"].is_null(), "{what}: {rec}");
        }
    }
}

fn volume_rig(runner: &str) -> Rig {
    Rig::new(runner, "s_0123456789ab", &format!("{LOCAL_VOLUME}{GRACE}"))
}

#[test]
fn local_volume_mode_keeps_the_builds_dir_and_nothing_else() {
    let rig = volume_rig("35");
    let first = job(5).suspend_on(true, false);
    let env = rig
        .state_dir
        .join("environments")
        .join(dormant::identity::new_env_id("35", first.id).to_string());
    let first = first.script(&format!(
        "echo precious > kept.txt; echo gone > {}/work/outside.txt; pwd",
        env.display()
    ));
    let r = rig.run(&first);
    assert_result(&r, JobResult::Success);
    let key = r.key.clone().unwrap();
    assert!(key.contains("storage=volume"), "{key}");
    assert!(
        r.log()
            .contains(&format!("{}/work/volume/builds/", env.display())),
        "the project dir is on the volume: {}",
        r.log()
    );
    assert_eq!(rig.status(&key).as_deref(), Some("suspended"));
    assert_volume_settled(&rig, "after the suspend");
    let list = String::from_utf8_lossy(&rig.dormant(&["list"]).stdout).to_string();
    assert!(
        list.contains("STORAGE") && list.contains(" volume "),
        "{list}"
    );
    let inspect: serde_json::Value =
        serde_json::from_slice(&rig.dormant(&["inspect", &key]).stdout).unwrap();
    assert_eq!(inspect["storage"], "volume");
    assert_eq!(inspect["volume"]["step"], "detached");

    let r2 = rig.run(&job(5).resume(&key).script(
        "test \"$(cat kept.txt)\" = precious || exit 7; \
         test ! -e ../../../../outside.txt || { echo 'outside.txt survived' >&2; exit 8; }",
    ));
    assert_result(&r2, JobResult::Success);
    assert!(r2.log().contains("skipping get_sources"), "{}", r2.log());
    assert!(r2.log().contains("fresh from the image"), "{}", r2.log());
    assert!(
        rig.status(&key).is_none(),
        "released: {}",
        r2.cleanup_output()
    );
    assert!(!env.exists(), "nothing left of {}", env.display());
}

#[test]
fn every_crash_point_on_local_volume_mode() {
    let mut rig = volume_rig("34");
    let machines = WorkDirs(rig.state_dir.clone());
    // The generic scenarios (prepare, resume, run, suspend, release killed at
    // each step), in volume mode.
    every_crash_point(&mut rig, &machines);
    assert_volume_settled(&rig, "generic scenarios");

    // A new job's prepare killed at each volume step; the runner cleans up
    // and retries: the job succeeds, its environment is suspended, its file kept.
    for point in [
        "volume:create-intent",
        "volume:created",
        "volume:attach-intent",
        "volume:attached",
    ] {
        arm(&mut rig, Some(point), true);
        let r = rig.run(&keeper());
        assert_result(&r, JobResult::Success);
        assert_eq!(r.prepare_attempts, 2, "{point}: killed once, retried once");
        assert_killed_at(&rig, &r.calls, point, 1);
        let key = r.key.clone().unwrap();
        assert_eq!(rig.status(&key).as_deref(), Some("suspended"), "{point}");
        assert_settled(&rig, &machines, point);
        assert_volume_settled(&rig, point);
        resume_and_release(&mut rig, &key, point);
        assert_settled(&rig, &machines, point);
    }

    // The suspend killed at each volume step, then a sweep: suspended, the
    // machine deleted, the file kept.
    for point in [
        "volume:detach-intent",
        "volume:detached",
        "volume:delete-machine-intent",
        "volume:machine-deleted",
    ] {
        arm(&mut rig, Some(point), true);
        let r = rig.run(&keeper());
        assert_killed_at(&rig, &r.calls, point, 1);
        let key = r.key.clone().unwrap();
        arm(&mut rig, None, false);
        let text = sweep(&rig);
        assert_eq!(
            rig.status(&key).as_deref(),
            Some("suspended"),
            "{point}: {text}"
        );
        assert_settled(&rig, &machines, point);
        assert_volume_settled(&rig, point);
        resume_and_release(&mut rig, &key, point);
        assert_settled(&rig, &machines, point);
    }

    // A resume killed at each volume step; the runner cleans up (the new
    // machine is deleted again) and retries: resumed, the file there.
    for point in ["volume:attach-intent", "volume:attached"] {
        arm(&mut rig, None, false);
        let key = rig.run(&keeper()).key.unwrap();
        arm(&mut rig, Some(point), true);
        let r = rig.run(
            &job(5)
                .resume(&key)
                .suspend_on(true, false)
                .script("test \"$(cat kept.txt)\" = precious || exit 9"),
        );
        assert_result(&r, JobResult::Success);
        assert_eq!(r.prepare_attempts, 2, "{point}");
        assert_killed_at(&rig, &r.calls, point, 1);
        assert_eq!(rig.status(&key).as_deref(), Some("suspended"), "{point}");
        assert_volume_settled(&rig, point);
        resume_and_release(&mut rig, &key, point);
        assert_settled(&rig, &machines, point);
    }

    // A resume killed after launching its machine, before recording it, on
    // every attempt (the runner gives up after three): each cleanup finds the
    // unrecorded machine by its name and deletes it; suspended, nothing left.
    arm(&mut rig, None, false);
    let key = rig.run(&keeper()).key.unwrap();
    arm(&mut rig, Some("resume:started"), false);
    let r = rig.run(&job(5).resume(&key));
    assert_eq!(r.prepare_attempts, 3, "{}", r.log());
    assert_killed_at(&rig, &r.calls, "resume:started", 3);
    assert_eq!(rig.status(&key).as_deref(), Some("suspended"));
    assert!(
        r.cleanup_output()
            .contains("by a process that did not finish"),
        "{}",
        r.cleanup_output()
    );
    assert_volume_settled(&rig, "resume killed after its launch");
    resume_and_release(&mut rig, &key, "resume killed after its launch");

    // A resumed job's suspend killed half-way; no sweep: a later resume,
    // past the grace, recovers it (detach, delete) and runs with the file.
    for point in ["volume:detach-intent", "volume:machine-deleted"] {
        arm(&mut rig, None, false);
        let key = rig.run(&keeper()).key.unwrap();
        arm(&mut rig, Some(point), true);
        let r = rig.run(&job(5).resume(&key).suspend_on(true, false));
        assert_killed_at(&rig, &r.calls, point, 1);
        assert_eq!(rig.status(&key).as_deref(), Some("suspending"), "{point}");
        std::thread::sleep(PAST_GRACE);
        resume_and_release(&mut rig, &key, point);
        assert_settled(&rig, &machines, point);
    }

    // A release killed between the machine and the volume, or after both:
    // a sweep finishes it; no volume is left.
    for point in ["release:deleted", "release:volume-deleted"] {
        arm(&mut rig, Some(point), true);
        let r = rig.run(&job(5));
        assert_killed_at(&rig, &r.calls, point, 1);
        let key = r.key.clone().unwrap();
        assert_eq!(rig.status(&key).as_deref(), Some("releasing"), "{point}");
        arm(&mut rig, None, false);
        let text = sweep(&rig);
        assert!(rig.status(&key).is_none(), "{point}: {text}");
        assert_settled(&rig, &machines, point);
    }
    let left = entries(rig.state_dir.join("environments"));
    assert!(left.is_empty(), "every environment was released: {left:?}");
}

#[test]
fn dormant_shell_opens_a_volume_mode_environment_on_a_new_machine_and_suspends_it_again() {
    let rig = volume_rig("36");
    let r = rig.run(
        &job(5)
            .suspend_on(true, false)
            .script("echo precious > kept.txt"),
    );
    assert_result(&r, JobResult::Success);
    let key = r.key.clone().unwrap();
    let out = rig.dormant(&["shell", &key, "--", "cat kept.txt; pwd"]);
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{said}");
    assert!(said.contains("precious"), "{said}");
    assert!(
        said.contains("/volume/builds/group/project"),
        "in the project dir on the volume: {said}"
    );
    assert!(said.contains("making a new machine"), "{said}");
    assert_eq!(rig.status(&key).as_deref(), Some("suspended"));
    assert_volume_settled(&rig, "after the shell");
    let out = rig.dormant(&["release", &key]);
    assert!(out.status.success());
    assert!(entries(rig.state_dir.join("environments")).is_empty());
}

/// The work directory (the "machine") deleted between two steps of a job: a
/// machine lost. With the failure trigger the volume is kept (notify reason
/// `machine lost`) and a later job resumes it with its files; without it the
/// environment is released, as for any failure nothing asked to keep.
#[test]
fn a_machine_lost_under_a_job_keeps_the_volume_when_the_failure_trigger_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let notes = dir.path().join("notes.jsonl");
    let hook = dir.path().join("hook.sh");
    std::fs::write(
        &hook,
        format!("#!/bin/sh\ncat >> {n}\necho >> {n}\n", n = notes.display()),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&hook, std::fs::Permissions::from_mode(0o755)).unwrap();
    let rig = Rig::new(
        "37",
        "s_0123456789ab",
        &format!(
            "{LOCAL_VOLUME}[suspend]\nclaim_grace = \"1s\"\nnotify_command = [\"{}\"]\n",
            hook.display()
        ),
    );
    let lose = |j: &dormant::runner_sim::SimJob| {
        let env = rig
            .state_dir
            .join("environments")
            .join(dormant::identity::new_env_id("37", j.id).to_string());
        format!("rm -rf {}/work", env.display())
    };
    for keep in [true, false] {
        let mut j = job(5).suspend_on(false, keep);
        j.steps = vec![
            ("build_script".into(), "echo precious > kept.txt".into()),
            ("step_second".into(), "echo never".into()),
        ];
        let r = rig.run_with_command_before(&j, "step_second", &lose(&j));
        assert_eq!(r.result, JobResult::SystemFailure, "{}", r.log());
        assert!(r.log().contains("machine lost: machine "), "{}", r.log());
        let key = r.key.clone().unwrap();
        if !keep {
            assert!(
                rig.status(&key).is_none(),
                "released: {}",
                r.cleanup_output()
            );
            continue;
        }
        assert_eq!(
            rig.status(&key).as_deref(),
            Some("suspended"),
            "{}",
            r.cleanup_output()
        );
        assert!(
            r.cleanup_output().contains("(machine lost)"),
            "{}",
            r.cleanup_output()
        );
        assert_volume_settled(&rig, "machine lost");
        let said = std::fs::read_to_string(&notes).unwrap();
        assert!(said.contains("\"reason\":\"machine lost\""), "{said}");
        // Where the environment lives now: its volume, no machine.
        let doc: serde_json::Value = said
            .lines()
            .rev()
            .find(|l| l.contains("\"event\":\"suspend\""))
            .map(|l| serde_json::from_str(l).unwrap())
            .unwrap_or_else(|| panic!("no suspend document: {said}"));
        assert_eq!(doc["storage"], "volume", "{doc}");
        assert!(doc["machine"].is_null(), "{doc}");
        assert!(
            doc["volume"]["id"]
                .as_str()
                .is_some_and(|v| v.ends_with("/volume")),
            "{doc}"
        );
        let events = rig.dormant(&["events", &key, "--json"]);
        let events = String::from_utf8_lossy(&events.stdout).to_string();
        assert!(
            events.lines().any(|l| l.contains("\"event\":\"suspended\"")
                && l.contains("\"cause\":\"machine_lost\"")),
            "the event log says why: {events}"
        );
        let r2 = rig.run(
            &job(5)
                .resume(&key)
                .script("test \"$(cat kept.txt)\" = precious || exit 9"),
        );
        assert_result(&r2, JobResult::Success);
        assert!(rig.status(&key).is_none());
    }
}
