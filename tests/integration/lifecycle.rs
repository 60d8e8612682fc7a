//! The lifecycle's promises through the binary, without killing anything:
//! refused jobs leave no files; a claim whose holder is gone is recovered by
//! `release` and `sweep`, a live one never; directories without a record are
//! shown and removed. (Crash points: `crash.rs`.)

use dormant::state::{EnvStatus, Holder, Mode, StateStore};

use crate::harness::*;

const GRACE: &str = "[suspend]\nclaim_grace = \"1s\"\n";

fn text(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn job_holder(job_id: u64) -> Holder {
    Holder::Job {
        runner_id: "41".into(),
        job_id,
        mode: Mode::New,
        suspend_on_failure: false,
    }
}

#[test]
fn refused_and_finished_jobs_leave_no_lock_files() {
    let rig = Rig::new("41", "s_0123456789ab", "");
    for i in 0..40 {
        let r = rig.run(&job(5).resume(&format!("not-a-key-{i}")));
        assert!(
            matches!(r.result, JobResult::BuildFailure(_)),
            "{}",
            r.log()
        );
    }
    rig.run(&job(5));
    let left: Vec<_> = std::fs::read_dir(rig.state_dir.join("jobs"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn a_claim_whose_holder_is_gone_is_released_by_the_operator_and_a_live_one_never() {
    // The fresh claim must stay within the grace for as long as the test runs,
    // however loaded the machine: with a 1 s grace, a first `release` that took
    // over a second under CI load let the second one release it too.
    let notes = tempfile::NamedTempFile::new().unwrap();
    let rig = Rig::new(
        "41",
        "s_0123456789ab",
        &format!(
            "[suspend]\nclaim_grace = \"10m\"\nnotify_command = [\"/bin/sh\", \"-c\", \"cat >> {}; echo >> {}\"]\n",
            notes.path().display(),
            notes.path().display()
        ),
    );
    let store = StateStore::open(&rig.state_dir).unwrap();
    let stale = uuid::Uuid::new_v4();
    let fresh = uuid::Uuid::new_v4();
    let live = uuid::Uuid::new_v4();
    dormant::state::testing::place(
        &store,
        stale,
        EnvStatus::Active,
        Some(job_holder(90)),
        3600,
        None,
    )
    .unwrap();
    dormant::state::testing::place(
        &store,
        fresh,
        EnvStatus::Active,
        Some(job_holder(91)),
        0,
        None,
    )
    .unwrap();
    dormant::state::testing::place(
        &store,
        live,
        EnvStatus::Active,
        Some(job_holder(92)),
        30,
        None,
    )
    .unwrap();
    let _alive = dormant::state::lock::LiveLock::hold(&store.job_live_file("41", 92)).unwrap();

    let out = rig.dormant(&["release", &stale.to_string()]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("which has no process left"),
        "{}",
        text(&out)
    );
    assert!(!store.env_paths(stale).exists());
    // Whoever waits for the environment hears what became of it, and why.
    let said = std::fs::read_to_string(notes.path()).unwrap();
    let heard: Vec<serde_json::Value> = said
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON: {l}: {e}")))
        .collect();
    assert!(
        heard.iter().any(|n| n["event"] == "release"
            && n["environment_id"] == stale.to_string()
            && n["reason"]
                .as_str()
                .is_some_and(|r| r.contains("job 90") && r.contains("no process left"))),
        "{said}"
    );

    let out = rig.dormant(&["release", &fresh.to_string()]);
    let t = text(&out);
    assert!(!out.status.success(), "within the grace: {t}");
    assert!(
        t.contains("held by job 91") && t.contains("--force") && !t.contains("Some("),
        "{t}"
    );
    let out = rig.dormant(&["release", "--force", &fresh.to_string()]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(!store.env_paths(fresh).exists());

    for args in [vec!["release", "--force"], vec!["release"]] {
        let mut args = args.clone();
        let id = live.to_string();
        args.push(&id);
        let out = rig.dormant(&args);
        let t = text(&out);
        assert!(!out.status.success(), "{t}");
        assert!(t.contains("in use by job 92"), "{t}");
    }
    assert!(store.env_paths(live).exists());
}

#[test]
fn a_resume_recovers_an_environment_whose_resuming_job_died() {
    let rig = Rig::new("41", "s_0123456789ab", GRACE);
    let r = rig.run(&job(5).suspend_on(true, false).script("echo kept > f"));
    let key = r.key.clone().unwrap();
    let id = dormant::envkey::EnvironmentKey::parse(&key).unwrap().env_id;
    let store = StateStore::open(&rig.state_dir).unwrap();
    // A runner killed during the resume's prepare: the record says resuming,
    // held by a job that has no process left, a while ago.
    dormant::state::testing::rewrite(&store, id, |status, claim, _| {
        *status = EnvStatus::Resuming;
        *claim = Some(dormant::state::Claim {
            holder: Holder::Job {
                runner_id: "41".into(),
                job_id: 77,
                mode: Mode::Resume,
                suspend_on_failure: false,
            },
            since: 1,
            last_activity: 1,
        });
    })
    .unwrap();
    let r = rig.run(&job(5).resume(&key).script("cat f"));
    assert_result(&r, JobResult::Success);
    assert!(
        r.log()
            .contains("was held by job 77 (resuming), which has no process left"),
        "{}",
        r.log()
    );
    assert!(r.log().contains("kept"), "{}", r.log());
}

#[test]
fn list_shows_every_directory_and_sweep_removes_the_recordless_ones() {
    let rig = Rig::new("41", "s_0123456789ab", GRACE);
    let store = StateStore::open(&rig.state_dir).unwrap();
    let orphan = store.env_paths(uuid::Uuid::new_v4());
    std::fs::create_dir_all(&orphan.dir).unwrap();
    std::fs::write(&orphan.lock, "").unwrap();
    let corrupt = store.env_paths(uuid::Uuid::new_v4());
    std::fs::create_dir_all(&corrupt.dir).unwrap();
    std::fs::write(&corrupt.record, "{ not json").unwrap();

    let out = rig.dormant(&["list", "--json"]);
    let t = String::from_utf8_lossy(&out.stdout).to_string();
    let lines: Vec<serde_json::Value> = t
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON: {l}: {e}")))
        .collect();
    assert_eq!(lines.len(), 2, "{t}");
    assert!(t.contains("no-record") && t.contains("unreadable"), "{t}");

    let out = rig.dormant(&["sweep"]);
    assert!(
        !out.status.success(),
        "the corrupt record is an error: {}",
        text(&out)
    );
    assert!(!orphan.dir.exists(), "removed: {}", text(&out));
    assert_eq!(
        std::fs::read_to_string(&corrupt.record).unwrap(),
        "{ not json",
        "never touched"
    );
}

#[test]
fn a_resume_within_the_grace_of_a_dead_holder_is_refused_saying_when_it_recovers() {
    let rig = Rig::new("41", "s_0123456789ab", "[suspend]\nclaim_grace = \"10m\"\n");
    let r = rig.run(&job(5).suspend_on(true, false));
    let key = r.key.clone().unwrap();
    let id = dormant::envkey::EnvironmentKey::parse(&key).unwrap().env_id;
    let store = StateStore::open(&rig.state_dir).unwrap();
    dormant::state::testing::rewrite(&store, id, |status, claim, _| {
        *status = EnvStatus::Active;
        *claim = Some(dormant::state::Claim::new(job_holder(78)));
    })
    .unwrap();
    let r = rig.run(&job(5).resume(&key));
    assert!(
        matches!(r.result, JobResult::BuildFailure(_)),
        "{}",
        r.log()
    );
    let log = r.log();
    assert!(
        log.contains("in use by job 78 (none of its processes has run for")
            && log.contains("suspend.claim_grace, 10m")
            && !log.contains("Some("),
        "{log}"
    );
    assert_eq!(rig.status(&key).as_deref(), Some("active"), "untouched");
}

#[test]
fn a_cleanup_sweeps_one_slice_and_dormant_sweep_the_rest() {
    // (A budget no slow disk runs out of: the slice is what is counted here.)
    let rig = Rig::new(
        "41",
        "s_0123456789ab",
        "[suspend]\nttl = \"1h\"\ncleanup_sweep_budget = \"10m\"\n",
    );
    let store = StateStore::open(&rig.state_dir).unwrap();
    const EXPIRED: usize = 200;
    for _ in 0..EXPIRED {
        let id = uuid::Uuid::new_v4();
        dormant::state::testing::place(&store, id, EnvStatus::Suspended, None, 7200, None).unwrap();
    }
    let count = || store.environment_ids().unwrap().len();
    // A job's cleanup: its own environment, then one slice of the others.
    assert_result(&rig.run(&job(5)), JobResult::Success);
    let slice = dormant::lifecycle::sweep::SLICE;
    assert_eq!(
        count(),
        EXPIRED - slice,
        "a cleanup looks at one slice only"
    );
    assert_result(&rig.run(&job(5)), JobResult::Success);
    assert_eq!(
        count(),
        EXPIRED - 2 * slice,
        "the next cleanup, the next slice"
    );
    let out = rig.dormant(&["sweep"]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(count(), 0, "dormant sweep looks at every environment");
}

/// A killed process's leftovers in `jobs/`: the temp file of a state write it
/// never renamed, and the lock and liveness files of a job with no state left.
/// The sweep removes those of jobs that are over, and nothing of a job that
/// still has state, a live process, or a write that may be in progress.
#[test]
fn sweep_removes_what_killed_processes_left_in_jobs() {
    let rig = Rig::new("7", "s_0123456789ab", GRACE);
    let jobs = rig.state_dir.join("jobs");
    std::fs::create_dir_all(&jobs).unwrap();
    let old = std::time::SystemTime::now() - std::time::Duration::from_secs(600);
    let put = |name: &str, age: Option<std::time::SystemTime>| {
        let path = jobs.join(name);
        let f = std::fs::File::create(&path).unwrap();
        if let Some(t) = age {
            f.set_modified(t).unwrap();
        }
        path
    };
    let gone = [
        put(".7-41.json.12345.tmp", Some(old)),
        put("7-42.lock", Some(old)),
        put("7-42.live", Some(old)),
        put("7-43.lock", Some(old)),
    ];
    // A write that may be in progress; a job that still has state.
    let kept = [
        put(".7-44.json.12346.tmp", None),
        put("7-45.lock", Some(old)),
        put("7-45.json", Some(old)),
    ];
    std::fs::write(&kept[2], b"{not json").unwrap();
    let (_live, live_lock) = {
        // A job whose stage process lives: its liveness lock is held.
        let lock = put("7-46.lock", Some(old));
        let live = dormant::state::lock::LiveLock::hold(&jobs.join("7-46.live")).unwrap();
        (live, lock)
    };
    let out = rig.dormant(&["sweep"]);
    let said = text(&out);
    for path in &gone {
        assert!(!path.exists(), "{} left: {said}", path.display());
    }
    for path in kept.iter().chain([&live_lock]) {
        assert!(path.exists(), "{} removed: {said}", path.display());
    }
}

/// Between two stages of a job no process of it runs (its liveness file is
/// unheld), but the process that runs its stages — GitLab Runner, here the
/// test — does: `release --force` refuses, naming that process, and the job
/// goes on in its environment. Once the job's state names a runner process
/// that no longer runs (the same pid with another start time: the pid was
/// reused), `--force` takes the environment.
#[test]
fn release_force_never_takes_the_environment_of_a_job_between_two_stages() {
    let rig = Rig::local("41", "s_0123456789ab");
    let store = StateStore::open(&rig.state_dir).unwrap();
    let only_env = || {
        let ids = store.environment_ids().unwrap();
        assert_eq!(ids.len(), 1, "{ids:?}");
        ids[0]
    };
    let j = job(5).script("echo built");
    let mut forced = None;
    let r = rig
        .runner
        .run_job_with(&j, &mut |name| {
            if name == "build_script" {
                forced = Some(rig.dormant(&["release", "--force", &only_env().to_string()]));
            }
        })
        .unwrap();
    assert_result(&r, JobResult::Success);
    assert!(r.log().contains("built"), "{}", r.log());
    let out = forced.expect("the job reached its build stage");
    let t = text(&out);
    assert!(!out.status.success(), "{t}");
    assert!(
        t.contains(&format!("held by job {}", j.id))
            && t.contains("between two of its stages")
            && t.contains(&format!("pid {}", std::process::id())),
        "{t}"
    );

    // The runner process the job's state names is not running any more.
    let j = job(5).script("echo built");
    let mut forced = None;
    let _ = rig
        .runner
        .run_job_with(&j, &mut |name| {
            if name == "build_script" {
                let file = store.job_file("41", j.id);
                let mut state: serde_json::Value =
                    serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
                assert_eq!(
                    state["runner_process"]["pid"],
                    std::process::id(),
                    "{state}"
                );
                state["runner_process"]["started"] = 1.into();
                std::fs::write(&file, serde_json::to_vec(&state).unwrap()).unwrap();
                let id = only_env();
                forced = Some((id, rig.dormant(&["release", "--force", &id.to_string()])));
            }
        })
        .unwrap();
    let (id, out) = forced.expect("the job reached its build stage");
    assert!(out.status.success(), "{}", text(&out));
    assert!(!store.env_paths(id).exists(), "released");
}
