//! `dormant config`: prints the one JSON object GitLab Runner reads
//! ([`ConfigOutput`], see `docs/runner-contract.md`). No cloud or network call,
//! no state written: settings, the job payload, and a path.

use std::io::Write;

use anyhow::Result;

use crate::contract::{ConfigOutput, DriverInfo};
use crate::envkey::EnvironmentKey;
use crate::exit::Failure;
use crate::job::Job;
use crate::settings::Settings;
use crate::state::EnvPaths;

pub fn config(settings: &Settings, job: &Job, out: &mut dyn Write) -> Result<(), Failure> {
    let input = job.input()?;
    let runner_id = crate::identity::runner_id(settings, &input)?;
    // A resume runs in the environment its key names, so its builds_dir (and so
    // CI_PROJECT_DIR) is the suspended job's. A malformed key is refused by
    // prepare with a clear message; here it just gets a new job's id.
    // Its storage mode too: the key of a volume-mode environment says
    // `storage=volume` (its dirs are on the volume), whatever the setting is now.
    let key = input
        .suspend
        .resume_key
        .as_deref()
        .and_then(|k| EnvironmentKey::parse(k).ok());
    let (env_id, storage) = match &key {
        Some(k) => (k.env_id, crate::envkey::storage_of(k)),
        None => (
            crate::identity::new_env_id(&runner_id, input.job_id),
            crate::provider::storage_setting(settings),
        ),
    };
    let paths = EnvPaths::new(&settings.state_dir(job)?, env_id);
    let dirs = crate::provider::dirs(settings, &paths, storage)?;
    let doc = ConfigOutput {
        builds_dir: Some(dirs.builds),
        cache_dir: Some(dirs.cache),
        // The project dir is `<builds_dir>/<namespace>/<project>`, the same for
        // a resumed job as for the one that suspended its environment.
        builds_dir_is_shared: Some(false),
        hostname: Some(format!("dormant-{}", &env_id.simple().to_string()[..12])),
        driver: Some(DriverInfo {
            name: Some("dormant".into()),
            version: Some(env!("CARGO_PKG_VERSION").into()),
        }),
        ..Default::default()
    };
    writeln!(out, "{}", doc.to_line()).map_err(anyhow::Error::from)?;
    Ok(())
}
