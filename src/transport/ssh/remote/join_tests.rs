//! `join.sh` and `join_end.sh` run under a local bash, as the job's machine
//! would run them (with `TMPDIR` a directory of the test's): how a join and
//! the job's cleanup meet there, whichever comes first.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use super::tests::{alive, as_sshd_would, wait_for};
use super::*;

/// `<tmp>/dormant-<uid>`, where both scripts keep their files.
fn files_dir(tmp: &Path) -> PathBuf {
    // SAFETY: getuid has no preconditions.
    tmp.join(format!("dormant-{}", unsafe { libc::getuid() }))
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Runs `script` with `args` under bash, `TMPDIR` = `tmp`.
fn run(tmp: &Path, script: &str, args: &[&str]) -> std::process::Output {
    as_sshd_would(Command::new("bash"))
        .arg("-c")
        .arg(script)
        .arg("dormant")
        .args(args)
        .env("TMPDIR", tmp)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

/// The cleanup first, for a join it saw marked: the wrapper arriving after
/// it runs nothing, says why, and leaves nothing behind.
#[test]
fn a_join_arriving_after_the_cleanup_ended_its_job_runs_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let ran = tmp.path().join("ran");
    let end = run(tmp.path(), JOIN_END, &["e1", "the job ended", "00aa"]);
    assert!(end.status.success(), "{end:?}");
    assert_eq!(names(&files_dir(tmp.path())), ["e1.join.00aa"]);
    let line = format!("touch {}", ran.display());
    let join = run(tmp.path(), JOIN, &["e1", "00aa", "/", &line]);
    let said = String::from_utf8_lossy(&join.stderr);
    assert_eq!(join.status.code(), Some(97), "{said}");
    assert!(
        said.contains("the job ended before this shell could join it"),
        "{said}"
    );
    assert!(!ran.exists(), "the late join ran its command");
    assert!(names(&files_dir(tmp.path())).is_empty());
}

/// A registration is held from the moment it exists, before the wrapper
/// wrote its pid in it: the cleanup ends that join (it does not take the
/// empty file for one a killed wrapper left), then removes its file; a file
/// nobody holds is removed as left over.
#[test]
fn a_registration_not_yet_written_is_a_join_the_cleanup_ends() {
    use std::os::unix::process::CommandExt;
    let tmp = tempfile::tempdir().unwrap();
    let dir = files_dir(tmp.path());
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("e1.join.dead"), "1\n").unwrap();
    let held = dir.join("e1.join.00bb");
    // A wrapper stopped right after `exec 9>` (its own session, as sshd
    // starts it).
    let mut cmd = as_sshd_would(Command::new("bash"));
    cmd.arg("-c")
        .arg(format!("exec 9>'{}'; exec sleep 60", held.display()))
        .stdin(Stdio::null())
        .stderr(Stdio::null());
    // SAFETY: setsid is async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    let mut wrapper = cmd.spawn().unwrap();
    let pid = wrapper.id() as i32;
    wait_for(|| held.exists(), "the registration");
    let end = run(tmp.path(), JOIN_END, &["e1", "the job ended", "00bb"]);
    assert!(end.status.success(), "{end:?}");
    let outlived = alive(pid);
    let _ = wrapper.kill();
    let _ = wrapper.wait();
    assert!(
        !outlived,
        "the join whose pid was not written yet outlived the job"
    );
    assert!(names(&dir).is_empty(), "{:?}", names(&dir));
}
