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

use super::record::{EnvStatus, EnvironmentRecord, Holder};
use super::transitions::NotAllowed;
use super::volume_state::{HostKeyChange, VolumeState, VolumeStep, HOST_KEY_CHANGES_KEPT};
use crate::model::{Machine, Volume};

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
