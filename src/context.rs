//! What every long operation gets: where to say what it is doing (the job log),
//! the cancellation that SIGTERM fires, and the deadline it must finish by.
//! Waiting itself (polling, backoff, progress lines) is `crate::wait`.

use std::fmt::Display;
use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use tokio_util::sync::CancellationToken;

/// Lines for the reader of the job log: `dormant: ...`, no timestamps (the
/// runner adds them). In prepare and run stderr is the job log; in cleanup it
/// goes to the runner's own log.
#[derive(Clone)]
pub struct JobLog {
    sink: Arc<Mutex<Box<dyn Write + Send>>>,
}

impl JobLog {
    pub fn stderr() -> Self {
        JobLog {
            sink: Arc::new(Mutex::new(Box::new(std::io::stderr()))),
        }
    }

    /// A log that drops its lines: for a wait whose progress must not reach
    /// the job log (a re-attach, which says one line of its own at the end).
    pub fn discard() -> Self {
        JobLog {
            sink: Arc::new(Mutex::new(Box::new(std::io::sink()))),
        }
    }

    /// A log that keeps its lines in memory, for tests.
    pub fn capture() -> (Self, Arc<Mutex<Vec<u8>>>) {
        #[derive(Clone)]
        struct Shared(Arc<Mutex<Vec<u8>>>);
        impl Write for Shared {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buf = Arc::new(Mutex::new(Vec::new()));
        (
            JobLog {
                sink: Arc::new(Mutex::new(Box::new(Shared(buf.clone())))),
            },
            buf,
        )
    }

    pub fn info(&self, msg: impl Display) {
        self.line(format_args!("dormant: {msg}"));
    }

    pub fn warn(&self, msg: impl Display) {
        self.line(format_args!("dormant: warning: {msg}"));
    }

    fn line(&self, text: std::fmt::Arguments<'_>) {
        if let Ok(mut sink) = self.sink.lock() {
            let _ = writeln!(sink, "{text}");
            let _ = sink.flush();
        }
    }
}

/// Context for one bounded, cancellable operation.
#[derive(Clone)]
pub struct Ctx {
    pub log: JobLog,
    pub cancel: CancellationToken,
    pub deadline: Instant,
}

impl Ctx {
    pub fn new(log: JobLog, cancel: CancellationToken, budget: Duration) -> Self {
        Ctx {
            log,
            cancel,
            deadline: deadline_after(budget),
        }
    }

    /// The same log and cancellation with a tighter deadline.
    pub fn within(&self, budget: Duration) -> Ctx {
        Ctx {
            deadline: self.deadline.min(deadline_after(budget)),
            ..self.clone()
        }
    }

    /// The same log and deadline, but deaf to SIGTERM (a suspension in progress
    /// finishes before termination wins).
    pub fn uncancellable(&self) -> Ctx {
        Ctx {
            cancel: CancellationToken::new(),
            ..self.clone()
        }
    }

    pub fn remaining(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now())
    }

    pub fn check(&self, what: &str) -> Result<()> {
        if self.cancel.is_cancelled() {
            bail!("cancelled (termination signal) while {what}");
        }
        if self.remaining().is_zero() {
            bail!("timed out {what}");
        }
        Ok(())
    }
}

/// `now + budget`, saturating: settings bound every duration, but a budget no
/// clock can hold must still mean "no deadline to speak of", never a panic.
fn deadline_after(budget: Duration) -> Instant {
    const CENTURY: Duration = Duration::from_secs(100 * 365 * 86400);
    let now = Instant::now();
    now.checked_add(budget.min(CENTURY)).unwrap_or(now)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets_no_clock_can_hold_saturate() {
        let ctx = Ctx::new(JobLog::capture().0, CancellationToken::new(), Duration::MAX);
        assert!(ctx.remaining() > Duration::from_secs(365 * 86400));
        let inner = ctx.within(Duration::MAX);
        assert!(inner.remaining() > Duration::from_secs(365 * 86400));
        assert!(ctx.within(Duration::from_secs(1)).remaining() <= Duration::from_secs(1));
    }
}
