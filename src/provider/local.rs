//! The `local` provider, the embedded default: an environment is a directory
//! under the state dir (`environments/<id>/work`) and scripts run in a local
//! bash. Suspend keeps the directory; release deletes it. Needs no setup.

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use async_trait::async_trait;

use super::{
    Dirs, Machine, MachineGone, MachineSpec, MachineState, ManagedMachine, Provider, Target,
};
use crate::context::Ctx;
use crate::state::{EnvPaths, StateStore};

/// The environment's work directory; builds and cache live inside it.
pub fn workdir(paths: &EnvPaths) -> PathBuf {
    paths.dir.join("work")
}

pub fn dirs(paths: &EnvPaths) -> Dirs {
    let w = workdir(paths);
    Dirs {
        builds: w.join("builds").display().to_string(),
        cache: w.join("cache").display().to_string(),
    }
}

pub struct LocalProvider {
    store: StateStore,
}

impl LocalProvider {
    pub fn new(store: StateStore) -> Self {
        LocalProvider { store }
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

    async fn stop(&self, machine: &Machine, _ctx: &Ctx) -> Result<()> {
        let dir = self.checked_dir(machine)?;
        if !dir.is_dir() {
            bail!(
                "the environment's directory {} is gone: nothing to suspend",
                dir.display()
            );
        }
        Ok(())
    }

    async fn delete(&self, machine: &Machine, _ctx: &Ctx) -> Result<()> {
        let dir = self.checked_dir(machine)?;
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
