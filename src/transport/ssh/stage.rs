//! A whole stage over SSH, across as many sessions as it takes: the first
//! one over the master prepare left (a new master when that one is gone), and
//! when the connection is lost mid-stage, reconnects within
//! `ssh.reconnect_timeout` that follow the script, which runs on on the
//! machine ([`super::kept`]). Direct stages ([`super::channel`]) have one
//! session: a lost connection ends them.

use anyhow::{anyhow, bail, Result};
use openssh::Session;

use super::kept;
use super::kept_state::{Place, Stage};
use super::master::{Master, Purpose};
use super::{channel, remote};
use crate::context::{Ctx, JobLog};
use crate::settings::ssh::SshSettings;
use crate::state::stage_output::JobLogOut;
use crate::transport::{MachineLost, Ran, Script, ScriptExit};

/// The file in an environment's directory that says its machine cannot keep
/// a stage's output (written by prepare's probe, with the reason): its stages
/// run direct.
pub const NO_KEEP_FILE: &str = "ssh-no-keep";

/// Runs `script` (uploaded as `body`) over `master`.
pub async fn run(
    master: &Master,
    settings: &SshSettings,
    body: &[u8],
    script: &Script<'_>,
    ctx: &Ctx,
) -> Result<Ran> {
    // No `-O check` round trip first: the session itself finds out, and a
    // master whose socket does not answer cannot have started the script.
    let mut session = match master.attach_unchecked() {
        Some(s) => s,
        None => {
            master
                .session_checked(ctx, Purpose::Reconnect, script.machine)
                .await?
        }
    };
    let dest = master.destination();
    let workdir = master.target.workdir.as_deref();
    let kept =
        !settings.reconnect_timeout.is_zero() && !master.paths.dir.join(NO_KEEP_FILE).exists();
    if !kept {
        return run_direct(master, session, &dest, workdir, body, script, ctx).await;
    }
    let env = master.paths.id.simple().to_string();
    let place = Place {
        dest: &dest,
        workdir,
        body,
        env: &env,
        linger_secs: remote::linger(
            settings.reconnect_timeout.get(),
            settings.server_alive_interval.get(),
        ),
        bound: settings.kept_output_bytes(),
    };
    let mut st = Stage::new(JobLogOut::new(script.copy));
    let mut futile = 0;
    loop {
        let before = st.progress();
        match kept::run_once(&session, &place, script, &mut st, ctx).await? {
            kept::Once::Done(ran) => {
                st.stream.finish();
                return Ok(ran);
            }
            // The master died between two stages: nothing reached the
            // machine, a new master runs the stage (as with direct stages).
            kept::Once::MasterUnreachable(why) if !st.sent && st.lost_since.is_none() => {
                tracing::debug!("master unreachable: {why}");
                session = master
                    .session_checked(ctx, Purpose::Reconnect, script.machine)
                    .await?;
            }
            kept::Once::MasterUnreachable(why) | kept::Once::Broken(why) => {
                tracing::debug!(stage = script.stage, "the session broke: {why}");
                if session.check().await.is_ok() {
                    // The master answers: only the session went (its follower
                    // fell too far behind, say). Follow again over it.
                    if !st.again_after_broken(before, &mut futile).await {
                        bail!(
                            "the sessions of {} on {dest} keep ending at once ({why})",
                            script.stage
                        );
                    }
                    continue;
                }
                let since = *st.lost_since.get_or_insert_with(std::time::Instant::now);
                match reattach(master, settings, since, script, &dest, ctx).await {
                    Ok(s) => session = s,
                    Err(Lost::Cancelled) => {
                        st.stream.end_line();
                        ctx.log.warn(format!(
                            "termination while the SSH connection to {dest} was lost during {}: \
                             the script may still be running there: the job's cleanup stops it",
                            script.stage
                        ));
                        return Ok(Ran {
                            exit: ScriptExit::Cancelled,
                            watched: None,
                            left_running: true,
                            paused: None,
                            paused_mid_line: false,
                        });
                    }
                    Err(Lost::Failed(e)) => {
                        st.stream.end_line();
                        return Err(e);
                    }
                }
            }
        }
    }
}

enum Lost {
    Cancelled,
    Failed(anyhow::Error),
}

/// A new master for a stage whose connection was lost at `since`, by
/// `since + reconnect_timeout`: silent in the job log (the stage's one line
/// comes when a session follows again), ended by SIGTERM, or at once by a
/// machine that is gone.
async fn reattach(
    master: &Master,
    settings: &SshSettings,
    since: std::time::Instant,
    script: &Script<'_>,
    dest: &str,
    ctx: &Ctx,
) -> Result<Session, Lost> {
    let timeout = settings.reconnect_timeout;
    let quiet = Ctx {
        log: JobLog::discard(),
        cancel: ctx.cancel.clone(),
        deadline: ctx.deadline.min(since + timeout.get()),
    };
    match master.reconnect(&quiet, script.machine).await {
        Ok(s) => Ok(s),
        Err(_) if ctx.cancel.is_cancelled() => Err(Lost::Cancelled),
        // The machine itself is gone: said as such (the run stage records it
        // and cleanup settles it as a machine lost); the typed error stays in
        // the chain for it to find.
        Err(e) if e.downcast_ref::<MachineLost>().is_some() => {
            Err(Lost::Failed(e.context(format!(
                "the SSH connection to {dest} was lost during {}; dormant stopped reconnecting \
                 after {:.0} s",
                script.stage,
                since.elapsed().as_secs_f64()
            ))))
        }
        Err(e) => Err(Lost::Failed(anyhow!(
            "the SSH connection to {dest} was lost during {} and did not come back within \
             ssh.reconnect_timeout = {timeout} (dormant tried to reconnect for {:.0} s): {e:#}",
            script.stage,
            since.elapsed().as_secs_f64()
        ))),
    }
}

/// A stage with the direct wrapper: one session, and a master that died
/// before it is replaced once.
async fn run_direct(
    master: &Master,
    mut session: Session,
    dest: &str,
    workdir: Option<&str>,
    body: &[u8],
    script: &Script<'_>,
    ctx: &Ctx,
) -> Result<Ran> {
    let mut reconnected = false;
    loop {
        match channel::run_once(&session, dest, workdir, body, script, ctx).await? {
            channel::Once::Done(ran) => return Ok(ran),
            channel::Once::MasterUnreachable(why) if !reconnected => {
                tracing::debug!("master unreachable: {why}");
                reconnected = true;
                session = master
                    .session_checked(ctx, Purpose::Reconnect, script.machine)
                    .await?;
            }
            channel::Once::MasterUnreachable(why) => {
                bail!("the new SSH connection to {dest} does not take sessions: {why}")
            }
        }
    }
}
