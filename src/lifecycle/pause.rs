//! A job's script paused in `dormant-ask` (docs/pause.md), as the run and
//! cleanup stages and `list` see it: whether this environment can keep a paused
//! script (`DORMANT_PAUSE`, which `dormant-ask` reads), and the one
//! parseable job-log line that shows the question.

use crate::model::StorageMode;
use crate::settings::ec2::SuspendMode;
use crate::settings::qemu::QemuSuspendMode;
use crate::settings::{ProviderKind, Settings};
use crate::state::EnvironmentRecord;

/// The variable `dormant-ask` reads: `ok`, or why it cannot pause here.
pub const VAR: &str = "DORMANT_PAUSE";

/// The variable `dormant-continue` reads first: set (to the whole message)
/// only when the environment's paused script was lost with its machine's
/// memory (a hibernation that fell back to a power-off), so it fails at once
/// saying so instead of finding nothing or waiting.
pub const LOST_VAR: &str = "DORMANT_PAUSE_LOST";

/// The variable `dormant-continue` reads when it finds no paused script:
/// set to the exit code of a continued script whose end a job's log has but
/// whose code that job never gave (its `dormant run` was killed:
/// `crate::state::relayed_end`), so the next continue gives it.
pub const ENDED_VAR: &str = "DORMANT_PAUSE_ENDED";

/// The variables of pausing a stage's script gets (docs/pause.md): whether
/// `dormant-ask` may pause ([`VAR`]: `ok` or why not), and for
/// `dormant-continue` a paused script lost with the machine's memory
/// ([`LOST_VAR`]: it says so at once; the record stops saying paused at this
/// job's cleanup) or one that ended whose code a killed job never gave
/// ([`ENDED_VAR`]: it gives it).
pub fn script_vars(settings: &Settings, record: &EnvironmentRecord) -> Vec<(String, String)> {
    let mut vars = vec![(
        VAR.to_string(),
        refusal(settings, record).unwrap_or_else(|| "ok".into()),
    )];
    if let Some(lost) = lost_message(record) {
        vars.push((LOST_VAR.to_string(), lost));
    }
    if let Some(code) = record.paused.as_ref().and_then(|p| p.ended) {
        vars.push((ENDED_VAR.to_string(), code.to_string()));
    }
    vars
}

/// How long a paused script will be kept: the hot window, and what follows
/// it. `dormant run` prints it as a `dormant-ask:` line of its own right
/// after the question's line (where a pause is allowed).
pub fn keep_message(settings: &Settings, record: &EnvironmentRecord) -> Option<String> {
    if refusal(settings, record).is_some() {
        return None;
    }
    let ttl = settings.suspend.ttl;
    let Some(window) = super::hot::window(settings, record) else {
        return Some(format!(
            "the paused script is kept until it is continued, or the environment is released \
             (suspend.ttl = \"{ttl}\")"
        ));
    };
    let window = crate::settings::HumanDuration::from_secs(window.as_secs());
    Some(if keeps_memory(settings, record) {
        format!(
            "the machine stays running {window} after this job (suspend.hot_for), then it \
             hibernates with the paused script; kept until continued or released \
             (suspend.ttl = \"{ttl}\")"
        )
    } else {
        format!(
            "the paused script is kept for {window} after this job (suspend.hot_for) while its \
             machine runs; then the machine is suspended and the script is lost: answer within \
             {window}"
        )
    })
}

/// Whether this environment's suspension keeps the machine's memory (and so
/// a paused script) beyond a hot window: never in volume mode (the machine
/// is deleted).
fn keeps_memory(settings: &Settings, record: &EnvironmentRecord) -> bool {
    if record.storage == StorageMode::Volume {
        return false;
    }
    match settings.provider {
        ProviderKind::Ssh | ProviderKind::Local => true,
        ProviderKind::Qemu => settings.qemu.suspend_mode == QemuSuspendMode::Hibernate,
        ProviderKind::Ec2 => settings.ec2.suspend_mode == SuspendMode::Hibernate,
    }
}

/// The message behind [`LOST_VAR`] for this record, if its paused script
/// was lost: names the environment, what happened, and what to do.
pub fn lost_message(record: &EnvironmentRecord) -> Option<String> {
    let lost = record.paused.as_ref()?.lost.as_deref()?;
    let name = record.key.clone().unwrap_or_else(|| record.id.to_string());
    Some(format!(
        "environment {name}: the script paused there is gone: {lost} (the suspension kept the \
         disk only); nothing to continue: run its work again from the start"
    ))
}

/// The most of a question the job state and the record keep.
pub const QUESTION_MAX: usize = 4096;

/// The most of a question's first line the event log and notify hook get.
pub const SUMMARY_MAX: usize = 200;

/// Why a script in this environment cannot pause, naming the setting; `None`
/// when a paused script is kept: the `ssh` and `local` providers' kept
/// stages (the script waits on the host), and qemu's and EC2's in `hibernate` mode (it
/// waits in the guest or instance, whose memory the suspension saves) — or,
/// in their other modes, for the hot window only (`suspend.hot_for`: the
/// machine runs on after the job; its suspension then loses the script).
pub fn refusal(settings: &Settings, record: &EnvironmentRecord) -> Option<String> {
    if !settings.suspend.enabled {
        return Some("suspend.enabled = false: the environment is released, not kept".into());
    }
    // Volume mode keeps a paused script for the hot window only (qemu, ec2).
    if record.storage == StorageMode::Volume && super::hot::window(settings, record).is_none() {
        return Some(
            "storage = \"volume\": a suspension gives the machine up, with its processes \
             (suspend.hot_for keeps it running for a while after the job, on qemu and ec2)"
                .into(),
        );
    }
    // Every provider below runs its stages through the ssh transport's kept
    // stages, where a paused script waits.
    if matches!(
        settings.provider,
        ProviderKind::Ssh | ProviderKind::Qemu | ProviderKind::Ec2
    ) && settings.ssh.reconnect_timeout.is_zero()
    {
        return Some(
            "ssh.reconnect_timeout = \"0s\": stages run direct, their script ends with the session"
                .into(),
        );
    }
    // Volume mode without a window was refused above; with one it is kept
    // for the window only (keep_message says so).
    let hot = !settings.suspend.hot_for.is_zero();
    match settings.provider {
        // The script waits on the host, which stays up.
        ProviderKind::Ssh => None,
        // The same: its stages run kept in a local bash (the local
        // transport keeps them under these same conditions).
        ProviderKind::Local => None,
        // Hibernation saves the guest's memory, the paused script with it.
        ProviderKind::Qemu if settings.qemu.suspend_mode == QemuSuspendMode::Hibernate => None,
        // The hot window keeps the VM running: a pause for that long.
        ProviderKind::Qemu if hot => None,
        ProviderKind::Qemu => Some(
            "qemu.suspend_mode = \"shutdown\": a suspension powers the VM off, ending its \
             processes (suspend_mode = \"hibernate\" keeps them)"
                .into(),
        ),
        // As qemu's: the hibernated instance's memory holds the script.
        // (Volume mode never hibernates: it has a window, or was refused.)
        ProviderKind::Ec2 if settings.ec2.suspend_mode == SuspendMode::Hibernate => None,
        ProviderKind::Ec2 if hot => None,
        ProviderKind::Ec2 => Some(
            "ec2.suspend_mode = \"stop\": a suspension stops the instance, ending its \
             processes (suspend_mode = \"hibernate\" keeps them)"
                .into(),
        ),
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

    /// A record of storage `storage` (all `refusal` reads of it).
    fn record(storage: crate::model::StorageMode) -> EnvironmentRecord {
        EnvironmentRecord::new(
            crate::state::NewEnvironment {
                id: uuid::Uuid::nil(),
                provider: "qemu",
                runner_id: "1",
                system_id: "s",
                project_id: 5,
                project_path: None,
                job_id: 9,
                storage,
                image: None,
            },
            crate::state::Holder::Operator {
                pid: 0,
                what: "test".into(),
            },
        )
    }

    #[test]
    fn qemu_keeps_a_paused_script_only_when_it_hibernates() {
        let machine = record(StorageMode::Machine);
        let mut s = Settings {
            provider: ProviderKind::Qemu,
            ..Settings::default()
        };
        s.qemu.suspend_mode = QemuSuspendMode::Hibernate;
        assert_eq!(refusal(&s, &machine), None);
        let volume = refusal(&s, &record(StorageMode::Volume)).unwrap();
        assert!(volume.contains("storage = \"volume\""), "{volume}");
        s.ssh.reconnect_timeout = crate::settings::HumanDuration::from_secs(0);
        let direct = refusal(&s, &machine).unwrap();
        assert!(direct.contains("ssh.reconnect_timeout"), "{direct}");
        s = Settings {
            provider: ProviderKind::Qemu,
            ..Settings::default()
        };
        let shutdown = refusal(&s, &machine).unwrap();
        assert!(
            shutdown.contains("qemu.suspend_mode = \"shutdown\""),
            "{shutdown}"
        );
        s.suspend.enabled = false;
        let off = refusal(&s, &machine).unwrap();
        assert!(off.contains("suspend.enabled = false"), "{off}");
    }

    #[test]
    fn local_keeps_a_paused_script_where_it_suspends_in_machine_mode() {
        let machine = record(StorageMode::Machine);
        let mut s = Settings::default();
        assert_eq!(s.provider, ProviderKind::Local);
        assert_eq!(refusal(&s, &machine), None);
        let volume = refusal(&s, &record(StorageMode::Volume)).unwrap();
        assert!(volume.contains("storage = \"volume\""), "{volume}");
        s.suspend.enabled = false;
        let off = refusal(&s, &machine).unwrap();
        assert!(off.contains("suspend.enabled = false"), "{off}");
    }

    #[test]
    fn ec2_keeps_a_paused_script_only_when_it_hibernates_in_machine_mode() {
        let machine = record(StorageMode::Machine);
        let mut s = Settings {
            provider: ProviderKind::Ec2,
            ..Settings::default()
        };
        let stop = refusal(&s, &machine).unwrap();
        assert!(stop.contains("ec2.suspend_mode = \"stop\""), "{stop}");
        s.ec2.suspend_mode = SuspendMode::Hibernate;
        assert_eq!(refusal(&s, &machine), None);
        let volume = refusal(&s, &record(StorageMode::Volume)).unwrap();
        assert!(volume.contains("storage = \"volume\""), "{volume}");
        s.ssh.reconnect_timeout = crate::settings::HumanDuration::from_secs(0);
        let direct = refusal(&s, &machine).unwrap();
        assert!(direct.contains("ssh.reconnect_timeout"), "{direct}");
    }

    #[test]
    fn a_hot_window_allows_a_pause_where_memory_is_lost_and_says_for_how_long() {
        let mut machine = record(StorageMode::Machine);
        machine.machine = Some(crate::model::Machine::new("i-1"));
        for provider in [ProviderKind::Ec2, ProviderKind::Qemu] {
            let mut s = Settings {
                provider,
                ..Settings::default()
            };
            assert!(refusal(&s, &machine).is_some(), "stop/shutdown, no window");
            assert_eq!(keep_message(&s, &machine), None);
            s.suspend.hot_for = crate::settings::HumanDuration::from_secs(600);
            assert_eq!(refusal(&s, &machine), None, "{provider:?} with a window");
            let keep = keep_message(&s, &machine).unwrap();
            assert!(
                keep.contains("kept for 10m") && keep.contains("lost"),
                "{keep}"
            );
            // Volume mode: a window (a machine recorded) allows a pause for
            // the window only, in either suspend mode; without a machine
            // recorded (no window), still refused.
            let mut volume = record(StorageMode::Volume);
            assert!(refusal(&s, &volume).is_some());
            volume.machine = Some(crate::model::Machine::new("i-2"));
            assert_eq!(refusal(&s, &volume), None, "{provider:?} volume");
            s.ec2.suspend_mode = SuspendMode::Hibernate;
            s.qemu.suspend_mode = QemuSuspendMode::Hibernate;
            let keep = keep_message(&s, &volume).unwrap();
            assert!(
                keep.contains("kept for 10m") && keep.contains("lost"),
                "volume mode never keeps it past the window: {keep}"
            );
            s.ec2.suspend_mode = SuspendMode::Stop;
            s.qemu.suspend_mode = QemuSuspendMode::Shutdown;
            s.ec2.suspend_mode = SuspendMode::Hibernate;
            s.qemu.suspend_mode = QemuSuspendMode::Hibernate;
            let keep = keep_message(&s, &machine).unwrap();
            assert!(keep.contains("hibernates"), "{keep}");
        }
        // local: no window (nothing to keep running), kept all the same.
        let mut s = Settings::default();
        s.suspend.hot_for = crate::settings::HumanDuration::from_secs(600);
        let keep = keep_message(&s, &machine).unwrap();
        assert!(keep.contains("until it is continued"), "{keep}");
    }

    #[test]
    fn the_summary_is_the_first_line_bounded() {
        assert_eq!(summary("first\nsecond"), "first");
        let long = "é".repeat(300);
        let s = summary(&long);
        assert!(s.len() <= SUMMARY_MAX && s.chars().all(|c| c == 'é'));
    }
}
