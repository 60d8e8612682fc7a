//! The environment lifecycle as a state machine: every change of an
//! environment's `status` and `claim` is one of the methods here, each
//! checking it is allowed from the current status and by this holder. They are
//! applied under the record lock by `registry::update` only; no other code can
//! write those fields (they are private to `state`).
//!
//! ```text
//!              claim (new job)                 activate
//!   (none) ─────────────────────▶ creating ───────────────▶ active ──┐
//!                                    │                        ▲      │ begin_suspend
//!                                    │ begin_release          │      ▼
//!                                    ▼              activate  │  suspending ── suspended ──▶ suspended
//!   (gone) ◀── remove ── releasing ◀──────── resuming ───────┘      ▲
//!                          ▲    ▲               ▲                    │
//!                          │    └─ begin_release (any held status)   │
//!                          │                    └── claim_for_resume ┘ (from suspended)
//!                          └── begin_release (suspended: TTL, operator)
//! ```
//!
//! The hot window (docs/pause.md) adds no status: `suspending ──
//! suspended_hot ──▶ suspended` with `hot_until` set and the machine running;
//! `claim_for_resume` takes it as it is, `begin_cool ──▶ suspending` ends the
//! window (then the usual `suspended`).
//!
//! The pure rules — what cleanup does with a job's environment, what a stale
//! claim is settled to — are functions at the end, unit-tested over every
//! status × phase × outcome. `docs/architecture.md` has the table.

use super::record::{Claim, EnvStatus, EnvironmentRecord, Holder, Mode};
use crate::model::Machine;

/// A transition that is not allowed now; says why in words for the log.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("environment {id} is {status}{held}: cannot {verb}")]
pub struct NotAllowed {
    pub id: uuid::Uuid,
    pub status: &'static str,
    pub held: String,
    pub verb: &'static str,
}

fn not_allowed(rec: &EnvironmentRecord, verb: &'static str) -> NotAllowed {
    NotAllowed {
        id: rec.id,
        status: rec.status.as_str(),
        held: rec
            .holder()
            .map(|h| format!(" (held by {})", h.describe()))
            .unwrap_or_default(),
        verb,
    }
}

/// Whether `a` and `b` are the same holder (a job's triggers may be updated
/// by a retried prepare; it is still the same job).
pub fn same_holder(a: &Holder, b: &Holder) -> bool {
    match (a, b) {
        (
            Holder::Job {
                runner_id: r1,
                job_id: j1,
                ..
            },
            Holder::Job {
                runner_id: r2,
                job_id: j2,
                ..
            },
        ) => r1 == r2 && j1 == j2,
        _ => a == b,
    }
}

/// What the record of an environment taken over from a lost host is made
/// of (`dormant adopt`): what the cloud keeps about it.
pub struct Adopted {
    pub id: uuid::Uuid,
    pub provider: String,
    pub runner_id: String,
    pub system_id: String,
    pub project_id: u64,
    /// The job that made it.
    pub job_id: u64,
    pub key: String,
    /// Machine mode: the stopped machine. Volume mode: `None`.
    pub machine: Option<Machine>,
    /// Volume mode: the detached data volume.
    pub volume: Option<crate::model::Volume>,
    pub created_at: u64,
    /// Its original suspension: the TTL counts from here.
    pub suspended_at: u64,
}

impl EnvironmentRecord {
    /// A suspended environment that nobody holds, rebuilt from the cloud:
    /// the status it had on the host that lost it.
    pub fn adopted(a: Adopted) -> Self {
        let storage = if a.volume.is_some() {
            crate::model::StorageMode::Volume
        } else {
            crate::model::StorageMode::Machine
        };
        let mut rec = EnvironmentRecord::new(
            super::record::NewEnvironment {
                id: a.id,
                provider: &a.provider,
                runner_id: &a.runner_id,
                system_id: &a.system_id,
                project_id: a.project_id,
                project_path: None,
                job_id: a.job_id,
                storage,
                image: None,
            },
            Holder::Operator {
                pid: std::process::id(),
                what: "dormant adopt".into(),
            },
        );
        rec.status = EnvStatus::Suspended;
        rec.claim = None;
        rec.key = Some(a.key);
        rec.machine = a.machine;
        rec.created_at = a.created_at;
        rec.suspended_at = Some(a.suspended_at);
        if let (Some(v), Some(state)) = (a.volume, rec.volume.as_mut()) {
            state.adopted(v);
        }
        rec
    }

    fn held_by(&self, holder: &Holder) -> bool {
        self.claim
            .as_ref()
            .is_some_and(|c| same_holder(&c.holder, holder))
    }

    fn require(
        &self,
        holder: &Holder,
        from: &[EnvStatus],
        verb: &'static str,
    ) -> Result<(), NotAllowed> {
        if self.held_by(holder) && from.contains(&self.status) {
            Ok(())
        } else {
            Err(not_allowed(self, verb))
        }
    }

    fn set(&mut self, status: EnvStatus, holder: &Holder) {
        self.status = status;
        match &mut self.claim {
            Some(c) if same_holder(&c.holder, holder) => {
                c.holder = holder.clone();
                c.last_activity = super::now_unix();
            }
            _ => self.claim = Some(Claim::new(holder.clone())),
        }
    }

    /// The holding job's script paused (docs/pause.md): the question goes
    /// on the record at once, and the claim says the job's environment is
    /// kept whatever becomes of the job — so a recovery of a cleanup killed
    /// before it suspended suspends it ([`on_stale`]) instead of releasing
    /// the paused script with it. `false`: the job does not hold it.
    pub fn paused_by(&mut self, job_id: u64, question: &str) -> bool {
        match self.claim.as_mut().map(|c| &mut c.holder) {
            Some(Holder::Job {
                job_id: holder,
                suspend_on_failure,
                ..
            }) if *holder == job_id => {
                *suspend_on_failure = true;
                self.paused = Some(super::Paused {
                    question: question.to_string(),
                    job_id,
                    at: super::now_unix(),
                    lost: None,
                    ended: None,
                });
                true
            }
            _ => false,
        }
    }

    /// A retried prepare of the job that made this environment takes it back,
    /// whatever an earlier attempt's cleanup left (it may have failed to
    /// release it): the machine is found again by `create_or_reclaim`.
    pub fn retake_for_retry(&mut self, holder: &Holder) -> Result<(), NotAllowed> {
        let ours = holder.job_id() == Some(self.created_by_job)
            && (self.claim.is_none() || self.held_by(holder));
        if !ours || self.status == EnvStatus::Suspended {
            return Err(not_allowed(self, "be taken back by a retried prepare"));
        }
        self.set(EnvStatus::Creating, holder);
        Ok(())
    }

    /// Records the machine a create made (result right after the effect).
    pub fn machine_made(
        &mut self,
        holder: &Holder,
        machine: Machine,
        key: String,
    ) -> Result<(), NotAllowed> {
        self.require(holder, &[EnvStatus::Creating], "record its new machine")?;
        self.machine = Some(machine);
        self.key = Some(key);
        self.set(EnvStatus::Creating, holder);
        Ok(())
    }

    /// A job (or a shell) claims a suspended environment to resume it. A
    /// hot one keeps its `hot_until` until the resume is done (`activate`):
    /// a retried prepare of the same job sees its machine still runs, and
    /// the cleanup of a resume that failed puts it back hot for the rest of
    /// its window (docs/pause.md, "The hot window"), rather than stopping a
    /// machine whose paused script a stop would lose.
    pub fn claim_for_resume(&mut self, holder: &Holder) -> Result<(), NotAllowed> {
        if self.status != EnvStatus::Suspended || self.claim.is_some() {
            return Err(not_allowed(self, "be resumed"));
        }
        self.set(EnvStatus::Resuming, holder);
        Ok(())
    }

    /// Records the machine as started (it may have a new address).
    pub fn machine_started(&mut self, holder: &Holder, machine: Machine) -> Result<(), NotAllowed> {
        self.require(holder, &[EnvStatus::Resuming], "record its started machine")?;
        self.machine = Some(machine);
        self.set(EnvStatus::Resuming, holder);
        Ok(())
    }

    /// Prepare finished: the environment runs the holder's commands.
    pub fn activate(&mut self, holder: &Holder) -> Result<(), NotAllowed> {
        self.require(
            holder,
            &[EnvStatus::Creating, EnvStatus::Resuming, EnvStatus::Active],
            "become active",
        )?;
        if self.status == EnvStatus::Resuming {
            self.resumed_at = Some(super::now_unix());
            self.job_count += 1;
        }
        // A hot window ends with the resume it served.
        self.hot_until = None;
        self.last_error = None;
        self.set(EnvStatus::Active, holder);
        Ok(())
    }

    /// Intent to stop the machine and keep it.
    pub fn begin_suspend(&mut self, holder: &Holder) -> Result<(), NotAllowed> {
        self.require(
            holder,
            &[
                EnvStatus::Active,
                EnvStatus::Resuming,
                EnvStatus::Suspending,
            ],
            "be suspended",
        )?;
        self.set(EnvStatus::Suspending, holder);
        Ok(())
    }

    /// The stop's result: suspended either way — a machine whose stop failed
    /// is kept all the same (its disk holds the job's work; the next resume
    /// starts it, or the TTL deletes it), with the error recorded.
    /// `fresh`: a new suspension (its TTL starts now), not a failed resume
    /// put back. `memory_lost`: the machine's memory did not survive (why):
    /// a paused script is marked gone (docs/pause.md), and stays so until a
    /// job that ran stages settles the question (`dormant-continue` says so
    /// at once in the meantime).
    pub fn suspended(
        &mut self,
        holder: &Holder,
        error: Option<String>,
        fresh: bool,
        memory_lost: Option<String>,
    ) -> Result<(), NotAllowed> {
        self.require(holder, &[EnvStatus::Suspending], "be marked suspended")?;
        // (A script that ended, whose code the record holds (`ended`), lost
        // nothing with the memory.)
        if let (Some(paused), Some(why)) = (
            self.paused.as_mut().filter(|p| p.ended.is_none()),
            memory_lost,
        ) {
            paused.lost.get_or_insert(why);
        }
        self.status = EnvStatus::Suspended;
        self.claim = None;
        self.hot_until = None;
        if fresh || self.suspended_at.is_none() {
            self.suspended_at = Some(super::now_unix());
        }
        self.last_error = error;
        Ok(())
    }

    /// Intent to delete the machine. Allowed to the holder in any held
    /// status, and to anyone on a suspended environment (TTL, operator) or on
    /// a release that failed (nobody holds it: anyone may finish it).
    pub fn begin_release(&mut self, holder: &Holder) -> Result<(), NotAllowed> {
        let unheld = self.claim.is_none()
            && matches!(self.status, EnvStatus::Suspended | EnvStatus::Releasing);
        if !(self.held_by(holder) || unheld) {
            return Err(not_allowed(self, "be released"));
        }
        self.hot_until = None;
        self.set(EnvStatus::Releasing, holder);
        Ok(())
    }

    /// The delete failed: stays `releasing` with nobody holding it, so the
    /// next sweep (or `dormant release`) retries at once; error recorded.
    pub fn release_failed(&mut self, holder: &Holder, error: String) -> Result<(), NotAllowed> {
        self.require(holder, &[EnvStatus::Releasing], "record a failed release")?;
        self.last_error = Some(error);
        self.claim = None;
        Ok(())
    }

    /// Whether `holder` may now delete the record and directory (the machine is gone).
    pub fn may_remove(&self, holder: &Holder) -> Result<(), NotAllowed> {
        self.require(holder, &[EnvStatus::Releasing], "be removed")
    }

    /// A new stage of the holder started or ended: its claim is alive.
    pub fn touch(&mut self, holder: &Holder) -> Result<(), NotAllowed> {
        if !self.held_by(holder) {
            return Err(not_allowed(self, "be touched by a holder it does not have"));
        }
        let status = self.status;
        self.set(status, holder);
        Ok(())
    }

    /// Takes over a claim whose holder is gone (checked by the caller: dead and
    /// idle past the grace, or forced), to settle it as [`on_stale`] says.
    pub fn take_over(&mut self, by: &Holder, why: String) -> Result<Holder, NotAllowed> {
        let Some(old) = self.claim.clone() else {
            return Err(not_allowed(self, "be taken over (nobody holds it)"));
        };
        self.claim = Some(Claim::new(by.clone()));
        self.last_recovery = Some(why);
        Ok(old.holder)
    }
}

/// What happens to an environment's machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settle {
    /// Stop it and keep it: a job's triggers asked for it.
    Suspend,
    /// Stop it and keep it: a resume that never reached the job's first stage,
    /// or a stop that did not finish, goes back to suspended.
    Resuspend,
    /// Delete it.
    Release,
    /// Nothing to do (not held).
    Nothing,
}

/// How far a job got, as cleanup needs to know it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Reached {
    /// Prepare did not finish.
    Preparing,
    /// Prepare finished; no stage script started.
    Ready,
    /// At least one stage script started.
    Stages,
}

/// What cleanup does with the environment its job holds. `suspends` is
/// whether the job's outcome matches its triggers (false for cancel/timeout).
/// `machine_lost`: a volume-mode environment's machine went away under a
/// stage (a spot reclaim, someone deleting it): the job failed (a system
/// failure), and its volume is kept when the triggers keep a failure — or
/// when the job had resumed it, since that environment was kept before the
/// job came and losing a machine must not lose it.
pub fn at_cleanup(
    status: EnvStatus,
    mode: Mode,
    reached: Reached,
    terminated: bool,
    suspends: bool,
    suspend_enabled: bool,
    machine_lost: bool,
) -> Settle {
    match status {
        EnvStatus::Suspended => Settle::Nothing,
        EnvStatus::Creating => Settle::Release,
        // The machine may be half started: stop it again, nothing is lost.
        EnvStatus::Resuming | EnvStatus::Suspending => Settle::Resuspend,
        EnvStatus::Releasing => Settle::Release,
        EnvStatus::Active => {
            if mode == Mode::Resume && reached < Reached::Stages {
                // The job never touched it: it is still what was suspended.
                Settle::Resuspend
            } else if suspend_enabled
                && !terminated
                && ((reached >= Reached::Ready && suspends)
                    || (machine_lost && (suspends || mode == Mode::Resume)))
            {
                Settle::Suspend
            } else {
                Settle::Release
            }
        }
    }
}

/// What a claim whose holder is gone is settled to.
pub fn on_stale(status: EnvStatus, holder: &Holder, suspend_enabled: bool) -> Settle {
    match status {
        EnvStatus::Suspended => Settle::Nothing,
        EnvStatus::Creating | EnvStatus::Releasing => Settle::Release,
        EnvStatus::Resuming | EnvStatus::Suspending => Settle::Resuspend,
        EnvStatus::Active => match holder {
            Holder::Job {
                mode: Mode::Resume, ..
            } => Settle::Resuspend,
            // A new job's environment: as its triggers say for a system failure.
            Holder::Job {
                mode: Mode::New,
                suspend_on_failure,
                ..
            } => {
                if *suspend_on_failure && suspend_enabled {
                    Settle::Suspend
                } else {
                    Settle::Release
                }
            }
            Holder::Shell { .. } | Holder::Operator { .. } => Settle::Resuspend,
        },
    }
}

// The hot window's two transitions (a child module: the same rules).
#[path = "transitions_hot.rs"]
mod hot;

#[cfg(test)]
#[path = "transitions_tests.rs"]
mod tests;
