//! One session of a stage whose output is kept on the machine
//! (`remote/kept.sh`): it starts the stage, or follows one a lost connection
//! left running, from the byte where the job log stopped ([`Stream`]).
//!
//! The session's stdin carries the script (when it starts the stage), then
//! control lines: `TERM`/`KILL` on SIGTERM, `PAUSE <question>` on a
//! `dormant pause` request. The stage is over when the
//! wrapper has reported the exit code with the output's length and that many
//! bytes have arrived: no end of file is waited for, so the follower that
//! copies the output costs the stage's end nothing. Then dormant just closes
//! the session: over a connection that lives, that tells the machine dormant
//! is done (or dead) and it drops what it kept — no acknowledgement to wait
//! for. A session that ends before that is [`Once::Broken`]: dormant first
//! says `KEEP` (it will follow again; the script must run on), and the caller
//! reconnects if need be and follows again.
//!
//! The reading itself ([`drive`]) does not care what carries the session:
//! the local transport runs the same wrapper in a local bash and reads it
//! with it (`transport/local_kept.rs`), so pausing works there by this one
//! protocol.

use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use openssh::Session;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};

use super::channel::{self, KILL_STEP, TERM_GRACE};
use super::remote::{self, Kept, Mode, Report};
use super::stream::Stream;
use crate::context::Ctx;
use crate::transport::{Ran, Script, ScriptExit};

/// How long `KEEP` may take to leave dormant's pipe for the master: once the
/// master has read it, it is delivered even as dormant closes the session
/// (the master sends what it read before it closes a channel whose client
/// left). Only on the rare path of a session broken over a live connection.
const KEEP_HANDOFF: Duration = Duration::from_millis(200);

/// How often a running stage looks for a `dormant pause` request: the pause
/// takes effect at most this long after it was recorded (plus the machine's
/// 50 ms owner step).
const PAUSE_POLL: Duration = Duration::from_millis(100);

/// How long the stage's owner may take to report a `PAUSE` it was sent
/// (`halt` freezes the group within 2 s, then asks). Past it the owner is
/// taken for dead (killed between `$o.stop` and `$o.ask`, docs/pause.md):
/// its session does not end by itself — the wrapper still holds its stderr
/// while it waits for the frozen script —, so dormant follows the stage
/// again, and the new session's owner takes over and halts again.
const PAUSE_TAKEN: Duration = Duration::from_secs(10);

/// Sessions in a row that broke at once, the stage not moving (nothing learnt
/// from them), before the stage is given up: the machine (or the local bash)
/// refuses them for a reason waiting does not fix.
const MAX_FUTILE_SESSIONS: u32 = 5;

/// What dormant knows of a stage across its sessions.
pub struct Stage<W: std::io::Write> {
    pub stream: Stream<W>,
    /// The machine said the stage started (a session claimed it or follows it).
    pub started: bool,
    /// A session carrying the script was opened: a later one must not start
    /// the script again without asking ([`Mode::Retry`]).
    pub sent: bool,
    /// When the connection was found lost, until a session follows again.
    pub lost_since: Option<Instant>,
    /// The machine refused a `dormant pause` (another script of the
    /// environment waits for its answer): it is not asked again.
    pub pause_refused: bool,
}

impl<W: std::io::Write> Stage<W> {
    pub fn new(out: W) -> Self {
        Stage {
            stream: Stream::new(out),
            started: false,
            sent: false,
            lost_since: None,
            pause_refused: false,
        }
    }

    /// How far the stage has come: a session that ends at once leaves it
    /// where it was.
    pub fn progress(&self) -> (bool, u64) {
        (self.started, self.stream.offset())
    }

    /// After a session that broke (`before`: [`Stage::progress`] when it
    /// began): counts it in `futile` if the stage did not move, and waits a
    /// little longer each time. `false`: [`MAX_FUTILE_SESSIONS`] came in a
    /// row (the job log's line is ended): the caller gives the stage up.
    pub async fn again_after_broken(&mut self, before: (bool, u64), futile: &mut u32) -> bool {
        *futile = if self.progress() == before {
            *futile + 1
        } else {
            0
        };
        if *futile >= MAX_FUTILE_SESSIONS {
            self.stream.end_line();
            return false;
        }
        tokio::time::sleep(Duration::from_millis(100) * *futile).await;
        true
    }

    /// How the next session takes part.
    pub fn mode(&self) -> Mode {
        if self.started {
            Mode::Follow(self.stream.offset())
        } else if self.sent {
            Mode::Retry
        } else {
            Mode::Start
        }
    }
}

/// How one session ended.
pub enum Once {
    Done(Ran),
    /// The master's socket did not answer: nothing reached the machine.
    MasterUnreachable(String),
    /// The session ended before the stage's end was read.
    Broken(String),
}

/// The stage's place on the machine, the script and where its output goes.
pub struct Place<'a> {
    pub dest: &'a str,
    pub workdir: Option<&'a str>,
    /// The script as uploaded ([`remote::script_with_env`]).
    pub body: &'a [u8],
    pub env: &'a str,
    pub linger_secs: u64,
    pub bound: u64,
}

/// The next session's command line (`remote/kept.sh` in `mode`) and what it
/// uploads: the script, unless the session follows a stage that started.
/// The same over SSH and through a local bash (`transport/local_kept.rs`).
pub fn next_session<'a>(place: &Place<'a>, script: &Script<'_>, mode: Mode) -> (&'a [u8], String) {
    let upload: &'a [u8] = match mode {
        Mode::Follow(_) => &[],
        Mode::Start | Mode::Retry => place.body,
    };
    let kept = Kept {
        env: place.env,
        stage: script.id,
        mode,
        linger_secs: place.linger_secs,
        bound: place.bound,
    };
    let line = remote::command_line(upload.len(), place.workdir, script.watch, Some(&kept));
    (upload, line)
}

/// Opens one session of the stage over `session` and reads it to the stage's
/// end, or until it breaks.
pub async fn run_once<W: std::io::Write>(
    session: &Session,
    place: &Place<'_>,
    script: &Script<'_>,
    st: &mut Stage<W>,
    ctx: &Ctx,
) -> Result<Once> {
    let (upload, line) = next_session(place, script, st.mode());
    let mut child = match channel::open(session, &line, place.dest, script.stage).await? {
        channel::Opened::Child(child) => child,
        channel::Opened::MasterUnreachable(why) => return Ok(Once::MasterUnreachable(why)),
    };
    st.sent |= !upload.is_empty();
    let (Some(stdin), Some(stdout), Some(stderr)) = (
        child.stdin().take(),
        child.stdout().take(),
        child.stderr().take(),
    ) else {
        bail!("the SSH session for {} has no pipes", script.stage);
    };
    drive(child, stdin, stdout, stderr, upload, place, script, st, ctx).await
}

/// Reads one session of the stage, whatever carries it: an SSH session's
/// pipes (the `ssh` transport), or a local bash's running the same wrapper
/// (the `local` transport's kept stages, [`crate::transport::local_kept`]).
/// `child` is held while the session is read and dropped (closing the
/// session) once its end is known; `upload` is what goes first on `stdin`.
#[allow(clippy::too_many_arguments)]
pub async fn drive<C, I, O, E, W>(
    child: C,
    stdin: I,
    mut stdout: O,
    stderr: E,
    upload: &[u8],
    place: &Place<'_>,
    script: &Script<'_>,
    st: &mut Stage<W>,
    ctx: &Ctx,
) -> Result<Once>
where
    I: AsyncWrite + AsRawFd + Unpin,
    O: AsyncRead + Unpin,
    E: AsyncRead + Unpin,
    W: std::io::Write,
{
    let (control, control_rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    let writer = write_control(stdin, upload, control_rx);
    tokio::pin!(writer);
    let mut lines = BufReader::new(stderr).lines();
    let mut buf = vec![0u8; 64 * 1024];
    let mut s = Heard::default();
    let mut writing = true;
    let (mut stdout_done, mut stderr_done) = (false, false);
    let mut escalation: Option<(tokio::time::Instant, &'static str)> = None;
    // `dormant pause` (docs/pause.md): its request is looked for while the
    // script runs; once passed on, the owner's `dormant-paused` ends the stage.
    let mut pause_poll = tokio::time::interval(PAUSE_POLL);
    pause_poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut pause_sent = script.pause.is_none() || st.pause_refused;
    let mut pause_due: Option<tokio::time::Instant> = None;
    let ended = loop {
        if let Some((at, _)) = &s.paused {
            if st.stream.offset() >= *at {
                break Some(0);
            }
        }
        if let Some((code, len)) = s.exit {
            if s.cancelled || st.stream.offset() >= len.unwrap_or(0) {
                break Some(code);
            }
        }
        if stdout_done || stderr_done {
            break None;
        }
        let next_step = escalation.map(|(at, _)| at);
        tokio::select! {
            biased;
            () = ctx.cancel.cancelled(), if !s.cancelled => {
                s.cancelled = true;
                ctx.log.info(format!("termination: stopping {} on {}", script.stage, place.dest));
                let _ = control.send("TERM".into());
                escalation = Some((tokio::time::Instant::now() + TERM_GRACE, "KILL"));
            }
            () = sleep_until(next_step), if next_step.is_some() => {
                match escalation.take() {
                    Some((_, "KILL")) => {
                        ctx.log.info(format!(
                            "{} did not stop within {} s of SIGTERM: killing it",
                            script.stage,
                            TERM_GRACE.as_secs()
                        ));
                        let _ = control.send("KILL".into());
                        escalation = Some((tokio::time::Instant::now() + KILL_STEP, "give up"));
                    }
                    _ => break None,
                }
            }
            () = sleep_until(pause_due), if pause_due.is_some() && s.paused.is_none() && !s.cancelled && !st.pause_refused => {
                ctx.log.warn(format!(
                    "{} on {}: its owner on the machine did not take the pause within {} s (it \
                     died?): following the stage again",
                    script.stage,
                    place.dest,
                    PAUSE_TAKEN.as_secs()
                ));
                break None;
            }
            _ = pause_poll.tick(), if !pause_sent && s.attached && !s.cancelled => {
                let asked = script
                    .pause
                    .and_then(|file| crate::state::pause_request::for_stage(file, script.id));
                if let Some(question) = asked {
                    // (A line of the job log's own: after the script's
                    // current line, which a frozen script may leave open.)
                    st.stream.note(format!("dormant pause: pausing {} on {}", script.stage, place.dest));
                    let _ = control.send(format!(
                        "PAUSE {}",
                        super::pause::encode_base64(question.as_bytes())
                    ));
                    pause_sent = true;
                    pause_due = Some(tokio::time::Instant::now() + PAUSE_TAKEN);
                }
            }
            line = lines.next_line(), if !stderr_done => match line {
                Ok(Some(line)) => s.take(remote::parse_report(&line), st, place, script),
                _ => stderr_done = true,
            },
            read = stdout.read(&mut buf), if s.attached && !stdout_done => match read {
                Ok(n) if n > 0 => {
                    st.stream.write(&buf[..n]);
                    // Taken into the job log, after every read: the machine
                    // drops it in steps of a quarter of the bound, and a
                    // relayed paused script records how far this job's log
                    // has it (remote/kept_owner.sh `ack`, `relayed`): a
                    // `dormant run` killed then leaves at most this one read
                    // to be shown again.
                    let _ = control.send(format!("ACK {}", st.stream.offset()));
                }
                _ => stdout_done = true,
            },
            r = &mut writer, if writing => {
                writing = false;
                if let Err(e) = r {
                    tracing::debug!("writing to the {} session: {e}", script.stage);
                }
            }
        }
    };
    if let Some(code) = ended {
        if s.paused.is_some() {
            // The round's job log ends where dormant stopped, which is past
            // the owner's offset when a background writer went on: the next
            // round starts there (`TAKEN`), and the question starts a line.
            let _ = control.send(format!("TAKEN {}", st.stream.offset()));
            st.stream.end_line();
        } else if !s.cancelled {
            // The job log has the stage's end: a paused script the stage
            // relayed to its end goes with the stage's files (`DONE`).
            let _ = control.send("DONE".into());
        }
        drop(control);
        if writing {
            let _ = tokio::time::timeout(KEEP_HANDOFF * 2, &mut writer).await;
        }
        // Closing the session over a live connection tells the machine that
        // dormant has the stage's end: it drops what it kept.
        drop(child);
        let exit = if s.cancelled {
            ScriptExit::Cancelled
        } else {
            ScriptExit::Code(code)
        };
        let paused = s.paused.take().map(|(_, question)| question);
        return Ok(Once::Done(Ran {
            exit,
            watched: s.watched,
            left_running: false,
            paused,
        }));
    }
    if !s.cancelled && s.error.is_none() {
        // Following again: the script must not take the closed session for
        // dormant's end.
        let _ = control.send("KEEP".into());
        drop(control);
        if writing {
            let _ = tokio::time::timeout(KEEP_HANDOFF * 2, &mut writer).await;
        }
        drop(child);
        let said = if s.other.is_empty() {
            "the session ended".to_string()
        } else {
            s.other.join("; ")
        };
        return Ok(Once::Broken(said));
    }
    drop(control);
    drop(child);
    if s.cancelled {
        st.stream.end_line();
        ctx.log.warn(format!(
            "termination during {}: the script on {} did not report its end; it may still be \
             running there: the job's cleanup stops it",
            script.stage, place.dest
        ));
        return Ok(Once::Done(Ran {
            exit: ScriptExit::Cancelled,
            watched: None,
            left_running: true,
            paused: None,
        }));
    }
    let e = s.error.unwrap_or_default();
    st.stream.end_line();
    bail!("{e} ({})", place.dest)
}

/// What one session reported so far.
#[derive(Default)]
struct Heard {
    /// The session's stdout carries the stage's output (it said where from).
    attached: bool,
    exit: Option<(i32, Option<u64>)>,
    /// The script asked: this round's output ends at the offset.
    paused: Option<(u64, Vec<u8>)>,
    watched: Option<bool>,
    error: Option<String>,
    other: Vec<String>,
    cancelled: bool,
}

impl Heard {
    fn take<W: std::io::Write>(
        &mut self,
        report: Report,
        st: &mut Stage<W>,
        place: &Place<'_>,
        script: &Script<'_>,
    ) {
        match report {
            Report::Kept => {
                self.attached = true;
                st.started = true;
            }
            Report::At(at) => {
                self.attached = true;
                st.started = true;
                let dropped = st.stream.resume_at(at);
                let gap = if dropped > 0 {
                    format!(
                        "; {dropped} bytes of its output were dropped on the machine meanwhile \
                         (more than ssh.kept_output_mib = {} MiB)",
                        place.bound >> 20
                    )
                } else {
                    String::new()
                };
                match st.lost_since.take() {
                    Some(since) => st.stream.note(format!(
                        "the SSH connection to {} was gone for {:.1} s during {}; re-attached, the \
                         script ran on{gap}",
                        place.dest,
                        since.elapsed().as_secs_f64(),
                        script.stage
                    )),
                    None if dropped > 0 => st
                        .stream
                        .note(format!("the job log fell behind {}{gap}", script.stage)),
                    None => {}
                }
            }
            Report::Pgid(_) => {
                for l in &self.other {
                    eprintln!("{l}");
                }
            }
            Report::Exit(code, len) => self.exit = Some((code, len)),
            Report::Paused(at, question) => self.paused = Some((at, question)),
            Report::Watched(present) => self.watched = Some(present),
            Report::Warn(text) => {
                // (kept_owner.sh `halt`: one paused script per environment.)
                if text.starts_with("dormant pause: not paused") {
                    st.pause_refused = true;
                    if let Some(file) = script.pause {
                        let _ = crate::state::pause_request::withdraw(file, script.id);
                    }
                }
                st.stream.note(format!("warning: {text}"));
            }
            Report::Error(e) => self.error = Some(e),
            Report::Other(l) => {
                if self.attached {
                    eprintln!("{l}");
                }
                self.other.push(l);
            }
        }
    }
}

/// The session's stdin: the script, then control lines until the sender is
/// dropped; then it waits (at most [`KEEP_HANDOFF`]) until the master has
/// taken them.
async fn write_control<I: AsyncWrite + AsRawFd + Unpin>(
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

async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
