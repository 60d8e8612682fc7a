//! Pausing a job on qemu in `hibernate` mode (issue 31, docs/pause.md), one
//! boot: a script that asks (`dormant-ask`) ends its job's stage
//! successfully, cleanup hibernates the VM with the script waiting in its
//! memory, and a later job that restored it (its clock set forward past the
//! time it was hibernated) answers with `dormant-continue`: the same
//! process, a value only its memory held, the answer byte for byte, nothing
//! before the ask run again, the script's exit code carried; the resuming
//! job has no trigger, so the environment is released and nothing is left.
//! The protocol's other cases are on the ssh provider (`pause.rs`).

use std::time::Duration;

use crate::harness::*;
use crate::qemu::{env_paths, field, one_vm, qemu_pids, qemu_rig_full};

#[test]
fn qemu_hibernate_keeps_a_paused_script_and_a_resumed_job_continues_it() {
    let _one = one_vm();
    let rig = qemu_rig_full("hibernate", "", "");
    // No trigger: the ask alone keeps the environment. The value is only in
    // the script's memory; /tmp/runs counts the runs of what precedes the ask.
    let first = job(98).script(
        "v=$RANDOM$RANDOM; echo \"value-in-memory $v\"; echo \"script-pid $BASHPID\"; \
         echo before-the-ask >> /tmp/runs; echo 'line before'; a=$(dormant-ask 'Deploy to prod?'); \
         echo \"answer=[$a] v=$v pid=$BASHPID runs=$(wc -l < /tmp/runs)\"; exit 7",
    );
    let env = env_paths(&rig, &first);
    let r = rig.run(&first);
    assert_result(&r, JobResult::Success);
    let key = r.key.clone().expect("the ask suspends the environment");
    let log = r.log();
    assert!(
        log.lines()
            .any(|l| l == format!("dormant-ask: paused key={key} question=\"Deploy to prod?\"")),
        "the job log shows the question and the key on one line:\n{log}"
    );
    assert!(!log.contains("answer="), "{log}");
    assert_eq!(rig.status(&key).as_deref(), Some("suspended"));
    assert!(
        r.cleanup_output().contains("hibernated"),
        "{}",
        r.cleanup_output()
    );
    assert!(qemu_pids(&env).is_empty(), "hibernation quits QEMU");
    let value = field(&log, "value-in-memory");
    let pid = field(&log, "script-pid");

    // Long enough that the restored guest's clock jumps forward.
    std::thread::sleep(Duration::from_secs(30));

    let second = job(98)
        .resume(&key)
        .script("dormant-continue \"$(printf 'yes\\n second line')\"");
    let r2 = rig.run(&second);
    let log2 = r2.log();
    assert_result(&r2, JobResult::BuildFailure(Some(7)));
    assert!(log2.contains("restored"), "{log2}");
    assert!(log2.contains("guest clock set from its RTC"), "{log2}");
    assert!(
        log2.contains(&format!(
            "answer=[yes\n second line] v={value} pid={pid} runs=1\n"
        )),
        "the answer byte for byte, the value the process held in memory, the \
         same process, nothing before the ask run again:\n{log2}"
    );
    assert!(!log2.contains("line before"), "nothing twice:\n{log2}");
    // No trigger in the resuming job: released, nothing left running.
    assert!(qemu_pids(&env).is_empty());
    assert!(!env.dir.exists(), "release left {}", env.dir.display());
}
