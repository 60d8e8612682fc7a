//! The local transport: each stage script runs in a bash on this host, in its
//! own process group so a termination kills everything the script started.
//!
//! The script gets a clean environment: a few basics from the runner process
//! (PATH, HOME, ...) and `DORMANT_ENVIRONMENT_KEY`, never dormant's own
//! `CUSTOM_ENV_*` (they hold the job token); the runner's script exports every
//! job variable itself.

use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use async_trait::async_trait;
use tokio::process::Command;

use super::{Script, ScriptExit, Transport};
use crate::context::Ctx;

/// After SIGTERM to the script's group, how long it may take to exit before
/// SIGKILL. The runner's scripts `trap 'exit 1' TERM`, so this is quick.
const TERM_GRACE: Duration = Duration::from_secs(5);

/// Variables of the runner process passed through to local scripts.
pub const INHERITED_VARS: &[&str] = &[
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "TERM", "SHELL", "TZ",
];

pub struct LocalTransport {
    workdir: PathBuf,
    shell: PathBuf,
    base_env: Vec<(String, String)>,
}

impl LocalTransport {
    pub fn new(workdir: PathBuf, shell: PathBuf, base_env: Vec<(String, String)>) -> Self {
        LocalTransport {
            workdir,
            shell,
            base_env,
        }
    }

    fn command(&self) -> Command {
        let mut cmd = Command::new(&self.shell);
        cmd.current_dir(&self.workdir)
            .env_clear()
            .envs(self.base_env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .process_group(0)
            .kill_on_drop(true);
        cmd
    }
}

#[async_trait]
impl Transport for LocalTransport {
    async fn connect(&self, ctx: &Ctx) -> Result<()> {
        if !self.workdir.is_dir() {
            bail!(
                "environment directory {} does not exist",
                self.workdir.display()
            );
        }
        let out = self
            .command()
            .arg("-c")
            .arg("for t in git gitlab-runner; do command -v $t >/dev/null 2>&1 || echo $t; done")
            .stdout(Stdio::piped())
            .output()
            .await
            .with_context(|| {
                format!(
                    "running {} (the local provider needs bash)",
                    self.shell.display()
                )
            })?;
        if !out.status.success() {
            bail!(
                "{} does not run scripts (exit {:?})",
                self.shell.display(),
                out.status.code()
            );
        }
        for missing in String::from_utf8_lossy(&out.stdout).split_whitespace() {
            ctx.log.warn(match missing {
                "git" => "git is not installed on this host: get_sources will fail".to_string(),
                _ => "gitlab-runner is not installed on this host: cache and artifact stages will only warn".to_string(),
            });
        }
        Ok(())
    }

    async fn run_script(&self, script: &Script<'_>, ctx: &Ctx) -> Result<ScriptExit> {
        // The script goes in a file next to the work dir rather than on stdin,
        // so a command in it that reads stdin cannot swallow the rest.
        let file = self.workdir.with_file_name("stage-script.sh");
        tokio::fs::write(&file, script.body)
            .await
            .with_context(|| {
                format!("writing the {} script to {}", script.stage, file.display())
            })?;
        let mut child = self
            .command()
            .arg(&file)
            .envs(script.env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::inherit())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting {} for {}", self.shell.display(), script.stage))?;
        let pgid = child
            .id()
            .context("the script's shell exited before it could be tracked")?
            as i32;
        let status = tokio::select! {
            status = child.wait() => status.context("waiting for the script")?,
            _ = ctx.cancel.cancelled() => {
                kill_group(pgid, libc::SIGTERM);
                if tokio::time::timeout(TERM_GRACE, child.wait()).await.is_err() {
                    kill_group(pgid, libc::SIGKILL);
                    let _ = child.wait().await;
                }
                // Whatever the script left running in its group goes too.
                kill_group(pgid, libc::SIGKILL);
                return Ok(ScriptExit::Cancelled);
            }
        };
        // Children the script left behind in its group do not outlive the stage.
        kill_group(pgid, libc::SIGKILL);
        Ok(ScriptExit::Code(
            status
                .code()
                .unwrap_or_else(|| 128 + status.signal().unwrap_or(0)),
        ))
    }

    async fn close(&self, _ctx: &Ctx) -> Result<()> {
        let _ = std::fs::remove_file(self.workdir.with_file_name("stage-script.sh"));
        Ok(())
    }

    async fn take_file(&self, path: &str, max: usize, _ctx: &Ctx) -> Result<Option<Vec<u8>>> {
        take_local_file(std::path::Path::new(path), max)
    }

    async fn shell_command(
        &self,
        dir: &str,
        command: Option<&str>,
        _tty: bool,
        _ctx: &Ctx,
    ) -> Result<Command> {
        // The operator's own environment (their terminal, TERM, ...), unlike
        // a job's scripts: this is a person at a shell, not the job.
        let mut cmd = Command::new(&self.shell);
        let dir = std::path::Path::new(dir);
        cmd.current_dir(if dir.is_dir() { dir } else { &self.workdir });
        match command {
            Some(line) => cmd.arg("-c").arg(line),
            None => cmd.arg("-l"),
        };
        Ok(cmd)
    }
}

/// [`Transport::take_file`] on this host. The file is the job's to write: a
/// symlink is not followed (O_NOFOLLOW), only removed.
pub fn take_local_file(path: &std::path::Path, max: usize) -> Result<Option<Vec<u8>>> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path);
    let mut file = match file {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        // ELOOP: a symlink. Not ours to read; remove it so it asks nothing.
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            let _ = std::fs::remove_file(path);
            return Ok(None);
        }
        Err(e) => return Err(e).with_context(|| format!("opening {}", path.display())),
    };
    if !file.metadata()?.is_file() {
        return Ok(None);
    }
    let mut content = Vec::new();
    (&mut file)
        .take(max as u64)
        .read_to_end(&mut content)
        .with_context(|| format!("reading {}", path.display()))?;
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("removing {}", path.display())),
    }
    Ok(Some(content))
}

fn kill_group(pgid: i32, signal: i32) {
    // SAFETY: kill(2) with a negative pid signals a process group; no memory is touched.
    unsafe {
        libc::kill(-pgid, signal);
    }
}
