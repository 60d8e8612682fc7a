//! Reading the event log: its files in order, from a position on, one whole
//! line at a time. A line without its newline is not read yet — in the
//! current file it may be a line being written; in an older file (a newer
//! one exists, so no writer will come back to it) it is a torn line and
//! counted as damaged. A line that does not parse is damaged, never fatal.
//!
//! Positions (file number, byte offset after a whole line) let `dormant
//! events --follow` and `dormant metrics` read only what was appended since
//! they last looked, across rotations: the files are listed *before* any is
//! read, so when a newer file is seen, every line of the older ones is
//! already complete (rotation happens under the append lock, after the last
//! write to the older file).

use std::fs::File;
use std::io::{BufRead, BufReader, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use super::Event;

const PREFIX: &str = "events-";
const SUFFIX: &str = ".jsonl";

/// `events/events-0000000042.jsonl`
pub fn segment_path(dir: &Path, seq: u64) -> PathBuf {
    dir.join(format!("{PREFIX}{seq:010}{SUFFIX}"))
}

/// The log's files by number, oldest first. No directory: no files.
pub fn segments(dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("listing {}", dir.display())),
    };
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry.with_context(|| format!("listing {}", dir.display()))?;
        let name = entry.file_name();
        let seq = name
            .to_str()
            .and_then(|n| n.strip_prefix(PREFIX))
            .and_then(|n| n.strip_suffix(SUFFIX))
            .and_then(|n| n.parse::<u64>().ok());
        if let Some(seq) = seq {
            out.push((seq, entry.path()));
        }
    }
    out.sort();
    Ok(out)
}

/// Where a reader is: in file `seq`, after the whole line ending at `offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Position {
    pub seq: u64,
    pub offset: u64,
}

/// One line as read.
pub enum Line<'a> {
    /// A line that parsed, with its text (as written, without the newline).
    Event(Box<Event>, &'a str),
    /// A line that did not parse, or a torn one in an older file.
    Damaged(&'a str),
}

/// What a read got through.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Progress {
    /// Where the next read starts (`None`: the log has no file yet).
    pub pos: Option<Position>,
    /// Files that were rotated away before they were (wholly) read.
    pub missed_files: u64,
    pub damaged: u64,
}

/// Reads every whole line after `from` (from the oldest file when `None`),
/// calling `visit` for each.
pub fn read_from(
    dir: &Path,
    from: Option<Position>,
    visit: &mut dyn FnMut(Line<'_>),
) -> Result<Progress> {
    let files = segments(dir)?;
    let mut progress = Progress {
        pos: from,
        ..Default::default()
    };
    let Some((first, _)) = files.first() else {
        return Ok(progress);
    };
    let start = match from {
        Some(p) if files.iter().any(|(s, _)| *s == p.seq) => p,
        // Rotated away since: what was in it and in the files between is gone.
        Some(p) if p.seq < *first => {
            progress.missed_files = first - p.seq;
            Position {
                seq: *first,
                offset: 0,
            }
        }
        // None, or a position past every file (the log was deleted and
        // started again): from the beginning.
        _ => Position {
            seq: *first,
            offset: 0,
        },
    };
    let last = files.len() - 1;
    for (i, (seq, path)) in files.iter().enumerate() {
        if *seq < start.seq {
            continue;
        }
        let offset = if *seq == start.seq { start.offset } else { 0 };
        let file = match File::open(path) {
            Ok(f) => f,
            // Rotated away between the listing and now.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                progress.missed_files += 1;
                continue;
            }
            Err(e) => return Err(e).with_context(|| format!("opening {}", path.display())),
        };
        let (end, torn) = read_file(file, path, offset, &mut progress, visit)?;
        if i == last {
            progress.pos = Some(Position {
                seq: *seq,
                offset: end,
            });
        } else if torn {
            progress.damaged += 1;
        }
    }
    Ok(progress)
}

/// Reads the whole lines of one file from `offset`; returns the offset after
/// the last whole line and whether a fragment without a newline follows it.
fn read_file(
    mut file: File,
    path: &Path,
    offset: u64,
    progress: &mut Progress,
    visit: &mut dyn FnMut(Line<'_>),
) -> Result<(u64, bool)> {
    let len = file
        .metadata()
        .with_context(|| format!("reading {}", path.display()))?
        .len();
    // A file shorter than where we were was replaced: read it from the start.
    let mut pos = if offset > len { 0 } else { offset };
    file.seek(SeekFrom::Start(pos))
        .with_context(|| format!("reading {}", path.display()))?;
    let mut reader = BufReader::with_capacity(64 * 1024, file);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        let n = reader
            .read_until(b'\n', &mut buf)
            .with_context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            return Ok((pos, false));
        }
        if buf.last() != Some(&b'\n') {
            return Ok((pos, true));
        }
        pos += n as u64;
        let text = String::from_utf8_lossy(&buf[..n - 1]);
        match serde_json::from_str::<Event>(&text) {
            Ok(e) => visit(Line::Event(Box::new(e), &text)),
            Err(_) => {
                progress.damaged += 1;
                visit(Line::Damaged(&text));
            }
        }
    }
}

/// The last `n` events of environment `id`, oldest first (for `dormant inspect`).
pub fn last_of(dir: &Path, id: uuid::Uuid, n: usize) -> Result<Vec<Event>> {
    let mut kept = std::collections::VecDeque::with_capacity(n + 1);
    read_from(dir, None, &mut |line| {
        if let Line::Event(e, _) = line {
            if e.env == Some(id) {
                kept.push_back(*e);
                if kept.len() > n {
                    kept.pop_front();
                }
            }
        }
    })?;
    Ok(kept.into())
}
