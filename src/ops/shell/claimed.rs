//! `dormant shell` on an environment no job holds (a suspended one): the
//! shell holds it while the person works in it.
//!
//! The lifecycle, top to bottom in [`shell`]: claim it as a shell holder (a
//! job that tries to resume it meanwhile is refused "in use by a shell"; one
//! whose holder is gone is recovered first) → start its machine (the
//! provider's progress lines, as in prepare) and connect → run the shell
//! (`enter`) → suspend it again, or release it with `--release`. SIGTERM or
//! SIGHUP (a closed terminal) end the shell and suspend it, never release it;
//! Ctrl-C belongs to the program in the shell. Any error after the claim puts
//! it back to suspended. A `dormant shell` killed outright leaves a claim
//! with no live process, recovered to suspended after `suspend.claim_grace`
//! by the next resume, release or sweep.

use anyhow::{bail, Context, Result};

use crate::context::{Ctx, JobLog};
use crate::events::{Event, EventLog, Kind, ReleaseCause, Step, SuspendCause};
use crate::job::Job;
use crate::lifecycle::recover::{self, Found};
use crate::lifecycle::volume::{self, Relaunch};
use crate::lifecycle::{self, update_error, Reason, World};
use crate::model::{EnvPaths, Machine, StorageMode};
use crate::notify::{self, Audience, Notification};
use crate::settings::Settings;
use crate::state::lock::LiveLock;
use crate::state::registry::{self, UpdateError};
use crate::state::{EnvironmentRecord, Holder, StateStore};
use crate::transport::Transport;

use super::terminal::{self, Ended, Signals};
use super::{project_dir, ShellRequest};
use crate::ops::OPERATOR_BUDGET;

/// Claims, starts, enters and settles environment `id`; returns the exit
/// code dormant exits with (the command's, or the login shell's).
pub(super) async fn shell(
    settings: &Settings,
    job: &Job,
    store: &StateStore,
    id: uuid::Uuid,
    req: &ShellRequest,
    log: JobLog,
) -> Result<i32> {
    let paths = store.env_paths(id);
    let provider = crate::provider::from_settings(settings, store)?;
    let events = EventLog::new(store.root(), &settings.events);
    let w = World {
        store,
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
    let (machine, hot_until) = claim(w, &paths, &me, settings, &ctx).await?;
    // From here on the environment is ours: every way out settles it.
    let s = Session {
        w,
        settings,
        job,
        paths: &paths,
        me: &me,
        signals: &Signals::new()?,
        ctx: &ctx,
        hot_until,
    };
    let entered = s.enter(machine, req).await;
    let release = req.release && matches!(entered, Ok((_, false)));
    let settled = s.settle(release, entered.is_ok()).await;
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

/// Claims the environment as a shell: a suspended one becomes `resuming`
/// (its machine returned, to be started); one whose holder is gone is
/// recovered first; one a job or another shell holds is refused. Also
/// returns its hot window's end, if it was hot (its machine runs: the
/// provider's start finds it running and starts nothing; in volume mode it
/// is taken as it is, its volume attached, rather than replaced).
async fn claim(
    w: World<'_>,
    paths: &EnvPaths,
    me: &Holder,
    settings: &Settings,
    ctx: &Ctx,
) -> Result<(Option<Machine>, Option<u64>)> {
    let id = paths.id;
    for attempt in 0..2 {
        let claimed = registry::update(paths, ctx, |r| {
            r.claim_for_resume(me)?;
            Ok::<_, crate::state::NotAllowed>(r.machine.clone())
        })
        .await;
        match claimed {
            // Volume mode: a new machine is made for it, unless it is hot.
            Ok((rec, machine)) if rec.storage == StorageMode::Volume => {
                return Ok(match rec.hot_until() {
                    Some(until) => (machine, Some(until)),
                    None => (None, None),
                })
            }
            Ok((rec, Some(machine))) => return Ok((Some(machine), rec.hot_until())),
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

/// A claimed environment and what works on it.
struct Session<'a> {
    w: World<'a>,
    settings: &'a Settings,
    job: &'a Job,
    paths: &'a EnvPaths,
    me: &'a Holder,
    signals: &'a Signals,
    ctx: &'a Ctx,
    /// The hot window it was claimed in (docs/pause.md): the shell puts it
    /// back hot until then, rather than ending the window of a paused
    /// script someone may still answer.
    hot_until: Option<u64>,
}

impl Session<'_> {
    /// Starts the machine, connects and runs the shell. Returns the exit code
    /// and whether a signal ended it (then it is suspended, never released).
    async fn enter(&self, machine: Option<Machine>, req: &ShellRequest) -> Result<(i32, bool)> {
        let (w, paths, id) = (self.w, self.paths, self.paths.id);
        let started = std::time::Instant::now();
        self.ctx
            .log
            .info(format!("resuming {} environment {id}", w.provider.name()));
        let machine = self.start(machine).await?;
        let rec = registry::peek(paths)?
            .with_context(|| format!("environment {id} has no record any more"))?;
        let target = w.provider.target(&machine)?;
        let transport = crate::transport::open(&target, paths, self.settings, self.job)?;
        self.connect(transport.as_ref(), &rec).await?;
        let (active, ()) = registry::update(paths, self.ctx, |r| r.activate(self.me))
            .await
            .map_err(update_error)?;
        let resumed = Event::about(Kind::Resumed, "shell", &active)
            .by(self.me)
            .duration(started.elapsed())
            .suspended_for(
                rec.suspended_at
                    .map_or(0, |t| crate::state::now_unix().saturating_sub(t)),
            );
        w.events.record(resumed, self.ctx).await;
        self.announce(notify::Event::Resume, &active, "dormant shell")
            .await;
        let dir = project_dir(self.settings, paths, &rec)?;
        let result = self.run_shell(transport.as_ref(), &dir, req).await;
        lifecycle::close(Some(transport.as_ref()), id, self.ctx).await;
        result
    }

    /// Starts the machine (volume mode: makes a new one), and records it.
    /// Ctrl-C, SIGTERM or SIGHUP meanwhile stop, to suspend it again.
    async fn start(&self, machine: Option<Machine>) -> Result<Machine> {
        let (w, id, ctx) = (self.w, self.paths.id, self.ctx);
        // Volume mode records its new machine itself; a started one is recorded here.
        let relaunch = Relaunch::default();
        let started = match machine {
            Some(machine) => tokio::select! {
                m = w.provider.start(&machine, ctx) => m.map(|m| (m, false)),
                s = self.signals.any(true) => bail!("{s} while starting environment {id}"),
            },
            None => tokio::select! {
                m = volume::relaunch(w, self.paths, self.me, &relaunch, ctx) => m.map(|m| (m.machine, true)),
                s = self.signals.any(true) => bail!("{s} while starting environment {id}"),
            },
        };
        match started {
            Ok((machine, recorded)) => {
                if !recorded {
                    registry::update(self.paths, ctx, |r| {
                        r.machine_started(self.me, machine.clone())
                    })
                    .await
                    .map_err(update_error)?;
                }
                Ok(machine)
            }
            Err(e) => {
                let e = e.context(format!("starting environment {id}"));
                self.failed(Step::Start, &e, registry::peek(self.paths)?)
                    .await;
                Err(e)
            }
        }
    }

    /// Connects to the started machine (volume mode: mounts the volume).
    async fn connect(&self, transport: &dyn Transport, rec: &EnvironmentRecord) -> Result<()> {
        let (id, ctx) = (self.paths.id, self.ctx);
        let volumes = self.w.provider.volumes();
        tokio::select! {
            c = volume::connect(self.paths, self.me, transport, volumes, ctx) => if let Err(e) = c {
                self.failed(Step::Connect, &e, Some(rec.clone())).await;
                lifecycle::close(Some(transport), id, ctx).await;
                return Err(e);
            },
            s = self.signals.any(true) => {
                lifecycle::close(Some(transport), id, ctx).await;
                bail!("{s} while connecting to environment {id}")
            }
        }
        Ok(())
    }

    /// Records that `step` failed (if the environment still has a record).
    async fn failed(&self, step: Step, e: &anyhow::Error, rec: Option<EnvironmentRecord>) {
        if let Some(rec) = rec {
            let event = Event::about(Kind::Failed, step.as_str(), &rec)
                .by(self.me)
                .error(e);
            self.w.events.record(event, self.ctx).await;
        }
    }

    /// The shell itself: until it exits, or SIGTERM or SIGHUP end it.
    async fn run_shell(
        &self,
        transport: &dyn Transport,
        dir: &str,
        req: &ShellRequest,
    ) -> Result<(i32, bool)> {
        let log = &self.ctx.log;
        let line = (!req.command.is_empty()).then(|| req.command.join(" "));
        let tty = terminal::wants_tty(line.as_deref());
        if line.is_none() {
            let release = if req.release {
                " (--release: to release it)"
            } else {
                ""
            };
            log.info(format!(
                "opening a shell in {dir}; exit it to suspend the environment again{release}"
            ));
        }
        let cmd = transport
            .shell_command(dir, line.as_deref(), tty, self.ctx)
            .await?;
        let after = "the environment is suspended, not released";
        match terminal::run(cmd, self.signals, log, after).await? {
            Ended::Signalled(s) => Ok((128 + s.number(), true)),
            // A hang-up reaches the shell and dormant together, and the shell
            // may exit (EOF, status 0) before dormant's signal is handled: a
            // hung-up terminal, or a signal within a moment, still counts.
            Ended::Exited(_) if tty && terminal::hung_up() => {
                log.info("the terminal hung up: the environment is suspended, not released");
                Ok((128 + libc::SIGHUP, true))
            }
            Ended::Exited(code) => {
                match tokio::time::timeout(SIGNAL_SETTLE, self.signals.any(false)).await {
                    Ok(s) => {
                        log.info(format!("{s}: the environment is suspended, not released"));
                        Ok((128 + s.number(), true))
                    }
                    Err(_) => Ok((code, false)),
                }
            }
        }
    }

    /// Suspends the environment again (`release`: releases it) and says so.
    /// `entered`: the shell ran (else the suspension says it was not used).
    async fn settle(&self, release: bool, entered: bool) -> Result<()> {
        let (w, paths, id, ctx) = (self.w, self.paths, self.paths.id, self.ctx);
        let log = &ctx.log;
        let rec = registry::peek(paths)?;
        let reason = if release {
            log.info(format!("releasing environment {id} (--release)"));
            let why = Reason::new(ReleaseCause::Operator, "dormant shell --release");
            lifecycle::release(w, paths, self.me, None, &why, ctx).await?;
            "dormant shell --release"
        } else if let Some(until) = self.hot_until.filter(|t| *t > crate::state::now_unix()) {
            let why = Reason::new(SuspendCause::Shell, "dormant shell ended");
            lifecycle::hot::keep_hot(w, paths, self.me, until, &why, ctx).await?;
            log.info(format!(
                "environment {id} is hot again (its machine runs on) until {}",
                lifecycle::hot::until_text(until)
            ));
            // The window's waiter left when the shell claimed it.
            if let Err(e) = lifecycle::hot::start_waiter(paths) {
                log.warn(format!(
                    "starting the hot window's waiter failed ({e:#}); the next sweep suspends it \
                     once the window has passed"
                ));
            }
            "dormant shell ended"
        } else {
            log.info(format!("suspending environment {id}"));
            let why = Reason::new(SuspendCause::Shell, "dormant shell ended");
            lifecycle::suspend(w, paths, self.me, entered, None, &why, ctx).await?;
            "dormant shell ended"
        };
        if let Some(rec) = rec {
            let event = if release {
                notify::Event::Release
            } else {
                notify::Event::Suspend
            };
            self.announce(event, &rec, reason).await;
        }
        Ok(())
    }

    /// Tells the notify hook (and the operator's log) what became of it.
    async fn announce(&self, event: notify::Event, rec: &EnvironmentRecord, reason: &str) {
        let n = Notification::for_record(event, rec).reason(reason);
        let (suspend, log) = (&self.settings.suspend, &self.ctx.log);
        notify::announce(suspend, self.w.events, &n, log, Audience::Operator).await;
    }
}

/// How long after the shell exits a SIGTERM or SIGHUP that ended it may still
/// arrive (the signal driver runs on the next poll; delivery is immediate).
const SIGNAL_SETTLE: std::time::Duration = std::time::Duration::from_millis(150);
