//! Volume mode on EC2: finding an environment's data volume (where its
//! record says it is, or by its tags) and, before one is attached or
//! deleted, checking that it is this runner manager's data volume and that
//! no other host took it over since the record was made; the fields a
//! record holds of a data volume ([`vfield`]). The `Volumes` operations that
//! use these are `volumes.rs`.

use anyhow::{bail, Context, Result};
use aws_sdk_ec2::Client;
use uuid::Uuid;

use super::create::VolumePlace;
use super::instance::{tag, tag_filter};
use super::volume::{self, VolumeInfo};
use super::{handover, subnets, Ec2Provider, EPOCH_FIELD};
use crate::context::Ctx;
use crate::model::Volume;
use crate::provider::{Refusal, VolumeGone};

/// A data volume's fields (and key fields).
pub(super) mod vfield {
    pub const REGION: &str = "region";
    pub const ZONE: &str = "zone";
    /// Its size, GiB, as created or described: what it keeps (`kept.rs`).
    pub const SIZE_GIB: &str = "size_gib";
}

impl Ec2Provider {
    /// Where a data volume is, and the subnet of its zone.
    pub(super) async fn volume_place(&self, v: &Volume, ctx: &Ctx) -> Result<VolumePlace> {
        let region = match v.field(vfield::REGION) {
            Some(r) => r.to_string(),
            None => self.clients.default_region().await?,
        };
        let client = self.clients.client(&region).await;
        let zone = match v.field(vfield::ZONE) {
            Some(z) => z.to_string(),
            None => match volume::describe(&client, &v.id, ctx).await? {
                Some(info) if !info.is_gone() => info.zone,
                _ => return Err(gone(&v.id, &region).into()),
            },
        };
        let all = subnets::with_zones(&client, &self.store, &region, &self.settings.subnets(), ctx)
            .await?;
        let Some(subnet) = subnets::in_zone(&all, &zone).cloned() else {
            bail!(
                "the data volume {} is in zone {zone}, but no subnet of ec2.subnet_id / ec2.subnet_ids is \
                 in that zone ({}): a volume attaches only to an instance in its own zone; add a subnet of \
                 {zone} to ec2.subnet_ids",
                v.id,
                all.iter()
                    .map(|s| s.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        };
        Ok(VolumePlace {
            region,
            zone,
            subnet,
        })
    }

    /// The region of a volume (its field, else the settings').
    pub(super) async fn volume_client(&self, v: &Volume) -> Result<(Client, String)> {
        let region = match v.field(vfield::REGION) {
            Some(r) => r.to_string(),
            None => self.clients.default_region().await?,
        };
        Ok((self.clients.client(&region).await, region))
    }

    /// This environment's data volume, found by its tags (not one being deleted).
    pub(super) async fn env_volume(
        &self,
        client: &Client,
        env_id: Uuid,
        ctx: &Ctx,
    ) -> Result<Option<VolumeInfo>> {
        let found = volume::find(
            client,
            vec![
                tag_filter(tag::ENV, &env_id.to_string()),
                tag_filter(tag::SYSTEM, &self.system_id),
                tag_filter(tag::VOLUME, tag::VOLUME_DATA),
            ],
            ctx,
        )
        .await
        .with_context(|| format!("looking for the data volume of environment {env_id}"))?;
        let mut live: Vec<VolumeInfo> = found.into_iter().filter(|v| !v.is_gone()).collect();
        live.sort_by_key(|v| (v.created_at, v.id.clone()));
        Ok(live.into_iter().next())
    }

    pub(super) fn as_volume(region: &str, info: &VolumeInfo) -> Volume {
        let v = Volume::new(&info.id)
            .with(vfield::REGION, region)
            .with(vfield::ZONE, &info.zone);
        match info.size_gb {
            Some(gib) => v.with(vfield::SIZE_GIB, gib.to_string()),
            None => v,
        }
    }

    /// Never attach or delete a data volume another host has taken over
    /// since this record was made (`handover::epoch_matches`).
    pub(super) fn verify_epoch(v: &Volume, info: &VolumeInfo, doing: &str) -> Result<()> {
        let (recorded, tagged) = (v.field(EPOCH_FIELD), info.tag(handover::tag::EPOCH));
        if handover::epoch_matches(recorded, tagged) {
            return Ok(());
        }
        Err(Refusal(handover::stale_record(
            doing,
            &format!("data volume {}", info.id),
            recorded,
            tagged,
        ))
        .into())
    }

    /// Never attach or delete a volume that is not this runner manager's data volume.
    pub(super) fn verify_volume(&self, info: &VolumeInfo, doing: &str) -> Result<()> {
        for (name, want) in [
            (tag::MANAGED_BY, tag::MANAGED_BY_VALUE),
            (tag::SYSTEM, self.system_id.as_str()),
            (tag::VOLUME, tag::VOLUME_DATA),
        ] {
            if info.tag(name) != Some(want) {
                bail!(
                    "refusing to {doing} volume {}: its tag {name} is {:?}, not {want:?}; it is not a data volume \
                     of this runner manager (was the volume id in the record changed?)",
                    info.id,
                    info.tag(name).unwrap_or("(missing)")
                );
            }
        }
        Ok(())
    }
}

pub(super) fn gone(volume: &str, region: &str) -> VolumeGone {
    VolumeGone(format!(
        "data volume {volume} no longer exists in {region} (deleted outside dormant): the environment's \
         files are gone"
    ))
}
