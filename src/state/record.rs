//! The registry entry of one environment (`environments/<id>/record.json`):
//! what it is, where its machine is, and who holds it.
//!
//! `status` and `claim` are private to `state`: they change only through the
//! transitions in `lifecycle.rs`, applied under the record lock by
//! `registry::update`. Everything else reads them through accessors.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::store::{FORMAT_VERSION, VOLUME_FORMAT_VERSION};
use super::volume_state::{HostKeyChange, VolumeState};
use crate::model::{Machine, StorageMode};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EnvStatus {
    /// A new job's prepare is making the machine.
    Creating,
    /// A job claimed a suspended environment and is starting its machine.
    Resuming,
    /// A job (or a shell) is using it.
    Active,
    /// Its machine is being stopped, to be kept.
    Suspending,
    /// Stopped, disk kept, waiting for a job with its key.
    Suspended,
    /// Its machine is being deleted; then its directory goes.
    Releasing,
}

impl EnvStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            EnvStatus::Creating => "creating",
            EnvStatus::Resuming => "resuming",
            EnvStatus::Active => "active",
            EnvStatus::Suspending => "suspending",
            EnvStatus::Suspended => "suspended",
            EnvStatus::Releasing => "releasing",
        }
    }

    pub const ALL: [EnvStatus; 6] = [
        EnvStatus::Creating,
        EnvStatus::Resuming,
        EnvStatus::Active,
        EnvStatus::Suspending,
        EnvStatus::Suspended,
        EnvStatus::Releasing,
    ];
}

/// Whether a job made the environment or resumed it: decides what a stale
/// claim of it is settled to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    New,
    Resume,
}

/// Who holds an environment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Holder {
    /// A job's stages. Alive while one of its stage processes holds the job's
    /// liveness file (`jobs/<runner>-<job>.live`).
    Job {
        runner_id: String,
        job_id: u64,
        mode: Mode,
        /// The job's `suspend_on_failure`: a dead job's environment is settled
        /// as its triggers say for a system failure.
        suspend_on_failure: bool,
    },
    /// `dormant shell`. Alive while it holds the environment's `holder.live`.
    Shell { pid: u32 },
    /// An operator's `dormant release`, a `sweep`, or a recovery. Alive while
    /// it holds the environment's `holder.live`.
    Operator { pid: u32, what: String },
}

impl Holder {
    /// For messages: "job 12", "a shell (pid 345)", "dormant sweep (pid 9)".
    pub fn describe(&self) -> String {
        match self {
            Holder::Job { job_id, .. } => format!("job {job_id}"),
            Holder::Shell { pid } => format!("a shell (dormant shell, pid {pid})"),
            Holder::Operator { pid, what } => format!("{what} (pid {pid})"),
        }
    }

    pub fn job_id(&self) -> Option<u64> {
        match self {
            Holder::Job { job_id, .. } => Some(*job_id),
            _ => None,
        }
    }

    pub fn is_job(&self, runner: &str, job: u64) -> bool {
        matches!(self, Holder::Job { runner_id, job_id, .. } if runner_id == runner && *job_id == job)
    }
}

/// A claim on an environment: who holds it, since when, and when it last
/// showed activity (a stage of its job started or ended).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claim {
    pub holder: Holder,
    pub since: u64,
    pub last_activity: u64,
}

impl Claim {
    pub fn new(holder: Holder) -> Claim {
        let now = super::now_unix();
        Claim {
            holder,
            since: now,
            last_activity: now,
        }
    }
}

/// `environments/<id>/record.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EnvironmentRecord {
    pub version: u32,
    pub id: Uuid,
    /// The environment key, once the machine exists.
    pub key: Option<String>,
    pub provider: String,
    pub machine: Option<Machine>,
    pub runner_id: String,
    pub system_id: String,
    pub project_id: u64,
    pub project_path: Option<String>,
    pub(super) status: EnvStatus,
    /// Who holds it; `None` only when suspended.
    #[serde(default)]
    pub(super) claim: Option<Claim>,
    /// Format 1 named the holding job only; read to recover such records.
    #[serde(default, skip_serializing)]
    pub(super) current_job: Option<u64>,
    /// The job that made it.
    pub created_by_job: u64,
    pub created_at: u64,
    pub suspended_at: Option<u64>,
    pub resumed_at: Option<u64>,
    /// Jobs that have run in it.
    pub job_count: u32,
    /// Why the last suspend or release did not finish cleanly, if it did not.
    #[serde(default)]
    pub last_error: Option<String>,
    /// The last time a stale claim on it was recovered, and how.
    #[serde(default)]
    pub last_recovery: Option<String>,
    /// `machine` (the default: not written, so a machine-mode record is what
    /// it always was) or `volume`.
    #[serde(default, skip_serializing_if = "StorageMode::is_machine")]
    pub storage: StorageMode,
    /// Volume mode: the data volume and how far it is attached.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume: Option<VolumeState>,
    /// Host keys pinned anew for a new machine of the environment (volume
    /// mode), oldest first, the last few kept: what changed and when.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub host_key_changes: Vec<HostKeyChange>,
    /// The question a paused script asks (`dormant-ask`, docs/pause.md),
    /// written by the cleanup of the job that ended paused, cleared by the
    /// cleanup of a later job that did not: what `list` and `inspect` show.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused: Option<Paused>,
    /// The hot window (docs/pause.md): the record is `suspended` but its
    /// machine still runs, until this time (Unix seconds); then a sweep or
    /// the detached waiter suspends it as its mode does. Written only by the
    /// transitions (`suspended_hot` sets it; a resume's `activate`, a
    /// cooling's claim, a release and every `suspended` clear it; a resume's
    /// claim keeps it until `activate`, for a failed resume to go back hot).
    /// Older records have none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) hot_until: Option<u64>,
}

/// What a new environment's record is made from.
pub struct NewEnvironment<'a> {
    pub id: Uuid,
    pub provider: &'a str,
    pub runner_id: &'a str,
    pub system_id: &'a str,
    pub project_id: u64,
    pub project_path: Option<String>,
    pub job_id: u64,
    pub storage: StorageMode,
    /// The job's `image:` (volume mode: every later machine is made from
    /// what it names then).
    pub image: Option<String>,
}

impl EnvironmentRecord {
    /// A new environment, `creating`, held by `holder` (the job making it).
    pub fn new(n: NewEnvironment<'_>, holder: Holder) -> Self {
        let volume = (n.storage == StorageMode::Volume).then(|| VolumeState::creating(n.image));
        EnvironmentRecord {
            version: version_for(n.storage),
            id: n.id,
            key: None,
            provider: n.provider.to_string(),
            machine: None,
            runner_id: n.runner_id.to_string(),
            system_id: n.system_id.to_string(),
            project_id: n.project_id,
            project_path: n.project_path,
            status: EnvStatus::Creating,
            claim: Some(Claim::new(holder)),
            current_job: None,
            created_by_job: n.job_id,
            created_at: super::now_unix(),
            suspended_at: None,
            resumed_at: None,
            job_count: 1,
            last_error: None,
            last_recovery: None,
            storage: n.storage,
            volume,
            host_key_changes: Vec::new(),
            paused: None,
            hot_until: None,
        }
    }

    pub fn status(&self) -> EnvStatus {
        self.status
    }

    /// Until when its machine is kept running for a paused script (the hot
    /// window): `Some` only for a suspended record nobody holds.
    pub fn hot_until(&self) -> Option<u64> {
        self.hot_until
    }

    pub fn claim(&self) -> Option<&Claim> {
        self.claim.as_ref()
    }

    pub fn holder(&self) -> Option<&Holder> {
        self.claim.as_ref().map(|c| &c.holder)
    }

    /// The last sign of life: a claim's activity, a suspension, a resume, the creation.
    pub fn last_activity(&self) -> u64 {
        [
            Some(self.created_at),
            self.suspended_at,
            self.resumed_at,
            self.claim.as_ref().map(|c| c.last_activity),
        ]
        .into_iter()
        .flatten()
        .max()
        .unwrap_or(0)
    }

    /// Format 1 records said `current_job: N` for a held environment; they
    /// become a claim by that job whose liveness file tells whether it lives.
    pub(super) fn upgrade(mut self) -> Self {
        if self.version < 2 && self.claim.is_none() && self.status != EnvStatus::Suspended {
            if let Some(job_id) = self.current_job.take() {
                self.claim = Some(Claim {
                    holder: Holder::Job {
                        runner_id: self.runner_id.clone(),
                        job_id,
                        mode: if self.job_count > 1 {
                            Mode::Resume
                        } else {
                            Mode::New
                        },
                        suspend_on_failure: false,
                    },
                    since: self.last_activity(),
                    last_activity: self.last_activity(),
                });
            } else {
                // A release that format 1 left half done.
                self.claim = Some(Claim {
                    holder: Holder::Operator {
                        pid: 0,
                        what: "an earlier dormant".into(),
                    },
                    since: self.last_activity(),
                    last_activity: self.last_activity(),
                });
            }
        }
        self.version = version_for(self.storage);
        self
    }
}

/// The format version a record is written with: a volume-mode record is one
/// an older dormant must refuse (it would take the missing machine of a
/// suspended environment for a lost one), a machine-mode record stays
/// readable by it.
fn version_for(storage: StorageMode) -> u32 {
    match storage {
        StorageMode::Machine => FORMAT_VERSION,
        StorageMode::Volume => VOLUME_FORMAT_VERSION,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_format_1_record_is_read_as_a_claim_by_its_job() {
        let v1 = r#"{"version":1,"id":"00000000-0000-0000-0000-000000000001","key":null,
            "provider":"local","machine":null,"runner_id":"7","system_id":"s","project_id":5,
            "project_path":null,"status":"active","current_job":42,"created_by_job":42,
            "created_at":100,"suspended_at":null,"resumed_at":null,"job_count":1}"#;
        let rec: EnvironmentRecord = serde_json::from_str(v1).unwrap();
        let rec = rec.upgrade();
        assert_eq!(rec.status(), EnvStatus::Active);
        assert!(rec.holder().unwrap().is_job("7", 42));
        let text = serde_json::to_string(&rec).unwrap();
        assert!(!text.contains("current_job"), "{text}");
    }
}

/// A paused script's question (see [`EnvironmentRecord::paused`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Paused {
    pub question: String,
    /// The job whose stage asked.
    pub job_id: u64,
    /// When that job's cleanup kept it (Unix seconds).
    pub at: u64,
    /// The paused script is gone, and why: a suspension did not keep the
    /// machine's memory (a hibernation that fell back to a power-off).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lost: Option<String>,
    /// The paused script ended, its output is in a job's log, and its
    /// continue gave this exit code, but that job's `dormant run` was
    /// killed before the runner had it (`super::relayed_end`): the next
    /// `dormant-continue` gives it, with nothing more to show.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended: Option<i32>,
}
