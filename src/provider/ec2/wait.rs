//! Waiting for an instance to be running or stopped: DescribeInstances polled
//! with bounded, jittered backoff, inside the caller's deadline, with progress
//! in the job log. EC2's describe calls are eventually consistent:
//! `InvalidInstanceID.NotFound` shortly after a launch means "not visible yet".

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use aws_sdk_ec2::Client;

use super::instance::{self, InstanceInfo};
use crate::context::{Backoff, Ctx};
use crate::provider::MachineState;

/// Poll intervals: the first check 1 s after the state change was asked for,
/// then doubling to a 5 s cap (±20 % jitter). A launch takes 10–30 s, a stop
/// 20–60 s; a 5 s cap keeps the detection lag under ~6 s while a fleet of
/// runners stays well inside DescribeInstances' rate limit.
pub const POLL_FIRST: Duration = Duration::from_secs(1);
pub const POLL_MAX: Duration = Duration::from_secs(5);
/// How long a just-launched instance may be invisible to DescribeInstances.
const NOT_VISIBLE_GRACE: Duration = Duration::from_secs(120);
/// A progress line at most this often while waiting.
const PROGRESS_EVERY: Duration = Duration::from_secs(30);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Want {
    Running,
    Stopped,
}

impl Want {
    fn as_str(self) -> &'static str {
        match self {
            Want::Running => "running",
            Want::Stopped => "stopped",
        }
    }
}

/// Polls until the instance is in the wanted state; returns what the last
/// describe saw (with fresh addresses).
pub async fn wait_for(client: &Client, id: &str, want: Want, ctx: &Ctx) -> Result<InstanceInfo> {
    let started = Instant::now();
    let mut backoff = Backoff::new(POLL_FIRST, POLL_MAX);
    let mut last_progress = Instant::now();
    let what = format!("waiting for instance {id} to be {}", want.as_str());
    let mut polls = 0u32;
    let mut last = "not polled yet".to_string();
    loop {
        let seen = async {
            ctx.sleep(backoff.next_delay(), &what).await?;
            instance::describe(client, id, ctx).await
        }
        .await
        .with_context(|| {
            format!(
                "{what}: it was {last} after {} s",
                started.elapsed().as_secs()
            )
        })?;
        polls += 1;
        let state_name = match &seen {
            None => "not visible yet".to_string(),
            Some(i) => i.state_name.clone(),
        };
        tracing::debug!(id, state = %state_name, polls, "polled instance state");
        last.clone_from(&state_name);
        match (&seen, want) {
            (None, _) if started.elapsed() < NOT_VISIBLE_GRACE => {}
            (None, _) => bail!(
                "instance {id} is not known to EC2 {} s after it was asked to be {}: it was deleted",
                started.elapsed().as_secs(),
                want.as_str()
            ),
            (Some(i), _) if i.state == MachineState::Gone => bail!(
                "instance {id} is {} while dormant waited for it to be {}{}",
                i.state_name,
                want.as_str(),
                i.state_reason
                    .as_deref()
                    .map(|r| format!(" (EC2 says: {r})"))
                    .unwrap_or_default()
            ),
            (Some(i), Want::Running) if i.state == MachineState::Running => {
                ctx.log.info(format!(
                    "instance {id} running after {} s",
                    started.elapsed().as_secs()
                ));
                return Ok(i.clone());
            }
            (Some(i), Want::Stopped) if i.state == MachineState::Stopped => {
                ctx.log.info(format!(
                    "instance {id} stopped after {} s",
                    started.elapsed().as_secs()
                ));
                return Ok(i.clone());
            }
            (Some(i), Want::Running) if i.state == MachineState::Stopped => bail!(
                "instance {id} stopped while dormant waited for it to run{}",
                i.state_reason
                    .as_deref()
                    .map(|r| format!(" (EC2 says: {r})"))
                    .unwrap_or_default()
            ),
            _ => {}
        }
        if last_progress.elapsed() >= PROGRESS_EVERY {
            last_progress = Instant::now();
            ctx.log.info(format!(
                "waiting for instance {id} to be {}: {state_name}, {} s",
                want.as_str(),
                started.elapsed().as_secs()
            ));
        }
    }
}
