//! Untrusted text in messages: a key, a payload value or a job variable is
//! shown as a short, printable excerpt, never echoed whole.

/// At most this many bytes of untrusted input reach a message.
pub const EXCERPT_BYTES: usize = 200;

/// `s` quoted, control characters escaped, cut to about [`EXCERPT_BYTES`] on a
/// character boundary with its full length said: `"abc…" (65536 bytes)`.
pub fn excerpt(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        if out.len() >= EXCERPT_BYTES {
            out.push_str(&format!("…\" ({} bytes)", s.len()));
            return out;
        }
        out.extend(c.escape_debug());
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_input_is_cut_and_short_input_kept() {
        assert_eq!(excerpt("a\nb"), "\"a\\nb\"");
        let long = "é".repeat(40_000);
        let e = excerpt(&long);
        assert!(e.len() < EXCERPT_BYTES + 40, "{}", e.len());
        assert!(e.ends_with("(80000 bytes)"), "{e}");
    }
}
