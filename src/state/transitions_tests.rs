//! Unit tests of the lifecycle state machine and its rules (`transitions.rs`).
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
            storage: crate::model::StorageMode::Machine,
            image: None,
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
    r.suspended(&j1, None, true, None).unwrap();
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
                            false,
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
                        for (enabled, lost) in
                            [(false, false), (true, false), (false, true), (true, true)]
                        {
                            let d = at_cleanup(
                                status, mode, reached, terminated, suspends, enabled, lost,
                            );
                            let expected = match status {
                                EnvStatus::Suspended => Settle::Nothing,
                                EnvStatus::Creating | EnvStatus::Releasing => Settle::Release,
                                EnvStatus::Resuming | EnvStatus::Suspending => Settle::Resuspend,
                                EnvStatus::Active => {
                                    if mode == Mode::Resume && reached != Reached::Stages {
                                        Settle::Resuspend
                                    } else if lost
                                        && enabled
                                        && !terminated
                                        && (suspends || mode == Mode::Resume)
                                    {
                                        // A lost machine keeps the volume of a resumed
                                        // environment, or as the failure trigger says.
                                        Settle::Suspend
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
                                "{status:?} {mode:?} {reached:?} t={terminated} s={suspends} e={enabled} lost={lost}"
                            );
                            // Suspension is only ever by request (or to keep what a
                            // job resumed), never by default.
                            if d == Settle::Suspend {
                                assert!(enabled && !terminated);
                                assert!(suspends || (lost && mode == Mode::Resume));
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

/// A suspension that lost the machine's memory marks a paused script lost
/// (the first reason stays); one that kept it, or a record with nothing
/// paused, records nothing (docs/pause.md, "A suspension that lost the memory").
#[test]
fn a_suspension_that_lost_the_memory_marks_the_paused_script_lost() {
    let j1 = job(1, Mode::New);
    let j2 = job(2, Mode::Resume);
    let mut r = record();
    r.machine_made(&j1, Machine::new("m"), "k".into()).unwrap();
    r.activate(&j1).unwrap();
    r.begin_suspend(&j1).unwrap();
    r.suspended(&j1, None, true, Some("powered off".into()))
        .unwrap();
    assert_eq!(r.paused, None, "nothing paused: nothing to mark");
    r.claim_for_resume(&j2).unwrap();
    r.machine_started(&j2, Machine::new("m")).unwrap();
    r.activate(&j2).unwrap();
    r.paused = Some(crate::state::Paused {
        question: "q".into(),
        job_id: 2,
        at: 0,
        lost: None,
        ended: None,
    });
    r.begin_suspend(&j2).unwrap();
    r.suspended(&j2, None, true, None).unwrap();
    assert_eq!(r.paused.as_ref().unwrap().lost, None, "memory kept");
    let j3 = job(3, Mode::Resume);
    r.claim_for_resume(&j3).unwrap();
    r.begin_suspend(&j3).unwrap();
    r.suspended(&j3, None, false, Some("hibernation fell back".into()))
        .unwrap();
    let j4 = job(4, Mode::Resume);
    r.claim_for_resume(&j4).unwrap();
    r.begin_suspend(&j4).unwrap();
    r.suspended(&j4, None, false, Some("later".into())).unwrap();
    assert_eq!(
        r.paused.as_ref().unwrap().lost.as_deref(),
        Some("hibernation fell back"),
        "the first reason stays"
    );
    // A script that ended, its code on the record (`ended`), loses nothing.
    r.paused = Some(crate::state::Paused {
        question: "q".into(),
        job_id: 4,
        at: 0,
        lost: None,
        ended: Some(7),
    });
    let j5 = job(5, Mode::Resume);
    r.claim_for_resume(&j5).unwrap();
    r.begin_suspend(&j5).unwrap();
    r.suspended(&j5, None, false, Some("powered off".into()))
        .unwrap();
    assert_eq!(r.paused.as_ref().unwrap().lost, None, "an end is not lost");
    assert_eq!(r.paused.unwrap().ended, Some(7));
}

#[test]
fn a_hot_window_is_taken_by_a_resume_or_ended_by_one_cooling() {
    let j1 = job(1, Mode::New);
    let j2 = job(2, Mode::Resume);
    let sweep = Holder::Operator {
        pid: 7,
        what: "dormant sweep".into(),
    };
    let mut r = record();
    r.machine_made(&j1, Machine::new("m"), "k".into()).unwrap();
    r.activate(&j1).unwrap();
    assert!(r.suspended_hot(&j1, 100).is_err(), "only from suspending");
    r.begin_suspend(&j1).unwrap();
    r.suspended_hot(&j1, 100).unwrap();
    assert_eq!(r.status(), EnvStatus::Suspended);
    assert_eq!(r.hot_until(), Some(100));
    assert!(r.claim().is_none());
    // An old record (no field) loads, not hot.
    let text = serde_json::to_string(&r).unwrap();
    assert!(text.contains("\"hot_until\":100"), "{text}");
    let old: EnvironmentRecord =
        serde_json::from_str(&text.replace(",\"hot_until\":100", "")).unwrap();
    assert_eq!(old.hot_until(), None);

    // A resume takes it as it is: held, it is not cooled; the window is
    // remembered until the resume is done (a failed one goes back hot).
    let mut resumed = r.clone();
    resumed.claim_for_resume(&j2).unwrap();
    assert_eq!(resumed.hot_until(), Some(100));
    assert!(
        resumed.begin_cool(&sweep).is_err(),
        "held: not cooled under its holder"
    );
    let mut back = resumed.clone();
    back.begin_suspend(&j2).unwrap();
    back.suspended_hot(&j2, 100).unwrap();
    assert_eq!(back.hot_until(), Some(100), "a failed resume goes back hot");
    resumed.activate(&j2).unwrap();
    assert_eq!(resumed.hot_until(), None, "the window ends with the resume");

    // A cooling claims it once, then suspends it as usual.
    r.begin_cool(&sweep).unwrap();
    assert_eq!(r.status(), EnvStatus::Suspending);
    assert_eq!(r.hot_until(), None);
    assert!(r.begin_cool(&sweep).is_err(), "cooled once");
    r.begin_suspend(&sweep).unwrap();
    r.suspended(&sweep, None, false, None).unwrap();
    assert_eq!(r.hot_until(), None);
    assert!(r.begin_cool(&sweep).is_err(), "a cold record is not cooled");
}
