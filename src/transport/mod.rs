//! Transports run stage scripts in an environment: `local` spawns bash on this
//! host, `ssh` streams the script over one multiplexed SSH connection per job.

pub mod keys;
pub mod local;
mod local_child;
pub mod local_kept;
mod relay;
pub mod signals;
pub mod ssh;

use std::time::Duration;

use anyhow::Result;
use async_trait::async_trait;

use crate::context::Ctx;
use crate::job::Job;
use crate::model::EnvPaths;
use crate::model::Target;
use crate::settings::Settings;

/// How a script ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScriptExit {
    /// The script exited with this code (0 = success).
    Code(i32),
    /// `ctx.cancel` fired (SIGTERM); the script's whole process group was killed.
    Cancelled,
}

/// How a stage ended: the script's exit, and whether the file the caller
/// asked to watch ([`Script::watch`]) exists afterwards.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ran {
    pub exit: ScriptExit,
    /// `Some(exists)` when the transport looked on its way out of the stage
    /// at no extra cost; `None` when it did not (the caller looks itself).
    pub watched: Option<bool>,
    /// Something of the stage may still run in the environment (a
    /// termination whose end the machine never reported): the job's cleanup
    /// must stop it ([`Transport::stop_leftovers`]) before it suspends or
    /// releases the environment.
    pub left_running: bool,
    /// The script asked a question (`dormant-ask`, docs/pause.md) and waits,
    /// alive, for a later job's answer: the stage is over for the runner.
    pub paused: Option<Vec<u8>>,
    /// Paused with the job log in the middle of a line (a prompt): the
    /// paused line must start with the newline dormant adds, written with
    /// it in one write, so that a `dormant run` killed between the two
    /// leaves no byte the script did not write.
    pub paused_mid_line: bool,
}

impl Ran {
    /// Ended with `exit`, nothing left running; the watched file was not looked at.
    pub fn unwatched(exit: ScriptExit) -> Ran {
        Ran {
            exit,
            watched: None,
            left_running: false,
            paused: None,
            paused_mid_line: false,
        }
    }
}

/// The words for a machine that went away under a job, in errors, the notify
/// hook's reason and the job log (`crate::lifecycle::lost`).
pub const MACHINE_LOST: &str = "machine lost";

/// The machine of a lost connection will not come back ([`MachineCheck`] said
/// so, in these words: "machine i-0abc is gone"): waiting for it ended at once.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{}: {}", MACHINE_LOST, .0)]
pub struct MachineLost(pub String);

/// Asked between attempts to reach a machine whose connection was lost,
/// whether waiting can still help. The run stage answers from the provider
/// (`crate::lifecycle::lost`): a machine that was terminated, deleted or
/// stopped will not come back, so the wait ends at once instead of after the
/// whole `ssh.reconnect_timeout`.
#[async_trait]
pub trait MachineCheck: Send + Sync {
    /// `Some(what became of it)` when the machine is gone for good; `None`
    /// while it runs, or when the provider cannot tell.
    async fn lost(&self, ctx: &Ctx) -> Option<String>;
}

/// One stage script to run.
#[derive(Clone)]
pub struct Script<'a> {
    /// The runner's self-contained bash script.
    pub body: &'a [u8],
    /// The stage name (`build_script`, ...), for messages.
    pub stage: &'a str,
    /// Extra environment for the script (`DORMANT_ENVIRONMENT_KEY`).
    pub env: &'a [(String, String)],
    /// A file the script may leave behind (the job's suspend request): the
    /// SSH wrapper says whether it exists when it reports the exit, so the
    /// common case (no request) costs no second command per stage.
    pub watch: Option<&'a str>,
    /// This run of the stage, unique in its environment (`<stage>.<random>`):
    /// the name its output is kept under on the machine, so a session opened
    /// after a lost connection finds it again.
    pub id: &'a str,
    /// Whether the machine can still come back while its connection is lost.
    pub machine: Option<&'a dyn MachineCheck>,
    /// Where the stage's job log is copied as it is written, for `dormant
    /// attach` (`crate::state::stage_output`); `None`: nowhere.
    pub copy: Option<&'a crate::state::stage_output::OutputCopy>,
    /// Where `dormant pause` writes its request for this stage run
    /// (`crate::state::pause_request`); `None`: the stage cannot be paused
    /// from the host. Read while the stage runs by the transports that can
    /// keep a paused script (kept stages: over SSH, and local ones).
    pub pause: Option<&'a std::path::Path>,
    /// Where a stage that relayed a paused script to its end notes the exit
    /// code its continue gave, before the machine lets the script go
    /// (`crate::state::relayed_end`); `None`: not noted.
    pub relayed: Option<&'a std::path::Path>,
}

/// How one of dormant's own commands in the environment ended ([`Transport::exec`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecOutput {
    /// The exit code; `None` if a signal ended it.
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

#[async_trait]
pub trait Transport: Send + Sync {
    /// Prepare: waits (bounded by `ctx.deadline`, with progress in the job log)
    /// until the environment runs commands, sets up what later stage processes
    /// reuse (an SSH ControlMaster), and probes for bash, git and gitlab-runner.
    async fn connect(&self, ctx: &Ctx) -> Result<()>;

    /// Prepare of a machine that kept running since the prepare of the job
    /// before, which probed it (a hot window, docs/pause.md): takes the
    /// connection that job left, if it still answers, with no new login and
    /// no probe. `Ok(false)`: nothing to take (then [`Self::connect`]).
    async fn take_live(&self, ctx: &Ctx) -> Result<bool> {
        let _ = ctx;
        Ok(false)
    }

    /// Runs one stage script, streaming its stdout and stderr live to ours.
    /// `Err` means the transport broke (a system failure), never the script.
    async fn run_script(&self, script: &Script<'_>, ctx: &Ctx) -> Result<Ran>;

    /// Suspend or release: closes what `connect` set up. Best effort, idempotent.
    async fn close(&self, ctx: &Ctx) -> Result<()>;

    /// Cleanup, when a stage of the job did not end cleanly ([`Ran::left_running`],
    /// or a `run` that was killed): stops every process the job's stages left
    /// in the environment and removes what was kept of them, so a suspended
    /// environment never resumes with a job's script still running in it.
    /// Bounded by `ctx`; `machine` ends a wait for a machine that is gone.
    async fn stop_leftovers(&self, machine: Option<&dyn MachineCheck>, ctx: &Ctx) -> Result<()> {
        let _ = (machine, ctx);
        Ok(())
    }

    /// Cleanup of a resumed job that did not end paused, while the machine
    /// still runs: whether a paused stage is left in the environment (a
    /// script still waits for its answer: the job did not continue it), so
    /// the record keeps saying paused. What else the stages left is stopped
    /// as by [`Transport::stop_leftovers`]. Transports that cannot keep a
    /// paused script have none.
    async fn paused_left(&self, ctx: &Ctx) -> Result<bool> {
        let _ = ctx;
        Ok(false)
    }

    /// Reads (at most `max` bytes of) a regular file in the environment and
    /// removes it; `None` if there is none (a symlink is removed, never read).
    /// Cleanup reads the job's suspend request (`crate::job_request`) with it,
    /// before the machine stops. Bounded by `ctx.deadline`.
    async fn take_file(&self, path: &str, max: usize, ctx: &Ctx) -> Result<Option<Vec<u8>>> {
        let _ = (path, max, ctx);
        anyhow::bail!("this transport cannot read files in the environment")
    }

    /// Runs one of dormant's own commands (never a job's script: the data
    /// volume's mount and unmount) through the environment's shell, its
    /// output captured. Over SSH it uses the job's master (a new connection
    /// only if none runs). Bounded by `limit` and `ctx.deadline`.
    async fn exec(&self, line: &str, limit: Duration, ctx: &Ctx) -> Result<ExecOutput> {
        let _ = (line, limit, ctx);
        anyhow::bail!("this transport cannot run commands in the environment")
    }

    /// `dormant shell`: the command that opens a login shell in `dir` on the
    /// machine, or runs `command` there (a line its shell interprets, as
    /// `ssh host -- ...` would), with the caller's terminal when `tty`. Called
    /// after `connect`; the caller runs it with its own stdin, stdout, stderr.
    async fn shell_command(
        &self,
        dir: &str,
        command: Option<&str>,
        tty: bool,
        ctx: &Ctx,
    ) -> Result<tokio::process::Command> {
        let _ = (dir, command, tty, ctx);
        anyhow::bail!("this transport cannot open a shell in the environment")
    }

    /// `dormant shell` beside a running job: like [`Self::shell_command`],
    /// but over a connection of its own (the job's is not touched), and
    /// registered on the machine under `nonce` so the job's cleanup can end
    /// it ([`Self::end_joined`]).
    async fn join_command(
        &self,
        dir: &str,
        command: Option<&str>,
        tty: bool,
        nonce: &str,
        ctx: &Ctx,
    ) -> Result<tokio::process::Command> {
        let _ = (dir, command, tty, nonce, ctx);
        anyhow::bail!("this transport cannot open a shell beside a running job")
    }

    /// The job's cleanup: tells every shell joined beside the job
    /// (`message`), ends it with everything it started, and removes what it
    /// left on the machine; a join of `nonces` (the marks the cleanup saw)
    /// not registered there yet is refused when it arrives. Bounded by `ctx`.
    async fn end_joined(&self, message: &str, nonces: &[String], ctx: &Ctx) -> Result<()> {
        let _ = (message, nonces, ctx);
        Ok(())
    }
}

/// Opens the transport for a target.
pub fn open(
    target: &Target,
    paths: &EnvPaths,
    settings: &Settings,
    job: &Job,
) -> Result<Box<dyn Transport>> {
    match target {
        Target::Local { workdir } => {
            let base_env = local::INHERITED_VARS
                .iter()
                .filter_map(|k| job.driver_var(k).map(|v| (k.to_string(), v.to_string())))
                .collect();
            let local =
                local::LocalTransport::new(workdir.clone(), settings.local.shell.clone(), base_env)
                    .with_tools(paths.dir.join(ssh::pause::tools_dir()));
            // Kept where a paused script can be kept (the same conditions as
            // `lifecycle::pause::refusal`'s for this provider): elsewhere a
            // stage keeps the stronger guarantee that it dies with dormant.
            let keeps = settings.suspend.enabled
                && settings.local.storage == crate::model::StorageMode::Machine;
            Ok(Box::new(if keeps {
                local.with_kept(local_kept::KeptHere {
                    env: paths.id.simple().to_string(),
                    dir: local_kept::dir(&paths.dir),
                    bound: settings.ssh.kept_output_bytes(),
                })
            } else {
                local
            }))
        }
        Target::Ssh(t) => Ok(Box::new(ssh::SshTransport::new(
            t.clone(),
            paths.clone(),
            settings.ssh.clone(),
        ))),
    }
}

pub use crate::state::store::write_private;
