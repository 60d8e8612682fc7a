//! The qemu provider's volume mode: an environment's data disk is a qcow2
//! file of its own, `environments/<id>/volume/data.qcow2` (allocated as it is
//! written, up to `qemu.volume_size`), beside the VM's directory.
//!
//! No VM is started with it. `attach` hot-plugs it into the running VM over
//! QMP (`hotplug.rs`: a block node and a virtio disk whose serial the guest
//! finds under `/dev/disk/by-id/`, on the empty PCIe root port every VM gets
//! from `vm::argv`), so that any booted VM can take it. The guest's mount
//! command (`lifecycle::guest`, run after `attach`) formats it on the
//! environment's first mount and mounts it; cloud-init never sees it (it
//! arrives after boot). A VM started by an older dormant with the disk on its
//! command line has it attached already; one with neither the disk nor the
//! root port cannot take it (the error says it is deleted and a new VM made).
//!
//! `detach` does not hot-unplug: the VM is deleted right after, and a VM that
//! held an environment's disk never takes another (it ran that environment's
//! job), so a QEMU that exits is the whole detach. It stops QEMU at once when
//! the guest said it unmounted the disk (QEMU flushes it on `quit`), else by an
//! ACPI power-off so the guest's own shutdown unmounts it. An unplug would
//! also need the guest's consent (a virtio disk leaves only once the guest
//! released it), which is slower than either.

use std::path::PathBuf;
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};
use async_trait::async_trait;
use uuid::Uuid;

use super::hotplug::{self, Plugged};
use super::qmp::Qmp;
use super::vm::{self, VmDir};
use super::{power_off, process, QemuProvider};
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

    async fn attach(&self, volume: &Volume, machine: &Machine, ctx: &Ctx) -> Result<()> {
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
        if vm::has_data_disk(&launch.argv, &vm) {
            return Ok(()); // started with it, by an older dormant
        }
        if !vm::has_data_port(&launch.argv) {
            bail!(
                "VM {} was started without the PCIe root port {} that its data disk {} is hot-plugged \
                 into (an older dormant started it): it is deleted and a new one started on the next attempt",
                machine.id,
                vm::DATA_PORT,
                volume.id
            );
        }
        let plugged = Qmp::connect(&vm.qmp())
            .and_then(|mut q| hotplug::plug(&mut q, &vm.data_disk()))
            .with_context(|| format!("hot-plugging the data disk into VM {}", machine.id))?;
        ctx.log.info(match plugged {
            Plugged::Already => format!("VM {} has its data disk already", machine.id),
            Plugged::Finished => format!(
                "finished hot-plugging the data disk into VM {} (an earlier attempt added its block node)",
                machine.id
            ),
            Plugged::New => format!("hot-plugged the data disk into VM {}", machine.id),
        });
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
            power_off::quit(&vm, ctx).await
        } else {
            power_off::powerdown(self, &vm, ctx).await
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
            devices: vec![format!("/dev/disk/by-id/virtio-{}", vm::DATA_SERIAL)],
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

#[cfg(test)]
mod tests {
    use super::super::hotplug::fake::{self, State};
    use super::super::process::fake::FakeQemu;
    use super::*;
    use crate::context::JobLog;
    use crate::settings::boot_image::BootImage;
    use crate::settings::Settings;
    use crate::state::StateStore;

    /// A provider on a temp state dir, an environment with its data disk,
    /// and a fake QEMU running "its VM" with `argv` recorded as the launch.
    struct Rig {
        dir: tempfile::TempDir,
        provider: QemuProvider,
        vm: VmDir,
        volume: Volume,
        machine: Machine,
        _qemu: FakeQemu,
    }

    fn rig(argv: impl FnOnce(&Settings, &VmDir) -> Vec<String>) -> Rig {
        let dir = tempfile::tempdir().unwrap();
        let store = StateStore::open(dir.path()).unwrap();
        let settings = Settings::default();
        let provider = QemuProvider::new(&settings, &store);
        let id = Uuid::new_v4();
        let vm = VmDir::new(&store.env_paths(id));
        vm.ensure().unwrap();
        std::fs::create_dir_all(provider.volume_dir(id)).unwrap();
        std::fs::write(vm.data_disk(), b"").unwrap();
        let launch = vm::Launch {
            version: crate::state::store::FORMAT_VERSION,
            argv: argv(&settings, &vm),
            port: 2222,
            running_as: None,
        };
        vm.write_launch(&launch).unwrap();
        let qemu = FakeQemu::start(dir.path(), &vm);
        Rig {
            volume: Volume::new(vm.data_disk().display().to_string()),
            machine: Machine::new(vm.name()),
            provider,
            vm,
            dir,
            _qemu: qemu,
        }
    }

    fn ctx() -> Ctx {
        Ctx::new(
            JobLog::discard(),
            Default::default(),
            std::time::Duration::from_secs(30),
        )
    }

    fn todays(settings: &Settings, vm: &VmDir) -> Vec<String> {
        vm::argv(
            &settings.qemu,
            &BootImage::Path("/b.qcow2".into()),
            vm,
            2222,
        )
    }

    #[tokio::test]
    async fn attach_hot_plugs_the_disk_into_a_vm_with_the_root_port_once() {
        let r = rig(todays);
        let state = fake::serve(&r.vm.qmp(), State::default());
        r.provider
            .attach(&r.volume, &r.machine, &ctx())
            .await
            .unwrap();
        let disk = r.vm.data_disk().display().to_string();
        assert_eq!(state.lock().unwrap().device.as_deref(), Some(disk.as_str()));
        // Attached again (a retried prepare): the disk is found, nothing added.
        r.provider
            .attach(&r.volume, &r.machine, &ctx())
            .await
            .unwrap();
        assert_eq!(
            state.lock().unwrap().commands,
            [
                "query-block",
                "query-named-block-nodes",
                "blockdev-add",
                "device_add",
                "query-block"
            ],
            "the second attach found the disk and added nothing"
        );
        drop(r.dir);
    }

    #[tokio::test]
    async fn a_vm_an_older_dormant_started_with_the_disk_counts_as_attached() {
        let r = rig(|settings, vm| {
            let mut a = todays(settings, vm);
            a.truncate(a.len() - 2); // no root port
            a.extend([
                "-drive".to_string(),
                format!(
                    "file={},if=none,id=data,format=qcow2",
                    vm.data_disk().display()
                ),
                "-device".into(),
                "virtio-blk-pci,drive=data,serial=dormant-data,addr=0x10".into(),
            ]);
            a
        });
        // No QMP socket: attach must not need one.
        r.provider
            .attach(&r.volume, &r.machine, &ctx())
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn a_vm_without_the_root_port_is_refused_saying_it_is_replaced() {
        let r = rig(|settings, vm| {
            let mut a = todays(settings, vm);
            a.truncate(a.len() - 2);
            a
        });
        let state = fake::serve(&r.vm.qmp(), State::default());
        let e = r
            .provider
            .attach(&r.volume, &r.machine, &ctx())
            .await
            .unwrap_err();
        let e = format!("{e:#}");
        assert!(
            e.contains("without the PCIe root port dormant-data-port")
                && e.contains("it is deleted and a new one started"),
            "{e}"
        );
        assert!(state.lock().unwrap().commands.is_empty());
    }
}
