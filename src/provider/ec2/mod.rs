//! The `ec2` provider: one EC2 instance per environment. Create-or-reclaim by
//! tags, capacity waits, suspend by stop (or hibernate), resume by start
//! (after checking the instance's tags), release by terminate.
//!
//! One concern per file: `create` (adopt or launch), `lifecycle` (resume,
//! suspend, release), `machine` (recorded fields, tag checks, SSH target),
//! `client` (SDK config, retries off on purpose),
//! `call` (throttling/transient retries), `errors` (classification and hints
//! naming the setting or IAM permission), `instance` (describe, find by tag),
//! `image` (allow-list, name patterns, the cached resolution), `launch`
//! (RunInstances: tags, IMDSv2, user-data, market), `placement` (the ordered
//! instance type × subnet × market choices and one round of trying them),
//! `subnets` (the zones of `subnet_ids`), `capacity` (`max_environments`,
//! capacity errors), `retype` (a resume that changes the instance type when
//! the current one has no capacity), `volume` (the EBS calls of a data
//! volume and their waits), `volumes` (volume mode: the `Volumes` side),
//! `volumes_find` (finding a data volume and checking it is this host's to
//! act on), `guest_seam` (the tests' stand-in for the guest's block device),
//! `wait` (polling for an instance's state), `handover` (the tags a
//! replacement runner-manager host takes an environment over with, and the
//! boot hook that lets it in), `takeover` (what `dormant adopt` finds in
//! EC2), `takeover_write` (the tag write that takes an environment over),
//! `warm` (warm instances: the `WarmMachines` side), `warm_launch` (what a
//! warm instance is launched as).

pub mod call;
pub mod capacity;
pub mod client;
mod create;
pub mod errors;
pub mod guest_seam;
pub mod handover;
pub mod image;
pub mod instance;
pub mod kept;
pub mod launch;
mod lifecycle;
mod machine;
pub mod placement;
mod retype;
pub mod subnets;
pub mod takeover;
pub mod takeover_write;
pub mod volume;
mod volumes;
mod volumes_find;
pub mod wait;
mod warm;
mod warm_launch;

use std::time::Duration;

use anyhow::{Context, Result};
use async_trait::async_trait;
use aws_sdk_ec2::config::Credentials;
use aws_sdk_ec2::Client;

use self::instance::{tag, tag_filter};
use super::{
    Machine, MachineSpec, MachineState, ManagedMachine, Provider, StorageMode, Suspended, Target,
    Volumes,
};
use crate::context::Ctx;
use crate::settings::ec2::Ec2Settings;
use crate::settings::Settings;
use crate::state::StateStore;

/// Machine fields: where the instance is and whose it is (checked on resume).
mod field {
    pub const REGION: &str = "region";
    pub const ADDRESS: &str = "address";
    pub const PRIVATE_IP: &str = "private_ip";
    pub const PUBLIC_IP: &str = "public_ip";
    pub const ENV: &str = "env";
    pub const RUNNER: &str = "runner";
    pub const SYSTEM: &str = "system";
    /// The instance's zone, type and market, as EC2 last described it.
    pub const ZONE: &str = "zone";
    pub const INSTANCE_TYPE: &str = "instance_type";
    pub const MARKET: &str = "market";
    /// The instance types this environment may run on, in order (its
    /// creator's choice), comma-separated: a resume without capacity for the
    /// current one tries the others.
    pub const INSTANCE_TYPES: &str = "instance_types";
    /// The ownership epoch the instance carried when this record last took
    /// it (`handover.rs`).
    pub const EPOCH: &str = "epoch";
    /// A warm instance's pool id (`list`: one no environment has taken).
    pub const WARM: &str = "warm";
    /// The size of the root EBS volume it was launched with, GiB (the
    /// setting, else the image's): what it keeps while stopped (`kept.rs`).
    pub const ROOT_GIB: &str = "root_gib";
}

/// The field of a record's machine (and data volume) that holds the
/// ownership epoch the record took it with (`handover.rs`).
pub const EPOCH_FIELD: &str = field::EPOCH;

pub struct Ec2Provider {
    settings: Ec2Settings,
    /// The top-level prepare timeout, when `ec2.prepare_timeout` is unset.
    prepare_timeout: Duration,
    store: StateStore,
    system_id: String,
    /// The top-level `runner_id`, if set: warm instances, made outside any
    /// job, count toward this runner's `max_environments`.
    runner_id: Option<String>,
    clients: client::Clients,
}

impl Ec2Provider {
    pub fn new(settings: &Settings, store: &StateStore) -> Result<Self> {
        Self::build(settings, store, None)
    }

    /// With fixed credentials instead of the AWS chain (tests against an emulator).
    pub fn with_credentials(
        settings: &Settings,
        store: &StateStore,
        access_key: &str,
        secret_key: &str,
    ) -> Result<Self> {
        let creds = Credentials::new(access_key, secret_key, None, None, "dormant-static");
        Self::build(settings, store, Some(creds))
    }

    fn build(settings: &Settings, store: &StateStore, creds: Option<Credentials>) -> Result<Self> {
        Ok(Ec2Provider {
            settings: settings.ec2.clone(),
            prepare_timeout: settings.prepare_timeout.get(),
            store: store.clone(),
            system_id: crate::identity::system_id(settings, store)?,
            runner_id: settings
                .runner_id
                .as_deref()
                .map(str::trim)
                .filter(|r| !r.is_empty())
                .map(str::to_string),
            clients: client::Clients::new(&settings.ec2, creds),
        })
    }

    fn bounded(&self, ctx: &Ctx) -> Ctx {
        ctx.within(
            self.settings
                .prepare_timeout
                .map(|t| t.get())
                .unwrap_or(self.prepare_timeout),
        )
    }

    async fn client_for(&self, machine: &Machine) -> Result<(Client, String)> {
        let region = match machine.field(field::REGION) {
            Some(r) => r.to_string(),
            None => self.clients.default_region().await?,
        };
        Ok((self.clients.client(&region).await, region))
    }
}

#[async_trait]
impl Provider for Ec2Provider {
    fn name(&self) -> &'static str {
        "ec2"
    }

    fn needs_ssh_key(&self) -> bool {
        true
    }

    fn storage(&self) -> StorageMode {
        self.settings.storage
    }

    /// Always: environments made in volume mode stay resumable after the
    /// setting goes back to `machine`.
    fn volumes(&self) -> Option<&dyn Volumes> {
        Some(self)
    }

    /// While `warm` > 0, and after it went back to 0 while the pool still
    /// has entries (the sweep retires them).
    fn warm(&self) -> Option<&dyn super::warm::WarmMachines> {
        (self.settings.warm > 0 || self.store.root().join("warm").exists()).then_some(self)
    }

    async fn create_or_reclaim(&self, spec: &MachineSpec, ctx: &Ctx) -> Result<Machine> {
        self.create(spec, ctx).await
    }

    async fn start(&self, machine: &Machine, ctx: &Ctx) -> Result<Machine> {
        self.resume(machine, ctx).await
    }

    async fn stop(&self, machine: &Machine, ctx: &Ctx) -> Result<Suspended> {
        self.suspend(machine, ctx).await
    }

    async fn delete(&self, machine: &Machine, ctx: &Ctx) -> Result<()> {
        self.release(machine, ctx).await
    }

    async fn describe(&self, machine: &Machine, ctx: &Ctx) -> Result<MachineState> {
        let (client, _) = self.client_for(machine).await?;
        Ok(instance::describe(&client, &machine.id, ctx)
            .await?
            .map(|i| i.state)
            .unwrap_or(MachineState::Gone))
    }

    async fn list(&self, ctx: &Ctx) -> Result<Vec<ManagedMachine>> {
        let region = self.clients.default_region().await?;
        let client = self.clients.client(&region).await;
        let found = instance::find(
            &client,
            vec![
                tag_filter(tag::MANAGED_BY, tag::MANAGED_BY_VALUE),
                tag_filter(tag::SYSTEM, &self.system_id),
                instance::filter("instance-state-name", instance::LIVE_STATES),
            ],
            ctx,
        )
        .await
        .with_context(|| format!("listing this runner manager's instances in {region}"))?;
        Ok(found
            .into_iter()
            .map(|i| {
                let mut machine = Machine::new(&i.id).with(field::REGION, &region);
                for (k, t) in [
                    (field::ENV, tag::ENV),
                    (field::WARM, tag::WARM),
                    (field::RUNNER, tag::RUNNER),
                    (field::SYSTEM, tag::SYSTEM),
                ] {
                    if let Some(v) = i.tag(t) {
                        machine = machine.with(k, v);
                    }
                }
                let env_id = i.tag(tag::ENV).and_then(|e| uuid::Uuid::parse_str(e).ok());
                ManagedMachine {
                    // An instance with an environment's tag is the
                    // environment's, even mid-hand-over (both tags).
                    warm: i
                        .tag(tag::WARM)
                        .and_then(|w| uuid::Uuid::parse_str(w).ok())
                        .filter(|_| env_id.is_none()),
                    env_id,
                    state: i.state.clone(),
                    launched_at: i.launched_at,
                    machine,
                }
            })
            .collect())
    }

    async fn keep_host_key(&self, machine: &Machine, known_hosts: &str, ctx: &Ctx) -> Result<()> {
        let Some(key) = handover::pinned_host_key(known_hosts) else {
            anyhow::bail!(
                "the host key pinned for instance {} is not one key short enough for the {} tag",
                machine.id,
                handover::tag::HOST_KEY
            );
        };
        let (client, _) = self.client_for(machine).await?;
        handover::set_tags(&client, &machine.id, &[(handover::tag::HOST_KEY, key)], ctx).await
    }

    fn target(&self, machine: &Machine) -> Result<Target> {
        Ok(Target::Ssh(self.ssh_target(machine)?))
    }

    fn key_fields(&self, machine: &Machine) -> Vec<(String, String)> {
        let mut f = vec![("instance".to_string(), machine.id.clone())];
        if let Some(r) = machine.field(field::REGION) {
            f.push(("region".into(), r.to_string()));
        }
        f
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::ec2::INSTANCE_TYPE_VARIABLE;

    fn provider(extra: &str) -> (tempfile::TempDir, Ec2Provider) {
        let dir = tempfile::tempdir().unwrap();
        let store = StateStore::open(&dir.path().join("s")).unwrap();
        let settings = Settings::parse_str(&format!(
            "provider = \"ec2\"\nsystem_id = \"s_test\"\n[ec2]\nregion = \"us-east-1\"\nsubnet_id = \"subnet-1\"\n\
             image = \"ami-0abc\"\n{extra}"
        ))
        .unwrap();
        let p = Ec2Provider::new(&settings, &store).unwrap();
        (dir, p)
    }

    fn spec(vars: &[(&str, &str)]) -> MachineSpec {
        let id = uuid::Uuid::new_v4();
        MachineSpec {
            env_id: id,
            name: MachineSpec::machine_name(id),
            runner_id: "1".into(),
            system_id: "s_test".into(),
            project_id: 5,
            job_id: 7,
            image: None,
            variables: vars
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            ssh_public_key: Some("ssh-ed25519 AAAA test".into()),
            paths: crate::state::EnvPaths::new(std::path::Path::new("/s"), id),
            volume: None,
        }
    }

    #[test]
    fn instance_type_goes_through_the_allow_list() {
        let (_d, p) = provider("allowed_instance_types = [\"t3.large\"]\n");
        assert_eq!(p.instance_type(&spec(&[])).unwrap(), "t3.medium");
        assert_eq!(
            p.instance_type(&spec(&[(INSTANCE_TYPE_VARIABLE, "t3.large")]))
                .unwrap(),
            "t3.large"
        );
        let r = p
            .instance_type(&spec(&[(INSTANCE_TYPE_VARIABLE, "p5.48xlarge")]))
            .unwrap_err();
        assert!(r.0.contains("ec2.allowed_instance_types (t3.large)"), "{r}");
        let (_d, p) = provider("");
        let r = p
            .instance_type(&spec(&[(INSTANCE_TYPE_VARIABLE, "t3.large")]))
            .unwrap_err();
        assert!(r.0.contains("ec2.allowed_instance_types is empty"), "{r}");
    }

    #[test]
    fn target_honours_connect_address() {
        let (_d, p) = provider("connect_address = \"127.0.0.1:2222\"\nssh_user = \"root\"\n");
        let m = Machine::new("i-1").with(field::ADDRESS, "10.0.0.5");
        let Target::Ssh(t) = p.target(&m).unwrap() else {
            panic!()
        };
        assert_eq!(
            (t.host.as_str(), t.port, t.user.as_str()),
            ("127.0.0.1", 2222, "root")
        );
        let (_d, p) = provider("");
        let Target::Ssh(t) = p.target(&m).unwrap() else {
            panic!()
        };
        assert_eq!((t.host.as_str(), t.port), ("10.0.0.5", 22));
        assert_eq!(t.identity_file, None);
    }

    #[test]
    fn user_data_carries_the_public_key() {
        let (_d, p) = provider("");
        let ud = launch::user_data(&spec(&[]), &p.settings).unwrap();
        let text = String::from_utf8(aws_smithy_types::base64::decode(ud).unwrap()).unwrap();
        assert!(text.starts_with("#cloud-config\n"), "{text}");
        assert!(text.contains("  - ssh-ed25519 AAAA test\n"), "{text}");
        let mut bad = spec(&[]);
        bad.ssh_public_key = Some("ssh-ed25519 A\nruncmd: [evil]".into());
        assert!(launch::user_data(&bad, &p.settings).is_err());
    }
}
