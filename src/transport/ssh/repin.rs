//! Pinning the host key of a new machine of an existing environment (volume
//! mode, where a resume launches a new machine): the key pinned for the
//! machine it replaces is set aside before the first connection (which then
//! pins the new machine's key as a new environment's first connection does),
//! kept until the change is recorded, then forgotten. Only the lifecycle
//! calls this, and only for a machine dormant launched in this very prepare
//! (see docs/ssh.md, "Host keys across machines"); every other connection
//! refuses a changed key. A warm machine's key was pinned when it booted
//! (before any job): taking one writes that pin and marks it
//! ([`pinned_at_launch`]), and the first connection checks the machine
//! against it instead of pinning anew.

use std::path::PathBuf;

use anyhow::{Context, Result};

use super::hostkey::fingerprints;
use crate::model::EnvPaths;

/// Where the replaced machine's pin waits while the new one is pinned.
pub fn replaced(paths: &EnvPaths) -> PathBuf {
    paths.known_hosts.with_extension("replaced")
}

/// Marks the current pin as the new machine's own, taken when it booted
/// (a warm machine): [`set_aside`] keeps it.
pub fn pinned_at_launch(paths: &EnvPaths) -> Result<()> {
    crate::state::store::write_private(&launch_pin(paths), b"")
        .with_context(|| format!("writing {}", launch_pin(paths).display()))
}

fn launch_pin(paths: &EnvPaths) -> PathBuf {
    paths.known_hosts.with_extension("launch-pin")
}

/// Sets the current pin aside (once: a retried prepare keeps the first one
/// set aside, and drops whatever an earlier attempt pinned since) — unless
/// it is the new machine's own pin from its launch ([`pinned_at_launch`]).
pub fn set_aside(paths: &EnvPaths) -> Result<()> {
    if launch_pin(paths).exists() {
        return Ok(());
    }
    let old = replaced(paths);
    if old.exists() {
        return match std::fs::remove_file(&paths.known_hosts) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e).with_context(|| format!("removing {}", paths.known_hosts.display())),
        };
    }
    match std::fs::rename(&paths.known_hosts, &old) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).with_context(|| {
            format!(
                "setting {} aside for a new machine's host key",
                paths.known_hosts.display()
            )
        }),
    }
}

/// The fingerprints pinned before and now.
pub fn finish(paths: &EnvPaths) -> (Vec<String>, Vec<String>) {
    let old = replaced(paths);
    let before = if old.exists() {
        fingerprints(&old)
    } else {
        Vec::new()
    };
    (before, fingerprints(&paths.known_hosts))
}

/// Forgets the replaced machine's pin once the change is recorded.
pub fn forget_old(paths: &EnvPaths) -> Result<()> {
    crate::state::store::remove_file(&launch_pin(paths))?;
    match std::fs::remove_file(replaced(paths)) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).with_context(|| format!("removing {}", replaced(paths).display())),
    }
}
