//! What a warm instance is launched as (`warm.rs` is the rest of warm
//! instances): an environment's instance from today's settings — the image,
//! the default instance types, the market, the subnet of its zone, the
//! user-data with the warm machine's own key (machine mode: the way back in
//! for a replacement host too) — with the warm tags instead of an
//! environment's, in one round over the placement choices under
//! `max_environments` less one. The instance id is kept beside the pool
//! entry (`warm/<id>/ec2-instance.json`) as soon as RunInstances answers.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use aws_sdk_ec2::Client;
use serde::{Deserialize, Serialize};

use super::capacity::Capacity;
use super::image::{self, ImageResolver};
use super::instance::tag;
use super::launch::{self, LaunchRequest};
use super::placement::{self, Rounds};
use super::{subnets, Ec2Provider};
use crate::context::Ctx;
use crate::model::StorageMode;
use crate::provider::MachineSpec;
use crate::settings::ec2::SuspendMode;
use crate::state::pool::WarmPaths;
use crate::state::store::{write_json, FORMAT_VERSION};

/// Where a warm instance is (written right after RunInstances answered).
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct WarmInstance {
    pub version: u32,
    pub region: String,
    pub instance: String,
}

pub(super) fn instance_file(warm: &WarmPaths) -> PathBuf {
    warm.dir.join("ec2-instance.json")
}

/// A warm instance's `Name`.
fn warm_name(warm: &WarmPaths) -> String {
    format!("dormant-warm-{}", warm.id.simple())
}

impl Ec2Provider {
    /// A machine-mode instance needs the way back in for a replacement host
    /// (`handover.rs`); a volume-mode one never stops.
    pub(super) fn warm_machine_mode(&self) -> bool {
        self.settings.storage == StorageMode::Machine
    }

    /// What a warm instance is launched as: an environment's spec with the
    /// warm id for the environment's (user-data, ClientToken) and no job.
    pub(super) fn warm_spec(&self, warm: &WarmPaths, ssh_public_key: &str) -> MachineSpec {
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
    pub(super) fn warm_tags(&self, warm: &WarmPaths) -> Vec<(String, String)> {
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
    pub(super) fn warm_capacity<'a>(&'a self, client: &'a Client) -> Capacity<'a> {
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
    pub(super) fn default_types(&self) -> Vec<String> {
        let mut types = vec![self.settings.instance_type.clone()];
        types.extend(self.settings.fallback_instance_types.iter().cloned());
        types
    }

    /// RunInstances for a warm instance in `zone`'s subnet: one round over
    /// the placement choices, under `max_environments` less one; no wait for
    /// capacity (nobody waits for a warm instance).
    pub(super) async fn launch_warm(
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
}
