//! The hot window's transitions (docs/pause.md, "The hot window"): a paused
//! environment kept suspended with its machine running (`suspended_hot`),
//! and the intent that ends the window (`begin_cool`). A child of
//! `transitions.rs`, the one place that writes an environment's status.

use super::*;

impl EnvironmentRecord {
    /// The hot window's result: suspended (GitLab's job is over, the key
    /// resumes it) with its machine left running until `until` (Unix
    /// seconds). From `suspending`, like [`Self::suspended`], so a cleanup
    /// killed between the two is put back by a recovery that stops it.
    pub fn suspended_hot(&mut self, holder: &Holder, until: u64) -> Result<(), NotAllowed> {
        self.require(holder, &[EnvStatus::Suspending], "be kept hot")?;
        self.status = EnvStatus::Suspended;
        self.claim = None;
        self.suspended_at = Some(crate::state::now_unix());
        self.last_error = None;
        self.hot_until = Some(until);
        Ok(())
    }

    /// Intent to end a hot window (it passed, or its slot is needed): the
    /// cooler claims the record as `suspending`, then stops the machine
    /// through `begin_suspend` and [`Self::suspended`]. Killed after this,
    /// the claim is stale and its recovery (`on_stale`: `Resuspend`) stops
    /// the machine: never lost, never hot for ever.
    pub fn begin_cool(&mut self, holder: &Holder) -> Result<(), NotAllowed> {
        if self.status != EnvStatus::Suspended || self.claim.is_some() || self.hot_until.is_none() {
            return Err(not_allowed(self, "be cooled (it is not hot)"));
        }
        self.hot_until = None;
        self.set(EnvStatus::Suspending, holder);
        Ok(())
    }
}
