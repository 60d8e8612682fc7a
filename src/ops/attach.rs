//! `dormant attach KEY|ID|JOB_ID [--from-now]`: watch a running job, live.
//!
//! Prints the running stage's job log from its first byte (or from now),
//! then each next stage of the same job, until the job ends (exit 0) or the
//! person detaches (Ctrl-C, SIGTERM, a closed pipe: exit 0, the job
//! untouched). The bytes are the job log's own, read from the copy `dormant
//! run` keeps on the runner host (`crate::state::stage_output`): stdout
//! carries exactly them, and dormant's own lines (which stage, its end, the
//! job's end) go to stderr.
//!
//! Read-only: an attach reads files and holds no lock, starts nothing in the
//! environment and opens no connection, so watchers — any number — change
//! nothing for the job, and one killed at any point leaves nothing behind.
//! An environment no job runs in (suspended, paused, in a shell) shows what
//! its last stage printed, says it is not running, and exits with
//! [`Refused::NotRunning`]'s code.
//!
//! Who may: whoever can read the state dir (the runner's user, root), as
//! for every operator command.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::time::Duration;

use anyhow::{Context, Result};
use tokio_util::sync::CancellationToken;

use crate::context::{Ctx, JobLog};
use crate::events::{Event, EventLog, Kind};
use crate::exit::Refused;
use crate::job::Job;
use crate::model::EnvPaths;
use crate::settings::Settings;
use crate::state::registry;
use crate::state::stage_output::{self, StageEnd, StageNow};

use super::find::{self, running_job};
use super::open_store;

/// How often a watcher looks for new bytes when it has read all there is: a
/// byte reaches it at most this long after the job log (plus a read).
const POLL: Duration = Duration::from_millis(10);
/// Idle polls between two looks at the environment's record (has the job
/// ended?): every 100 ms.
const RECORD_EVERY: u32 = 10;

#[derive(Debug, Clone, Default)]
pub struct AttachRequest {
    pub key: String,
    /// Start at the running stage's current end instead of its first byte.
    pub from_now: bool,
}

/// How a watch ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Watched {
    /// The job ended (its cleanup began, or it is gone).
    JobEnded,
    /// Ctrl-C, SIGTERM, or the reader of our stdout went away.
    Detached,
}

pub async fn attach(
    settings: &Settings,
    job: &Job,
    req: &AttachRequest,
    log: JobLog,
    cancel: CancellationToken,
    out: &mut dyn Write,
) -> Result<Watched> {
    let store = open_store(settings, job)?;
    let found = find::find(settings, &store, &req.key)?;
    let id = found.paths.id;
    let Some((runner, job_id)) = found.running_job().filter(|(_, j)| match found.job {
        Some(asked) => asked == *j,
        None => true,
    }) else {
        return not_running(&found, out);
    };
    let events = EventLog::new(store.root(), &settings.events);
    let ctx = Ctx::new(log.clone(), cancel.clone(), super::OPERATOR_BUDGET);
    let user = local_user(job);
    let event = Event::about(Kind::Joined, "attach", &found.record)
        .by_text(&format!("dormant attach (pid {})", std::process::id()))
        .job(Some(job_id))
        .user(&user);
    events.record(event, &ctx).await;
    log.info(format!(
        "watching job {job_id} in environment {id} (read-only; Ctrl-C detaches, the job runs on)"
    ));
    let w = Watch {
        paths: &found.paths,
        runner: &runner,
        job: job_id,
        log: &log,
        cancel: &cancel,
    };
    let ended = w.follow_job(req.from_now, out).await?;
    match ended {
        Watched::JobEnded => log.info(format!("job {job_id} ended")),
        Watched::Detached => log.info(format!("detached; job {job_id} runs on")),
    }
    Ok(ended)
}

/// The environment runs no job: what its last stage printed, then why not.
fn not_running(found: &find::Found, out: &mut dyn Write) -> Result<Watched> {
    let id = found.paths.id;
    let state = match (found.record.holder(), found.record.status()) {
        (Some(h), s) => format!("{} and held by {}", s.as_str(), h.describe()),
        (None, s) => s.as_str().to_string(),
    };
    let asked = match found.job {
        Some(job) => format!("job {job} runs no stage: its environment {id}"),
        None => format!("environment {id}"),
    };
    let now = stage_output::read_last(&found.paths)?;
    let shown = match stage_output::last_copy(&found.paths) {
        Some((path, stage_id)) => match File::open(&path) {
            Ok(file) => {
                drain(&file, &mut 0, out, None);
                let _ = out.flush();
                let which = match now.filter(|n| n.id == stage_id) {
                    Some(n) => format!(
                        "{} of job {}{}",
                        n.stage,
                        n.job,
                        ended_words(n.ended.as_ref())
                    ),
                    // `<stage>.<random>`
                    None => stage_id
                        .rsplit_once('.')
                        .map_or(stage_id.clone(), |(stage, _)| stage.to_string()),
                };
                format!("; above is what its last stage that printed something printed ({which})")
            }
            Err(_) => "; the output of its last stage is not kept any more".to_string(),
        },
        None => "; no stage printed anything in it on this runner manager".to_string(),
    };
    Err(Refused::NotRunning.because(format!("{asked} is not running (it is {state}){shown}")))
}

fn ended_words(end: Option<&StageEnd>) -> String {
    match end {
        Some(StageEnd {
            code: Some(code), ..
        }) => format!(", exit code {code}"),
        Some(_) => ", no exit code reported".to_string(),
        None => ", its end never recorded".to_string(),
    }
}

/// One watcher of one job.
struct Watch<'a> {
    paths: &'a EnvPaths,
    runner: &'a str,
    job: u64,
    log: &'a JobLog,
    cancel: &'a CancellationToken,
}

/// How following one stage ended.
enum Stage {
    Ended(Option<StageEnd>),
    JobEnded,
    Detached,
}

impl Watch<'_> {
    /// The job's stages, one after the other, until it ends.
    async fn follow_job(&self, from_now: bool, out: &mut dyn Write) -> Result<Watched> {
        let mut seen: Option<String> = None;
        let mut first = true;
        let mut said_waiting = false;
        loop {
            if self.cancel.is_cancelled() {
                return Ok(Watched::Detached);
            }
            if !self.job_runs()? {
                return Ok(Watched::JobEnded);
            }
            let now = stage_output::read_stage(self.paths)?
                .filter(|n| n.runner == self.runner && n.job == self.job);
            match now {
                Some(now) if seen.as_deref() != Some(now.id.as_str()) => {
                    seen = Some(now.id.clone());
                    // A stage that ended before we came is not "the running stage".
                    if !(first && now.ended.is_some()) {
                        said_waiting = false;
                        self.log.info(format!("{} of job {}:", now.stage, self.job));
                        match self.follow_stage(&now, first && from_now, out).await? {
                            Stage::Ended(end) => self.log.info(format!(
                                "{} ended{}",
                                now.stage,
                                ended_words(end.as_ref())
                            )),
                            Stage::JobEnded => return Ok(Watched::JobEnded),
                            Stage::Detached => return Ok(Watched::Detached),
                        }
                    }
                }
                _ => {
                    if !said_waiting {
                        self.log
                            .info(format!("waiting for the next stage of job {}", self.job));
                        said_waiting = true;
                    }
                }
            }
            first = false;
            if self.nap(POLL).await {
                return Ok(Watched::Detached);
            }
        }
    }

    /// Copies one stage's job log to `out` until the stage's end.
    async fn follow_stage(
        &self,
        now: &StageNow,
        from_now: bool,
        out: &mut dyn Write,
    ) -> Result<Stage> {
        let path = stage_output::copy_file(self.paths, &now.id);
        let file = match File::open(&path) {
            Ok(f) => f,
            // A newer stage began and removed it before we could look.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Stage::Ended(None)),
            Err(e) => return Err(e).with_context(|| format!("opening {}", path.display())),
        };
        let mut offset = if from_now {
            file.metadata().map(|m| m.len()).unwrap_or(0)
        } else {
            0
        };
        let mut idle = 0u32;
        // The end says more than the copy holds after a read found nothing:
        // the bytes came in between; a second time, they never will.
        let mut short = false;
        loop {
            if self.cancel.is_cancelled() {
                return Ok(Stage::Detached);
            }
            match copy_out(&file, &mut offset, out, Some(self.log)) {
                Err(_) => return Ok(Stage::Detached),
                Ok(true) => {
                    idle = 0;
                    short = false;
                    continue;
                }
                Ok(false) => {}
            }
            // All there is, read: has the stage ended?
            match stage_output::read_stage(self.paths)? {
                Some(n) if n.id == now.id => {
                    if let Some(end) = n.ended {
                        if offset >= end.length || short {
                            return Ok(Stage::Ended(Some(end)));
                        }
                        short = true;
                        continue;
                    }
                }
                // A newer stage began (so ours ended and its copy is whole),
                // or the environment is gone: what is left, then done.
                other => {
                    drain(&file, &mut offset, out, Some(self.log));
                    return Ok(match other {
                        None => Stage::JobEnded,
                        Some(_) => Stage::Ended(None),
                    });
                }
            }
            idle += 1;
            if idle.is_multiple_of(RECORD_EVERY) && !self.job_runs()? {
                // (The run that wrote it was killed: its end is never recorded.)
                drain(&file, &mut offset, out, Some(self.log));
                return Ok(Stage::JobEnded);
            }
            if self.nap(POLL).await {
                return Ok(Stage::Detached);
            }
        }
    }

    /// Whether the job still holds the environment (its cleanup has not begun).
    fn job_runs(&self) -> Result<bool> {
        Ok(registry::peek(self.paths)?
            .and_then(|r| running_job(&r))
            .is_some_and(|(r, j)| r == self.runner && j == self.job))
    }

    /// Sleeps; `true` when the person detached meanwhile.
    async fn nap(&self, d: Duration) -> bool {
        tokio::select! {
            () = tokio::time::sleep(d) => false,
            () = self.cancel.cancelled() => true,
        }
    }
}

/// Copies all that `file` holds from `offset` on, for a stage that will not
/// grow any more. A failed write (the reader went away) ends it too: nobody
/// wants the rest.
fn drain(file: &File, offset: &mut u64, out: &mut dyn Write, log: Option<&JobLog>) {
    while matches!(copy_out(file, offset, out, log), Ok(true)) {}
}

/// Copies what `file` holds from `offset` on (one read of up to 64 KiB) to
/// `out`; `Ok(true)` when it copied something. Bytes punched out of the copy
/// (a stage past the copy's bound) are skipped, saying how many.
fn copy_out(
    file: &File,
    offset: &mut u64,
    out: &mut dyn Write,
    log: Option<&JobLog>,
) -> std::io::Result<bool> {
    if let Some(data) = stage_output::next_data(file, *offset) {
        if data > *offset {
            if let Some(log) = log {
                log.warn(format!(
                    "{} bytes of this stage's output were dropped from the copy before they were \
                     read (it keeps the newest {} MiB)",
                    data - *offset,
                    stage_output::BOUND >> 20
                ));
            }
            *offset = data;
        }
    }
    let mut buf = vec![0u8; 64 * 1024];
    let n = file.read_at(&mut buf, *offset)?;
    if n == 0 {
        return Ok(false);
    }
    out.write_all(&buf[..n])?;
    out.flush()?;
    *offset += n as u64;
    Ok(true)
}

/// The local user running this command, for the event log: the login name
/// of the real uid, and under sudo who called it.
pub fn local_user(job: &Job) -> String {
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    let name = user_name(uid).unwrap_or_else(|| format!("uid {uid}"));
    match job.driver_var("SUDO_USER") {
        Some(by) if !by.is_empty() && by != name => format!("{name} (sudo by {by})"),
        _ => name,
    }
}

fn user_name(uid: libc::uid_t) -> Option<String> {
    let mut buf = vec![0 as libc::c_char; 4096];
    let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
    let mut result: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: getpwuid_r writes into `pwd` and `buf`, both ours and sized as
    // passed; `result` points at `pwd` or is null.
    let r = unsafe { libc::getpwuid_r(uid, &mut pwd, buf.as_mut_ptr(), buf.len(), &mut result) };
    if r != 0 || result.is_null() {
        return None;
    }
    // SAFETY: on success pw_name is a NUL-terminated string inside `buf`.
    let name = unsafe { std::ffi::CStr::from_ptr(pwd.pw_name) };
    Some(name.to_string_lossy().into_owned())
}
