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
//! 2. one CreateTags call: the next ownership epoch and, in machine mode, the
//!    new public key for the boot hook (`adopt:staged` before it);
//! 3. the record — suspended, its original suspension time, the new epoch —
//!    written into the staging directory and renamed into place with the
//!    key files (`adopt:tagged` before it, `adopt:recorded` after);
//! 4. an `adopted` event.
//!
//! Killed before 3, the environment is still unknown here: the next run
//! adopts it again (one more epoch, a new key in the tag: the record it then
//! writes matches both), and the staging directory left behind is removed by
//! `dormant sweep`. One adopt runs at a time (`adopt.lock` in the state dir).

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
}

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
mod imp {
    use std::path::Path;

    use anyhow::{bail, Context, Result};
    use tokio_util::sync::CancellationToken;

    use super::Report;
    use crate::context::{Ctx, JobLog};
    use crate::envkey::EnvironmentKey;
    use crate::events::{Event, EventLog, Kind};
    use crate::job::Job;
    use crate::model::{EnvPaths, StorageMode};
    use crate::ops::{open_store, OPERATOR_BUDGET};
    use crate::provider::ec2::takeover::{Adoptable, Held};
    use crate::provider::ec2::Ec2Provider;
    use crate::provider::Provider;
    use crate::settings::Settings;
    use crate::state::lock::FileLock;
    use crate::state::{registry, store, Adopted, EnvironmentRecord, StateStore};

    use crate::provider::ec2::EPOCH_FIELD;

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
                Err(e) => Some(format!(
                    "its record on this host cannot be read ({e:#}): move {} aside and run `dormant adopt` \
                     again to rebuild it from the cloud",
                    paths.dir.display()
                )),
            };
            if let Some(why) = known {
                report
                    .left
                    .push(format!("{resource} (environment {}): {why}", a.env_id));
                continue;
            }
            match adopt_one(&store, &ec2, &system_id, a, &paths, &ctx).await {
                Ok(rec) => {
                    let line = describe(&rec, a);
                    let event = Event::about(Kind::Adopted, "operator", &rec)
                        .reason(&format!("taken over from the cloud: {resource}"));
                    events.record(event, &ctx).await;
                    report.adopted.push((a.env_id, line));
                }
                Err(e) => report.left.push(format!(
                    "{resource} (environment {}): not adopted: {e:#}",
                    a.env_id
                )),
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

    async fn adopt_one(
        store: &StateStore,
        ec2: &Ec2Provider,
        system_id: &str,
        a: &Adoptable,
        paths: &EnvPaths,
        ctx: &Ctx,
    ) -> Result<EnvironmentRecord> {
        let staging = store.staging_dir(a.env_id)?;
        let result = stage_and_record(store, ec2, system_id, a, paths, &staging, ctx).await;
        if result.is_err() {
            let _ = store::remove_tree(&staging);
        }
        result
    }

    async fn stage_and_record(
        store: &StateStore,
        ec2: &Ec2Provider,
        system_id: &str,
        a: &Adoptable,
        paths: &EnvPaths,
        staging: &Path,
        ctx: &Ctx,
    ) -> Result<EnvironmentRecord> {
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
        let epoch = ec2.take_over(a, public_key.as_deref(), ctx).await?;
        crate::failpoint!("adopt:tagged");
        let mut key = EnvironmentKey::new(&a.runner_id, system_id, a.env_id)
            .with_field("provider", ec2.name());
        let (machine, volume) = match &a.what {
            Held::Machine { machine, .. } => {
                for (k, v) in ec2.key_fields(machine) {
                    key = key.with_field(&k, &v);
                }
                (
                    Some(machine.clone().with(EPOCH_FIELD, epoch.to_string())),
                    None,
                )
            }
            Held::Volume { volume } => {
                key = key.with_field(crate::envkey::STORAGE_FIELD, StorageMode::Volume.as_str());
                if let Some(vols) = ec2.volumes() {
                    for (k, v) in vols.key_fields(volume) {
                        key = key.with_field(&k, &v);
                    }
                }
                (
                    None,
                    Some(volume.clone().with(EPOCH_FIELD, epoch.to_string())),
                )
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
        if !registry::create_staged(store, &rec, staging.to_path_buf())? {
            bail!(
                "environment {} appeared in {} meanwhile: left to the process that made it",
                a.env_id,
                store.environments_dir().display()
            );
        }
        crate::failpoint!("adopt:recorded");
        Ok(rec)
    }
}
