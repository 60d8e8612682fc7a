//! The test seam of EC2 volume mode (`testing` builds only): in the tests
//! every "instance" is a loopback sshd on the test host, which has no EBS
//! device to mount. With `DORMANT_TEST_EC2_VOLUMES=<dir>` in dormant's own
//! environment, the provider plays the guest's block device: each data
//! volume's files are `<dir>/<volume id>`; `attach` (after its real
//! AttachVolume) links `volume_mount` to that directory, `detach` removes the
//! link, `delete_volume` removes the directory, and `guest_mount` names no
//! device, so the core's mount and unmount commands (`lifecycle/guest.rs`)
//! skip their block-device half (wait for the device, mkfs, mount, umount)
//! and only check the mark and make the builds and cache dirs. Everything
//! else — the EBS calls, their waits, the records — runs as in production.
//! A build without the `testing` feature ignores the variable.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

#[cfg(feature = "testing")]
static DIR: std::sync::OnceLock<Option<PathBuf>> = std::sync::OnceLock::new();

/// Reads the seam's directory from dormant's environment (once, at start).
pub fn init(_dir: Option<&str>) {
    #[cfg(feature = "testing")]
    let _ = DIR.set(_dir.filter(|d| !d.is_empty()).map(PathBuf::from));
}

/// The directory holding the volumes' files, when the seam is on.
pub fn dir() -> Option<&'static Path> {
    #[cfg(feature = "testing")]
    return DIR.get().and_then(|d| d.as_deref());
    #[cfg(not(feature = "testing"))]
    None
}

fn volume_dir(root: &Path, volume: &str) -> PathBuf {
    root.join(volume)
}

/// The volume is attached: `mountpoint` shows its files.
pub fn attach(root: &Path, volume: &str, mountpoint: &str) -> Result<()> {
    let dir = volume_dir(root, volume);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let link = Path::new(mountpoint);
    match std::fs::read_link(link) {
        Ok(target) if target == dir => return Ok(()),
        Ok(_) => std::fs::remove_file(link).with_context(|| format!("replacing {mountpoint}"))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("reading {mountpoint}")),
    }
    if let Some(parent) = link.parent() {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("creating {}", parent.display()))?;
    }
    std::os::unix::fs::symlink(&dir, link)
        .with_context(|| format!("linking {mountpoint} to {}", dir.display()))
}

/// The volume is detached: `mountpoint` no longer shows it (a link to
/// another volume's files is left alone).
pub fn detach(root: &Path, volume: &str, mountpoint: &str) -> Result<()> {
    let link = Path::new(mountpoint);
    match std::fs::read_link(link) {
        Ok(target) if target == volume_dir(root, volume) => {
            std::fs::remove_file(link).with_context(|| format!("removing the link {mountpoint}"))
        }
        _ => Ok(()),
    }
}

/// The volume is deleted: its files are gone.
pub fn delete(root: &Path, volume: &str) -> Result<()> {
    let dir = volume_dir(root, volume);
    match std::fs::remove_dir_all(&dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).with_context(|| format!("removing {}", dir.display())),
    }
}
