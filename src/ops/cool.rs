//! `dormant cool ID` (hidden): the detached waiter a cleanup starts when it
//! leaves a paused environment hot (`lifecycle::hot`). Sleeps until the
//! window has passed, then suspends the machine; every sweep does the same
//! for a waiter that died, so nothing depends on this process living.

use anyhow::Result;
use tokio_util::sync::CancellationToken;

use crate::context::{Ctx, JobLog};
use crate::events::EventLog;
use crate::job::Job;
use crate::lifecycle::{hot, World};
use crate::settings::Settings;

use super::{open_store, OPERATOR_BUDGET};

pub async fn cool(
    settings: &Settings,
    job: &Job,
    id: uuid::Uuid,
    log: JobLog,
    cancel: CancellationToken,
) -> Result<()> {
    let store = open_store(settings, job)?;
    let provider = crate::provider::from_settings(settings, &store)?;
    let events = EventLog::new(store.root(), &settings.events);
    let w = World {
        store: &store,
        provider: provider.as_ref(),
        events: &events,
    };
    let paths = store.env_paths(id);
    // The window, then a stop, each bounded as an operator command's.
    let budget = settings.suspend.hot_for.get() + OPERATOR_BUDGET;
    let ctx = Ctx::new(log, cancel, budget);
    // Dormant's own connection, for a volume-mode machine's unmount.
    let guests = crate::lifecycle::warm_refill::OverSsh(settings.ssh.clone());
    hot::wait_and_cool(w, &paths, &guests, &ctx).await
}
