//! The `qemu` provider: one QEMU virtual machine per environment on the runner
//! host, driven directly (no daemon) over its QMP socket. A new environment
//! gets a copy-on-write overlay on the read-only base image and a cloud-init
//! seed with its SSH key; suspend powers the VM off (`shutdown`) or saves its
//! memory to a file beside the disk (`hibernate`); resume boots the disk again
//! or restores the memory image; release quits QEMU and deletes the directory.
//! See docs/qemu.md.
//!
//! One concern per file: `vm` (the VM's files and command line), `process`
//! (starting QEMU detached, recognising its process), `tools` (overlay,
//! seed ISO, a free port), `qmp` (the QMP client), `guest` (sshd readiness,
//! the clock after a restore), `capacity` (`max_environments`), `power`
//! (boot, restore), `power_off` (power-off, hibernate, quit), `volume`
//! (volume mode's data disk), `hotplug` (plugging that disk into a running
//! VM), `warm` (VMs booted ahead of jobs), `pins` (the read-only copies of
//! base images every overlay is made on, so an image file can be replaced).

pub mod alias;
pub mod base_file;
pub mod capacity;
pub mod guest;
pub mod hotplug;
pub mod kept;
pub mod pins;
pub mod power;
pub mod power_off;
pub mod process;
pub mod qmp;
pub mod ram;
pub mod tools;
pub mod vm;
pub mod volume;
pub mod warm;

use std::time::Duration;

use anyhow::{Context, Result};
use async_trait::async_trait;
use uuid::Uuid;

use self::process::Pid;
use self::vm::VmDir;
use super::{
    Machine, MachineGone, MachineSpec, MachineState, ManagedMachine, Provider, Refusal, SshTarget,
    StorageMode, Suspended, Target, Volumes,
};
use crate::context::Ctx;
use crate::settings::boot_image::BootImage;
use crate::settings::qemu::QemuSettings;
use crate::settings::Settings;
use crate::state::{EnvPaths, StateStore};

/// Machine fields.
pub mod field {
    /// The environment id (the VM's directory and `-name`).
    pub const ENV: &str = "env";
    /// The host port on 127.0.0.1 forwarded to the guest's sshd.
    pub const PORT: &str = "port";
    /// The name of the base image in `qemu.images`, or "default".
    pub const IMAGE: &str = "image";
}

/// Quitting what a failed prepare started gets at most this long.
const ABANDON_BUDGET: Duration = Duration::from_secs(30);

pub struct QemuProvider {
    settings: QemuSettings,
    store: StateStore,
}

impl QemuProvider {
    pub fn new(settings: &Settings, store: &StateStore) -> Self {
        QemuProvider {
            settings: settings.qemu.clone(),
            store: store.clone(),
        }
    }

    fn vm(&self, env_id: Uuid) -> VmDir {
        VmDir::new(&self.store.env_paths(env_id))
    }

    fn paths(&self, env_id: Uuid) -> EnvPaths {
        self.store.env_paths(env_id)
    }

    fn env_of(&self, machine: &Machine) -> Result<Uuid> {
        let text = machine
            .field(field::ENV)
            .or_else(|| machine.id.strip_prefix("dormant-"))
            .with_context(|| format!("machine {} names no environment", machine.id))?;
        Uuid::parse_str(text)
            .with_context(|| format!("machine {}: bad environment id {text:?}", machine.id))
    }

    /// The base image: the job's `image:` through the allow-list, else the default.
    pub fn choose_image(&self, asked: Option<&str>) -> Result<(String, BootImage), Refusal> {
        let default = || {
            self.settings
                .image
                .clone()
                .map(|i| ("default".to_string(), i))
                .ok_or_else(|| Refusal("qemu.image is not set".into()))
        };
        let Some(asked) = asked.map(str::trim).filter(|s| !s.is_empty()) else {
            return default();
        };
        if let Some(image) = self.settings.images.get(asked) {
            return Ok((asked.to_string(), image.clone()));
        }
        let names: Vec<&str> = self.settings.images.keys().map(String::as_str).collect();
        Err(Refusal(if names.is_empty() {
            format!(
                "the job asks for image {asked:?}, but this runner's allow-list qemu.images is empty: jobs run \
                 on the default image; drop `image:` or ask the runner's operator"
            )
        } else {
            format!(
                "the job asks for image {asked:?}, which is not in this runner's allow-list qemu.images ({})",
                names.join(", ")
            )
        }))
    }

    fn image_named(&self, name: Option<&str>) -> Result<BootImage> {
        match name {
            None | Some("default") => self.settings.image.clone().context("qemu.image is not set"),
            Some(n) => self.settings.images.get(n).cloned().with_context(|| {
                format!("the environment's image {n:?} is no longer in qemu.images: add it back to resume it")
            }),
        }
    }

    fn machine(&self, env_id: Uuid, port: u16, image: &str) -> Machine {
        Machine::new(vm::vm_name(env_id))
            .with(field::ENV, env_id.to_string())
            .with(field::PORT, port.to_string())
            .with(field::IMAGE, image)
    }

    /// The seed and the disk of a new VM (kept if an earlier attempt made
    /// them); returns the image it boots: `image` pinned (`pins.rs`).
    async fn make_files(
        &self,
        spec: &MachineSpec,
        image: &BootImage,
        vm: &VmDir,
        ctx: &Ctx,
    ) -> Result<BootImage> {
        vm.ensure()?;
        // The same in both storage modes: the guest's mount command, run
        // once dormant has connected, formats and mounts a data disk.
        let user_data = super::cloud_init::user_data(
            spec.env_id,
            spec.ssh_public_key.as_deref(),
            &self.settings.ssh_user,
        )?;
        tools::create_seed(vm, &user_data, &vm::meta_data(spec.env_id))?;
        let pinned = self.pins().for_new_vm(vm, image, ctx).await?;
        if !vm.overlay().exists() {
            tools::create_overlay(
                &self.settings.qemu_img,
                pinned.disk(),
                self.settings.disk_size.as_deref(),
                vm,
            )?;
        }
        Ok(pinned)
    }

    pub fn pins(&self) -> pins::Pins {
        pins::Pins::new(self.store.root())
    }

    async fn create(&self, spec: &MachineSpec, ctx: &Ctx) -> Result<Machine> {
        let (image_name, image) = self.choose_image(spec.image.as_deref())?;
        let vm = VmDir::new(&spec.paths);
        if let Some(pid) = process::find(&vm) {
            ctx.log.info(format!(
                "adopting VM {} (QEMU pid {}) that an earlier attempt of this prepare started",
                vm.name(),
                pid.0
            ));
            let launch = vm
                .read_launch()?
                .context("the running VM has no launch.json")?;
            power::ensure_running(self, &vm, ctx).await?;
            self.wait_ready(&vm, pid, launch.port, ctx).await?;
            return Ok(self.machine(spec.env_id, launch.port, &image_name));
        }
        let image = self.make_files(spec, &image, &vm, ctx).await?;
        let (pid, port) = power::boot(self, &vm, &image, None, ctx).await?;
        self.wait_ready(&vm, pid, port, ctx).await?;
        Ok(self.machine(spec.env_id, port, &image_name))
    }

    async fn wait_ready(&self, vm: &VmDir, pid: Pid, port: u16, ctx: &Ctx) -> Result<()> {
        let secs =
            guest::wait_for_sshd(vm, pid, port, self.settings.boot_timeout.get(), ctx).await?;
        ctx.log.info(format!(
            "VM {} answers SSH on 127.0.0.1:{port} after {secs:.1} s",
            vm.name()
        ));
        Ok(())
    }

    /// After a failed create: quit the QEMU it started (the environment is
    /// new, nothing to keep running); cleanup deletes the files.
    async fn abandon(&self, vm: &VmDir, ctx: &Ctx) {
        let ctx = Ctx::new(ctx.log.clone(), Default::default(), ABANDON_BUDGET);
        if let Err(e) = power_off::quit(vm, &ctx).await {
            ctx.log.warn(format!(
                "could not stop QEMU of {} after the failed prepare: {e:#}; `dormant sweep` finds it",
                vm.name()
            ));
        }
    }
}

#[async_trait]
impl Provider for QemuProvider {
    fn name(&self) -> &'static str {
        "qemu"
    }

    fn needs_ssh_key(&self) -> bool {
        true
    }

    fn storage(&self) -> StorageMode {
        self.settings.storage
    }

    fn volumes(&self) -> Option<&dyn Volumes> {
        Some(self)
    }

    fn warm(&self) -> Option<&dyn super::warm::WarmMachines> {
        (self.settings.warm > 0 || self.store.root().join("warm").exists()).then_some(self)
    }

    /// Every running VM holds a slot, a hot one too; a hibernated one none.
    async fn running_slots_full(&self, _ctx: &Ctx) -> Result<bool> {
        let max = self.settings.max_environments;
        Ok(max > 0 && capacity::running(self.store.root()) >= max as usize)
    }

    async fn create_or_reclaim(&self, spec: &MachineSpec, ctx: &Ctx) -> Result<Machine> {
        let result = self.create(spec, ctx).await;
        if result.is_err()
            && result
                .as_ref()
                .err()
                .and_then(|e| e.downcast_ref::<Refusal>())
                .is_none()
        {
            self.abandon(&VmDir::new(&spec.paths), ctx).await;
        }
        result
    }

    async fn start(&self, machine: &Machine, ctx: &Ctx) -> Result<Machine> {
        let env_id = self.env_of(machine)?;
        let vm = self.vm(env_id);
        if !vm.exists() {
            return Err(MachineGone(format!(
                "the disk of VM {} ({}) is gone",
                vm.name(),
                vm.overlay().display()
            ))
            .into());
        }
        let image_name = machine.field(field::IMAGE).unwrap_or("default").to_string();
        let configured = || self.image_named(Some(&image_name));
        // The pins the VM was made on, whatever the settings' file holds now
        // (a running QEMU being adopted needs no image).
        let image = if process::find(&vm).is_some() {
            configured()?
        } else {
            self.pins()
                .for_existing_vm(&self.settings.qemu_img, &vm, configured, ctx)
                .await?
        };
        // A restored guest's clock is set by the transport right after its
        // login (`guest::clock_from_rtc`, in `target`): no second connection.
        let (pid, port, _restored) = power::resume(self, &vm, &image, ctx).await?;
        self.wait_ready(&vm, pid, port, ctx).await?;
        Ok(self.machine(env_id, port, &image_name))
    }

    async fn stop(&self, machine: &Machine, ctx: &Ctx) -> Result<Suspended> {
        let vm = self.vm(self.env_of(machine)?);
        power_off::suspend(self, &vm, ctx).await
    }

    async fn delete(&self, machine: &Machine, ctx: &Ctx) -> Result<()> {
        let vm = self.vm(self.env_of(machine)?);
        power_off::quit(&vm, ctx).await?;
        // Read before the directory goes: the alias of a QEMU that was
        // started as a warm VM goes with it (`alias.rs`).
        let running_as = vm.read_launch().ok().flatten().and_then(|l| l.running_as);
        if vm.dir.exists() {
            ctx.log
                .info(format!("deleting VM {} ({})", vm.name(), vm.dir.display()));
        }
        vm.remove()?;
        match running_as {
            Some(r) => alias::remove(self.store.root(), r.id),
            None => Ok(()),
        }
    }

    async fn describe(&self, machine: &Machine, _ctx: &Ctx) -> Result<MachineState> {
        let vm = self.vm(self.env_of(machine)?);
        Ok(describe(&vm))
    }

    async fn list(&self, _ctx: &Ctx) -> Result<Vec<ManagedMachine>> {
        let mut ids: Vec<Uuid> = process::scan(&self.store.root().join("environments"))
            .into_iter()
            .map(|(id, _)| id)
            .collect();
        for id in self.store.environment_ids()? {
            if self.vm(id).dir.exists() {
                ids.push(id);
            }
        }
        ids.sort();
        ids.dedup();
        Ok(ids
            .into_iter()
            .map(|id| {
                let vm = self.vm(id);
                let launched_at = std::fs::metadata(&vm.dir)
                    .and_then(|m| m.modified())
                    .ok()
                    .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                    .map(|d| d.as_secs());
                let port = vm.read_launch().ok().flatten().map(|l| l.port).unwrap_or(0);
                // A VM whose environment has no record is an orphan: no env id
                // matches it (`sweep` reports it; its machine still names it).
                let recorded = self.paths(id).record.exists();
                ManagedMachine {
                    machine: self.machine(id, port, "default"),
                    env_id: recorded.then_some(id),
                    state: describe(&vm),
                    launched_at,
                    warm: None,
                }
            })
            .collect())
    }

    fn target(&self, machine: &Machine) -> Result<Target> {
        let port = machine
            .field(field::PORT)
            .and_then(|p| p.parse::<u16>().ok())
            .with_context(|| format!("machine {} has no SSH port in its record", machine.id))?;
        Ok(Target::Ssh(SshTarget {
            host: "127.0.0.1".into(),
            port,
            user: self.settings.ssh_user.clone(),
            identity_file: None,
            workdir: None,
            on_login: Some(guest::clock_from_rtc(&self.settings.ssh_user)),
        }))
    }

    fn key_fields(&self, _machine: &Machine) -> Vec<(String, String)> {
        Vec::new()
    }

    async fn tidy(&self, ctx: &Ctx) -> Result<Vec<std::path::PathBuf>> {
        let pins = self.pins().tidy(ctx).await;
        let mut removed = alias::tidy(self.store.root())?;
        removed.extend(pins?);
        Ok(removed)
    }
}

fn describe(vm: &VmDir) -> MachineState {
    if process::find(vm).is_some() {
        MachineState::Running
    } else if vm.exists() {
        MachineState::Stopped
    } else {
        MachineState::Gone
    }
}
