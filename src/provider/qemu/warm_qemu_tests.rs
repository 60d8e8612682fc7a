//! A warm VM's real QEMU, without a guest (a blank disk, TCG, 64 MiB: it
//! runs the firmware only, seconds): started, handed to an environment,
//! hibernated and restored through dormant's own code. QEMU opens its disks
//! again by their command-line paths when a save completes, and the
//! hand-over moves the VM's directory under it (`alias.rs`), with the
//! guest's RAM file (`ram.rs`), which the restore opens by the
//! environment's path. Needs
//! qemu-system-x86_64, qemu-img and genisoimage. The real-VM proof with a
//! guest and a job is `tests/integration/qemu_warm.rs`.

use std::time::Duration;

use super::*;
use crate::context::JobLog;
use crate::settings::duration::HumanDuration;
use crate::settings::qemu::{Accel, QemuSuspendMode};
use crate::settings::Settings;
use crate::state::pool::Pool;
use crate::state::StateStore;

/// Kills every QEMU of the state dir when the test ends, passed or not
/// (they run detached, `-daemonize`).
struct KillAll(std::path::PathBuf);

impl Drop for KillAll {
    fn drop(&mut self) {
        for parent in ["warm", "environments"] {
            for (_, pid) in process::scan(&self.0.join(parent)) {
                // SAFETY: kill(2) on a QEMU whose command line names this
                // test's own state dir.
                unsafe { libc::kill(pid.0, libc::SIGKILL) };
            }
        }
    }
}

#[tokio::test]
async fn a_warm_vm_handed_over_under_its_running_qemu_hibernates_and_restores() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.qcow2");
    let made = std::process::Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2"])
        .arg(&base)
        .arg("64M")
        .status()
        .unwrap();
    assert!(made.success());
    let store = StateStore::open(&dir.path().join("state")).unwrap();
    let _kill = KillAll(store.root().to_path_buf());
    let mut settings = Settings::default();
    settings.qemu.image = Some(BootImage::Path(base.clone()));
    settings.qemu.warm = 1;
    settings.qemu.accel = Accel::Tcg;
    settings.qemu.cpus = 1;
    settings.qemu.memory_mib = 64;
    settings.qemu.suspend_mode = QemuSuspendMode::Hibernate;
    // Were the save to fail, the power-off it falls back to would wait this
    // long for a guest that is not there.
    settings.qemu.shutdown_timeout = HumanDuration(Duration::from_secs(1));
    let p = QemuProvider::new(&settings, &store);
    let ctx = Ctx::new(
        JobLog::stderr(),
        Default::default(),
        Duration::from_secs(300),
    );

    let pool = Pool::new(&store);
    let (wp, _entry, _lock) = pool.begin_launch("qemu", "fp", "default", None).unwrap();
    let (warm_vm, pid, port) = p
        .boot_warm(&wp, "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIA test", &ctx)
        .await
        .unwrap();
    let started_as = std::fs::read(format!("/proc/{}/cmdline", pid.0)).unwrap();
    let started_as = String::from_utf8_lossy(&started_as).replace('\0', " ");
    let alias = alias::path(store.root(), wp.id);
    assert!(
        started_as.contains(&format!("file={}/overlay.qcow2", alias.display())),
        "the disk is opened through the alias: {started_as}"
    );

    let env = store.env_paths(uuid::Uuid::new_v4());
    std::fs::create_dir_all(&env.dir).unwrap();
    p.hand_over(&wp, &p.machine(wp.id, port, "default"), &env, &ctx)
        .await
        .unwrap();
    let vm = VmDir::new(&env);
    assert!(!warm_vm.dir.exists(), "moved under its running QEMU");
    assert_eq!(process::find(&vm), Some(pid));
    assert_eq!(
        std::fs::canonicalize(&alias).unwrap(),
        std::fs::canonicalize(&vm.dir).unwrap(),
        "the alias follows the VM"
    );

    // As a hand-over killed between the move and the re-point leaves it (and
    // no retry finished): the hibernation re-points it before QEMU reopens.
    alias::point(store.root(), wp.id, &warm_vm.dir).unwrap();
    assert!(!alias.join("overlay.qcow2").exists());

    // What a job's end does in hibernate mode.
    power_off::suspend(&p, &vm, &ctx).await.unwrap();
    assert!(
        vm.state().exists(),
        "no memory image: the save failed and the VM was powered off instead (memory lost)"
    );
    assert_eq!(process::find(&vm), None, "QEMU quit after the save");
    // Hibernate mode: the guest's RAM is a file, opened once when the warm
    // VM started; it moved with the directory under the running QEMU.
    assert!(
        vm.ram().exists(),
        "the RAM file is in the environment's vm/"
    );

    // The restore runs the command line the hand-over rewrote (the
    // environment's own paths), and its start drops the alias.
    let (restored_pid, _, restored) = power::resume(&p, &vm, &BootImage::Path(base), &ctx)
        .await
        .unwrap();
    assert!(restored, "memory restored");
    assert!(!vm.state().exists(), "an image is restored once");
    let now = std::fs::read(format!("/proc/{}/cmdline", restored_pid.0)).unwrap();
    let now = String::from_utf8_lossy(&now).replace('\0', " ");
    assert!(
        now.contains(&format!("file={}/overlay.qcow2", vm.dir.display()))
            && !now.contains(alias::DIR)
            && !now.contains("/warm/"),
        "{now}"
    );
    assert!(
        now.contains(&format!("mem-path={},share=on", vm.ram().display())),
        "the restore maps the environment's RAM file: {now}"
    );
    assert!(vm.read_launch().unwrap().unwrap().running_as.is_none());
    assert!(
        std::fs::symlink_metadata(&alias).is_err(),
        "the alias goes with the QEMU it was made for"
    );
    power_off::quit(&vm, &ctx).await.unwrap();
    assert_eq!(process::find(&vm), None);
}
