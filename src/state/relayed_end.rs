//! The end of a paused script that a stage relayed (`dormant-continue`), noted
//! by that stage's `dormant run` before it tells the machine the stage ended
//! (`DONE`, after which the machine lets the paused script's files go): the
//! exit code the continue gave. The same `dormant run` removes the note as
//! its last act before it exits with the stage's code (only its own note: a
//! later stage leaves a killed stage's to the cleanup). A note the job's
//! cleanup still finds means that `dormant run` was killed in between: the
//! runner never had the stage's code, and the paused script's code lives
//! only here. The cleanup then keeps the environment paused with that code
//! (`Paused::ended`), and the next job's `dormant-continue` gives it
//! (docs/pause.md, "Exactness and bounds").

use std::path::{Path, PathBuf};

use anyhow::Result;
use serde::{Deserialize, Serialize};

use crate::model::EnvPaths;

use super::store;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RelayedEnd {
    /// The state files' format version ([`store::FORMAT_VERSION`]).
    pub version: u32,
    /// The stage run that relayed it (`<stage>.<random>`).
    pub stage_id: String,
    /// The exit code `dormant-continue` gave: the paused script's.
    pub code: i32,
}

/// The note's file in the environment's directory.
pub fn path(paths: &EnvPaths) -> PathBuf {
    paths.dir.join("relayed-end.json")
}

/// Notes the end (atomic, 0600, durable: the runner's restart must not lose
/// a code that is nowhere else).
pub fn note(file: &Path, stage_id: &str, code: i32) -> Result<()> {
    store::write_json(
        file,
        &RelayedEnd {
            version: store::FORMAT_VERSION,
            stage_id: stage_id.to_string(),
            code,
        },
    )
}

/// The note, if one is there. One that cannot be read is none: the code is
/// then lost as it was before notes (said by the caller).
pub fn read(paths: &EnvPaths) -> Result<Option<RelayedEnd>> {
    store::read_json(&path(paths))
}

/// Removes the note.
pub fn clear(file: &Path) -> Result<()> {
    store::remove_file(file)
}

/// Removes the note if stage run `stage_id` wrote it: a later stage of the
/// job (`after_script`, which the runner runs after a killed one) must leave
/// a killed stage's note to the cleanup.
pub fn clear_for(file: &Path, stage_id: &str) -> Result<()> {
    let note: Option<RelayedEnd> = store::read_json(file).ok().flatten();
    if note.is_some_and(|n| n.stage_id == stage_id) {
        clear(file)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_note_is_read_back_and_cleared() {
        let dir = tempfile::tempdir().unwrap();
        let paths = EnvPaths::new(dir.path(), uuid::Uuid::nil());
        std::fs::create_dir_all(&paths.dir).unwrap();
        assert_eq!(read(&paths).unwrap(), None);
        note(&path(&paths), "build_script.1", 7).unwrap();
        let n = read(&paths).unwrap().unwrap();
        assert_eq!((n.stage_id.as_str(), n.code), ("build_script.1", 7));
        clear_for(&path(&paths), "after_script.2").unwrap();
        assert!(
            read(&paths).unwrap().is_some(),
            "another stage's note stays"
        );
        clear_for(&path(&paths), "build_script.1").unwrap();
        assert_eq!(read(&paths).unwrap(), None);
        clear(&path(&paths)).unwrap();
    }
}
