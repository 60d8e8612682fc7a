//! Checks of the `[ec2]` settings (`Ec2Settings::validate`): every problem
//! as `ec2.key: problem`, reported all at once when dormant starts.

use super::ec2::*;
use crate::model::StorageMode;
use crate::text::quoted;

/// EBS volume types (`root_volume_type`).
const VOLUME_TYPES: &[&str] = &["gp3", "gp2", "io1", "io2", "st1", "sc1", "standard"];
/// The data volume's types: those whose performance comes with the size
/// (io1 and io2 would need provisioned IOPS).
const DATA_VOLUME_TYPES: &[&str] = &["gp3", "gp2", "st1", "sc1", "standard"];
/// The largest EBS volume of the types above (16 TiB).
const MAX_VOLUME_SIZE_GB: u32 = 16384;

impl Ec2Settings {
    /// `selected`: the `ec2` provider is the one in use, so its required settings must be there.
    pub fn validate(&self, selected: bool, problems: &mut Vec<String>) {
        let mut p = |key: &str, msg: String| problems.push(format!("ec2.{key}: {msg}"));
        if selected {
            if self.subnet_id.as_deref().is_none_or(str::is_empty) && self.subnet_ids.is_empty() {
                p(
                    "subnet_id",
                    "required with provider = \"ec2\": the subnet instances are launched in \
                     (or ec2.subnet_ids: one subnet per zone)"
                        .into(),
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
        self.validate_placement(&mut p);
        self.validate_warm(&mut p);
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
                } else if self.storage == StorageMode::Volume
                    && !super::mount_point::inside(d, &self.volume_mount)
                {
                    p(
                        key,
                        format!(
                            "{} is not on the data volume (ec2.volume_mount = {}): with storage = \"volume\" \
                             only what is on it is kept; leave it out or put it inside",
                            quoted(d),
                            quoted(&self.volume_mount)
                        ),
                    );
                }
            }
        }
        self.validate_volume(&mut p);
    }

    /// The data volume of volume mode. Checked whatever `storage` says: an
    /// environment made in volume mode stays in it after the setting changes.
    fn validate_volume(&self, p: &mut impl FnMut(&str, String)) {
        if !DATA_VOLUME_TYPES.contains(&self.volume_type.as_str()) {
            let why = if self.volume_type.starts_with("io") {
                " (io1 and io2 need provisioned IOPS, which dormant does not set: use gp3, whose IOPS come \
                 with the volume)"
            } else {
                ""
            };
            p(
                "volume_type",
                format!(
                    "{} is not one of {}{why}",
                    quoted(&self.volume_type),
                    DATA_VOLUME_TYPES.join(", ")
                ),
            );
        }
        let min = match self.volume_type.as_str() {
            // EBS's own minimum sizes of the HDD types.
            "st1" | "sc1" => 125,
            _ => 1,
        };
        if self.volume_size_gb < min || self.volume_size_gb > MAX_VOLUME_SIZE_GB {
            p(
                "volume_size_gb",
                format!(
                    "{} GiB is out of range: a {} volume is {min} to {MAX_VOLUME_SIZE_GB} GiB",
                    self.volume_size_gb, self.volume_type
                ),
            );
        }
        if self.volume_kms_key_id.is_some() && !self.volume_encrypted {
            p(
                "volume_kms_key_id",
                "a KMS key encrypts the volume: it needs volume_encrypted = true".into(),
            );
        }
        if self
            .volume_kms_key_id
            .as_deref()
            .is_some_and(|k| k.trim().is_empty())
        {
            p(
                "volume_kms_key_id",
                "must not be empty (leave it out for the account's EBS key)".into(),
            );
        }
        if let Some(problem) = super::mount_point::mount_problem(&self.volume_mount) {
            p("volume_mount", problem);
        }
    }

    /// Subnets, instance types and market.
    fn validate_placement(&self, p: &mut impl FnMut(&str, String)) {
        if self.subnet_id.is_some() && !self.subnet_ids.is_empty() {
            p(
                "subnet_ids",
                "set either subnet_id (one subnet) or subnet_ids (one per zone), not both".into(),
            );
        }
        if self
            .subnet_id
            .as_deref()
            .is_some_and(|s| s.trim().is_empty())
        {
            p("subnet_id", "must not be empty".into());
        }
        check_list(
            p,
            "subnet_ids",
            &self.subnet_ids,
            "a subnet id",
            MAX_SUBNETS,
        );
        if self.instance_type.trim().is_empty() || self.instance_type.contains(char::is_whitespace)
        {
            p(
                "instance_type",
                format!("{} is not an instance type", quoted(&self.instance_type)),
            );
        }
        check_list(
            p,
            "fallback_instance_types",
            &self.fallback_instance_types,
            "an instance type",
            MAX_FALLBACK_TYPES,
        );
        if self.fallback_instance_types.contains(&self.instance_type) {
            p(
                "fallback_instance_types",
                format!(
                    "{} is ec2.instance_type itself: list only the types to try after it",
                    quoted(&self.instance_type)
                ),
            );
        }
        for t in &self.allowed_instance_types {
            if t.trim().is_empty() || t.contains(char::is_whitespace) || t.contains(',') {
                p(
                    "allowed_instance_types",
                    format!("{} is not an instance type", quoted(t)),
                );
            }
        }
        if self.on_demand_fallback && self.market != Market::Spot {
            p(
                "on_demand_fallback",
                "only means something with market = \"spot\" (instances are on-demand already)"
                    .into(),
            );
        }
        if self.market == Market::Spot && self.suspend_mode == SuspendMode::Hibernate {
            p(
                "suspend_mode",
                "\"hibernate\" cannot be used with market = \"spot\": a spot instance is never stopped \
                 (EC2 may reclaim it at any time)"
                    .into(),
            );
        }
    }
}

/// Entries must be one word each, listed once, at most `max` of them.
fn check_list(
    p: &mut impl FnMut(&str, String),
    key: &str,
    list: &[String],
    what: &str,
    max: usize,
) {
    if list.len() > max {
        p(
            key,
            format!("{} entries; at most {max} are allowed", list.len()),
        );
    }
    for (i, v) in list.iter().enumerate() {
        if v.trim().is_empty() || v.contains(char::is_whitespace) || v.contains(',') {
            p(key, format!("{} is not {what}", quoted(v)));
        } else if list[..i].contains(v) {
            p(key, format!("{} is listed twice", quoted(v)));
        }
    }
}

impl Ec2Settings {
    /// `warm` and `warm_max_age` (docs/ec2.md, "Warm instances").
    fn validate_warm(&self, p: &mut impl FnMut(&str, String)) {
        let zones = self.subnets().len().max(1) as u32;
        if self.warm > MAX_WARM {
            p(
                "warm",
                format!(
                    "{} is more than {MAX_WARM} warm instances per zone",
                    self.warm
                ),
            );
        } else if self.max_environments > 0 && self.warm * zones >= self.max_environments {
            p(
                "warm",
                format!(
                    "{} warm instances in each of {zones} zone(s) leave no room for a job's own instance under \
                     max_environments = {}: set warm below max_environments / zones",
                    self.warm, self.max_environments
                ),
            );
        }
        if self.warm_max_age.get() < MIN_WARM_AGE {
            p(
                "warm_max_age",
                format!(
                    "{} is less than 10m: a warm instance must live long enough to boot and be taken",
                    self.warm_max_age
                ),
            );
        }
    }
}
