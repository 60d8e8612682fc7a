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
mod staged;

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
    use crate::provider::ec2::takeover::{Adoptable, Held};
    use crate::provider::ec2::takeover_write::{Confirmed, NothingWritten};
    use crate::provider::ec2::Ec2Provider;
    use crate::provider::Provider;
    use crate::settings::Settings;
    use crate::state::lock::FileLock;
    use crate::state::{registry, store, Adopted, EnvironmentRecord, StateStore};

    use crate::provider::ec2::EPOCH_FIELD;

    use super::pending::{adopted_reason, record_pending_events};
    use super::staged::{leftovers, Intent, Staged, INTENT};

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
                        Staged::of(&store, a.env_id).dir.display()
                    ))
                }
            }
        }
        let seen: Vec<_> = found.adoptable.iter().map(|a| a.env_id).collect();
        for (id, dir) in leftovers(&store, &seen) {
            report.left.push(format!(
                "{}: an earlier `dormant adopt` began taking environment {id} over and did not finish, \
                 and the environment is not adoptable now (its line above, if any, says why): kept; once \
                 it is adoptable again the next run finishes or drops it; if the environment is gone, \
                 delete the directory",
                dir.display()
            ));
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

    /// Why a take-over did not end in a record.
    enum NotAdopted {
        /// Nothing in EC2 changed (or the change was another host's): no
        /// staging kept.
        Nothing(anyhow::Error),
        /// The tag write was sent (it may have landed): the take-over stays
        /// staged for the next run to finish or drop.
        Unfinished(anyhow::Error),
    }

    /// Takes `a` over: its record, the epoch written, and where an
    /// unreadable record it replaced went (`unreadable`: one is there).
    /// A take-over an earlier run staged and whose tag write landed is
    /// finished with that run's key and epoch, not written again.
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
    ) -> Result<(EnvironmentRecord, String, Option<PathBuf>), NotAdopted> {
        let staged = Staged::of(store, a.env_id);
        let resource = a.what.resource();
        let earlier = staged
            .intent()
            .filter(|i| Staged::landed(i, resource, a.epoch_tag.as_deref()));
        if let Some(intent) = earlier {
            ctx.log.info(format!(
                "finishing the take-over of {resource} (environment {}) that an earlier `dormant adopt` \
                 wrote to EC2 (epoch {}) and did not record: its key and record come from {}",
                a.env_id,
                intent.written,
                staged.dir.display()
            ));
            return record(
                store,
                ec2,
                system_id,
                a,
                paths,
                unreadable,
                &staged,
                intent.written,
                ctx,
            )
            .map_err(NotAdopted::Unfinished);
        }
        if let Some(intent) = staged.intent() {
            ctx.log.info(format!(
                "an earlier `dormant adopt` began taking {resource} (environment {}) over with epoch {}, \
                 but its tag shows {}: that write never landed or another host's came after it; its \
                 staging is dropped and the environment adopted afresh",
                a.env_id,
                intent.written,
                a.epoch_tag.as_deref().unwrap_or("no epoch")
            ));
        }
        staged.begin().map_err(NotAdopted::Nothing)?;
        let result = stage_and_write(ec2, owner, a, paths, unreadable, &staged, ctx).await;
        let epoch = match result {
            Ok(epoch) => epoch,
            Err(e) => {
                if let NotAdopted::Nothing(_) = e {
                    let _ = staged.drop_it();
                }
                return Err(e);
            }
        };
        crate::failpoint!("adopt:tagged");
        record(
            store, ec2, system_id, a, paths, unreadable, &staged, epoch, ctx,
        )
        .map_err(NotAdopted::Unfinished)
    }

    /// The key pair and intent staged, then the tag write and its read-back:
    /// the epoch written, once it is this run's.
    async fn stage_and_write(
        ec2: &Ec2Provider,
        owner: &str,
        a: &Adoptable,
        paths: &EnvPaths,
        unreadable: bool,
        staged: &Staged,
        ctx: &Ctx,
    ) -> Result<String, NotAdopted> {
        let nothing = NotAdopted::Nothing;
        let in_staging = |p: &Path| staged.dir.join(p.file_name().unwrap_or_default());
        let mut public_key = None;
        if let Held::Machine { entry, .. } = &a.what {
            let mut keys = paths.clone();
            keys.ssh_key = in_staging(&paths.ssh_key);
            public_key = Some(crate::transport::keys::ensure_keypair(&keys).map_err(nothing)?);
            // The host key pinned at creation: the first resume's connection
            // checks the machine against it (never accept-new).
            let alias = format!("dormant-{}", a.env_id);
            store::write_private(
                &in_staging(&paths.known_hosts),
                format!("{alias} {}\n", entry.host_key).as_bytes(),
            )
            .with_context(|| format!("writing the pinned host key into {}", staged.dir.display()))
            .map_err(nothing)?;
        }
        if unreadable {
            // The unreadable record goes aside after the tag write, under its
            // lock: a process holding it now would make that fail with the
            // take-over written, so find out before.
            if registry::try_lock(paths).map_err(nothing)?.is_none() {
                return Err(nothing(busy(paths)));
            }
        }
        let value = crate::provider::ec2::handover::epoch_value(
            crate::provider::ec2::handover::next_epoch(a.epoch),
            owner,
        );
        staged
            .record_intent(&Intent {
                version: 1,
                resource: a.what.resource().to_string(),
                written: value.clone(),
                found: a.epoch_tag.clone(),
            })
            .map_err(nothing)?;
        crate::failpoint!("adopt:staged");
        let (epoch, confirmed) = match ec2.take_over(a, &value, public_key.as_deref(), ctx).await {
            Ok(done) => done,
            Err(e) if e.is::<NothingWritten>() => return Err(nothing(e)),
            Err(e) => return Err(NotAdopted::Unfinished(e)),
        };
        if let Confirmed::Another(now) = confirmed {
            return Err(nothing(anyhow::anyhow!(
                "another host adopted it at the same time: its epoch tag is now {} (this run wrote {epoch}), \
                 so it is that host's; no record written here",
                now.as_deref().unwrap_or("gone")
            )));
        }
        Ok(epoch)
    }

    /// The record of a take-over whose tag write is this run's (or an
    /// earlier run's, finished now): written into the staging directory
    /// with its pending-event marker, the unreadable record moved aside,
    /// then renamed into place.
    #[allow(clippy::too_many_arguments)]
    fn record(
        store: &StateStore,
        ec2: &Ec2Provider,
        system_id: &str,
        a: &Adoptable,
        paths: &EnvPaths,
        unreadable: bool,
        staged: &Staged,
        epoch: String,
        _ctx: &Ctx,
    ) -> Result<(EnvironmentRecord, String, Option<PathBuf>)> {
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
            &staged.dir.join(PENDING_EVENT),
            format!("{epoch}\n{}\n", a.what.resource()).as_bytes(),
        )
        .with_context(|| format!("writing {PENDING_EVENT} into {}", staged.dir.display()))?;
        // Taken over in the cloud: the unreadable record can go aside now
        // (earlier, a failed tag write would have moved it for nothing).
        let quarantined = if unreadable {
            Some(quarantine(store, paths)?)
        } else {
            None
        };
        if !registry::create_staged(store, &rec, staged.dir.clone())? {
            bail!(
                "environment {} appeared in {} meanwhile: left to the process that made it",
                a.env_id,
                store.environments_dir().display()
            );
        }
        // The intent came along with the rename; the record now says it all
        // (one left by a kill right here is an inert file).
        let _ = store::remove_file(&paths.dir.join(INTENT));
        crate::failpoint!("adopt:recorded");
        Ok((rec, epoch, quarantined))
    }

    fn busy(paths: &EnvPaths) -> anyhow::Error {
        anyhow::anyhow!(
            "its record here cannot be read, and a dormant process holds its lock ({}): left as it is; \
             run `dormant adopt` again once no job uses this host",
            paths.lock.display()
        )
    }

    /// Moves an environment directory whose record cannot be read into
    /// `quarantine/<id>-<unix seconds>` in the state dir (never deleted),
    /// under its record lock: a process that holds the lock is left to finish.
    fn quarantine(store: &StateStore, paths: &EnvPaths) -> Result<PathBuf> {
        let Some(_lock) = registry::try_lock(paths)? else {
            return Err(busy(paths));
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
