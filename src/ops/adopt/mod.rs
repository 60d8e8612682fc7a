//! `dormant adopt`: a replacement runner-manager host (the same system id,
//! an empty or partial state dir) takes over the suspended EC2 environments
//! of the host it replaces, so the keys an orchestrator already holds
//! resume them here as they would have there.
//!
//! The cloud side (what is found, what is adoptable, the tag write) is
//! `provider/ec2/takeover.rs`; this file is the state side. Per
//! environment, in this order, so that no change in EC2 is ever without its
//! record of intent here (a process killed or failing at any point leaves
//! either nothing, or a staged take-over the next run finishes, or a whole
//! record):
//!
//! 1. a staging directory `adopting/<id>/` in the state dir (`staged.rs`)
//!    with a new SSH key pair and, in machine mode, a known_hosts holding
//!    the host key pinned at creation (from its tag); an unreadable record
//!    here is checked to be unlocked (it is moved aside in step 4);
//! 2. `intent.json` in it, fsynced: the epoch value about to be written
//!    (the next epoch with this run's owner id) and the value found;
//! 3. one CreateTags call: that epoch and, in machine mode, the new public
//!    key for the boot hook (`adopt:staged` before it), read back: another
//!    owner's value there means another host adopted it at the same time
//!    and wrote last, and this run drops its staging and writes no record
//!    (docs/ec2.md, "Two hosts adopting at once");
//! 4. the record — suspended, its original suspension time, the new epoch —
//!    written into the staging directory, an unreadable record moved aside,
//!    and the directory renamed into `environments/` (`adopt:tagged` before
//!    it, `adopt:recorded` after); with the record comes a marker,
//!    `adopted.pending`, that says its `adopted` event is still to be written;
//! 5. the `adopted` event, then the marker removed (`adopt:announced`
//!    between them).
//!
//! Stopped after 2 (killed, or an error after the tag write was sent: a
//! failed read-back, a quarantine or record write that fails), the next run
//! reads the tag: if it shows the staged value, it finishes the take-over
//! with the staged key and epoch (no second write: the record it writes is
//! the one the tags describe); otherwise the write never landed (or another
//! host's came after), and the staging is dropped and the environment
//! adopted afresh. A run that fails after the write says so, naming the
//! environment, the staging directory and that the next run finishes it.
//! Killed between 4 and 5, the record stands with its marker: the next run
//! writes the event first thing (unless the log shows it was written, with
//! that epoch, just before the kill). One adopt runs at a time (`adopt.lock`
//! in the state dir).
//!
//! A record here that cannot be read (damaged, or written by a newer dormant)
//! is never overwritten nor deleted: once the environment is taken over in
//! the cloud, its directory is moved into `quarantine/<id>-<unix seconds>` in
//! the state dir, for the operator to look at, and the record is rebuilt in
//! its place. An environment whose take-over fails is listed and makes the
//! run fail (the operator's exit code for a system failure), after every
//! other environment was dealt with.

use anyhow::{bail, Result};
use tokio_util::sync::CancellationToken;

use crate::context::JobLog;
use crate::job::Job;
use crate::settings::{ProviderKind, Settings};

/// What one run did, for the report and the tests.
#[derive(Debug, Default)]
pub struct Report {
    /// (environment id, one line saying what it is now).
    pub adopted: Vec<(uuid::Uuid, String)>,
    /// One line each: the resources, the environment, why.
    pub left: Vec<String>,
    /// How many of `left` were adoptable but their take-over failed.
    pub failed: usize,
    /// How many of those failed after their tag write was sent: staged in
    /// `adopting/` for the next run to finish (or drop, if it never landed).
    pub unfinished: usize,
}

/// Beside a record `dormant adopt` wrote until its `adopted` event is in the
/// log: the epoch it wrote, then the instance or volume, one per line.
pub const PENDING_EVENT: &str = "adopted.pending";

/// Where a record that cannot be read is moved by `dormant adopt`.
pub const QUARANTINE_DIR: &str = "quarantine";

pub async fn adopt(
    settings: &Settings,
    job: &Job,
    log: JobLog,
    cancel: CancellationToken,
) -> Result<Report> {
    if settings.provider != ProviderKind::Ec2 {
        bail!(
            "dormant adopt takes over EC2 environments, but this host's provider is {}: qemu VMs, \
             local directories and workspaces on SSH hosts are not kept in a cloud a new host could \
             find them in",
            settings.provider.as_str()
        );
    }
    imp::adopt(settings, job, log, cancel).await
}

#[cfg(not(feature = "ec2"))]
mod imp {
    use super::*;

    pub async fn adopt(_: &Settings, _: &Job, _: JobLog, _: CancellationToken) -> Result<Report> {
        bail!("this dormant was built without the ec2 feature, so it cannot adopt EC2 environments")
    }
}

#[cfg(feature = "ec2")]
mod pending;
#[cfg(feature = "ec2")]
mod run;
#[cfg(feature = "ec2")]
mod staged;
#[cfg(feature = "ec2")]
mod take;

#[cfg(feature = "ec2")]
mod imp {
    use anyhow::{bail, Result};
    use tokio_util::sync::CancellationToken;

    use super::pending::record_pending_events;
    use super::run::Run;
    use super::staged::{leftovers, Staged};
    use super::take::{NotAdopted, Takeover};
    use super::Report;
    use crate::context::JobLog;
    use crate::job::Job;
    use crate::provider::ec2::takeover::{Adoptable, Found, Held, LeftAlone};
    use crate::settings::Settings;
    use crate::state::{registry, EnvironmentRecord, StateStore};

    /// The run, in the order the module comment gives: the adopt lock; the
    /// `adopted` events an earlier run left to write; what EC2 holds; each
    /// adoptable environment taken over; the report, failing when a
    /// take-over failed.
    pub async fn adopt(
        settings: &Settings,
        job: &Job,
        log: JobLog,
        cancel: CancellationToken,
    ) -> Result<Report> {
        let run = Run::open(settings, job, log, cancel).await?;
        record_pending_events(&run.store, &run.events, &run.ctx).await;
        let found = run.find(settings.runner_id.as_deref()).await?;
        let mut report = Report::default();
        report.left.extend(found.left.iter().map(left_alone));
        for a in &found.adoptable {
            adopt_env(&run, a, &mut report).await;
        }
        report.left.extend(unfinished_elsewhere(&run.store, &found));
        say(&run.ctx.log, &report);
        failed_if_any(report)
    }

    /// One adoptable environment: left alone if this host knows it,
    /// otherwise taken over and announced; its line goes into `report`.
    async fn adopt_env(run: &Run, a: &Adoptable, report: &mut Report) {
        let paths = run.store.env_paths(a.env_id);
        let resource = a.what.resource().to_string();
        let unreadable = match known_here(&paths) {
            Ok(Some(why)) => {
                report
                    .left
                    .push(format!("{resource} (environment {}): {why}", a.env_id));
                return;
            }
            Ok(None) => None,
            Err(e) => Some(format!("{e:#}")),
        };
        let take = Takeover::new(run, a, paths, unreadable);
        match take.run().await {
            Ok(taken) => {
                take.announce(&taken).await;
                let line = describe(&taken.rec, a) + &take.quarantine_note(&taken);
                report.adopted.push((a.env_id, line));
            }
            Err(NotAdopted::Nothing(e)) => {
                report.failed += 1;
                report.left.push(format!(
                    "{resource} (environment {}): not adopted, nothing changed in EC2: {e:#}",
                    a.env_id
                ))
            }
            Err(NotAdopted::Unfinished(e)) => {
                report.failed += 1;
                report.unfinished += 1;
                report.left.push(format!(
                    "{resource} (environment {}): its take-over was sent to EC2 (a new ownership epoch \
                     and, in machine mode, a new SSH key in its tags) but is not recorded here: {e:#}; \
                     the new key and the epoch are kept in {}: fix what this says and run `dormant adopt` \
                     again, which finishes this take-over (or starts it afresh if the tag write never \
                     landed); until then neither this host nor the old one can resume it",
                    a.env_id,
                    Staged::of(&run.store, a.env_id).dir.display()
                ))
            }
        }
    }

    /// Why this host has nothing to adopt for an environment it already
    /// knows (`None`: it does not); an error: its record cannot be read.
    fn known_here(paths: &crate::model::EnvPaths) -> Result<Option<String>> {
        Ok(match registry::peek(paths)? {
            Some(rec) => Some(format!(
                "a record on this host knows it ({}): nothing to adopt",
                rec.status().as_str()
            )),
            None if paths.exists() => Some(format!(
                "{} exists without a record (left by a killed release): `dormant sweep` removes it; \
                 run `dormant adopt` again then",
                paths.dir.display()
            )),
            None => None,
        })
    }

    fn left_alone(l: &LeftAlone) -> String {
        format!(
            "{}{}: {}",
            l.resources,
            l.env_id
                .map(|id| format!(" (environment {id})"))
                .unwrap_or_default(),
            l.why
        )
    }

    /// Staging directories of earlier runs whose environment is not
    /// adoptable now: kept, one line each.
    fn unfinished_elsewhere(store: &StateStore, found: &Found) -> Vec<String> {
        let seen: Vec<_> = found.adoptable.iter().map(|a| a.env_id).collect();
        leftovers(store, &seen)
            .into_iter()
            .map(|(id, dir)| {
                format!(
                    "{}: an earlier `dormant adopt` began taking environment {id} over and did not finish, \
                     and the environment is not adoptable now (its line above, if any, says why): kept; once \
                     it is adoptable again the next run finishes or drops it; if the environment is gone, \
                     delete the directory",
                    dir.display()
                )
            })
            .collect()
    }

    fn say(log: &JobLog, report: &Report) {
        for (_, line) in &report.adopted {
            log.info(format!("adopted {line}"));
        }
        for line in &report.left {
            log.info(format!("left alone: {line}"));
        }
        log.info(format!(
            "adopted {}, left alone {}",
            report.adopted.len(),
            report.left.len()
        ));
    }

    /// The run fails (the operator's system-failure exit code) when any
    /// adoptable environment was not taken over.
    fn failed_if_any(report: Report) -> Result<Report> {
        if report.unfinished > 0 {
            bail!(
                "{} environment(s) could be adopted but their take-over failed (the lines above say why), \
                 {} of them after the new epoch was sent to EC2: no record of them was written; fix what \
                 the lines say and run `dormant adopt` again, which finishes what this run began",
                report.failed,
                report.unfinished
            );
        }
        if report.failed > 0 {
            bail!(
                "{} environment(s) could be adopted but their take-over failed (the lines above say why): \
                 they are not adopted, and no record of them was written; fix what they say and run \
                 `dormant adopt` again",
                report.failed
            );
        }
        Ok(report)
    }

    fn describe(rec: &EnvironmentRecord, a: &Adoptable) -> String {
        let what = match &a.what {
            Held::Machine { machine, .. } => format!("machine mode, instance {}", machine.id),
            Held::Volume { volume } => format!("volume mode, data volume {}", volume.id),
        };
        format!(
            "environment {} ({what}, project {}, suspended {}): key {}",
            rec.id,
            rec.project_id,
            rec.suspended_at
                .map(crate::state::rfc3339)
                .unwrap_or_else(|| "?".into()),
            rec.key.as_deref().unwrap_or("?")
        )
    }
}
