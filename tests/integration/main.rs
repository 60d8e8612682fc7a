//! The one integration test binary. Every test drives the *built* dormant
//! binary the way GitLab Runner does (see `harness.rs`), against the `local`
//! provider, a private sshd on loopback, an EC2 emulator on loopback, or real
//! QEMU virtual machines forwarding SSH to loopback.

mod core;
#[cfg(feature = "ec2")]
mod ec2;
#[cfg(feature = "ec2")]
mod ec2_job;
mod harness;
#[cfg(feature = "ec2")]
mod moto;
mod qemu;
mod ssh;
mod sshd;

/// The EC2 scenarios need the `ec2` feature; without it, say so instead of
/// passing with those tests silently missing.
#[cfg(not(feature = "ec2"))]
#[test]
fn ec2_tests_need_the_ec2_feature() {
    panic!("built without the `ec2` cargo feature: the EC2 provider's tests did not run; use --all-features");
}
