//! `dormant release KEY|ID [--force]`: deletes an environment now. A suspended
//! one is released at once. One held by a job or a shell is refused while its
//! holder lives; one whose holder is gone is recovered first (after the grace,
//! or at once with `--force`), then released. A release that failed half-way
//! is finished.

use anyhow::{bail, Result};
use tokio_util::sync::CancellationToken;

use crate::context::{Ctx, JobLog};
use crate::events::{EventLog, ReleaseCause};
use crate::job::Job;
use crate::lifecycle::recover::{self, Found};
use crate::lifecycle::{self, Reason, World};
use crate::notify::{self, Audience, Event, Notification};
use crate::settings::Settings;
use crate::state::registry;

use super::{open_store, OPERATOR_BUDGET};

pub async fn release(
    settings: &Settings,
    job: &Job,
    key: &str,
    force: bool,
    log: JobLog,
    cancel: CancellationToken,
) -> Result<()> {
    let store = open_store(settings, job)?;
    let id = super::find::env_id(settings, &store, key)?;
    let paths = store.env_paths(id);
    let provider = crate::provider::from_settings(settings, &store)?;
    let events = EventLog::new(store.root(), &settings.events);
    let w = World {
        store: &store,
        provider: provider.as_ref(),
        events: &events,
    };
    let ctx = Ctx::new(log.clone(), cancel, OPERATOR_BUDGET);
    let me = recover::operator("dormant release");
    if registry::peek(&paths)?.is_none() {
        if paths.exists() && registry::remove_recordless(&store, &paths)? {
            log.info(format!(
                "removed {} (a directory without a record)",
                paths.dir.display()
            ));
            return Ok(());
        }
        return Err(crate::exit::Refused::NotFound.because(format!(
            "environment {id} is not in the registry under {}: nothing to release (it was released \
             or expired, or never was here; `dormant list` shows what is)",
            store.environments_dir().display()
        )));
    }
    match recover::recover(w, &paths, &me, &settings.suspend, force, &ctx).await? {
        Found::NoEnvironment => {
            log.info(format!("environment {id} is already gone"));
            return Ok(());
        }
        Found::NotHeld | Found::Recovered { .. } => {}
        Found::Live { holder, .. } => bail!(
            "environment {id} is in use by {} (a process of it is running): it cannot be released \
             under it; wait for it to finish, or cancel the job",
            holder.describe()
        ),
        Found::RunnerAlive {
            holder, runner_pid, ..
        } => bail!(
            "environment {id} is held by {}, which is between two of its stages: no stage of it \
             runs, but the process that runs its stages (GitLab Runner, pid {runner_pid}) does; \
             --force never takes an environment from a live job: wait for the job to finish, or \
             cancel it (its cleanup settles the environment)",
            holder.describe()
        ),
        Found::Idle { holder, idle, .. } => bail!(
            "environment {id} is held by {}, which has no process running but was active {idle} s ago \
             (within suspend.claim_grace, {}): it is recovered automatically after that; \
             `dormant release --force {id}` releases it now",
            holder.describe(),
            settings.suspend.claim_grace
        ),
    }
    let before = registry::peek(&paths)?;
    let why = Reason::new(ReleaseCause::Operator, "dormant release");
    lifecycle::release(w, &paths, &me, None, &why, &ctx).await?;
    log.info(format!("environment {id} released"));
    if let Some(rec) = before {
        let n = Notification::for_record(Event::Release, &rec).reason("dormant release");
        notify::announce(&settings.suspend, &events, &n, &log, Audience::Operator).await;
    }
    Ok(())
}
