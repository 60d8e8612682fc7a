//! Warm VMs (`[qemu] warm`) with real VMs, one test walking the pool's life:
//!
//! 1. `dormant warm` boots a warm VM before any job exists;
//! 2. a new job's prepare takes it: the job's commands run in that very QEMU
//!    (its pid, started before the job began), the log says so, and the
//!    prepare starts a detached refill, which boots a second warm VM;
//! 3. the job suspends (the VM powers off); its resume boots the
//!    environment's disk under the environment's own name and paths (a
//!    command line built from the settings, as for any environment: the one
//!    the hand-over rewrote is used only by a hibernated VM's restore, proven
//!    in the kill test below): the file is there, get_sources skipped — and
//!    the VM of that finished job is never in the pool again;
//! 4. the base image is replaced: `dormant sweep` retires the warm VM made
//!    from the old one instead of handing it out;
//! 5. `dormant warm` boots one from the new image; `warm = 0` and `dormant
//!    sweep` retire it: no warm VM, no QEMU of the state dir left.
//!
//! The warm VMs count toward `max_environments = 3`: a refill boots only
//! while two slots are free, so with a job's VM and one warm VM running the
//! pool can still be refilled (at most two VMs at once: the job's and the
//! one booting; otherwise one VM at a time on the machine, `one_vm`).

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::harness::*;
use crate::qemu::{env_paths, image_dir, one_vm, qemu_pids, NoVmLeft, RUNNER, SYSTEM};

fn settings(base: &Path, warm: u32) -> String {
    let d = image_dir();
    format!(
        "provider = \"qemu\"\nprepare_timeout = \"10m\"\n\
         [ssh]\nready_timeout = \"2m\"\n\
         [qemu]\naccel = \"tcg\"\ncpus = 2\nmemory_mib = 1024\nrestrict_network = true\n\
         boot_timeout = \"400s\"\nshutdown_timeout = \"600s\"\nmax_environments = 3\n\
         warm = {warm}\n\
         image = {{ disk = \"{base}\", kernel = \"{d}/vmlinuz\", initrd = \"{d}/initrd.img\" }}\n",
        base = base.display(),
        d = d.display()
    )
}

/// The pool as `dormant list --json` shows it: (id, status) of each warm machine.
fn pool(rig: &Rig) -> Vec<(String, String)> {
    rig.warm_pool()
}

/// Live QEMU processes started under the name `dormant-<id>`.
fn qemu_named(id: &str) -> Vec<i32> {
    qemu_pids(&dormant::state::EnvPaths::new(
        Path::new("/nonexistent"),
        uuid::Uuid::parse_str(id).unwrap(),
    ))
}

/// Every live QEMU whose command line points into `dir`.
fn qemu_under(dir: &Path) -> Vec<i32> {
    let needle = dir.display().to_string();
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
                let text = String::from_utf8_lossy(&c);
                text.contains("qemu") && text.contains(&needle)
            }) && process_running(*pid)
        })
        .collect()
}

/// Waits (bounded: a TCG boot under load takes minutes) until the pool has a
/// ready machine other than `not`; returns its id.
fn wait_for_ready(rig: &Rig, not: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(900);
    loop {
        let p = pool(rig);
        if let Some((id, _)) = p.iter().find(|(id, s)| s == "ready" && id != not) {
            return id.clone();
        }
        assert!(
            Instant::now() < deadline,
            "no new ready warm VM after 15 min: {p:?}; refill log:\n{}",
            std::fs::read_to_string(rig.state_dir.join("warm/refill.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_secs(2));
    }
}

/// Waits until no refill holds the pool's lock (a detached one may still be
/// booting, or finishing after its VM became ready; a TCG boot under load
/// takes minutes).
fn wait_no_refill(rig: &Rig) {
    let path = rig.state_dir.join("warm/refill.lock");
    let deadline = Instant::now() + Duration::from_secs(900);
    loop {
        let f = std::fs::File::open(&path).unwrap();
        if f.try_lock().is_ok() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "a refill still runs after 15 min"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// No QEMU runs: none of the paths warm VMs opened their disks through is
/// left (`<state dir>/qemu-paths/<warm id>`, removed once its QEMU is gone).
fn assert_no_alias_left(rig: &Rig) {
    let left: Vec<String> = std::fs::read_dir(rig.state_dir.join("qemu-paths"))
        .map(|d| {
            d.filter_map(|e| Some(e.ok()?.file_name().to_string_lossy().into_owned()))
                .collect()
        })
        .unwrap_or_default();
    assert!(left.is_empty(), "aliases left in qemu-paths/: {left:?}");
}

/// Kills every QEMU of the rig's state dir when the test ends (a failed
/// assertion must not leave warm VMs behind).
struct NoPoolLeft(std::path::PathBuf);

impl Drop for NoPoolLeft {
    fn drop(&mut self) {
        for pid in qemu_under(&self.0) {
            // SAFETY: kill(2) on a QEMU whose command line points into this test's state dir.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

#[test]
fn a_new_job_takes_the_warm_vm_booted_before_it_and_the_pool_is_refilled() {
    let _one = one_vm();
    let dir = tempfile::tempdir().unwrap();
    // The base image: an overlay of the test image (cheap to make), so that
    // "a new image" is a new file at the same path. Environments are made on
    // a pinned copy of it (`pins.rs`, tests/integration/qemu_pins.rs), so
    // replacing it changes only what new VMs are made from.
    let base = dir.path().join("base.qcow2");
    let make_base = || {
        let _ = std::fs::remove_file(&base);
        let st = Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2", "-F", "qcow2", "-b"])
            .arg(image_dir().join("base.qcow2"))
            .arg(&base)
            .status()
            .unwrap();
        assert!(st.success());
    };
    make_base();
    let rig = Rig::new(RUNNER, SYSTEM, &settings(&base, 1));
    let _no_pool = NoPoolLeft(rig.state_dir.clone());

    // 1. Booted before any job.
    let out = rig.dormant(&["warm"]);
    assert!(
        out.status.success(),
        "dormant warm: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let p = pool(&rig);
    assert_eq!(p.len(), 1, "{p:?}");
    let (w1, status) = p[0].clone();
    assert_eq!(status, "ready");
    let w1_pids = qemu_named(&w1);
    assert_eq!(w1_pids.len(), 1, "one QEMU for warm VM {w1}");
    // Its host key, pinned when it booted (under its own name).
    let warm_pin = std::fs::read_to_string(rig.state_dir.join(format!("warm/{w1}/known_hosts")))
        .unwrap()
        .replace(&format!("dormant-{w1}"), "OWNER");
    assert_eq!(warm_pin.lines().count(), 1, "{warm_pin}");

    // 2. A new job takes it.
    let job1 = job(97)
        .suspend_on(true, false)
        .script("echo kept-on-disk > state.txt");
    let env = env_paths(&rig, &job1);
    let _no_vm = NoVmLeft(env.clone());
    let seen = dir.path().join("pid-at-build.txt");
    let r = rig.run_with_command_before(
        &job1,
        "build_script",
        &format!(
            "cat {} > {}",
            env.dir.join("vm/qemu.pid").display(),
            seen.display()
        ),
    );
    assert_result(&r, JobResult::Success);
    let prepare = r.log();
    assert!(
        prepare.contains(&format!("took warm machine {w1}")),
        "{prepare}"
    );
    assert!(
        prepare.contains("refilling the warm pool in the background"),
        "{prepare}"
    );
    assert!(
        !prepare.contains("answers SSH on"),
        "the job waited for no boot: {prepare}"
    );
    let pid_at_build: i32 = std::fs::read_to_string(&seen)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_eq!(
        pid_at_build, w1_pids[0],
        "the job ran in the QEMU `dormant warm` started before it"
    );
    let key = r.key.clone().expect("the key is printed");
    assert_eq!(
        rig.status(&key).as_deref(),
        Some("suspended"),
        "{}",
        r.cleanup_output()
    );
    // The job's connections checked the VM against the pin from its boot:
    // the environment holds that one pin, under its own name, and no other.
    let env_pin = std::fs::read_to_string(&env.known_hosts)
        .unwrap()
        .replace(&format!("dormant-{}", env.id), "OWNER");
    assert_eq!(
        env_pin, warm_pin,
        "no host key was taken on trust after the boot"
    );

    // The refill boots another; the machine of the job is not in the pool.
    let w2 = wait_for_ready(&rig, &w1);
    wait_no_refill(&rig);
    assert!(
        pool(&rig).iter().all(|(id, _)| *id != w1),
        "the taken VM is never in the pool again"
    );
    assert!(qemu_named(&w1).is_empty(), "job 1's VM powered off");

    // 3. The resume boots the environment's disk under its own name.
    let mut job2 = job(97)
        .resume(&key)
        .script("cat state.txt; test ! -e .fetched-again");
    job2.get_sources = "touch .fetched-again".into();
    let r2 = rig.run(&job2);
    assert_result(&r2, JobResult::Success);
    assert!(r2.log().contains("kept-on-disk"), "{}", r2.log());
    assert!(r2.log().contains("skipping get_sources"), "{}", r2.log());
    assert!(
        !r2.log().contains("took warm machine"),
        "a machine-mode resume boots its own disk: {}",
        r2.log()
    );
    assert!(
        qemu_pids(&env).is_empty(),
        "released: {}",
        r2.cleanup_output()
    );
    assert!(pool(&rig).iter().any(|(id, _)| *id == w2));

    // 4. A new base image: the warm VM made from the old one is retired.
    std::thread::sleep(Duration::from_millis(20));
    make_base();
    let out = rig.dormant(&["sweep"]);
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains(&format!("retired {w2}")) && text.contains("settings that changed"),
        "{text}"
    );
    assert!(qemu_named(&w2).is_empty(), "the retired VM's QEMU is gone");
    assert!(pool(&rig).is_empty());

    // 5. One from the new image; warm = 0 and a sweep retire it, and
    //    nothing of the pool is left.
    let out = rig.dormant(&["warm"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let p = pool(&rig);
    assert!(p.len() == 1 && p[0].1 == "ready", "{p:?}");
    let w3 = p[0].0.clone();
    assert_eq!(qemu_named(&w3).len(), 1, "warm VM {w3} runs");
    Rig::write_settings(&rig.settings_path, SYSTEM, &settings(&base, 0));
    let out = rig.dormant(&["sweep"]);
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains(&format!("retired {w3}")) && text.contains("not wanted: warm = 0"),
        "{text}"
    );
    assert!(qemu_named(&w3).is_empty(), "the retired VM's QEMU is gone");
    assert!(pool(&rig).is_empty());
    assert!(
        qemu_under(&rig.state_dir).is_empty(),
        "no QEMU of the state dir runs"
    );
    assert_no_alias_left(&rig);
}

/// `dormant warm` killed by its failpoint: it printed the last words and died of SIGKILL.
fn assert_warm_killed_at(out: &std::process::Output, point: &str) {
    use std::os::unix::process::ExitStatusExt;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("dormant: failpoint {point}: SIGKILL"))
            && out.status.signal() == Some(9),
        "dormant warm was not SIGKILLed at {point} ({:?}):\n{err}",
        out.status
    );
}

/// kill -9 during a refill and during a hand-out (real VMs, four boots):
/// 1. a refill killed after its VM booted, before it was ready: the next
///    refill retires that VM (its QEMU gone) and boots another;
/// 2. a prepare killed right after it marked a warm VM taken, and
/// 3. one killed half-way through moving the VM into the environment: each
///    time the runner's retry finishes the same hand-over, the job runs in
///    that warm VM's QEMU, and no other job ever gets it; the second job
///    suspends by hibernation (`suspend_mode = "hibernate"`), and its resume
///    restores the VM from memory with the command line the hand-over
///    rewrote (the killed attempt rewrote it, the retry moved the directory):
///    QEMU runs under the environment's name and paths, and the process the
///    job left in the guest is still counting;
/// 4. nothing is left: no warm VM, no QEMU of the state dir.
#[test]
fn a_kill_during_a_refill_or_a_hand_out_leaks_nothing_and_hands_out_nothing_twice() {
    let _one = one_vm();
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.qcow2");
    let st = Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-F", "qcow2", "-b"])
        .arg(image_dir().join("base.qcow2"))
        .arg(&base)
        .status()
        .unwrap();
    assert!(st.success());
    let mut rig = Rig::new(
        RUNNER,
        SYSTEM,
        &format!("{}suspend_mode = \"hibernate\"\n", settings(&base, 1)),
    );
    let _no_pool = NoPoolLeft(rig.state_dir.clone());

    // 1. A refill killed after the boot, before `ready`.
    crate::crash::arm(&mut rig, Some("warm:launched"), false);
    let out = rig.dormant(&["warm"]);
    assert_warm_killed_at(&out, "warm:launched");
    let p = pool(&rig);
    assert_eq!(p.len(), 1, "{p:?}");
    let (w0, status) = p[0].clone();
    assert_eq!(status, "launching");
    assert_eq!(qemu_named(&w0).len(), 1, "its VM runs");
    crate::crash::arm(&mut rig, None, false);
    let out = rig.dormant(&["warm"]);
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains(&format!("retired {w0}")) && text.contains("launch was killed"),
        "{text}"
    );
    assert!(
        qemu_named(&w0).is_empty(),
        "the killed launch's VM is not leaked"
    );
    let w1 = wait_for_ready(&rig, &w0);

    // 2 and 3. A prepare killed during the hand-out; the runner retries it.
    let mut taken = vec![w0.clone()];
    let mut warm = w1;
    for (n, point) in ["warm:taken", "warm:qemu-relabelled"]
        .into_iter()
        .enumerate()
    {
        let pid = qemu_named(&warm);
        assert_eq!(pid.len(), 1, "warm VM {warm} runs");
        crate::crash::arm(&mut rig, Some(point), true);
        // The second leaves a process counting in the guest, and suspends.
        let hibernates = point == "warm:qemu-relabelled";
        let job = if hibernates {
            job(98 + n as u64).suspend_on(true, false).script(COUNTER)
        } else {
            job(98 + n as u64).script("echo ran-on-warm")
        };
        let env = env_paths(&rig, &job);
        let _no_vm = NoVmLeft(env.clone());
        let seen = dir.path().join(format!("pid-{n}.txt"));
        let r = rig.run_with_command_before(
            &job,
            "build_script",
            &format!(
                "cat {} > {}",
                env.dir.join("vm/qemu.pid").display(),
                seen.display()
            ),
        );
        crate::crash::assert_killed_at(&rig, &r.calls, point, 1);
        assert_result(&r, JobResult::Success);
        assert_eq!(r.prepare_attempts, 2, "{}", r.log());
        assert!(
            r.log().contains(&format!("took warm machine {warm}")),
            "{}",
            r.log()
        );
        let at_build: i32 = std::fs::read_to_string(&seen)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert_eq!(at_build, pid[0], "the retry finished the same hand-over");
        crate::crash::arm(&mut rig, None, false);
        taken.push(warm.clone());
        // Released at the job's end (no trigger), or hibernated: the warm
        // VM's QEMU is gone for good.
        assert!(qemu_named(&warm).is_empty(), "{}", r.cleanup_output());
        warm = wait_for_ready(&rig, &warm);
        wait_no_refill(&rig);
        assert!(
            pool(&rig).iter().all(|(id, _)| !taken.contains(id)),
            "no taken VM is back in the pool"
        );
        if hibernates {
            let project = 98 + n as u64;
            restore_after_hand_over(&rig, &r, project, &env, &taken[taken.len() - 1], dir.path());
        }
    }

    // 4. Nothing left.
    Rig::write_settings(&rig.settings_path, SYSTEM, &settings(&base, 0));
    let out = rig.dormant(&["sweep"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(pool(&rig).is_empty());
    assert!(
        qemu_under(&rig.state_dir).is_empty(),
        "no QEMU of the state dir runs"
    );
    assert_no_alias_left(&rig);
}

/// A job script that leaves a process counting seconds in the guest
/// (`/tmp/counter`), and prints where it was.
const COUNTER: &str =
    "setsid bash -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/counter.new; \
     mv /tmp/counter.new /tmp/counter; sleep 1; done' </dev/null >/dev/null 2>&1 & sleep 3; \
     echo \"counter-at-suspend $(cat /tmp/counter)\"";

/// `r` (a job of `project` on warm VM `warm`, environment `env`) hibernated its VM: the
/// resume restores it from memory with the command line the hand-over
/// rewrote — QEMU runs under the environment's name and paths, none of the
/// warm VM's — and the process the job left still counts; then it is
/// released (no trigger).
fn restore_after_hand_over(
    rig: &Rig,
    r: &JobReport,
    project: u64,
    env: &dormant::state::EnvPaths,
    warm: &str,
    dir: &Path,
) {
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
    assert!(env.dir.join("vm/memory.state").is_file(), "a memory image");
    let at_suspend = crate::qemu::field(&r.log(), "counter-at-suspend");
    let cmdline = dir.join("cmdline-at-resume.txt");
    let resume = job(project).resume(&key).script(
        "a=$(cat /tmp/counter); sleep 3; b=$(cat /tmp/counter); \
         echo \"counter-before $a\"; echo \"counter-after $b\"",
    );
    let r2 = rig.run_with_command_before(
        &resume,
        "build_script",
        &format!(
            "tr '\\0' ' ' < /proc/$(cat {})/cmdline > {}",
            env.dir.join("vm/qemu.pid").display(),
            cmdline.display()
        ),
    );
    assert_result(&r2, JobResult::Success);
    assert!(r2.log().contains("restored"), "{}", r2.log());
    let (a, b) = (
        crate::qemu::field(&r2.log(), "counter-before"),
        crate::qemu::field(&r2.log(), "counter-after"),
    );
    assert!(
        a >= at_suspend && b > a,
        "the process runs on: {at_suspend} at the suspend, then {a}, {b}"
    );
    let argv = std::fs::read_to_string(&cmdline).unwrap();
    assert!(
        argv.contains(&format!("dormant-{}", env.id))
            && argv.contains(&env.dir.display().to_string())
            && !argv.contains(warm),
        "the restored QEMU runs as the environment's, none of warm VM {warm}'s: {argv}"
    );
    assert!(
        qemu_pids(env).is_empty(),
        "released: {}",
        r2.cleanup_output()
    );
}

/// Volume mode on warm VMs: a new environment takes one (its data disk
/// hot-plugged); after its suspension the base image is replaced; the warm
/// VM made from the old image is retired, and the resume takes one booted
/// from the new image: the project file is there, get_sources is skipped,
/// and the marker file is the new image's (the VM is from today's image).
#[test]
fn a_volume_mode_resume_takes_a_warm_vm_from_todays_image() {
    let _one = one_vm();
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.qcow2");
    crate::qemu_volume::marked_image(&image_dir().join("base.qcow2"), &base, "image-one");
    let volume_settings = |warm: u32| {
        format!(
            "{}storage = \"volume\"\nvolume_size = \"1G\"\n",
            settings(&base, warm)
        )
    };
    let mut rig = Rig::new(RUNNER, SYSTEM, &volume_settings(1));
    let _no_pool = NoPoolLeft(rig.state_dir.clone());
    let out = rig.dormant(&["warm"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let w1 = pool(&rig)[0].0.clone();

    let job1 = job(99)
        .suspend_on(true, false)
        .script("echo kept-on-volume > state.txt; cat /etc/dormant-test-marker");
    let env = env_paths(&rig, &job1);
    let _no_vm = NoVmLeft(env.clone());
    let r = rig.run(&job1);
    assert_result(&r, JobResult::Success);
    assert!(
        r.log().contains(&format!("took warm machine {w1}")),
        "{}",
        r.log()
    );
    assert!(r.log().contains("image-one"), "{}", r.log());
    let key = r.key.clone().expect("the key is printed");
    assert!(key.contains("storage=volume"), "{key}");
    assert_eq!(rig.status(&key).as_deref(), Some("suspended"));
    assert!(
        qemu_named(&w1).is_empty(),
        "a suspended volume-mode environment has no VM"
    );
    let w2 = wait_for_ready(&rig, &w1);
    wait_no_refill(&rig);

    // A new image: the warm VM made from the old one is not handed out.
    std::fs::remove_file(&base).unwrap();
    crate::qemu_volume::marked_image(&image_dir().join("base.qcow2"), &base, "image-two");
    let out = rig.dormant(&["warm"]);
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    assert!(text.contains(&format!("retired {w2}")), "{text}");
    let w3 = pool(&rig)
        .into_iter()
        .find(|(_, s)| s == "ready")
        .expect("a warm VM from the new image")
        .0;

    let mut job2 = job(99)
        .resume(&key)
        .script("cat state.txt; cat /etc/dormant-test-marker; test ! -e .fetched-again");
    job2.get_sources = "touch .fetched-again".into();
    let r2 = rig.run(&job2);
    assert_result(&r2, JobResult::Success);
    let log = r2.log();
    assert!(log.contains(&format!("took warm machine {w3}")), "{log}");
    assert!(log.contains("kept-on-volume"), "{log}");
    assert!(
        log.contains("image-two") && !log.contains("image-one"),
        "{log}"
    );
    assert!(log.contains("skipping get_sources"), "{log}");
    wait_no_refill(&rig);

    Rig::write_settings(&rig.settings_path, SYSTEM, &volume_settings(0));
    rig.runner.env.remove("DORMANT_FAILPOINT");
    let out = rig.dormant(&["sweep"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(pool(&rig).is_empty());
    assert!(
        qemu_under(&rig.state_dir).is_empty(),
        "no QEMU of the state dir runs"
    );
    assert_no_alias_left(&rig);
}
