//! Starting and restoring a VM (stopping, hibernating and quitting it:
//! `power_off.rs`).
//!
//! Crash safety, step by step (any dormant process may be SIGKILLed at any line):
//! - boot: `launch.json` is written before QEMU starts; a QEMU left running by
//!   a killed prepare is found by its command line (cleanup quits it, a retried
//!   prepare adopts it).
//! - hibernate: the guest syncs its disks first (the disk is the fallback if
//!   the image is ever lost); the memory goes to `memory.state.partial`,
//!   renamed to `memory.state` only once QEMU reports the save complete and
//!   the file is synced. QEMU finishes a save whose dormant was killed and
//!   keeps the VM paused: the recovery's hibernation cancels or drops that
//!   save, continues the VM and saves anew. A partial file is never restored:
//!   a resume that finds one boots the disk (memory lost, disk kept) and says so.
//!   With the guest's RAM in a file (`ram.rs`), that file is synced before
//!   the rename too: the image is the device state and those pages.
//! - restore: `memory.state` is deleted (durably) once the restored VM has
//!   loaded and before it is continued, since the overlay (and the RAM file)
//!   change from then on and the image would no longer match them. Whenever a live QEMU owns the overlay, a leftover state
//!   file is stale and deleted too, so an image is never restored twice.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::process::{self, Pid};
use super::qmp::Qmp;
use super::vm::{self, Launch, VmDir};
use super::{alias, capacity, power_off, ram, tools, QemuProvider};
use crate::context::Ctx;
use crate::settings::boot_image::BootImage;
use crate::wait::{Poll, Schedule, Wait};
/// Loading a memory image takes seconds; a stuck one is given up after this.
const RESTORE_LIMIT: Duration = Duration::from_secs(300);
/// How often a restore is looked at over QMP.
const RESTORE_POLL: Duration = Duration::from_millis(100);
/// Restores take seconds: a progress line only past this.
const PROGRESS_QUIET: Duration = Duration::from_secs(5);
/// Tries at starting QEMU when its forwarded port was taken in between.
const PORT_TRIES: usize = 3;

/// Starts QEMU on the overlay (or restoring `incoming`'s memory image) once a
/// slot is free; returns its pid and SSH port.
pub async fn boot(
    p: &QemuProvider,
    vm: &VmDir,
    image: &BootImage,
    incoming: Option<&Launch>,
    ctx: &Ctx,
) -> Result<(Pid, u16)> {
    let max = p.settings.max_environments;
    boot_within(
        p,
        vm,
        image,
        incoming,
        max,
        capacity::Waiter::Job,
        None,
        ctx,
    )
    .await
}

/// [`boot`] once fewer than `limit` VMs run (0: no limit): a warm VM is
/// booted within one slot less than `max_environments`, so a refill never
/// takes the last slot a job could need. A warm VM's disks are given to
/// QEMU under `alias`, a symlink to `vm`'s directory (`alias.rs`).
#[allow(clippy::too_many_arguments)]
pub async fn boot_within(
    p: &QemuProvider,
    vm: &VmDir,
    image: &BootImage,
    incoming: Option<&Launch>,
    limit: u32,
    waiter: capacity::Waiter,
    alias: Option<&std::path::Path>,
    ctx: &Ctx,
) -> Result<(Pid, u16)> {
    let recorded = vm.read_launch()?;
    let mut last_error = None;
    for attempt in 0..PORT_TRIES {
        let wanted = incoming.or(recorded.as_ref()).map(|l| l.port);
        let port = match wanted {
            Some(port) if attempt == 0 && tools::port_free(port) => port,
            _ => tools::free_port()?,
        };
        let mut argv = match incoming {
            Some(l) => vm::with_port(&l.argv, l.port, port),
            None => {
                let argv = vm::argv(&p.settings, image, vm, port);
                match alias {
                    Some(alias) => vm::with_drives_under(&argv, vm, alias),
                    None => argv,
                }
            }
        };
        vm.write_launch(&Launch {
            version: crate::state::store::FORMAT_VERSION,
            argv: argv.clone(),
            port,
            running_as: None,
        })?;
        // The QEMU started as a warm VM is gone (a start follows none that
        // runs): its alias with it.
        if let Some(r) = recorded.as_ref().and_then(|l| l.running_as.as_ref()) {
            alias::remove(p.store.root(), r.id)?;
        }
        let file_ram = vm::has_file_ram(&argv);
        match incoming {
            // The RAM file is opened in place; the capability the load
            // needs is set over QMP before it starts (`restore`).
            Some(_) if file_ram => {
                ram::check_restorable(vm)?;
                argv.push("-incoming".into());
                argv.push("defer".into());
            }
            Some(_) => {
                argv.push("-incoming".into());
                argv.push(format!("file:{}", vm.state().display()));
            }
            None => ram::fresh(vm, &argv)?,
        }
        let started = capacity::start_when_free(p.store.root(), limit, waiter, ctx, || {
            process::spawn(&argv, vm)
        })
        .await;
        match started {
            Ok(pid) => {
                ctx.log.info(format!(
                    "{} VM {} (QEMU pid {}, SSH on 127.0.0.1:{port})",
                    if incoming.is_some() {
                        "restoring"
                    } else {
                        "booted"
                    },
                    vm.name(),
                    pid.0
                ));
                return Ok((pid, port));
            }
            // The port was taken between the check and QEMU's bind: another one.
            Err(e) if format!("{e:#}").contains("host forwarding") => last_error = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(last_error.expect("at least one attempt")).context("no free port for the VM's SSH")
}

/// Resume: adopt a QEMU already running for this VM, restore a complete
/// memory image, or boot the disk. Returns pid, port and whether memory was restored.
pub async fn resume(
    p: &QemuProvider,
    vm: &VmDir,
    image: &BootImage,
    ctx: &Ctx,
) -> Result<(Pid, u16, bool)> {
    if let Some(pid) = process::find(vm) {
        let launch = vm
            .read_launch()?
            .context("the running VM has no launch.json")?;
        ctx.log.info(format!(
            "VM {} is already running (QEMU pid {}): adopting it",
            vm.name(),
            pid.0
        ));
        ensure_running(p, vm, ctx).await?;
        return Ok((pid, launch.port, false));
    }
    if vm.state().exists() {
        match vm.read_launch()? {
            Some(launch) => match restore(p, vm, image, &launch, ctx).await {
                Ok((pid, port)) => return Ok((pid, port, true)),
                // Terminated while loading: the VM never ran, so the image
                // still matches the disk; keep it for the next resume.
                Err(e) if ctx.cancel.is_cancelled() => {
                    power_off::quit(vm, &ctx.uncancellable()).await?;
                    return Err(e);
                }
                Err(e) => {
                    // QEMU exits on an image it cannot load; its own message
                    // went to /dev/null with the rest of its stderr.
                    let why = if process::find(vm).is_none() {
                        format!(
                            "QEMU exited while loading it: the image is damaged or was saved by another \
                             QEMU version; {e:#}"
                        )
                    } else {
                        format!("{e:#}")
                    };
                    ctx.log.warn(format!(
                        "restoring the saved memory of VM {} failed ({why}): booting from its disk instead \
                         (memory lost, disk kept)",
                        vm.name()
                    ));
                    power_off::quit(vm, ctx).await?;
                    vm.remove_durably(&vm.state())?;
                }
            },
            None => {
                // Without the command line that saved it, the image cannot be loaded.
                ctx.log.warn(format!(
                    "VM {} has a memory image but no recorded command line: booting from its disk \
                     (memory lost, disk kept)",
                    vm.name()
                ));
                vm.remove_durably(&vm.state())?;
            }
        }
    }
    if vm.partial_state().exists() {
        ctx.log.warn(format!(
            "the last hibernation of VM {} did not complete (interrupted while saving memory): booting from \
             its disk (memory lost, disk kept)",
            vm.name()
        ));
        vm.remove_durably(&vm.partial_state())?;
    }
    let (pid, port) = boot(p, vm, image, None, ctx).await?;
    Ok((pid, port, false))
}

async fn restore(
    p: &QemuProvider,
    vm: &VmDir,
    image: &BootImage,
    launch: &Launch,
    ctx: &Ctx,
) -> Result<(Pid, u16)> {
    let size = std::fs::metadata(vm.state()).map(|m| m.len()).unwrap_or(0);
    ctx.log.info(format!(
        "restoring VM {} from its saved memory ({} MiB)",
        vm.name(),
        size / (1024 * 1024)
    ));
    // From QEMU's start: with the RAM file the load itself is milliseconds.
    let started = Instant::now();
    let (pid, port) = boot(p, vm, image, Some(launch), ctx).await?;
    if vm::has_file_ram(&launch.argv) {
        // `-incoming defer`: the pages stay in the RAM file, only the
        // device state is loaded from the image.
        let mut q = Qmp::connect(&vm.qmp())?;
        ram::ignore_shared(&mut q)?;
        q.execute(
            "migrate-incoming",
            Some(serde_json::json!({ "uri": format!("file:{}", vm.state().display()) })),
        )?;
    }
    let status = Wait::new(
        &ctx.within(RESTORE_LIMIT),
        format!("VM {} to load its saved memory", vm.name()),
        Schedule::fixed(RESTORE_POLL),
    )
    .quiet_for(PROGRESS_QUIET)
    .until(|| std::future::ready(loaded(vm)))
    .await?;
    // Deleted before the VM runs: from then on the overlay (and the RAM
    // file) change, and the image must never be restored again. A process
    // killed between the two leaves a paused QEMU, which the next resume
    // adopts and continues.
    vm.remove_durably(&vm.state())?;
    if status != "running" {
        Qmp::connect(&vm.qmp())?.execute("cont", None)?;
    }
    ctx.log.info(format!(
        "VM {} restored in {:.1} s; its memory image was deleted (it matches the disk only once)",
        vm.name(),
        started.elapsed().as_secs_f64()
    ));
    Ok((pid, port))
}

/// One look at a restoring VM: loaded (paused, as hibernate saved it) is
/// ready, with its status; still loading is "not yet".
fn loaded(vm: &VmDir) -> Result<Poll<String>> {
    let status = Qmp::connect(&vm.qmp())?.status()?;
    match status.as_str() {
        "inmigrate" => Ok(Poll::Pending("loading (inmigrate)".into())),
        // Loaded as it was saved: paused (hibernate stops the VM first).
        "running" | "paused" | "postmigrate" | "prelaunch" => Ok(Poll::Ready(status)),
        other => bail!("the restored VM is {other:?}, not running"),
    }
}

/// A live QEMU that a killed stage left paused (mid-save, or restored and
/// not continued) is continued; its state files are stale.
pub async fn ensure_running(p: &QemuProvider, vm: &VmDir, ctx: &Ctx) -> Result<()> {
    // A `cont` opens the disks again by their command-line paths.
    alias::follow_vm(p.store.root(), vm)?;
    let mut q = Qmp::connect(&vm.qmp())?;
    // Before the VM may run: its memory image stops matching from then on.
    vm.remove_durably(&vm.partial_state())?;
    vm.remove_durably(&vm.state())?;
    power_off::continue_after_interrupted_save(&mut q, vm, ctx).await?;
    Ok(())
}
