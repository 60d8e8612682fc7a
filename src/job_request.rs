//! A job asks for its own suspension: every stage script sees
//! `DORMANT_SUSPEND_FILE`, and a script that writes to it (the first line a
//! reason, e.g. the question an agent asks a human) asks for the environment
//! to be suspended at cleanup even without a payload trigger, if the operator
//! allows it (`[suspend] allow_job_request`).
//!
//! Where the file is: `<builds_dir>/.dormant-suspend-request`, on the machine
//! the scripts run on. The builds dir holds the checkout
//! (`<builds_dir>/<namespace>/<project>`) but the file sits beside it, not in
//! it, so `git clean`, `clear_worktree` and a fresh checkout never touch it;
//! the builds dir exists before the first script runs (the runner creates the
//! project dir inside it) and the job's user can write there on every provider;
//! and it is the same path for every job of the environment (config derives
//! builds_dir from the environment alone), so a resumed job sees the same file.
//!
//! How cleanup learns about it: [`take`] reads the file through the
//! environment's transport (a local read, or one command over the still-open
//! SSH master) before the machine is stopped, and removes it, so a resumed
//! job does not inherit the request of the job before it. Only the first line
//! is kept, cleaned of control characters and bounded, since it is untrusted
//! text that goes into logs and the notify hook's JSON.

use anyhow::Result;

use crate::context::Ctx;
use crate::provider::{Dirs, StorageMode};
use crate::settings::Settings;
use crate::state::EnvPaths;
use crate::transport::Transport;

/// The variable every stage script sees.
pub const VAR: &str = "DORMANT_SUSPEND_FILE";
/// The file's name inside the builds dir.
pub const FILE_NAME: &str = ".dormant-suspend-request";
/// At most this much of the file is read.
pub const MAX_BYTES: usize = 4096;
/// At most this many characters of the reason are kept.
pub const MAX_REASON_CHARS: usize = 200;
/// The reason when the file's first line is empty.
pub const NO_REASON: &str = "no reason given";

/// The file's path for an environment whose builds dir is `dirs.builds`.
pub fn path(dirs: &Dirs) -> String {
    format!("{}/{FILE_NAME}", dirs.builds.trim_end_matches('/'))
}

/// The file's path for an environment, from the settings alone (like config).
pub fn path_for(settings: &Settings, paths: &EnvPaths, storage: StorageMode) -> Result<String> {
    Ok(path(&crate::provider::dirs(settings, paths, storage)?))
}

/// The reason: the first line, control characters turned into spaces,
/// trimmed, and cut to `MAX_REASON_CHARS` characters plus `…` when longer.
pub fn reason(content: &[u8]) -> String {
    let text = String::from_utf8_lossy(content);
    let first = text.split(['\n', '\r']).next().unwrap_or("");
    let cleaned: String = first
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    let trimmed = cleaned.trim();
    if trimmed.is_empty() {
        return NO_REASON.to_string();
    }
    let mut out: String = trimmed.chars().take(MAX_REASON_CHARS).collect();
    if trimmed.chars().count() > MAX_REASON_CHARS {
        out.push('…');
    }
    out
}

/// Reads and removes the request: `Some(reason)` if the job wrote the file.
pub async fn take(transport: &dyn Transport, path: &str, ctx: &Ctx) -> Result<Option<String>> {
    Ok(transport
        .take_file(path, MAX_BYTES, ctx)
        .await?
        .map(|content| reason(&content)))
}

/// Whether the job's own code runs in this stage (`build_script`, the
/// `step_*` of multi-step jobs, `after_script`): after those, the run stage
/// looks for a request: over SSH only when the stage's wrapper reported the
/// file present (`Script::watch`), then one command over the open connection.
pub fn runs_job_code(stage: &str) -> bool {
    stage == "build_script" || stage == "after_script" || stage.starts_with("step_")
}

/// After a stage that ran the job's code: takes a request the script wrote and
/// says in the job log what becomes of it. Never fails the stage: a request
/// that cannot be read now is read again by cleanup.
pub async fn after_stage(
    settings: &Settings,
    transport: &dyn Transport,
    path: &str,
    ctx: &Ctx,
) -> Option<String> {
    let reason = match take(transport, path, ctx).await {
        Ok(r) => r?,
        Err(e) => {
            tracing::debug!("looking for a suspend request at {path}: {e:#}");
            return None;
        }
    };
    ctx.log.info(match verdict(settings) {
        Verdict::Honoured => format!("suspending: requested by the job: {reason}"),
        Verdict::NotAllowed => format!(
            "warning: the job asked to be suspended ({reason}) but this runner does not allow it \
             (suspend.allow_job_request = false): its environment is released at the end"
        ),
        Verdict::SuspendDisabled => format!(
            "warning: the job asked to be suspended ({reason}) but suspension is off on this \
             runner (suspend.enabled = false): its environment is released at the end"
        ),
    });
    Some(reason)
}

/// What the operator's settings make of a job's request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Honoured,
    NotAllowed,
    SuspendDisabled,
}

pub fn verdict(settings: &Settings) -> Verdict {
    if !settings.suspend.enabled {
        Verdict::SuspendDisabled
    } else if !settings.suspend.allow_job_request {
        Verdict::NotAllowed
    } else {
        Verdict::Honoured
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_path_is_beside_the_checkout_in_the_builds_dir() {
        let dirs = Dirs {
            builds: "/home/admin/builds/".into(),
            cache: "/home/admin/cache".into(),
        };
        assert_eq!(path(&dirs), "/home/admin/builds/.dormant-suspend-request");
        let state = tempfile::tempdir().unwrap();
        let paths = EnvPaths::new(state.path(), uuid::Uuid::nil());
        let local = path_for(&Settings::default(), &paths, StorageMode::Machine).unwrap();
        assert_eq!(
            local,
            format!(
                "{}/work/builds/.dormant-suspend-request",
                paths.dir.display()
            )
        );
    }

    #[tokio::test]
    async fn the_local_transport_takes_the_request_and_never_follows_a_symlink() {
        let dir = tempfile::tempdir().unwrap();
        let t = crate::transport::local::LocalTransport::new(
            dir.path().to_path_buf(),
            "bash".into(),
            Vec::new(),
        );
        let ctx = Ctx::new(
            crate::context::JobLog::capture().0,
            tokio_util::sync::CancellationToken::new(),
            std::time::Duration::from_secs(10),
        );
        let file = dir.path().join(FILE_NAME);
        let path = file.display().to_string();
        assert_eq!(take(&t, &path, &ctx).await.unwrap(), None);
        std::fs::write(&file, "Which schema?\nsecond\n").unwrap();
        assert_eq!(
            take(&t, &path, &ctx).await.unwrap().as_deref(),
            Some("Which schema?")
        );
        assert!(!file.exists(), "taken means removed");
        std::fs::write(&file, "").unwrap();
        assert_eq!(
            take(&t, &path, &ctx).await.unwrap().as_deref(),
            Some(NO_REASON)
        );
        let secret = dir.path().join("secret");
        std::fs::write(&secret, "root:x:0:0").unwrap();
        std::os::unix::fs::symlink(&secret, &file).unwrap();
        assert_eq!(take(&t, &path, &ctx).await.unwrap(), None);
        assert!(file.symlink_metadata().is_err() && secret.exists());
    }

    #[test]
    fn the_reason_is_the_first_line_cleaned_and_bounded() {
        assert_eq!(
            reason(b"  Which schema should I migrate to?\nmore\n"),
            "Which schema should I migrate to?"
        );
        assert_eq!(reason(b"a\x1b[31mred\x07"), "a [31mred");
        assert_eq!(reason(b""), NO_REASON);
        assert_eq!(reason(b"\n second line only"), NO_REASON);
        let long = "x".repeat(500);
        let r = reason(long.as_bytes());
        assert_eq!(r.chars().count(), MAX_REASON_CHARS + 1);
        assert!(r.ends_with('…'));
        assert_eq!(reason(b"caf\xc3\xa9 \xff"), "café �");
    }
}
