//! Warm machines, the provider's half: a provider that can keep machines
//! booted ahead of any job implements [`WarmMachines`]. The pool's books are
//! `state::pool`; taking and retiring are `lifecycle::warm`, refilling
//! `lifecycle::warm_refill`.
//! See docs/architecture.md, "Warm machines".

use std::time::Duration;

use anyhow::Result;
use async_trait::async_trait;

use super::{Machine, MachineSpec};
use crate::context::Ctx;
use crate::model::EnvPaths;
use crate::state::pool::WarmPaths;

/// What today's settings make a warm machine from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WarmKind {
    /// Changes whenever anything a machine is made from changes (the image
    /// file, its size, user-data, network): a warm machine with another
    /// fingerprint is retired, never handed out.
    pub fingerprint: String,
    /// For people: what it is (e.g. the image's name and file).
    pub made_from: String,
}

#[async_trait]
pub trait WarmMachines: Send + Sync {
    /// How many warm machines the settings ask for (per zone).
    fn wanted(&self) -> u32;

    /// A warm machine older than this is retired.
    fn max_age(&self) -> Duration;

    /// What a warm machine is made from today.
    fn kind(&self) -> Result<WarmKind>;

    /// Whether a new environment's machine may be a warm one: it asks for
    /// what warm machines are made from (e.g. the default image).
    fn fits(&self, spec: &MachineSpec) -> bool;

    /// Whether a volume-mode resume's new machine may be a warm one (its
    /// volume exists; `zone_for` picks the zone). Default: as [`Self::fits`].
    fn fits_resume(&self, spec: &MachineSpec) -> bool {
        self.fits(spec)
    }

    /// Whether a new volume-mode environment takes its warm machine before
    /// its volume is made, and the volume is then made where that machine
    /// is (`VolumeSpec::beside`): EC2, whose volume attaches only in its own
    /// zone and so follows the instance. Default (`false`): the volume is
    /// made first and the machine taken after it, as for a resume.
    fn takes_before_volume(&self) -> bool {
        false
    }

    /// The zones the pool keeps `wanted` machines in (`[None]` on one host).
    /// Async: a cloud may have to be asked (EC2: the zones of the subnets).
    async fn zones(&self, _ctx: &Ctx) -> Result<Vec<Option<String>>> {
        Ok(vec![None])
    }

    /// Why no warm machine may be booted now (no free slot under the
    /// machine limit, leaving one for a job), or `None`. Async: a cloud's
    /// count of machines is a call. An error (the machines could not be
    /// counted) is the refill's error, reported: never taken for "no room".
    async fn no_room(&self, _ctx: &Ctx) -> Result<Option<String>> {
        Ok(None)
    }

    /// Whether a job's own machine would wait for a free slot now (the
    /// machine limit is reached): a report, on which the lifecycle decides
    /// (`lifecycle/warm.rs`): a job that fits waits for a warm machine still
    /// booting and takes it, instead of making that machine give its slot up
    /// once ready and booting its own; a job that cannot take one makes the
    /// oldest ready one give its slot up. Default: never (no machine limit).
    async fn job_must_wait(&self, _ctx: &Ctx) -> Result<bool> {
        Ok(false)
    }

    /// Boots a warm machine in `warm`'s directory, for `ssh_public_key`, and
    /// returns once it answers SSH. Bounded by `ctx`.
    async fn launch(
        &self,
        warm: &WarmPaths,
        zone: Option<&str>,
        ssh_public_key: &str,
        ctx: &Ctx,
    ) -> Result<Machine>;

    /// The machine of a `launching` entry whose launcher died, if it got as
    /// far as making one (found by its files or tags).
    async fn find_launched(&self, warm: &WarmPaths, ctx: &Ctx) -> Result<Option<Machine>>;

    /// Makes a running warm machine the machine of environment `env`: moves
    /// what the provider keeps of it, relabels it; returns the machine as
    /// the environment records it. Idempotent: a retried hand-over finishes
    /// what a killed one began.
    async fn hand_over(
        &self,
        warm: &WarmPaths,
        machine: &Machine,
        env: &EnvPaths,
        ctx: &Ctx,
    ) -> Result<Machine>;

    /// Whether a hand-over to `env` already made the machine the
    /// environment's (then it is the environment's to delete, not the pool's).
    async fn handed_over(&self, warm: &WarmPaths, env: &EnvPaths, ctx: &Ctx) -> Result<bool>;

    /// The zone a machine for `spec` must be in (volume mode: its volume's),
    /// or `None` for any.
    fn zone_for(&self, _spec: &MachineSpec) -> Option<String> {
        None
    }

    /// Deletes a warm machine that was never handed over. Already gone is success.
    async fn retire(&self, warm: &WarmPaths, machine: Option<&Machine>, ctx: &Ctx) -> Result<()>;

    /// Whether a ready warm machine still runs: `Ok(false)` only on a
    /// definite answer (gone, terminated, stopped), and such a machine is
    /// retired; an error (the cloud did not answer, a call was refused)
    /// says nothing about the machine, so the caller neither retires it nor
    /// hands it out, and asks again later.
    async fn alive(&self, warm: &WarmPaths, machine: &Machine, ctx: &Ctx) -> Result<bool>;
}
