//! `[ec2]`: the EC2 provider's settings. Everything that could let a job escape
//! the operator's intent (AMI, instance type, subnet) comes from here, or from
//! the job only through an allow-list. `examples/dormant.toml` documents each
//! key with its default; `validate` reports every problem as `ec2.key: problem`.

use std::collections::BTreeMap;

use anyhow::Result;
use serde::Deserialize;

use super::HumanDuration;
use crate::model::{Dirs, EnvPaths, StorageMode};

/// At most this many warm instances per zone (each is billed while it waits).
pub const MAX_WARM: u32 = 16;
/// A warm instance must live long enough to boot and be taken.
pub const MIN_WARM_AGE: std::time::Duration = std::time::Duration::from_secs(600);

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
    /// Warm instances kept running in each zone of `subnet_ids`, ready for a
    /// new environment (docs/ec2.md, "Warm instances"); 0: none.
    pub warm: u32,
    /// A warm instance older than this is retired and replaced.
    pub warm_max_age: HumanDuration,
    /// builds_dir inside the instance; default `<home of ssh_user>/builds`.
    pub builds_dir: Option<String>,
    /// cache_dir inside the instance; default `<home of ssh_user>/cache`.
    pub cache_dir: Option<String>,
    /// "machine": suspend stops (or hibernates) the instance, its disks kept.
    /// "volume": the builds and cache dirs live on a data volume (EBS) of
    /// their own; suspend terminates the instance and keeps the volume.
    pub storage: StorageMode,
    /// Volume mode: the data volume's size in GiB.
    pub volume_size_gb: u32,
    /// Volume mode: the data volume's EBS type.
    pub volume_type: String,
    /// Volume mode: encrypt the data volume.
    pub volume_encrypted: bool,
    /// Volume mode: KMS key of the data volume; unset: the account's EBS default key.
    pub volume_kms_key_id: Option<String>,
    /// Volume mode: where the data volume is mounted in the instance.
    pub volume_mount: String,
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
            warm: 0,
            warm_max_age: HumanDuration::from_secs(6 * 3600),
            builds_dir: None,
            cache_dir: None,
            storage: StorageMode::Machine,
            volume_size_gb: DEFAULT_VOLUME_SIZE_GB,
            volume_type: "gp3".into(),
            volume_encrypted: true,
            volume_kms_key_id: None,
            volume_mount: DEFAULT_VOLUME_MOUNT.into(),
        }
    }
}

pub const DEFAULT_VOLUME_SIZE_GB: u32 = 20;
pub const DEFAULT_VOLUME_MOUNT: &str = "/dormant";

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
    /// The subnets a new environment may start in, in the order they are tried.
    pub fn subnets(&self) -> Vec<String> {
        match &self.subnet_id {
            Some(s) => vec![s.clone()],
            None => self.subnet_ids.clone(),
        }
    }

    /// builds_dir / cache_dir for config (no I/O): the same paths serve
    /// every environment of a storage mode — on the instance's own disk, or
    /// (volume mode) on the data volume mounted at `volume_mount`.
    pub fn dirs(&self, _paths: &EnvPaths, storage: StorageMode) -> Result<Dirs> {
        Ok(super::own_machine_dirs(
            &self.ssh_user,
            self.builds_dir.as_deref(),
            self.cache_dir.as_deref(),
            storage,
            &self.volume_mount,
        ))
    }
}

#[cfg(test)]
#[path = "ec2_tests.rs"]
mod tests;
