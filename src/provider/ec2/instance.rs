//! What dormant reads from an instance (state, tags, addresses), and the two
//! ways it finds instances: by id, and by its `dormant:*` tags.

use std::collections::BTreeMap;

use anyhow::Result;
use aws_sdk_ec2::types::{Filter, Instance, InstanceLifecycleType, InstanceStateName};
use aws_sdk_ec2::Client;

use super::call::call;
use super::errors::is_not_found;
use crate::context::Ctx;
use crate::provider::MachineState;

/// Tag names dormant sets on every instance and volume it launches.
pub mod tag {
    pub const MANAGED_BY: &str = "dormant:managed-by";
    pub const MANAGED_BY_VALUE: &str = "dormant";
    pub const ENV: &str = "dormant:env";
    pub const RUNNER: &str = "dormant:runner";
    pub const SYSTEM: &str = "dormant:system";
    pub const PROJECT: &str = "dormant:project";
    pub const JOB: &str = "dormant:job";
    /// On an environment's data volume (volume mode) only: tells it from the
    /// instance's root volume, which carries the other tags too.
    pub const VOLUME: &str = "dormant:volume";
    pub const VOLUME_DATA: &str = "data";
    /// On a warm instance (`warm.rs`) until it is handed to an environment:
    /// its id in the pool. It carries no `dormant:env` meanwhile.
    pub const WARM: &str = "dormant:warm";
}

#[derive(Debug, Clone)]
pub struct InstanceInfo {
    pub id: String,
    pub state: MachineState,
    /// EC2's own state name (`pending`, `shutting-down`, ...), for messages.
    pub state_name: String,
    pub tags: BTreeMap<String, String>,
    pub private_ip: Option<String>,
    pub public_ip: Option<String>,
    pub launched_at: Option<u64>,
    pub state_reason: Option<String>,
    /// The state reason's code (`Server.InsufficientInstanceCapacity`,
    /// `Client.UserInitiatedShutdown`, ...).
    pub state_reason_code: Option<String>,
    pub instance_type: Option<String>,
    /// The instance's availability zone.
    pub zone: Option<String>,
    pub subnet_id: Option<String>,
    /// Bought on the spot market (EC2 may reclaim it).
    pub spot: bool,
}

impl InstanceInfo {
    pub fn from_sdk(i: &Instance) -> InstanceInfo {
        let name = i.state().and_then(|s| s.name());
        let state = match name {
            Some(InstanceStateName::Pending) => MachineState::Pending,
            Some(InstanceStateName::Running) => MachineState::Running,
            Some(InstanceStateName::Stopping) => MachineState::Stopping,
            Some(InstanceStateName::Stopped) => MachineState::Stopped,
            Some(InstanceStateName::ShuttingDown | InstanceStateName::Terminated) => {
                MachineState::Gone
            }
            Some(other) => MachineState::Other(other.as_str().to_string()),
            None => MachineState::Other("unknown".into()),
        };
        InstanceInfo {
            id: i.instance_id().unwrap_or_default().to_string(),
            state,
            state_name: name.map(|n| n.as_str().to_string()).unwrap_or_default(),
            tags: i
                .tags()
                .iter()
                .filter_map(|t| Some((t.key()?.to_string(), t.value().unwrap_or("").to_string())))
                .collect(),
            private_ip: i.private_ip_address().map(str::to_string),
            public_ip: i.public_ip_address().map(str::to_string),
            launched_at: i.launch_time().map(|t| t.secs().max(0) as u64),
            state_reason: i
                .state_reason()
                .and_then(|r| r.message())
                .filter(|m| !m.is_empty())
                .map(str::to_string),
            state_reason_code: i
                .state_reason()
                .and_then(|r| r.code())
                .filter(|c| !c.is_empty())
                .map(str::to_string),
            instance_type: i.instance_type().map(|t| t.as_str().to_string()),
            zone: i
                .placement()
                .and_then(|p| p.availability_zone())
                .map(str::to_string),
            subnet_id: i.subnet_id().map(str::to_string),
            spot: i.instance_lifecycle() == Some(&InstanceLifecycleType::Spot),
        }
    }

    pub fn tag(&self, k: &str) -> Option<&str> {
        self.tags.get(k).map(String::as_str)
    }

    /// Stopped because EC2 had no capacity for it: a StartInstances that EC2
    /// accepted, but the instance went from `pending` back to `stopped` with
    /// the state reason `Server.InsufficientInstanceCapacity` (EC2 reports a
    /// start it cannot place this way as well as by refusing the call).
    pub fn stopped_for_capacity(&self) -> bool {
        self.state == MachineState::Stopped
            && [&self.state_reason_code, &self.state_reason]
                .into_iter()
                .flatten()
                .any(|r| r.contains("InsufficientInstanceCapacity"))
    }
}

/// Describes one instance by id. `None`: EC2 does not know it (terminated long
/// ago, or — right after a launch — not visible yet).
pub async fn describe(client: &Client, id: &str, ctx: &Ctx) -> Result<Option<InstanceInfo>> {
    let result = call("DescribeInstances", ctx, || {
        client.describe_instances().instance_ids(id).send()
    })
    .await;
    match result {
        Ok(out) => Ok(out
            .reservations()
            .iter()
            .flat_map(|r| r.instances())
            .find(|i| i.instance_id() == Some(id))
            .map(InstanceInfo::from_sdk)),
        Err(e) if is_not_found(&e) => Ok(None),
        Err(e) => Err(e),
    }
}

pub fn filter(name: &str, values: &[&str]) -> Filter {
    Filter::builder()
        .name(name)
        .set_values(Some(values.iter().map(|v| v.to_string()).collect()))
        .build()
}

pub fn tag_filter(key: &str, value: &str) -> Filter {
    filter(&format!("tag:{key}"), &[value])
}

/// States of an instance that still exists (and still counts, and still bills).
pub const LIVE_STATES: &[&str] = &["pending", "running", "stopping", "stopped"];

/// Every instance matching the filters (all pages).
pub async fn find(client: &Client, filters: Vec<Filter>, ctx: &Ctx) -> Result<Vec<InstanceInfo>> {
    let mut out = Vec::new();
    let mut token: Option<String> = None;
    loop {
        let page = call("DescribeInstances", ctx, || {
            client
                .describe_instances()
                .set_filters(Some(filters.clone()))
                .set_next_token(token.clone())
                .send()
        })
        .await?;
        out.extend(
            page.reservations()
                .iter()
                .flat_map(|r| r.instances())
                .map(InstanceInfo::from_sdk),
        );
        match page.next_token() {
            Some(t) if !t.is_empty() => token = Some(t.to_string()),
            _ => return Ok(out),
        }
    }
}
