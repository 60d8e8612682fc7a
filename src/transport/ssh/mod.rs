//! The SSH transport: every stage script of a job runs over the one
//! ControlMaster prepare started (see [`master`]), as one multiplexed channel
//! running a small wrapper (see [`remote`]).
//!
//! Outcomes: the wrapper's `dormant-exit N` is the script's code (build
//! failure when not 0, including a script's own 255). A channel that ends
//! without it is the transport breaking, a system failure: the session check
//! tells a dead master (lost connection) from anything else. On SIGTERM the
//! script's whole remote process group is killed through a second channel —
//! killing the local ssh client would leave it running on the host.
//!
//! The channel's `ssh` client runs in its own process group: the runner's
//! SIGTERM goes to dormant's group, and dormant, not the signal, decides
//! what happens to the channel.

pub mod master;
pub mod remote;

use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use async_trait::async_trait;
use openssh::Session;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::Command;

use self::master::{Master, Purpose};
use self::remote::Report;
use super::{Script, ScriptExit, Transport};
use crate::context::Ctx;
use crate::model::EnvPaths;
use crate::provider::SshTarget;
use crate::settings::ssh::SshSettings;

/// After SIGTERM to the script's group, how long it may take to exit before
/// SIGKILL (the runner's scripts `trap 'exit 1' TERM`, so this is quick).
const TERM_GRACE: Duration = Duration::from_secs(5);
/// How long a cancelled stage waits for the wrapper to say which process
/// group to kill, and for remote kill commands.
const KILL_STEP: Duration = Duration::from_secs(5);

pub struct SshTransport {
    master: Master,
}

impl SshTransport {
    pub fn new(target: SshTarget, paths: EnvPaths, settings: SshSettings) -> Self {
        SshTransport {
            master: Master::new(target, paths, settings),
        }
    }

    fn channel(&self, session: &Session, remote: &str) -> Command {
        let mut cmd = Command::new("ssh");
        cmd.arg("-F")
            .arg(self.master.config_file())
            .arg("-S")
            .arg(session.control_socket())
            .args(["-o", "BatchMode=yes", "-o", "ControlMaster=no", "-T"])
            // Without a master ssh would fall back to a new connection to
            // "none": make that fail at once instead of resolving a name.
            .args(["-o", "ProxyCommand=false"])
            // Port 9 ("discard"): if the master is gone, ssh must fail rather
            // than quietly open a second connection.
            .args(["-p", "9", "none", "--"])
            .arg(remote)
            .process_group(0)
            .kill_on_drop(true);
        cmd
    }

    /// One attempt at running the script over `session`.
    async fn run_once(
        &self,
        session: &Session,
        body: &[u8],
        script: &Script<'_>,
        ctx: &Ctx,
    ) -> Result<Once> {
        let dest = self.master.destination();
        let line = remote::command_line(body.len(), self.master.target.workdir.as_deref());
        let mut child = self
            .channel(session, &line)
            .stdin(Stdio::piped())
            .stdout(Stdio::inherit())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting ssh for {} on {dest}", script.stage))?;

        let mut stdin = child.stdin.take().context("ssh has no stdin")?;
        let body = body.to_vec();
        let writer = tokio::spawn(async move {
            let r = stdin.write_all(&body).await;
            drop(stdin);
            r
        });
        let state = Arc::new(Mutex::new(ChannelState::default()));
        let stderr = child.stderr.take().context("ssh has no stderr")?;
        let reader = {
            let state = state.clone();
            tokio::spawn(async move {
                let mut lines = BufReader::new(stderr).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    let mut st = state.lock().unwrap();
                    match remote::parse_report(&line) {
                        Report::Pgid(p) => {
                            st.pgid = Some(p);
                            // The script runs: what ssh said before is worth reading.
                            for l in &st.other {
                                eprintln!("{l}");
                            }
                        }
                        Report::Exit(c) => st.exit = Some(c),
                        Report::Error(e) => st.error = Some(e),
                        Report::Other(l) => {
                            // ssh itself or the wrapper's shell. Before the script
                            // starts it is held back: a dead master's fallback noise
                            // is retried away, any other failure quotes it.
                            if st.pgid.is_some() {
                                eprintln!("{l}");
                            }
                            st.other.push(l);
                        }
                    }
                }
            })
        };

        let status = tokio::select! {
            status = child.wait() => status.context("waiting for ssh")?,
            _ = ctx.cancel.cancelled() => {
                let exit = self.cancel(session, &mut child, &state, script.stage, ctx).await;
                reader.abort();
                writer.abort();
                return Ok(Once::Done(exit));
            }
        };
        let _ = tokio::time::timeout(KILL_STEP, reader).await;
        let _ = writer.await;
        let st = std::mem::take(&mut *state.lock().unwrap());
        if let Some(code) = st.exit {
            return Ok(Once::Done(ScriptExit::Code(code)));
        }
        if let Some(e) = st.error {
            bail!("{e} ({dest})");
        }
        if st.pgid.is_none() {
            if let Some(l) = st.other.iter().find(|l| is_control_socket_failure(l)) {
                // The local master is gone: nothing reached the host.
                return Ok(Once::MasterUnreachable(l.clone()));
            }
        }
        let said = if st.other.is_empty() {
            String::new()
        } else {
            format!(": {}", st.other.join("; "))
        };
        if session.check().await.is_err() {
            return Err(anyhow!(
                "the SSH connection to {dest} was lost during {}{said}",
                script.stage
            ));
        }
        Err(anyhow!(
            "the {} script on {dest} ended without reporting its exit status (ssh {status}){said}: \
             its processes were killed on the host, or bash is missing there",
            script.stage
        ))
    }

    /// Kills the remote process group `pgid` with `signal` (best effort).
    async fn kill_remote(&self, session: &Session, pgid: i64, signal: &str) -> Result<()> {
        let mut cmd = self.channel(
            session,
            &format!("kill -{signal} -- -{pgid} 2>/dev/null; true"),
        );
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let status = tokio::time::timeout(KILL_STEP, cmd.status())
            .await
            .context("the remote kill command did not finish")??;
        if !status.success() {
            bail!("the remote kill command failed ({status})");
        }
        Ok(())
    }

    async fn cancel(
        &self,
        session: &Session,
        child: &mut tokio::process::Child,
        state: &Arc<Mutex<ChannelState>>,
        stage: &str,
        ctx: &Ctx,
    ) -> ScriptExit {
        let dest = self.master.destination();
        let pgid = {
            let deadline = tokio::time::Instant::now() + KILL_STEP;
            loop {
                if let Some(p) = state.lock().unwrap().pgid {
                    break Some(p);
                }
                if tokio::time::Instant::now() >= deadline {
                    break None;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        let Some(pgid) = pgid else {
            ctx.log.warn(format!(
                "termination during {stage}: the script on {dest} never reported its process group; \
                 it may still be running there"
            ));
            let _ = child.start_kill();
            return ScriptExit::Cancelled;
        };
        ctx.log.info(format!(
            "termination: stopping {stage} on {dest} (remote process group {pgid})"
        ));
        if let Err(e) = self.kill_remote(session, pgid, "TERM").await {
            ctx.log
                .warn(format!("sending SIGTERM to the script on {dest}: {e:#}"));
        }
        if tokio::time::timeout(TERM_GRACE, child.wait())
            .await
            .is_err()
        {
            ctx.log.info(format!(
                "{stage} did not stop within {} s of SIGTERM: killing it",
                TERM_GRACE.as_secs()
            ));
            if let Err(e) = self.kill_remote(session, pgid, "KILL").await {
                ctx.log
                    .warn(format!("sending SIGKILL to the script on {dest}: {e:#}"));
            }
            if tokio::time::timeout(KILL_STEP, child.wait()).await.is_err() {
                let _ = child.start_kill();
            }
        }
        ScriptExit::Cancelled
    }
}

/// How one attempt at a channel ended.
enum Once {
    Done(ScriptExit),
    /// The master's socket did not answer: the script never left this host.
    MasterUnreachable(String),
}

/// ssh's message when the control socket has no master behind it.
fn is_control_socket_failure(line: &str) -> bool {
    line.contains("Control socket connect(")
}

/// What the wrapper reported so far.
#[derive(Debug, Default)]
struct ChannelState {
    pgid: Option<i64>,
    exit: Option<i32>,
    error: Option<String>,
    /// ssh's own messages, for the error when the channel breaks.
    other: Vec<String>,
}

#[async_trait]
impl Transport for SshTransport {
    async fn connect(&self, ctx: &Ctx) -> Result<()> {
        let session = self.master.session(ctx, Purpose::Connect).await?;
        let dest = self.master.destination();
        let workdir = self.master.target.workdir.clone().unwrap_or_default();
        let probe = format!(
            "for t in bash git gitlab-runner; do command -v $t >/dev/null 2>&1 || echo missing:$t; done; \
             if [ -n {w} ] && [ ! -d {w} ]; then echo missing:workdir; fi; true",
            w = remote::shell_quote(&workdir)
        );
        let out = tokio::time::timeout(
            ctx.remaining().min(Duration::from_secs(60)),
            session.raw_command(&probe).output(),
        )
        .await
        .with_context(|| format!("probing {dest} for bash, git and gitlab-runner timed out"))?
        .with_context(|| format!("probing {dest} for bash, git and gitlab-runner"))?;
        if !out.status.success() {
            bail!(
                "probing {dest} failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        for missing in String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .filter_map(|w| w.strip_prefix("missing:"))
        {
            match missing {
                "bash" => bail!(
                    "bash is not installed on {dest}: dormant runs every stage script with bash; install it on the host or image"
                ),
                "workdir" => bail!("the work directory {workdir} does not exist on {dest}"),
                "git" => ctx.log.warn(format!(
                    "git is not installed on {dest}: get_sources will fail"
                )),
                _ => ctx.log.warn(format!(
                    "gitlab-runner is not installed on {dest}: cache and artifact stages will only warn"
                )),
            }
        }
        Ok(())
    }

    async fn run_script(&self, script: &Script<'_>, ctx: &Ctx) -> Result<ScriptExit> {
        let body = remote::script_with_env(script.body, script.env)?;
        // No `-O check` round trip first: the channel itself finds out, and a
        // master whose socket does not answer cannot have started the script.
        let mut session = match self.master.attach_unchecked() {
            Some(s) => s,
            None => self.master.session(ctx, Purpose::Reconnect).await?,
        };
        let mut reconnected = false;
        loop {
            match self.run_once(&session, &body, script, ctx).await? {
                Once::Done(exit) => return Ok(exit),
                Once::MasterUnreachable(why) if !reconnected => {
                    tracing::debug!("master unreachable: {why}");
                    reconnected = true;
                    session = self.master.session(ctx, Purpose::Reconnect).await?;
                }
                Once::MasterUnreachable(why) => bail!(
                    "the new SSH connection to {} does not take sessions: {why}",
                    self.master.destination()
                ),
            }
        }
    }

    async fn close(&self, _ctx: &Ctx) -> Result<()> {
        self.master.close().await
    }

    async fn take_file(&self, path: &str, max: usize, ctx: &Ctx) -> Result<Option<Vec<u8>>> {
        // Over the job's master when it still runs (cleanup, before the stop):
        // one multiplexed command, no new handshake.
        let session = self.master.session(ctx, Purpose::Reconnect).await?;
        let dest = self.master.destination();
        let out = tokio::time::timeout(
            ctx.remaining().min(TAKE_FILE_BOUND),
            session.raw_command(take_file_command(path, max)).output(),
        )
        .await
        .with_context(|| format!("reading {path} on {dest} timed out"))?
        .with_context(|| format!("reading {path} on {dest}"))?;
        if !out.status.success() {
            bail!(
                "reading {path} on {dest} failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        parse_take_file(&out.stdout)
            .with_context(|| format!("reading {path} on {dest}: unexpected answer"))
    }

    async fn shell_command(
        &self,
        dir: &str,
        command: Option<&str>,
        tty: bool,
        ctx: &Ctx,
    ) -> Result<Command> {
        // Through the master `connect` opened: the environment's own key and
        // pinned host key are in its config; no second handshake.
        let session = self.master.session(ctx, Purpose::Reconnect).await?;
        let mut cmd = Command::new("ssh");
        cmd.arg("-F")
            .arg(self.master.config_file())
            .arg("-S")
            .arg(session.control_socket())
            .args(["-o", "BatchMode=yes", "-o", "ControlMaster=no"])
            .args(["-o", "ProxyCommand=false", "-o", "LogLevel=ERROR"])
            .arg(if tty { "-t" } else { "-T" })
            .args(["-p", "9", "none", "--"])
            .arg(shell_line(dir, command));
        // In the caller's process group (not its own, unlike stage channels):
        // with a terminal it must be in the foreground group to read from it.
        Ok(cmd)
    }
}

/// The remote side of `shell_command`: into the job's project dir (or say why
/// not), then a login shell or the command line.
fn shell_line(dir: &str, command: Option<&str>) -> String {
    let dir = remote::shell_quote(dir);
    match command {
        Some(line) => format!("cd -- {dir} || exit 1\n{line}"),
        None => format!(
            "cd -- {dir} 2>/dev/null || echo \"dormant: \"{dir}\" does not exist, starting in $HOME\" >&2\n\
             exec \"${{SHELL:-/bin/sh}}\" -l"
        ),
    }
}

/// Bound on the one command [`Transport::take_file`] runs.
const TAKE_FILE_BOUND: Duration = Duration::from_secs(30);

/// The remote side of `take_file`: says `absent` or `present` on the first
/// line, then the content. A symlink (the file is the job's to write) is
/// removed, never read.
fn take_file_command(path: &str, max: usize) -> String {
    format!(
        "f={}; if [ -L \"$f\" ]; then rm -f -- \"$f\"; echo absent; \
         elif [ -f \"$f\" ]; then echo present; head -c {max} -- \"$f\" && rm -f -- \"$f\"; \
         else echo absent; fi",
        remote::shell_quote(path)
    )
}

fn parse_take_file(stdout: &[u8]) -> Result<Option<Vec<u8>>> {
    let (head, rest) = match stdout.iter().position(|&b| b == b'\n') {
        Some(i) => (&stdout[..i], &stdout[i + 1..]),
        None => (stdout, &[][..]),
    };
    match head {
        b"absent" => Ok(None),
        b"present" => Ok(Some(rest.to_vec())),
        other => bail!("{:?}", String::from_utf8_lossy(other)),
    }
}

#[cfg(test)]
mod take_file_tests {
    use super::*;

    /// The command runs in a real shell against real files.
    #[test]
    fn the_remote_command_reads_removes_and_refuses_symlinks() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("it's here");
        let run = |path: &std::path::Path, max: usize| {
            let out = std::process::Command::new("sh")
                .arg("-c")
                .arg(take_file_command(&path.display().to_string(), max))
                .output()
                .unwrap();
            assert!(out.status.success());
            parse_take_file(&out.stdout).unwrap()
        };
        assert_eq!(run(&file, 100), None);
        std::fs::write(&file, "why\nmore").unwrap();
        assert_eq!(run(&file, 5), Some(b"why\nm".to_vec()));
        assert!(!file.exists(), "taken means removed");
        let secret = dir.path().join("secret");
        std::fs::write(&secret, "do not read").unwrap();
        std::os::unix::fs::symlink(&secret, &file).unwrap();
        assert_eq!(run(&file, 100), None);
        assert!(file.symlink_metadata().is_err() && secret.exists());
        assert!(parse_take_file(b"bash: oops").is_err());
    }
}
