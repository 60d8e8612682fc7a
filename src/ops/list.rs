//! `list` and `inspect`: the operator's view of the registry. `list` shows
//! every directory under `environments/`, also one without a readable record
//! (a corrupt file, or a leftover `sweep` removes).

use std::io::Write;

use anyhow::{Context, Result};
use serde_json::json;

use crate::job::Job;
use crate::lifecycle::human_age;
use crate::settings::Settings;
use crate::state::{now_unix, registry, EnvStatus, EnvironmentRecord};

use super::{env_id, open_store};

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
                writeln!(
                    out,
                    "{:<36}  {:<10}  {:<8}  {:<7}  {:>7}  {:>10}  {:>4}  {:<10}  {}",
                    rec.id,
                    rec.status().as_str(),
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
    Ok(())
}

/// A record as one JSON line: its fields, with `storage` always said (the
/// file leaves it out for machine mode).
fn record_json(rec: &EnvironmentRecord) -> Result<String> {
    Ok(serde_json::to_string(&with_storage(rec)?)?)
}

fn with_storage(rec: &EnvironmentRecord) -> Result<serde_json::Value> {
    let mut v = serde_json::to_value(rec)?;
    if let Some(o) = v.as_object_mut() {
        o.insert("storage".into(), json!(rec.storage.as_str()));
    }
    Ok(v)
}

pub fn inspect(settings: &Settings, job: &Job, key: &str, out: &mut dyn Write) -> Result<()> {
    let store = open_store(settings, job)?;
    let id = env_id(key)?;
    let rec = registry::peek(&store.env_paths(id))?.with_context(|| {
        format!(
            "environment {id} is not in the registry under {}",
            store.environments_dir().display()
        )
    })?;
    writeln!(
        out,
        "{}",
        serde_json::to_string_pretty(&with_storage(&rec)?)?
    )?;
    Ok(())
}
