//! One SSH ControlMaster per environment, shared by every stage process of a
//! job (and by the `ssh` provider's own remote calls), so a job pays for one
//! SSH handshake.
//!
//! The master is started with the `openssh` crate (`SessionBuilder::connect`)
//! and immediately detached: it lives in its own session, outlives the stage
//! process that started it, and ends when cleanup closes it or, if nobody does,
//! after `ssh.control_persist` of idleness. Its socket lives in the
//! environment's short control directory (`<state>/ctl/<12 hex>/.ssh-connection*/master`);
//! a later process finds it there and re-attaches with `Session::resume`.
//!
//! Host keys: the first successful connection pins the host key in the
//! environment's own `known_hosts` (`StrictHostKeyChecking=accept-new`) under
//! the alias `dormant-<environment id>` (`HostKeyAlias`), so the pin follows
//! the environment, not its address (an EC2 instance's public IP changes on
//! every start). A changed key is refused, naming both fingerprints.

use std::num::NonZeroUsize;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};
use openssh::{ControlPersist, KnownHosts, Session, SessionBuilder};

use super::hostkey::{fingerprints, host_key_mismatch};
use super::ready::{self, BANNER_WAIT, READY_POLL};
use crate::context::Ctx;
use crate::model::EnvPaths;
use crate::model::SshTarget;
use crate::settings::ssh::SshSettings;
use crate::transport::{MachineCheck, MachineLost};
use crate::wait::{Poll, Schedule, Wait};

/// The prefix of the crate's per-master temp directory inside the control dir.
const CONNECTION_DIR_PREFIX: &str = ".ssh-connection";
/// Logins to a host whose sshd answers but refuses us (cloud-init has not
/// installed the key yet) are retried from this, doubling to the cap: each
/// costs the host a full handshake.
const LOGIN_RETRY_FIRST: Duration = Duration::from_millis(500);
const LOGIN_RETRY_MAX: Duration = Duration::from_secs(5);
/// While reconnecting to a machine whose connection was lost, how often the
/// provider is asked whether it still exists (an EC2 describe costs an API
/// call; a terminated machine is noticed within this).
const MACHINE_CHECK_EVERY: Duration = Duration::from_secs(5);

/// Why a master is being started: the first connection of a prepare, or a
/// reconnect because the one prepare made is gone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    Connect,
    Reconnect,
}

/// The master of one environment on one target.
#[derive(Debug, Clone)]
pub struct Master {
    pub target: SshTarget,
    pub paths: EnvPaths,
    pub(super) settings: SshSettings,
}

impl Master {
    pub fn new(target: SshTarget, paths: EnvPaths, settings: SshSettings) -> Self {
        Master {
            target,
            paths,
            settings,
        }
    }

    /// A live master of this environment, if one runs. Dead masters' leftover
    /// directories are removed on the way.
    pub async fn attach(&self) -> Option<Session> {
        let mut found = None;
        for dir in self.connection_dirs() {
            let socket = dir.join("master");
            if found.is_none() && socket.exists() {
                let session = Session::resume_mux(
                    socket.into_boxed_path(),
                    Some(dir.join("log").into_boxed_path()),
                );
                if session.check().await.is_ok() {
                    found = Some(session);
                    continue;
                }
            }
            let _ = std::fs::remove_dir_all(&dir);
        }
        found
    }

    /// The master whose socket exists, without asking it anything (a stage's
    /// fast path: the caller must cope with a socket nobody answers).
    pub fn attach_unchecked(&self) -> Option<Session> {
        self.connection_dirs().into_iter().find_map(|dir| {
            let socket = dir.join("master");
            socket.exists().then(|| {
                Session::resume_mux(
                    socket.into_boxed_path(),
                    Some(dir.join("log").into_boxed_path()),
                )
            })
        })
    }

    /// The live master, or a new one (waiting until the host accepts SSH,
    /// bounded by `ctx` and `ssh.ready_timeout`). A reconnect is said in the job log.
    pub async fn session(&self, ctx: &Ctx, purpose: Purpose) -> Result<Session> {
        self.session_checked(ctx, purpose, None).await
    }

    /// [`Self::session`], asking `machine` between attempts whether the
    /// machine still exists (see [`Self::reconnect`]).
    pub async fn session_checked(
        &self,
        ctx: &Ctx,
        purpose: Purpose,
        machine: Option<&dyn MachineCheck>,
    ) -> Result<Session> {
        if let Some(s) = self.attach().await {
            return Ok(s);
        }
        if purpose == Purpose::Reconnect {
            ctx.log.info(format!(
                "the SSH connection of environment {} to {} is gone (closed, timed out or the host restarted): reconnecting",
                self.paths.id,
                self.destination()
            ));
        }
        let ctx = ctx.within(self.settings.ready_timeout.get());
        self.start(&ctx, machine).await
    }

    /// The live master, or a new one, within `ctx` (its log gets the wait's
    /// progress; a re-attach passes one that drops it). `machine` is asked
    /// between attempts whether the machine still exists: a machine that is
    /// gone ends the wait at once with a [`MachineLost`] error.
    pub async fn reconnect(
        &self,
        ctx: &Ctx,
        machine: Option<&dyn MachineCheck>,
    ) -> Result<Session> {
        if let Some(s) = self.attach().await {
            return Ok(s);
        }
        self.start(ctx, machine).await
    }

    /// Closes the master (if one runs) and removes the control directory.
    /// Idempotent; a master that already died is not an error.
    pub async fn close(&self) -> Result<()> {
        close_masters(&self.paths).await
    }

    fn connection_dirs(&self) -> Vec<PathBuf> {
        connection_dirs(&self.paths)
    }

    /// Starts a master once the host answers SSH: its banner is probed every
    /// [`READY_POLL`] (a TCP accept proves nothing behind a tunnel), and a
    /// login made as soon as it answers. A failed login to a host that
    /// answers (sshd up, the key not installed yet) is retried with backoff.
    async fn start(&self, ctx: &Ctx, machine: Option<&dyn MachineCheck>) -> Result<Session> {
        self.preflight()?;
        let dest = self.destination();
        let first_pin = !has_content(&self.paths.known_hosts);
        let logins = Schedule::backoff(LOGIN_RETRY_FIRST, LOGIN_RETRY_MAX);
        // (failed logins so far, earliest next login); shared with the probes.
        let gate = std::sync::Mutex::new((0u32, Instant::now()));
        let checked = std::sync::Mutex::new(None::<Instant>);
        let mut wait = Wait::new(ctx, format!("SSH on {dest}"), Schedule::fixed(READY_POLL));
        let session = wait
            .until(|| async {
                // Asked first: a connection is being replaced because
                // something went wrong, and a machine the provider says is
                // gone must not be reached at its old address (nor waited for).
                if let Some(check) = machine {
                    let due = checked
                        .lock()
                        .unwrap()
                        .is_none_or(|at| at.elapsed() >= MACHINE_CHECK_EVERY);
                    if due {
                        *checked.lock().unwrap() = Some(Instant::now());
                        if let Some(words) = check.lost(ctx).await {
                            return Err(MachineLost(words).into());
                        }
                    }
                }
                let limit = BANNER_WAIT.min(ctx.remaining());
                if let Err(why) = ready::banner(&self.target.host, self.target.port, limit).await {
                    return Ok(Poll::Pending(why));
                }
                let (failed, next) = *gate.lock().unwrap();
                if Instant::now() < next {
                    return Ok(Poll::Pending(format!(
                        "sshd answers; login attempt {} not due yet",
                        failed + 1
                    )));
                }
                match self.launch(ctx).await {
                    Ok(session) => Ok(Poll::Ready(session)),
                    Err(Attempt::Fatal(e)) => Err(e),
                    Err(Attempt::Retry(why)) => {
                        *gate.lock().unwrap() = (failed + 1, Instant::now() + logins.delay(failed));
                        Ok(Poll::Pending(format!(
                            "sshd answers, but the login failed: {why}"
                        )))
                    }
                }
            })
            .await?;
        let secs = wait.elapsed().as_secs_f64();
        if first_pin {
            // ssh does not fsync what it pinned: a power loss that lost it
            // would have the next connection pin whatever answers, on trust.
            let pinned = &self.paths.known_hosts;
            std::fs::File::open(pinned)
                .and_then(|f| f.sync_all())
                .and_then(|()| {
                    crate::state::store::sync_dir(pinned.parent().unwrap_or(Path::new(".")))
                })
                .with_context(|| format!("syncing the pinned host key {}", pinned.display()))?;
            ctx.log.info(format!(
                "SSH to {dest} ready after {secs:.1} s; host key {} pinned for environment {}",
                fingerprints(&self.paths.known_hosts).join(", "),
                self.paths.id
            ));
        } else {
            ctx.log.info(format!(
                "SSH to {dest} ready after {secs:.1} s (host key matches the one pinned for environment {})",
                self.paths.id
            ));
        }
        Ok(session)
    }

    async fn launch(&self, ctx: &Ctx) -> Result<Session, Attempt> {
        let mut b = SessionBuilder::default();
        b.user(self.target.user.clone())
            .port(self.target.port)
            .keyfile(self.identity())
            .known_hosts_check(KnownHosts::Add)
            .user_known_hosts_file(&self.paths.known_hosts)
            .control_directory(&self.paths.control_dir)
            .control_persist(ControlPersist::IdleFor(
                NonZeroUsize::new(self.settings.control_persist.as_secs().max(1) as usize)
                    .expect("at least 1"),
            ))
            .connect_timeout(self.settings.connect_timeout.get())
            .server_alive_interval(self.settings.server_alive_interval.get())
            .config_file(self.config_file());
        let connect = b.connect_mux(&self.target.host);
        // ConnectTimeout bounds the TCP connect only; a stuck handshake is cut here.
        let limit = (self.settings.connect_timeout.get() * 3).min(ctx.remaining());
        let result = tokio::select! {
            r = tokio::time::timeout(limit, connect) => r,
            _ = ctx.cancel.cancelled() => {
                return Err(Attempt::Fatal(anyhow!("cancelled (termination signal) while connecting to {}", self.destination())));
            }
        };
        match result {
            Ok(Ok(session)) => {
                // Detached: the master must outlive this process. A resumed
                // handle does not close it on drop.
                let (ctl, log) = session.detach();
                // The crate makes its directory with the umask's mode: make it
                // private like the rest of the state dir.
                if let Some(dir) = ctl.parent() {
                    let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700));
                }
                Ok(Session::resume_mux(ctl, log))
            }
            Ok(Err(e)) => {
                let text = format!("{:#}", anyhow::Error::from(e));
                Err(self.classify(&text))
            }
            Err(_) => Err(Attempt::Retry(format!(
                "the SSH handshake did not finish within {} s",
                limit.as_secs()
            ))),
        }
    }

    fn classify(&self, ssh_error: &str) -> Attempt {
        if let Some(offered) = host_key_mismatch(ssh_error) {
            let pinned = fingerprints(&self.paths.known_hosts);
            return Attempt::Fatal(anyhow!(
                "the host key of environment {id} has changed: {dest} now presents {offered}, but the key \
                 pinned for environment {id} in {kh} is {pinned}. Refusing to connect: the machine may have \
                 been replaced or the connection intercepted. If the change is expected, release the \
                 environment (dormant release <key>) and start a new one",
                id = self.paths.id,
                dest = self.destination(),
                kh = self.paths.known_hosts.display(),
                pinned = if pinned.is_empty() {
                    "unknown".to_string()
                } else {
                    pinned.join(", ")
                },
            ));
        }
        let line = ssh_error
            .lines()
            .map(str::trim)
            .rfind(|l| !l.is_empty())
            .unwrap_or("ssh failed without a message");
        Attempt::Retry(line.to_string())
    }
}

/// One connection attempt's failure: wait and retry, or give up now.
enum Attempt {
    Retry(String),
    Fatal(anyhow::Error),
}

fn has_content(path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| m.len() > 0)
}

/// [`Master::close`] without a target: every master of the environment is
/// asked to exit and the control directory removed. For the end of a hot
/// window (`lifecycle::hot`), whose cooler has no transport: the master a
/// hot machine's job left must not outlive the machine's stop, or the next
/// resume would attach to a dead connection.
pub async fn close_masters(paths: &EnvPaths) -> Result<()> {
    // Every live master, not just the first: two stage processes that
    // overlapped (a cleanup beside a run the runner gave up on) may each
    // have started one.
    for dir in connection_dirs(paths) {
        let socket = dir.join("master");
        if socket.exists() {
            let session = Session::resume_mux(
                socket.into_boxed_path(),
                Some(dir.join("log").into_boxed_path()),
            );
            // Asks the master to stop taking sessions and exit once the
            // last one is closed. A master that already died is gone anyway.
            if let Err(e) = session.close().await {
                tracing::debug!("closing the SSH master of {}: {e}", paths.id);
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
    match std::fs::remove_dir(&paths.control_dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e)
            .with_context(|| format!("removing control directory {}", paths.control_dir.display())),
    }
}

fn connection_dirs(paths: &EnvPaths) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(&paths.control_dir) else {
        return Vec::new();
    };
    let mut dirs: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with(CONNECTION_DIR_PREFIX)
        })
        .map(|e| e.path())
        .collect();
    dirs.sort();
    dirs
}
