//! The EC2 side of `dormant adopt`, its writing part: taking one adoptable
//! environment over ([`Ec2Provider::take_over`]): a check that it is still
//! as found, one CreateTags call that raises the ownership epoch with the
//! run's owner id and, in machine mode, sets the new host's SSH key for the
//! boot hook, then the tag read back to see whose write landed last (two
//! hosts adopting at once both write; the last write wins, and the loser
//! must find out before it writes a record). What is adoptable is
//! `takeover.rs`.

use anyhow::Result;

use super::handover;
use super::instance;
use super::takeover::{Adoptable, Held};
use super::volume;
use super::Ec2Provider;
use crate::context::Ctx;
use crate::model::{Machine, MachineState, Volume};

impl Held {
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

impl Ec2Provider {
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
                let region = match v.field(super::volumes_find::vfield::REGION) {
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
