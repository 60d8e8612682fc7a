//! Unit tests of the `[ec2]` settings.

use super::*;
use crate::model::StorageMode;
use crate::settings::Settings;

fn problems(text: &str) -> String {
    match Settings::parse_str(text) {
        Ok(_) => String::new(),
        Err(e) => format!("{e:#}"),
    }
}

#[test]
fn selected_ec2_needs_subnet_and_image() {
    let text = problems("provider = \"ec2\"\n[ec2]\n");
    assert!(text.contains("ec2.subnet_id: required"), "{text}");
    assert!(text.contains("ec2.image: required"), "{text}");
    // Not selected: nothing required.
    assert_eq!(problems("[ec2]\n"), "");
}

#[test]
fn bad_values_name_their_key() {
    let text = problems(
        "[ec2]\nimage = \"debian-12-*\"\nendpoint_url = \"localhost\"\nconnect_address = \"nope\"\n\
         root_volume_type = \"ssd\"\ntags = { \"dormant:env\" = \"x\" }\nbuilds_dir = \"rel\"\n\
         allowed_instance_types = [\"t3 large\"]\n",
    );
    for needle in [
        "ec2.image_owners: required when ec2.image is a name pattern",
        "ec2.endpoint_url:",
        "ec2.connect_address:",
        "ec2.root_volume_type:",
        "ec2.tags:",
        "ec2.builds_dir:",
        "ec2.allowed_instance_types:",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in {text}");
    }
    let text = problems("[ec2]\naddress = \"elastic\"\n");
    assert!(text.contains("address"), "{text}");
}

#[test]
fn hibernation_needs_an_encrypted_root_volume_up_front() {
    let text = problems("[ec2]\nsuspend_mode = \"hibernate\"\n");
    assert!(
        text.contains("ec2.root_volume_encrypted: suspend_mode = \"hibernate\" needs an encrypted root volume"),
        "{text}"
    );
    assert!(text.contains("ec2.root_volume_size_gb:"), "{text}");
    assert_eq!(
        problems(
            "[ec2]\nsuspend_mode = \"hibernate\"\nroot_volume_encrypted = true\nroot_volume_size_gb = 30\n"
        ),
        ""
    );
}

#[test]
fn dirs_come_from_settings_alone() {
    let paths = EnvPaths::new(std::path::Path::new("/s"), uuid::Uuid::nil());
    let s = Ec2Settings::default();
    assert_eq!(
        s.dirs(&paths, StorageMode::Machine).unwrap().builds,
        "/home/admin/builds"
    );
    let s = Ec2Settings {
        ssh_user: "root".into(),
        cache_dir: Some("/cache".into()),
        ..Default::default()
    };
    let d = s.dirs(&paths, StorageMode::Machine).unwrap();
    assert_eq!(
        (d.builds.as_str(), d.cache.as_str()),
        ("/root/builds", "/cache")
    );
}

#[test]
fn the_shipped_example_documents_every_ec2_setting() {
    let text = include_str!("../../examples/dormant.toml");
    let section = text.split("\n[ec2]\n").nth(1).expect("an [ec2] section");
    // Up to the next table; a key is documented by a line of its own, set or
    // commented out (not by a longer key that ends with its name).
    let section = section.split("\n[").next().unwrap();
    let documented = |key: &str| {
        section
            .lines()
            .map(|l| l.trim_start_matches("# "))
            .any(|l| l.starts_with(&format!("{key} =")))
    };
    for key in [
        "region",
        "endpoint_url",
        "subnet_id",
        "subnet_ids",
        "security_group_ids",
        "instance_type",
        "fallback_instance_types",
        "allowed_instance_types",
        "market",
        "on_demand_fallback",
        "image",
        "image_owners",
        "allowed_images",
        "image_cache_ttl",
        "ssh_user",
        "ssh_port",
        "address",
        "connect_address",
        "root_volume_size_gb",
        "root_volume_type",
        "root_volume_encrypted",
        "root_volume_kms_key_id",
        "iam_instance_profile",
        "tags",
        "suspend_mode",
        "max_environments",
        "prepare_timeout",
        "builds_dir",
        "cache_dir",
        "storage",
        "volume_size_gb",
        "volume_type",
        "volume_encrypted",
        "volume_kms_key_id",
        "volume_mount",
    ] {
        assert!(
            documented(key),
            "examples/dormant.toml does not document ec2.{key}"
        );
    }
    // Uncommenting the required ones gives a valid ec2 configuration.
    let enabled = text
        .replace("provider = \"local\"", "provider = \"ec2\"")
        .replace("# subnet_id =", "subnet_id =")
        .replace("# image = ", "image = ")
        .replace("image_owners = []", "image_owners = [\"136693071363\"]");
    let s = Settings::parse_str(&enabled).unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(s.ec2.image.as_deref(), Some("debian-12-amd64-*"));
}

#[test]
fn ami_ids_and_host_ports() {
    assert!(is_ami_id("ami-0abc123"));
    assert!(!is_ami_id("ami-"));
    assert!(!is_ami_id("debian-12-*"));
    assert_eq!(
        parse_host_port("127.0.0.1:2222"),
        Some(("127.0.0.1".into(), 2222))
    );
    assert_eq!(parse_host_port("[::1]:22"), Some(("::1".into(), 22)));
    assert_eq!(parse_host_port("host"), None);
}

#[test]
fn subnet_ids_are_the_many_subnet_form_of_subnet_id() {
    let base = "provider = \"ec2\"\n[suspend]\nenabled = false\n[ec2]\nimage = \"ami-0abc\"\n";
    let s = Settings::parse_str(&format!(
        "{base}subnet_ids = [\"subnet-a\", \"subnet-b\"]\n"
    ))
    .unwrap();
    assert_eq!(s.ec2.subnets(), ["subnet-a", "subnet-b"]);
    let s = Settings::parse_str(&format!("{base}subnet_id = \"subnet-a\"\n")).unwrap();
    assert_eq!(s.ec2.subnets(), ["subnet-a"]);
    for (lines, needle) in [
        (
            "subnet_id = \"subnet-a\"\nsubnet_ids = [\"subnet-b\"]\n",
            "ec2.subnet_ids: set either subnet_id (one subnet) or subnet_ids (one per zone), not both",
        ),
        (
            "subnet_ids = [\"subnet-a\", \"subnet-a\"]\n",
            "ec2.subnet_ids: \"subnet-a\" is listed twice",
        ),
        ("subnet_ids = [\"subnet a\"]\n", "ec2.subnet_ids: \"subnet a\" is not a subnet id"),
        ("subnet_ids = []\n", "ec2.subnet_id: required"),
    ] {
        let text = problems(&format!("{base}{lines}"));
        assert!(text.contains(needle), "{lines:?}: want {needle:?} in {text}");
    }
    let many: Vec<String> = (0..=MAX_SUBNETS)
        .map(|i| format!("\"subnet-{i}\""))
        .collect();
    let text = problems(&format!("{base}subnet_ids = [{}]\n", many.join(", ")));
    assert!(
        text.contains("ec2.subnet_ids: 17 entries; at most 16"),
        "{text}"
    );
}

#[test]
fn instance_type_lists_are_checked() {
    for (lines, needle) in [
        (
            "fallback_instance_types = [\"t3a.medium\", \"t3a.medium\"]\n",
            "ec2.fallback_instance_types: \"t3a.medium\" is listed twice",
        ),
        (
            "fallback_instance_types = [\"t3.medium\"]\n",
            "ec2.fallback_instance_types: \"t3.medium\" is ec2.instance_type itself",
        ),
        (
            "fallback_instance_types = [\"\"]\n",
            "ec2.fallback_instance_types: \"\" is not an instance type",
        ),
        (
            "allowed_instance_types = [\"m5.large,m5a.large\"]\n",
            "ec2.allowed_instance_types: \"m5.large,m5a.large\" is not an instance type",
        ),
        ("instance_type = \"t3 medium\"\n", "ec2.instance_type:"),
    ] {
        let text = problems(&format!("[ec2]\n{lines}"));
        assert!(
            text.contains(needle),
            "{lines:?}: want {needle:?} in {text}"
        );
    }
    let many: Vec<String> = (0..=MAX_FALLBACK_TYPES)
        .map(|i| format!("\"m{i}.large\""))
        .collect();
    let text = problems(&format!(
        "[ec2]\nfallback_instance_types = [{}]\n",
        many.join(", ")
    ));
    assert!(
        text.contains("ec2.fallback_instance_types: 9 entries; at most 8"),
        "{text}"
    );
    let s =
        Settings::parse_str("[ec2]\nfallback_instance_types = [\"t3a.medium\", \"m5.large\"]\n")
            .unwrap();
    assert_eq!(s.ec2.fallback_instance_types, ["t3a.medium", "m5.large"]);
}

#[test]
fn spot_is_for_environments_that_do_not_live_on_the_instance() {
    let ec2 = "[ec2]\nsubnet_id = \"subnet-1\"\nimage = \"ami-0abc\"\n";
    assert_eq!(Settings::default().ec2.market, Market::OnDemand);
    assert!(!Settings::default().ec2.on_demand_fallback);
    // Machine mode with suspension on: a spot instance would take the environment with it.
    let text = problems(&format!("provider = \"ec2\"\n{ec2}market = \"spot\"\n"));
    assert!(
        text.contains("ec2.market: \"spot\" cannot hold a suspended environment in machine mode")
            && text.contains("ec2.storage = \"volume\"")
            && text.contains("suspend.enabled = false"),
        "{text}"
    );
    let s = Settings::parse_str(&format!(
        "provider = \"ec2\"\n[suspend]\nenabled = false\n{ec2}market = \"spot\"\non_demand_fallback = true\n"
    ))
    .unwrap();
    assert_eq!(
        (s.ec2.market, s.ec2.on_demand_fallback),
        (Market::Spot, true)
    );
    for (lines, needle) in [
        (
            "on_demand_fallback = true\n",
            "ec2.on_demand_fallback: only means something with market = \"spot\"",
        ),
        (
            "market = \"spot\"\nsuspend_mode = \"hibernate\"\nroot_volume_encrypted = true\nroot_volume_size_gb = 30\n",
            "ec2.suspend_mode: \"hibernate\" cannot be used with market = \"spot\"",
        ),
        ("market = \"reserved\"\n", "ec2.market"),
    ] {
        let text = problems(&format!("[ec2]\n{lines}"));
        assert!(text.contains(needle), "{lines:?}: want {needle:?} in {text}");
    }
}

#[test]
fn volume_mode_settings_have_defaults_and_bounds() {
    let s = Settings::default().ec2;
    assert_eq!(s.storage, StorageMode::Machine);
    assert_eq!(
        (
            s.volume_size_gb,
            s.volume_type.as_str(),
            s.volume_encrypted,
            s.volume_mount.as_str()
        ),
        (20, "gp3", true, "/dormant")
    );
    assert_eq!(s.volume_kms_key_id, None);
    for (lines, needle) in [
        ("volume_type = \"io2\"\n", "ec2.volume_type: \"io2\" is not one of gp3, gp2, st1, sc1, standard (io1 and io2 need provisioned IOPS"),
        ("volume_size_gb = 0\n", "ec2.volume_size_gb: 0 GiB is out of range: a gp3 volume is 1 to 16384 GiB"),
        ("volume_size_gb = 16385\n", "ec2.volume_size_gb: 16385 GiB is out of range"),
        ("volume_type = \"st1\"\nvolume_size_gb = 100\n", "ec2.volume_size_gb: 100 GiB is out of range: a st1 volume is 125 to 16384 GiB"),
        ("volume_encrypted = false\nvolume_kms_key_id = \"alias/k\"\n", "ec2.volume_kms_key_id: a KMS key encrypts the volume"),
        ("volume_mount = \"/etc\"\n", "ec2.volume_mount: \"/etc\" is a system directory"),
        ("volume_mount = \"rel\"\n", "ec2.volume_mount: \"rel\" must be an absolute path"),
        ("storage = \"volume\"\nbuilds_dir = \"/home/admin/builds\"\n", "ec2.builds_dir: \"/home/admin/builds\" is not on the data volume (ec2.volume_mount = \"/dormant\")"),
        ("storage = \"disk\"\n", "ec2.storage"),
    ] {
        let text = problems(&format!("[ec2]\n{lines}"));
        assert!(text.contains(needle), "{lines:?}: want {needle:?} in {text}");
    }
    // In volume mode the dirs are on the volume; a machine-mode environment keeps its own.
    let s = Settings::parse_str(
        "[ec2]\nstorage = \"volume\"\nvolume_mount = \"/data\"\ncache_dir = \"/data/c\"\n",
    )
    .unwrap()
    .ec2;
    let paths = EnvPaths::new(std::path::Path::new("/s"), uuid::Uuid::nil());
    let d = s.dirs(&paths, StorageMode::Volume).unwrap();
    assert_eq!(
        (d.builds.as_str(), d.cache.as_str()),
        ("/data/builds", "/data/c")
    );
    assert_eq!(
        s.dirs(&paths, StorageMode::Machine).unwrap().builds,
        "/home/admin/builds"
    );
}
