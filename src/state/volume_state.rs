//! The data of volume mode in an environment record: the volume, the step
//! of its cycle, and the host keys pinned anew for new machines. Plain data,
//! so the record (`record.rs`) can hold it without importing the transitions
//! that change it (`volume.rs`, the only writer of the step).

use serde::{Deserialize, Serialize};

use crate::model::Volume;

/// How many host key changes a record keeps (the last ones).
pub(super) const HOST_KEY_CHANGES_KEPT: usize = 10;

/// Where the data volume is in its cycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum VolumeStep {
    /// Being created; it may exist without its id recorded here.
    Creating,
    /// Exists and is attached to no machine: what a suspended environment is.
    Detached,
    /// A machine is being launched for it and it is being attached to that
    /// machine; the machine may exist without being recorded yet.
    Attaching,
    /// Attached to the record's machine.
    Attached,
    /// Being detached from the record's machine (the guest unmounted it, or
    /// could not be asked to).
    Detaching,
    /// Detached; the record's machine is being deleted.
    DeletingMachine,
}

impl VolumeStep {
    pub fn as_str(self) -> &'static str {
        match self {
            VolumeStep::Creating => "creating",
            VolumeStep::Detached => "detached",
            VolumeStep::Attaching => "attaching",
            VolumeStep::Attached => "attached",
            VolumeStep::Detaching => "detaching",
            VolumeStep::DeletingMachine => "deleting-machine",
        }
    }
}

/// The volume part of a volume-mode record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeState {
    /// The provider's handle, once the create returned it.
    pub volume: Option<Volume>,
    pub(super) step: VolumeStep,
    /// The `image:` of the job that made the environment: every new machine
    /// of it is made from what that names in the settings *then* (as a
    /// machine-mode environment keeps the image it was made from).
    #[serde(default)]
    pub image: Option<String>,
    /// The first mount marked the volume as this environment's: every later
    /// mount must find that mark (a blank or foreign volume is refused, never
    /// taken for a fresh start).
    #[serde(default)]
    pub initialized: bool,
    /// The machine being launched replaces the one whose host key is pinned:
    /// its first connection pins its own key (see docs/ssh.md).
    #[serde(default)]
    pub(super) repin: bool,
}

impl VolumeState {
    pub(super) fn creating(image: Option<String>) -> Self {
        VolumeState {
            volume: None,
            step: VolumeStep::Creating,
            image,
            initialized: false,
            repin: false,
        }
    }

    /// A detached volume taken over from a lost host (`dormant adopt`): it
    /// was mounted and marked by the environment's first machine, so every
    /// later mount must find its mark.
    pub(super) fn adopted(&mut self, volume: Volume) {
        self.volume = Some(volume);
        self.step = VolumeStep::Detached;
        self.initialized = true;
        self.repin = false;
    }

    pub fn step(&self) -> VolumeStep {
        self.step
    }

    /// Whether the next connection to the record's machine pins its host key
    /// anew (the machine was launched to replace the one pinned).
    pub fn repin(&self) -> bool {
        self.repin
    }
}

/// A host key pinned anew for a new machine (volume mode).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostKeyChange {
    /// Unix seconds.
    pub at: u64,
    /// The machine the new key belongs to.
    pub machine: String,
    /// Fingerprints pinned before (the replaced machine's) and now.
    pub old: Vec<String>,
    pub new: Vec<String>,
}
