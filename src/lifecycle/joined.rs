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
//!
//! Cleanup looks for marks while the record still says `active`, so a join
//! cannot rely on the record alone: it writes its mark first and then checks,
//! and cleanup first closes the job's joins (`joined/closed` names the job)
//! and then looks. Whichever comes second sees the other: a mark written
//! before cleanup looked is ended with the rest; one written after finds the
//! joins closed and the join gives up. The files are the state dir owner's
//! even when root joins, so the runner's cleanup can read and remove them.
//!
//! A join that passed that check still has to connect and register on the
//! machine: cleanup may find its mark with nothing registered yet. So it
//! hands the transport the nonces of the marks it saw; on the machine each
//! not yet registered gets a registration file saying `ended`, which the
//! wrapper arriving late finds (both create the file exclusively: whichever
//! is first, the other sees it) and then runs nothing.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};

use crate::context::Ctx;
use crate::exit::Refused;
use crate::model::EnvPaths;
use crate::state::{registry, EnvStatus, Holder};
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

/// Marks a join beside job `job` of runner `runner` (`nonce`) before it
/// connects, then checks that it may: the job still runs its stages and its
/// cleanup has not closed its joins. In that order (see the module comment).
pub fn mark(paths: &EnvPaths, runner: &str, job: u64, nonce: &str) -> Result<Mark> {
    let dir = dir(paths);
    make_dir(paths, &dir)?;
    let path = dir.join(nonce);
    write_owned(paths, &path, format!("{}\n", std::process::id()).as_bytes())
        .with_context(|| format!("writing {}", path.display()))?;
    let mark = Mark { path };
    if closed_for(paths) == Some(job) || !runs(paths, runner, job)? {
        // (The mark goes when dropped: cleanup may have seen it, and then
        // it ends what is there, which is nothing of ours.)
        return Err(Refused::NotRunning.because(format!(
            "job {job} ended while this shell was joining it: its environment {} is no longer \
             the job's to join",
            paths.id
        )));
    }
    Ok(mark)
}

/// Whether job `job` of `runner` holds the environment and runs its stages.
fn runs(paths: &EnvPaths, runner: &str, job: u64) -> Result<bool> {
    Ok(registry::peek(paths)?.is_some_and(|rec| {
        rec.status() == EnvStatus::Active
            && matches!(rec.holder(), Some(Holder::Job { runner_id, job_id, .. })
                if runner_id == runner && *job_id == job)
    }))
}

/// The job whose joins its cleanup closed (the last one that ended here).
fn closed_for(paths: &EnvPaths) -> Option<u64> {
    let text = std::fs::read_to_string(dir(paths).join(CLOSED)).ok()?;
    text.trim().strip_prefix("job ")?.parse().ok()
}

/// `joined/closed`: which job's joins its cleanup closed. Not a mark (nor
/// is anything named from it).
const CLOSED: &str = "closed";

/// Closes job `job`'s joins: `joined/closed` names it, whole at once (a
/// join reading it half-written would not see it closed).
fn close(paths: &EnvPaths, job: u64) -> Result<()> {
    let dir = dir(paths);
    make_dir(paths, &dir)?;
    let (tmp, closed) = (dir.join(format!("{CLOSED}.new")), dir.join(CLOSED));
    write_owned(paths, &tmp, format!("job {job}\n").as_bytes())?;
    std::fs::rename(&tmp, &closed).with_context(|| format!("writing {}", closed.display()))
}

/// The marks there are. A `joined/` that cannot be read is an error (a
/// cleanup that could not see the marks must say so).
fn marks(paths: &EnvPaths) -> Result<Vec<PathBuf>> {
    let dir = dir(paths);
    match std::fs::read_dir(&dir) {
        Ok(entries) => Ok(entries
            .flatten()
            .filter(|e| !e.file_name().to_string_lossy().starts_with(CLOSED))
            .map(|e| e.path())
            .collect()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(e).with_context(|| format!("reading {}", dir.display())),
    }
}

/// Creates `joined/` (0700), owned like the environment's directory.
fn make_dir(paths: &EnvPaths, dir: &Path) -> Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => give_to_owner(paths, dir),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(e).with_context(|| format!("creating {}", dir.display())),
    }
}

/// Writes a private file owned like the environment's directory.
fn write_owned(paths: &EnvPaths, path: &Path, data: &[u8]) -> Result<()> {
    crate::state::store::write_private(path, data)?;
    give_to_owner(paths, path)
}

/// Root joining an environment of a runner running as another user makes its
/// files that user's: the runner's cleanup must read and remove them.
fn give_to_owner(paths: &EnvPaths, path: &Path) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Ok(());
    }
    let owner = std::fs::metadata(&paths.dir)
        .with_context(|| format!("reading {}", paths.dir.display()))?;
    if owner.uid() == 0 {
        return Ok(());
    }
    std::os::unix::fs::chown(path, Some(owner.uid()), Some(owner.gid()))
        .with_context(|| format!("giving {} to uid {}", path.display(), owner.uid()))
}

/// Cleanup: closes job `job`'s joins, ends every shell joined beside it (told
/// first), then removes the marks. Best effort: what fails is said in the
/// runner's log (a machine that cannot be reached is being stopped or
/// deleted anyway).
pub async fn end_all(paths: &EnvPaths, transport: Option<&dyn Transport>, job: u64, ctx: &Ctx) {
    let warn = |what: &str, e: anyhow::Error| {
        ctx.log.warn(format!(
            "environment {}: {what} the shells joined beside job {job}: {e:#}",
            paths.id
        ))
    };
    // Close first, then look (see the module comment).
    if let Err(e) = close(paths, job) {
        warn("could not close the way to", e);
    }
    let marks = match marks(paths) {
        Ok(marks) if marks.is_empty() => return,
        Ok(marks) => marks,
        Err(e) => return warn("could not look for", e),
    };
    // Each join learns why its shell ended (the mark stays until they are).
    for mark in &marks {
        let _ =
            crate::state::store::write_private(mark, format!("{ENDING} job {job}\n").as_bytes());
    }
    if let Some(t) = transport {
        let ctx = ctx.uncancellable().within(END_BOUND);
        let message = format!(
            "dormant: job {job} has ended: its cleanup ends this shell now (dormant shell beside a \
             running job lasts as long as the job)"
        );
        let nonces: Vec<String> = marks
            .iter()
            .filter_map(|m| Some(m.file_name()?.to_string_lossy().into_owned()))
            .collect();
        if let Err(e) = t.end_joined(&message, &nonces, &ctx).await {
            warn("could not end", e);
        }
    }
    for mark in &marks {
        let _ = std::fs::remove_file(mark);
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;
    use std::time::Duration;

    use super::*;
    use crate::state::{testing, Mode, StateStore};

    fn ctx() -> Ctx {
        Ctx::new(
            crate::context::JobLog::stderr(),
            Default::default(),
            Duration::from_secs(60),
        )
    }

    /// An active environment held by job 12 of runner `r`.
    fn active(store: &StateStore) -> EnvPaths {
        let id = uuid::Uuid::new_v4();
        let holder = Holder::Job {
            runner_id: "r".into(),
            job_id: 12,
            mode: Mode::New,
            suspend_on_failure: false,
        };
        testing::place(store, id, EnvStatus::Active, Some(holder), 0, None).unwrap();
        store.env_paths(id)
    }

    /// The race, both ways round: a mark the cleanup can see is ended by it;
    /// a join marking after the cleanup looked is refused.
    #[tokio::test]
    async fn a_join_is_ended_by_the_cleanup_or_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let store = StateStore::open(tmp.path()).unwrap();
        let paths = active(&store);
        // Marked before the cleanup: the cleanup finds it (and says so in it).
        let early = mark(&paths, "r", 12, "early").unwrap();
        let seen = std::fs::read_to_string(&early.path).unwrap();
        assert!(!seen.starts_with(ENDING), "{seen}");
        end_all(&paths, None, 12, &ctx()).await;
        assert!(early.ended_by_cleanup());
        // Marked after: refused, though the record still says active.
        let late = mark(&paths, "r", 12, "late").map(drop).unwrap_err();
        assert!(format!("{late:#}").contains("ended while"), "{late:#}");
        assert!(marks(&paths).unwrap().is_empty(), "its mark went with it");
        // The next job of the environment may be joined.
        testing::rewrite(&store, paths.id, |_, claim, _| {
            if let Some(Holder::Job { job_id, .. }) = claim.as_mut().map(|c| &mut c.holder) {
                *job_id = 13;
            }
        })
        .unwrap();
        assert!(mark(&paths, "r", 13, "next").is_ok());
        // Not a job that is not the environment's.
        assert!(mark(&paths, "r", 14, "other").is_err());
    }

    /// Root joining the environment of a runner running as another user:
    /// `joined/` and what is in it are that user's, or its cleanup could
    /// neither read nor remove them.
    #[test]
    fn roots_join_leaves_files_the_runners_user_owns() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: needs root to give files away");
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let store = StateStore::open(tmp.path()).unwrap();
        let paths = active(&store);
        std::os::unix::fs::chown(&paths.dir, Some(65534), Some(65534)).unwrap();
        let m = mark(&paths, "r", 12, "n").unwrap();
        close(&paths, 12).unwrap();
        for p in [dir(&paths), m.path.clone(), dir(&paths).join(CLOSED)] {
            let meta = std::fs::metadata(&p).unwrap();
            assert_eq!((meta.uid(), meta.gid()), (65534, 65534), "{}", p.display());
        }
    }
}
