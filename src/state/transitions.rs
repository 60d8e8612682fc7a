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

impl EnvironmentRecord {
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

    /// A job (or a shell) claims a suspended environment to resume it.
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
    /// put back.
    pub fn suspended(
        &mut self,
        holder: &Holder,
        error: Option<String>,
        fresh: bool,
    ) -> Result<(), NotAllowed> {
        self.require(holder, &[EnvStatus::Suspending], "be marked suspended")?;
        self.status = EnvStatus::Suspended;
        self.claim = None;
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
pub fn at_cleanup(
    status: EnvStatus,
    mode: Mode,
    reached: Reached,
    terminated: bool,
    suspends: bool,
    suspend_enabled: bool,
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
            } else if reached >= Reached::Ready && suspend_enabled && !terminated && suspends {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::record::NewEnvironment;

    fn job(id: u64, mode: Mode) -> Holder {
        Holder::Job {
            runner_id: "1".into(),
            job_id: id,
            mode,
            suspend_on_failure: false,
        }
    }

    fn record() -> EnvironmentRecord {
        EnvironmentRecord::new(
            NewEnvironment {
                id: uuid::Uuid::nil(),
                provider: "local",
                runner_id: "1",
                system_id: "s",
                project_id: 5,
                project_path: None,
                job_id: 1,
            },
            job(1, Mode::New),
        )
    }

    #[test]
    fn a_whole_life_goes_through_the_allowed_transitions() {
        let j1 = job(1, Mode::New);
        let j2 = job(2, Mode::Resume);
        let mut r = record();
        assert_eq!(r.status(), EnvStatus::Creating);
        r.machine_made(&j1, Machine::new("m"), "k".into()).unwrap();
        r.activate(&j1).unwrap();
        assert!(r.claim_for_resume(&j2).is_err(), "held by job 1");
        r.begin_suspend(&j1).unwrap();
        r.suspended(&j1, None, true).unwrap();
        assert_eq!(r.status(), EnvStatus::Suspended);
        assert!(r.claim().is_none());
        r.claim_for_resume(&j2).unwrap();
        assert!(r.activate(&j1).is_err(), "job 1 no longer holds it");
        r.machine_started(&j2, Machine::new("m2")).unwrap();
        r.activate(&j2).unwrap();
        assert_eq!(r.job_count, 2);
        r.begin_release(&j2).unwrap();
        r.may_remove(&j2).unwrap();
    }

    #[test]
    fn only_the_holder_moves_a_held_environment() {
        let mut r = record();
        let other = job(9, Mode::New);
        let err = r.begin_release(&other).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "environment {} is creating (held by job 1): cannot be released",
                uuid::Uuid::nil()
            )
        );
        assert!(r.begin_suspend(&other).is_err());
        assert!(r.touch(&other).is_err());
        let sweep = Holder::Operator {
            pid: 3,
            what: "dormant sweep".into(),
        };
        let old = r.take_over(&sweep, "stale".into()).unwrap();
        assert_eq!(old.job_id(), Some(1));
        r.begin_release(&sweep).unwrap();
        assert_eq!(r.status(), EnvStatus::Releasing);
    }

    #[test]
    fn a_retried_prepare_takes_back_what_its_job_made_and_nothing_else() {
        let mut r = record();
        let j1 = job(1, Mode::New);
        r.begin_release(&j1).unwrap();
        r.release_failed(&j1, "boom".into()).unwrap();
        r.retake_for_retry(&j1).unwrap();
        assert_eq!(r.status(), EnvStatus::Creating);
        assert!(r.retake_for_retry(&job(2, Mode::New)).is_err());
    }

    const PHASES: [Reached; 3] = [Reached::Preparing, Reached::Ready, Reached::Stages];

    #[test]
    fn cleanup_never_releases_a_resume_that_did_not_reach_a_stage() {
        for status in EnvStatus::ALL {
            for reached in PHASES {
                for terminated in [false, true] {
                    for suspends in [false, true] {
                        for enabled in [false, true] {
                            let d = at_cleanup(
                                status,
                                Mode::Resume,
                                reached,
                                terminated,
                                suspends,
                                enabled,
                            );
                            let held_before_stages =
                                reached < Reached::Stages && status != EnvStatus::Suspended;
                            if held_before_stages
                                && !matches!(status, EnvStatus::Creating | EnvStatus::Releasing)
                            {
                                assert_eq!(d, Settle::Resuspend, "{status:?} {reached:?}");
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn cleanup_decisions_over_every_status_phase_and_outcome() {
        for status in EnvStatus::ALL {
            for mode in [Mode::New, Mode::Resume] {
                for reached in PHASES {
                    for terminated in [false, true] {
                        for suspends in [false, true] {
                            for enabled in [false, true] {
                                let d = at_cleanup(
                                    status, mode, reached, terminated, suspends, enabled,
                                );
                                let expected = match status {
                                    EnvStatus::Suspended => Settle::Nothing,
                                    EnvStatus::Creating | EnvStatus::Releasing => Settle::Release,
                                    EnvStatus::Resuming | EnvStatus::Suspending => {
                                        Settle::Resuspend
                                    }
                                    EnvStatus::Active => {
                                        if mode == Mode::Resume && reached != Reached::Stages {
                                            Settle::Resuspend
                                        } else if reached != Reached::Preparing
                                            && enabled
                                            && !terminated
                                            && suspends
                                        {
                                            Settle::Suspend
                                        } else {
                                            Settle::Release
                                        }
                                    }
                                };
                                assert_eq!(
                                    d, expected,
                                    "{status:?} {mode:?} {reached:?} t={terminated} s={suspends} e={enabled}"
                                );
                                // Suspension is only ever by request, never by default.
                                if d == Settle::Suspend {
                                    assert!(suspends && enabled && !terminated);
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn stale_claims_settle_to_what_loses_nothing() {
        let shell = Holder::Shell { pid: 1 };
        for status in EnvStatus::ALL {
            for enabled in [false, true] {
                let resumed = on_stale(status, &job(1, Mode::Resume), enabled);
                let new = on_stale(status, &job(1, Mode::New), enabled);
                let mut keeps = job(1, Mode::New);
                if let Holder::Job {
                    suspend_on_failure, ..
                } = &mut keeps
                {
                    *suspend_on_failure = true;
                }
                let new_keeps = on_stale(status, &keeps, enabled);
                match status {
                    EnvStatus::Suspended => assert_eq!(resumed, Settle::Nothing),
                    EnvStatus::Creating | EnvStatus::Releasing => {
                        assert_eq!((resumed, new), (Settle::Release, Settle::Release))
                    }
                    EnvStatus::Resuming | EnvStatus::Suspending => {
                        assert_eq!((resumed, new), (Settle::Resuspend, Settle::Resuspend))
                    }
                    EnvStatus::Active => {
                        assert_eq!(resumed, Settle::Resuspend, "a resumed one goes back");
                        assert_eq!(on_stale(status, &shell, enabled), Settle::Resuspend);
                        assert_eq!(new, Settle::Release);
                        let want = if enabled {
                            Settle::Suspend
                        } else {
                            Settle::Release
                        };
                        assert_eq!(new_keeps, want, "as its triggers say for a system failure");
                    }
                }
            }
        }
    }
}
