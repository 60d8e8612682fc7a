//! `list` and `inspect`: the operator's view of the registry. `list` shows
//! every directory under `environments/`, also one without a readable record
//! (a corrupt file, or a leftover `sweep` removes). `inspect` shows one
//! record with its last events from the event log. Both show the warm
//! pool's machines too (`list` after the environments; `inspect <warm id>`).

use std::io::Write;

use anyhow::Result;
use serde_json::json;

use crate::job::Job;
use crate::lifecycle::human_age;
use crate::settings::Settings;
use crate::state::{now_unix, registry, EnvStatus, EnvironmentRecord};

use super::open_store;

pub fn list(settings: &Settings, job: &Job, json: bool, out: &mut dyn Write) -> Result<()> {
    let store = open_store(settings, job)?;
    if !json {
        writeln!(
            out,
            "{:<36}  {:<10}  {:<8}  {:<7}  {:>7}  {:>10}  {:>4}  {:<10}  KEY",
            "ENVIRONMENT",
            "STATUS",
            "PROVIDER",
            "STORAGE",
            "PROJECT",
            "SUSPENDED",
            "JOBS",
            "HELD BY"
        )?;
    }
    for id in store.environment_ids()? {
        let paths = store.env_paths(id);
        match registry::peek(&paths) {
            Ok(Some(rec)) if json => writeln!(out, "{}", record_json(&rec)?)?,
            Ok(Some(rec)) => {
                let age = rec
                    .suspended_at
                    .filter(|_| rec.status() == EnvStatus::Suspended)
                    .map(|t| human_age(now_unix().saturating_sub(t)))
                    .unwrap_or_else(|| "-".into());
                let held = rec
                    .holder()
                    .map(|h| h.describe())
                    .unwrap_or_else(|| "-".into());
                // A suspended environment whose script waits for an answer
                // (docs/pause.md) says so, and what it asks, after its key;
                // one whose script was lost with the machine's memory is
                // not paused, and says that instead.
                let (status, asks) = match &rec.paused {
                    Some(p) if rec.status() == EnvStatus::Suspended && p.lost.is_some() => (
                        rec.status().as_str(),
                        format!(
                            "  paused script lost: {}",
                            crate::text::json_for_terminal(
                                &serde_json::Value::String(crate::lifecycle::pause::summary(
                                    p.lost.as_deref().unwrap_or_default()
                                ))
                                .to_string()
                            )
                        ),
                    ),
                    // Its script ended; the job that continued it was
                    // killed before it gave the code: the next continue does.
                    Some(p) if rec.status() == EnvStatus::Suspended && p.ended.is_some() => (
                        "paused",
                        format!(
                            "  ended with exit code {}: the next dormant-continue gives it",
                            p.ended.unwrap_or_default()
                        ),
                    ),
                    Some(p) if rec.status() == EnvStatus::Suspended => (
                        "paused",
                        format!(
                            "  asks: {}",
                            crate::text::json_for_terminal(
                                &serde_json::Value::String(crate::lifecycle::pause::summary(
                                    &p.question
                                ))
                                .to_string()
                            )
                        ),
                    ),
                    _ => (rec.status().as_str(), String::new()),
                };
                // The hot window: its machine still runs (docs/pause.md).
                // (A resume's claim keeps it until it is done: not hot then.)
                let asks = match rec.hot_until().filter(|_| rec.claim().is_none()) {
                    Some(t) => format!("  hot until {}{asks}", crate::state::rfc3339(t)),
                    None => asks,
                };
                writeln!(
                    out,
                    "{:<36}  {:<10}  {:<8}  {:<7}  {:>7}  {:>10}  {:>4}  {:<10}  {}{asks}",
                    rec.id,
                    status,
                    rec.provider,
                    rec.storage.as_str(),
                    rec.project_id,
                    age,
                    rec.job_count,
                    held,
                    rec.key.as_deref().unwrap_or("-")
                )?;
            }
            Ok(None) if json => writeln!(
                out,
                "{}",
                json!({"id": id, "status": "no-record", "error": "directory without a record; `dormant sweep` removes it"})
            )?,
            Ok(None) => writeln!(
                out,
                "{id}  no-record   (a directory without a record; `dormant sweep` removes it)"
            )?,
            Err(e) if json => writeln!(
                out,
                "{}",
                json!({"id": id, "status": "unreadable", "error": format!("{e:#}")})
            )?,
            Err(e) => writeln!(out, "{id}  unreadable  {e:#}")?,
        }
    }
    list_warm(&store, json, out)
}

/// The warm pool's machines, after the environments: one line each (JSON:
/// the entry, with `"warm": true` and its age).
fn list_warm(store: &crate::state::StateStore, json: bool, out: &mut dyn Write) -> Result<()> {
    let pool = crate::state::pool::Pool::new(store);
    let entries = pool.entries()?;
    if entries.is_empty() {
        return Ok(());
    }
    let now = now_unix();
    if !json {
        writeln!(out)?;
        writeln!(
            out,
            "{:<36}  {:<10}  {:<8}  {:>8}  {:<12}  MADE FROM",
            "WARM MACHINE", "STATUS", "PROVIDER", "AGE", "ZONE"
        )?;
    }
    for (id, entry) in entries {
        match entry {
            Ok(Some(e)) if json => writeln!(
                out,
                "{}",
                json!({"warm": true, "age_s": e.age_secs(now), "entry": e})
            )?,
            Ok(Some(e)) => writeln!(
                out,
                "{:<36}  {:<10}  {:<8}  {:>8}  {:<12}  {}",
                e.id,
                e.status.as_str(),
                e.provider,
                human_age(e.age_secs(now)),
                e.zone.as_deref().unwrap_or("-"),
                e.made_from
            )?,
            Ok(None) => {}
            Err(e) if json => writeln!(
                out,
                "{}",
                json!({"warm": true, "id": id, "status": "unreadable", "error": format!("{e:#}")})
            )?,
            Err(e) => writeln!(out, "{id}  unreadable  {e:#}")?,
        }
    }
    Ok(())
}

/// A record as one JSON line: its fields, with `storage` always said.
fn record_json(rec: &EnvironmentRecord) -> Result<String> {
    Ok(serde_json::to_string(&Shown::of(rec))?)
}

/// A record as shown: its fields in their order, plus `storage` for a
/// machine-mode record (whose file leaves it out, so it stays what older
/// dormants wrote).
#[derive(serde::Serialize)]
struct Shown<'a> {
    #[serde(flatten)]
    record: &'a EnvironmentRecord,
    #[serde(skip_serializing_if = "Option::is_none")]
    storage: Option<&'static str>,
}

impl<'a> Shown<'a> {
    fn of(record: &'a EnvironmentRecord) -> Self {
        Shown {
            record,
            storage: record.storage.is_machine().then_some("machine"),
        }
    }
}

pub fn inspect(settings: &Settings, job: &Job, key: &str, out: &mut dyn Write) -> Result<()> {
    let store = open_store(settings, job)?;
    let id = super::find::env_id(settings, &store, key)?;
    if !store.env_paths(id).exists() {
        if let Some(entry) = crate::state::pool::Pool::new(&store).peek(id)? {
            let doc = json!({"warm": true, "age_s": entry.age_secs(now_unix()), "entry": entry});
            let text = serde_json::to_string_pretty(&doc)?;
            writeln!(out, "{}", crate::text::json_for_terminal(&text))?;
            return Ok(());
        }
    }
    let rec = registry::peek(&store.env_paths(id))?.ok_or_else(|| {
        crate::exit::Refused::NotFound.because(format!(
            "environment {id} is not in the registry under {} (it was released or expired, or never \
             was here; `dormant list` shows what is)",
            store.environments_dir().display()
        ))
    })?;
    // The record's fields (with its storage mode, which a machine-mode
    // record's file leaves out), then its last events: one JSON document.
    #[derive(serde::Serialize)]
    struct Inspected<'a> {
        #[serde(flatten)]
        record: Shown<'a>,
        last_events: Vec<crate::events::Event>,
        /// Why a copy of a stage's output for `dormant attach` last stopped
        /// short (a write on this host failed): the operator's to fix, so
        /// said here and not in the job log.
        #[serde(skip_serializing_if = "Option::is_none")]
        output_copy_stopped: Option<String>,
    }
    let paths = store.env_paths(id);
    let output_copy_stopped = crate::state::stage_output::read_stopped(&paths);
    let doc = Inspected {
        output_copy_stopped,
        record: Shown::of(&rec),
        last_events: crate::events::read::last_of(
            &crate::events::dir(store.root()),
            id,
            LAST_EVENTS,
        )?,
    };
    let text = serde_json::to_string_pretty(&doc)?;
    writeln!(out, "{}", crate::text::json_for_terminal(&text))?;
    Ok(())
}

/// How many of an environment's events `inspect` shows (`dormant events ID`
/// shows them all).
const LAST_EVENTS: usize = 10;
