//! Volume mode in the state machine: the data volume of an environment and
//! how far it is attached, as steps of the record next to its status.
//!
//! ```text
//!  creating ──volume_created──▶ detached ──begin_attach──▶ attaching ──volume_attached──▶ attached
//!                                  ▲                        (machine                          │
//!                                  │                         launched)                        │ begin_detach
//!                                  │                                                          ▼
//!                                  └──machine_deleted── deleting-machine ◀──volume_detached── detaching
//! ```
//!
//! Every step is written before its side effect (intent) and its result right
//! after, like the status: `creating` (the volume may exist, unrecorded: found
//! by its tags or path), `attaching` (a machine may have been launched for it,
//! unrecorded: found by `Provider::find`), `detaching`, `deleting-machine`.
//! Whoever finds a step half done finishes it (`lifecycle::volume`). The
//! status says who acts (a `creating` or `resuming` environment attaches, a
//! `suspending` one detaches); these methods check both, under the record
//! lock, and are the only writers of the volume's step.

use serde::{Deserialize, Serialize};

use super::record::{EnvStatus, EnvironmentRecord, Holder};
use super::transitions::NotAllowed;
use crate::model::{Machine, Volume};

/// How many host key changes a record keeps (the last ones).
const HOST_KEY_CHANGES_KEPT: usize = 10;

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

fn refuse(rec: &EnvironmentRecord, verb: &'static str) -> NotAllowed {
    NotAllowed {
        id: rec.id,
        status: rec.status.as_str(),
        held: format!(
            "{} (volume {})",
            rec.holder()
                .map(|h| format!(" (held by {})", h.describe()))
                .unwrap_or_default(),
            rec.volume
                .as_ref()
                .map(|v| v.step.as_str())
                .unwrap_or("none")
        ),
        verb,
    }
}

impl EnvironmentRecord {
    /// The volume state, for a holder in one of `statuses`, at one of `steps`.
    fn volume_step(
        &mut self,
        holder: &Holder,
        statuses: &[EnvStatus],
        steps: &[VolumeStep],
        verb: &'static str,
    ) -> Result<&mut VolumeState, NotAllowed> {
        let ok = self
            .claim()
            .is_some_and(|c| super::transitions::same_holder(&c.holder, holder))
            && statuses.contains(&self.status)
            && self
                .volume
                .as_ref()
                .is_some_and(|v| steps.contains(&v.step));
        if !ok {
            return Err(refuse(self, verb));
        }
        Ok(self.volume.as_mut().expect("checked above"))
    }

    /// The create's result: the volume exists; the environment's key, which
    /// names it, is known.
    pub fn volume_created(
        &mut self,
        holder: &Holder,
        volume: Volume,
        key: String,
    ) -> Result<(), NotAllowed> {
        let v = self.volume_step(
            holder,
            &[EnvStatus::Creating],
            &[VolumeStep::Creating],
            "record its new volume",
        )?;
        v.volume = Some(volume);
        v.step = VolumeStep::Detached;
        self.key = Some(key);
        Ok(())
    }

    /// Intent: a machine is launched for the volume and the volume attached
    /// to it. `repin`: that machine replaces one whose host key is pinned.
    pub fn begin_attach(&mut self, holder: &Holder, repin: bool) -> Result<(), NotAllowed> {
        // From `attached` too: a retried prepare of a new environment whose
        // earlier attempt got that far (its machine is reclaimed by name).
        let v = self.volume_step(
            holder,
            &[EnvStatus::Creating, EnvStatus::Resuming],
            &[
                VolumeStep::Detached,
                VolumeStep::Attaching,
                VolumeStep::Attached,
            ],
            "attach its volume to a new machine",
        )?;
        if v.volume.is_none() {
            return Err(refuse(self, "attach a volume it does not have"));
        }
        let v = self.volume.as_mut().expect("checked above");
        v.step = VolumeStep::Attaching;
        // Once set, kept until the new machine's key is pinned: a retried
        // prepare may find the pin of an earlier attempt in known_hosts.
        v.repin |= repin;
        Ok(())
    }

    /// A machine launched for the volume but not recorded (its launch's
    /// result was lost with a killed process), found again and recorded.
    pub fn machine_found(&mut self, holder: &Holder, machine: Machine) -> Result<(), NotAllowed> {
        self.volume_step(
            holder,
            &[
                EnvStatus::Creating,
                EnvStatus::Resuming,
                EnvStatus::Suspending,
            ],
            &[VolumeStep::Attaching],
            "record a machine found by its tags",
        )?;
        if self.machine.is_some() {
            return Err(refuse(self, "record a second machine"));
        }
        self.machine = Some(machine);
        Ok(())
    }

    /// The attach's result.
    pub fn volume_attached(&mut self, holder: &Holder) -> Result<(), NotAllowed> {
        let has_machine = self.machine.is_some();
        let v = self.volume_step(
            holder,
            &[EnvStatus::Creating, EnvStatus::Resuming],
            &[VolumeStep::Attaching, VolumeStep::Attached],
            "record its volume attached",
        )?;
        if !has_machine {
            return Err(refuse(self, "be attached to no machine"));
        }
        v.step = VolumeStep::Attached;
        Ok(())
    }

    /// The first mount marked the volume as this environment's.
    pub fn volume_initialized(&mut self, holder: &Holder) -> Result<(), NotAllowed> {
        let v = self.volume_step(
            holder,
            &[EnvStatus::Creating, EnvStatus::Resuming, EnvStatus::Active],
            &[VolumeStep::Attached],
            "record its volume ready",
        )?;
        v.initialized = true;
        Ok(())
    }

    /// The new machine's host key is pinned: records what changed.
    pub fn host_key_repinned(
        &mut self,
        holder: &Holder,
        old: Vec<String>,
        new: Vec<String>,
    ) -> Result<(), NotAllowed> {
        let machine = self
            .machine
            .as_ref()
            .map(|m| m.id.clone())
            .unwrap_or_default();
        let v = self.volume_step(
            holder,
            &[EnvStatus::Creating, EnvStatus::Resuming, EnvStatus::Active],
            &[VolumeStep::Attaching, VolumeStep::Attached],
            "record a new machine's host key",
        )?;
        v.repin = false;
        if old != new {
            self.host_key_changes.push(HostKeyChange {
                at: super::now_unix(),
                machine,
                old,
                new,
            });
            let extra = self
                .host_key_changes
                .len()
                .saturating_sub(HOST_KEY_CHANGES_KEPT);
            self.host_key_changes.drain(..extra);
        }
        Ok(())
    }

    /// Intent: detach the volume from the record's machine. Also from
    /// `attaching` (a launch or attach cut short) and again from `detaching`.
    pub fn begin_detach(&mut self, holder: &Holder) -> Result<(), NotAllowed> {
        let has_machine = self.machine.is_some();
        let v = self.volume_step(
            holder,
            &[EnvStatus::Resuming, EnvStatus::Suspending],
            &[
                VolumeStep::Attaching,
                VolumeStep::Attached,
                VolumeStep::Detaching,
            ],
            "detach its volume",
        )?;
        if !has_machine {
            return Err(refuse(self, "detach its volume from no machine"));
        }
        v.step = VolumeStep::Detaching;
        Ok(())
    }

    /// The detach's result, and the intent to delete the machine (one write).
    /// Also when a detached volume's machine is left over (a delete that failed).
    pub fn volume_detached(&mut self, holder: &Holder) -> Result<(), NotAllowed> {
        let has_machine = self.machine.is_some();
        let v = self.volume_step(
            holder,
            &[EnvStatus::Resuming, EnvStatus::Suspending],
            &[
                VolumeStep::Detaching,
                VolumeStep::Detached,
                VolumeStep::DeletingMachine,
            ],
            "record its volume detached",
        )?;
        if !has_machine {
            return Err(refuse(self, "delete no machine"));
        }
        v.step = VolumeStep::DeletingMachine;
        Ok(())
    }

    /// The machine's delete's result: the environment is its volume alone.
    /// Also for an `attaching` step whose machine never came to exist.
    pub fn machine_deleted(&mut self, holder: &Holder) -> Result<(), NotAllowed> {
        let has_machine = self.machine.is_some();
        let v = self.volume_step(
            holder,
            &[EnvStatus::Resuming, EnvStatus::Suspending],
            &[VolumeStep::DeletingMachine, VolumeStep::Attaching],
            "record its machine deleted",
        )?;
        if v.step == VolumeStep::Attaching && has_machine {
            return Err(refuse(self, "forget a machine it did not delete"));
        }
        v.step = VolumeStep::Detached;
        self.machine = None;
        Ok(())
    }
}

#[cfg(test)]
#[path = "volume_tests.rs"]
mod tests;
