//! A machine lost under a job: terminated, deleted, stopped or crashed while
//! a stage ran on it (a spot reclaim, someone deleting a VM). One question,
//! asked of the provider (`Provider::describe`) in two places: between the
//! SSH transport's attempts to reconnect to a stage whose connection was
//! lost ([`Watch`], the transport's [`MachineCheck`]: a lost machine ends the
//! wait at once rather than after `ssh.reconnect_timeout`), and once by the
//! run stage when a stage failed for any other reason the transport could
//! not tell (a direct stage, a local one). Either way the run stage records
//! the same thing, and cleanup settles it by the same rules
//! (`state::transitions::at_cleanup`: in volume mode the volume is kept when
//! the triggers say so; the notify reason and the event cause say
//! [`MACHINE_LOST`]).

use std::time::Duration;

use async_trait::async_trait;

use crate::context::Ctx;
use crate::model::{Machine, MachineState};
use crate::provider::Provider;
use crate::transport::MachineCheck;

pub use crate::transport::MACHINE_LOST;

/// Bound on one look (an EC2 DescribeInstances; a local file for the others).
const DESCRIBE_LIMIT: Duration = Duration::from_secs(30);

/// `Some(what the provider says)` when `machine` is not running — terminated,
/// deleted, stopped, or (qemu) its process gone — so it will not come back by
/// itself. `None` when it runs or is starting, or when the provider cannot
/// tell (an API error): then waiting, or the stage's own error, stands.
pub async fn machine_lost(provider: &dyn Provider, machine: &Machine, ctx: &Ctx) -> Option<String> {
    let ctx = ctx.uncancellable().within(DESCRIBE_LIMIT);
    match provider.describe(machine, &ctx).await {
        Ok(MachineState::Running | MachineState::Pending) => None,
        Ok(state) => Some(format!("machine {} is {state}", machine.id)),
        Err(e) => {
            tracing::debug!("describing machine {}: {e:#}", machine.id);
            None
        }
    }
}

/// [`machine_lost`] as the transport asks it while a connection is lost.
pub struct Watch<'a> {
    pub provider: &'a dyn Provider,
    pub machine: &'a Machine,
}

#[async_trait]
impl MachineCheck for Watch<'_> {
    async fn lost(&self, ctx: &Ctx) -> Option<String> {
        machine_lost(self.provider, self.machine, ctx).await
    }
}
