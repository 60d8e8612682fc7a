//! `[ssh]`: the SSH transport's knobs (used by every provider that reaches its
//! machines over SSH: `ssh` and `ec2`) and the `ssh` provider's hosts.
//! Every setting and its default is documented in `examples/dormant.toml`.

use std::path::PathBuf;

use anyhow::Result;
use serde::Deserialize;

use super::HumanDuration;
use crate::model::Dirs;
use crate::model::EnvPaths;
use crate::text::quoted;

#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct SshSettings {
    /// Upper bound of one TCP connect or SSH handshake attempt (`ConnectTimeout`).
    pub connect_timeout: HumanDuration,
    /// Upper bound of the readiness wait in prepare (TCP, then an authenticated
    /// session), within `prepare_timeout`.
    pub ready_timeout: HumanDuration,
    /// An idle ControlMaster exits by itself after this long (`ControlPersist`),
    /// so a master that cleanup never closed does not live forever.
    pub control_persist: HumanDuration,
    /// Keepalive probes on the master (`ServerAliveInterval`, 3 missed = dead).
    pub server_alive_interval: HumanDuration,
    /// How long `dormant run` tries to reconnect and re-attach to a stage
    /// whose connection was lost (the script keeps running on the machine
    /// meanwhile); 0 turns re-attaching off: a lost connection fails the
    /// stage at once and its script is stopped.
    pub reconnect_timeout: HumanDuration,
    /// The bound of a stage's output kept on the machine for a re-attach, in
    /// MiB not yet taken by dormant: past it the script waits (back-pressure).
    pub kept_output_mib: u32,
    /// `ssh` provider: the directory on every host under which each environment
    /// gets its workspace `<workspace_root>/<environment id>`.
    pub workspace_root: String,
    /// `ssh` provider: how long prepare waits for a free slot when every host is busy.
    pub slot_wait: HumanDuration,
    /// Hosts the `ssh` provider may put workspaces on.
    pub hosts: Vec<SshHost>,
}

impl Default for SshSettings {
    fn default() -> Self {
        SshSettings {
            connect_timeout: HumanDuration::from_secs(10),
            ready_timeout: HumanDuration::from_secs(5 * 60),
            control_persist: HumanDuration::from_secs(10 * 60),
            server_alive_interval: HumanDuration::from_secs(15),
            reconnect_timeout: HumanDuration::from_secs(2 * 60),
            kept_output_mib: 16,
            workspace_root: "/var/lib/dormant-workspaces".into(),
            slot_wait: HumanDuration::from_secs(10 * 60),
            hosts: Vec::new(),
        }
    }
}

/// One `[[ssh.hosts]]` entry.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct SshHost {
    /// The host's name in environment keys and logs (`host=<name>`); default: `address`.
    pub name: Option<String>,
    pub address: String,
    pub port: u16,
    pub user: String,
    /// The private key dormant logs in with (the host's `authorized_keys` has its public key).
    pub identity_file: PathBuf,
    /// How many environments may be active on this host at once.
    pub slots: u32,
}

impl Default for SshHost {
    fn default() -> Self {
        SshHost {
            name: None,
            address: String::new(),
            port: 22,
            user: String::new(),
            identity_file: PathBuf::new(),
            slots: 1,
        }
    }
}

impl SshHost {
    pub fn name(&self) -> &str {
        self.name.as_deref().unwrap_or(&self.address)
    }
}

/// The range of `ssh.kept_output_mib`: at least what a connection can have
/// in flight (the SSH channel window and the sockets' buffers, a few MiB),
/// which must still be on the machine when dormant re-attaches; at most 1 GiB,
/// as it may live in the machine's memory (a tmpfs).
pub const KEPT_OUTPUT_MIB: std::ops::RangeInclusive<u32> = 4..=1024;

impl SshSettings {
    /// `kept_output_mib` in bytes.
    pub fn kept_output_bytes(&self) -> u64 {
        u64::from(self.kept_output_mib) << 20
    }

    /// `selected`: the `ssh` provider is the one in use, so its required settings must be there.
    pub fn validate(&self, selected: bool, problems: &mut Vec<String>) {
        // Durations are checked with every other section's (`super::bounds`).
        if !KEPT_OUTPUT_MIB.contains(&self.kept_output_mib) {
            problems.push(format!(
                "ssh.kept_output_mib: {} is out of range: {} to {} (MiB of a stage's output kept on the machine)",
                self.kept_output_mib,
                KEPT_OUTPUT_MIB.start(),
                KEPT_OUTPUT_MIB.end()
            ));
        }
        if !self.workspace_root.starts_with('/')
            || self.workspace_root.trim_end_matches('/').is_empty()
        {
            problems.push(format!(
                "ssh.workspace_root: {} must be an absolute path other than /",
                quoted(&self.workspace_root)
            ));
        } else if self
            .workspace_root
            .split('/')
            .any(|c| c == ".." || c == ".")
        {
            problems.push(format!(
                "ssh.workspace_root: {} must not contain . or .. components",
                quoted(&self.workspace_root)
            ));
        }
        if !selected {
            return;
        }
        if self.hosts.is_empty() {
            problems
                .push("ssh.hosts: the ssh provider needs at least one [[ssh.hosts]] entry".into());
        }
        let mut names = std::collections::BTreeSet::new();
        for (i, h) in self.hosts.iter().enumerate() {
            let key = format!("ssh.hosts[{i}]");
            if h.address.trim().is_empty() {
                problems.push(format!("{key}.address: is required"));
            }
            if h.user.trim().is_empty() {
                problems.push(format!(
                    "{key}.user: is required (the account to log in as)"
                ));
            }
            if h.port == 0 {
                problems.push(format!("{key}.port: must be 1-65535"));
            }
            if h.slots == 0 {
                problems.push(format!("{key}.slots: must be at least 1"));
            }
            if !h.identity_file.is_absolute() {
                problems.push(format!(
                    "{key}.identity_file: {} must be an absolute path to a private key",
                    quoted(&h.identity_file.display().to_string())
                ));
            }
            let name = h.name();
            if name.is_empty()
                || !name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.:".contains(c))
            {
                problems.push(format!(
                    "{key}.name: {} may only use letters, digits and - _ . :",
                    quoted(name)
                ));
            }
            if !names.insert(name.to_string()) {
                problems.push(format!(
                    "{key}.name: {} is used twice (names must be unique)",
                    quoted(name)
                ));
            }
        }
    }

    /// The workspace of an environment on whichever host holds it.
    pub fn workspace(&self, paths: &EnvPaths) -> String {
        format!("{}/{}", self.workspace_root.trim_end_matches('/'), paths.id)
    }

    /// builds_dir / cache_dir for config (no I/O): inside the workspace, the
    /// same on every host, so a resumed job gets the same `CI_PROJECT_DIR`.
    pub fn dirs(&self, paths: &EnvPaths) -> Result<Dirs> {
        let ws = self.workspace(paths);
        Ok(Dirs {
            builds: format!("{ws}/builds"),
            cache: format!("{ws}/cache"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::Settings;
    use super::*;

    #[test]
    fn a_full_ssh_section_parses() {
        let s = Settings::parse_str(
            "provider = \"ssh\"\n[ssh]\nworkspace_root = \"/srv/ws\"\ncontrol_persist = \"2m\"\n\
             [[ssh.hosts]]\nname = \"b1\"\naddress = \"10.0.0.5\"\nuser = \"ci\"\n\
             identity_file = \"/etc/dormant/id\"\nslots = 3\n",
        )
        .unwrap_or_else(|e| panic!("{e:#}"));
        assert_eq!(s.ssh.hosts[0].port, 22);
        assert_eq!(s.ssh.hosts[0].slots, 3);
        assert_eq!(s.ssh.control_persist.as_secs(), 120);
        let paths = EnvPaths::new(std::path::Path::new("/state"), uuid::Uuid::nil());
        let d = s.ssh.dirs(&paths).unwrap();
        assert_eq!(
            d.builds,
            "/srv/ws/00000000-0000-0000-0000-000000000000/builds"
        );
    }

    #[test]
    fn every_host_problem_names_its_key() {
        let err = Settings::parse_str(
            "provider = \"ssh\"\n[ssh]\nworkspace_root = \"rel\"\nready_timeout = \"0s\"\n\
             [[ssh.hosts]]\naddress = \"a\"\nidentity_file = \"id\"\nslots = 0\nport = 0\ncolour = 1\n\
             [[ssh.hosts]]\naddress = \"a\"\nuser = \"u\"\nidentity_file = \"/id\"\n",
        )
        .unwrap_err();
        let text = format!("{err:#}");
        for needle in [
            "ssh.workspace_root:",
            "ssh.ready_timeout:",
            "ssh.hosts[0].user: is required",
            "ssh.hosts[0].slots:",
            "ssh.hosts[0].port:",
            "ssh.hosts[0].identity_file:",
            "ssh.hosts[1].name: \"a\" is used twice",
            "colour: unknown setting",
        ] {
            assert!(text.contains(needle), "missing {needle:?} in {text}");
        }
    }

    #[test]
    fn the_shipped_example_documents_every_ssh_setting_with_its_default() {
        let text = include_str!("../../examples/dormant.toml");
        let d = SshSettings::default();
        for (key, default) in [
            ("connect_timeout", d.connect_timeout.to_string()),
            ("ready_timeout", d.ready_timeout.to_string()),
            ("control_persist", d.control_persist.to_string()),
            ("server_alive_interval", d.server_alive_interval.to_string()),
            ("reconnect_timeout", d.reconnect_timeout.to_string()),
            ("workspace_root", d.workspace_root.clone()),
            ("slot_wait", d.slot_wait.to_string()),
        ] {
            let line = format!("{key} = \"{default}\"");
            assert!(text.contains(&line), "examples/dormant.toml lacks `{line}`");
        }
        assert!(
            text.contains(&format!("kept_output_mib = {}", d.kept_output_mib)),
            "examples/dormant.toml lacks kept_output_mib"
        );
        for key in [
            "[[ssh.hosts]]",
            "name =",
            "address =",
            "port = 22",
            "user =",
            "identity_file =",
            "slots = 1",
        ] {
            assert!(text.contains(key), "examples/dormant.toml lacks {key}");
        }
    }

    #[test]
    fn reconnect_timeout_and_kept_output_are_bounded() {
        let s = Settings::parse_str("[ssh]\nreconnect_timeout = \"0s\"\nkept_output_mib = 4\n")
            .unwrap();
        assert!(s.ssh.reconnect_timeout.is_zero());
        let s = Settings::parse_str("[ssh]\nreconnect_timeout = \"1h\"\nkept_output_mib = 1024\n")
            .unwrap();
        assert_eq!(s.ssh.kept_output_bytes(), 1 << 30);
        let err = Settings::parse_str("[ssh]\nreconnect_timeout = \"61m\"\nkept_output_mib = 3\n")
            .unwrap_err();
        let text = format!("{err:#}");
        assert!(
            text.contains("ssh.reconnect_timeout: must be at most"),
            "{text}"
        );
        assert!(
            text.contains("ssh.kept_output_mib: 3 is out of range: 4 to 1024"),
            "{text}"
        );
        let err = Settings::parse_str("[ssh]\nkept_output_mib = 2000\n").unwrap_err();
        assert!(
            format!("{err:#}").contains("ssh.kept_output_mib: 2000"),
            "{err:#}"
        );
        let err = Settings::parse_str("[ssh]\nreconnect_timeout = \"soon\"\n").unwrap_err();
        assert!(format!("{err:#}").contains("reconnect_timeout"), "{err:#}");
    }

    #[test]
    fn the_ssh_provider_needs_hosts_but_others_do_not() {
        assert!(Settings::parse_str("provider = \"ssh\"\n").is_err());
        assert!(Settings::parse_str("provider = \"local\"\n[ssh]\n").is_ok());
    }
}
