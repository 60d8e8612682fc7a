//! What a simulated job produced: every call with its exit code, time and
//! output, the job's result as the runner would report it, and the key dormant
//! printed.

use std::time::Duration;

use crate::contract::ConfigOutput;

/// What happened to one call of the binary.
#[derive(Debug, Clone)]
pub struct Call {
    /// `config#N`, `prepare#N`, `cleanup#N` (N = prepare attempt) or the stage name.
    pub name: String,
    pub exit_code: i32,
    pub elapsed: Duration,
    /// stdout and stderr as the job log would show them (one pipe, in order).
    pub output: String,
    /// Each output line with the time it arrived, from the start of the call.
    pub arrivals: Vec<(Duration, String)>,
    /// [`Call::output`] as the bytes that came, before the lossy UTF-8
    /// conversion: what a test comparing binary output byte for byte reads
    /// (the runner's job log is bytes too).
    pub raw: Vec<u8>,
}

impl Call {
    /// A call of `cleanup_exec` (not the `cleanup_file_variables` stage).
    pub fn is_cleanup(&self) -> bool {
        self.name.starts_with("cleanup#")
    }

    /// A call of `run_exec` for one stage.
    pub fn is_stage(&self) -> bool {
        !self.name.contains('#')
    }

    /// When the first line containing `text` arrived.
    pub fn arrived(&self, text: &str) -> Option<Duration> {
        self.arrivals
            .iter()
            .find(|(_, l)| l.contains(text))
            .map(|(t, _)| *t)
    }
}

/// The job's result as the runner reports it to GitLab.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobResult {
    Success,
    /// Script failure with the job's exit code (from `BUILD_EXIT_CODE_FILE`).
    BuildFailure(Option<i32>),
    SystemFailure,
    Canceled,
}

impl std::fmt::Display for JobResult {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            JobResult::Success => f.write_str("success"),
            JobResult::BuildFailure(Some(code)) => write!(f, "build failure (exit {code})"),
            JobResult::BuildFailure(None) => f.write_str("build failure"),
            JobResult::SystemFailure => f.write_str("system failure"),
            JobResult::Canceled => f.write_str("canceled"),
        }
    }
}

#[derive(Debug, Clone)]
pub struct JobReport {
    pub result: JobResult,
    pub calls: Vec<Call>,
    /// config's output in the last attempt that printed a valid one.
    pub config: Option<ConfigOutput>,
    /// The key dormant printed in the job log, if any.
    pub key: Option<String>,
    pub prepare_attempts: u32,
}

impl JobReport {
    pub(super) fn new(
        result: JobResult,
        calls: Vec<Call>,
        config: Option<ConfigOutput>,
        prepare_attempts: u32,
    ) -> JobReport {
        let mut r = JobReport {
            result,
            calls,
            config,
            key: None,
            prepare_attempts,
        };
        r.key = r
            .log()
            .lines()
            .filter_map(|l| {
                l.split_once("environment key: ")
                    .map(|(_, k)| k.trim().to_string())
            })
            .next_back();
        r
    }

    /// The job log: every prepare and run call's output, in order (not
    /// config's, whose stdout is the protocol, nor cleanup's, which goes to the
    /// runner's own log).
    pub fn log(&self) -> String {
        self.calls
            .iter()
            .filter(|c| !c.is_cleanup() && !c.name.starts_with("config#"))
            .map(|c| c.output.as_str())
            .collect()
    }

    /// What cleanup printed (the runner's log, never the job log).
    pub fn cleanup_output(&self) -> String {
        self.calls
            .iter()
            .filter(|c| c.is_cleanup())
            .map(|c| c.output.as_str())
            .collect()
    }

    pub fn call(&self, name: &str) -> Option<&Call> {
        self.calls.iter().find(|c| c.name == name)
    }

    pub fn ran(&self, name: &str) -> bool {
        self.call(name).is_some()
    }
}
