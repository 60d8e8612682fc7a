//! The kept wrapper run under a local `sh` as sshd would run it, session by
//! session: the offset/resume protocol on the machine's side. Each session's
//! shell is started by a stand-in for its sshd process (a parent shell): a
//! "lost connection" is that parent's death with the session's stdin at end
//! of file and its output unread; dormant closing a session it is done with
//! is end of file while the parent lives.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use super::tests::{alive, as_sshd_would, wait_for};
use super::*;

const ENV: &str = "0123456789abcdef0123456789abcdef";

/// The pids a script wrote into `file` (`echo … > file`), once its line is
/// whole: the shell creates the file before `echo` writes into it, so a file
/// that exists may still be empty (the soak saw it, on a loaded machine).
#[track_caller]
fn pids_in(file: &Path) -> Vec<i32> {
    let whole = || std::fs::read_to_string(file).is_ok_and(|t| t.ends_with('\n'));
    wait_for(whole, "the script to start and write its pid");
    std::fs::read_to_string(file)
        .unwrap()
        .split_whitespace()
        .map(|p| p.parse().unwrap())
        .collect()
}

/// A machine: its temp dir, where the wrapper keeps output.
struct Machine {
    tmp: tempfile::TempDir,
}

/// Whatever a test left on the "machine" goes with it, paused stages too (as
/// the environment's release does): a test that ends with a script waiting
/// in `dormant-ask`, or one that failed midway, leaves no process behind.
impl Drop for Machine {
    fn drop(&mut self) {
        let _ = as_sshd_would(Command::new("sh"))
            .arg("-c")
            .arg(super::release_command(ENV))
            .env("TMPDIR", self.tmp.path())
            .output();
    }
}

impl Machine {
    fn new() -> Machine {
        Machine {
            tmp: tempfile::tempdir().unwrap(),
        }
    }

    /// The stage's files on the machine.
    fn files(&self, stage: &str) -> Vec<PathBuf> {
        let dir = self.kept_dir();
        let Ok(entries) = std::fs::read_dir(&dir) else {
            return Vec::new();
        };
        let mut found: Vec<PathBuf> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with(&format!("{ENV}.{stage}.")))
            })
            .collect();
        found.sort();
        found
    }

    /// Runs the leftovers script for the environment, as prepare
    /// (`check`) or cleanup would; its stdout.
    fn leftovers(&self, check: bool) -> String {
        let out = as_sshd_would(Command::new("sh"))
            .arg("-c")
            .arg(leftovers_command(ENV, check))
            .env("TMPDIR", self.tmp.path())
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).unwrap()
    }

    /// A paused stage of the environment (`build.P`: 300 000 bytes of
    /// output, NULs among them, and its `.paused`), so that a stage begun now
    /// relays; its path without extension and its output.
    fn paused_stage(&self) -> (PathBuf, Vec<u8>) {
        std::fs::create_dir_all(self.kept_dir()).unwrap();
        let p = self.kept_dir().join(format!("{ENV}.build.P"));
        let data: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(p.with_extension("P.out"), &data).unwrap();
        std::fs::write(p.with_extension("P.paused"), "1 0\n").unwrap();
        (p, data)
    }

    fn kept_dir(&self) -> PathBuf {
        // SAFETY: getuid has no preconditions.
        let uid = unsafe { libc::getuid() };
        self.tmp.path().join(format!("dormant-{uid}"))
    }

    fn file(&self, stage: &str, ext: &str) -> PathBuf {
        self.kept_dir().join(format!("{ENV}.{stage}.{ext}"))
    }

    /// Opens a session of `stage` in `mode`; `script` is uploaded unless following.
    fn session(&self, stage: &str, mode: Mode, script: &str, bound: u64, linger: u64) -> Sess {
        self.session_owned_by(stage, mode, script, bound, linger, None)
    }

    /// [`Machine::session`], with `owner` (when given) in place of the owner's
    /// functions: what the owner runs once it has started the follower.
    fn session_owned_by(
        &self,
        stage: &str,
        mode: Mode,
        script: &str,
        bound: u64,
        linger: u64,
        owner: Option<&str>,
    ) -> Sess {
        let body = match mode {
            Mode::Follow(_) => Vec::new(),
            _ => script_with_env(script.as_bytes(), &[]).unwrap(),
        };
        let kept = Kept {
            env: ENV,
            stage,
            mode,
            linger_secs: linger,
            bound,
        };
        let mut line = command_line(body.len(), None, None, Some(&kept));
        if let Some(owner) = owner {
            let functions = shell_quote(sent(Text::KeptOwner));
            assert!(line.contains(&functions));
            line = line.replace(&functions, &shell_quote(owner));
        }
        // The stand-in for the session's sshd process.
        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            // (holding none of the session's pipes itself, as sshd reads and
            // writes them through its own ends)
            .arg(
                "exec 3<&0 4>&1 5>&2 </dev/null >/dev/null 2>/dev/null; \
                 sh -c \"$1\" <&3 >&4 2>&5 3<&- 4>&- 5>&- & exec 3<&- 4>&- 5>&-; wait",
            )
            .arg("sshd")
            .arg(line)
            .env("TMPDIR", self.tmp.path())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = as_sshd_would(cmd).spawn().unwrap();
        child.stdin.as_mut().unwrap().write_all(&body).unwrap();
        let err = child.stderr.take().unwrap();
        let (tx, reports) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines() {
                let Ok(line) = line else { break };
                if tx.send(parse_report(&line)).is_err() {
                    break;
                }
            }
        });
        let out = child.stdout.take();
        Sess {
            child,
            out,
            reports,
        }
    }
}

/// One session: the wrapper's streams as dormant would see them.
struct Sess {
    child: Child,
    out: Option<std::process::ChildStdout>,
    reports: mpsc::Receiver<Report>,
}

impl Sess {
    /// The next report (waiting up to 20 s: a hang detector).
    fn report(&self) -> Report {
        self.reports
            .recv_timeout(Duration::from_secs(20))
            .expect("a report from the wrapper")
    }

    /// Reads reports until one matches.
    fn until(&self, want: impl Fn(&Report) -> bool) -> Report {
        loop {
            let r = self.report();
            if want(&r) {
                return r;
            }
            assert!(!matches!(r, Report::Error(_)), "{r:?}");
        }
    }

    /// Reads exactly `n` bytes of output.
    fn read(&mut self, n: usize) -> Vec<u8> {
        let mut buf = vec![0; n];
        self.out.as_mut().unwrap().read_exact(&mut buf).unwrap();
        buf
    }

    /// Reads up to `n` bytes of output: fewer when the output ends first.
    fn read_up_to(&mut self, n: usize) -> Vec<u8> {
        let mut buf = Vec::new();
        self.out
            .as_mut()
            .unwrap()
            .take(n as u64)
            .read_to_end(&mut buf)
            .unwrap();
        buf
    }

    fn send(&mut self, line: &str) {
        self.child
            .stdin
            .as_mut()
            .unwrap()
            .write_all(&signal_line(line))
            .unwrap();
    }

    /// The connection is lost: the session's sshd process goes, nobody
    /// writes to the session nor reads it (nor waits for its processes).
    fn cut(mut self) {
        let _ = self.child.kill();
        drop(self.child.stdin.take());
        drop(self.out.take());
        drop(self.reports);
        std::thread::spawn(move || self.child.wait());
    }

    /// dormant has everything (or died): it closes the session, whose sshd
    /// process lives on.
    fn close(mut self) {
        drop(self.child.stdin.take());
        std::thread::spawn(move || self.child.wait());
    }
}

/// Numbered lines, `n` of them, the last one unfinished, then `exit code`.
fn counting(n: u32, pause: &str, code: i32) -> (String, String) {
    let script =
        format!("for i in $(seq 1 {n}); do echo \"line $i\"; sleep {pause}; done; printf 'partial'; exit {code}");
    let mut want: String = (1..=n).map(|i| format!("line {i}\n")).collect();
    want.push_str("partial");
    (script, want)
}

#[test]
fn a_stage_runs_on_after_its_connection_and_a_new_session_continues_at_the_byte() {
    let m = Machine::new();
    let (script, want) = counting(20, "0.05", 255);
    let mut first = m.session("build.1", Mode::Start, &script, 1 << 20, 60);
    assert_eq!(first.report(), Report::Kept);
    let got = first.read(23);
    // Cut in the middle of a line.
    assert_eq!(String::from_utf8_lossy(&got), &want[..23]);
    first.cut();
    wait_for(
        || m.file("build.1", "exit").exists(),
        "the script to end on its own",
    );
    assert_eq!(
        std::fs::read_to_string(m.file("build.1", "out")).unwrap(),
        want,
        "the whole output kept"
    );
    let mut second = m.session("build.1", Mode::Follow(23), "", 1 << 20, 60);
    assert_eq!(second.report(), Report::At(23));
    let rest = second.read(want.len() - 23);
    assert_eq!(String::from_utf8_lossy(&rest), &want[23..]);
    assert_eq!(
        second.until(|r| matches!(r, Report::Exit(..))),
        Report::Exit(255, Some(want.len() as u64)),
        "the script's own 255, exactly"
    );
    second.close();
    wait_for(
        || m.files("build.1").is_empty(),
        "the stage's files to go once dormant closed the session",
    );
}

#[test]
fn a_session_follows_a_stage_still_running_and_three_cuts_lose_nothing() {
    let m = Machine::new();
    let (script, want) = counting(40, "0.05", 3);
    let mut s = m.session("build.2", Mode::Start, &script, 1 << 20, 60);
    assert_eq!(s.report(), Report::Kept);
    let mut got = Vec::new();
    for _ in 0..3 {
        got.extend(s.read(30));
        s.cut();
        s = m.session("build.2", Mode::Follow(got.len() as u64), "", 1 << 20, 60);
        assert_eq!(
            s.until(|r| matches!(r, Report::At(_))),
            Report::At(got.len() as u64)
        );
    }
    let Report::Exit(code, Some(len)) = s.until(|r| matches!(r, Report::Exit(..))) else {
        panic!()
    };
    got.extend(s.read(len as usize - got.len()));
    assert_eq!(String::from_utf8_lossy(&got), want);
    assert_eq!(code, 3);
    s.close();
    wait_for(|| m.files("build.2").is_empty(), "the files to go");
}

#[test]
fn a_session_lost_before_dormant_heard_of_the_start_is_followed_not_run_twice() {
    let m = Machine::new();
    let marker = m.tmp.path().join("runs");
    let script = format!("echo run >> '{}'; echo once; sleep 0.5", marker.display());
    let first = m.session("build.3", Mode::Start, &script, 1 << 20, 60);
    wait_for(|| marker.exists(), "the script to start");
    first.cut();
    // dormant never saw `dormant-kept`: it sends the script again, to retry.
    let mut retry = m.session("build.3", Mode::Retry, &script, 1 << 20, 60);
    assert_eq!(retry.until(|r| matches!(r, Report::At(_))), Report::At(0));
    assert_eq!(retry.read(5), b"once\n");
    assert!(matches!(
        retry.until(|r| matches!(r, Report::Exit(..))),
        Report::Exit(0, Some(5))
    ));
    retry.close();
    assert_eq!(std::fs::read_to_string(&marker).unwrap(), "run\n");
    // A retry whose first session never claimed the stage runs it.
    let mut fresh = m.session("build.4", Mode::Retry, "echo ran", 1 << 20, 60);
    assert_eq!(fresh.report(), Report::Kept);
    assert_eq!(fresh.read(4), b"ran\n");
    fresh.close();
}

#[test]
fn output_past_the_bound_waits_for_dormant_and_nothing_is_dropped() {
    let m = Machine::new();
    let bound = 64 * 1024;
    // 400 000 bytes: six times the bound.
    let script = "seq 1 60000 | sed 's/^/n/'; echo done".to_string();
    let full = {
        let out = Command::new("sh").arg("-c").arg(&script).output().unwrap();
        out.stdout
    };
    let mut s = m.session("build.5", Mode::Start, &script, bound, 60);
    assert_eq!(s.report(), Report::Kept);
    let first = s.read_up_to(10);
    assert_eq!(first, &full[..first.len()]);
    let from = first.len() as u64;
    s.cut();
    // Nobody takes the output: the pump stops at the bound and the script
    // waits on its pipe (it does not end, nothing is dropped).
    let out = m.file("build.5", "out");
    let len = || std::fs::metadata(&out).unwrap().len();
    wait_for(|| len() >= bound - 65536, "the output to reach its bound");
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert!(
        len() <= bound,
        "the kept output stays within its bound: {}",
        len()
    );
    assert!(
        !m.file("build.5", "exit").exists(),
        "the script waits for dormant"
    );
    // A re-attach takes it all, acknowledging as dormant does: the machine
    // drops what was taken and the script goes on to its end.
    let mut follow = m.session("build.5", Mode::Follow(from), "", bound, 60);
    assert_eq!(
        follow.until(|r| matches!(r, Report::At(_))),
        Report::At(from)
    );
    let mut got = first.clone();
    let mut most = 0u64;
    while got.len() < full.len() {
        let chunk = follow.read((full.len() - got.len()).min(16 * 1024));
        got.extend_from_slice(&chunk);
        follow.send(&format!("ACK {}", got.len()));
        let allocated = {
            use std::os::unix::fs::MetadataExt;
            std::fs::metadata(&out)
                .map(|m| m.blocks() * 512)
                .unwrap_or(0)
        };
        most = most.max(allocated);
    }
    let Report::Exit(0, Some(n)) = follow.until(|r| matches!(r, Report::Exit(..))) else {
        panic!()
    };
    assert_eq!(n, full.len() as u64);
    assert!(got == full, "every byte once, in order");
    // (The file's blocks: at most the bound past `.kept`, and a step of it
    // not yet punched.)
    assert!(most <= 2 * bound + 65536, "{most}");
    follow.close();
}

/// A relaying stage whose script writes without a pause (a background
/// writer that never stops) does not hold the relay back: the pump takes
/// turns, and the request is done while the writer still writes.
#[test]
fn a_relaying_pump_copies_while_the_script_writes_on() {
    let m = Machine::new();
    let (p, _) = m.paused_stage();
    let (splice, spliced) = (m.file("relay.2", "splice"), m.file("relay.2", "spliced"));
    let (splice, spliced, p) = (splice.display(), spliced.display(), p.display());
    let ticks = 1_000_000;
    let script = format!(
        "( yes t | head -c {} ) & w=$!\n\
         printf '%s %s %s\\n' 0 250000 '{p}' > '{splice}.c' && mv '{splice}.c' '{splice}'\n\
         until read -r n < '{spliced}' && [ \"$n\" = 250000 ]; do sleep 0.01; done 2>/dev/null\n\
         if kill -0 $w 2>/dev/null; then s=while-writing; else s=after-the-writer; fi\n\
         wait $w; printf '%s\\n' \"$s\"",
        2 * ticks
    );
    let total = 2 * ticks + 250_000;
    let bound = 64 * 1024;
    let mut s = m.session("relay.2", Mode::Start, &script, bound, 60);
    assert_eq!(s.report(), Report::Kept);
    // (Its last line: `while-writing` or, 3 bytes longer, `after-the-writer`.)
    let want = total + "while-writing\n".len();
    let mut got = Vec::new();
    while got.len() < want {
        let chunk = s.read((want - got.len()).min(16 * 1024));
        got.extend_from_slice(&chunk);
        s.send(&format!("ACK {}", got.len()));
    }
    assert!(
        got.ends_with(b"while-writing\n"),
        "the relay waited for the writer: {:?}",
        String::from_utf8_lossy(&got[got.len() - 20..])
    );
    s.close();
}

/// A stage whose output reached its bound with nobody taking it (dormant
/// was killed), then stopped by the cleanup: nothing of it stays, its pump
/// included, in either of the pump's ways (waiting in `dd`; polling, where
/// another stage is paused).
#[test]
fn a_stage_stopped_at_its_bound_leaves_no_pump() {
    for relaying in [false, true] {
        let m = Machine::new();
        if relaying {
            std::fs::create_dir_all(m.kept_dir()).unwrap();
            std::fs::write(m.kept_dir().join(format!("{ENV}.build.P.paused")), "1 0\n").unwrap();
        }
        let bound = 64 * 1024;
        let script = "seq 1 60000 | sed 's/^/n/'; echo done";
        let mut s = m.session("build.8", Mode::Start, script, bound, 60);
        assert_eq!(s.report(), Report::Kept);
        s.read_up_to(10);
        s.cut();
        let out = m.file("build.8", "out");
        let len = || std::fs::metadata(&out).map(|m| m.len()).unwrap_or(0);
        wait_for(|| len() >= bound - 65536, "the output to reach its bound");
        let (dev, ino) = {
            use std::os::unix::fs::MetadataExt;
            let md = std::fs::metadata(&out).unwrap();
            (md.dev(), md.ino())
        };
        // What the cleanup does when a stage did not end cleanly.
        m.leftovers(false);
        let holders = || {
            use std::os::unix::fs::MetadataExt;
            let mut pids = Vec::new();
            for e in std::fs::read_dir("/proc").unwrap().flatten() {
                let Ok(fds) = std::fs::read_dir(e.path().join("fd")) else {
                    continue;
                };
                if fds.flatten().any(|fd| {
                    std::fs::metadata(fd.path()).is_ok_and(|m| m.dev() == dev && m.ino() == ino)
                }) {
                    pids.push(e.file_name().to_string_lossy().to_string());
                }
            }
            pids
        };
        wait_for(
            || holders().is_empty(),
            &format!("no process holding the stage's output (relaying: {relaying})"),
        );
    }
}

/// In a stage begun while another stage of the environment is paused, the
/// pump writes a relay request's bytes (`.splice`, as `dormant-continue`
/// asks) after what the script wrote before, within the bound, byte for
/// byte (NULs too), each piece noted in `.map` where it went; a request for
/// a paused stage whose file is gone is given up, and the script's own
/// output flows on.
#[test]
fn a_relaying_pump_writes_the_paused_output_in_order_and_notes_each_piece() {
    let m = Machine::new();
    let (p, data) = m.paused_stage();
    let (splice, spliced) = (m.file("relay.1", "splice"), m.file("relay.1", "spliced"));
    let (splice, spliced, p) = (splice.display(), spliced.display(), p.display());
    let go = m.kept_dir().join("go");
    let go = go.display();
    let script = format!(
        "until [ -e '{go}' ]; do sleep 0.01; done\n\
         printf 'before\\n'\n\
         printf '%s %s %s\\n' 1000 250000 '{p}' > '{splice}.c' && mv '{splice}.c' '{splice}'\n\
         until read -r n < '{spliced}' && [ \"$n\" = 250000 ]; do sleep 0.01; done 2>/dev/null\n\
         printf 'after\\n'\n\
         printf '%s %s %s\\n' 0 10 '{p}.gone' > '{splice}.c' && mv '{splice}.c' '{splice}'\n\
         head -c 200000 /dev/zero | tr '\\0' x; printf end"
    );
    let mut want = b"before\n".to_vec();
    want.extend_from_slice(&data[1000..250_000]);
    want.extend_from_slice(b"after\n");
    want.extend(std::iter::repeat_n(b'x', 200_000));
    want.extend_from_slice(b"end");
    let bound = 64 * 1024;
    let mut s = m.session("relay.1", Mode::Start, &script, bound, 60);
    assert_eq!(s.report(), Report::Kept);
    // The pump held still while the script writes `before` and then asks:
    // once it goes on, it finds both, and what the script wrote first must
    // come first.
    let out = std::fs::metadata(m.file("relay.1", "out")).unwrap();
    let pump = || {
        use std::os::unix::fs::MetadataExt;
        std::fs::read_dir("/proc").unwrap().flatten().find_map(|e| {
            let pid: i32 = e.file_name().to_str()?.parse().ok()?;
            let fd = std::fs::metadata(e.path().join("fd/1")).ok()?;
            let comm = std::fs::read_to_string(e.path().join("comm")).ok()?;
            (fd.dev() == out.dev() && fd.ino() == out.ino() && comm.trim() != "dd").then_some(pid)
        })
    };
    wait_for(|| pump().is_some(), "the pump");
    let pid = pump().unwrap();
    // SAFETY: kill(2) on the pump's pid, just read from /proc.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    std::fs::write(m.kept_dir().join("go"), "").unwrap();
    wait_for(|| m.file("relay.1", "splice").exists(), "the request");
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    let mut got = Vec::new();
    while got.len() < want.len() {
        let chunk = s.read((want.len() - got.len()).min(16 * 1024));
        got.extend_from_slice(&chunk);
        s.send(&format!("ACK {}", got.len()));
    }
    let Report::Exit(0, Some(n)) = s.until(|r| matches!(r, Report::Exit(..))) else {
        panic!()
    };
    assert_eq!(n, want.len() as u64);
    let at = got.iter().zip(&want).take_while(|(a, b)| a == b).count();
    assert!(got == want, "every byte once, in order: they part at {at}");
    // The map: contiguous pieces of P from 1000 to 250000, the first right
    // after `before\n`, each noted before it was written.
    let map = std::fs::read_to_string(m.file("relay.1", "map")).unwrap();
    let pieces: Vec<(u64, u64, u64)> = map
        .lines()
        .map(|l| {
            assert_eq!(l.len(), 63, "a line is 64 bytes: {l:?}");
            let v: Vec<u64> = l.split_whitespace().map(|x| x.parse().unwrap()).collect();
            (v[0], v[1], v[2])
        })
        .collect();
    // (The request for a stage whose file is gone, after `after\n`, taking
    // turns with the script's `x`s: tried once, if before the script ends:
    // noted, then noted again at its real end, nothing written.)
    let (tried, pieces): (Vec<_>, Vec<_>) = pieces.into_iter().partition(|p| p.1 < 1000);
    assert!(
        tried.is_empty()
            || tried.len() == 2
                && tried[0].0 == tried[1].0
                && tried[0].0 >= 7 + 249_000 + 6
                && (tried[0].1, tried[0].2, tried[1].1, tried[1].2) == (0, 10, 0, 0),
        "{map}"
    );
    assert_eq!(pieces.first().map(|x| (x.0, x.1)), Some((7, 1000)), "{map}");
    assert_eq!(pieces.last().map(|x| x.2), Some(250_000), "{map}");
    for w in pieces.windows(2) {
        assert_eq!(w[0].2, w[1].1, "contiguous in P: {map}");
        assert_eq!(
            w[0].0 + (w[0].2 - w[0].1),
            w[1].0,
            "and in this stage: {map}"
        );
    }
    s.close();
}

#[test]
fn a_script_reopening_its_stdout_and_stderr_cannot_truncate_its_output() {
    let m = Machine::new();
    let script = "seq 1 20000; echo x >/dev/stderr; echo y >/dev/stdout; \
                  printf 'a\\0b' | tee /dev/stderr >/dev/null; exec >&2; echo after";
    let mut want: Vec<u8> = (1..=20000)
        .flat_map(|i| format!("{i}\n").into_bytes())
        .collect();
    want.extend_from_slice(b"x\ny\na\0bafter\n");
    let mut s = m.session("build.9", Mode::Start, script, 1 << 20, 60);
    assert_eq!(s.report(), Report::Kept);
    let got = s.read(want.len());
    let Report::Exit(0, Some(n)) = s.until(|r| matches!(r, Report::Exit(..))) else {
        panic!()
    };
    assert_eq!(n, want.len() as u64);
    assert!(
        got == want,
        "{:?}",
        String::from_utf8_lossy(&got[got.len() - 40..])
    );
    s.close();
}

#[test]
fn nobody_coming_back_stops_the_script_and_drops_its_files_after_the_linger() {
    let m = Machine::new();
    let pid_file = m.tmp.path().join("pid");
    let script = format!("echo $BASHPID > '{}'; sleep 300", pid_file.display());
    let s = m.session("build.6", Mode::Start, &script, 1 << 20, 1);
    assert_eq!(s.report(), Report::Kept);
    let pid = pids_in(&pid_file)[0];
    s.cut();
    assert!(alive(pid), "the script runs on without its connection");
    wait_for(|| !alive(pid), "the script to be stopped after the linger");
    wait_for(
        || m.files("build.6").is_empty(),
        "the files to go after the linger",
    );
}

/// A script that asks after its connection was lost (dormant may never come
/// back) is paused, not stopped by the loss timeout: it waits for its answer.
#[test]
fn a_script_that_asks_after_its_connection_was_lost_outlives_the_linger() {
    let m = Machine::new();
    let pid_file = m.tmp.path().join("pid");
    let go = m.tmp.path().join("go");
    let script = format!(
        "echo $BASHPID > '{}'; while [ ! -e '{}' ]; do sleep 0.05; done; dormant-ask 'q?'; sleep 300",
        pid_file.display(),
        go.display()
    );
    // The linger (5 s; counted in whole seconds, so 4 to 5) leaves the
    // script time to ask after the cut on a loaded machine: with 1 s it
    // could end before the script had asked (a flaky failure).
    let s = m.session("build.7", Mode::Start, &script, 1 << 20, 5);
    assert_eq!(s.report(), Report::Kept);
    let pid = pids_in(&pid_file)[0];
    s.cut();
    std::fs::write(&go, "").unwrap();
    wait_for(
        || m.file("build.7", "paused").exists(),
        "the owner to record the pause",
    );
    // No timed sleep past the linger: the owner, which alone would stop the
    // script at the linger's end, goes once the pause is recorded. Had it
    // lingered, it would have stopped the script before going.
    let owner: i32 = std::fs::read_to_string(m.file("build.7", "own"))
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    wait_for(|| !alive(owner), "the stage's owner to go");
    assert!(
        alive(pid),
        "the paused script was stopped by the loss timeout"
    );
    assert!(m.file("build.7", "ask").exists(), "the question is kept");
    m.leftovers(false);
    assert!(alive(pid), "leftovers spare a paused stage");
}

#[test]
fn a_term_line_and_a_newer_session_are_obeyed() {
    let m = Machine::new();
    let script = "trap 'echo trapped; exit 9' TERM; echo up; while :; do sleep 0.1; done";
    let mut first = m.session("build.7", Mode::Start, script, 1 << 20, 60);
    assert_eq!(first.report(), Report::Kept);
    assert_eq!(first.read(3), b"up\n");
    // A newer session takes the stage over: the old one's output ends.
    let mut second = m.session("build.7", Mode::Follow(3), "", 1 << 20, 60);
    assert_eq!(second.until(|r| matches!(r, Report::At(_))), Report::At(3));
    let mut rest = Vec::new();
    first.out.take().unwrap().read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty(), "{rest:?}");
    second.send("TERM");
    let Report::Exit(9, Some(len)) = second.until(|r| matches!(r, Report::Exit(..))) else {
        panic!("the script's trap decides the exit")
    };
    let rest = second.read(len as usize - 3);
    // (bash may say its `sleep` was terminated first: the script's own output.)
    assert!(
        rest.ends_with(b"trapped\n"),
        "{}",
        String::from_utf8_lossy(&rest)
    );
    second.close();
    first.cut();
    wait_for(|| m.files("build.7").is_empty(), "the files to go");
}

/// The owner polls for control lines; a poll that timed out in the middle
/// of a line lost what it had read, and the rest of the line was no command
/// (the soak lost a TERM that way, on a loaded machine). A line arriving in
/// two pieces, a poll's length apart, makes that moment sure.
#[test]
fn a_control_line_that_arrives_in_pieces_is_obeyed() {
    let m = Machine::new();
    let script = "echo up; sleep 300";
    for (stage, line, want) in [("build.13", "TERM", 143), ("build.14", "KILL", 137)] {
        let mut s = m.session(stage, Mode::Start, script, 1 << 20, 60);
        assert_eq!(s.report(), Report::Kept);
        assert_eq!(s.read(3), b"up\n");
        let (head, tail) = line.split_at(2);
        let stdin = s.child.stdin.as_mut().unwrap();
        stdin.write_all(head.as_bytes()).unwrap();
        stdin.flush().unwrap();
        std::thread::sleep(Duration::from_millis(300));
        stdin.write_all(format!("{tail}\n").as_bytes()).unwrap();
        let Report::Exit(code, _) = s.until(|r| matches!(r, Report::Exit(..))) else {
            unreachable!()
        };
        assert_eq!(code, want, "{line} split in two");
        s.close();
        wait_for(|| m.files(stage).is_empty(), "the files to go");
    }
}

#[test]
fn a_stage_whose_files_are_gone_says_so() {
    let m = Machine::new();
    std::fs::create_dir(m.kept_dir()).unwrap();
    let s = m.session("build.8", Mode::Follow(0), "", 1 << 20, 60);
    match s.report() {
        Report::Error(e) => assert!(e.starts_with("gone"), "{e}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn leftovers_are_stopped_and_their_files_removed() {
    let m = Machine::new();
    let pid_file = m.tmp.path().join("pid");
    let script = format!(
        "trap '' TERM; sleep 300 & echo \"$BASHPID $!\" > '{}'; wait",
        pid_file.display()
    );
    let s = m.session("build.9", Mode::Start, &script, 1 << 20, 600);
    assert_eq!(s.report(), Report::Kept);
    let pids = pids_in(&pid_file);
    assert_eq!(pids.len(), 2, "the script's shell and its sleep");
    s.cut();
    let run = |check: bool| m.leftovers(check);
    assert_eq!(run(true), "keep:ok\n");
    for pid in pids {
        // At once: the leftovers script returns only once the group is gone.
        assert!(!alive(pid), "{pid} survived, even ignoring SIGTERM");
    }
    assert!(m.files("build.9").is_empty(), "{:?}", m.files("build.9"));
    assert!(
        Path::new(&m.kept_dir()).is_dir(),
        "the user's directory stays"
    );
    assert_eq!(run(false), "", "nothing left: nothing said");
}

/// A stage whose script's group is gone while its wrapper has yet to record
/// the end: cleanup's leftovers script waits for the wrapper (and the owner
/// it sent TERM) before it removes the files. (It used to wait only for a
/// group it could signal: the soak found the end recorded after the
/// removal, left on the machine.)
#[test]
fn leftovers_wait_for_a_wrapper_still_recording_the_end() {
    let m = Machine::new();
    // A group that is gone: a child's, reaped.
    let mut gone = Command::new("true").spawn().unwrap();
    gone.wait().unwrap();
    let dir = m.kept_dir();
    std::fs::create_dir_all(&dir).unwrap();
    let (out, pid, exit) = (
        m.file("build.15", "out"),
        m.file("build.15", "pid"),
        m.file("build.15", "exit"),
    );
    // The wrapper as it is between the script's end and its record of it:
    // holding the output on fd 3, about to write the end.
    let mut wrapper = Command::new("bash")
        .arg("-c")
        .arg(format!(
            "exec 3>>'{}'; echo \"$$ {}\" > '{}'; sleep 0.5; echo '0 0' > '{}'; exec 3>&-",
            out.display(),
            gone.id(),
            pid.display(),
            exit.display()
        ))
        .spawn()
        .unwrap();
    pids_in(&pid);
    // And its owner, which marks the bound a moment after its TERM (it
    // finishes the command it is in), later than the wrapper's record.
    let own = m.file("build.15", "own");
    let mut owner = Command::new("bash")
        .arg("-c")
        .arg(format!(
            "exec 3<'{}'; trap \"sleep 0.8; echo 5 > '{}'; exit\" TERM; echo \"$$ \" > '{}'; \
             while :; do sleep 0.05; done",
            out.display(),
            m.file("build.15", "kept").display(),
            own.display()
        ))
        .spawn()
        .unwrap();
    pids_in(&own);
    assert_eq!(m.leftovers(false), "");
    wrapper.wait().unwrap();
    owner.wait().unwrap();
    assert!(m.files("build.15").is_empty(), "{:?}", m.files("build.15"));
}

#[test]
fn a_session_dormant_closes_mid_stage_stops_the_script_unless_it_said_keep() {
    let m = Machine::new();
    let pid_file = |n: &str| m.tmp.path().join(n);
    let script = |f: &Path| format!("echo $BASHPID > '{}'; sleep 300", f.display());
    // dormant died (or gave up) over a live connection: as with the direct
    // wrapper, the script goes, and what was kept with it.
    let (a, b) = (pid_file("a"), pid_file("b"));
    let s = m.session("build.10", Mode::Start, &script(&a), 1 << 20, 600);
    assert_eq!(s.report(), Report::Kept);
    let pid = pids_in(&a)[0];
    s.close();
    wait_for(|| !alive(pid), "the script to be stopped");
    wait_for(|| m.files("build.10").is_empty(), "the files to go");
    // KEEP: dormant follows again, the script runs on.
    let mut s = m.session("build.11", Mode::Start, &script(&b), 1 << 20, 600);
    assert_eq!(s.report(), Report::Kept);
    let pid = pids_in(&b)[0];
    s.send("KEEP");
    s.close();
    std::thread::sleep(Duration::from_millis(500));
    assert!(alive(pid), "KEEP: the script runs on");
    let mut again = m.session("build.11", Mode::Follow(0), "", 1 << 20, 600);
    assert_eq!(again.until(|r| matches!(r, Report::At(_))), Report::At(0));
    again.send("TERM");
    assert!(matches!(
        again.until(|r| matches!(r, Report::Exit(..))),
        Report::Exit(143, _)
    ));
    again.close();
    wait_for(|| m.files("build.11").is_empty(), "the files to go");
}

#[test]
fn a_script_that_arrives_incomplete_is_not_run_and_leaves_no_claim() {
    let m = Machine::new();
    let kept = Kept {
        env: ENV,
        stage: "build.12",
        mode: Mode::Start,
        linger_secs: 60,
        bound: 1 << 20,
    };
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg(command_line(100, None, None, Some(&kept)))
        .env("TMPDIR", m.tmp.path())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = as_sshd_would(cmd).spawn().unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"echo ran\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "");
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .ends_with("dormant-error the stage script arrived incomplete: not run\n"),
        "{out:?}"
    );
    assert!(m.files("build.12").is_empty(), "{:?}", m.files("build.12"));
}

#[test]
fn a_signal_to_dollar_dollar_that_ends_the_wrappers_wait_early_is_not_the_exit_code() {
    // As in the direct wrapper (tests.rs): the script's `kill $$` ends the
    // wrapper's `wait` early, the script's trap ends it with 7, often before
    // the wrapper looks again. Before, the kept wrapper reported 138 in 18
    // runs of 300 here (3 of 100 in another run).
    let m = Machine::new();
    let mut wrong = Vec::new();
    let runs = 300;
    for i in 0..runs {
        let stage = format!("sig{i}");
        let s = m.session(
            &stage,
            Mode::Start,
            "trap 'exit 7' USR1; kill -s USR1 $$; sleep 30 & wait $!\n",
            1 << 20,
            60,
        );
        let end = s.until(|r| matches!(r, Report::Exit(..)));
        if !matches!(end, Report::Exit(7, _)) {
            wrong.push(end);
        }
        s.close();
    }
    assert!(wrong.is_empty(), "{} of {runs}: {wrong:?}", wrong.len());
    for i in 0..runs {
        wait_for(|| m.files(&format!("sig{i}")).is_empty(), "the files to go");
    }
}

/// Whether `pid` is a live process following `out` (its command line names
/// the file): not a process that got the pid later.
fn follows(pid: i32, out: &Path) -> bool {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let out = out.as_os_str().as_encoded_bytes();
    alive(pid) && cmdline.split(|&b| b == 0).any(|arg| arg == out)
}

/// An owner killed right after it forked the follower, before it could record
/// the follower's pid anywhere: the follower ends by itself (`tail --pid`),
/// and the session is not held open by it. (Before, that `tail -f` followed
/// the output forever, and no later stage or cleanup knew of it.) dormant,
/// short of output, follows again: the new session takes over the stage
/// that has no owner, sends all of it, and removes its files at the end.
#[test]
fn a_follower_does_not_outlive_an_owner_killed_before_it_recorded_it() {
    let m = Machine::new();
    let record = m.tmp.path().join("follower");
    let gate = m.tmp.path().join("kill-the-owner");
    // In place of the owner's functions: note the follower's pid, wait (at
    // most a minute) until the test has seen the follower follow, then die
    // as an owner SIGKILLed at that point would. (Killed at once, the owner
    // could be gone before the follower ran at all: a follower that never
    // followed proves nothing about ending with its owner.)
    let owner = format!(
        "echo \"$f\" > '{}'; for i in $(seq 1200); do [ -e '{}' ] && break; sleep 0.05; done; \
         kill -s KILL $BASHPID",
        record.display(),
        gate.display()
    );
    let mut s = m.session_owned_by(
        "build.13",
        Mode::Start,
        "echo first; sleep 1; echo second",
        1 << 20,
        60,
        Some(&owner),
    );
    assert_eq!(s.report(), Report::Kept);
    let follower = pids_in(&record)[0];
    let out = m.file("build.13", "out");
    // (Its pid names the forked shell until it has exec'd tail.) A live
    // follower, following this stage's output: not one already gone.
    wait_for(|| follows(follower, &out), "the follower to start");
    std::fs::write(&gate, "").unwrap();
    let end = s.until(|r| matches!(r, Report::Exit(..)));
    assert!(matches!(end, Report::Exit(0, Some(13))), "{end:?}");
    wait_for(
        || !follows(follower, &out),
        "the follower of a killed owner to end",
    );
    // Nothing holds the session's output open any more: it ends.
    s.read_up_to(1 << 20);
    s.close();
    let mut again = m.session("build.13", Mode::Follow(0), "", 1 << 20, 60);
    assert_eq!(again.report(), Report::At(0));
    assert_eq!(again.read(13), b"first\nsecond\n");
    let end = again.until(|r| matches!(r, Report::Exit(..)));
    assert!(matches!(end, Report::Exit(0, Some(13))), "{end:?}");
    again.close();
    wait_for(|| m.files("build.13").is_empty(), "the files to go");
}

/// An owner SIGKILLed after it recorded itself (and its follower) in
/// `.own`: the follower ends with it (`tail --pid`) instead of holding the
/// session open; the wrapper still reports the end; and a new session finds
/// the recorded owner dead, takes the stage over, sends all of its output
/// and removes its files at the end.
#[test]
fn an_owner_killed_after_it_recorded_itself_is_taken_over() {
    let m = Machine::new();
    let gate = m.tmp.path().join("gate");
    let script = format!(
        "echo first; while [ ! -e '{}' ]; do sleep 0.05; done; echo second",
        gate.display()
    );
    let mut s = m.session("build.14", Mode::Start, &script, 1 << 20, 60);
    assert_eq!(s.report(), Report::Kept);
    assert_eq!(s.read(6), b"first\n");
    let own = m.file("build.14", "own");
    let recorded = || {
        let t = std::fs::read_to_string(&own).unwrap_or_default();
        let ids: Vec<i32> = t
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect();
        (t.ends_with('\n') && ids.len() == 2).then(|| (ids[0], ids[1]))
    };
    wait_for(|| recorded().is_some(), "the owner to record itself");
    let (owner, follower) = recorded().unwrap();
    let out = m.file("build.14", "out");
    assert!(follows(follower, &out), "the recorded follower follows");
    // SAFETY: kill(2) on the owner this test's session started.
    unsafe { libc::kill(owner, libc::SIGKILL) };
    wait_for(
        || !follows(follower, &out),
        "the follower of a killed owner to end",
    );
    std::fs::write(&gate, "").unwrap();
    // The wrapper reports the end; nothing holds the output open after it.
    let end = s.until(|r| matches!(r, Report::Exit(..)));
    assert!(matches!(end, Report::Exit(0, Some(13))), "{end:?}");
    s.read_up_to(1 << 20);
    s.close();
    let mut again = m.session("build.14", Mode::Follow(6), "", 1 << 20, 60);
    assert_eq!(again.report(), Report::At(6));
    assert_eq!(again.read(7), b"second\n");
    let end = again.until(|r| matches!(r, Report::Exit(..)));
    assert!(matches!(end, Report::Exit(0, Some(13))), "{end:?}");
    again.close();
    wait_for(|| m.files("build.14").is_empty(), "the files to go");
}

/// A host whose `tail` cannot end with its owner (BusyBox's takes no
/// `--pid`): prepare's probe says so, and its stages run direct.
#[test]
fn a_tail_without_pid_is_no_place_to_keep_output() {
    let m = Machine::new();
    let bin = m.tmp.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    let fake = bin.join("tail");
    std::fs::write(
        &fake,
        "#!/bin/sh\ncase \"$*\" in *--pid*) echo \"tail: unrecognized option\" >&2; exit 1;; esac\nexec /usr/bin/tail \"$@\"\n",
    )
    .unwrap();
    std::fs::set_permissions(&fake, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap());
    let out = as_sshd_would(Command::new("sh"))
        .arg("-c")
        .arg(leftovers_command(ENV, true))
        .env("TMPDIR", m.tmp.path())
        .env("PATH", path)
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "keep:no tail does not take --pid and -s (GNU coreutils' tail does)\n",
        "{out:?}"
    );
    assert_eq!(m.leftovers(true), "keep:ok\n", "with GNU tail");
}

/// A re-attach whose stage's files go while it waits for the stage's last
/// owner to let go (a cleanup on the machine removed them as dormant came
/// back): it says the output went, and ends; no bash complaint about the
/// file reaches dormant first. (Before, the open of `.out` failed with
/// bash's `No such file or directory` and the re-attach went on following
/// nothing.)
#[test]
fn a_reattach_whose_output_goes_while_it_waits_says_it_is_gone() {
    let m = Machine::new();
    std::fs::create_dir_all(m.kept_dir()).unwrap();
    let out = m.file("build.9", "out");
    std::fs::write(&out, "kept bytes\n").unwrap();
    // The last owner, still holding the output: the re-attach records
    // itself in `.own` (past its look at `.out`), then waits for it. (In a
    // group of its own, named as the stage's in `.pid`: whatever stops the
    // stage stops only it.)
    let mut owner = {
        use std::os::unix::process::CommandExt;
        Command::new("bash")
            .arg("-c")
            .arg("exec 3<\"$1\"; exec sleep 30")
            .arg("owner")
            .arg(&out)
            .process_group(0)
            .spawn()
            .unwrap()
    };
    let w = owner.id();
    std::fs::write(m.file("build.9", "pid"), format!("{w} {w}\n")).unwrap();
    wait_for(
        || {
            (0..10)
                .any(|fd| std::fs::read_link(format!("/proc/{w}/fd/{fd}")).is_ok_and(|l| l == out))
        },
        "the last owner to hold the output",
    );
    std::fs::write(m.file("build.9", "own"), format!("{w} -\n")).unwrap();
    let s = m.session("build.9", Mode::Follow(0), "", 1 << 20, 60);
    let own = m.file("build.9", "own");
    wait_for(
        || {
            std::fs::read_to_string(&own)
                .is_ok_and(|t| t.ends_with(" -\n") && !t.starts_with(&format!("{w} ")))
        },
        "the re-attach to record itself",
    );
    std::fs::remove_file(&out).unwrap();
    let r = s.report();
    let _ = owner.kill();
    let _ = owner.wait();
    assert!(
        matches!(&r, Report::Error(e) if e.contains("its files were removed as dormant came back")),
        "the first report of a re-attach whose output went: {r:?}"
    );
    s.close();
}
