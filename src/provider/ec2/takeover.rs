//! The EC2 side of `dormant adopt`: find every environment of this runner
//! manager (its system id) in the region by the `dormant:*` tags, say which
//! can be taken over and why the others are left alone ([`classify`], pure),
//! and take one over ([`Ec2Provider::take_over`]: a check that it is still
//! as found, one CreateTags call that raises the ownership epoch with the
//! run's owner id and, in machine mode, sets the new host's SSH key for the
//! boot hook, then the tag read back to see whose write landed last). The
//! state side (records, keys, events) is `ops/adopt/`.
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

    /// What the take-over tags, as a record knows it.
    pub fn taken(&self) -> Taken<'_> {
        match self {
            Held::Machine { machine, .. } => Taken::Instance(machine),
            Held::Volume { volume } => Taken::Volume(volume),
        }
    }
}

/// The instance (machine mode) or data volume (volume mode) a take-over
/// writes its epoch on, as a record holds it (its region among the fields).
#[derive(Debug, Clone, Copy)]
pub enum Taken<'a> {
    Instance(&'a Machine),
    Volume(&'a Volume),
}

impl Taken<'_> {
    pub fn id(&self) -> &str {
        match self {
            Taken::Instance(m) => &m.id,
            Taken::Volume(v) => &v.id,
        }
    }

    fn what(&self) -> &'static str {
        match self {
            Taken::Instance(_) => "instance",
            Taken::Volume(_) => "data volume",
        }
    }
}

/// What the instance or data volume of a take-over shows now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shown {
    /// Stopped (an instance) or available (a volume): nobody uses it.
    pub idle: bool,
    /// Its `dormant:epoch` value (`None`: no tag).
    pub epoch: Option<String>,
}

/// Whose a take-over's tag write is, read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Confirmed {
    /// The epoch tag holds this take-over's value.
    Ours,
    /// It holds another value (another host adopted it at the same time,
    /// and its write landed after ours), or the resource is gone.
    Another(Option<String>),
}

/// How long a take-over reads its tag back while EC2 still shows the value
/// it had (EC2's describe calls are eventually consistent).
const CONFIRM_BOUND: std::time::Duration = std::time::Duration::from_secs(30);
const CONFIRM_POLL: std::time::Duration = std::time::Duration::from_secs(1);

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
            .with(super::volumes::vfield::REGION, region)
            .with(super::volumes::vfield::ZONE, &v.zone);
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

    /// What `t` shows now; `None`: it is gone.
    pub async fn shown(&self, t: Taken<'_>, ctx: &Ctx) -> Result<Option<Shown>> {
        match t {
            Taken::Instance(m) => {
                let (client, _) = self.client_for(m).await?;
                Ok(instance::describe(&client, &m.id, ctx)
                    .await?
                    .filter(|i| i.state != MachineState::Gone)
                    .map(|i| Shown {
                        idle: i.state == MachineState::Stopped,
                        epoch: i.tag(handover::tag::EPOCH).map(str::to_string),
                    }))
            }
            Taken::Volume(v) => {
                let region = match v.field(super::volumes::vfield::REGION) {
                    Some(r) => r.to_string(),
                    None => self.clients.default_region().await?,
                };
                let client = self.clients.client(&region).await;
                Ok(volume::describe(&client, &v.id, ctx)
                    .await?
                    .filter(|i| !i.is_gone())
                    .map(|i| Shown {
                        idle: i.state == "available",
                        epoch: i.tag(handover::tag::EPOCH).map(str::to_string),
                    }))
            }
        }
    }

    /// Takes `a` over in EC2 with the epoch tag `value` (the next epoch and
    /// the run's owner id, `handover::epoch_value`; the caller recorded it
    /// first): checks the resource still is as it was found (idle, the epoch
    /// tag unchanged), writes `value` and, in machine mode, `authorized_key`
    /// for the boot hook, in one CreateTags call, then reads the tag back
    /// ([`Self::confirm`]). Returns the value written and whose the tag is.
    /// An error before the CreateTags call is a [`NothingWritten`]; any other
    /// error leaves it unknown whether the write landed.
    pub async fn take_over(
        &self,
        a: &Adoptable,
        value: &str,
        authorized_key: Option<&str>,
        ctx: &Ctx,
    ) -> Result<(String, Confirmed)> {
        let value = value.to_string();
        self.check_as_found(a, authorized_key, ctx)
            .await
            .map_err(|e| anyhow::Error::new(NothingWritten(format!("{e:#}"))))?;
        self.write_epoch(a, &value, authorized_key, ctx).await?;
        let confirmed = self
            .confirm(a.what.taken(), a.epoch_tag.as_deref(), &value, ctx)
            .await?;
        Ok((value, confirmed))
    }

    /// Before the tag write: `a` is still idle with the epoch tag it was
    /// found with, and (machine mode) `authorized_key` fits a tag.
    pub async fn check_as_found(
        &self,
        a: &Adoptable,
        authorized_key: Option<&str>,
        ctx: &Ctx,
    ) -> Result<()> {
        if let Held::Machine { machine, .. } = &a.what {
            if authorized_key
                .and_then(handover::authorized_key_tag)
                .is_none()
            {
                anyhow::bail!(
                    "no usable SSH key to set for instance {} of environment {}",
                    machine.id,
                    a.env_id
                );
            }
        }
        let t = a.what.taken();
        match self.shown(t, ctx).await? {
            Some(now) if now.idle && now.epoch == a.epoch_tag => Ok(()),
            _ => anyhow::bail!(
                "{} {} of environment {} changed while it was being adopted ({}, or adopted by another \
                 host): left alone; run `dormant adopt` again",
                t.what(),
                t.id(),
                a.env_id,
                match t {
                    Taken::Instance(_) => "started",
                    Taken::Volume(_) => "attached",
                }
            ),
        }
    }

    /// The one CreateTags call of a take-over: the epoch `value` and, in
    /// machine mode, the authorized key.
    pub async fn write_epoch(
        &self,
        a: &Adoptable,
        value: &str,
        authorized_key: Option<&str>,
        ctx: &Ctx,
    ) -> Result<()> {
        let region = self.clients.default_region().await?;
        let client = self.clients.client(&region).await;
        let mut tags = vec![(handover::tag::EPOCH, value.to_string())];
        if let Held::Machine { .. } = &a.what {
            if let Some(key) = authorized_key.and_then(handover::authorized_key_tag) {
                tags.push((handover::tag::AUTHORIZED_KEY, key));
            }
        }
        handover::set_tags(&client, a.what.resource(), &tags, ctx).await
    }

    /// Reads a take-over's epoch tag back: [`Confirmed::Ours`] once it shows
    /// `ours`, [`Confirmed::Another`] once it shows anything but `ours` and
    /// the value it was found with (`found`), which EC2 may still show for a
    /// moment after the write (asked again every second, for at most 30 s).
    pub async fn confirm(
        &self,
        t: Taken<'_>,
        found: Option<&str>,
        ours: &str,
        ctx: &Ctx,
    ) -> Result<Confirmed> {
        let bounded = ctx.within(CONFIRM_BOUND);
        let mut wait = crate::wait::Wait::new(
            &bounded,
            format!(
                "the epoch tag of {} {} to show this take-over",
                t.what(),
                t.id()
            ),
            crate::wait::Schedule::fixed(CONFIRM_POLL),
        );
        wait.until(|| async {
            use crate::wait::Poll;
            Ok(match self.shown(t, &bounded).await? {
                None => Poll::Ready(Confirmed::Another(None)),
                Some(now) if now.epoch.as_deref() == Some(ours) => Poll::Ready(Confirmed::Ours),
                Some(now) if now.epoch.as_deref() == found => {
                    Poll::Pending(format!("it still shows {}", found.unwrap_or("no epoch")))
                }
                Some(now) => Poll::Ready(Confirmed::Another(now.epoch)),
            })
        })
        .await
    }
}

/// A take-over that failed before its tag write: nothing changed in EC2.
#[derive(Debug)]
pub struct NothingWritten(pub String);

impl std::fmt::Display for NothingWritten {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for NothingWritten {}

#[cfg(test)]
#[path = "takeover_tests.rs"]
mod tests;
