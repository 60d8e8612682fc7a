//! The EC2 provider's warm instances (`ec2.warm`, per zone of `subnet_ids`):
//! launched like an environment's instance from today's settings (image,
//! instance types, market, subnet of the zone, user-data with the warm
//! machine's own key), tagged with the usual `dormant:*` tags plus
//! `dormant:warm = <warm id>` and no `dormant:env`. Handing one to an
//! environment is two tag writes: the environment's tags (`dormant:env`,
//! project, job, `Name`, `dormant:epoch`) first, then `dormant:warm` deleted;
//! an instance carrying both is one whose hand-over was killed, finished by
//! the retry. The instance id is kept beside the pool entry
//! (`warm/<id>/ec2-instance.json`) so it is found after the warm tag is gone.
//! How one is launched is `warm_launch.rs`. See docs/ec2.md, "Warm instances".

use std::time::Duration;

use anyhow::{bail, Context, Result};
use async_trait::async_trait;
use aws_sdk_ec2::types::Tag;
use aws_sdk_ec2::Client;

use super::call::call;
use super::capacity;
use super::image;
use super::instance::{self, tag, tag_filter, InstanceInfo};
use super::launch;
use super::lifecycle::terminate;
use super::wait::{wait_for, Want};
use super::warm_launch::{instance_file, WarmInstance};
use super::{field, handover, subnets, Ec2Provider};
use crate::context::Ctx;
use crate::model::{EnvPaths, Machine};
use crate::provider::warm::{WarmKind, WarmMachines};
use crate::provider::{MachineSpec, MachineState};
use crate::settings::ec2::INSTANCE_TYPE_VARIABLE;
use crate::state::pool::WarmPaths;
use crate::state::store::read_json;

impl Ec2Provider {
    /// The machine of a warm instance known only by id (its fields come
    /// with the hand-over).
    fn bare(region: &str, id: &str) -> Machine {
        Machine::new(id).with(field::REGION, region)
    }

    /// The warm instance of `warm` and its region: by the id kept beside the
    /// entry, else (a launch killed before it was written) by its tag.
    async fn warm_instance(
        &self,
        warm: &WarmPaths,
        ctx: &Ctx,
    ) -> Result<Option<(Client, String, InstanceInfo)>> {
        if let Some(w) = read_json::<WarmInstance>(&instance_file(warm))? {
            let client = self.clients.client(&w.region).await;
            return Ok(instance::describe(&client, &w.instance, ctx)
                .await?
                .filter(|i| i.state != MachineState::Gone)
                .map(|i| (client, w.region, i)));
        }
        let region = self.clients.default_region().await?;
        let client = self.clients.client(&region).await;
        let mut found = instance::find(
            &client,
            vec![
                tag_filter(tag::WARM, &warm.id.to_string()),
                tag_filter(tag::SYSTEM, &self.system_id),
                instance::filter("instance-state-name", instance::LIVE_STATES),
            ],
            ctx,
        )
        .await
        .with_context(|| format!("looking for warm instance {}", warm.id))?;
        found.sort_by_key(|i| (i.launched_at, i.id.clone()));
        Ok(found.into_iter().next().map(|i| (client, region, i)))
    }

    /// Before an orphaned warm instance (listed, in no pool here) is
    /// terminated: it is still a warm instance of this runner manager, and
    /// no environment has taken it since it was listed.
    pub(super) fn verify_orphan_warm(&self, machine: &Machine, info: &InstanceInfo) -> Result<()> {
        let ours = info.tag(tag::SYSTEM) == Some(self.system_id.as_str())
            && info.tag(tag::MANAGED_BY) == Some(tag::MANAGED_BY_VALUE);
        if ours && info.tag(tag::ENV).is_none() && info.tag(tag::WARM) == machine.field(field::WARM)
        {
            return Ok(());
        }
        bail!(
            "refusing to terminate instance {}: it is no longer an untaken warm instance of this runner manager \
             (tags {}={:?}, {}={:?}); run `dormant sweep` again",
            info.id,
            tag::WARM,
            info.tag(tag::WARM),
            tag::ENV,
            info.tag(tag::ENV)
        )
    }

    /// Never acts on an instance that is not this warm machine: its
    /// `dormant:warm` tag names it, or (a hand-over killed after its first
    /// tag write) it is gone and the environment's tag is `env`'s.
    fn verify_warm(
        &self,
        warm: &WarmPaths,
        info: &InstanceInfo,
        env: Option<&EnvPaths>,
        doing: &str,
    ) -> Result<()> {
        let ours = info.tag(tag::SYSTEM) == Some(self.system_id.as_str())
            && info.tag(tag::MANAGED_BY) == Some(tag::MANAGED_BY_VALUE);
        let env_tag = info.tag(tag::ENV);
        let this_warm = match (info.tag(tag::WARM), env) {
            (Some(w), _) if w != warm.id.to_string() => false,
            // Before or during its hand-over to `e`.
            (Some(_), Some(e)) => env_tag.is_none_or(|t| t == e.id.to_string()),
            // Retiring: a hand-over killed between its two tag writes too.
            (Some(_), None) => true,
            // A hand-over retried after it finished.
            (None, Some(e)) => env_tag == Some(e.id.to_string().as_str()),
            (None, None) => false,
        };
        if ours && this_warm {
            return Ok(());
        }
        bail!(
            "refusing to {doing} instance {}: it is not warm instance {} of this runner manager (tags {}={:?}, \
             {}={:?}, {}={:?}); was the instance id in {} changed?",
            info.id,
            warm.id,
            tag::WARM,
            info.tag(tag::WARM),
            tag::ENV,
            env_tag,
            tag::SYSTEM,
            info.tag(tag::SYSTEM),
            instance_file(warm).display()
        )
    }
}

#[async_trait]
impl WarmMachines for Ec2Provider {
    fn wanted(&self) -> u32 {
        self.settings.warm
    }

    fn max_age(&self) -> Duration {
        self.settings.warm_max_age.get()
    }

    /// Counted as a job's launch counts (`ec2.max_environments`, this
    /// runner's instances, and in volume mode its data volumes alone): one
    /// DescribeInstances, asked only when a job found no ready warm instance
    /// to take or cannot take one.
    async fn job_must_wait(&self, ctx: &Ctx) -> Result<bool> {
        let max = self.settings.max_environments;
        // Settings refuse `warm` with `max_environments` but no `runner_id`;
        // without one there is no runner whose instances could be counted.
        let (true, Some(runner_id)) = (max > 0, self.runner_id.as_deref()) else {
            return Ok(false);
        };
        let region = self.clients.default_region().await?;
        let client = self.clients.client(&region).await;
        let cap = super::capacity::Capacity {
            client: &client,
            store: &self.store,
            runner_id,
            system_id: &self.system_id,
            max,
            count_volumes: self.settings.storage == crate::model::StorageMode::Volume,
        };
        Ok(cap.used(ctx).await? >= max as usize)
    }

    fn kind(&self) -> Result<WarmKind> {
        let s = &self.settings;
        let image = s
            .image
            .clone()
            .filter(|i| !i.trim().is_empty())
            .context("ec2.image is not set: warm instances are launched from it")?;
        // Everything a launch takes from the settings: a warm instance made
        // from anything else is retired, never handed out.
        let fingerprint = format!(
            "region={:?} image={image:?} owners={:?} types={:?} market={:?} on_demand_fallback={} subnets={:?} \
             security_groups={:?} ssh_user={} storage={:?} suspend_mode={:?} root={:?}/{:?}/{:?}/{:?} \
             profile={:?} tags={:?}",
            s.region,
            s.image_owners,
            self.default_types(),
            s.market,
            s.on_demand_fallback,
            s.subnets(),
            s.security_group_ids,
            s.ssh_user,
            s.storage,
            s.suspend_mode,
            s.root_volume_size_gb,
            s.root_volume_type,
            s.root_volume_encrypted,
            s.root_volume_kms_key_id,
            s.iam_instance_profile,
            s.tags,
        );
        Ok(WarmKind {
            fingerprint,
            made_from: format!("{} from {image}", self.default_types().join(" / ")),
        })
    }

    fn fits(&self, spec: &MachineSpec) -> bool {
        let default_image = image::choose(&self.settings, spec.image.as_deref())
            .is_ok_and(|(asked, _)| Some(&asked) == self.settings.image.as_ref());
        let default_types = spec
            .variables
            .get(INSTANCE_TYPE_VARIABLE)
            .is_none_or(|v| v.trim().is_empty());
        // Volume mode: a new environment takes its warm instance before its
        // volume exists (`takes_before_volume`), so its spec has none; a
        // spec with a volume is a resume's (`fits_resume`). Taken after a
        // new environment's volume, it would come on top of the instance
        // that volume was made beside (`volumes.rs`).
        default_image && default_types && spec.volume.is_none()
    }

    fn fits_resume(&self, spec: &MachineSpec) -> bool {
        let mut machine_spec = spec.clone();
        machine_spec.volume = None;
        self.fits(&machine_spec)
    }

    /// An EBS volume attaches only in its own zone: a new volume-mode
    /// environment takes a warm instance (of any zone) first, and its
    /// volume is made in that instance's zone.
    fn takes_before_volume(&self) -> bool {
        true
    }

    async fn zones(&self, ctx: &Ctx) -> Result<Vec<Option<String>>> {
        if self.settings.warm == 0 {
            // Nothing is wanted anywhere: no call.
            return Ok(Vec::new());
        }
        let region = self.clients.default_region().await?;
        let client = self.clients.client(&region).await;
        let all = subnets::with_zones(&client, &self.store, &region, &self.settings.subnets(), ctx)
            .await?;
        Ok(all.into_iter().map(|s| s.zone).collect())
    }

    async fn no_room(&self, ctx: &Ctx) -> Result<Option<String>> {
        let max = self.settings.max_environments;
        if max == 0 {
            return Ok(None);
        }
        // Not counted is not "no room": the refill reports it (a missing
        // ec2:DescribeInstances permission would otherwise stop every
        // refill in silence, `dormant warm` exiting 0).
        let cannot = || {
            format!(
                "cannot count this runner manager's instances, so no warm instance is launched (ec2.max_environments \
                 = {max} keeps the last slot for a job); dormant needs ec2:DescribeInstances"
            )
        };
        let region = self.clients.default_region().await.with_context(cannot)?;
        let client = self.clients.client(&region).await;
        let cap = self.warm_capacity(&client);
        let used = cap.used(ctx).await.with_context(cannot)?;
        Ok((used + 1 >= max as usize).then(|| {
            format!(
                "{used} of ec2.max_environments = {max} instances: a warm instance would take the last \
                 slot a job may need"
            )
        }))
    }

    async fn launch(
        &self,
        warm: &WarmPaths,
        zone: Option<&str>,
        ssh_public_key: &str,
        ctx: &Ctx,
    ) -> Result<Machine> {
        let ctx = self.bounded(ctx);
        let (client, region, id) = self.launch_warm(warm, zone, ssh_public_key, &ctx).await?;
        // A failure from here on is retired by the caller (found by the file).
        let info = wait_for(&client, &id, Want::Running, &ctx).await?;
        Ok(self
            .machine(&region, &info)?
            .with(field::INSTANCE_TYPES, self.default_types().join(",")))
    }

    async fn find_launched(&self, warm: &WarmPaths, ctx: &Ctx) -> Result<Option<Machine>> {
        Ok(self
            .warm_instance(warm, ctx)
            .await?
            .map(|(_, region, i)| Self::bare(&region, &i.id)))
    }

    async fn hand_over(
        &self,
        warm: &WarmPaths,
        machine: &Machine,
        env: &EnvPaths,
        ctx: &Ctx,
    ) -> Result<Machine> {
        let rec = crate::state::registry::peek(env)?
            .with_context(|| format!("environment {} has no record to hand over to", env.id))?;
        let (client, region) = self.client_for(machine).await?;
        let info = instance::describe(&client, &machine.id, ctx)
            .await?
            .filter(|i| i.state != MachineState::Gone)
            .with_context(|| format!("warm instance {} is gone", machine.id))?;
        self.verify_warm(warm, &info, Some(env), "hand over")?;
        let spec = MachineSpec {
            env_id: env.id,
            name: MachineSpec::machine_name(env.id),
            runner_id: rec.runner_id.clone(),
            system_id: rec.system_id.clone(),
            project_id: rec.project_id,
            job_id: rec.created_by_job,
            image: None,
            variables: Default::default(),
            ssh_public_key: None,
            paths: env.clone(),
            volume: None,
        };
        // The environment's tags first (a kill after this leaves both tags:
        // the retry finds it by the file or the warm tag and goes on).
        let tags = launch::tags(&spec, &self.settings);
        let borrowed: Vec<(&str, String)> =
            tags.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
        handover::set_tags(&client, &info.id, &borrowed, ctx).await?;
        crate::failpoint!("warm:ec2-tagged");
        call("DeleteTags", ctx, || {
            client
                .delete_tags()
                .resources(&info.id)
                .tags(Tag::builder().key(tag::WARM).build())
                .send()
        })
        .await
        .with_context(|| format!("removing tag {} from instance {}", tag::WARM, info.id))?;
        // The record's fields as the tags now say (not read back: EC2's
        // describe calls are eventually consistent).
        let mut m = self
            .machine(&region, &info)?
            .with(field::INSTANCE_TYPES, self.default_types().join(","));
        for (k, v) in [
            (field::ENV, env.id.to_string()),
            (field::RUNNER, rec.runner_id.clone()),
            (field::SYSTEM, rec.system_id.clone()),
            (field::EPOCH, handover::FIRST_EPOCH.to_string()),
        ] {
            m = m.with(k, v);
        }
        Ok(m)
    }

    async fn handed_over(&self, warm: &WarmPaths, env: &EnvPaths, ctx: &Ctx) -> Result<bool> {
        let Some(w) = read_json::<WarmInstance>(&instance_file(warm))? else {
            return Ok(false);
        };
        let client = self.clients.client(&w.region).await;
        Ok(instance::describe(&client, &w.instance, ctx)
            .await?
            .is_some_and(|i| {
                i.state != MachineState::Gone
                    && i.tag(tag::ENV) == Some(env.id.to_string().as_str())
                    && i.tag(tag::WARM).is_none()
            }))
    }

    fn zone_for(&self, spec: &MachineSpec) -> Option<String> {
        spec.volume
            .as_ref()
            .and_then(|v| v.field(super::volumes_find::vfield::ZONE))
            .map(str::to_string)
    }

    async fn retire(&self, warm: &WarmPaths, machine: Option<&Machine>, ctx: &Ctx) -> Result<()> {
        let found = match machine {
            Some(m) => {
                let (client, region) = self.client_for(m).await?;
                instance::describe(&client, &m.id, ctx)
                    .await?
                    .filter(|i| i.state != MachineState::Gone)
                    .map(|i| (client, region, i))
            }
            None => self.warm_instance(warm, ctx).await?,
        };
        let Some((client, _, info)) = found else {
            return Ok(()); // already gone (a spot interruption, an operator)
        };
        self.verify_warm(warm, &info, None, "terminate")?;
        terminate(&client, &info.id, ctx).await?;
        if let Some(r) = &self.runner_id {
            capacity::note_release(&self.store, r);
        }
        Ok(())
    }

    async fn alive(&self, _warm: &WarmPaths, machine: &Machine, ctx: &Ctx) -> Result<bool> {
        let (client, _) = self.client_for(machine).await?;
        // Not found, or in any state but running: a definite answer. An
        // error is returned as it is: a DescribeInstances outage must not
        // retire (terminate) a healthy instance.
        Ok(instance::describe(&client, &machine.id, ctx)
            .await
            .with_context(|| format!("asking EC2 whether warm instance {} still runs", machine.id))?
            .is_some_and(|i| i.state == MachineState::Running))
    }
}

#[cfg(test)]
#[path = "warm_tests.rs"]
mod tests;
