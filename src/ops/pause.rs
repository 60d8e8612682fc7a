//! `dormant pause KEY|JOB_ID [--reason TEXT]`: pause a running job from the
//! runner host (docs/pause.md, "Pausing from the host").
//!
//! The job's current user script stage ends successfully at once, with what
//! it printed so far in its job log; its script is frozen (SIGSTOP of its
//! process group on the machine) and kept; the job's remaining stages run,
//! and its cleanup suspends the environment keeping the frozen script, as
//! for a script that asked with `dormant-ask` (the reason is the question).
//! A later job that resumed the environment wakes it with `dormant-continue`.
//!
//! This command only records the request (`state::pause_request`, naming
//! the stage run) and waits until the job state says the stage ended paused:
//! the `dormant run` of the stage passes it to the machine (it holds the
//! stage's session). Killed after the request is written, the pause still
//! happens. Refusals have their own exit codes ([`Refused`]).

use std::time::Duration;

use anyhow::Result;
use tokio_util::sync::CancellationToken;

use crate::context::{Ctx, JobLog};
use crate::exit::Refused;
use crate::job::Job;
use crate::lifecycle::pause;
use crate::settings::Settings;
use crate::state::job::JobState;
use crate::state::pause_request::{self, PauseRequest};
use crate::state::{registry, stage_output, store};
use crate::wait::{Poll, Schedule, Wait};

use super::find;
use super::open_store;

/// How long the stage may take to end paused once asked: its `dormant run`
/// looks every 100 ms and the machine's owner every 50 ms; much longer means
/// the stage does not listen (it runs direct: no owner on the machine).
const BUDGET: Duration = Duration::from_secs(60);
/// How long after the stage's end its job state may take to say it paused.
const RECORD_GRACE: Duration = Duration::from_secs(5);

pub async fn pause(
    settings: &Settings,
    job: &Job,
    key: &str,
    reason: Option<&str>,
    log: JobLog,
    cancel: CancellationToken,
) -> Result<()> {
    let store = open_store(settings, job)?;
    let found = find::find(settings, &store, key)?;
    let id = found.paths.id;
    let Some((runner, job_id)) = found.running_job().filter(|(_, j)| match found.job {
        Some(asked) => asked == *j,
        None => true,
    }) else {
        return Err(Refused::NotRunning.because(format!(
            "environment {id} runs no job (it is {}): only a running job can be paused",
            found.record.status().as_str()
        )));
    };
    if let Some(why) = pause::refusal(settings, &found.record) {
        return Err(Refused::CannotKeep.because(format!(
            "environment {id} cannot keep a paused script: {why}; the job runs on"
        )));
    }
    let now = stage_output::read_stage(&found.paths)?
        .filter(|n| n.runner == runner && n.job == job_id && n.ended.is_none());
    let Some(now) = now.filter(|n| pause::USER_STAGES.contains(&n.stage.as_str())) else {
        let at = match stage_output::read_stage(&found.paths)? {
            Some(n) if n.job == job_id && n.ended.is_none() => format!("it runs {}", n.stage),
            _ => "it is between stages".to_string(),
        };
        return Err(Refused::NotInScript.because(format!(
            "job {job_id} in environment {id} runs no user script now ({at}): only {} can be \
             paused; try again while it runs",
            pause::USER_STAGES.join(" or ")
        )));
    };
    let question = pause::host_question(reason);
    // Intent before effect: the stage's `dormant run` acts on this file.
    pause_request::write(
        &found.paths,
        &PauseRequest {
            version: crate::state::store::FORMAT_VERSION,
            stage_id: now.id.clone(),
            question: question.clone(),
        },
    )?;
    crate::failpoint!("pause:requested");
    let ctx = Ctx::new(log.clone(), cancel, BUDGET);
    let job_file = store.job_file(&runner, job_id);
    let paths = found.paths.clone();
    let mut ended_at: Option<tokio::time::Instant> = None;
    let mut wait = Wait::new(
        &ctx,
        format!("{} of job {job_id} to end paused", now.stage),
        Schedule::fixed(Duration::from_millis(50)),
    )
    .quiet_for(Duration::from_secs(5));
    let mut probe = || -> Result<Poll<bool>> {
        match store::read_json::<JobState>(&job_file)? {
            Some(s) if s.paused.is_some() => return Ok(Poll::Ready(true)),
            Some(_) => {}
            // The job's cleanup ran: the record has the pause, or not.
            None => {
                let kept = registry::peek(&paths)?.is_some_and(|r| r.paused.is_some());
                return Ok(Poll::Ready(kept));
            }
        }
        let over =
            stage_output::read_stage(&paths)?.is_none_or(|n| n.id != now.id || n.ended.is_some());
        if !over {
            // The stage's `dormant run` withdraws a request the machine
            // refused: another script of the environment waits for its
            // answer (one paused script per environment, docs/pause.md).
            if !pause_request::path(&paths).exists() {
                return Err(Refused::AlreadyPaused.because(format!(
                    "environment {id} already has a paused script waiting for its answer (a job \
                     resumed it and did not continue it): continue it first (dormant-continue \
                     in this job's script), or release the environment; nothing was paused, \
                     the job runs on"
                )));
            }
            return Ok(Poll::Pending("the stage runs".into()));
        }
        // Its `dormant run` records the pause just after the stage's end.
        let since = *ended_at.get_or_insert_with(tokio::time::Instant::now);
        if since.elapsed() > RECORD_GRACE {
            return Ok(Poll::Ready(false));
        }
        Ok(Poll::Pending("the stage ended".into()))
    };
    let paused = wait.until(|| std::future::ready(probe())).await;
    let paused = match paused {
        Ok(p) => p,
        Err(e) => {
            let _ = pause_request::clear(&found.paths);
            return Err(e.context(format!(
                "the stage did not pause: does it run direct (`ssh.reconnect_timeout = \"0s\"`, \
                 or the machine cannot keep a stage's output)? The request in {} was withdrawn",
                pause_request::path(&found.paths).display()
            )));
        }
    };
    if !paused {
        anyhow::bail!(
            "{} of job {job_id} in environment {id} ended before it could be paused; nothing was \
             kept",
            now.stage
        );
    }
    let key = found.record.key.clone().unwrap_or_default();
    log.info(format!(
        "paused job {job_id}: its {} ended, its script is frozen on the machine; environment {id} \
         suspends at the job's cleanup, and a job resuming it (key {key}) continues it with \
         dormant-continue",
        now.stage
    ));
    Ok(())
}
