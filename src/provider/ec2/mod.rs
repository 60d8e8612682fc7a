//! The `ec2` provider: one EC2 instance per environment. Create-or-reclaim by
//! tags, capacity waits, suspend by stop (or hibernate), resume by start
//! (after checking the instance's tags), release by terminate.
//!
//! One concern per file: `client` (SDK config, retries off on purpose),
//! `call` (throttling/transient retries), `errors` (classification and hints
//! naming the setting or IAM permission), `instance` (describe, find by tag),
//! `image` (allow-list, name patterns, the cached resolution), `launch`
//! (RunInstances: tags, IMDSv2, user-data), `capacity` (`max_environments`,
//! capacity errors), `wait` (polling for a state).

pub mod call;
pub mod capacity;
pub mod client;
pub mod errors;
pub mod image;
pub mod instance;
pub mod launch;
pub mod wait;

use std::time::Duration;

use anyhow::{bail, Context, Result};
use async_trait::async_trait;
use aws_sdk_ec2::config::Credentials;
use aws_sdk_ec2::Client;

use self::call::call;
use self::capacity::{retry_capacity, Capacity};
use self::errors::{api_error, is_not_found};
use self::image::ImageResolver;
use self::instance::{tag, tag_filter, InstanceInfo};
use self::launch::LaunchRequest;
use self::wait::{wait_for, Want};
use super::{
    Machine, MachineGone, MachineSpec, MachineState, ManagedMachine, Provider, Refusal, SshTarget,
    Target,
};
use crate::context::Ctx;
use crate::settings::ec2::{
    parse_host_port, AddressKind, Ec2Settings, SuspendMode, INSTANCE_TYPE_VARIABLE,
};
use crate::settings::Settings;
use crate::state::StateStore;

/// Terminating what a failed prepare launched gets at most this long.
const ABANDON_BUDGET: Duration = Duration::from_secs(60);

/// Machine fields: where the instance is and whose it is (checked on resume).
mod field {
    pub const REGION: &str = "region";
    pub const ADDRESS: &str = "address";
    pub const PRIVATE_IP: &str = "private_ip";
    pub const PUBLIC_IP: &str = "public_ip";
    pub const ENV: &str = "env";
    pub const RUNNER: &str = "runner";
    pub const SYSTEM: &str = "system";
}

pub struct Ec2Provider {
    settings: Ec2Settings,
    /// The top-level prepare timeout, when `ec2.prepare_timeout` is unset.
    prepare_timeout: Duration,
    store: StateStore,
    system_id: String,
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

    /// The instance type: the job's pick through the allow-list, else the default.
    pub fn instance_type(&self, spec: &MachineSpec) -> Result<String, Refusal> {
        let asked = spec
            .variables
            .get(INSTANCE_TYPE_VARIABLE)
            .map(|s| s.trim())
            .filter(|s| !s.is_empty());
        let Some(asked) = asked else {
            return Ok(self.settings.instance_type.clone());
        };
        if self
            .settings
            .allowed_instance_types
            .iter()
            .any(|t| t == asked)
        {
            return Ok(asked.to_string());
        }
        if self.settings.allowed_instance_types.is_empty() {
            return Err(Refusal(format!(
                "the job asks for instance type {asked:?} ({INSTANCE_TYPE_VARIABLE}), but this runner's allow-list \
                 ec2.allowed_instance_types is empty: jobs run on {}; drop the variable or ask the runner's operator",
                self.settings.instance_type
            )));
        }
        Err(Refusal(format!(
            "the job asks for instance type {asked:?} ({INSTANCE_TYPE_VARIABLE}), which is not in this runner's \
             allow-list ec2.allowed_instance_types ({})",
            self.settings.allowed_instance_types.join(", ")
        )))
    }

    fn machine(&self, region: &str, info: &InstanceInfo) -> Result<Machine> {
        let address = match self.settings.address {
            AddressKind::Private => info.private_ip.clone(),
            AddressKind::Public => info.public_ip.clone(),
        };
        if address.is_none() && self.settings.connect_address.is_none() {
            bail!(
                "instance {} has no {} address: {}",
                info.id,
                match self.settings.address {
                    AddressKind::Private => "private",
                    AddressKind::Public => "public",
                },
                match self.settings.address {
                    AddressKind::Public =>
                        "the subnet in ec2.subnet_id does not assign public IPs; use a subnet \
                                            that does, or ec2.address = \"private\"",
                    AddressKind::Private => "check ec2.subnet_id",
                }
            );
        }
        let mut m = Machine::new(&info.id).with(field::REGION, region);
        for (k, v) in [
            (field::ADDRESS, address),
            (field::PRIVATE_IP, info.private_ip.clone()),
            (field::PUBLIC_IP, info.public_ip.clone()),
            (field::ENV, info.tag(tag::ENV).map(str::to_string)),
            (field::RUNNER, info.tag(tag::RUNNER).map(str::to_string)),
            (field::SYSTEM, info.tag(tag::SYSTEM).map(str::to_string)),
        ] {
            if let Some(v) = v {
                m = m.with(k, v);
            }
        }
        Ok(m)
    }

    /// Never act on an instance that is not this environment's: its `dormant:*`
    /// tags must match what the environment record says.
    fn verify_tags(&self, machine: &Machine, info: &InstanceInfo, doing: &str) -> Result<()> {
        let Some(env) = machine.field(field::ENV) else {
            bail!(
                "refusing to {doing} instance {}: the environment record names no environment for it",
                info.id
            );
        };
        for (tag_name, want) in [
            (tag::MANAGED_BY, Some(tag::MANAGED_BY_VALUE)),
            (tag::ENV, Some(env)),
            (tag::RUNNER, machine.field(field::RUNNER)),
            (tag::SYSTEM, machine.field(field::SYSTEM)),
        ] {
            let Some(want) = want else { continue };
            let have = info.tag(tag_name);
            if have != Some(want) {
                bail!(
                    "refusing to {doing} instance {}: its tag {tag_name} is {:?} but the environment record says {want:?}; \
                     the instance is not this environment's (was the instance id in the record changed?)",
                    info.id,
                    have.unwrap_or("(missing)")
                );
            }
        }
        Ok(())
    }

    async fn start_instance(&self, client: &Client, id: &str, ctx: &Ctx) -> Result<InstanceInfo> {
        retry_capacity(ctx, || async {
            call("StartInstances", ctx, || {
                client.start_instances().instance_ids(id).send()
            })
            .await
            .map(|_| ())
        })
        .await
        .with_context(|| format!("starting instance {id}"))?;
        wait_for(client, id, Want::Running, ctx).await
    }

    /// Brings an adopted or resumed instance to running, whatever its state.
    async fn bring_up(
        &self,
        client: &Client,
        info: InstanceInfo,
        ctx: &Ctx,
    ) -> Result<InstanceInfo> {
        match info.state {
            MachineState::Running => Ok(info),
            MachineState::Pending => wait_for(client, &info.id, Want::Running, ctx).await,
            MachineState::Stopped => self.start_instance(client, &info.id, ctx).await,
            MachineState::Stopping => {
                wait_for(client, &info.id, Want::Stopped, ctx).await?;
                self.start_instance(client, &info.id, ctx).await
            }
            MachineState::Gone => bail!("instance {} is {}", info.id, info.state_name),
            MachineState::Other(_) => wait_for(client, &info.id, Want::Running, ctx).await,
        }
    }

    async fn reclaim_or_launch(
        &self,
        client: &Client,
        region: &str,
        spec: &MachineSpec,
        instance_type: &str,
        image_request: &str,
        ctx: &Ctx,
    ) -> Result<Machine> {
        let mut found = instance::find(
            client,
            vec![
                tag_filter(tag::ENV, &spec.env_id.to_string()),
                tag_filter(tag::SYSTEM, &spec.system_id),
            ],
            ctx,
        )
        .await
        .context("looking for an instance an earlier attempt of this prepare made")?;
        found.sort_by_key(|i| (i.launched_at, i.id.clone()));
        let generation = found
            .iter()
            .filter(|i| i.state == MachineState::Gone)
            .count();
        let mut live = found.into_iter().filter(|i| i.state != MachineState::Gone);
        if let Some(first) = live.next() {
            ctx.log.info(format!(
                "adopting instance {} ({}) that an earlier attempt of this prepare launched",
                first.id, first.state_name
            ));
            for extra in live {
                ctx.log.warn(format!(
                    "terminating instance {}: a duplicate launch for environment {}",
                    extra.id, spec.env_id
                ));
                terminate(client, &extra.id, ctx).await?;
            }
            let info = self.bring_up(client, first, ctx).await?;
            return self.machine(region, &info);
        }

        let image = ImageResolver {
            store: &self.store,
            settings: &self.settings,
            region,
        }
        .resolve(client, image_request, ctx)
        .await?;
        let req = LaunchRequest {
            spec,
            settings: &self.settings,
            image: &image,
            instance_type,
            client_token: launch::client_token(spec, generation),
            user_data: launch::user_data(spec, &self.settings)?,
        };
        let cap = Capacity {
            client,
            store: &self.store,
            runner_id: &spec.runner_id,
            system_id: &spec.system_id,
            max: self.settings.max_environments,
        };
        let id = cap
            .launch_when_free(ctx, || launch::run_instance(client, &req, ctx))
            .await
            .with_context(|| {
                format!(
                    "launching a {instance_type} instance from {} in {} (subnet {})",
                    image.image_id,
                    region,
                    self.settings.subnet_id.as_deref().unwrap_or("?")
                )
            })?;
        ctx.log.info(format!(
            "launched instance {id} ({instance_type}, image {}{}) in {region}",
            image.image_id,
            image
                .name
                .as_deref()
                .map(|n| format!(" {n}"))
                .unwrap_or_default()
        ));
        let info = wait_for(client, &id, Want::Running, ctx).await?;
        self.machine(region, &info)
    }

    /// After a failed create: terminate whatever this environment launched (it
    /// is new, never suspended), so a failed prepare leaks no instance.
    async fn abandon(&self, client: &Client, spec: &MachineSpec, ctx: &Ctx) {
        // A fresh budget: the prepare's own deadline may be what just ran out, and
        // a termination signal must not stop the clean-up of what it launched.
        let ctx = Ctx::new(ctx.log.clone(), Default::default(), ABANDON_BUDGET);
        let found = instance::find(
            client,
            vec![
                tag_filter(tag::ENV, &spec.env_id.to_string()),
                tag_filter(tag::SYSTEM, &spec.system_id),
            ],
            &ctx,
        )
        .await;
        match found {
            Ok(list) => {
                for i in list.into_iter().filter(|i| i.state != MachineState::Gone) {
                    ctx.log.info(format!(
                        "terminating instance {} launched by this failed prepare",
                        i.id
                    ));
                    if let Err(e) = terminate(client, &i.id, &ctx).await {
                        ctx.log.warn(format!(
                            "could not terminate instance {}: {e:#}; `dormant sweep` lists it as an orphan",
                            i.id
                        ));
                    }
                }
            }
            Err(e) => tracing::debug!("looking for instances to abandon: {e:#}"),
        }
    }
}

async fn terminate(client: &Client, id: &str, ctx: &Ctx) -> Result<()> {
    match call("TerminateInstances", ctx, || {
        client.terminate_instances().instance_ids(id).send()
    })
    .await
    {
        Ok(_) => Ok(()),
        Err(e) if is_not_found(&e) => Ok(()),
        Err(e) => Err(e).with_context(|| format!("terminating instance {id}")),
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

    async fn create_or_reclaim(&self, spec: &MachineSpec, ctx: &Ctx) -> Result<Machine> {
        let ctx = self.bounded(ctx);
        // Allow-lists first: a refusal does not depend on what exists in EC2.
        let instance_type = self.instance_type(spec)?;
        let (image_request, note) = image::choose(&self.settings, spec.image.as_deref())?;
        if let Some(note) = note {
            ctx.log.warn(note);
        }
        let region = self.clients.default_region().await?;
        let client = self.clients.client(&region).await;
        let result = self
            .reclaim_or_launch(&client, &region, spec, &instance_type, &image_request, &ctx)
            .await;
        if result.is_err() {
            self.abandon(&client, spec, &ctx).await;
        }
        result
    }

    async fn start(&self, machine: &Machine, ctx: &Ctx) -> Result<Machine> {
        let ctx = self.bounded(ctx);
        let (client, region) = self.client_for(machine).await?;
        let id = &machine.id;
        let Some(info) = instance::describe(&client, id, &ctx).await? else {
            return Err(MachineGone(format!(
                "instance {id} no longer exists in {region}: the environment's disk is gone"
            ))
            .into());
        };
        self.verify_tags(machine, &info, "start")?;
        if info.state == MachineState::Gone {
            return Err(MachineGone(format!(
                "instance {id} is {}: the environment's disk is gone",
                info.state_name
            ))
            .into());
        }
        ctx.log
            .info(format!("starting instance {id} ({})", info.state_name));
        let info = self.bring_up(&client, info, &ctx).await?;
        let mut fresh = self.machine(&region, &info)?;
        // Keep what the record knew that the instance does not say.
        for (k, v) in &machine.fields {
            fresh.fields.entry(k.clone()).or_insert_with(|| v.clone());
        }
        Ok(fresh)
    }

    async fn stop(&self, machine: &Machine, ctx: &Ctx) -> Result<()> {
        let (client, region) = self.client_for(machine).await?;
        let id = &machine.id;
        let Some(info) = instance::describe(&client, id, ctx).await? else {
            bail!("instance {id} no longer exists in {region}: nothing to suspend");
        };
        self.verify_tags(machine, &info, "stop")?;
        match info.state {
            MachineState::Stopped => return Ok(()),
            MachineState::Stopping => {
                wait_for(&client, id, Want::Stopped, ctx).await?;
                return Ok(());
            }
            MachineState::Gone => bail!("instance {id} is {}: nothing to suspend", info.state_name),
            MachineState::Pending => {
                wait_for(&client, id, Want::Running, ctx).await?;
            }
            _ => {}
        }
        let hibernate = self.settings.suspend_mode == SuspendMode::Hibernate;
        ctx.log.info(format!(
            "{} instance {id}",
            if hibernate { "hibernating" } else { "stopping" }
        ));
        let stop = |hibernate: bool| {
            let client = &client;
            call("StopInstances", ctx, move || {
                client
                    .stop_instances()
                    .instance_ids(id)
                    .hibernate(hibernate)
                    .send()
            })
        };
        match stop(hibernate).await {
            Ok(_) => {}
            Err(e)
                if hibernate
                    && api_error(&e)
                        .and_then(|a| a.code.as_deref())
                        .is_some_and(|c| {
                            c == "UnsupportedHibernationConfiguration"
                                || c == "UnsupportedOperation"
                        }) =>
            {
                // The disk is what a suspended job needs; losing RAM is acceptable.
                ctx.log.warn(format!(
                    "instance {id} cannot hibernate ({e:#}); stopping it instead (disk kept, memory lost)"
                ));
                stop(false)
                    .await
                    .with_context(|| format!("stopping instance {id}"))?;
            }
            Err(e)
                if api_error(&e).and_then(|a| a.code.as_deref())
                    == Some("IncorrectInstanceState") =>
            {
                tracing::debug!("StopInstances on {id}: {e:#}; waiting for it to stop anyway");
            }
            Err(e) => return Err(e).with_context(|| format!("stopping instance {id}")),
        }
        wait_for(&client, id, Want::Stopped, ctx).await?;
        Ok(())
    }

    async fn delete(&self, machine: &Machine, ctx: &Ctx) -> Result<()> {
        let (client, region) = self.client_for(machine).await?;
        let id = &machine.id;
        let Some(info) = instance::describe(&client, id, ctx).await? else {
            ctx.log
                .info(format!("instance {id} is already gone from {region}"));
            return Ok(());
        };
        if info.state == MachineState::Gone {
            return Ok(());
        }
        self.verify_tags(machine, &info, "terminate")?;
        ctx.log.info(format!("terminating instance {id}"));
        terminate(&client, id, ctx).await
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
                    (field::RUNNER, tag::RUNNER),
                    (field::SYSTEM, tag::SYSTEM),
                ] {
                    if let Some(v) = i.tag(t) {
                        machine = machine.with(k, v);
                    }
                }
                ManagedMachine {
                    env_id: i.tag(tag::ENV).and_then(|e| uuid::Uuid::parse_str(e).ok()),
                    state: i.state.clone(),
                    launched_at: i.launched_at,
                    machine,
                }
            })
            .collect())
    }

    fn target(&self, machine: &Machine) -> Result<Target> {
        let (host, port) = match &self.settings.connect_address {
            Some(c) => parse_host_port(c)
                .with_context(|| format!("ec2.connect_address {c:?} is not host:port"))?,
            None => (
                machine
                    .field(field::ADDRESS)
                    .with_context(|| format!("instance {} has no recorded address", machine.id))?
                    .to_string(),
                self.settings.ssh_port,
            ),
        };
        Ok(Target::Ssh(SshTarget {
            host,
            port,
            user: self.settings.ssh_user.clone(),
            identity_file: None,
            workdir: None,
        }))
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
