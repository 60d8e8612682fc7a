//! Plain data every layer shares: a provider's handle on a machine, how to reach
//! it, where an environment's files are. This module imports nothing of
//! dormant's, so settings, state, providers and transports can all use it
//! without importing each other (see `docs/architecture.md`, "Layers").

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// A provider's handle on the machine of one environment. Stored in the
/// environment record; `fields` are provider-specific (region, host, address).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Machine {
    /// Instance id, directory, or host/workspace: what the provider acts on.
    pub id: String,
    #[serde(default)]
    pub fields: BTreeMap<String, String>,
}

impl Machine {
    pub fn new(id: impl Into<String>) -> Self {
        Machine {
            id: id.into(),
            fields: BTreeMap::new(),
        }
    }
    pub fn with(mut self, k: &str, v: impl Into<String>) -> Self {
        self.fields.insert(k.to_string(), v.into());
        self
    }
    pub fn field(&self, k: &str) -> Option<&str> {
        self.fields.get(k).map(String::as_str)
    }
}

/// How an environment keeps its files while suspended: the `storage` setting
/// of a provider, fixed per environment when it is made (its record and key
/// say which).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StorageMode {
    /// The machine is kept (stopped, powered off, hibernated): everything on
    /// its disks survives. Today's behaviour, the default.
    #[default]
    Machine,
    /// The builds and cache dirs live on a data volume; suspend deletes the
    /// machine and keeps only the volume; resume makes a new machine from the
    /// image configured now and attaches the volume.
    Volume,
}

impl StorageMode {
    pub fn as_str(self) -> &'static str {
        match self {
            StorageMode::Machine => "machine",
            StorageMode::Volume => "volume",
        }
    }

    pub fn is_machine(&self) -> bool {
        *self == StorageMode::Machine
    }
}

/// A provider's handle on the data volume of a volume-mode environment: an
/// EBS volume id, a disk file. Stored in the record; `fields` are
/// provider-specific (zone, size).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Volume {
    pub id: String,
    #[serde(default)]
    pub fields: BTreeMap<String, String>,
}

impl Volume {
    pub fn new(id: impl Into<String>) -> Self {
        Volume {
            id: id.into(),
            fields: BTreeMap::new(),
        }
    }
    pub fn with(mut self, k: &str, v: impl Into<String>) -> Self {
        self.fields.insert(k.to_string(), v.into());
        self
    }
    pub fn field(&self, k: &str) -> Option<&str> {
        self.fields.get(k).map(String::as_str)
    }
}

/// A data volume found by listing what the provider manages (orphan detection).
#[derive(Debug, Clone)]
pub struct ManagedVolume {
    pub volume: Volume,
    /// The environment it belongs to, from its tags or path, whether or not a
    /// record of this state dir knows it (the sweep compares it with the
    /// registry; an orphan's event names it); `None` when nothing says.
    pub env_id: Option<Uuid>,
    /// The provider's word for its state (`available`, `in-use`, `file`).
    pub state: String,
}

/// Where the guest finds the data volume and mounts it (volume mode).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestMount {
    /// The names the guest may give the block device, most specific first,
    /// each stable across machines (`/dev/disk/by-id/...`, or the name the
    /// volume was attached as). The mount waits for whichever appears first
    /// and uses no other device. Several because one attach shows under
    /// different names on different machines (EC2: an NVMe disk named by
    /// its volume id on Nitro, `/dev/xvdf` on Xen). Empty when there is
    /// nothing to mount (the `local` provider's volume is a directory the
    /// attach links in).
    pub devices: Vec<String>,
    /// Where it is mounted.
    pub mountpoint: String,
    /// Directories on it the login user must own: the builds and cache dirs.
    pub user_dirs: Vec<String>,
}

/// How the machine's state looks to the provider.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MachineState {
    Pending,
    Running,
    Stopping,
    Stopped,
    /// Terminated, shutting down, or not found.
    Gone,
    Other(String),
}

impl std::fmt::Display for MachineState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            MachineState::Pending => "pending",
            MachineState::Running => "running",
            MachineState::Stopping => "stopping",
            MachineState::Stopped => "stopped",
            MachineState::Gone => "gone",
            MachineState::Other(s) => s,
        })
    }
}

/// A machine found by listing what the provider manages (orphan detection).
#[derive(Debug, Clone)]
pub struct ManagedMachine {
    pub machine: Machine,
    /// The environment it belongs to, from its tags or directory name.
    pub env_id: Option<Uuid>,
    pub state: MachineState,
    /// Unix seconds when it was launched, if known.
    pub launched_at: Option<u64>,
    /// A warm machine's pool id (tagged so, not yet handed to an
    /// environment): `sweep` looks for its pool entry, not a record.
    pub warm: Option<Uuid>,
}

/// How to reach a machine to run scripts on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// Run bash on this host, in this directory.
    Local { workdir: PathBuf },
    /// Run bash over SSH.
    Ssh(SshTarget),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SshTarget {
    pub host: String,
    pub port: u16,
    pub user: String,
    /// The key to log in with; `None` means the environment's own key (`EnvPaths::ssh_key`).
    pub identity_file: Option<PathBuf>,
    /// Run scripts in this directory (the workspace on an SSH host).
    pub workdir: Option<String>,
    /// A shell snippet run once after each login, in the same command as the
    /// readiness probes (no extra round trip); its output lines `say:TEXT`
    /// and `warn:TEXT` go to the job log. The qemu provider sets the guest's
    /// clock with it after a restore.
    pub on_login: Option<String>,
}

/// Where builds and caches go inside an environment (config's JSON).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dirs {
    pub builds: String,
    pub cache: String,
}

/// The files of one environment under `<state dir>/environments/<id>/`. Only
/// paths: reading and locking them is `state`'s business.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvPaths {
    pub id: Uuid,
    /// `environments/<id>/` (0700).
    pub dir: PathBuf,
    pub record: PathBuf,
    pub lock: PathBuf,
    /// Held (shared) by a non-job holder of the environment (a shell, an
    /// operator's release, a sweep) for as long as it lives: proof it is alive.
    pub holder_live: PathBuf,
    /// The environment's own SSH private key (0600); `.pub` beside it.
    pub ssh_key: PathBuf,
    /// Host keys pinned on first connect.
    pub known_hosts: PathBuf,
    /// Short directory for the SSH control socket (Unix socket paths are short).
    pub control_dir: PathBuf,
    /// Present while a stage runs, and after one that may have left processes
    /// in the environment: cleanup then stops them before it settles it.
    pub stages_left: PathBuf,
}

impl EnvPaths {
    pub fn new(root: &Path, id: Uuid) -> Self {
        let dir = root.join("environments").join(id.to_string());
        let short = id.simple().to_string();
        EnvPaths {
            id,
            record: dir.join("record.json"),
            lock: dir.join("record.lock"),
            holder_live: dir.join("holder.live"),
            ssh_key: dir.join("id_ed25519"),
            known_hosts: dir.join("known_hosts"),
            control_dir: root.join("ctl").join(&short[..12]),
            stages_left: dir.join("stages-left"),
            dir,
        }
    }

    /// Whether the environment's directory exists (it is created atomically
    /// with its record, and removed atomically by a release).
    pub fn exists(&self) -> bool {
        self.dir.exists()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_dir_is_short_enough_for_a_unix_socket() {
        // A socket path must fit in 108 bytes; openssh adds a socket name of up
        // to ~40 bytes, so the directory must stay well under 61 bytes for a
        // typical state dir.
        let p = EnvPaths::new(Path::new("/var/lib/dormant"), Uuid::new_v4());
        assert!(
            p.control_dir.as_os_str().len() <= 40,
            "{}",
            p.control_dir.display()
        );
    }
}
