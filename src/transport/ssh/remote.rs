//! The remote side of one stage: a small bash wrapper that receives the stage
//! script on stdin, runs it in its own process group and reports on stderr.
//!
//! Protocol (the wrapper's stderr; the script's own stderr is merged into its
//! stdout so the job log keeps the order the script wrote in):
//! - `dormant-pgid <pgid>`: the script's process group, for a termination;
//! - `dormant-exit <code>`: the script's exit code, the authoritative result
//!   (a script's own 255 is not confused with ssh's 255);
//! - `dormant-error <text>`: the wrapper could not run the script.
//!
//! The script is written to a private temp file first (`head -c <len>`),
//! checked to be complete (a connection lost while it arrives must not run
//! half a script), and run with stdin from /dev/null, so a command in it that
//! reads stdin cannot swallow the rest of the script.

/// The wrapper, run as `bash -c WRAPPER dormant <script bytes> <workdir>`.
pub const WRAPPER: &str = r#"d=$(mktemp -d "${TMPDIR:-/tmp}/dormant.XXXXXXXX") || { echo "dormant-error cannot create a temp dir on the host" >&2; exit 97; }
trap 'rm -rf "$d"' EXIT
if ! head -c "$1" > "$d/script"; then echo "dormant-error cannot store the stage script in $d" >&2; exit 97; fi
if [ "$(wc -c < "$d/script")" -ne "$1" ]; then echo "dormant-error the stage script arrived incomplete: not run" >&2; exit 97; fi
if [ -n "$2" ] && ! cd -- "$2" 2>/dev/null; then echo "dormant-error the work directory $2 does not exist on the host" >&2; exit 97; fi
if command -v setsid >/dev/null 2>&1; then
  setsid bash "$d/script" </dev/null 2>&1 &
else
  set -m
  bash "$d/script" </dev/null 2>&1 &
fi
p=$!
# Only now (the script must keep the default): a lost connection must not
# kill the wrapper before it has cleaned up.
trap '' PIPE
echo "dormant-pgid $p" >&2
wait "$p"
rc=$?
kill -KILL -- "-$p" 2>/dev/null
echo "dormant-exit $rc" >&2
exit "$rc"
"#;

/// The remote command line (interpreted once by the login shell).
pub fn command_line(script_len: usize, workdir: Option<&str>) -> String {
    format!(
        "bash -c {} dormant {script_len} {}",
        shell_quote(WRAPPER),
        shell_quote(workdir.unwrap_or(""))
    )
}

/// The script as uploaded: the extra environment exported first, then the
/// runner's script unchanged.
pub fn script_with_env(body: &[u8], env: &[(String, String)]) -> anyhow::Result<Vec<u8>> {
    let mut out = Vec::with_capacity(body.len() + 128);
    for (k, v) in env {
        if k.is_empty()
            || !k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            || k.starts_with(|c: char| c.is_ascii_digit())
        {
            anyhow::bail!("{k:?} is not a valid environment variable name");
        }
        out.extend_from_slice(format!("export {k}={}\n", shell_quote(v)).as_bytes());
    }
    out.extend_from_slice(body);
    Ok(out)
}

/// A line of the wrapper's stderr.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Report {
    Pgid(i64),
    Exit(i32),
    Error(String),
    /// Anything else: ssh's own messages, or the wrapper's shell complaining.
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
mod tests {
    use super::*;

    #[test]
    fn reports_are_parsed_and_anything_else_passes_through() {
        assert_eq!(parse_report("dormant-pgid 4242\n"), Report::Pgid(4242));
        assert_eq!(parse_report("dormant-exit 255"), Report::Exit(255));
        assert_eq!(
            parse_report("dormant-error no dir"),
            Report::Error("no dir".into())
        );
        assert_eq!(
            parse_report("dormant-exit x"),
            Report::Other("dormant-exit x".into())
        );
        assert_eq!(
            parse_report("mux_client_request_session: read from master failed"),
            Report::Other("mux_client_request_session: read from master failed".into())
        );
    }

    #[test]
    fn env_is_exported_quoted_before_the_script() {
        let s = script_with_env(b"echo hi\n", &[("K".into(), "a'b $x".into())]).unwrap();
        assert_eq!(
            String::from_utf8(s).unwrap(),
            "export K='a'\\''b $x'\necho hi\n"
        );
        assert!(script_with_env(b"", &[("A-B".into(), "x".into())]).is_err());
    }

    /// Runs a remote command line under a local `sh`, as sshd would, feeding `stdin`.
    fn run_wrapper(line: &str, stdin: &[u8]) -> std::process::Output {
        use std::io::Write;
        let mut child = std::process::Command::new("sh")
            .arg("-c")
            .arg(line)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        child.stdin.take().unwrap().write_all(stdin).unwrap();
        child.wait_with_output().unwrap()
    }

    /// The wrapper runs under a local bash exactly as sshd would run it.
    #[test]
    fn the_wrapper_reports_pgid_and_exit_and_merges_streams_in_order() {
        let script = b"echo one; echo two >&2; echo three; exit 255\n";
        let line = command_line(script.len(), Some("/"));
        let out = run_wrapper(&line, script);
        assert_eq!(String::from_utf8_lossy(&out.stdout), "one\ntwo\nthree\n");
        let reports: Vec<Report> = String::from_utf8_lossy(&out.stderr)
            .lines()
            .map(parse_report)
            .collect();
        assert!(
            matches!(reports[0], Report::Pgid(p) if p > 1),
            "{reports:?}"
        );
        assert_eq!(reports.last(), Some(&Report::Exit(255)));
        assert_eq!(out.status.code(), Some(255));
    }

    #[test]
    fn a_truncated_script_is_not_run() {
        let line = command_line(100, None);
        let out = run_wrapper(&line, b"echo ran\n");
        assert_eq!(String::from_utf8_lossy(&out.stdout), "");
        assert!(
            String::from_utf8_lossy(&out.stderr)
                .starts_with("dormant-error the stage script arrived incomplete"),
            "{out:?}"
        );
    }
}
