//! What an operator command is pointed at: `dormant attach` and `dormant
//! shell` take an environment key, an environment id, or a job id (a job
//! between its prepare and its cleanup, found by its state file
//! `jobs/<runner>-<job>.json`); `release`, `inspect` and `events --key` a key
//! or an id (`env_id`). Each way of missing has its own exit code
//! ([`crate::exit::Refused`]): the same for every command.

use anyhow::Result;
use uuid::Uuid;

use crate::envkey::EnvironmentKey;
use crate::exit::Refused;
use crate::model::EnvPaths;
use crate::settings::Settings;
use crate::state::job::JobState;
use crate::state::{registry, store, EnvStatus, EnvironmentRecord, Holder, StateStore};

/// An environment of this runner manager, with its record.
pub struct Found {
    pub paths: EnvPaths,
    pub record: EnvironmentRecord,
    /// The job asked for by its id (`None`: asked for by key or id).
    pub job: Option<u64>,
}

impl Found {
    /// The job that holds the environment and may still run a stage in it:
    /// `(runner, job)` while its prepare, stages or the gaps between them
    /// run; `None` once its cleanup began (suspending, releasing) or when no
    /// job holds it (suspended, a shell).
    pub fn running_job(&self) -> Option<(String, u64)> {
        running_job(&self.record)
    }
}

/// The job holding `rec`, while it may still run stages.
pub fn running_job(rec: &EnvironmentRecord) -> Option<(String, u64)> {
    match rec.holder() {
        Some(Holder::Job {
            runner_id, job_id, ..
        }) if matches!(
            rec.status(),
            EnvStatus::Creating | EnvStatus::Resuming | EnvStatus::Active
        ) =>
        {
            Some((runner_id.clone(), *job_id))
        }
        _ => None,
    }
}

/// Finds what `text` names.
pub fn find(settings: &Settings, store: &StateStore, text: &str) -> Result<Found> {
    let shown = crate::text::quoted(text);
    let text = text.trim();
    if !text.is_empty() && text.len() <= 20 && text.bytes().all(|b| b.is_ascii_digit()) {
        let job: u64 = text
            .parse()
            .map_err(|_| Refused::NotFound.because(format!("{shown} is not a job id")))?;
        let (paths, record) = by_job(store, job)?;
        return Ok(Found {
            paths,
            record,
            job: Some(job),
        });
    }
    let id = parse_id(
        settings,
        store,
        text,
        "an environment key, an environment id nor a job id",
    )?;
    let paths = store.env_paths(id);
    let record = registry::peek(&paths)?.ok_or_else(|| {
        Refused::NotFound.because(format!(
            "environment {id} is not in this runner manager's registry ({}): it was released or \
             expired, or never was here; `dormant list` shows what is",
            store.environments_dir().display()
        ))
    })?;
    Ok(Found {
        paths,
        record,
        job: None,
    })
}

/// The environment id `text` names (a key or an id; not a job id), refused
/// with [`Refused::NotFound`] when it is neither and [`Refused::OtherRunner`]
/// for a key another runner manager made. Whether the environment exists is
/// the caller's to look up (`release`, `inspect`).
pub fn env_id(settings: &Settings, store: &StateStore, text: &str) -> Result<Uuid> {
    parse_id(
        settings,
        store,
        text,
        "an environment key nor an environment id",
    )
}

/// `accepted`: what the message says `text` is not ("an environment key nor …").
fn parse_id(settings: &Settings, store: &StateStore, text: &str, accepted: &str) -> Result<Uuid> {
    let shown = crate::text::quoted(text);
    let text = text.trim();
    Ok(match Uuid::parse_str(text) {
        Ok(id) => id,
        Err(_) => {
            let key = EnvironmentKey::parse(text).map_err(|e| {
                Refused::NotFound.because(format!(
                    "{shown} is neither {accepted} ({e}); \
                     `dormant list` shows the keys and ids of this runner manager's environments"
                ))
            })?;
            let system_id = crate::identity::system_id(settings, store)?;
            let other_runner = settings
                .runner_id
                .as_deref()
                .is_some_and(|r| r.trim() != key.runner_id);
            if key.system_id != system_id || other_runner {
                return Err(Refused::OtherRunner.because(format!(
                    "the key belongs to runner {} on system {}, and this is system {system_id}{}: \
                     run this command on the runner manager that made the key",
                    crate::text::quoted(&key.runner_id),
                    crate::text::quoted(&key.system_id),
                    settings
                        .runner_id
                        .as_deref()
                        .map(|r| format!(" (runner {r})"))
                        .unwrap_or_default()
                )));
            }
            key.env_id
        }
    })
}

/// The environment of job `job`: its state file names it (`jobs/*-<job>.json`;
/// with several runners in one state dir, the one of each runner).
fn by_job(store: &StateStore, job: u64) -> Result<(EnvPaths, EnvironmentRecord)> {
    let dir = store.root().join("jobs");
    let suffix = format!("-{job}.json");
    let mut states = Vec::new();
    if let Ok(entries) = std::fs::read_dir(&dir) {
        for e in entries.flatten() {
            let name = e.file_name();
            if name.to_str().is_some_and(|n| n.ends_with(&suffix)) {
                if let Some(s) = store::read_json::<JobState>(&e.path())? {
                    if s.job_id == job {
                        states.push(s);
                    }
                }
            }
        }
    }
    let not_found = || {
        Refused::NotFound.because(format!(
            "job {job} is not running on this runner manager (no job state {}/<runner>-{job}.json: \
             a job has one from its prepare to its cleanup); for an environment that is not running \
             pass its key or id (`dormant list`)",
            dir.display()
        ))
    };
    let state = match states.len() {
        0 => return Err(not_found()),
        1 => states.remove(0),
        _ => anyhow::bail!(
            "job {job} is known to several runners in this state dir ({}): pass the environment's \
             key or id instead",
            states
                .iter()
                .map(|s| format!("runner {} → environment {}", s.runner_id, s.env_id))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let paths = store.env_paths(state.env_id);
    let record = registry::peek(&paths)?.ok_or_else(not_found)?;
    Ok((paths, record))
}
