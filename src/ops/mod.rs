//! Operator commands beside the four stages: `list`, `inspect`, `events`,
//! `release`, `sweep`, `adopt` (take over a lost host's EC2 environments),
//! `metrics`, `shell`, `attach` (watch a running job), `pause` (pause a running job), `warm` (top up the warm pool), `cool` (the detached end of a hot window), and `try`, which drives a whole job like GitLab Runner
//! would. They use the lifecycle (`crate::lifecycle`), never a stage.

pub mod adopt;
pub mod attach;
pub mod cool;
pub mod events;
pub mod find;
pub mod list;
pub mod metrics;
pub mod pause;
pub mod release;
pub mod shell;
pub mod sweep;
pub mod try_job;
pub mod warm;

use anyhow::Result;

use crate::job::Job;
use crate::settings::Settings;
use crate::state::StateStore;

/// How long `release` and `sweep` may take.
pub const OPERATOR_BUDGET: std::time::Duration = std::time::Duration::from_secs(30 * 60);

pub fn open_store(settings: &Settings, job: &Job) -> Result<StateStore> {
    StateStore::open(&settings.state_dir(job)?)
}
