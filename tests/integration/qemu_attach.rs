//! `dormant attach` and `dormant shell` beside a running job on a real qemu
//! VM (one boot): a watcher follows the stage from its first byte while the
//! script runs in the guest, a shell joins the job's machine in its project
//! dir and does what the script waits for, the job's exit code is its own,
//! and the watcher ends when the job does (`join::watched_and_joined`, which
//! the EC2 test shares). The ssh and local providers' byte-for-byte checks
//! are in `attach.rs` and `join.rs`.

use std::time::Duration;

use crate::harness::*;
use crate::join::{beside_script, watched_and_joined};
use crate::qemu::{env_paths, one_vm, qemu_pids, qemu_rig_full};

/// A TCG boot on a loaded machine takes minutes (`boot_timeout` is 400 s).
const STAGE_STARTS_WITHIN: Duration = Duration::from_secs(20 * 60);

#[test]
fn qemu_a_watcher_follows_the_stage_and_a_joined_shell_runs_beside_the_job() {
    let _one = one_vm();
    let rig = qemu_rig_full("shutdown", "", "");
    let sim = job(97).script(&beside_script("started-in-vm"));
    let env = env_paths(&rig, &sim);
    watched_and_joined(&rig, &sim, "started-in-vm", STAGE_STARTS_WITHIN);
    // No trigger: released, nothing left running.
    assert!(qemu_pids(&env).is_empty());
    assert!(!env.dir.exists());
}
