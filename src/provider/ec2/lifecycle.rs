//! Resume (start), suspend (stop or hibernate) and release (terminate) of
//! an environment's instance, each after checking the instance's tags.
//!
//! Resume is tuned for a person waiting: right after StartInstances two
//! waits run side by side, the instance's state (DescribeInstances once a
//! second, the first at once) and, where the address is known before the
//! instance runs (private IP, `connect_address`), sshd's banner every 200 ms.
//! Whichever says "log in now" first ends the resume. A public address is
//! new at every start: the state polls re-read it, and the banner probes
//! start on it as soon as a describe shows it, which on EC2 is usually while
//! the instance is still pending (no extra API call: the same polls).

use anyhow::{bail, Context, Result};
use aws_sdk_ec2::Client;

use super::call::call;
use super::capacity::{self, retry_capacity};
use super::errors::{api_error, is_not_found};
use super::handover;
use super::instance;
use super::instance::InstanceInfo;
use super::wait::{wait_for, wait_for_seeing, StoppedForCapacity, Want};
use super::{field, Ec2Provider};
use crate::context::Ctx;
use crate::provider::{Machine, MachineGone, MachineState, Suspended};
use crate::settings::ec2::SuspendMode;
use crate::transport::ssh::ready;

impl Ec2Provider {
    /// StartInstances, waiting out capacity errors.
    pub(super) async fn start_call(&self, client: &Client, id: &str, ctx: &Ctx) -> Result<()> {
        retry_capacity(ctx, || async {
            call("StartInstances", ctx, || {
                client.start_instances().instance_ids(id).send()
            })
            .await
            .map(|_| ())
        })
        .await
        .with_context(|| format!("starting instance {id}"))
    }

    pub(super) async fn resume(&self, machine: &Machine, ctx: &Ctx) -> Result<Machine> {
        let ctx = self.bounded(ctx);
        let ctx = &ctx;
        let (client, region) = self.client_for(machine).await?;
        let id = &machine.id;
        let Some(info) = instance::describe(&client, id, ctx).await? else {
            return Err(MachineGone(format!(
                "instance {id} no longer exists in {region}: the environment's disk is gone"
            ))
            .into());
        };
        self.verify_tags(machine, &info, "start")?;
        ctx.log
            .info(format!("starting instance {id} ({})", info.state_name));
        match info.state {
            MachineState::Gone => {
                return Err(MachineGone(format!(
                    "instance {id} is {}: the environment's disk is gone",
                    info.state_name
                ))
                .into())
            }
            MachineState::Running => return self.refreshed(machine, &region, &info),
            MachineState::Stopped => {
                return self
                    .start_stopped(&client, &region, machine, info, ctx)
                    .await;
            }
            MachineState::Stopping => {
                let info = wait_for(&client, id, Want::Stopped, ctx).await?;
                return self
                    .start_stopped(&client, &region, machine, info, ctx)
                    .await;
            }
            MachineState::Pending | MachineState::Other(_) => {}
        }
        self.until_reachable(&client, &region, machine, ctx).await
    }

    /// Starts a stopped instance and waits until SSH may log in. A start EC2
    /// accepted that ends with the instance stopped again for lack of
    /// capacity ([`StoppedForCapacity`]) is started again as the
    /// environment's next instance type (`retype.rs`): each type at most
    /// once, so at most as many starts as the environment has types.
    async fn start_stopped(
        &self,
        client: &Client,
        region: &str,
        machine: &Machine,
        mut info: InstanceInfo,
        ctx: &Ctx,
    ) -> Result<Machine> {
        let id = &machine.id;
        let mut tried: Vec<String> = Vec::new();
        loop {
            let started_as = self
                .start_any_type(client, machine, &info, &tried, ctx)
                .await?;
            let started = self
                .until_reachable(client, region, &as_type(machine, started_as.clone()), ctx)
                .await;
            let Err(e) = started else {
                return started;
            };
            let Some(stopped) = e.downcast_ref::<StoppedForCapacity>().cloned() else {
                return Err(e);
            };
            ctx.log.warn(format!(
                "{stopped}; EC2 accepted the start but had no room for it: starting it as another \
                 of the environment's instance types"
            ));
            tried.push(started_as.unwrap_or(stopped.instance_type));
            info = match instance::describe(client, id, ctx).await? {
                Some(info) => info,
                None => {
                    return Err(MachineGone(format!(
                        "instance {id} no longer exists in {region}: the environment's disk is gone"
                    ))
                    .into())
                }
            };
        }
    }

    /// After a start: the machine once SSH may log in to it.
    async fn until_reachable(
        &self,
        client: &Client,
        region: &str,
        machine: &Machine,
        ctx: &Ctx,
    ) -> Result<Machine> {
        let id = &machine.id;
        if !self.address_is_stable() {
            return self
                .until_reachable_at_a_new_address(client, region, machine, ctx)
                .await;
        }
        let running = wait_for(client, id, Want::Running, ctx);
        let target = self.ssh_target(machine)?;
        let dest = format!("{}:{} (instance {id})", target.host, target.port);
        let answers = ready::wait_for_banner(ctx, &dest, &target.host, target.port);
        tokio::select! {
            info = running => self.refreshed(machine, region, &info?),
            answered = answers => {
                answered?;
                ctx.log.info(format!(
                    "instance {id} answers SSH on {dest} before EC2 reports it running: logging in now"
                ));
                Ok(machine.clone())
            }
        }
    }

    /// A public address: the first describe after the start that shows one
    /// starts the banner probes on it, beside the state polls. The old
    /// address is never probed: EC2 released it at the stop and may have
    /// given it to someone else (the pinned host key would refuse it anyway).
    async fn until_reachable_at_a_new_address(
        &self,
        client: &Client,
        region: &str,
        machine: &Machine,
        ctx: &Ctx,
    ) -> Result<Machine> {
        let id = &machine.id;
        let (shown, mut address) = tokio::sync::watch::channel::<Option<InstanceInfo>>(None);
        let note = |info: &InstanceInfo| {
            if info.public_ip.is_some() && shown.borrow().is_none() {
                shown.send_replace(Some(info.clone()));
            }
        };
        let running = wait_for_seeing(client, id, Want::Running, ctx, &note);
        let answers = async {
            let info = loop {
                if let Some(info) = address.borrow_and_update().clone() {
                    break info;
                }
                // The sender lives as long as this function.
                let _ = address.changed().await;
            };
            let fresh = self.refreshed(machine, region, &info)?;
            let target = self.ssh_target(&fresh)?;
            let dest = format!("{}:{} (instance {id})", target.host, target.port);
            ready::wait_for_banner(ctx, &dest, &target.host, target.port).await?;
            ctx.log.info(format!(
                "instance {id} answers SSH at its new address {dest} while EC2 still says {}: logging in now",
                info.state_name
            ));
            Ok::<_, anyhow::Error>(fresh)
        };
        tokio::select! {
            info = running => self.refreshed(machine, region, &info?),
            fresh = answers => fresh,
        }
    }

    /// The machine with what the instance says now (a new public address),
    /// keeping what the record knew that the instance does not say.
    fn refreshed(
        &self,
        machine: &Machine,
        region: &str,
        info: &super::instance::InstanceInfo,
    ) -> Result<Machine> {
        let mut fresh = self.machine(region, info)?;
        for (k, v) in &machine.fields {
            fresh.fields.entry(k.clone()).or_insert_with(|| v.clone());
        }
        Ok(fresh)
    }

    /// Stops (or hibernates) the instance; says whether its memory was kept.
    /// An instance already stopped was stopped by an earlier suspension,
    /// whose outcome was said then.
    pub(super) async fn suspend(&self, machine: &Machine, ctx: &Ctx) -> Result<Suspended> {
        let (client, region) = self.client_for(machine).await?;
        let id = &machine.id;
        let Some(info) = instance::describe(&client, id, ctx).await? else {
            bail!("instance {id} no longer exists in {region}: nothing to suspend");
        };
        self.verify_tags(machine, &info, "stop")?;
        match info.state {
            MachineState::Stopped => return Ok(Suspended::kept()),
            MachineState::Stopping => {
                wait_for(&client, id, Want::Stopped, ctx).await?;
                return Ok(Suspended::kept());
            }
            MachineState::Gone => bail!("instance {id} is {}: nothing to suspend", info.state_name),
            MachineState::Pending => {
                wait_for(&client, id, Want::Running, ctx).await?;
            }
            _ => {}
        }
        self.note_suspended(&client, id, ctx).await;
        let hibernate = self.settings.suspend_mode == SuspendMode::Hibernate;
        ctx.log.info(format!(
            "{} instance {id}",
            if hibernate { "hibernating" } else { "stopping" }
        ));
        let stop = |hibernate: bool| {
            let client = &client;
            call("StopInstances", ctx, move || {
                client
                    .stop_instances()
                    .instance_ids(id)
                    .hibernate(hibernate)
                    .send()
            })
        };
        let mut suspended = if hibernate {
            Suspended::kept()
        } else {
            Suspended::lost("ec2.suspend_mode = \"stop\": the instance was stopped")
        };
        match stop(hibernate).await {
            Ok(_) => {}
            Err(e)
                if hibernate
                    && api_error(&e)
                        .and_then(|a| a.code.as_deref())
                        .is_some_and(|c| {
                            c == "UnsupportedHibernationConfiguration"
                                || c == "UnsupportedOperation"
                        }) =>
            {
                // The disk is what a suspended job needs; losing RAM is acceptable.
                ctx.log.warn(format!(
                    "instance {id} cannot hibernate ({e:#}); stopping it instead (disk kept, memory lost)"
                ));
                stop(false)
                    .await
                    .with_context(|| format!("stopping instance {id}"))?;
                suspended = Suspended::lost(format!(
                    "instance {id} could not hibernate ({}), so it was stopped instead: its memory \
                     was lost",
                    api_error(&e)
                        .and_then(|a| a.code.as_deref())
                        .unwrap_or("refused")
                ));
            }
            Err(e)
                if api_error(&e).and_then(|a| a.code.as_deref())
                    == Some("IncorrectInstanceState") =>
            {
                tracing::debug!("StopInstances on {id}: {e:#}; waiting for it to stop anyway");
            }
            Err(e) => return Err(e).with_context(|| format!("stopping instance {id}")),
        }
        wait_for(&client, id, Want::Stopped, ctx).await?;
        Ok(suspended)
    }

    /// The suspension time on the instance (before it is stopped) or the
    /// data volume (once it is detached): a host that takes the environment
    /// over keeps it for the TTL (`handover.rs`). A failure is a warning:
    /// the suspension itself matters more, and a take-over without the tag
    /// counts the TTL from the take-over.
    pub(super) async fn note_suspended(&self, client: &Client, resource: &str, ctx: &Ctx) {
        let now = crate::state::now_unix().to_string();
        if let Err(e) =
            handover::set_tags(client, resource, &[(handover::tag::SUSPENDED_AT, now)], ctx).await
        {
            ctx.log.warn(format!(
                "could not record the suspension time on {resource} ({e:#}): a runner-manager host that \
                 takes this environment over counts its TTL from the take-over"
            ));
        }
    }

    pub(super) async fn release(&self, machine: &Machine, ctx: &Ctx) -> Result<()> {
        let (client, region) = self.client_for(machine).await?;
        let id = &machine.id;
        let Some(info) = instance::describe(&client, id, ctx).await? else {
            ctx.log
                .info(format!("instance {id} is already gone from {region}"));
            return Ok(());
        };
        if info.state == MachineState::Gone {
            return Ok(());
        }
        if machine.field(field::ENV).is_none() && machine.field(field::WARM).is_some() {
            // An orphaned warm instance (`dormant sweep --delete-orphans`).
            self.verify_orphan_warm(machine, &info)?;
        } else {
            self.verify_tags(machine, &info, "terminate")?;
        }
        ctx.log.info(format!("terminating instance {id}"));
        terminate(&client, id, ctx).await?;
        if let Some(runner) = machine.field(field::RUNNER) {
            capacity::note_release(&self.store, runner);
        }
        Ok(())
    }
}

/// The machine with the instance type it was started as (a resume may have
/// changed it: `retype.rs`).
fn as_type(machine: &Machine, started_as: Option<String>) -> Machine {
    match started_as {
        Some(t) => machine.clone().with(field::INSTANCE_TYPE, t),
        None => machine.clone(),
    }
}

pub(super) async fn terminate(client: &Client, id: &str, ctx: &Ctx) -> Result<()> {
    match call("TerminateInstances", ctx, || {
        client.terminate_instances().instance_ids(id).send()
    })
    .await
    {
        Ok(_) => Ok(()),
        Err(e) if is_not_found(&e) => Ok(()),
        Err(e) => Err(e).with_context(|| format!("terminating instance {id}")),
    }
}
