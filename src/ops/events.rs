//! `dormant events [KEY|ID] [--since DURATION] [--follow] [--json]`: the
//! event history of one environment (also one released long ago) or of all,
//! oldest first, as a table or as the JSON lines stored. `--follow` keeps
//! printing new lines as they are appended, through rotations, until SIGINT
//! or SIGTERM. Damaged lines are skipped and counted on stderr.

use std::io::Write;
use std::time::Duration;

use anyhow::{bail, Result};
use tokio_util::sync::CancellationToken;

use crate::events::read::{read_from, Line};
use crate::events::Event;
use crate::job::Job;
use crate::settings::{HumanDuration, Settings};
use crate::text::excerpt;

use super::open_store;

/// How often `--follow` looks for new lines: a person watching sees a line
/// within half a second; each look lists the log's directory and reads only
/// what was appended. An unbounded tail on purpose, like `tail -f`: it ends
/// when the person interrupts it.
const FOLLOW_EVERY: Duration = Duration::from_millis(500);
/// `--since` at most ten years: beyond, it means "everything" anyway.
const SINCE_MAX: HumanDuration = HumanDuration::from_secs(3650 * 86400);

/// What the person asked for.
#[derive(Debug, Clone, Default)]
pub struct EventsRequest {
    pub key: Option<String>,
    pub since: Option<String>,
    pub follow: bool,
    pub json: bool,
}

pub async fn events(
    settings: &Settings,
    job: &Job,
    req: &EventsRequest,
    cancel: CancellationToken,
    out: &mut dyn Write,
) -> Result<()> {
    let store = open_store(settings, job)?;
    let id = req
        .key
        .as_deref()
        .map(|k| super::find::env_id(settings, &store, k))
        .transpose()?;
    let since_ms = match &req.since {
        None => None,
        Some(text) => {
            let d = HumanDuration::parse(text).map_err(|e| anyhow::anyhow!("--since: {e}"))?;
            if d > SINCE_MAX {
                bail!("--since: {d} is more than {SINCE_MAX}; leave --since out for everything");
            }
            let now_ms = crate::state::now_unix().saturating_mul(1000);
            Some(now_ms.saturating_sub(d.as_secs().saturating_mul(1000)))
        }
    };
    let dir = crate::events::dir(store.root());
    let mut printer = Printer {
        out,
        json: req.json,
        id,
        since_ms,
        header: false,
        broken: None,
    };
    let mut progress = read_from(&dir, None, &mut |line| printer.line(line))?;
    printer.flush();
    let mut damaged = progress.damaged;
    while req.follow && printer.broken.is_none() {
        tokio::select! {
            _ = cancel.cancelled() => break,
            _ = tokio::time::sleep(FOLLOW_EVERY) => {}
        }
        let next = read_from(&dir, progress.pos, &mut |line| printer.line(line))?;
        printer.flush();
        if next.missed_files > 0 {
            eprintln!(
                "dormant: {} event log file(s) were rotated away before they were read \
                 (events.keep_files keeps more)",
                next.missed_files
            );
        }
        damaged += next.damaged;
        progress = next;
    }
    if damaged > 0 {
        eprintln!(
            "dormant: {damaged} damaged line(s) in the event log {} were skipped",
            dir.display()
        );
    }
    match printer.broken {
        // The reader went away (`| head`): nothing more to say.
        Some(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        Some(e) => Err(anyhow::Error::from(e).context("writing the events")),
        None => Ok(()),
    }
}

struct Printer<'a> {
    out: &'a mut dyn Write,
    json: bool,
    id: Option<uuid::Uuid>,
    since_ms: Option<u64>,
    header: bool,
    /// The first write error: the rest is not written.
    broken: Option<std::io::Error>,
}

impl Printer<'_> {
    fn line(&mut self, line: Line<'_>) {
        let Line::Event(e, text) = line else { return };
        if self.broken.is_some()
            || self.id.is_some_and(|id| e.env != Some(id))
            || self.since_ms.is_some_and(|since| e.ts_ms < since)
        {
            return;
        }
        let written = if self.json {
            writeln!(self.out, "{text}")
        } else {
            self.row(&e)
        };
        if let Err(err) = written {
            self.broken = Some(err);
        }
    }

    fn row(&mut self, e: &Event) -> std::io::Result<()> {
        if !self.header {
            self.header = true;
            writeln!(
                self.out,
                "{:<24}  {:<9}  {:<16}  {:<36}  {:>8}  {:>7}  {:<8}  {:>9}  DETAIL",
                "TIME", "EVENT", "CAUSE", "ENVIRONMENT", "JOB", "PROJECT", "PROVIDER", "TOOK"
            )?;
        }
        let dash = || "-".to_string();
        writeln!(
            self.out,
            "{:<24}  {:<9}  {:<16}  {:<36}  {:>8}  {:>7}  {:<8}  {:>9}  {}",
            excerpt(&e.time),
            excerpt(&e.event),
            excerpt(&e.cause),
            e.env.map_or_else(dash, |id| id.to_string()),
            e.job.map_or_else(dash, |j| j.to_string()),
            e.project.map_or_else(dash, |p| p.to_string()),
            excerpt(&e.provider),
            e.duration_s.map_or_else(dash, span),
            detail(e)
        )
    }

    fn flush(&mut self) {
        if self.broken.is_none() {
            if let Err(e) = self.out.flush() {
                self.broken = Some(e);
            }
        }
    }
}

/// The last column: what a person wants to know beyond the others.
pub fn detail(e: &Event) -> String {
    let mut parts = Vec::new();
    if let Some(by) = &e.by {
        parts.push(format!("by {by}"));
    }
    if let Some(user) = &e.user {
        parts.push(format!("user {user}"));
    }
    if let Some(from) = &e.from {
        parts.push(format!("from {from}"));
    }
    if let Some(s) = e.suspended_s {
        parts.push(format!("after {} suspended", span(s)));
    }
    if let Some(s) = &e.sweep {
        let of = s
            .environments
            .map(|n| format!(" of {n}"))
            .unwrap_or_default();
        parts.push(format!(
            "visited {}{of}, released {}, recovered {}, removed {}, errors {}, unvisited {}",
            s.visited, s.released, s.recovered, s.removed, s.errors, s.unvisited
        ));
    }
    if let Some(r) = &e.reason {
        parts.push(r.clone());
    }
    if let Some(err) = &e.error {
        parts.push(format!("error: {err}"));
    }
    excerpt(&parts.join("; "))
}

/// "0.31 s", "12 s", "3 min", "5 h", "2 days".
pub fn span(secs: f64) -> String {
    match secs {
        s if s < 10.0 => format!("{s:.2} s"),
        s if s < 120.0 => format!("{s:.0} s"),
        s if s < 7200.0 => format!("{:.0} min", s / 60.0),
        s if s < 172_800.0 => format!("{:.0} h", s / 3600.0),
        s => format!("{:.0} days", s / 86400.0),
    }
}
