//! One stage over the environment's master with the direct wrapper
//! (`remote/direct.sh`: `ssh.reconnect_timeout = "0s"`, or a host that cannot
//! keep output; the default is [`super::kept`]): a multiplexed session opened
//! by dormant itself on the master's control socket (the `openssh` crate's
//! native mux client), so a stage starts no local `ssh` process at all.
//!
//! The session's three streams are pipes dormant owns: stdin carries the
//! script and then the control lines (`TERM` / `KILL`); stdout is relayed to
//! dormant's stdout ([`crate::transport::relay`]); stderr carries the
//! wrapper's reports. The master, which outlives the stage, holds only these
//! pipes, never the runner's: if dormant dies, the master sees its mux client
//! go and closes the session, the wrapper sees its stdin end and terminates
//! the script.

use std::time::Duration;

use anyhow::{anyhow, bail, Result};
use openssh::{Session, Stdio};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use super::remote::{self, Report};
use crate::context::Ctx;
use crate::transport::{relay, Ran, Script, ScriptExit};
use crate::wait::{Schedule, Wait};

/// After SIGTERM to the script's group, how long it may take to exit before
/// SIGKILL (the runner's scripts `trap 'exit 1' TERM`, so this is quick).
/// Kept stages use the same steps.
pub(super) const TERM_GRACE: Duration = Duration::from_secs(5);
/// After SIGKILL, how long to wait for the wrapper's exit report.
pub(super) const KILL_STEP: Duration = Duration::from_secs(5);

/// A stage's session, opened over the master, or why not.
pub(super) enum Opened<'s> {
    Child(openssh::Child<&'s Session>),
    /// The master's socket did not answer: nothing reached the machine.
    MasterUnreachable(String),
}

/// Opens a session running `line` (a wrapper's command line) with its three
/// streams piped, for `stage` on `dest`. Both wrappers' sessions start here.
pub(super) async fn open<'s>(
    session: &'s Session,
    line: &str,
    dest: &str,
    stage: &str,
) -> Result<Opened<'s>> {
    let spawned = session
        .raw_command(line)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .await;
    match spawned {
        Ok(child) => Ok(Opened::Child(child)),
        Err(e) if session.check().await.is_err() => Ok(Opened::MasterUnreachable(e.to_string())),
        Err(e) => bail!("opening a session on {dest} for {stage}: {e}"),
    }
}

/// How one attempt at a channel ended.
pub enum Once {
    Done(Ran),
    /// The master's socket did not answer: the script never left this host.
    MasterUnreachable(String),
}

/// What the wrapper reported so far.
#[derive(Debug, Default)]
struct Reports {
    pgid: Option<i64>,
    exit: Option<i32>,
    /// The watched file after the script: present or not.
    watched: Option<bool>,
    error: Option<String>,
    /// The remote shell's own messages, for the error when the channel breaks.
    other: Vec<String>,
}

/// Runs the uploaded script `body` (see [`remote::script_with_env`]) once over `session`.
pub async fn run_once(
    session: &Session,
    dest: &str,
    workdir: Option<&str>,
    body: &[u8],
    script: &Script<'_>,
    ctx: &Ctx,
) -> Result<Once> {
    let line = remote::command_line(body.len(), workdir, script.watch, None);
    let mut child = match open(session, &line, dest, script.stage).await? {
        Opened::Child(child) => child,
        Opened::MasterUnreachable(why) => return Ok(Once::MasterUnreachable(why)),
    };
    let (Some(mut stdin), Some(stdout), Some(stderr)) = (
        child.stdin().take(),
        child.stdout().take(),
        child.stderr().take(),
    ) else {
        bail!("the SSH session for {} has no pipes", script.stage);
    };

    // stdin: the script, then control lines until the stage is over.
    let (control, mut control_rx) = tokio::sync::mpsc::unbounded_channel::<&'static str>();
    let writer = async move {
        let mut r = stdin.write_all(body).await;
        while r.is_ok() {
            match control_rx.recv().await {
                Some(signal) => r = stdin.write_all(&remote::signal_line(signal)).await,
                None => break,
            }
        }
        r
    };
    let reader = async move {
        let mut reports = Reports::default();
        let mut lines = BufReader::new(stderr).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            reports.take(remote::parse_report(&line));
        }
        reports
    };
    let copy = relay::copy_to_stdout(stdout, script.copy);
    tokio::pin!(writer, reader, copy);

    // The stage ends with the wrapper's reports. SIGTERM escalates: `TERM`
    // to the script's group, a grace, `KILL`, a last wait for the report.
    // The writer (control lines) and the relay keep running meanwhile.
    let stage = async {
        tokio::select! {
            biased;
            reports = &mut reader => return (Some(reports), false),
            () = ctx.cancel.cancelled() => {}
        }
        ctx.log
            .info(format!("termination: stopping {} on {dest}", script.stage));
        let _ = control.send("TERM");
        // Already cancelled: the graces are bounded by their own lengths.
        let after = ctx.uncancellable();
        let grace = after.within(TERM_GRACE);
        let what = format!("{} on {dest} to stop after SIGTERM", script.stage);
        if let Ok(reports) = Wait::new(&grace, what, Schedule::fixed(TERM_GRACE))
            .event(&mut reader)
            .await
        {
            return (Some(reports), true);
        }
        ctx.log.info(format!(
            "{} did not stop within {} s of SIGTERM: killing it",
            script.stage,
            TERM_GRACE.as_secs()
        ));
        let _ = control.send("KILL");
        let grace = after.within(KILL_STEP);
        let what = format!("{} on {dest} to report after SIGKILL", script.stage);
        let reports = Wait::new(&grace, what, Schedule::fixed(KILL_STEP))
            .event(&mut reader)
            .await
            .ok();
        (reports, true)
    };
    let mut writing = true;
    let mut copying = true;
    let (reports, cancelled) = {
        tokio::pin!(stage);
        loop {
            tokio::select! {
                ended = &mut stage => break ended,
                r = &mut writer, if writing => {
                    writing = false;
                    if let Err(e) = r {
                        tracing::debug!("writing to the {} session: {e}", script.stage);
                    }
                }
                () = &mut copy, if copying => copying = false,
            }
        }
    };
    // Output still in flight, unless something that escaped the script's
    // group holds it open.
    if copying && !relay::drain(&mut copy).await {
        tracing::debug!(
            stage = script.stage,
            "a process that left the script's group still holds its output"
        );
    }
    // Closing stdin and the mux connection: the master closes the session.
    drop(control);
    drop(child);

    if cancelled {
        if reports.as_ref().is_none_or(|r| r.exit.is_none()) {
            ctx.log.warn(format!(
                "termination during {}: the script on {dest} did not report its end; \
                 it may still be running there",
                script.stage
            ));
        }
        return Ok(Once::Done(Ran {
            exit: ScriptExit::Cancelled,
            watched: None,
            // Without the end, the script may run on (the direct wrapper
            // stops it when its session goes; cleanup makes sure).
            left_running: reports.as_ref().is_none_or(|r| r.exit.is_none()),
            paused: None,
            paused_mid_line: false,
        }));
    }
    let reports = reports.unwrap_or_default();
    if let Some(code) = reports.exit {
        return Ok(Once::Done(Ran {
            exit: ScriptExit::Code(code),
            watched: reports.watched,
            left_running: false,
            paused: None,
            paused_mid_line: false,
        }));
    }
    if let Some(e) = reports.error {
        bail!("{e} ({dest})");
    }
    let said = if reports.other.is_empty() {
        String::new()
    } else {
        format!(": {}", reports.other.join("; "))
    };
    if session.check().await.is_err() {
        return Err(anyhow!(
            "the SSH connection to {dest} was lost during {}{said}",
            script.stage
        ));
    }
    Err(anyhow!(
        "the {} script on {dest} ended without reporting its exit status{said}: \
         its processes were killed on the host, or bash is missing there",
        script.stage
    ))
}

impl Reports {
    fn take(&mut self, report: Report) {
        match report {
            Report::Pgid(p) => {
                self.pgid = Some(p);
                // The script runs: what the shell said before is worth reading.
                for l in &self.other {
                    eprintln!("{l}");
                }
            }
            Report::Exit(c, _) => self.exit = Some(c),
            Report::Watched(present) => self.watched = Some(present),
            Report::Error(e) => self.error = Some(e),
            // The kept wrapper's reports; the direct one never says them.
            Report::Kept
            | Report::At(_)
            | Report::Paused(..)
            | Report::Relaying(_)
            | Report::Took => {}
            Report::Warn(text) => eprintln!("dormant: warning: {text}"),
            Report::Other(l) => {
                // The remote shell. Before the script starts it is held back
                // and quoted in the error if the script never starts.
                if self.pgid.is_some() {
                    eprintln!("{l}");
                }
                self.other.push(l);
            }
        }
    }
}
