//! Script output reaches the runner through dormant, never directly.
//!
//! The runner reads a stage's stdout and stderr until every process holding
//! them has closed them. A script may leave a process behind that escaped its
//! process group (`setsid cmd &`); had it inherited the runner's pipe, the
//! runner would wait for it forever, even after killing dormant ("likely
//! process is dormant"). So everything dormant starts for a stage writes into
//! a pipe dormant owns, and dormant copies that to its own stdout: once dormant
//! is gone, what is left holds only a pipe nobody reads (its next write fails).
//!
//! When the script has ended, [`drain`] reads what is still in the pipe: to end
//! of file, which comes at once unless something escaped, else for at most
//! [`DRAIN_GRACE`], so an escaped process cannot hold the stage open either.

use std::io::Write;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt};

/// After the script ended: how long to keep copying output that is still
/// arriving before the stage ends anyway (only an escaped process keeps the
/// pipe open that long; output in flight takes milliseconds).
pub const DRAIN_GRACE: Duration = Duration::from_secs(1);

/// Copies `from` to dormant's stdout (and to `copy`, for `dormant attach`)
/// until end of file or a read error. Each chunk is flushed as it comes, so
/// the job log stays live.
pub async fn copy_to_stdout<R: AsyncRead + Unpin>(
    mut from: R,
    copy: Option<&crate::state::stage_output::OutputCopy>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                let mut out = std::io::stdout().lock();
                // The runner stopped reading: nothing left to show the output to.
                if out.write_all(&buf[..n]).and_then(|()| out.flush()).is_err() {
                    return;
                }
                if let Some(copy) = copy {
                    copy.append(&buf[..n]);
                }
            }
        }
    }
}

/// Lets a running copy finish: to end of file, or [`DRAIN_GRACE`] at most.
/// Returns whether end of file was reached.
pub async fn drain(copy: impl std::future::Future<Output = ()>) -> bool {
    tokio::time::timeout(DRAIN_GRACE, copy).await.is_ok()
}
