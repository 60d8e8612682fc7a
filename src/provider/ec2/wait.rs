//! Waiting for an instance to be running or stopped: DescribeInstances through
//! the one wait helper (`crate::wait`), inside the caller's deadline, with
//! progress in the job log. EC2's describe calls are eventually consistent:
//! `InvalidInstanceID.NotFound` shortly after a launch means "not visible yet".

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use aws_sdk_ec2::Client;

use super::instance::{self, InstanceInfo};
use crate::context::Ctx;
use crate::provider::MachineState;
use crate::wait::{Poll, Schedule, Wait};

/// During a transition the instance is described once a second, the first
/// time right after the call that started it: a state change is noticed at
/// most 1 s (plus one API round trip) late, and each instance in transition
/// costs one DescribeInstances a second (the arithmetic against EC2's request
/// rate limits is in docs/ec2.md). Throttled calls back off inside
/// `call::call`, so a throttled account is asked less often, not more.
pub const POLL_EVERY: Duration = Duration::from_secs(1);
/// How long a just-launched instance may be invisible to DescribeInstances.
const NOT_VISIBLE_GRACE: Duration = Duration::from_secs(120);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Want {
    Running,
    Stopped,
}

impl Want {
    pub fn as_str(self) -> &'static str {
        match self {
            Want::Running => "running",
            Want::Stopped => "stopped",
        }
    }
}

/// Polls until the instance is in the wanted state; returns what the last
/// describe saw (with fresh addresses).
pub async fn wait_for(client: &Client, id: &str, want: Want, ctx: &Ctx) -> Result<InstanceInfo> {
    wait_for_seeing(client, id, want, ctx, &|_| {}).await
}

/// As [`wait_for`], showing `seen` every describe on the way (a resume
/// learns a new public address from them while the instance is pending).
pub async fn wait_for_seeing(
    client: &Client,
    id: &str,
    want: Want,
    ctx: &Ctx,
    seen: &(dyn Fn(&InstanceInfo) + Sync),
) -> Result<InstanceInfo> {
    let mut wait = Wait::new(
        ctx,
        format!("instance {id} to be {}", want.as_str()),
        Schedule::fixed(POLL_EVERY),
    );
    let started = Instant::now();
    let info = wait
        .until(|| async {
            let info = instance::describe(client, id, ctx)
                .await
                .with_context(|| format!("waiting for instance {id} to be {}", want.as_str()))?;
            if let Some(info) = &info {
                seen(info);
            }
            check(id, want, info, started.elapsed())
        })
        .await?;
    ctx.log.info(format!(
        "instance {id} {} after {:.1} s",
        want.as_str(),
        wait.elapsed().as_secs_f64()
    ));
    Ok(info)
}

/// An instance that EC2 accepted to start stopped again for lack of capacity
/// ([`InstanceInfo::stopped_for_capacity`]): a resume may change its type
/// and start it again (`lifecycle.rs`).
#[derive(Debug, Clone, thiserror::Error)]
#[error(
    "instance {id} stopped again after it was started, for lack of capacity for {instance_type} \
     (EC2 says: {reason})"
)]
pub struct StoppedForCapacity {
    pub id: String,
    pub instance_type: String,
    pub reason: String,
}

/// What one describe means for a wait for `want`.
pub fn check(
    id: &str,
    want: Want,
    seen: Option<InstanceInfo>,
    elapsed: Duration,
) -> Result<Poll<InstanceInfo>> {
    let Some(i) = seen else {
        if elapsed < NOT_VISIBLE_GRACE {
            return Ok(Poll::Pending("not visible yet".into()));
        }
        bail!(
            "instance {id} is not known to EC2 {} s after it was asked to be {}: it was deleted",
            elapsed.as_secs(),
            want.as_str()
        );
    };
    let reason = || {
        i.state_reason
            .as_deref()
            .map(|r| format!(" (EC2 says: {r})"))
            .unwrap_or_default()
    };
    match (&i.state, want) {
        (MachineState::Gone, _) => bail!(
            "instance {id} is {} while dormant waited for it to be {}{}",
            i.state_name,
            want.as_str(),
            reason()
        ),
        (MachineState::Running, Want::Running) | (MachineState::Stopped, Want::Stopped) => {
            Ok(Poll::Ready(i))
        }
        (MachineState::Stopped, Want::Running) if i.stopped_for_capacity() => {
            Err(StoppedForCapacity {
                id: id.to_string(),
                instance_type: i.instance_type.clone().unwrap_or_else(|| "its type".into()),
                reason: i
                    .state_reason
                    .clone()
                    .or_else(|| i.state_reason_code.clone())
                    .unwrap_or_default(),
            }
            .into())
        }
        (MachineState::Stopped, Want::Running) => {
            bail!(
                "instance {id} stopped while dormant waited for it to run{}",
                reason()
            )
        }
        _ => Ok(Poll::Pending(i.state_name.clone())),
    }
}
