//! `[ec2]`: the EC2 provider's settings.
//! (Owned by the EC2 provider work; the core only calls `validate`.)

use anyhow::Result;
use serde::Deserialize;

use crate::provider::Dirs;
use crate::state::EnvPaths;

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct Ec2Settings {
    /// AWS region; else the standard AWS chain.
    pub region: Option<String>,
}

impl Ec2Settings {
    /// `selected`: the `ec2` provider is the one in use, so its required settings must be there.
    pub fn validate(&self, _selected: bool, _problems: &mut Vec<String>) {}

    /// builds_dir / cache_dir for config (no I/O).
    pub fn dirs(&self, _paths: &EnvPaths) -> Result<Dirs> {
        anyhow::bail!("provider = \"ec2\" is not built yet")
    }
}
