//! The files and host resources a new VM needs, made with the host's tools:
//! its copy-on-write disk (`qemu-img`), its cloud-init seed ISO
//! (`genisoimage`, `mkisofs` or `xorriso`), and a free port on 127.0.0.1 for
//! its SSH. Each file is made under a temporary name and renamed.

use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};

use super::vm::{write_atomic, VmDir};

/// A TCP port on 127.0.0.1 nobody listens on now. std binds with SO_REUSEADDR,
/// so a port in TIME-WAIT (a VM that just exited) counts as free, as it is for QEMU.
pub fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")
        .context("finding a free port on 127.0.0.1 for the VM's SSH")?
        .local_addr()?
        .port())
}

pub fn port_free(port: u16) -> bool {
    std::net::TcpListener::bind(("127.0.0.1", port)).is_ok()
}

/// Runs a tool to completion, failing with its stderr.
fn run(cmd: &mut Command, what: &str) -> Result<()> {
    let out = cmd.stdin(Stdio::null()).output().with_context(|| {
        format!(
            "{what}: cannot run {:?} (is it installed?)",
            cmd.get_program()
        )
    })?;
    if !out.status.success() {
        bail!(
            "{what}: {:?} failed ({}): {}",
            cmd.get_program(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Makes the VM's copy-on-write disk on the base image (never written).
pub fn create_overlay(qemu_img: &Path, base: &Path, size: Option<&str>, vm: &VmDir) -> Result<()> {
    if !base.is_file() {
        bail!(
            "the base image {} does not exist (qemu.image / qemu.images): see docs/qemu.md, \"Images\"",
            base.display()
        );
    }
    let tmp = vm.dir.join("overlay.qcow2.tmp");
    let mut cmd = Command::new(qemu_img);
    cmd.args(["create", "-q", "-f", "qcow2", "-F", "qcow2", "-b"])
        .arg(base)
        .arg(&tmp);
    if let Some(size) = size {
        cmd.arg(size);
    }
    run(&mut cmd, "making the VM's disk")?;
    std::fs::rename(&tmp, vm.overlay())
        .with_context(|| format!("renaming {} into place", tmp.display()))
}

/// The NoCloud seed: an ISO 9660 volume labelled `cidata` with `user-data`
/// and `meta-data`, made by genisoimage, mkisofs or xorriso (whichever exists).
pub fn create_seed(vm: &VmDir, user_data: &str, meta_data: &str) -> Result<()> {
    let src = vm.dir.join("seed");
    let _ = std::fs::remove_dir_all(&src);
    std::fs::create_dir(&src).with_context(|| format!("creating {}", src.display()))?;
    write_atomic(&src.join("user-data"), user_data.as_bytes())?;
    write_atomic(&src.join("meta-data"), meta_data.as_bytes())?;
    // Kept beside the ISO for operators (and tests) to read.
    write_atomic(&vm.user_data(), user_data.as_bytes())?;
    let tmp = vm.dir.join("seed.iso.tmp");
    let tool = ["genisoimage", "mkisofs", "xorrisofs"]
        .into_iter()
        .find(|t| which(t))
        .context(
            "making the cloud-init seed ISO needs genisoimage, mkisofs or xorriso: \
             install one (Debian: apt-get install genisoimage)",
        )?;
    let mut cmd = Command::new(tool);
    cmd.args(["-quiet", "-output"])
        .arg(&tmp)
        .args(["-volid", "cidata", "-joliet", "-rock"])
        .arg(src.join("user-data"))
        .arg(src.join("meta-data"));
    run(&mut cmd, "making the cloud-init seed ISO")?;
    std::fs::rename(&tmp, vm.seed())?;
    let _ = std::fs::remove_dir_all(&src);
    Ok(())
}

fn which(tool: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|paths| std::env::split_paths(&paths).any(|d| d.join(tool).is_file()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_ports_are_loopback_and_bindable() {
        let p = free_port().unwrap();
        assert!(port_free(p));
        let held = std::net::TcpListener::bind(("127.0.0.1", p)).unwrap();
        assert!(!port_free(p));
        drop(held);
    }
}
