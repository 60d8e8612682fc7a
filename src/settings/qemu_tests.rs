//! Unit tests of the `[qemu]` settings.

use crate::settings::{ProviderKind, Settings};

use super::*;
use crate::settings::boot_image::DEFAULT_KERNEL_ARGS;
use crate::settings::disk_size::valid_size;

#[test]
fn a_minimal_section_parses_with_documented_defaults() {
    let s = Settings::parse_str("provider = \"qemu\"\n[qemu]\nimage = \"/img/base.qcow2\"\n")
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(s.provider, ProviderKind::Qemu);
    let q = &s.qemu;
    assert_eq!(
        q.image.as_ref().unwrap().disk(),
        Path::new("/img/base.qcow2")
    );
    assert_eq!(q.accel, Accel::Kvm);
    assert_eq!(q.cpu_model(), "host");
    assert_eq!(q.suspend_mode, QemuSuspendMode::Shutdown);
    assert_eq!(
        q.dirs(
            &EnvPaths::new(Path::new("/s"), uuid::Uuid::nil()),
            StorageMode::Machine
        )
        .builds,
        "/home/debian/builds"
    );
}

#[test]
fn a_direct_boot_image_and_an_allow_list_parse() {
    let s = Settings::parse_str(
        "provider = \"qemu\"\n[qemu]\naccel = \"tcg\"\nsuspend_mode = \"hibernate\"\n\
         image = { disk = \"/i/b.qcow2\", kernel = \"/i/vmlinuz\", initrd = \"/i/initrd.img\" }\n\
         [qemu.images]\nubuntu = \"/i/noble.qcow2\"\n",
    )
    .unwrap_or_else(|e| panic!("{e:#}"));
    let image = s.qemu.image.as_ref().unwrap();
    assert_eq!(image.kernel(), Some(Path::new("/i/vmlinuz")));
    assert_eq!(image.kernel_args(), DEFAULT_KERNEL_ARGS);
    assert_eq!(s.qemu.cpu_model(), "qemu64");
    assert_eq!(s.qemu.images["ubuntu"].disk(), Path::new("/i/noble.qcow2"));
    assert_eq!(s.qemu.suspend_mode, QemuSuspendMode::Hibernate);
}

#[test]
fn every_problem_names_its_key() {
    let err = Settings::parse_str(
        "provider = \"qemu\"\n[qemu]\ncpus = 0\nmemory_mib = 64\ndisk_size = \"lots\"\n\
         ssh_user = \"\"\nboot_timeout = \"0s\"\nbuilds_dir = \"rel\"\n\
         [qemu.images]\nx = { disk = \"rel.qcow2\", initrd = \"/i\" }\n",
    )
    .unwrap_err();
    let text = format!("{err:#}");
    for needle in [
        "qemu.image: required with provider = \"qemu\"",
        "qemu.cpus: must be at least 1",
        "qemu.memory_mib: 64 MiB",
        "qemu.disk_size: \"lots\" is not a size",
        "qemu.ssh_user:",
        "qemu.boot_timeout: must be more than 0s",
        "qemu.builds_dir: \"rel\" must be an absolute path",
        "qemu.images.x: disk rel.qcow2 must be an absolute path",
        "qemu.images.x: initrd without kernel",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in {text}");
    }
    let err = Settings::parse_str("[qemu]\naccel = \"hvf\"\n").unwrap_err();
    assert!(format!("{err:#}").contains("qemu.accel"), "{err:#}");
    let err = Settings::parse_str("[qemu]\nmemory = 1\n").unwrap_err();
    assert!(
        format!("{err:#}").contains("qemu.memory: unknown setting"),
        "{err:#}"
    );
}

#[test]
fn the_example_documents_every_qemu_setting() {
    let text = include_str!("../../examples/dormant.toml");
    let section = &text[text.find("\n[qemu]\n").expect("a [qemu] section")..];
    for key in [
        "image",
        "[qemu.images]",
        "accel",
        "cpu",
        "cpus",
        "memory_mib",
        "disk_size",
        "ssh_user",
        "max_environments",
        "suspend_mode",
        "qemu_binary",
        "qemu_img",
        "shutdown_timeout",
        "boot_timeout",
        "builds_dir",
        "cache_dir",
        "storage",
        "volume_size",
        "volume_mount",
    ] {
        assert!(
            section.contains(key),
            "examples/dormant.toml [qemu] does not document {key}"
        );
    }
    // The defaults it states are the defaults.
    let d = QemuSettings::default();
    for (line, want) in [
        (format!("cpus = {}", d.cpus), true),
        (format!("memory_mib = {}", d.memory_mib), true),
        (format!("ssh_user = \"{}\"", d.ssh_user), true),
        (format!("max_environments = {}", d.max_environments), true),
        (
            format!("shutdown_timeout = \"{}s\"", d.shutdown_timeout.as_secs()),
            true,
        ),
        (format!("volume_size = \"{}\"", d.volume_size), true),
        (format!("volume_mount = \"{}\"", d.volume_mount), true),
        ("storage = \"machine\"".to_string(), true),
    ] {
        assert_eq!(section.contains(&line), want, "{line}");
    }
    // Uncommenting the settings gives valid settings (with an image).
    let is_setting = |r: &str| {
        r.starts_with("[qemu.")
            || r.split_once(" = ").is_some_and(|(k, _)| {
                !k.is_empty()
                    && k.chars()
                        .all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c))
            })
    };
    let uncommented: String = section
        .lines()
        .map(|l| l.strip_prefix("# ").filter(|r| is_setting(r)).unwrap_or(l))
        .collect::<Vec<_>>()
        .join("\n");
    let s = Settings::parse_str(&format!(
        "provider = \"qemu\"\n{}",
        uncommented.replacen("[qemu]\n", "[qemu]\nimage = \"/i/base.qcow2\"\n", 1)
    ))
    .unwrap_or_else(|e| panic!("{e:#}\n{uncommented}"));
    assert!(s.qemu.images.contains_key("ubuntu-noble"), "{uncommented}");
}

#[test]
fn sizes() {
    for ok in ["20G", "512M", "1T", "100K"] {
        assert!(valid_size(ok), "{ok}");
    }
    for bad in ["", "G", "20", "20GB", "0G", "-1G", "2.5G"] {
        assert!(!valid_size(bad), "{bad}");
    }
}

#[test]
fn volume_mode_settings_are_checked() {
    let parse = |extra: &str| {
        Settings::parse_str(&format!(
            "provider = \"qemu\"\n[qemu]\nimage = \"/i/b.qcow2\"\n{extra}"
        ))
    };
    let s = parse("storage = \"volume\"\n").unwrap();
    assert_eq!(s.qemu.storage, StorageMode::Volume);
    let paths = EnvPaths::new(Path::new("/s"), uuid::Uuid::nil());
    let d = s.qemu.dirs(&paths, StorageMode::Volume);
    assert_eq!(
        (d.builds.as_str(), d.cache.as_str()),
        ("/dormant/builds", "/dormant/cache")
    );
    let d = parse("storage = \"volume\"\nvolume_mount = \"/data\"\nbuilds_dir = \"/data/b\"\n")
        .unwrap()
        .qemu
        .dirs(&paths, StorageMode::Volume);
    assert_eq!(
        (d.builds.as_str(), d.cache.as_str()),
        ("/data/b", "/data/cache")
    );
    for (extra, says) in [
        ("storage = \"disk\"\n", "qemu.storage: unknown variant"),
        (
            "volume_size = \"20\"\n",
            "qemu.volume_size: \"20\" is not a size",
        ),
        (
            "volume_size = \"17T\"\n",
            "qemu.volume_size: \"17T\" is more than the maximum, 16T",
        ),
        (
            "volume_size = \"1M\"\n",
            "qemu.volume_size: \"1M\" is too small",
        ),
        (
            "volume_mount = \"data\"\n",
            "qemu.volume_mount: \"data\" must be an absolute path",
        ),
        (
            "volume_mount = \"/\"\n",
            "qemu.volume_mount: \"/\" must be an absolute path below /",
        ),
        ("volume_mount = \"/my data\"\n", "may hold only letters"),
        ("volume_mount = \"/a/../etc\"\n", "may hold only letters"),
        ("volume_mount = \"/home\"\n", "is a system directory"),
        (
            "storage = \"volume\"\nbuilds_dir = \"/home/debian/builds\"\n",
            "qemu.builds_dir: \"/home/debian/builds\" is not on the data disk",
        ),
        (
            "storage = \"volume\"\nsuspend_mode = \"hibernate\"\n",
            "qemu.suspend_mode: \"hibernate\" cannot apply with storage = \"volume\"",
        ),
        (
            "storage = \"volume\"\ncache_dir = \"/dormantx/c\"\n",
            "qemu.cache_dir: \"/dormantx/c\" is not on the data disk",
        ),
    ] {
        let e = format!("{:#}", parse(extra).unwrap_err());
        assert!(e.contains(says), "{extra}: {e}");
    }
    // Outside volume mode builds_dir may be anywhere.
    parse("builds_dir = \"/home/debian/builds\"\n").unwrap();
}
