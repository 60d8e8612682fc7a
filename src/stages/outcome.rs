//! How the job ended, worked out at cleanup from what the stages recorded and
//! `CI_JOB_STATUS`, and whether that outcome suspends the environment.

use crate::state::{JobState, StageResult};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Success,
    Failed,
    /// The environment broke (a stage ended with a system failure).
    SystemFailure,
    Canceled,
    TimedOut,
}

impl Outcome {
    /// `ci_job_status` is `CI_JOB_STATUS` as cleanup sees it. It stays `running`
    /// when the job failed before its user script; then the recorded stages decide.
    pub fn of(state: &JobState, ci_job_status: Option<&str>) -> Outcome {
        match ci_job_status {
            Some("timedout") => return Outcome::TimedOut,
            Some("canceled") | Some("cancelled") => return Outcome::Canceled,
            _ => {}
        }
        if state.terminated
            || state
                .stages
                .iter()
                .any(|s| s.result == StageResult::Terminated)
        {
            return Outcome::Canceled;
        }
        // after_script's result never changes the job's (the runner ignores it).
        let counted = state.stages.iter().filter(|s| s.name != "after_script");
        let mut failed = false;
        for s in counted {
            match s.result {
                StageResult::System => return Outcome::SystemFailure,
                StageResult::Build { .. } => failed = true,
                _ => {}
            }
        }
        match ci_job_status {
            Some("success") if !failed => Outcome::Success,
            Some("failed") => Outcome::Failed,
            _ if failed => Outcome::Failed,
            _ => {
                let user_steps_ran = state
                    .stages
                    .iter()
                    .any(|s| s.name == "build_script" || s.name.starts_with("step_"));
                if user_steps_ran && state.prepared() {
                    Outcome::Success
                } else {
                    Outcome::Failed
                }
            }
        }
    }

    /// Whether the job's triggers ask to keep the environment for this outcome.
    /// A system failure counts as a failure: a developer debugging a broken job
    /// wants its environment kept. Cancel and timeout always release.
    pub fn suspends(self, on_success: bool, on_failure: bool) -> bool {
        match self {
            Outcome::Success => on_success,
            Outcome::Failed | Outcome::SystemFailure => on_failure,
            Outcome::Canceled | Outcome::TimedOut => false,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Success => "succeeded",
            Outcome::Failed => "failed",
            Outcome::SystemFailure => "failed (system failure)",
            Outcome::Canceled => "was canceled",
            Outcome::TimedOut => "timed out",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{Mode, StageRecord};
    use uuid::Uuid;

    fn state(stages: &[(&str, StageResult)]) -> JobState {
        let mut s = JobState::new("1", 2, 3, Uuid::nil(), Mode::New);
        s.phase = crate::state::Phase::Stages;
        s.stages = stages
            .iter()
            .map(|(n, r)| StageRecord {
                name: n.to_string(),
                result: r.clone(),
            })
            .collect();
        s
    }

    #[test]
    fn recorded_stages_decide_when_status_is_running() {
        let ok = state(&[
            ("get_sources", StageResult::Ok),
            ("build_script", StageResult::Ok),
        ]);
        assert_eq!(Outcome::of(&ok, Some("running")), Outcome::Success);
        let failed = state(&[("build_script", StageResult::Build { code: 7 })]);
        assert_eq!(Outcome::of(&failed, Some("running")), Outcome::Failed);
        let early = state(&[("get_sources", StageResult::Build { code: 1 })]);
        assert_eq!(Outcome::of(&early, None), Outcome::Failed);
        let never_ran = state(&[("prepare_script", StageResult::Ok)]);
        assert_eq!(Outcome::of(&never_ran, Some("running")), Outcome::Failed);
    }

    #[test]
    fn cancel_and_timeout_win_and_never_suspend() {
        let ok = state(&[("build_script", StageResult::Ok)]);
        assert_eq!(Outcome::of(&ok, Some("canceled")), Outcome::Canceled);
        assert_eq!(Outcome::of(&ok, Some("timedout")), Outcome::TimedOut);
        let mut t = ok.clone();
        t.terminated = true;
        assert_eq!(Outcome::of(&t, Some("success")), Outcome::Canceled);
        assert!(!Outcome::Canceled.suspends(true, true));
        assert!(!Outcome::TimedOut.suspends(true, true));
    }

    #[test]
    fn after_script_failure_does_not_fail_the_job() {
        let s = state(&[
            ("build_script", StageResult::Ok),
            ("after_script", StageResult::Build { code: 3 }),
        ]);
        assert_eq!(Outcome::of(&s, Some("success")), Outcome::Success);
    }

    #[test]
    fn triggers_match_outcomes() {
        assert!(Outcome::Success.suspends(true, false));
        assert!(!Outcome::Success.suspends(false, true));
        assert!(Outcome::Failed.suspends(false, true));
        assert!(!Outcome::Failed.suspends(true, false));
        assert!(Outcome::SystemFailure.suspends(false, true));
    }
}
