//! One call of the driver, made the way the runner makes it: its own process
//! group, stdin `/dev/null`, the per-job temp dir as working directory, only
//! the environment composed for it, stdout and stderr into one pipe read line
//! by line (config's stdout apart: it is the protocol), and SIGTERM to the
//! whole process group when the job is canceled.

use std::collections::BTreeMap;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::job::When;
use super::report::Call;

/// How to make one call.
pub(super) struct CallSpec<'a> {
    pub binary: &'a Path,
    /// `*_args` from the runner's config, then the call's own arguments.
    pub args: Vec<String>,
    pub dir: &'a Path,
    pub env: &'a BTreeMap<String, String>,
    /// Keep stdout apart from the job log (config's JSON).
    pub capture_stdout: bool,
    /// SIGTERM the call's process group then.
    pub cancel_after: Option<When>,
    /// Then SIGKILL it this much later (the runner's escalation).
    pub force_kill: Option<Duration>,
    /// SIGKILL it then, with no SIGTERM first.
    pub kill_at: Option<When>,
    /// Start the call with SIGHUP ignored, as a runner started under `nohup`
    /// (or by a CI agent that ignores it) passes it on.
    pub ignore_sighup: bool,
}

/// Blocks until `when` (a file is polled every 20 ms); false if the call
/// ended first while waiting for a file (one that never comes must not keep
/// the thread).
fn wait_for(when: &When, ended: &std::sync::atomic::AtomicBool) -> bool {
    match when {
        When::After(d) => std::thread::sleep(*d),
        When::FileExists(f) => {
            while !f.exists() {
                if ended.load(std::sync::atomic::Ordering::Relaxed) {
                    return false;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
    true
}

/// Runs a call to its end. Returns the call (stdout+stderr in order, or only
/// stderr for `capture_stdout`) and the separate stdout.
pub(super) fn call(name: &str, spec: CallSpec<'_>) -> Result<(Call, String)> {
    let started = Instant::now();
    let mut cmd = Command::new(spec.binary);
    cmd.args(&spec.args)
        .current_dir(spec.dir)
        .env_clear()
        .envs(spec.env)
        .stdin(Stdio::null())
        .process_group(0);
    if spec.ignore_sighup {
        // SAFETY: signal(2) is async-signal-safe.
        unsafe {
            cmd.pre_exec(|| {
                libc::signal(libc::SIGHUP, libc::SIG_IGN);
                Ok(())
            });
        }
    }
    let (reader, writer) = std::io::pipe()?;
    let mut stdout_reader = None;
    if spec.capture_stdout {
        let (r, w) = std::io::pipe()?;
        cmd.stdout(w);
        stdout_reader = Some(r);
    } else {
        cmd.stdout(writer.try_clone()?);
    }
    cmd.stderr(writer);
    let mut child = cmd
        .spawn()
        .with_context(|| format!("starting {}", spec.binary.display()))?;
    // Our copies of the pipes' write ends must go, or the reads never end.
    drop(cmd);
    let pid = child.id() as i32;
    let out_thread = stdout_reader.map(|mut r| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = r.read_to_string(&mut s);
            s
        })
    });
    let force_kill = spec.force_kill;
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let killed_on = spec.kill_at.map(|when| {
        let done = done.clone();
        std::thread::spawn(move || {
            if !wait_for(&when, &done) {
                return;
            }
            // SAFETY: signals the call's process group, as an operator's kill -9 would.
            unsafe {
                libc::kill(-pid, libc::SIGKILL);
            }
        })
    });
    let killer = spec.cancel_after.map(|after| {
        let done = done.clone();
        std::thread::spawn(move || {
            if !wait_for(&after, &done) {
                return;
            }
            // A zero grace is the runner's escalation at its worst: the
            // SIGKILL right behind the SIGTERM, before the call has done
            // anything about it. Two kill(2)s cannot make that sure (under
            // load this thread can be descheduled between them long enough
            // for the call to finish its cancel), so the group is stopped
            // first: it receives both signals and never runs in between.
            if force_kill == Some(Duration::ZERO) {
                // SAFETY: signals the call's process group; SIGKILL follows.
                unsafe {
                    libc::kill(-pid, libc::SIGSTOP);
                }
            }
            // SAFETY: signals the call's process group, as the runner does.
            unsafe {
                libc::kill(-pid, libc::SIGTERM);
            }
            if let Some(grace) = force_kill {
                std::thread::sleep(grace);
                // SAFETY: as above; the runner's escalation after its grace.
                unsafe {
                    libc::kill(-pid, libc::SIGKILL);
                }
            }
        })
    });
    // Read line by line, noting when each line arrived, so tests can tell
    // live output from output that only appears when the call ends.
    let mut output = String::new();
    let mut raw = Vec::new();
    let mut arrivals = Vec::new();
    let mut lines = std::io::BufReader::new(reader);
    let mut buf = Vec::new();
    while std::io::BufRead::read_until(&mut lines, b'\n', &mut buf)? > 0 {
        let line = String::from_utf8_lossy(&buf).into_owned();
        arrivals.push((started.elapsed(), line.trim_end_matches('\n').to_string()));
        output.push_str(&line);
        raw.extend_from_slice(&buf);
        buf.clear();
    }
    let status = child.wait()?;
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    if let Some(k) = killer {
        let _ = k.join();
    }
    if let Some(k) = killed_on {
        let _ = k.join();
    }
    let stdout = out_thread
        .map(|t| t.join().unwrap_or_default())
        .unwrap_or_default();
    // Death by signal is an "unknown exit code" to the runner; keep the shell's
    // convention so a test can tell which signal it was.
    let exit_code = status
        .code()
        .unwrap_or_else(|| 128 + status.signal().unwrap_or(0));
    Ok((
        Call {
            name: name.to_string(),
            exit_code,
            elapsed: started.elapsed(),
            output,
            arrivals,
            raw,
        },
        stdout,
    ))
}

/// A fresh private temp dir (`custom-executor<random>`, 0700) for one prepare
/// attempt, as the runner makes one per attempt.
pub(super) fn temp_dir(root: &Path) -> Result<PathBuf> {
    std::fs::create_dir_all(root)?;
    for _ in 0..100 {
        let dir = root.join(format!(
            "{}{}",
            crate::contract::TEMP_DIR_PREFIX,
            fastrand::u64(..)
        ));
        if std::fs::create_dir(&dir).is_ok() {
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))?;
            return Ok(dir);
        }
    }
    bail!("cannot make a temp dir under {}", root.display())
}
