//! Every EC2 API call goes through [`call`]: throttling and transient faults
//! are retried here with jittered backoff inside the caller's deadline, through
//! `crate::wait` (one progress style for every wait). Capacity errors are returned to the
//! capacity loop; everything else fails at once as a classified [`ApiError`].

use std::future::Future;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::Result;
use aws_sdk_ec2::error::{ProvideErrorMetadata, SdkError};
use aws_smithy_runtime_api::client::orchestrator::HttpResponse;

use super::errors::{ApiError, ErrorKind};
use crate::context::Ctx;
use crate::wait::{Poll, Schedule, Wait};

/// Throttling: EC2 refills API tokens per second; back off from 1 s up to 20 s.
pub const THROTTLE_FIRST: Duration = Duration::from_secs(1);
pub const THROTTLE_MAX: Duration = Duration::from_secs(20);
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
    // Shared by the attempts (the futures borrow them; Send + Sync for the runtime).
    let transient = AtomicU32::new(0);
    let last: Mutex<Option<ApiError>> = Mutex::new(None);
    let mut wait = Wait::new(
        ctx,
        format!("EC2 {action} to be accepted"),
        Schedule::backoff(THROTTLE_FIRST, THROTTLE_MAX),
    );
    let result = wait
        .until(|| {
            let attempt = op();
            let (transient, last) = (&transient, &last);
            async move {
                let t = Instant::now();
                let result = attempt.await;
                tracing::debug!(
                    action,
                    ok = result.is_ok(),
                    ms = t.elapsed().as_millis() as u64,
                    "EC2 call"
                );
                let err = match result {
                    Ok(v) => return Ok(Poll::Ready(v)),
                    Err(e) => ApiError::classify(action, &e),
                };
                let retry = match err.kind {
                    ErrorKind::Throttled => true,
                    ErrorKind::Transient => {
                        transient.fetch_add(1, Ordering::Relaxed) + 1 < TRANSIENT_ATTEMPTS
                    }
                    _ => false,
                };
                if !retry {
                    return Err(err.into());
                }
                let state = format!(
                    "{} ({})",
                    err.code.as_deref().unwrap_or("no answer from EC2"),
                    if err.kind == ErrorKind::Throttled {
                        "the account's API rate limit"
                    } else {
                        "a transient fault"
                    }
                );
                *last.lock().unwrap() = Some(err);
                Ok(Poll::Pending(state))
            }
        })
        .await;
    match (result, last.into_inner().unwrap()) {
        (Ok(v), _) => Ok(v),
        // Out of time or cancelled while retrying: the API error is the cause.
        (Err(e), Some(api)) if e.downcast_ref::<ApiError>().is_none() => Err(e.context(api)),
        (Err(e), _) => Err(e),
    }
}
