//! One environment's take-over, steps 1 to 5 of the module comment in
//! `mod.rs`: the staging directory with its key and intent, the tag write
//! and its read-back, the record renamed into place (an unreadable one
//! moved aside first), the `adopted` event. A take-over an earlier run
//! staged and whose tag write landed is finished here with that run's key
//! and epoch, not written again.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use super::pending::adopted_reason;
use super::run::Run;
use super::staged::{Intent, Staged, INTENT};
use super::{PENDING_EVENT, QUARANTINE_DIR};
use crate::envkey::EnvironmentKey;
use crate::events::{Event, Kind};
use crate::model::{EnvPaths, StorageMode};
use crate::provider::ec2::handover::{epoch_value, next_epoch};
use crate::provider::ec2::takeover::{Adoptable, Held};
use crate::provider::ec2::takeover_write::{Confirmed, NothingWritten};
use crate::provider::ec2::EPOCH_FIELD;
use crate::provider::Provider;
use crate::state::{registry, store, Adopted, EnvironmentRecord, StateStore};

/// Why a take-over did not end in a record.
pub(super) enum NotAdopted {
    /// Nothing in EC2 changed (or the change was another host's): no
    /// staging kept.
    Nothing(anyhow::Error),
    /// The tag write was sent (it may have landed): the take-over stays
    /// staged for the next run to finish or drop.
    Unfinished(anyhow::Error),
}

/// What a finished take-over left: the record, the epoch written, and where
/// an unreadable record it replaced went.
pub(super) struct Taken {
    pub rec: EnvironmentRecord,
    pub epoch: String,
    pub quarantined: Option<PathBuf>,
}

/// The take-over of one adoptable environment `a` by `run`.
pub(super) struct Takeover<'a> {
    run: &'a Run,
    a: &'a Adoptable,
    paths: EnvPaths,
    /// Why the record here cannot be read, if there is one that cannot.
    unreadable: Option<String>,
    staged: Staged,
}

impl<'a> Takeover<'a> {
    pub fn new(
        run: &'a Run,
        a: &'a Adoptable,
        paths: EnvPaths,
        unreadable: Option<String>,
    ) -> Self {
        let staged = Staged::of(&run.store, a.env_id);
        Takeover {
            run,
            a,
            paths,
            unreadable,
            staged,
        }
    }

    /// Steps 1 to 4: an earlier run's landed take-over finished, or the
    /// staging, the tag write and the record.
    pub async fn run(&self) -> Result<Taken, NotAdopted> {
        if let Some(intent) = self.earlier_landed() {
            return self.record(intent.written).map_err(NotAdopted::Unfinished);
        }
        self.staged.begin().map_err(NotAdopted::Nothing)?;
        let epoch = match self.stage_and_write().await {
            Ok(epoch) => epoch,
            Err(e) => {
                if let NotAdopted::Nothing(_) = e {
                    let _ = self.staged.drop_it();
                }
                return Err(e);
            }
        };
        crate::failpoint!("adopt:tagged");
        self.record(epoch).map_err(NotAdopted::Unfinished)
    }

    /// The intent an earlier run staged, if the tag shows its write landed
    /// (said in the log either way).
    fn earlier_landed(&self) -> Option<Intent> {
        let (a, resource) = (self.a, self.a.what.resource());
        let intent = self.staged.intent()?;
        if Staged::landed(&intent, resource, a.epoch_tag.as_deref()) {
            self.run.ctx.log.info(format!(
                "finishing the take-over of {resource} (environment {}) that an earlier `dormant adopt` \
                 wrote to EC2 (epoch {}) and did not record: its key and record come from {}",
                a.env_id,
                intent.written,
                self.staged.dir.display()
            ));
            return Some(intent);
        }
        self.run.ctx.log.info(format!(
            "an earlier `dormant adopt` began taking {resource} (environment {}) over with epoch {}, \
             but its tag shows {}: that write never landed or another host's came after it; its \
             staging is dropped and the environment adopted afresh",
            a.env_id,
            intent.written,
            a.epoch_tag.as_deref().unwrap_or("no epoch")
        ));
        None
    }

    /// Steps 1 to 3: the key pair and intent staged, then the tag write and
    /// its read-back: the epoch written, once it is this run's.
    async fn stage_and_write(&self) -> Result<String, NotAdopted> {
        let (a, paths, staged) = (self.a, &self.paths, &self.staged);
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
        if self.unreadable.is_some() {
            // The unreadable record goes aside after the tag write, under its
            // lock: a process holding it now would make that fail with the
            // take-over written, so find out before.
            if registry::try_lock(paths).map_err(nothing)?.is_none() {
                return Err(nothing(busy(paths)));
            }
        }
        let value = epoch_value(next_epoch(a.epoch), &self.run.owner);
        staged
            .record_intent(&Intent {
                version: 1,
                resource: a.what.resource().to_string(),
                written: value.clone(),
                found: a.epoch_tag.clone(),
            })
            .map_err(nothing)?;
        crate::failpoint!("adopt:staged");
        let written = self
            .run
            .ec2
            .take_over(a, &value, public_key.as_deref(), &self.run.ctx);
        let (epoch, confirmed) = match written.await {
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

    /// Step 4: the record of a take-over whose tag write is this run's (or
    /// an earlier run's, finished now): written into the staging directory
    /// with its pending-event marker, the unreadable record moved aside,
    /// then renamed into place.
    fn record(&self, epoch: String) -> Result<Taken> {
        let (run, a, staged) = (self.run, self.a, &self.staged);
        let rec = self.adopted_record(&epoch);
        store::write_private(
            &staged.dir.join(PENDING_EVENT),
            format!("{epoch}\n{}\n", a.what.resource()).as_bytes(),
        )
        .with_context(|| format!("writing {PENDING_EVENT} into {}", staged.dir.display()))?;
        // Taken over in the cloud: the unreadable record can go aside now
        // (earlier, a failed tag write would have moved it for nothing).
        let quarantined = match self.unreadable {
            Some(_) => Some(quarantine(&run.store, &self.paths)?),
            None => None,
        };
        if !registry::create_staged(&run.store, &rec, staged.dir.clone())? {
            bail!(
                "environment {} appeared in {} meanwhile: left to the process that made it",
                a.env_id,
                run.store.environments_dir().display()
            );
        }
        // The intent came along with the rename; the record now says it all
        // (one left by a kill right here is an inert file).
        let _ = store::remove_file(&self.paths.dir.join(INTENT));
        crate::failpoint!("adopt:recorded");
        Ok(Taken {
            rec,
            epoch,
            quarantined,
        })
    }

    /// The suspended record the cloud's tags describe, with `epoch`.
    fn adopted_record(&self, epoch: &str) -> EnvironmentRecord {
        let (ec2, a) = (&self.run.ec2, self.a);
        let mut key = EnvironmentKey::new(&a.runner_id, &self.run.system_id, a.env_id)
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
        EnvironmentRecord::adopted(Adopted {
            id: a.env_id,
            provider: ec2.name().to_string(),
            runner_id: a.runner_id.clone(),
            system_id: self.run.system_id.clone(),
            project_id: a.project_id,
            job_id: a.job_id,
            key: key.encode(),
            machine,
            volume,
            created_at: a.created_at.unwrap_or(now),
            // Not recorded (a suspension whose tag write failed): from now,
            // so the TTL never deletes it early.
            suspended_at: a.suspended_at.unwrap_or(now),
        })
    }

    /// Step 5: the `adopted` event, then the pending-event marker removed;
    /// an event that cannot be written is left to the next run (the marker
    /// stays).
    pub async fn announce(&self, taken: &Taken) {
        let mut reason = adopted_reason(self.a.what.resource(), &taken.epoch);
        if let Some(q) = &taken.quarantined {
            reason.push_str(&format!(
                "; the unreadable record here was moved to {}",
                q.display()
            ));
        }
        let event = Event::about(Kind::Adopted, "operator", &taken.rec).reason(&reason);
        match self.run.events.append(&event, &self.run.ctx).await {
            Ok(()) => {
                crate::failpoint!("adopt:announced");
                let _ = store::remove_file(&self.paths.dir.join(PENDING_EVENT));
            }
            Err(e) => self.run.ctx.log.warn(format!(
                "the adopted event of environment {} was not recorded in the event log ({e:#}); \
                 the next `dormant adopt` records it",
                self.a.env_id
            )),
        }
    }

    /// What the report adds to the adopted line when an unreadable record
    /// was moved aside (nothing otherwise).
    pub fn quarantine_note(&self, taken: &Taken) -> String {
        match (&taken.quarantined, &self.unreadable) {
            (Some(q), Some(why)) => format!(
                "; its record here could not be read ({why}) and was moved to {} (kept for you \
                 to look at; delete it when done), and rebuilt from the cloud",
                q.display()
            ),
            _ => String::new(),
        }
    }
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
