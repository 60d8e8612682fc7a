//! Durable state on the runner host: every stage is a new process, so what must
//! survive between stages and jobs lives here, under file locks.
//!
//! Layout under the state dir (0700):
//! - `jobs/<runner>-<job>.json` (+ `.lock`): one job's progress ([`job::JobState`]).
//! - `environments/<id>/record.json` (+ `record.lock`): the registry entry of one
//!   environment ([`environment::EnvironmentRecord`]), beside its SSH key,
//!   known_hosts and, for the `local` provider, its work directory.

pub mod environment;
pub mod job;
pub mod store;

pub use environment::{EnvPaths, EnvStatus, EnvironmentRecord};
pub use job::{JobState, Mode, StageRecord, StageResult};
pub use store::{FileLock, StateStore};

/// Seconds since the Unix epoch: what state files record as times.
pub fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
