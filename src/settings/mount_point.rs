//! Where a data volume may be mounted in the guest (`ec2.volume_mount`,
//! `qemu.volume_mount`), and whether a directory lies on it: shared by the
//! two providers whose environments can live on a volume.

/// Directories a data disk must not be mounted on: the guest's own system.
const SYSTEM_DIRS: &[&str] = &[
    "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib64", "/opt", "/proc", "/root", "/run",
    "/sbin", "/srv", "/sys", "/tmp", "/usr", "/var",
];

/// Why `path` cannot be a data disk's mount point, if it cannot: it goes
/// into fstab and a shell script, so plain characters only.
pub(super) fn mount_problem(path: &str) -> Option<String> {
    if !path.starts_with('/') || path == "/" || path.ends_with('/') {
        return Some(format!(
            "{path:?} must be an absolute path below / without a trailing slash (e.g. \"/dormant\")"
        ));
    }
    if !path
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '/' | '-' | '_' | '.'))
        || path.split('/').any(|c| c == "." || c == "..")
        || path.contains("//")
    {
        return Some(format!(
            "{path:?} may hold only letters, digits, '-', '_', '.' and '/' (it goes into the guest's fstab)"
        ));
    }
    if SYSTEM_DIRS.contains(&path) {
        return Some(format!(
            "{path:?} is a system directory of the guest: mount the data disk on a directory of its own"
        ));
    }
    None
}

/// Whether `dir` is `mount` or inside it.
pub(super) fn inside(dir: &str, mount: &str) -> bool {
    dir == mount
        || dir
            .strip_prefix(mount)
            .is_some_and(|rest| rest.starts_with('/'))
}
