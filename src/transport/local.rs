//! The local transport: each stage script runs in a bash on this host, in its
//! own process group so a termination kills everything the script started.
//!
//! Two modes. Where the environment can keep a paused script (suspension
//! enabled, machine storage: `lifecycle::pause::refusal`), the job's own
//! script stages run *kept* ([`super::local_kept`]): through the `ssh` transport's kept
//! wrapper in a local bash, so a script that asks (`dormant-ask`) or is
//! paused (`dormant pause`) outlives its `dormant run` and a later job
//! continues it. Every other stage (the runner's own: sources, caches,
//! artifacts; and every stage where nothing can be kept) runs as described
//! below, the script dormant's child. The two differ in what a SIGKILLed `dormant run` leaves:
//! below, nothing, at once (parent-death signal and watchdog); kept, the
//! script runs on until its wrapper's owner or the job's cleanup stops it
//! (within [`super::local_kept::LINGER_SECS`], then SIGTERM and SIGKILL
//! 5 s later) — the price of a script that can outlive dormant on purpose. The rest of this comment is the other mode.
//!
//! The script gets a clean environment: a few basics from the runner process
//! (PATH, HOME, ...) and `DORMANT_ENVIRONMENT_KEY`, never dormant's own
//! `CUSTOM_ENV_*` (they hold the job token); the runner's script exports every
//! job variable itself. Its output is relayed through a pipe dormant owns
//! (see [`super::relay`]), stderr merged into stdout in the order written.
//!
//! How the script is started — from a memory file, never a disk, in a
//! process group that goes with dormant even when dormant is SIGKILLed — is
//! in [`super::local_child`].

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use async_trait::async_trait;
use tokio::process::Command;

use super::local_child::{child_setup, kill_group, memory_file, Watchdog};
use super::{relay, ExecOutput, MachineCheck, Ran, Script, ScriptExit, Transport};
use crate::context::Ctx;
use crate::wait::{Schedule, Wait};

/// After SIGTERM to the script's group, how long it may take to exit before
/// SIGKILL. The runner's scripts `trap 'exit 1' TERM`, so this is quick.
const TERM_GRACE: Duration = Duration::from_secs(5);

/// Variables of the runner process passed through to local scripts.
pub const INHERITED_VARS: &[&str] = &[
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "TERM", "SHELL", "TZ",
];

/// Where earlier versions kept the stage script, next to the work dir; removed
/// when met, so an upgrade leaves no old script (and its job token) behind.
const LEGACY_SCRIPT_FILE: &str = "stage-script.sh";

pub struct LocalTransport {
    workdir: PathBuf,
    shell: PathBuf,
    base_env: Vec<(String, String)>,
    /// Where `dormant-ask` and `dormant-continue` are put for the script's
    /// PATH (docs/pause.md); `None`: not at all.
    tools: Option<PathBuf>,
    /// Stages run kept ([`super::local_kept`]): the environment can keep a
    /// paused script. `None`: the script is dormant's child, as below.
    kept: Option<super::local_kept::KeptHere>,
}

impl LocalTransport {
    pub fn new(workdir: PathBuf, shell: PathBuf, base_env: Vec<(String, String)>) -> Self {
        LocalTransport {
            workdir,
            shell,
            base_env,
            tools: None,
            kept: None,
        }
    }

    /// Runs every stage kept in `here` ([`super::local_kept`]): where the
    /// environment can keep a paused script.
    pub fn with_kept(mut self, here: super::local_kept::KeptHere) -> Self {
        self.kept = Some(here);
        self
    }

    /// Puts `dormant-ask` and `dormant-continue` in `dir` (made once) on
    /// every script's PATH, for stages that do not run kept: there they
    /// refuse at once, naming why (`DORMANT_PAUSE`: the environment is not
    /// suspended, or suspends without its processes). Kept stages get them
    /// from their wrapper.
    pub fn with_tools(mut self, dir: PathBuf) -> Self {
        self.tools = Some(dir);
        self
    }

    /// The PATH a script gets: the tools' directory first, when there is one
    /// and it could be made (else the script goes on without them).
    fn script_path(&self) -> Option<String> {
        let dir = self.tools.as_ref()?;
        if let Err(e) = install_tools(dir) {
            tracing::debug!("writing dormant-ask into {}: {e:#}", dir.display());
            return None;
        }
        let inherited = self
            .base_env
            .iter()
            .find(|(k, _)| k == "PATH")
            .map_or("/usr/local/bin:/usr/bin:/bin", |(_, v)| v.as_str());
        Some(format!("{}:{inherited}", dir.display()))
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

    fn remove_legacy_script(&self) {
        let _ = std::fs::remove_file(self.workdir.with_file_name(LEGACY_SCRIPT_FILE));
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
                "{} does not run scripts ({})",
                self.shell.display(),
                out.status
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

    async fn run_script(&self, script: &Script<'_>, ctx: &Ctx) -> Result<Ran> {
        self.remove_legacy_script();
        if let Some(here) = self
            .kept
            .as_ref()
            .filter(|_| super::local_kept::runs_kept(script.stage))
        {
            return super::local_kept::run(
                &self.shell,
                &self.workdir,
                &self.base_env,
                here,
                script,
                ctx,
            )
            .await;
        }
        let file = memory_file(script.body)
            .with_context(|| format!("holding the {} script in memory", script.stage))?;
        let (out_read, out_write) = std::io::pipe().context("making the output pipe")?;
        let mut cmd = self.command();
        cmd.arg("/dev/fd/3")
            .envs(script.env.iter().map(|(k, v)| (k, v)))
            // The environment can pause, but not this stage (one of the
            // runner's own, not kept): the tools say so in these words
            // (`lifecycle::pause::VAR`, which this layer does not import).
            .envs(self.kept.as_ref().map(|_| {
                (
                    "DORMANT_PAUSE",
                    format!(
                        "{} is one of the runner's own stages on provider = \"local\": only the \
                         job's script stages (build_script, step_*, after_script) can pause",
                        script.stage
                    ),
                )
            }))
            .envs(self.script_path().map(|p| ("PATH", p)))
            .stdout(
                out_write
                    .try_clone()
                    .context("duplicating the output pipe")?,
            )
            .stderr(out_write);
        // The script's group is the watchdog's, made before the script starts:
        // there is no moment when the group lives unguarded.
        let watchdog = Watchdog::start()
            .with_context(|| format!("guarding the {} script's process group", script.stage))?;
        let pgid = watchdog.pid;
        cmd.process_group(pgid);
        let fd = file.as_raw_fd();
        let parent = std::process::id() as libc::pid_t;
        // SAFETY: between fork and exec this calls only async-signal-safe
        // functions (dup2, fcntl, prctl, getppid) on descriptors it owns.
        unsafe {
            cmd.pre_exec(move || child_setup(fd, parent));
        }
        // The runtime's one thread spawns the shell and outlives it, so the
        // parent-death signal fires only when dormant itself dies.
        let spawned = cmd.spawn();
        // Ours are closed now: the shell holds the only write end, so end of
        // file means every process of the script closed it.
        drop(cmd);
        drop(file);
        let mut child = spawned
            .with_context(|| format!("starting {} for {}", self.shell.display(), script.stage))?;
        let out_read = tokio::net::unix::pipe::Receiver::from_owned_fd(OwnedFd::from(out_read))
            .context("reading the script's output")?;
        let copy = relay::copy_to_stdout(out_read, script.copy);
        tokio::pin!(copy);
        let mut copying = true;
        let status = loop {
            tokio::select! {
                status = child.wait() => break Some(status.context("waiting for the script")?),
                () = &mut copy, if copying => copying = false,
                () = ctx.cancel.cancelled() => {
                    kill_group(pgid, libc::SIGTERM);
                    let grace = ctx.uncancellable().within(TERM_GRACE);
                    let what = format!("{} to stop after SIGTERM", script.stage);
                    let stopped = Wait::new(&grace, what, Schedule::fixed(TERM_GRACE))
                        .event(child.wait())
                        .await;
                    if stopped.is_err() {
                        kill_group(pgid, libc::SIGKILL);
                        let _ = child.wait().await;
                    }
                    break None;
                }
            }
        };
        // Whatever the script left running in its group goes too.
        kill_group(pgid, libc::SIGKILL);
        if copying && !relay::drain(&mut copy).await {
            tracing::debug!(
                stage = script.stage,
                "a process that left the script's group still holds its output"
            );
        }
        let Some(status) = status else {
            return Ok(Ran::unwatched(ScriptExit::Cancelled));
        };
        // A local look for the watched file is as cheap as any: the caller does it.
        Ok(Ran::unwatched(ScriptExit::Code(
            status
                .code()
                .unwrap_or_else(|| 128 + status.signal().unwrap_or(0)),
        )))
    }

    async fn close(&self, _ctx: &Ctx) -> Result<()> {
        self.remove_legacy_script();
        Ok(())
    }

    async fn stop_leftovers(&self, _machine: Option<&dyn MachineCheck>, ctx: &Ctx) -> Result<()> {
        match &self.kept {
            Some(here) => super::local_kept::stop_leftovers(here, ctx).await,
            // The watchdog took the group with the stage's dormant.
            None => Ok(()),
        }
    }

    async fn paused_left(&self, ctx: &Ctx) -> Result<bool> {
        match &self.kept {
            Some(here) => super::local_kept::paused_left(here, ctx).await,
            None => Ok(false),
        }
    }

    async fn take_file(&self, path: &str, max: usize, _ctx: &Ctx) -> Result<Option<Vec<u8>>> {
        take_local_file(std::path::Path::new(path), max)
    }

    async fn exec(&self, line: &str, limit: Duration, ctx: &Ctx) -> Result<ExecOutput> {
        let mut cmd = self.command();
        cmd.arg("-c").arg(line);
        let limit = limit.min(ctx.remaining());
        let out = tokio::time::timeout(limit, cmd.output())
            .await
            .with_context(|| format!("a command did not finish within {} s", limit.as_secs()))?
            .with_context(|| format!("running {}", self.shell.display()))?;
        Ok(ExecOutput {
            code: out.status.code(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        })
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

/// Writes the two tools into `dir` once: into a new directory beside it,
/// then renamed into place whole (a concurrent stage's rename wins; ours goes).
fn install_tools(dir: &std::path::Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    if dir.is_dir() {
        return Ok(());
    }
    let tmp = dir.with_extension(format!("new-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir(&tmp)?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o700))?;
    for (name, text) in [
        ("dormant-ask", super::ssh::pause::ASK),
        ("dormant-continue", super::ssh::pause::CONTINUE),
    ] {
        let f = tmp.join(name);
        std::fs::write(&f, text)?;
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o700))?;
    }
    match std::fs::rename(&tmp, dir) {
        Ok(()) => Ok(()),
        Err(_) if dir.is_dir() => std::fs::remove_dir_all(&tmp),
        Err(e) => {
            let _ = std::fs::remove_dir_all(&tmp);
            Err(e)
        }
    }
}
