//! The notify hook's README example, `examples/notify-merge-request.sh`,
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
