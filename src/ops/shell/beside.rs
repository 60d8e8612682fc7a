//! `dormant shell` on an environment a job holds: a shell (or the command)
//! on the job's machine, in its project directory, beside the job, over a
//! connection of its own. It claims nothing (the job's exit suspends or
//! releases the environment as it would have); the job's cleanup ends it
//! (`lifecycle::joined`). A `local` environment has no machine to join: the
//! message says where the job's directory is on this host.
//!
//! The lifecycle: is the job running its stages → record who joins (an
//! event) → mark the join, then check the job still runs
//! (`joined::mark`: its cleanup either ends this shell or it is refused
//! here) → connect and run the shell → remove the mark.

use anyhow::{bail, Context, Result};

use crate::context::{Ctx, JobLog};
use crate::events::{Event, EventLog, Kind};
use crate::exit::Refused;
use crate::job::Job;
use crate::lifecycle::joined;
use crate::ops::find::Found;
use crate::settings::Settings;
use crate::state::{EnvStatus, StateStore};

use super::terminal::{self, Ended, Signals};
use super::{project_dir, ShellRequest};
use crate::ops::OPERATOR_BUDGET;

/// Joins the job running in `found`; returns the shell's exit code.
pub(super) async fn join(
    settings: &Settings,
    job: &Job,
    store: &StateStore,
    found: &Found,
    req: &ShellRequest,
    log: JobLog,
) -> Result<i32> {
    let id = found.paths.id;
    let rec = &found.record;
    let (runner, job_id) = match (found.running_job(), found.job) {
        (Some((runner, running)), asked) if asked.is_none_or(|a| a == running) => (runner, running),
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
    let user = crate::ops::attach::local_user(job);
    let event = Event::about(Kind::Joined, "shell", rec)
        .by_text(&format!("dormant shell (pid {})", std::process::id()))
        .job(Some(job_id))
        .user(&user);
    events.record(event, &ctx).await;
    // The window the mark closes: the job was seen running, its cleanup may
    // run now (a test pauses here to prove it).
    crate::failpoint::pause("shell:join-checked").await;
    let nonce = format!("{:016x}", fastrand::u64(..));
    // Intent before effect: the job's cleanup finds the mark and ends the
    // shell, whatever becomes of this process.
    let mark = joined::mark(&found.paths, &runner, job_id, &nonce)?;
    // The window the machine side closes: marked and allowed, not yet
    // registered on the machine; the cleanup may run now (a test pauses here).
    crate::failpoint::pause("shell:join-marked").await;
    let transport = crate::transport::open(&target, &found.paths, settings, job)?;
    let line = (!req.command.is_empty()).then(|| req.command.join(" "));
    let tty = terminal::wants_tty(line.as_deref());
    if line.is_none() {
        log.info(format!(
            "opening a shell in {dir} beside job {job_id} (it runs on; this shell holds nothing \
             and ends when the job does, at most {} s into its cleanup)",
            joined::END_BOUND.as_secs()
        ));
    }
    let cmd = transport
        .join_command(&dir, line.as_deref(), tty, &nonce, &ctx)
        .await?;
    let signals = Signals::new()?;
    let after = format!("job {job_id} runs on");
    let code = match terminal::run(cmd, &signals, &log, &after).await? {
        Ended::Exited(code) => code,
        Ended::Signalled(s) => 128 + s.number(),
    };
    // (97: the wrapper refused, having said why: the job ended first.)
    if mark.ended_by_cleanup() && code != 97 {
        log.info(format!("job {job_id} ended: its cleanup ended this shell"));
    }
    drop(mark);
    Ok(code)
}
