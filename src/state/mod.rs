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
//! - `environments/<id>/output/`: a copy of what the running (or last) stage
//!   printed, for `dormant attach` ([`stage_output`]).
//! - `warm/<id>/`: a warm machine booted ahead of any job ([`pool`]).
//! - `environments/<id>/pause-request.json`: a `dormant pause` waiting for its
//!   stage ([`pause_request`]).
//! - `environments/<id>/relayed-end.json`: a relayed paused script's exit code,
//!   between a relaying stage's end on the machine and its `dormant run`'s exit
//!   ([`relayed_end`]).
//! - `trash/`: directories being deleted (renamed here first).

pub mod job;
pub mod lock;
pub mod pause_request;
pub mod pool;
pub mod record;
pub mod registry;
pub mod relayed_end;
pub mod stage_output;
pub mod store;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod transitions;
pub mod volume;
pub mod volume_state;

pub use crate::model::EnvPaths;
pub use job::{JobState, Phase, StageRecord, StageResult};
pub use lock::FileLock;
pub use record::{Claim, EnvStatus, EnvironmentRecord, Holder, Mode, NewEnvironment, Paused};
pub use store::StateStore;
pub use transitions::{Adopted, NotAllowed, Settle};
pub use volume_state::{HostKeyChange, VolumeState, VolumeStep};

/// Seconds since the Unix epoch: what state files record as times.
pub fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Formats unix seconds as RFC 3339 UTC. (Howard Hinnant's civil-from-days.)
pub fn rfc3339(unix: u64) -> String {
    let days = (unix / 86_400) as i64;
    let secs = unix % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        secs / 3600,
        secs % 3600 / 60,
        secs % 60
    )
}
