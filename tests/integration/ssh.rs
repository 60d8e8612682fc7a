//! The SSH transport and the `ssh` provider against a real sshd on loopback
//! (`sshd.rs`): whole jobs through the built binary, as GitLab Runner drives it.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::harness::*;
use crate::sshd::{assert_dies, Sshd};
use dormant::runner_sim::SimJob;
use dormant::state::EnvPaths;

pub const RUNNER: &str = "77";

/// A runner whose provider is `ssh` with the test sshd as its one host.
pub fn ssh_rig(sshd: &Sshd) -> (Rig, PathBuf) {
    ssh_rig_with(sshd, "")
}

/// [`ssh_rig`] with more `[ssh]` settings (`key = value` lines).
pub fn ssh_rig_with(sshd: &Sshd, ssh: &str) -> (Rig, PathBuf) {
    let ws_root = sshd.dir.path().join("ws");
    let rig = Rig::new(
        RUNNER,
        "s_55aa55aa55aa",
        &format!(
            "provider = \"ssh\"\n[ssh]\nworkspace_root = \"{}\"\nready_timeout = \"20s\"\n{ssh}\n\
             [[ssh.hosts]]\nname = \"test-host\"\naddress = \"127.0.0.1\"\nport = {}\nuser = \"root\"\n\
             identity_file = \"{}\"\nslots = 8\n",
            ws_root.display(),
            sshd.port,
            sshd.client_key.display()
        ),
    );
    (rig, ws_root)
}

fn env_paths(rig: &Rig, job: &SimJob) -> EnvPaths {
    EnvPaths::new(
        &rig.state_dir,
        dormant::identity::new_env_id(RUNNER, job.id),
    )
}

fn workspace(ws_root: &Path, key: &str) -> PathBuf {
    ws_root.join(
        dormant::envkey::EnvironmentKey::parse(key)
            .unwrap()
            .env_id
            .to_string(),
    )
}

/// Runs a job and returns it with the number of SSH connections it made.
fn run_counted(rig: &Rig, sshd: &Sshd, job: &SimJob) -> (JobReport, usize) {
    let before = sshd.connections();
    let r = rig.run(job);
    (r, sshd.connections() - before)
}

#[test]
fn a_job_suspends_and_a_later_job_resumes_its_workspace_over_ssh_with_one_handshake_each() {
    let sshd = Sshd::start();
    let (rig, ws_root) = ssh_rig(&sshd);

    let first = job(41)
        .suspend_on(true, false)
        .script("echo kept > state.txt; echo \"key in job: $DORMANT_ENVIRONMENT_KEY\"; pwd");
    let (r, handshakes) = run_counted(&rig, &sshd, &first);
    assert_result(&r, JobResult::Success);
    let key = r.key.clone().expect("the key is printed");
    assert!(
        key.contains("provider=ssh") && key.contains("host=test-host"),
        "{key}"
    );
    assert!(
        r.log().contains(&format!("key in job: {key}")),
        "{}",
        r.log()
    );
    assert!(r.log().contains("pinned for environment"), "{}", r.log());
    assert!(
        r.log().contains("gitlab-runner is not installed"),
        "the probe warns about gitlab-runner: {}",
        r.log()
    );
    assert_eq!(
        handshakes,
        1,
        "one SSH handshake for the whole job; sshd log:\n{}",
        sshd.log()
    );
    assert_eq!(rig.status(&key).as_deref(), Some("suspended"));
    let ws = workspace(&ws_root, &key);
    let project = ws.join("builds/group/project");
    assert_eq!(
        std::fs::read_to_string(project.join("state.txt")).unwrap(),
        "kept\n"
    );
    let paths = env_paths(&rig, &first);
    assert!(
        !paths.control_dir.exists(),
        "suspend closed the master and removed its control dir"
    );
    assert!(paths.known_hosts.exists());

    let mut second = job(41)
        .resume(&key)
        .script("cat state.txt; test ! -e .fetched-by-job-2; pwd");
    second.get_sources = "touch .fetched-by-job-2".into();
    let (r2, handshakes) = run_counted(&rig, &sshd, &second);
    assert_result(&r2, JobResult::Success);
    assert!(r2.log().contains("kept"), "{}", r2.log());
    assert!(r2.log().contains("skipping get_sources"), "{}", r2.log());
    assert!(
        r2.log().contains(&project.display().to_string()),
        "same CI_PROJECT_DIR"
    );
    assert!(
        r2.log().contains("host key matches the one pinned"),
        "{}",
        r2.log()
    );
    assert_eq!(
        handshakes,
        1,
        "one handshake for the resumed job, release included; sshd log:\n{}",
        sshd.log()
    );
    assert!(!ws.exists(), "release removed the workspace");
    assert!(!paths.control_dir.exists());
    assert!(rig.record(&key).is_none());
}

#[test]
fn a_changed_host_key_is_refused_on_resume_naming_both_fingerprints() {
    let mut sshd = Sshd::start();
    let (rig, ws_root) = ssh_rig(&sshd);
    let r = rig.run(&job(42).suspend_on(true, false));
    assert_result(&r, JobResult::Success);
    let key = r.key.clone().unwrap();
    let pinned = sshd.host_fingerprint();

    sshd.swap_host_key();
    let offered = sshd.host_fingerprint();
    assert_ne!(pinned, offered);
    let r2 = rig.run(&job(42).resume(&key).script("echo must not run"));
    assert_result(&r2, JobResult::SystemFailure);
    let log = r2.log();
    let env_id = dormant::envkey::EnvironmentKey::parse(&key).unwrap().env_id;
    assert!(
        log.contains(&format!("the host key of environment {env_id} has changed")),
        "{log}"
    );
    assert!(
        log.contains(&pinned),
        "names the pinned key {pinned}: {log}"
    );
    assert!(
        log.contains(&offered),
        "names the offered key {offered}: {log}"
    );
    assert!(!log.contains("must not run"));
    assert!(
        !log.contains("waiting for SSH"),
        "a changed key is not retried: {log}"
    );
    assert_eq!(
        rig.status(&key).as_deref(),
        Some("suspended"),
        "a refused resume keeps the environment"
    );
    assert!(workspace(&ws_root, &key).exists());
}

#[test]
fn a_master_killed_between_stages_is_reconnected_and_the_job_succeeds() {
    let sshd = Sshd::start();
    let (rig, _ws) = ssh_rig(&sshd);
    let j = job(43).script("echo build ran over a new master");
    let ctl = env_paths(&rig, &j).control_dir;
    let before = sshd.connections();
    let r = rig.run_with_command_before(
        &j,
        "build_script",
        &format!("pkill -KILL -f '{}/.ssh-connection'", ctl.display()),
    );
    let handshakes = sshd.connections() - before;
    assert_result(&r, JobResult::Success);
    assert!(r.log().contains("is gone"), "{}", r.log());
    assert!(r.log().contains("reconnecting"), "{}", r.log());
    assert!(r.log().contains("build ran over a new master"));
    assert!(
        !r.log().contains("Control socket") && !r.log().contains("Connection closed"),
        "the failed first try is not noise in the job log: {}",
        r.log()
    );
    assert_eq!(handshakes, 2, "the reconnect is the only extra handshake");
    assert!(!ctl.exists());
}

/// With re-attaching off, a cut connection fails the stage at once, as it
/// did before stages outlived their connections.
#[test]
fn with_reconnect_timeout_0s_a_connection_cut_mid_script_is_a_system_failure() {
    let sshd = Sshd::start();
    let (rig, _ws) = ssh_rig_with(&sshd, "reconnect_timeout = \"0s\"");
    let marker = sshd.dir.path().join("cut-marker");
    let j = job(44).script(&format!(
        "echo started; echo $$ > '{}'; sleep 60; echo not reached",
        marker.display()
    ));
    let started = Instant::now();
    let r = std::thread::scope(|s| {
        let run = s.spawn(|| rig.run(&j));
        while std::fs::read_to_string(&marker).map_or(true, |t| !t.ends_with('\n')) {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "the script never started"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(sshd.cut_connections() > 0);
        run.join().unwrap()
    });
    assert_result(&r, JobResult::SystemFailure);
    let build = r.call("build_script").unwrap();
    assert_eq!(build.exit_code, 2, "{}", build.output);
    assert!(
        build.output.contains("SSH connection to root@127.0.0.1"),
        "{}",
        build.output
    );
    assert!(build.output.contains("was lost during build_script"));
    assert!(!build.output.contains("reconnect"), "{}", build.output);
    assert!(!r.log().contains("not reached"));
    assert!(started.elapsed() < Duration::from_secs(50));
    crate::reattach::assert_nothing_kept(&sshd);
    // Without a connection nobody can stop the script on the host; here the
    // host is this machine, so tidy up its process group.
    if let Ok(pid) = std::fs::read_to_string(&marker)
        .unwrap()
        .trim()
        .parse::<i32>()
    {
        // SAFETY: kill(2) on the process group the script's own pid leads (setsid).
        unsafe {
            libc::kill(-pid, libc::SIGKILL);
        }
    }
}

#[test]
fn sigterm_mid_script_kills_the_remote_process_group() {
    let sshd = Sshd::start();
    let (rig, _ws) = ssh_rig(&sshd);
    let pids = sshd.dir.path().join("pids");
    let ready = sshd.dir.path().join("ready");
    let mut j = job(45).script(&format!(
        "echo $BASHPID > '{p}'; sleep 300 & echo $! >> '{p}'; echo script running; touch '{r}'; wait",
        p = pids.display(),
        r = ready.display()
    ));
    // Canceled once the script is set up (the host is this machine), not
    // after a guessed delay.
    j.cancel_on_file = Some(("build_script".into(), ready));
    let r = rig.run(&j);
    assert_result(&r, JobResult::Canceled);
    let build = r.call("build_script").unwrap();
    assert!(build.output.contains("script running"), "{}", build.output);
    assert!(
        build.output.contains("termination: stopping build_script"),
        "{}",
        build.output
    );
    assert!(
        build.elapsed < Duration::from_secs(15),
        "run exits promptly: {:?}",
        build.elapsed
    );
    let text = std::fs::read_to_string(&pids).unwrap();
    let pids: Vec<u32> = text.lines().map(|l| l.trim().parse().unwrap()).collect();
    assert_eq!(pids.len(), 2, "{text}");
    for pid in pids {
        assert_dies(
            pid,
            &format!("remote process {pid} survived the termination"),
        );
    }
}

/// A script that ignores SIGTERM gets the grace, then SIGKILL: the stage
/// still ends, says so, and nothing of the script survives on the host.
#[test]
fn a_script_ignoring_sigterm_is_killed_after_the_grace() {
    let sshd = Sshd::start();
    let (rig, _ws) = ssh_rig(&sshd);
    let pids = sshd.dir.path().join("pids");
    let ready = sshd.dir.path().join("ready");
    let mut j = job(49).script(&format!(
        "trap '' TERM; echo $BASHPID > '{p}'; echo stubborn running; touch '{r}'; while :; do sleep 0.2; done",
        p = pids.display(),
        r = ready.display()
    ));
    j.cancel_on_file = Some(("build_script".into(), ready));
    let r = rig.run(&j);
    assert_result(&r, JobResult::Canceled);
    let build = r.call("build_script").unwrap();
    assert!(
        build.output.contains("stubborn running"),
        "{}",
        build.output
    );
    assert!(
        build
            .output
            .contains("build_script did not stop within 5 s of SIGTERM: killing it"),
        "{}",
        build.output
    );
    // The wrapper reported the end after SIGKILL: no "may still be running".
    assert!(
        !build.output.contains("may still be running"),
        "{}",
        build.output
    );
    let pid: u32 = std::fs::read_to_string(&pids)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_dies(pid, &format!("the script's shell {pid} survived SIGKILL"));
}

#[test]
fn a_script_writing_to_both_streams_keeps_its_order() {
    let sshd = Sshd::start();
    let (rig, _ws) = ssh_rig(&sshd);
    let r = rig.run(
        &job(46).script("for i in $(seq 1 30); do echo \"out-$i\"; echo \"err-$i\" >&2; done"),
    );
    assert_result(&r, JobResult::Success);
    let build = &r.call("build_script").unwrap().output;
    let lines: Vec<&str> = build
        .lines()
        .filter(|l| l.starts_with("out-") || l.starts_with("err-"))
        .collect();
    let want: Vec<String> = (1..=30)
        .flat_map(|i| [format!("out-{i}"), format!("err-{i}")])
        .collect();
    assert_eq!(lines, want);
}

#[test]
fn a_script_exiting_255_by_itself_is_a_build_failure() {
    let sshd = Sshd::start();
    let (rig, _ws) = ssh_rig(&sshd);
    let r = rig.run(&job(47).script("echo about to fail; exit 255"));
    assert_result(&r, JobResult::BuildFailure(Some(255)));
    assert!(!r.log().contains("connection"), "{}", r.log());
    // And a missing command (127, which the openssh crate treats specially) too.
    let r = rig.run(&job(47).script("no-such-command-here"));
    assert_result(&r, JobResult::BuildFailure(Some(127)));
}

#[test]
fn prepare_waits_for_a_host_that_is_not_up_yet_and_says_so() {
    let mut sshd = Sshd::start();
    let (rig, _ws) = ssh_rig(&sshd);
    sshd.stop();
    let started = Instant::now();
    let r = std::thread::scope(|s| {
        let run = s.spawn(|| rig.run(&job(48)));
        // Long enough for config and prepare to start and find the host down
        // on a loaded machine (prepare's first attempt comes at once).
        std::thread::sleep(Duration::from_secs(5));
        sshd.restart();
        run.join().unwrap()
    });
    assert_result(&r, JobResult::Success);
    let prepare = &r.call("prepare#1").expect("one prepare attempt").output;
    assert!(
        prepare.contains(&format!("waiting for SSH on root@127.0.0.1:{}", sshd.port)),
        "{prepare}"
    );
    assert!(
        prepare.contains("Connection refused"),
        "says why: {prepare}"
    );
    assert!(prepare.contains("SSH to root@127.0.0.1"), "{prepare}");
    // A hang detector only: the wait ends once the host is up.
    assert!(started.elapsed() < Duration::from_secs(60));
}

#[test]
fn a_host_that_never_comes_up_fails_prepare_within_ready_timeout() {
    let mut sshd = Sshd::start();
    let ws_root = sshd.dir.path().join("ws");
    let rig = Rig::new(
        RUNNER,
        "s_55aa55aa55aa",
        &format!(
            "provider = \"ssh\"\n[ssh]\nworkspace_root = \"{}\"\nready_timeout = \"2s\"\n\
             [[ssh.hosts]]\naddress = \"127.0.0.1\"\nport = {}\nuser = \"root\"\n\
             identity_file = \"{}\"\n",
            ws_root.display(),
            sshd.port,
            sshd.client_key.display()
        ),
    );
    sshd.stop();
    let started = Instant::now();
    let r = rig.run(&job(49));
    assert_result(&r, JobResult::SystemFailure);
    assert_eq!(r.prepare_attempts, 3);
    let prepare = &r.call("prepare#1").unwrap().output;
    assert!(prepare.contains("timed out waiting for SSH"), "{prepare}");
    assert!(
        prepare.contains("(last: port"),
        "says what it saw last: {prepare}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn processes_a_script_leaves_behind_do_not_outlive_its_stage() {
    let sshd = Sshd::start();
    let (rig, _ws) = ssh_rig(&sshd);
    let pidfile = sshd.dir.path().join("left-behind");
    let started = Instant::now();
    let r = rig.run(&job(50).script(&format!(
        "sleep 300 & echo $! > '{}'; echo leaving",
        pidfile.display()
    )));
    assert_result(&r, JobResult::Success);
    let build = r.call("build_script").unwrap();
    assert!(
        build.elapsed < Duration::from_secs(10),
        "the stage does not wait for its leftovers: {:?}",
        build.elapsed
    );
    let pid: u32 = std::fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_dies(pid, &format!("the leftover sleep {pid} was not killed"));
    assert!(started.elapsed() < Duration::from_secs(30));
}

#[test]
fn dormant_try_passes_on_the_ssh_provider() {
    let sshd = Sshd::start();
    let (rig, ws_root) = ssh_rig(&sshd);
    let before = sshd.connections();
    let out = rig.dormant(&["try"]);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    assert_eq!(
        sshd.connections() - before,
        2,
        "one handshake per job (try runs two): {text}"
    );
    assert_eq!(
        std::fs::read_dir(&ws_root).unwrap().count(),
        0,
        "try released its workspace"
    );
}

#[test]
fn a_suspended_workspace_frees_its_slot_and_a_full_host_makes_prepare_wait() {
    let sshd = Sshd::start();
    let ws_root = sshd.dir.path().join("ws");
    let rig = Rig::new(
        RUNNER,
        "s_55aa55aa55aa",
        &format!(
            "provider = \"ssh\"\n[ssh]\nworkspace_root = \"{}\"\nslot_wait = \"60s\"\n\
             [[ssh.hosts]]\nname = \"one-slot\"\naddress = \"127.0.0.1\"\nport = {}\nuser = \"root\"\n\
             identity_file = \"{}\"\nslots = 1\n",
            ws_root.display(),
            sshd.port,
            sshd.client_key.display()
        ),
    );
    // A suspended environment does not hold the host's only slot...
    let r = rig.run(&job(51).suspend_on(true, false));
    assert_result(&r, JobResult::Success);
    let r = rig.run(&job(52));
    assert_result(&r, JobResult::Success);
    assert!(!r.log().contains("busy"), "{}", r.log());

    // ...an active one does: the next job waits for it, saying so.
    let marker = sshd.dir.path().join("holding");
    let holder = job(53).script(&format!("touch '{}'; sleep 2", marker.display()));
    let (first, second) = std::thread::scope(|s| {
        let a = s.spawn(|| rig.run(&holder));
        let t = Instant::now();
        while !marker.exists() {
            assert!(t.elapsed() < Duration::from_secs(30));
            std::thread::sleep(Duration::from_millis(20));
        }
        let b = rig.run(&job(54));
        (a.join().unwrap(), b)
    });
    assert_result(&first, JobResult::Success);
    assert_result(&second, JobResult::Success);
    assert!(
        second
            .log()
            .contains("waiting for a free SSH host slot: every slot is busy (one-slot 1/1)"),
        "{}",
        second.log()
    );
    assert!(second.log().contains("got a slot on SSH host one-slot"));
}

#[test]
fn sigterm_while_waiting_for_ssh_ends_prepare_promptly() {
    let mut sshd = Sshd::start();
    let (rig, _ws) = ssh_rig(&sshd);
    sshd.stop();
    let mut j = job(55);
    // Late enough that prepare is waiting for SSH on a loaded machine.
    j.cancel = Some(("prepare".into(), Duration::from_secs(5)));
    let r = rig.run(&j);
    assert_result(&r, JobResult::Canceled);
    let prepare = r.call("prepare#1").unwrap();
    assert!(
        prepare.output.contains("waiting for SSH"),
        "{}",
        prepare.output
    );
    assert!(prepare.output.contains("cancelled"), "{}", prepare.output);
    // Well before the rig's 20 s ready_timeout would have ended the wait.
    assert!(
        prepare.elapsed < Duration::from_secs(12),
        "{:?}",
        prepare.elapsed
    );
}

/// The transport as the EC2 provider uses it: the environment's own key
/// (no identity file in the target), and an address that changes between
/// connections while the pinned host key stays valid.
#[tokio::test]
async fn the_environments_own_key_and_a_changed_address_keep_the_pin() {
    use dormant::context::{Ctx, JobLog};
    use dormant::provider::SshTarget;
    use dormant::settings::ssh::SshSettings;
    use dormant::transport::ssh::SshTransport;
    use dormant::transport::{Script, ScriptExit, Transport};

    let sshd = Sshd::start();
    let state = tempfile::tempdir().unwrap();
    let paths = EnvPaths::new(state.path(), uuid::Uuid::new_v4());
    std::fs::create_dir_all(&paths.dir).unwrap();
    let public = dormant::transport::keys::ensure_keypair(&paths).unwrap();
    sshd.authorize(&public);
    let (log, lines) = JobLog::capture();
    let ctx = Ctx::new(
        log,
        tokio_util::sync::CancellationToken::new(),
        Duration::from_secs(60),
    );
    for address in ["127.0.0.1", "localhost"] {
        let t = SshTransport::new(
            SshTarget {
                host: address.into(),
                port: sshd.port,
                user: "root".into(),
                identity_file: None,
                workdir: None,
                // Said in the job log, in the probes' one command.
                on_login: Some(format!(
                    "echo 'say:logged in to {address}'; echo 'warn:careful'; echo ignored"
                )),
            },
            paths.clone(),
            SshSettings::default(),
        );
        t.connect(&ctx).await.unwrap();
        let exit = t
            .run_script(
                &Script {
                    body: b"test -n \"$DORMANT_ENVIRONMENT_KEY\" && exit 7\n",
                    stage: "build_script",
                    env: &[("DORMANT_ENVIRONMENT_KEY".into(), "k".into())],
                    watch: None,
                    id: "build_script.1",
                    machine: None,
                    copy: None,
                    pause: None,
                    relayed: None,
                },
                &ctx,
            )
            .await
            .unwrap();
        assert_eq!(exit.exit, ScriptExit::Code(7));
        t.close(&ctx).await.unwrap();
        assert!(!paths.control_dir.exists());
    }
    let pinned = std::fs::read_to_string(&paths.known_hosts).unwrap();
    assert_eq!(pinned.lines().count(), 1, "{pinned}");
    assert!(
        pinned.starts_with(&format!("dormant-{} ", paths.id)),
        "{pinned}"
    );
    let text = String::from_utf8(lines.lock().unwrap().clone()).unwrap();
    assert!(text.contains("pinned for environment"), "{text}");
    assert!(text.contains("host key matches the one pinned"), "{text}");
    assert!(
        text.contains("dormant: logged in to 127.0.0.1\n")
            && text.contains("dormant: logged in to localhost\n")
            && text.contains("dormant: warning: careful\n")
            && !text.contains("ignored"),
        "{text}"
    );
}

#[test]
fn the_job_token_never_reaches_the_environment_of_the_ssh_master() {
    // The master lives between stages; before build_script, look at every
    // process's environment on this host for the simulated job token.
    let sshd = Sshd::start();
    let (rig, _) = ssh_rig(&sshd);
    let found = rig.dir.path().join("token-holders");
    let r = rig.run_with_command_before(
        &job(41),
        "build_script",
        &format!(
            "for f in /proc/[0-9]*/environ; do grep -qa -- '{}' \"$f\" 2>/dev/null && echo \"$f $(tr '\\0' ' ' < \"${{f%environ}}cmdline\")\"; done > {} || true",
            rig.secret_token(),
            found.display()
        ),
    );
    assert_result(&r, JobResult::Success);
    let holders = std::fs::read_to_string(&found).unwrap();
    assert!(
        holders.trim().is_empty(),
        "processes holding the job token: {holders}"
    );
}

#[test]
fn script_output_streams_live_over_ssh() {
    let sshd = Sshd::start();
    let (rig, _) = ssh_rig(&sshd);
    let r = rig.run(&job(41).script("echo early-line; sleep 3; echo late-line >&2"));
    assert_result(&r, JobResult::Success);
    let call = r.call("build_script").unwrap();
    assert_line_arrived_early(call, "early-line");
    assert!(call.arrived("late-line").is_some());
}
