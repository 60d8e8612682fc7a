//! A base image of the `qemu` provider as the settings name it: a disk, or a
//! disk with a kernel and initrd for a direct kernel boot. Used by `[qemu]`'s
//! `image` and `images`, and by the pins (`provider/qemu/pins.rs`), which
//! stand a pinned copy in for the configured files.

use std::path::{Path, PathBuf};

use serde::Deserialize;

/// The kernel command line when `kernel` is set and `kernel_args` is not: root
/// on the whole first virtio disk, console on the serial port (the console
/// log), `quiet` because printing to an emulated UART costs seconds under TCG.
pub const DEFAULT_KERNEL_ARGS: &str = "root=/dev/vda rw console=ttyS0 quiet";

/// A base image: a path, or a table with a kernel and initrd for direct boot
/// (faster than firmware and bootloader; needed by images without a bootloader).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum BootImage {
    Path(PathBuf),
    Full(FullBootImage),
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FullBootImage {
    pub disk: PathBuf,
    pub kernel: Option<PathBuf>,
    pub initrd: Option<PathBuf>,
    pub kernel_args: Option<String>,
}

impl BootImage {
    pub fn disk(&self) -> &Path {
        match self {
            BootImage::Path(p) => p,
            BootImage::Full(f) => &f.disk,
        }
    }
    pub fn kernel(&self) -> Option<&Path> {
        match self {
            BootImage::Path(_) => None,
            BootImage::Full(f) => f.kernel.as_deref(),
        }
    }
    pub fn initrd(&self) -> Option<&Path> {
        match self {
            BootImage::Path(_) => None,
            BootImage::Full(f) => f.initrd.as_deref(),
        }
    }
    pub fn kernel_args(&self) -> &str {
        match self {
            BootImage::Full(FullBootImage {
                kernel_args: Some(a),
                ..
            }) => a,
            _ => DEFAULT_KERNEL_ARGS,
        }
    }

    pub(super) fn validate(&self, key: &str, p: &mut impl FnMut(&str, String)) {
        let mut files = vec![("disk", Some(self.disk()))];
        files.push(("kernel", self.kernel()));
        files.push(("initrd", self.initrd()));
        for (what, path) in files {
            if let Some(path) = path {
                if !path.is_absolute() {
                    p(
                        key,
                        format!("{what} {} must be an absolute path", path.display()),
                    );
                }
            }
        }
        if self.initrd().is_some() && self.kernel().is_none() {
            p(key, "initrd without kernel: set both or neither".into());
        }
        if let BootImage::Full(f) = self {
            if f.kernel_args.is_some() && f.kernel.is_none() {
                p(
                    key,
                    "kernel_args without kernel: set both or neither".into(),
                );
            }
        }
    }
}
