//! The stdin of a kept stage's session ([`super::kept::drive`]): the script
//! when the session starts the stage, then the control lines dormant sends
//! the wrapper (`TERM`, `KILL`, `PAUSE`, `ACK`, `TAKEN`, `DONE`, `KEEP`), and
//! at the end a short wait until the master has taken the last of them.

use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use tokio::io::{AsyncWrite, AsyncWriteExt};

use super::remote;

/// How long `KEEP` may take to leave dormant's pipe for the master: once the
/// master has read it, it is delivered even as dormant closes the session
/// (the master sends what it read before it closes a channel whose client
/// left). Only on the rare path of a session broken over a live connection.
pub(super) const KEEP_HANDOFF: Duration = Duration::from_millis(200);

/// The session's stdin: the script, then control lines until the sender is
/// dropped; then it waits (at most [`KEEP_HANDOFF`]) until the master has
/// taken them.
pub(super) async fn write_control<I: AsyncWrite + AsRawFd + Unpin>(
    mut stdin: I,
    upload: &[u8],
    mut lines: tokio::sync::mpsc::UnboundedReceiver<String>,
) -> std::io::Result<()> {
    stdin.write_all(upload).await?;
    while let Some(line) = lines.recv().await {
        stdin.write_all(&remote::signal_line(&line)).await?;
    }
    stdin.flush().await?;
    let started = Instant::now();
    // The master takes a line within microseconds: looked at every 50 µs
    // for the first 2 ms (the end of a stage waits on this), then every 2 ms.
    let mut quick = 0;
    while pending_in_pipe(&stdin) > 0 && started.elapsed() < KEEP_HANDOFF {
        if quick < 40 {
            quick += 1;
            std::thread::sleep(Duration::from_micros(50));
        } else {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
    Ok(())
}

/// Bytes written into the pipe the master reads the session's stdin from,
/// not read by it yet.
fn pending_in_pipe(stdin: &impl AsRawFd) -> i32 {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one int through a valid pointer; the fd is ours.
    let r = unsafe { libc::ioctl(stdin.as_raw_fd(), libc::FIONREAD, &mut n) };
    if r == 0 {
        n
    } else {
        0
    }
}
