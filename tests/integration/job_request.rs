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
    let builds = r.config.as_ref().unwrap()["builds_dir"].as_str().unwrap();
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
    paths.create().unwrap();
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
