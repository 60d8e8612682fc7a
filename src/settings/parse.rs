//! Strict parsing of the settings text: every unknown key and every bad
//! value of the file reported at once, each naming its key.

use anyhow::{bail, Result};

use super::Settings;
use crate::text::{excerpt, excerpt_ends};

impl Settings {
    /// Parses settings text, reporting every unknown key and bad value at once.
    ///
    /// serde stops at the first value that does not parse (a duration, an
    /// enum), so the file is parsed as a tree first: each value that fails is
    /// reported, taken out of the tree and the rest parsed again — the default
    /// stands in for it — until all of it parses. Then the unknown keys of
    /// that last pass and the checks of `validate` (minus those about a key
    /// already reported) join the list.
    pub fn parse_str(text: &str) -> Result<Settings> {
        // The parsed document, before any value is read from it: a syntax
        // error ends here (toml quotes the offending line: keep each line of
        // its message short).
        let mut tree = toml::de::DeTable::parse(text).map_err(|e| {
            let msg: Vec<String> = e.to_string().trim_end().lines().map(excerpt).collect();
            anyhow::anyhow!("{}", msg.join("\n"))
        })?;
        let mut bad_values = Vec::new();
        let (parsed, unknown) = loop {
            let mut unknown = Vec::new();
            // serde_ignored collects every unknown key; serde_path_to_error
            // names the key of a value that does not parse (`suspend.ttl`).
            let mut record = |path: serde_ignored::Path<'_>| unknown.push(path.to_string());
            let parsed: Result<Settings, _> =
                serde_path_to_error::deserialize(serde_ignored::Deserializer::new(
                    toml::Deserializer::from(tree.clone()),
                    &mut record,
                ));
            match parsed {
                Ok(settings) => break (Some(settings), unknown),
                Err(e) => {
                    let taken_out = take_out(tree.get_mut(), e.path()).is_some();
                    // serde's message may quote the whole bad value.
                    let key = excerpt(&e.path().to_string());
                    let msg = excerpt_ends(e.into_inner().message().trim_end());
                    bad_values.push((key, msg));
                    // Nothing to take out (no key to name): report what is known.
                    if !taken_out {
                        break (None, unknown);
                    }
                }
            }
        };
        let mut problems: Vec<String> = unknown
            .into_iter()
            .map(|k| {
                format!(
                    "{}: unknown setting (see examples/dormant.toml for every setting)",
                    excerpt(&k)
                )
            })
            .collect();
        problems.extend(bad_values.iter().map(|(key, msg)| format!("{key}: {msg}")));
        if let Some(settings) = &parsed {
            let mut checks = Vec::new();
            settings.validate(&mut checks);
            // A bad value's key holds its default now: a check of that
            // default would report the key twice.
            problems.extend(checks.into_iter().filter(|p| {
                !bad_values.iter().any(|(key, _)| {
                    p.strip_prefix(key.as_str())
                        .is_some_and(|rest| rest.starts_with([':', '.', '[']))
                })
            }));
        }
        match parsed {
            Some(settings) if problems.is_empty() => Ok(settings),
            _ => bail!(
                "{} problem(s):\n  {}",
                problems.len(),
                problems.join("\n  ")
            ),
        }
    }
}

/// Takes the value a parse error points at out of the parsed document; None
/// when the path leads to no key. A bad element of a list takes the whole
/// list with it, so that the index of a later bad element in another list is
/// still the one in the file.
fn take_out(tree: &mut toml::de::DeTable<'_>, path: &serde_path_to_error::Path) -> Option<()> {
    use serde_path_to_error::Segment;
    use std::borrow::BorrowMut;
    use toml::de::DeValue;
    let segments: Vec<&Segment> = path.iter().collect();
    let last = segments
        .iter()
        .rposition(|s| matches!(s, Segment::Map { .. }))?;
    let Segment::Map { key } = segments[last] else {
        return None;
    };
    let Some((Segment::Map { key: first }, within)) = segments[..last].split_first() else {
        return tree.remove(key.as_str()).map(drop);
    };
    let mut at = tree.get_mut(first.as_str())?.get_mut();
    for segment in within {
        at = match (segment, at) {
            (Segment::Map { key }, DeValue::Table(t)) => t.get_mut(key.as_str()),
            (Segment::Seq { index }, DeValue::Array(a)) => {
                let items: &mut [_] = a.borrow_mut();
                items.get_mut(*index)
            }
            _ => None,
        }?
        .get_mut();
    }
    match at {
        DeValue::Table(t) => t.remove(key.as_str()).map(drop),
        _ => None,
    }
}
