//! The qemu provider's volume mode with real VMs (`storage = "volume"`): one
//! environment through the scenario, with a process SIGKILLed at a
//! detach step and at an attach step on the way, in four boots:
//!
//! 1. job 1 (new) writes a file in `CI_PROJECT_DIR` and one in `$HOME`; its
//!    cleanup is killed right after recording the detach (the guest had
//!    unmounted the data disk; QEMU still runs); `dormant sweep` finishes it:
//!    no QEMU, no VM directory (no root overlay), the data disk kept;
//! 2. the base image is replaced by another one (a marker file differs);
//! 3. job 2 resumes: its first prepare is killed once the new VM runs with
//!    the disk attached, before it recorded that; the runner's cleanup deletes
//!    that VM, the retried prepare boots another from the new image. The
//!    project file is there, the `$HOME` file is not, the marker is the new
//!    image's, get_sources was skipped, the new VM's host key was pinned
//!    with old and new fingerprints recorded. Before its after_script the
//!    first VM's pin is put back behind dormant's back: that stage's new
//!    connection is refused (a key change on a machine dormant did not just
//!    launch); the next stage has the right pin again, and the job's suspend
//!    unmounts the disk in the guest and stops QEMU;
//! 4. `dormant release` leaves nothing: no QEMU, no disk, no directory.
//!
//! The data disk is hot-plugged into each VM (it boots without it), and the
//! guest's mount command formats it on the first mount. The second test
//! drives the provider itself on one VM: a hot-plug left half done (the block
//! node added, the device not: a process killed between the two QMP commands)
//! is finished by the next attach, a further attach adds nothing, and the
//! guest finds the disk by its serial.

use std::path::Path;
use std::process::Command;

use crate::harness::*;
use crate::qemu::{
    cloud_init_schema, env_paths, image_dir, one_vm, qemu_pids, NoVmLeft, GRACE, PAST_GRACE,
    RUNNER, SYSTEM,
};

/// A copy of the test image with `/etc/dormant-test-marker` holding
/// `marker`: raw copy, one debugfs write, back to qcow2 (seconds, no debootstrap).
pub(crate) fn marked_image(base: &Path, out: &Path, marker: &str) {
    let raw = out.with_extension("raw");
    let run = |cmd: &mut Command| {
        let o = cmd.output().unwrap();
        assert!(
            o.status.success(),
            "{cmd:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    };
    run(Command::new("qemu-img")
        .args(["convert", "-f", "qcow2", "-O", "raw"])
        .arg(base)
        .arg(&raw));
    let src = out.with_extension("marker");
    std::fs::write(&src, format!("{marker}\n")).unwrap();
    run(Command::new("debugfs")
        .arg("-w")
        .arg("-R")
        .arg(format!("write {} /etc/dormant-test-marker", src.display()))
        .arg(&raw));
    run(Command::new("qemu-img")
        .args(["convert", "-f", "raw", "-O", "qcow2"])
        .arg(&raw)
        .arg(out));
    std::fs::remove_file(&raw).unwrap();
}

/// The rig's settings; `shutdown_timeout` is long for the reason given in
/// `qemu.rs` (a VM powered off while it boots: the killed attempt's below).
fn settings(disk: &Path) -> String {
    let d = image_dir();
    format!(
        "provider = \"qemu\"\nprepare_timeout = \"10m\"\n\
         [ssh]\nready_timeout = \"2m\"\n\
         [qemu]\naccel = \"tcg\"\ncpus = 2\nmemory_mib = 1024\nrestrict_network = true\n\
         boot_timeout = \"400s\"\nshutdown_timeout = \"600s\"\nmax_environments = 1\n\
         storage = \"volume\"\nvolume_size = \"1G\"\n\
         image = {{ disk = \"{disk}\", kernel = \"{d}/vmlinuz\", initrd = \"{d}/initrd.img\" }}\n\
         {GRACE}",
        disk = disk.display(),
        d = d.display()
    )
}

fn arm_once(rig: &mut Rig, point: &str) {
    rig.runner
        .env
        .insert("DORMANT_FAILPOINT".into(), point.into());
    rig.runner.env.insert(
        "DORMANT_FAILPOINT_ONCE".into(),
        rig.dir
            .path()
            .join(format!("fired-{}", job_id()))
            .display()
            .to_string(),
    );
}

fn disarm(rig: &mut Rig) {
    rig.runner.env.remove("DORMANT_FAILPOINT");
    rig.runner.env.remove("DORMANT_FAILPOINT_ONCE");
}

fn text(o: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// What a suspended volume-mode environment holds: its data disk, no VM.
fn assert_only_the_volume(rig: &Rig, env: &dormant::state::EnvPaths, key: &str, what: &str) {
    assert_eq!(rig.status(key).as_deref(), Some("suspended"), "{what}");
    assert!(qemu_pids(env).is_empty(), "{what}: QEMU still runs");
    assert!(
        !env.dir.join("vm").exists(),
        "{what}: the VM (root overlay) was not deleted"
    );
    assert!(
        env.dir.join("volume/data.qcow2").is_file(),
        "{what}: the data disk is gone"
    );
    let rec = rig.record(key).unwrap();
    assert!(rec["machine"].is_null(), "{what}: {rec}");
    assert_eq!(rec["volume"]["step"], "detached", "{what}: {rec}");
}

#[test]
fn volume_mode_keeps_the_project_on_its_disk_across_new_vms_and_crashes() {
    let _one = one_vm();
    let mut rig = Rig::new(RUNNER, SYSTEM, "");
    let img = rig.dir.path().join("img");
    std::fs::create_dir(&img).unwrap();
    let base = img.join("base.qcow2");
    std::os::unix::fs::symlink(image_dir().join("base.qcow2"), &base).unwrap();
    let image_b = img.join("image-b.qcow2");
    marked_image(&image_dir().join("base.qcow2"), &image_b, "image-b");
    Rig::write_settings(&rig.settings_path, SYSTEM, &settings(&base));

    // Job 1: its cleanup killed right after recording the detach.
    arm_once(&mut rig, "volume:detach-intent");
    let first = job(95).suspend_on(true, false).script(
        "echo precious > kept.txt; echo mine > \"$HOME/home.txt\"; \
         echo \"marker $(cat /etc/dormant-test-marker 2>/dev/null || echo none)\"; \
         echo \"source $(findmnt -n -o SOURCE --target \"$PWD\")\"; \
         echo \"mark $(cat /dormant/.dormant-volume)\"; pwd",
    );
    let env = env_paths(&rig, &first);
    let _no_vm_left = NoVmLeft(env.clone());
    let mut seed = String::new();
    let mut launch = String::new();
    let r1 = rig
        .runner
        .run_job_with(&first, &mut |stage| {
            if stage == "build_script" {
                seed = std::fs::read_to_string(env.dir.join("vm/user-data")).unwrap();
                launch = std::fs::read_to_string(env.dir.join("vm/launch.json")).unwrap();
            }
        })
        .unwrap();
    assert_result(&r1, JobResult::Success);
    let key = r1.key.clone().expect("the key is printed");
    assert!(key.contains("storage=volume"), "{key}");
    let log1 = r1.log();
    for line in [
        "hot-plugged the data disk into VM",
        "formatted the data volume",
        "marker none",
        "source /dev/vdc",
        &format!("mark {}", env.id),
        "/dormant/builds/",
    ] {
        assert!(log1.contains(line), "{line:?} not in job 1's log:\n{log1}");
    }
    // The VM booted without the disk (it was hot-plugged into the empty
    // root port), and cloud-init was not asked to format or mount it (the
    // guest's mount command did, after the hot-plug).
    assert!(
        launch.contains("pcie-root-port,id=dormant-data-port") && !launch.contains("data.qcow2"),
        "{launch}"
    );
    assert!(
        !seed.contains("fs_setup") && !seed.contains("mounts") && !seed.contains("dormant-data"),
        "{seed}"
    );
    cloud_init_schema(&seed).unwrap_or_else(|e| panic!("{e}\n{seed}"));
    let c1 = r1.cleanup_output();
    assert!(c1.contains("unmounted"), "the guest unmounted first: {c1}");
    assert!(c1.contains("failpoint volume:detach-intent"), "{c1}");
    assert_eq!(rig.status(&key).as_deref(), Some("suspending"));
    assert_eq!(qemu_pids(&env).len(), 1, "killed before QEMU was stopped");
    let pin_1 = std::fs::read_to_string(&env.known_hosts).unwrap();
    let pin_1_copy = rig.dir.path().join("known_hosts.job1");
    std::fs::write(&pin_1_copy, &pin_1).unwrap();

    // The sweep finishes the suspend: QEMU stopped, VM deleted, disk kept.
    disarm(&mut rig);
    std::thread::sleep(PAST_GRACE);
    let out = rig.dormant(&["sweep"]);
    assert!(out.status.success(), "{}", text(&out));
    assert_only_the_volume(&rig, &env, &key, "after the sweep");

    // The base image is replaced.
    std::fs::remove_file(&base).unwrap();
    std::os::unix::fs::symlink(&image_b, &base).unwrap();

    // Job 2: its first prepare killed once the new VM has the disk attached.
    arm_once(&mut rig, "volume:attached");
    let mut second = job(95).resume(&key).suspend_on(true, false).script(
        "test \"$(cat kept.txt)\" = precious || { echo 'kept.txt lost' >&2; exit 7; }; \
             test ! -e \"$HOME/home.txt\" || { echo 'home.txt survived' >&2; exit 8; }; \
             test ! -e .fetched-by-job-2 || exit 9; \
             echo \"marker $(cat /etc/dormant-test-marker 2>/dev/null || echo none)\"",
    );
    second.get_sources = "touch .fetched-by-job-2".into();
    second.after_script = Some("echo after".into());
    // Before after_script: the master gone and the first VM's pin put back.
    let control = env.control_dir.clone();
    let tamper = format!(
        "for s in {ctl}/.ssh-connection*/master; do ssh -S \"$s\" -O exit none 2>/dev/null; done; \
         cp {pin} {kh}",
        ctl = control.display(),
        pin = pin_1_copy.display(),
        kh = env.known_hosts.display()
    );
    // The next stage finds its own pin back (its connection is refused
    // otherwise too, and a failing stage after after_script fails the job).
    let pin_2_copy = rig.dir.path().join("known_hosts.job2");
    let mut pin_2 = String::new();
    let mut tampered = false;
    let r2 = rig
        .runner
        .run_job_with(&second, &mut |stage| {
            if stage == "after_script" {
                pin_2 = std::fs::read_to_string(&env.known_hosts).unwrap();
                std::fs::write(&pin_2_copy, &pin_2).unwrap();
                Command::new("sh").arg("-c").arg(&tamper).status().unwrap();
                tampered = true;
            } else if tampered {
                std::fs::copy(&pin_2_copy, &env.known_hosts).unwrap();
                tampered = false;
            }
        })
        .unwrap();
    disarm(&mut rig);
    assert_result(&r2, JobResult::Success);
    assert_eq!(r2.prepare_attempts, 2, "killed once, retried: {}", r2.log());
    let log2 = r2.log();
    for line in [
        "failpoint volume:attached",
        "marker image-b",
        "skipping get_sources",
        "fresh from the image",
        "host key of the new machine",
        // The later connection with the first VM's pin put back is refused.
        "has changed",
    ] {
        assert!(log2.contains(line), "{line:?} not in job 2's log:\n{log2}");
    }
    assert_ne!(pin_2, pin_1, "the new VM's key is pinned");
    let rec = rig.record(&key).unwrap();
    let changes = rec["host_key_changes"].as_array().unwrap();
    assert!(!changes.is_empty(), "{rec}");
    let last = changes.last().unwrap();
    assert_ne!(last["old"], last["new"], "{rec}");
    let c2 = r2.cleanup_output();
    assert!(
        c2.contains("powering off VM") && c2.contains("powered off"),
        "the killed attempt's VM (its disk attached, not recorded) is powered off by the \
         runner's cleanup, its guest unmounting the disk itself: {c2}"
    );
    assert!(
        c2.contains("the guest unmounted its data disk: stopping QEMU"),
        "the job's own suspend: {c2}"
    );
    assert_only_the_volume(&rig, &env, &key, "after job 2");
    eprintln!("job 1:\n{log1}\n{c1}\njob 2:\n{log2}\n{c2}",);

    // Release: nothing is left.
    let out = rig.dormant(&["release", &key]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(rig.status(&key).is_none());
    assert!(qemu_pids(&env).is_empty());
    assert!(!env.dir.exists(), "release left {}", env.dir.display());
}

/// The test's own QMP command on the VM of `env`.
fn qmp_execute(
    env: &dormant::state::EnvPaths,
    cmd: &str,
    args: Option<serde_json::Value>,
) -> serde_json::Value {
    dormant::provider::qemu::qmp::Qmp::connect(&env.dir.join("vm/qmp.sock"))
        .unwrap()
        .execute(cmd, args)
        .unwrap()
}

#[tokio::test]
async fn a_half_done_hot_plug_is_finished_and_a_second_attach_adds_nothing() {
    use dormant::provider::qemu::{hotplug, QemuProvider};
    use dormant::provider::{MachineSpec, Provider, VolumeSpec, Volumes};

    let _one = one_vm();
    let dir = tempfile::tempdir().unwrap();
    let state_dir = dir.path().join("state");
    let toml = format!(
        "state_dir = \"{}\"\n{}",
        state_dir.display(),
        settings(&image_dir().join("base.qcow2"))
    );
    let settings = dormant::settings::Settings::parse_str(&toml).unwrap();
    let store = dormant::state::StateStore::open(&state_dir).unwrap();
    let provider = QemuProvider::new(&settings, &store);
    let (log, said) = dormant::context::JobLog::capture();
    let ctx =
        dormant::context::Ctx::new(log, Default::default(), std::time::Duration::from_secs(600));
    let said = move || String::from_utf8_lossy(&said.lock().unwrap()).into_owned();

    let id = uuid::Uuid::new_v4();
    let env = store.env_paths(id);
    let _no_vm_left = NoVmLeft(env.clone());
    std::fs::create_dir_all(&env.dir).unwrap();
    let public = dormant::transport::keys::ensure_keypair(&env).unwrap();
    let mut spec = MachineSpec {
        env_id: id,
        name: MachineSpec::machine_name(id),
        runner_id: RUNNER.into(),
        system_id: SYSTEM.into(),
        project_id: 1,
        job_id: 1,
        image: None,
        variables: Default::default(),
        ssh_public_key: Some(public),
        paths: env.clone(),
        volume: None,
    };
    let vspec = VolumeSpec {
        env_id: id,
        name: spec.name.clone(),
        runner_id: spec.runner_id.clone(),
        system_id: spec.system_id.clone(),
        project_id: 1,
        job_id: 1,
        paths: env.clone(),
        machine: Some(spec.clone()),
        beside: None,
    };
    let volume = provider.create_volume(&vspec, &ctx).await.unwrap();
    spec.volume = Some(volume.clone());
    let machine = provider.create_or_reclaim(&spec, &ctx).await.unwrap();
    let disk = env.dir.join("volume/data.qcow2");
    let data_blocks = |blocks: &serde_json::Value| -> Vec<String> {
        blocks
            .as_array()
            .unwrap()
            .iter()
            .filter(|b| b["qdev"].as_str().unwrap_or("").contains(hotplug::DEVICE))
            .map(|b| b["inserted"]["file"].as_str().unwrap_or("").to_string())
            .collect()
    };
    assert!(
        data_blocks(&qmp_execute(&env, "query-block", None)).is_empty(),
        "the VM booted without its data disk"
    );

    // Killed between the two QMP commands: the block node is there, no device.
    qmp_execute(&env, "blockdev-add", Some(hotplug::blockdev_args(&disk)));
    provider.attach(&volume, &machine, &ctx).await.unwrap();
    assert!(
        said().contains("finished hot-plugging the data disk into VM"),
        "{}",
        said()
    );
    provider.attach(&volume, &machine, &ctx).await.unwrap();
    assert!(said().contains("has its data disk already"), "{}", said());
    assert_eq!(
        data_blocks(&qmp_execute(&env, "query-block", None)),
        [disk.display().to_string()],
        "one data disk device, on the environment's disk"
    );

    // The guest finds it by its serial (it waits for the hot-plug to reach it).
    let port = machine.field("port").unwrap();
    let out = Command::new("ssh")
        .args(["-F", "/dev/null", "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes"])
        .args(["-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null"])
        .arg("-i")
        .arg(&env.ssh_key)
        .args(["-p", port, "debian@127.0.0.1"])
        .arg(
            "for i in $(seq 600); do [ -e /dev/disk/by-id/virtio-dormant-data ] && break; sleep 0.1; done; \
             echo \"dev $(readlink -f /dev/disk/by-id/virtio-dormant-data)\"; \
             echo \"size $(cat /sys/class/block/$(basename $(readlink -f /dev/disk/by-id/virtio-dormant-data))/size)\"",
        )
        .output()
        .unwrap();
    let seen = text(&out);
    assert!(out.status.success(), "{seen}");
    // volume_size = "1G": 2097152 sectors of 512 bytes.
    assert!(
        seen.contains("dev /dev/vd") && seen.contains("size 2097152"),
        "{seen}"
    );

    provider.delete(&machine, &ctx).await.unwrap();
    provider.delete_volume(&volume, &ctx).await.unwrap();
    assert!(qemu_pids(&env).is_empty());
}
