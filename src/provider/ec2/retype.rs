//! A resume (machine mode) whose instance type has no capacity in the
//! instance's zone: the zone cannot change (the disk is there), but the type
//! of a stopped instance can. When the environment was made with more than
//! one instance type (`instance_types` field: `ec2.instance_type` and
//! `ec2.fallback_instance_types`, or the job's list), each round of the
//! capacity wait tries StartInstances as the current type, then changes the
//! type (ModifyInstanceAttribute) to each other one in order and tries again.
//! The instance keeps the type it started as.
//!
//! EC2 may also accept the StartInstances and then stop the instance again
//! for lack of capacity (state reason `Server.InsufficientInstanceCapacity`).
//! The resume (`lifecycle.rs`) then calls [`Ec2Provider::start_any_type`]
//! again with that type left out (`tried`), so the next type is set and
//! started; each type is left out at most once per resume, so this ends.
//!
//! Not for a hibernated instance: its saved memory belongs to the hardware it
//! was taken on, and EC2 does not let its type change.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;

use anyhow::{Context, Result};
use aws_sdk_ec2::types::AttributeValue;
use aws_sdk_ec2::Client;

use super::call::call;
use super::capacity;
use super::errors::capacity_reason;
use super::field;
use super::instance::InstanceInfo;
use super::Ec2Provider;
use crate::context::Ctx;
use crate::provider::Machine;
use crate::settings::ec2::SuspendMode;

impl Ec2Provider {
    /// Starts a stopped instance, trying the environment's other instance
    /// types when its own has no capacity. Returns the type it started as.
    /// `tried`: types a start was accepted as in this resume, but the
    /// instance stopped again for lack of capacity: not tried again.
    pub(super) async fn start_any_type(
        &self,
        client: &Client,
        machine: &Machine,
        info: &InstanceInfo,
        tried: &[String],
        ctx: &Ctx,
    ) -> Result<Option<String>> {
        let id = &machine.id;
        let current = info.instance_type.clone();
        let order = type_order(machine.field(field::INSTANCE_TYPES), current.as_deref());
        let hibernated = self.settings.suspend_mode == SuspendMode::Hibernate
            || info
                .state_reason
                .as_deref()
                .is_some_and(|r| r.to_ascii_lowercase().contains("hibernat"));
        if tried.is_empty() && (order.len() < 2 || hibernated) {
            self.start_call(client, id, ctx).await?;
            return Ok(current);
        }
        let order: Vec<String> = order.into_iter().filter(|t| !tried.contains(t)).collect();
        if order.is_empty() || hibernated {
            let zone = info.zone.as_deref().unwrap_or("its zone");
            return Err(anyhow::Error::new(NoTypeLeft)).with_context(|| {
                format!(
                    "instance {id} stopped again for lack of capacity in {zone} after EC2 accepted \
                     its start as {}{}; retry the job later, or let the environment have more \
                     instance types (ec2.fallback_instance_types, when it is made)",
                    tried.join(", then "),
                    if hibernated {
                        " (a hibernated instance cannot change its type)"
                    } else {
                        ", each of the environment's instance types"
                    }
                )
            });
        }
        let now = Mutex::new(current.clone().unwrap_or_default());
        let rounds = AtomicU32::new(0);
        let zone = info.zone.as_deref().unwrap_or("its zone");
        capacity::wait_out(ctx, || async {
            let first_round = rounds.fetch_add(1, Ordering::Relaxed) == 0;
            let mut refused = Vec::new();
            for (k, t) in order.iter().enumerate() {
                let was = now.lock().unwrap().clone();
                if *t != was {
                    if let Err(e) = self.change_type(client, id, t, ctx).await {
                        ctx.log.warn(format!(
                            "could not change instance {id} from {was} to {t}: {e:#}; skipping {t}"
                        ));
                        continue;
                    }
                    *now.lock().unwrap() = t.clone();
                }
                let started = call("StartInstances", ctx, || {
                    client.start_instances().instance_ids(id).send()
                })
                .await;
                let reason = match started {
                    Ok(_) => return Ok(Ok(t.clone())),
                    Err(e) => capacity_reason(e)
                        .with_context(|| format!("starting instance {id} as {t}"))?,
                };
                if first_round {
                    if let Some(next) = order.get(k + 1) {
                        ctx.log.info(format!(
                            "no capacity for instance {id} as {t} in {zone}: {reason}; changing it to {next} \
                             (the environment's next instance type) and starting it"
                        ));
                    }
                }
                refused.push(format!("{t}: {reason}"));
            }
            Ok(Err(format!(
                "no capacity in {zone} for any of the environment's instance types ({})",
                refused.join("; ")
            )))
        })
        .await
        .with_context(|| format!("starting instance {id}"))
        .map(Some)
    }

    pub(super) async fn change_type(
        &self,
        client: &Client,
        id: &str,
        to: &str,
        ctx: &Ctx,
    ) -> Result<()> {
        call("ModifyInstanceAttribute", ctx, || {
            client
                .modify_instance_attribute()
                .instance_id(id)
                .instance_type(AttributeValue::builder().value(to).build())
                .send()
        })
        .await?;
        Ok(())
    }
}

/// Every type of the environment was started once in this resume and
/// stopped again for lack of capacity (or the instance cannot change type).
#[derive(Debug, Clone, thiserror::Error)]
#[error("no instance type of the environment is left to start it as")]
pub struct NoTypeLeft;

/// The current type first, then the environment's other types in their order.
fn type_order(recorded: Option<&str>, current: Option<&str>) -> Vec<String> {
    let mut order: Vec<String> = current.map(str::to_string).into_iter().collect();
    for t in recorded.unwrap_or("").split(',').map(str::trim) {
        if !t.is_empty() && !order.iter().any(|o| o == t) {
            order.push(t.to_string());
        }
    }
    order
}

#[cfg(test)]
mod tests {
    use super::type_order;

    #[test]
    fn the_current_type_first_then_the_recorded_order() {
        assert_eq!(
            type_order(Some("a,b,c"), Some("b")),
            vec!["b".to_string(), "a".into(), "c".into()]
        );
        // A record from before instance_types: the current type alone, as before.
        assert_eq!(type_order(None, Some("a")), vec!["a".to_string()]);
        assert!(type_order(None, None).is_empty());
    }
}
