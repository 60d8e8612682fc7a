//! An environment's data volume (volume mode): the EBS calls — create (in a
//! zone, with its size, type, encryption, KMS key and the `dormant:*` tags
//! set by the create itself), attach, detach, describe, delete, and listing
//! this runner manager's volumes by tag for `sweep` — and the bounded waits
//! for their state changes, through the one wait helper (`crate::wait`).
//!
//! Every call is idempotent where EC2 lets it be: CreateVolume carries a
//! ClientToken (a retried create returns the same volume), attaching a volume
//! already attached to that instance, detaching a detached one and deleting a
//! deleted one are success. What the guest does with the volume (format,
//! mount) is not here.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use aws_sdk_ec2::types::{Filter, ResourceType, Tag, TagSpecification, Volume, VolumeType};
use aws_sdk_ec2::Client;

use super::call::call;
use super::errors::{api_error, is_not_found};
use crate::context::Ctx;
use crate::wait::{Poll, Schedule, Wait};

/// The device name a data volume is attached as. The guest sees it under
/// another name ([`guest_devices`]).
pub const DEVICE: &str = "/dev/sdf";
/// A volume's state is described once a second during a transition, like an
/// instance's (`wait::POLL_EVERY`): EBS attaches and detaches in seconds.
pub const POLL_EVERY: Duration = Duration::from_secs(1);
/// How long a just-created volume may be invisible to DescribeVolumes.
const NOT_VISIBLE_GRACE: Duration = Duration::from_secs(120);

/// The names under which an instance's kernel shows data volume `volume`
/// attached as [`DEVICE`], in the order the mount prefers them:
///
/// - Nitro (every current generation): an NVMe disk whatever the attach
///   name said, its serial the volume id without the dash, which udev links
///   as `/dev/disk/by-id/nvme-Amazon_Elastic_Block_Store_vol…`. It names
///   this very volume, so it comes first.
/// - Xen (t2, m4, c4, …): the attach name with `sd` turned into `xvd`
///   (`/dev/xvdf`); some kernels keep `/dev/sdf`. Xen disks carry no
///   serial: the name is all there is, and it is ours because EC2 refuses a
///   second attach at a name in use. (RHEL 6's kernel shifts the letter by
///   four, `/dev/xvdj`: not looked for.)
///
/// (Amazon Linux also links `/dev/sdf` and `/dev/xvdf` to the NVMe disk on
/// Nitro: the same volume under a later name.)
pub fn guest_devices(volume: &str) -> Vec<String> {
    let nvme = format!(
        "/dev/disk/by-id/nvme-Amazon_Elastic_Block_Store_{}",
        volume.replace('-', "")
    );
    let xen = DEVICE.replacen("/dev/sd", "/dev/xvd", 1);
    vec![nvme, xen, DEVICE.to_string()]
}

/// What a new data volume is.
#[derive(Debug, Clone)]
pub struct NewVolume {
    pub zone: String,
    pub size_gb: u32,
    pub volume_type: String,
    pub encrypted: bool,
    pub kms_key_id: Option<String>,
    /// `Name`, `dormant:*` and the operator's tags, set by CreateVolume itself.
    pub tags: Vec<(String, String)>,
    /// Makes a retried CreateVolume return the volume the first one made.
    pub client_token: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeInfo {
    pub id: String,
    /// `creating`, `available`, `in-use`, `deleting`, `deleted`, `error`.
    pub state: String,
    pub zone: String,
    pub size_gb: Option<i32>,
    pub tags: BTreeMap<String, String>,
    /// (instance id, attachment state) for each attachment.
    pub attachments: Vec<(String, String)>,
    pub created_at: Option<u64>,
}

impl VolumeInfo {
    fn from_sdk(v: &Volume) -> VolumeInfo {
        VolumeInfo {
            id: v.volume_id().unwrap_or_default().to_string(),
            state: v
                .state()
                .map(|s| s.as_str().to_string())
                .unwrap_or_default(),
            zone: v.availability_zone().unwrap_or_default().to_string(),
            size_gb: v.size(),
            tags: v
                .tags()
                .iter()
                .filter_map(|t| Some((t.key()?.to_string(), t.value().unwrap_or("").to_string())))
                .collect(),
            attachments: v
                .attachments()
                .iter()
                .map(|a| {
                    (
                        a.instance_id().unwrap_or_default().to_string(),
                        a.state()
                            .map(|s| s.as_str().to_string())
                            .unwrap_or_default(),
                    )
                })
                .collect(),
            created_at: v.create_time().map(|t| t.secs().max(0) as u64),
        }
    }

    pub fn tag(&self, k: &str) -> Option<&str> {
        self.tags.get(k).map(String::as_str)
    }

    /// The attachment to `instance`, if any, and its state.
    pub fn attachment_to(&self, instance: &str) -> Option<&str> {
        self.attachments
            .iter()
            .find(|(i, _)| i == instance)
            .map(|(_, s)| s.as_str())
    }

    /// Gone, or going: nothing can be done with it any more.
    pub fn is_gone(&self) -> bool {
        matches!(self.state.as_str(), "deleting" | "deleted")
    }
}

/// CreateVolume; returns the volume id once it is `available`.
pub async fn create(client: &Client, new: &NewVolume, ctx: &Ctx) -> Result<String> {
    let tags: Vec<Tag> = new
        .tags
        .iter()
        .map(|(k, v)| Tag::builder().key(k).value(v).build())
        .collect();
    let out = call("CreateVolume", ctx, || {
        client
            .create_volume()
            .availability_zone(&new.zone)
            .size(new.size_gb as i32)
            .volume_type(VolumeType::from(new.volume_type.as_str()))
            .encrypted(new.encrypted)
            .set_kms_key_id(new.kms_key_id.clone())
            .client_token(&new.client_token)
            .tag_specifications(
                TagSpecification::builder()
                    .resource_type(ResourceType::Volume)
                    .set_tags(Some(tags.clone()))
                    .build(),
            )
            .send()
    })
    .await
    .with_context(|| {
        format!(
            "creating a {} GiB {} volume in {}",
            new.size_gb, new.volume_type, new.zone
        )
    })?;
    let Some(id) = out.volume_id().map(str::to_string) else {
        bail!("EC2 CreateVolume answered without a volume id");
    };
    wait_until(client, &id, Until::Available, ctx).await?;
    Ok(id)
}

/// AttachVolume to `instance` (already attached there: nothing to do);
/// returns once EC2 says `attached`.
pub async fn attach(client: &Client, volume: &str, instance: &str, ctx: &Ctx) -> Result<()> {
    match describe(client, volume, ctx).await? {
        Some(v) => attach_seen(client, &v, instance, ctx).await,
        None => bail!("volume {volume} does not exist: nothing to attach"),
    }
}

/// [`attach`] of a volume just described (`seen`).
pub async fn attach_seen(
    client: &Client,
    seen: &VolumeInfo,
    instance: &str,
    ctx: &Ctx,
) -> Result<()> {
    let volume = seen.id.as_str();
    if seen.attachment_to(instance) == Some("attached") {
        return Ok(());
    }
    let done = call("AttachVolume", ctx, || {
        client
            .attach_volume()
            .volume_id(volume)
            .instance_id(instance)
            .device(DEVICE)
            .send()
    })
    .await;
    if let Err(e) = done {
        // A retry after an attach that went through: EC2 says it is in use (by us).
        let in_use = api_error(&e)
            .and_then(|a| a.code.as_deref())
            .is_some_and(|c| c == "VolumeInUse");
        let ours = in_use
            && describe(client, volume, ctx)
                .await?
                .is_some_and(|v| v.attachment_to(instance).is_some());
        if !ours {
            return Err(e)
                .with_context(|| format!("attaching volume {volume} to instance {instance}"));
        }
    }
    wait_until(client, volume, Until::AttachedTo(instance), ctx).await?;
    Ok(())
}

/// DetachVolume from `instance`; returns once the volume is `available`.
/// Already detached (or the instance gone, which detaches it) is success.
pub async fn detach(client: &Client, volume: &str, instance: &str, ctx: &Ctx) -> Result<()> {
    let Some(v) = describe(client, volume, ctx).await? else {
        bail!("volume {volume} does not exist: nothing to detach");
    };
    detach_seen(client, &v, instance, ctx).await
}

/// [`detach`] of a volume just described (`v`).
pub async fn detach_seen(client: &Client, v: &VolumeInfo, instance: &str, ctx: &Ctx) -> Result<()> {
    let volume = v.id.as_str();
    if v.state == "available" {
        return Ok(());
    }
    if v.attachment_to(instance).is_some_and(|s| s != "detaching") {
        let done = call("DetachVolume", ctx, || {
            client
                .detach_volume()
                .volume_id(volume)
                .instance_id(instance)
                .send()
        })
        .await;
        if let Err(e) = done {
            let settled = api_error(&e)
                .and_then(|a| a.code.as_deref())
                .is_some_and(|c| c == "IncorrectState" || c == "InvalidAttachment.NotFound");
            if !settled {
                return Err(e).with_context(|| {
                    format!("detaching volume {volume} from instance {instance}")
                });
            }
        }
    }
    wait_until(client, volume, Until::Available, ctx).await?;
    Ok(())
}

/// DeleteVolume; already gone is success. The volume must be detached.
pub async fn delete(client: &Client, volume: &str, ctx: &Ctx) -> Result<()> {
    match call("DeleteVolume", ctx, || {
        client.delete_volume().volume_id(volume).send()
    })
    .await
    {
        Ok(_) => Ok(()),
        Err(e) if is_not_found(&e) => Ok(()),
        Err(e) => Err(e).with_context(|| format!("deleting volume {volume}")),
    }
}

/// DescribeVolumes of one volume; `None`: EC2 does not know it.
pub async fn describe(client: &Client, volume: &str, ctx: &Ctx) -> Result<Option<VolumeInfo>> {
    match call("DescribeVolumes", ctx, || {
        client.describe_volumes().volume_ids(volume).send()
    })
    .await
    {
        Ok(out) => Ok(out
            .volumes()
            .iter()
            .find(|v| v.volume_id() == Some(volume))
            .map(VolumeInfo::from_sdk)),
        Err(e) if is_not_found(&e) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Every volume matching the filters (all pages): by `dormant:*` tags for
/// `sweep` and for finding an environment's volume after a crash.
pub async fn find(client: &Client, filters: Vec<Filter>, ctx: &Ctx) -> Result<Vec<VolumeInfo>> {
    let mut out = Vec::new();
    let mut token: Option<String> = None;
    loop {
        let page = call("DescribeVolumes", ctx, || {
            client
                .describe_volumes()
                .set_filters(Some(filters.clone()))
                .set_next_token(token.clone())
                .send()
        })
        .await?;
        out.extend(page.volumes().iter().map(VolumeInfo::from_sdk));
        match page.next_token() {
            Some(t) if !t.is_empty() => token = Some(t.to_string()),
            _ => return Ok(out),
        }
    }
}

/// What a volume wait waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Until<'a> {
    /// `available`: created, or detached.
    Available,
    /// Attached to this instance.
    AttachedTo(&'a str),
}

impl Until<'_> {
    fn describe(&self) -> String {
        match self {
            Until::Available => "available".into(),
            Until::AttachedTo(i) => format!("attached to instance {i}"),
        }
    }
}

/// Polls the volume once a second until `until`, inside the caller's deadline.
pub async fn wait_until(client: &Client, volume: &str, until: Until<'_>, ctx: &Ctx) -> Result<()> {
    let what = format!("volume {volume} to be {}", until.describe());
    let mut wait = Wait::new(ctx, what.clone(), Schedule::fixed(POLL_EVERY));
    let started = std::time::Instant::now();
    wait.until(|| async {
        let seen = describe(client, volume, ctx)
            .await
            .with_context(|| format!("waiting for {what}"))?;
        check(volume, until, seen, started.elapsed())
    })
    .await?;
    tracing::debug!(volume, until = ?until, ms = started.elapsed().as_millis() as u64, "volume wait");
    Ok(())
}

/// What one describe means for a wait.
pub fn check(
    volume: &str,
    until: Until<'_>,
    seen: Option<VolumeInfo>,
    elapsed: Duration,
) -> Result<Poll<()>> {
    let Some(v) = seen else {
        if elapsed < NOT_VISIBLE_GRACE {
            return Ok(Poll::Pending("not visible yet".into()));
        }
        bail!("volume {volume} does not exist (any more) while dormant waited for it");
    };
    if v.is_gone() || v.state == "error" {
        bail!(
            "volume {volume} is {} while dormant waited for it to be {}",
            v.state,
            until.describe()
        );
    }
    match until {
        Until::Available if v.state == "available" => Ok(Poll::Ready(())),
        Until::AttachedTo(i) if v.attachment_to(i) == Some("attached") => Ok(Poll::Ready(())),
        Until::AttachedTo(i) if v.state == "available" || v.attachment_to(i).is_none() => {
            // Nothing is attaching it (any more): another instance has it, or
            // the attach was undone (the instance went away).
            match v.attachments.first() {
                Some((other, _)) if other != i => {
                    bail!("volume {volume} is attached to instance {other}, not {i}")
                }
                _ => Ok(Poll::Pending(v.state.clone())),
            }
        }
        _ => Ok(Poll::Pending(match v.attachments.first() {
            Some((_, s)) => format!("{} ({s})", v.state),
            None => v.state.clone(),
        })),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vol(state: &str, attached: &[(&str, &str)]) -> Option<VolumeInfo> {
        Some(VolumeInfo {
            id: "vol-1".into(),
            state: state.into(),
            zone: "z".into(),
            size_gb: Some(8),
            tags: BTreeMap::new(),
            attachments: attached
                .iter()
                .map(|(i, s)| (i.to_string(), s.to_string()))
                .collect(),
            created_at: None,
        })
    }

    fn ready(p: Result<Poll<()>>) -> bool {
        matches!(p.unwrap(), Poll::Ready(()))
    }

    #[test]
    fn the_guest_looks_for_the_nitro_serial_then_the_xen_names() {
        assert_eq!(
            guest_devices("vol-0123456789abcdef0"),
            [
                "/dev/disk/by-id/nvme-Amazon_Elastic_Block_Store_vol0123456789abcdef0",
                "/dev/xvdf",
                "/dev/sdf",
            ]
        );
    }

    #[test]
    fn waits_end_on_the_wanted_state_and_fail_on_a_lost_volume() {
        let z = Duration::ZERO;
        let late = NOT_VISIBLE_GRACE + Duration::from_secs(1);
        assert!(ready(check(
            "vol-1",
            Until::Available,
            vol("available", &[]),
            z
        )));
        assert!(!ready(check(
            "vol-1",
            Until::Available,
            vol("creating", &[]),
            z
        )));
        assert!(!ready(check(
            "vol-1",
            Until::Available,
            vol("in-use", &[("i-1", "detaching")]),
            z
        )));
        let on = Until::AttachedTo("i-1");
        assert!(ready(check(
            "vol-1",
            on,
            vol("in-use", &[("i-1", "attached")]),
            z
        )));
        assert!(!ready(check(
            "vol-1",
            on,
            vol("in-use", &[("i-1", "attaching")]),
            z
        )));
        assert!(!ready(check("vol-1", Until::Available, None, z)));
        let e = check("vol-1", Until::Available, None, late).unwrap_err();
        assert!(format!("{e:#}").contains("does not exist"), "{e:#}");
        let e = check("vol-1", on, vol("in-use", &[("i-2", "attached")]), z).unwrap_err();
        assert!(
            format!("{e:#}").contains("attached to instance i-2, not i-1"),
            "{e:#}"
        );
        let e = check("vol-1", Until::Available, vol("error", &[]), z).unwrap_err();
        assert!(format!("{e:#}").contains("is error"), "{e:#}");
    }
}
