//! Root using a runner's state dir (an operator's `sudo dormant list`):
//! what it makes there must stay usable by the runner's own user. The
//! read-only commands on a fresh state dir owned by another user leave
//! nothing root-owned in it.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use crate::harness::Rig;

/// Every path under `dir` (itself included) owned by uid 0.
fn root_owned(dir: &Path, found: &mut Vec<String>) {
    let meta = std::fs::symlink_metadata(dir).unwrap();
    if meta.uid() == 0 {
        found.push(dir.display().to_string());
    }
    if meta.is_dir() {
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            root_owned(&e.path(), found);
        }
    }
}

#[test]
fn roots_read_only_commands_leave_nothing_root_owned_in_a_runners_fresh_state_dir() {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: this test needs root (it runs dormant as root on another user's dir)");
        return;
    }
    let rig = Rig::local("1", "s_owner");
    std::fs::create_dir(&rig.state_dir).unwrap();
    std::os::unix::fs::chown(&rig.state_dir, Some(65534), Some(65534)).unwrap();
    let id = uuid::Uuid::new_v4().to_string();
    for args in [
        vec!["list"],
        vec!["list", "--json"],
        vec!["inspect", id.as_str()],
        vec!["attach", id.as_str()],
        vec!["events"],
    ] {
        let out = rig.dormant(&args);
        let mut found = Vec::new();
        root_owned(&rig.state_dir, &mut found);
        assert!(
            found.is_empty(),
            "`dormant {}` left root-owned {found:?} (exit {:?}: {})",
            args.join(" "),
            out.status.code(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
