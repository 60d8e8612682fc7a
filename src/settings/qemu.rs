//! `[qemu]`: the `qemu` provider's settings (one QEMU process per running
//! environment on the runner host). The base image, and the images a job's
//! `image:` may pick, come only from here. `examples/dormant.toml` documents
//! each key with its default; `validate` reports every problem as `qemu.key: problem`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::boot_image::BootImage;
use super::disk_size::{size_bytes, valid_size, MAX_VOLUME_BYTES};
use super::mount_point::{inside, mount_problem};
use super::HumanDuration;
use crate::model::{Dirs, EnvPaths, StorageMode};
use uuid::Uuid;

/// At most this many warm VMs (each holds its memory while it waits).
pub const MAX_WARM: u32 = 16;
const MIN_WARM_AGE: std::time::Duration = std::time::Duration::from_secs(600);

#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct QemuSettings {
    /// The base image (qcow2 with cloud-init): never written, every
    /// environment gets a copy-on-write overlay on it. Required with provider = "qemu".
    pub image: Option<BootImage>,
    /// Names a job's `image:` may use, each mapped to a base image.
    pub images: BTreeMap<String, BootImage>,
    /// "kvm" (hardware virtualisation, /dev/kvm) or "tcg" (emulation, slow).
    pub accel: Accel,
    /// `-cpu`; default "host" with kvm, "qemu64" with tcg.
    pub cpu: Option<String>,
    pub cpus: u32,
    pub memory_mib: u32,
    /// Virtual size of each environment's disk (`qemu-img` size, e.g. "20G");
    /// unset: the base image's. The guest grows its filesystem (cloud-init resizefs).
    pub disk_size: Option<String>,
    /// The image's cloud-init default user; the environment's key is installed for it.
    pub ssh_user: String,
    /// Running environments at once (a suspended one holds only disk); 0: no limit.
    pub max_environments: u32,
    /// What suspending does: power off keeping the disk, or save memory too.
    pub suspend_mode: QemuSuspendMode,
    /// Forbid the guest's own outbound connections (QEMU `restrict=on`): only
    /// the forwarded SSH port works. Jobs usually need the network; tests don't.
    pub restrict_network: bool,
    /// The QEMU system emulator.
    pub qemu_binary: PathBuf,
    pub qemu_img: PathBuf,
    /// How long an ACPI power-down may take before QEMU is quit (like pulling the plug).
    pub shutdown_timeout: HumanDuration,
    /// How long a boot may take until the guest's sshd answers.
    pub boot_timeout: HumanDuration,
    /// builds_dir inside the VM; default `<home of ssh_user>/builds`.
    pub builds_dir: Option<String>,
    /// cache_dir inside the VM; default `<home of ssh_user>/cache`.
    pub cache_dir: Option<String>,
    /// "machine": suspend keeps the VM's disk (powered off or hibernated).
    /// "volume": the builds and cache dirs live on a second disk of their own;
    /// suspend deletes the VM and its disk, resume boots a new one from the
    /// base image configured then (docs/qemu.md, "Volume mode").
    pub storage: StorageMode,
    /// Volume mode: the virtual size of an environment's data disk (qcow2,
    /// allocated as it is written).
    pub volume_size: String,
    /// Volume mode: where the data disk is mounted in the VM. The builds and
    /// cache dirs are `builds` and `cache` in it (or builds_dir / cache_dir,
    /// which must then be inside it).
    pub volume_mount: String,
    /// Warm machines: VMs booted ahead of any job from the default image,
    /// which a new environment or a volume-mode resume takes instead of
    /// booting one (docs/qemu.md, "Warm machines"). 0: none.
    pub warm: u32,
    /// A warm VM older than this is retired and replaced.
    pub warm_max_age: HumanDuration,
}

impl Default for QemuSettings {
    fn default() -> Self {
        QemuSettings {
            image: None,
            images: BTreeMap::new(),
            accel: Accel::Kvm,
            cpu: None,
            cpus: 2,
            memory_mib: 2048,
            disk_size: None,
            ssh_user: "debian".into(),
            max_environments: 2,
            suspend_mode: QemuSuspendMode::Shutdown,
            restrict_network: false,
            qemu_binary: PathBuf::from("qemu-system-x86_64"),
            qemu_img: PathBuf::from("qemu-img"),
            shutdown_timeout: HumanDuration::from_secs(60),
            boot_timeout: HumanDuration::from_secs(5 * 60),
            builds_dir: None,
            cache_dir: None,
            storage: StorageMode::Machine,
            volume_size: DEFAULT_VOLUME_SIZE.into(),
            volume_mount: DEFAULT_VOLUME_MOUNT.into(),
            warm: 0,
            warm_max_age: HumanDuration::from_secs(6 * 3600),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Accel {
    #[default]
    Kvm,
    Tcg,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum QemuSuspendMode {
    /// ACPI power-down: the disk is kept, processes end.
    #[default]
    Shutdown,
    /// Memory saved to a file beside the disk: processes keep running after resume.
    Hibernate,
}

pub const DEFAULT_VOLUME_SIZE: &str = "20G";
pub const DEFAULT_VOLUME_MOUNT: &str = "/dormant";

/// Where a VM's QMP socket lives, inside its environment dir.
pub const QMP_SOCKET: &str = "vm/qmp.sock";
/// A Unix socket path must fit in 108 bytes with its NUL.
pub const MAX_SOCKET_PATH: usize = 107;

/// The longest state dir the qemu provider can use: every VM's QMP socket,
/// `<state dir>/environments/<id>/vm/qmp.sock`, must fit in a socket path.
pub fn max_state_dir_len() -> usize {
    let tail = EnvPaths::new(Path::new(""), Uuid::nil())
        .dir
        .join(QMP_SOCKET);
    // The separator between the state dir and `environments`.
    MAX_SOCKET_PATH - 1 - tail.as_os_str().len()
}

impl QemuSettings {
    /// `selected`: the `qemu` provider is the one in use, so its required settings must be there.
    pub fn validate(&self, selected: bool, problems: &mut Vec<String>) {
        let mut p = |key: &str, msg: String| problems.push(format!("qemu.{key}: {msg}"));
        match &self.image {
            Some(image) => image.validate("image", &mut p),
            None if selected => p(
                "image",
                "required with provider = \"qemu\": the path of a qcow2 base image with cloud-init \
                 (see docs/qemu.md, \"Images\")"
                    .into(),
            ),
            None => {}
        }
        for (name, image) in &self.images {
            if name.trim().is_empty() {
                p("images", "an image name must not be empty".into());
            }
            image.validate(&format!("images.{name}"), &mut p);
        }
        if let Some(cpu) = &self.cpu {
            if cpu.trim().is_empty() || cpu.contains(char::is_whitespace) {
                p("cpu", format!("{cpu:?} is not a QEMU CPU model"));
            }
        }
        if self.warm > MAX_WARM {
            p(
                "warm",
                format!("{} is more than {MAX_WARM} warm VMs", self.warm),
            );
        } else if self.max_environments > 0 && self.warm >= self.max_environments {
            p(
                "warm",
                format!(
                    "{} warm VMs leave no room for a job's own VM under max_environments = {}: \
                     set warm below max_environments",
                    self.warm, self.max_environments
                ),
            );
        }
        if self.warm_max_age.get() < MIN_WARM_AGE {
            p(
                "warm_max_age",
                format!(
                    "{} is less than 10m: a warm VM must live long enough to boot and be taken",
                    self.warm_max_age
                ),
            );
        }
        if self.cpus == 0 {
            p("cpus", "must be at least 1".into());
        }
        if self.memory_mib < 128 {
            p(
                "memory_mib",
                format!(
                    "{} MiB is too little for a Linux guest (at least 128)",
                    self.memory_mib
                ),
            );
        }
        if let Some(size) = &self.disk_size {
            if !valid_size(size) {
                p(
                    "disk_size",
                    format!("{size:?} is not a size: write e.g. \"20G\" or \"512M\""),
                );
            }
        }
        if self.ssh_user.trim().is_empty() || self.ssh_user.contains(char::is_whitespace) {
            p(
                "ssh_user",
                format!("{:?} is not a user name", self.ssh_user),
            );
        }
        for (key, path) in [
            ("qemu_binary", &self.qemu_binary),
            ("qemu_img", &self.qemu_img),
        ] {
            if path.as_os_str().is_empty() {
                p(key, "must not be empty".into());
            }
        }
        for (key, d) in [
            ("shutdown_timeout", self.shutdown_timeout),
            ("boot_timeout", self.boot_timeout),
        ] {
            if d.is_zero() {
                p(key, "must be more than 0s".into());
            }
        }
        for (key, dir) in [
            ("builds_dir", &self.builds_dir),
            ("cache_dir", &self.cache_dir),
        ] {
            if let Some(d) = dir {
                if !d.starts_with('/') {
                    p(key, format!("{d:?} must be an absolute path inside the VM"));
                } else if self.storage == StorageMode::Volume && !inside(d, &self.volume_mount) {
                    p(
                        key,
                        format!(
                            "{d:?} is not on the data disk (qemu.volume_mount = {:?}): with storage = \"volume\" \
                             only what is on it is kept; leave it out or put it inside",
                            self.volume_mount
                        ),
                    );
                }
            }
        }
        match size_bytes(&self.volume_size) {
            None => p(
                "volume_size",
                format!(
                    "{:?} is not a size: write e.g. \"20G\" or \"512M\"",
                    self.volume_size
                ),
            ),
            Some(b) if b > MAX_VOLUME_BYTES => p(
                "volume_size",
                format!("{:?} is more than the maximum, 16T", self.volume_size),
            ),
            Some(b) if b < 64 << 20 => p(
                "volume_size",
                format!(
                    "{:?} is too small for an ext4 filesystem with a checkout (at least 64M)",
                    self.volume_size
                ),
            ),
            Some(_) => {}
        }
        if let Some(why) = mount_problem(&self.volume_mount) {
            p("volume_mount", why);
        }
        if self.storage == StorageMode::Volume && self.suspend_mode == QemuSuspendMode::Hibernate {
            p(
                "suspend_mode",
                "\"hibernate\" cannot apply with storage = \"volume\": a suspended volume-mode \
                 environment has no VM to keep memory for (its VM is deleted); leave suspend_mode out"
                    .into(),
            );
        }
    }

    /// The CPU model: the setting, else what suits the accelerator.
    pub fn cpu_model(&self) -> &str {
        match (&self.cpu, self.accel) {
            (Some(c), _) => c,
            (None, Accel::Kvm) => "host",
            (None, Accel::Tcg) => "qemu64",
        }
    }

    /// builds_dir / cache_dir for config (no I/O): every VM has its own
    /// disk; in volume mode they are on the data disk.
    pub fn dirs(&self, _paths: &EnvPaths, storage: StorageMode) -> Dirs {
        super::own_machine_dirs(
            &self.ssh_user,
            self.builds_dir.as_deref(),
            self.cache_dir.as_deref(),
            storage,
            &self.volume_mount,
        )
    }
}

#[cfg(test)]
#[path = "qemu_tests.rs"]
mod tests;
