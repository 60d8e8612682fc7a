//! Every EC2 API call goes through [`call`]: throttling and transient faults
//! are retried here with jittered backoff inside the caller's deadline, and
//! each wait is one line in the job log. Capacity errors are returned to the
//! capacity loop; everything else fails at once as a classified [`ApiError`].

use std::future::Future;
use std::time::{Duration, Instant};

use anyhow::Result;
use aws_sdk_ec2::error::{ProvideErrorMetadata, SdkError};
use aws_smithy_runtime_api::client::orchestrator::HttpResponse;

use super::errors::{ApiError, ErrorKind};
use crate::context::{Backoff, Ctx};

/// Throttling: EC2 refills API tokens per second; back off from 1 s up to 20 s.
const THROTTLE_FIRST: Duration = Duration::from_secs(1);
const THROTTLE_MAX: Duration = Duration::from_secs(20);
/// A 5xx or a dropped connection is retried this many times, then it is an error
/// (a wrong endpoint must not be retried until the prepare timeout).
const TRANSIENT_ATTEMPTS: u32 = 4;

/// Runs one API call, retrying throttling and transient faults.
pub async fn call<T, E, F, Fut>(action: &'static str, ctx: &Ctx, mut op: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, SdkError<E, HttpResponse>>>,
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
{
    let mut backoff = Backoff::new(THROTTLE_FIRST, THROTTLE_MAX);
    let mut transient = 0;
    let started = Instant::now();
    loop {
        ctx.check(&format!("calling EC2 {action}"))?;
        let t = Instant::now();
        let result = op().await;
        tracing::debug!(
            action,
            ok = result.is_ok(),
            ms = t.elapsed().as_millis() as u64,
            "EC2 call"
        );
        let err = match result {
            Ok(v) => return Ok(v),
            Err(e) => ApiError::classify(action, &e),
        };
        let retry = match err.kind {
            ErrorKind::Throttled => true,
            ErrorKind::Transient => {
                transient += 1;
                transient < TRANSIENT_ATTEMPTS
            }
            _ => false,
        };
        if !retry {
            return Err(err.into());
        }
        let delay = backoff.next_delay();
        ctx.log.info(format!(
            "EC2 {action}: {} ({}), retrying in {:.0} s ({} s so far)",
            err.code.as_deref().unwrap_or("no answer from EC2"),
            if err.kind == ErrorKind::Throttled {
                "the account's API rate limit"
            } else {
                "a transient fault"
            },
            delay.as_secs_f64().max(1.0),
            started.elapsed().as_secs()
        ));
        ctx.sleep(delay, &format!("waiting to retry EC2 {action}"))
            .await
            .map_err(|e| e.context(err))?;
    }
}
