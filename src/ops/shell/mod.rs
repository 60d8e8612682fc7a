//! `dormant shell KEY|ID [--release] [-- COMMAND...]`: a person steps into an
//! environment on the runner host — a failed job kept for debugging, an agent
//! waiting for a human.
//!
//! Two operations behind one command. An environment a job holds is joined
//! beside the job ([`beside`]): a shell on its machine that holds nothing and
//! ends with the job. Any other (a suspended one) is claimed, started,
//! entered and suspended again ([`claimed`]). Either way the person gets an
//! interactive login shell with the terminal in the job's project directory
//! (`CI_PROJECT_DIR`), over the environment's own SSH key and pinned host key
//! on ssh and ec2 (a local shell on `local`); with `-- COMMAND` the command
//! runs without a terminal and its exit code is dormant's. The terminal and
//! the signals that end a session are [`terminal`]'s, shared by both.

mod beside;
mod claimed;
mod terminal;

use anyhow::Result;

use crate::context::JobLog;
use crate::job::Job;
use crate::model::EnvPaths;
use crate::settings::Settings;
use crate::state::EnvironmentRecord;

use super::open_store;

/// What the person asked for.
#[derive(Debug, Clone, Default)]
pub struct ShellRequest {
    pub key: String,
    /// Release the environment on exit instead of suspending it.
    pub release: bool,
    /// Run this (the words joined, as `ssh host -- ...` does) instead of a login shell.
    pub command: Vec<String>,
}

/// Runs the shell; returns the exit code dormant exits with (the command's,
/// or the login shell's).
pub async fn shell(settings: &Settings, job: &Job, req: &ShellRequest, log: JobLog) -> Result<i32> {
    let store = open_store(settings, job)?;
    let found = super::find::find(settings, &store, &req.key)?;
    if found.running_job().is_some() || found.job.is_some() {
        return beside::join(settings, job, &store, &found, req, log).await;
    }
    claimed::shell(settings, job, &store, found.paths.id, req, log).await
}

/// The job's `CI_PROJECT_DIR`: `<builds_dir>/<project path>` (the runner's
/// layout for a builds dir that is not shared), else the builds dir.
fn project_dir(settings: &Settings, paths: &EnvPaths, rec: &EnvironmentRecord) -> Result<String> {
    let builds = crate::provider::dirs(settings, paths, rec.storage)?.builds;
    Ok(match &rec.project_path {
        Some(p) => format!("{}/{p}", builds.trim_end_matches('/')),
        None => builds,
    })
}
