//! One session of a stage whose output is kept on the machine
//! (`remote/kept.sh`): it starts the stage, or follows one a lost connection
//! left running, from the byte where the job log stopped
//! ([`Stream`](super::stream::Stream)).
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
//!
//! Here is the session's driver; what dormant knows of the stage across its
//! sessions and what one session reported are in [`super::kept_state`], the
//! session's stdin in [`super::kept_control`].

use std::os::fd::AsRawFd;
use std::time::Duration;

use anyhow::{bail, Result};
use openssh::Session;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, BufReader};

use super::channel::{self, KILL_STEP, TERM_GRACE};
use super::kept_control::{write_control, KEEP_HANDOFF};
use super::kept_state::{Heard, Place, Stage};
use super::remote::{self, Kept, Mode};
use crate::context::Ctx;
use crate::transport::{Ran, Script, ScriptExit};

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

/// How long the end of a stage that relayed a paused script, or of a pause
/// round a background writer went on in, waits for the owner to confirm it
/// has dormant's last line (`dormant-took`; it looks every 50 ms).
const OWNER_TOOK: Duration = Duration::from_secs(5);

/// How one session ended.
pub enum Once {
    Done(Ran),
    /// The master's socket did not answer: nothing reached the machine.
    MasterUnreachable(String),
    /// The session ended before the stage's end was read.
    Broken(String),
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
            // The control lines first: below the output's reads, which are
            // ready all along while a script writes fast, they waited in
            // dormant's memory (acknowledgements by the megabyte, lost
            // with a killed `dormant run`, and the machine's bound not
            // moving meanwhile).
            r = &mut writer, if writing => {
                writing = false;
                if let Err(e) = r {
                    tracing::debug!("writing to the {} session: {e}", script.stage);
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
        }
    };
    if let Some(code) = ended {
        // Whether the owner must have the last line before the session
        // closes: what is still in the connection then is lost with it.
        let mut confirm = false;
        let mut mid_line = false;
        if s.paused.is_some() {
            // The round's job log ends where dormant stopped, which is past
            // the owner's offset when a background writer went on: the next
            // round starts there (`TAKEN`, recorded in `.kept` before the
            // owner confirms), and the question starts a line: the newline
            // that ends a prompt goes with the question's line, in one
            // write (`Ran::paused_mid_line`), not here, where a `dormant
            // run` killed before that line left a byte the script never
            // wrote (soak seed 1282249999024437585).
            let _ = control.send(format!("TAKEN {}", st.stream.offset()));
            confirm = true;
            mid_line = st.stream.ends_mid_line();
        } else if !s.cancelled {
            // The job log has the stage's end (`DONE`): the owner drops the
            // stage's files at once. (Without it the owner tells dormant's
            // close from a lost connection by looking for 100 ms whether
            // the connection lives, and a connection cut meanwhile left the
            // files kept for the whole reconnect timeout: soak seed
            // 9219574273027428238 on ssh.) A paused script the stage
            // relayed to its end goes with them, and its owner records how
            // far this job's log has it: then dormant waits for its
            // `dormant-took`.
            //
            // The relayed script's exit code, given by its continue, is
            // noted on this host first: from `DONE` on it is on the machine
            // no more, and until this process exits the runner has not got
            // it (`crate::state::relayed_end`).
            if let (Some(code), Some(file)) = (s.relayed_exit, script.relayed) {
                if let Err(e) = crate::state::relayed_end::note(file, script.id, code) {
                    tracing::warn!("noting the relayed script's exit code {code}: {e:#}");
                }
            }
            let _ = control.send("DONE".into());
            confirm = s.relaying;
        }
        drop(control);
        if confirm {
            let took = async {
                loop {
                    tokio::select! {
                        r = &mut writer, if writing => {
                            writing = false;
                            if let Err(e) = r {
                                tracing::debug!("writing to the {} session: {e}", script.stage);
                            }
                        }
                        line = lines.next_line() => match line {
                            Ok(Some(l)) if remote::parse_report(&l) == remote::Report::Took => break,
                            Ok(Some(_)) => {}
                            _ => break,
                        },
                    }
                }
            };
            if tokio::time::timeout(OWNER_TOOK, took).await.is_err() {
                tracing::debug!(
                    "{} on {}: the owner did not confirm the stage's last line within {} s",
                    script.stage,
                    place.dest,
                    OWNER_TOOK.as_secs()
                );
            }
            // (Crash point: the machine let the relayed script go, the
            // runner has not got the stage's code.)
            if s.relaying {
                crate::failpoint!("run:relayed");
            }
        }
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
            paused_mid_line: mid_line,
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
            paused_mid_line: false,
        }));
    }
    let e = s.error.unwrap_or_default();
    st.stream.end_line();
    bail!("{e} ({})", place.dest)
}

async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
