//! Durable state on the runner host: every stage is a new process, so what must
//! survive between stages and jobs lives here, under file locks. This layer
//! owns the environment lifecycle's state machine (`transitions.rs`): nothing
//! outside it writes an environment's status or claim. It imports only
//! `model` and `context`, never a provider or a stage.
//!
//! Layout under the state dir (0700, files 0600):
//! - `jobs/<runner>-<job>.json` (+ `.lock`, `.live`): one job's progress ([`job::JobState`]).
//! - `environments/<id>/record.json` (+ `record.lock`, `holder.live`): the registry
//!   entry of one environment ([`record::EnvironmentRecord`]), beside its SSH key,
//!   known_hosts and, for the `local` provider, its work directory.
//! - `environments/.new-*`: a record being created (renamed into place).
//! - `trash/`: directories being deleted (renamed here first).

pub mod job;
pub mod lock;
pub mod record;
pub mod registry;
pub mod store;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod transitions;
pub mod volume;

pub use crate::model::EnvPaths;
pub use job::{JobState, Phase, StageRecord, StageResult};
pub use lock::FileLock;
pub use record::{Claim, EnvStatus, EnvironmentRecord, Holder, Mode, NewEnvironment};
pub use store::StateStore;
pub use transitions::{NotAllowed, Settle};
pub use volume::{HostKeyChange, VolumeState, VolumeStep};

/// Seconds since the Unix epoch: what state files record as times.
pub fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
