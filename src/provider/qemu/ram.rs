//! Guest RAM in a file (`vm/memory.ram`), for VMs of `suspend_mode =
//! "hibernate"`: what makes a restore take well under a second.
//!
//! Such a VM's memory is a file mapped shared (`memory-backend-file,share=on`,
//! the machine's `memory-backend`), so the guest's pages already *are* the
//! file. A hibernation then saves with the `x-ignore-shared` migration
//! capability: QEMU writes only the device state to `memory.state` (a few
//! hundred KiB) and dormant makes the RAM file durable (fsync). A restore
//! starts QEMU on the same file (`-incoming defer`, the capability, then
//! `migrate-incoming`) and the guest faults its pages in as it touches
//! them: nothing is copied before it runs. Measured with
//! `scripts/bench-hibernate-methods.py`; docs/qemu.md, "Lifecycle", says
//! what it costs and why only hibernate-mode VMs get it.
//!
//! The command line that maps the file is `vm.rs`'s, with the rest of the
//! command line (`vm::argv`); this file keeps the file itself: made anew for
//! a boot, checked before a restore, synced on a save.
//!
//! Which way a VM saves and restores is read from its recorded command line
//! (`vm::has_file_ram`), never from the settings: a VM started by an older
//! dormant (anonymous RAM) hibernates and restores the old way, copying its
//! whole memory into `memory.state`.
//!
//! Crash safety: the RAM file and `memory.state` are one image. The file is
//! synced *before* `memory.state.partial` is renamed into place, so a
//! `memory.state` always has its pages on disk; a VM that runs again (a
//! restore continued, a failed save's VM continued) has its `memory.state`
//! deleted before it runs (`power.rs`, `power_off.rs`). A fresh boot starts
//! on a new empty file ([`fresh`]): the pages of an earlier run are never a
//! new boot's memory, and nothing restores from them without a
//! `memory.state`.

use std::fs;
use std::io::ErrorKind;
use std::os::unix::fs::OpenOptionsExt;

use anyhow::{bail, Context, Result};
use serde_json::json;

use super::qmp::Qmp;
use super::vm::{has_file_ram, VmDir};

/// Before a fresh boot (not a restore): the RAM file of an earlier run is
/// removed, and one that `argv` uses is made anew, empty and 0600 (QEMU
/// sizes it; it holds the guest's memory, so it is private whatever umask
/// QEMU runs with).
pub fn fresh(vm: &VmDir, argv: &[String]) -> Result<()> {
    match fs::remove_file(vm.ram()) {
        Ok(()) => {}
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("removing {}", vm.ram().display())),
    }
    if has_file_ram(argv) {
        fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(vm.ram())
            .with_context(|| format!("making the guest RAM file {}", vm.ram().display()))?;
    }
    Ok(())
}

/// Before a restore from the RAM file: it must be there (QEMU would make an
/// empty one, and the guest would run on zeroed memory).
pub fn check_restorable(vm: &VmDir) -> Result<()> {
    if !vm.ram().exists() {
        bail!(
            "its guest RAM file {} is missing (the memory image holds only the device state)",
            vm.ram().display()
        );
    }
    Ok(())
}

/// Turns on `x-ignore-shared` for the load of a save: the RAM file's pages
/// are not in the image. The save side sets it too (`power_off.rs`).
pub fn ignore_shared(q: &mut Qmp) -> Result<()> {
    q.execute(
        "migrate-set-capabilities",
        Some(json!({ "capabilities": [{ "capability": "x-ignore-shared", "state": true }] })),
    )
    .context("turning on the x-ignore-shared migration capability")?;
    Ok(())
}

/// Makes the guest's pages durable in the RAM file (the VM is stopped: no
/// page changes after this).
pub fn sync(vm: &VmDir) -> Result<()> {
    fs::File::open(vm.ram())
        .and_then(|f| f.sync_all())
        .with_context(|| format!("syncing the guest RAM file {}", vm.ram().display()))
}

#[cfg(test)]
#[path = "ram_qemu_tests.rs"]
mod qemu_tests;
