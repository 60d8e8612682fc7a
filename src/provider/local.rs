//! The `local` provider, the embedded default: an environment is a directory
//! under the state dir (`environments/<id>/work`) and scripts run in a local
//! bash. Suspend keeps the directory; release deletes it. Needs no setup.
//!
//! With `[local] storage = "volume"` it plays volume mode on one host: the
//! "volume" is `environments/<id>/volume/`, "attaching" it links it into the
//! work directory as `work/volume` (the builds and cache dirs are inside),
//! and suspend deletes the work directory, the "machine". What a job wrote
//! outside the builds and cache dirs is gone after a resume, as on a VM.

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use async_trait::async_trait;

use super::{
    Dirs, GuestMount, Machine, MachineGone, MachineSpec, MachineState, ManagedMachine,
    ManagedVolume, Provider, StorageMode, Suspended, Target, Volume, VolumeGone, VolumeSpec,
    Volumes,
};
use crate::context::Ctx;
use crate::state::{EnvPaths, StateStore};

/// The environment's work directory; builds and cache live inside it.
pub fn workdir(paths: &EnvPaths) -> PathBuf {
    paths.dir.join("work")
}

/// Volume mode: the volume directory, kept while the work directory is not.
pub fn volume_dir(paths: &EnvPaths) -> PathBuf {
    paths.dir.join("volume")
}

/// Volume mode: where the work directory links the volume in.
fn mountpoint(paths: &EnvPaths) -> PathBuf {
    workdir(paths).join("volume")
}

pub fn dirs(paths: &EnvPaths, storage: StorageMode) -> Dirs {
    let base = match storage {
        StorageMode::Machine => workdir(paths),
        StorageMode::Volume => mountpoint(paths),
    };
    Dirs {
        builds: base.join("builds").display().to_string(),
        cache: base.join("cache").display().to_string(),
    }
}

pub struct LocalProvider {
    store: StateStore,
    storage: StorageMode,
}

impl LocalProvider {
    pub fn new(store: StateStore, storage: StorageMode) -> Self {
        LocalProvider { store, storage }
    }

    /// A volume id is its directory; refuse anything but an environment's.
    fn checked_volume(&self, volume: &Volume) -> Result<EnvPaths> {
        let dir = PathBuf::from(&volume.id);
        let id = dir
            .parent()
            .and_then(|p| p.file_name())
            .and_then(|n| n.to_str())
            .and_then(|n| uuid::Uuid::parse_str(n).ok());
        match id {
            Some(id) if dir == volume_dir(&self.store.env_paths(id)) => {
                Ok(self.store.env_paths(id))
            }
            _ => bail!(
                "local volume {} is not an environment's volume directory in this state dir ({})",
                dir.display(),
                self.store.environments_dir().display()
            ),
        }
    }

    fn workdir(paths: &EnvPaths) -> PathBuf {
        workdir(paths)
    }

    /// A machine id is the work directory; refuse anything outside our state dir.
    fn checked_dir(&self, machine: &Machine) -> Result<PathBuf> {
        let dir = PathBuf::from(&machine.id);
        let envs = self.store.root().join("environments");
        if !dir.starts_with(&envs)
            || dir
                .components()
                .any(|c| matches!(c, std::path::Component::ParentDir))
        {
            bail!(
                "local machine {} is not under this state dir's {}",
                dir.display(),
                envs.display()
            );
        }
        Ok(dir)
    }
}

#[async_trait]
impl Provider for LocalProvider {
    fn name(&self) -> &'static str {
        "local"
    }

    fn storage(&self) -> StorageMode {
        self.storage
    }

    fn volumes(&self) -> Option<&dyn Volumes> {
        Some(self)
    }

    async fn create_or_reclaim(&self, spec: &MachineSpec, ctx: &Ctx) -> Result<Machine> {
        let dir = Self::workdir(&spec.paths);
        let reclaimed = dir.exists();
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("creating environment directory {}", dir.display()))?;
        // Private like the rest of the state dir: the job's checkout may hold secrets.
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
            .with_context(|| format!("setting 0700 on {}", dir.display()))?;
        ctx.log.info(format!(
            "{} local environment directory {}",
            if reclaimed { "reusing" } else { "created" },
            dir.display()
        ));
        Ok(Machine::new(dir.display().to_string()))
    }

    async fn start(&self, machine: &Machine, _ctx: &Ctx) -> Result<Machine> {
        let dir = self.checked_dir(machine)?;
        if !dir.is_dir() {
            return Err(MachineGone(format!(
                "the environment's directory {} is gone: its files cannot be resumed",
                dir.display()
            ))
            .into());
        }
        Ok(machine.clone())
    }

    async fn stop(&self, machine: &Machine, _ctx: &Ctx) -> Result<Suspended> {
        let dir = self.checked_dir(machine)?;
        if !dir.is_dir() {
            bail!(
                "the environment's directory {} is gone: nothing to suspend",
                dir.display()
            );
        }
        // Nothing is stopped: the runner host runs on.
        Ok(Suspended::kept())
    }

    async fn delete(&self, machine: &Machine, _ctx: &Ctx) -> Result<()> {
        let dir = self.checked_dir(machine)?;
        // A script paused in the environment (docs/pause.md) goes with it,
        // and whatever else its kept stages left.
        if let Some(env_dir) = dir.parent() {
            let env = env_dir
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| uuid::Uuid::parse_str(n).ok());
            if let Some(env) = env {
                crate::transport::local_kept::release(env_dir, &env.simple().to_string())
                    .await
                    .with_context(|| format!("releasing environment {env}'s kept stages"))?;
            }
        }
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => {
                Err(e).with_context(|| format!("deleting environment directory {}", dir.display()))
            }
        }
    }

    async fn describe(&self, machine: &Machine, _ctx: &Ctx) -> Result<MachineState> {
        let dir = self.checked_dir(machine)?;
        Ok(if dir.is_dir() {
            MachineState::Running
        } else {
            MachineState::Gone
        })
    }

    async fn list(&self, _ctx: &Ctx) -> Result<Vec<ManagedMachine>> {
        let mut out = Vec::new();
        for id in self.store.environment_ids()? {
            let dir = Self::workdir(&self.store.env_paths(id));
            if dir.is_dir() {
                out.push(ManagedMachine {
                    machine: Machine::new(dir.display().to_string()),
                    env_id: Some(id),
                    state: MachineState::Running,
                    launched_at: None,
                    warm: None,
                });
            }
        }
        Ok(out)
    }

    fn target(&self, machine: &Machine) -> Result<Target> {
        Ok(Target::Local {
            workdir: self.checked_dir(machine)?,
        })
    }

    fn key_fields(&self, _machine: &Machine) -> Vec<(String, String)> {
        Vec::new()
    }
}

#[async_trait]
impl Volumes for LocalProvider {
    async fn create_volume(&self, spec: &VolumeSpec, ctx: &Ctx) -> Result<Volume> {
        let dir = volume_dir(&spec.paths);
        let reclaimed = dir.exists();
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("creating volume directory {}", dir.display()))?;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
            .with_context(|| format!("setting 0700 on {}", dir.display()))?;
        ctx.log.info(format!(
            "{} local volume directory {}",
            if reclaimed { "reusing" } else { "created" },
            dir.display()
        ));
        Ok(Volume::new(dir.display().to_string()))
    }

    async fn find_volume(&self, env_id: uuid::Uuid, _ctx: &Ctx) -> Result<Option<Volume>> {
        let dir = volume_dir(&self.store.env_paths(env_id));
        Ok(dir.is_dir().then(|| Volume::new(dir.display().to_string())))
    }

    async fn attach(&self, volume: &Volume, machine: &Machine, _ctx: &Ctx) -> Result<()> {
        let paths = self.checked_volume(volume)?;
        let work = self.checked_dir(machine)?;
        let dir = volume_dir(&paths);
        if !dir.is_dir() {
            return Err(
                VolumeGone(format!("the volume directory {} is gone", dir.display())).into(),
            );
        }
        let link = work.join("volume");
        match std::fs::read_link(&link) {
            Ok(target) if target == dir => return Ok(()),
            Ok(_) => std::fs::remove_file(&link)
                .with_context(|| format!("replacing {}", link.display()))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e).with_context(|| format!("reading {}", link.display())),
        }
        std::os::unix::fs::symlink(&dir, &link)
            .with_context(|| format!("linking {} to {}", link.display(), dir.display()))
    }

    async fn detach(
        &self,
        volume: &Volume,
        machine: &Machine,
        _unmounted: bool,
        _ctx: &Ctx,
    ) -> Result<()> {
        self.checked_volume(volume)?;
        let link = self.checked_dir(machine)?.join("volume");
        match std::fs::remove_file(&link) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e).with_context(|| format!("removing {}", link.display())),
        }
    }

    async fn delete_volume(&self, volume: &Volume, _ctx: &Ctx) -> Result<()> {
        let paths = self.checked_volume(volume)?;
        let dir = volume_dir(&paths);
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => {
                Err(e).with_context(|| format!("deleting volume directory {}", dir.display()))
            }
        }
    }

    async fn list_volumes(&self, _ctx: &Ctx) -> Result<Vec<ManagedVolume>> {
        let mut out = Vec::new();
        for id in self.store.environment_ids()? {
            let paths = self.store.env_paths(id);
            let dir = volume_dir(&paths);
            if dir.is_dir() {
                out.push(ManagedVolume {
                    volume: Volume::new(dir.display().to_string()),
                    env_id: Some(id),
                    state: "directory".into(),
                });
            }
        }
        Ok(out)
    }

    fn guest_mount(&self, volume: &Volume) -> GuestMount {
        let paths = self.checked_volume(volume).ok();
        let mountpoint = paths
            .as_ref()
            .map(mountpoint)
            .unwrap_or_else(|| PathBuf::from(&volume.id));
        let dirs = paths.map(|p| dirs(&p, StorageMode::Volume));
        GuestMount {
            devices: Vec::new(),
            mountpoint: mountpoint.display().to_string(),
            user_dirs: dirs.map(|d| vec![d.builds, d.cache]).unwrap_or_default(),
        }
    }

    fn key_fields(&self, _volume: &Volume) -> Vec<(String, String)> {
        Vec::new()
    }
}
