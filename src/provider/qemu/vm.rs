//! The files of one VM, in the `vm/` directory of its environment:
//!
//! | file | what |
//! | --- | --- |
//! | `overlay.qcow2` | the VM's disk: copy-on-write on the pinned copy of its base image (`pins.rs`) |
//! | `image.json` | the pinned files it was made from (`pins.rs`) |
//! | `seed.iso` | NoCloud seed (volume label `cidata`): `user-data`, `meta-data` |
//! | `launch.json` | the exact QEMU command line of the running or hibernated VM |
//! | `qmp.sock` | QMP control socket (0600) |
//! | `qemu.pid` | QEMU's pidfile |
//! | `console.log` | the serial console, appended across boots |
//! | `memory.state` | a complete hibernation image (only after a finished save) |
//! | `memory.state.partial` | a save in progress; never restored |
//! | `memory.ram` | the guest's RAM, hibernate mode only (`ram.rs`); with `memory.state` it is the hibernation image |
//!
//! Every file is written to a temporary name and renamed, so a process killed
//! at any line leaves either the old file or the new one.
//!
//! Volume mode keeps the environment's data disk beside `vm/`, in
//! `volume/data.qcow2`: deleting the VM (its directory) leaves it. No VM is
//! started with it: every VM gets an empty PCIe root port, into which
//! `Volumes::attach` hot-plugs the disk of the environment that takes the VM
//! (`hotplug.rs`), so a VM can boot before it is known whose disk it gets.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::settings::boot_image::BootImage;
use crate::settings::qemu::{Accel, QemuSettings, QemuSuspendMode, MAX_SOCKET_PATH};
use crate::state::EnvPaths;

#[derive(Debug, Clone)]
pub struct VmDir {
    pub env_id: Uuid,
    pub dir: PathBuf,
}

/// What started the VM: replayed exactly for a restore (QEMU loads a saved
/// memory image only into the same machine it was saved from).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Launch {
    /// The state-file format version (`state::store::FORMAT_VERSION`).
    pub version: u32,
    pub argv: Vec<String>,
    /// The host port forwarded to the guest's port 22.
    pub port: u16,
    /// A warm VM handed to an environment: the QEMU that runs now was started
    /// in the pool, under the pool's name and pidfile path (its command line
    /// cannot change); `argv` already names the environment's, for the next
    /// start. Cleared by every start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub running_as: Option<RunningAs>,
}

/// The identity of a running QEMU started under another VM directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunningAs {
    pub id: Uuid,
    /// The VM directory it was started in (its `-pidfile` is inside it).
    pub dir: PathBuf,
}

impl VmDir {
    pub fn new(paths: &EnvPaths) -> Self {
        VmDir {
            env_id: paths.id,
            dir: paths.dir.join("vm"),
        }
    }

    /// The VM's name: in its QEMU command line (`-name`), which is how a
    /// process is recognised as this environment's before it is signalled.
    pub fn name(&self) -> String {
        vm_name(self.env_id)
    }

    pub fn overlay(&self) -> PathBuf {
        self.dir.join("overlay.qcow2")
    }
    pub fn seed(&self) -> PathBuf {
        self.dir.join("seed.iso")
    }
    pub fn user_data(&self) -> PathBuf {
        self.dir.join("user-data")
    }
    pub fn launch_file(&self) -> PathBuf {
        self.dir.join("launch.json")
    }
    pub fn qmp(&self) -> PathBuf {
        self.dir.join("qmp.sock")
    }
    pub fn pidfile(&self) -> PathBuf {
        self.dir.join("qemu.pid")
    }
    pub fn console(&self) -> PathBuf {
        self.dir.join("console.log")
    }
    pub fn state(&self) -> PathBuf {
        self.dir.join("memory.state")
    }
    pub fn partial_state(&self) -> PathBuf {
        self.dir.join("memory.state.partial")
    }
    /// The guest's RAM as a file (hibernate mode, `ram.rs`).
    pub fn ram(&self) -> PathBuf {
        self.dir.join("memory.ram")
    }

    pub fn exists(&self) -> bool {
        self.overlay().exists()
    }

    /// Volume mode: the environment's data disk (outside `vm/`).
    pub fn data_disk(&self) -> PathBuf {
        data_disk(&self.dir.with_file_name("volume"))
    }

    pub fn ensure(&self) -> Result<()> {
        crate::state::store::ensure_private_dir(&self.dir)?;
        let qmp = self.qmp();
        if qmp.as_os_str().len() > MAX_SOCKET_PATH {
            bail!(
                "the QMP socket path {} is {} bytes long, more than a Unix socket allows ({MAX_SOCKET_PATH}): \
                 use a shorter state_dir",
                qmp.display(),
                qmp.as_os_str().len()
            );
        }
        Ok(())
    }

    pub fn read_launch(&self) -> Result<Option<Launch>> {
        crate::state::store::read_json(&self.launch_file())
    }

    pub fn write_launch(&self, launch: &Launch) -> Result<()> {
        crate::state::store::write_json(&self.launch_file(), launch)
    }

    /// Removes the whole VM directory. Already gone is success.
    pub fn remove(&self) -> Result<()> {
        match fs::remove_dir_all(&self.dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e).with_context(|| format!("removing {}", self.dir.display())),
        }
    }

    /// Removes a file and makes the removal durable (a hibernation image must
    /// not come back after a crash and be restored twice).
    pub fn remove_durably(&self, file: &Path) -> Result<()> {
        match fs::remove_file(file) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e).with_context(|| format!("removing {}", file.display())),
        }
        sync_dir(&self.dir)
    }
}

/// The data disk inside an environment's `volume/` directory.
pub fn data_disk(volume_dir: &Path) -> PathBuf {
    volume_dir.join("data.qcow2")
}

/// The serial of the data disk: the guest names it
/// `/dev/disk/by-id/virtio-<serial>` (virtio-blk serials are at most 20 bytes).
pub const DATA_SERIAL: &str = "dormant-data";
/// The PCI slot on the q35 root bus of the data disk's root port: after the
/// slots QEMU assigns to the other devices (from 0x1 up), well before the
/// chipset's (0x1f). VMs of older dormant versions had the disk itself there.
const DATA_PCI_SLOT: &str = "0x10";
/// The id of the PCIe root port every VM gets for the data disk (a q35 root
/// bus takes no hot-plugged device; a root port does).
pub const DATA_PORT: &str = "dormant-data-port";

pub fn vm_name(env_id: Uuid) -> String {
    format!("dormant-{env_id}")
}

pub fn sync_dir(dir: &Path) -> Result<()> {
    fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("syncing directory {}", dir.display()))
}

/// Writes `bytes` to `path` through a temporary file and a rename.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    let mut f = fs::File::create(&tmp).with_context(|| format!("writing {}", tmp.display()))?;
    f.write_all(bytes)?;
    f.sync_all()?;
    fs::rename(&tmp, path).with_context(|| format!("renaming {} into place", tmp.display()))
}

/// `meta-data` of the NoCloud seed. The instance id is the environment's: a
/// reboot of the same disk is the same instance (no new host keys, no new
/// user), while a new environment is a new instance.
pub fn meta_data(env_id: Uuid) -> String {
    format!(
        "instance-id: {}\nlocal-hostname: dormant-{}\n",
        vm_name(env_id),
        &env_id.simple().to_string()[..12]
    )
}

/// A value inside a QEMU `-drive`/`-netdev` option: commas are doubled.
fn opt_value(path: &Path) -> String {
    path.display().to_string().replace(',', ",,")
}

/// The id of the guest RAM's memory backend on the command line.
const RAM_BACKEND_ID: &str = "dormant-ram";

/// The `-machine` value and the `-object` that put the guest's RAM in
/// `vm`'s RAM file, for hibernate mode (`ram.rs` says why): the restore maps
/// the file instead of copying the memory image.
fn file_ram_args(vm: &VmDir, memory_mib: u32) -> [String; 2] {
    [
        format!("q35,memory-backend={RAM_BACKEND_ID}"),
        format!(
            "memory-backend-file,id={RAM_BACKEND_ID},size={memory_mib}M,mem-path={},share=on",
            opt_value(&vm.ram())
        ),
    ]
}

/// Whether a recorded command line keeps the guest's RAM in the RAM file
/// (VMs started by an older dormant, and those of other suspend modes, do
/// not).
pub fn has_file_ram(argv: &[String]) -> bool {
    let object = format!("memory-backend-file,id={RAM_BACKEND_ID},");
    argv.iter().any(|a| a.starts_with(&object))
}

/// The QEMU command line of a VM (without `-incoming`).
pub fn argv(settings: &QemuSettings, image: &BootImage, vm: &VmDir, port: u16) -> Vec<String> {
    let mut a: Vec<String> = vec![settings.qemu_binary.display().to_string()];
    let mut push = |items: &[&str]| a.extend(items.iter().map(|s| s.to_string()));
    let accel = match settings.accel {
        Accel::Kvm => "kvm",
        Accel::Tcg => "tcg,thread=multi",
    };
    let cpus = settings.cpus.to_string();
    let mem = settings.memory_mib.to_string();
    // Hibernate mode keeps the guest's RAM in a file (`ram.rs`): the restore
    // maps it instead of copying the memory image. Others keep anonymous RAM.
    let file_ram = (settings.suspend_mode == QemuSuspendMode::Hibernate)
        .then(|| file_ram_args(vm, settings.memory_mib));
    let machine = file_ram.as_ref().map_or("q35", |[m, _]| m.as_str());
    push(&[
        "-name",
        &vm.name(),
        "-machine",
        machine,
        "-accel",
        accel,
        "-cpu",
        settings.cpu_model(),
        "-smp",
        &cpus,
        "-m",
        &mem,
    ]);
    if let Some([_, object]) = &file_ram {
        push(&["-object", object]);
    }
    push(&[
        "-nodefaults",
        "-display",
        "none",
        // Appended, so the log of every boot of the environment is kept.
        "-chardev",
        &format!(
            "file,id=console,path={},append=on",
            opt_value(&vm.console())
        ),
        "-serial",
        "chardev:console",
        "-qmp",
        &format!("unix:{},server=on,wait=off", opt_value(&vm.qmp())),
        "-pidfile",
        &vm.pidfile().display().to_string(),
        // Own session, stdio on /dev/null, and the parent exits only once the
        // VM is set up: its exit status and stderr tell whether QEMU started.
        "-daemonize",
    ]);
    if let Some(kernel) = image.kernel() {
        push(&["-kernel", &kernel.display().to_string()]);
        if let Some(initrd) = image.initrd() {
            push(&["-initrd", &initrd.display().to_string()]);
        }
        push(&["-append", image.kernel_args()]);
    }
    let netdev = format!(
        "user,id=net0{},hostfwd=tcp:127.0.0.1:{port}-:22",
        if settings.restrict_network {
            ",restrict=on"
        } else {
            ""
        }
    );
    push(&[
        "-drive",
        &format!("file={},if=virtio,format=qcow2", opt_value(&vm.overlay())),
        "-netdev",
        &netdev,
        "-device",
        "virtio-net-pci,netdev=net0",
        "-drive",
        &format!(
            "file={},if=virtio,format=raw,readonly=on",
            opt_value(&vm.seed())
        ),
    ]);
    // The root port the data disk is hot-plugged into (volume mode), empty
    // at boot. Its PCI slot is fixed past the ones QEMU gives the other
    // devices: a `-device` without an address is placed before the `if=virtio`
    // drives, which would move the root disk and the network card to other
    // slots than VMs of earlier versions had (the guest names its network
    // interface by slot). Every VM gets it, so any running VM can take a data
    // disk; an empty port costs the guest nothing.
    push(&[
        "-device",
        &format!("pcie-root-port,id={DATA_PORT},chassis=1,slot=1,bus=pcie.0,addr={DATA_PCI_SLOT}"),
    ]);
    a
}

/// The same command line opening the VM's disks (`-drive`) through `alias`,
/// a symlink to the VM's directory (a warm VM's, `alias.rs`: QEMU opens its
/// disks again by these paths, and a warm VM's directory moves).
pub fn with_drives_under(argv: &[String], vm: &VmDir, alias: &Path) -> Vec<String> {
    let from = format!("file={}/", opt_value(&vm.dir));
    let to = format!("file={}/", opt_value(alias));
    let mut drive = false;
    argv.iter()
        .map(|a| {
            let out = match a.strip_prefix(&from) {
                Some(rest) if drive => format!("{to}{rest}"),
                _ => a.clone(),
            };
            drive = a == "-drive";
            out
        })
        .collect()
}

/// Whether a command line attaches the data disk: VMs started by a dormant
/// from before the disk was hot-plugged had it on their command line.
pub fn has_data_disk(argv: &[String], vm: &VmDir) -> bool {
    let drive = format!("file={},if=none,id=data", opt_value(&vm.data_disk()));
    argv.iter().any(|a| a.starts_with(&drive))
}

/// Whether a command line has the root port the data disk is hot-plugged
/// into (VMs started by an older dormant have none).
pub fn has_data_port(argv: &[String]) -> bool {
    let port = format!("pcie-root-port,id={DATA_PORT},");
    argv.iter().any(|a| a.starts_with(&port))
}

/// The same command line forwarding another host port (when the recorded one
/// was taken while the VM was suspended: the forward is not part of the saved
/// machine, so a restore may change it).
pub fn with_port(argv: &[String], old: u16, new: u16) -> Vec<String> {
    let from = format!("hostfwd=tcp:127.0.0.1:{old}-:22");
    let to = format!("hostfwd=tcp:127.0.0.1:{new}-:22");
    argv.iter().map(|a| a.replace(&from, &to)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_hibernate_mode_vm_gets_its_ram_in_a_file() {
        let vm = VmDir::new(&EnvPaths::new(Path::new("/s,x"), Uuid::nil()));
        let image = BootImage::Path("/b.qcow2".into());
        let mut settings = QemuSettings {
            memory_mib: 512,
            ..Default::default()
        };
        for mode in [QemuSuspendMode::Shutdown, QemuSuspendMode::Hibernate] {
            settings.suspend_mode = mode;
            let a = argv(&settings, &image, &vm, 2222);
            let joined = a.join(" ");
            let file = mode == QemuSuspendMode::Hibernate;
            assert_eq!(has_file_ram(&a), file, "{joined}");
            assert_eq!(
                joined.contains("-machine q35,memory-backend=dormant-ram "),
                file,
                "{joined}"
            );
            assert_eq!(
                joined.contains(
                    "memory-backend-file,id=dormant-ram,size=512M,\
                     mem-path=/s,,x/environments/00000000-0000-0000-0000-000000000000/vm/memory.ram,share=on"
                ),
                file,
                "the environment's own file, commas doubled: {joined}"
            );
            assert!(joined.contains("-m 512 "), "{joined}");
        }
    }

    #[test]
    fn the_recorded_command_line_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir::new(&EnvPaths::new(dir.path(), Uuid::nil()));
        vm.ensure().unwrap();
        assert_eq!(vm.read_launch().unwrap(), None);
        let launch = Launch {
            version: crate::state::store::FORMAT_VERSION,
            argv: vec!["qemu-system-x86_64".into(), "-name".into(), vm.name()],
            port: 2222,
            running_as: None,
        };
        vm.write_launch(&launch).unwrap();
        assert_eq!(vm.read_launch().unwrap(), Some(launch));
    }

    #[test]
    fn the_qmp_socket_is_where_the_settings_bound_the_state_dir_for() {
        let paths = EnvPaths::new(Path::new("/s"), Uuid::new_v4());
        assert_eq!(
            VmDir::new(&paths).qmp(),
            paths.dir.join(crate::settings::qemu::QMP_SOCKET)
        );
    }

    #[test]
    fn the_command_line_names_the_environment_and_forwards_loopback_only() {
        let paths = EnvPaths::new(Path::new("/s,x"), Uuid::nil());
        let vm = VmDir::new(&paths);
        let settings = QemuSettings {
            accel: Accel::Tcg,
            restrict_network: true,
            ..Default::default()
        };
        let image = BootImage::Path("/img/base.qcow2".into());
        let a = argv(&settings, &image, &vm, 2222);
        let joined = a.join(" ");
        assert!(
            joined.contains("-name dormant-00000000-0000-0000-0000-000000000000"),
            "{joined}"
        );
        assert!(
            joined.contains("hostfwd=tcp:127.0.0.1:2222-:22"),
            "{joined}"
        );
        assert!(joined.contains("restrict=on"), "{joined}");
        assert!(joined.contains("-cpu qemu64"), "{joined}");
        assert!(
            joined.contains("file=/s,,x/environments/"),
            "commas doubled: {joined}"
        );
        assert!(!joined.contains("-kernel"), "{joined}");
        let moved = with_port(&a, 2222, 3333).join(" ");
        assert!(
            moved.contains("127.0.0.1:3333-:22") && !moved.contains("2222"),
            "{moved}"
        );
        assert!(meta_data(Uuid::nil()).starts_with("instance-id: dormant-00000000-"));
        assert!(!has_data_disk(&a, &vm), "machine mode: no data disk");
        assert!(has_data_port(&a), "every VM can take a data disk");
        let aliased = with_drives_under(&a, &vm, Path::new("/s,x/qemu-paths/a"));
        let drives: Vec<&String> = aliased
            .windows(2)
            .filter(|w| w[0] == "-drive")
            .map(|w| &w[1])
            .collect();
        assert_eq!(drives.len(), 2, "{aliased:?}");
        assert!(
            drives
                .iter()
                .all(|d| d.starts_with("file=/s,,x/qemu-paths/a/")),
            "{drives:?}"
        );
        let others = |v: &[String]| -> Vec<String> {
            v.iter()
                .filter(|a| !a.contains(".qcow2") && !a.contains(".iso"))
                .cloned()
                .collect()
        };
        assert_eq!(others(&aliased), others(&a), "only the disks are aliased");
    }

    #[test]
    fn every_vm_gets_an_empty_root_port_last_and_no_data_disk() {
        let dir = tempfile::tempdir().unwrap();
        let paths = EnvPaths::new(dir.path(), Uuid::nil());
        let vm = VmDir::new(&paths);
        std::fs::create_dir_all(paths.dir.join("volume")).unwrap();
        std::fs::write(vm.data_disk(), b"").unwrap();
        assert_eq!(vm.data_disk(), paths.dir.join("volume/data.qcow2"));
        let settings = QemuSettings::default();
        let a = argv(&settings, &BootImage::Path("/b.qcow2".into()), &vm, 2222);
        let joined = a.join(" ");
        assert!(
            !joined.contains("data.qcow2") && !joined.contains("serial="),
            "volume mode: the disk is hot-plugged, not on the command line: {joined}"
        );
        let root = joined.find("overlay.qcow2").unwrap();
        let seed = joined.find("seed.iso").unwrap();
        let net = joined.find("virtio-net-pci").unwrap();
        let port = joined.find("pcie-root-port").unwrap();
        assert!(root < seed && net < port && seed < port, "{joined}");
        assert!(
            joined.ends_with(
                "-device pcie-root-port,id=dormant-data-port,chassis=1,slot=1,bus=pcie.0,addr=0x10"
            ),
            "{joined}"
        );
        assert_eq!(a.iter().filter(|a| a.contains("pcie-root-port")).count(), 1);
        assert!(has_data_port(&a));
        assert!(!has_data_disk(&a, &vm));
        assert!(DATA_SERIAL.len() <= 20);
    }

    #[test]
    fn a_command_line_of_an_older_dormant_is_recognised() {
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir::new(&EnvPaths::new(dir.path(), Uuid::nil()));
        // What dormant put on the command line of a volume-mode VM before the
        // data disk was hot-plugged: no root port, the disk itself.
        let older = vec![
            "qemu-system-x86_64".to_string(),
            "-drive".into(),
            format!(
                "file={},if=none,id=data,format=qcow2",
                vm.data_disk().display()
            ),
            "-device".into(),
            "virtio-blk-pci,drive=data,serial=dormant-data,addr=0x10".into(),
        ];
        assert!(has_data_disk(&older, &vm));
        assert!(!has_data_port(&older));
        assert!(!has_data_port(&older[..1]));
    }
}
