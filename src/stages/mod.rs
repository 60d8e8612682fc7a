//! The four stages GitLab Runner calls, and what they share: a [`Session`]
//! holding the job, settings, state store and the injected provider and
//! transports, so the stage logic runs the same against real adapters and
//! in-memory fakes.

pub mod cleanup;
mod cleanup_left;
pub mod config;
pub mod outcome;
mod prep;
pub mod prepare;
mod resume;
pub mod run;

use std::sync::Arc;

use anyhow::Result;
use tokio_util::sync::CancellationToken;

use crate::context::JobLog;
use crate::events::EventLog;
use crate::job::{Job, JobInput};
use crate::model::EnvPaths;
use crate::provider::{Provider, Target};
use crate::settings::Settings;
use crate::state::StateStore;
use crate::transport::Transport;

/// Opens transports; injected so stage logic can be tested without processes.
pub trait Transports: Send + Sync {
    fn open(&self, target: &Target, paths: &EnvPaths) -> Result<Box<dyn Transport>>;
}

/// The real transports: local bash and SSH.
pub struct RealTransports {
    pub settings: Settings,
    pub job: Job,
}

/// How the lifecycle reaches a machine outside a stage's own connection
/// (a hot volume-mode machine's unmount when a job needs its slot).
impl crate::lifecycle::warm_refill::OpenTransport for Session {
    fn open(&self, target: &Target, paths: &EnvPaths) -> Result<Box<dyn Transport>> {
        self.transports.open(target, paths)
    }
}

impl Transports for RealTransports {
    fn open(&self, target: &Target, paths: &EnvPaths) -> Result<Box<dyn Transport>> {
        crate::transport::open(target, paths, &self.settings, &self.job)
    }
}

/// Everything a stage needs, built once at the edge.
pub struct Session {
    pub settings: Settings,
    pub job: Job,
    pub input: JobInput,
    pub runner_id: String,
    pub store: StateStore,
    /// The event log of the state dir (`crate::events`).
    pub events: EventLog,
    pub provider: Arc<dyn Provider>,
    pub transports: Arc<dyn Transports>,
    pub log: JobLog,
    /// Fired by SIGTERM / SIGINT.
    pub cancel: CancellationToken,
}

impl Session {
    /// Builds the session for prepare, run and cleanup from real adapters.
    pub fn from_job(
        settings: Settings,
        job: Job,
        log: JobLog,
        cancel: CancellationToken,
    ) -> Result<Session> {
        let input = job.input()?;
        let runner_id = crate::identity::runner_id(&settings, &input)?;
        let store = StateStore::open(&settings.state_dir(&job)?)?;
        let events = EventLog::new(store.root(), &settings.events);
        let provider = crate::provider::from_settings(&settings, &store)?;
        let transports = Arc::new(RealTransports {
            settings: settings.clone(),
            job: job.clone(),
        });
        Ok(Session {
            settings,
            job,
            input,
            runner_id,
            store,
            events,
            provider,
            transports,
            log,
            cancel,
        })
    }

    pub fn job_id(&self) -> u64 {
        self.input.job_id
    }

    /// This job as the holder of its environment's claim.
    pub fn holder(&self, mode: crate::state::Mode) -> crate::state::Holder {
        crate::state::Holder::Job {
            runner_id: self.runner_id.clone(),
            job_id: self.job_id(),
            mode,
            suspend_on_failure: self.input.suspend.on_failure,
        }
    }

    /// The store, the provider and the event log, for the lifecycle's effects.
    pub fn world(&self) -> crate::lifecycle::World<'_> {
        crate::lifecycle::World {
            store: &self.store,
            provider: self.provider.as_ref(),
            events: &self.events,
        }
    }
}

#[cfg(test)]
pub(crate) mod fakes;
#[cfg(test)]
#[path = "hot_tests.rs"]
mod hot_tests;
#[cfg(test)]
mod volume_tests;
#[cfg(test)]
mod warm_tests;

#[cfg(test)]
#[path = "events_tests.rs"]
mod events_tests;
