//! `dormant shell KEY|ID [--release] [-- COMMAND...]`: a person steps into an
//! environment on the runner host — a failed job kept for debugging, an agent
//! waiting for a human.
//!
//! The environment is claimed by a shell holder first (a job that tries to
//! resume it meanwhile is refused "in use by a shell"; an environment a job
//! holds is joined instead, see [`join`]), started if it was suspended (the provider's progress
//! lines, as in prepare), and entered through its own transport: an
//! interactive login shell with the terminal in the job's project directory
//! (`CI_PROJECT_DIR`), over the environment's own SSH key and pinned host key
//! on ssh and ec2, or a local shell on `local`. With `-- COMMAND` the command
//! runs without a terminal and its exit code is dormant's.
//!
//! On exit the environment is suspended again, or released with `--release`.
//! SIGTERM or SIGHUP (a closed terminal) end the shell and suspend it, never
//! release it; Ctrl-C belongs to the program in the shell. Any error after the
//! claim puts it back to suspended. A `dormant shell` killed outright leaves a
//! claim with no live process, recovered to suspended after
//! `suspend.claim_grace` by the next resume, release or sweep.

use std::os::unix::process::ExitStatusExt;
use std::process::Stdio;

use anyhow::{bail, Context, Result};
use tokio::signal::unix::{signal, SignalKind};

use crate::context::{Ctx, JobLog};
use crate::events::{Event, EventLog, Kind, ReleaseCause, Step, SuspendCause};
use crate::exit::Refused;
use crate::job::Job;
use crate::lifecycle::joined;
use crate::lifecycle::recover::{self, Found};
use crate::lifecycle::volume::{self, Relaunch};
use crate::lifecycle::{self, update_error, Reason, World};
use crate::model::{EnvPaths, Machine, StorageMode};
use crate::notify::{self, Audience, Notification};
use crate::settings::Settings;
use crate::state::lock::LiveLock;
use crate::state::registry::{self, UpdateError};
use crate::state::{EnvStatus, EnvironmentRecord, Holder};
use crate::transport::Transport;

use super::{open_store, OPERATOR_BUDGET};

/// What the person asked for.
#[derive(Debug, Clone, Default)]
pub struct ShellRequest {
    pub key: String,
    /// Release the environment on exit instead of suspending it.
    pub release: bool,
    /// Run this (the words joined, as `ssh host -- ...` does) instead of a login shell.
    pub command: Vec<String>,
}

/// Runs the shell; returns the exit code dormant exits with (the command's,
/// or the login shell's).
pub async fn shell(settings: &Settings, job: &Job, req: &ShellRequest, log: JobLog) -> Result<i32> {
    let store = open_store(settings, job)?;
    let found = super::find::find(settings, &store, &req.key)?;
    if found.running_job().is_some() || found.job.is_some() {
        return join(settings, job, &store, &found, req, log).await;
    }
    let id = found.paths.id;
    let paths = store.env_paths(id);
    let provider = crate::provider::from_settings(settings, &store)?;
    let events = EventLog::new(store.root(), &settings.events);
    let w = World {
        store: &store,
        provider: provider.as_ref(),
        events: &events,
    };
    // Ours alone: the stage commands' SIGINT handling would cancel on Ctrl-C,
    // which here belongs to the program in the shell.
    let cancel = tokio_util::sync::CancellationToken::new();
    let ctx = Ctx::new(log.clone(), cancel.clone(), OPERATOR_BUDGET);
    let me = Holder::Shell {
        pid: std::process::id(),
    };
    // Proof we live, taken before the claim is ours (see `registry::liveness`).
    let _alive = LiveLock::hold(&paths.holder_live).with_context(|| {
        format!(
            "environment {id} is not in this runner's registry ({}): `dormant list` shows what is",
            store.environments_dir().display()
        )
    })?;
    let machine = claim(w, &paths, &me, settings, &ctx).await?;
    // From here on the environment is ours: every way out settles it.
    let signals = Signals::new()?;
    let entered = enter(w, settings, job, &paths, &me, machine, req, &signals, &ctx).await;
    let release = req.release && matches!(entered, Ok((_, false)));
    let rec = registry::peek(&paths)?;
    let settled = if release {
        log.info(format!("releasing environment {id} (--release)"));
        let why = Reason::new(ReleaseCause::Operator, "dormant shell --release");
        lifecycle::release(w, &paths, &me, None, &why, &ctx).await
    } else {
        log.info(format!("suspending environment {id}"));
        let why = Reason::new(SuspendCause::Shell, "dormant shell ended");
        lifecycle::suspend(w, &paths, &me, entered.is_ok(), None, &why, &ctx)
            .await
            .map(drop)
    };
    if let (Ok(()), Some(rec)) = (&settled, rec) {
        let (event, reason) = if release {
            (notify::Event::Release, "dormant shell --release")
        } else {
            (notify::Event::Suspend, "dormant shell ended")
        };
        let n = Notification::for_record(event, &rec).reason(reason);
        notify::announce(&settings.suspend, w.events, &n, &log, Audience::Operator).await;
    }
    match (entered, settled) {
        (Ok((code, _)), Ok(())) => {
            if !release {
                if let Some(key) = registry::peek(&paths)?.and_then(|r| r.key) {
                    log.info(format!("environment {id} suspended; key: {key}"));
                }
            }
            Ok(code)
        }
        (Err(e), Ok(())) => Err(e.context(format!("environment {id} is suspended again"))),
        (Ok(_), Err(e)) => Err(e),
        (Err(e), Err(s)) => Err(e.context(format!("and settling environment {id}: {s:#}"))),
    }
}

/// `dormant shell` on an environment a job holds: a shell (or the command)
/// on the job's machine, in its project directory, beside the job, over a
/// connection of its own. It claims nothing (the job's exit suspends or
/// releases the environment as it would have); the job's cleanup ends it
/// (`lifecycle::joined`). A `local` environment has no machine to join: the
/// message says where the job's directory is on this host.
async fn join(
    settings: &Settings,
    job: &Job,
    store: &crate::state::StateStore,
    found: &super::find::Found,
    req: &ShellRequest,
    log: JobLog,
) -> Result<i32> {
    let id = found.paths.id;
    let rec = &found.record;
    let job_id = match (found.running_job(), found.job) {
        (Some((_, running)), asked) if asked.is_none_or(|a| a == running) => running,
        _ => {
            return Err(Refused::NotRunning.because(format!(
                "job {} runs no stage: its environment {id} is {}; `dormant shell` with the \
                 environment's key opens it once it is suspended",
                found.job.unwrap_or_default(),
                rec.status().as_str()
            )))
        }
    };
    if rec.status() != EnvStatus::Active {
        return Err(Refused::NotRunning.because(format!(
            "job {job_id} is still preparing environment {id} ({}): retry once its first stage runs",
            rec.status().as_str()
        )));
    }
    if req.release {
        bail!(
            "--release cannot be used beside a running job: environment {id} belongs to job \
             {job_id} until it ends (its triggers decide what becomes of it)"
        );
    }
    let machine = rec
        .machine
        .clone()
        .with_context(|| format!("environment {id} has no machine"))?;
    let provider = crate::provider::from_settings(settings, store)?;
    let target = provider.target(&machine)?;
    let dir = project_dir(settings, &found.paths, rec)?;
    if matches!(target, crate::model::Target::Local { .. }) {
        return Err(Refused::NotOnThisProvider.because(format!(
            "environment {id} is a local one: job {job_id} runs on this host, in {dir}; look \
             there as the runner's user (`cd {dir}`): there is no machine to open a shell on"
        )));
    }
    let events = EventLog::new(store.root(), &settings.events);
    let ctx = Ctx::new(log.clone(), Default::default(), OPERATOR_BUDGET);
    let user = super::attach::local_user(job);
    let event = Event::about(Kind::Joined, "shell", rec)
        .by_text(&format!("dormant shell (pid {})", std::process::id()))
        .job(Some(job_id))
        .user(&user);
    events.record(event, &ctx).await;
    let nonce = format!("{:016x}", fastrand::u64(..));
    // Intent before effect: the job's cleanup finds the mark and ends the
    // shell, whatever becomes of this process.
    let mark = joined::mark(&found.paths, &nonce)?;
    let transport = crate::transport::open(&target, &found.paths, settings, job)?;
    let line = (!req.command.is_empty()).then(|| req.command.join(" "));
    // SAFETY: isatty only inspects the descriptor.
    let tty = line.is_none() && unsafe { libc::isatty(0) } == 1;
    if line.is_none() {
        log.info(format!(
            "opening a shell in {dir} beside job {job_id} (it runs on; this shell holds nothing \
             and ends when the job does, at most {} s into its cleanup)",
            joined::END_BOUND.as_secs()
        ));
    }
    let mut cmd = transport
        .join_command(&dir, line.as_deref(), tty, &nonce, &ctx)
        .await?;
    // SAFETY: prctl only sets this child's parent-death signal: a `dormant
    // shell` killed outright takes its ssh client (and the connection) along.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            Ok(())
        });
    }
    let mut child = cmd
        .stdin(Stdio::inherit())
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .context("starting ssh for the shell")?;
    let signals = Signals::new()?;
    let code = tokio::select! {
        status = child.wait() => {
            let status = status.context("waiting for the shell")?;
            status.code().unwrap_or_else(|| 128 + status.signal().unwrap_or(0))
        }
        s = signals.any(false) => {
            log.info(format!("{s}: ending the shell; job {job_id} runs on"));
            let _ = child.start_kill();
            let _ = child.wait().await;
            128 + s.number()
        }
    };
    if mark.ended_by_cleanup() {
        log.info(format!("job {job_id} ended: its cleanup ended this shell"));
    }
    drop(mark);
    Ok(code)
}

/// Claims the environment as a shell: a suspended one becomes `resuming`
/// (its machine returned, to be started); one whose holder is gone is
/// recovered first; one a job or another shell holds is refused.
async fn claim(
    w: World<'_>,
    paths: &EnvPaths,
    me: &Holder,
    settings: &Settings,
    ctx: &Ctx,
) -> Result<Option<Machine>> {
    let id = paths.id;
    for attempt in 0..2 {
        let claimed = registry::update(paths, ctx, |r| {
            r.claim_for_resume(me)?;
            Ok::<_, crate::state::NotAllowed>(r.machine.clone())
        })
        .await;
        match claimed {
            // Volume mode: a new machine is made for it.
            Ok((rec, _)) if rec.storage == StorageMode::Volume => return Ok(None),
            Ok((_, Some(machine))) => return Ok(Some(machine)),
            Ok((_, None)) => bail!("environment {id} has no machine to open a shell in"),
            Err(UpdateError::Gone(_)) => bail!(
                "environment {id} is not in this runner's registry: it was released or expired; \
                 `dormant list` shows what is"
            ),
            Err(UpdateError::Refused(_)) if attempt == 0 => {}
            Err(e) => return Err(update_error(e)),
        }
        // Held: by whom, and is it still there?
        let operator = recover::operator("dormant shell");
        match recover::recover(w, paths, &operator, &settings.suspend, false, ctx).await? {
            Found::NoEnvironment => bail!("environment {id} is gone"),
            Found::NotHeld | Found::Recovered { .. } => {}
            Found::Live { holder, status }
            | Found::Idle { holder, status, .. }
            | Found::RunnerAlive { holder, status, .. } => bail!(
                "environment {id} is {} and held by {}: `dormant shell` opens only an \
                 environment nobody holds (a suspended one); retry after it is suspended",
                status.as_str(),
                holder.describe()
            ),
        }
    }
    bail!("environment {id} was claimed by someone else while it was recovered; retry")
}

/// Starts the machine, connects and runs the shell. Returns the exit code and
/// whether a signal ended it (then it is suspended, never released).
#[allow(clippy::too_many_arguments)]
async fn enter(
    w: World<'_>,
    settings: &Settings,
    job: &Job,
    paths: &EnvPaths,
    me: &Holder,
    machine: Option<Machine>,
    req: &ShellRequest,
    signals: &Signals,
    ctx: &Ctx,
) -> Result<(i32, bool)> {
    let id = paths.id;
    let log = &ctx.log;
    let started = std::time::Instant::now();
    log.info(format!("resuming {} environment {id}", w.provider.name()));
    let failed = |step: Step, e: &anyhow::Error, rec: Option<EnvironmentRecord>| {
        rec.map(|rec| {
            Event::about(Kind::Failed, step.as_str(), &rec)
                .by(me)
                .error(e)
        })
    };
    // Ctrl-C, SIGTERM or SIGHUP while it starts: stop, and suspend it again.
    // Volume mode records its new machine itself; a started one is recorded here.
    let relaunch = Relaunch::default();
    let started_machine = match machine {
        Some(machine) => tokio::select! {
            m = w.provider.start(&machine, ctx) => m.map(|m| (m, false)),
            s = signals.any(true) => bail!("{s} while starting environment {id}"),
        },
        None => tokio::select! {
            m = volume::relaunch(w, paths, me, &relaunch, ctx) => m.map(|m| (m.machine, true)),
            s = signals.any(true) => bail!("{s} while starting environment {id}"),
        },
    };
    let machine = match started_machine {
        Ok((machine, recorded)) => {
            if !recorded {
                registry::update(paths, ctx, |r| r.machine_started(me, machine.clone()))
                    .await
                    .map_err(update_error)?;
            }
            machine
        }
        Err(e) => {
            let e = e.context(format!("starting environment {id}"));
            if let Some(event) = failed(Step::Start, &e, registry::peek(paths)?) {
                w.events.record(event, ctx).await;
            }
            return Err(e);
        }
    };
    let rec = registry::peek(paths)?
        .with_context(|| format!("environment {id} has no record any more"))?;
    let transport = crate::transport::open(&w.provider.target(&machine)?, paths, settings, job)?;
    tokio::select! {
        c = volume::connect(paths, me, transport.as_ref(), w.provider.volumes(), ctx) => if let Err(e) = c {
            if let Some(event) = failed(Step::Connect, &e, Some(rec.clone())) {
                w.events.record(event, ctx).await;
            }
            lifecycle::close(Some(transport.as_ref()), id, ctx).await;
            return Err(e);
        },
        s = signals.any(true) => {
            lifecycle::close(Some(transport.as_ref()), id, ctx).await;
            bail!("{s} while connecting to environment {id}")
        }
    }
    let (rec_active, ()) = registry::update(paths, ctx, |r| r.activate(me))
        .await
        .map_err(update_error)?;
    let resumed = Event::about(Kind::Resumed, "shell", &rec_active)
        .by(me)
        .duration(started.elapsed())
        .suspended_for(
            rec.suspended_at
                .map_or(0, |t| crate::state::now_unix().saturating_sub(t)),
        );
    w.events.record(resumed, ctx).await;
    let n = Notification::for_record(notify::Event::Resume, &rec_active).reason("dormant shell");
    notify::announce(&settings.suspend, w.events, &n, log, Audience::Operator).await;
    let dir = project_dir(settings, paths, &rec)?;
    let result = run_shell(transport.as_ref(), &dir, req, signals, ctx).await;
    lifecycle::close(Some(transport.as_ref()), id, ctx).await;
    result
}

/// The job's `CI_PROJECT_DIR`: `<builds_dir>/<project path>` (the runner's
/// layout for a builds dir that is not shared), else the builds dir.
fn project_dir(settings: &Settings, paths: &EnvPaths, rec: &EnvironmentRecord) -> Result<String> {
    let builds = crate::provider::dirs(settings, paths, rec.storage)?.builds;
    Ok(match &rec.project_path {
        Some(p) => format!("{}/{p}", builds.trim_end_matches('/')),
        None => builds,
    })
}

async fn run_shell(
    transport: &dyn Transport,
    dir: &str,
    req: &ShellRequest,
    signals: &Signals,
    ctx: &Ctx,
) -> Result<(i32, bool)> {
    let line = (!req.command.is_empty()).then(|| req.command.join(" "));
    // SAFETY: isatty only inspects the descriptor.
    let tty = line.is_none() && unsafe { libc::isatty(0) } == 1;
    if line.is_none() {
        ctx.log.info(format!(
            "opening a shell in {dir}; exit it to suspend the environment again{}",
            if req.release {
                " (--release: to release it)"
            } else {
                ""
            }
        ));
    }
    let mut cmd = transport
        .shell_command(dir, line.as_deref(), tty, ctx)
        .await?;
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
            let code = status.code().unwrap_or_else(|| 128 + status.signal().unwrap_or(0));
            // A hang-up reaches the shell and dormant together, and the shell
            // may exit (EOF, status 0) before dormant's signal is handled: a
            // hung-up terminal, or a signal within a moment, still counts.
            // SAFETY: tcgetpgrp only inspects the descriptor.
            if tty && unsafe { libc::tcgetpgrp(0) } == -1 {
                ctx.log.info("the terminal hung up: the environment is suspended, not released");
                return Ok((128 + libc::SIGHUP, true));
            }
            if let Ok(s) = tokio::time::timeout(SIGNAL_SETTLE, signals.any(false)).await {
                ctx.log.info(format!("{s}: the environment is suspended, not released"));
                return Ok((128 + s.number(), true));
            }
            Ok((code, false))
        }
        s = signals.any(false) => {
            ctx.log.info(format!("{s}: ending the shell; the environment is suspended, not released"));
            let _ = child.start_kill();
            let _ = child.wait().await;
            Ok((128 + s.number(), true))
        }
    }
}

/// How long after the shell exits a SIGTERM or SIGHUP that ended it may still
/// arrive (the signal driver runs on the next poll; delivery is immediate).
const SIGNAL_SETTLE: std::time::Duration = std::time::Duration::from_millis(150);

/// The signals that end a shell session: SIGTERM, SIGHUP (the terminal went
/// away) and, while the environment starts, SIGINT (Ctrl-C). Inside the shell
/// Ctrl-C belongs to the program there (the terminal sends it to both).
struct Signals {
    term: tokio::sync::Mutex<tokio::signal::unix::Signal>,
    hup: tokio::sync::Mutex<tokio::signal::unix::Signal>,
    int: tokio::sync::Mutex<tokio::signal::unix::Signal>,
}

#[derive(Debug, Clone, Copy)]
enum Ended {
    Term,
    Hup,
    Int,
}

impl Ended {
    fn number(self) -> i32 {
        match self {
            Ended::Term => libc::SIGTERM,
            Ended::Hup => libc::SIGHUP,
            Ended::Int => libc::SIGINT,
        }
    }
}

impl std::fmt::Display for Ended {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Ended::Term => "SIGTERM",
            Ended::Hup => "SIGHUP",
            Ended::Int => "SIGINT",
        })
    }
}

impl Signals {
    fn new() -> Result<Signals> {
        let listen = |k| signal(k).context("listening for signals");
        Ok(Signals {
            term: tokio::sync::Mutex::new(listen(SignalKind::terminate())?),
            hup: tokio::sync::Mutex::new(listen(SignalKind::hangup())?),
            int: tokio::sync::Mutex::new(listen(SignalKind::interrupt())?),
        })
    }

    /// The next signal that ends the session; SIGINT only with `interrupt`.
    async fn any(&self, interrupt: bool) -> Ended {
        let mut term = self.term.lock().await;
        let mut hup = self.hup.lock().await;
        let mut int = self.int.lock().await;
        tokio::select! {
            _ = term.recv() => Ended::Term,
            _ = hup.recv() => Ended::Hup,
            _ = int.recv(), if interrupt => Ended::Int,
        }
    }
}
