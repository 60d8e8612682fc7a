//! A job's script paused in `dormant-ask` (docs/pause.md), as the run and
//! cleanup stages and `list` see it: whether this environment can keep a paused
//! script (`DORMANT_PAUSE`, which `dormant-ask` reads), and the one
//! parseable job-log line that shows the question.

use crate::model::StorageMode;
use crate::settings::{ProviderKind, Settings};
use crate::state::EnvironmentRecord;

/// The variable `dormant-ask` reads: `ok`, or why it cannot pause here.
pub const VAR: &str = "DORMANT_PAUSE";

/// The most of a question the job state and the record keep.
pub const QUESTION_MAX: usize = 4096;

/// The most of a question's first line the event log and notify hook get.
pub const SUMMARY_MAX: usize = 200;

/// Why a script in this environment cannot pause, naming the setting; `None`
/// when a paused script is kept (the `ssh` provider's kept stages: the
/// script waits on the host).
pub fn refusal(settings: &Settings, record: &EnvironmentRecord) -> Option<String> {
    if !settings.suspend.enabled {
        return Some("suspend.enabled = false: the environment is released, not kept".into());
    }
    if record.storage == StorageMode::Volume {
        return Some(
            "storage = \"volume\": a suspension gives the machine up, with its processes".into(),
        );
    }
    match settings.provider {
        ProviderKind::Ssh if settings.ssh.reconnect_timeout.is_zero() => Some(
            "ssh.reconnect_timeout = \"0s\": stages run direct, their script ends with the session"
                .into(),
        ),
        ProviderKind::Ssh => None,
        other => Some(format!(
            "provider = \"{}\": this dormant keeps a paused script only on the ssh provider",
            other.as_str()
        )),
    }
}

/// The stages whose script `dormant pause` may freeze: the job's own script.
/// (after_script is the job's too, but it runs after the pause would have
/// ended the stage; the runner's own stages move caches and artifacts.)
pub const USER_STAGES: &[&str] = &["build_script", "step_script"];

/// What a job paused from the host (`dormant pause`) shows as its question,
/// in the job log, the record, `list`, the event log and notify.
pub fn host_question(reason: Option<&str>) -> String {
    let q = match reason.map(str::trim).filter(|r| !r.is_empty()) {
        Some(r) => format!("paused by dormant pause: {r}"),
        None => "paused by dormant pause".to_string(),
    };
    question_text(q.as_bytes())
}

/// The question as kept on the runner host: bounded, lossy UTF-8.
pub fn question_text(question: &[u8]) -> String {
    let q = &question[..question.len().min(QUESTION_MAX)];
    String::from_utf8_lossy(q).into_owned()
}

/// The question's first line, bounded, for the event log and notify hook.
pub fn summary(question: &str) -> String {
    let first = question.lines().next().unwrap_or("");
    let mut end = first.len().min(SUMMARY_MAX);
    while !first.is_char_boundary(end) {
        end -= 1;
    }
    first[..end].to_string()
}

/// The job log's line: one line, parseable (a JSON string holds any question).
pub fn log_line(key: &str, question: &str) -> String {
    format!(
        "dormant-ask: paused key={key} question={}\n",
        serde_json::Value::String(question.to_string())
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_line_is_one_line_whatever_the_question() {
        let line = log_line("k1", "two\nlines \"quoted\"");
        assert_eq!(line.lines().count(), 1);
        assert!(
            line.ends_with("question=\"two\\nlines \\\"quoted\\\"\"\n"),
            "{line}"
        );
    }

    #[test]
    fn the_summary_is_the_first_line_bounded() {
        assert_eq!(summary("first\nsecond"), "first");
        let long = "é".repeat(300);
        let s = summary(&long);
        assert!(s.len() <= SUMMARY_MAX && s.chars().all(|c| c == 'é'));
    }
}
