//! The qemu provider's warm VMs (`qemu.warm`): booted from the default image
//! in the pool's directory (`warm/<id>/vm/`, named `dormant-<id>`), each with
//! its own key and seed. Handing one to an environment moves its directory
//! into the environment's (`environments/<env>/vm/`): the running QEMU keeps
//! its open files, its QMP socket moves with the directory, and its command
//! line, which cannot change, is recorded as `Launch::running_as` so the
//! process is still recognised as this VM's. The next start of the VM uses
//! the environment's own name and paths. See docs/qemu.md, "Warm machines".

use std::time::Duration;

use anyhow::{Context, Result};
use async_trait::async_trait;

use super::vm::{RunningAs, VmDir};
use super::{field, power, process, QemuProvider};
use crate::context::Ctx;
use crate::model::{EnvPaths, Machine};
use crate::provider::warm::{WarmKind, WarmMachines};
use crate::provider::MachineSpec;
use crate::settings::qemu::BootImage;
use crate::state::pool::WarmPaths;

impl QemuProvider {
    fn warm_vm(&self, warm: &WarmPaths) -> VmDir {
        VmDir::new(&warm.paths)
    }

    fn default_image(&self) -> Result<BootImage> {
        self.settings
            .image
            .clone()
            .context("qemu.image is not set: warm VMs boot the default image")
    }
}

/// What of a base image file says it was replaced (a new build written over
/// the old path): its size and modification time.
fn file_stamp(path: &std::path::Path) -> String {
    match std::fs::metadata(path) {
        Ok(m) => {
            let mtime = m
                .modified()
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map(|d| d.as_nanos())
                .unwrap_or(0);
            format!("{}@{mtime}", m.len())
        }
        Err(_) => "missing".into(),
    }
}

#[async_trait]
impl WarmMachines for QemuProvider {
    fn wanted(&self) -> u32 {
        self.settings.warm
    }

    fn max_age(&self) -> Duration {
        self.settings.warm_max_age.get()
    }

    fn no_room(&self) -> Option<String> {
        let max = self.settings.max_environments;
        let running = super::capacity::running(self.store.root());
        (max > 0 && running + 1 >= max as usize).then(|| {
            format!(
                "{running} of qemu.max_environments = {max} VMs run: a warm VM would take the last \
                 slot a job may need"
            )
        })
    }

    fn kind(&self) -> Result<WarmKind> {
        let image = self.default_image()?;
        let s = &self.settings;
        let fingerprint = format!(
            "image={image:?} disk={} size={:?} cpus={} memory={} cpu={:?} accel={:?} user={} \
             restrict={} qemu={}",
            file_stamp(image.disk()),
            s.disk_size,
            s.cpus,
            s.memory_mib,
            s.cpu,
            s.accel,
            s.ssh_user,
            s.restrict_network,
            s.qemu_binary.display()
        );
        Ok(WarmKind {
            fingerprint,
            made_from: format!("default image {}", image.disk().display()),
        })
    }

    fn fits(&self, spec: &MachineSpec) -> bool {
        let default_image = spec
            .image
            .as_deref()
            .map(str::trim)
            .is_none_or(|i| i.is_empty() || i == "default");
        // A volume-mode VM needs its data disk on its command line until the
        // disk can be hot-plugged.
        default_image && spec.volume.is_none() && self.settings.image.is_some()
    }

    async fn launch(
        &self,
        warm: &WarmPaths,
        _zone: Option<&str>,
        ssh_public_key: &str,
        ctx: &Ctx,
    ) -> Result<Machine> {
        let image = self.default_image()?;
        let vm = self.warm_vm(warm);
        vm.ensure()?;
        let user_data = crate::provider::cloud_init::user_data_with(
            warm.id,
            Some(ssh_public_key),
            &self.settings.ssh_user,
            None,
        )?;
        process::create_seed(&vm, &user_data, &super::vm::meta_data(warm.id))?;
        if !vm.overlay().exists() {
            process::create_overlay(
                &self.settings.qemu_img,
                image.disk(),
                self.settings.disk_size.as_deref(),
                &vm,
            )?;
        }
        // One slot less than max_environments: a refill never takes the
        // last slot a job could need.
        let limit = match self.settings.max_environments {
            0 => 0,
            max => max.saturating_sub(1).max(1),
        };
        let booted = power::boot_within(self, &vm, &image, None, limit, ctx).await;
        let (pid, port) = match booted {
            Ok(b) => b,
            Err(e) => {
                let _ = power::quit(&vm, ctx).await;
                return Err(e);
            }
        };
        if let Err(e) = self.wait_ready(&vm, pid, port, ctx).await {
            let _ = power::quit(&vm, ctx).await;
            return Err(e);
        }
        Ok(self.machine(warm.id, port, "default"))
    }

    async fn find_launched(&self, warm: &WarmPaths, _ctx: &Ctx) -> Result<Option<Machine>> {
        let vm = self.warm_vm(warm);
        if !vm.dir.exists() {
            return Ok(None);
        }
        let port = vm.read_launch().ok().flatten().map(|l| l.port).unwrap_or(0);
        Ok(Some(self.machine(warm.id, port, "default")))
    }

    async fn hand_over(
        &self,
        warm: &WarmPaths,
        machine: &Machine,
        env: &EnvPaths,
        _ctx: &Ctx,
    ) -> Result<Machine> {
        let from = self.warm_vm(warm);
        let to = VmDir::new(env);
        if from.dir.exists() {
            let mut launch = from
                .read_launch()?
                .with_context(|| format!("warm VM {} has no launch.json", from.name()))?;
            if launch.running_as.is_none() {
                // The next start is the environment's: its name, its paths.
                let (old_dir, new_dir) =
                    (from.dir.display().to_string(), to.dir.display().to_string());
                launch.argv = launch
                    .argv
                    .iter()
                    .map(|a| {
                        a.replace(&old_dir, &new_dir)
                            .replace(&from.name(), &to.name())
                    })
                    .collect();
                launch.running_as = Some(RunningAs {
                    id: warm.id,
                    dir: from.dir.clone(),
                });
                from.write_launch(&launch)?;
            }
            crate::failpoint!("warm:qemu-relabelled");
            std::fs::rename(&from.dir, &to.dir).with_context(|| {
                format!(
                    "moving warm VM {} to {}",
                    from.dir.display(),
                    to.dir.display()
                )
            })?;
            for dir in [&warm.dir, &env.dir] {
                crate::state::store::sync_dir(dir)
                    .with_context(|| format!("syncing {}", dir.display()))?;
            }
        }
        let launch = to
            .read_launch()?
            .with_context(|| format!("VM {} has no launch.json", to.name()))?;
        let port = machine
            .field(field::PORT)
            .and_then(|p| p.parse().ok())
            .unwrap_or(launch.port);
        Ok(self.machine(env.id, port, "default"))
    }

    fn handed_over(&self, warm: &WarmPaths, env: &EnvPaths) -> bool {
        !self.warm_vm(warm).dir.exists()
            && VmDir::new(env)
                .read_launch()
                .ok()
                .flatten()
                .and_then(|l| l.running_as)
                .is_some_and(|r| r.id == warm.id)
    }

    async fn retire(&self, warm: &WarmPaths, _machine: Option<&Machine>, ctx: &Ctx) -> Result<()> {
        let vm = self.warm_vm(warm);
        power::quit(&vm, ctx).await?;
        vm.remove()
    }

    async fn alive(&self, warm: &WarmPaths, _machine: &Machine, _ctx: &Ctx) -> bool {
        process::find(&self.warm_vm(warm)).is_some()
    }
}
