//! The job log's side of a stage whose output is kept on the machine
//! (`remote/kept.sh`): which byte of the stage's output comes next, so a
//! session opened after a lost connection continues exactly where the job
//! log stopped — no byte lost or twice, bytes in order — and where dormant's
//! own line about it goes: on a line of its own, never inside a line the
//! script was in the middle of writing.
//!
//! Offsets are absolute: byte `n` of the stage's output is byte `n` of the
//! file on the machine (the oldest part may have been punched out of it, the
//! offsets stay). A session says where its output starts (`dormant-at`); the
//! stream takes what it has not seen and counts.

use std::io::Write;

/// The stage's output as it reaches the job log.
pub struct Stream<W: Write> {
    out: W,
    /// The offset of the next byte of the stage's output.
    offset: u64,
    /// The last byte written was a newline, or nothing was written yet.
    line_start: bool,
    /// dormant's own line, held until the script's current line is complete.
    note: Option<String>,
    /// Writing failed (the runner stopped reading): the rest is only counted.
    broken: bool,
}

impl<W: Write> Stream<W> {
    pub fn new(out: W) -> Self {
        Stream {
            out,
            offset: 0,
            line_start: true,
            note: None,
            broken: false,
        }
    }

    /// The offset of the next byte expected: where a new session follows from.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// A session's output starts at `at`. Returns how many bytes were dropped
    /// on the machine before it (past the bound): `at - offset`, else 0.
    pub fn resume_at(&mut self, at: u64) -> u64 {
        let lost = at.saturating_sub(self.offset);
        self.offset = self.offset.max(at);
        lost
    }

    /// Copies a chunk of the session's output (it follows on from
    /// [`Self::offset`]); dormant's held line goes in after its first newline.
    pub fn write(&mut self, mut data: &[u8]) {
        if data.is_empty() {
            return;
        }
        self.offset += data.len() as u64;
        if self.note.is_some() {
            match data.iter().position(|&b| b == b'\n') {
                Some(i) => {
                    self.emit(&data[..=i]);
                    self.line_start = true;
                    self.flush_note();
                    data = &data[i + 1..];
                }
                None => {
                    self.emit(data);
                    self.line_start = false;
                    return;
                }
            }
        }
        if let Some(&last) = data.last() {
            self.emit(data);
            self.line_start = last == b'\n';
        }
    }

    /// dormant's own line (`dormant: ` is added): at once when the job log is
    /// at the start of a line, else after the script's current line. A line
    /// still held is replaced (it said less).
    pub fn note(&mut self, text: impl std::fmt::Display) {
        self.note = Some(format!("dormant: {text}\n"));
        if self.line_start {
            self.flush_note();
        }
    }

    /// The stage is over: a held line goes out now, after a newline that ends
    /// the script's last, unfinished line.
    pub fn finish(&mut self) {
        if self.note.is_some() {
            if !self.line_start {
                self.emit(b"\n");
                self.line_start = true;
            }
            self.flush_note();
        }
    }

    /// The stage is over (a held line goes out, as [`Self::finish`]);
    /// whether the job log is in the middle of a line the script left
    /// unfinished. The caller writes the newline that ends it with its own
    /// line, in one write.
    pub fn ends_mid_line(&mut self) -> bool {
        self.finish();
        !self.line_start
    }

    /// Ends a line the script left unfinished, so a message that follows
    /// (an error, a termination) starts on a line of its own.
    pub fn end_line(&mut self) {
        self.finish();
        if !self.line_start {
            self.emit(b"\n");
            self.line_start = true;
        }
    }

    fn flush_note(&mut self) {
        if let Some(note) = self.note.take() {
            self.emit(note.as_bytes());
        }
    }

    fn emit(&mut self, bytes: &[u8]) {
        if self.broken {
            return;
        }
        // The job log stays live: every chunk is flushed as it comes.
        if self
            .out
            .write_all(bytes)
            .and_then(|()| self.out.flush())
            .is_err()
        {
            self.broken = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(s: &Stream<Vec<u8>>) -> String {
        String::from_utf8(s.out.clone()).unwrap()
    }

    #[test]
    fn a_resumed_session_continues_at_the_byte_where_the_log_stopped() {
        let mut s = Stream::new(Vec::new());
        s.write(b"line 1\nline 2\nli");
        assert_eq!(s.offset(), 16);
        // The next session starts exactly there: nothing lost, nothing twice.
        assert_eq!(s.resume_at(16), 0);
        s.write(b"ne 3\n");
        assert_eq!(text(&s), "line 1\nline 2\nline 3\n");
        assert_eq!(s.offset(), 21);
    }

    #[test]
    fn dormants_line_waits_for_the_end_of_a_partial_line() {
        let mut s = Stream::new(Vec::new());
        s.write(b"progress: 50%");
        s.note("the connection was gone for 3.0 s");
        assert_eq!(text(&s), "progress: 50%", "not inside the script's line");
        s.write(b" done\nnext");
        assert_eq!(
            text(&s),
            "progress: 50% done\ndormant: the connection was gone for 3.0 s\nnext"
        );
        s.write(b" line\n");
        assert!(text(&s).ends_with("next line\n"));
        assert_eq!(s.offset(), 29, "dormant's own bytes are not the stage's");
    }

    #[test]
    fn at_a_line_start_dormants_line_goes_out_at_once() {
        let mut s = Stream::new(Vec::new());
        s.write(b"a\n");
        s.note("back");
        s.write(b"b\n");
        assert_eq!(text(&s), "a\ndormant: back\nb\n");
    }

    #[test]
    fn a_stage_ending_in_a_partial_line_gets_the_held_line_after_it() {
        let mut s = Stream::new(Vec::new());
        s.write(b"no newline at the end");
        s.note("back");
        s.finish();
        assert_eq!(text(&s), "no newline at the end\ndormant: back\n");
        // Nothing held: nothing added.
        let mut s = Stream::new(Vec::new());
        s.write(b"tail");
        s.finish();
        assert_eq!(text(&s), "tail");
    }

    #[test]
    fn bytes_dropped_on_the_machine_are_counted_and_skipped() {
        let mut s = Stream::new(Vec::new());
        s.write(b"0123");
        assert_eq!(s.resume_at(10), 6);
        s.write(b"abc");
        assert_eq!(s.offset(), 13);
        // A session never starts before what dormant has (the machine's
        // `max(asked, kept)`); if one did, nothing is counted twice.
        assert_eq!(s.resume_at(5), 0);
        assert_eq!(s.offset(), 13);
    }

    #[test]
    fn a_later_line_replaces_one_still_held() {
        let mut s = Stream::new(Vec::new());
        s.write(b"x");
        s.note("first");
        s.note("second");
        s.write(b"\n");
        assert_eq!(text(&s), "x\ndormant: second\n");
    }

    #[test]
    fn end_line_finishes_a_partial_line_before_a_message() {
        let mut s = Stream::new(Vec::new());
        s.write(b"half");
        s.end_line();
        s.end_line();
        assert_eq!(text(&s), "half\n");
    }

    #[test]
    fn a_runner_that_stopped_reading_only_stops_the_copy() {
        struct Closed;
        impl Write for Closed {
            fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
                Err(std::io::ErrorKind::BrokenPipe.into())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let mut s = Stream::new(Closed);
        s.write(b"abc\n");
        s.write(b"de");
        assert_eq!(s.offset(), 6);
    }
}
