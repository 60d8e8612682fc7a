//! A private OpenSSH server for tests: its own host key, config and
//! authorized keys in a temp dir, listening on 127.0.0.1 at a free port, in
//! the foreground, stopped on drop. Reusable by any test that needs a real
//! SSH host (the `ssh` provider, the EC2 provider's routed instances).
//!
//! The binary is `$DORMANT_TEST_SSHD` or `/usr/sbin/sshd`; without one the
//! tests fail (never skip): run `scripts/install-test-deps.sh`.

#![allow(dead_code)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::harness::free_port;

/// How long sshd may take to say it is listening.
const START_TIMEOUT: Duration = Duration::from_secs(10);

pub struct Sshd {
    pub dir: tempfile::TempDir,
    pub port: u16,
    /// A key pair this server accepts: the "operator's" identity file.
    pub client_key: PathBuf,
    child: Child,
    binary: PathBuf,
}

impl Sshd {
    /// Starts a server that accepts `client_key`.
    pub fn start() -> Sshd {
        let binary = std::env::var_os("DORMANT_TEST_SSHD")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/usr/sbin/sshd"));
        assert!(
            binary.exists(),
            "no sshd at {} (DORMANT_TEST_SSHD): run scripts/install-test-deps.sh",
            binary.display()
        );
        // Debian's sshd refuses to start without its privilege-separation dir.
        let _ = std::fs::create_dir_all("/run/sshd");
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("home")).unwrap();
        // The sessions' TMPDIR, private to this server, so a test can see what
        // anything left in the host's temp dir.
        std::fs::create_dir(dir.path().join("tmp")).unwrap();
        keygen(&dir.path().join("host_ed25519"));
        let client_key = dir.path().join("client_ed25519");
        keygen(&client_key);
        let port = free_port();
        let pubkey = std::fs::read_to_string(client_key.with_extension("pub")).unwrap();
        std::fs::write(dir.path().join("authorized_keys"), pubkey).unwrap();
        let d = dir.path().display();
        std::fs::write(
            dir.path().join("sshd_config"),
            format!(
                "Port {port}\nListenAddress 127.0.0.1\nHostKey {d}/host_ed25519\nPidFile {d}/sshd.pid\n\
                 AuthorizedKeysFile {d}/authorized_keys\nUsePAM no\nPasswordAuthentication no\n\
                 KbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\nStrictModes no\n\
                 MaxSessions 50\nMaxStartups 100\nLogLevel VERBOSE\nSetEnv HOME={d}/home TMPDIR={d}/tmp\n"
            ),
        )
        .unwrap();
        let child = spawn(&binary, dir.path());
        let sshd = Sshd {
            dir,
            port,
            client_key,
            child,
            binary,
        };
        sshd.wait_listening(0);
        sshd
    }

    /// The TMPDIR of every session on this server.
    pub fn tmp_dir(&self) -> PathBuf {
        self.dir.path().join("tmp")
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("sshd.log")
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// SSH logins so far (each handshake dormant makes is one). Readiness
    /// probes, which only read sshd's banner, are TCP connections but no login.
    pub fn connections(&self) -> usize {
        self.log().matches("Accepted publickey for").count()
    }

    /// TCP connections accepted so far (logins and banner probes).
    pub fn tcp_connections(&self) -> usize {
        self.log().matches("Connection from 127.0.0.1").count()
    }

    /// Authorizes one more public key (e.g. an environment's own key).
    pub fn authorize(&self, public_key_line: &str) {
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(self.dir.path().join("authorized_keys"))
            .unwrap();
        writeln!(f, "{}", public_key_line.trim()).unwrap();
    }

    pub fn host_public_key(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("host_ed25519.pub")).unwrap()
    }

    /// The host key's fingerprint as ssh prints it (`SHA256:...`).
    pub fn host_fingerprint(&self) -> String {
        let out = Command::new("ssh-keygen")
            .arg("-l")
            .arg("-f")
            .arg(self.dir.path().join("host_ed25519.pub"))
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .nth(1)
            .unwrap()
            .to_string()
    }

    /// Restarts the server with a new host key on the same port, as a
    /// replaced (or impersonated) machine would look.
    pub fn swap_host_key(&mut self) {
        self.stop();
        for f in ["host_ed25519", "host_ed25519.pub"] {
            std::fs::remove_file(self.dir.path().join(f)).unwrap();
        }
        keygen(&self.dir.path().join("host_ed25519"));
        let before = self.log().matches("Server listening").count();
        self.child = spawn(&self.binary, self.dir.path());
        self.wait_listening(before);
    }

    /// Cuts every established connection: kills the per-connection sshd
    /// processes (the listener's children), as a network failure would.
    pub fn cut_connections(&self) -> usize {
        let children = children_of(self.child.id());
        for pid in &children {
            // SAFETY: kill(2) on a pid we just read as our sshd's child.
            unsafe {
                libc::kill(*pid as i32, libc::SIGKILL);
            }
        }
        children.len()
    }

    /// Freezes every established connection (SIGSTOP to its sshd processes:
    /// the listener's children and their sshd children), as a network that
    /// stops carrying anything would: nothing reaches either side, and
    /// neither side sees an end. Returns them for [`Sshd::kill`].
    pub fn freeze_connections(&self) -> Vec<u32> {
        let mut pids = Vec::new();
        for monitor in children_of(self.child.id()) {
            pids.push(monitor);
            for child in children_of(monitor) {
                let comm =
                    std::fs::read_to_string(format!("/proc/{child}/comm")).unwrap_or_default();
                if comm.starts_with("sshd") {
                    pids.push(child);
                }
            }
        }
        for pid in &pids {
            // SAFETY: kill(2) on pids just read as this server's connection processes.
            unsafe {
                libc::kill(*pid as i32, libc::SIGSTOP);
            }
        }
        pids
    }

    /// SIGKILLs processes [`Sshd::freeze_connections`] returned (a stopped
    /// process dies of SIGKILL too): the frozen connections end at once.
    pub fn kill(&self, pids: &[u32]) {
        for pid in pids {
            // SAFETY: as above.
            unsafe {
                libc::kill(*pid as i32, libc::SIGKILL);
            }
        }
    }

    /// Where the sessions' stages keep their output (`$TMPDIR/dormant-<uid>`).
    pub fn kept_dir(&self) -> PathBuf {
        // SAFETY: getuid has no preconditions.
        let uid = unsafe { libc::getuid() };
        self.tmp_dir().join(format!("dormant-{uid}"))
    }

    /// The files kept there, by name; not the directory of `dormant-ask`
    /// and `dormant-continue` (`bin-<version>`, docs/pause.md), which holds
    /// nothing of a job and stays for the next stage.
    pub fn kept_files(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(self.kept_dir())
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| !n.starts_with("bin-"))
                    .collect()
            })
            .unwrap_or_default();
        names.sort();
        names
    }

    /// Stops the server (established connections are cut too).
    pub fn stop(&mut self) {
        self.cut_connections();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts a stopped server again, same port, same host key.
    pub fn restart(&mut self) {
        let before = self.log().matches("Server listening").count();
        self.child = spawn(&self.binary, self.dir.path());
        self.wait_listening(before);
    }

    fn wait_listening(&self, seen_before: usize) {
        let start = Instant::now();
        while self.log().matches("Server listening").count() <= seen_before {
            assert!(
                start.elapsed() < START_TIMEOUT,
                "sshd did not start listening within {} s; its log:\n{}",
                START_TIMEOUT.as_secs(),
                self.log()
            );
            // Short: the resume benchmark takes "accepting" from here.
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

impl Drop for Sshd {
    fn drop(&mut self) {
        self.kill_kept_scripts();
        self.stop();
    }
}

impl Sshd {
    /// Kills the script groups of the stages still kept on this server (a
    /// paused script waiting in `dormant-ask`, a stage left running): a test
    /// that fails before it continues its paused script must not leave it
    /// waiting on this host. A group is killed only while its wrapper holds
    /// the stage's output (fd 3), as the machine's own scripts check: then
    /// the group id is the stage's, not a number reused since.
    fn kill_kept_scripts(&self) {
        use std::os::unix::fs::MetadataExt;
        let Ok(dir) = std::fs::read_dir(self.kept_dir()) else {
            return;
        };
        for entry in dir.flatten() {
            let path = entry.path();
            if path.extension().is_none_or(|e| e != "pid") {
                continue;
            }
            let Ok(text) = std::fs::read_to_string(&path) else {
                continue;
            };
            let mut it = text.split_whitespace().map(|w| w.parse::<i32>());
            let (Some(Ok(wrapper)), Some(Ok(group))) = (it.next(), it.next()) else {
                continue;
            };
            let (Ok(out), Ok(fd3)) = (
                std::fs::metadata(path.with_extension("out")),
                std::fs::metadata(format!("/proc/{wrapper}/fd/3")),
            ) else {
                continue;
            };
            if (out.dev(), out.ino()) == (fd3.dev(), fd3.ino()) && group > 1 {
                // SAFETY: kill has no memory-safety preconditions.
                unsafe {
                    libc::kill(-group, libc::SIGKILL);
                }
            }
        }
    }
}

fn spawn(binary: &Path, dir: &Path) -> Child {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(binary);
    // As systemd starts it: every signal at its default, whatever this test
    // process was started with (sshd passes an ignored one on to sessions).
    // SAFETY: reset_in_child calls only async-signal-safe functions.
    unsafe {
        cmd.pre_exec(dormant::transport::signals::reset_in_child);
    }
    cmd.arg("-D")
        .arg("-f")
        .arg(dir.join("sshd_config"))
        .arg("-E")
        .arg(dir.join("sshd.log"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "starting {}: {e}: run scripts/install-test-deps.sh",
                binary.display()
            )
        })
}

pub fn keygen(path: &Path) {
    let out = Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-f"])
        .arg(path)
        .output()
        .expect("ssh-keygen (openssh-client): run scripts/install-test-deps.sh");
    assert!(out.status.success(), "{out:?}");
}

/// Pids whose parent is `pid`.
pub fn children_of(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(p) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else {
            continue;
        };
        // "pid (comm) state ppid ..."; comm may hold spaces, so split after ')'.
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|s| s.parse::<u32>().ok());
        if ppid == Some(pid) {
            out.push(p);
        }
    }
    out
}

/// Whether a process is alive (and not a zombie).
/// Waits until `pid` is gone (or a zombie), or fails after 10 s: a hang
/// detector, not a speed check. A process sent SIGKILL dies when it is next
/// scheduled, which on a loaded machine is not at once; one that survived
/// (the tests' scripts sleep for minutes) is still there after 10 s.
#[track_caller]
pub fn assert_dies(pid: u32, what: &str) {
    let t = std::time::Instant::now();
    while alive(pid) {
        assert!(t.elapsed() < std::time::Duration::from_secs(10), "{what}");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

pub fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !matches!(
            stat.rsplit_once(')')
                .and_then(|(_, r)| r.split_whitespace().next()),
            Some("Z") | Some("X")
        ),
        Err(_) => false,
    }
}
