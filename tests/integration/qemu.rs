//! The `qemu` provider with real VMs: whole jobs through the built binary, as
//! GitLab Runner drives it, booting the test image that
//! `scripts/build-test-image.sh` builds (a small Debian with systemd, sshd and
//! cloud-init) under TCG. VMs run one at a time (`ONE_VM`): two at once on a
//! small CI machine take as long as both in turn and risk the boot timeouts.
//!
//! Needs QEMU, genisoimage and cloud-init (`scripts/install-test-deps.sh`) and
//! the image (`DORMANT_TEST_QEMU_IMAGE`, else the script is run here: it
//! reuses its cache). A missing piece fails the tests; nothing is skipped.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::harness::*;
use dormant::provider::qemu::qmp::Qmp;
use dormant::runner_sim::SimJob;
use dormant::state::EnvPaths;

pub(crate) const RUNNER: &str = "93";
pub(crate) const SYSTEM: &str = "s_9e9e9e9e9e9e";
/// The test image's cloud-init default user.
pub(crate) const USER: &str = "debian";

static ONE_VM: Mutex<()> = Mutex::new(());

/// Held while a test runs its VM: one VM at a time in this test binary (the
/// mutex) and on the whole machine (a lock file in the temp dir, which the
/// kernel drops if the holder dies), so two checkouts' suites or a benchmark
/// run side by side never boot two VMs at once on two cores.
pub(crate) struct OneVm {
    _machine: std::fs::File,
    _binary: std::sync::MutexGuard<'static, ()>,
}

pub(crate) fn one_vm() -> OneVm {
    let binary = ONE_VM.lock().unwrap_or_else(|e| e.into_inner());
    let path = std::env::temp_dir().join("dormant-tests-one-vm.lock");
    let machine = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .unwrap_or_else(|e| panic!("opening {}: {e}", path.display()));
    machine
        .lock()
        .unwrap_or_else(|e| panic!("locking {}: {e}", path.display()));
    OneVm {
        _machine: machine,
        _binary: binary,
    }
}

/// The directory holding base.qcow2, vmlinuz and initrd.img.
pub(crate) fn image_dir() -> PathBuf {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        if let Some(d) = std::env::var_os("DORMANT_TEST_QEMU_IMAGE").filter(|d| !d.is_empty()) {
            return PathBuf::from(d);
        }
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/build-test-image.sh");
        let out = Command::new(&script)
            .output()
            .unwrap_or_else(|e| panic!("running {}: {e}", script.display()));
        assert!(
            out.status.success(),
            "{} failed (run scripts/install-test-deps.sh first; it needs root):\n{}",
            script.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        PathBuf::from(
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .last()
                .unwrap_or("")
                .trim(),
        )
    })
    .clone()
}

fn qemu_rig(suspend_mode: &str) -> Rig {
    qemu_rig_with(suspend_mode, "")
}

/// `extra`: settings appended after the `[qemu]` table (other tables).
fn qemu_rig_with(suspend_mode: &str, extra: &str) -> Rig {
    qemu_rig_full(suspend_mode, "", extra)
}

/// As [`qemu_rig_with`], with `ssh` added to the `[ssh]` table.
pub(crate) fn qemu_rig_full(suspend_mode: &str, ssh: &str, extra: &str) -> Rig {
    let img = image_dir();
    for f in ["base.qcow2", "vmlinuz", "initrd.img"] {
        assert!(
            img.join(f).is_file(),
            "the test VM image has no {f} in {}: run scripts/build-test-image.sh",
            img.display()
        );
    }
    assert!(
        Command::new("qemu-system-x86_64")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success()),
        "qemu-system-x86_64 is not installed: run scripts/install-test-deps.sh"
    );
    // A VM may be powered off while it still boots (a prepare killed after
    // the launch): the guest drops the presses until it has booted far
    // enough (dormant presses again every 10 s), so its ACPI power-off takes
    // the rest of its boot (up to boot_timeout, 400 s under TCG on a loaded
    // machine) and its shutdown; the tests that check a clean power-off must
    // not depend on load.
    Rig::new(
        RUNNER,
        SYSTEM,
        &format!(
            "provider = \"qemu\"\nprepare_timeout = \"10m\"\n\
             [ssh]\nready_timeout = \"2m\"\n{ssh}\
             [qemu]\naccel = \"tcg\"\ncpus = 2\nmemory_mib = 1024\nrestrict_network = true\n\
             boot_timeout = \"400s\"\nshutdown_timeout = \"600s\"\nmax_environments = 1\n\
             suspend_mode = \"{suspend_mode}\"\n\
             image = {{ disk = \"{d}/base.qcow2\", kernel = \"{d}/vmlinuz\", initrd = \"{d}/initrd.img\" }}\n\
             {extra}",
            d = img.display()
        ),
    )
}

pub(crate) fn env_paths(rig: &Rig, job: &SimJob) -> EnvPaths {
    EnvPaths::new(
        &rig.state_dir,
        dormant::identity::new_env_id(RUNNER, job.id),
    )
}

/// Live QEMU processes whose command line names this environment.
pub(crate) fn qemu_pids(env: &EnvPaths) -> Vec<i32> {
    let name = format!("dormant-{}", env.id);
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
                let args: Vec<&[u8]> = c.split(|b| *b == 0).collect();
                args.first()
                    .is_some_and(|a| String::from_utf8_lossy(a).contains("qemu"))
                    && args.contains(&name.as_bytes())
            }) && process_running(*pid)
        })
        .collect()
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// `cloud-init schema` from the host's cloud-init: Ok, or its complaint.
pub(crate) fn cloud_init_schema(user_data: &str) -> Result<(), String> {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("user-data");
    std::fs::write(&file, user_data).unwrap();
    let out = Command::new("cloud-init")
        .args(["schema", "--config-file"])
        .arg(&file)
        .output()
        .expect("cloud-init is not installed: run scripts/install-test-deps.sh");
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

#[test]
fn the_user_data_every_provider_sends_is_valid_cloud_config() {
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("k");
    let st = Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-f"])
        .arg(&key)
        .status()
        .unwrap();
    assert!(st.success());
    let public = std::fs::read_to_string(key.with_extension("pub")).unwrap();
    let id = uuid::Uuid::new_v4();
    for user in ["debian", "root"] {
        let text = dormant::provider::cloud_init::user_data(id, Some(&public), user).unwrap();
        cloud_init_schema(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    }
    // The validator does fail (so the checks above mean something).
    assert!(cloud_init_schema("#cloud-config\nssh_authorized_keys: 5\n").is_err());
    assert!(cloud_init_schema("#cloud-config\nssh_authorized_keys: [\n").is_err());
}

#[cfg(feature = "ec2")]
#[test]
fn ec2_sends_the_same_user_data_as_qemu() {
    use dormant::provider::MachineSpec;
    let id = uuid::Uuid::new_v4();
    let public =
        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIJb5kG0r9Yd7m1t8j1oT0p9H2l9mX0c6w2k8b0a1c2d3 x";
    let settings = dormant::settings::ec2::Ec2Settings::default();
    let spec = MachineSpec {
        env_id: id,
        name: MachineSpec::machine_name(id),
        runner_id: "1".into(),
        system_id: "s".into(),
        project_id: 1,
        job_id: 1,
        image: None,
        variables: Default::default(),
        ssh_public_key: Some(public.into()),
        paths: EnvPaths::new(Path::new("/nonexistent"), id),
        volume: None,
    };
    let encoded = dormant::provider::ec2::launch::user_data(&spec, &settings).unwrap();
    let decoded = aws_smithy_types::base64::decode(&encoded).unwrap();
    let text = String::from_utf8(decoded).unwrap();
    assert_eq!(
        text,
        dormant::provider::cloud_init::user_data(id, Some(public), &settings.ssh_user).unwrap()
    );
    cloud_init_schema(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
}

/// A shell command (a runner_sim hook, run on the host between prepare and
/// the job's steps) logging in to the VM with nothing but the environment's
/// own key and its pinned host key, writing what it saw to `out`.
fn login_with_env_key_only(env: &EnvPaths, out: &Path) -> String {
    let port_of = format!(
        "sed -n 's/.*\"port\": *\"\\([0-9]*\\)\".*/\\1/p' {}",
        env.record.display()
    );
    format!(
        "port=$({port_of}); ssh -F /dev/null -o IdentitiesOnly=yes -o BatchMode=yes -i {key} \
         -o UserKnownHostsFile={kh} -o GlobalKnownHostsFile=/dev/null -o StrictHostKeyChecking=yes \
         -o HostKeyAlias=dormant-{id} -p \"$port\" {USER}@127.0.0.1 'echo logged-in-as-$(id -un)' > {out} 2>&1",
        key = env.ssh_key.display(),
        kh = env.known_hosts.display(),
        id = env.id,
        out = out.display()
    )
}

#[test]
fn a_vm_powers_off_keeping_its_disk_and_a_later_job_boots_it_again() {
    let _one = one_vm();
    let rig = qemu_rig("shutdown");
    let login_out = rig.dir.path().join("login.txt");
    let first = job(91)
        .suspend_on(true, false)
        .script("echo kept-on-disk > state.txt; uname -n");
    let env = env_paths(&rig, &first);
    let login_cmd = login_with_env_key_only(&env, &login_out);
    // How the running QEMU is detached: its stdio, session and QMP socket mode.
    let detached_out = rig.dir.path().join("detached.txt");
    let vm = env.dir.join("vm");
    let detached_cmd = format!(
        "pid=$(cat {vm}/qemu.pid); {{ readlink /proc/$pid/fd/0 /proc/$pid/fd/1 /proc/$pid/fd/2; \
         echo \"session $(ps -o sid= -p $pid | tr -d ' ') pid $pid\"; stat -c 'qmp %a' {vm}/qmp.sock; }} > {out}",
        vm = vm.display(),
        out = detached_out.display()
    );
    let r = rig.run_with_command_before(
        &first,
        "build_script",
        &format!("{login_cmd}\n{detached_cmd}"),
    );
    assert_result(&r, JobResult::Success);
    let key = r.key.clone().expect("the key is printed");
    assert!(key.contains("provider=qemu"), "{key}");
    assert_eq!(
        rig.status(&key).as_deref(),
        Some("suspended"),
        "{}",
        r.cleanup_output()
    );

    // cloud-init installed the environment's key from the seed dormant built.
    let login = std::fs::read_to_string(&login_out).unwrap();
    assert_eq!(login.trim(), format!("logged-in-as-{USER}"), "{login}");
    let seed_user_data = std::fs::read_to_string(env.dir.join("vm/user-data")).unwrap();
    let public = std::fs::read_to_string(env.ssh_key.with_extension("pub")).unwrap();
    assert_eq!(
        seed_user_data,
        dormant::provider::cloud_init::user_data(env.id, Some(&public), USER).unwrap()
    );
    cloud_init_schema(&seed_user_data).unwrap();

    // QEMU ran detached: stdio on /dev/null, its own session, a private QMP socket.
    let detached = std::fs::read_to_string(&detached_out).unwrap();
    let lines: Vec<&str> = detached.lines().collect();
    assert_eq!(&lines[..3], &["/dev/null"; 3], "{detached}");
    let session: Vec<&str> = lines[3].split_whitespace().collect();
    // SAFETY: getsid(0) has no preconditions.
    let ours = unsafe { libc::getsid(0) }.to_string();
    assert_ne!(
        session[1], ours,
        "QEMU runs in a session of its own, not the runner's: {detached}"
    );
    assert_eq!(lines[4], "qmp 600", "{detached}");

    // Suspended: powered off, disk kept.
    assert!(
        qemu_pids(&env).is_empty(),
        "no QEMU runs for a powered-off VM"
    );
    assert!(env.dir.join("vm/overlay.qcow2").is_file());
    assert!(
        r.cleanup_output().contains("powered off"),
        "{}",
        r.cleanup_output()
    );
    let pinned = std::fs::read_to_string(&env.known_hosts).unwrap();
    // As if a hibernation had been interrupted while saving memory: the
    // partial image is never restored; the resume boots the disk and says so.
    std::fs::write(vm.join("memory.state.partial"), b"half a memory image").unwrap();

    let mut second = job(91)
        .resume(&key)
        .script("cat state.txt; test ! -e .fetched-by-job-2");
    second.get_sources = "touch .fetched-by-job-2".into();
    let pinned_in_job_2 = rig.dir.path().join("known_hosts.job2");
    let copy_pin = format!(
        "cp {} {}",
        env.known_hosts.display(),
        pinned_in_job_2.display()
    );
    // Its first prepare is killed as soon as QEMU runs: the runner's cleanup
    // puts the environment back to suspended, powering off a VM that has
    // only just started to boot, whose guest drops the power button until
    // systemd-logind listens (about 50 s into a TCG boot here). It is
    // pressed again until it powers off (before, it was quit after the whole
    // shutdown_timeout, 600 s here). The retry boots it again.
    let killer = PrepareKiller::start(&rig, &env, true);
    let r2 = rig.run_with_command_before(&second, "build_script", &copy_pin);
    let killed = killer.stop();
    // (A QEMU caught daemonizing is two processes.)
    assert!(
        !killed.is_empty(),
        "a prepare killed mid-boot: {}",
        r2.log()
    );
    assert_eq!(r2.prepare_attempts, 2, "{}", r2.log());
    let c2 = r2.cleanup_output();
    assert!(
        c2.contains("powering off VM")
            && c2.contains(
                "pressing it again every 10 s (a guest that is still booting ignores the button)"
            )
            && c2.contains("powered off in")
            && !c2.contains("did not power off"),
        "the VM powered off mid-boot: {c2}"
    );
    assert_result(&r2, JobResult::Success);
    assert!(r2.log().contains("kept-on-disk"), "{}", r2.log());
    assert!(
        r2.log().contains("did not complete") && r2.log().contains("memory lost, disk kept"),
        "{}",
        r2.log()
    );
    assert!(r2.log().contains("skipping get_sources"), "{}", r2.log());
    assert!(
        r2.log().contains("host key matches the one pinned"),
        "{}",
        r2.log()
    );
    assert_eq!(
        std::fs::read_to_string(&pinned_in_job_2).unwrap(),
        pinned,
        "the pinned host key is unchanged after the reboot"
    );
    eprintln!(
        "job 1:\n{}\n{}\njob 2:\n{}\n{}",
        r.log(),
        r.cleanup_output(),
        r2.log(),
        r2.cleanup_output()
    );

    // No trigger in job 2: released.
    assert!(
        qemu_pids(&env).is_empty(),
        "release left QEMU running: {}",
        r2.cleanup_output()
    );
    assert!(!env.dir.exists(), "release left {}", env.dir.display());
}

#[test]
fn a_hibernated_vm_resumes_with_its_processes_running_and_its_clock_set() {
    let _one = one_vm();
    let rig = qemu_rig("hibernate");
    let first = job(92).suspend_on(true, false).script(
        "setsid bash -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/counter.new; mv /tmp/counter.new /tmp/counter; sleep 1; done' \
         </dev/null >/dev/null 2>&1 & sleep 3; echo \"counter-at-suspend $(cat /tmp/counter)\"",
    );
    let env = env_paths(&rig, &first);
    let r = rig.run(&first);
    assert_result(&r, JobResult::Success);
    let key = r.key.clone().expect("the key is printed");
    assert_eq!(
        rig.status(&key).as_deref(),
        Some("suspended"),
        "{}",
        r.cleanup_output()
    );
    assert!(
        r.cleanup_output().contains("hibernated"),
        "{}",
        r.cleanup_output()
    );
    assert!(qemu_pids(&env).is_empty(), "hibernation quits QEMU");
    assert!(
        env.dir.join("vm/memory.state").is_file(),
        "the memory image is beside the disk"
    );
    let at_suspend: u64 = field(&r.log(), "counter-at-suspend");

    // Long enough that a guest clock left as it was would be far off.
    std::thread::sleep(Duration::from_secs(30));

    let second = job(92).resume(&key).script(
        "a=$(cat /tmp/counter); sleep 3; b=$(cat /tmp/counter); \
         echo \"counter-before $a\"; echo \"counter-after $b\"; echo \"guest-epoch $(date +%s)\"",
    );
    let before = now();
    let r2 = rig.run(&second);
    let after = now();
    assert_result(&r2, JobResult::Success);
    assert!(r2.log().contains("restored"), "{}", r2.log());
    assert!(
        r2.log().contains("guest clock set from its RTC"),
        "{}",
        r2.log()
    );
    let (a, b): (u64, u64) = (
        field(&r2.log(), "counter-before"),
        field(&r2.log(), "counter-after"),
    );
    assert!(
        a >= at_suspend,
        "the counter went on from {at_suspend}, not from scratch: {a}"
    );
    assert!(
        b > a,
        "the background process still runs after the restore: {a} then {b}"
    );
    let guest: u64 = field(&r2.log(), "guest-epoch");
    assert!(
        guest + 3 >= before && guest <= after + 3,
        "the guest clock ({guest}) is within a few seconds of the host's ({before}..{after})"
    );
    assert!(
        !env.dir.join("vm/memory.state").exists() || !env.dir.exists(),
        "a restored memory image is deleted: it must never be restored twice"
    );
    assert!(
        qemu_pids(&env).is_empty(),
        "release quit QEMU: {}",
        r2.cleanup_output()
    );
    assert!(!env.dir.exists());
}

pub(crate) fn field(log: &str, name: &str) -> u64 {
    log.lines()
        .find_map(|l| l.trim().strip_prefix(name)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name:?} line in the job log:\n{log}"))
}

/// `dormant prepare` processes of this rig (found by the state dir in their environment).
fn prepare_pids(state_dir: &Path) -> Vec<i32> {
    let marker = format!("DORMANT_STATE_DIR={}", state_dir.display());
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let args: Vec<&[u8]> = cmd.split(|b| *b == 0).collect();
            args.first().is_some_and(|a| a.ends_with(b"dormant"))
                && args.iter().any(|a| *a == b"prepare")
                && std::fs::read(format!("/proc/{pid}/environ"))
                    .is_ok_and(|e| e.split(|b| *b == 0).any(|v| v == marker.as_bytes()))
        })
        .collect()
}

/// Kills the rig's `dormant prepare` as soon as a QEMU of the environment
/// runs that it has not seen before (mid-boot): every attempt, or with
/// `once` only the first.
struct PrepareKiller {
    done: std::sync::Arc<std::sync::atomic::AtomicBool>,
    killed: std::sync::Arc<Mutex<Vec<i32>>>,
    thread: std::thread::JoinHandle<()>,
}

impl PrepareKiller {
    fn start(rig: &Rig, env: &EnvPaths, once: bool) -> PrepareKiller {
        let killed = std::sync::Arc::new(Mutex::new(Vec::new()));
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let thread = {
            let (env, killed, done) = (env.clone(), killed.clone(), done.clone());
            let state_dir = rig.state_dir.clone();
            std::thread::spawn(move || {
                while !done.load(std::sync::atomic::Ordering::Relaxed) {
                    let qemus = qemu_pids(&env);
                    let fresh: Vec<i32> = qemus
                        .iter()
                        .copied()
                        .filter(|p| !killed.lock().unwrap().contains(p))
                        .collect();
                    if !fresh.is_empty() {
                        for pid in prepare_pids(&state_dir) {
                            // SAFETY: kill(2) on a dormant prepare of this test's own rig.
                            unsafe { libc::kill(pid, libc::SIGKILL) };
                        }
                        killed.lock().unwrap().extend(fresh);
                        if once {
                            return;
                        }
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            })
        };
        PrepareKiller {
            done,
            killed,
            thread,
        }
    }

    /// Stops looking; the QEMUs whose prepare was killed.
    fn stop(self) -> Vec<i32> {
        self.done.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().unwrap();
        let killed = self.killed.lock().unwrap().clone();
        killed
    }
}

#[test]
fn prepare_killed_mid_boot_leaves_no_qemu_after_the_runners_cleanup() {
    let _one = one_vm();
    let rig = qemu_rig("shutdown");
    let j = job(93).script("echo never-runs");
    let env = env_paths(&rig, &j);
    let killer = PrepareKiller::start(&rig, &env, false);
    let r = rig.run(&j);
    let killed = killer.stop();
    assert!(
        !killed.is_empty(),
        "no prepare was killed mid-boot: {}",
        r.log()
    );
    assert!(
        matches!(r.result, JobResult::SystemFailure),
        "every prepare attempt was killed: {:?}\n{}",
        r.result,
        r.log()
    );
    for pid in &killed {
        assert!(
            !process_running(*pid),
            "QEMU {pid} of a killed prepare outlived the cleanup: {}",
            r.cleanup_output()
        );
    }
    assert!(qemu_pids(&env).is_empty(), "{}", r.cleanup_output());
    assert!(
        !env.dir.join("vm").exists(),
        "cleanup released the VM: {}",
        r.cleanup_output()
    );
}

/// The test's own look at a VM's QEMU over its QMP socket (dormant's client).
fn qmp(env: &EnvPaths) -> Qmp {
    Qmp::connect(&env.dir.join("vm/qmp.sock")).unwrap()
}

/// QEMU's migration (memory save) status: `active`, `completed`, ...
fn migration_status(env: &EnvPaths) -> String {
    qmp(env).execute("query-migrate", None).unwrap()["status"]
        .as_str()
        .unwrap_or("none")
        .to_string()
}

/// Arms the `qemu:hibernate-saving` failpoint for this rig's jobs, held
/// back: it fires once, at the first hibernation after the returned marker
/// file is removed (so a job's cleanup is killed, not the hibernation its
/// prepare may do while recovering the environment).
fn arm_hibernate_saving(rig: &mut Rig) -> PathBuf {
    let marker = rig.dir.path().join(format!("fired-{}", job_id()));
    std::fs::write(&marker, "").unwrap();
    rig.runner
        .env
        .insert("DORMANT_FAILPOINT".into(), "qemu:hibernate-saving".into());
    rig.runner.env.insert(
        "DORMANT_FAILPOINT_ONCE".into(),
        marker.display().to_string(),
    );
    marker
}

fn disarm(rig: &mut Rig) {
    rig.runner.env.remove("DORMANT_FAILPOINT");
    rig.runner.env.remove("DORMANT_FAILPOINT_ONCE");
}

/// Kills this environment's QEMU when a test ends, so a failed assertion
/// leaves no VM behind (release does it on success).
pub(crate) struct NoVmLeft(pub(crate) EnvPaths);

impl Drop for NoVmLeft {
    fn drop(&mut self) {
        for pid in qemu_pids(&self.0) {
            // SAFETY: kill(2) on a QEMU whose command line names this test's environment.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

/// Runs `job`; just before its build_script, `at_build` sees the VM from the host.
fn run_observed(rig: &Rig, job: &SimJob, at_build: &mut dyn FnMut()) -> JobReport {
    let mut ran = false;
    let r = rig
        .runner
        .run_job_with(job, &mut |stage| {
            if stage == "build_script" {
                at_build();
                ran = true;
            }
        })
        .unwrap();
    assert!(ran, "the job never reached build_script: {}", r.log());
    r
}

/// The files of the VM directory whose name starts with `memory.state`.
fn memory_images(env: &EnvPaths) -> Vec<String> {
    let mut found: Vec<String> = std::fs::read_dir(env.dir.join("vm"))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("memory.state"))
                .collect()
        })
        .unwrap_or_default();
    found.sort();
    found
}

/// The background counter of the hibernation tests, recognisable by its `$0`.
/// It writes through a rename: a `cat` between `>`'s truncation and the
/// write read nothing (seen once, beside a busy loop).
const COUNTER: &str =
    "setsid bash -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/counter.new; mv /tmp/counter.new /tmp/counter; sleep 1; done' \
     dormant-counter </dev/null >/dev/null 2>&1 &";
/// A job step printing the counter twice, 2 s apart, and how many counters run
/// (the `[r]` keeps pgrep from matching this very script).
const READ_COUNTER: &str = "a=$(cat /tmp/counter 2>/dev/null || echo 0); sleep 2; \
     b=$(cat /tmp/counter 2>/dev/null || echo 0); echo \"counter-before $a\"; echo \"counter-after $b\"; \
     echo \"counters-running $(pgrep -cf 'dormant-counte[r]')\"";

/// Claims whose holder died count as gone after this (`suspend.claim_grace`).
pub(crate) const GRACE: &str = "[suspend]\nclaim_grace = \"1s\"\n";
pub(crate) const PAST_GRACE: Duration = Duration::from_millis(2100);

/// One VM through every way a hibernation can be cut short:
/// 1. cleanup SIGKILLed while QEMU still writes the memory (a save held
///    so it outlasts the grace): the next job's recovery cancels that save,
///    continues the VM, hibernates it anew and restores it;
/// 2. cleanup SIGKILLed after QEMU finished the save on its own (the VM left
///    in `postmigrate`, which refuses a second save until continued): the same;
/// 3. a clean hibernation, its image then damaged: the resume warns, boots the
///    disk (memory lost, disk kept: with the files written just before the
///    suspend, which the guest synced), and the job runs.
///
/// In 1 and 2 the background counter started in job 1 still runs, and no
/// image is left once a VM runs.
#[test]
fn hibernations_cut_short_keep_memory_and_a_damaged_image_boots_the_disk() {
    let _one = one_vm();
    let mut rig = qemu_rig_with("hibernate", GRACE);

    // Job 1: a counter, a file; its cleanup is killed mid-save. The save is
    // held (QEMU's `pause-before-switchover` capability, set over QMP in this
    // process) so it is still running when job 2 comes, however slow the
    // machine: like a large guest's. (A hibernate-mode VM's save writes only
    // its device state, in well under a second: bandwidth cannot slow it.
    // Job 2 cancels the held save; a save dormant runs in that QEMU later
    // gives the held step its go itself.)
    let fire = arm_hibernate_saving(&mut rig);
    let first = job(94).suspend_on(true, false).script(&format!(
        "{COUNTER} echo kept-on-disk > kept.txt; sleep 3; echo \"counter-at-suspend $(cat /tmp/counter)\""
    ));
    let env = env_paths(&rig, &first);
    let _no_vm_left = NoVmLeft(env.clone());
    let r1 = run_observed(&rig, &first, &mut || {
        std::fs::remove_file(&fire).unwrap();
        qmp(&env)
            .execute(
                "migrate-set-capabilities",
                Some(serde_json::json!({ "capabilities": [
                    { "capability": "pause-before-switchover", "state": true }
                ] })),
            )
            .unwrap();
    });
    assert_result(&r1, JobResult::Success);
    let key = r1.key.clone().expect("the key is printed");
    let at_suspend: u64 = field(&r1.log(), "counter-at-suspend");
    assert!(
        r1.cleanup_output()
            .contains("failpoint qemu:hibernate-saving"),
        "{}",
        r1.cleanup_output()
    );
    assert_eq!(rig.status(&key).as_deref(), Some("suspending"));
    std::thread::sleep(PAST_GRACE);
    assert_eq!(qemu_pids(&env).len(), 1, "QEMU lives on without dormant");
    assert_eq!(
        migration_status(&env),
        "pre-switchover",
        "the held save still runs past the grace"
    );

    // Job 2 resumes: its prepare recovers the environment from the dead
    // cleanup (cancels the save, continues, hibernates anew), then restores it.
    // Its own cleanup is killed mid-save too; this save is not held (a
    // restored QEMU is a new process, with default settings).
    let fire = arm_hibernate_saving(&mut rig);
    let second = job(94)
        .resume(&key)
        .suspend_on(true, false)
        .script(READ_COUNTER);
    let mut seen = (0, Vec::new());
    let r2 = run_observed(&rig, &second, &mut || {
        seen = (qemu_pids(&env).len(), memory_images(&env));
        std::fs::remove_file(&fire).unwrap();
    });
    assert_result(&r2, JobResult::Success);
    let log2 = r2.log();
    for line in [
        "which has no process left",
        "still saving its memory for an interrupted hibernation (pre-switchover): cancelling that save",
        "hibernated",
        "restored",
    ] {
        assert!(log2.contains(line), "{line:?} not in the job log:\n{log2}");
    }
    assert_eq!(
        seen,
        (1, Vec::new()),
        "one QEMU, no memory image while it runs"
    );
    let (a, b): (u64, u64) = (
        field(&log2, "counter-before"),
        field(&log2, "counter-after"),
    );
    assert!(
        a >= at_suspend && b > a,
        "the counter went on: {at_suspend}, {a}, {b}\n{log2}"
    );
    assert_eq!(field(&log2, "counters-running"), 1, "{log2}");
    assert!(
        r2.cleanup_output()
            .contains("failpoint qemu:hibernate-saving"),
        "{}",
        r2.cleanup_output()
    );

    // QEMU finishes that save by itself and keeps the VM paused.
    let until = std::time::Instant::now() + Duration::from_secs(120);
    while migration_status(&env) != "completed" {
        assert!(
            std::time::Instant::now() < until,
            "QEMU never finished the save"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(qmp(&env).status().unwrap(), "postmigrate");
    assert_eq!(memory_images(&env), vec!["memory.state.partial"]);
    std::thread::sleep(PAST_GRACE);

    // Job 3: recovered again (the paused VM continued, hibernated anew),
    // restored, the counter still going; its own cleanup hibernates cleanly.
    disarm(&mut rig);
    // Its last write is still in the guest's page cache when cleanup begins.
    let third = job(94)
        .resume(&key)
        .suspend_on(true, false)
        .script(&format!(
            "{READ_COUNTER}; echo written-just-before-suspend > fresh.txt"
        ));
    let r3 = run_observed(&rig, &third, &mut || {
        seen = (qemu_pids(&env).len(), memory_images(&env))
    });
    assert_result(&r3, JobResult::Success);
    let log3 = r3.log();
    for line in [
        "which has no process left",
        "was postmigrate: continuing it",
        "hibernated",
        "restored",
    ] {
        assert!(log3.contains(line), "{line:?} not in the job log:\n{log3}");
    }
    assert_eq!(
        seen,
        (1, Vec::new()),
        "one QEMU, no memory image while it runs"
    );
    let (a3, b3): (u64, u64) = (
        field(&log3, "counter-before"),
        field(&log3, "counter-after"),
    );
    assert!(
        a3 >= b && b3 > a3,
        "the counter went on: {b}, {a3}, {b3}\n{log3}"
    );
    assert_eq!(field(&log3, "counters-running"), 1, "{log3}");
    assert!(
        r3.cleanup_output().contains("hibernated")
            && !r3
                .cleanup_output()
                .contains("did not write its cached files"),
        "{}",
        r3.cleanup_output()
    );
    assert_eq!(rig.status(&key).as_deref(), Some("suspended"));
    assert!(qemu_pids(&env).is_empty(), "hibernation quits QEMU");
    assert_eq!(memory_images(&env), vec!["memory.state"]);

    // Job 4: the image is damaged (cut in half): the disk is booted instead.
    let image = env.dir.join("vm/memory.state");
    let size = std::fs::metadata(&image).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&image)
        .unwrap()
        .set_len(size / 2)
        .unwrap();
    let fourth = job(94)
        .resume(&key)
        .script(&format!("cat kept.txt fresh.txt; {READ_COUNTER}"));
    let r4 = run_observed(&rig, &fourth, &mut || {
        seen = (qemu_pids(&env).len(), memory_images(&env))
    });
    assert_result(&r4, JobResult::Success);
    let log4 = r4.log();
    for line in [
        "restoring the saved memory of VM",
        "QEMU exited while loading it",
        "booting from its disk instead (memory lost, disk kept)",
        "kept-on-disk",
        // Synced before the save: the disk has what the guest wrote last.
        "written-just-before-suspend",
    ] {
        assert!(log4.contains(line), "{line:?} not in the job log:\n{log4}");
    }
    assert!(!log4.contains(" restored in "), "{log4}");
    assert_eq!(seen, (1, Vec::new()), "one QEMU, no memory image left");
    assert_eq!(
        field(&log4, "counters-running"),
        0,
        "memory lost: the counter is gone\n{log4}"
    );
    eprintln!(
        "job 1:\n{}\n{}\njob 2:\n{log2}\n{}\njob 3:\n{log3}\n{}\njob 4:\n{log4}\n{}",
        r1.log(),
        r1.cleanup_output(),
        r2.cleanup_output(),
        r3.cleanup_output(),
        r4.cleanup_output()
    );

    // No trigger in job 4: released.
    assert!(qemu_pids(&env).is_empty(), "{}", r4.cleanup_output());
    assert!(!env.dir.exists(), "release left {}", env.dir.display());
    assert!(rig.status(&key).is_none());
}
