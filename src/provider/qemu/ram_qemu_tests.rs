//! A hibernation and a restore through dormant's own code on a real QEMU
//! without a guest (a blank disk, TCG, 64 MiB: the firmware only, seconds),
//! whose RAM a `loader` device filled with random bytes at start (only the
//! first start: the restore's command line is the recorded one, without
//! it, so the bytes can only come back from the saved memory). Proves the
//! RAM-file way (`ram.rs`) keeps the pages out of the memory image and
//! brings them back, and that a VM started without the RAM file (an older
//! dormant) still hibernates and restores the old way. Needs
//! qemu-system-x86_64, qemu-img and genisoimage.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

use super::super::vm::{self, Launch, VmDir};
use super::super::{power, power_off, process, qmp::Qmp, tools, QemuProvider};
use crate::context::{Ctx, JobLog};
use crate::settings::boot_image::BootImage;
use crate::settings::duration::HumanDuration;
use crate::settings::qemu::{Accel, QemuSuspendMode};
use crate::settings::Settings;
use crate::state::StateStore;

/// Random bytes put in the guest's RAM, and where.
const FILL: usize = 8 << 20;
const FILL_AT: u64 = 0x100_0000;

/// Kills every QEMU of the state dir when the test ends, passed or not
/// (they run detached, `-daemonize`).
struct KillAll(std::path::PathBuf);

impl Drop for KillAll {
    fn drop(&mut self) {
        for (_, pid) in process::scan(&self.0.join("environments")) {
            // SAFETY: kill(2) on a QEMU whose command line names this
            // test's own state dir.
            unsafe { libc::kill(pid.0, libc::SIGKILL) };
        }
    }
}

/// The guest's bytes where the fill went.
fn guest_bytes(vm: &VmDir, out: &Path) -> Vec<u8> {
    let _ = std::fs::remove_file(out);
    Qmp::connect(&vm.qmp())
        .unwrap()
        .execute(
            "pmemsave",
            Some(serde_json::json!({ "val": FILL_AT, "size": FILL, "filename": out })),
        )
        .unwrap();
    std::fs::read(out).unwrap()
}

/// A VM started as `power::boot` starts it, by the settings of
/// `started_with`, plus a loader device that fills its RAM (not recorded in
/// `launch.json`). Its QEMU is killed when this is dropped.
struct Started {
    dir: tempfile::TempDir,
    store: StateStore,
    settings: Settings,
    image: BootImage,
    vm: VmDir,
    fill: Vec<u8>,
    _kill: KillAll,
}

async fn start(started_with: QemuSuspendMode) -> Started {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.qcow2");
    let made = std::process::Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2"])
        .arg(&base)
        .arg("64M")
        .status()
        .unwrap();
    assert!(made.success());
    let fill: Vec<u8> = (0..FILL).map(|_| fastrand::u8(..)).collect();
    let fill_file = dir.path().join("fill.bin");
    std::fs::write(&fill_file, &fill).unwrap();
    let store = StateStore::open(&dir.path().join("state")).unwrap();
    let kill = KillAll(store.root().to_path_buf());
    let mut settings = Settings::default();
    let image = BootImage::Path(base.clone());
    settings.qemu.image = Some(image.clone());
    settings.qemu.accel = Accel::Tcg;
    settings.qemu.cpus = 1;
    settings.qemu.memory_mib = 64;
    settings.qemu.suspend_mode = started_with;
    // Were the save to fail, the power-off it falls back to would wait this
    // long for a guest that is not there.
    settings.qemu.shutdown_timeout = HumanDuration(Duration::from_secs(1));
    let env = store.env_paths(uuid::Uuid::new_v4());
    std::fs::create_dir_all(&env.dir).unwrap();
    let vm = VmDir::new(&env);
    vm.ensure().unwrap();
    tools::create_overlay(&settings.qemu.qemu_img, &base, None, &vm).unwrap();
    tools::create_seed(&vm, "#cloud-config\n", &vm::meta_data(env.id)).unwrap();

    let port = tools::free_port().unwrap();
    let argv = vm::argv(&settings.qemu, &image, &vm, port);
    super::fresh(&vm, &argv).unwrap();
    vm.write_launch(&Launch {
        version: crate::state::store::FORMAT_VERSION,
        argv: argv.clone(),
        port,
        running_as: None,
    })
    .unwrap();
    let mut filled = argv.clone();
    filled.extend([
        "-device".to_string(),
        format!(
            "loader,file={},addr={FILL_AT:#x},force-raw=on",
            fill_file.display()
        ),
    ]);
    process::spawn(&filled, &vm).await.unwrap();
    let out = dir.path().join("out.bin");
    assert!(
        guest_bytes(&vm, &out) == fill,
        "the loader filled the guest's RAM"
    );
    // From here on, a dormant of today's settings.
    settings.qemu.suspend_mode = QemuSuspendMode::Hibernate;
    Started {
        dir,
        store,
        settings,
        image,
        vm,
        fill,
        _kill: kill,
    }
}

fn ctx() -> Ctx {
    Ctx::new(
        JobLog::stderr(),
        Default::default(),
        Duration::from_secs(120),
    )
}

/// Starts a VM (`start`), hibernates and restores it with dormant's code.
/// Returns the size of the memory image and whether a RAM file was there
/// while hibernated.
async fn hibernate_and_restore(started_with: QemuSuspendMode) -> (u64, bool) {
    let s = start(started_with).await;
    let (vm, image, fill) = (&s.vm, &s.image, &s.fill);
    let out = s.dir.path().join("out.bin");
    let p = QemuProvider::new(&s.settings, &s.store);
    let ctx = ctx();
    power_off::suspend(&p, vm, &ctx).await.unwrap();
    assert!(
        vm.state().exists(),
        "no memory image: the save failed and the VM was powered off instead (memory lost)"
    );
    assert_eq!(process::find(vm), None, "QEMU quit after the save");
    let image_size = std::fs::metadata(vm.state()).unwrap().len();
    let ram_file = vm.ram().exists();
    if ram_file {
        let mode = std::fs::metadata(vm.ram()).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "the guest's memory is private");
    }

    let (pid, _, restored) = power::resume(&p, vm, image, &ctx).await.unwrap();
    assert!(restored, "memory restored");
    assert!(!vm.state().exists(), "an image is restored once");
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", pid.0)).unwrap();
    assert!(
        !String::from_utf8_lossy(&cmdline).contains("loader"),
        "the restore runs the recorded command line, without the loader"
    );
    assert!(
        guest_bytes(vm, &out) == *fill,
        "the guest's RAM came back byte for byte"
    );
    power_off::quit(vm, &ctx).await.unwrap();
    assert_eq!(process::find(vm), None);
    (image_size, ram_file)
}

#[tokio::test]
async fn a_hibernate_vm_saves_only_its_device_state_and_restores_its_ram_from_the_file() {
    let (image_size, ram_file) = hibernate_and_restore(QemuSuspendMode::Hibernate).await;
    assert!(
        ram_file,
        "a hibernate-mode VM keeps its RAM in vm/memory.ram"
    );
    assert!(
        image_size < FILL as u64 / 8,
        "the memory image ({image_size} bytes) holds the device state only, not the {FILL} bytes \
         of guest RAM"
    );
}

#[tokio::test]
async fn a_vm_started_without_the_ram_file_hibernates_and_restores_the_old_way() {
    // As one started by an older dormant, or before the setting changed.
    let (image_size, ram_file) = hibernate_and_restore(QemuSuspendMode::Shutdown).await;
    assert!(!ram_file, "anonymous RAM: no file");
    assert!(
        image_size > FILL as u64,
        "the memory image ({image_size} bytes) holds the whole guest RAM"
    );
}

#[tokio::test]
async fn a_failed_hibernation_powers_off_and_leaves_no_ram_file_to_restore_from() {
    let s = start(QemuSuspendMode::Hibernate).await;
    let vm = &s.vm;
    // A capability a save to a file refuses: `migrate` fails after `stop`.
    Qmp::connect(&vm.qmp())
        .unwrap()
        .execute(
            "migrate-set-capabilities",
            Some(
                serde_json::json!({ "capabilities": [{ "capability": "multifd", "state": true }] }),
            ),
        )
        .unwrap();
    let p = QemuProvider::new(&s.settings, &s.store);
    let ctx = ctx();
    power_off::suspend(&p, vm, &ctx).await.unwrap();
    assert_eq!(process::find(vm), None, "powered off instead");
    for f in [vm.state(), vm.partial_state(), vm.ram()] {
        assert!(!f.exists(), "{} left by a failed hibernation", f.display());
    }
    let (_, _, restored) = power::resume(&p, vm, &s.image, &ctx).await.unwrap();
    assert!(!restored, "the disk is booted");
    let ram = std::fs::metadata(vm.ram()).expect("a boot makes a new RAM file");
    assert_eq!(ram.permissions().mode() & 0o777, 0o600);
    let out = s.dir.path().join("out.bin");
    assert!(
        guest_bytes(vm, &out).iter().all(|b| *b == 0),
        "a new boot's memory holds nothing of the last run"
    );
    power_off::quit(vm, &ctx).await.unwrap();
}
