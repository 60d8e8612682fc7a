//! What every take-over of one `dormant adopt` run shares, and how the run
//! gets it: the state dir, held by `adopt.lock` while the run lasts (one
//! adopt at a time), the cloud, this host's system id, the event log, the
//! run's owner id; and what EC2 holds of this system id.

use anyhow::{bail, Result};
use tokio_util::sync::CancellationToken;

use crate::context::{Ctx, JobLog};
use crate::events::EventLog;
use crate::job::Job;
use crate::ops::{open_store, OPERATOR_BUDGET};
use crate::provider::ec2::takeover::Found;
use crate::provider::ec2::Ec2Provider;
use crate::settings::Settings;
use crate::state::lock::FileLock;
use crate::state::StateStore;

/// What every take-over of one run shares: the state dir (held by
/// `adopt.lock` while the run lasts), the cloud, this host's system id,
/// the event log, and the run's owner id.
pub(super) struct Run {
    pub store: StateStore,
    pub ec2: Ec2Provider,
    pub system_id: String,
    /// This run's owner id, written with every epoch it takes: a host
    /// adopting the same environment at once writes another one.
    pub owner: String,
    pub events: EventLog,
    pub ctx: Ctx,
    _lock: FileLock,
}

impl Run {
    /// Opens the state dir and the cloud, and waits for the adopt lock.
    pub async fn open(
        settings: &Settings,
        job: &Job,
        log: JobLog,
        cancel: CancellationToken,
    ) -> Result<Run> {
        let store = open_store(settings, job)?;
        let ec2 = Ec2Provider::new(settings, &store)?;
        let system_id = crate::identity::system_id(settings, &store)?;
        let events = EventLog::new(store.root(), &settings.events);
        let ctx = Ctx::new(log, cancel, OPERATOR_BUDGET);
        let lock_path = store.root().join("adopt.lock");
        let Some(lock) =
            FileLock::acquire(&lock_path, &ctx, "another dormant adopt to finish").await?
        else {
            bail!("could not take {}", lock_path.display());
        };
        Ok(Run {
            store,
            ec2,
            system_id,
            owner: crate::provider::ec2::handover::new_owner_id(),
            events,
            ctx,
            _lock: lock,
        })
    }

    /// What EC2 holds of this system id (and runner, if the settings
    /// name one).
    pub async fn find(&self, runner: Option<&str>) -> Result<Found> {
        let runner = runner.map(str::trim);
        self.ctx.log.info(format!(
            "looking for environments of system {}{} to adopt",
            self.system_id,
            runner
                .map(|r| format!(", runner {r}"))
                .unwrap_or_else(|| " (every runner)".into())
        ));
        self.ec2.takeover_candidates(runner, &self.ctx).await
    }
}
