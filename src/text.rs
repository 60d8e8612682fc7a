//! Untrusted text in messages.
//!
//! Environment keys, job payload values, job variables and settings values can
//! be anything a job (or a typo) puts there: 64 KiB of it, escape sequences
//! that repaint the reader's terminal, or text that only looks like the end of
//! a message. Every message that quotes such text goes through [`excerpt`], so
//! it shows at most [`EXCERPT_MAX`] bytes, with control characters escaped and
//! the full length said when it was cut.

use std::fmt::Write;

/// How many bytes of untrusted text a message quotes, before the suffix.
pub const EXCERPT_MAX: usize = 200;

/// `s` fit for a message: at most [`EXCERPT_MAX`] bytes (cut on a character
/// boundary), control and bidirectional-override characters escaped as
/// `\n`, `\u{1b}`, ..., and `… (N bytes)` appended when it was cut.
pub fn excerpt(s: &str) -> String {
    let mut out = String::with_capacity(s.len().min(EXCERPT_MAX) + 24);
    let mut buf = String::new();
    for c in s.chars() {
        buf.clear();
        if needs_escape(c) {
            // `escape_default` gives `\n`, `\t`, `\u{1b}`: readable and unambiguous.
            let _ = write!(buf, "{}", c.escape_default());
        } else {
            buf.push(c);
        }
        if out.len() + buf.len() > EXCERPT_MAX {
            let _ = write!(out, "… ({} bytes)", s.len());
            return out;
        }
        out.push_str(&buf);
    }
    out
}

/// [`excerpt`] in double quotes, for values whose edges matter (empty, spaces).
pub fn quoted(s: &str) -> String {
    format!("\"{}\"", excerpt(s))
}

/// Characters a terminal acts on rather than shows: C0/C1 controls and the
/// bidirectional overrides that make text display in another order than it reads.
fn needs_escape(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_text_is_kept_as_is() {
        assert_eq!(excerpt("12/s_x/env=abc"), "12/s_x/env=abc");
        assert_eq!(excerpt(""), "");
        assert_eq!(excerpt("日本語"), "日本語");
    }

    #[test]
    fn long_text_is_cut_on_a_char_boundary_and_says_its_length() {
        let long = "é".repeat(40_000);
        let e = excerpt(&long);
        assert!(e.ends_with("… (80000 bytes)"), "{e}");
        let kept = e.trim_end_matches("… (80000 bytes)");
        assert!(kept.len() <= EXCERPT_MAX && kept.len() >= EXCERPT_MAX - 1);
        assert!(kept.chars().all(|c| c == 'é'));
        // Exactly the limit is not cut.
        let exact = "a".repeat(EXCERPT_MAX);
        assert_eq!(excerpt(&exact), exact);
        assert!(excerpt(&"a".repeat(EXCERPT_MAX + 1)).ends_with("(201 bytes)"));
    }

    #[test]
    fn control_characters_are_escaped() {
        assert_eq!(
            excerpt("a\nb\t\u{1b}[2Jc\u{202e}d\0"),
            "a\\nb\\t\\u{1b}[2Jc\\u{202e}d\\u{0}"
        );
        // Escapes count toward the limit: the result stays short.
        let e = excerpt(&"\u{1b}".repeat(10_000));
        assert!(e.len() < EXCERPT_MAX + 30, "{}", e.len());
    }
}
