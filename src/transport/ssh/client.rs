//! How every ssh client of an environment is configured: the destination,
//! the key it logs in with, the alias its host key is pinned under, the
//! config file every ssh process reads (`-F`), the command for a connection
//! of its own (beside a job), and the local checks a connect makes before
//! it tries (`preflight`). The master's life (start, re-attach, close) is
//! `master.rs`.

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};

use super::master::Master;
use crate::state::store::ensure_private_dir;
use crate::transport::write_private;

/// `<control dir>/.ssh-connectionXXXXXX/master` plus ssh's own temporary
/// suffix (`.` + 16 chars) must fit in a Unix socket path (108 bytes with NUL).
const MAX_CONTROL_DIR_LEN: usize = 61;

impl Master {
    /// `user@host:port`, for messages.
    pub fn destination(&self) -> String {
        format!(
            "{}@{}:{}",
            self.target.user, self.target.host, self.target.port
        )
    }

    /// The key ssh logs in with: the target's, else the environment's own.
    pub fn identity(&self) -> PathBuf {
        self.target
            .identity_file
            .clone()
            .unwrap_or_else(|| self.paths.ssh_key.clone())
    }

    /// The name the host key is pinned under in the environment's known_hosts.
    pub fn host_alias(&self) -> String {
        format!("dormant-{}", self.paths.id)
    }

    /// A plain `ssh` to the machine on a connection of its own (no master:
    /// a `dormant shell` beside a running job must not share, start or hold
    /// the job's), with the environment's key, config and pinned host key;
    /// the remote command and `-t`/`-T` are the caller's to add.
    pub fn own_connection(&self) -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new("ssh");
        let o = |k: &str, v: String| ["-o".to_string(), format!("{k}={v}")];
        cmd.arg("-F")
            .arg(self.config_file())
            .arg("-i")
            .arg(self.identity())
            .args(o("IdentitiesOnly", "yes".into()))
            .args(o(
                "UserKnownHostsFile",
                self.paths.known_hosts.display().to_string(),
            ))
            .args(o("StrictHostKeyChecking", "yes".into()))
            .args(o("BatchMode", "yes".into()))
            .args(o("ControlMaster", "no".into()))
            .args(o("ControlPath", "none".into()))
            .args(o(
                "ConnectTimeout",
                self.settings.connect_timeout.as_secs().max(1).to_string(),
            ))
            .args(o(
                "ServerAliveInterval",
                self.settings
                    .server_alive_interval
                    .as_secs()
                    .max(1)
                    .to_string(),
            ))
            .arg("-p")
            .arg(self.target.port.to_string())
            .arg("-l")
            .arg(&self.target.user)
            .arg(&self.target.host);
        cmd
    }

    /// The ssh config file every ssh process of this environment reads (`-F`).
    pub fn config_file(&self) -> PathBuf {
        self.paths.dir.join("ssh_config")
    }

    /// Local problems no amount of waiting fixes.
    pub(super) fn preflight(&self) -> Result<()> {
        let control = &self.paths.control_dir;
        if control.as_os_str().len() > MAX_CONTROL_DIR_LEN {
            bail!(
                "the SSH control directory {} is {} bytes long, more than the {MAX_CONTROL_DIR_LEN} a Unix \
                 socket path allows here: use a shorter state_dir",
                control.display(),
                control.as_os_str().len()
            );
        }
        let key = self.identity();
        let meta = std::fs::metadata(&key).with_context(|| {
            format!(
                "the SSH identity file {} for {} cannot be read",
                key.display(),
                self.destination()
            )
        })?;
        if meta.permissions().mode() & 0o077 != 0 {
            bail!(
                "the SSH identity file {} is accessible by other users (mode {:o}): ssh refuses such keys; \
                 run chmod 600 on it",
                key.display(),
                meta.permissions().mode() & 0o777
            );
        }
        if let Some(parent) = control.parent() {
            ensure_private_dir(parent)?;
        }
        ensure_private_dir(control)?;
        write_private(&self.config_file(), self.config_text().as_bytes())
            .with_context(|| format!("writing the ssh config {}", self.config_file().display()))?;
        // ssh appends to known_hosts keeping its mode, but creates it world-readable.
        if !self.paths.known_hosts.exists() {
            write_private(&self.paths.known_hosts, b"")
                .with_context(|| format!("creating {}", self.paths.known_hosts.display()))?;
        }
        Ok(())
    }

    /// Options the crate's builder has no setter for; `-o` options on the
    /// command line still win over these.
    fn config_text(&self) -> String {
        format!(
            "# Written by dormant for environment {id}; rewritten on every connect.\n\
             Host *\n\
             \x20 HostKeyAlias {alias}\n\
             \x20 GlobalKnownHostsFile /dev/null\n\
             \x20 UpdateHostKeys no\n\
             \x20 CheckHostIP no\n\
             \x20 HashKnownHosts no\n\
             \x20 ServerAliveCountMax 3\n\
             \x20 PasswordAuthentication no\n\
             \x20 KbdInteractiveAuthentication no\n\
             \x20 LogLevel ERROR\n",
            id = self.paths.id,
            alias = self.host_alias(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{EnvPaths, SshTarget};
    use crate::settings::ssh::SshSettings;

    #[test]
    fn the_config_pins_by_environment_not_by_address() {
        let dir = tempfile::tempdir().unwrap();
        let paths = EnvPaths::new(dir.path(), uuid::Uuid::nil());
        let m = Master::new(
            SshTarget {
                host: "127.0.0.1".into(),
                port: 22,
                user: "root".into(),
                identity_file: None,
                workdir: None,
                on_login: None,
            },
            paths.clone(),
            SshSettings::default(),
        );
        let text = m.config_text();
        assert!(text.contains("HostKeyAlias dormant-00000000-0000-0000-0000-000000000000"));
        assert!(text.contains("GlobalKnownHostsFile /dev/null"));
        assert_eq!(m.identity(), paths.ssh_key);
    }
}
