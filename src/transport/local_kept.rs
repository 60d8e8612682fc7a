//! The local transport's kept stages (docs/pause.md, "On the local
//! provider"): where an environment can keep a paused script (suspension
//! enabled, machine storage), each stage runs the `ssh` transport's kept
//! wrapper (`transport/ssh/remote/kept.sh`) in a local bash instead of over
//! SSH, and dormant reads it with the same session code
//! ([`crate::transport::ssh::kept::drive`]) over the bash's pipes. So
//! `dormant-ask`, `dormant-continue` and `dormant pause` work here by the one
//! protocol the `ssh` provider has: no second one.
//!
//! The stage directory (`$t` of the scripts) is
//! `environments/<id>/kept/dormant-<uid>/` in the state dir (0700; the
//! wrapper finds it through `TMPDIR`, which the script itself does not get:
//! [`PRELUDE`]). It holds the stage's output (`.out`, 0600, as the job log's
//! copy for `dormant attach` beside it does), never the script (it reaches
//! the wrapper's bash through a pipe and stays in a shell variable: the job
//! token never touches a disk) nor an answer (it passes through the FIFO).
//! The environment's release stops what is kept there, paused scripts
//! included ([`release`]), before the directory goes.
//!
//! The trade (the module comment of [`super::local`] says what the other
//! mode guarantees): a kept stage's wrapper is not dormant's to take along
//! when dormant dies. Its owner sees the end of its input when dormant closes
//! it or dies; over a dormant that lives it stops the script at once, after
//! one that died it lets the script run at most [`LINGER_SECS`] more (the
//! wrapper cannot tell a dormant that died from one following again), then
//! stops it (SIGTERM, SIGKILL 5 s later) — and the job's cleanup stops it
//! too ([`stop_leftovers`]). A paused script is left alone in every case:
//! that is the point.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use tokio::process::Command;

use super::ssh::kept::{self, Once};
use super::ssh::kept_state::{Place, Stage};
use super::ssh::remote;
use super::{Ran, Script};
use crate::context::Ctx;
use crate::state::stage_output::JobLogOut;

/// How long a stage's wrapper keeps the script after its input ended without
/// dormant having its end: dormant died, or follows again in a new bash (its
/// session broke: the follower fell more than the bound behind), which takes
/// milliseconds. The wrapper tells a dormant that closed it from one that
/// died by whether its parent (dormant) still lives a moment later, and a
/// `dormant run` exits right after its stage: short, so the owner of a stage
/// that ended goes at once or within this, not minutes later as over SSH.
/// (Whole seconds: the owner counts bash's `SECONDS`, so 1 would be 0–1 s.)
pub const LINGER_SECS: u64 = 2;

/// The script's first line: the wrapper's `TMPDIR` (the stage directory) is
/// not the job's. (The local transport passes the script no `TMPDIR` of the
/// runner's: the script sees none, as in the other mode.)
const PRELUDE: &[u8] = b"unset TMPDIR\n";

/// What the messages call the machine.
const HERE: &str = "this host";

/// Whether stage `stage` runs kept where the environment can keep a paused
/// script: the job's own script stages (`build_script`, `step_*`,
/// `after_script`), where `dormant-ask` and `dormant pause` have a use. The
/// runner's own stages (sources, caches, artifacts, file variables) never
/// ask; they keep the cheaper path whose script dies with dormant (in
/// `dormant try`, every stage kept took it from ≈ 0.3 s to ≈ 0.75 s:
/// docs/pause.md).
pub fn runs_kept(stage: &str) -> bool {
    matches!(stage, "build_script" | "after_script") || stage.starts_with("step_")
}

/// Where an environment's kept stages are: `TMPDIR` of their wrappers (the
/// scripts add `dormant-<uid>`).
pub fn dir(env_dir: &Path) -> PathBuf {
    env_dir.join("kept")
}

/// A local environment's kept stages.
#[derive(Clone)]
pub struct KeptHere {
    /// The environment's id (32 hex digits): the prefix of its stages' files.
    pub env: String,
    /// [`dir`].
    pub dir: PathBuf,
    /// The bound of a stage's kept output (`ssh.kept_output_mib`).
    pub bound: u64,
}

/// The wrapper's bash: `shell -c <line>` in `workdir`, with `env` only, in a
/// process group of its own (a signal the runner sends dormant's group is not
/// the script's), every signal at its default, and none of dormant's
/// descriptors beyond the three pipes: the runner waits for the end of its
/// pipes, which a paused script must not hold.
fn wrapper(
    shell: &Path,
    workdir: &Path,
    env: &[(String, String)],
    dir: &Path,
    line: &str,
) -> Command {
    let mut cmd = Command::new(shell);
    cmd.arg("-c")
        .arg(line)
        .current_dir(workdir)
        .env_clear()
        .envs(env.iter().map(|(k, v)| (k, v)))
        .env("TMPDIR", dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(false);
    // SAFETY: between fork and exec only async-signal-safe calls (sigaction,
    // sigprocmask, close_range, close).
    unsafe {
        cmd.pre_exec(|| {
            super::signals::reset_in_child()?;
            if libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32) != 0 {
                for fd in 3..4096 {
                    libc::close(fd);
                }
            }
            Ok(())
        });
    }
    cmd
}

/// Runs `script` as a kept stage of `here`, reading it to its end (or its
/// pause).
pub async fn run(
    shell: &Path,
    workdir: &Path,
    base_env: &[(String, String)],
    here: &KeptHere,
    script: &Script<'_>,
    ctx: &Ctx,
) -> Result<Ran> {
    let mut body = PRELUDE.to_vec();
    body.extend_from_slice(script.body);
    let upload = remote::script_with_env(&body, script.env)?;
    let workdir_text = workdir.display().to_string();
    let place = Place {
        dest: HERE,
        workdir: Some(&workdir_text),
        body: &upload,
        env: &here.env,
        linger_secs: LINGER_SECS,
        bound: here.bound,
    };
    let mut st = Stage::new(JobLogOut::new(script.copy));
    let mut futile = 0;
    loop {
        let before = st.progress();
        let (sent, line) = kept::next_session(&place, script, st.mode());
        let mut child = wrapper(shell, workdir, base_env, &here.dir, &line)
            .spawn()
            .with_context(|| format!("starting {} for {}", shell.display(), script.stage))?;
        st.sent |= !sent.is_empty();
        let (Some(stdin), Some(stdout), Some(stderr)) =
            (child.stdin.take(), child.stdout.take(), child.stderr.take())
        else {
            bail!("the bash of {} has no pipes", script.stage);
        };
        match kept::drive(
            child, stdin, stdout, stderr, sent, &place, script, &mut st, ctx,
        )
        .await?
        {
            Once::Done(ran) => {
                st.stream.finish();
                return Ok(ran);
            }
            Once::MasterUnreachable(why) | Once::Broken(why) => {
                tracing::debug!(stage = script.stage, "the local session broke: {why}");
                if !st.again_after_broken(before, &mut futile).await {
                    bail!(
                        "the local bash running {} keeps ending at once ({why})",
                        script.stage
                    );
                }
            }
        }
    }
}

/// Stops the stages of `here` left running (a `dormant run` killed or
/// terminated mid-stage) and removes their files; paused stages are spared
/// (`remote/leftovers.sh`).
pub async fn stop_leftovers(here: &KeptHere, ctx: &Ctx) -> Result<()> {
    leftovers(&here.dir, &here.env, Mode::Spare, ctx.remaining())
        .await
        .map(drop)
}

/// [`stop_leftovers`], saying whether a paused stage is left
/// ([`super::Transport::paused_left`]).
pub async fn paused_left(here: &KeptHere, ctx: &Ctx) -> Result<bool> {
    match leftovers(&here.dir, &here.env, Mode::Look, ctx.remaining()).await? {
        Some(out) => remote::parse_paused_left(&out),
        None => Ok(false),
    }
}

/// What `remote/leftovers.sh` does with paused stages.
enum Mode {
    Spare,
    Look,
    All,
}

/// The environment's release: every stage kept in `env_dir`, paused ones
/// too, is stopped and its files removed; then the directory goes.
pub async fn release(env_dir: &Path, env: &str) -> Result<()> {
    let dir = dir(env_dir);
    if !dir.exists() {
        return Ok(());
    }
    leftovers(&dir, env, Mode::All, Duration::from_secs(30)).await?;
    match std::fs::remove_dir_all(&dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).with_context(|| format!("removing {}", dir.display())),
    }
}

/// Its stdout; `None` when nothing was ever kept here.
async fn leftovers(dir: &Path, env: &str, mode: Mode, limit: Duration) -> Result<Option<Vec<u8>>> {
    if !dir.exists() {
        return Ok(None);
    }
    let mut cmd = Command::new("bash");
    cmd.arg("-c")
        .arg(remote::LEFTOVERS)
        .arg("dormant")
        .arg(env)
        .arg("")
        .arg(match mode {
            Mode::Spare => "",
            Mode::Look => "look",
            Mode::All => "all",
        })
        .env("TMPDIR", dir)
        .stdin(Stdio::null())
        .kill_on_drop(true);
    let out = tokio::time::timeout(limit, cmd.output())
        .await
        .with_context(|| {
            format!(
                "stopping the stages kept in {} took over {} s",
                dir.display(),
                limit.as_secs()
            )
        })?
        .context("running bash to stop the kept stages")?;
    if !out.status.success() {
        bail!(
            "stopping the stages kept in {} failed ({}): {}",
            dir.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(Some(out.stdout))
}
