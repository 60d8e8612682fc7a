//! A take-over staged in `<state dir>/adopting/<id>/` before its tag write:
//! the new SSH key pair and pinned host key (machine mode) and
//! `intent.json`, the epoch value this run is about to write and the value
//! it found. Written (fsynced) before the CreateTags call, so that whatever
//! stops a run after it — a kill, a failed read-back, a quarantine or record
//! write that fails — leaves what the cloud now holds on disk here: the key
//! whose public half the tag names, and the epoch a record must carry.
//!
//! The next `dormant adopt` reads the tag ([`Staged::landed`]): it shows the
//! value written → the take-over landed, and that run finishes it with the
//! staged key and that epoch (no second tag write); anything else (the value
//! found, or another host's) → the write never landed or was overwritten,
//! and the staging is dropped before the environment is adopted afresh.
//! The record is written into this directory and renamed into
//! `environments/` (same filesystem), so a record stands complete or not at
//! all; the intent file travels with it and is removed after.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use crate::state::{store, StateStore};

/// The directory of the staged take-overs, in the state dir.
pub const ADOPTING_DIR: &str = "adopting";
/// The intent inside a staged take-over.
pub const INTENT: &str = "intent.json";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Intent {
    pub version: u32,
    /// The instance or data volume tagged.
    pub resource: String,
    /// The epoch tag value this take-over writes.
    pub written: String,
    /// The value it found there (`None`: no tag).
    pub found: Option<String>,
}

/// One environment's staging directory.
pub struct Staged {
    pub dir: PathBuf,
}

impl Staged {
    pub fn of(store: &StateStore, id: uuid::Uuid) -> Staged {
        Staged {
            dir: store.root().join(ADOPTING_DIR).join(id.to_string()),
        }
    }

    /// The intent an earlier run left; `None`: no staging, or one killed
    /// before its intent was written (its tag write never began).
    pub fn intent(&self) -> Option<Intent> {
        store::read_json::<Intent>(&self.dir.join(INTENT))
            .ok()
            .flatten()
    }

    /// Whether an earlier run's take-over landed: the tag (`now`, as this
    /// run found it) shows the value it wrote.
    pub fn landed(intent: &Intent, resource: &str, now: Option<&str>) -> bool {
        intent.resource == resource && now == Some(intent.written.as_str())
    }

    /// A fresh, empty staging directory (0700), any earlier one removed.
    pub fn begin(&self) -> Result<()> {
        self.drop_it()?;
        let parent = self.dir.parent().unwrap_or(Path::new("."));
        store::ensure_private_dir(parent)?;
        store::ensure_private_dir(&self.dir)
    }

    /// Records the intent, durably, before the tag write.
    pub fn record_intent(&self, intent: &Intent) -> Result<()> {
        store::write_json(&self.dir.join(INTENT), intent)
            .with_context(|| format!("recording the take-over's intent in {}", self.dir.display()))
    }

    pub fn drop_it(&self) -> Result<()> {
        store::remove_tree(&self.dir)
    }
}

/// The staged take-overs this run did not deal with (their environment was
/// not adoptable this time): their ids.
pub fn leftovers(store: &StateStore, seen: &[uuid::Uuid]) -> Vec<(uuid::Uuid, PathBuf)> {
    let Ok(dir) = std::fs::read_dir(store.root().join(ADOPTING_DIR)) else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| {
            let id = uuid::Uuid::parse_str(&e.file_name().to_string_lossy()).ok()?;
            (!seen.contains(&id)).then(|| (id, e.path()))
        })
        .collect()
}
