//! The one integration test binary. Every test drives the *built* dormant
//! binary the way GitLab Runner does (see `harness.rs`), against the `local`
//! provider, a private sshd on loopback, or an EC2 emulator on loopback.

mod core;
mod harness;
mod ssh;
mod sshd;
