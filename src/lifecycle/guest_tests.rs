//! Unit tests of the guest's mount and unmount commands, run by a local bash
//! on a directory standing in for the volume, and of the mount's device
//! lookup on a directory standing in for `/dev` (the mount of a real device
//! runs in the qemu tests, on a real second disk).

use super::*;
use crate::context::JobLog;
use crate::transport::local::LocalTransport;

fn ctx() -> (Ctx, std::sync::Arc<std::sync::Mutex<Vec<u8>>>) {
    let (log, buf) = JobLog::capture();
    (
        Ctx::new(
            log,
            tokio_util::sync::CancellationToken::new(),
            Duration::from_secs(30),
        ),
        buf,
    )
}

fn bash(dir: &std::path::Path) -> LocalTransport {
    let path = std::env::var("PATH").unwrap_or_default();
    LocalTransport::new(
        dir.to_path_buf(),
        "bash".into(),
        vec![("PATH".into(), path)],
    )
}

fn mount_of(dir: &std::path::Path) -> GuestMount {
    GuestMount {
        devices: Vec::new(),
        mountpoint: dir.join("vol").display().to_string(),
        user_dirs: vec![
            dir.join("vol/builds").display().to_string(),
            dir.join("vol/cache with space").display().to_string(),
        ],
    }
}

#[tokio::test]
async fn the_first_mount_marks_the_volume_and_later_ones_require_the_mark() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("vol")).unwrap();
    let t = bash(dir.path());
    let m = mount_of(dir.path());
    let id = Uuid::new_v4();
    let (c, buf) = ctx();
    // Not the first mount, and no mark: refused, nothing written.
    let e = mount(&t, &m, id, false, &c).await.unwrap_err();
    assert!(format!("{e:#}").contains("wiped or replaced"), "{e:#}");
    assert!(!dir.path().join("vol").join(MARK).exists());
    // The first mount marks it and makes the user's dirs.
    mount(&t, &m, id, true, &c).await.unwrap();
    let mark = std::fs::read_to_string(dir.path().join("vol").join(MARK)).unwrap();
    assert_eq!(mark.trim(), id.to_string());
    assert!(dir.path().join("vol/builds").is_dir());
    assert!(dir.path().join("vol/cache with space").is_dir());
    let log = String::from_utf8(buf.lock().unwrap().clone()).unwrap();
    assert!(log.contains("mounted "), "{log}");
    // Later mounts find the mark.
    mount(&t, &m, id, false, &c).await.unwrap();
    // Another environment's volume is refused, first mount or not.
    for first in [false, true] {
        let e = mount(&t, &m, Uuid::new_v4(), first, &c).await.unwrap_err();
        assert!(
            format!("{e:#}").contains(&format!("belongs to environment {id}")),
            "{e:#}"
        );
    }
}

#[tokio::test]
async fn a_missing_mount_point_and_a_failing_shell_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let t = bash(dir.path());
    let (c, _) = ctx();
    let e = mount(&t, &mount_of(dir.path()), Uuid::nil(), true, &c)
        .await
        .unwrap_err();
    assert!(format!("{e:#}").contains("does not exist"), "{e:#}");
    // A command that fails without saying why: its exit code and stderr.
    let out = ExecOutput {
        code: Some(3),
        stdout: "noise\n".into(),
        stderr: "sudo: a password is required\n".into(),
    };
    let e = said(&out, &c).unwrap_err();
    assert!(
        format!("{e:#}").contains("exit code 3") && format!("{e:#}").contains("password"),
        "{e:#}"
    );
}

#[tokio::test]
async fn unmounting_a_volume_without_a_device_only_syncs() {
    let dir = tempfile::tempdir().unwrap();
    let t = bash(dir.path());
    let (c, buf) = ctx();
    unmount(&t, &mount_of(dir.path()), &c).await.unwrap();
    let log = String::from_utf8(buf.lock().unwrap().clone()).unwrap();
    assert!(log.contains("unmounted"), "{log}");
}

#[test]
fn the_commands_quote_what_they_are_given() {
    let m = GuestMount {
        devices: vec![
            "/dev/disk/by-id/virtio-dormant-data".into(),
            "/dev/it's".into(),
        ],
        mountpoint: "/dormant".into(),
        user_dirs: vec!["/dormant/builds".into(), "/dormant/x'y".into()],
    };
    let text = mount_script(&m, Uuid::nil(), true);
    assert!(text.starts_with("M='/dormant';"), "{text}");
    assert!(
        text.contains(r#"set -- '/dev/disk/by-id/virtio-dormant-data' '/dev/it'\''s'"#),
        "{text}"
    );
    assert!(text.contains(r#"'/dormant/x'\''y'"#), "{text}");
    assert!(text.contains("FIRST=1"), "{text}");
    assert!(!mount_script(&m, Uuid::nil(), false).contains("FIRST=1"));
    assert!(unmount_script(&m).starts_with("BLOCK=1; M='/dormant'"));
}

/// A directory standing in for the guest's `/dev`, and the names the EC2
/// provider gives a data volume there: the Nitro serial, the Xen names.
struct FakeDev {
    dir: tempfile::TempDir,
    names: Vec<String>,
}

impl FakeDev {
    fn new() -> FakeDev {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("dev/disk/by-id")).unwrap();
        // As `provider::ec2::volume::guest_devices` names volume vol-0abc.
        let names = [
            "dev/disk/by-id/nvme-Amazon_Elastic_Block_Store_vol0abc",
            "dev/xvdf",
            "dev/sdf",
        ]
        .iter()
        .map(|n| dir.path().join(n).display().to_string())
        .collect();
        FakeDev { dir, names }
    }

    fn path(&self, rel: &str) -> std::path::PathBuf {
        self.dir.path().join(rel)
    }

    /// The volume's mount command, waiting `wait` for the device; not the
    /// first mount (a device found is never formatted by these tests).
    fn mount(&self, wait: Duration, t: &LocalTransport) -> String {
        let m = GuestMount {
            devices: self.names.clone(),
            mountpoint: self.path("mnt").display().to_string(),
            user_dirs: Vec::new(),
        };
        let script = mount_script_waiting(&m, Uuid::nil(), false, wait);
        let (c, _) = ctx();
        let out = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(t.exec(&script, Duration::from_secs(60), &c))
            .unwrap();
        assert_ne!(out.code, Some(0), "{out:?}");
        out.stdout
    }
}

#[test]
fn the_mount_takes_only_a_device_named_for_the_volume() {
    let dev = FakeDev::new();
    let t = bash(dev.dir.path());
    // Other disks are there (the root disk, another volume's NVMe disk, the
    // next Xen name): none of them is taken, however long the wait.
    for other in [
        "dev/xvda",
        "dev/xvdg",
        "dev/disk/by-id/nvme-Amazon_Elastic_Block_Store_vol0def",
    ] {
        std::fs::write(dev.path(other), "").unwrap();
    }
    let said = dev.mount(Duration::from_secs(1), &t);
    assert!(
        said.contains("did not appear in the machine within 1 s as any of:")
            && said.contains(&dev.names[0])
            && said.contains(&dev.names[1]),
        "{said}"
    );
    // A name of the volume that is not a block device is refused, not used.
    std::fs::write(dev.path("dev/xvdf"), "").unwrap();
    let said = dev.mount(Duration::from_secs(1), &t);
    assert!(
        said.contains(&format!("{} is not a block device", dev.names[1])),
        "{said}"
    );
    // With the Nitro serial there too, that is the one taken.
    std::fs::write(&dev.names[0], "").unwrap();
    let said = dev.mount(Duration::from_secs(1), &t);
    assert!(
        said.contains(&format!("{} is not a block device", dev.names[0])),
        "{said}"
    );
}

#[test]
fn the_mount_waits_for_the_xen_name_to_appear() {
    let dev = FakeDev::new();
    // `sleep` makes `/dev/sdf` appear on its first call, i.e. after the
    // first look found nothing: the lookup must keep looking and take it.
    let bin = dev.path("bin");
    std::fs::create_dir(&bin).unwrap();
    let real_sleep = which("sleep");
    std::fs::write(
        bin.join("sleep"),
        format!(
            "#!/bin/sh\n[ -e {sdf} ] || {{ touch {sdf}; echo appeared >> {log}; }}\nexec {real_sleep} \"$@\"\n",
            sdf = dev.names[2],
            log = dev.path("sleeps").display(),
        ),
    )
    .unwrap();
    let mut perms = std::fs::metadata(bin.join("sleep")).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
    std::fs::set_permissions(bin.join("sleep"), perms).unwrap();
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let t = LocalTransport::new(
        dev.dir.path().to_path_buf(),
        "bash".into(),
        vec![("PATH".into(), path)],
    );
    assert!(!std::path::Path::new(&dev.names[2]).exists());
    let said = dev.mount(Duration::from_secs(30), &t);
    assert!(
        said.contains(&format!("{} is not a block device", dev.names[2])),
        "{said}"
    );
    let sleeps = std::fs::read_to_string(dev.path("sleeps")).unwrap();
    assert_eq!(sleeps, "appeared\n");
}

#[test]
fn the_device_lookup_takes_a_block_device() {
    // A real block device of this machine, linked under the Xen name: the
    // lookup alone (it only looks: nothing is read or written) takes it.
    let dev = FakeDev::new();
    let block = std::fs::read_dir("/dev")
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| {
            std::fs::metadata(p)
                .is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_block_device(&m.file_type()))
        })
        .expect("this test needs a block device node in /dev (none found)");
    std::os::unix::fs::symlink(&block, &dev.names[1]).unwrap();
    let find = find_device(&dev.names, Duration::from_secs(1));
    let m = GuestMount {
        devices: dev.names.clone(),
        mountpoint: "/x".into(),
        user_dirs: Vec::new(),
    };
    // The same text is the mount command's device part.
    assert!(mount_script(&m, Uuid::nil(), false).contains(&find_device(&dev.names, DEVICE_WAIT)));
    let script = format!("{}{find}echo \"found $D\"\n", preamble());
    let out = std::process::Command::new("bash")
        .args(["-c", &script])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{said}");
    assert_eq!(said.trim(), format!("found {}", dev.names[1]));
}

fn which(cmd: &str) -> String {
    let out = std::process::Command::new("sh")
        .args(["-c", &format!("command -v {cmd}")])
        .output()
        .unwrap();
    let p = String::from_utf8(out.stdout).unwrap().trim().to_string();
    assert!(!p.is_empty(), "{cmd} is not on PATH");
    p
}
