//! Where dormant's settings come from and where its state dir is: the
//! settings file (`--config`, `DORMANT_CONFIG`, the default path) and the
//! state dir (`DORMANT_STATE_DIR`, `state_dir`, the system default), each
//! refused with a message saying what to set when it cannot work.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use super::{qemu, DriverEnv, ProviderKind, Settings, DEFAULT_CONFIG_PATH};

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
