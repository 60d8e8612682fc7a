//! dormant: a GitLab Runner custom executor whose environments can be
//! suspended at the end of a job and resumed, disk intact, by a later job.
//!
//! `main.rs` only calls [`main_entry`]; everything else is reachable from here
//! so tests can drive it. See `README.md` and `docs/architecture.md`.

pub mod cli;
pub mod context;
pub mod contract;
#[cfg(test)]
mod doc_links_tests;
pub mod envkey;
pub mod events;
pub mod exit;
pub mod failpoint;
#[cfg(test)]
mod fuzz;
pub mod identity;
pub mod job;
pub mod job_request;
#[cfg(test)]
mod layout_tests;
pub mod lifecycle;
pub mod model;
pub mod notify;
pub mod ops;
pub mod provider;
pub mod runner_sim;
pub mod settings;
pub mod stages;
pub mod state;
pub mod text;
pub mod transport;
pub mod wait;

use std::io::Write;
use std::panic::AssertUnwindSafe;

use anyhow::Result;
use clap::Parser;
use tokio_util::sync::CancellationToken;

use cli::{Cli, Command};
use context::JobLog;
use exit::{ExitCodes, Failure};
use job::Job;
use settings::Settings;

/// Parses the command line, runs it, and returns the process exit code. A
/// panic becomes a system failure, never the 101 the runner would call unknown.
pub fn main_entry() -> i32 {
    hold_termination_signals();
    let job = Job::from_env();
    scrub_job_variables();
    failpoint::init(
        job.driver_var("DORMANT_FAILPOINT"),
        job.driver_var("DORMANT_FAILPOINT_ONCE"),
        job.driver_var("DORMANT_FAILPOINT_PAUSE"),
    );
    #[cfg(feature = "ec2")]
    provider::ec2::guest_seam::init(job.driver_var("DORMANT_TEST_EC2_VOLUMES"));
    let codes = job.exit_codes();
    std::panic::set_hook(Box::new(|info| {
        eprintln!("dormant: internal error (a bug, please report it): {info}");
    }));
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() {
                codes.system_failure
            } else {
                0
            };
        }
    };
    init_logging(&job);
    match std::panic::catch_unwind(AssertUnwindSafe(|| run(cli, job, codes))) {
        Ok(code) => code,
        Err(_) => codes.system_failure,
    }
}

/// The job's variables (`CUSTOM_ENV_*`, the job token among them) now live in
/// `Job`; remove them from the process environment so no child — an SSH master
/// that outlives the stage, an `ssh` channel — inherits them. Called before any
/// thread exists.
fn scrub_job_variables() {
    let names: Vec<_> = std::env::vars_os()
        .map(|(k, _)| k)
        .filter(|k| {
            k.to_str()
                .is_some_and(|k| k.starts_with(contract::var::CUSTOM_ENV_PREFIX))
        })
        .collect();
    for name in names {
        std::env::remove_var(name);
    }
}

fn init_logging(job: &Job) {
    // Debug chatter (SDK calls, timings) only when asked: stderr is the job log.
    let filter = job.driver_var("DORMANT_LOG").unwrap_or("warn,dormant=warn");
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_writer(std::io::stderr)
        .without_time()
        .with_target(false)
        .try_init();
}

fn run(cli: Cli, job: Job, codes: ExitCodes) -> i32 {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("dormant: cannot start the async runtime: {e}");
            return codes.system_failure;
        }
    };
    let result = runtime.block_on(dispatch(cli, job));
    codes.exit_code(&result, &mut std::io::stderr())
}

async fn dispatch(cli: Cli, job: Job) -> Result<(), Failure> {
    let (settings, _path) = Settings::load(cli.config.as_deref(), &job)?;
    let log = JobLog::stderr();
    let cancel = CancellationToken::new();
    listen_for_termination(cancel.clone());
    release_termination_signals();
    match cli.command {
        Command::Config => {
            let mut out = std::io::stdout().lock();
            stages::config::config(&settings, &job, &mut out)?;
            out.flush().map_err(anyhow::Error::from)?;
            Ok(())
        }
        Command::Prepare => {
            let s = stages::Session::from_job(settings, job, log, cancel)?;
            stages::prepare::prepare(&s).await
        }
        Command::Run { script, stage } => {
            let s = stages::Session::from_job(settings, job, log, cancel)?;
            stages::run::run(&s, &script, &stage).await
        }
        Command::Cleanup => {
            let s = stages::Session::from_job(settings, job, log, cancel)?;
            stages::cleanup::cleanup(&s).await
        }
        Command::List { json } => Ok(ops::list::list(
            &settings,
            &job,
            json,
            &mut std::io::stdout(),
        )?),
        Command::Inspect { key } => Ok(ops::list::inspect(
            &settings,
            &job,
            &key,
            &mut std::io::stdout(),
        )?),
        Command::Events {
            key,
            since,
            follow,
            json,
        } => {
            let req = ops::events::EventsRequest {
                key,
                since,
                follow,
                json,
            };
            Ok(ops::events::events(&settings, &job, &req, cancel, &mut std::io::stdout()).await?)
        }
        Command::Release { key, force } => {
            Ok(ops::release::release(&settings, &job, &key, force, log, cancel).await?)
        }
        Command::Shell {
            key,
            release,
            command,
        } => {
            let req = ops::shell::ShellRequest {
                key,
                release,
                command,
            };
            let code = ops::shell::shell(&settings, &job, &req, log).await?;
            if code != 0 {
                // The shell's or the command's exit code is dormant's (as with
                // ssh); the environment is settled by now.
                std::process::exit(code);
            }
            Ok(())
        }
        Command::Attach { key, from_now } => {
            let req = ops::attach::AttachRequest { key, from_now };
            let mut out = std::io::stdout();
            ops::attach::attach(&settings, &job, &req, log, cancel, &mut out).await?;
            Ok(())
        }
        Command::Pause { key, reason } => {
            Ok(ops::pause::pause(&settings, &job, &key, reason.as_deref(), log, cancel).await?)
        }
        Command::Sweep { delete_orphans } => {
            Ok(ops::sweep::sweep(&settings, &job, delete_orphans, log, cancel).await?)
        }
        Command::Adopt => {
            ops::adopt::adopt(&settings, &job, log, cancel).await?;
            Ok(())
        }
        Command::Warm => Ok(ops::warm::warm(&settings, &job, log, cancel).await?),
        Command::Cool { id } => {
            let id = uuid::Uuid::parse_str(&id).map_err(|e| {
                anyhow::anyhow!("dormant cool: {id:?} is not an environment id: {e}")
            })?;
            Ok(ops::cool::cool(&settings, &job, id, log, cancel).await?)
        }
        Command::Metrics => {
            let store = state::StateStore::open(&settings.state_dir(&job)?)?;
            Ok(ops::metrics::metrics(
                &settings,
                &store,
                &log,
                &mut std::io::stdout(),
            )?)
        }
        Command::Try { keep } => Ok(ops::try_job::try_job(
            cli.config.as_deref(),
            &settings,
            &job,
            keep,
            &mut std::io::stdout(),
        )?),
    }
}

/// SIGTERM (and SIGINT) become a cancellation every wait selects on. The
/// runner sends SIGTERM to the whole process group on cancel and timeout;
/// Ctrl-C sends SIGINT to the terminal's foreground process group (an
/// operator's `dormant attach` detaches on it, exit 0). Installing the
/// handler sets the disposition whatever dormant inherited: a runner or a
/// shell that started dormant in the background (SIGINT ignored, as a
/// non-interactive shell's `&` does) or under `nohup` changes nothing.
fn listen_for_termination(cancel: CancellationToken) {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        return;
    };
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        cancel.cancel();
    });
}

/// The termination signals, blocked from dormant's first line until their
/// handler is installed ([`release_termination_signals`]): one that comes
/// meanwhile (a Ctrl-C right after starting `dormant attach`, the runner's
/// SIGTERM right after starting a stage) waits and is then handled like any
/// other, instead of killing dormant or, inherited as ignored, being lost.
/// Called before any thread exists; children never inherit the mask (Rust's
/// `Command` and `transport::signals::reset_in_child` clear it).
fn hold_termination_signals() {
    set_termination_mask(libc::SIG_BLOCK);
}

/// Unblocks what [`hold_termination_signals`] blocked (and a SIGINT or
/// SIGTERM blocked by whoever started dormant): a pending one is delivered
/// now, to the handler.
fn release_termination_signals() {
    set_termination_mask(libc::SIG_UNBLOCK);
}

fn set_termination_mask(how: libc::c_int) {
    // SAFETY: sigemptyset/sigaddset fill a zeroed set of ours;
    // pthread_sigmask only changes this thread's mask.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::pthread_sigmask(how, &set, std::ptr::null_mut());
    }
}

/// Result type of the operator commands.
pub type OpResult = Result<()>;
