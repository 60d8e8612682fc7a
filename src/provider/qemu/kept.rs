//! What a suspended qemu environment keeps on the host's disk: its root
//! overlay and memory image, with the guest RAM file a hibernate-mode VM's
//! image is made of (machine mode: `vm/`), its data disk (volume
//! mode: `volume/`). Bytes allocated on disk (`st_blocks`), not the
//! images' virtual sizes: a qcow2 file holds only what was written. The
//! base image is shared by every environment and not counted.

use std::os::unix::fs::MetadataExt;

use super::vm::VmDir;
use crate::model::EnvPaths;

/// The bytes environment `paths` holds in its overlay, memory image (also a
/// partial one a cut-short hibernation left), guest RAM file (`ram.rs`) and
/// data disk. Five `stat`s.
pub fn bytes(paths: &EnvPaths) -> u64 {
    let vm = VmDir::new(paths);
    [
        vm.overlay(),
        vm.state(),
        vm.partial_state(),
        vm.ram(),
        vm.data_disk(),
    ]
    .iter()
    .filter_map(|f| std::fs::symlink_metadata(f).ok())
    .filter(|m| m.is_file())
    .map(|m| m.blocks() * 512)
    .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_the_overlay_memory_image_ram_file_and_data_disk_as_allocated_on_disk() {
        let dir = tempfile::tempdir().unwrap();
        let paths = EnvPaths::new(dir.path(), uuid::Uuid::new_v4());
        let vm = VmDir::new(&paths);
        assert_eq!(bytes(&paths), 0, "nothing there yet");
        std::fs::create_dir_all(&vm.dir).unwrap();
        std::fs::create_dir_all(vm.data_disk().parent().unwrap()).unwrap();
        std::fs::write(vm.overlay(), vec![1u8; 64 * 1024]).unwrap();
        std::fs::write(vm.state(), vec![2u8; 128 * 1024]).unwrap();
        std::fs::write(vm.data_disk(), vec![3u8; 256 * 1024]).unwrap();
        std::fs::write(vm.ram(), vec![5u8; 32 * 1024]).unwrap();
        // A sparse file: 1 GiB long, one block written.
        let sparse = std::fs::File::create(vm.partial_state()).unwrap();
        sparse.set_len(1 << 30).unwrap();
        // The seed and the console log are not what a suspension keeps.
        std::fs::write(vm.console(), vec![4u8; 512 * 1024]).unwrap();
        let got = bytes(&paths);
        let written = (64 + 128 + 256 + 32) * 1024;
        assert!(
            (written..written + 64 * 1024).contains(&got),
            "{got} bytes, {written} written"
        );
    }
}
