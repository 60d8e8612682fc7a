//! Disk sizes as `qemu-img` writes them (`20G`): the `[qemu]` settings'
//! `disk_size` and `volume_size` are checked here before any `qemu-img` runs.

/// The largest data disk: far beyond any job's files, and far from what
/// qcow2 and ext4 can address.
pub(super) const MAX_VOLUME_BYTES: u64 = 16 << 40;

/// `qemu-img` sizes in bytes: digits and one of K, M, G, T.
pub(super) fn size_bytes(s: &str) -> Option<u64> {
    let unit = s.chars().last()?;
    let digits = &s[..s.len() - unit.len_utf8()];
    let shift = match unit {
        'K' => 10,
        'M' => 20,
        'G' => 30,
        'T' => 40,
        _ => return None,
    };
    if digits.is_empty() || !digits.chars().all(|c| c.is_ascii_digit()) {
        return None;
    }
    digits
        .parse::<u64>()
        .ok()
        .filter(|n| *n > 0)
        .and_then(|n| n.checked_mul(1 << shift))
}

pub(super) fn valid_size(s: &str) -> bool {
    size_bytes(s).is_some()
}
