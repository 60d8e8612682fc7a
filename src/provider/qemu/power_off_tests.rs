use super::*;
use crate::context::JobLog;
use crate::provider::qemu::process::fake::FakeQemu;
use crate::state::EnvPaths;

/// A VM directory in a temp dir of its own (kept alive by the returned dir).
fn vm_dir() -> (tempfile::TempDir, VmDir) {
    let dir = tempfile::tempdir().unwrap();
    let vm = VmDir::new(&EnvPaths::new(dir.path(), uuid::Uuid::new_v4()));
    vm.ensure().unwrap();
    (dir, vm)
}

/// The fake QEMU "exits" (its guest powered off, or QEMU quit).
fn kill_fake(pid: process::Pid) {
    // SAFETY: kill(2) on a fake QEMU the test started.
    unsafe { libc::kill(pid.0, libc::SIGKILL) };
}

/// A context whose job log is captured, with time to spare.
fn capture_ctx() -> (Ctx, std::sync::Arc<std::sync::Mutex<Vec<u8>>>) {
    let (log, buf) = JobLog::capture();
    (
        Ctx::new(log, Default::default(), Duration::from_secs(120)),
        buf,
    )
}

/// What the job log got.
fn said(buf: &std::sync::Mutex<Vec<u8>>) -> String {
    String::from_utf8_lossy(&buf.lock().unwrap()).into_owned()
}

#[tokio::test]
async fn quit_ends_both_processes_of_a_qemu_caught_daemonizing() {
    let (dir, vm) = vm_dir();
    // The parent exits 3 s in: after the looks below however loaded the
    // machine, long before quit's wait for it (10 s) runs out.
    let mut parent = FakeQemu::start_daemonizing(dir.path(), &vm, "3");
    let environments = dir.path().join("environments");
    let both = process::scan(&environments);
    assert_eq!(both.len(), 2, "parent and child run: {both:?}");
    let parent_pid = process::Pid(parent.0.id() as i32);
    assert_eq!(
        process::find(&vm),
        Some(parent_pid),
        "the parent is found first"
    );

    let ctx = Ctx::new(
        JobLog::capture().0,
        Default::default(),
        Duration::from_secs(60),
    );
    quit(&vm, &ctx).await.unwrap();
    let left = process::scan(&environments);
    assert!(
        left.is_empty(),
        "the daemonized child outlived quit: {left:?}"
    );
    parent.0.wait().unwrap();
}

/// A QMP socket at the VM's path that answers every command, counts the
/// `system_powerdown`s and calls `on_press` with the count after each, and
/// `on_quit` at a `quit`.
fn fake_qmp(
    vm: &VmDir,
    on_press: impl Fn(u32) + Send + 'static,
    on_quit: impl Fn() + Send + 'static,
) -> std::sync::Arc<std::sync::atomic::AtomicU32> {
    fake_qmp_after(vm, Duration::ZERO, on_press, on_quit)
}

/// [`fake_qmp`], its socket made only after `after` (a QEMU still starting).
fn fake_qmp_after(
    vm: &VmDir,
    after: Duration,
    on_press: impl Fn(u32) + Send + 'static,
    on_quit: impl Fn() + Send + 'static,
) -> std::sync::Arc<std::sync::atomic::AtomicU32> {
    use std::io::{BufRead, BufReader, Write};
    use std::sync::atomic::{AtomicU32, Ordering};
    let presses = std::sync::Arc::new(AtomicU32::new(0));
    let counted = presses.clone();
    let socket = vm.qmp();
    std::thread::spawn(move || {
        std::thread::sleep(after);
        let listener = std::os::unix::net::UnixListener::bind(socket).unwrap();
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            let mut reader = BufReader::new(conn.try_clone().unwrap());
            let _ = conn.write_all(b"{\"QMP\": {\"version\": {}, \"capabilities\": []}}\n");
            let mut line = String::new();
            while reader.read_line(&mut line).unwrap_or(0) > 0 {
                let _ = conn.write_all(b"{\"return\": {}}\n");
                if line.contains("system_powerdown") {
                    on_press(counted.fetch_add(1, Ordering::SeqCst) + 1);
                } else if line.contains("\"quit\"") {
                    on_quit();
                }
                line.clear();
            }
        }
    });
    presses
}

#[tokio::test]
async fn the_power_button_is_pressed_again_until_the_guest_heeds_it() {
    let (dir, vm) = vm_dir();
    let mut qemu = FakeQemu::start(dir.path(), &vm);
    let pid = process::Pid(qemu.0.id() as i32);
    // Like a guest that was still booting at the first press: only the
    // second one powers it off.
    let presses = fake_qmp(
        &vm,
        move |n| {
            if n == 2 {
                kill_fake(pid);
            }
        },
        || panic!("quit, although the VM powered off"),
    );
    let (ctx, buf) = capture_ctx();

    let gone = press_power_button(
        &vm,
        Duration::from_secs(60),
        Duration::from_millis(200),
        &ctx,
    )
    .await;
    let said = said(&buf);
    assert!(
        gone.is_ok(),
        "the VM ignored one press and was never pressed again: {gone:?} {said}"
    );
    assert_eq!(presses.load(std::sync::atomic::Ordering::SeqCst), 2);
    assert!(
        said.contains(
            "pressing it again every 0.2 s (a guest that is still booting ignores the button)"
        ),
        "the log says why: {said}"
    );
    qemu.0.wait().unwrap();
}

#[tokio::test]
async fn a_vm_that_never_powers_off_is_quit_and_its_console_tells_why() {
    let (dir, vm) = vm_dir();
    std::fs::write(
        vm.console(),
        "boot line\nA stop job is running for Something Stuck (5min)\n",
    )
    .unwrap();
    let mut qemu = FakeQemu::start(dir.path(), &vm);
    let pid = process::Pid(qemu.0.id() as i32);
    let presses = fake_qmp(
        &vm,
        |_| {},
        move || {
            kill_fake(pid);
        },
    );
    let (ctx, buf) = capture_ctx();

    powerdown_within(&vm, Duration::from_secs(1), &ctx)
        .await
        .unwrap();
    qemu.0.wait().unwrap();
    let said = said(&buf);
    assert!(
        said.contains(&format!(
            // (not the seconds it says it waited: the wait's clock starts
            // a moment after the bound's)
            "did not power off: timed out waiting for QEMU of VM {} to exit after ",
            vm.name()
        )) && said.contains("(qemu.shutdown_timeout is 1 s): quitting QEMU"),
        "{said}"
    );
    assert!(
        said.contains(&format!(
            "the end of its console log {}:\nboot line\nA stop job is running for Something Stuck",
            vm.console().display()
        )),
        "the warning shows what the guest was doing: {said}"
    );
    assert!(
        presses.load(std::sync::atomic::Ordering::SeqCst) >= 1,
        "{said}"
    );
}

/// A QEMU caught while it starts (a prepare killed right after launching
/// it) has no QMP socket yet: the press waits for it instead of failing the
/// power-off (which left the VM running, kept as suspended).
#[tokio::test]
async fn a_qemu_still_starting_gets_its_press_once_its_socket_is_there() {
    let (dir, vm) = vm_dir();
    let mut qemu = FakeQemu::start(dir.path(), &vm);
    let pid = process::Pid(qemu.0.id() as i32);
    let presses = fake_qmp_after(
        &vm,
        Duration::from_secs(1),
        move |_| {
            kill_fake(pid);
        },
        || panic!("quit, although the VM powered off"),
    );
    let (ctx, buf) = capture_ctx();

    let gone =
        press_power_button(&vm, Duration::from_secs(60), Duration::from_secs(10), &ctx).await;
    let said = said(&buf);
    assert!(gone.is_ok(), "{gone:?} {said}");
    assert_eq!(presses.load(std::sync::atomic::Ordering::SeqCst), 1);
    qemu.0.wait().unwrap();
}

/// A QEMU caught while it daemonizes: its parent exits while the child runs
/// the VM on. The power-off is over only when no QEMU of the VM is left, not
/// when the first pid found exits.
#[tokio::test]
async fn a_daemonizing_qemus_parent_exiting_is_not_the_vm_powering_off() {
    let (dir, vm) = vm_dir();
    let mut qemu = FakeQemu::start_daemonizing(dir.path(), &vm, "1");
    let environments = dir.path().join("environments");
    assert_eq!(process::scan(&environments).len(), 2);
    // A guest that never heeds the button.
    let presses = fake_qmp(&vm, |_| {}, || {});
    let (ctx, buf) = capture_ctx();

    let gone = press_power_button(&vm, Duration::from_secs(4), Duration::from_secs(10), &ctx).await;
    let said = said(&buf);
    qemu.0.wait().unwrap();
    assert_eq!(
        process::scan(&environments).len(),
        1,
        "the parent exited, the child runs on"
    );
    let err = gone.expect_err("the VM's QEMU still runs");
    assert!(
        format!("{err:#}").contains("timed out waiting for QEMU of VM"),
        "{err:#} {said}"
    );
    assert_eq!(presses.load(std::sync::atomic::Ordering::SeqCst), 1);
}
