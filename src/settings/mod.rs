//! dormant's settings: one TOML file, strict parsing, every problem at once.
//!
//! Where the file is: `--config PATH`, else `DORMANT_CONFIG`, else
//! `/etc/dormant/config.toml`; with no file at all the defaults run the `local`
//! provider. Unknown keys and bad values are errors naming the key
//! (`ec2.instance_type: ...`), every one of the file in one error: those that
//! do not parse (`Settings::parse_str`) as well as those out of range. `examples/dormant.toml` documents every setting
//! and a test parses it. Sections of a provider live in their own file.

pub mod boot_image;
pub mod bounds;
mod disk_size;
pub mod duration;
pub mod ec2;
mod ec2_checks;
pub mod events;
mod load;
mod mount_point;
mod parse;
pub mod qemu;
pub mod ssh;

use std::path::{Path, PathBuf};

use serde::Deserialize;

pub use duration::HumanDuration;

use crate::text::excerpt;

/// Where the settings file is when neither `--config` nor `DORMANT_CONFIG` says.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/dormant/config.toml";
/// GitLab Runner keeps its system id next to its config.toml.
pub const DEFAULT_RUNNER_SYSTEM_ID_FILE: &str = "/etc/gitlab-runner/.runner_system_id";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum ProviderKind {
    /// Embedded default: a directory under the state dir, scripts in a local bash.
    #[default]
    Local,
    /// Workspaces on a configured list of SSH hosts.
    Ssh,
    /// One EC2 instance per environment.
    Ec2,
    /// One QEMU virtual machine per environment, on the runner host.
    Qemu,
}

impl ProviderKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ProviderKind::Local => "local",
            ProviderKind::Ssh => "ssh",
            ProviderKind::Ec2 => "ec2",
            ProviderKind::Qemu => "qemu",
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct Settings {
    /// Which provider makes environments: "local", "ssh", "ec2" or "qemu".
    pub provider: ProviderKind,
    /// Where state lives. `DORMANT_STATE_DIR` overrides it.
    pub state_dir: Option<PathBuf>,
    /// The runner id in environment keys; else `CI_RUNNER_ID` from the job payload.
    pub runner_id: Option<String>,
    /// The runner manager's system id; else read from `runner_system_id_file`.
    pub system_id: Option<String>,
    pub runner_system_id_file: PathBuf,
    /// Upper bound for a whole prepare: create or start, capacity, readiness.
    pub prepare_timeout: HumanDuration,
    pub suspend: SuspendSettings,
    /// The event log's rotation (`[events]`).
    pub events: events::EventSettings,
    pub local: LocalSettings,
    pub ssh: ssh::SshSettings,
    pub ec2: ec2::Ec2Settings,
    pub qemu: qemu::QemuSettings,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            provider: ProviderKind::Local,
            state_dir: None,
            runner_id: None,
            system_id: None,
            runner_system_id_file: PathBuf::from(DEFAULT_RUNNER_SYSTEM_ID_FILE),
            prepare_timeout: HumanDuration::from_secs(15 * 60),
            suspend: SuspendSettings::default(),
            events: events::EventSettings::default(),
            local: LocalSettings::default(),
            ssh: ssh::SshSettings::default(),
            ec2: ec2::Ec2Settings::default(),
            qemu: qemu::QemuSettings::default(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct SuspendSettings {
    /// Whether jobs may suspend at all. Off: every environment is released.
    pub enabled: bool,
    /// Suspended environments older than this are deleted.
    pub ttl: HumanDuration,
    /// How long the TTL sweep at the end of every cleanup may take.
    pub cleanup_sweep_budget: HumanDuration,
    /// Runs on every suspend, resume, release and expiry with a JSON document
    /// on stdin (`crate::notify`). Empty: no hook.
    pub notify_command: Vec<String>,
    /// Bound on one run of `notify_command`; then its process group is killed.
    pub notify_timeout: HumanDuration,
    /// Whether a job may ask for its own suspension through `DORMANT_SUSPEND_FILE`.
    pub allow_job_request: bool,
    /// How long an environment whose holder has no process running still
    /// counts as held. The gap between two stages of a job is milliseconds
    /// and a running stage is a live process, so past this the holder is gone:
    /// a resume, `release` or `sweep` recovers the environment.
    pub claim_grace: HumanDuration,
    /// The hot window (docs/pause.md, "The hot window"): how long the machine
    /// of a job that ended paused keeps running before it is suspended as
    /// the provider's mode does (qemu and EC2 only; `local` and `ssh` keep
    /// nothing running for it). A continue within it takes the running
    /// machine. `0s` (the default: a running machine costs money) turns it off.
    pub hot_for: HumanDuration,
}

impl Default for SuspendSettings {
    fn default() -> Self {
        SuspendSettings {
            enabled: true,
            ttl: HumanDuration::from_secs(7 * 24 * 3600),
            cleanup_sweep_budget: HumanDuration::from_secs(10),
            notify_command: Vec::new(),
            notify_timeout: HumanDuration::from_secs(5),
            allow_job_request: true,
            claim_grace: HumanDuration::from_secs(5 * 60),
            hot_for: HumanDuration::from_secs(0),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct LocalSettings {
    /// The shell that runs stage scripts.
    pub shell: PathBuf,
    /// "machine": the work directory is kept while suspended. "volume": the
    /// builds and cache dirs live in a directory of their own that a new work
    /// directory gets on every resume (volume mode without a cloud or a VM:
    /// for trying it out, and for the crash tests of its lifecycle).
    pub storage: crate::model::StorageMode,
}

impl Default for LocalSettings {
    fn default() -> Self {
        LocalSettings {
            shell: PathBuf::from("bash"),
            storage: crate::model::StorageMode::Machine,
        }
    }
}

/// What the settings read from dormant's own environment (never the job's):
/// `DORMANT_CONFIG`, `DORMANT_STATE_DIR`, the runner's `TMPDIR`. Implemented
/// by `job::Job`, which reads the environment once at the edge; settings do
/// not depend on it.
pub trait DriverEnv {
    fn driver_var(&self, name: &str) -> Option<&str>;
}

impl SuspendSettings {
    fn validate(&self, problems: &mut Vec<String>) {
        if let Some(program) = self.notify_command.first() {
            if !Path::new(program).is_absolute() {
                problems.push(format!(
                    "suspend.notify_command: the program {} must be an absolute path \
                     (the runner's PATH is not the operator's shell's)",
                    crate::text::quoted(program)
                ));
            }
        }
    }
}

impl Settings {
    fn validate(&self, problems: &mut Vec<String>) {
        for (key, value) in [
            ("runner_id", &self.runner_id),
            ("system_id", &self.system_id),
        ] {
            if let Some(v) = value {
                if v.trim().is_empty() {
                    problems.push(format!(
                        "{key}: must not be empty (leave it out to use the default)"
                    ));
                }
            }
        }
        if let Some(r) = &self.runner_id {
            if r.contains('/') {
                problems.push(format!(
                    "runner_id: \"{}\" must not contain '/'",
                    excerpt(r)
                ));
            }
        }
        if let Some(d) = &self.state_dir {
            if !d.is_absolute() {
                problems.push(format!(
                    "state_dir: {} must be an absolute path",
                    excerpt(&d.display().to_string())
                ));
            }
        }
        self.check_durations(problems);
        self.suspend.validate(problems);
        self.events.validate(problems);
        self.ssh
            .validate(self.provider == ProviderKind::Ssh, problems);
        self.ec2
            .validate(self.provider == ProviderKind::Ec2, problems);
        if self.provider == ProviderKind::Ec2
            && self.ec2.market == ec2::Market::Spot
            && self.suspend.enabled
            && self.ec2.storage == crate::model::StorageMode::Machine
        {
            // A one-time spot instance cannot be stopped, and EC2 reclaims it
            // when it likes: an environment that *is* the instance would be lost.
            problems.push(
                "ec2.market: \"spot\" cannot hold a suspended environment in machine mode: a spot instance \
                 cannot be stopped, and EC2 may reclaim it at any time, taking the environment's disk with it; \
                 set ec2.storage = \"volume\" (the environment lives on a data volume that outlives its \
                 instances) or suspend.enabled = false (no suspension)"
                    .into(),
            );
        }
        if self.provider == ProviderKind::Ec2
            && self.ec2.warm > 0
            && self.ec2.max_environments > 0
            && self
                .runner_id
                .as_deref()
                .is_none_or(|r| r.trim().is_empty())
        {
            // `dormant warm` runs outside any job: only the settings can say
            // which runner's max_environments its instances count toward.
            problems.push(
                "ec2.warm: with ec2.max_environments, warm instances count toward one runner's limit, and \
                 `dormant warm` runs outside any job: set runner_id (this runner's id)"
                    .into(),
            );
        }
        self.qemu
            .validate(self.provider == ProviderKind::Qemu, problems);
    }
}

#[cfg(test)]
#[path = "settings_tests.rs"]
mod tests;

/// builds_dir / cache_dir on a machine of its own (an EC2 instance, a qemu
/// VM), the same paths for every environment of a storage mode: the
/// configured paths, else in machine mode `builds` and `cache` in the ssh
/// user's home on a cloud image, in volume mode on the data volume mounted
/// at `volume_mount`.
fn own_machine_dirs(
    ssh_user: &str,
    builds_dir: Option<&str>,
    cache_dir: Option<&str>,
    storage: crate::model::StorageMode,
    volume_mount: &str,
) -> crate::model::Dirs {
    let base = match storage {
        crate::model::StorageMode::Machine if ssh_user == "root" => "/root".to_string(),
        crate::model::StorageMode::Machine => format!("/home/{ssh_user}"),
        crate::model::StorageMode::Volume => volume_mount.to_string(),
    };
    crate::model::Dirs {
        builds: builds_dir.map_or_else(|| format!("{base}/builds"), str::to_string),
        cache: cache_dir.map_or_else(|| format!("{base}/cache"), str::to_string),
    }
}
