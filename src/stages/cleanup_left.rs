//! What a job's stages left in its environment, dealt with by cleanup before
//! it suspends or releases the environment: the processes of a stage that
//! did not end cleanly (stopped, so a suspended environment never resumes
//! with them), and the question of a script that asked and waits (kept in
//! the record for `list` and `inspect`, or cleared once nothing waits).

use std::time::Duration;

use crate::context::Ctx;
use crate::lifecycle;
use crate::model::EnvPaths;
use crate::state::{registry, EnvironmentRecord, JobState};
use crate::transport::Transport;

use super::Session;

/// Upper bound for stopping what the job's stages left in the environment
/// (reaching the machine, then one command).
const LEFTOVERS_BUDGET: Duration = Duration::from_secs(60);
/// At most this long asking the machine whether a paused script still waits
/// (`keep_question`); past it, the record keeps the question.
const PAUSED_LEFT_LOOK: Duration = Duration::from_secs(30);

/// A stage of the job did not end cleanly (its `run` was killed, or
/// terminated without the machine reporting the script's end): its processes
/// may still run in the environment. They are stopped before the environment
/// is suspended (a suspended environment never resumes with them) or
/// released. A machine that cannot be reached is said in the runner's log;
/// the next prepare of the environment stops them in any case.
pub(super) async fn stop_leftovers(
    s: &Session,
    rec: &EnvironmentRecord,
    paths: &EnvPaths,
    transport: Option<&dyn Transport>,
    ctx: &Ctx,
) {
    let Some(t) = transport else { return };
    let check = rec.machine.as_ref().map(|machine| lifecycle::lost::Watch {
        provider: s.provider.as_ref(),
        machine,
    });
    let check = check
        .as_ref()
        .map(|c| c as &dyn crate::transport::MachineCheck);
    let ctx = ctx.uncancellable().within(LEFTOVERS_BUDGET);
    match t.stop_leftovers(check, &ctx).await {
        Ok(()) => {
            let _ = std::fs::remove_file(&paths.stages_left);
        }
        // Nothing runs on a machine that is gone or stopped (and a machine
        // stopped with its memory kept is stopped by the next prepare's probe).
        Err(e) if e.downcast_ref::<crate::transport::MachineLost>().is_some() => {
            tracing::debug!("no leftovers to stop: {e:#}");
            let _ = std::fs::remove_file(&paths.stages_left);
        }
        Err(e) => s.log.warn(format!(
            "environment {}: what the job's stages left running could not be stopped: {e:#}",
            paths.id
        )),
    }
}

/// The record keeps the question of a script that asked (`list`, `inspect`);
/// a resumed job that ran stages and did not end paused clears it once its
/// script no longer waits: continued to its end, gone, or lost with the
/// machine's memory. A job that did not run `dormant-continue` leaves the
/// script waiting for the next one: the machine is asked
/// ([`Transport::paused_left`]); if it cannot say, the question is kept
/// (`dormant-continue` is what finds out).
///
/// A continued script whose end only this host has (`relayed`: the job's
/// `dormant run` was killed after the machine let the script go) stays on
/// record as paused with that end (`Paused::ended`), under the question it
/// was asked: the next `dormant-continue` gives its exit code.
pub(super) async fn keep_question(
    state: &JobState,
    relayed: Option<&crate::state::relayed_end::RelayedEnd>,
    paths: &EnvPaths,
    rec: &EnvironmentRecord,
    transport: Option<&dyn Transport>,
    ctx: &Ctx,
) {
    let mut paused = state.paused.as_ref().map(|question| crate::state::Paused {
        question: question.clone(),
        job_id: state.job_id,
        at: crate::state::now_unix(),
        lost: None,
        ended: None,
    });
    if let (None, Some(end)) = (&paused, relayed) {
        let asked = rec.paused.as_ref();
        paused = Some(crate::state::Paused {
            question: asked.map(|p| p.question.clone()).unwrap_or_default(),
            job_id: asked.map_or(state.job_id, |p| p.job_id),
            at: crate::state::now_unix(),
            lost: None,
            ended: Some(end.code),
        });
        let kept = registry::update(paths, &ctx.uncancellable(), |r| {
            r.paused = paused;
            Ok::<_, std::convert::Infallible>(())
        })
        .await;
        match kept {
            Ok(_) => {
                let _ = crate::state::relayed_end::clear(&crate::state::relayed_end::path(paths));
            }
            Err(e) => tracing::warn!(
                "environment {}: recording the continued script's exit code {}: {e}",
                paths.id,
                end.code
            ),
        }
        return;
    }
    let ran = !state.stages.is_empty();
    if paused.is_none() && (rec.paused.is_none() || !ran) {
        return;
    }
    let lost = rec.paused.as_ref().is_some_and(|p| p.lost.is_some());
    if paused.is_none() && !lost {
        let waits = match transport {
            Some(t) => t.paused_left(&ctx.within(PAUSED_LEFT_LOOK)).await,
            None => Ok(false),
        };
        match waits {
            Ok(false) => {}
            Ok(true) => return,
            Err(e) => {
                tracing::warn!(
                    "environment {}: whether its paused script still waits is unknown \
                     ({e:#}): the record keeps its question",
                    paths.id
                );
                return;
            }
        }
    }
    let updated = registry::update(paths, &ctx.uncancellable(), |r| {
        r.paused = paused;
        Ok::<_, std::convert::Infallible>(())
    })
    .await;
    if let Err(e) = updated {
        tracing::warn!(
            "environment {}: recording its paused question: {e}",
            paths.id
        );
    }
}
