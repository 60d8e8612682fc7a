//! The SSH transport: every stage script of a job runs over the one
//! ControlMaster prepare started (see [`master`]), as one multiplexed session
//! (see [`channel`]) running a small wrapper (see [`remote`]).
//!
//! Outcomes: the wrapper's `dormant-exit N` is the script's code (build
//! failure when not 0, including a script's own 255). A stage whose
//! connection is lost is followed again over a new one ([`stage`]); one that
//! cannot be (re-attaching off, or the machine does not come back in time)
//! is the transport breaking, a system failure. On SIGTERM the script's whole
//! remote process group is signalled through the session's own stdin —
//! closing the session alone would leave it running on the host.

mod channel;
mod client;
mod hostkey;
pub(crate) mod kept;
mod kept_control;
pub(crate) mod kept_state;
mod master;
pub use master::close_masters;
pub(crate) mod pause;
pub mod ready;
pub(crate) mod remote;
pub mod repin;
mod stage;
pub(crate) mod stream;

// The transport's public API for providers that reach machines over SSH (the
// `ssh` provider removes workspaces over an environment's master); providers
// never reach into the modules themselves.
pub use master::{Master, Purpose};

/// The command that stops every stage of environment `env` left on the
/// machine, paused ones included, and removes their files: the `ssh`
/// provider runs it before it removes a released workspace (docs/pause.md).
pub fn release_command(env: &str) -> String {
    remote::release_command(env)
}

use std::time::Duration;

use anyhow::{bail, Context, Result};
use async_trait::async_trait;

use super::{write_private, ExecOutput, MachineCheck, Ran, Script, Transport};
use crate::context::Ctx;
use crate::model::EnvPaths;
use crate::model::SshTarget;
use crate::settings::ssh::SshSettings;
use crate::text::shell_quote;

pub struct SshTransport {
    master: Master,
    settings: SshSettings,
}

/// How long cleanup spends reaching a machine to stop what a job's stages
/// left there (a handshake or two; a machine that does not answer is being
/// stopped or deleted anyway, and its next prepare stops them too).
const LEFTOVERS_REACH: Duration = Duration::from_secs(30);
/// Bound on the command that stops them (it waits up to 6 s for the groups).
const LEFTOVERS_BOUND: Duration = Duration::from_secs(30);

impl SshTransport {
    pub fn new(target: SshTarget, paths: EnvPaths, settings: SshSettings) -> Self {
        SshTransport {
            master: Master::new(target, paths, settings.clone()),
            settings,
        }
    }

    /// Records what prepare's probe found about keeping output on the
    /// machine, for this environment's stages (`keep:ok` / `keep:no <why>`).
    fn note_keeping(&self, said: &str, ctx: &Ctx) -> Result<()> {
        let marker = self.master.paths.dir.join(stage::NO_KEEP_FILE);
        let why = said
            .lines()
            .find_map(|l| l.strip_prefix("keep:no "))
            .map(str::to_string)
            .or_else(|| {
                (!said.lines().any(|l| l == "keep:ok"))
                    .then(|| "the machine did not say whether it can keep output".to_string())
            });
        match why {
            None => match std::fs::remove_file(&marker) {
                Ok(()) => Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                Err(e) => Err(e).with_context(|| format!("removing {}", marker.display())),
            },
            Some(why) => {
                ctx.log.warn(format!(
                    "stages on {} cannot re-attach after a lost connection ({}): a lost \
                     connection fails the stage, as with ssh.reconnect_timeout = \"0s\"",
                    self.master.destination(),
                    crate::text::excerpt(&why)
                ));
                write_private(&marker, why.as_bytes())
                    .with_context(|| format!("writing {}", marker.display()))
            }
        }
    }
}

#[async_trait]
impl Transport for SshTransport {
    async fn connect(&self, ctx: &Ctx) -> Result<()> {
        let session = self.master.session(ctx, Purpose::Connect).await?;
        let dest = self.master.destination();
        let workdir = self.master.target.workdir.clone().unwrap_or_default();
        let keeps = !self.settings.reconnect_timeout.is_zero();
        // What earlier jobs' stages left on the machine is stopped (a resumed
        // environment never runs on with them), in the probes' one command.
        let probe = format!(
            "for t in bash git gitlab-runner; do command -v $t >/dev/null 2>&1 || echo missing:$t; done; \
             if [ -n {w} ] && [ ! -d {w} ]; then echo missing:workdir; fi; {on_login}\n\
             if command -v bash >/dev/null 2>&1; then {leftovers}; fi\ntrue",
            w = shell_quote(&workdir),
            on_login = self.master.target.on_login.as_deref().unwrap_or(""),
            leftovers = remote::leftovers_command(&self.master.paths.id.simple().to_string(), keeps),
        );
        let out = run_checked(
            &session,
            &probe,
            ctx.remaining().min(Duration::from_secs(60)),
            &format!("probing {dest} for bash, git and gitlab-runner"),
        )
        .await?;
        let said = String::from_utf8_lossy(&out.stdout);
        for line in said.lines() {
            if let Some(text) = line.strip_prefix("say:") {
                ctx.log.info(crate::text::excerpt(text));
            } else if let Some(text) = line.strip_prefix("warn:") {
                ctx.log.warn(crate::text::excerpt(text));
            }
        }
        if keeps && !said.contains("missing:bash") {
            self.note_keeping(&said, ctx)?;
        }
        for missing in said
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

    /// The kept master answers (`ssh -O check`, a local question): it is
    /// the connection stages use, and the probe's answers still hold on a
    /// machine that never stopped (its tools, the work directory, whether
    /// output can be kept: `NO_KEEP_FILE` stays from that probe; its clock
    /// never lagged). What its stages left was stopped by that job's cleanup
    /// (the caller checks it finished: `stages_left`).
    async fn take_live(&self, _ctx: &Ctx) -> Result<bool> {
        Ok(self.master.attach().await.is_some())
    }

    async fn run_script(&self, script: &Script<'_>, ctx: &Ctx) -> Result<Ran> {
        let body = remote::script_with_env(script.body, script.env)?;
        stage::run(&self.master, &self.settings, &body, script, ctx).await
    }

    async fn close(&self, _ctx: &Ctx) -> Result<()> {
        self.master.close().await
    }

    async fn stop_leftovers(&self, machine: Option<&dyn MachineCheck>, ctx: &Ctx) -> Result<()> {
        let dest = self.master.destination();
        let session = self
            .master
            .reconnect(&ctx.within(LEFTOVERS_REACH), machine)
            .await
            .with_context(|| format!("reaching {dest} to stop what the job's stages left there"))?;
        let command = remote::leftovers_command(&self.master.paths.id.simple().to_string(), false);
        run_checked(
            &session,
            &command,
            ctx.remaining().min(LEFTOVERS_BOUND),
            &format!("stopping what the job's stages left on {dest}"),
        )
        .await
        .map(drop)
    }

    async fn paused_left(&self, ctx: &Ctx) -> Result<bool> {
        let session = self.master.session(ctx, Purpose::Reconnect).await?;
        let dest = self.master.destination();
        let out = run_checked(
            &session,
            &remote::paused_left_command(&self.master.paths.id.simple().to_string()),
            ctx.remaining().min(LEFTOVERS_BOUND),
            &format!("looking for a paused script on {dest}"),
        )
        .await?;
        remote::parse_paused_left(&out.stdout)
    }

    async fn take_file(&self, path: &str, max: usize, ctx: &Ctx) -> Result<Option<Vec<u8>>> {
        // Over the job's master when it still runs (cleanup, before the stop):
        // one multiplexed command, no new handshake.
        let session = self.master.session(ctx, Purpose::Reconnect).await?;
        let dest = self.master.destination();
        let out = run_checked(
            &session,
            &take_file_command(path, max),
            ctx.remaining().min(TAKE_FILE_BOUND),
            &format!("reading {path} on {dest}"),
        )
        .await?;
        parse_take_file(&out.stdout)
            .with_context(|| format!("reading {path} on {dest}: unexpected answer"))
    }

    async fn exec(&self, line: &str, limit: Duration, ctx: &Ctx) -> Result<ExecOutput> {
        let ctx = ctx.within(limit);
        let session = self.master.session(&ctx, Purpose::Reconnect).await?;
        let dest = self.master.destination();
        let out = tokio::time::timeout(ctx.remaining(), session.raw_command(line).output())
            .await
            .with_context(|| {
                format!(
                    "a command on {dest} did not finish within {} s",
                    limit.as_secs()
                )
            })?
            .with_context(|| format!("running a command on {dest}"))?;
        Ok(ExecOutput {
            code: out.status.code(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        })
    }

    async fn join_command(
        &self,
        dir: &str,
        command: Option<&str>,
        tty: bool,
        nonce: &str,
        ctx: &Ctx,
    ) -> Result<tokio::process::Command> {
        let _ = ctx;
        // The config file (`-F`) prepare wrote is there while the job runs.
        Ok(self.join(dir, command, tty, nonce))
    }

    async fn end_joined(&self, message: &str, nonces: &[String], ctx: &Ctx) -> Result<()> {
        // Over the job's master while it runs (cleanup, before the stop).
        let session = self.master.session(ctx, Purpose::Reconnect).await?;
        let dest = self.master.destination();
        let env = self.master.paths.id.simple().to_string();
        run_checked(
            &session,
            &remote::join_end_command(&env, message, nonces),
            ctx.remaining().min(JOIN_END_BOUND),
            &format!("ending the shells joined beside the job on {dest}"),
        )
        .await
        .map(drop)
    }

    async fn shell_command(
        &self,
        dir: &str,
        command: Option<&str>,
        tty: bool,
        ctx: &Ctx,
    ) -> Result<tokio::process::Command> {
        // Through the master `connect` opened: the environment's own key and
        // pinned host key are in its config; no second handshake.
        let session = self.master.session(ctx, Purpose::Reconnect).await?;
        let mut cmd = tokio::process::Command::new("ssh");
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

impl SshTransport {
    /// `dormant shell` beside a running job (see [`Transport::join_command`]).
    pub fn join(
        &self,
        dir: &str,
        command: Option<&str>,
        tty: bool,
        nonce: &str,
    ) -> tokio::process::Command {
        let env = self.master.paths.id.simple().to_string();
        let mut cmd = self.master.own_connection();
        cmd.arg(if tty { "-t" } else { "-T" })
            .arg("--")
            .arg(remote::join_command(&env, nonce, dir, command));
        cmd
    }
}

/// The most the command ending joined shells may take (it ends them within
/// 6 s; `crate::lifecycle::joined::END_BOUND` bounds the whole step).
const JOIN_END_BOUND: Duration = Duration::from_secs(9);

/// The remote side of `shell_command`: into the job's project dir (or say why
/// not), then a login shell or the command line.
fn shell_line(dir: &str, command: Option<&str>) -> String {
    let dir = shell_quote(dir);
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
        shell_quote(path)
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

/// Runs one of dormant's own commands over `session` (a probe, a read, the
/// leftovers' stop), within `bound`, and requires it to succeed; `what`
/// names it in every error.
async fn run_checked(
    session: &openssh::Session,
    command: &str,
    bound: Duration,
    what: &str,
) -> Result<std::process::Output> {
    let out = tokio::time::timeout(bound, session.raw_command(command).output())
        .await
        .with_context(|| format!("{what} timed out"))?
        .with_context(|| what.to_string())?;
    if !out.status.success() {
        bail!(
            "{what} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(out)
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
