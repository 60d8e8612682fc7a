//! `dormant try`: drives a sample job through every stage exactly as GitLab
//! Runner would (through [`crate::runner_sim`]), suspends it, resumes it in a
//! second job that proves a file survived and `get_sources` was skipped,
//! releases it, and prints a summary with per-stage timings. Where the
//! environment can keep a paused script, job 1 also asks a question
//! (`dormant-ask`) and job 2 answers it (`dormant-continue`): the same
//! process goes on (docs/pause.md). It uses whatever
//! provider the settings select, so an operator can check a real setup before
//! registering the runner.

use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::job::Job;
use crate::runner_sim::{JobReport, JobResult, Runner, SimJob};
use crate::settings::{ProviderKind, Settings};
use crate::state::lock::FileLock;
use crate::state::pool::Pool;
use crate::state::{now_unix, EnvStatus, StateStore};

/// The runner-process variables `try` hands on to the stages it calls.
const PASSED_VARS: &[&str] = &[
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "LANG",
    "DORMANT_STATE_DIR",
    "DORMANT_CONFIG",
    "DORMANT_LOG",
    // The AWS credential chain's variables: the runner passes its own
    // environment to dormant, so an `ec2` try must too (else only a profile
    // under HOME or an instance profile would work).
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_EC2_METADATA_DISABLED",
];

const WRITE_FILE: &str = "echo \"written by dormant try job $CI_JOB_ID at $(date)\" > dormant-try.txt\necho wrote dormant-try.txt in $PWD";
/// Job 1 then pauses (docs/pause.md): it asks a question and waits, alive,
/// for job 2's answer. Where the environment cannot keep a paused script,
/// it says why and goes on.
const ASK: &str = "\nif [ \"$DORMANT_PAUSE\" = ok ] && answer=$(dormant-ask 'Which colour should the build be?'); then\n\
    echo \"job 1's script (pid $BASHPID) got the answer: $answer\"\n\
    else echo \"this environment cannot pause a job: $DORMANT_PAUSE\"; fi";

/// Job 2 answers the question, when job 1 asked one.
const CONTINUE: &str = "\ndormant-continue blue";

/// In job 1's log when its script asked (`lifecycle::pause::log_line`).
const ASKED: &str = "dormant-ask: paused key=";

const CHECK_FILE: &str = "if [ ! -f dormant-try.txt ]; then echo 'dormant-try.txt is missing: the environment was not preserved' >&2; exit 3; fi\n\
    echo \"found: $(cat dormant-try.txt)\"\n\
    if [ -e .fetched-by-job-2 ]; then echo 'get_sources ran on the resumed environment' >&2; exit 4; fi";

pub fn try_job(
    config: Option<&Path>,
    settings: &Settings,
    job: &Job,
    keep: bool,
    out: &mut dyn Write,
) -> Result<()> {
    let binary = std::env::current_exe().context("finding the dormant binary")?;
    let state_dir = settings.state_dir(job)?;
    let tmp_root = std::env::temp_dir().join(format!("dormant-try-{}", std::process::id()));
    let runner_id = settings
        .runner_id
        .clone()
        .unwrap_or_else(|| "1".to_string());
    let mut runner = Runner::new(binary, tmp_root.clone(), &runner_id);
    runner.keep_temp_dirs = keep;
    if let Some(c) = config {
        runner.args = vec!["--config".into(), c.display().to_string()];
    }
    runner.env = PASSED_VARS
        .iter()
        .filter_map(|k| job.driver_var(k).map(|v| (k.to_string(), v.to_string())))
        .collect();

    writeln!(
        out,
        "dormant try: provider {}, state dir {}",
        settings.provider.as_str(),
        state_dir.display()
    )?;
    let base = now_unix() * 100 + fastrand::u64(0..50);
    let project = 1;

    // Job 1 asks through a job variable, job 2 through the payload: both ways
    // a job asks stay exercised, under the runner's own payload encoding
    // (`"suspend_options": {}` when GitLab set nothing).
    let mut first = SimJob::new(base, project)
        .var("DORMANT_SUSPEND_ON_SUCCESS", "true")
        .script(&format!("{WRITE_FILE}{ASK}"));
    first.get_sources = "echo 'fetching sources (simulated)'; touch .fetched-by-job-1".into();
    let r1 = runner.run_job(&first)?;
    print_job(
        out,
        "job 1: new environment, suspend on success (asked by DORMANT_SUSPEND_ON_SUCCESS=true)",
        &r1,
    )?;
    let asked = r1.log().contains(ASKED);
    if asked {
        writeln!(
            out,
            "  job 1's script asked a question (dormant-ask) and waits, alive, in the suspended \
             environment: the job ended successfully at the question"
        )?;
    } else if let Some(why) = r1
        .log()
        .lines()
        .find(|l| l.starts_with("this environment cannot pause a job"))
    {
        writeln!(out, "  {why}")?;
    }
    let mut checks: Vec<(bool, String)> = Vec::new();
    checks.push((r1.result == JobResult::Success, "job 1 succeeded".into()));
    checks.push((
        r1.log()
            .contains("triggers from the DORMANT_* job variables"),
        "job 1's suspension was read from its job variable".into(),
    ));
    let key = r1.key.clone();
    checks.push((key.is_some(), "job 1 printed an environment key".into()));
    let store = StateStore::open(&state_dir)?;
    let env_id = key
        .as_deref()
        .and_then(|k| crate::envkey::EnvironmentKey::parse(k).ok())
        .map(|k| k.env_id);
    let suspended = env_id
        .and_then(|id| {
            crate::state::registry::peek(&store.env_paths(id))
                .ok()
                .flatten()
        })
        .is_some_and(|rec| rec.status() == EnvStatus::Suspended);
    checks.push((
        suspended,
        "job 1's environment is suspended in the registry".into(),
    ));

    if let (Some(key), true) = (&key, suspended) {
        wait_for_refill(&state_dir, settings.prepare_timeout.get(), out)?;
        let mut second = SimJob::new(base + 1, project).resume(key).script(&format!(
            "{CHECK_FILE}{}",
            if asked { CONTINUE } else { "" }
        ));
        second.get_sources = "touch .fetched-by-job-2".into();
        // The hot window (docs/pause.md): job 1's machine still runs, and
        // job 2's timing is that of a continue that starts nothing.
        let hot = env_id
            .and_then(|id| {
                crate::state::registry::peek(&store.env_paths(id))
                    .ok()
                    .flatten()
            })
            .and_then(|rec| rec.hot_until())
            .is_some();
        // On local and ssh a paused script waits on a host that never stops:
        // every continue there is a hot one, with no window to keep.
        let host_stays_up = matches!(settings.provider, ProviderKind::Local | ProviderKind::Ssh);
        let r2 = runner.run_job(&second)?;
        print_job(
            out,
            if hot {
                "job 2: resume with the key in the payload, hot (job 1's machine still ran: no \
                 start, no restore), no trigger (releases at the end)"
            } else if asked && host_stays_up {
                "job 2: resume with the key in the payload, hot (job 1's script waits on a host \
                 that never stops: nothing to start or restore), no trigger (releases at the end)"
            } else {
                "job 2: resume with the key in the payload, no trigger (releases at the end)"
            },
            &r2,
        )?;
        if hot {
            checks.push((
                r2.log().contains("is hot: taking its running machine"),
                "job 2 took job 1's running machine (the hot window, suspend.hot_for)".into(),
            ));
        }
        checks.push((
            r2.result == JobResult::Success,
            "job 2 resumed and found job 1's file".into(),
        ));
        checks.push((
            r2.log().contains("skipping get_sources"),
            "job 2 skipped get_sources".into(),
        ));
        if asked {
            let answered = r2.log().contains("got the answer: blue");
            if answered {
                writeln!(
                    out,
                    "  job 2 answered it (dormant-continue blue): job 1's script went on in the \
                     same process, its output in job 2's log"
                )?;
                if let Some(t) = first_byte_after_answer(&r2) {
                    writeln!(
                        out,
                        "  the script's first byte after the answer came {t:.2} s after job 2's \
                         first call ({})",
                        if hot || host_stays_up {
                            "a hot continue"
                        } else {
                            "a cold continue: the machine was started"
                        }
                    )?;
                }
            }
            checks.push((
                answered,
                "job 2 continued job 1's paused script with an answer".into(),
            ));
        }
        let gone = env_id.is_some_and(|id| !store.env_paths(id).exists());
        checks.push((gone, "job 2 released the environment".into()));
        if r2.result != JobResult::Success {
            writeln!(
                out,
                "--- job 2 log ---\n{}--- job 2 cleanup ---\n{}",
                r2.log(),
                r2.cleanup_output()
            )?;
        }
    } else {
        writeln!(
            out,
            "--- job 1 log ---\n{}--- job 1 cleanup ---\n{}",
            r1.log(),
            r1.cleanup_output()
        )?;
    }
    writeln!(out, "checks:")?;
    for (ok, what) in &checks {
        writeln!(out, "  {}  {what}", if *ok { "ok  " } else { "FAIL" })?;
    }
    if keep {
        writeln!(out, "temp dirs kept under {}", tmp_root.display())?;
    } else {
        let _ = std::fs::remove_dir_all(&tmp_root);
    }
    let failed = checks.iter().filter(|(ok, _)| !ok).count();
    if failed > 0 {
        bail!("dormant try: {failed} check(s) failed");
    }
    writeln!(out, "dormant try: all checks passed")?;
    Ok(())
}

/// With a warm pool, job 1's prepare started a refill that boots the next
/// warm machine. Job 2 starts once it is done: a volume-mode resume then
/// takes that machine (as it would after a human's pause), and job 2's
/// timings are not those of a prepare racing a boot for the CPU. Bounded by
/// `prepare_timeout`; a refill still running then is left to finish on its own.
fn wait_for_refill(state_dir: &Path, bound: Duration, out: &mut dyn Write) -> Result<()> {
    let lock = Pool::at(state_dir).refill_lock();
    if !lock.exists() || FileLock::try_acquire(&lock)?.is_some() {
        return Ok(());
    }
    writeln!(
        out,
        "job 2 waits for the warm pool's refill to finish (at most {} s)",
        bound.as_secs()
    )?;
    let started = Instant::now();
    while started.elapsed() < bound {
        std::thread::sleep(Duration::from_millis(200));
        if FileLock::try_acquire(&lock)?.is_some() {
            writeln!(
                out,
                "the refill finished after {:.1} s",
                started.elapsed().as_secs_f64()
            )?;
            return Ok(());
        }
    }
    writeln!(
        out,
        "the refill still runs after {} s: job 2 starts anyway (see {})",
        bound.as_secs(),
        Pool::at(state_dir).dir().join("refill.log").display()
    )?;
    Ok(())
}

/// From the resuming job's first call to the line the continued script
/// printed after its answer (the measure of docs/pause.md's hot window):
/// the calls before the stage that continued it, then the line's arrival
/// in that stage.
fn first_byte_after_answer(r: &JobReport) -> Option<f64> {
    let mut before = 0.0;
    for c in &r.calls {
        if let Some((at, _)) = c
            .arrivals
            .iter()
            .find(|(_, l)| l.contains("got the answer: blue"))
        {
            return Some(before + at.as_secs_f64());
        }
        before += c.elapsed.as_secs_f64();
    }
    None
}

fn print_job(out: &mut dyn Write, title: &str, r: &JobReport) -> Result<()> {
    let total: f64 = r.calls.iter().map(|c| c.elapsed.as_secs_f64()).sum();
    writeln!(
        out,
        "{title}: {}, {} call(s), {:.2} s",
        r.result,
        r.calls.len(),
        total
    )?;
    for c in &r.calls {
        writeln!(
            out,
            "  {:<24} exit {:>3}  {:>8.3} s",
            c.name,
            c.exit_code,
            c.elapsed.as_secs_f64()
        )?;
    }
    if let Some(k) = &r.key {
        writeln!(out, "  key: {k}")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Collects what is written; the first write signals the channel.
    struct Signalling(Vec<u8>, Option<std::sync::mpsc::Sender<()>>);

    impl Write for Signalling {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            if let Some(tx) = self.1.take() {
                let _ = tx.send(());
            }
            self.0.write(buf)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn job_2_waits_for_a_running_refill_and_only_then() {
        let tmp = tempfile::tempdir().unwrap();
        let pool = Pool::at(tmp.path());
        // No pool at all (warm = 0): nothing is said, nothing waited for.
        let mut out = Vec::new();
        wait_for_refill(tmp.path(), Duration::from_secs(60), &mut out).unwrap();
        assert!(out.is_empty(), "{}", String::from_utf8_lossy(&out));

        std::fs::create_dir_all(pool.dir()).unwrap();
        let held = FileLock::try_acquire(&pool.refill_lock()).unwrap().unwrap();
        // The refill "finishes" (its lock is dropped) only once `try` has
        // said it waits: no timing in the test.
        let (tx, rx) = std::sync::mpsc::channel();
        let releaser = std::thread::spawn(move || {
            // Err: `try` never said it waits (and dropped the sender).
            let _ = rx.recv();
            drop(held);
        });
        let mut out = Signalling(Vec::new(), Some(tx));
        wait_for_refill(tmp.path(), Duration::from_secs(60), &mut out).unwrap();
        let Signalling(out, unused) = out;
        drop(unused);
        releaser.join().unwrap();
        let said = String::from_utf8_lossy(&out);
        assert!(said.contains("waits for the warm pool's refill"), "{said}");
        assert!(said.contains("the refill finished after"), "{said}");
        // The lock is free now: the refill really had finished.
        assert!(FileLock::try_acquire(&pool.refill_lock())
            .unwrap()
            .is_some());

        // A refill that outlasts the bound: job 2 starts anyway, and says so.
        let _held = FileLock::try_acquire(&pool.refill_lock()).unwrap().unwrap();
        let mut out = Vec::new();
        wait_for_refill(tmp.path(), Duration::from_millis(500), &mut out).unwrap();
        let said = String::from_utf8_lossy(&out);
        assert!(said.contains("still runs after"), "{said}");
    }
}
