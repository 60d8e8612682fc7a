//! Slots of the `ssh` provider: each host runs at most `slots` active
//! environments, counted in `<state>/ssh-slots.json` under `ssh-slots.lock`.
//! A prepare waits for a free slot through `crate::wait`, looking every
//! [`SLOT_POLL`] (a local file read, no remote call), so a slot freed by a
//! suspend or release is taken within that.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::SshHostsProvider;
use crate::context::Ctx;
use crate::settings::ssh::SshHost;
use crate::state::store::{self, FORMAT_VERSION};
use crate::state::EnvStatus;
use crate::state::{registry, FileLock};
use crate::wait::{Poll, Schedule, Wait};

/// The slot file's lock is held for a read-modify-write only.
const SLOT_LOCK_TIMEOUT: Duration = Duration::from_secs(30);
/// A freed slot is noticed within this: a look is a local file read under a
/// lock (no remote call), cheap enough to repeat four times a second.
const SLOT_POLL: Duration = Duration::from_millis(250);

/// `<state>/ssh-slots.json`: which environments hold a slot on which host.
#[derive(Debug, Default, Serialize, Deserialize)]
pub(super) struct Slots {
    pub version: u32,
    #[serde(default)]
    pub hosts: BTreeMap<String, Vec<Uuid>>,
}

impl SshHostsProvider {
    fn slots_path(&self) -> PathBuf {
        self.store.root().join("ssh-slots.json")
    }

    pub(super) async fn with_slots<T>(
        &self,
        ctx: &Ctx,
        change: impl FnOnce(&mut Slots) -> T,
    ) -> Result<T> {
        let path = self.store.root().join("ssh-slots.lock");
        let _lock = FileLock::acquire(
            &path,
            &ctx.uncancellable().within(SLOT_LOCK_TIMEOUT),
            "waiting for the SSH host slots' lock",
        )
        .await?
        .with_context(|| format!("the state dir of {} is missing", path.display()))?;
        let mut slots: Slots = store::read_json(&self.slots_path())?.unwrap_or_default();
        slots.version = FORMAT_VERSION;
        // A slot whose environment was released, or is suspended, is free.
        for ids in slots.hosts.values_mut() {
            ids.retain(|id| {
                matches!(registry::peek(&self.store.env_paths(*id)), Ok(Some(rec)) if rec.status() != EnvStatus::Suspended)
            });
        }
        let out = change(&mut slots);
        store::write_json(&self.slots_path(), &slots)?;
        Ok(out)
    }

    /// Takes a slot for `env` on `only` (resume) or on the least busy host.
    /// Waits, bounded and with progress, while every candidate is full.
    pub(super) async fn acquire_slot(
        &self,
        env: Uuid,
        only: Option<&str>,
        ctx: &Ctx,
    ) -> Result<SshHost> {
        let ctx = ctx.within(self.settings.slot_wait.get());
        let mut wait = Wait::new(&ctx, "a free SSH host slot", Schedule::fixed(SLOT_POLL));
        let host = wait
            .until(|| async { self.try_slot(env, only, &ctx).await })
            .await
            .with_context(|| {
                format!(
                    "no SSH host slot for environment {env}: raise `slots` in [[ssh.hosts]], add hosts, \
                     or raise ssh.slot_wait (suspended environments hold no slot)"
                )
            })?;
        if wait.probes() > 1 {
            ctx.log.info(format!(
                "got a slot on SSH host {} after {:.1} s",
                host.name(),
                wait.elapsed().as_secs_f64()
            ));
        }
        Ok(host)
    }

    /// One look at the slots: a host with a free slot (taken for `env`), or
    /// how busy every candidate is.
    async fn try_slot(&self, env: Uuid, only: Option<&str>, ctx: &Ctx) -> Result<Poll<SshHost>> {
        let candidates: Vec<&SshHost> = match only {
            Some(name) => vec![self.host(name)?],
            None => self.settings.hosts.iter().collect(),
        };
        self.with_slots(ctx, |slots| {
            if let Some((name, _)) = slots.hosts.iter().find(|(_, ids)| ids.contains(&env)) {
                if let Some(h) = candidates.iter().find(|h| h.name() == name) {
                    return Poll::Ready((*h).clone());
                }
            }
            let used = |h: &SshHost| slots.hosts.get(h.name()).map_or(0, Vec::len) as u32;
            let best = candidates
                .iter()
                .filter(|h| used(h) < h.slots)
                .min_by_key(|h| used(h) * 1000 / h.slots);
            match best {
                Some(h) => {
                    slots
                        .hosts
                        .entry(h.name().to_string())
                        .or_default()
                        .push(env);
                    Poll::Ready((*h).clone())
                }
                None => Poll::Pending(format!(
                    "every slot is busy ({})",
                    candidates
                        .iter()
                        .map(|h| format!("{} {}/{}", h.name(), used(h), h.slots))
                        .collect::<Vec<_>>()
                        .join(", ")
                )),
            }
        })
        .await
    }

    pub(super) async fn release_slot(&self, env: Uuid, ctx: &Ctx) -> Result<()> {
        self.with_slots(ctx, |slots| {
            for ids in slots.hosts.values_mut() {
                ids.retain(|id| *id != env);
            }
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::context::JobLog;
    use crate::provider::ssh_hosts::tests::{active_env, provider};
    use tokio_util::sync::CancellationToken;

    fn ctx(budget: Duration) -> Ctx {
        Ctx::new(JobLog::capture().0, CancellationToken::new(), budget)
    }

    #[tokio::test]
    async fn slots_spread_over_hosts_and_a_full_fleet_waits_bounded() {
        let (_d, p) = provider(1);
        let (e1, e2, e3) = (active_env(&p), active_env(&p), active_env(&p));
        let h1 = p
            .acquire_slot(e1, None, &ctx(Duration::from_secs(5)))
            .await
            .unwrap();
        let h2 = p
            .acquire_slot(e2, None, &ctx(Duration::from_secs(5)))
            .await
            .unwrap();
        assert_ne!(h1.name(), h2.name(), "the least busy host is picked");
        // A retried prepare gets the slot it already holds.
        let again = p
            .acquire_slot(e1, None, &ctx(Duration::from_secs(5)))
            .await
            .unwrap();
        assert_eq!(again.name(), h1.name());
        let err = p
            .acquire_slot(e3, None, &ctx(Duration::from_millis(700)))
            .await
            .unwrap_err();
        assert!(format!("{err:#}").contains("a 1/1, b 1/1"), "{err:#}");
        // Suspending e1 frees its slot for e3.
        p.release_slot(e1, &ctx(Duration::from_secs(5)))
            .await
            .unwrap();
        let h3 = p
            .acquire_slot(e3, None, &ctx(Duration::from_secs(5)))
            .await
            .unwrap();
        assert_eq!(h3.name(), h1.name());
    }

    /// A waiter takes the slot a suspend frees, saying what it waited for.
    /// (How soon is bounded by `SLOT_POLL`: a fixed schedule, see `crate::wait`.)
    #[tokio::test]
    async fn a_waiter_takes_a_freed_slot_and_says_so() {
        let (_d, p) = provider(1);
        let (e1, e2, e3) = (active_env(&p), active_env(&p), active_env(&p));
        let budget = Duration::from_secs(60);
        p.acquire_slot(e1, Some("a"), &ctx(budget)).await.unwrap();
        p.acquire_slot(e2, Some("b"), &ctx(budget)).await.unwrap();
        let (log, buf) = JobLog::capture();
        let waiting = Ctx::new(log, CancellationToken::new(), budget);
        let (got, freed) = tokio::join!(p.acquire_slot(e3, None, &waiting), async {
            tokio::time::sleep(Duration::from_millis(600)).await;
            p.release_slot(e2, &ctx(Duration::from_secs(5)))
                .await
                .unwrap();
            std::time::Instant::now()
        });
        assert_eq!(got.unwrap().name(), "b");
        eprintln!(
            "MEASURE slot noticed {:?} after it was freed",
            freed.elapsed()
        );
        let log = String::from_utf8_lossy(&buf.lock().unwrap()).to_string();
        assert!(
            log.contains(
                "waiting for a free SSH host slot: every slot is busy (a 1/1, b 1/1) (0 s of 60 s)"
            ),
            "{log}"
        );
        assert!(log.contains("got a slot on SSH host b after "), "{log}");
    }

    #[tokio::test]
    async fn slots_of_released_environments_are_reclaimed() {
        let (_d, p) = provider(1);
        let e1 = active_env(&p);
        p.acquire_slot(e1, Some("a"), &ctx(Duration::from_secs(5)))
            .await
            .unwrap();
        crate::state::store::remove_tree(&p.store.env_paths(e1).dir).unwrap();
        let e2 = active_env(&p);
        let h = p
            .acquire_slot(e2, Some("a"), &ctx(Duration::from_secs(2)))
            .await
            .unwrap();
        assert_eq!(h.name(), "a");
    }
}
