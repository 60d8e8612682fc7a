//! A job asks for its own suspension through `DORMANT_SUSPEND_FILE`: the
//! scripts see the path (local and ssh), and the transports read and remove
//! the request on the machine (the SSH side against the test sshd).

use std::time::Duration;

use crate::harness::*;
use crate::sshd::Sshd;

/// Every stage script sees the path; it lies in the builds dir beside the
/// checkout, and a script can write it.
#[test]
fn scripts_see_a_writable_suspend_file_beside_the_checkout() {
    let rig = Rig::local("91", "s_91aa91aa91aa");
    let r = rig.run(&job(9).script(
        "echo \"file=$DORMANT_SUSPEND_FILE\"; \
         case \"$DORMANT_SUSPEND_FILE\" in \"$CI_PROJECT_DIR\"/*) echo inside-checkout; exit 3;; esac; \
         echo 'Which schema?' > \"$DORMANT_SUSPEND_FILE\"",
    ));
    assert_result(&r, JobResult::Success);
    let log = r.log();
    let line = log
        .lines()
        .find_map(|l| l.strip_prefix("file="))
        .unwrap_or_else(|| panic!("no file= line: {log}"));
    let builds = r.config.as_ref().unwrap().builds_dir.clone().unwrap();
    assert_eq!(line, format!("{builds}/.dormant-suspend-request"));
}

/// Over SSH the request is read and removed with one command on the host; a
/// symlink planted there is removed, never followed.
#[tokio::test]
async fn the_ssh_transport_takes_the_request_on_the_host() {
    use dormant::context::{Ctx, JobLog};
    use dormant::provider::SshTarget;
    use dormant::settings::ssh::SshSettings;
    use dormant::state::EnvPaths;
    use dormant::transport::ssh::SshTransport;
    use dormant::transport::Transport;

    let sshd = Sshd::start();
    let state = tempfile::tempdir().unwrap();
    let paths = EnvPaths::new(state.path(), uuid::Uuid::new_v4());
    std::fs::create_dir_all(&paths.dir).unwrap();
    let (log, _) = JobLog::capture();
    let ctx = Ctx::new(
        log,
        tokio_util::sync::CancellationToken::new(),
        Duration::from_secs(60),
    );
    let t = SshTransport::new(
        SshTarget {
            host: "127.0.0.1".into(),
            port: sshd.port,
            user: "root".into(),
            identity_file: Some(sshd.client_key.clone()),
            workdir: None,
            on_login: None,
        },
        paths.clone(),
        SshSettings::default(),
    );
    t.connect(&ctx).await.unwrap();
    let builds = sshd.dir.path().join("builds");
    std::fs::create_dir(&builds).unwrap();
    let file = builds.join(dormant::job_request::FILE_NAME);
    let path = file.display().to_string();
    let before = sshd.connections();

    assert_eq!(
        dormant::job_request::take(&t, &path, &ctx).await.unwrap(),
        None
    );
    std::fs::write(&file, "Which schema should I use?\nsecond line\n").unwrap();
    assert_eq!(
        dormant::job_request::take(&t, &path, &ctx).await.unwrap(),
        Some("Which schema should I use?".to_string())
    );
    assert!(!file.exists(), "the request is removed once taken");

    let secret = sshd.dir.path().join("secret");
    std::fs::write(&secret, "not for the job log").unwrap();
    std::os::unix::fs::symlink(&secret, &file).unwrap();
    assert_eq!(
        dormant::job_request::take(&t, &path, &ctx).await.unwrap(),
        None
    );
    assert!(file.symlink_metadata().is_err() && secret.exists());
    assert_eq!(
        sshd.connections(),
        before,
        "taken over the open master, no new connection"
    );
    t.close(&ctx).await.unwrap();
}

/// The key prepare printed in the job log.
fn key_of(r: &JobReport) -> String {
    r.key
        .clone()
        .unwrap_or_else(|| panic!("no key in the job log:\n{}", r.log()))
}

#[test]
fn a_job_without_triggers_that_writes_the_file_is_suspended_and_its_job_log_says_why() {
    let rig = Rig::local("92", "s_92aa92aa92aa");
    let r = rig.run(&job(9).script(
        "echo kept > work.txt; echo 'Which schema should I migrate to?' > \"$DORMANT_SUSPEND_FILE\"",
    ));
    assert_result(&r, JobResult::Success);
    let key = key_of(&r);
    assert!(
        r.log().contains(
            "dormant: suspending: requested by the job: Which schema should I migrate to?"
        ),
        "job log:\n{}",
        r.log()
    );
    assert_eq!(
        rig.status(&key).as_deref(),
        Some("suspended"),
        "{}",
        r.cleanup_output()
    );
    assert!(
        r.cleanup_output().contains("requested by the job"),
        "{}",
        r.cleanup_output()
    );

    // The request was taken: the resumed job finds no file, and without a
    // trigger or a new request its environment is released at its end.
    let r2 = rig.run(
        &job(9)
            .resume(&key)
            .script("cat work.txt; test ! -e \"$DORMANT_SUSPEND_FILE\" || exit 9"),
    );
    assert_result(&r2, JobResult::Success);
    assert!(r2.log().contains("kept"), "{}", r2.log());
    assert_eq!(rig.status(&key), None, "released: {}", r2.cleanup_output());
}

#[test]
fn a_failed_job_that_asked_is_suspended_but_a_canceled_one_is_released() {
    let rig = Rig::local("93", "s_93aa93aa93aa");
    let failed =
        rig.run(&job(9).script("echo 'look at this failure' > \"$DORMANT_SUSPEND_FILE\"; exit 3"));
    assert_result(&failed, JobResult::BuildFailure(Some(3)));
    assert_eq!(rig.status(&key_of(&failed)).as_deref(), Some("suspended"));

    let mut canceled = job(9).script("echo 'asked' > \"$DORMANT_SUSPEND_FILE\"");
    canceled.after_script = Some("sleep 30".into());
    canceled.cancel = Some(("after_script".into(), Duration::from_millis(800)));
    let r = rig.run(&canceled);
    let key = key_of(&r);
    assert!(
        r.log().contains("suspending: requested by the job: asked"),
        "{}",
        r.log()
    );
    assert_eq!(rig.status(&key), None, "released: {}", r.cleanup_output());
    assert!(
        r.cleanup_output().contains("was canceled"),
        "{}",
        r.cleanup_output()
    );
}

#[test]
fn allow_job_request_false_ignores_the_request_with_a_warning() {
    let rig = Rig::new(
        "94",
        "s_94aa94aa94aa",
        "[suspend]\nallow_job_request = false\n",
    );
    let r = rig.run(&job(9).script("echo 'please keep it' > \"$DORMANT_SUSPEND_FILE\""));
    assert_result(&r, JobResult::Success);
    assert!(
        r.log().contains(
            "warning: the job asked to be suspended (please keep it) but this runner does not allow it"
        ),
        "{}",
        r.log()
    );
    assert_eq!(
        rig.status(&key_of(&r)),
        None,
        "released: {}",
        r.cleanup_output()
    );
    assert!(
        r.cleanup_output()
            .contains("ignored: suspend.allow_job_request = false"),
        "{}",
        r.cleanup_output()
    );
}

#[test]
fn a_job_on_an_ssh_host_suspends_itself() {
    let sshd = Sshd::start();
    let rig = Rig::new(
        "95",
        "s_95aa95aa95aa",
        &format!(
            "provider = \"ssh\"\n[ssh]\nworkspace_root = \"{}\"\nready_timeout = \"20s\"\n\
             [[ssh.hosts]]\nname = \"h\"\naddress = \"127.0.0.1\"\nport = {}\nuser = \"root\"\n\
             identity_file = \"{}\"\nslots = 4\n",
            sshd.dir.path().join("ws").display(),
            sshd.port,
            sshd.client_key.display()
        ),
    );
    let r = rig.run(&job(9).script("echo 'agent waits for a human' > \"$DORMANT_SUSPEND_FILE\""));
    assert_result(&r, JobResult::Success);
    assert!(
        r.log()
            .contains("suspending: requested by the job: agent waits for a human"),
        "{}",
        r.log()
    );
    // Said in the stage that wrote it: the wrapper reported the file, so the
    // run stage took it (a stage without a request takes no second command).
    let build = &r.call("build_script").unwrap().output;
    assert!(
        build.contains("suspending: requested by the job: agent waits for a human"),
        "{build}"
    );
    assert_eq!(rig.status(&key_of(&r)).as_deref(), Some("suspended"));
}
