//! The qemu provider's warm VMs (`qemu.warm`): booted from the default image
//! in the pool's directory (`warm/<id>/vm/`, named `dormant-<id>`), each with
//! its own key and seed. Handing one to an environment moves its directory
//! into the environment's (`environments/<env>/vm/`): the running QEMU keeps
//! its open files, its QMP socket moves with the directory, and its command
//! line, which cannot change, is recorded as `Launch::running_as` so the
//! process is still recognised as this VM's. Its disks, which QEMU opens
//! again by name while it runs, are given through an alias that follows the
//! directory (`alias.rs`). The next start of the VM uses the environment's
//! own name and paths. See docs/qemu.md, "Warm machines".

use std::time::Duration;

use anyhow::{Context, Result};
use async_trait::async_trait;

use super::process::Pid;
use super::vm::{RunningAs, VmDir};
use super::{alias, field, power, power_off, process, tools, QemuProvider};
use crate::context::Ctx;
use crate::model::{EnvPaths, Machine};
use crate::provider::warm::{WarmKind, WarmMachines};
use crate::provider::MachineSpec;
use crate::settings::boot_image::BootImage;
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

    /// A warm VM's files, its alias and its QEMU, started (its guest not
    /// waited for: `launch`).
    async fn boot_warm(
        &self,
        warm: &WarmPaths,
        ssh_public_key: &str,
        ctx: &Ctx,
    ) -> Result<(VmDir, Pid, u16)> {
        let image = self.default_image()?;
        let vm = self.warm_vm(warm);
        vm.ensure()?;
        let user_data = crate::provider::cloud_init::user_data(
            warm.id,
            Some(ssh_public_key),
            &self.settings.ssh_user,
        )?;
        tools::create_seed(&vm, &user_data, &super::vm::meta_data(warm.id))?;
        // Pinned like any VM's: a hand-over moves `image.json` with the VM.
        let image = self.pins().for_new_vm(&vm, &image, ctx).await?;
        if !vm.overlay().exists() {
            tools::create_overlay(
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
        // Its disks through an alias that follows the VM when it is handed
        // over (QEMU opens them again by these paths: `alias.rs`).
        let alias = alias::point(self.store.root(), warm.id, &vm.dir)?;
        let booted = power::boot_within(
            self,
            &vm,
            &image,
            None,
            limit,
            super::capacity::Waiter::Warm,
            Some(&alias),
            ctx,
        )
        .await;
        let (pid, port) = match booted {
            Ok(b) => b,
            Err(e) => {
                let _ = power_off::quit(&vm, ctx).await;
                return Err(e);
            }
        };
        Ok((vm, pid, port))
    }
}

/// What of a base image file says it was replaced: `base_file::stamp`, the
/// test that makes `pins.rs` pin the file anew, so warm VMs of an old file
/// are retired when new VMs would be made from a new pin.
fn file_stamp(path: &std::path::Path) -> String {
    super::base_file::stamp(path).unwrap_or_else(|_| "missing".into())
}

#[async_trait]
impl WarmMachines for QemuProvider {
    fn wanted(&self) -> u32 {
        self.settings.warm
    }

    fn max_age(&self) -> Duration {
        self.settings.warm_max_age.get()
    }

    async fn no_room(&self, _ctx: &Ctx) -> Result<Option<String>> {
        let max = self.settings.max_environments;
        let running = super::capacity::running(self.store.root());
        Ok((max > 0 && running + 1 >= max as usize).then(|| {
            format!(
                "{running} of qemu.max_environments = {max} VMs run: a warm VM would take the last \
                 slot a job may need"
            )
        }))
    }

    async fn job_must_wait(&self, _ctx: &Ctx) -> Result<bool> {
        let max = self.settings.max_environments;
        Ok(max > 0 && super::capacity::running(self.store.root()) >= max as usize)
    }

    fn kind(&self) -> Result<WarmKind> {
        let image = self.default_image()?;
        let s = &self.settings;
        let stamp = |p: Option<&std::path::Path>| p.map(file_stamp).unwrap_or_default();
        let fingerprint = format!(
            "image={image:?} disk={} kernel={} initrd={} size={:?} cpus={} memory={} cpu={:?} accel={:?} user={} \
             restrict={} qemu={} file_ram={}",
            file_stamp(image.disk()),
            stamp(image.kernel()),
            stamp(image.initrd()),
            s.disk_size,
            s.cpus,
            s.memory_mib,
            s.cpu,
            s.accel,
            s.ssh_user,
            s.restrict_network,
            s.qemu_binary.display(),
            // A hibernate-mode VM keeps its RAM in a file (`ram.rs`): one
            // booted without it would restore the slow way.
            s.suspend_mode == crate::settings::qemu::QemuSuspendMode::Hibernate
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
        // A volume-mode environment's data disk is hot-plugged into the VM
        // it takes (`hotplug.rs`): every VM has the port for it.
        default_image && self.settings.image.is_some()
    }

    async fn launch(
        &self,
        warm: &WarmPaths,
        _zone: Option<&str>,
        ssh_public_key: &str,
        ctx: &Ctx,
    ) -> Result<Machine> {
        let (vm, pid, port) = self.boot_warm(warm, ssh_public_key, ctx).await?;
        if let Err(e) = self.wait_ready(&vm, pid, port, ctx).await {
            let _ = power_off::quit(&vm, ctx).await;
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
                // (Its disks were given through the alias: the next start
                // opens them by the environment's own path.)
                let (old_dir, new_dir) =
                    (from.dir.display().to_string(), to.dir.display().to_string());
                let alias_dir = alias::path(self.store.root(), warm.id)
                    .display()
                    .to_string();
                launch.argv = launch
                    .argv
                    .iter()
                    .map(|a| {
                        a.replace(&old_dir, &new_dir)
                            .replace(&alias_dir, &new_dir)
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
        // The running QEMU opens its disks through the alias: it follows the
        // directory (also when a killed hand-over is finished here).
        if to
            .read_launch()?
            .and_then(|l| l.running_as)
            .is_some_and(|r| r.id == warm.id)
        {
            alias::follow(self.store.root(), warm.id, &to.dir)?;
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

    async fn handed_over(&self, warm: &WarmPaths, env: &EnvPaths, _ctx: &Ctx) -> Result<bool> {
        Ok(!self.warm_vm(warm).dir.exists()
            && VmDir::new(env)
                .read_launch()
                .ok()
                .flatten()
                .and_then(|l| l.running_as)
                .is_some_and(|r| r.id == warm.id))
    }

    async fn retire(&self, warm: &WarmPaths, _machine: Option<&Machine>, ctx: &Ctx) -> Result<()> {
        let vm = self.warm_vm(warm);
        power_off::quit(&vm, ctx).await?;
        vm.remove()?;
        alias::remove(self.store.root(), warm.id)
    }

    async fn alive(&self, warm: &WarmPaths, _machine: &Machine, _ctx: &Ctx) -> Result<bool> {
        // A look at this host's /proc: always a definite answer.
        Ok(process::find(&self.warm_vm(warm)).is_some())
    }
}

#[cfg(test)]
#[path = "warm_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "warm_qemu_tests.rs"]
mod qemu_tests;
