//! `[ssh]`: the SSH transport's knobs and the `ssh` provider's hosts.
//! (Owned by the SSH transport work; the core only calls `validate`.)

use anyhow::Result;
use serde::Deserialize;

use crate::provider::Dirs;
use crate::state::EnvPaths;

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct SshSettings {
    /// Hosts the `ssh` provider may put workspaces on.
    pub hosts: Vec<SshHost>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SshHost {
    pub address: String,
}

impl SshSettings {
    /// `selected`: the `ssh` provider is the one in use, so its required settings must be there.
    pub fn validate(&self, selected: bool, problems: &mut Vec<String>) {
        if selected && self.hosts.is_empty() {
            problems
                .push("ssh.hosts: the ssh provider needs at least one [[ssh.hosts]] entry".into());
        }
    }

    /// builds_dir / cache_dir for config (no I/O).
    pub fn dirs(&self, _paths: &EnvPaths) -> Result<Dirs> {
        anyhow::bail!("provider = \"ssh\" is not built yet")
    }
}
