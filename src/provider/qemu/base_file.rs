//! A base image's files as files: whether one changed since it was last
//! looked at, a hashed copy of it, and the backing file a qcow2 overlay
//! names. `pins.rs` pins images with these and the warm pool (`warm.rs`)
//! tells by [`stamp`] whether its VMs were booted from today's file: one
//! notion of "the base image changed" for both, so a replacement that
//! repins new VMs also retires the warm VMs of the old file.

use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};

/// Copy buffer: large reads keep a multi-GiB copy at disk speed.
const COPY_BUF: usize = 1 << 20;

/// A file's identity as long as its content is unchanged: a write changes
/// its ctime (which no one can set back, unlike the mtime that `cp -p` and
/// `rsync -t` copy over), a replacement by rename its inode. Size and mtime
/// alone miss a same-size rewrite that keeps the mtime.
pub fn stamp(path: &Path) -> Result<String> {
    let m = fs::metadata(path).with_context(|| format!("reading {}", path.display()))?;
    if !m.is_file() {
        bail!("{} is not a file", path.display());
    }
    Ok(format!(
        "{}-{}-{}-{}.{}-{}.{}",
        m.dev(),
        m.ino(),
        m.len(),
        m.mtime(),
        m.mtime_nsec(),
        m.ctime(),
        m.ctime_nsec()
    ))
}

/// Copies `src` to `dst` (0444, synced) and returns the copy's SHA-256 in hex.
pub fn copy_hashing(src: &Path, dst: &Path) -> Result<String> {
    let mut from = fs::File::open(src).with_context(|| format!("reading {}", src.display()))?;
    let mut to = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(dst)
        .with_context(|| format!("creating {}", dst.display()))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; COPY_BUF];
    loop {
        let n = from
            .read(&mut buf)
            .with_context(|| format!("reading {}", src.display()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        to.write_all(&buf[..n])
            .with_context(|| format!("writing {}", dst.display()))?;
    }
    to.set_permissions(fs::Permissions::from_mode(0o444))?;
    to.sync_all()
        .with_context(|| format!("syncing {}", dst.display()))?;
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// The backing file a qcow2 image's header names (None: no backing file or
/// not a qcow2 file). Read from the header (QEMU's qcow2 spec: magic, then
/// the backing file name's offset as a big-endian u64 at byte 8 and its
/// length as a u32 at byte 16), so a look costs no process.
pub fn qcow2_backing(path: &Path) -> Result<Option<PathBuf>> {
    let mut f = match fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    let mut header = [0u8; 20];
    if f.read_exact(&mut header).is_err() || &header[..4] != b"QFI\xfb" {
        return Ok(None);
    }
    let offset = u64::from_be_bytes(header[8..16].try_into().expect("8 bytes"));
    let len = u32::from_be_bytes(header[16..20].try_into().expect("4 bytes")) as usize;
    // The spec bounds it at 1023 bytes.
    if offset == 0 || len == 0 || len > 1023 {
        return Ok(None);
    }
    use std::io::Seek;
    f.seek(std::io::SeekFrom::Start(offset))?;
    let mut name = vec![0u8; len];
    f.read_exact(&mut name)
        .with_context(|| format!("reading the backing file name of {}", path.display()))?;
    use std::os::unix::ffi::OsStringExt;
    Ok(Some(PathBuf::from(std::ffi::OsString::from_vec(name))))
}

/// Points `overlay`'s header at `base` without touching its data (`-u`):
/// only for a base with the same content as the one it names now.
pub fn rebase_unsafe(qemu_img: &Path, overlay: &Path, base: &Path) -> Result<()> {
    let out = Command::new(qemu_img)
        .args(["rebase", "-u", "-f", "qcow2", "-F", "qcow2", "-b"])
        .arg(base)
        .arg(overlay)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {} (is it installed?)", qemu_img.display()))?;
    if !out.status.success() {
        bail!(
            "pointing {} at its pinned base image {}: qemu-img rebase failed ({}): {}",
            overlay.display(),
            base.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_same_size_rewrite_that_keeps_the_mtime_is_a_change() {
        // What `cp -p new old` or `rsync -t` does to the configured file:
        // new bytes of the same length, the old file's mtime put back.
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("base.qcow2");
        fs::write(&base, b"build 1").unwrap();
        let mtime = fs::metadata(&base).unwrap().modified().unwrap();
        let before = stamp(&base).unwrap();
        assert_eq!(stamp(&base).unwrap(), before, "stable while unchanged");

        std::thread::sleep(std::time::Duration::from_millis(20));
        let f = fs::OpenOptions::new().write(true).open(&base).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&f, b"build 2", 0).unwrap();
        f.set_modified(mtime).unwrap();
        drop(f);
        let m = fs::metadata(&base).unwrap();
        assert_eq!(
            (m.len(), m.modified().unwrap()),
            (7, mtime),
            "size and mtime kept"
        );
        assert_ne!(stamp(&base).unwrap(), before);

        // A replacement renamed over it (another inode) is one too.
        let before = stamp(&base).unwrap();
        let new = dir.path().join("new");
        fs::write(&new, b"build 3").unwrap();
        fs::rename(&new, &base).unwrap();
        assert_ne!(stamp(&base).unwrap(), before);
        assert!(stamp(&dir.path().join("missing")).is_err());
    }
}
