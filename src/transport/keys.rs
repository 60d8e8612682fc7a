//! The environment's own SSH key pair: ed25519, made with `ssh-keygen`, private
//! key 0600 in the environment's state dir. Its public key is what the EC2
//! provider puts in user-data; this is the one place that builds it.

use std::os::unix::fs::PermissionsExt;
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::model::EnvPaths;

/// Makes the key pair if it does not exist yet; returns the public key line.
pub fn ensure_keypair(paths: &EnvPaths) -> Result<String> {
    let private = &paths.ssh_key;
    let public = private.with_extension("pub");
    if !private.exists() || !public.exists() {
        let _ = std::fs::remove_file(private);
        let _ = std::fs::remove_file(&public);
        let out = Command::new("ssh-keygen")
            .args(["-q", "-t", "ed25519", "-N", "", "-C"])
            .arg(format!("dormant-{}", paths.id))
            .arg("-f")
            .arg(private)
            .output()
            .context("running ssh-keygen to make the environment's key (install openssh-client)")?;
        if !out.status.success() {
            bail!(
                "ssh-keygen failed making {}: {}",
                private.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        // ssh-keygen does not fsync: a power loss could leave a suspended
        // machine whose only way in is gone. Once, when the pair is made.
        let sync = || -> std::io::Result<()> {
            for f in [private, &public] {
                std::fs::File::open(f)?.sync_all()?;
            }
            let dir = private.parent().unwrap_or(std::path::Path::new("."));
            crate::state::store::sync_dir(dir)
        };
        sync().with_context(|| format!("syncing the key pair {}", private.display()))?;
    }
    // The public half too: every file in the state dir is dormant's user's alone.
    for f in [private, &public] {
        std::fs::set_permissions(f, std::fs::Permissions::from_mode(0o600))
            .with_context(|| format!("setting 0600 on {}", f.display()))?;
    }
    let key = std::fs::read_to_string(&public)
        .with_context(|| format!("reading {}", public.display()))?;
    Ok(key.trim().to_string())
}
