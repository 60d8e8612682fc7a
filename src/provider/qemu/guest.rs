//! Talking to the guest outside the job's stages: waiting for its sshd, the
//! snippet that sets its clock after a restore (run by the transport's login),
//! and syncing its disks before a hibernation.
//!
//! Readiness is the `SSH-` banner, never a TCP connect: QEMU's user-mode
//! network accepts on the forwarded port at once, long before the guest runs
//! sshd, and drops the connection when nothing answers inside. The transport's
//! login (with the environment's key and the pinned host key) follows.

use std::path::Path;
use std::time::Duration;

use anyhow::{anyhow, bail, Result};

use super::process::{self, Pid};
use super::vm::VmDir;
use crate::context::Ctx;
use crate::model::EnvPaths;
use crate::transport::ssh::ready;
use crate::wait::{Poll, Schedule, Wait};

/// One banner read (the same probe as every SSH readiness wait,
/// `transport::ssh::ready`): the guest's sshd answers in milliseconds once
/// it runs, but an emulated CPU under load may take seconds.
const BANNER_TIMEOUT: Duration = Duration::from_secs(5);

/// Waits for the guest's sshd banner, with progress lines in the job log,
/// failing at once if QEMU exits (the console log's tail says why).
pub async fn wait_for_sshd(
    vm: &VmDir,
    pid: Pid,
    port: u16,
    limit: Duration,
    ctx: &Ctx,
) -> Result<f64> {
    let ctx = ctx.within(limit);
    let mut wait = Wait::new(
        &ctx,
        format!("the VM's sshd on 127.0.0.1:{port}"),
        Schedule::fixed(ready::READY_POLL),
    );
    let waited = wait
        .until(|| async {
            match ready::banner("127.0.0.1", port, BANNER_TIMEOUT.min(ctx.remaining())).await {
                Ok(_) => Ok(Poll::Ready(())),
                Err(reason) => {
                    if process::find(vm) != Some(pid) {
                        bail!(
                            "QEMU of {} exited while the guest booted; the end of its console log {}:\n{}",
                            vm.name(),
                            vm.console().display(),
                            console_tail(&vm.console(), 15)
                        );
                    }
                    Ok(Poll::Pending(reason))
                }
            }
        })
        .await;
    match waited {
        Ok(()) => Ok(wait.elapsed().as_secs_f64()),
        Err(e) => Err(anyhow!(
            "{e:#} (qemu.boot_timeout {} s); the end of the console log {}:\n{}",
            limit.as_secs(),
            vm.console().display(),
            console_tail(&vm.console(), 15)
        )),
    }
}

/// The last lines of the console log, for errors.
pub fn console_tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read(path).unwrap_or_default();
    let text = String::from_utf8_lossy(&text);
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// After a restore the guest's clock lags by the time spent suspended (it
/// was frozen), while its RTC follows the host. This snippet, run by the SSH
/// transport right after its login in the same command as its probes (see
/// `SshTarget::on_login`: no second connection), sets the clock from the RTC
/// when they are 2 s or more apart, which is only ever after a restore. The
/// guest needs `/sys/class/rtc/rtc0` and, for a user other than root,
/// passwordless sudo (cloud images' default user has both). A failure is a
/// warning: the environment works with a late clock.
pub fn clock_from_rtc(user: &str) -> String {
    let sudo = if user == "root" { "" } else { "sudo -n " };
    format!(
        r#"if r=$(cat /sys/class/rtc/rtc0/since_epoch 2>/dev/null); then b=$(date +%s); d=$((r - b));
if [ "$d" -ge 2 ] || [ "$d" -le -2 ]; then
if {sudo}date -u -s "@$r" >/dev/null 2>&1; then echo "say:guest clock set from its RTC (it was $d s behind after the hibernation)";
else echo "warn:could not set the guest's clock from its RTC: it lags by $d s, the time the environment was hibernated; the guest needs passwordless sudo for {user} (see docs/qemu.md)"; fi; fi;
else echo "warn:the guest has no /sys/class/rtc/rtc0: its clock is not set after a hibernation (see docs/qemu.md)"; fi"#
    )
}

/// Before a hibernation: the guest writes what it holds in its page cache to
/// its disk, so that if the memory image is ever lost (a damaged file, a QEMU
/// upgrade, a host crash while saving) the disk booted instead has every file
/// the job wrote, not only those Linux had written back (it waits up to 30 s).
/// Over the job's SSH master when one runs (cleanup closes it only after the
/// suspend), so it costs no handshake; else a login of its own.
pub async fn sync_disks(paths: &EnvPaths, user: &str, port: u16, ctx: &Ctx) -> Result<()> {
    run(paths, user, port, "sync", ctx).await.map(drop)
}

/// The socket of a master the SSH transport left running for this environment.
fn master_socket(paths: &EnvPaths) -> Option<std::path::PathBuf> {
    std::fs::read_dir(&paths.control_dir)
        .ok()?
        .filter_map(Result::ok)
        .map(|e| e.path().join("master"))
        .find(|socket| socket.exists())
}

/// One command in the guest, logging in as the transport does (the
/// environment's key, its pinned host key); its stdout, trimmed. ssh falls
/// back to a login of its own if the master does not answer.
async fn run(paths: &EnvPaths, user: &str, port: u16, script: &str, ctx: &Ctx) -> Result<String> {
    let mut cmd = tokio::process::Command::new("ssh");
    if let Some(socket) = master_socket(paths) {
        cmd.args(["-o", "ControlMaster=no", "-o"])
            .arg(format!("ControlPath={}", socket.display()));
    }
    cmd.arg("-F")
        .arg("/dev/null")
        .arg("-i")
        .arg(&paths.ssh_key)
        .args(["-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes"])
        .arg("-o")
        .arg(format!(
            "UserKnownHostsFile={}",
            paths.known_hosts.display()
        ))
        .args([
            "-o",
            "GlobalKnownHostsFile=/dev/null",
            "-o",
            "StrictHostKeyChecking=yes",
        ])
        .arg("-o")
        .arg(format!("HostKeyAlias=dormant-{}", paths.id))
        .args(["-o", "ConnectTimeout=10", "-o", "LogLevel=ERROR", "-p"])
        .arg(port.to_string())
        .arg(format!("{user}@127.0.0.1"))
        .arg(script)
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    let limit = Duration::from_secs(30).min(ctx.remaining());
    let out = match tokio::time::timeout(limit, cmd.output()).await {
        Ok(r) => r?,
        Err(_) => bail!("no answer within {} s", limit.as_secs()),
    };
    if !out.status.success() {
        bail!(
            "ssh exited with {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}
