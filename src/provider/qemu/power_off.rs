//! Stopping a VM: suspend in the configured mode (an ACPI power-off,
//! pressed again while a booting guest ignores it, or a hibernation to a
//! memory image), and quitting QEMU. Starting and restoring: `power.rs`,
//! whose module comment gives the crash-safety rules both follow.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use super::process::{self, Pid};
use super::qmp::Qmp;
use super::vm::{self, VmDir};
use super::{guest, ram, QemuProvider};
use crate::context::Ctx;
use crate::provider::Suspended;
use crate::settings::qemu::QemuSuspendMode;
use crate::wait::{Poll, Schedule, Wait};

/// How often a save is looked at over QMP.
const SAVE_POLL: Duration = Duration::from_millis(50);
/// Saves take seconds: a progress line only past this.
const PROGRESS_QUIET: Duration = Duration::from_secs(5);

/// `quit` ends QEMU in milliseconds; past this it is killed.
const QUIT_WAIT: Duration = Duration::from_secs(10);
/// A VM still running this long after its power button was pressed gets it
/// pressed again (see [`press_power_button`]).
const REPRESS: Duration = Duration::from_secs(10);
/// A QEMU that has not made its QMP socket this long after a power-off began
/// is quit: one starting makes it within milliseconds (seconds when loaded).
const FIRST_PRESS_WITHIN: Duration = Duration::from_secs(30);
/// How often the first press is tried while the socket is not there.
const SOCKET_RETRY: Duration = Duration::from_millis(250);

/// Suspend in the configured mode; a VM that is not running is already
/// suspended (by an earlier suspension, whose outcome was said then). Says
/// whether the VM's memory was kept: a hibernation that fails falls back to
/// a power-off, which ends every process of the guest (a paused script).
pub async fn suspend(p: &QemuProvider, vm: &VmDir, ctx: &Ctx) -> Result<Suspended> {
    let Some(pid) = process::find(vm) else {
        if !vm.exists() {
            bail!(
                "VM {} has no disk ({}): nothing to suspend",
                vm.name(),
                vm.overlay().display()
            );
        }
        return Ok(Suspended::kept());
    };
    let lost = if p.settings.suspend_mode == QemuSuspendMode::Hibernate {
        match hibernate(p, vm, pid, ctx).await {
            Ok(()) => return Ok(Suspended::kept()),
            Err(e) => {
                ctx.log.warn(format!(
                    "hibernating VM {} failed ({e:#}): powering it off instead (disk kept, memory lost)",
                    vm.name()
                ));
                vm.remove_durably(&vm.partial_state())?;
                if let Ok(mut q) = Qmp::connect(&vm.qmp()) {
                    let _ = q.execute("cont", None);
                }
                fell_back(vm, &e)
            }
        }
    } else {
        Suspended::lost("qemu.suspend_mode = \"shutdown\": the VM was powered off")
    };
    powerdown(p, vm, ctx).await?;
    Ok(lost)
}

/// What a hibernation that failed with `e` and fell back to a power-off
/// kept: the disk, not the memory.
fn fell_back(vm: &VmDir, e: &anyhow::Error) -> Suspended {
    Suspended::lost(format!(
        "hibernating VM {} failed ({e:#}), so it was powered off instead: its memory was lost",
        vm.name()
    ))
}

/// ACPI power button, a bounded wait, then `quit`.
pub async fn powerdown(p: &QemuProvider, vm: &VmDir, ctx: &Ctx) -> Result<()> {
    powerdown_within(vm, p.settings.shutdown_timeout.get(), ctx).await
}

async fn powerdown_within(vm: &VmDir, limit: Duration, ctx: &Ctx) -> Result<()> {
    let started = Instant::now();
    ctx.log
        .info(format!("powering off VM {} (ACPI)", vm.name()));
    match press_power_button(vm, limit, REPRESS, ctx).await {
        Ok(()) => {
            ctx.log.info(format!(
                "VM {} powered off in {:.1} s",
                vm.name(),
                started.elapsed().as_secs_f64()
            ));
            Ok(())
        }
        Err(e) => {
            ctx.log.warn(format!(
                "VM {} did not power off: {e:#} (qemu.shutdown_timeout is {} s): quitting QEMU (like \
                 pulling the plug; writes the guest had not flushed are lost); the end of its console \
                 log {}:\n{}",
                vm.name(),
                limit.as_secs(),
                vm.console().display(),
                guest::console_tail(&vm.console(), 15)
            ));
            quit(vm, ctx).await
        }
    }
}

/// Presses the VM's power button, and again every `repress` while QEMU runs,
/// until no QEMU of the VM is left, for up to `limit`.
///
/// A guest drops a press that comes while it boots (before its kernel's ACPI
/// button driver and systemd-logind listen): seen with a VM whose prepare was
/// killed as its sshd first answered, which booted on and ran until
/// `shutdown_timeout` was up. Pressing again is harmless to a guest already
/// shutting down. And a QEMU caught while it starts (a prepare killed right
/// after launching it) has no QMP socket yet: the first press is tried again
/// until it has, for up to [`FIRST_PRESS_WITHIN`].
async fn press_power_button(
    vm: &VmDir,
    limit: Duration,
    repress: Duration,
    ctx: &Ctx,
) -> Result<()> {
    let press = || Qmp::connect(&vm.qmp())?.execute("system_powerdown", None);
    let started = Instant::now();
    let mut presses = 0u32;
    let mut tried: Option<Instant> = None;
    let mut said = false;
    process::wait_vm_gone(vm, limit, ctx, || {
        let due = match (presses, tried) {
            (_, None) => true,
            (0, Some(at)) => at.elapsed() >= SOCKET_RETRY,
            (_, Some(at)) => at.elapsed() >= repress,
        };
        if due {
            if presses == 1 && !said {
                said = true;
                ctx.log.info(format!(
                    "VM {} is still running {} s after its power button was pressed: pressing it \
                     again every {} s (a guest that is still booting ignores the button)",
                    vm.name(),
                    repress.as_secs_f64(),
                    repress.as_secs_f64()
                ));
            }
            tried = Some(Instant::now());
            match press() {
                Ok(_) => presses += 1,
                Err(e) if presses == 0 && started.elapsed() >= FIRST_PRESS_WITHIN => {
                    return Err(e.context(format!(
                        "its power button could not be pressed for {} s",
                        FIRST_PRESS_WITHIN.as_secs()
                    )));
                }
                // A QEMU still starting has not made its socket yet; one on
                // its way out may have closed it (the next look finds it gone).
                Err(_) => {}
            }
        }
        Ok(match presses {
            0 => ", its QMP socket not answering yet".to_string(),
            1 => String::new(),
            n => format!(", its power button pressed {n} times"),
        })
    })
    .await
}

/// Sync the guest's disks, pause, save memory next to the disk, quit. A
/// failed hibernation leaves no memory image and no RAM file: the caller
/// powers the VM off (its memory is lost with it), and a RAM file left
/// would hold disk space for nothing (QEMU keeps its mapping until it
/// exits; the next boot makes a new one anyway).
async fn hibernate(p: &QemuProvider, vm: &VmDir, pid: Pid, ctx: &Ctx) -> Result<()> {
    let saved = save(p, vm, pid, ctx).await;
    if saved.is_err() {
        vm.remove_durably(&vm.state())?;
        vm.remove_durably(&vm.ram())?;
    }
    saved
}

async fn save(p: &QemuProvider, vm: &VmDir, pid: Pid, ctx: &Ctx) -> Result<()> {
    let started = Instant::now();
    // A save's end (and a `cont`) opens the disks again by their
    // command-line paths: a warm VM's alias must name this directory.
    super::alias::follow_vm(p.store.root(), vm)?;
    let mut q = Qmp::connect(&vm.qmp())?;
    // Before the VM may run again (an interrupted save's VM is continued).
    vm.remove_durably(&vm.state())?;
    vm.remove_durably(&vm.partial_state())?;
    continue_after_interrupted_save(&mut q, vm, ctx).await?;
    let launch = vm.read_launch()?;
    // The way the VM was started decides (a VM of an older dormant has
    // anonymous RAM: the whole memory goes into the image).
    let file_ram = launch.as_ref().is_some_and(|l| vm::has_file_ram(&l.argv));
    if let Some(launch) = launch {
        let paths = p.store.env_paths(vm.env_id);
        if let Err(e) = guest::sync_disks(&paths, &p.settings.ssh_user, launch.port, ctx).await {
            ctx.log.warn(format!(
                "VM {} did not write its cached files to its disk ({e:#}): hibernating anyway; should \
                 its memory image be lost, the disk lacks what the guest wrote in its last ~30 s",
                vm.name()
            ));
        }
    }
    ctx.log
        .info(format!("hibernating VM {}: saving its memory", vm.name()));
    q.execute("stop", None)?;
    // With the RAM file only the device state goes into the image (the
    // pages are the file); set either way, as the VM was started.
    q.execute(
        "migrate-set-capabilities",
        Some(json!({ "capabilities": [
            { "capability": "x-ignore-shared", "state": file_ram },
        ] })),
    )
    .context("setting the x-ignore-shared migration capability of the save")?;
    q.execute(
        "migrate",
        Some(json!({ "uri": format!("file:{}", vm.partial_state().display()) })),
    )?;
    // QEMU saves on without dormant from here.
    crate::failpoint!("qemu:hibernate-saving");
    Wait::new(
        ctx,
        format!("VM {} to save its memory", vm.name()),
        Schedule::fixed(SAVE_POLL),
    )
    .quiet_for(PROGRESS_QUIET)
    .until(|| std::future::ready(saved(&mut q)))
    .await?;
    std::fs::File::open(vm.partial_state())
        .and_then(|f| f.sync_all())
        .with_context(|| format!("syncing {}", vm.partial_state().display()))?;
    if file_ram {
        // The image is the device state *and* these pages: durable before
        // the rename makes it a hibernation.
        ram::sync(vm)?;
        crate::failpoint!("qemu:hibernate-ram-synced");
    }
    std::fs::rename(vm.partial_state(), vm.state())
        .with_context(|| format!("renaming {} into place", vm.partial_state().display()))?;
    vm::sync_dir(&vm.dir)?;
    q.quit()?;
    if !process::wait_gone(pid, QUIT_WAIT, ctx).await {
        process::kill(vm, pid)?;
    }
    let size = std::fs::metadata(vm.state()).map(|m| m.len()).unwrap_or(0);
    let ram_size = match file_ram {
        true => std::fs::metadata(vm.ram())
            .map(|m| std::os::unix::fs::MetadataExt::blocks(&m) * 512)
            .unwrap_or(0),
        false => 0,
    };
    ctx.log.info(format!(
        "VM {} hibernated in {:.1} s ({} MiB of memory saved{})",
        vm.name(),
        started.elapsed().as_secs_f64(),
        size / (1024 * 1024),
        match file_ram {
            true => format!(", {} MiB in its RAM file", ram_size / (1024 * 1024)),
            false => String::new(),
        }
    ));
    Ok(())
}

/// Ends QEMU now (`quit`, then SIGKILL to a process confirmed to be it).
/// Not running is success. A QEMU caught while it daemonizes (a prepare
/// killed right after starting it) is two processes: the parent, which exits
/// once its child runs the VM, and that child. So every one found is ended,
/// until none is left.
pub async fn quit(vm: &VmDir, ctx: &Ctx) -> Result<()> {
    // The parent and the child of one daemonizing QEMU, and a spare look.
    for _ in 0..3 {
        let Some(pid) = process::find(vm) else {
            return Ok(());
        };
        quit_one(vm, pid, ctx).await?;
    }
    match process::find(vm) {
        None => Ok(()),
        Some(pid) => bail!(
            "QEMU of VM {} is running again (pid {}) after being stopped 3 times: is another \
             dormant process starting it?",
            vm.name(),
            pid.0
        ),
    }
}

async fn quit_one(vm: &VmDir, pid: Pid, ctx: &Ctx) -> Result<()> {
    ctx.log
        .info(format!("stopping QEMU of VM {} (pid {})", vm.name(), pid.0));
    if let Err(e) = Qmp::connect(&vm.qmp()).and_then(Qmp::quit) {
        tracing::debug!("QMP quit of {}: {e:#}", vm.name());
    }
    if process::wait_gone(pid, QUIT_WAIT, ctx).await {
        return Ok(());
    }
    process::kill(vm, pid)?;
    if process::wait_gone(pid, QUIT_WAIT, &ctx.uncancellable()).await {
        return Ok(());
    }
    bail!(
        "QEMU pid {} of VM {} does not exit even after SIGKILL",
        pid.0,
        vm.name()
    )
}

/// One look at a save in progress.
fn saved(q: &mut Qmp) -> Result<Poll<()>> {
    let m = q.execute("query-migrate", None)?;
    match m.get("status").and_then(Value::as_str).unwrap_or("") {
        "completed" => Ok(Poll::Ready(())),
        // A QEMU with the `pause-before-switchover` capability (set over QMP
        // by someone else: the kill tests hold a save this way) waits for a
        // go before its last step; this save gives it. One killed before
        // that stays held, like any save left running: the recovery cancels it.
        "pre-switchover" => {
            q.execute(
                "migrate-continue",
                Some(json!({ "state": "pre-switchover" })),
            )?;
            Ok(Poll::Pending("saving (pre-switchover, continued)".into()))
        }
        "failed" | "cancelled" => bail!(
            "QEMU could not save the memory: {}",
            m.get("error-desc")
                .and_then(Value::as_str)
                .unwrap_or("no reason given")
        ),
        other => Ok(Poll::Pending(format!("saving ({other})"))),
    }
}

/// Migration states in which no save is running.
const NO_SAVE_RUNNING: &[&str] = &["none", "completed", "failed", "cancelled"];

/// A save started by a dormant process that was then killed goes on without
/// it: QEMU is still writing (and refuses another `migrate` while it does),
/// or it finished and left the VM in `postmigrate` (and refuses another save
/// of it: "Can't migrate the vm that was paused due to previous migration").
/// Nobody vouches for that image: a running save is cancelled, and the VM is
/// continued, so the caller starts from a running VM (a hibernation then
/// saves anew).
pub(super) async fn continue_after_interrupted_save(
    q: &mut Qmp,
    vm: &VmDir,
    ctx: &Ctx,
) -> Result<()> {
    let saving = q.migration_status()?;
    if !NO_SAVE_RUNNING.contains(&saving.as_str()) {
        ctx.log.info(format!(
            "VM {} is still saving its memory for an interrupted hibernation ({saving}): cancelling that save",
            vm.name()
        ));
        if saving != "cancelling" {
            q.execute("migrate_cancel", None)?;
        }
        Wait::new(
            ctx,
            format!("the interrupted save of VM {} to stop", vm.name()),
            Schedule::fixed(SAVE_POLL),
        )
        .quiet_for(PROGRESS_QUIET)
        .until(|| {
            std::future::ready(q.migration_status().map(|s| match s.as_str() {
                done if NO_SAVE_RUNNING.contains(&done) => Poll::Ready(()),
                _ => Poll::Pending(s),
            }))
        })
        .await?;
    }
    let status = q.status()?;
    if status != "running" {
        ctx.log
            .info(format!("VM {} was {status}: continuing it", vm.name()));
        q.execute("cont", None)?;
    }
    Ok(())
}

#[cfg(test)]
#[path = "power_off_tests.rs"]
mod tests;
