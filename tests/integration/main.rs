//! The one integration test binary. Every test drives the *built* dormant
//! binary the way GitLab Runner does (see `harness.rs`), against the `local`
//! provider, a private sshd on loopback, an EC2 emulator on loopback, or real
//! QEMU virtual machines forwarding SSH to loopback.

mod attach;
mod core;
#[cfg(feature = "testing")]
mod crash;
#[cfg(all(feature = "testing", feature = "ec2"))]
mod crash_ec2_adopt;
#[cfg(all(feature = "testing", feature = "ec2"))]
mod crash_ec2_volume;
#[cfg(all(feature = "testing", feature = "ec2"))]
mod crash_ec2_warm;
#[cfg(feature = "testing")]
mod crash_volume;
#[cfg(feature = "ec2")]
mod ec2;
#[cfg(feature = "ec2")]
mod ec2_adopt;
#[cfg(feature = "ec2")]
mod ec2_adopt_race;
#[cfg(feature = "ec2")]
mod ec2_adopt_unfinished;
#[cfg(feature = "ec2")]
mod ec2_bench;
#[cfg(feature = "ec2")]
mod ec2_calls;
#[cfg(feature = "ec2")]
mod ec2_handover;
#[cfg(feature = "ec2")]
mod ec2_holds;
#[cfg(all(feature = "testing", feature = "ec2"))]
mod ec2_hot;
mod ec2_hot_claims;
mod ec2_hot_volume;
#[cfg(feature = "ec2")]
mod ec2_job;
#[cfg(feature = "ec2")]
mod ec2_pause;
#[cfg(feature = "ec2")]
mod ec2_placement;
#[cfg(feature = "ec2")]
mod ec2_resume;
#[cfg(feature = "ec2")]
mod ec2_rig;
#[cfg(feature = "ec2")]
mod ec2_shell;
#[cfg(feature = "ec2")]
mod ec2_volume;
#[cfg(feature = "ec2")]
mod ec2_volume_mode;
#[cfg(feature = "ec2")]
mod ec2_volume_spot;
#[cfg(feature = "ec2")]
mod ec2_warm;
#[cfg(feature = "ec2")]
mod ec2_warm_errors;
#[cfg(feature = "ec2")]
mod ec2_warm_faults;
mod edge;
mod events;
mod exact;
mod harness;
mod hygiene;
mod job_request;
mod job_variables;
mod join;
#[cfg(feature = "testing")]
mod lifecycle;
mod metrics;
#[cfg(feature = "ec2")]
mod moto;
#[cfg(feature = "ec2")]
mod moto_refusals;
mod notify;
#[cfg(feature = "testing")]
mod output_copy;
mod pause;
mod pause_bench;
#[cfg(feature = "testing")]
mod pause_crash;
mod pause_host;
mod pause_local;
mod qemu;
mod qemu_attach;
mod qemu_pause;
mod qemu_pins;
mod qemu_reattach;
#[cfg(feature = "testing")]
mod qemu_volume;
#[cfg(feature = "testing")]
mod qemu_warm;
mod reattach;
mod shell;
mod signals;
mod ssh;
mod sshd;
mod state_owner;
mod stress;

/// The EC2 scenarios need the `ec2` feature; without it, say so instead of
/// passing with those tests silently missing.
#[cfg(not(feature = "ec2"))]
#[test]
fn ec2_tests_need_the_ec2_feature() {
    panic!("built without the `ec2` cargo feature: the EC2 provider's tests did not run; use --all-features");
}

/// The crash tests need dormant's failpoints (`testing` feature): say so
/// instead of passing with them silently missing.
#[cfg(not(feature = "testing"))]
#[test]
fn crash_tests_need_the_testing_feature() {
    panic!("built without the `testing` cargo feature: the crash-point tests did not run; use --all-features");
}
