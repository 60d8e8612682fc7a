//! A new environment's instance: adopt what an earlier attempt of the same
//! prepare launched (found by tags), else launch one within capacity; a
//! failed create terminates what it launched.
//!
//! Volume mode: a machine for a data volume is launched in the subnet of the
//! volume's zone (an EBS volume attaches only there), without hibernation
//! (the machine is terminated on suspend), and an instance of the
//! environment found in another zone is terminated rather than adopted. A
//! new volume-mode environment's first machine is launched before its volume
//! (`volumes.rs`), anywhere there is capacity, and its volume made beside it.

use std::time::Duration;

use anyhow::{bail, Context, Result};
use aws_sdk_ec2::Client;

use super::capacity::{self, Capacity};
use super::image::{self, ImageResolver};
use super::instance::{self, tag, tag_filter, InstanceInfo};
use super::launch::{self, LaunchRequest};
use super::lifecycle::terminate;
use super::placement::{self, Rounds, Subnet};
use super::subnets;
use super::wait::{wait_for, Want};
use super::{field, Ec2Provider};
use crate::context::Ctx;
use crate::provider::{Machine, MachineSpec, MachineState, StorageMode};
use crate::settings::ec2::{Market, SuspendMode};

/// Where a launch may go.
#[derive(Debug, Clone)]
pub(super) enum Within {
    /// Any of the subnets (a new environment). `volume_mode`: its volume is
    /// made beside it next (no hibernation: the machine is never stopped).
    Anywhere { volume_mode: bool },
    /// The zone of a data volume: only the subnet there.
    VolumeZone(VolumePlace),
}

impl Within {
    fn zone(&self) -> Option<&str> {
        match self {
            Within::VolumeZone(p) => Some(&p.zone),
            Within::Anywhere { .. } => None,
        }
    }
}

/// What a create launches (or adopts): checked against the allow-lists.
struct What<'a> {
    spec: &'a MachineSpec,
    within: &'a Within,
    instance_types: &'a [String],
    image_request: &'a str,
}

/// Where a data volume is: its region, zone, and the subnet of that zone.
#[derive(Debug, Clone)]
pub(super) struct VolumePlace {
    pub region: String,
    pub zone: String,
    pub subnet: Subnet,
}

/// Terminating what a failed prepare launched gets at most this long.
const ABANDON_BUDGET: Duration = Duration::from_secs(60);

impl Ec2Provider {
    pub(super) async fn create(&self, spec: &MachineSpec, ctx: &Ctx) -> Result<Machine> {
        let within = match &spec.volume {
            Some(v) => Within::VolumeZone(self.volume_place(v, ctx).await?),
            None => Within::Anywhere { volume_mode: false },
        };
        self.create_within(spec, within, ctx).await
    }

    /// [`Self::create`] where `within` says.
    pub(super) async fn create_within(
        &self,
        spec: &MachineSpec,
        within: Within,
        ctx: &Ctx,
    ) -> Result<Machine> {
        let ctx = self.bounded(ctx);
        // Allow-lists first: a refusal does not depend on what exists in EC2.
        let instance_types = self.instance_types(spec)?;
        let (image_request, note) = image::choose(&self.settings, spec.image.as_deref())?;
        if let Some(note) = note {
            ctx.log.warn(note);
        }
        if matches!(within, Within::Anywhere { volume_mode: false }) {
            launch::check_tags_for_metadata(&self.settings)?;
        }
        let region = match &within {
            Within::VolumeZone(place) => place.region.clone(),
            Within::Anywhere { .. } => self.clients.default_region().await?,
        };
        let client = self.clients.client(&region).await;
        let what = What {
            spec,
            within: &within,
            instance_types: &instance_types,
            image_request: &image_request,
        };
        let result = self.reclaim_or_launch(&client, &region, &what, &ctx).await;
        if result.is_err() {
            self.abandon(&client, spec, &ctx).await;
        }
        result
    }

    /// Brings an adopted or resumed instance to running, whatever its state.
    pub(super) async fn bring_up(
        &self,
        client: &Client,
        info: InstanceInfo,
        ctx: &Ctx,
    ) -> Result<InstanceInfo> {
        match info.state {
            MachineState::Running => Ok(info),
            MachineState::Pending => wait_for(client, &info.id, Want::Running, ctx).await,
            MachineState::Stopped => {
                self.start_call(client, &info.id, ctx).await?;
                wait_for(client, &info.id, Want::Running, ctx).await
            }
            MachineState::Stopping => {
                wait_for(client, &info.id, Want::Stopped, ctx).await?;
                {
                    self.start_call(client, &info.id, ctx).await?;
                    wait_for(client, &info.id, Want::Running, ctx).await
                }
            }
            MachineState::Gone => bail!("instance {} is {}", info.id, info.state_name),
            MachineState::Other(_) => wait_for(client, &info.id, Want::Running, ctx).await,
        }
    }

    async fn reclaim_or_launch(
        &self,
        client: &Client,
        region: &str,
        what: &What<'_>,
        ctx: &Ctx,
    ) -> Result<Machine> {
        let (spec, within, instance_types) = (what.spec, what.within, what.instance_types);
        // Only a machine-mode instance is ever stopped and started again, so
        // only it needs a way back in for a new host (`handover.rs`).
        let machine_mode = matches!(within, Within::Anywhere { volume_mode: false });
        let mut found = instance::find(
            client,
            vec![
                tag_filter(tag::ENV, &spec.env_id.to_string()),
                tag_filter(tag::SYSTEM, &spec.system_id),
            ],
            ctx,
        )
        .await
        .context("looking for an instance an earlier attempt of this prepare made")?;
        found.sort_by_key(|i| (i.launched_at, i.id.clone()));
        let generation = found
            .iter()
            .filter(|i| i.state == MachineState::Gone)
            .count();
        let mut live: Vec<InstanceInfo> = Vec::new();
        for i in found.into_iter().filter(|i| i.state != MachineState::Gone) {
            match within.zone() {
                Some(z) if i.zone.as_deref() != Some(z) => {
                    // It cannot take the volume: never adopted, never left running.
                    ctx.log.warn(format!(
                        "terminating instance {} of environment {}: it is in zone {}, but the environment's \
                         data volume is in {z}",
                        i.id,
                        spec.env_id,
                        i.zone.as_deref().unwrap_or("?")
                    ));
                    terminate(client, &i.id, ctx).await?;
                }
                _ => live.push(i),
            }
        }
        let mut live = live.into_iter();
        if let Some(first) = live.next() {
            ctx.log.info(format!(
                "adopting instance {} ({}) already launched for this environment (by an earlier attempt of \
                 this prepare, or in volume mode by this prepare's volume step to choose the zone)",
                first.id, first.state_name
            ));
            for extra in live {
                ctx.log.warn(format!(
                    "terminating instance {}: a duplicate launch for environment {}",
                    extra.id, spec.env_id
                ));
                terminate(client, &extra.id, ctx).await?;
            }
            let info = self.bring_up(client, first, ctx).await?;
            return Ok(self
                .machine(region, &info)?
                .with(field::INSTANCE_TYPES, instance_types.join(",")));
        }

        let image = ImageResolver {
            store: &self.store,
            settings: &self.settings,
            region,
        }
        .resolve(client, what.image_request, ctx)
        .await?;
        let req = LaunchRequest {
            spec,
            tags: launch::tags(spec, &self.settings),
            settings: &self.settings,
            image: &image,
            client_token: match within {
                Within::Anywhere { volume_mode: false } => launch::client_token(spec, generation),
                // Every resume of a volume-mode environment launches: a token
                // of its own each time (EC2 answers a token it saw before with
                // that launch's instance, terminated long ago). Retries inside
                // this call share it; a retried prepare finds its launch by tags.
                _ => launch::fresh_token(),
            },
            user_data: if machine_mode {
                launch::machine_user_data(spec, &self.settings)?
            } else {
                launch::user_data(spec, &self.settings)?
            },
            hibernate: machine_mode && self.settings.suspend_mode == SuspendMode::Hibernate,
            entry_tags: if machine_mode {
                launch::entry_tags(spec)?
            } else {
                Vec::new()
            },
        };
        let subnets = match within {
            Within::VolumeZone(place) => vec![place.subnet.clone()],
            Within::Anywhere { .. } => self.subnets(client, region, ctx).await?,
        };
        let choices = placement::choices(
            instance_types,
            &subnets,
            self.settings.market,
            self.settings.on_demand_fallback,
        );
        let cap = Capacity {
            client,
            store: &self.store,
            runner_id: &spec.runner_id,
            system_id: &spec.system_id,
            max: self.settings.max_environments,
            count_volumes: self.settings.storage == StorageMode::Volume,
        };
        let rounds = Rounds::default();
        let launched = cap
            .launch_when_free(ctx, || {
                rounds.try_round(&choices, ctx, |k| {
                    launch::run_instance(client, &req, &choices[k], k, ctx)
                })
            })
            .await
            .with_context(|| {
                format!(
                    "launching a {} instance from {} in {} (subnet {})",
                    instance_types.join(" / "),
                    image.image_id,
                    region,
                    subnets
                        .iter()
                        .map(|s| s.id.as_str())
                        .collect::<Vec<_>>()
                        .join(" / ")
                )
            })?;
        let (id, choice) = (&launched.id, &launched.choice);
        ctx.log.info(format!(
            "launched instance {id} ({}{}, image {}{}) in {region}{}",
            choice.instance_type,
            if choice.market == Market::Spot {
                ", spot"
            } else {
                ""
            },
            image.image_id,
            image
                .name
                .as_deref()
                .map(|n| format!(" {n}"))
                .unwrap_or_default(),
            if subnets.len() > 1 {
                format!(", subnet {}", choice.subnet)
            } else {
                String::new()
            }
        ));
        let info = wait_for(client, id, Want::Running, ctx).await?;
        let mut machine = self
            .machine(region, &info)?
            .with(field::INSTANCE_TYPES, instance_types.join(","));
        if let Some(gib) = self.settings.root_volume_size_gb.or(image.root_volume_gib) {
            machine = machine.with(field::ROOT_GIB, gib.to_string());
        }
        Ok(machine)
    }

    /// The subnets a new environment may start in; with more than one, their
    /// zones (cached for good: `subnets.rs`). One subnet needs no lookup.
    pub(super) async fn subnets(
        &self,
        client: &Client,
        region: &str,
        ctx: &Ctx,
    ) -> Result<Vec<Subnet>> {
        let ids = self.settings.subnets();
        if ids.len() < 2 {
            return Ok(ids
                .into_iter()
                .map(|id| Subnet { id, zone: None })
                .collect());
        }
        subnets::with_zones(client, &self.store, region, &ids, ctx).await
    }

    /// After a failed create: terminate whatever this environment launched (it
    /// is new, never suspended), so a failed prepare leaks no instance.
    async fn abandon(&self, client: &Client, spec: &MachineSpec, ctx: &Ctx) {
        // A fresh budget: the prepare's own deadline may be what just ran out, and
        // a termination signal must not stop the clean-up of what it launched.
        let ctx = Ctx::new(ctx.log.clone(), Default::default(), ABANDON_BUDGET);
        let found = instance::find(
            client,
            vec![
                tag_filter(tag::ENV, &spec.env_id.to_string()),
                tag_filter(tag::SYSTEM, &spec.system_id),
            ],
            &ctx,
        )
        .await;
        match found {
            Ok(list) => {
                for i in list.into_iter().filter(|i| i.state != MachineState::Gone) {
                    ctx.log.info(format!(
                        "terminating instance {} launched by this failed prepare",
                        i.id
                    ));
                    let done = terminate(client, &i.id, &ctx).await;
                    if done.is_ok() {
                        capacity::note_release(&self.store, &spec.runner_id);
                    }
                    if let Err(e) = done {
                        ctx.log.warn(format!(
                            "could not terminate instance {}: {e:#}; `dormant sweep` lists it as an orphan",
                            i.id
                        ));
                    }
                }
            }
            Err(e) => tracing::debug!("looking for instances to abandon: {e:#}"),
        }
    }
}
