//! `dormant pause`'s request (docs/pause.md, "Pausing from the host"): the
//! operator's command writes it into the environment's directory, naming the
//! stage run it pauses; the `dormant run` of that stage reads it while its
//! stage runs and asks the machine to freeze the script. The intent is on
//! disk before any effect: a `dormant pause` killed after writing it still
//! pauses the stage; one for a stage that has ended is never acted on (the
//! stage id is unique) and is removed by the next run stage's start (or
//! goes with the environment's directory).

use std::path::{Path, PathBuf};

use anyhow::Result;
use serde::{Deserialize, Serialize};

use crate::model::EnvPaths;

use super::store;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PauseRequest {
    /// The state files' format version ([`store::FORMAT_VERSION`]).
    pub version: u32,
    /// The stage run to pause (`<stage>.<random>`, `stage_output::StageNow::id`).
    pub stage_id: String,
    /// What the job log, the record and `list` show as the paused script's question.
    pub question: String,
}

/// The request's file in the environment's directory.
pub fn path(paths: &EnvPaths) -> PathBuf {
    paths.dir.join("pause-request.json")
}

/// Records the request (atomic, 0600, durable).
pub fn write(paths: &EnvPaths, request: &PauseRequest) -> Result<()> {
    store::write_json(&path(paths), request)
}

/// The question asked of stage run `stage_id`, if a request names it. A
/// request that cannot be read is no request (it is the operator's, and
/// `dormant pause` reports it when it is not acted on).
pub fn for_stage(file: &Path, stage_id: &str) -> Option<String> {
    let request: PauseRequest = store::read_json(file).ok().flatten()?;
    (request.stage_id == stage_id).then_some(request.question)
}

/// Removes the request in `file` if it names stage run `stage_id` (the
/// machine refused it: `dormant pause` sees it gone while the stage runs).
pub fn withdraw(file: &Path, stage_id: &str) -> Result<()> {
    if for_stage(file, stage_id).is_some() {
        store::remove_file(file)?;
    }
    Ok(())
}

/// Removes a request, whichever stage it names.
pub fn clear(paths: &EnvPaths) -> Result<()> {
    store::remove_file(&path(paths))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_is_for_the_stage_it_names_only() {
        let dir = tempfile::tempdir().unwrap();
        let paths = EnvPaths::new(dir.path(), uuid::Uuid::nil());
        std::fs::create_dir_all(&paths.dir).unwrap();
        assert_eq!(for_stage(&path(&paths), "step_script.1"), None);
        let r = PauseRequest {
            version: store::FORMAT_VERSION,
            stage_id: "step_script.1".into(),
            question: "why".into(),
        };
        write(&paths, &r).unwrap();
        assert_eq!(
            for_stage(&path(&paths), "step_script.1").as_deref(),
            Some("why")
        );
        assert_eq!(for_stage(&path(&paths), "step_script.2"), None);
        clear(&paths).unwrap();
        assert_eq!(for_stage(&path(&paths), "step_script.1"), None);
    }
}
