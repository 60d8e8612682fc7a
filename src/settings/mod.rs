//! dormant's settings: one TOML file, strict parsing, every problem at once.
//!
//! Where the file is: `--config PATH`, else `DORMANT_CONFIG`, else
//! `/etc/dormant/config.toml`; with no file at all the defaults run the `local`
//! provider. Unknown keys and bad values are errors naming the key
//! (`ec2.instance_type: ...`), every one of the file in one error: those that
//! do not parse (`Settings::parse_str`) as well as those out of range. `examples/dormant.toml` documents every setting
//! and a test parses it. Sections of a provider live in their own file.

pub mod bounds;
pub mod duration;
pub mod ec2;
mod ec2_checks;
pub mod events;
pub mod qemu;
pub mod ssh;

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::Deserialize;

pub use duration::HumanDuration;

use crate::text::{excerpt, excerpt_ends};

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
    /// The event log's rotation (`[events]`).
    pub events: events::EventSettings,
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
            events: events::EventSettings::default(),
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
    /// Runs on every suspend, resume, release and expiry with a JSON document
    /// on stdin (`crate::notify`). Empty: no hook.
    pub notify_command: Vec<String>,
    /// Bound on one run of `notify_command`; then its process group is killed.
    pub notify_timeout: HumanDuration,
    /// Whether a job may ask for its own suspension through `DORMANT_SUSPEND_FILE`.
    pub allow_job_request: bool,
    /// How long an environment whose holder has no process running still
    /// counts as held. The gap between two stages of a job is milliseconds
    /// and a running stage is a live process, so past this the holder is gone:
    /// a resume, `release` or `sweep` recovers the environment.
    pub claim_grace: HumanDuration,
}

impl Default for SuspendSettings {
    fn default() -> Self {
        SuspendSettings {
            enabled: true,
            ttl: HumanDuration::from_secs(7 * 24 * 3600),
            cleanup_sweep_budget: HumanDuration::from_secs(10),
            notify_command: Vec::new(),
            notify_timeout: HumanDuration::from_secs(5),
            allow_job_request: true,
            claim_grace: HumanDuration::from_secs(5 * 60),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct LocalSettings {
    /// The shell that runs stage scripts.
    pub shell: PathBuf,
    /// "machine": the work directory is kept while suspended. "volume": the
    /// builds and cache dirs live in a directory of their own that a new work
    /// directory gets on every resume (volume mode without a cloud or a VM:
    /// for trying it out, and for the crash tests of its lifecycle).
    pub storage: crate::model::StorageMode,
}

impl Default for LocalSettings {
    fn default() -> Self {
        LocalSettings {
            shell: PathBuf::from("bash"),
            storage: crate::model::StorageMode::Machine,
        }
    }
}

/// What the settings read from dormant's own environment (never the job's):
/// `DORMANT_CONFIG`, `DORMANT_STATE_DIR`, the runner's `TMPDIR`. Implemented
/// by `job::Job`, which reads the environment once at the edge; settings do
/// not depend on it.
pub trait DriverEnv {
    fn driver_var(&self, name: &str) -> Option<&str>;
}

impl SuspendSettings {
    fn validate(&self, problems: &mut Vec<String>) {
        if let Some(program) = self.notify_command.first() {
            if !Path::new(program).is_absolute() {
                problems.push(format!(
                    "suspend.notify_command: the program {} must be an absolute path \
                     (the runner's PATH is not the operator's shell's)",
                    crate::text::quoted(program)
                ));
            }
        }
    }
}

impl Settings {
    /// Finds and parses the settings file. Returns the settings and the file they came from.
    pub fn load(
        cli_path: Option<&Path>,
        job: &dyn DriverEnv,
    ) -> Result<(Settings, Option<PathBuf>)> {
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
    ///
    /// serde stops at the first value that does not parse (a duration, an
    /// enum), so the file is parsed as a tree first: each value that fails is
    /// reported, taken out of the tree and the rest parsed again — the default
    /// stands in for it — until all of it parses. Then the unknown keys of
    /// that last pass and the checks of `validate` (minus those about a key
    /// already reported) join the list.
    pub fn parse_str(text: &str) -> Result<Settings> {
        // The parsed document, before any value is read from it: a syntax
        // error ends here (toml quotes the offending line: keep each line of
        // its message short).
        let mut tree = toml::de::DeTable::parse(text).map_err(|e| {
            let msg: Vec<String> = e.to_string().trim_end().lines().map(excerpt).collect();
            anyhow::anyhow!("{}", msg.join("\n"))
        })?;
        let mut bad_values = Vec::new();
        let (parsed, unknown) = loop {
            let mut unknown = Vec::new();
            // serde_ignored collects every unknown key; serde_path_to_error
            // names the key of a value that does not parse (`suspend.ttl`).
            let mut record = |path: serde_ignored::Path<'_>| unknown.push(path.to_string());
            let parsed: Result<Settings, _> =
                serde_path_to_error::deserialize(serde_ignored::Deserializer::new(
                    toml::Deserializer::from(tree.clone()),
                    &mut record,
                ));
            match parsed {
                Ok(settings) => break (Some(settings), unknown),
                Err(e) => {
                    let taken_out = take_out(tree.get_mut(), e.path()).is_some();
                    // serde's message may quote the whole bad value.
                    let key = excerpt(&e.path().to_string());
                    let msg = excerpt_ends(e.into_inner().message().trim_end());
                    bad_values.push((key, msg));
                    // Nothing to take out (no key to name): report what is known.
                    if !taken_out {
                        break (None, unknown);
                    }
                }
            }
        };
        let mut problems: Vec<String> = unknown
            .into_iter()
            .map(|k| {
                format!(
                    "{}: unknown setting (see examples/dormant.toml for every setting)",
                    excerpt(&k)
                )
            })
            .collect();
        problems.extend(bad_values.iter().map(|(key, msg)| format!("{key}: {msg}")));
        if let Some(settings) = &parsed {
            let mut checks = Vec::new();
            settings.validate(&mut checks);
            // A bad value's key holds its default now: a check of that
            // default would report the key twice.
            problems.extend(checks.into_iter().filter(|p| {
                !bad_values.iter().any(|(key, _)| {
                    p.strip_prefix(key.as_str())
                        .is_some_and(|rest| rest.starts_with([':', '.', '[']))
                })
            }));
        }
        match parsed {
            Some(settings) if problems.is_empty() => Ok(settings),
            _ => bail!(
                "{} problem(s):\n  {}",
                problems.len(),
                problems.join("\n  ")
            ),
        }
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
                problems.push(format!(
                    "runner_id: \"{}\" must not contain '/'",
                    excerpt(r)
                ));
            }
        }
        if let Some(d) = &self.state_dir {
            if !d.is_absolute() {
                problems.push(format!(
                    "state_dir: {} must be an absolute path",
                    excerpt(&d.display().to_string())
                ));
            }
        }
        self.check_durations(problems);
        self.suspend.validate(problems);
        self.events.validate(problems);
        self.ssh
            .validate(self.provider == ProviderKind::Ssh, problems);
        self.ec2
            .validate(self.provider == ProviderKind::Ec2, problems);
        if self.provider == ProviderKind::Ec2
            && self.ec2.market == ec2::Market::Spot
            && self.suspend.enabled
            && self.ec2.storage == crate::model::StorageMode::Machine
        {
            // A one-time spot instance cannot be stopped, and EC2 reclaims it
            // when it likes: an environment that *is* the instance would be lost.
            problems.push(
                "ec2.market: \"spot\" cannot hold a suspended environment in machine mode: a spot instance \
                 cannot be stopped, and EC2 may reclaim it at any time, taking the environment's disk with it; \
                 set ec2.storage = \"volume\" (the environment lives on a data volume that outlives its \
                 instances) or suspend.enabled = false (no suspension)"
                    .into(),
            );
        }
        if self.provider == ProviderKind::Ec2
            && self.ec2.warm > 0
            && self.ec2.max_environments > 0
            && self
                .runner_id
                .as_deref()
                .is_none_or(|r| r.trim().is_empty())
        {
            // `dormant warm` runs outside any job: only the settings can say
            // which runner's max_environments its instances count toward.
            problems.push(
                "ec2.warm: with ec2.max_environments, warm instances count toward one runner's limit, and \
                 `dormant warm` runs outside any job: set runner_id (this runner's id)"
                    .into(),
            );
        }
        self.qemu
            .validate(self.provider == ProviderKind::Qemu, problems);
    }

    /// The state dir: `DORMANT_STATE_DIR`, else `state_dir`, else the system default.
    /// Never inside the runner's per-job TMPDIR, which is deleted after cleanup.
    pub fn state_dir(&self, job: &dyn DriverEnv) -> Result<PathBuf> {
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
        if self.provider == ProviderKind::Qemu && dir.as_os_str().len() > qemu::max_state_dir_len()
        {
            bail!(
                "state dir {} is {} bytes long; the qemu provider needs one of at most {} bytes (each VM's \
                 QMP socket, <state dir>/environments/<id>/{}, must fit in a Unix socket path of {} bytes): \
                 set state_dir (or DORMANT_STATE_DIR) to a shorter path such as /var/lib/dormant",
                dir.display(),
                dir.as_os_str().len(),
                qemu::max_state_dir_len(),
                qemu::QMP_SOCKET,
                qemu::MAX_SOCKET_PATH
            );
        }
        let runner_tmp = job
            .driver_var("TMPDIR")
            .filter(|s| !s.is_empty())
            .map(PathBuf::from);
        if let Some(tmp) = runner_tmp {
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

/// Takes the value a parse error points at out of the parsed document; None
/// when the path leads to no key. A bad element of a list takes the whole
/// list with it, so that the index of a later bad element in another list is
/// still the one in the file.
fn take_out(tree: &mut toml::de::DeTable<'_>, path: &serde_path_to_error::Path) -> Option<()> {
    use serde_path_to_error::Segment;
    use std::borrow::BorrowMut;
    use toml::de::DeValue;
    let segments: Vec<&Segment> = path.iter().collect();
    let last = segments
        .iter()
        .rposition(|s| matches!(s, Segment::Map { .. }))?;
    let Segment::Map { key } = segments[last] else {
        return None;
    };
    let Some((Segment::Map { key: first }, within)) = segments[..last].split_first() else {
        return tree.remove(key.as_str()).map(drop);
    };
    let mut at = tree.get_mut(first.as_str())?.get_mut();
    for segment in within {
        at = match (segment, at) {
            (Segment::Map { key }, DeValue::Table(t)) => t.get_mut(key.as_str()),
            (Segment::Seq { index }, DeValue::Array(a)) => {
                let items: &mut [_] = a.borrow_mut();
                items.get_mut(*index)
            }
            _ => None,
        }?
        .get_mut();
    }
    match at {
        DeValue::Table(t) => t.remove(key.as_str()).map(drop),
        _ => None,
    }
}

#[cfg(test)]
#[path = "settings_tests.rs"]
mod tests;

/// builds_dir / cache_dir on a machine of its own (an EC2 instance, a qemu
/// VM): the configured paths, else `builds` and `cache` in the ssh user's
/// home on a cloud image. The same paths serve every environment.
fn own_disk_dirs(
    ssh_user: &str,
    builds_dir: Option<&str>,
    cache_dir: Option<&str>,
) -> crate::model::Dirs {
    let home = if ssh_user == "root" {
        "/root".to_string()
    } else {
        format!("/home/{ssh_user}")
    };
    crate::model::Dirs {
        builds: builds_dir.map_or_else(|| format!("{home}/builds"), str::to_string),
        cache: cache_dir.map_or_else(|| format!("{home}/cache"), str::to_string),
    }
}
