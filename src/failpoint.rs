//! Crash points for tests: `failpoint!("prepare:claimed")` marks a line where
//! the crash tests SIGKILL the process, to prove the next process can finish
//! or undo what it left. Compiled in only with the `testing` cargo feature
//! (test builds; `scripts/test.sh` turns it on); otherwise the macro is empty.
//!
//! Armed by two variables in dormant's own environment (read once at start):
//! `DORMANT_FAILPOINT=<name>` and, optionally, `DORMANT_FAILPOINT_ONCE=<file>`:
//! fire only if that file does not exist yet, creating it — so the runner's
//! retry of the same stage gets past the point. `<name>` may list several
//! points, comma-separated, for a scenario in which two processes die (a
//! prepare, then the runner's cleanup after it); with a once-file each fires
//! once, the first listed making `<file>`, the n-th `<file>.<n>`.
//!
//! A pause point (`failpoint::pause("shell:join-checked").await`) is for a
//! race instead: armed by the same `DORMANT_FAILPOINT`, with
//! `DORMANT_FAILPOINT_PAUSE=<dir>` it makes `<dir>/<name>.reached` and waits
//! there until the test makes `<dir>/<name>.go`, so a test can run the other
//! side of the race in the window, deterministically.

#[cfg(feature = "testing")]
mod armed {
    use std::path::PathBuf;
    use std::sync::OnceLock;

    static ARMED: OnceLock<Vec<(String, Option<PathBuf>)>> = OnceLock::new();
    static PAUSE: OnceLock<Option<PathBuf>> = OnceLock::new();

    /// The longest a pause point waits for its test (then it goes on).
    const PAUSE_BOUND: std::time::Duration = std::time::Duration::from_secs(300);

    pub fn init(names: Option<&str>, once: Option<&str>, pause: Option<&str>) {
        let _ = PAUSE.set(pause.map(PathBuf::from));
        let names = names.unwrap_or("").split(',').map(str::trim);
        let armed = names
            .filter(|n| !n.is_empty())
            .enumerate()
            .map(|(i, n)| {
                let marker = once.map(|f| match i {
                    0 => PathBuf::from(f),
                    _ => PathBuf::from(format!("{f}.{}", i + 1)),
                });
                (n.to_string(), marker)
            })
            .collect();
        let _ = ARMED.set(armed);
    }

    fn find(name: &str) -> Option<&'static (String, Option<PathBuf>)> {
        ARMED.get()?.iter().find(|(armed, _)| armed == name)
    }

    /// Whether `name` is an armed failpoint (its once-marker not yet made):
    /// for a step that must be split to be killed half-way (a torn write).
    pub fn armed(name: &str) -> bool {
        find(name).is_some_and(|(_, once)| once.as_ref().is_none_or(|m| !m.exists()))
    }

    pub async fn pause(name: &str) {
        let (Some(_), Some(Some(dir))) = (find(name), PAUSE.get()) else {
            return;
        };
        let _ = std::fs::write(dir.join(format!("{name}.reached")), "");
        let go = dir.join(format!("{name}.go"));
        let deadline = std::time::Instant::now() + PAUSE_BOUND;
        while !go.exists() && std::time::Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }

    pub fn hit(name: &str) {
        let Some((_, once)) = find(name) else {
            return;
        };
        if let Some(marker) = once {
            let created = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(marker);
            if created.is_err() {
                return;
            }
        }
        eprintln!("dormant: failpoint {name}: SIGKILL");
        // SAFETY: kill(2) on our own pid has no memory-safety preconditions.
        unsafe {
            libc::kill(libc::getpid(), libc::SIGKILL);
        }
    }
}

/// Arms the failpoint named in dormant's environment (no-op without the feature).
pub fn init(_name: Option<&str>, _once: Option<&str>, _pause: Option<&str>) {
    #[cfg(feature = "testing")]
    armed::init(_name, _once, _pause);
}

#[cfg(feature = "testing")]
pub use armed::{armed, hit, pause};

/// Without the `testing` feature no pause point ever waits.
#[cfg(not(feature = "testing"))]
pub async fn pause(_name: &str) {}

/// Without the `testing` feature no failpoint is ever armed.
#[cfg(not(feature = "testing"))]
pub fn armed(_name: &str) -> bool {
    false
}

/// `failpoint!("stage:step")`: SIGKILL here if armed (test builds only).
#[macro_export]
macro_rules! failpoint {
    ($name:literal) => {
        #[cfg(feature = "testing")]
        $crate::failpoint::hit($name);
    };
}

/// Crash points in the shell scripts dormant sends to a machine (the kept
/// stage's owner, `dormant-continue`): a line `: failpoint NAME` there is a
/// no-op (one builtin) in every build. A `testing` build sends it as code
/// that, when `DORMANT_FAILPOINT` names NAME on the machine (see
/// [`script_env`] for how it gets there), says the same last words as
/// [`hit`] and SIGKILLs the shell that runs it ($BASHPID; or the pids the
/// words after NAME give, e.g. `$$ $BASHPID` for a pipeline's subshell and
/// its script), once per `DORMANT_FAILPOINT_ONCE` file as here. With
/// `DORMANT_FAILPOINT_NAP=<seconds>` it sleeps that long instead (saying
/// `nap`): a race window widened to a certainty, e.g. a script that ends
/// while the owner halts it.
pub fn in_script(text: &str) -> std::borrow::Cow<'_, str> {
    #[cfg(feature = "testing")]
    {
        if text.contains(": failpoint ") {
            return text
                .lines()
                .map(|l| {
                    let t = l.trim_start();
                    match t.strip_prefix(": failpoint ") {
                        Some(rest) => {
                            let (name, pids) = rest.split_once(' ').unwrap_or((rest, "$BASHPID"));
                            format!(
                            "{indent}case ,${{DORMANT_FAILPOINT-}}, in *,{name},*) if [ -z \"${{DORMANT_FAILPOINT_ONCE-}}\" ] \
                             || ( set -C; : > \"$DORMANT_FAILPOINT_ONCE\" ) 2>/dev/null; then \
                             if [ -n \"${{DORMANT_FAILPOINT_NAP-}}\" ]; then \
                             echo \"dormant: failpoint {name}: nap\" >&2; sleep \"$DORMANT_FAILPOINT_NAP\"; else \
                             echo \"dormant: failpoint {name}: SIGKILL\" >&2; kill -s KILL {pids}; fi; fi;; esac\n",
                            indent = &l[..l.len() - t.len()],
                        )
                        }
                        None => format!("{l}\n"),
                    }
                })
                .collect::<String>()
                .into();
        }
    }
    text.into()
}

/// The variables that arm [`in_script`]'s crash points on the machine: this
/// process's own `DORMANT_FAILPOINT` and `DORMANT_FAILPOINT_ONCE` (`testing`
/// builds; none otherwise). `dormant run` puts them in the stage script's
/// environment (`dormant-continue` runs there) and in the owner's functions.
pub fn script_env() -> Vec<(String, String)> {
    #[cfg(feature = "testing")]
    {
        [
            "DORMANT_FAILPOINT",
            "DORMANT_FAILPOINT_ONCE",
            "DORMANT_FAILPOINT_NAP",
        ]
        .into_iter()
        .filter_map(|k| Some((k.to_string(), std::env::var(k).ok()?)))
        .collect()
    }
    #[cfg(not(feature = "testing"))]
    Vec::new()
}
