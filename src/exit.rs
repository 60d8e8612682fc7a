//! How a stage ends: the one failure type and the one map from it to the exit
//! codes GitLab Runner reads (`BUILD_FAILURE_EXIT_CODE` / `SYSTEM_FAILURE_EXIT_CODE`).
//!
//! A bare `?` inside a stage is a system failure. Only the run stage makes a
//! build failure from a script's exit code, and prepare refuses a job's own bad
//! input (a malformed or foreign environment key, ...) as a build failure on
//! purpose: the runner retries a system failure of prepare three times, which
//! cannot help when the job asked for something this runner will never grant
//! (`docs/runner-contract.md`, "Exit codes" and "Prepare retries").

use std::path::Path;

use crate::contract::{self, var};

/// Why a stage did not succeed.
#[derive(Debug)]
pub enum Failure {
    /// The job's script exited with `code` (already written to `BUILD_EXIT_CODE_FILE`).
    Build { code: i32 },
    /// The job asked for something this runner refuses (bad key, wrong project, ...).
    Refused(anyhow::Error),
    /// The environment or the runner host broke, not the job.
    System(anyhow::Error),
}

impl From<anyhow::Error> for Failure {
    fn from(err: anyhow::Error) -> Self {
        Failure::System(err)
    }
}

impl Failure {
    pub fn refused(msg: impl std::fmt::Display) -> Self {
        Failure::Refused(anyhow::anyhow!("{msg}"))
    }
}

/// An operator command refused what it was asked (`dormant attach`, `dormant
/// shell`, `dormant pause`): its own exit code, so a script can tell the cases apart. Raised
/// as the error of a bare `?` (a system failure) and picked out of it by
/// [`ExitCodes::exit_code`].
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct Refusal {
    pub why: Refused,
    pub message: String,
}

/// Why an operator command refused; each has its own exit code (docs/guide/
/// exit-codes.md), apart from the runner's 1 and 2.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// No environment or job of this runner manager by that key, id or job id.
    NotFound,
    /// A key of another runner manager (another system id or runner id).
    OtherRunner,
    /// The environment is not running a job (suspended, paused, being
    /// released): `attach` showed what its last stage printed.
    NotRunning,
    /// Not on this provider (`shell` beside a job on `local`: the job's
    /// directory is on this host, the message says where).
    NotOnThisProvider,
    /// `dormant pause`: the environment cannot keep a paused script (the
    /// message names the setting: `suspend.enabled = false`, ...).
    CannotKeep,
    /// `dormant pause`: the job runs no user script stage now (it is in
    /// prepare, between stages, in after_script, caches or artifacts).
    NotInScript,
    /// `dormant pause`: another script of the environment already waits for
    /// its answer (one paused script per environment: docs/pause.md).
    AlreadyPaused,
}

impl Refused {
    pub fn code(self) -> i32 {
        match self {
            Refused::NotFound => 3,
            Refused::OtherRunner => 4,
            Refused::NotRunning => 5,
            Refused::NotOnThisProvider => 6,
            Refused::CannotKeep => 7,
            Refused::NotInScript => 8,
            Refused::AlreadyPaused => 9,
        }
    }

    /// The error to return.
    pub fn because(self, message: impl std::fmt::Display) -> anyhow::Error {
        Refusal {
            why: self,
            message: message.to_string(),
        }
        .into()
    }
}

/// The two exit codes the runner told us to use (today 1 and 2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExitCodes {
    pub build_failure: i32,
    pub system_failure: i32,
}

impl Default for ExitCodes {
    fn default() -> Self {
        // The values GitLab Runner has always passed; used only when dormant is
        // run by hand, outside the runner.
        ExitCodes {
            build_failure: contract::DEFAULT_BUILD_FAILURE_EXIT_CODE,
            system_failure: contract::DEFAULT_SYSTEM_FAILURE_EXIT_CODE,
        }
    }
}

impl ExitCodes {
    /// Reads the codes from the driver's environment, falling back to the defaults.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Self {
        let d = ExitCodes::default();
        let read = |name: &str, default: i32| {
            get(name)
                .and_then(|v| v.trim().parse::<i32>().ok())
                .unwrap_or(default)
        };
        ExitCodes {
            build_failure: read(var::BUILD_FAILURE_EXIT_CODE, d.build_failure),
            system_failure: read(var::SYSTEM_FAILURE_EXIT_CODE, d.system_failure),
        }
    }

    /// The one place a stage's result becomes a process exit code. Messages go
    /// to stderr: the job log for prepare and run, the runner's log for cleanup.
    pub fn exit_code(&self, result: &Result<(), Failure>, err: &mut dyn std::io::Write) -> i32 {
        match result {
            Ok(()) => 0,
            Err(Failure::Build { .. }) => self.build_failure,
            Err(Failure::Refused(e)) => {
                let _ = writeln!(err, "dormant: {e:#}");
                self.build_failure
            }
            Err(Failure::System(e)) => {
                let _ = writeln!(err, "dormant: {e:#}");
                match e.downcast_ref::<Refusal>() {
                    Some(r) => r.why.code(),
                    None => self.system_failure,
                }
            }
        }
    }
}

/// Writes a script's real exit code to `BUILD_EXIT_CODE_FILE`, where the runner
/// reads the job's exit code (so `allow_failure: exit_codes` works).
pub fn write_build_exit_code(file: &Path, code: i32) -> anyhow::Result<()> {
    use anyhow::Context;
    std::fs::write(file, format!("{code}\n")).with_context(|| {
        format!(
            "writing the exit code to BUILD_EXIT_CODE_FILE {}",
            file.display()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_come_from_the_environment() {
        let codes = ExitCodes::from_lookup(|k| match k {
            "BUILD_FAILURE_EXIT_CODE" => Some("17".into()),
            "SYSTEM_FAILURE_EXIT_CODE" => Some("42".into()),
            _ => None,
        });
        assert_eq!(codes.build_failure, 17);
        assert_eq!(codes.system_failure, 42);
        let mut sink = Vec::new();
        assert_eq!(codes.exit_code(&Ok(()), &mut sink), 0);
        assert_eq!(
            codes.exit_code(&Err(Failure::Build { code: 9 }), &mut sink),
            17
        );
        assert_eq!(
            codes.exit_code(&Err(Failure::System(anyhow::anyhow!("boom"))), &mut sink),
            42
        );
        assert_eq!(codes.exit_code(&Err(Failure::refused("no")), &mut sink), 17);
        let text = String::from_utf8(sink).unwrap();
        assert!(text.contains("dormant: boom"), "{text}");
        assert!(text.contains("dormant: no"), "{text}");
    }

    #[test]
    fn an_operator_refusal_has_its_own_code_and_its_message() {
        let codes = ExitCodes::default();
        let mut sink = Vec::new();
        let e = Refused::NotFound.because("no environment 7");
        assert_eq!(codes.exit_code(&Err(Failure::System(e)), &mut sink), 3);
        let e = Refused::OtherRunner
            .because("another's")
            .context("attaching");
        assert_eq!(codes.exit_code(&Err(Failure::System(e)), &mut sink), 4);
        let text = String::from_utf8(sink).unwrap();
        assert!(text.contains("dormant: no environment 7"), "{text}");
        assert!(text.contains("dormant: attaching: another's"), "{text}");
    }

    #[test]
    fn missing_or_garbled_codes_fall_back_to_defaults() {
        let codes =
            ExitCodes::from_lookup(|k| (k == "BUILD_FAILURE_EXIT_CODE").then(|| "x".into()));
        assert_eq!(codes, ExitCodes::default());
    }
}
