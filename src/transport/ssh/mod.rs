//! The SSH transport: every stage script of a job runs over the one
//! ControlMaster prepare started (see [`master`]), as one multiplexed session
//! (see [`channel`]) running a small wrapper (see [`remote`]).
//!
//! Outcomes: the wrapper's `dormant-exit N` is the script's code (build
//! failure when not 0, including a script's own 255). A session that ends
//! without it is the transport breaking, a system failure: the master check
//! tells a dead master (lost connection) from anything else. On SIGTERM the
//! script's whole remote process group is signalled through the session's
//! own stdin — closing the session alone would leave it running on the host.

mod channel;
pub mod hostkey;
pub mod master;
pub mod ready;
pub mod remote;

use std::time::Duration;

use anyhow::{bail, Context, Result};
use async_trait::async_trait;

use self::channel::Once;
use self::master::{Master, Purpose};
use super::{Script, ScriptExit, Transport};
use crate::context::Ctx;
use crate::model::EnvPaths;
use crate::model::SshTarget;
use crate::settings::ssh::SshSettings;

pub struct SshTransport {
    master: Master,
}

impl SshTransport {
    pub fn new(target: SshTarget, paths: EnvPaths, settings: SshSettings) -> Self {
        SshTransport {
            master: Master::new(target, paths, settings),
        }
    }
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
        let dest = self.master.destination();
        let workdir = self.master.target.workdir.as_deref();
        loop {
            match channel::run_once(&session, &dest, workdir, &body, script, ctx).await? {
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
}
