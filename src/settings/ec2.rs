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
    /// The one subnet instances are launched in (or `subnet_ids`).
    pub subnet_id: Option<String>,
    /// Several subnets, one per zone, tried in this order (or `subnet_id`).
    pub subnet_ids: Vec<String>,
    /// Security groups of the instances; empty: the VPC's default group.
    pub security_group_ids: Vec<String>,
    /// Instance type when the job does not pick one.
    pub instance_type: String,
    /// Tried in this order after `instance_type` when it has no capacity.
    pub fallback_instance_types: Vec<String>,
    /// Instance types a job may pick through `DORMANT_EC2_INSTANCE_TYPE`.
    pub allowed_instance_types: Vec<String>,
    /// On-demand or spot instances.
    pub market: Market,
    /// With spot: launch on-demand when no spot capacity is found anywhere.
    pub on_demand_fallback: bool,
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
            subnet_ids: Vec::new(),
            security_group_ids: Vec::new(),
            instance_type: "t3.medium".into(),
            fallback_instance_types: Vec::new(),
            allowed_instance_types: Vec::new(),
            market: Market::OnDemand,
            on_demand_fallback: false,
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

/// Which EC2 market instances are bought in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
pub enum Market {
    #[default]
    #[serde(rename = "on-demand")]
    OnDemand,
    /// 60–90 % cheaper; EC2 may reclaim the instance at any time.
    #[serde(rename = "spot")]
    Spot,
}

impl Market {
    pub fn as_str(self) -> &'static str {
        match self {
            Market::OnDemand => "on-demand",
            Market::Spot => "spot",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum SuspendMode {
    #[default]
    Stop,
    Hibernate,
}

/// `subnet_ids` holds one subnet per zone: a region has at most six zones,
/// plus its local zones; more entries than this is a mistake.
pub const MAX_SUBNETS: usize = 16;
/// Every capacity round tries each instance type in each subnet (and market):
/// this many fallbacks keeps a round to a few dozen RunInstances calls.
pub const MAX_FALLBACK_TYPES: usize = 8;

const VOLUME_TYPES: &[&str] = &["gp3", "gp2", "io1", "io2", "st1", "sc1", "standard"];

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

    /// The subnets a new environment may start in, in the order they are tried.
    pub fn subnets(&self) -> Vec<String> {
        match &self.subnet_id {
            Some(s) => vec![s.clone()],
            None => self.subnet_ids.clone(),
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
#[path = "ec2_tests.rs"]
mod tests;
