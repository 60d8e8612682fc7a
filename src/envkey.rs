//! The environment key: `<runner-id>/<PathEscape(system-id)>/<query>`.
//!
//! The format is GitLab Runner's own (see `docs/runner-contract.md`, "The job
//! payload"): the runner id and the path-escaped system id route the key to
//! the runner manager that made it; the rest is a query string in the encoding
//! of Go's `url.Values.Encode()` (keys sorted, values query-escaped) that only
//! dormant reads. It carries at least `env=<uuid>` and the provider's fields.
//! Parsers ignore fields they do not know, so fields can be added freely.

use std::collections::BTreeMap;
use std::fmt;

use uuid::Uuid;

use crate::text::quoted;

/// The longest text [`EnvironmentKey::parse`] reads. A key dormant makes is
/// about 150 bytes (runner id, system id, env uuid, a few provider fields);
/// anything near this long was not printed by dormant, and refusing it up
/// front bounds the work a hostile key can cause.
pub const MAX_KEY_LEN: usize = 2048;

/// A parsed environment key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvironmentKey {
    pub runner_id: String,
    pub system_id: String,
    pub env_id: Uuid,
    /// Every other query field (`provider`, `instance`, ...), unknown ones included.
    pub fields: BTreeMap<String, String>,
}

/// Why a string is not an environment key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("it is empty")]
    Empty,
    #[error("it is {0} bytes long; a key dormant printed is at most {MAX_KEY_LEN}")]
    TooLong(usize),
    #[error("it has no '/' after the runner id (expected <runner-id>/<system-id>/<fields>)")]
    MissingSystemId,
    #[error("it has no '/' after the system id (expected <runner-id>/<system-id>/<fields>)")]
    MissingFields,
    #[error("the runner id is empty")]
    EmptyRunnerId,
    #[error("the system id is empty")]
    EmptySystemId,
    #[error("bad percent-encoding in the {0}")]
    BadEscape(&'static str),
    #[error("it has no env=<uuid> field")]
    MissingEnv,
    #[error("env={} is not a UUID", quoted(.0))]
    BadEnv(String),
}

impl EnvironmentKey {
    pub fn new(runner_id: &str, system_id: &str, env_id: Uuid) -> Self {
        EnvironmentKey {
            runner_id: runner_id.to_string(),
            system_id: system_id.to_string(),
            env_id,
            fields: BTreeMap::new(),
        }
    }

    pub fn with_field(mut self, name: &str, value: &str) -> Self {
        self.fields.insert(name.to_string(), value.to_string());
        self
    }

    pub fn field(&self, name: &str) -> Option<&str> {
        self.fields.get(name).map(String::as_str)
    }

    pub fn encode(&self) -> String {
        let mut pairs: Vec<(&str, String)> = vec![("env", self.env_id.to_string())];
        for (k, v) in &self.fields {
            if k != "env" {
                pairs.push((k, v.clone()));
            }
        }
        pairs.sort_by(|a, b| a.0.cmp(b.0));
        let query = pairs
            .iter()
            .map(|(k, v)| format!("{}={}", query_escape(k), query_escape(v)))
            .collect::<Vec<_>>()
            .join("&");
        format!(
            "{}/{}/{}",
            self.runner_id,
            path_escape(&self.system_id),
            query
        )
    }

    pub fn parse(text: &str) -> Result<Self, KeyError> {
        let text = text.trim();
        if text.is_empty() {
            return Err(KeyError::Empty);
        }
        if text.len() > MAX_KEY_LEN {
            return Err(KeyError::TooLong(text.len()));
        }
        let (runner_id, rest) = text.split_once('/').ok_or(KeyError::MissingSystemId)?;
        let (system, query) = rest.split_once('/').ok_or(KeyError::MissingFields)?;
        if runner_id.is_empty() {
            return Err(KeyError::EmptyRunnerId);
        }
        let system_id = path_unescape(system).ok_or(KeyError::BadEscape("system id"))?;
        if system_id.is_empty() {
            return Err(KeyError::EmptySystemId);
        }
        let mut fields = BTreeMap::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let k = query_unescape(k).ok_or(KeyError::BadEscape("fields"))?;
            let v = query_unescape(v).ok_or(KeyError::BadEscape("fields"))?;
            // Like Go's url.Values.Get: the first value of a repeated field wins.
            fields.entry(k).or_insert(v);
        }
        let env = fields.remove("env").ok_or(KeyError::MissingEnv)?;
        let env_id = Uuid::parse_str(&env).map_err(|_| KeyError::BadEnv(env.clone()))?;
        Ok(EnvironmentKey {
            runner_id: runner_id.to_string(),
            system_id,
            env_id,
            fields,
        })
    }
}

impl fmt::Display for EnvironmentKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.encode())
    }
}

/// The key field saying an environment is in volume mode (`storage=volume`);
/// machine-mode keys do not carry it, so they are what they always were.
pub const STORAGE_FIELD: &str = "storage";

/// The storage mode a key says: volume mode if it carries `storage=volume`.
pub fn storage_of(key: &EnvironmentKey) -> crate::model::StorageMode {
    match key.field(STORAGE_FIELD) {
        Some("volume") => crate::model::StorageMode::Volume,
        _ => crate::model::StorageMode::Machine,
    }
}

fn is_unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~')
}

/// Go's `url.PathEscape`: a path segment keeps `$ & + : = @` and escapes `/ ; , ?`.
pub fn path_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for &b in s.as_bytes() {
        if is_unreserved(b) || matches!(b, b'$' | b'&' | b'+' | b':' | b'=' | b'@') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Go's `url.QueryEscape`: space becomes `+`, everything but unreserved is escaped.
pub fn query_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for &b in s.as_bytes() {
        if is_unreserved(b) {
            out.push(b as char);
        } else if b == b' ' {
            out.push('+');
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn unescape(s: &str, plus_is_space: bool) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = bytes.get(i + 1..i + 3)?;
                let hex = std::str::from_utf8(hex).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            b'+' if plus_is_space => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

pub fn path_unescape(s: &str) -> Option<String> {
    unescape(s, false)
}

pub fn query_unescape(s: &str) -> Option<String> {
    unescape(s, true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn id() -> Uuid {
        Uuid::parse_str("0b6e1f52-3c1d-4b8e-9a51-7f2d4f0d9c11").unwrap()
    }

    #[test]
    fn encodes_like_go() {
        let key = EnvironmentKey::new("42", "s_0123456789ab", id())
            .with_field("provider", "ec2")
            .with_field("instance", "i-0abc")
            .with_field("region", "eu-west-1");
        assert_eq!(
            key.encode(),
            "42/s_0123456789ab/env=0b6e1f52-3c1d-4b8e-9a51-7f2d4f0d9c11&instance=i-0abc&provider=ec2&region=eu-west-1"
        );
    }

    #[test]
    fn path_escape_matches_go_url_path_escape() {
        // Values checked against Go 1.22: url.PathEscape.
        assert_eq!(path_escape("a/b"), "a%2Fb");
        assert_eq!(path_escape("a b"), "a%20b");
        assert_eq!(path_escape("100%"), "100%25");
        assert_eq!(path_escape("x;y,z?"), "x%3By%2Cz%3F");
        assert_eq!(path_escape("$&+:=@"), "$&+:=@");
        assert_eq!(path_escape("é"), "%C3%A9");
        assert_eq!(query_escape("a b&c=d/é"), "a+b%26c%3Dd%2F%C3%A9");
    }

    #[test]
    fn awkward_system_ids_round_trip() {
        for sys in [
            "s_abc/def",
            "100% sure",
            "tab\there",
            "日本語",
            "a+b",
            "%2F",
        ] {
            let key = EnvironmentKey::new("7", sys, id()).with_field("host", "h 1&x=y");
            let parsed = EnvironmentKey::parse(&key.encode()).unwrap();
            assert_eq!(parsed, key, "{sys}");
        }
    }

    #[test]
    fn unknown_fields_are_kept_and_ignored() {
        let key = EnvironmentKey::parse(
            "1/s_x/future=thing&env=0b6e1f52-3c1d-4b8e-9a51-7f2d4f0d9c11&provider=local",
        )
        .unwrap();
        assert_eq!(key.env_id, id());
        assert_eq!(key.field("provider"), Some("local"));
        assert_eq!(key.field("future"), Some("thing"));
    }

    #[test]
    fn malformed_keys_say_what_is_wrong() {
        assert_eq!(EnvironmentKey::parse(""), Err(KeyError::Empty));
        assert_eq!(EnvironmentKey::parse("12"), Err(KeyError::MissingSystemId));
        assert_eq!(
            EnvironmentKey::parse("12/s_x"),
            Err(KeyError::MissingFields)
        );
        assert_eq!(
            EnvironmentKey::parse("/s_x/env=1"),
            Err(KeyError::EmptyRunnerId)
        );
        assert_eq!(
            EnvironmentKey::parse("1//env=1"),
            Err(KeyError::EmptySystemId)
        );
        assert_eq!(
            EnvironmentKey::parse("1/s%zz/env=1"),
            Err(KeyError::BadEscape("system id"))
        );
        assert_eq!(
            EnvironmentKey::parse("1/s/provider=x"),
            Err(KeyError::MissingEnv)
        );
        assert_eq!(
            EnvironmentKey::parse("1/s/env=nope"),
            Err(KeyError::BadEnv("nope".into()))
        );
    }

    #[test]
    fn a_huge_key_is_refused_briefly() {
        let huge = format!("1/s_x/env={}", "a".repeat(65_536));
        let err = EnvironmentKey::parse(&huge).unwrap_err();
        assert_eq!(err, KeyError::TooLong(huge.len()));
        assert!(err.to_string().len() < 200, "{err}");
        // A bad env value is quoted briefly, escapes and all.
        let err = EnvironmentKey::parse(&format!("1/s/env={}%1B", "b".repeat(1000))).unwrap_err();
        let text = err.to_string();
        assert!(text.len() < 300 && text.contains("(1001 bytes)"), "{text}");
        let text = EnvironmentKey::parse("1/s/env=%1B%5B2J")
            .unwrap_err()
            .to_string();
        assert_eq!(text, "env=\"\\u{1b}[2J\" is not a UUID");
    }

    // Round trips and no-panic over random and mutated keys: `crate::fuzz`.
    proptest! {
        #[test]
        fn escapes_are_inverse(s in any::<String>()) {
            prop_assert_eq!(path_unescape(&path_escape(&s)).unwrap(), s.clone());
            prop_assert_eq!(query_unescape(&query_escape(&s)).unwrap(), s);
        }
    }
}
