//! Volume mode's side of a provider (`storage = "volume"`): the data volume
//! that holds an environment's builds and cache dirs and outlives its
//! machines. A provider that offers volume mode implements [`Volumes`] and
//! returns it from `Provider::volumes`; the lifecycle (`lifecycle::volume`)
//! drives it, recording every step before its effect, so a provider only
//! makes single, idempotent effects: create, attach, detach, delete.
//!
//! The order the lifecycle calls them in:
//! - new environment: `create_volume` → `Provider::create_or_reclaim` (with
//!   `MachineSpec::volume`: EC2 launches in the volume's zone) → `attach`
//!   (to the running machine: EC2's AttachVolume, QEMU's hot-plug) → the
//!   guest mount (`guest_mount`, run by the lifecycle over the transport);
//!   on EC2 with a ready warm instance: the warm instance taken first, then
//!   `create_volume` beside it (`VolumeSpec::beside`) → `attach` to it;
//! - suspend: the guest unmount → `detach` → `Provider::delete` (the machine);
//! - resume: as a new environment from `create_or_reclaim` on;
//! - release: `Provider::delete` (if a machine exists) → `delete_volume`.

use anyhow::Result;
use async_trait::async_trait;
use uuid::Uuid;

use crate::context::Ctx;
use crate::model::{EnvPaths, GuestMount, Machine, ManagedVolume, Volume};
use crate::provider::MachineSpec;

/// The ext4 label of a data volume dormant formats (the guest's mount
/// command, `lifecycle::guest`, on the environment's first mount).
pub const FS_LABEL: &str = "dormant-data";

/// What a provider needs to create (or find again) an environment's volume.
#[derive(Debug, Clone)]
pub struct VolumeSpec {
    pub env_id: Uuid,
    /// Deterministic name (`dormant-<env id>`): a retried create finds it.
    pub name: String,
    pub runner_id: String,
    pub system_id: String,
    pub project_id: u64,
    pub job_id: u64,
    pub paths: EnvPaths,
    /// A new environment's first machine, when the caller knows it. A
    /// provider whose volumes can only attach where they were made (an EBS
    /// volume lives in one zone) may launch this machine first, wherever
    /// there is capacity, and make the volume beside it; its
    /// `create_or_reclaim` then adopts the machine (found by its name or
    /// tags, as a retried prepare's would be).
    pub machine: Option<MachineSpec>,
    /// A running machine the new environment already has (a warm one it
    /// took, `WarmMachines::takes_before_volume`): the volume is made where
    /// it can be attached to that machine (EC2: its zone), and no machine is
    /// launched for it. Wins over `machine`.
    pub beside: Option<Machine>,
}

/// The data volume of a suspended environment no longer exists (deleted
/// outside dormant): a resume cannot succeed however often it is retried, so
/// prepare reports it once, as a refusal (like `MachineGone`).
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct VolumeGone(pub String);

/// The data volumes of a provider. Every call is bounded by `ctx.deadline`;
/// progress goes to `ctx.log`. "Already done" is success for every effect.
#[async_trait]
pub trait Volumes: Send + Sync {
    /// Makes the environment's data volume, or returns the one an earlier
    /// attempt made (found by its tags or path). Returns once it can be attached.
    async fn create_volume(&self, spec: &VolumeSpec, ctx: &Ctx) -> Result<Volume>;

    /// The volume of an environment by its tags or path: for a record that
    /// never got its id (a create whose process was killed).
    async fn find_volume(&self, env_id: Uuid, ctx: &Ctx) -> Result<Option<Volume>>;

    /// Attaches the volume to the running machine; attached already is
    /// success. Returns once the provider has attached it (the guest's kernel
    /// may see the device a moment later: the mount command waits for it). A
    /// volume that no longer exists is a [`VolumeGone`].
    async fn attach(&self, volume: &Volume, machine: &Machine, ctx: &Ctx) -> Result<()>;

    /// Detaches the volume from the machine; returns once it is free. The
    /// machine is deleted next, so stopping it is a fine way to detach.
    /// `unmounted`: the guest confirmed it unmounted the volume (everything
    /// written is on it); when false (the guest could not be asked: it is
    /// gone, or the environment is recovered from a dead process) the
    /// provider detaches only in a way that lets the guest's own shutdown
    /// unmount it, or that the machine is gone already.
    async fn detach(
        &self,
        volume: &Volume,
        machine: &Machine,
        unmounted: bool,
        ctx: &Ctx,
    ) -> Result<()>;

    /// Deletes the volume (its machine was deleted before).
    async fn delete_volume(&self, volume: &Volume, ctx: &Ctx) -> Result<()>;

    /// Every data volume this provider manages for this runner (orphans).
    async fn list_volumes(&self, ctx: &Ctx) -> Result<Vec<ManagedVolume>>;

    /// Where the guest sees the volume and where it is mounted.
    fn guest_mount(&self, volume: &Volume) -> GuestMount;

    /// The provider's fields for the environment key of a volume-mode
    /// environment (`volume=vol-..&zone=..`): what it is while suspended.
    fn key_fields(&self, volume: &Volume) -> Vec<(String, String)>;
}
