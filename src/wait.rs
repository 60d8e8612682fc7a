//! The one way dormant waits for something outside its control: an instance
//! to reach a state, sshd to answer, a slot or capacity to free up, a lock, a
//! throttled API to accept calls again.
//!
//! [`Wait::until`] runs a probe on a [`Schedule`] inside the caller's [`Ctx`]
//! (its deadline and SIGTERM) and reports progress to the job log in one
//! style, at a bounded rate:
//!
//! ```text
//! dormant: waiting for instance i-0ab… to be running: pending (12 s of 600 s)
//! ```
//!
//! Every wait's tuning (interval, backoff, how chatty it is) is a value here
//! or at its call site, never a hand-written loop: see docs/waits.md for the
//! intervals every wait uses and why, and for the few loops that drive
//! something of dormant's own (a kept stage's session, `events --follow`)
//! and are not waits on this helper.

use std::future::Future;
use std::time::Duration;

use anyhow::{anyhow, Result};
// Tokio's clock (the monotonic clock `Ctx::deadline` is measured on, unless a
// test pauses time).
use tokio::time::Instant;

use crate::context::Ctx;

/// When the next probe runs, measured from the start of the previous one
/// (so a fixed interval of 1 s is at most one probe a second, however long
/// each probe takes).
#[derive(Debug, Clone)]
pub enum Schedule {
    /// Every `interval`; for cheap probes and for transitions that must be
    /// noticed promptly.
    Fixed(Duration),
    /// `first`, doubling to `max`, each ±20 % (so a fleet of runners does
    /// not probe in lockstep); for probes that cost the other side something.
    Backoff { first: Duration, max: Duration },
}

impl Schedule {
    pub fn fixed(interval: Duration) -> Self {
        Schedule::Fixed(interval)
    }

    pub fn backoff(first: Duration, max: Duration) -> Self {
        Schedule::Backoff { first, max }
    }

    /// The pause after the `n`-th probe (0-based).
    pub fn delay(&self, n: u32) -> Duration {
        match *self {
            Schedule::Fixed(d) => d,
            Schedule::Backoff { first, max } => {
                let base = first.checked_mul(1u32 << n.min(20)).unwrap_or(max).min(max);
                base.mul_f64(0.8 + fastrand::f64() * 0.4)
            }
        }
    }
}

/// What one probe found.
#[derive(Debug)]
pub enum Poll<T> {
    Ready(T),
    /// Not yet; the text says what it is now ("pending", "3 of 3 slots in
    /// use", "connection refused"), for the progress line and the timeout error.
    Pending(String),
}

/// A progress line at most this often while the state stays the same.
pub const PROGRESS_EVERY: Duration = Duration::from_secs(10);
/// And at most this often when it changes.
const PROGRESS_MIN_GAP: Duration = Duration::from_secs(1);

/// One wait: what is waited for, how often to look, and the progress it has
/// reported so far.
pub struct Wait<'a> {
    ctx: &'a Ctx,
    what: String,
    schedule: Schedule,
    quiet_for: Duration,
    progress_every: Duration,
    started: Instant,
    budget: Duration,
    probes: u32,
    last_state: Option<String>,
    last_line: Option<(Instant, String)>,
}

impl<'a> Wait<'a> {
    /// `what` completes "waiting for ...": e.g. "instance i-1 to be running".
    pub fn new(ctx: &'a Ctx, what: impl Into<String>, schedule: Schedule) -> Self {
        Wait {
            ctx,
            what: what.into(),
            schedule,
            quiet_for: Duration::ZERO,
            progress_every: PROGRESS_EVERY,
            started: Instant::now(),
            budget: Instant::from_std(ctx.deadline).saturating_duration_since(Instant::now()),
            probes: 0,
            last_state: None,
            last_line: None,
        }
    }

    /// No progress line before this much time has passed (waits that are
    /// usually over in milliseconds, like a lock, stay silent).
    pub fn quiet_for(mut self, d: Duration) -> Self {
        self.quiet_for = d;
        self
    }

    /// A progress line at most this often while the state stays the same.
    pub fn progress_every(mut self, d: Duration) -> Self {
        self.progress_every = d;
        self
    }

    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// Probes made so far.
    pub fn probes(&self) -> u32 {
        self.probes
    }

    /// What the last probe said, if it was not ready.
    pub fn last_state(&self) -> Option<&str> {
        self.last_state.as_deref()
    }

    pub fn what(&self) -> &str {
        &self.what
    }

    /// Probes until ready. The first probe runs at once. An error from the
    /// probe ends the wait with that error; the deadline and SIGTERM end it
    /// with an error naming what was waited for and what it was last.
    pub async fn until<T, F, Fut>(&mut self, mut probe: F) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<Poll<T>>>,
    {
        loop {
            self.check()?;
            let probe_started = Instant::now();
            let n = self.probes;
            self.probes += 1;
            match probe().await? {
                Poll::Ready(v) => return Ok(v),
                Poll::Pending(state) => {
                    self.report(&state);
                    self.last_state = Some(state);
                }
            }
            let next = probe_started + self.schedule.delay(n);
            self.sleep_until(next).await?;
        }
    }

    /// Waits for something that announces itself (a future: a process's
    /// report, a pipe closing) instead of being probed, bounded by the
    /// deadline and SIGTERM like every other wait and ending with the same
    /// errors. For grace periods: "the script gets 5 s to exit after SIGTERM".
    pub async fn event<T>(&mut self, happened: impl Future<Output = T>) -> Result<T> {
        self.check()?;
        tokio::select! {
            biased;
            v = happened => Ok(v),
            _ = self.ctx.cancel.cancelled() => Err(self.ended("cancelled (termination signal) while waiting for")),
            _ = tokio::time::sleep_until(self.deadline()) => Err(self.ended("timed out waiting for")),
        }
    }

    /// Sleeps until `at` (cut short by the deadline, which the next check reports).
    pub async fn sleep_until(&self, at: Instant) -> Result<()> {
        let at = at.min(self.deadline());
        tokio::select! {
            _ = tokio::time::sleep_until(at) => Ok(()),
            _ = self.ctx.cancel.cancelled() => Err(self.ended("cancelled (termination signal) while waiting for")),
        }
    }

    fn check(&self) -> Result<()> {
        if self.ctx.cancel.is_cancelled() {
            return Err(self.ended("cancelled (termination signal) while waiting for"));
        }
        if self.probes > 0 && self.remaining().is_zero() {
            return Err(self.ended("timed out waiting for"));
        }
        Ok(())
    }

    fn deadline(&self) -> Instant {
        Instant::from_std(self.ctx.deadline)
    }

    /// Time left before the caller's deadline.
    pub fn remaining(&self) -> Duration {
        self.deadline().saturating_duration_since(Instant::now())
    }

    fn ended(&self, how: &str) -> anyhow::Error {
        anyhow!(
            "{how} {} after {} s{}",
            self.what,
            self.started.elapsed().as_secs(),
            self.last_state
                .as_deref()
                .map(|s| format!(" (last: {s})"))
                .unwrap_or_default()
        )
    }

    /// The progress line, if one is due: the first after `quiet_for`, then on
    /// a change of state (at most once a second) or every `progress_every`.
    fn report(&mut self, state: &str) {
        let elapsed = self.started.elapsed();
        if elapsed < self.quiet_for {
            return;
        }
        let due = match &self.last_line {
            None => true,
            Some((at, said)) => {
                let since = at.elapsed();
                since >= self.progress_every || (said != state && since >= PROGRESS_MIN_GAP)
            }
        };
        if due {
            self.ctx.log.info(self.line(state));
            self.last_line = Some((Instant::now(), state.to_string()));
        }
    }

    /// "waiting for X: state (12 s of 600 s)".
    pub fn line(&self, state: &str) -> String {
        format!(
            "waiting for {}: {state} ({} s of {} s)",
            self.what,
            self.started.elapsed().as_secs(),
            // The budget was measured a moment after the deadline was set.
            self.budget.as_secs_f64().round() as u64
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::context::JobLog;
    use std::sync::{Arc, Mutex};
    use tokio_util::sync::CancellationToken;

    fn ctx(budget: Duration) -> (Ctx, Arc<Mutex<Vec<u8>>>) {
        let (log, buf) = JobLog::capture();
        (Ctx::new(log, CancellationToken::new(), budget), buf)
    }

    fn text(buf: &Arc<Mutex<Vec<u8>>>) -> String {
        String::from_utf8_lossy(&buf.lock().unwrap()).to_string()
    }

    #[test]
    fn backoff_grows_to_its_cap_with_jitter_and_fixed_stays() {
        let s = Schedule::backoff(Duration::from_millis(100), Duration::from_secs(1));
        let d: Vec<_> = (0..8).map(|n| s.delay(n)).collect();
        assert!(d[0] >= Duration::from_millis(80) && d[0] <= Duration::from_millis(120));
        assert!(d[2] >= Duration::from_millis(320) && d[2] <= Duration::from_millis(480));
        assert!(d[7] >= Duration::from_millis(800) && d[7] <= Duration::from_millis(1200));
        assert!(s.delay(u32::MAX) <= Duration::from_millis(1200));
        let f = Schedule::fixed(Duration::from_millis(200));
        assert_eq!(f.delay(0), f.delay(50));
    }

    #[tokio::test]
    async fn probes_first_at_once_then_on_schedule_until_ready() {
        let (ctx, buf) = ctx(Duration::from_secs(600));
        // (Long enough that a preempted first probe still comes before it.)
        let every = Duration::from_millis(250);
        let mut wait = Wait::new(&ctx, "the thing", Schedule::fixed(every));
        let seen = std::sync::Mutex::new(Vec::new());
        let t = Instant::now();
        let v = wait
            .until(|| async {
                let mut seen = seen.lock().unwrap();
                seen.push(t.elapsed());
                let k = seen.len();
                Ok(if k == 4 {
                    Poll::Ready(k)
                } else {
                    Poll::Pending(format!("step {k}"))
                })
            })
            .await
            .unwrap();
        assert_eq!((v, wait.probes()), (4, 4));
        let seen = seen.into_inner().unwrap();
        // The first probe without a pause, then one per interval (start to start).
        assert!(seen[0] < every, "{seen:?}");
        for (k, at) in seen.iter().enumerate() {
            assert!(*at >= every * k as u32, "{seen:?}");
        }
        let log = text(&buf);
        assert!(
            log.starts_with("dormant: waiting for the thing: step 1 (0 s of 600 s)\n"),
            "{log}"
        );
        // The state changed at every probe, but a line comes at most once a second.
        let lines = log.lines().count() as u64;
        assert!(lines <= 1 + t.elapsed().as_secs(), "{log}");
    }

    #[tokio::test]
    async fn progress_is_bounded_while_the_state_stays_the_same() {
        let (ctx, buf) = ctx(Duration::from_millis(350));
        let every = Duration::from_millis(100);
        let mut wait = Wait::new(&ctx, "a slot", Schedule::fixed(Duration::from_millis(5)))
            .progress_every(every);
        let t = Instant::now();
        let e = wait
            .until(|| async { Ok(Poll::<()>::Pending("2 of 2 in use".into())) })
            .await
            .unwrap_err();
        let waited = t.elapsed();
        assert!(waited >= Duration::from_millis(350), "{waited:?}");
        let msg = format!("{e:#}");
        assert!(
            msg.starts_with("timed out waiting for a slot after 0 s (last: 2 of 2 in use)"),
            "{msg}"
        );
        // Many probes, but a line only at the start and then once per `every`.
        let lines = text(&buf).lines().count() as u32;
        assert!(wait.probes() > lines, "{} probes", wait.probes());
        assert!(
            lines >= 2 && lines <= 1 + (waited.as_millis() / every.as_millis()) as u32,
            "{lines} lines in {waited:?}:\n{}",
            text(&buf)
        );
    }

    #[tokio::test]
    async fn quiet_waits_say_nothing_when_short_and_cancel_names_the_wait() {
        let (ctx, buf) = ctx(Duration::from_secs(60));
        let mut wait = Wait::new(&ctx, "a lock", Schedule::fixed(Duration::from_millis(5)))
            .quiet_for(Duration::from_secs(30));
        let n = std::sync::atomic::AtomicU32::new(0);
        wait.until(|| async {
            Ok(
                if n.fetch_add(1, std::sync::atomic::Ordering::Relaxed) >= 5 {
                    Poll::Ready(())
                } else {
                    Poll::Pending("held".into())
                },
            )
        })
        .await
        .unwrap();
        assert_eq!(text(&buf), "");

        let cancel = ctx.cancel.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            cancel.cancel();
        });
        let mut wait = Wait::new(&ctx, "a lock", Schedule::fixed(Duration::from_secs(1)));
        let e = wait
            .until(|| async { Ok(Poll::<()>::Pending("held".into())) })
            .await
            .unwrap_err();
        assert!(
            format!("{e:#}").contains("cancelled (termination signal) while waiting for a lock"),
            "{e:#}"
        );
    }

    #[tokio::test]
    async fn an_event_wait_returns_the_event_or_fails_at_the_deadline_or_on_sigterm() {
        let (short, _) = ctx(Duration::from_millis(300));
        let mut wait = Wait::new(
            &short,
            "the report",
            Schedule::fixed(Duration::from_secs(1)),
        );
        let v = wait
            .event(async {
                tokio::time::sleep(Duration::from_millis(20)).await;
                7
            })
            .await
            .unwrap();
        assert_eq!(v, 7);

        let t = Instant::now();
        let e = wait.event(std::future::pending::<()>()).await.unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        assert!(
            format!("{e:#}").starts_with("timed out waiting for the report after 0 s"),
            "{e:#}"
        );

        let (long, _) = ctx(Duration::from_secs(600));
        let cancel = long.cancel.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            cancel.cancel();
        });
        let e = Wait::new(&long, "the report", Schedule::fixed(Duration::from_secs(1)))
            .event(std::future::pending::<()>())
            .await
            .unwrap_err();
        assert!(
            format!("{e:#}")
                .contains("cancelled (termination signal) while waiting for the report"),
            "{e:#}"
        );
    }

    #[tokio::test]
    async fn a_probe_error_ends_the_wait_with_that_error() {
        let (ctx, _) = ctx(Duration::from_secs(60));
        let mut wait = Wait::new(&ctx, "x", Schedule::fixed(Duration::from_secs(1)));
        let e = wait
            .until(|| async { Err::<Poll<()>, _>(anyhow!("access denied")) })
            .await
            .unwrap_err();
        assert_eq!(format!("{e:#}"), "access denied");
        assert_eq!(wait.probes(), 1);
    }
}
