//! Unit tests of the notify hook: what it receives, and that a hanging or failing hook is cut and reported.
use super::*;
use std::time::Instant;

fn script(dir: &std::path::Path, name: &str, body: &str) -> String {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join(name);
    std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path.display().to_string()
}

fn sample() -> Notification {
    let mut n = Notification::new(Event::Suspend, Uuid::nil(), "local");
    n.key = Some("1/s_x/env=00000000-0000-0000-0000-000000000000".into());
    n.project_id = Some(5);
    n.project_path = Some("group/project".into());
    n.job_id = Some(77);
    n.job_url = Some("https://gitlab.example.com/group/project/-/jobs/77".into());
    n.machine = Some(Machine::new("i-0abc").with("region", "eu-central-1"));
    n.reason = Some("requested by the job: which schema?".into());
    n
}

#[tokio::test]
async fn the_hook_gets_one_json_document_on_stdin_and_its_arguments() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("got.json");
    let args = dir.path().join("args");
    let hook = script(
        dir.path(),
        "record",
        &format!("echo \"$@\" > {}; cat > {}", args.display(), out.display()),
    );
    let n = Notifier::new(
        vec![hook, "--to".into(), "ops".into()],
        Duration::from_secs(10),
    )
    .unwrap();
    n.send(&sample()).await.unwrap();
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(doc["event"], "suspend");
    assert_eq!(doc["key"], sample().key.unwrap().as_str());
    assert_eq!(doc["environment_id"], Uuid::nil().to_string());
    assert_eq!(doc["project_id"], 5);
    assert_eq!(doc["project_path"], "group/project");
    assert_eq!(doc["job_id"], 77);
    assert_eq!(
        doc["job_url"],
        "https://gitlab.example.com/group/project/-/jobs/77"
    );
    assert_eq!(doc["provider"], "local");
    assert_eq!(doc["machine"]["id"], "i-0abc");
    assert_eq!(doc["machine"]["fields"]["region"], "eu-central-1");
    assert_eq!(doc["reason"], "requested by the job: which schema?");
    assert!(doc["time"].as_str().unwrap().ends_with('Z'), "{doc}");
    assert_eq!(std::fs::read_to_string(&args).unwrap().trim(), "--to ops");
}

#[tokio::test]
async fn a_hanging_hook_and_what_it_started_are_killed_at_the_bound() {
    let dir = tempfile::tempdir().unwrap();
    let pidfile = dir.path().join("child.pid");
    // The hook starts a grandchild in its group and never reads stdin.
    let hook = script(
        dir.path(),
        "hang",
        &format!("sleep 300 & echo $! > {}; wait", pidfile.display()),
    );
    // (A bound the hook outlives, with room for it to start and record its
    // grandchild on a loaded machine.)
    let n = Notifier::new(vec![hook], Duration::from_secs(3)).unwrap();
    // Without the cut this returns Ok after 300 s (the hook exits 0).
    let err = n.send(&sample()).await.unwrap_err();
    assert!(matches!(err, NotifyError::Timeout { .. }), "{err}");
    let pid: i32 = std::fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    // The grandchild was killed with the group: gone (reaped) or a zombie.
    // SIGKILL takes effect when it is next scheduled, so poll a little.
    let deadline = Instant::now() + Duration::from_secs(5);
    let state = loop {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let state = stat.rsplit(')').next().unwrap_or("").trim().to_string();
        if state.is_empty() || state.starts_with('Z') || Instant::now() > deadline {
            break state;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(
        state.is_empty() || state.starts_with('Z'),
        "the hook's child still runs: {state}"
    );
    assert!(
        err.short().contains("did not finish within 3 s"),
        "{}",
        err.short()
    );
}

#[tokio::test]
async fn failures_say_what_happened_and_the_short_form_hides_the_output() {
    let dir = tempfile::tempdir().unwrap();
    let hook = script(dir.path(), "fail", "echo 'token=secret-ish' >&2; exit 3");
    let err = Notifier::new(vec![hook], Duration::from_secs(10))
        .unwrap()
        .send(&sample())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("exited with 3"), "{err}");
    assert!(err.to_string().contains("token=secret-ish"), "{err}");
    assert_eq!(err.short(), "the notify command exited with 3");
    let missing = Notifier::new(
        vec![dir.path().join("nope").display().to_string()],
        Duration::from_secs(10),
    )
    .unwrap()
    .send(&sample())
    .await
    .unwrap_err();
    assert!(matches!(missing, NotifyError::Spawn { .. }), "{missing}");
    assert!(missing.to_string().contains("nope"), "{missing}");
}

#[test]
fn no_command_means_no_notifier() {
    assert!(Notifier::new(vec![], Duration::from_secs(1)).is_none());
}

#[test]
fn rfc3339_matches_known_dates() {
    assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
    assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
    assert_eq!(rfc3339(1_700_000_000), "2023-11-14T22:13:20Z");
    assert_eq!(rfc3339(4_102_444_799), "2099-12-31T23:59:59Z");
}
