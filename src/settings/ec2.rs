//! `[ec2]`: the EC2 provider's settings. Everything that could let a job escape
//! the operator's intent (AMI, instance type, subnet) comes from here, or from
//! the job only through an allow-list. `examples/dormant.toml` documents each
//! key with its default; `validate` reports every problem as `ec2.key: problem`.

use std::collections::BTreeMap;

use anyhow::Result;
use serde::Deserialize;

use super::HumanDuration;
use crate::model::Dirs;
use crate::model::EnvPaths;
use crate::text::quoted;

/// The job variable through which a job picks an instance type from `allowed_instance_types`.
pub const INSTANCE_TYPE_VARIABLE: &str = "DORMANT_EC2_INSTANCE_TYPE";

#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct Ec2Settings {
    /// AWS region; else the standard AWS chain (`AWS_REGION`, profile, IMDS).
    pub region: Option<String>,
    /// Another EC2 endpoint (an emulator in tests, a VPC endpoint).
    pub endpoint_url: Option<String>,
    /// Subnet the instances are launched in (required).
    pub subnet_id: Option<String>,
    /// Security groups of the instances; empty: the VPC's default group.
    pub security_group_ids: Vec<String>,
    /// Instance type when the job does not pick one.
    pub instance_type: String,
    /// Instance types a job may pick through `DORMANT_EC2_INSTANCE_TYPE`.
    pub allowed_instance_types: Vec<String>,
    /// AMI id (`ami-...`) or AMI name pattern (`debian-12-amd64-*`, newest match).
    pub image: Option<String>,
    /// Owners a name pattern is looked up in (`self`, `amazon`, an account id).
    pub image_owners: Vec<String>,
    /// AMI ids or name patterns the job's `image:` may name.
    pub allowed_images: Vec<String>,
    /// How long a name pattern's resolution is reused before it is looked up again.
    pub image_cache_ttl: HumanDuration,
    /// The image's cloud-init default user; the environment's key is installed for it.
    pub ssh_user: String,
    pub ssh_port: u16,
    /// Which instance address to connect to.
    pub address: AddressKind,
    /// Connect here (`host:port`) instead of the instance's address: an SSM or
    /// port-forward tunnel, or a test sshd in front of an emulator.
    pub connect_address: Option<String>,
    /// Root volume size in GiB; unset: the AMI's.
    pub root_volume_size_gb: Option<u32>,
    /// Root volume type (gp3, gp2, io1, io2, st1, sc1, standard).
    pub root_volume_type: Option<String>,
    /// Encrypt the root volume; unset: the AMI's / the account's default.
    pub root_volume_encrypted: Option<bool>,
    /// KMS key for the root volume; unset: the account's EBS default key.
    pub root_volume_kms_key_id: Option<String>,
    /// IAM instance profile (name or ARN) given to the instances.
    pub iam_instance_profile: Option<String>,
    /// Extra tags on instances and volumes (names starting with `dormant:` are reserved).
    pub tags: BTreeMap<String, String>,
    /// What suspending does: stop (disk kept) or hibernate (disk and RAM kept).
    pub suspend_mode: SuspendMode,
    /// Running plus suspended instances of this runner; 0: no limit.
    pub max_environments: u32,
    /// Bound on the EC2 part of a prepare (capacity waits, launch, start);
    /// unset: the top-level `prepare_timeout`.
    pub prepare_timeout: Option<HumanDuration>,
    /// builds_dir inside the instance; default `<home of ssh_user>/builds`.
    pub builds_dir: Option<String>,
    /// cache_dir inside the instance; default `<home of ssh_user>/cache`.
    pub cache_dir: Option<String>,
}

impl Default for Ec2Settings {
    fn default() -> Self {
        Ec2Settings {
            region: None,
            endpoint_url: None,
            subnet_id: None,
            security_group_ids: Vec::new(),
            instance_type: "t3.medium".into(),
            allowed_instance_types: Vec::new(),
            image: None,
            image_owners: Vec::new(),
            allowed_images: Vec::new(),
            image_cache_ttl: HumanDuration::from_secs(3600),
            ssh_user: "admin".into(),
            ssh_port: 22,
            address: AddressKind::Private,
            connect_address: None,
            root_volume_size_gb: None,
            root_volume_type: None,
            root_volume_encrypted: None,
            root_volume_kms_key_id: None,
            iam_instance_profile: None,
            tags: BTreeMap::new(),
            suspend_mode: SuspendMode::Stop,
            max_environments: 0,
            prepare_timeout: None,
            builds_dir: None,
            cache_dir: None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum AddressKind {
    #[default]
    Private,
    Public,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum SuspendMode {
    #[default]
    Stop,
    Hibernate,
}

const VOLUME_TYPES: &[&str] = &["gp3", "gp2", "io1", "io2", "st1", "sc1", "standard"];

/// `ami-` followed by hex: an id, not a name pattern.
pub fn is_ami_id(s: &str) -> bool {
    s.strip_prefix("ami-")
        .is_some_and(|h| !h.is_empty() && h.chars().all(|c| c.is_ascii_hexdigit()))
}

/// `host:port` with a port number.
pub fn parse_host_port(s: &str) -> Option<(String, u16)> {
    let (host, port) = s.rsplit_once(':')?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        return None;
    }
    Some((host.to_string(), port.parse().ok()?))
}

impl Ec2Settings {
    /// `selected`: the `ec2` provider is the one in use, so its required settings must be there.
    pub fn validate(&self, selected: bool, problems: &mut Vec<String>) {
        let mut p = |key: &str, msg: String| problems.push(format!("ec2.{key}: {msg}"));
        if selected {
            if self.subnet_id.as_deref().is_none_or(str::is_empty) {
                p(
                    "subnet_id",
                    "required with provider = \"ec2\": the subnet instances are launched in".into(),
                );
            }
            if self.image.as_deref().is_none_or(str::is_empty) {
                p(
                    "image",
                    "required with provider = \"ec2\": an AMI id (ami-...) or an AMI name pattern"
                        .into(),
                );
            }
        }
        if let Some(image) = &self.image {
            if !is_ami_id(image) && !image.is_empty() && self.image_owners.is_empty() {
                p(
                    "image_owners",
                    format!(
                        "required when ec2.image is a name pattern ({}): any AWS account can publish \
                         an AMI under any name; say whose images to trust, e.g. [\"self\"] or an account id",
                        quoted(image)
                    ),
                );
            }
        }
        if self.allowed_images.iter().any(|i| !is_ami_id(i)) && self.image_owners.is_empty() {
            p(
                "image_owners",
                "required when ec2.allowed_images holds name patterns: say whose images to trust"
                    .into(),
            );
        }
        if self.instance_type.trim().is_empty() {
            p("instance_type", "must not be empty".into());
        }
        for t in &self.allowed_instance_types {
            if t.trim().is_empty() || t.contains(char::is_whitespace) {
                p(
                    "allowed_instance_types",
                    format!("{} is not an instance type", quoted(t)),
                );
            }
        }
        if let Some(e) = &self.endpoint_url {
            if !(e.starts_with("http://") || e.starts_with("https://")) {
                p(
                    "endpoint_url",
                    format!(
                        "{} must be a URL starting with http:// or https://",
                        quoted(e)
                    ),
                );
            }
        }
        if let Some(c) = &self.connect_address {
            if parse_host_port(c).is_none() {
                p(
                    "connect_address",
                    format!("{} must be host:port, e.g. \"127.0.0.1:2222\"", quoted(c)),
                );
            }
        }
        if self.ssh_user.trim().is_empty() {
            p("ssh_user", "must not be empty".into());
        }
        if self.ssh_port == 0 {
            p("ssh_port", "must not be 0".into());
        }
        if let Some(t) = &self.root_volume_type {
            if !VOLUME_TYPES.contains(&t.as_str()) {
                p(
                    "root_volume_type",
                    format!("{} is not one of {}", quoted(t), VOLUME_TYPES.join(", ")),
                );
            }
        }
        if self.root_volume_size_gb == Some(0) {
            p(
                "root_volume_size_gb",
                "must be more than 0 (leave it out for the AMI's size)".into(),
            );
        }
        if self.suspend_mode == SuspendMode::Hibernate {
            if self.root_volume_encrypted != Some(true) {
                p(
                    "root_volume_encrypted",
                    "suspend_mode = \"hibernate\" needs an encrypted root volume: set root_volume_encrypted = true \
                     (and a root_volume_size_gb that holds the AMI plus the instance's RAM)"
                        .into(),
                );
            }
            if self.root_volume_size_gb.is_none() {
                p(
                    "root_volume_size_gb",
                    "suspend_mode = \"hibernate\" writes the instance's RAM to the root volume: set a size \
                     that holds the AMI plus the RAM of the largest allowed instance type"
                        .into(),
                );
            }
        }
        for k in self.tags.keys() {
            if k.starts_with("dormant:") || k.starts_with("aws:") || k == "Name" {
                p(
                    "tags",
                    format!(
                        "{} is reserved (dormant sets Name and dormant:* itself; aws:* is AWS's)",
                        quoted(k)
                    ),
                );
            }
        }
        for (key, dir) in [
            ("builds_dir", &self.builds_dir),
            ("cache_dir", &self.cache_dir),
        ] {
            if let Some(d) = dir {
                if !d.starts_with('/') {
                    p(
                        key,
                        format!("{} must be an absolute path inside the instance", quoted(d)),
                    );
                }
            }
        }
    }

    /// builds_dir / cache_dir for config (no I/O): every instance has its own
    /// disk, so the same paths serve every environment.
    pub fn dirs(&self, _paths: &EnvPaths) -> Result<Dirs> {
        Ok(super::own_disk_dirs(
            &self.ssh_user,
            self.builds_dir.as_deref(),
            self.cache_dir.as_deref(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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
        assert_eq!(s.dirs(&paths).unwrap().builds, "/home/admin/builds");
        let s = Ec2Settings {
            ssh_user: "root".into(),
            cache_dir: Some("/cache".into()),
            ..Default::default()
        };
        let d = s.dirs(&paths).unwrap();
        assert_eq!(
            (d.builds.as_str(), d.cache.as_str()),
            ("/root/builds", "/cache")
        );
    }

    #[test]
    fn the_shipped_example_documents_every_ec2_setting() {
        let text = include_str!("../../examples/dormant.toml");
        let section = text.split("\n[ec2]\n").nth(1).expect("an [ec2] section");
        for key in [
            "region",
            "endpoint_url",
            "subnet_id",
            "security_group_ids",
            "instance_type",
            "allowed_instance_types",
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
        ] {
            assert!(
                section.contains(&format!("{key} =")),
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
}
