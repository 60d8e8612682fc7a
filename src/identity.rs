//! Who we are: the runner id and the runner manager's system id, which prefix
//! every environment key, and the environment id of a job.

use std::path::Path;

use anyhow::{Context, Result};
use uuid::Uuid;

use crate::job::{read_trimmed, JobInput};
use crate::settings::Settings;
use crate::state::StateStore;

/// Namespace for the environment ids dormant derives (UUID v5).
const ENV_NAMESPACE: Uuid = Uuid::from_u128(0x6d0f_1c1e_8a4b_4b7e_9d6c_3f2a_1b0e_5c4d);

/// The runner id: settings, else `CI_RUNNER_ID` from the trusted payload.
/// Never the job's own `CI_RUNNER_ID` variable: a job can set it, and the
/// runner id says which runner's environments a key may resume.
pub fn runner_id(settings: &Settings, input: &JobInput) -> Result<String> {
    settings
        .runner_id
        .clone()
        .or_else(|| input.payload_runner_id.clone())
        .map(|r| r.trim().to_string())
        .filter(|r| !r.is_empty() && !r.contains('/'))
        .context(
            "cannot tell this runner's id: the job payload's variables carry no usable CI_RUNNER_ID \
             (a job's own CI_RUNNER_ID variable is never used: a job can set it); \
             set runner_id in dormant's settings",
        )
}

/// The system id: settings, else the runner's `.runner_system_id`, else one
/// derived from `/etc/machine-id` and kept in the state dir so it never changes.
pub fn system_id(settings: &Settings, store: &StateStore) -> Result<String> {
    if let Some(id) = &settings.system_id {
        return Ok(id.trim().to_string());
    }
    if let Some(id) = read_trimmed(&settings.runner_system_id_file)? {
        return Ok(id);
    }
    let kept = store.root().join("system_id");
    if let Some(id) = read_trimmed(&kept)? {
        return Ok(id);
    }
    let seed =
        read_trimmed(Path::new("/etc/machine-id"))?.unwrap_or_else(|| Uuid::new_v4().to_string());
    let derived = format!(
        "d_{}",
        &Uuid::new_v5(&ENV_NAMESPACE, seed.as_bytes())
            .simple()
            .to_string()[..12]
    );
    // Atomic (temp + rename): two first jobs on a fresh host may race here.
    // 0600 like every state file.
    let tmp = kept.with_extension(format!("tmp{}", std::process::id()));
    crate::state::store::write_private(&tmp, format!("{derived}\n").as_bytes())
        .and_then(|()| std::fs::rename(&tmp, &kept))
        .with_context(|| format!("writing {}", kept.display()))?;
    Ok(derived)
}

/// A new job's environment id: derived from runner and job id, so a retried
/// prepare (a fresh process) finds the machine the first attempt made.
pub fn new_env_id(runner_id: &str, job_id: u64) -> Uuid {
    Uuid::new_v5(&ENV_NAMESPACE, format!("{runner_id}/{job_id}").as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_ids_are_stable_and_distinct() {
        assert_eq!(new_env_id("1", 2), new_env_id("1", 2));
        assert_ne!(new_env_id("1", 2), new_env_id("1", 3));
        assert_ne!(new_env_id("1", 23), new_env_id("12", 3));
    }

    #[test]
    fn system_id_comes_from_settings_then_runner_file_then_is_derived_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let store = StateStore::open(&dir.path().join("state")).unwrap();
        let mut s = Settings {
            runner_system_id_file: dir.path().join("missing"),
            ..Default::default()
        };
        let derived = system_id(&s, &store).unwrap();
        assert!(
            derived.starts_with("d_") && derived.len() == 14,
            "{derived}"
        );
        assert_eq!(system_id(&s, &store).unwrap(), derived);
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(store.root().join("system_id"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "system_id is for dormant's user only");
        std::fs::write(dir.path().join("rsid"), "s_0123456789ab\n").unwrap();
        s.runner_system_id_file = dir.path().join("rsid");
        assert_eq!(system_id(&s, &store).unwrap(), "s_0123456789ab");
        s.system_id = Some("from settings".into());
        assert_eq!(system_id(&s, &store).unwrap(), "from settings");
    }
}
