//! Providers make, stop, start and delete the machines environments run on.
//!
//! The stage logic talks only to [`Provider`]; each implementation lives in its
//! own file: `local` (a directory, the embedded default), `ssh_hosts` (a
//! workspace on one of a list of SSH hosts), `ec2` (one instance per environment,
//! behind the default-on `ec2` cargo feature), `qemu` (one VM per environment
//! on the runner host). `cloud_init` is the user-data both VM providers send.
//! `volume` is the companion trait of volume mode (`storage = "volume"`),
//! `warm` the one of warm machines (booted ahead of any job).
//! Tests inject fakes.

pub mod cloud_init;
#[cfg(feature = "ec2")]
pub mod ec2;
pub mod kept;
pub mod local;
pub mod qemu;
pub mod ssh_hosts;
pub mod volume;
pub mod warm;

use std::collections::BTreeMap;
use std::sync::Arc;

use anyhow::Result;
use async_trait::async_trait;
use uuid::Uuid;

use crate::context::Ctx;
use crate::settings::{ProviderKind, Settings};
use crate::state::StateStore;

pub use crate::model::{
    Dirs, EnvPaths, GuestMount, Machine, MachineState, ManagedMachine, ManagedVolume, SshTarget,
    StorageMode, Target, Volume,
};
pub use volume::{VolumeGone, VolumeSpec, Volumes};

/// A job's request that the operator's settings do not allow (an image or an
/// instance type outside an allow-list). Prepare reports it as a refusal (build
/// failure), which the runner does not retry: retrying cannot make it allowed.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct Refusal(pub String);

/// The machine of a suspended environment no longer exists (terminated or
/// deleted outside dormant): a resume cannot succeed however often the runner
/// retries it, so prepare reports it once, as a refusal.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct MachineGone(pub String);

/// What a suspension kept of the machine besides its disk. A paused script
/// (docs/pause.md) waits in the machine's memory: when a suspension that
/// should keep it (a hibernation) fell back to a power-off, the lifecycle
/// records in the environment's record that the script is gone, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Suspended {
    /// `None`: the memory (and every process) is kept; else why it was lost.
    pub memory_lost: Option<String>,
}

impl Suspended {
    /// The machine's processes outlive the suspension (a hibernation, a host
    /// that stays up, or a machine an earlier suspension already stopped).
    pub fn kept() -> Self {
        Suspended { memory_lost: None }
    }

    /// The machine was powered off: its processes are gone (`why` says how).
    pub fn lost(why: impl Into<String>) -> Self {
        Suspended {
            memory_lost: Some(why.into()),
        }
    }
}

/// What a provider needs to create (or reclaim) the machine of an environment.
#[derive(Debug, Clone)]
pub struct MachineSpec {
    pub env_id: Uuid,
    /// Deterministic name (`dormant-<env id>`): a retried prepare finds the same machine.
    pub name: String,
    pub runner_id: String,
    pub system_id: String,
    pub project_id: u64,
    pub job_id: u64,
    /// The job's `image:`, to be checked against the operator's allow-list.
    pub image: Option<String>,
    /// Job variables a provider may read through an allow-list (e.g. an instance type).
    pub variables: BTreeMap<String, String>,
    /// The environment's SSH public key (OpenSSH format), for providers that
    /// deliver it to the machine (EC2 user-data). `None` when `needs_ssh_key` is false.
    pub ssh_public_key: Option<String>,
    pub paths: EnvPaths,
    /// Volume mode: the data volume the machine is for. A provider places
    /// the machine where the volume can attach (its zone); `Volumes::attach`
    /// attaches it once the machine runs.
    pub volume: Option<Volume>,
}

impl MachineSpec {
    pub fn machine_name(env_id: Uuid) -> String {
        format!("dormant-{env_id}")
    }
}

/// A place environments run. Every call is bounded by `ctx.deadline` and
/// cancelled by `ctx.cancel`; progress goes to `ctx.log` (the job log).
#[async_trait]
pub trait Provider: Send + Sync {
    /// `local`, `ssh`, `ec2` or `qemu`: also the `provider=` field of environment keys.
    fn name(&self) -> &'static str;

    /// Whether the machine must be given the environment's SSH public key at creation.
    fn needs_ssh_key(&self) -> bool {
        false
    }

    /// The storage mode of new environments (the provider's `storage`
    /// setting). An environment keeps the mode it was made with.
    fn storage(&self) -> StorageMode {
        StorageMode::Machine
    }

    /// Volume mode's operations, if this provider offers it. Present whatever
    /// `storage` says: environments made in volume mode stay resumable after
    /// the setting goes back to `machine`.
    fn volumes(&self) -> Option<&dyn Volumes> {
        None
    }

    /// Warm machines' operations, if this provider keeps them (or still has
    /// some to retire after `warm` went back to 0).
    fn warm(&self) -> Option<&dyn warm::WarmMachines> {
        None
    }

    /// Whether a job's machine would wait for a slot now (`max_environments`)
    /// that suspending a running machine frees: the hot window's give-way
    /// (`lifecycle::hot::give_way`) asks it. qemu counts running VMs; EC2
    /// counts stopped instances too, so a hot instance holds no slot its
    /// hibernation would free (default: never).
    async fn running_slots_full(&self, _ctx: &Ctx) -> Result<bool> {
        Ok(false)
    }

    /// Makes the machine, or adopts the one an earlier attempt made under the
    /// same name, whatever state it is in. Returns once it is running.
    async fn create_or_reclaim(&self, spec: &MachineSpec, ctx: &Ctx) -> Result<Machine>;

    /// Resume: checks the machine is ours, starts it, waits until running, and
    /// returns it with fresh fields (a new address).
    async fn start(&self, machine: &Machine, ctx: &Ctx) -> Result<Machine>;

    /// Suspend: stops the machine keeping its disk; waits until stopped.
    /// Says whether its memory was kept (see [`Suspended`]).
    async fn stop(&self, machine: &Machine, ctx: &Ctx) -> Result<Suspended>;

    /// Release: deletes the machine. Already gone is success.
    async fn delete(&self, machine: &Machine, ctx: &Ctx) -> Result<()>;

    async fn describe(&self, machine: &Machine, ctx: &Ctx) -> Result<MachineState>;

    /// Every machine this provider manages for this runner (tags / directories).
    async fn list(&self, ctx: &Ctx) -> Result<Vec<ManagedMachine>>;

    /// The machine of an environment, looked up by its tags or directory: for a
    /// release whose record never got the machine (prepare died between creating
    /// it and saving it), so nothing leaks.
    async fn find(&self, env_id: Uuid, ctx: &Ctx) -> Result<Option<Machine>> {
        Ok(self
            .list(ctx)
            .await?
            .into_iter()
            .find(|m| m.env_id == Some(env_id) && m.state != MachineState::Gone)
            .map(|m| m.machine))
    }

    /// Files of the provider's that no machine uses any more (qemu: pinned
    /// base images), removed by `dormant sweep`; returns what it removed.
    /// Default: none.
    async fn tidy(&self, _ctx: &Ctx) -> Result<Vec<std::path::PathBuf>> {
        Ok(Vec::new())
    }

    /// After a new machine-mode environment's first connection pinned its
    /// machine's host key (`known_hosts`: the environment's known_hosts
    /// file): keep it with the machine, where a replacement runner-manager
    /// host can check the machine against it (EC2: a tag). Default: nothing
    /// (the machine lives on this host, or is never entered by another).
    async fn keep_host_key(
        &self,
        _machine: &Machine,
        _known_hosts: &str,
        _ctx: &Ctx,
    ) -> Result<()> {
        Ok(())
    }

    /// Where to connect to run scripts.
    fn target(&self, machine: &Machine) -> Result<Target>;

    /// The provider's fields for the environment key (`instance=i-..&region=..`).
    fn key_fields(&self, machine: &Machine) -> Vec<(String, String)>;
}

/// The directories for `config`: stable per environment and computed from
/// settings alone — config builds no provider and makes no call — so a resumed
/// job gets the same `CI_PROJECT_DIR` as the job that suspended. `storage`
/// is the environment's (a resume key says it), else the setting's.
pub fn dirs(settings: &Settings, paths: &EnvPaths, storage: StorageMode) -> Result<Dirs> {
    match settings.provider {
        ProviderKind::Local => Ok(local::dirs(paths, storage)),
        ProviderKind::Ssh => settings.ssh.dirs(paths),
        ProviderKind::Ec2 => settings.ec2.dirs(paths, storage),
        ProviderKind::Qemu => Ok(settings.qemu.dirs(paths, storage)),
    }
}

/// The storage mode the settings give new environments of the selected provider.
pub fn storage_setting(settings: &Settings) -> StorageMode {
    match settings.provider {
        ProviderKind::Local => settings.local.storage,
        ProviderKind::Qemu => settings.qemu.storage,
        ProviderKind::Ec2 => settings.ec2.storage,
        ProviderKind::Ssh => StorageMode::Machine,
    }
}

/// Builds the provider the settings select.
pub fn from_settings(settings: &Settings, store: &StateStore) -> Result<Arc<dyn Provider>> {
    match settings.provider {
        ProviderKind::Local => Ok(Arc::new(local::LocalProvider::new(
            store.clone(),
            settings.local.storage,
        ))),
        ProviderKind::Ssh => Ok(Arc::new(ssh_hosts::SshHostsProvider::new(
            settings.ssh.clone(),
            store.clone(),
        ))),
        ProviderKind::Qemu => Ok(Arc::new(qemu::QemuProvider::new(settings, store))),
        #[cfg(feature = "ec2")]
        ProviderKind::Ec2 => Ok(Arc::new(ec2::Ec2Provider::new(settings, store)?)),
        #[cfg(not(feature = "ec2"))]
        ProviderKind::Ec2 => anyhow::bail!(
            "provider = \"ec2\" but this dormant was built without EC2 support (cargo feature `ec2`); \
             use a build with default features"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ec2_is_built_or_says_it_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let store = StateStore::open(dir.path()).unwrap();
        let settings = Settings::parse_str(
            "provider = \"ec2\"\nsystem_id = \"s_x\"\n[ec2]\nregion = \"us-east-1\"\nsubnet_id = \"subnet-1\"\nimage = \"ami-0abc\"\n",
        )
        .unwrap();
        let built = from_settings(&settings, &store);
        if cfg!(feature = "ec2") {
            // Building it makes no cloud call and reads no credentials.
            assert_eq!(built.unwrap().name(), "ec2");
        } else {
            let e = built.err().unwrap();
            assert!(
                format!("{e:#}").contains("built without EC2 support"),
                "{e:#}"
            );
        }
    }
}
