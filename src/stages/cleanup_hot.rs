//! Cleanup of a job that ends paused into the hot window (docs/pause.md,
//! "The hot window"): whether its environment has one, and keeping it hot —
//! the machine runs on, the record says suspended until `hot_until`, a
//! detached `dormant cool` ends the window. A child of `cleanup.rs`.

use anyhow::Result;

use crate::events::SuspendCause;
use crate::lifecycle::{self, Reason};
use crate::notify::Event;
use crate::transport::Transport;

use super::{announce, suspend, Held, Why};

/// The hot window of a job that ends paused, if this environment has one
/// (`lifecycle::hot::window`): never for a machine lost under the job.
pub(super) fn hot_window(held: Held<'_>, why: &Why) -> Option<std::time::Duration> {
    if why.paused.is_none() || why.machine_lost.is_some() {
        return None;
    }
    lifecycle::hot::window(&held.s.settings, held.rec)
}

/// Suspends into the hot window: the machine keeps running, the record says
/// suspended until `hot_until`, a detached `dormant cool` ends the window
/// (the sweep does, if it dies). `Ok(true)`: kept hot (the SSH master stays
/// for the resume); a termination meanwhile releases it instead.
pub(super) async fn keep_hot(
    held: Held<'_>,
    why: &Why,
    window: std::time::Duration,
    transport: Option<&dyn Transport>,
) -> Result<bool> {
    let Held {
        s,
        state,
        paths,
        holder,
        ..
    } = held;
    let ctx = held.ctx;
    let id = state.env_id;
    if s.cancel.is_cancelled() {
        return suspend(held, why, transport).await.map(|()| false);
    }
    let reason = why.suspend_reason();
    let until = crate::state::now_unix() + window.as_secs();
    let rec = lifecycle::hot::keep_hot(s.world(), paths, holder, until, &reason, ctx).await?;
    s.log.info(format!(
        "job {} {}: paused; environment {id} stays hot (its machine runs) until {}, then it is \
         suspended; key: {}",
        state.job_id,
        why.outcome.as_str(),
        lifecycle::hot::until_text(until),
        rec.key.as_deref().unwrap_or("(none recorded)")
    ));
    waiter_and_announce(held, &rec, &reason.text, until).await;
    Ok(true)
}

/// A resume that claimed a hot environment and did not reach a stage (its
/// prepare killed or failed, the runner's cleanup after it): back hot for
/// the rest of the window, its machine untouched — a stop would end the
/// paused script in the modes that cannot keep one, and the runner's retried
/// prepare takes the running machine. `None`: not hot (no window recorded,
/// or it has passed), or its machine is not running any more (the provider
/// says so: a spot interruption, someone stopped it): put back to suspended
/// as any resume, and the retry starts it or is told it is gone (a retry
/// taking it hot would only wait for a machine that is not there).
pub(super) async fn back_hot(held: Held<'_>, words: &str) -> Option<Result<bool>> {
    let until = held
        .rec
        .hot_until()
        .filter(|t| *t > crate::state::now_unix())?;
    if let Some(machine) = &held.rec.machine {
        // An answer we cannot get keeps the window: its end cools it anyway.
        match held.s.provider.describe(machine, held.ctx).await {
            Ok(crate::model::MachineState::Running) | Err(_) => {}
            Ok(state) => {
                held.s.log.info(format!(
                    "environment {}: its hot machine {} is {state} now: not kept hot",
                    held.paths.id, machine.id
                ));
                return None;
            }
        }
    }
    let Held {
        s, paths, holder, ..
    } = held;
    let reason = Reason::new(SuspendCause::Unused, words);
    let rec =
        match lifecycle::hot::keep_hot(s.world(), paths, holder, until, &reason, held.ctx).await {
            Ok(rec) => rec,
            Err(e) => return Some(Err(e)),
        };
    s.log.info(format!(
        "environment {}: {words}: back hot (its machine runs on) until {}",
        paths.id,
        lifecycle::hot::until_text(until)
    ));
    waiter_and_announce(held, &rec, words, until).await;
    Some(Ok(true))
}

/// Starts the window's waiter (`dormant cool`) and tells the notify hook.
async fn waiter_and_announce(
    held: Held<'_>,
    rec: &crate::state::EnvironmentRecord,
    text: &str,
    until: u64,
) {
    let (s, paths) = (held.s, held.paths);
    let id = paths.id;
    match lifecycle::hot::start_waiter(paths) {
        Ok(pid) => tracing::debug!("dormant cool {id} started (pid {pid})"),
        Err(e) => s.log.warn(format!(
            "environment {id}: starting the hot window's waiter failed ({e:#}); the next sweep \
             suspends it once the window has passed"
        )),
    }
    announce(
        s,
        Event::Suspend,
        rec,
        format!("{text}; hot until {}", lifecycle::hot::until_text(until)),
    )
    .await;
}
