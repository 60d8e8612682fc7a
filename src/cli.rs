//! Command line: the four stages GitLab Runner calls, and the operator commands.
//!
//! `build.rs` includes this file to generate the man pages and shell
//! completions: it may use only `std` and `clap`.

use std::path::PathBuf;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "dormant",
    version,
    about = "GitLab Runner custom executor with suspendable environments"
)]
pub struct Cli {
    /// Settings file (else DORMANT_CONFIG, else /etc/dormant/config.toml, else defaults).
    #[arg(long, global = true, value_name = "PATH")]
    pub config: Option<PathBuf>,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Stage 1 (config_exec): print the executor's JSON config.
    Config,
    /// Stage 2 (prepare_exec): create or resume the job's environment.
    Prepare,
    /// Stage 3 (run_exec): run one stage script in the environment.
    Run {
        /// The script the runner wrote.
        script: PathBuf,
        /// The stage name (prepare_script, get_sources, build_script, ...).
        stage: String,
    },
    /// Stage 4 (cleanup_exec): suspend or release the environment.
    Cleanup,
    /// List environments in the registry.
    List {
        /// Print JSON lines instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Show one environment's record and its last events, by key or id.
    /// Exit 3: no such environment here; 4: another runner manager's key.
    Inspect { key: String },
    /// The event history (created, resumed, suspended, released, failed,
    /// recovered, sweep) of one environment or of all, oldest first.
    Events {
        /// Only this environment (its key or id; exit 3 when it is neither,
        /// 4 for another runner manager's key).
        key: Option<String>,
        /// Only events of the last DURATION ("90s", "10m", "2h", "7d").
        #[arg(long, value_name = "DURATION")]
        since: Option<String>,
        /// Keep printing new events as they are written (through rotations)
        /// until interrupted.
        #[arg(long)]
        follow: bool,
        /// Print the lines as stored (JSON lines) instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Release (delete) an environment, by key or id: a suspended one, or one
    /// whose holder (job or shell) is gone. Exit 3: no such environment here;
    /// 4: another runner manager's key (nothing is released).
    Release {
        key: String,
        /// Do not wait for the claim grace of a holder that has no process
        /// left (a live holder is never overridden).
        #[arg(long)]
        force: bool,
    },
    /// Open a shell in an environment (starting it if suspended); on exit it
    /// is suspended again. On an environment a job is running in it joins
    /// the job instead: the shell runs on the job's machine, in its project
    /// directory, beside the job, claims nothing, and is ended by the job's
    /// cleanup (told first, at most 10 s). Exit 3: no such environment or job
    /// here; 4: another runner manager's key; 5: the job is still preparing
    /// its environment; 6: beside a job on `local` (the message says where
    /// its directory is); otherwise the shell's or command's own code.
    Shell {
        /// The environment's key or id, or the id of a job running in it.
        #[arg(value_name = "KEY|ID|JOB_ID")]
        key: String,
        /// Release the environment on exit instead of suspending it (refused
        /// beside a running job).
        #[arg(long)]
        release: bool,
        /// Run this command line there without a terminal, and exit with its code.
        #[arg(last = true, value_name = "COMMAND")]
        command: Vec<String>,
    },
    /// Watch a running job, live and read-only: the running stage's output
    /// from its first byte, then each next stage, until the job ends (exit 0)
    /// or Ctrl-C (exit 0, the job runs on). An environment that runs no job
    /// shows what its last stage printed and exits 5. Exit 3: no such
    /// environment or job here; 4: another runner manager's key.
    Attach {
        /// The environment's key or id, or the job's id.
        #[arg(value_name = "KEY|ID|JOB_ID")]
        key: String,
        /// Start at the running stage's current end, not its first byte.
        #[arg(long)]
        from_now: bool,
    },
    /// Pause a running job: its running build_script or step_script ends
    /// successfully at once (its output so far in the job log), its script is
    /// frozen on the machine, and the job's cleanup suspends the environment
    /// keeping it; a job that resumes the environment wakes it with
    /// `dormant-continue`, which exits with the script's code (125 when it
    /// cannot continue: its own failures). local and ssh providers; qemu and
    /// ec2 with suspend_mode = "hibernate". Exit 3: no such environment or
    /// job here; 4: another runner manager's key; 5: it runs no job; 7: the
    /// environment cannot keep a paused script (the setting is named); 8: the
    /// job runs no user script now; 9: another script of the environment
    /// already waits for its answer.
    Pause {
        /// The environment's key or id, or the job's id.
        #[arg(value_name = "KEY|ID|JOB_ID")]
        key: String,
        /// Shown as the paused job's question (job log, list, events, notify).
        #[arg(long, value_name = "TEXT")]
        reason: Option<String>,
    },
    /// Delete suspended environments past the TTL; report machines with no record.
    Sweep {
        /// Also delete machines the provider manages that have no record (lost state).
        #[arg(long)]
        delete_orphans: bool,
    },
    /// Take over the suspended EC2 environments of this runner manager (its
    /// system id) that no record here knows: after replacing the host, with the
    /// old one gone. Prints what it adopted, and what it left alone and why;
    /// fails when it cannot list the region or a take-over failed.
    Adopt,
    /// Top up the warm pool: retire warm machines that are too old, made from
    /// settings that changed, dead or not wanted, and boot what `warm` asks for
    /// (`[qemu] warm`, `[ec2] warm`). Prepare starts it detached after taking a warm
    /// machine; the Debian package's timer runs it every minute.
    Warm,
    /// Wait until the hot window of environment ID has passed, then suspend
    /// its machine (docs/pause.md, "The hot window"). Started detached by the
    /// cleanup that made it hot; not for operators (`dormant sweep` does the
    /// same for every window that has passed).
    #[command(hide = true)]
    Cool {
        /// The environment's id.
        id: String,
    },
    /// Print Prometheus text: the registry (environments by status, oldest
    /// suspension, paused jobs waiting for an answer and the oldest question)
    /// and the event log's counters and histograms.
    Metrics,
    /// Drive a sample job through every stage like GitLab Runner, suspend it,
    /// resume it in a second job, release it, and print a summary.
    Try {
        /// Keep the temp dirs and print their paths.
        #[arg(long)]
        keep: bool,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shipped runner stanza calls this binary with arguments it accepts.
    #[test]
    fn the_example_runner_stanza_matches_the_command_line() {
        let text = include_str!("../examples/config.toml");
        let doc: toml::Table = toml::from_str(text).expect("examples/config.toml is valid TOML");
        let runner = &doc["runners"].as_array().expect("[[runners]]")[0];
        assert_eq!(runner["executor"].as_str(), Some("custom"));
        let custom = runner["custom"].as_table().expect("[runners.custom]");
        for stage in ["config", "prepare", "run", "cleanup"] {
            let exec = custom[&format!("{stage}_exec")].as_str().unwrap();
            assert!(exec.ends_with("/dormant"), "{stage}_exec = {exec}");
            let mut argv: Vec<String> = vec!["dormant".into()];
            argv.extend(
                custom[&format!("{stage}_args")]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|a| a.as_str().unwrap().to_string()),
            );
            if stage == "run" {
                // The runner appends the script path and the stage name.
                argv.extend(["/tmp/script".into(), "build_script".into()]);
            }
            let cli = Cli::try_parse_from(&argv).unwrap_or_else(|e| panic!("{argv:?}: {e}"));
            let matches = match (&cli.command, stage) {
                (Command::Config, "config")
                | (Command::Prepare, "prepare")
                | (Command::Cleanup, "cleanup") => true,
                (Command::Run { stage: s, .. }, "run") => s == "build_script",
                _ => false,
            };
            assert!(matches, "{stage}: parsed as {:?}", cli.command);
        }
    }
}
