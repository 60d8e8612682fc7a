//! `dormant run <script> <stage>`: runs one stage script in the environment.
//!
//! Script exit N → N into `BUILD_EXIT_CODE_FILE`, build failure. The transport
//! breaking → system failure. SIGTERM → the script's process group is killed,
//! the termination recorded (so cleanup releases), and run exits promptly. On a
//! resumed environment `get_sources` and `clear_worktree` are skipped: the
//! checkout would clean the tree the suspended job left.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use crate::context::Ctx;
use crate::exit::{write_build_exit_code, Failure};
use crate::lifecycle::lost::{self, MACHINE_LOST};
use crate::model::{EnvPaths, Machine, StorageMode};
use crate::state::job::{hold_job_alive, LockedJob};
use crate::state::stage_output::{self, OutputCopy, StageNow};
use crate::state::{registry, EnvironmentRecord, JobState, Mode, Phase, StageRecord, StageResult};
use crate::transport::{MachineLost, Ran, Script, ScriptExit, Transport};

use super::Session;

/// Stages the runner would use to check out sources: they would clean the
/// working tree a resumed environment kept.
pub const SKIPPED_ON_RESUME: &[&str] = &["get_sources", "clear_worktree"];

/// run has no timeout of its own: the runner enforces the job's timeout and
/// signals us. This only bounds a run the runner forgot.
const RUN_BUDGET: Duration = Duration::from_secs(30 * 24 * 3600);

/// The stage, top to bottom: the job enters its stages; a checkout stage of a
/// resumed environment is skipped; the script runs in the environment with
/// the stage's marks around it; what it left (the job's request, a lost
/// machine, a question it waits on) is read; the outcome is classified and
/// recorded.
pub async fn run(s: &Session, script_path: &Path, stage: &str) -> Result<(), Failure> {
    let ctx = Ctx::new(s.log.clone(), s.cancel.clone(), RUN_BUDGET);
    let _alive = hold_job_alive(&s.store, &s.runner_id, s.job_id())?;
    let (state, record) = enter_stages(s, stage, &ctx).await?;
    if state.mode == Mode::Resume && SKIPPED_ON_RESUME.contains(&stage) {
        s.log.info(format!(
            "skipping {stage}: environment {} was resumed and keeps the working tree the suspended job left",
            state.env_id
        ));
        record_stage(s, stage, StageResult::Skipped, None, None, None, &ctx).await?;
        return Ok(());
    }
    let body = std::fs::read(script_path)
        .with_context(|| format!("reading the {stage} script {}", script_path.display()))?;
    let machine = record
        .machine
        .clone()
        .with_context(|| format!("environment {} has no machine", state.env_id))?;
    let paths = s.store.env_paths(state.env_id);
    let transport = s.transports.open(&s.provider.target(&machine)?, &paths)?;
    let request_file = crate::job_request::path_for(&s.settings, &paths, record.storage)?;
    let env = script_env(s, &record, &request_file);
    let job_code = crate::job_request::runs_job_code(stage);
    let id = format!("{stage}.{:016x}", fastrand::u64(..));
    let check = lost::Watch {
        provider: s.provider.as_ref(),
        machine: &machine,
    };
    let marked_before = mark_stage_running(&paths)?;
    // A `dormant pause` request names one stage run: one for an earlier
    // stage (its `dormant pause` came too late) goes now, before this
    // stage is announced below (where `dormant pause` learns its id).
    let pause_file = crate::state::pause_request::path(&paths);
    let relayed_file = crate::state::relayed_end::path(&paths);
    let _ = crate::state::pause_request::clear(&paths);
    let (now, copy) = begin_copy(s, &paths, stage, &id);
    let started = Instant::now();
    let result = transport
        .run_script(
            &Script {
                body: &body,
                stage,
                env: &env,
                watch: job_code.then_some(request_file.as_str()),
                id: &id,
                machine: Some(&check),
                copy: copy.as_ref(),
                pause: Some(&pause_file),
                relayed: Some(&relayed_file),
            },
            &ctx,
        )
        .await;
    tracing::debug!(stage, elapsed = ?started.elapsed(), "stage finished");
    end_copy(&paths, now, copy.as_ref(), &result, stage);
    if !marked_before && matches!(&result, Ok(ran) if !ran.left_running) {
        let _ = std::fs::remove_file(&paths.stages_left);
    }
    let request = job_request_after(
        s,
        transport.as_ref(),
        &request_file,
        &result,
        job_code,
        &ctx,
    )
    .await;
    let lost = lost_under(s, &machine, &result, &ctx).await;
    let paused = waits_on_question(&result, &record, &s.settings);
    let volume = record.storage == StorageMode::Volume;
    let (recorded, outcome) = classify(s, &state, stage, result, lost.as_ref(), volume)?;
    // Cleanup settles it by volume mode's rules (the volume kept as the
    // triggers say); a machine mode environment has nothing to keep of a
    // machine that is gone, and follows the usual rules.
    let lost = lost.filter(|_| volume).map(|l| l.what);
    let question = paused.clone();
    record_stage(s, stage, recorded, request, lost, paused, &ctx).await?;
    if let Some(question) = question {
        record_paused(s, &state, &question, &ctx).await;
    }
    // The stage's code is the runner's once this process exits: a relayed
    // script's code noted for a kill before then is not needed now.
    if let Err(e) = crate::state::relayed_end::clear_for(&relayed_file, &id) {
        tracing::warn!("{e:#}");
    }
    outcome
}

/// The job's state and its environment's record, once the job state says
/// its stages began (prepare must have completed).
async fn enter_stages(
    s: &Session,
    stage: &str,
    ctx: &Ctx,
) -> Result<(JobState, EnvironmentRecord), Failure> {
    let locked = LockedJob::lock(&s.store, &s.runner_id, s.job_id(), ctx).await?;
    let state = locked.load()?.with_context(|| {
        format!(
            "job {} has no state ({}): prepare did not run on this host, or cleanup already removed it",
            s.job_id(),
            locked.path().display()
        )
    })?;
    if !state.prepared() {
        return Err(anyhow::anyhow!(
            "job {}: prepare did not complete, so there is no environment to run {stage} in",
            s.job_id()
        )
        .into());
    }
    let mut state = state;
    if state.phase < Phase::Stages {
        // Intent before effect: from here on the job has touched its
        // environment (a resume that fails later is no longer "unused").
        state.phase = Phase::Stages;
        locked.save(&state)?;
    }
    crate::failpoint!("run:first-stage");
    let paths = s.store.env_paths(state.env_id);
    let record = registry::peek(&paths)?.with_context(|| {
        format!(
            "environment {} of job {} has no record ({})",
            state.env_id,
            s.job_id(),
            paths.record.display()
        )
    })?;
    Ok((state, record))
}

/// The variables dormant gives the script: the environment's key, where the
/// job asks for its own suspension, whether `dormant-ask` may pause.
fn script_env(
    s: &Session,
    record: &EnvironmentRecord,
    request_file: &str,
) -> Vec<(String, String)> {
    let mut env = vec![
        (
            "DORMANT_ENVIRONMENT_KEY".to_string(),
            record.key.clone().unwrap_or_default(),
        ),
        (
            crate::job_request::VAR.to_string(),
            request_file.to_string(),
        ),
    ];
    env.extend(crate::lifecycle::pause::script_vars(&s.settings, record));
    // Test builds: the crash points of the scripts on the machine.
    env.extend(crate::failpoint::script_env());
    env
}

/// Marks that a stage runs; whether a mark was there before.
fn mark_stage_running(paths: &EnvPaths) -> Result<bool> {
    // Intent before effect: a `run` killed from here on leaves the mark, and
    // cleanup stops whatever the stage left running in the environment. No
    // fsync: the mark matters to this host's next cleanup, not after a crash
    // of the host, which takes the stage's connection with it.
    // A mark an earlier stage left (its `run` was killed) stays for cleanup.
    let marked_before = paths.stages_left.exists();
    crate::transport::write_private(&paths.stages_left, b"")
        .with_context(|| format!("marking {} (a stage runs)", paths.stages_left.display()))?;
    Ok(marked_before)
}

/// The job log's copy for `dormant attach`: a watcher learns of the stage
/// here. Never fails the stage (it would run unwatched).
fn begin_copy(
    s: &Session,
    paths: &EnvPaths,
    stage: &str,
    id: &str,
) -> (StageNow, Option<OutputCopy>) {
    let now = StageNow {
        version: crate::state::store::FORMAT_VERSION,
        runner: s.runner_id.clone(),
        job: s.job_id(),
        stage: stage.to_string(),
        id: id.to_string(),
        started_ms: stage_output::now_ms(),
        ended: None,
    };
    let copy = match stage_output::begin(paths, &now) {
        Ok(copy) => Some(copy),
        Err(e) => {
            s.log.warn(format!(
                "{stage} runs without a copy of its output for `dormant attach`: {e:#}"
            ));
            None
        }
    };
    (now, copy)
}

/// The end of the stage in its copy for `dormant attach`.
fn end_copy(
    paths: &EnvPaths,
    now: StageNow,
    copy: Option<&OutputCopy>,
    result: &Result<Ran>,
    stage: &str,
) {
    let Some(copy) = copy else { return };
    let code = match result {
        Ok(Ran {
            exit: ScriptExit::Code(c),
            ..
        }) => Some(*c),
        _ => None,
    };
    if let Err(e) = stage_output::end(paths, now, code, copy) {
        tracing::debug!("recording the end of {stage} for `dormant attach`: {e:#}");
    }
}

/// The job may have asked for its own suspension (`crate::job_request`):
/// looked for only when the transport did not already say it is absent.
async fn job_request_after(
    s: &Session,
    transport: &dyn Transport,
    request_file: &str,
    result: &Result<Ran>,
    job_code: bool,
    ctx: &Ctx,
) -> Option<String> {
    match result {
        Ok(Ran {
            exit: ScriptExit::Code(_),
            watched,
            ..
        }) if job_code && *watched != Some(false) => {
            crate::job_request::after_stage(&s.settings, transport, request_file, ctx).await
        }
        _ => None,
    }
}

/// A stage that failed because its machine is gone (a spot reclaim,
/// someone deleting it) is a machine lost: the transport found out while
/// reconnecting (the same question, `check`), or it is asked once now.
async fn lost_under(
    s: &Session,
    machine: &Machine,
    result: &Result<Ran>,
    ctx: &Ctx,
) -> Option<Lost> {
    match result {
        Err(e) => match e.downcast_ref::<MachineLost>() {
            Some(said) => Some(Lost {
                what: said.0.clone(),
                said: true,
            }),
            None => lost::machine_lost(s.provider.as_ref(), machine, ctx)
                .await
                .map(|what| Lost { what, said: false }),
        },
        Ok(_) => None,
    }
}

/// The script asked and waits (docs/pause.md): the job log ends with the
/// question, the stage succeeds, cleanup keeps the script.
fn waits_on_question(
    result: &Result<Ran>,
    record: &EnvironmentRecord,
    settings: &crate::settings::Settings,
) -> Option<String> {
    match result {
        Ok(Ran {
            paused: Some(question),
            paused_mid_line,
            ..
        }) => {
            let question = crate::lifecycle::pause::question_text(question);
            let key = record.key.clone().unwrap_or_default();
            use std::io::Write;
            let mut out = std::io::stdout().lock();
            // (Crash point: the round's output is in the job log, its line
            // not yet.)
            crate::failpoint!("run:paused-line");
            // (The newline that ends a prompt, with the line: one write.)
            let line = crate::lifecycle::pause::log_line(&key, &question);
            let line = if *paused_mid_line {
                format!("\n{line}")
            } else {
                line
            };
            let _ = out.write_all(line.as_bytes());
            // How long the script is kept, on a line of its own after the
            // question's: not from `dormant-ask` into the script's output,
            // where it landed mid-line after a prompt and was no byte the
            // script wrote.
            if let Some(keep) = crate::lifecycle::pause::keep_message(settings, record) {
                let _ = out.write_all(format!("dormant-ask: {keep}\n").as_bytes());
            }
            let _ = out.flush();
            Some(question)
        }
        _ => None,
    }
}

/// The job state says paused (cleanup suspends); the record says it too, so
/// a sweep that settles this job after a cleanup killed before its
/// suspension keeps the script (`paused_by`).
async fn record_paused(s: &Session, state: &JobState, question: &str, ctx: &Ctx) {
    let paths = s.store.env_paths(state.env_id);
    let job = s.job_id();
    let marked = registry::update(&paths, &ctx.uncancellable(), |r| {
        Ok::<_, std::convert::Infallible>(r.paused_by(job, question))
    })
    .await;
    if let Err(e) = marked {
        tracing::warn!(
            "environment {}: recording its paused question: {e}",
            state.env_id
        );
    }
    crate::failpoint!("pause:recorded");
}

/// What became of a machine lost under the stage; `said`: the transport's
/// error says it already.
struct Lost {
    what: String,
    said: bool,
}

fn classify(
    s: &Session,
    state: &JobState,
    stage: &str,
    result: Result<Ran>,
    lost: Option<&Lost>,
    volume: bool,
) -> Result<(StageResult, Result<(), Failure>)> {
    Ok(match result {
        Ok(Ran {
            exit: ScriptExit::Code(0),
            ..
        }) => (StageResult::Ok, Ok(())),
        Ok(Ran {
            exit: ScriptExit::Code(code),
            ..
        }) => {
            if let Some(file) = s.job.build_exit_code_file() {
                write_build_exit_code(&file, code)?;
            }
            (StageResult::Build { code }, Err(Failure::Build { code }))
        }
        Ok(Ran {
            exit: ScriptExit::Cancelled,
            ..
        }) => (
            StageResult::Terminated,
            Err(Failure::System(anyhow::anyhow!(
                "job terminated during {stage}: the script's processes in environment {} were stopped",
                state.env_id
            ))),
        ),
        Err(e) => {
            let kept = "data volume is kept if the job's triggers keep a failure or the job \
                        resumed it, and a job with the key resumes it on a new machine";
            let e = match lost {
                Some(Lost { said: true, .. }) if volume => {
                    e.context(format!("the {kept}"))
                }
                Some(Lost { said: true, .. }) | None => e,
                Some(Lost { what, .. }) if volume => {
                    e.context(format!("{MACHINE_LOST}: {what}; its {kept}"))
                }
                Some(Lost { what, .. }) => e.context(format!("{MACHINE_LOST}: {what}")),
            };
            (
                StageResult::System,
                Err(Failure::System(
                    e.context(format!("running {stage} in environment {}", state.env_id)),
                )),
            )
        }
    })
}

async fn record_stage(
    s: &Session,
    stage: &str,
    result: StageResult,
    request: Option<String>,
    machine_lost: Option<String>,
    paused: Option<String>,
    ctx: &Ctx,
) -> Result<()> {
    // Deaf to SIGTERM: a termination must still be recorded, so cleanup releases.
    let locked = LockedJob::lock(&s.store, &s.runner_id, s.job_id(), &ctx.uncancellable()).await?;
    let Some(mut state) = locked.load()? else {
        // Cleanup already ran (the runner gave up on this stage): nothing to record.
        return Ok(());
    };
    if result == StageResult::Terminated {
        state.terminated = true;
    }
    state.stages.push(StageRecord {
        name: stage.to_string(),
        result,
    });
    if request.is_some() {
        state.job_request = request;
    }
    if machine_lost.is_some() {
        state.machine_lost = machine_lost;
    }
    if paused.is_some() {
        state.paused = paused;
    }
    locked.save_stage(&state)
}
