//! The machine's side of pausing a job (docs/pause.md): `dormant-ask` and
//! `dormant-continue`, two bash scripts (bash and coreutils only) that the
//! kept wrapper writes once per boot into the stage directory and puts on
//! the script's PATH, the owner's `dormant-paused` report, and the
//! `PAUSE` control line's encoding (`dormant pause`).

use crate::text::shell_quote;

/// `dormant-ask QUESTION...` (see the script's header).
pub const ASK: &str = include_str!("remote/dormant-ask.sh");
/// `dormant-continue [ANSWER...]` (see the script's header).
pub const CONTINUE: &str = include_str!("remote/dormant-continue.sh");

/// The two tools as sent (their `: failpoint` lines armed in `testing`
/// builds: `crate::failpoint::in_script`).
fn sent() -> &'static (String, String) {
    static SENT: std::sync::OnceLock<(String, String)> = std::sync::OnceLock::new();
    SENT.get_or_init(|| {
        (
            crate::failpoint::in_script(ASK).into_owned(),
            crate::failpoint::in_script(CONTINUE).into_owned(),
        )
    })
}

/// The tools' directory in the stage directory: named by their content, so a
/// dormant with other tools never runs an older copy a machine still has.
pub fn tools_dir() -> &'static str {
    static DIR: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        // FNV-1a: a name, not a defence (the directory is the user's own, 0700).
        let mut h: u64 = 0xcbf29ce484222325;
        let (ask, cont) = sent();
        for b in ask.bytes().chain(cont.bytes()) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x100000001b3);
        }
        format!("bin-{h:016x}")
    })
}

/// The command the wrapper evals (in the stage directory `$t`) when the
/// tools' directory is missing: both files written into a new directory,
/// made executable, then the directory renamed into place whole.
pub fn install_command() -> &'static str {
    static CMD: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    CMD.get_or_init(|| {
        format!(
            "( b=\"$t/.{dir}.$$\"; rm -rf -- \"$b\"; mkdir -- \"$b\" && printf '%s' {ask} > \"$b/dormant-ask\" \
             && printf '%s' {cont} > \"$b/dormant-continue\" && chmod 700 \"$b/dormant-ask\" \"$b/dormant-continue\" \
             && mv -T -- \"$b\" \"$t/{dir}\" 2>/dev/null; rm -rf -- \"$b\" ) 2>/dev/null",
            dir = tools_dir(),
            ask = shell_quote(&sent().0),
            cont = shell_quote(&sent().1),
        )
    })
}

/// `dormant-paused <offset> <question in base64>`: the script asked; this
/// round's job log ends at byte `offset` of the stage's output.
pub fn parse_paused(rest: &str) -> Option<(u64, Vec<u8>)> {
    let mut words = rest.split_whitespace();
    let at = words.next()?.parse().ok()?;
    let question = decode_base64(words.next().unwrap_or(""))?;
    if words.next().is_some() {
        return None;
    }
    Some((at, question))
}

/// Standard base64 with padding, as coreutils' `base64 -d` reads it.
pub fn encode_base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, &b)| n | u32::from(b) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i)) as usize & 63] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Standard base64 (coreutils' `base64 -w0`), `None` if it is not.
pub fn decode_base64(text: &str) -> Option<Vec<u8>> {
    fn value(c: u8) -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    }
    let bytes = text.as_bytes();
    if !bytes.len().is_multiple_of(4) {
        return None;
    }
    let mut out = Vec::with_capacity(bytes.len() / 4 * 3);
    for (i, chunk) in bytes.chunks(4).enumerate() {
        let last = i + 1 == bytes.len() / 4;
        let pad = chunk.iter().rev().take_while(|&&c| c == b'=').count();
        if pad > 2 || (pad > 0 && !last) {
            return None;
        }
        let mut n = 0u32;
        for &c in &chunk[..4 - pad] {
            n = (n << 6) | value(c)?;
        }
        n <<= 6 * pad as u32;
        let three = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        out.extend_from_slice(&three[..3 - pad]);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_decodes_what_coreutils_writes() {
        assert_eq!(decode_base64("").unwrap(), b"");
        assert_eq!(decode_base64("YQ==").unwrap(), b"a");
        assert_eq!(decode_base64("YWI=").unwrap(), b"ab");
        assert_eq!(decode_base64("YWJj").unwrap(), b"abc");
        assert_eq!(decode_base64("AP8KYQ==").unwrap(), b"\0\xff\na");
        assert!(decode_base64("YQ=").is_none());
        assert!(decode_base64("YQ==YQ==").is_none());
        assert!(decode_base64("Y!==").is_none());
        for text in [&b""[..], b"a", b"ab", b"abc", b"\0\xff\na", b"paused: why?"] {
            assert_eq!(decode_base64(&encode_base64(text)).unwrap(), text);
        }
        assert_eq!(encode_base64(b"a"), "YQ==");
    }

    /// A tool `dormant-ask` runs that a signal ends (a script's `timeout`
    /// stops the command as it runs `mkfifo`): bash's own `Terminated` is
    /// not written into the script's output, `dormant-ask`'s line is.
    #[test]
    fn dormant_ask_says_its_own_words_only_when_a_tool_it_runs_is_terminated() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let bin = d.path().join("bin");
        std::fs::create_dir(&bin).unwrap();
        let shim = bin.join("mkfifo");
        std::fs::write(&shim, "#!/bin/sh\nkill -s TERM $$\n").unwrap();
        std::fs::set_permissions(&shim, std::fs::Permissions::from_mode(0o755)).unwrap();
        let ask = d.path().join("dormant-ask");
        std::fs::write(&ask, ASK).unwrap();
        let stage = d.path().join("s");
        std::fs::write(stage.with_extension("out"), "").unwrap();
        let out = std::process::Command::new("bash")
            .arg(&ask)
            .arg("q?")
            .env("DORMANT_PAUSE", "ok")
            .env("DORMANT_STAGE", &stage)
            .env(
                "PATH",
                format!("{}:{}", bin.display(), std::env::var("PATH").unwrap()),
            )
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(125), "{err}");
        assert_eq!(
            err,
            format!("dormant-ask: could not make {}.fifo\n", stage.display())
        );
    }

    #[test]
    fn the_paused_report_carries_the_offset_and_the_question() {
        assert_eq!(parse_paused("12 cT8K"), Some((12, b"q?\n".to_vec())));
        assert_eq!(parse_paused("12"), Some((12, Vec::new())));
        assert_eq!(parse_paused("x cT8K"), None);
    }
}
