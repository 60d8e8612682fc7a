//! dormant's settings: one TOML file, strict parsing, every problem at once.
//!
//! Where the file is: `--config PATH`, else `DORMANT_CONFIG`, else
//! `/etc/dormant/config.toml`; with no file at all the defaults run the `local`
//! provider. Unknown keys and bad values are errors naming the key
//! (`ec2.instance_type: ...`). `examples/dormant.toml` documents every setting
//! and a test parses it. Sections of a provider live in their own file.

pub mod duration;
pub mod ec2;
pub mod qemu;
pub mod ssh;

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::Deserialize;

pub use duration::HumanDuration;

use crate::job::Job;

/// Where the settings file is when neither `--config` nor `DORMANT_CONFIG` says.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/dormant/config.toml";
/// GitLab Runner keeps its system id next to its config.toml.
pub const DEFAULT_RUNNER_SYSTEM_ID_FILE: &str = "/etc/gitlab-runner/.runner_system_id";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum ProviderKind {
    /// Embedded default: a directory under the state dir, scripts in a local bash.
    #[default]
    Local,
    /// Workspaces on a configured list of SSH hosts.
    Ssh,
    /// One EC2 instance per environment.
    Ec2,
    /// One QEMU virtual machine per environment, on the runner host.
    Qemu,
}

impl ProviderKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ProviderKind::Local => "local",
            ProviderKind::Ssh => "ssh",
            ProviderKind::Ec2 => "ec2",
            ProviderKind::Qemu => "qemu",
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct Settings {
    /// Which provider makes environments: "local", "ssh", "ec2" or "qemu".
    pub provider: ProviderKind,
    /// Where state lives. `DORMANT_STATE_DIR` overrides it.
    pub state_dir: Option<PathBuf>,
    /// The runner id in environment keys; else `CI_RUNNER_ID` from the job payload.
    pub runner_id: Option<String>,
    /// The runner manager's system id; else read from `runner_system_id_file`.
    pub system_id: Option<String>,
    pub runner_system_id_file: PathBuf,
    /// Upper bound for a whole prepare: create or start, capacity, readiness.
    pub prepare_timeout: HumanDuration,
    pub suspend: SuspendSettings,
    pub local: LocalSettings,
    pub ssh: ssh::SshSettings,
    pub ec2: ec2::Ec2Settings,
    pub qemu: qemu::QemuSettings,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            provider: ProviderKind::Local,
            state_dir: None,
            runner_id: None,
            system_id: None,
            runner_system_id_file: PathBuf::from(DEFAULT_RUNNER_SYSTEM_ID_FILE),
            prepare_timeout: HumanDuration::from_secs(15 * 60),
            suspend: SuspendSettings::default(),
            local: LocalSettings::default(),
            ssh: ssh::SshSettings::default(),
            ec2: ec2::Ec2Settings::default(),
            qemu: qemu::QemuSettings::default(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct SuspendSettings {
    /// Whether jobs may suspend at all. Off: every environment is released.
    pub enabled: bool,
    /// Suspended environments older than this are deleted.
    pub ttl: HumanDuration,
    /// How long the TTL sweep at the end of every cleanup may take.
    pub cleanup_sweep_budget: HumanDuration,
}

impl Default for SuspendSettings {
    fn default() -> Self {
        SuspendSettings {
            enabled: true,
            ttl: HumanDuration::from_secs(7 * 24 * 3600),
            cleanup_sweep_budget: HumanDuration::from_secs(10),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct LocalSettings {
    /// The shell that runs stage scripts.
    pub shell: PathBuf,
}

impl Default for LocalSettings {
    fn default() -> Self {
        LocalSettings {
            shell: PathBuf::from("bash"),
        }
    }
}

impl Settings {
    /// Finds and parses the settings file. Returns the settings and the file they came from.
    pub fn load(cli_path: Option<&Path>, job: &Job) -> Result<(Settings, Option<PathBuf>)> {
        let explicit = cli_path.map(Path::to_path_buf).or_else(|| {
            job.driver_var("DORMANT_CONFIG")
                .filter(|s| !s.is_empty())
                .map(PathBuf::from)
        });
        let path = match explicit {
            Some(p) => {
                if !p.exists() {
                    bail!(
                        "settings file {} does not exist (from --config or DORMANT_CONFIG)",
                        p.display()
                    );
                }
                p
            }
            None => {
                let p = PathBuf::from(DEFAULT_CONFIG_PATH);
                if !p.exists() {
                    return Ok((Settings::default(), None));
                }
                p
            }
        };
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading settings file {}", path.display()))?;
        let settings = Settings::parse_str(&text)
            .with_context(|| format!("settings file {}", path.display()))?;
        Ok((settings, Some(path)))
    }

    /// Parses settings text, reporting every unknown key and bad value at once.
    pub fn parse_str(text: &str) -> Result<Settings> {
        let mut unknown = Vec::new();
        let de = toml::Deserializer::parse(text)
            .map_err(|e| anyhow::anyhow!("{}", e.to_string().trim_end()))?;
        // serde_ignored collects every unknown key; serde_path_to_error names
        // the key of a value of the wrong type (`suspend.ttl: ...`).
        let mut record = |path: serde_ignored::Path<'_>| unknown.push(path.to_string());
        let parsed: Result<Settings, _> =
            serde_path_to_error::deserialize(serde_ignored::Deserializer::new(de, &mut record));
        let mut problems: Vec<String> = unknown
            .into_iter()
            .map(|k| format!("{k}: unknown setting (see examples/dormant.toml for every setting)"))
            .collect();
        let settings = match parsed {
            Ok(s) => s,
            Err(e) => {
                let path = e.path().to_string();
                problems.push(format!("{path}: {}", e.into_inner().message().trim_end()));
                bail!(
                    "{} problem(s):\n  {}",
                    problems.len(),
                    problems.join("\n  ")
                );
            }
        };
        settings.validate(&mut problems);
        if !problems.is_empty() {
            bail!(
                "{} problem(s):\n  {}",
                problems.len(),
                problems.join("\n  ")
            );
        }
        Ok(settings)
    }

    fn validate(&self, problems: &mut Vec<String>) {
        for (key, value) in [
            ("runner_id", &self.runner_id),
            ("system_id", &self.system_id),
        ] {
            if let Some(v) = value {
                if v.trim().is_empty() {
                    problems.push(format!(
                        "{key}: must not be empty (leave it out to use the default)"
                    ));
                }
            }
        }
        if let Some(r) = &self.runner_id {
            if r.contains('/') {
                problems.push(format!("runner_id: {r:?} must not contain '/'"));
            }
        }
        if let Some(d) = &self.state_dir {
            if !d.is_absolute() {
                problems.push(format!(
                    "state_dir: {} must be an absolute path",
                    d.display()
                ));
            }
        }
        if self.prepare_timeout.is_zero() {
            problems.push("prepare_timeout: must be more than 0s".into());
        }
        if self.suspend.ttl.is_zero() {
            problems.push("suspend.ttl: must be more than 0s".into());
        }
        self.ssh
            .validate(self.provider == ProviderKind::Ssh, problems);
        self.ec2
            .validate(self.provider == ProviderKind::Ec2, problems);
        self.qemu
            .validate(self.provider == ProviderKind::Qemu, problems);
    }

    /// The state dir: `DORMANT_STATE_DIR`, else `state_dir`, else the system default.
    /// Never inside the runner's per-job TMPDIR, which is deleted after cleanup.
    pub fn state_dir(&self, job: &Job) -> Result<PathBuf> {
        let dir = match job
            .driver_var("DORMANT_STATE_DIR")
            .filter(|s| !s.is_empty())
        {
            Some(d) => PathBuf::from(d),
            None => match &self.state_dir {
                Some(d) => d.clone(),
                None => default_state_dir()?,
            },
        };
        if !dir.is_absolute() {
            bail!(
                "state dir {} (DORMANT_STATE_DIR) must be an absolute path",
                dir.display()
            );
        }
        if let Some(tmp) = job.runner_tmpdir() {
            if dir.starts_with(&tmp) {
                bail!(
                    "state dir {} is inside the runner's per-job temp dir {} which is deleted after \
                     every job: set state_dir to a durable place such as /var/lib/dormant",
                    dir.display(),
                    tmp.display()
                );
            }
        }
        Ok(dir)
    }
}

fn default_state_dir() -> Result<PathBuf> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } == 0 {
        return Ok(PathBuf::from("/var/lib/dormant"));
    }
    let dirs = directories::ProjectDirs::from("", "", "dormant")
        .context("no home directory to put the state dir in: set state_dir or DORMANT_STATE_DIR")?;
    Ok(dirs
        .state_dir()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| dirs.data_local_dir().to_path_buf()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_file_gives_defaults() {
        let s = Settings::parse_str("").unwrap();
        assert_eq!(s.provider, ProviderKind::Local);
        assert_eq!(s.suspend.ttl.as_secs(), 7 * 24 * 3600);
        assert!(s.suspend.enabled);
    }

    #[test]
    fn the_shipped_example_parses_and_names_every_top_level_setting() {
        let text = include_str!("../../examples/dormant.toml");
        let parsed = Settings::parse_str(text).unwrap_or_else(|e| panic!("{e:#}"));
        assert_eq!(parsed.provider, ProviderKind::Local);
        for key in [
            "provider",
            "state_dir",
            "runner_id",
            "system_id",
            "runner_system_id_file",
            "prepare_timeout",
            "[suspend]",
            "enabled",
            "ttl",
            "cleanup_sweep_budget",
            "[local]",
            "shell",
            "[ssh]",
            "[ec2]",
            "[qemu]",
        ] {
            assert!(
                text.contains(key),
                "examples/dormant.toml does not document {key}"
            );
        }
    }

    #[test]
    fn every_problem_is_reported_at_once_naming_the_key() {
        let err = Settings::parse_str(
            "colour = 1\nprepare_timeout = \"0s\"\n[suspend]\nttl = \"0s\"\nbogus = true\n",
        )
        .unwrap_err();
        let text = format!("{err:#}");
        for needle in [
            "colour: unknown setting",
            "suspend.bogus: unknown setting",
            "prepare_timeout: must be",
            "suspend.ttl: must be",
        ] {
            assert!(text.contains(needle), "missing {needle:?} in {text}");
        }
    }

    #[test]
    fn bad_values_name_the_key() {
        let err = Settings::parse_str("provider = \"gcp\"\n").unwrap_err();
        assert!(format!("{err:#}").contains("provider"), "{err:#}");
        let err = Settings::parse_str("colour = 1\n[suspend]\nttl = \"seven days\"\n").unwrap_err();
        let text = format!("{err:#}");
        assert!(
            text.contains("suspend.ttl: \"seven days\" is not a duration"),
            "{text}"
        );
        assert!(
            text.contains("colour: unknown setting"),
            "unknown keys before a bad value are reported too: {text}"
        );
        let err = Settings::parse_str("runner_id = \"a/b\"\n").unwrap_err();
        assert!(format!("{err:#}").contains("runner_id"), "{err:#}");
    }

    #[test]
    fn state_dir_env_overrides_and_runner_tmpdir_is_refused() {
        let s = Settings::parse_str("state_dir = \"/srv/dormant\"\n").unwrap();
        assert_eq!(
            s.state_dir(&Job::default()).unwrap(),
            PathBuf::from("/srv/dormant")
        );
        let job = Job::from_map([("DORMANT_STATE_DIR", "/x/state")]);
        assert_eq!(s.state_dir(&job).unwrap(), PathBuf::from("/x/state"));
        let job = Job::from_map([
            ("DORMANT_STATE_DIR", "/tmp/custom-executor1/s"),
            ("TMPDIR", "/tmp/custom-executor1"),
        ]);
        assert!(format!("{:#}", s.state_dir(&job).unwrap_err()).contains("deleted after"));
    }
}
