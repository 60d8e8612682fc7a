//! Untrusted text in messages, and in shell command lines (`shell_quote`).
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
    let (head, cut) = escaped_prefix(s.chars(), EXCERPT_MAX);
    if cut {
        format!("{head}… ({} bytes)", s.len())
    } else {
        head
    }
}

/// Like [`excerpt`], but keeps the end as well: for a third party's message
/// (serde's, toml's) that quotes a huge value and then says what was
/// expected, e.g. ``unknown variant `xxx…`, expected one of `local`, `ssh` ``.
pub fn excerpt_ends(s: &str) -> String {
    const TAIL: usize = 120;
    let (head, cut) = escaped_prefix(s.chars(), EXCERPT_MAX - TAIL);
    if !cut || s.len() <= EXCERPT_MAX {
        return excerpt(s);
    }
    // Where the last TAIL bytes (escaped) start.
    let mut start = s.len();
    let mut used = 0;
    for (i, c) in s.char_indices().rev() {
        used += escaped(c, &mut String::new()).len();
        if used > TAIL {
            break;
        }
        start = i;
    }
    let (tail, _) = escaped_prefix(s[start..].chars(), TAIL);
    format!("{head}… ({} bytes) …{tail}", s.len())
}

/// The escaped characters of `chars` that fit in `max` bytes, and whether any were left out.
fn escaped_prefix(chars: impl Iterator<Item = char>, max: usize) -> (String, bool) {
    let mut out = String::new();
    let mut buf = String::new();
    for c in chars {
        escaped(c, &mut buf);
        if out.len() + buf.len() > max {
            return (out, true);
        }
        out.push_str(&buf);
    }
    (out, false)
}

/// `c` as a message shows it, in `buf` (cleared first).
fn escaped(c: char, buf: &mut String) -> &str {
    buf.clear();
    if needs_escape(c) {
        // `escape_default` gives `\n`, `\t`, `\u{1b}`: readable and unambiguous.
        let _ = write!(buf, "{}", c.escape_default());
    } else {
        buf.push(c);
    }
    buf
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

/// JSON text fit for a terminal: the characters a terminal acts on that
/// JSON leaves as they are (DEL, C1 controls such as U+009B, bidirectional
/// overrides such as U+202E) written as `\uXXXX` escapes. The same JSON
/// value; ASCII controls are escaped by the serializer already (only in
/// strings: the layout's newlines stay).
pub fn json_for_terminal(json: &str) -> String {
    let mut out = String::with_capacity(json.len());
    for c in json.chars() {
        if u32::from(c) >= 0x7f && needs_escape(c) {
            let mut units = [0u16; 2];
            for u in c.encode_utf16(&mut units) {
                let _ = write!(out, "\\u{u:04x}");
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// POSIX single-quoting: `s` as one word for sh and bash, whatever it holds.
pub fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shell_quote_makes_one_word_of_anything() {
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
        assert_eq!(shell_quote(""), "''");
    }

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
    fn a_long_message_keeps_its_end() {
        let msg = format!(
            "unknown variant `{}`, expected one of `local`, `ssh`, `ec2`",
            "x".repeat(70_000)
        );
        let e = excerpt_ends(&msg);
        assert!(e.len() <= EXCERPT_MAX + 40, "{}", e.len());
        assert!(e.starts_with("unknown variant `xxx"), "{e}");
        assert!(
            e.ends_with("xx`, expected one of `local`, `ssh`, `ec2`"),
            "{e}"
        );
        assert!(e.contains(&format!("… ({} bytes) …", msg.len())), "{e}");
        assert_eq!(excerpt_ends("short \n one"), "short \\n one");
        // An escape at the cut stays whole in the tail.
        let e = excerpt_ends(&format!("{}\u{1b}end", "y".repeat(500)));
        assert!(e.ends_with("\\u{1b}end"), "{e}");
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

    #[test]
    fn json_for_terminal_escapes_what_a_terminal_acts_on_and_keeps_the_value() {
        let value = serde_json::json!({"q": "a\u{202e}b\u{9b}c\u{7f}d é\n"});
        let text = serde_json::to_string_pretty(&value).unwrap();
        let shown = json_for_terminal(&text);
        assert!(!shown.contains(['\u{202e}', '\u{9b}', '\u{7f}']), "{shown}");
        assert!(shown.contains("\\u202e") && shown.contains("\\u009b") && shown.contains('é'));
        let back: serde_json::Value = serde_json::from_str(&shown).unwrap();
        assert_eq!(back, value);
    }
}
