//! The notify hook's example (docs/guide/notify.md), `examples/notify-merge-request.sh`,
//! against a fake GitLab API on loopback: it finds the job's merge request and
//! comments the key on it (and stays quiet for other events).

use std::path::Path;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use dormant::notify::{Event, Notification, Notifier};

use crate::harness::free_port;

/// Answers the three calls the script makes; records the note it posts and
/// the token it was sent with. Python's standard library only.
const FAKE_GITLAB: &str = r#"
import http.server, json, sys, urllib.parse
port, out = int(sys.argv[1]), sys.argv[2]
class H(http.server.BaseHTTPRequestHandler):
    def reply(self, code, doc):
        body = json.dumps(doc).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        if self.headers.get("PRIVATE-TOKEN") != "glpat-test":
            return self.reply(401, {"message": "401 Unauthorized"})
        if self.path == "/api/v4/projects/5/jobs/77":
            return self.reply(200, {"id": 77, "commit": {"id": "abc123"}})
        if self.path == "/api/v4/projects/5/repository/commits/abc123/merge_requests":
            return self.reply(200, [{"iid": 12}])
        self.reply(404, {"message": "404 Not Found"})
    def do_POST(self):
        n = int(self.headers.get("Content-Length", 0))
        form = urllib.parse.parse_qs(self.rfile.read(n).decode())
        with open(out, "a") as f:
            f.write(json.dumps({"path": self.path, "token": self.headers.get("PRIVATE-TOKEN"),
                                "body": form.get("body", [""])[0]}) + "\n")
        self.reply(201, {"id": 1})
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"#;

struct FakeGitlab {
    child: Child,
    port: u16,
}

impl FakeGitlab {
    fn start(dir: &Path) -> FakeGitlab {
        let port = free_port();
        let script = dir.join("fake_gitlab.py");
        std::fs::write(&script, FAKE_GITLAB).unwrap();
        let child = Command::new("python3")
            .arg(&script)
            .arg(port.to_string())
            .arg(dir.join("notes.jsonl"))
            .spawn()
            .expect("python3 runs the fake GitLab API");
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "the fake GitLab API did not start"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        FakeGitlab { child, port }
    }
}

impl Drop for FakeGitlab {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn notification(event: Event) -> Notification {
    let mut n = Notification::new(event, uuid::Uuid::nil(), "ec2");
    n.key = Some("42/s_0123456789ab/env=x&provider=ec2".into());
    n.project_id = Some(5);
    n.project_path = Some("group/project".into());
    n.job_id = Some(77);
    n.job_url = Some("https://gitlab.example.com/group/project/-/jobs/77".into());
    n.reason = Some("requested by the job: which schema?".into());
    n
}

#[tokio::test]
async fn the_readme_hook_comments_the_key_on_the_merge_request() {
    let dir = tempfile::tempdir().unwrap();
    let api = FakeGitlab::start(dir.path());
    let token = dir.path().join("token");
    std::fs::write(&token, "glpat-test\n").unwrap();
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/notify-merge-request.sh");
    let hook = Notifier::new(
        vec![
            "/usr/bin/env".into(),
            format!("GITLAB_API_URL=http://127.0.0.1:{}/api/v4", api.port),
            format!("GITLAB_TOKEN_FILE={}", token.display()),
            example.display().to_string(),
        ],
        Duration::from_secs(20),
    )
    .unwrap();

    hook.send(&notification(Event::Resume)).await.unwrap();
    assert!(
        !dir.path().join("notes.jsonl").exists(),
        "only a suspension is commented"
    );
    hook.send(&notification(Event::Suspend)).await.unwrap();
    let notes = std::fs::read_to_string(dir.path().join("notes.jsonl")).unwrap();
    let notes: Vec<serde_json::Value> = notes
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(notes.len(), 1, "{notes:?}");
    assert_eq!(
        notes[0]["path"],
        "/api/v4/projects/5/merge_requests/12/notes"
    );
    assert_eq!(notes[0]["token"], "glpat-test");
    let body = notes[0]["body"].as_str().unwrap();
    assert!(
        body.contains("DORMANT_ENVIRONMENT_KEY=42/s_0123456789ab/env=x&provider=ec2"),
        "{body}"
    );
    assert!(
        body.contains("dormant shell 42/s_0123456789ab/env=x&provider=ec2"),
        "{body}"
    );
    assert!(body.contains("which schema?"), "{body}");
    assert!(body.contains("/-/jobs/77"), "{body}");
}

/// A hook that appends each document to `docs.jsonl` beside it.
fn recorder(dir: &Path) -> (String, std::path::PathBuf) {
    use std::os::unix::fs::PermissionsExt;
    let out = dir.join("docs.jsonl");
    let hook = dir.join("record.sh");
    std::fs::write(&hook, format!("#!/bin/sh\ncat >> {}\n", out.display())).unwrap();
    std::fs::set_permissions(&hook, std::fs::Permissions::from_mode(0o755)).unwrap();
    (hook.display().to_string(), out)
}

fn documents(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn a_recording_hook_receives_suspend_resume_release_and_expire() {
    use crate::harness::*;
    let hooks = tempfile::tempdir().unwrap();
    let (hook, out) = recorder(hooks.path());
    let rig = Rig::new(
        "96",
        "s_96aa96aa96aa",
        &format!("[suspend]\nnotify_command = [\"{hook}\"]\n"),
    );
    let first = job(31).suspend_on(true, false);
    let r = rig.run(&first);
    assert_result(&r, JobResult::Success);
    let key = r.key.clone().unwrap();
    let docs = documents(&out);
    assert_eq!(docs.len(), 1, "{docs:?}\n{}", r.cleanup_output());
    let d = &docs[0];
    assert_eq!(d["event"], "suspend");
    assert_eq!(d["key"], key.as_str());
    let env_id = dormant::envkey::EnvironmentKey::parse(&key).unwrap().env_id;
    assert_eq!(d["environment_id"], env_id.to_string());
    assert_eq!(d["project_id"], 31);
    assert_eq!(d["project_path"], "group/project");
    assert_eq!(d["job_id"], first.id);
    assert_eq!(d["provider"], "local");
    assert!(
        d["machine"]["id"].as_str().unwrap().ends_with("/work"),
        "{d}"
    );
    assert_eq!(d["reason"], "job succeeded");
    assert_eq!(d["storage"], "machine");
    assert!(d["volume"].is_null(), "{d}");
    assert!(d["time"].as_str().unwrap().ends_with('Z'));

    // Resumed without a trigger: resume in prepare, release in cleanup.
    let second = job(31).resume(&key);
    let r = rig.run(&second);
    assert_result(&r, JobResult::Success);
    let docs = documents(&out);
    let events: Vec<&str> = docs.iter().map(|d| d["event"].as_str().unwrap()).collect();
    assert_eq!(events, ["suspend", "resume", "release"], "{docs:?}");
    for d in &docs[1..] {
        assert_eq!(d["key"], key.as_str());
        assert_eq!(d["job_id"], second.id);
    }
    assert_eq!(docs[1]["reason"], format!("resumed by job {}", second.id));
    assert_eq!(docs[2]["reason"], "job succeeded");

    // An environment past the TTL: expired by `dormant sweep`.
    let rig = Rig::new(
        "97",
        "s_97aa97aa97aa",
        &format!("[suspend]\nttl = \"1s\"\nnotify_command = [\"{hook}\"]\n"),
    );
    let r = rig.run(&job(31).suspend_on(true, false));
    let key = r.key.clone().unwrap();
    std::thread::sleep(Duration::from_millis(2100));
    let out_sweep = rig.dormant(&["sweep"]);
    assert!(out_sweep.status.success(), "{out_sweep:?}");
    let last = documents(&out).pop().unwrap();
    assert_eq!(last["event"], "expire", "{last}");
    assert_eq!(last["key"], key.as_str());
    assert!(last["reason"].as_str().unwrap().contains("TTL"), "{last}");
}

#[test]
fn a_hanging_or_failing_hook_is_cut_and_the_job_goes_on() {
    use crate::harness::*;
    use std::os::unix::fs::PermissionsExt;
    let hooks = tempfile::tempdir().unwrap();
    let hang = hooks.path().join("hang.sh");
    std::fs::write(&hang, "#!/bin/sh\nsleep 300\n").unwrap();
    std::fs::set_permissions(&hang, std::fs::Permissions::from_mode(0o755)).unwrap();
    let rig = Rig::new(
        "98",
        "s_98aa98aa98aa",
        &format!(
            "[suspend]\nnotify_command = [\"{}\"]\nnotify_timeout = \"1s\"\n",
            hang.display()
        ),
    );
    let r = rig.run(&job(32).suspend_on(true, false));
    assert_result(&r, JobResult::Success);
    let key = r.key.clone().unwrap();
    assert_eq!(rig.status(&key).as_deref(), Some("suspended"));
    assert!(
        r.cleanup_output()
            .contains("did not finish within 1 s: its process group was killed"),
        "{}",
        r.cleanup_output()
    );

    // A failing hook at a resume: one short line in the job log, without
    // what the hook printed; the job runs.
    let fail = hooks.path().join("fail.sh");
    std::fs::write(&fail, "#!/bin/sh\necho hook-private-output >&2\nexit 4\n").unwrap();
    std::fs::set_permissions(&fail, std::fs::Permissions::from_mode(0o755)).unwrap();
    Rig::write_settings(
        &rig.settings_path,
        "s_98aa98aa98aa",
        &format!("[suspend]\nnotify_command = [\"{}\"]\n", fail.display()),
    );
    let r = rig.run(&job(32).resume(&key));
    assert_result(&r, JobResult::Success);
    assert!(
        r.log()
            .contains("dormant: warning: the notify command exited with 4 (the job goes on)"),
        "{}",
        r.log()
    );
    assert!(!r.log().contains("hook-private-output"), "{}", r.log());
    assert!(
        r.cleanup_output().contains("hook-private-output"),
        "the runner's log has it all: {}",
        r.cleanup_output()
    );

    // The event log says each time the hook failed, about which environment
    // and job, with the whole error: the suspend (timed out), the resume and
    // the release at the end of the resumed job (exited with 4).
    let env = dormant::envkey::EnvironmentKey::parse(&key)
        .unwrap()
        .env_id
        .to_string();
    let failed: Vec<serde_json::Value> = crate::events::events_json(&rig, &[])
        .into_iter()
        .filter(|e| e["event"] == "notify_failed")
        .collect();
    let causes: Vec<&str> = failed
        .iter()
        .map(|e| e["cause"].as_str().unwrap())
        .collect();
    assert_eq!(causes, ["suspend", "resume", "release"], "{failed:?}");
    assert_eq!(failed[1]["job"], failed[2]["job"], "the resumed job's");
    assert_ne!(failed[0]["job"], failed[1]["job"], "{failed:?}");
    for e in &failed {
        assert_eq!(e["env"], env.as_str(), "{e}");
        assert_eq!(e["project"], 32, "{e}");
        assert!(e["job"].is_u64(), "{e}");
        assert_eq!(e["provider"], "local", "{e}");
    }
    let error = |i: usize| failed[i]["error"].as_str().unwrap_or_default().to_string();
    assert!(error(0).contains("did not finish within 1 s"), "{failed:?}");
    assert!(
        error(1).contains("exited with 4") && error(1).contains("hook-private-output"),
        "{failed:?}"
    );
}
