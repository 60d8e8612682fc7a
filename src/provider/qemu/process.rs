//! QEMU processes: starting a VM detached from the stage process,
//! recognising an environment's QEMU by its command line before signalling
//! it (a pidfile may be stale and its pid reused), finding every QEMU of a
//! state dir (orphans, capacity). The files a VM is made from: `tools.rs`.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use uuid::Uuid;

use super::vm::{vm_name, VmDir};
use crate::context::Ctx;
use crate::wait::{Poll, Schedule, Wait};

/// How often an exiting QEMU is looked at (a `kill(pid, 0)`).
const EXIT_POLL: Duration = Duration::from_millis(50);
/// An exit taking longer than this (an ACPI power-off) gets progress lines.
const EXIT_QUIET: Duration = Duration::from_secs(5);

/// A running QEMU of one environment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pid(pub i32);

fn cmdline(pid: i32) -> Option<Vec<String>> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    Some(
        raw.split(|b| *b == 0)
            .filter(|s| !s.is_empty())
            .map(|s| String::from_utf8_lossy(s).into_owned())
            .collect(),
    )
}

/// Not a zombie: a process that exited but was not reaped runs nothing.
fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(") ")
            .and_then(|(_, rest)| rest.chars().next())
            .is_some_and(|s| s != 'Z' && s != 'X'),
        Err(_) => false,
    }
}

/// Whether a command line is the QEMU of environment `env_id` living in
/// `vm_dir`: `-name dormant-<id>` and `-pidfile <vm_dir>/qemu.pid`, as
/// `vm::argv` writes them. The binary's name is not checked: `qemu.qemu_binary`
/// may be any path (a wrapper, `kvm`).
fn is_vm(args: &[String], env_id: Uuid, vm_dir: &Path) -> bool {
    let name = vm_name(env_id);
    let pidfile = vm_dir.join("qemu.pid").display().to_string();
    args.windows(2).any(|w| w[0] == "-name" && w[1] == name)
        && args
            .windows(2)
            .any(|w| w[0] == "-pidfile" && w[1] == pidfile)
}

/// The live QEMU of this VM, found through its pidfile and confirmed by its
/// command line; else by scanning processes (a pidfile lost or not yet
/// written). A warm VM handed to an environment runs under the identity it
/// was started with (`Launch::running_as`): that one is accepted too.
pub fn find(vm: &VmDir) -> Option<Pid> {
    let mut identities = vec![(vm.env_id, vm.dir.clone())];
    if let Some(r) = vm.read_launch().ok().flatten().and_then(|l| l.running_as) {
        identities.push((r.id, r.dir));
    }
    let matches = |args: &[String]| identities.iter().any(|(id, dir)| is_vm(args, *id, dir));
    if let Ok(text) = std::fs::read_to_string(vm.pidfile()) {
        if let Ok(pid) = text.trim().parse::<i32>() {
            if alive(pid) && cmdline(pid).is_some_and(|a| matches(&a)) {
                return Some(Pid(pid));
            }
        }
    }
    identities.iter().find_map(|(id, dir)| {
        let root = dir.parent().and_then(Path::parent).unwrap_or(dir);
        still_running(scan(root), *id, |pid| {
            cmdline(pid.0).is_some_and(|a| matches(&a))
        })
    })
}

/// Of the processes a scan found, the first of VM `id` that still runs it
/// when looked at again. Every match is looked at, not only the first: a
/// daemonizing QEMU's parent has the VM's command line too until it exits,
/// and one that exits between the scan and the look must not hide the child
/// that runs on (the VM would be taken for gone).
fn still_running(found: Vec<(Uuid, Pid)>, id: Uuid, runs_it: impl Fn(Pid) -> bool) -> Option<Pid> {
    found
        .into_iter()
        .filter(|(found, _)| *found == id)
        .map(|(_, pid)| pid)
        .find(|pid| runs_it(*pid))
}

/// Every live dormant QEMU whose files are under `environments` (a state
/// dir's `environments/`, or its warm pool `warm/`: the same shape), with
/// its id (the environment's, or the warm machine's it was started as).
pub fn scan(environments: &Path) -> Vec<(Uuid, Pid)> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let root = environments.display().to_string();
    let mut found = Vec::new();
    for e in entries.filter_map(Result::ok) {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Some(args) = cmdline(pid) else { continue };
        if !alive(pid) {
            continue;
        }
        let Some(id) = args
            .windows(2)
            .find(|w| w[0] == "-name")
            .and_then(|w| w[1].strip_prefix("dormant-"))
            .and_then(|s| Uuid::parse_str(s).ok())
        else {
            continue;
        };
        let dir = Path::new(&root).join(id.to_string()).join("vm");
        if is_vm(&args, id, &dir) {
            found.push((id, Pid(pid)));
        }
    }
    found
}

/// Waits until the process is gone, up to `limit` (and the context's
/// deadline). Not ended by SIGTERM: every caller bounds it by `limit` and
/// goes on to a harder stop, which is what a terminated job needs too.
pub async fn wait_gone(pid: Pid, limit: Duration, ctx: &Ctx) -> bool {
    let bounded = ctx.uncancellable().within(limit);
    Wait::new(
        &bounded,
        format!("QEMU (pid {}) to exit", pid.0),
        Schedule::fixed(EXIT_POLL),
    )
    .quiet_for(EXIT_QUIET)
    .until(|| async {
        Ok(if alive(pid.0) {
            Poll::Pending("still running".into())
        } else {
            Poll::Ready(())
        })
    })
    .await
    .is_ok()
}

/// Waits until no QEMU of the VM is left, up to `limit` (and the context's
/// deadline; not ended by SIGTERM, like [`wait_gone`]). A QEMU caught while it
/// daemonizes is two processes, the parent exiting once its child runs the
/// VM: waiting for the first pid found would take the parent's exit for the
/// VM's. `nudge` runs at every look while one lives (an ACPI power button
/// pressed again): what it returns is added to the progress line, and its
/// error ends the wait.
pub async fn wait_vm_gone(
    vm: &VmDir,
    limit: Duration,
    ctx: &Ctx,
    mut nudge: impl FnMut() -> Result<String>,
) -> Result<()> {
    let bounded = ctx.uncancellable().within(limit);
    Wait::new(
        &bounded,
        format!("QEMU of VM {} to exit", vm.name()),
        Schedule::fixed(EXIT_POLL),
    )
    .quiet_for(EXIT_QUIET)
    .until(|| {
        std::future::ready(match find(vm) {
            None => Ok(Poll::Ready(())),
            Some(pid) => {
                nudge().map(|note| Poll::Pending(format!("pid {} still running{note}", pid.0)))
            }
        })
    })
    .await
}

/// SIGKILL, only after confirming the pid is still this VM's QEMU.
pub fn kill(vm: &VmDir, pid: Pid) -> Result<()> {
    if !cmdline(pid.0).is_some_and(|a| is_vm(&a, vm.env_id, &vm.dir)) {
        return Ok(()); // gone, or the pid now belongs to someone else
    }
    // SAFETY: kill(2) on a pid whose command line we just checked is this VM's QEMU.
    if unsafe { libc::kill(pid.0, libc::SIGKILL) } != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::ESRCH) {
            return Err(e).with_context(|| format!("killing QEMU {} of {}", pid.0, vm.name()));
        }
    }
    Ok(())
}

/// Starts QEMU detached (`-daemonize`: own session, stdio on /dev/null) and
/// returns once its parent exited, which QEMU does after the VM is set up or
/// on a start-up error (then its stderr is the message).
pub async fn spawn(argv: &[String], vm: &VmDir) -> Result<Pid> {
    let _ = std::fs::remove_file(vm.pidfile());
    let _ = std::fs::remove_file(vm.qmp());
    let mut cmd = tokio::process::Command::new(&argv[0]);
    cmd.args(&argv[1..])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(false);
    // SAFETY: umask(2) is async-signal-safe; it makes the QMP socket and the
    // files QEMU creates private to this user.
    unsafe {
        cmd.pre_exec(|| {
            libc::umask(0o077);
            Ok(())
        });
    }
    let out = cmd.output().await.with_context(|| {
        format!(
            "starting {} (qemu.qemu_binary; is QEMU installed?)",
            argv[0]
        )
    })?;
    if !out.status.success() {
        bail!(
            "QEMU did not start ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let pid = find(vm).with_context(|| {
        format!(
            "QEMU started but no process of {} is running (see {})",
            vm.name(),
            vm.console().display()
        )
    })?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(vm.qmp(), std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("making {} private", vm.qmp().display()))?;
    Ok(pid)
}

/// A stand-in QEMU for unit tests: a shell named `qemu-system-fake` whose
/// command line carries `-name dormant-<id>` and the VM directory, as dormant's
/// QEMUs do, sleeping until killed.
#[cfg(test)]
pub(crate) mod fake {
    use std::os::unix::process::CommandExt;
    use std::path::Path;
    use std::process::{Child, Command};

    use super::VmDir;

    /// A stand-in QEMU: `sh` under a name QEMU's scan recognises, in a
    /// process group of its own so that dropping it ends every process it
    /// started (its `sleep` outlives a shell that is killed, and would hold
    /// the test's output open).
    pub struct FakeQemu(pub Child);

    impl FakeQemu {
        pub fn start(bin_dir: &Path, vm: &VmDir) -> FakeQemu {
            let sh = bin_dir.join("qemu-system-fake");
            if !sh.exists() {
                std::os::unix::fs::symlink("/bin/sh", &sh).unwrap();
            }
            let child = Command::new(&sh)
                .process_group(0)
                // `; true` keeps the shell itself running (no exec of sleep).
                .args(["-c", "sleep 60; true", "-name"])
                .arg(vm.name())
                .arg("-pidfile")
                .arg(vm.pidfile())
                .spawn()
                .unwrap();
            // Until the shell runs, /proc shows the parent's command line; and
            // until its `sleep` is exec'd, that forked child still shows the
            // shell's (a second "QEMU" of the same VM for a scan).
            let until = std::time::Instant::now() + std::time::Duration::from_secs(5);
            let pid = child.id();
            let sleeping = || {
                std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
                    .unwrap_or_default()
                    .split_whitespace()
                    .any(|c| {
                        std::fs::read_to_string(format!("/proc/{c}/comm"))
                            .is_ok_and(|comm| comm.trim() == "sleep")
                    })
            };
            while (super::find(vm).is_none() || !sleeping()) && std::time::Instant::now() < until {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            FakeQemu(child)
        }
    }

    impl FakeQemu {
        /// A QEMU caught while it daemonizes: a parent (returned) that exits
        /// after `parent_for`, and its child, which goes on like the VM's QEMU.
        /// Both carry the VM's `-name` and `-pidfile`; the child is found through
        /// [`super::find`] once the parent is gone.
        pub fn start_daemonizing(bin_dir: &Path, vm: &VmDir, parent_for: &str) -> FakeQemu {
            let sh = bin_dir.join("qemu-system-fake");
            if !sh.exists() {
                std::os::unix::fs::symlink("/bin/sh", &sh).unwrap();
            }
            let name = vm.name();
            let pidfile = vm.pidfile().display().to_string();
            let child = Command::new(&sh)
            .process_group(0)
            .arg("-c")
            .arg(format!(
                "\"$0\" -c 'sleep 60; true' -name {name} -pidfile {pidfile} & sleep {parent_for}; true"
            ))
            .arg(&sh)
            .args(["-name", &name, "-pidfile", &pidfile])
            .spawn()
            .unwrap();
            // Until both run; and for a moment while the shells fork (for
            // `sleep`, for the `&`) a third process shows the same command
            // line: wait for two looks 50 ms apart that both see exactly two.
            let until = std::time::Instant::now() + std::time::Duration::from_secs(5);
            let count = || super::scan(vm.dir.parent().unwrap().parent().unwrap()).len();
            let mut steady = 0;
            while steady < 2 && std::time::Instant::now() < until {
                steady = if count() == 2 { steady + 1 } else { 0 };
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            FakeQemu(child)
        }
    }

    impl Drop for FakeQemu {
        fn drop(&mut self) {
            // SAFETY: kill(2) on the process group this fake leads (Linux
            // does not hand out its id while a member lives).
            unsafe { libc::kill(-(self.0.id() as i32), libc::SIGKILL) };
            let _ = self.0.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::fake::FakeQemu;
    use super::*;
    use crate::state::EnvPaths;

    #[test]
    fn a_match_gone_since_the_scan_does_not_hide_the_vms_qemu_that_runs_on() {
        // A daemonizing QEMU: the parent (listed first, lower pid) exits
        // between the scan and the look; its child runs the VM on.
        let (vm, other) = (Uuid::new_v4(), Uuid::new_v4());
        let found = vec![(other, Pid(10)), (vm, Pid(11)), (vm, Pid(12))];
        let gone = Pid(11);
        assert_eq!(
            still_running(found.clone(), vm, |p| p != gone),
            Some(Pid(12))
        );
        assert_eq!(still_running(found.clone(), vm, |_| false), None);
        assert_eq!(still_running(found, Uuid::new_v4(), |_| true), None);
    }

    #[test]
    fn a_vms_qemu_is_found_by_its_command_line_and_only_it_is_killed() {
        let dir = tempfile::tempdir().unwrap();
        let ours = VmDir::new(&EnvPaths::new(dir.path(), Uuid::new_v4()));
        let other = VmDir::new(&EnvPaths::new(dir.path(), Uuid::new_v4()));
        let elsewhere = tempfile::tempdir().unwrap();
        let foreign = VmDir::new(&EnvPaths::new(elsewhere.path(), ours.env_id));
        assert_eq!(find(&ours), None);

        let mut q = FakeQemu::start(dir.path(), &ours);
        let _o = FakeQemu::start(dir.path(), &other);
        let pid = find(&ours).expect("found by scanning (no pidfile)");
        assert_eq!(pid.0, q.0.id() as i32);
        let mut all: Vec<Uuid> = scan(&dir.path().join("environments"))
            .into_iter()
            .map(|(id, _)| id)
            .collect();
        all.sort();
        let mut want = vec![ours.env_id, other.env_id];
        want.sort();
        assert_eq!(all, want);
        // The same environment id in another state dir is not ours.
        assert_eq!(find(&foreign), None);

        // A stale pidfile naming another process is not believed.
        ours.ensure().unwrap();
        std::fs::write(ours.pidfile(), format!("{}\n", std::process::id())).unwrap();
        assert_eq!(find(&ours), Some(pid));

        // kill() refuses a pid that is not this VM's QEMU.
        kill(&other, pid).unwrap();
        assert!(alive(pid.0), "another VM's kill must not touch ours");
        kill(&ours, pid).unwrap();
        q.0.wait().unwrap();
        assert_eq!(find(&ours), None);
    }
}
