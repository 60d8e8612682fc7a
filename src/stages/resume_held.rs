//! A resume that finds its environment held by someone else: recovered if
//! the holder is gone, else refused saying who holds it and what to do. A
//! child of `resume.rs`.

use crate::context::Ctx;
use crate::events::RefuseCause;
use crate::exit::Failure;
use crate::lifecycle::recover::{self, Found};
use crate::state::{EnvPaths, EnvStatus, Holder};

use super::super::Session;
use super::refuse;

/// The environment is held by someone else: recover it if its holder is gone,
/// else refuse saying who holds it and what to do.
pub(super) async fn held_elsewhere(
    s: &Session,
    paths: &EnvPaths,
    ctx: &Ctx,
) -> Result<(), Failure> {
    let id = paths.id;
    let w = s.world();
    let me = recover::operator(&format!("job {}'s prepare", s.job_id()));
    let found = recover::recover(w, paths, &me, &s.settings.suspend, false, ctx)
        .await
        .map_err(|e| Failure::System(e.context(format!("recovering environment {id}"))))?;
    match found {
        Found::NoEnvironment | Found::NotHeld | Found::Recovered { .. } => Ok(()),
        Found::Live { holder, status } | Found::RunnerAlive { holder, status, .. } => Err(refuse(
            RefuseCause::InUse,
            held_message(id, &holder, status, None, s),
        )),
        Found::Idle {
            holder,
            status,
            idle,
        } => Err(refuse(
            RefuseCause::InUse,
            held_message(id, &holder, status, Some(idle), s),
        )),
    }
}

/// Why a job cannot have an environment someone else holds, and what to do.
/// `idle`: the holder has no process running and was last active this long
/// ago (within the grace: most likely a job between two of its stages).
fn held_message(
    id: uuid::Uuid,
    holder: &Holder,
    status: EnvStatus,
    idle: Option<u64>,
    s: &Session,
) -> String {
    let recovery = |idle: u64| {
        format!(
            " (none of its processes has run for {idle} s: if it is gone, the environment is \
             recovered automatically once it has been idle for suspend.claim_grace, {})",
            s.settings.suspend.claim_grace
        )
    };
    if status == EnvStatus::Releasing {
        return format!(
            "environment {id} is being released (by {}): it cannot be resumed; run the job \
             without the key to start a new environment",
            holder.describe()
        );
    }
    match holder {
        Holder::Shell { .. } => format!(
            "environment {id} is in use by a shell ({}) on the runner host: retry after it exits",
            holder.describe()
        ),
        Holder::Operator { .. } => format!(
            "environment {id} is {}, held for a moment by {}: retry shortly",
            status.as_str(),
            holder.describe()
        ),
        Holder::Job { .. } => format!(
            "environment {id} is in use by {}{}: one environment runs one job at a time; \
             retry after that job has finished",
            holder.describe(),
            idle.map(recovery).unwrap_or_default()
        ),
    }
}
