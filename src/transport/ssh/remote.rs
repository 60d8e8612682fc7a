//! The remote side of one stage: a small bash wrapper that receives the stage
//! script on stdin, runs it in its own process group and reports on stderr.
//!
//! Protocol (the wrapper's stderr; the script's own stderr is merged into its
//! stdout so the job log keeps the order the script wrote in):
//! - `dormant-pgid <pgid>`: the script started, in this process group;
//! - `dormant-exit <code>`: the script's exit code, the authoritative result
//!   (a script's own 255 is not confused with ssh's 255);
//! - `dormant-watched present|absent`: after the script, whether the file
//!   named by `$3` exists (a shell test, no fork; only when `$3` is set);
//! - `dormant-error <text>`: the wrapper could not run the script.
//!
//! After the script's bytes, the wrapper's stdin stays open as a control
//! line: `TERM` or `KILL` signals the script's process group (a termination
//! needs no second channel), and end of file — dormant died or the connection
//! was lost — terminates the group (SIGTERM, SIGKILL 5 s later), so a script
//! never runs on with nobody to report to.
//!
//! Nothing touches the host's disk: the script is read into a shell variable
//! with bash's own `read -N` (all of it, checked complete: a connection lost
//! while it arrives must not run half a script) and run by `eval` in a
//! subshell of the wrapper — a fork, no new bash, no pipe, no file — with
//! stdin from /dev/null so a command that reads stdin cannot swallow anything.
//! The wrapper starts no programs at all (no `mktemp`, `head`, `wc`, `setsid`,
//! not even a second bash): each exec cost 1–3 ms on every stage, the bulk of
//! a stage's cost over a bare `ssh -S … true` (see the README's performance
//! section). The script's process group comes from job control (`set -m`,
//! turned off again inside the subshell so the script's own pipelines stay in
//! its group). When the login shell is bash, it runs the wrapper itself (see
//! [`command_line`]).
//!
//! What a subshell changes for the script, and how the wrapper keeps it as a
//! shell of its own would see it: the wrapper's variables and positional
//! parameters are cleared first (the script's first line unsets the copy of
//! itself, `eval` has already taken it); `$$` is the wrapper's pid, as in any
//! subshell (`$BASHPID` is the script's), so a signal the script sends to
//! `$$` is passed on by the wrapper to the script's shell (INT to its whole
//! group, as a Ctrl-C would) — `kill $$` ends the script, runs its trap or
//! is ignored (QUIT) as it would in a bash of its own, and is reported as its
//! exit.

/// The wrapper, run with `$1` = the script's length in bytes, `$2` = the
/// work directory and `$3` = the file to watch (see [`command_line`]).
pub const WRAPPER: &str = r#"r() { local LC_ALL=C; IFS= read -r -N "$1" s && [ "${#s}" -eq "$1" ]; }
if ! r "$1"; then echo "dormant-error the stage script arrived incomplete: not run" >&2; exit 97; fi
unset -f r
if [ -n "$2" ] && ! cd -- "$2" 2>/dev/null; then echo "dormant-error the work directory $2 does not exist on the host" >&2; exit 97; fi
# `$$` in the script is this wrapper: what the script sends it is passed on
# to the script. Set before the script starts (a subshell starts with them
# reset), so a signal sent at once is kept until the script's pid is known.
# INT goes to the whole group, as a Ctrl-C would: bash ignores an INT that
# arrives while it waits for a command the INT did not reach. The script
# starts with QUIT ignored but trappable, as a bash of its own does.
p= q=
for g in TERM HUP QUIT USR1 USR2; do
  trap "if [ -n \"\$p\" ]; then kill -s $g \$p; else q=$g; fi 2>/dev/null" "$g"
done
trap "if [ -n \"\$p\" ]; then kill -s INT -- -\$p; else q=INT; fi 2>/dev/null" INT
# Job control only to start the script in a group of its own; its messages
# ("[1]+ Exit 3 ...", when the script ends at once) must not reach stderr.
{ set -m; ( set +m; trap '' QUIT; unset w p q g; set --; eval "$s" ) </dev/null 2>&1 & p=$!; set +m; } 2>/dev/null
unset s
[ -z "$q" ] || kill -s "$q" "$p" 2>/dev/null
# Only now (the script must keep the default): a lost connection must not
# kill the wrapper before it has reported and cleaned up.
trap '' PIPE
echo "dormant-pgid $p" >&2
( while IFS= read -r c; do case $c in TERM|KILL) kill -s "$c" -- "-$p";; esac; done
  kill -s TERM -- "-$p"; sleep 5; kill -s KILL -- "-$p" ) <&0 >/dev/null 2>&1 &
w=$!
disown "$w"
# A trapped signal ends `wait` early: wait again until the script is gone.
while :; do wait "$p"; rc=$?; kill -0 "$p" 2>/dev/null || break; done
kill -s KILL -- "-$p" "$w" 2>/dev/null
if [ -n "$3" ]; then
  if [ -e "$3" ] || [ -L "$3" ]; then echo "dormant-watched present" >&2; else echo "dormant-watched absent" >&2; fi
fi
echo "dormant-exit $rc" >&2
exit "$rc"
"#;

/// The first line of every uploaded script: the wrapper's copy of the script
/// goes (`eval` already holds it), so the script sees no variable it did not set.
const PRELUDE: &str = "unset s\n";

/// The control line that sends `signal` (`TERM` or `KILL`) to the script's group.
pub fn signal_line(signal: &str) -> Vec<u8> {
    format!("{signal}\n").into_bytes()
}

/// The remote command line, interpreted by the user's login shell: a bash
/// (not in POSIX mode) runs the wrapper itself, any other shell starts one —
/// a bash start saved on every stage for the common case.
pub fn command_line(script_len: usize, workdir: Option<&str>, watch: Option<&str>) -> String {
    format!(
        "set -- {script_len} {workdir} {watch}; w={wrapper}; \
         if [ -n \"${{BASH_VERSION-}}\" ] && ! shopt -oq posix; then eval \"$w\"; \
         else exec bash -c \"$w\" dormant \"$@\"; fi",
        workdir = shell_quote(workdir.unwrap_or("")),
        watch = shell_quote(watch.unwrap_or("")),
        wrapper = shell_quote(WRAPPER),
    )
}

/// The script as uploaded: the prelude, the extra environment exported, then
/// the runner's script unchanged.
pub fn script_with_env(body: &[u8], env: &[(String, String)]) -> anyhow::Result<Vec<u8>> {
    let mut out = Vec::with_capacity(body.len() + 128);
    out.extend_from_slice(PRELUDE.as_bytes());
    for (k, v) in env {
        if k.is_empty()
            || !k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            || k.starts_with(|c: char| c.is_ascii_digit())
        {
            anyhow::bail!("{k:?} is not a valid environment variable name");
        }
        out.extend_from_slice(format!("export {k}={}\n", shell_quote(v)).as_bytes());
    }
    if body.contains(&0) {
        // A shell variable cannot hold a NUL byte; bash would drop it and the
        // wrapper would call the script incomplete.
        anyhow::bail!("the stage script contains a NUL byte: it is not a shell script");
    }
    out.extend_from_slice(body);
    Ok(out)
}

/// A line of the wrapper's stderr.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Report {
    Pgid(i64),
    Exit(i32),
    /// Whether the watched file exists after the script.
    Watched(bool),
    Error(String),
    /// Anything else: the wrapper's shell complaining (e.g. no bash).
    Other(String),
}

pub fn parse_report(line: &str) -> Report {
    let line = line.trim_end_matches(['\r', '\n']);
    if let Some(rest) = line.strip_prefix("dormant-pgid ") {
        if let Ok(p) = rest.trim().parse() {
            return Report::Pgid(p);
        }
    }
    if let Some(rest) = line.strip_prefix("dormant-exit ") {
        if let Ok(c) = rest.trim().parse() {
            return Report::Exit(c);
        }
    }
    match line.strip_prefix("dormant-watched ") {
        Some("present") => return Report::Watched(true),
        Some("absent") => return Report::Watched(false),
        _ => {}
    }
    if let Some(rest) = line.strip_prefix("dormant-error ") {
        return Report::Error(rest.to_string());
    }
    Report::Other(line.to_string())
}

/// POSIX single-quoting.
pub fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

#[cfg(test)]
mod tests;
