//! What a suspended EC2 environment keeps: EBS storage, billed by the
//! provisioned GiB whether or not it is written. Machine mode keeps the
//! stopped instance's root volume (the size it was launched with, recorded
//! in the machine's `root_gib` field; else `root_volume_size_gb`); volume
//! mode keeps the data volume (its `size_gib` field, as created or
//! described; else `volume_size_gb`), its instance is gone. From the record
//! and the settings only: no call.

use super::field;
use super::volumes_find::vfield;
use crate::model::StorageMode;
use crate::settings::ec2::Ec2Settings;
use crate::state::EnvironmentRecord;

const GIB: u64 = 1 << 30;

/// The EBS bytes suspended environment `rec` keeps; `None` for a
/// machine-mode one launched before dormant recorded its root volume's
/// size while `root_volume_size_gb` is unset (the image's default size,
/// which only DescribeImages knows).
pub fn bytes(settings: &Ec2Settings, rec: &EnvironmentRecord) -> Option<u64> {
    let parse = |v: Option<&str>| v.and_then(|g| g.parse::<u64>().ok());
    let gib = match rec.storage {
        StorageMode::Volume => parse(
            rec.volume
                .as_ref()
                .and_then(|v| v.volume.as_ref())
                .and_then(|v| v.field(vfield::SIZE_GIB)),
        )
        .or(Some(u64::from(settings.volume_size_gb))),
        StorageMode::Machine => parse(rec.machine.as_ref().and_then(|m| m.field(field::ROOT_GIB)))
            .or(settings.root_volume_size_gb.map(u64::from)),
    };
    gib.map(|g| g * GIB)
}
