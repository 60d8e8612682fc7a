//! Shells joined beside a running job (`dormant shell` on an active
//! environment, `crate::ops::shell`): they do not claim the environment, so
//! the job's cleanup must end them before it suspends or releases it.
//!
//! A join marks itself in `environments/<id>/joined/<nonce>` before it
//! connects (intent before effect) and removes the mark after its shell
//! ended; on the machine the shell's session is registered under the same
//! nonce (`transport/ssh/remote/join.sh`). Cleanup, finding a mark, has the
//! transport tell every joined shell of the environment that the job ended,
//! end it and remove what it left ([`crate::transport::Transport::end_joined`],
//! bounded by [`END_BOUND`]), then removes the marks. A join killed before it
//! removed its mark costs the next cleanup that one command, nothing more.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};

use crate::context::Ctx;
use crate::model::EnvPaths;
use crate::transport::Transport;

/// The most a job's cleanup spends ending the shells joined beside it: the
/// command ends them within 6 s (told, 1 s, SIGHUP, SIGKILL after 4 s more);
/// the rest is reaching the machine over the job's master.
pub const END_BOUND: Duration = Duration::from_secs(10);

/// `environments/<id>/joined/`.
pub fn dir(paths: &EnvPaths) -> PathBuf {
    paths.dir.join("joined")
}

/// A join's mark, removed when dropped.
pub struct Mark {
    path: PathBuf,
}

impl Mark {
    /// Whether the job's cleanup has begun ending the joined shells (it
    /// marks each before, and removes the marks after).
    pub fn ended_by_cleanup(&self) -> bool {
        std::fs::read_to_string(&self.path).map_or(true, |t| t.starts_with(ENDING))
    }
}

/// What cleanup writes into each mark before it ends the shells.
const ENDING: &str = "ending";

impl Drop for Mark {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Marks a join (`nonce`, by process `pid`) before it connects.
pub fn mark(paths: &EnvPaths, nonce: &str) -> Result<Mark> {
    let dir = dir(paths);
    let made = {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new().mode(0o700).create(&dir)
    };
    match made {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e).with_context(|| format!("creating {}", dir.display())),
    }
    let path = dir.join(nonce);
    crate::state::store::write_private(&path, format!("{}\n", std::process::id()).as_bytes())
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(Mark { path })
}

/// Whether a shell may be joined beside the environment's job.
pub fn any(paths: &EnvPaths) -> bool {
    std::fs::read_dir(dir(paths)).is_ok_and(|mut d| d.next().is_some())
}

/// Cleanup: ends every shell joined beside job `job` (told first), then
/// removes the marks. Best effort: a machine that cannot be reached is said
/// in the runner's log (it is being stopped or deleted anyway).
pub async fn end_all(paths: &EnvPaths, transport: Option<&dyn Transport>, job: u64, ctx: &Ctx) {
    if !any(paths) {
        return;
    }
    // Each join learns why its shell ended (the mark stays until they are).
    if let Ok(entries) = std::fs::read_dir(dir(paths)) {
        for e in entries.flatten() {
            let _ = crate::state::store::write_private(
                &e.path(),
                format!("{ENDING} job {job}\n").as_bytes(),
            );
        }
    }
    if let Some(t) = transport {
        let ctx = ctx.uncancellable().within(END_BOUND);
        let message = format!(
            "dormant: job {job} has ended: its cleanup ends this shell now (dormant shell beside a \
             running job lasts as long as the job)"
        );
        if let Err(e) = t.end_joined(&message, &ctx).await {
            ctx.log.warn(format!(
                "environment {}: the shells joined beside job {job} could not be ended: {e:#}",
                paths.id
            ));
        }
    }
    let _ = std::fs::remove_dir_all(dir(paths));
}
