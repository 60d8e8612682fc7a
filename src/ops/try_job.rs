//! `dormant try`: drives a sample job through every stage exactly as GitLab
//! Runner would (through [`crate::runner_sim`]), suspends it, resumes it in a
//! second job that proves a file survived and `get_sources` was skipped,
//! releases it, and prints a summary with per-stage timings. It uses whatever
//! provider the settings select, so an operator can check a real setup before
//! registering the runner.

use std::io::Write;
use std::path::Path;

use anyhow::{bail, Context, Result};

use crate::job::Job;
use crate::runner_sim::{JobReport, JobResult, Runner, SimJob};
use crate::settings::Settings;
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
];

const WRITE_FILE: &str = "echo \"written by dormant try job $CI_JOB_ID at $(date)\" > dormant-try.txt\necho wrote dormant-try.txt in $PWD";
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
        .script(WRITE_FILE);
    first.get_sources = "echo 'fetching sources (simulated)'; touch .fetched-by-job-1".into();
    let r1 = runner.run_job(&first)?;
    print_job(
        out,
        "job 1: new environment, suspend on success (asked by DORMANT_SUSPEND_ON_SUCCESS=true)",
        &r1,
    )?;
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
        let mut second = SimJob::new(base + 1, project)
            .resume(key)
            .script(CHECK_FILE);
        second.get_sources = "touch .fetched-by-job-2".into();
        let r2 = runner.run_job(&second)?;
        print_job(
            out,
            "job 2: resume with the key in the payload, no trigger (releases at the end)",
            &r2,
        )?;
        checks.push((
            r2.result == JobResult::Success,
            "job 2 resumed and found job 1's file".into(),
        ));
        checks.push((
            r2.log().contains("skipping get_sources"),
            "job 2 skipped get_sources".into(),
        ));
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
