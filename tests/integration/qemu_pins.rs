//! Replacing a qemu base image file in place (an operator's nightly
//! `cp new.qcow2 base.qcow2`) with real VMs: a suspended machine-mode
//! environment still boots on the image it was made on and finds its files,
//! a new environment boots the new image, and `sweep` removes the old pin
//! once no VM uses it (`provider/qemu/pins.rs`, docs/qemu.md "Updating an
//! image"). Three boots, one VM at a time.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::harness::*;
use crate::qemu::{env_paths, image_dir, one_vm, RUNNER, SYSTEM};
use dormant::provider::qemu::base_file::qcow2_backing;

/// Runs a tool, failing the test with its stderr.
fn tool(cmd: &mut Command) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// "Another image": the test image with a file `/dormant-image-two` at the
/// root of its filesystem (written with debugfs, no mount needed: the image
/// is ext4 on the whole disk). The root directory's block is one a VM's boot
/// and jobs never rewrite, so a disk laid over the wrong base shows the file.
fn second_image(from: &Path, dir: &Path) -> PathBuf {
    let raw = dir.join("two.raw");
    let marker = dir.join("marker");
    std::fs::write(&marker, "two\n").unwrap();
    tool(
        Command::new("qemu-img")
            .args(["convert", "-q", "-f", "qcow2", "-O", "raw"])
            .arg(from)
            .arg(&raw),
    );
    tool(
        Command::new("debugfs")
            .arg("-w")
            .arg("-R")
            .arg(format!("write {} dormant-image-two", marker.display()))
            .arg(&raw),
    );
    let out = dir.join("two.qcow2");
    tool(
        Command::new("qemu-img")
            .args(["convert", "-q", "-f", "raw", "-O", "qcow2"])
            .arg(&raw)
            .arg(&out),
    );
    std::fs::remove_file(raw).unwrap();
    out
}

/// The pins in the state dir whose file name ends in `suffix` (the disk's
/// `base.qcow2`, the kernel's `vmlinuz`, the initrd's `initrd.img`).
fn pins(state: &Path, suffix: &str) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(state.join("images"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            name.starts_with("sha256-") && name.ends_with(suffix)
        })
        .collect();
    v.sort();
    v
}

fn image_json(env_dir: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(env_dir.join("vm/image.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

#[test]
fn a_base_image_replaced_in_place_leaves_a_suspended_environment_intact() {
    let _one = one_vm();
    let img = image_dir();
    let images = tempfile::tempdir().unwrap();
    // The runner's own image file, which this test replaces as an operator would.
    let base = images.path().join("base.qcow2");
    std::fs::copy(img.join("base.qcow2"), &base).unwrap();
    let two = second_image(&base, images.path());
    let rig = Rig::new(
        RUNNER,
        SYSTEM,
        &format!(
            "provider = \"qemu\"\nprepare_timeout = \"10m\"\n\
             [ssh]\nready_timeout = \"2m\"\n\
             [qemu]\naccel = \"tcg\"\ncpus = 2\nmemory_mib = 1024\nrestrict_network = true\n\
             boot_timeout = \"400s\"\nshutdown_timeout = \"600s\"\nmax_environments = 1\n\
             suspend_mode = \"shutdown\"\n\
             image = {{ disk = \"{b}\", kernel = \"{d}/vmlinuz\", initrd = \"{d}/initrd.img\" }}\n",
            b = base.display(),
            d = img.display()
        ),
    );

    // 1. A machine-mode environment made on the first image, suspended.
    let first = job(95)
        .suspend_on(true, false)
        .script("echo kept-on-disk > state.txt; test ! -e /dormant-image-two && echo on-image-one");
    let env = env_paths(&rig, &first);
    let r1 = rig.run(&first);
    assert_result(&r1, JobResult::Success);
    assert!(r1.log().contains("on-image-one"), "{}", r1.log());
    let key = r1.key.clone().expect("the key is printed");
    assert_eq!(rig.status(&key).as_deref(), Some("suspended"));
    let pinned = image_json(&env.dir);
    let old_pin = PathBuf::from(pinned["disk"].as_str().unwrap());
    assert_eq!(pinned["pinned_from"].as_str(), Some(base.to_str().unwrap()));
    assert_eq!(
        old_pin.parent(),
        Some(rig.state_dir.join("images").as_path())
    );
    assert_eq!(
        qcow2_backing(&env.dir.join("vm/overlay.qcow2")).unwrap(),
        Some(old_pin.clone()),
        "the environment's disk is laid over the pin, not over {}",
        base.display()
    );

    // 2. The configured file overwritten in place (same inode, new content).
    std::fs::copy(&two, &base).unwrap();

    // 3. The resume boots on the first image and finds its files.
    let second = job(95)
        .resume(&key)
        .script("cat state.txt; test ! -e /dormant-image-two && echo still-on-image-one");
    let r2 = rig.run(&second);
    assert_result(&r2, JobResult::Success);
    assert!(
        r2.log().contains("kept-on-disk") && r2.log().contains("still-on-image-one"),
        "{}",
        r2.log()
    );
    // No trigger in job 2: released; its pin is now used by no VM.
    assert!(!env.dir.exists());

    // 4. A new environment boots the new image, from a new pin.
    let third = job(96)
        .suspend_on(true, false)
        .script("cat /dormant-image-two");
    let env3 = env_paths(&rig, &third);
    let r3 = rig.run(&third);
    assert_result(&r3, JobResult::Success);
    assert!(r3.log().contains("two"), "{}", r3.log());
    let key3 = r3.key.clone().expect("the key is printed");
    let new_pin = PathBuf::from(image_json(&env3.dir)["disk"].as_str().unwrap().to_string());
    assert_ne!(new_pin, old_pin);
    assert_eq!(pins(&rig.state_dir, "base.qcow2"), {
        let mut both = vec![old_pin.clone(), new_pin.clone()];
        both.sort();
        both
    });
    // The kernel and initrd did not change: one pin each, shared.
    let boot_files = [
        pins(&rig.state_dir, "vmlinuz"),
        pins(&rig.state_dir, "initrd.img"),
    ];
    assert!(boot_files.iter().all(|p| p.len() == 1), "{boot_files:?}");

    // 5. sweep removes the pin no VM uses, and only it.
    let out = rig.dormant(&["sweep"]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}");
    assert_eq!(
        pins(&rig.state_dir, "base.qcow2"),
        vec![new_pin.clone()],
        "{said}"
    );
    assert_eq!(
        [
            pins(&rig.state_dir, "vmlinuz"),
            pins(&rig.state_dir, "initrd.img")
        ],
        boot_files,
        "{said}"
    );
    assert!(
        said.contains(&format!("removed {}", old_pin.display())),
        "{said}"
    );

    // The last environment released: its pins go with the next sweep.
    let out = rig.dormant(&["release", &key3]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = rig.dormant(&["sweep"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(pins(&rig.state_dir, "").is_empty());
}
