//! Core scenarios on the `local` provider, each driving the built binary the
//! way GitLab Runner does.

use std::time::{Duration, Instant};

use crate::harness::*;

const RUNNER: &str = "12";
const SYSTEM: &str = "s_0123456789ab";

fn rig() -> Rig {
    Rig::local(RUNNER, SYSTEM)
}

/// Suspends a fresh environment that holds `keep.txt`; returns its key.
fn suspended_env(rig: &Rig, project: u64) -> String {
    let r = rig.run(
        &job(project)
            .suspend_on(true, false)
            .script("echo precious > keep.txt"),
    );
    assert_result(&r, JobResult::Success);
    let key = r.key.clone().expect("key printed");
    assert_eq!(
        rig.status(&key).as_deref(),
        Some("suspended"),
        "cleanup: {}",
        r.cleanup_output()
    );
    key
}

#[test]
fn a_successful_job_runs_every_stage_and_releases() {
    let rig = rig();
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
    assert!(key.starts_with("12/s_0123456789ab/env="), "{key}");
    assert!(
        !rig.env_dir(&key).exists(),
        "released: the environment directory is gone"
    );
    let jobs: Vec<_> = std::fs::read_dir(rig.state_dir.join("jobs"))
        .unwrap()
        .collect();
    assert!(
        jobs.is_empty(),
        "job state and lock are removed by cleanup: {jobs:?}"
    );
}

#[test]
fn config_prints_one_json_object_with_a_stable_builds_dir() {
    let rig = rig();
    let r = rig.run(&job(5));
    let cfg = r.config.clone().unwrap();
    assert_eq!(cfg.builds_dir_is_shared, Some(false));
    let driver = cfg.driver.unwrap();
    assert_eq!(driver.name.as_deref(), Some("dormant"));
    assert_eq!(driver.version.as_deref(), Some(env!("CARGO_PKG_VERSION")));
    assert!(cfg
        .builds_dir
        .unwrap()
        .starts_with(rig.state_dir.to_str().unwrap()));
    assert!(!cfg.cache_dir.unwrap().is_empty());
    // config wrote nothing to stderr and exactly one object to stdout (checked
    // by contract::ConfigOutput::parse, with the runner's rules).
    assert_eq!(r.call("config#1").unwrap().output, "");
}

#[test]
fn a_script_exit_code_is_passed_through() {
    let rig = rig();
    let r = rig.run(&job(5).script("echo failing; exit 7"));
    assert_result(&r, JobResult::BuildFailure(Some(7)));
    assert_eq!(
        r.call("build_script").unwrap().exit_code,
        1,
        "BUILD_FAILURE_EXIT_CODE"
    );
    assert!(
        r.ran("cleanup_file_variables"),
        "the runner goes on with the failure stages"
    );
}

#[test]
fn suspend_on_success_then_resume_finds_the_files_and_skips_get_sources() {
    let rig = rig();
    let first = rig.run(
        &job(5)
            .suspend_on(true, false)
            .script("echo precious > keep.txt; mkdir -p deps && echo lib > deps/x"),
    );
    assert_result(&first, JobResult::Success);
    let key = first.key.clone().unwrap();
    assert!(
        first
            .log()
            .contains("will be suspended if the job succeeds"),
        "{}",
        first.log()
    );
    assert_eq!(rig.status(&key).as_deref(), Some("suspended"));

    let mut second = job(5).resume(&key).suspend_on(true, false).script(
        "cat keep.txt deps/x; test ! -e .fetched-again; echo \"key=$DORMANT_ENVIRONMENT_KEY\"",
    );
    second.get_sources = "touch .fetched-again".into();
    let r = rig.run(&second);
    assert_result(&r, JobResult::Success);
    assert!(r.log().contains("precious"), "{}", r.log());
    assert!(r.log().contains("skipping get_sources"), "{}", r.log());
    assert!(
        r.log().contains(&format!("key={key}")),
        "scripts see DORMANT_ENVIRONMENT_KEY: {}",
        r.log()
    );
    assert_eq!(
        first.config.as_ref().unwrap().builds_dir,
        r.config.as_ref().unwrap().builds_dir,
        "a resumed job gets the same builds_dir, so the same CI_PROJECT_DIR"
    );
    assert_eq!(
        r.key.as_deref(),
        Some(key.as_str()),
        "the same key is printed again"
    );
    let rec = rig.record(&key).unwrap();
    assert_eq!(rec["status"], "suspended");
    assert_eq!(rec["job_count"], 2);
}

#[test]
fn suspend_on_failure_keeps_a_failing_job_and_releases_a_succeeding_one() {
    let rig = rig();
    let failing = rig.run(
        &job(5)
            .suspend_on(false, true)
            .script("echo debug-me > state.txt; exit 3"),
    );
    assert_result(&failing, JobResult::BuildFailure(Some(3)));
    let key = failing.key.clone().unwrap();
    assert_eq!(rig.status(&key).as_deref(), Some("suspended"));

    let ok = rig.run(&job(5).suspend_on(false, true));
    assert_result(&ok, JobResult::Success);
    assert!(
        !rig.env_dir(ok.key.as_deref().unwrap()).exists(),
        "succeeding job released"
    );

    // The developer steps into the failed job's environment.
    let r = rig.run(&job(5).resume(&key).script("cat state.txt"));
    assert!(r.log().contains("debug-me"), "{}", r.log());
}

#[test]
fn a_canceled_job_is_never_suspended_and_its_script_group_is_killed() {
    let rig = rig();
    let pidfile = rig.dir.path().join("child.pid");
    let ready = rig.dir.path().join("ready");
    let mut j = job(5).suspend_on(true, true).script(&format!(
        "sleep 300 & echo $! > {}; touch {}; wait",
        pidfile.display(),
        ready.display()
    ));
    // Canceled once the script has recorded its child, not after a guessed delay.
    j.cancel_on_file = Some(("build_script".into(), ready));
    let started = Instant::now();
    let r = rig.run(&j);
    assert_result(&r, JobResult::Canceled);
    let call = r.call("build_script").unwrap();
    assert_eq!(
        call.exit_code, 2,
        "terminated run is a system failure: {}",
        call.output
    );
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "run exited promptly after SIGTERM"
    );
    let pid: i32 = std::fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(
        !process_running(pid),
        "the script's background child {pid} was killed with its process group"
    );
    let key = r.key.clone().unwrap();
    assert!(
        !rig.env_dir(&key).exists(),
        "canceled → released, not suspended: {}",
        r.cleanup_output()
    );
}

#[test]
fn a_key_from_another_runner_or_system_is_refused_and_the_genuine_key_still_works() {
    let rig = rig();
    let key = suspended_env(&rig, 5);
    let rest = key.splitn(3, '/').nth(2).unwrap();
    for forged in [
        format!("99/{SYSTEM}/{rest}"),
        format!("{RUNNER}/s_otherrunner1/{rest}"),
    ] {
        let r = rig.run(&job(5).resume(&forged));
        assert_result(&r, JobResult::BuildFailure(None));
        assert!(
            r.log()
                .contains("honoured only by the runner manager that made it"),
            "{}",
            r.log()
        );
        assert_eq!(r.prepare_attempts, 1, "a refusal is not retried");
        assert_eq!(
            rig.status(&key).as_deref(),
            Some("suspended"),
            "the refused job touched nothing"
        );
    }
    let r = rig.run(&job(5).resume(&key).script("cat keep.txt"));
    assert_result(&r, JobResult::Success);
    assert!(r.log().contains("precious"));
}

#[test]
fn a_malformed_key_is_refused_clearly() {
    let rig = rig();
    for bad in [
        "not-a-key",
        "12/s_x",
        "12/s_x/env=not-a-uuid",
        "12/%zz/env=0b6e1f52-3c1d-4b8e-9a51-7f2d4f0d9c11",
    ] {
        let r = rig.run(&job(5).resume(bad));
        assert_result(&r, JobResult::BuildFailure(None));
        assert!(r.log().contains("is malformed"), "{bad}: {}", r.log());
        assert!(!r.ran("build_script"));
    }
}

#[test]
fn an_unknown_environment_is_refused_never_replaced_by_a_fresh_one() {
    let rig = rig();
    let key = format!("{RUNNER}/{SYSTEM}/env=0b6e1f52-3c1d-4b8e-9a51-7f2d4f0d9c11&provider=local");
    let r = rig.run(&job(5).resume(&key));
    assert_result(&r, JobResult::BuildFailure(None));
    assert!(
        r.log().contains("is not in this runner's registry"),
        "{}",
        r.log()
    );
    assert!(
        !r.ran("build_script"),
        "no fresh environment was made instead"
    );
    assert!(!rig.env_dir(&key).exists());
}

#[test]
fn another_projects_job_cannot_resume_the_environment() {
    let rig = rig();
    let key = suspended_env(&rig, 5);
    let r = rig.run(&job(6).resume(&key).script("cat keep.txt"));
    assert_result(&r, JobResult::BuildFailure(None));
    assert!(
        r.log()
            .contains("belongs to project 5, not to this job's project 6"),
        "{}",
        r.log()
    );
    assert!(!r.log().contains("precious"));
    assert_eq!(rig.status(&key).as_deref(), Some("suspended"));
}

#[test]
fn a_corrupt_record_is_an_error_naming_it_and_is_left_untouched() {
    let rig = rig();
    let key = suspended_env(&rig, 5);
    let record = rig.env_dir(&key).join("record.json");
    std::fs::write(&record, "{ this is not json").unwrap();
    let r = rig.run(&job(5).resume(&key));
    assert_result(&r, JobResult::SystemFailure);
    assert!(r.log().contains("is corrupt"), "{}", r.log());
    assert!(r.log().contains(record.to_str().unwrap()), "{}", r.log());
    assert_eq!(
        std::fs::read_to_string(&record).unwrap(),
        "{ this is not json"
    );
    assert!(
        rig.env_dir(&key).join("work/builds").exists(),
        "the environment's files are kept"
    );
    // A newer format is refused the same way.
    std::fs::write(&record, r#"{"version": 99}"#).unwrap();
    let r = rig.run(&job(5).resume(&key));
    assert!(
        r.log().contains("newer than this dormant understands"),
        "{}",
        r.log()
    );
}

#[test]
fn a_failed_resume_keeps_the_environment_suspended_across_prepare_retries() {
    let rig = rig();
    let key = suspended_env(&rig, 5);
    // The resume's prepare fails (the shell is missing) on every attempt.
    Rig::write_settings(
        &rig.settings_path,
        SYSTEM,
        "[local]\nshell = \"/nonexistent/bash\"\n",
    );
    let r = rig.run(&job(5).resume(&key).suspend_on(true, true));
    assert_result(&r, JobResult::SystemFailure);
    assert_eq!(
        r.prepare_attempts, 3,
        "the runner retried prepare with cleanup in between"
    );
    assert!(r.log().contains("stays suspended"), "{}", r.log());
    assert_eq!(
        rig.status(&key).as_deref(),
        Some("suspended"),
        "cleanup: {}",
        r.cleanup_output()
    );
    // Once the host is fixed, the environment resumes with its files.
    Rig::write_settings(&rig.settings_path, SYSTEM, "");
    let r = rig.run(&job(5).resume(&key).script("cat keep.txt"));
    assert_result(&r, JobResult::Success);
    assert!(r.log().contains("precious"));
}

#[test]
fn ttl_sweep_removes_only_expired_environments() {
    let rig = rig();
    let old = suspended_env(&rig, 5);
    let young = suspended_env(&rig, 5);
    // A TTL that the first environment has passed and the second has not,
    // however slow the machine: the first was suspended two hours ago.
    let store = dormant::state::StateStore::open(&rig.state_dir).unwrap();
    let id = dormant::envkey::EnvironmentKey::parse(&old).unwrap().env_id;
    dormant::state::testing::backdate(&store, id, 2 * 3600).unwrap();
    Rig::write_settings(&rig.settings_path, SYSTEM, "[suspend]\nttl = \"1h\"\n");
    let out = rig.dormant(&["sweep"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!rig.env_dir(&old).exists(), "expired environment released");
    assert_eq!(
        rig.status(&young).as_deref(),
        Some("suspended"),
        "young environment kept"
    );
}

#[test]
fn cleanup_sweeps_expired_environments_too() {
    let rig = rig();
    let old = suspended_env(&rig, 5);
    std::thread::sleep(Duration::from_secs(2));
    Rig::write_settings(&rig.settings_path, SYSTEM, "[suspend]\nttl = \"1s\"\n");
    let r = rig.run(&job(5));
    assert_result(&r, JobResult::Success);
    assert!(
        !rig.env_dir(&old).exists(),
        "cleanup's sweep released it: {}",
        r.cleanup_output()
    );
}

#[test]
fn two_jobs_run_in_parallel_in_separate_environments() {
    let rig = rig();
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(|| {
            rig.run(
                &job(5)
                    .suspend_on(true, false)
                    .script("sleep 1; echo a > who"),
            )
        });
        let b = s.spawn(|| {
            rig.run(
                &job(5)
                    .suspend_on(true, false)
                    .script("sleep 1; echo b > who"),
            )
        });
        (a.join().unwrap(), b.join().unwrap())
    });
    assert_result(&a, JobResult::Success);
    assert_result(&b, JobResult::Success);
    assert_ne!(a.key, b.key);
    for (r, who) in [(&a, "a"), (&b, "b")] {
        let key = r.key.as_deref().unwrap();
        let file = rig.env_dir(key).join("work/builds/group/project/who");
        assert_eq!(std::fs::read_to_string(file).unwrap().trim(), who);
    }
}

#[test]
fn two_jobs_racing_to_resume_one_key_one_wins_one_is_refused() {
    let rig = rig();
    let key = suspended_env(&rig, 5);
    // The winner holds the environment until the loser has been refused, not
    // for a guessed while: its script waits for a gate the test opens then.
    let gate = rig.dir.path().join("gate");
    let script = format!(
        "for i in $(seq 1200); do [ -e '{}' ] && break; sleep 0.1; done; cat keep.txt",
        gate.display()
    );
    let racer = || rig.run(&job(5).resume(&key).suspend_on(true, false).script(&script));
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(racer);
        let b = s.spawn(racer);
        let until = Instant::now() + Duration::from_secs(120);
        while !a.is_finished() && !b.is_finished() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(20));
        }
        std::fs::write(&gate, "").unwrap();
        (a.join().unwrap(), b.join().unwrap())
    });
    let results = [&a, &b];
    let winners: Vec<_> = results
        .iter()
        .filter(|r| r.result == JobResult::Success)
        .collect();
    let losers: Vec<_> = results
        .iter()
        .filter(|r| r.result != JobResult::Success)
        .collect();
    assert_eq!(winners.len(), 1, "a: {}\nb: {}", a.log(), b.log());
    assert!(winners[0].log().contains("precious"));
    assert_eq!(losers[0].result, JobResult::BuildFailure(None));
    assert!(
        losers[0].log().contains("is in use by job"),
        "{}",
        losers[0].log()
    );
    assert_eq!(
        rig.status(&key).as_deref(),
        Some("suspended"),
        "the loser did not disturb the winner"
    );
}

#[test]
fn secrets_never_reach_state_files_or_logs() {
    let rig = rig();
    let masked = format!(
        "masked-SIMULATED-SECRET-{}-{}",
        std::process::id(),
        job_id()
    );
    let secrets = [rig.secret_token().to_string(), masked.clone()];
    // A new environment suspended, then resumed and suspended again: every
    // stage and both kinds of cleanup saw the secrets.
    let r = rig.run(
        &job(5)
            .suspend_on(true, false)
            .masked_var("DEPLOY_PASSWORD", &masked),
    );
    assert_result(&r, JobResult::Success);
    let key = r.key.clone().unwrap();
    let r2 = rig.run(
        &job(5)
            .resume(&key)
            .suspend_on(true, false)
            .masked_var("DEPLOY_PASSWORD", &masked)
            .script("test -n \"$DEPLOY_PASSWORD\" || exit 9"),
    );
    assert_result(&r2, JobResult::Success);
    assert_eq!(rig.status(&key).as_deref(), Some("suspended"));
    let holds =
        |hay: &[u8], needle: &str| hay.windows(needle.len()).any(|w| w == needle.as_bytes());
    // The job log and the runner's log (cleanup): every call's output.
    for call in r.calls.iter().chain(&r2.calls) {
        for s in &secrets {
            assert!(
                !holds(call.output.as_bytes(), s),
                "{} printed the secret {s}",
                call.name
            );
        }
    }
    // Every file of the state dir (records, job state, the event log, keys,
    // the environment's own tree), byte for byte: a secret in a file that is
    // not UTF-8 is a leak too.
    let mut files = 0;
    let mut stack = vec![rig.state_dir.clone()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            let meta = std::fs::symlink_metadata(&path).unwrap();
            if meta.is_dir() {
                stack.push(path);
            } else if meta.is_file() {
                let bytes = std::fs::read(&path).unwrap();
                files += 1;
                for s in &secrets {
                    assert!(!holds(&bytes, s), "{} holds the secret {s}", path.display());
                }
            }
        }
    }
    assert!(
        files > 3,
        "only {files} files in the state dir: the walk missed it"
    );
    assert!(
        r.log().contains(&key) && !entries_of(&rig.state_dir.join("events")).is_empty(),
        "the job log and the event log were there to search"
    );
}

fn entries_of(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(dir)
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default()
}

#[test]
fn state_files_and_dirs_are_private() {
    use std::os::unix::fs::PermissionsExt;
    let rig = rig();
    let key = suspended_env(&rig, 5);
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&rig.state_dir), 0o700);
    assert_eq!(mode(&rig.env_dir(&key)), 0o700);
    assert_eq!(mode(&rig.env_dir(&key).join("record.json")), 0o600);
}

#[test]
fn suspension_disabled_by_the_operator_releases_with_a_warning() {
    let rig = Rig::new(RUNNER, SYSTEM, "[suspend]\nenabled = false\n");
    let r = rig.run(&job(5).suspend_on(true, true));
    assert_result(&r, JobResult::Success);
    assert!(
        r.log().contains("suspension is disabled on this runner"),
        "{}",
        r.log()
    );
    assert!(!rig.env_dir(r.key.as_deref().unwrap()).exists());
}

#[test]
fn bad_settings_fail_every_stage_with_the_key_named() {
    let rig = Rig::new(
        RUNNER,
        SYSTEM,
        "colour = \"blue\"\n[ec2]\nmarket = \"spott\"\n[suspend]\nttl = \"soon\"\n",
    );
    let r = rig.run(&job(5));
    assert_result(&r, JobResult::SystemFailure);
    let out = &r.call("config#1").unwrap().output;
    // Every problem in one run, also after a value that does not parse.
    for needle in [
        "3 problem(s)",
        "colour: unknown setting",
        "ec2.market: unknown variant `spott`",
        "suspend.ttl: \"soon\" is not a duration",
    ] {
        assert!(out.contains(needle), "missing {needle:?} in {out}");
    }
    assert_eq!(r.call("config#1").unwrap().exit_code, 2);
}

#[test]
fn a_missing_or_garbled_job_payload_is_a_clear_system_failure() {
    let rig = rig();
    let out = rig.dormant(&["config"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("JOB_RESPONSE_FILE is not set"));
    let payload = rig.dir.path().join("response.json");
    std::fs::write(&payload, "{\"id\": [garbage").unwrap();
    let out = std::process::Command::new(BIN)
        .arg("prepare")
        .env_clear()
        .envs(&rig.runner.env)
        .env("JOB_RESPONSE_FILE", &payload)
        .env("SYSTEM_FAILURE_EXIT_CODE", "42")
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(42),
        "the system failure code is read from the environment"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("not a valid job payload") && err.contains(payload.to_str().unwrap()),
        "{err}"
    );
}

#[test]
fn operator_commands_list_inspect_and_release() {
    let rig = rig();
    let key = suspended_env(&rig, 5);
    let out = rig.dormant(&["list"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("suspended") && text.contains(&key), "{text}");
    let out = rig.dormant(&["inspect", &key]);
    let rec: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(rec["project_id"], 5);
    let out = rig.dormant(&["release", &key]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!rig.env_dir(&key).exists());
    let out = rig.dormant(&["inspect", &key]);
    assert!(!out.status.success());
}

#[test]
fn release_inspect_and_events_refuse_bad_input_with_the_exit_codes_of_attach() {
    let rig = rig();
    let key = suspended_env(&rig, 6);
    // The same environment id under another system's key: a key another
    // runner manager made must never act on an environment here.
    let other = key.replacen(SYSTEM, "s_other0000000", 1);
    assert_ne!(other, key);
    let code = |args: &[&str]| {
        let out = rig.dormant(args);
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    for args in [
        &["release", other.as_str()][..],
        &["inspect", other.as_str()],
        &["events", other.as_str()],
    ] {
        let (c, e) = code(args);
        assert_eq!(c, Some(4), "{args:?}: {e}");
        assert!(
            e.contains("run this command on the runner manager that made the key"),
            "{args:?}: {e}"
        );
    }
    assert_eq!(
        rig.status(&key).as_deref(),
        Some("suspended"),
        "another runner manager's key released the environment"
    );
    let unknown = "5e5c1c3e-0000-4000-8000-000000000002";
    for args in [
        &["release", "not a key"][..],
        &["inspect", "not a key"],
        &["events", "not a key"],
        &["release", unknown],
        &["inspect", unknown],
    ] {
        let (c, e) = code(args);
        assert_eq!(c, Some(3), "{args:?}: {e}");
        assert!(
            e.contains("neither an environment key nor an environment id")
                || e.contains("is not in the registry"),
            "{args:?}: {e}"
        );
    }
    let (c, e) = code(&["release", &key]);
    assert_eq!(c, Some(0), "{e}");
}

#[test]
fn dormant_try_passes_on_the_local_provider() {
    let rig = rig();
    let out = rig.dormant(&["try"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("all checks passed"), "{text}");
    assert!(!text.contains("FAIL"), "{text}");
    // Job 1 asks through a job variable, so that path stays exercised.
    assert!(
        text.contains("job 1's suspension was read from its job variable"),
        "{text}"
    );
    // It shows pausing: job 1 asks, job 2 answers and the script goes on.
    assert!(
        text.contains("job 1's script asked a question (dormant-ask)"),
        "{text}"
    );
    assert!(
        text.contains("ok    job 2 continued job 1's paused script with an answer"),
        "{text}"
    );
    // The continue is a hot one (the script waits on this host), timed from
    // job 2's first call to the script's first byte after the answer.
    assert!(
        text.contains("job 2: resume with the key in the payload, hot (job 1's script waits on a host that never stops"),
        "{text}"
    );
    assert!(
        text.contains("after job 2's first call (a hot continue)"),
        "{text}"
    );
}

#[test]
fn script_output_reaches_the_job_log_live_not_at_the_end() {
    let rig = rig();
    let r = rig.run(&job(5).script("echo early-line; sleep 3; echo late-line"));
    assert_result(&r, JobResult::Success);
    let call = r.call("build_script").unwrap();
    assert_line_arrived_early(call, "early-line");
}

#[test]
fn a_machine_deleted_behind_our_back_fails_the_resume_once_and_clearly() {
    let rig = rig();
    let key = suspended_env(&rig, 5);
    std::fs::remove_dir_all(rig.env_dir(&key).join("work")).unwrap();
    let r = rig.run(&job(5).resume(&key));
    assert_result(&r, JobResult::BuildFailure(None));
    assert_eq!(
        r.prepare_attempts, 1,
        "retrying cannot bring the files back"
    );
    assert!(r.log().contains("its machine is gone"), "{}", r.log());
    assert!(
        r.log().contains("run the job without the key"),
        "{}",
        r.log()
    );
    assert!(
        !r.ran("build_script"),
        "no fresh environment was made instead"
    );
    // The record stays for the operator to look at and forget.
    assert_eq!(rig.status(&key).as_deref(), Some("suspended"));
    let out = rig.dormant(&["release", &key]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!rig.env_dir(&key).exists());
}
