//! Volume mode on EC2 (`[ec2] storage = "volume"`): the `Volumes` side of
//! the provider, driven by the core's lifecycle (`lifecycle/volume.rs`),
//! which records each step before calling it. An environment's data volume
//! is an EBS volume tagged like its instances plus `dormant:volume = data`;
//! every machine of the environment is launched in the volume's zone (the
//! subnet of `subnet_ids` in that zone) and the volume attached to it.
//!
//! A new environment's volume is made beside its first machine: that machine
//! is launched first, anywhere there is capacity (every zone, instance type
//! and market of the placement), and the volume created in its zone; the
//! core's `create_or_reclaim` then adopts the machine by its tags. With a
//! ready warm instance (`ec2.warm`), the prepare takes it first and the
//! volume is created in its zone (`VolumeSpec::beside`): no launch. A volume
//! lives in one zone: every later machine needs capacity there.
//!
//! Nothing is acted on that is not this runner manager's: a volume's
//! `dormant:*` tags are checked before it is attached or deleted
//! (`volumes_find.rs`).

use anyhow::{bail, Context, Result};
use async_trait::async_trait;
use aws_sdk_ec2::Client;
use uuid::Uuid;

use super::create::Within;
use super::instance::{self, tag, tag_filter};
use super::lifecycle::terminate;
use super::volume::{self, NewVolume, Until};
use super::volumes_find::{gone, vfield};
use super::{field, guest_seam, subnets, Ec2Provider};
use crate::context::Ctx;
use crate::model::{GuestMount, Machine, ManagedVolume, StorageMode, Volume};
use crate::provider::{MachineState, VolumeSpec, Volumes};

impl Ec2Provider {
    /// The tags of a new data volume: the instance's, plus `dormant:volume`.
    fn volume_tags(&self, spec: &VolumeSpec) -> Vec<(String, String)> {
        let mut t: Vec<(String, String)> = vec![
            ("Name".into(), spec.name.clone()),
            (tag::MANAGED_BY.into(), tag::MANAGED_BY_VALUE.into()),
            (tag::ENV.into(), spec.env_id.to_string()),
            (tag::RUNNER.into(), spec.runner_id.clone()),
            (tag::SYSTEM.into(), spec.system_id.clone()),
            (tag::PROJECT.into(), spec.project_id.to_string()),
            (tag::JOB.into(), spec.job_id.to_string()),
            (tag::VOLUME.into(), tag::VOLUME_DATA.into()),
            (
                super::handover::tag::EPOCH.into(),
                super::handover::FIRST_EPOCH.to_string(),
            ),
        ];
        t.extend(
            self.settings
                .tags
                .iter()
                .map(|(k, v)| (k.clone(), v.clone())),
        );
        t
    }

    /// The zone a volume without a first machine goes to: the first subnet's.
    async fn first_zone(&self, client: &Client, region: &str, ctx: &Ctx) -> Result<String> {
        let all =
            subnets::with_zones(client, &self.store, region, &self.settings.subnets(), ctx).await?;
        all.first()
            .and_then(|s| s.zone.clone())
            .context("ec2.subnet_id / ec2.subnet_ids names no subnet")
    }
}

#[async_trait]
impl Volumes for Ec2Provider {
    async fn create_volume(&self, spec: &VolumeSpec, ctx: &Ctx) -> Result<Volume> {
        let ctx = self.bounded(ctx);
        let ctx = &ctx;
        let region = self.clients.default_region().await?;
        let client = self.clients.client(&region).await;
        if let Some(found) = self.env_volume(&client, spec.env_id, ctx).await? {
            ctx.log.info(format!(
                "found data volume {} ({}) that an earlier attempt of this prepare made",
                found.id, found.state
            ));
            if found.state == "creating" {
                volume::wait_until(&client, &found.id, Until::Available, ctx).await?;
            }
            return Ok(Self::as_volume(&region, &found));
        }
        let zone = match (&spec.beside, &spec.machine) {
            (Some(warm), _) => {
                // A warm instance the environment took: the volume goes to
                // its zone (the subnet of `subnet_ids` it was launched in).
                let zone = warm
                    .field(field::ZONE)
                    .with_context(|| format!("instance {} reports no zone", warm.id))?
                    .to_string();
                ctx.log.info(format!(
                    "making the data volume in zone {zone}, beside instance {}",
                    warm.id
                ));
                zone
            }
            (None, Some(first)) => {
                // Where there is capacity: the volume follows its first machine.
                let m = self
                    .create_within(first, Within::Anywhere { volume_mode: true }, ctx)
                    .await?;
                m.field(field::ZONE)
                    .with_context(|| format!("instance {} reports no zone", m.id))?
                    .to_string()
            }
            (None, None) => self.first_zone(&client, &region, ctx).await?,
        };
        let s = &self.settings;
        let new = NewVolume {
            zone: zone.clone(),
            size_gb: s.volume_size_gb,
            volume_type: s.volume_type.clone(),
            encrypted: s.volume_encrypted,
            kms_key_id: s.volume_kms_key_id.clone(),
            tags: self.volume_tags(spec),
            // Retries of this call return the same volume; a retried prepare
            // finds it by its tags above.
            client_token: format!("dormant-vol-{}", Uuid::new_v4().simple()),
        };
        let id = volume::create(&client, &new, ctx).await?;
        ctx.log.info(format!(
            "created data volume {id} ({} GiB {}{}) in {zone}",
            s.volume_size_gb,
            s.volume_type,
            if s.volume_encrypted {
                ", encrypted"
            } else {
                ""
            }
        ));
        Ok(Volume::new(id)
            .with(vfield::REGION, &region)
            .with(vfield::ZONE, zone)
            .with(vfield::SIZE_GIB, s.volume_size_gb.to_string()))
    }

    async fn find_volume(&self, env_id: Uuid, ctx: &Ctx) -> Result<Option<Volume>> {
        let region = self.clients.default_region().await?;
        let client = self.clients.client(&region).await;
        Ok(self
            .env_volume(&client, env_id, ctx)
            .await?
            .map(|v| Self::as_volume(&region, &v)))
    }

    async fn attach(&self, v: &Volume, machine: &Machine, ctx: &Ctx) -> Result<()> {
        let (client, region) = self.volume_client(v).await?;
        let info = match volume::describe(&client, &v.id, ctx).await? {
            Some(info) if !info.is_gone() => info,
            _ => return Err(gone(&v.id, &region).into()),
        };
        self.verify_volume(&info, "attach")?;
        Self::verify_epoch(v, &info, "attach")?;
        if let Some(z) = machine.field(field::ZONE) {
            if z != info.zone {
                bail!(
                    "data volume {} is in zone {}, instance {} in {z}: a volume attaches only to an instance \
                     in its own zone",
                    v.id,
                    info.zone,
                    machine.id
                );
            }
        }
        volume::attach_seen(&client, &info, &machine.id, ctx).await?;
        ctx.log.info(format!(
            "data volume {} attached to instance {}",
            v.id, machine.id
        ));
        if let Some(root) = guest_seam::dir() {
            guest_seam::attach(root, &v.id, &self.settings.volume_mount)?;
        }
        Ok(())
    }

    async fn detach(
        &self,
        v: &Volume,
        machine: &Machine,
        unmounted: bool,
        ctx: &Ctx,
    ) -> Result<()> {
        if let Some(root) = guest_seam::dir() {
            guest_seam::detach(root, &v.id, &self.settings.volume_mount)?;
        }
        let (client, _) = self.volume_client(v).await?;
        let Some(info) = volume::describe(&client, &v.id, ctx).await? else {
            // Gone: nothing to detach (a resume will say the files are gone).
            return Ok(());
        };
        match info.attachments.first() {
            None if info.state == "available" => {
                self.note_suspended(&client, &v.id, ctx).await;
                return Ok(());
            }
            Some((other, _)) if *other != machine.id => bail!(
                "data volume {} is attached to instance {other}, not to the environment's instance {}; \
                 detach it by hand if {other} is not in use (`aws ec2 detach-volume --volume-id {}`)",
                v.id,
                machine.id,
                v.id
            ),
            _ => {}
        }
        if unmounted {
            volume::detach_seen(&client, &info, &machine.id, ctx).await?;
        } else {
            // The guest could not be asked to unmount: a DetachVolume under a
            // mounted filesystem could lose what is in its page cache. The
            // instance's own shutdown unmounts it; terminating it detaches the
            // volume (the instance is deleted next anyway).
            let (iclient, _) = self.client_for(machine).await?;
            if let Some(i) = instance::describe(&iclient, &machine.id, ctx).await? {
                if i.state != MachineState::Gone {
                    self.verify_tags(machine, &i, "terminate")?;
                    ctx.log.info(format!(
                        "terminating instance {} so that its shutdown unmounts data volume {}",
                        machine.id, v.id
                    ));
                    terminate(&iclient, &machine.id, ctx).await?;
                }
            }
            volume::wait_until(&client, &v.id, Until::Available, ctx).await?;
        }
        ctx.log.info(format!(
            "data volume {} detached from instance {}",
            v.id, machine.id
        ));
        self.note_suspended(&client, &v.id, ctx).await;
        Ok(())
    }

    async fn delete_volume(&self, v: &Volume, ctx: &Ctx) -> Result<()> {
        let (client, region) = self.volume_client(v).await?;
        let Some(info) = volume::describe(&client, &v.id, ctx).await? else {
            ctx.log.info(format!(
                "data volume {} is already gone from {region}",
                v.id
            ));
            return self.forget_seam(v);
        };
        if info.is_gone() {
            return self.forget_seam(v);
        }
        self.verify_volume(&info, "delete")?;
        Self::verify_epoch(v, &info, "delete")?;
        if info.state != "available" {
            // Its instance was terminated just before: the attachment ends with its shutdown.
            volume::wait_until(&client, &v.id, Until::Available, ctx)
                .await
                .with_context(|| format!("waiting to delete data volume {}", v.id))?;
        }
        ctx.log.info(format!("deleting data volume {}", v.id));
        volume::delete(&client, &v.id, ctx).await?;
        self.forget_seam(v)
    }

    async fn list_volumes(&self, ctx: &Ctx) -> Result<Vec<ManagedVolume>> {
        let region = self.clients.default_region().await?;
        let client = self.clients.client(&region).await;
        let found = volume::find(
            &client,
            vec![
                tag_filter(tag::MANAGED_BY, tag::MANAGED_BY_VALUE),
                tag_filter(tag::SYSTEM, &self.system_id),
                tag_filter(tag::VOLUME, tag::VOLUME_DATA),
            ],
            ctx,
        )
        .await
        .with_context(|| format!("listing this runner manager's data volumes in {region}"))?;
        Ok(found
            .into_iter()
            .filter(|v| !v.is_gone())
            .map(|v| {
                let env_id = v.tag(tag::ENV).and_then(|e| Uuid::parse_str(e).ok());
                ManagedVolume {
                    volume: Self::as_volume(&region, &v),
                    env_id,
                    state: v.state.clone(),
                }
            })
            .collect())
    }

    fn guest_mount(&self, v: &Volume) -> GuestMount {
        let dirs = self
            .settings
            .dirs(&self.store.env_paths(Uuid::nil()), StorageMode::Volume)
            .map(|d| vec![d.builds, d.cache])
            .unwrap_or_default();
        GuestMount {
            // Nitro and Xen instances name the device differently: the mount
            // takes whichever of these appears (the guest seam: none).
            devices: if guest_seam::dir().is_none() {
                volume::guest_devices(&v.id)
            } else {
                Vec::new()
            },
            mountpoint: self.settings.volume_mount.clone(),
            user_dirs: dirs,
        }
    }

    fn key_fields(&self, v: &Volume) -> Vec<(String, String)> {
        let mut f = vec![("volume".to_string(), v.id.clone())];
        for k in [vfield::ZONE, vfield::REGION] {
            if let Some(x) = v.field(k) {
                f.push((k.to_string(), x.to_string()));
            }
        }
        f
    }
}

impl Ec2Provider {
    fn forget_seam(&self, v: &Volume) -> Result<()> {
        if let Some(root) = guest_seam::dir() {
            guest_seam::delete(root, &v.id)?;
        }
        Ok(())
    }
}
