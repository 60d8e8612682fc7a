//! The qemu provider's volume mode: an environment's data disk is a qcow2
//! file of its own, `environments/<id>/volume/data.qcow2` (allocated as it is
//! written, up to `qemu.volume_size`), beside the VM's directory. Every VM of
//! the environment is started with it as a virtio disk whose serial the guest
//! finds under `/dev/disk/by-id/` (`vm::argv`); the guest's mount command
//! (`lifecycle::guest`) formats it on the environment's first mount and
//! mounts it.
//!
//! QEMU attaches disks when it starts (hot-plug would need a PCIe port and
//! the guest's cooperation), so
//! `attach` checks that the running VM was started with the disk, and
//! `detach` stops QEMU: at once when the guest said it unmounted the disk
//! (QEMU flushes it on `quit`), else by an ACPI power-off so the guest's own
//! shutdown unmounts it. The VM is deleted right after either way.

use std::path::PathBuf;
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};
use async_trait::async_trait;
use uuid::Uuid;

use super::vm::{self, VmDir};
use super::{power, process, QemuProvider};
use crate::context::Ctx;
use crate::model::{GuestMount, Machine, ManagedVolume, StorageMode, Volume};
use crate::provider::{VolumeGone, VolumeSpec, Volumes};
use crate::state::EnvPaths;

/// Volume fields.
pub mod field {
    /// The virtual size it was made with.
    pub const SIZE: &str = "size";
}

impl QemuProvider {
    fn volume_dir(&self, env_id: Uuid) -> PathBuf {
        self.store.env_paths(env_id).dir.join("volume")
    }

    /// The environment a volume belongs to: its id must be exactly an
    /// environment's data disk in this state dir.
    fn volume_env(&self, volume: &Volume) -> Result<EnvPaths> {
        let path = PathBuf::from(&volume.id);
        let id = path
            .parent()
            .and_then(|p| p.parent())
            .and_then(|p| p.file_name())
            .and_then(|n| n.to_str())
            .and_then(|n| Uuid::parse_str(n).ok());
        match id {
            Some(id) if path == vm::data_disk(&self.volume_dir(id)) => Ok(self.store.env_paths(id)),
            _ => bail!(
                "qemu volume {} is not an environment's data disk in this state dir ({})",
                path.display(),
                self.store.environments_dir().display()
            ),
        }
    }
}

/// `qemu-img create` of the data disk, through a temporary name.
fn create_disk(qemu_img: &std::path::Path, disk: &std::path::Path, size: &str) -> Result<()> {
    let tmp = disk.with_extension("qcow2.tmp");
    let out = Command::new(qemu_img)
        .args(["create", "-q", "-f", "qcow2"])
        .arg(&tmp)
        .arg(size)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {} (qemu.qemu_img)", qemu_img.display()))?;
    if !out.status.success() {
        bail!(
            "making the data disk {} failed ({}): {}",
            disk.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    std::fs::rename(&tmp, disk)
        .with_context(|| format!("renaming {} into place", tmp.display()))?;
    if let Some(dir) = disk.parent() {
        vm::sync_dir(dir)?;
    }
    Ok(())
}

#[async_trait]
impl Volumes for QemuProvider {
    async fn create_volume(&self, spec: &VolumeSpec, ctx: &Ctx) -> Result<Volume> {
        let dir = self.volume_dir(spec.env_id);
        crate::state::store::ensure_private_dir(&dir)?;
        let disk = vm::data_disk(&dir);
        let size = self.settings.volume_size.clone();
        if disk.exists() {
            ctx.log.info(format!(
                "reusing data disk {} (made by an earlier attempt)",
                disk.display()
            ));
        } else {
            create_disk(&self.settings.qemu_img, &disk, &size)?;
            ctx.log
                .info(format!("made data disk {} ({size})", disk.display()));
        }
        Ok(Volume::new(disk.display().to_string()).with(field::SIZE, size))
    }

    async fn find_volume(&self, env_id: Uuid, _ctx: &Ctx) -> Result<Option<Volume>> {
        let disk = vm::data_disk(&self.volume_dir(env_id));
        Ok(disk
            .exists()
            .then(|| Volume::new(disk.display().to_string())))
    }

    async fn attach(&self, volume: &Volume, machine: &Machine, _ctx: &Ctx) -> Result<()> {
        let paths = self.volume_env(volume)?;
        let vm = VmDir::new(&paths);
        if !vm.data_disk().exists() {
            return Err(VolumeGone(format!("the data disk {} is gone", volume.id)).into());
        }
        let launch = vm.read_launch()?.with_context(|| {
            format!("VM {} has no launch.json: it was never started", machine.id)
        })?;
        if process::find(&vm).is_none() {
            bail!(
                "VM {} is not running: its data disk cannot be attached",
                machine.id
            );
        }
        if !vm::has_data_disk(&launch.argv, &vm) {
            bail!(
                "VM {} was started without its data disk {} (QEMU attaches disks when it starts): \
                 it is deleted and a new one started on the next attempt",
                machine.id,
                volume.id
            );
        }
        Ok(())
    }

    async fn detach(
        &self,
        volume: &Volume,
        machine: &Machine,
        unmounted: bool,
        ctx: &Ctx,
    ) -> Result<()> {
        let vm = VmDir::new(&self.volume_env(volume)?);
        if process::find(&vm).is_none() {
            return Ok(()); // not running: nothing holds the disk
        }
        if unmounted {
            ctx.log.info(format!(
                "the guest unmounted its data disk: stopping QEMU of VM {}",
                machine.id
            ));
            power::quit(&vm, ctx).await
        } else {
            power::powerdown(self, &vm, ctx).await
        }
    }

    async fn delete_volume(&self, volume: &Volume, _ctx: &Ctx) -> Result<()> {
        let paths = self.volume_env(volume)?;
        let vm = VmDir::new(&paths);
        if process::find(&vm).is_some() {
            bail!(
                "the data disk {} is still used by a running VM of its environment",
                volume.id
            );
        }
        let dir = self.volume_dir(paths.id);
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e).with_context(|| format!("deleting {}", dir.display())),
        }
    }

    async fn list_volumes(&self, _ctx: &Ctx) -> Result<Vec<ManagedVolume>> {
        let mut out = Vec::new();
        for id in self.store.environment_ids()? {
            let disk = vm::data_disk(&self.volume_dir(id));
            if disk.exists() {
                out.push(ManagedVolume {
                    volume: Volume::new(disk.display().to_string()),
                    env_id: Some(id),
                    state: "disk file".into(),
                });
            }
        }
        Ok(out)
    }

    fn guest_mount(&self, volume: &Volume) -> GuestMount {
        let dirs = self
            .volume_env(volume)
            .ok()
            .map(|p| self.settings.dirs(&p, StorageMode::Volume));
        GuestMount {
            device: Some(format!("/dev/disk/by-id/virtio-{}", vm::DATA_SERIAL)),
            mountpoint: self.settings.volume_mount.clone(),
            user_dirs: dirs.map(|d| vec![d.builds, d.cache]).unwrap_or_default(),
        }
    }

    fn key_fields(&self, _volume: &Volume) -> Vec<(String, String)> {
        // The disk lives in the environment's directory: the key's `env=`
        // names it already; a host path has no place in a key.
        Vec::new()
    }
}
