//! `dormant adopt`: a replacement runner-manager host (the same system id,
//! an empty or partial state dir) takes over the suspended EC2 environments
//! of the host it replaces, so the keys an orchestrator already holds
//! resume them here as they would have there.
//!
//! The cloud side (what is found, what is adoptable, the tag write) is
//! `provider/ec2/takeover.rs`; this file is the state side. Per
//! environment, in this order, so that a process killed at any point leaves
//! either nothing or a whole record (a rerun adopts what is still unknown):
//!
//! 1. a staging directory with a new SSH key pair and, in machine mode, a
//!    known_hosts holding the host key pinned at creation (from its tag);
//! 2. one CreateTags call: the next ownership epoch with this run's owner id
//!    and, in machine mode, the new public key for the boot hook
//!    (`adopt:staged` before it), read back: another owner's value there
//!    means another host adopted it at the same time and wrote last, and
//!    this run writes no record (docs/ec2.md, "Two hosts adopting at once");
//! 3. the record — suspended, its original suspension time, the new epoch —
//!    written into the staging directory and renamed into place with the
//!    key files (`adopt:tagged` before it, `adopt:recorded` after);
//!    With the record comes a marker, `adopted.pending`, that says its
//!    `adopted` event is still to be written;
//! 4. the `adopted` event, then the marker removed (`adopt:announced`
//!    between them).
//!
//! Killed before 3, the environment is still unknown here: the next run
//! adopts it again (one more epoch, a new key in the tag: the record it then
//! writes matches both), and the staging directory left behind is removed by
//! `dormant sweep`. Killed between 3 and 4, the record stands with its
//! marker: the next run writes the event first thing (unless the log shows
//! it was written, with that epoch, just before the kill). One adopt runs at
//! a time (`adopt.lock` in the state dir).
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
mod imp {
    use std::path::{Path, PathBuf};

    use anyhow::{bail, Context, Result};
    use tokio_util::sync::CancellationToken;

    use super::{Report, PENDING_EVENT, QUARANTINE_DIR};
    use crate::context::{Ctx, JobLog};
    use crate::envkey::EnvironmentKey;
    use crate::events::{Event, EventLog, Kind};
    use crate::job::Job;
    use crate::model::{EnvPaths, StorageMode};
    use crate::ops::{open_store, OPERATOR_BUDGET};
    use crate::provider::ec2::takeover::{Adoptable, Confirmed, Held};
    use crate::provider::ec2::Ec2Provider;
    use crate::provider::Provider;
    use crate::settings::Settings;
    use crate::state::lock::FileLock;
    use crate::state::{registry, store, Adopted, EnvironmentRecord, StateStore};

    use crate::provider::ec2::EPOCH_FIELD;

    use super::pending::{adopted_reason, record_pending_events};

    pub async fn adopt(
        settings: &Settings,
        job: &Job,
        log: JobLog,
        cancel: CancellationToken,
    ) -> Result<Report> {
        let store = open_store(settings, job)?;
        let ec2 = Ec2Provider::new(settings, &store)?;
        let system_id = crate::identity::system_id(settings, &store)?;
        let events = EventLog::new(store.root(), &settings.events);
        let ctx = Ctx::new(log.clone(), cancel, OPERATOR_BUDGET);
        let lock_path = store.root().join("adopt.lock");
        let Some(_lock) =
            FileLock::acquire(&lock_path, &ctx, "another dormant adopt to finish").await?
        else {
            bail!("could not take {}", lock_path.display());
        };
        record_pending_events(&store, &events, &ctx).await;
        // This run's owner id, written with every epoch it takes: a host
        // adopting the same environment at once writes another one.
        let owner = crate::provider::ec2::handover::new_owner_id();
        let runner = settings.runner_id.as_deref().map(str::trim);
        log.info(format!(
            "looking for environments of system {system_id}{} to adopt",
            runner
                .map(|r| format!(", runner {r}"))
                .unwrap_or_else(|| " (every runner)".into())
        ));
        let found = ec2.takeover_candidates(runner, &ctx).await?;
        let mut report = Report::default();
        for l in &found.left {
            report.left.push(format!(
                "{}{}: {}",
                l.resources,
                l.env_id
                    .map(|id| format!(" (environment {id})"))
                    .unwrap_or_default(),
                l.why
            ));
        }
        for a in &found.adoptable {
            let paths = store.env_paths(a.env_id);
            let resource = a.what.resource().to_string();
            let mut unreadable = None;
            let known = match registry::peek(&paths) {
                Ok(Some(rec)) => Some(format!(
                    "a record on this host knows it ({}): nothing to adopt",
                    rec.status().as_str()
                )),
                Ok(None) if paths.exists() => Some(format!(
                    "{} exists without a record (left by a killed release): `dormant sweep` removes it; \
                     run `dormant adopt` again then",
                    paths.dir.display()
                )),
                Ok(None) => None,
                Err(e) => {
                    unreadable = Some(format!("{e:#}"));
                    None
                }
            };
            if let Some(why) = known {
                report
                    .left
                    .push(format!("{resource} (environment {}): {why}", a.env_id));
                continue;
            }
            match adopt_one(
                &store,
                &ec2,
                &system_id,
                &owner,
                a,
                &paths,
                unreadable.is_some(),
                &ctx,
            )
            .await
            {
                Ok((rec, epoch, quarantined)) => {
                    let mut line = describe(&rec, a);
                    let mut reason = adopted_reason(&resource, &epoch);
                    if let (Some(q), Some(why)) = (&quarantined, &unreadable) {
                        line.push_str(&format!(
                            "; its record here could not be read ({why}) and was moved to {} (kept for you \
                             to look at; delete it when done), and rebuilt from the cloud",
                            q.display()
                        ));
                        reason.push_str(&format!(
                            "; the unreadable record here was moved to {}",
                            q.display()
                        ));
                    }
                    let event = Event::about(Kind::Adopted, "operator", &rec).reason(&reason);
                    match events.append(&event, &ctx).await {
                        Ok(()) => {
                            crate::failpoint!("adopt:announced");
                            let _ = store::remove_file(&paths.dir.join(PENDING_EVENT));
                        }
                        Err(e) => log.warn(format!(
                            "the adopted event of environment {} was not recorded in the event log ({e:#}); \
                             the next `dormant adopt` records it",
                            a.env_id
                        )),
                    }
                    report.adopted.push((a.env_id, line));
                }
                Err(e) => {
                    report.failed += 1;
                    report.left.push(format!(
                        "{resource} (environment {}): not adopted: {e:#}",
                        a.env_id
                    ))
                }
            }
        }
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

    /// Takes `a` over: its record, the epoch written, and where an
    /// unreadable record it replaced went (`unreadable`: one is there).
    #[allow(clippy::too_many_arguments)]
    async fn adopt_one(
        store: &StateStore,
        ec2: &Ec2Provider,
        system_id: &str,
        owner: &str,
        a: &Adoptable,
        paths: &EnvPaths,
        unreadable: bool,
        ctx: &Ctx,
    ) -> Result<(EnvironmentRecord, String, Option<PathBuf>)> {
        let staging = store.staging_dir(a.env_id)?;
        let result = stage_and_record(
            store, ec2, system_id, owner, a, paths, unreadable, &staging, ctx,
        )
        .await;
        if result.is_err() {
            let _ = store::remove_tree(&staging);
        }
        result
    }

    #[allow(clippy::too_many_arguments)]
    async fn stage_and_record(
        store: &StateStore,
        ec2: &Ec2Provider,
        system_id: &str,
        owner: &str,
        a: &Adoptable,
        paths: &EnvPaths,
        unreadable: bool,
        staging: &Path,
        ctx: &Ctx,
    ) -> Result<(EnvironmentRecord, String, Option<PathBuf>)> {
        let in_staging = |p: &Path| staging.join(p.file_name().unwrap_or_default());
        let mut public_key = None;
        if let Held::Machine { entry, .. } = &a.what {
            let mut staged = paths.clone();
            staged.ssh_key = in_staging(&paths.ssh_key);
            public_key = Some(crate::transport::keys::ensure_keypair(&staged)?);
            // The host key pinned at creation: the first resume's connection
            // checks the machine against it (never accept-new).
            let alias = format!("dormant-{}", a.env_id);
            store::write_private(
                &in_staging(&paths.known_hosts),
                format!("{alias} {}\n", entry.host_key).as_bytes(),
            )
            .with_context(|| format!("writing the pinned host key into {}", staging.display()))?;
        }
        crate::failpoint!("adopt:staged");
        let (epoch, confirmed) = ec2.take_over(a, owner, public_key.as_deref(), ctx).await?;
        if let Confirmed::Another(now) = confirmed {
            bail!(
                "another host adopted it at the same time: its epoch tag is now {} (this run wrote {epoch}), \
                 so it is that host's; no record written here",
                now.as_deref().unwrap_or("gone")
            );
        }
        crate::failpoint!("adopt:tagged");
        let mut key = EnvironmentKey::new(&a.runner_id, system_id, a.env_id)
            .with_field("provider", ec2.name());
        let (machine, volume) = match &a.what {
            Held::Machine { machine, .. } => {
                for (k, v) in ec2.key_fields(machine) {
                    key = key.with_field(&k, &v);
                }
                (Some(machine.clone().with(EPOCH_FIELD, epoch.clone())), None)
            }
            Held::Volume { volume } => {
                key = key.with_field(crate::envkey::STORAGE_FIELD, StorageMode::Volume.as_str());
                if let Some(vols) = ec2.volumes() {
                    for (k, v) in vols.key_fields(volume) {
                        key = key.with_field(&k, &v);
                    }
                }
                (None, Some(volume.clone().with(EPOCH_FIELD, epoch.clone())))
            }
        };
        let now = crate::state::now_unix();
        let rec = EnvironmentRecord::adopted(Adopted {
            id: a.env_id,
            provider: ec2.name().to_string(),
            runner_id: a.runner_id.clone(),
            system_id: system_id.to_string(),
            project_id: a.project_id,
            job_id: a.job_id,
            key: key.encode(),
            machine,
            volume,
            created_at: a.created_at.unwrap_or(now),
            // Not recorded (a suspension whose tag write failed): from now,
            // so the TTL never deletes it early.
            suspended_at: a.suspended_at.unwrap_or(now),
        });
        store::write_private(
            &staging.join(PENDING_EVENT),
            format!("{epoch}\n{}\n", a.what.resource()).as_bytes(),
        )
        .with_context(|| format!("writing {PENDING_EVENT} into {}", staging.display()))?;
        // Taken over in the cloud: the unreadable record can go aside now
        // (earlier, a failed tag write would have moved it for nothing).
        let quarantined = if unreadable {
            Some(quarantine(store, paths)?)
        } else {
            None
        };
        if !registry::create_staged(store, &rec, staging.to_path_buf())? {
            bail!(
                "environment {} appeared in {} meanwhile: left to the process that made it",
                a.env_id,
                store.environments_dir().display()
            );
        }
        crate::failpoint!("adopt:recorded");
        Ok((rec, epoch, quarantined))
    }

    /// Moves an environment directory whose record cannot be read into
    /// `quarantine/<id>-<unix seconds>` in the state dir (never deleted),
    /// under its record lock: a process that holds the lock is left to finish.
    fn quarantine(store: &StateStore, paths: &EnvPaths) -> Result<PathBuf> {
        let Some(_lock) = registry::try_lock(paths)? else {
            bail!(
                "its record here cannot be read, and a dormant process holds its lock ({}): left as it is; \
                 run `dormant adopt` again once no job uses this host",
                paths.lock.display()
            );
        };
        let dir = store.root().join(QUARANTINE_DIR);
        store::ensure_private_dir(&dir)?;
        let to = dir.join(format!("{}-{}", paths.id, crate::state::now_unix()));
        std::fs::rename(&paths.dir, &to).with_context(|| {
            format!(
                "moving {} (its record cannot be read) to {}",
                paths.dir.display(),
                to.display()
            )
        })?;
        store::sync_dir(store.environments_dir().as_path())
            .with_context(|| format!("syncing {}", store.environments_dir().display()))?;
        Ok(to)
    }
}
