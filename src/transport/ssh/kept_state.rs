//! What dormant knows of a kept stage (`remote/kept.sh`): across its
//! sessions ([`Stage`]: started, script sent, connection lost, pause
//! refused, and the job log's offset), where it runs ([`Place`]), and what
//! one session has reported so far ([`Heard`]) — each wrapper report taken
//! into both by [`Heard::take`]. The session itself is read by
//! [`super::kept::drive`].

use std::time::{Duration, Instant};

use super::remote::{Mode, Report};
use super::stream::Stream;
use crate::transport::Script;

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

/// The stage's place on the machine, the script and where its output goes.
pub struct Place<'a> {
    pub dest: &'a str,
    pub workdir: Option<&'a str>,
    /// The script as uploaded ([`super::remote::script_with_env`]).
    pub body: &'a [u8],
    pub env: &'a str,
    pub linger_secs: u64,
    pub bound: u64,
}

/// What one session reported so far.
#[derive(Default)]
pub(super) struct Heard {
    /// The session's stdout carries the stage's output (it said where from).
    pub(super) attached: bool,
    pub(super) exit: Option<(i32, Option<u64>)>,
    /// The script asked: this round's output ends at the offset.
    pub(super) paused: Option<(u64, Vec<u8>)>,
    pub(super) watched: Option<bool>,
    pub(super) error: Option<String>,
    pub(super) other: Vec<String>,
    pub(super) cancelled: bool,
    /// The script relays a paused script ([`Report::Relaying`]): the stage's
    /// end waits until the owner took the last acknowledgement.
    pub(super) relaying: bool,
    /// The exit code the relayed script's continue gave, when it ended.
    pub(super) relayed_exit: Option<i32>,
}

impl Heard {
    /// Takes one report of the wrapper into what this session and the stage
    /// know, and notes in the job log what its reader must know.
    pub(super) fn take<W: std::io::Write>(
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
            Report::Relaying(code) => {
                self.relaying = true;
                self.relayed_exit = code;
            }
            // (Waited for at the stage's end only: `kept::drive`.)
            Report::Took => {}
            Report::Other(l) => {
                if self.attached {
                    eprintln!("{l}");
                }
                self.other.push(l);
            }
        }
    }
}
