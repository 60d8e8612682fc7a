//! The person's side of a `dormant shell`, shared by a shell that claims the
//! environment (`claimed`) and one joined beside a job (`beside`): whether
//! there is a terminal, the signals that end a session, and running the
//! shell's command on this process's terminal until it exits or a signal
//! ends it.

use std::os::unix::process::ExitStatusExt;
use std::process::Stdio;

use anyhow::{Context, Result};
use tokio::signal::unix::{signal, SignalKind};

use crate::context::JobLog;

/// Whether the shell gets a terminal: a login shell (no `line`) asked for at
/// one. A command runs without, like `ssh host -- ...`.
pub fn wants_tty(line: Option<&str>) -> bool {
    // SAFETY: isatty only inspects the descriptor.
    line.is_none() && unsafe { libc::isatty(0) } == 1
}

/// Whether the terminal on stdin hung up (it has no foreground process
/// group any more).
pub fn hung_up() -> bool {
    // SAFETY: tcgetpgrp only inspects the descriptor.
    let pgrp = unsafe { libc::tcgetpgrp(0) };
    pgrp == -1
}

/// How a shell session ended.
#[derive(Debug, Clone, Copy)]
pub enum Ended {
    /// The shell exited with this code (128 + N for signal N).
    Exited(i32),
    /// A signal ended the session; the shell was killed.
    Signalled(Signal),
}

/// Runs `cmd` (the transport's shell command) on this process's stdin,
/// stdout and stderr until it exits, or a signal of `signals` ends it (then
/// it is killed; `after` says what becomes of the environment). A `dormant
/// shell` killed outright takes its shell (its ssh client, and with it the
/// connection) along: the child's parent-death signal.
pub async fn run(
    mut cmd: tokio::process::Command,
    signals: &Signals,
    log: &JobLog,
    after: &str,
) -> Result<Ended> {
    // SAFETY: prctl only sets this child's parent-death signal.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            Ok(())
        });
    }
    // In our process group (not its own, unlike stage channels): with a
    // terminal it must be in the foreground group to read from it.
    let mut child = cmd
        .stdin(Stdio::inherit())
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .context("starting the shell")?;
    tokio::select! {
        status = child.wait() => {
            let status = status.context("waiting for the shell")?;
            Ok(Ended::Exited(status.code().unwrap_or_else(|| 128 + status.signal().unwrap_or(0))))
        }
        s = signals.any(false) => {
            log.info(format!("{s}: ending the shell; {after}"));
            let _ = child.start_kill();
            let _ = child.wait().await;
            Ok(Ended::Signalled(s))
        }
    }
}

/// The signals that end a shell session: SIGTERM, SIGHUP (the terminal went
/// away) and, while the environment starts, SIGINT (Ctrl-C). Inside the shell
/// Ctrl-C belongs to the program there (the terminal sends it to both).
pub struct Signals {
    term: tokio::sync::Mutex<tokio::signal::unix::Signal>,
    hup: tokio::sync::Mutex<tokio::signal::unix::Signal>,
    int: tokio::sync::Mutex<tokio::signal::unix::Signal>,
}

/// A signal that ended (a step of) a session.
#[derive(Debug, Clone, Copy)]
pub enum Signal {
    Term,
    Hup,
    Int,
}

impl Signal {
    pub fn number(self) -> i32 {
        match self {
            Signal::Term => libc::SIGTERM,
            Signal::Hup => libc::SIGHUP,
            Signal::Int => libc::SIGINT,
        }
    }
}

impl std::fmt::Display for Signal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Signal::Term => "SIGTERM",
            Signal::Hup => "SIGHUP",
            Signal::Int => "SIGINT",
        })
    }
}

impl Signals {
    pub fn new() -> Result<Signals> {
        let listen = |k| signal(k).context("listening for signals");
        Ok(Signals {
            term: tokio::sync::Mutex::new(listen(SignalKind::terminate())?),
            hup: tokio::sync::Mutex::new(listen(SignalKind::hangup())?),
            int: tokio::sync::Mutex::new(listen(SignalKind::interrupt())?),
        })
    }

    /// The next signal that ends the session; SIGINT only with `interrupt`.
    pub async fn any(&self, interrupt: bool) -> Signal {
        let mut term = self.term.lock().await;
        let mut hup = self.hup.lock().await;
        let mut int = self.int.lock().await;
        tokio::select! {
            _ = term.recv() => Signal::Term,
            _ = hup.recv() => Signal::Hup,
            _ = int.recv(), if interrupt => Signal::Int,
        }
    }
}
