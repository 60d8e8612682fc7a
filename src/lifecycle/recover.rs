//! Claims that can be proven stale, and their recovery. A claim's holder is
//! alive while one of its processes holds its liveness file (see
//! `state::registry::liveness`); one with no process left that has been idle
//! past `suspend.claim_grace` is gone. Whoever meets such a claim — a resume of
//! the environment, `dormant release`, `dormant sweep` — takes it over and
//! settles it as `state::transitions::on_stale` says, saying so in its log:
//! nothing stays blocked for the TTL, nothing is lost.

use anyhow::Result;

use super::{Reason, World};
use crate::context::Ctx;
use crate::events::{Event, Kind, ReleaseCause, SuspendCause};
use crate::model::EnvPaths;
use crate::notify::{self, Audience, Notification};
use crate::settings::SuspendSettings;
use crate::state::job::live_runner;
use crate::state::lock::LiveLock;
use crate::state::registry::{self, Liveness};
use crate::state::transitions::on_stale;
use crate::state::{EnvStatus, Holder, Settle};

/// What a look at an environment's claim found (and did).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Found {
    /// No such environment.
    NoEnvironment,
    /// Nobody holds it.
    NotHeld,
    /// Its holder has a process running.
    Live { holder: Holder, status: EnvStatus },
    /// Its holder has no process running but was active `idle` s ago, within
    /// the grace (a job between two stages, or one that just died).
    Idle {
        holder: Holder,
        status: EnvStatus,
        idle: u64,
    },
    /// Asked to skip the grace (`force`), but the holder is a job whose
    /// runner process (`runner_pid`, which runs all its stages) still runs:
    /// the job is between two stages, not gone.
    RunnerAlive {
        holder: Holder,
        status: EnvStatus,
        runner_pid: u32,
    },
    /// It was held by `from`, gone; now settled (`Settle::Suspend`/`Resuspend`:
    /// suspended; `Release`: deleted).
    Recovered { from: Holder, settled: Settle },
}

/// `me`: who recovers (an operator command, a sweep, a job's prepare): while
/// recovering, the environment is held by `me`, proven alive by the
/// environment's `holder.live`. `force`: skip the grace (an operator's
/// `release --force`) — never a live holder, nor a job whose runner process
/// still runs (between two stages no process of the job holds its liveness
/// file; its runner, which calls every stage, does live).
pub async fn recover(
    w: World<'_>,
    paths: &EnvPaths,
    me: &Holder,
    policy: &SuspendSettings,
    force: bool,
    ctx: &Ctx,
) -> Result<Found> {
    let grace = policy.claim_grace.get();
    let (old, status, idle, snapshot, _alive) = {
        let Some(env) = registry::lock(paths, ctx).await? else {
            return Ok(Found::NoEnvironment);
        };
        let Some(rec) = env.load()? else {
            return Ok(Found::NoEnvironment);
        };
        let Some(claim) = rec.claim().cloned() else {
            return Ok(Found::NotHeld);
        };
        let idle = match registry::liveness(w.store, paths, &rec, grace)? {
            Liveness::Live => {
                return Ok(Found::Live {
                    holder: claim.holder,
                    status: rec.status(),
                })
            }
            Liveness::Idle { idle } if !force => {
                return Ok(Found::Idle {
                    holder: claim.holder,
                    status: rec.status(),
                    idle,
                })
            }
            Liveness::Idle { idle } => {
                if let Holder::Job {
                    runner_id, job_id, ..
                } = &claim.holder
                {
                    if let Some(runner) = live_runner(w.store, runner_id, *job_id) {
                        return Ok(Found::RunnerAlive {
                            holder: claim.holder,
                            status: rec.status(),
                            runner_pid: runner.pid,
                        });
                    }
                }
                idle
            }
            Liveness::Gone { idle } => idle,
        };
        // Proof we live, taken before the claim is ours.
        let alive = LiveLock::hold(&paths.holder_live)?;
        let why = format!(
            "{} took over from {} (no process left, idle {} s) at {}",
            me.describe(),
            claim.holder.describe(),
            idle,
            crate::state::now_unix()
        );
        let (rec, old) =
            registry::update_locked(&env, |r| r.take_over(me, why)).map_err(super::update_error)?;
        (old, rec.status(), idle, rec, alive)
    };
    let settled = on_stale(status, &old, policy.enabled);
    let what = match settled {
        Settle::Release => "releasing it",
        Settle::Suspend => {
            "suspending it, as its job asked (a failure trigger, or its script paused)"
        }
        Settle::Resuspend | Settle::Nothing => "putting it back to suspended",
    };
    ctx.log.info(format!(
        "environment {} was held by {} ({}), which has no process left (idle {}): {what}",
        paths.id,
        old.describe(),
        status.as_str(),
        super::human_age(idle).trim_end_matches(" ago"),
    ));
    let words = format!(
        "recovered from {}, which had no process left",
        old.describe()
    );
    let recovered = Event::about(Kind::Recovered, settle_name(settled), &snapshot)
        .by(me)
        .from_holder(&old)
        .job(old.job_id())
        .reason(&format!(
            "{words} (it was {}, idle {idle} s)",
            status.as_str()
        ));
    w.events.record(recovered, ctx).await;
    let event = match settled {
        Settle::Release => {
            let why = Reason::new(ReleaseCause::Recovered, &words).job(old.job_id());
            super::release(w, paths, me, None, &why, ctx).await?;
            Some(notify::Event::Release)
        }
        Settle::Suspend | Settle::Resuspend => {
            let why = Reason::new(SuspendCause::Recovered, &words).job(old.job_id());
            super::suspend(w, paths, me, settled == Settle::Suspend, None, &why, ctx).await?;
            Some(notify::Event::Suspend)
        }
        Settle::Nothing => None,
    };
    if let Some(event) = event {
        // Whoever waits for this environment learns what became of it.
        let n = Notification::for_record(event, &snapshot).reason(words);
        notify::announce(policy, w.events, &n, &ctx.log, Audience::Job).await;
    }
    Ok(Found::Recovered { from: old, settled })
}

/// What a stale claim was settled to, as a `recovered` event's cause.
fn settle_name(settled: Settle) -> &'static str {
    match settled {
        Settle::Release => "release",
        Settle::Suspend => "suspend",
        Settle::Resuspend => "resuspend",
        Settle::Nothing => "nothing",
    }
}

/// The holder a process that is not a job's stage uses: `what` names it in messages.
pub fn operator(what: &str) -> Holder {
    Holder::Operator {
        pid: std::process::id(),
        what: what.to_string(),
    }
}
