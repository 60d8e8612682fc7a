//! What dormant records about an instance (the `Machine` fields), the checks
//! before it acts on one (its `dormant:*` tags), where SSH connects, and the
//! job's pick of instance type through the allow-list.

use anyhow::{bail, Context, Result};

use super::handover;
use super::instance::{tag, InstanceInfo};
use super::{field, Ec2Provider};
use crate::provider::{Machine, MachineSpec, Refusal, SshTarget};
use crate::settings::ec2::{parse_host_port, AddressKind, INSTANCE_TYPE_VARIABLE};

impl Ec2Provider {
    /// The instance types to try, in order: the job's pick through the
    /// allow-list (`DORMANT_EC2_INSTANCE_TYPE`: one type, or several separated
    /// by commas, each allowed), else `instance_type` then
    /// `fallback_instance_types`. A job that names types gets only those: it
    /// said what it needs, and a fallback of the operator's might not do.
    pub fn instance_types(&self, spec: &MachineSpec) -> Result<Vec<String>, Refusal> {
        let asked = spec
            .variables
            .get(INSTANCE_TYPE_VARIABLE)
            .map(|s| s.trim())
            .filter(|s| !s.is_empty());
        let Some(asked) = asked else {
            let mut types = vec![self.settings.instance_type.clone()];
            types.extend(self.settings.fallback_instance_types.iter().cloned());
            return Ok(types);
        };
        let mut types: Vec<String> = Vec::new();
        for t in asked.split(',').map(str::trim) {
            if !types.iter().any(|have| have == t) {
                types.push(t.to_string());
            }
        }
        for t in &types {
            self.check_allowed(t)?;
        }
        Ok(types)
    }

    /// The first instance type [`Self::instance_types`] gives.
    pub fn instance_type(&self, spec: &MachineSpec) -> Result<String, Refusal> {
        Ok(self.instance_types(spec)?.remove(0))
    }

    /// A type the job asked for must be in `allowed_instance_types`.
    fn check_allowed(&self, asked: &str) -> Result<(), Refusal> {
        // A job variable: untrusted, shown as a short excerpt.
        let asked_q = crate::text::quoted(asked);
        if self
            .settings
            .allowed_instance_types
            .iter()
            .any(|t| t == asked)
        {
            return Ok(());
        }
        if self.settings.allowed_instance_types.is_empty() {
            return Err(Refusal(format!(
                "the job asks for instance type {asked_q} ({INSTANCE_TYPE_VARIABLE}), but this runner's allow-list \
                 ec2.allowed_instance_types is empty: jobs run on {}; drop the variable or ask the runner's operator",
                self.settings.instance_type
            )));
        }
        Err(Refusal(format!(
            "the job asks for instance type {asked_q} ({INSTANCE_TYPE_VARIABLE}), which is not in this runner's \
             allow-list ec2.allowed_instance_types ({})",
            self.settings.allowed_instance_types.join(", ")
        )))
    }

    pub(super) fn machine(&self, region: &str, info: &InstanceInfo) -> Result<Machine> {
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
            (
                field::EPOCH,
                info.tag(handover::tag::EPOCH).map(str::to_string),
            ),
            (field::ZONE, info.zone.clone()),
            (field::INSTANCE_TYPE, info.instance_type.clone()),
            (
                field::MARKET,
                Some(if info.spot { "spot" } else { "on-demand" }.to_string()),
            ),
        ] {
            if let Some(v) = v {
                m = m.with(k, v);
            }
        }
        Ok(m)
    }

    /// Never act on an instance that is not this environment's: its `dormant:*`
    /// tags must match what the environment record says.
    pub(super) fn verify_tags(
        &self,
        machine: &Machine,
        info: &InstanceInfo,
        doing: &str,
    ) -> Result<()> {
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
        let (recorded, tagged) = (machine.field(field::EPOCH), info.tag(handover::tag::EPOCH));
        if !handover::epoch_matches(recorded, tagged) {
            // The job's own key, refused: retrying cannot make it this host's.
            return Err(Refusal(handover::stale_record(
                doing,
                &format!("instance {}", info.id),
                recorded,
                tagged,
            ))
            .into());
        }
        Ok(())
    }

    /// Whether the address SSH connects to is known before the instance
    /// runs: `connect_address` (a tunnel) and the private IP survive a
    /// stop/start; a public IP is assigned anew on every start.
    pub(super) fn address_is_stable(&self) -> bool {
        self.settings.connect_address.is_some() || self.settings.address == AddressKind::Private
    }

    /// Where SSH connects for this machine.
    pub(super) fn ssh_target(&self, machine: &Machine) -> Result<SshTarget> {
        let (host, port) = match &self.settings.connect_address {
            Some(c) => parse_host_port(c).with_context(|| {
                format!(
                    "ec2.connect_address {} is not host:port",
                    crate::text::quoted(c)
                )
            })?,
            None => (
                machine
                    .field(field::ADDRESS)
                    .with_context(|| format!("instance {} has no recorded address", machine.id))?
                    .to_string(),
                self.settings.ssh_port,
            ),
        };
        Ok(SshTarget {
            host,
            port,
            user: self.settings.ssh_user.clone(),
            identity_file: None,
            workdir: None,
            on_login: None,
        })
    }
}
