//! Unit tests of the guest's mount and unmount commands, run by a local bash
//! on a directory standing in for the volume (the device part runs in the
//! qemu tests, on a real second disk).

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
        device: None,
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
        device: Some("/dev/disk/by-id/virtio-dormant-data".into()),
        mountpoint: "/dormant".into(),
        user_dirs: vec!["/dormant/builds".into(), "/dormant/x'y".into()],
    };
    let text = mount_script(&m, Uuid::nil(), true);
    assert!(
        text.starts_with("D='/dev/disk/by-id/virtio-dormant-data'; M='/dormant';"),
        "{text}"
    );
    assert!(text.contains(r#"'/dormant/x'\''y'"#), "{text}");
    assert!(text.contains("FIRST=1"), "{text}");
    assert!(!mount_script(&m, Uuid::nil(), false).contains("FIRST=1"));
    assert!(unmount_script(&m).starts_with("D='/dev/disk/by-id/virtio-dormant-data'; M='/dormant'"));
}
