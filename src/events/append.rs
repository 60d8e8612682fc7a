//! Appending to the event log, and rotating it by size.
//!
//! The log is a series of files `events/events-<seq>.jsonl`; the one with the
//! highest number is the current one, the only one written. How an append
//! stays whole with 16 jobs and a sweep writing at once, and a writer
//! SIGKILLed at any line:
//!
//! - **One writer at a time.** Every append holds `events/append.lock` (the
//!   one lock API, `state/lock.rs`) for the few microseconds it takes to
//!   check the file, maybe rotate, and write. Lines never interleave, and a
//!   rotation never races an append. The kernel drops the lock of a killed
//!   writer.
//! - **A line is one `write` of the whole line and its newline**, to a file
//!   opened with `O_APPEND`. A writer killed before the write left nothing;
//!   after it, a whole line.
//! - **A torn tail is cut off by the next writer.** Should a line ever be
//!   left without its newline (a write cut short: a full disk, or a kill in
//!   the middle of a write the kernel split), the next writer, holding the
//!   lock, truncates the file back to its last newline before appending, so
//!   the fragment never glues onto a whole line. Lines before it are never
//!   touched, and readers never consume a line that has no newline yet.
//! - **Rotation** happens under the same lock: the next number is created,
//!   then the oldest files beyond `events.keep_files` are deleted — never the
//!   current one (at least two are kept). A writer killed in between leaves
//!   one file too many, which the next rotation deletes.
//!
//! No fsync: the log is history for operators, not state; a power loss may
//! lose its last lines, never the records and job phases it describes (which
//! are fsynced).

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};

use super::read::{segment_path, segments};
use super::Event;
use crate::context::Ctx;
use crate::settings::events::EventSettings;
use crate::state::store::ensure_private_dir;
use crate::state::FileLock;

/// The log's directory under the state dir.
pub const DIR: &str = "events";
const LOCK_FILE: &str = "append.lock";
/// An append holds the lock for microseconds; a writer that waited this long
/// is behind a stopped process (SIGSTOP) holding it. The event is then left
/// out with a warning: the log must never hold up a job.
const LOCK_WAIT: Duration = Duration::from_secs(5);

/// The event log of one state dir, with its rotation settings.
#[derive(Debug, Clone)]
pub struct EventLog {
    dir: PathBuf,
    max_file_size: u64,
    keep_files: usize,
}

impl EventLog {
    pub fn new(state_root: &Path, settings: &EventSettings) -> EventLog {
        EventLog {
            dir: state_root.join(DIR),
            max_file_size: settings.max_file_size.0,
            keep_files: settings.keep_files.max(2) as usize,
        }
    }

    /// `<state dir>/events`.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Appends `event`; a failure is a warning on the caller's log, never an
    /// error: whatever happened to the environment has happened.
    pub async fn record(&self, event: Event, ctx: &Ctx) {
        if let Err(e) = self.append(&event, ctx).await {
            ctx.log.warn(format!(
                "the {} event{} was not recorded in the event log {}: {e:#}",
                event.event,
                event
                    .env
                    .map(|id| format!(" of environment {id}"))
                    .unwrap_or_default(),
                self.dir.display()
            ));
        }
    }

    /// Appends one line (see the module comment for why it stays whole).
    pub async fn append(&self, event: &Event, ctx: &Ctx) -> Result<()> {
        let mut line = event.to_line().into_bytes();
        line.push(b'\n');
        ensure_private_dir(&self.dir)?;
        // Its own bound, deaf to SIGTERM: the event of a step that finished is
        // written even while the job is being canceled, or after the
        // caller's own time bound (a sweep's) ran out.
        let ctx = Ctx::new(ctx.log.clone(), Default::default(), LOCK_WAIT);
        let lock_path = self.dir.join(LOCK_FILE);
        let _lock = FileLock::acquire(&lock_path, &ctx, "waiting for the event log's lock")
            .await?
            .with_context(|| format!("{} was removed", self.dir.display()))?;
        crate::failpoint!("events:locked");
        self.append_locked(&line)
    }

    /// The append itself; the caller holds the lock.
    fn append_locked(&self, line: &[u8]) -> Result<()> {
        let existing = segments(&self.dir)?;
        let (mut seq, mut path) = match existing.last() {
            Some((seq, path)) => (*seq, path.clone()),
            None => (1, segment_path(&self.dir, 1)),
        };
        let mut file = open_append(&path)?;
        if existing.is_empty() {
            crate::failpoint!("events:file-created");
        }
        let mut size = cut_torn_tail(&file, &path)?;
        if size > 0 && size + line.len() as u64 > self.max_file_size {
            seq += 1;
            path = segment_path(&self.dir, seq);
            file = open_append(&path)?;
            size = 0;
            crate::failpoint!("events:file-created");
            self.drop_oldest()?;
        }
        write_line(&mut file, line, size)
            .with_context(|| format!("appending to {}", path.display()))
    }

    /// Deletes the oldest files beyond `keep_files`; the newest is never one.
    fn drop_oldest(&self) -> Result<()> {
        let all = segments(&self.dir)?;
        let extra = all.len().saturating_sub(self.keep_files.max(1));
        for (_, path) in all.iter().take(extra) {
            crate::state::store::remove_file(path)?;
        }
        Ok(())
    }
}

fn open_append(path: &Path) -> Result<File> {
    OpenOptions::new()
        .create(true)
        .append(true)
        .read(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("opening event log {}", path.display()))
}

/// Cuts a line left without its newline (a writer killed or cut short in the
/// middle of it) back to the last newline. Returns the file's size after.
fn cut_torn_tail(file: &File, path: &Path) -> Result<u64> {
    let len = file
        .metadata()
        .with_context(|| format!("reading {}", path.display()))?
        .len();
    let mut end = len;
    let mut buf = vec![0u8; 4096];
    // From the end backwards to the last newline: a fragment is shorter than
    // one line, so this reads one block unless the file is damaged otherwise.
    while end > 0 {
        let start = end.saturating_sub(buf.len() as u64);
        let chunk = &mut buf[..(end - start) as usize];
        file.read_exact_at(chunk, start)
            .with_context(|| format!("reading {}", path.display()))?;
        if let Some(i) = chunk.iter().rposition(|&b| b == b'\n') {
            end = start + i as u64 + 1;
            break;
        }
        end = start;
    }
    if end < len {
        file.set_len(end)
            .with_context(|| format!("cutting a torn line off {}", path.display()))?;
    }
    Ok(end)
}

/// Writes the whole line in one `write`; a write that fails part-way is cut
/// off again, so the file ends on a newline either way.
fn write_line(file: &mut File, line: &[u8], size: u64) -> std::io::Result<()> {
    let written = if crate::failpoint::armed("events:torn") {
        // Test builds only: half the line, then the kill, to prove a torn
        // line is cut off by the next writer.
        let half = line.len() / 2;
        file.write_all(&line[..half]).and_then(|()| {
            crate::failpoint!("events:torn");
            file.write_all(&line[half..])
        })
    } else {
        file.write_all(line)
    };
    if written.is_err() {
        let _ = file.set_len(size);
    }
    written?;
    crate::failpoint!("events:written");
    Ok(())
}
