//! The EC2 side of `dormant adopt`, its finding part: every environment of
//! this runner manager (its system id) in the region, found by the
//! `dormant:*` tags, sorted into those that can be taken over and those left
//! alone with why ([`classify`], pure). Taking one over (the check, the tag
//! write, its read-back) is `takeover_write.rs`; the state side (records,
//! keys, events) is `ops/adopt/`.
//!
//! What is adopted: a machine-mode environment whose instance is `stopped`
//! and carries a way back in (`handover::entry`); a volume-mode environment
//! whose data volume is `available` with no instance of it left. Anything in
//! between — an instance starting, stopping or running, a volume attached, a
//! volume beside an instance of its environment — is a resume, a suspension
//! or a job under way, or one the lost host left cut short: it is left
//! alone with what the operator can do, never taken from a host that may
//! still be using it.

use std::collections::BTreeMap;

use anyhow::{Context, Result};
use uuid::Uuid;

use super::handover::{self, Entry};
use super::instance::{self, tag, tag_filter, InstanceInfo};
use super::volume::{self, VolumeInfo};
use super::{field, Ec2Provider};
use crate::context::Ctx;
use crate::model::{Machine, MachineState, Volume};

/// An environment that can be taken over.
#[derive(Debug, Clone)]
pub struct Adoptable {
    pub env_id: Uuid,
    pub runner_id: String,
    pub project_id: u64,
    /// The job that made it (`dormant:job`).
    pub job_id: u64,
    /// The epoch its tags carry now; adoption writes the next one.
    pub epoch: u64,
    /// The epoch tag's value as found (`None`: no tag): a take-over writes
    /// only while the tag still has it.
    pub epoch_tag: Option<String>,
    /// When it was suspended (`dormant:suspended-at`); `None`: not recorded.
    pub suspended_at: Option<u64>,
    /// When it was made (the instance's launch or the volume's creation).
    pub created_at: Option<u64>,
    pub what: Held,
}

/// What the environment is while suspended.
#[derive(Debug, Clone)]
pub enum Held {
    /// Machine mode: the stopped instance as EC2 described it, the record's
    /// machine made from it, and how to get back in.
    Machine {
        info: Box<InstanceInfo>,
        machine: Machine,
        entry: Entry,
    },
    /// Volume mode: the available data volume.
    Volume { volume: Volume },
}

impl Held {
    /// The instance or volume id.
    pub fn resource(&self) -> &str {
        match self {
            Held::Machine { machine, .. } => &machine.id,
            Held::Volume { volume } => &volume.id,
        }
    }
}

/// An environment (or a resource) left alone, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeftAlone {
    /// The instance and/or volume ids.
    pub resources: String,
    pub env_id: Option<Uuid>,
    pub why: String,
}

/// What a look at the region found.
#[derive(Debug, Default)]
pub struct Found {
    pub adoptable: Vec<Adoptable>,
    pub left: Vec<LeftAlone>,
}

/// Sorts what EC2 lists (this system id's instances and data volumes, not
/// terminated or deleted) into adoptable environments and those left alone.
/// `runner`: only this runner's (`runner_id` in the settings); `None`: every
/// runner of this system id.
pub fn classify(
    region: &str,
    instances: Vec<InstanceInfo>,
    volumes: Vec<VolumeInfo>,
    runner: Option<&str>,
) -> Found {
    let mut found = Found::default();
    // By environment id, in a stable order.
    let mut envs: BTreeMap<Uuid, (Vec<InstanceInfo>, Vec<VolumeInfo>)> = BTreeMap::new();
    for i in instances {
        if i.tag(tag::WARM).is_some() {
            // A warm instance (or one mid-hand-over) of the lost host's pool:
            // no environment to adopt; `dormant sweep` finds it as an orphan.
            continue;
        }
        match i.tag(tag::ENV).map(Uuid::parse_str) {
            Some(Ok(id)) => envs.entry(id).or_default().0.push(i),
            other => found.left.push(LeftAlone {
                resources: format!("instance {}", i.id),
                env_id: None,
                why: unparsable_env(other.is_some(), i.tag(tag::ENV)),
            }),
        }
    }
    for v in volumes {
        match v.tag(tag::ENV).map(Uuid::parse_str) {
            Some(Ok(id)) => envs.entry(id).or_default().1.push(v),
            other => found.left.push(LeftAlone {
                resources: format!("data volume {}", v.id),
                env_id: None,
                why: unparsable_env(other.is_some(), v.tag(tag::ENV)),
            }),
        }
    }
    for (env_id, (instances, volumes)) in envs {
        let resources = instances
            .iter()
            .map(|i| format!("instance {}", i.id))
            .chain(volumes.iter().map(|v| format!("data volume {}", v.id)))
            .collect::<Vec<_>>()
            .join(", ");
        match one(region, env_id, &instances, &volumes, runner) {
            Ok(a) => found.adoptable.push(a),
            Err(why) => found.left.push(LeftAlone {
                resources,
                env_id: Some(env_id),
                why,
            }),
        }
    }
    found
}

fn unparsable_env(present: bool, value: Option<&str>) -> String {
    if present {
        format!(
            "its tag {} is {}, not an environment id: not dormant's doing; check who changed it",
            tag::ENV,
            crate::text::quoted(value.unwrap_or_default())
        )
    } else {
        format!(
            "it has no {} tag: not an environment dormant made",
            tag::ENV
        )
    }
}

/// One environment's instances and data volumes: adoptable, or why not.
fn one(
    region: &str,
    env_id: Uuid,
    instances: &[InstanceInfo],
    volumes: &[VolumeInfo],
    runner: Option<&str>,
) -> Result<Adoptable, String> {
    let tags = match volumes.first() {
        Some(v) => &v.tags,
        None => &instances[0].tags,
    };
    let runner_id = tags.get(tag::RUNNER).cloned().unwrap_or_default();
    if runner_id.is_empty() || runner_id.contains('/') {
        return Err(format!(
            "its tag {} is {}, not a runner id",
            tag::RUNNER,
            crate::text::quoted(&runner_id)
        ));
    }
    if let Some(mine) = runner {
        if runner_id != mine {
            return Err(format!(
                "it is runner {}'s, and this host adopts only runner {mine}'s (runner_id in the settings)",
                crate::text::quoted(&runner_id)
            ));
        }
    }
    let num = |name: &str| -> Result<Option<u64>, String> { handover::number(tags, name) };
    let project_id = num(tag::PROJECT)?.ok_or_else(|| format!("it has no {} tag", tag::PROJECT))?;
    let job_id = num(tag::JOB)?.unwrap_or(0);
    let epoch_tag = tags.get(handover::tag::EPOCH).cloned();
    let epoch = match &epoch_tag {
        None => 0,
        Some(v) => handover::epoch_number(v).ok_or_else(|| {
            format!(
                "its tag {} is {}, not a number",
                handover::tag::EPOCH,
                crate::text::quoted(v)
            )
        })?,
    };
    let suspended_at = num(handover::tag::SUSPENDED_AT)?;
    let base = |what: Held, created_at: Option<u64>| Adoptable {
        env_id,
        runner_id: runner_id.clone(),
        project_id,
        job_id,
        epoch,
        epoch_tag: epoch_tag.clone(),
        suspended_at,
        created_at,
        what,
    };
    if volumes.len() > 1 {
        return Err(format!(
            "it has {} data volumes; dormant makes one: find out which one holds the work, delete the others",
            volumes.len()
        ));
    }
    if let Some(v) = volumes.first() {
        if let Some(i) = instances.first() {
            return Err(format!(
                "instance {} ({}) of it still exists beside its data volume ({}): a resume, a suspension or a \
                 job is under way, or was cut short by the lost host; if that host is gone, terminate the \
                 instance (`aws ec2 terminate-instances --instance-ids {}`: its shutdown unmounts the volume) \
                 and run `dormant adopt` again",
                i.id, i.state_name, v.state, i.id
            ));
        }
        if v.state != "available" {
            return Err(format!(
                "its data volume is {}, not available: wait until it is, and run `dormant adopt` again",
                v.state
            ));
        }
        let volume = Volume::new(&v.id)
            .with(super::volumes_find::vfield::REGION, region)
            .with(super::volumes_find::vfield::ZONE, &v.zone);
        return Ok(base(Held::Volume { volume }, v.created_at));
    }
    if instances.len() > 1 {
        return Err(format!(
            "it has {} instances; dormant makes one: terminate the ones that are not its, and run \
             `dormant adopt` again",
            instances.len()
        ));
    }
    let i = &instances[0];
    match i.state {
        MachineState::Stopped => {}
        MachineState::Running => {
            return Err(format!(
                "instance {} is running: a job of the old host may still be using it, or the host was lost \
                 in the middle of one; if the old host is gone, stop it (`aws ec2 stop-instances \
                 --instance-ids {}`) and run `dormant adopt` again",
                i.id, i.id
            ))
        }
        _ => {
            return Err(format!(
                "instance {} is {}: it is being started or stopped right now; run `dormant adopt` again \
                 once it is stopped",
                i.id, i.state_name
            ))
        }
    }
    if i.state_reason
        .as_deref()
        .is_some_and(|r| r.to_ascii_lowercase().contains("hibernat"))
    {
        return Err(format!(
            "instance {} is hibernated: a hibernated instance resumes without booting, so the boot hook \
             cannot install a new host's key; release it, or start it by hand, stop it without \
             hibernation, and run `dormant adopt` again",
            i.id
        ));
    }
    let entry = handover::entry(&i.tags).map_err(|why| format!("instance {}: {why}", i.id))?;
    Ok(base(
        Held::Machine {
            info: Box::new(i.clone()),
            machine: Machine::new(&i.id),
            entry,
        },
        i.launched_at,
    ))
}

impl Ec2Provider {
    /// Every environment of this system id in the region, sorted.
    pub async fn takeover_candidates(&self, runner: Option<&str>, ctx: &Ctx) -> Result<Found> {
        let region = self.clients.default_region().await?;
        let client = self.clients.client(&region).await;
        let mine = || {
            vec![
                tag_filter(tag::MANAGED_BY, tag::MANAGED_BY_VALUE),
                tag_filter(tag::SYSTEM, &self.system_id),
            ]
        };
        let mut filters = mine();
        filters.push(instance::filter(
            "instance-state-name",
            instance::LIVE_STATES,
        ));
        let instances = instance::find(&client, filters, ctx)
            .await
            .with_context(|| {
                format!(
                    "listing the instances of system {} in {region}",
                    self.system_id
                )
            })?;
        let mut filters = mine();
        filters.push(tag_filter(tag::VOLUME, tag::VOLUME_DATA));
        let volumes: Vec<VolumeInfo> = volume::find(&client, filters, ctx)
            .await
            .with_context(|| {
                format!(
                    "listing the data volumes of system {} in {region}",
                    self.system_id
                )
            })?
            .into_iter()
            .filter(|v| !v.is_gone())
            .collect();
        let mut found = classify(&region, instances, volumes, runner);
        for a in &mut found.adoptable {
            if let Held::Machine { info, machine, .. } = &mut a.what {
                // What a record of this instance holds, as a launch records it;
                // the types it may be changed to are the one it has.
                *machine = self.stopped_machine(&region, info).with(
                    field::INSTANCE_TYPES,
                    info.instance_type.clone().unwrap_or_default(),
                );
            }
        }
        Ok(found)
    }

    /// [`Self::machine`] for a stopped instance, which may have no address
    /// yet (a public one is given at the next start, and a resume reads it).
    fn stopped_machine(&self, region: &str, info: &InstanceInfo) -> Machine {
        if let Ok(m) = self.machine(region, info) {
            return m;
        }
        let mut m = Machine::new(&info.id).with(field::REGION, region);
        for (k, v) in [
            (field::ENV, info.tag(tag::ENV)),
            (field::RUNNER, info.tag(tag::RUNNER)),
            (field::SYSTEM, info.tag(tag::SYSTEM)),
            (field::EPOCH, info.tag(handover::tag::EPOCH)),
            (field::ZONE, info.zone.as_deref()),
            (field::INSTANCE_TYPE, info.instance_type.as_deref()),
            (field::PRIVATE_IP, info.private_ip.as_deref()),
        ] {
            if let Some(v) = v {
                m = m.with(k, v);
            }
        }
        m.with(field::MARKET, if info.spot { "spot" } else { "on-demand" })
    }
}

#[cfg(test)]
#[path = "takeover_tests.rs"]
mod tests;
