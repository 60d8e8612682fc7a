//! Pins without a VM: real files and `qemu-img` (qemu-utils), no QEMU. The
//! real-VM proof (a suspended environment resumed after its base file was
//! overwritten) is `tests/integration/qemu_pins.rs`.

use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use super::*;
use crate::context::JobLog;
use crate::settings::boot_image::BootImage;
use sha2::{Digest, Sha256};

fn ctx() -> Ctx {
    Ctx::new(
        JobLog::discard(),
        Default::default(),
        Duration::from_secs(60),
    )
}

struct Dir {
    _tmp: tempfile::TempDir,
    root: PathBuf,
}

fn dir() -> Dir {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().to_path_buf();
    for d in ["environments", "warm"] {
        fs::create_dir_all(root.join(d)).unwrap();
    }
    Dir { _tmp: tmp, root }
}

/// A VM directory under `<root>/<parent>/<id>/vm`, as an environment's or
/// a warm VM's is.
fn vm(root: &Path, parent: &str) -> VmDir {
    let id = uuid::Uuid::new_v4();
    let vm = VmDir {
        env_id: id,
        dir: root.join(parent).join(id.to_string()).join("vm"),
    };
    fs::create_dir_all(&vm.dir).unwrap();
    vm
}

fn qemu_img() -> PathBuf {
    PathBuf::from("qemu-img")
}

/// A small qcow2 base whose first bytes of data are `marker`.
fn base(path: &Path, marker: &str) {
    let raw = path.with_extension("raw");
    let mut data = marker.as_bytes().to_vec();
    data.resize(1 << 20, 0);
    fs::write(&raw, data).unwrap();
    let ok = Command::new("qemu-img")
        .args(["convert", "-q", "-f", "raw", "-O", "qcow2"])
        .arg(&raw)
        .arg(path)
        .status()
        .expect("qemu-img (qemu-utils) is installed by scripts/install-test-deps.sh");
    assert!(ok.success());
    fs::remove_file(raw).unwrap();
}

/// Overwrites `path` in place (same inode), as `cp new old` does.
fn overwrite_in_place(path: &Path, with: &Path) {
    let bytes = fs::read(with).unwrap();
    let mut f = fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(path)
        .unwrap();
    f.write_all(&bytes).unwrap();
}

fn overlay_on(vm: &VmDir, base: &Path) {
    let ok = Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-F", "qcow2", "-b"])
        .arg(base)
        .arg(vm.overlay())
        .status()
        .unwrap();
    assert!(ok.success());
}

fn pins_in(root: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(root.join("images"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(PIN_PREFIX))
        .collect();
    names.sort();
    names
}

#[test]
fn the_backing_file_is_read_from_the_qcow2_header() {
    let d = dir();
    let b = d.root.join("base.qcow2");
    base(&b, "one");
    let v = vm(&d.root, "environments");
    overlay_on(&v, &b);
    assert_eq!(qcow2_backing(&v.overlay()).unwrap(), Some(b.clone()));
    assert_eq!(
        qcow2_backing(&b).unwrap(),
        None,
        "a base has no backing file"
    );
    fs::write(d.root.join("text"), "not an image").unwrap();
    assert_eq!(qcow2_backing(&d.root.join("text")).unwrap(), None);
    assert_eq!(qcow2_backing(&d.root.join("missing")).unwrap(), None);
}

#[tokio::test]
async fn a_new_vm_is_made_on_a_read_only_pin_named_by_content() {
    let d = dir();
    let b = d.root.join("base.qcow2");
    base(&b, "one");
    let pins = Pins::new(&d.root);
    let v = vm(&d.root, "environments");
    let image = pins
        .for_new_vm(&v, &BootImage::Path(b.clone()), &ctx())
        .await
        .unwrap();
    let pin = image.disk().to_path_buf();
    assert_ne!(pin, b, "the VM must not be made on the configured file");
    assert_eq!(pin.parent(), Some(d.root.join("images").as_path()));
    assert_eq!(fs::read(&pin).unwrap(), fs::read(&b).unwrap());
    let mode = fs::metadata(&pin).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o444, "a pin is read-only");
    let hex: String = Sha256::digest(fs::read(&b).unwrap())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(
        pin.file_name().unwrap().to_string_lossy(),
        format!("sha256-{hex}-base.qcow2")
    );
    let rec = recorded(&v).unwrap().expect("image.json written");
    assert_eq!(rec.disk, pin);
    assert_eq!(rec.pinned_from, b);

    // A second VM of the same file shares the pin (no second copy).
    let v2 = vm(&d.root, "warm");
    let image2 = pins
        .for_new_vm(&v2, &BootImage::Path(b.clone()), &ctx())
        .await
        .unwrap();
    assert_eq!(image2.disk(), pin.as_path());
    assert_eq!(pins_in(&d.root).len(), 1);
}

#[tokio::test]
async fn a_base_overwritten_in_place_changes_new_vms_only() {
    let d = dir();
    let b = d.root.join("base.qcow2");
    base(&b, "one");
    let next = d.root.join("next.qcow2");
    base(&next, "two");
    let pins = Pins::new(&d.root);
    let old_vm = vm(&d.root, "environments");
    let old = pins
        .for_new_vm(&old_vm, &BootImage::Path(b.clone()), &ctx())
        .await
        .unwrap();
    overlay_on(&old_vm, old.disk());
    let old_bytes = fs::read(old.disk()).unwrap();

    overwrite_in_place(&b, &next);

    // The old VM still boots on its own pin, unchanged.
    let again = pins
        .for_existing_vm(&qemu_img(), &old_vm, || unreachable!(), &ctx())
        .await
        .unwrap();
    assert_eq!(again.disk(), old.disk());
    assert_eq!(fs::read(again.disk()).unwrap(), old_bytes);
    // A new VM gets the new content, in a new pin.
    let new_vm = vm(&d.root, "environments");
    let new = pins
        .for_new_vm(&new_vm, &BootImage::Path(b.clone()), &ctx())
        .await
        .unwrap();
    assert_ne!(new.disk(), old.disk());
    assert_eq!(fs::read(new.disk()).unwrap(), fs::read(&next).unwrap());
    // A retried prepare of the old VM keeps what its first attempt recorded.
    let retried = pins
        .for_new_vm(&old_vm, &BootImage::Path(b.clone()), &ctx())
        .await
        .unwrap();
    assert_eq!(retried.disk(), old.disk());
}

#[tokio::test]
async fn tidy_removes_only_pins_no_vm_uses() {
    let d = dir();
    let b = d.root.join("base.qcow2");
    base(&b, "one");
    let pins = Pins::new(&d.root);
    let first = vm(&d.root, "environments");
    let one = pins
        .for_new_vm(&first, &BootImage::Path(b.clone()), &ctx())
        .await
        .unwrap();
    overlay_on(&first, one.disk());
    let next = d.root.join("next.qcow2");
    base(&next, "two");
    overwrite_in_place(&b, &next);
    let warm = vm(&d.root, "warm");
    let two = pins
        .for_new_vm(&warm, &BootImage::Path(b.clone()), &ctx())
        .await
        .unwrap();
    // A copy a killed pin left behind.
    fs::write(d.root.join("images/tmp-leftover"), "half").unwrap();
    // The pool's own files beside its entries hold no VM.
    fs::write(d.root.join("warm/refill.lock"), "").unwrap();
    fs::write(d.root.join("warm/refill.log"), "x").unwrap();

    let removed = pins.tidy(&ctx()).await.unwrap();
    assert_eq!(removed, vec![d.root.join("images/tmp-leftover")]);
    assert!(one.disk().is_file() && two.disk().is_file(), "both in use");

    // The first environment released: its pin goes, the warm VM's stays.
    fs::remove_dir_all(first.dir.parent().unwrap()).unwrap();
    let removed = pins.tidy(&ctx()).await.unwrap();
    assert_eq!(removed, vec![one.disk().to_path_buf()]);
    assert!(two.disk().is_file());
    // Its cache entry went with it: the same content is pinned anew.
    let by_stat: Vec<_> = fs::read_dir(d.root.join("images/by-stat"))
        .unwrap()
        .flatten()
        .collect();
    assert_eq!(by_stat.len(), 1, "{by_stat:?}");

    // An overlay that names a pin keeps it even without image.json.
    fs::remove_file(image_file(&warm)).unwrap();
    overlay_on(&warm, two.disk());
    assert!(pins.tidy(&ctx()).await.unwrap().is_empty());
    assert!(two.disk().is_file());
}

#[tokio::test]
async fn an_unreadable_image_json_keeps_every_pin() {
    let d = dir();
    let b = d.root.join("base.qcow2");
    base(&b, "one");
    let pins = Pins::new(&d.root);
    let v = vm(&d.root, "environments");
    pins.for_new_vm(&v, &BootImage::Path(b.clone()), &ctx())
        .await
        .unwrap();
    let other = vm(&d.root, "environments");
    fs::write(image_file(&other), "{ torn").unwrap();
    fs::remove_file(image_file(&v)).unwrap();
    let err = pins.tidy(&ctx()).await.unwrap_err();
    assert!(format!("{err:#}").contains("no pin is removed"), "{err:#}");
    assert_eq!(pins_in(&d.root).len(), 1);
}

#[tokio::test]
async fn a_vm_made_before_pins_is_pinned_on_the_file_its_disk_names() {
    let d = dir();
    // It was made on old.qcow2; the settings name another file now.
    let made_on = d.root.join("old.qcow2");
    base(&made_on, "one");
    let configured = d.root.join("now.qcow2");
    base(&configured, "two");
    let v = vm(&d.root, "environments");
    overlay_on(&v, &made_on);
    let pins = Pins::new(&d.root);
    let image = pins
        .for_existing_vm(
            &qemu_img(),
            &v,
            || Ok(BootImage::Path(configured.clone())),
            &ctx(),
        )
        .await
        .unwrap();
    assert_eq!(fs::read(image.disk()).unwrap(), fs::read(&made_on).unwrap());
    assert_eq!(
        qcow2_backing(&v.overlay()).unwrap().as_deref(),
        Some(image.disk()),
        "the overlay now names the pin"
    );
    assert_eq!(recorded(&v).unwrap().unwrap().pinned_from, made_on);

    // Its base gone and no pin recorded: a clear refusal, nothing changed.
    let gone = vm(&d.root, "environments");
    let lost = d.root.join("lost.qcow2");
    base(&lost, "three");
    overlay_on(&gone, &lost);
    fs::remove_file(&lost).unwrap();
    let err = pins
        .for_existing_vm(&qemu_img(), &gone, || unreachable!(), &ctx())
        .await
        .unwrap_err();
    assert!(
        format!("{err:#}").contains("is gone: put it back"),
        "{err:#}"
    );
    assert!(recorded(&gone).unwrap().is_none());
}

#[tokio::test]
async fn a_kernel_and_initrd_are_pinned_with_the_disk() {
    let d = dir();
    let b = d.root.join("base.qcow2");
    base(&b, "one");
    fs::write(d.root.join("vmlinuz"), "kernel one").unwrap();
    fs::write(d.root.join("initrd.img"), "initrd one").unwrap();
    let image = BootImage::Full(FullBootImage {
        disk: b.clone(),
        kernel: Some(d.root.join("vmlinuz")),
        initrd: Some(d.root.join("initrd.img")),
        kernel_args: Some("root=/dev/vda console=ttyS0".into()),
    });
    let pins = Pins::new(&d.root);
    let v = vm(&d.root, "environments");
    let pinned = pins.for_new_vm(&v, &image, &ctx()).await.unwrap();
    fs::write(d.root.join("vmlinuz"), "kernel two").unwrap();
    let kernel = pinned.kernel().unwrap();
    assert_ne!(kernel, d.root.join("vmlinuz"));
    assert_eq!(fs::read_to_string(kernel).unwrap(), "kernel one");
    assert_eq!(
        fs::read_to_string(pinned.initrd().unwrap()).unwrap(),
        "initrd one"
    );
    assert_eq!(pinned.kernel_args(), "root=/dev/vda console=ttyS0");
}
