//! The path a warm VM's QEMU opens its disks by: `<state dir>/qemu-paths/<warm id>`,
//! a symlink to the VM's directory, which follows the VM when the warm pool
//! hands it to an environment.
//!
//! Why: QEMU opens a disk image again *by the path on its command line*
//! while it runs: when a save (`migrate`) completes it inactivates the
//! images, and `cont` after a failed or interrupted save activates them
//! again; both change the image's access mode, which file-posix does by
//! reopening the file by name. A warm VM's directory is renamed under its
//! running QEMU (`warm/<id>/vm` → `environments/<env>/vm`, `warm.rs`), so a
//! QEMU started with `warm/<id>/vm/overlay.qcow2` would fail every
//! hibernation ("Error in migration completion: Bad address") and fall back
//! to a power-off. A warm VM's `-drive` paths go through the alias instead,
//! and the hand-over re-points it (a new symlink renamed over the old one:
//! atomic) at the environment's `vm/`, so the path stays valid for that
//! QEMU's whole life. Its other paths need no alias: the pidfile and the QMP
//! socket are the QEMU's identity and are only removed by it on exit
//! (nothing to remove once moved), the console log is opened once.
//!
//! The alias lives outside `warm/`: every directory there is a pool entry
//! with its `warm.json`. It is removed once its QEMU is gone: by the
//! retire of a warm VM, the next start of the environment (which clears
//! `Launch::running_as`), the environment's delete, or `sweep` ([`tidy`]) for
//! what a killed process left. The alias of a QEMU is found from its
//! `running_as.id`. A hand-over killed before its re-point is finished by
//! the retried hand-over, and in any case before a save or a `cont`
//! ([`follow`]).

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use uuid::Uuid;

use super::process;
use super::vm::VmDir;

/// The directory of the aliases, in the state dir.
pub const DIR: &str = "qemu-paths";

/// The alias of the QEMU started as warm VM `id`.
pub fn path(root: &Path, id: Uuid) -> PathBuf {
    root.join(DIR).join(id.to_string())
}

fn tmp_path(root: &Path, id: Uuid) -> PathBuf {
    root.join(DIR).join(format!("{id}.tmp"))
}

/// What the symlink holds: relative to the state dir when `target` is in it
/// (a state dir reached through another path, or moved, keeps its aliases).
fn link_text(root: &Path, target: &Path) -> PathBuf {
    match target.strip_prefix(root) {
        Ok(inside) => Path::new("..").join(inside),
        Err(_) => target.to_path_buf(),
    }
}

/// Makes the alias of `id` point at `target` (a VM directory), atomically:
/// a symlink made under a temporary name and renamed over the alias, so the
/// alias names either the old directory or the new one at every moment.
/// Returns the alias's path.
pub fn point(root: &Path, id: Uuid, target: &Path) -> Result<PathBuf> {
    let dir = root.join(DIR);
    crate::state::store::ensure_private_dir(&dir)?;
    let alias = path(root, id);
    let text = link_text(root, target);
    let tmp = tmp_path(root, id);
    // A killed earlier point may have left it.
    remove_file(&tmp)?;
    if fs::read_link(&alias).is_ok_and(|t| t == text) {
        return Ok(alias);
    }
    std::os::unix::fs::symlink(&text, &tmp).with_context(|| format!("making {}", tmp.display()))?;
    fs::rename(&tmp, &alias)
        .with_context(|| format!("renaming {} over {}", tmp.display(), alias.display()))?;
    crate::state::store::sync_dir(&dir).with_context(|| format!("syncing {}", dir.display()))?;
    Ok(alias)
}

/// Re-points the alias of `id` at `target` if it exists (a QEMU started
/// before aliases has none: its paths cannot be helped).
pub fn follow(root: &Path, id: Uuid, target: &Path) -> Result<()> {
    if fs::symlink_metadata(path(root, id)).is_ok() {
        point(root, id, target)?;
    }
    Ok(())
}

/// Before QEMU may open its disks again (a save, a `cont`): the alias of the
/// QEMU running for `vm`, if it was started as a warm VM, points at `vm`'s
/// directory (a hand-over killed between its rename and its re-point, and
/// not retried, left it naming the warm directory).
pub fn follow_vm(root: &Path, vm: &VmDir) -> Result<()> {
    match vm.read_launch()?.and_then(|l| l.running_as) {
        Some(r) => follow(root, r.id, &vm.dir),
        None => Ok(()),
    }
}

/// Removes the alias of `id` (its QEMU is gone). Already gone is success.
pub fn remove(root: &Path, id: Uuid) -> Result<()> {
    remove_file(&tmp_path(root, id))?;
    remove_file(&path(root, id))
}

fn remove_file(path: &Path) -> Result<()> {
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).with_context(|| format!("removing {}", path.display())),
    }
}

/// `sweep`: removes every alias (and temporary name) whose QEMU no longer
/// runs and whose warm VM directory is gone (handed over or retired). A warm
/// VM still in the pool keeps its alias even while its QEMU is not up yet
/// (booting) or any more: the pool's retire removes both. Returns what it
/// removed.
pub fn tidy(root: &Path) -> Result<Vec<PathBuf>> {
    let dir = root.join(DIR);
    let entries = match fs::read_dir(&dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("listing {}", dir.display())),
    };
    // A handed-over QEMU still carries the warm pidfile path it was started
    // with, so scanning `warm/` finds it wherever its directory went.
    let running: Vec<Uuid> = process::scan(&root.join("warm"))
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    let mut removed = Vec::new();
    for entry in entries {
        let entry = entry.with_context(|| format!("listing {}", dir.display()))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(id) = Uuid::parse_str(name.strip_suffix(".tmp").unwrap_or(&name)).ok() else {
            continue; // not dormant's: left alone
        };
        let in_pool = root.join("warm").join(id.to_string()).join("vm").exists();
        if running.contains(&id) || in_pool {
            continue;
        }
        remove_file(&entry.path())?;
        removed.push(entry.path());
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::qemu::process::fake::FakeQemu;
    use crate::state::EnvPaths;

    #[test]
    fn an_alias_follows_its_vm_and_sweep_removes_it_only_once_its_qemu_is_gone() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let warm = VmDir::new(&EnvPaths::new(&root.join("warm-root"), Uuid::new_v4()));
        // The pool's shape: `warm/<id>/vm`.
        let warm = VmDir {
            env_id: warm.env_id,
            dir: root.join("warm").join(warm.env_id.to_string()).join("vm"),
        };
        fs::create_dir_all(&warm.dir).unwrap();
        fs::write(warm.dir.join("overlay.qcow2"), b"disk").unwrap();
        let alias = point(root, warm.env_id, &warm.dir).unwrap();
        assert_eq!(alias, path(root, warm.env_id));
        assert_eq!(
            fs::read_link(&alias).unwrap(),
            Path::new("../warm")
                .join(warm.env_id.to_string())
                .join("vm"),
            "relative to the state dir"
        );
        assert_eq!(fs::read(alias.join("overlay.qcow2")).unwrap(), b"disk");
        assert!(tidy(root).unwrap().is_empty(), "a warm VM keeps its alias");

        // Handed over: the directory moves, the alias follows.
        let qemu = FakeQemu::start(root, &warm);
        let env = VmDir::new(&EnvPaths::new(root, Uuid::new_v4()));
        fs::create_dir_all(env.dir.parent().unwrap()).unwrap();
        fs::rename(&warm.dir, &env.dir).unwrap();
        assert!(
            !alias.join("overlay.qcow2").exists(),
            "dangling until re-pointed"
        );
        follow(root, warm.env_id, &env.dir).unwrap();
        assert_eq!(fs::read(alias.join("overlay.qcow2")).unwrap(), b"disk");
        assert!(
            tidy(root).unwrap().is_empty(),
            "its QEMU runs: kept although the warm directory is gone"
        );

        // A killed re-point's temporary name, and an alias of a QEMU that
        // is gone: both swept; what is not dormant's is left alone.
        fs::write(tmp_path(root, warm.env_id), b"").unwrap();
        point(root, warm.env_id, &env.dir).unwrap();
        assert!(
            !tmp_path(root, warm.env_id).exists(),
            "a re-point clears it"
        );
        fs::write(tmp_path(root, warm.env_id), b"").unwrap();
        fs::write(root.join(DIR).join("notes"), b"").unwrap();
        drop(qemu);
        let mut gone = tidy(root).unwrap();
        gone.sort();
        let mut want = vec![path(root, warm.env_id), tmp_path(root, warm.env_id)];
        want.sort();
        assert_eq!(gone, want);
        assert!(root.join(DIR).join("notes").exists());
        // Not there: nothing to follow, nothing made.
        follow(root, warm.env_id, &env.dir).unwrap();
        assert!(fs::symlink_metadata(path(root, warm.env_id)).is_err());
        remove(root, warm.env_id).unwrap();
    }
}
