//! What a suspended environment keeps while it waits, in bytes, for
//! `dormant metrics`' `dormant_suspended_storage_bytes`: the storage a
//! suspension costs. Read from the record, the settings and, for qemu, the
//! sizes of its files on disk — never from a provider's API, since metrics
//! runs every minute (docs/guide/events.md, "What suspended environments and
//! the warm pool cost").

use crate::settings::Settings;
use crate::state::{EnvironmentRecord, StateStore};

/// The bytes suspended environment `rec` keeps; `None` when this dormant
/// cannot know without asking the provider (an EC2 root disk launched
/// before dormant recorded its size, with `root_volume_size_gb` unset) or
/// when it is not the runner host's to pay for (`local`, `ssh`: a
/// directory on a host of the operator's, which would have to be walked).
pub fn kept_bytes(settings: &Settings, store: &StateStore, rec: &EnvironmentRecord) -> Option<u64> {
    match rec.provider.as_str() {
        "qemu" => Some(super::qemu::kept::bytes(&store.env_paths(rec.id))),
        #[cfg(feature = "ec2")]
        "ec2" => super::ec2::kept::bytes(&settings.ec2, rec),
        _ => {
            let _ = settings;
            None
        }
    }
}
