//! The remote side of one stage: a small bash wrapper that receives the stage
//! script on stdin, runs it in its own process group and reports on stderr.
//! Two wrappers: `remote/kept.sh` (the default) runs the script in its own
//! process group with its output going into a file on the machine, so a
//! stage outlives its connection and a later session re-attaches to it;
//! `remote/direct.sh` (`ssh.reconnect_timeout = "0s"`, or a host that cannot
//! keep output) runs it with its output going straight into the session, and
//! a lost connection ends it.
//!
//! Protocol (the wrapper's stderr; the script's own stderr is merged into its
//! stdout so the job log keeps the order the script wrote in):
//! - `dormant-kept`: (kept) this session claimed the stage and runs it; its
//!   stdout carries the output from byte 0 (sent with `dormant-pgid`, in
//!   one write, once the script started: one report less per stage);
//! - `dormant-at <offset>`: (kept) this session follows a stage another
//!   session started; its stdout carries the output from byte `<offset>`,
//!   which is past what dormant asked for only when the bytes between were
//!   dropped on the machine — output dormant had acknowledged (`ACK`), as by
//!   an earlier `dormant run` of the stage that was killed;
//! - `dormant-pgid <pgid>`: the script started, in this process group;
//! - `dormant-exit <code> [<length>]`: the script's exit code, the
//!   authoritative result (a script's own 255 is not confused with ssh's
//!   255), and (kept) the length of its whole output: the stage is over once
//!   dormant has that many bytes;
//! - `dormant-watched present|absent`: after the script, whether the file
//!   named by `$3` exists (a shell test, no fork; only when `$3` is set);
//! - `dormant-warn <text>`, `dormant-error <text>`: something for the job
//!   log; the wrapper could not run or follow the script.
//!
//! After the script's bytes, the wrapper's stdin stays open as a control
//! line: `TERM` or `KILL` signals the script's process group (a termination
//! needs no second channel). Kept only: `ACK <n>` (dormant has the output up
//! to byte `n` in its job log, sent after every read: the machine may drop
//! it), `TAKEN <n>` (a
//! paused round's job log ended at byte `n`: the next round starts there),
//! `PAUSE <question>` (`dormant pause`), `DONE` (dormant has the stage's
//! end: its files go, and a paused script the stage relayed to its end,
//! `dormant-relay <code>`, goes with them; dormant notes that code on the
//! runner host first, `crate::state::relayed_end`), `KEEP`
//! (below). Direct: end of file — dormant died or the
//! connection was lost — terminates the group (SIGTERM, SIGKILL 5 s later),
//! so a script never runs on with nobody to report to. Kept: end of file over
//! a connection that lives (the session's sshd process is still there)
//! means dormant closed the session — it has the whole output and the end,
//! or it died — and the stage's files go (the script too, if it still runs,
//! as with the direct wrapper); `KEEP` first means dormant follows again in
//! a new session. End of file because the connection was lost (the sshd
//! process went with it) leaves the script running and its output kept for
//! `ssh.reconnect_timeout` plus a margin ([`linger`]), for dormant to come
//! back; then the script is stopped and its files removed. The job's cleanup
//! stops earlier what a job left ([`LEFTOVERS`]).
//!
//! Kept, on the machine (`<dir>` is `$TMPDIR`, else `/dev/shm` — a tmpfs —
//! for users below 1000, else `/tmp`; see docs/ssh.md): `<dir>/dormant-<uid>/`
//! (0700) holds, per stage, `<env>.<stage id>.out` (the output, 0600),
//! `.own` (who owns the stage: the owner, its follower, the wrapper, the
//! script's group), `.exit` (the end) and `.kept` (where the kept output
//! starts: everything below it dormant has taken). The script's stdout and
//! stderr are one pipe, never the file: a script that reopens `/dev/stdout`
//! or `/dev/stderr` (`>/dev/stderr`, `tee /dev/stderr`) reopens the pipe,
//! which it cannot truncate. The pump at the pipe's other end (a subshell of
//! the wrapper running `dd`) is the one writer of `.out`, through one open
//! file description whose position (`/proc/<pid>/fdinfo`) is the exact
//! length of the output so far: no program counts it. The pump writes at
//! most `ssh.kept_output_mib` past `.kept`: past it, it reads no more and
//! the script waits on a full pipe (back-pressure, as with any slow reader),
//! in every state — running, disconnected, paused. A `tail -f` per session
//! (the owner starts it first thing, beside the script's start, and it reads
//! the file from byte 0 however late it comes) copies it into the session.
//! The owner, a subshell reading the control lines (all that wait, at
//! once), punches what dormant acknowledged (`ACK`) out of the file
//! (`fallocate -p`, offsets stay) and moves `.kept`: nothing dormant has not
//! taken is ever dropped, and after a round, a lost session or a kill
//! `.kept` is exactly what the job logs have (where the next
//! `dormant-continue` starts). It confirms `TAKEN` and a relaying stage's
//! `DONE` with `dormant-took`, which dormant waits for before it closes the
//! session. The owner's functions
//! (`remote/kept_owner.sh`) travel as the wrapper's last argument and are
//! defined only in the owner and in a re-attach: the stage's own path never
//! parses them.
//!
//! The script itself never touches the host's disk: it is read into a shell variable
//! with bash's own `read -N` (all of it, checked complete: a connection lost
//! while it arrives must not run half a script) and run by `eval` in a
//! subshell of the wrapper — a fork, no new bash, no pipe, no file — with
//! stdin from /dev/null so a command that reads stdin cannot swallow anything.
//! The direct wrapper starts no programs at all, the kept one only its
//! follower and its pump's `dd` (no `mktemp`, `head`, `wc`, `setsid`, not
//! even a second bash):
//! each exec costs 1–3 ms, the bulk of a stage's cost over a bare
//! `ssh -S … true` (see docs/performance.md). The script's process group comes from job control (`set -m`,
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
//! exit. The script's commands start with every signal at its default, as
//! sshd gives them to the wrapper.

use crate::text::shell_quote;

/// The wrapper without kept output. `$1` = the script's length in bytes,
/// `$2` = the work directory, `$3` = the file to watch (see [`command_line`]).
pub const DIRECT: &str = include_str!("remote/direct.sh");

/// The wrapper with kept output; its arguments are [`command_line`]'s.
pub const KEPT: &str = include_str!("remote/kept.sh");

/// The functions of a kept stage's owner, sent as the kept wrapper's last
/// argument and defined only in the processes that run them (the owner the
/// wrapper forks, a re-attach): parsing them on the stage's own path cost
/// ≈ 0.5 ms per stage (docs/performance.md).
pub const KEPT_OWNER: &str = include_str!("remote/kept_owner.sh");

/// Stops the stages of an environment left on the machine and removes their
/// kept output (`$1` = the environment); with `$2 = check`, also says
/// whether output can be kept there (`keep:ok` / `keep:no <why>`).
pub const LEFTOVERS: &str = include_str!("remote/leftovers.sh");

/// The wrapper of a shell joined beside a running job (`$1` = the
/// environment, `$2` = the join's nonce, `$3` = the directory, `$4` = a
/// command line or `''` for a login shell): registers its session on the
/// machine for [`JOIN_END`].
pub const JOIN: &str = include_str!("remote/join.sh");

/// Ends the shells joined beside environment `$1`'s job, telling them `$2`;
/// `$3...` = the nonces of the joins marked: one not registered yet is
/// refused when it arrives.
pub const JOIN_END: &str = include_str!("remote/join_end.sh");

/// The remote command of a joined shell (in bash, whatever the login shell).
pub fn join_command(env: &str, nonce: &str, dir: &str, command: Option<&str>) -> String {
    format!(
        "exec bash -c {} dormant {} {} {} {}",
        shell_quote(JOIN),
        shell_quote(env),
        shell_quote(nonce),
        shell_quote(dir),
        shell_quote(command.unwrap_or(""))
    )
}

/// The command that ends the shells joined beside environment `env`'s job
/// (and refuses the joins of `nonces` still on their way).
pub fn join_end_command(env: &str, message: &str, nonces: &[String]) -> String {
    let mut line = format!(
        "bash -c {} dormant {} {}",
        shell_quote(JOIN_END),
        shell_quote(env),
        shell_quote(message)
    );
    for n in nonces {
        line.push(' ');
        line.push_str(&shell_quote(n));
    }
    line
}

/// How a session takes part in a stage with kept output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Run the script: the first session of the stage.
    Start,
    /// Run the script unless a session did already (one was sent but dormant
    /// never heard whether it started before the connection was lost): then
    /// follow it from byte 0.
    Retry,
    /// Follow the stage (it started) from this offset.
    Follow(u64),
}

/// Where a stage's output is kept on the machine, and for how long.
#[derive(Debug, Clone, Copy)]
pub struct Kept<'a> {
    /// The environment (32 hex digits): the prefix of its stages' files.
    pub env: &'a str,
    /// The stage's id ([`crate::transport::Script::id`]).
    pub stage: &'a str,
    pub mode: Mode,
    /// How long a stage nobody follows is kept after its connection was lost.
    pub linger_secs: u64,
    /// The bound of the kept output, in bytes.
    pub bound: u64,
}

/// How long the machine keeps a stage whose connection was lost, waiting for
/// dormant to re-attach: dormant's own `reconnect_timeout`, plus the time
/// dormant may take to notice the loss (three missed keepalives) and a
/// minute for a last handshake; past it nobody will come back.
pub fn linger(reconnect_timeout: std::time::Duration, server_alive: std::time::Duration) -> u64 {
    (reconnect_timeout + server_alive * 3).as_secs() + 60
}

/// Which text [`sent`] returns.
#[derive(Clone, Copy)]
enum Text {
    Direct,
    Kept,
    KeptOwner,
}

/// A wrapper as sent: its comment lines out (they are for whoever reads the
/// source; bash would parse them on every stage, twice: `w='…'`, then `eval`).
fn sent(which: Text) -> &'static str {
    static SENT: [std::sync::OnceLock<String>; 3] = [
        std::sync::OnceLock::new(),
        std::sync::OnceLock::new(),
        std::sync::OnceLock::new(),
    ];
    let text = match which {
        Text::Direct => DIRECT,
        Text::Kept => KEPT,
        Text::KeptOwner => KEPT_OWNER,
    };
    SENT[which as usize].get_or_init(|| {
        // The wrapper's and the owner's crash points are armed by variables
        // defined with their code (`testing` builds: crate::failpoint).
        let mut out: String = match which {
            Text::Kept | Text::KeptOwner => crate::failpoint::script_env()
                .into_iter()
                .map(|(k, v)| format!("{k}={}\n", shell_quote(&v)))
                .collect(),
            _ => String::new(),
        };
        out.extend(
            crate::failpoint::in_script(text)
                .lines()
                .filter(|l| !l.trim_start().starts_with('#'))
                .map(|l| format!("{l}\n")),
        );
        out
    })
}

/// The first line of every uploaded script: the wrapper's copy of the script
/// goes (`eval` already holds it), so the script sees no variable it did not set.
const PRELUDE: &str = "unset s\n";

/// A control line: `TERM` or `KILL` (to the script's group), `KEEP` (kept:
/// dormant closes this session but follows the stage again).
pub fn signal_line(signal: &str) -> Vec<u8> {
    format!("{signal}\n").into_bytes()
}

/// The remote command line, interpreted by the user's login shell: a bash
/// (not in POSIX mode) runs the wrapper itself, any other shell starts one —
/// a bash start saved on every stage for the common case.
pub fn command_line(
    script_len: usize,
    workdir: Option<&str>,
    watch: Option<&str>,
    kept: Option<&Kept<'_>>,
) -> String {
    let (wrapper, more) = match kept {
        None => (sent(Text::Direct), String::new()),
        Some(k) => {
            let (mode, offset) = match k.mode {
                Mode::Start => ("start", 0),
                Mode::Retry => ("retry", 0),
                Mode::Follow(at) => ("follow", at),
            };
            (
                sent(Text::Kept),
                format!(
                    " {} {} {mode} {offset} {} {} {} {} {}",
                    shell_quote(k.env),
                    shell_quote(k.stage),
                    k.linger_secs,
                    k.bound,
                    shell_quote(sent(Text::KeptOwner)),
                    super::pause::tools_dir(),
                    shell_quote(super::pause::install_command()),
                ),
            )
        }
    };
    format!(
        "set -- {script_len} {workdir} {watch}{more}; w={wrapper}; \
         if [ -n \"${{BASH_VERSION-}}\" ] && ! shopt -oq posix; then eval \"$w\"; \
         else exec bash -c \"$w\" dormant \"$@\"; fi",
        workdir = shell_quote(workdir.unwrap_or("")),
        watch = shell_quote(watch.unwrap_or("")),
        wrapper = shell_quote(wrapper),
    )
}

/// The command that runs [`LEFTOVERS`] for environment `env` (in bash,
/// whatever the login shell), with `check` for prepare's probe.
pub fn leftovers_command(env: &str, check: bool) -> String {
    format!(
        "bash -c {} dormant {} {}",
        shell_quote(LEFTOVERS),
        shell_quote(env),
        if check { "check" } else { "''" }
    )
}

/// [`leftovers_command`] that also prints `paused:<n>`: how many paused
/// stages it spared (a script still waits for its answer).
pub fn paused_left_command(env: &str) -> String {
    format!(
        "bash -c {} dormant {} '' look",
        shell_quote(LEFTOVERS),
        shell_quote(env)
    )
}

/// The `paused:<n>` line of [`paused_left_command`]'s output: whether a
/// paused stage is left.
pub fn parse_paused_left(out: &[u8]) -> anyhow::Result<bool> {
    let text = String::from_utf8_lossy(out);
    match text.lines().find_map(|l| l.strip_prefix("paused:")) {
        Some(n) => Ok(n.trim() != "0"),
        None => anyhow::bail!("no paused:<n> line in {:?}", text.trim()),
    }
}

/// [`leftovers_command`] for the environment's release: paused stages too
/// (docs/pause.md), nothing of the environment stays.
pub fn release_command(env: &str) -> String {
    format!(
        "bash -c {} dormant {} '' all",
        shell_quote(LEFTOVERS),
        shell_quote(env)
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
    /// Kept: this session runs the stage, its stdout from byte 0.
    Kept,
    /// Kept: this session follows the stage, its stdout from this byte.
    At(u64),
    Pgid(i64),
    /// The script's exit code and (kept) the length of its output.
    Exit(i32, Option<u64>),
    Warn(String),
    /// Whether the watched file exists after the script.
    Watched(bool),
    Error(String),
    /// Kept: the script asked (`dormant-ask`); this round's output ends at
    /// this offset; the question (docs/pause.md).
    Paused(u64, Vec<u8>),
    /// Kept: the stage's script relayed a paused script (`dormant-continue`
    /// wrote `.relay`), said right before its end: dormant says `DONE` and
    /// waits for the owner's `dormant-took`. With the exit code the
    /// continue gave when the paused script ended (`.gave`).
    Relaying(Option<i32>),
    /// Kept: the owner has taken dormant's `TAKEN` or `DONE`, and every
    /// acknowledgement before it.
    Took,
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
    match line {
        "dormant-kept" => return Report::Kept,
        "dormant-relay" => return Report::Relaying(None),
        "dormant-took" => return Report::Took,
        _ => {}
    }
    if let Some(rest) = line.strip_prefix("dormant-relay ") {
        match rest.trim() {
            "" => return Report::Relaying(None),
            code => {
                if let Ok(c) = code.parse() {
                    return Report::Relaying(Some(c));
                }
            }
        }
    }
    if let Some(rest) = line.strip_prefix("dormant-at ") {
        if let Ok(at) = rest.trim().parse() {
            return Report::At(at);
        }
    }
    if let Some(rest) = line.strip_prefix("dormant-exit ") {
        let mut words = rest.split_whitespace();
        let code = words.next().map(str::parse::<i32>);
        let len = words.next().map(str::parse::<u64>);
        match (code, len, words.next()) {
            (Some(Ok(c)), None, None) => return Report::Exit(c, None),
            (Some(Ok(c)), Some(Ok(n)), None) => return Report::Exit(c, Some(n)),
            _ => {}
        }
    }
    if let Some((at, question)) = line
        .strip_prefix("dormant-paused ")
        .and_then(super::pause::parse_paused)
    {
        return Report::Paused(at, question);
    }
    if let Some(rest) = line.strip_prefix("dormant-warn ") {
        return Report::Warn(rest.to_string());
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

#[cfg(test)]
mod join_tests;
#[cfg(test)]
mod kept_tests;
#[cfg(test)]
mod tests;
