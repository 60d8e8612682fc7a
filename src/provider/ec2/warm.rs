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
//! See docs/ec2.md, "Warm instances".

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use async_trait::async_trait;
use aws_sdk_ec2::types::Tag;
use aws_sdk_ec2::Client;
use serde::{Deserialize, Serialize};

use super::call::call;
use super::capacity::{self, Capacity};
use super::image::{self, ImageResolver};
use super::instance::{self, tag, tag_filter, InstanceInfo};
use super::launch::{self, LaunchRequest};
use super::lifecycle::terminate;
use super::placement::{self, Rounds};
use super::wait::{wait_for, Want};
use super::{field, handover, subnets, Ec2Provider};
use crate::context::Ctx;
use crate::model::{EnvPaths, Machine, StorageMode};
use crate::provider::warm::{WarmKind, WarmMachines};
use crate::provider::{MachineSpec, MachineState};
use crate::settings::ec2::{SuspendMode, INSTANCE_TYPE_VARIABLE};
use crate::state::pool::WarmPaths;
use crate::state::store::{read_json, write_json, FORMAT_VERSION};

/// Where a warm instance is (written right after RunInstances answered).
#[derive(Debug, Serialize, Deserialize)]
struct WarmInstance {
    version: u32,
    region: String,
    instance: String,
}

fn instance_file(warm: &WarmPaths) -> PathBuf {
    warm.dir.join("ec2-instance.json")
}

/// A warm instance's `Name`.
fn warm_name(warm: &WarmPaths) -> String {
    format!("dormant-warm-{}", warm.id.simple())
}

impl Ec2Provider {
    /// The machine of a warm instance known only by id (its fields come
    /// with the hand-over).
    fn bare(region: &str, id: &str) -> Machine {
        Machine::new(id).with(field::REGION, region)
    }

    /// A machine-mode instance needs the way back in for a replacement host
    /// (`handover.rs`); a volume-mode one never stops.
    fn warm_machine_mode(&self) -> bool {
        self.settings.storage == StorageMode::Machine
    }

    /// What a warm instance is launched as: an environment's spec with the
    /// warm id for the environment's (user-data, ClientToken) and no job.
    fn warm_spec(&self, warm: &WarmPaths, ssh_public_key: &str) -> MachineSpec {
        MachineSpec {
            env_id: warm.id,
            name: warm_name(warm),
            runner_id: self.runner_id.clone().unwrap_or_default(),
            system_id: self.system_id.clone(),
            project_id: 0,
            job_id: 0,
            image: None,
            variables: Default::default(),
            ssh_public_key: Some(ssh_public_key.to_string()),
            paths: warm.paths.clone(),
            volume: None,
        }
    }

    /// The tags of a warm instance and its root volume: `dormant:*` without
    /// `dormant:env` (it is no environment's yet), plus `dormant:warm`.
    fn warm_tags(&self, warm: &WarmPaths) -> Vec<(String, String)> {
        let mut t: Vec<(String, String)> = vec![
            ("Name".into(), warm_name(warm)),
            (tag::MANAGED_BY.into(), tag::MANAGED_BY_VALUE.into()),
            (tag::SYSTEM.into(), self.system_id.clone()),
            (tag::WARM.into(), warm.id.to_string()),
        ];
        if let Some(r) = &self.runner_id {
            // Counted toward this runner's max_environments.
            t.push((tag::RUNNER.into(), r.clone()));
        }
        t.extend(
            self.settings
                .tags
                .iter()
                .map(|(k, v)| (k.clone(), v.clone())),
        );
        t
    }

    /// `max_environments` as it applies to warm instances: one slot fewer,
    /// so a refill never takes the last one a job may need.
    fn warm_capacity<'a>(&'a self, client: &'a Client) -> Capacity<'a> {
        let max = self.settings.max_environments;
        Capacity {
            client,
            store: &self.store,
            runner_id: self.runner_id.as_deref().unwrap_or_default(),
            system_id: &self.system_id,
            max: if max == 0 {
                0
            } else {
                max.saturating_sub(1).max(1)
            },
            count_volumes: self.settings.storage == StorageMode::Volume,
        }
    }

    /// The default instance types (what a job that names none gets).
    fn default_types(&self) -> Vec<String> {
        let mut types = vec![self.settings.instance_type.clone()];
        types.extend(self.settings.fallback_instance_types.iter().cloned());
        types
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

    /// RunInstances for a warm instance in `zone`'s subnet: one round over
    /// the placement choices, under `max_environments` less one; no wait for
    /// capacity (nobody waits for a warm instance).
    async fn launch_warm(
        &self,
        warm: &WarmPaths,
        zone: Option<&str>,
        ssh_public_key: &str,
        ctx: &Ctx,
    ) -> Result<(Client, String, String)> {
        let region = self.clients.default_region().await?;
        let client = self.clients.client(&region).await;
        let machine_mode = self.warm_machine_mode();
        if machine_mode {
            launch::check_tags_for_metadata(&self.settings)?;
        }
        let spec = self.warm_spec(warm, ssh_public_key);
        let (image_request, _) = image::choose(&self.settings, None)?;
        let image = ImageResolver {
            store: &self.store,
            settings: &self.settings,
            region: &region,
        }
        .resolve(&client, &image_request, ctx)
        .await?;
        let all = subnets::with_zones(&client, &self.store, &region, &self.settings.subnets(), ctx)
            .await?;
        let subnets = match zone {
            Some(z) => vec![subnets::in_zone(&all, z)
                .cloned()
                .with_context(|| format!("no subnet of ec2.subnet_ids is in zone {z}"))?],
            None => all,
        };
        let req = LaunchRequest {
            spec: &spec,
            tags: self.warm_tags(warm),
            client_token: launch::fresh_token(),
            user_data: if machine_mode {
                launch::machine_user_data(&spec, &self.settings)?
            } else {
                launch::user_data(&spec, &self.settings)?
            },
            hibernate: machine_mode && self.settings.suspend_mode == SuspendMode::Hibernate,
            entry_tags: if machine_mode {
                // The warm machine's key: it moves to the environment that takes it.
                launch::entry_tags(&spec)?
            } else {
                Vec::new()
            },
            image: &image,
            settings: &self.settings,
        };
        let types = self.default_types();
        let choices = placement::choices(
            &types,
            &subnets,
            self.settings.market,
            self.settings.on_demand_fallback,
        );
        let rounds = Rounds::default();
        let launched = self
            .warm_capacity(&client)
            .launch_once(ctx, || {
                rounds.try_round(&choices, ctx, |k| {
                    launch::run_instance(&client, &req, &choices[k], k, ctx)
                })
            })
            .await
            .with_context(|| format!("launching warm instance {} in {region}", warm.id))?;
        let launched = match launched {
            Ok(l) => l,
            Err(reason) => bail!(
                "no warm instance launched in {}: {reason}",
                zone.unwrap_or(&region)
            ),
        };
        write_json(
            &instance_file(warm),
            &WarmInstance {
                version: FORMAT_VERSION,
                region: region.clone(),
                instance: launched.id.clone(),
            },
        )?;
        ctx.log.info(format!(
            "launched warm instance {} ({}, image {}) in {}",
            launched.id,
            launched.choice.instance_type,
            image.image_id,
            launched
                .choice
                .subnet
                .zone
                .as_deref()
                .unwrap_or(&launched.choice.subnet.id)
        ));
        Ok((client, region, launched.id))
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
        // Volume mode: a new environment's first instance is launched before
        // its volume (`volumes.rs`), so a warm one taken after would leave
        // that instance running; and a resume does not take warm ones yet.
        default_image && default_types && spec.volume.is_none()
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

    async fn no_room(&self, ctx: &Ctx) -> Option<String> {
        let max = self.settings.max_environments;
        if max == 0 {
            return None;
        }
        let region = match self.clients.default_region().await {
            Ok(r) => r,
            Err(e) => return Some(format!("cannot count instances: {e:#}")),
        };
        let client = self.clients.client(&region).await;
        let cap = self.warm_capacity(&client);
        match cap.used(ctx).await {
            Ok(used) if used + 1 >= max as usize => Some(format!(
                "{used} of ec2.max_environments = {max} instances: a warm instance would take the last \
                 slot a job may need"
            )),
            Ok(_) => None,
            Err(e) => Some(format!("cannot count instances: {e:#}")),
        }
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
            .and_then(|v| v.field(super::volumes::vfield::ZONE))
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

    async fn alive(&self, _warm: &WarmPaths, machine: &Machine, ctx: &Ctx) -> bool {
        let Ok((client, _)) = self.client_for(machine).await else {
            return false;
        };
        match instance::describe(&client, &machine.id, ctx).await {
            Ok(Some(i)) => i.state == MachineState::Running,
            Ok(None) => false,
            Err(e) => {
                // Not handed out on a guess; the next refill asks again.
                tracing::debug!("describing warm instance {}: {e:#}", machine.id);
                false
            }
        }
    }
}
