//! Pinned base images: every VM's disk is an overlay on a read-only copy of
//! its base image that dormant keeps under the state dir, named by content,
//! never on the file the settings name.
//!
//! Why: a qcow2 overlay refers to its base by path and stores only the
//! clusters the guest changed. If the base file at that path is replaced
//! (an operator's nightly `cp new.qcow2 base.qcow2`), every suspended
//! machine-mode environment's disk becomes its own changes laid over another
//! image: a silent corruption. With pins, replacing the configured file
//! changes only what new VMs (new environments, warm VMs, volume mode's new
//! machines) are made from; a suspended environment boots from the pin it was
//! made on, as long as it lives (docs/qemu.md, "Updating an image").
//!
//! Layout, under `<state dir>/images/` (0700):
//!
//! | file | what |
//! | --- | --- |
//! | `sha256-<hex>-<name>` | a pinned file (0444): a disk, kernel or initrd, named by its content's SHA-256 and its original file name |
//! | `by-stat/<dev>-<ino>-<size>-<mtime>-<ctime>` | which pin a configured file is while it is unchanged (`base_file::stamp`, the warm pool's notion of a changed file too; a cache: a new VM does not hash the base again) |
//! | `pins.lock` | held while a pin is made and recorded, and while `sweep` removes pins |
//! | `tmp-<uuid>` | a copy in progress, renamed to its pin once hashed |
//!
//! Each VM records the pins it uses in `vm/image.json` (`PinnedImage`),
//! written before its overlay is made, under `pins.lock`: so a pin is either
//! recorded by a VM or can be removed, and `sweep` (holding the lock) removes
//! exactly the pins no `image.json` and no overlay names.
//!
//! Crash safety: a copy is made under a temporary name and renamed only once
//! complete and synced; a pin is found again by content, so a killed pin is
//! redone by the next prepare and its leftover `tmp-*` removed by `sweep`.
//! A base file that changes while it is copied (its size or times differ
//! after the copy) is refused: the copy could be half old, half new.
//!
//! Environments made by a dormant before pins refer to the configured path.
//! The first start of such a VM pins the file its overlay names and points
//! the overlay at the pin (`qemu-img rebase -u`: the header only; the
//! content is the same file), so it is safe from then on.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use super::base_file::{copy_hashing, qcow2_backing, rebase_unsafe, stamp};
use super::vm::VmDir;
use crate::context::Ctx;
use crate::settings::boot_image::{BootImage, FullBootImage};
use crate::state::lock::FileLock;
use crate::state::store::{ensure_private_dir, read_json, sync_dir, write_json};

/// The format version of `image.json`.
const IMAGE_FORMAT: u32 = 1;
/// Prefix of a pin's file name; what `sweep` may remove.
const PIN_PREFIX: &str = "sha256-";
const TMP_PREFIX: &str = "tmp-";

/// What a VM was made from: the pinned files (and the kernel command line,
/// which belongs with its kernel), recorded in `vm/image.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PinnedImage {
    pub version: u32,
    /// The pinned copy the overlay's backing file is.
    pub disk: PathBuf,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initrd: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel_args: Option<String>,
    /// The configured disk file it was pinned from (for operators).
    pub pinned_from: PathBuf,
}

impl PinnedImage {
    /// The image to boot: the pins in place of the configured files.
    pub fn boot_image(&self) -> BootImage {
        BootImage::Full(FullBootImage {
            disk: self.disk.clone(),
            kernel: self.kernel.clone(),
            initrd: self.initrd.clone(),
            kernel_args: self.kernel_args.clone(),
        })
    }

    fn files(&self) -> impl Iterator<Item = &Path> {
        std::iter::once(self.disk.as_path())
            .chain(self.kernel.as_deref())
            .chain(self.initrd.as_deref())
    }
}

/// The pins of one state dir.
pub struct Pins {
    dir: PathBuf,
}

impl Pins {
    pub fn new(state_root: &Path) -> Self {
        Pins {
            dir: state_root.join("images"),
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn lock_file(&self) -> PathBuf {
        self.dir.join("pins.lock")
    }

    async fn lock(&self, ctx: &Ctx) -> Result<FileLock> {
        ensure_private_dir(&self.dir)?;
        FileLock::acquire(&self.lock_file(), ctx, "the base image pins")
            .await?
            .with_context(|| format!("{} is gone", self.dir.display()))
    }

    /// The image a new VM in `vm` is made from: the pins its `image.json`
    /// records if an earlier attempt made one (its overlay may already refer
    /// to them), else `image`'s files pinned now and recorded.
    pub async fn for_new_vm(&self, vm: &VmDir, image: &BootImage, ctx: &Ctx) -> Result<BootImage> {
        if let Some(pinned) = recorded(vm)? {
            return Ok(pinned.boot_image());
        }
        let _lock = self.lock(ctx).await?;
        let pinned = self.pin_image(image, image.disk(), ctx)?;
        write_json(&image_file(vm), &pinned)?;
        Ok(pinned.boot_image())
    }

    /// The image an existing VM boots: its recorded pins (today's settings
    /// are not read: the image may have left `qemu.images` since). A VM made
    /// before pins (no `image.json`) is pinned now: the file its overlay
    /// names (not today's setting, which may name another file since), with
    /// the `configured` image's kernel and initrd, and its overlay pointed
    /// at the pin.
    pub async fn for_existing_vm(
        &self,
        qemu_img: &Path,
        vm: &VmDir,
        configured: impl FnOnce() -> Result<BootImage>,
        ctx: &Ctx,
    ) -> Result<BootImage> {
        let pinned = match recorded(vm)? {
            Some(p) => p,
            None => {
                let _lock = self.lock(ctx).await?;
                let base = qcow2_backing(&vm.overlay())?.with_context(|| {
                    format!("the disk {} names no base image", vm.overlay().display())
                })?;
                if !base.is_file() {
                    bail!(
                        "the base image {} that VM {}'s disk was made on is gone: put it back to resume \
                         the environment (docs/qemu.md, \"Updating an image\")",
                        base.display(),
                        vm.name()
                    );
                }
                ctx.log.info(format!(
                    "VM {} was made by a dormant that did not pin base images: pinning {} now",
                    vm.name(),
                    base.display()
                ));
                let p = self.pin_image(&configured()?, &base, ctx)?;
                write_json(&image_file(vm), &p)?;
                p
            }
        };
        for f in pinned.files() {
            if !f.is_file() {
                bail!(
                    "the pinned base image {} of VM {} is gone (deleted by hand?): the environment cannot \
                     boot; release it (docs/qemu.md, \"Updating an image\")",
                    f.display(),
                    vm.name()
                );
            }
        }
        // After the record (a kill in between is finished here next time).
        if qcow2_backing(&vm.overlay())?.as_deref() != Some(pinned.disk.as_path()) {
            rebase_unsafe(qemu_img, &vm.overlay(), &pinned.disk)?;
        }
        Ok(pinned.boot_image())
    }

    /// Pins `disk` and `image`'s kernel and initrd. Under the lock.
    fn pin_image(&self, image: &BootImage, disk: &Path, ctx: &Ctx) -> Result<PinnedImage> {
        let pin_opt = |p: Option<&Path>| p.map(|p| self.pin_file(p, ctx)).transpose();
        Ok(PinnedImage {
            version: IMAGE_FORMAT,
            disk: self.pin_file(disk, ctx)?,
            kernel: pin_opt(image.kernel())?,
            initrd: pin_opt(image.initrd())?,
            kernel_args: image.kernel().map(|_| image.kernel_args().to_string()),
            pinned_from: disk.to_path_buf(),
        })
    }

    /// The pin of `src` as it is now: found by its stat while unchanged,
    /// else copied, hashed and renamed into place. Under the lock.
    fn pin_file(&self, src: &Path, ctx: &Ctx) -> Result<PathBuf> {
        let before = stamp(src).with_context(|| {
            format!(
                "the base image file {} (qemu.image / qemu.images): see docs/qemu.md, \"Images\"",
                src.display()
            )
        })?;
        let cache = self.dir.join("by-stat").join(&before);
        if let Ok(name) = fs::read_to_string(&cache) {
            let pin = self.dir.join(name.trim());
            if is_pin_name(name.trim()) && pin.is_file() {
                return Ok(pin);
            }
        }
        let tmp = self
            .dir
            .join(format!("{TMP_PREFIX}{}", uuid::Uuid::new_v4()));
        let copied = copy_hashing(src, &tmp);
        let hash = match copied {
            Ok(h) => h,
            Err(e) => {
                let _ = fs::remove_file(&tmp);
                return Err(e);
            }
        };
        if stamp(src)? != before {
            let _ = fs::remove_file(&tmp);
            bail!(
                "the base image {} changed while dormant copied it (is it being replaced right now?): \
                 try again once the new file is complete; replace an image by writing a new file and \
                 renaming it over the old one",
                src.display()
            );
        }
        let name = format!(
            "{PIN_PREFIX}{hash}-{}",
            src.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| "image".into())
        );
        let pin = self.dir.join(&name);
        if pin.is_file() {
            fs::remove_file(&tmp).with_context(|| format!("removing {}", tmp.display()))?;
        } else {
            fs::rename(&tmp, &pin)
                .with_context(|| format!("renaming {} into place", tmp.display()))?;
            sync_dir(&self.dir).with_context(|| format!("syncing {}", self.dir.display()))?;
            ctx.log.info(format!(
                "pinned base image {} as {} (VMs made from it use the pin, so the file may be replaced)",
                src.display(),
                pin.display()
            ));
        }
        ensure_private_dir(&self.dir.join("by-stat"))?;
        crate::state::store::write_private(&cache, name.as_bytes())
            .with_context(|| format!("writing {}", cache.display()))?;
        Ok(pin)
    }

    /// `sweep`: removes every pin no VM of the state dir uses (no
    /// `image.json` and no overlay names it), copies a killed pin left, and
    /// cache entries of removed pins. Returns what it removed.
    pub async fn tidy(&self, ctx: &Ctx) -> Result<Vec<PathBuf>> {
        if !self.dir.exists() {
            return Ok(Vec::new());
        }
        let _lock = self.lock(ctx).await?;
        let root = self.dir.parent().context("the images dir has no parent")?;
        let used = used_pins(root)?;
        let mut removed = Vec::new();
        for entry in
            fs::read_dir(&self.dir).with_context(|| format!("listing {}", self.dir.display()))?
        {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let path = entry.path();
            let unused =
                (is_pin_name(&name) && !used.contains(&name)) || name.starts_with(TMP_PREFIX);
            if unused {
                fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))?;
                removed.push(path);
            }
        }
        let by_stat = self.dir.join("by-stat");
        if let Ok(entries) = fs::read_dir(&by_stat) {
            for entry in entries.flatten() {
                let keep = fs::read_to_string(entry.path())
                    .is_ok_and(|n| is_pin_name(n.trim()) && self.dir.join(n.trim()).is_file());
                if !keep {
                    let _ = fs::remove_file(entry.path());
                }
            }
        }
        Ok(removed)
    }
}

fn is_pin_name(name: &str) -> bool {
    name.starts_with(PIN_PREFIX) && !name.contains('/')
}

pub fn image_file(vm: &VmDir) -> PathBuf {
    vm.dir.join("image.json")
}

/// The pins `vm/image.json` records, if any.
pub fn recorded(vm: &VmDir) -> Result<Option<PinnedImage>> {
    read_json(&image_file(vm))
}

/// The file names of every file a VM of the state dir uses: the pins each
/// `image.json` names and the backing file each overlay names. Names, not
/// paths: a pin's name is its content, and a state dir reached through
/// another path (a symlink) must not make a used pin look unused. The pool
/// (`warm/`) is read before `environments/`: a hand-over renames a VM
/// directory from the first into the second, never back, so a VM moved
/// meanwhile is seen in one of them.
fn used_pins(root: &Path) -> Result<Vec<String>> {
    let mut used = Vec::new();
    for parent in ["warm", "environments"] {
        let Ok(entries) = fs::read_dir(root.join(parent)) else {
            continue;
        };
        for entry in entries.flatten() {
            // Only directories hold a VM: `warm/` also has the pool's
            // `refill.lock` and `refill.log`.
            if !entry.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let vm = entry.path().join("vm");
            let image = vm.join("image.json");
            match read_json::<PinnedImage>(&image) {
                Ok(Some(p)) => used.extend(p.files().filter_map(file_name)),
                Ok(None) => {}
                // A record we cannot read might name any pin: keep them all.
                Err(e) => {
                    return Err(e).context("a VM's image.json cannot be read: no pin is removed")
                }
            }
            if let Some(base) = qcow2_backing(&vm.join("overlay.qcow2")).ok().flatten() {
                used.extend(file_name(&base));
            }
        }
    }
    Ok(used)
}

fn file_name(p: &Path) -> Option<String> {
    p.file_name().map(|n| n.to_string_lossy().into_owned())
}

#[cfg(test)]
#[path = "pins_tests.rs"]
mod tests;
