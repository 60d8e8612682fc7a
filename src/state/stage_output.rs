//! A copy of what each stage printed to the job log, on the runner host, for
//! `dormant attach` (`crate::ops::attach`): `environments/<id>/output/`.
//!
//! `dormant run` writes every byte it gives the job log (the script's output
//! and dormant's own lines in it, in the job log's order) into
//! `output/<stage id>.out` right after it wrote it to its stdout, and records
//! which stage runs in `output/stage.json` (the job, the stage, its id; its
//! end and the copy's final length once it ended). An attach only reads these
//! files: it starts nothing in the environment and holds no lock, so any
//! number of watchers cost the job nothing, and a watcher killed at any point
//! leaves nothing behind, on the machine or here.
//!
//! Why a copy here rather than following the output the SSH transport keeps
//! on the machine (`transport/ssh/remote/kept.sh`): those files are removed
//! as soon as a stage ends, a stopped machine loses them (tmpfs), the `local`
//! transport keeps none, and a suspended environment must still show what its
//! last stage printed. One copy serves every provider and both cases, and a
//! watcher needs no connection of its own.
//!
//! Bounded: a copy keeps at most [`BOUND`] bytes; past it the oldest part is
//! punched out of the file (the offsets stay, as in the SSH transport's kept
//! output), and a reader that finds a hole skips it and says how many bytes
//! it missed. Only the running stage's copy and that of the last stage that
//! printed something are kept (a stage that ends with output removes the
//! older copies, one without removes its own), and the environment's
//! directory goes with its release. Writing the copy never fails or holds up
//! a stage: a write that fails stops the copy, and why is written beside it
//! (`output/copy-stopped`, until a later copy is whole), which `dormant
//! inspect` shows — not on
//! stderr: that is the job log, read by the job's people, not the operator
//! who can fix the runner host's disk.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use super::store;
use crate::model::EnvPaths;

/// The most of one stage's output a copy keeps (the newest part). The job
/// log itself is cut by GitLab Runner at `output_limit` (4 MiB by default):
/// a copy of 16 MiB holds every stage whose job log is whole.
pub const BOUND: u64 = 16 << 20;

/// When the copy outgrows [`BOUND`], it keeps this much of the newest output
/// (a reader that keeps up is never near the cut).
const KEEP_AFTER_CUT: u64 = BOUND / 4 * 3;

/// Holes are punched in whole blocks: the cut is rounded down to this, so
/// the bytes after it stay untouched on any filesystem.
const BLOCK: u64 = 64 << 10;

/// `environments/<id>/output/`.
pub fn dir(paths: &EnvPaths) -> PathBuf {
    paths.dir.join("output")
}

/// `output/stage.json`: which stage of which job runs, or ran last.
pub fn stage_file(paths: &EnvPaths) -> PathBuf {
    dir(paths).join("stage.json")
}

/// `output/last.json`: `stage.json` of the last stage that printed something.
pub fn last_file(paths: &EnvPaths) -> PathBuf {
    dir(paths).join("last.json")
}

/// Reads `output/last.json`.
pub fn read_last(paths: &EnvPaths) -> Result<Option<StageNow>> {
    store::read_json(&last_file(paths))
}

/// `output/<stage id>.out`: the copy of one stage's job log.
pub fn copy_file(paths: &EnvPaths, stage_id: &str) -> PathBuf {
    dir(paths).join(format!("{}.out", file_safe(stage_id)))
}

/// `output/copy-stopped`: the last time a copy stopped short (its stage and
/// why, one line); removed once a later stage's copy is whole.
pub fn stopped_file(paths: &EnvPaths) -> PathBuf {
    dir(paths).join("copy-stopped")
}

/// Why a copy of this environment's output last stopped short, if one did
/// since the last whole copy.
pub fn read_stopped(paths: &EnvPaths) -> Option<String> {
    std::fs::read_to_string(stopped_file(paths))
        .ok()
        .map(|t| t.trim().to_string())
}

fn file_safe(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '.' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// `output/stage.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageNow {
    /// The state files' format version (`store::FORMAT_VERSION`).
    pub version: u32,
    pub runner: String,
    pub job: u64,
    /// The runner's stage name (`build_script`, `step_script`, ...).
    pub stage: String,
    /// This run of the stage (`<stage>.<random>`): its copy's name.
    pub id: String,
    pub started_ms: u64,
    /// Written once the stage ended and its copy is complete.
    #[serde(default)]
    pub ended: Option<StageEnd>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageEnd {
    /// The script's exit code; `None` when it did not report one (a
    /// termination, a broken connection).
    pub code: Option<i32>,
    /// The copy's whole length: a reader that has read this much has it all.
    pub length: u64,
    pub ended_ms: u64,
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Reads `output/stage.json` (`None` when no stage ran in this environment).
pub fn read_stage(paths: &EnvPaths) -> Result<Option<StageNow>> {
    store::read_json(&stage_file(paths))
}

/// A stage starts: its copy is created (empty) and `stage.json` names it.
/// Not fsynced: the copy is for watchers of a running job, not something a
/// crash must keep.
pub fn begin(paths: &EnvPaths, now: &StageNow) -> Result<OutputCopy> {
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
    let path = copy_file(paths, &now.id);
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&path)
        .with_context(|| format!("creating {}", path.display()))?;
    store::write_json_unsynced(&stage_file(paths), now)?;
    Ok(OutputCopy {
        path,
        stopped: stopped_file(paths),
        stage_id: now.id.clone(),
        state: Mutex::new(CopyState {
            file: Some(file),
            stopped: false,
            written: 0,
            kept_from: 0,
        }),
    })
}

/// The stage ended: `stage.json` says so, with the copy's final length.
pub fn end(
    paths: &EnvPaths,
    mut now: StageNow,
    code: Option<i32>,
    copy: &OutputCopy,
) -> Result<()> {
    now.ended = Some(StageEnd {
        code,
        length: copy.len(),
        ended_ms: now_ms(),
    });
    store::write_json_unsynced(&stage_file(paths), &now)?;
    // What the environment shows when no job runs is the last stage that
    // printed something (the runner's last stages often print nothing): an
    // empty copy goes, a non-empty one replaces every older copy. (A watcher
    // still reading one keeps its open file.)
    let dir = dir(paths);
    if copy.is_empty() {
        let _ = std::fs::remove_file(&copy.path);
        return Ok(());
    }
    store::write_json_unsynced(&last_file(paths), &now)?;
    if !copy.has_stopped() {
        let _ = std::fs::remove_file(&copy.stopped);
    }
    if let Ok(entries) = std::fs::read_dir(&dir) {
        for e in entries.flatten() {
            let p = e.path();
            if p != copy.path && p.extension().is_some_and(|x| x == "out") {
                let _ = std::fs::remove_file(&p);
            }
        }
    }
    Ok(())
}

/// The copy of the last stage that printed something (the newest non-empty
/// copy), with its stage id; `None` when there is none.
pub fn last_copy(paths: &EnvPaths) -> Option<(PathBuf, String)> {
    let mut best: Option<(std::time::SystemTime, PathBuf)> = None;
    for e in std::fs::read_dir(dir(paths)).ok()?.flatten() {
        let p = e.path();
        let Ok(meta) = e.metadata() else { continue };
        if p.extension().is_some_and(|x| x == "out") && meta.len() > 0 {
            let t = meta.modified().unwrap_or(std::time::UNIX_EPOCH);
            if best.as_ref().is_none_or(|(bt, _)| t > *bt) {
                best = Some((t, p));
            }
        }
    }
    let (_, p) = best?;
    let id = p.file_stem()?.to_string_lossy().into_owned();
    Some((p, id))
}

/// The copy of a running stage's job log, appended to as the job log is
/// written ([`JobLogOut`]).
pub struct OutputCopy {
    path: PathBuf,
    /// Where why it stopped short is written (`stopped_file`).
    stopped: PathBuf,
    stage_id: String,
    state: Mutex<CopyState>,
}

struct CopyState {
    /// `None` once a write failed: the copy stops there.
    file: Option<File>,
    stopped: bool,
    written: u64,
    /// The offset of the first byte still kept (the part before is a hole).
    kept_from: u64,
}

impl OutputCopy {
    /// Appends `bytes`; never fails (a failed write stops the copy: a
    /// watcher misses the rest, and why is written to `copy-stopped`).
    pub fn append(&self, bytes: &[u8]) {
        let Ok(mut st) = self.state.lock() else {
            return;
        };
        let Some(file) = st.file.as_mut() else {
            return;
        };
        let written = if crate::failpoint::armed("output-copy:write") {
            // Test builds only: a write that fails (a full disk), no kill.
            Err(std::io::Error::other("failpoint output-copy:write"))
        } else {
            file.write_all(bytes)
        };
        if let Err(e) = written {
            let why = format!("writing {}: {e}", self.path.display());
            self.stop(&mut st, &why);
            return;
        }
        st.written += bytes.len() as u64;
        if st.written - st.kept_from > BOUND {
            let to = (st.written - KEEP_AFTER_CUT) / BLOCK * BLOCK;
            if to > st.kept_from {
                let from = st.kept_from;
                if let Err(e) = punch(st.file.as_ref().expect("checked above"), from, to - from) {
                    let why = format!(
                        "past {} MiB, dropping its oldest part from {} failed: {e}",
                        BOUND >> 20,
                        self.path.display()
                    );
                    self.stop(&mut st, &why);
                    return;
                }
                st.kept_from = to;
            }
        }
    }

    /// Stops the copy at what it holds, saying why in `copy-stopped`
    /// (best effort: the disk that refused the copy may refuse this too).
    fn stop(&self, st: &mut CopyState, why: &str) {
        st.file = None;
        st.stopped = true;
        let line = format!(
            "stage {}: its output's copy for `dormant attach` stopped at byte {}: {why}\n",
            self.stage_id, st.written
        );
        let _ = store::write_private(&self.stopped, line.as_bytes());
    }

    /// Whether a failed write stopped it short.
    pub fn has_stopped(&self) -> bool {
        self.state.lock().map(|s| s.stopped).unwrap_or(true)
    }

    /// Bytes appended so far (the copy's length).
    pub fn len(&self) -> u64 {
        self.state.lock().map(|s| s.written).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Frees `len` bytes at `offset` of `file`, keeping its size (`fallocate`
/// with `FALLOC_FL_PUNCH_HOLE`): a reader finds a hole there (`SEEK_DATA`).
fn punch(file: &File, offset: u64, len: u64) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: fallocate reads its integer arguments only; the fd is open.
    let r = unsafe {
        libc::fallocate(
            file.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            offset as libc::off_t,
            len as libc::off_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The job log of a stage: dormant's stdout first (the job log's delay is
/// never a watcher's business), then the copy.
pub struct JobLogOut<'a> {
    copy: Option<&'a OutputCopy>,
}

impl<'a> JobLogOut<'a> {
    pub fn new(copy: Option<&'a OutputCopy>) -> Self {
        JobLogOut { copy }
    }
}

impl Write for JobLogOut<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        std::io::stdout().lock().write_all(buf)?;
        if let Some(copy) = self.copy {
            copy.append(buf);
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stdout().lock().flush()
    }
}

/// Where the next kept byte is at or after `offset` in `file`: `offset`
/// itself unless the bytes there were punched out; `None` at the end.
pub fn next_data(file: &File, offset: u64) -> Option<u64> {
    use std::os::fd::AsRawFd;
    // SAFETY: lseek reads its integer arguments only; the fd is open.
    let r = unsafe { libc::lseek(file.as_raw_fd(), offset as libc::off_t, libc::SEEK_DATA) };
    (r >= 0).then_some(r as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::unix::fs::FileExt;

    fn paths(dir: &Path) -> EnvPaths {
        let p = EnvPaths::new(dir, uuid::Uuid::new_v4());
        std::fs::create_dir_all(&p.dir).unwrap();
        p
    }

    fn stage(id: &str) -> StageNow {
        StageNow {
            version: store::FORMAT_VERSION,
            runner: "1".into(),
            job: 7,
            stage: "build_script".into(),
            id: id.into(),
            started_ms: now_ms(),
            ended: None,
        }
    }

    #[test]
    fn a_copy_holds_every_byte_and_its_end_says_how_many() {
        let tmp = tempfile::tempdir().unwrap();
        let p = paths(tmp.path());
        let copy = begin(&p, &stage("build_script.1")).unwrap();
        copy.append(b"one\n");
        copy.append(b"\0two");
        assert_eq!(read_stage(&p).unwrap().unwrap().ended, None);
        end(&p, stage("build_script.1"), Some(3), &copy).unwrap();
        let now = read_stage(&p).unwrap().unwrap();
        let e = now.ended.unwrap();
        assert_eq!((e.code, e.length), (Some(3), 8));
        let mut text = Vec::new();
        File::open(copy_file(&p, "build_script.1"))
            .unwrap()
            .read_to_end(&mut text)
            .unwrap();
        assert_eq!(text, b"one\n\0two");
    }

    #[test]
    fn a_copy_that_cannot_be_written_says_why_until_a_later_copy_is_whole() {
        let tmp = tempfile::tempdir().unwrap();
        let p = paths(tmp.path());
        let a = begin(&p, &stage("a.1")).unwrap();
        a.append(b"kept");
        // The disk refuses the rest (ENOSPC).
        a.state.lock().unwrap().file = Some(
            std::fs::OpenOptions::new()
                .write(true)
                .open("/dev/full")
                .unwrap(),
        );
        a.append(b"lost");
        a.append(b"lost too");
        assert!(a.has_stopped());
        assert_eq!(a.len(), 4);
        end(&p, stage("a.1"), Some(0), &a).unwrap();
        let why = read_stopped(&p).expect("said");
        assert!(
            why.starts_with("stage a.1: ") && why.contains("stopped at byte 4: writing"),
            "{why}"
        );
        // A stage that prints nothing leaves it; one whose copy is whole ends it.
        let b = begin(&p, &stage("b.2")).unwrap();
        end(&p, stage("b.2"), Some(0), &b).unwrap();
        assert!(read_stopped(&p).is_some());
        let c = begin(&p, &stage("c.3")).unwrap();
        c.append(b"c");
        end(&p, stage("c.3"), Some(0), &c).unwrap();
        assert_eq!(read_stopped(&p), None);
    }

    #[test]
    fn the_last_stage_that_printed_is_kept_and_older_copies_go() {
        let tmp = tempfile::tempdir().unwrap();
        let p = paths(tmp.path());
        let a = begin(&p, &stage("a.1")).unwrap();
        a.append(b"a");
        end(&p, stage("a.1"), Some(0), &a).unwrap();
        let open = File::open(copy_file(&p, "a.1")).unwrap();
        // A stage that prints nothing leaves the last one's copy.
        let b = begin(&p, &stage("b.2")).unwrap();
        end(&p, stage("b.2"), Some(0), &b).unwrap();
        assert!(!copy_file(&p, "b.2").exists());
        assert_eq!(last_copy(&p).unwrap().1, "a.1");
        // One that prints replaces it.
        let c = begin(&p, &stage("c.3")).unwrap();
        c.append(b"c");
        end(&p, stage("c.3"), Some(0), &c).unwrap();
        assert!(!copy_file(&p, "a.1").exists());
        assert_eq!(last_copy(&p).unwrap().1, "c.3");
        // A reader of the older one keeps what it opened.
        let mut byte = [0u8; 1];
        open.read_at(&mut byte, 0).unwrap();
        assert_eq!(&byte, b"a");
        assert_eq!(read_stage(&p).unwrap().unwrap().id, "c.3");
    }

    #[test]
    fn past_the_bound_the_oldest_part_is_a_hole_and_the_rest_is_intact() {
        let tmp = tempfile::tempdir().unwrap();
        let p = paths(tmp.path());
        let copy = begin(&p, &stage("big.1")).unwrap();
        let chunk: Vec<u8> = (0..1 << 20).map(|i| (i % 251) as u8 + 1).collect();
        for _ in 0..17 {
            copy.append(&chunk);
        }
        assert_eq!(copy.len(), 17 << 20);
        let f = File::open(copy.path()).unwrap();
        let first = next_data(&f, 0).unwrap();
        assert!(first > 0, "the oldest part was dropped");
        assert!(17 * (1 << 20) - first >= KEEP_AFTER_CUT);
        assert_eq!(first % BLOCK, 0);
        let mut got = vec![0u8; 100];
        f.read_exact_at(&mut got, first).unwrap();
        let want: Vec<u8> = (first..first + 100)
            .map(|i| ((i % (1 << 20)) % 251) as u8 + 1)
            .collect();
        assert_eq!(got, want, "bytes after the hole are untouched");
    }
}
