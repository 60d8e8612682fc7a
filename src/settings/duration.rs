//! Durations in settings: `"90s"`, `"10m"`, `"2h"`, `"7d"`, or a number of seconds.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Deserializer};

use crate::text::excerpt;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct HumanDuration(pub Duration);

impl HumanDuration {
    pub const fn from_secs(secs: u64) -> Self {
        HumanDuration(Duration::from_secs(secs))
    }
    pub fn as_secs(&self) -> u64 {
        self.0.as_secs()
    }
    pub fn is_zero(&self) -> bool {
        self.0.is_zero()
    }
    pub fn get(&self) -> Duration {
        self.0
    }

    /// Parses `"90s"`, `"10m"`, `"2h"`, `"7d"` or a bare number of seconds. A
    /// value too large for any clock saturates rather than failing here: the
    /// per-key maximum ([`DurationBound`]) then reports it by name, together
    /// with every other problem of the file.
    pub fn parse(text: &str) -> Result<Self, String> {
        let t = text.trim();
        let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        if num.is_empty() {
            return Err(format!(
                "\"{}\" is not a duration: write e.g. \"90s\", \"10m\", \"2h\" or \"7d\"",
                excerpt(text)
            ));
        }
        // Digits only, so the one way `parse` fails is a number beyond u64.
        let n: u64 = num.parse().unwrap_or(u64::MAX);
        let mult = match unit.trim() {
            "" | "s" => 1,
            "m" => 60,
            "h" => 3600,
            "d" => 86400,
            other => {
                return Err(format!(
                    "\"{}\": unknown unit \"{}\" (use s, m, h or d)",
                    excerpt(text),
                    excerpt(other)
                ))
            }
        };
        Ok(HumanDuration::from_secs(n.saturating_mul(mult)))
    }
}

/// The range a duration setting may take, checked when the settings are read
/// so that a value no clock can hold fails `dormant config` naming its key,
/// instead of panicking in every later prepare or cleanup.
#[derive(Debug, Clone, Copy)]
pub struct DurationBound {
    /// The setting's full name (`suspend.ttl`).
    pub key: &'static str,
    /// Whether `0s` is allowed (it switches the thing off, e.g. no cleanup sweep).
    pub zero_ok: bool,
    pub max: HumanDuration,
}

impl DurationBound {
    /// Appends `key: problem` when `value` is out of range.
    pub fn check(&self, value: HumanDuration, problems: &mut Vec<String>) {
        if value.is_zero() && !self.zero_ok {
            problems.push(format!("{}: must be at least 1s", self.key));
        } else if value > self.max {
            problems.push(format!(
                "{}: must be at most {} (see examples/dormant.toml for why)",
                self.key, self.max
            ));
        }
    }
}

impl fmt::Display for HumanDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.as_secs();
        match s {
            s if s > 0 && s % 86400 == 0 => write!(f, "{}d", s / 86400),
            s if s > 0 && s % 3600 == 0 => write!(f, "{}h", s / 3600),
            s if s > 0 && s % 60 == 0 => write!(f, "{}m", s / 60),
            s => write!(f, "{s}s"),
        }
    }
}

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Secs(u64),
            Text(String),
        }
        match Raw::deserialize(d).map_err(|_| {
            serde::de::Error::custom(
                "expected a duration such as \"90s\", \"10m\" or a number of seconds",
            )
        })? {
            Raw::Secs(s) => Ok(HumanDuration::from_secs(s)),
            Raw::Text(t) => HumanDuration::parse(&t).map_err(serde::de::Error::custom),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units() {
        assert_eq!(HumanDuration::parse("90s").unwrap().as_secs(), 90);
        assert_eq!(HumanDuration::parse("10m").unwrap().as_secs(), 600);
        assert_eq!(HumanDuration::parse("2h").unwrap().as_secs(), 7200);
        assert_eq!(HumanDuration::parse("7d").unwrap().as_secs(), 604800);
        assert_eq!(HumanDuration::parse("15").unwrap().as_secs(), 15);
        assert!(HumanDuration::parse("7 weeks").is_err());
        assert!(HumanDuration::parse("d").is_err());
        assert!(HumanDuration::parse("").is_err());
        assert_eq!(HumanDuration::from_secs(7 * 86400).to_string(), "7d");
        assert_eq!(HumanDuration::from_secs(61).to_string(), "61s");
    }

    #[test]
    fn values_no_clock_can_hold_saturate_instead_of_failing() {
        // Reported by the key's bound with the file's other problems, not here.
        for text in ["18446744073709551615d", "99999999999999999999999"] {
            assert_eq!(
                HumanDuration::parse(text).unwrap(),
                HumanDuration::from_secs(u64::MAX),
                "{text}"
            );
        }
        assert_eq!(
            HumanDuration::parse("200000000000000d").unwrap().as_secs(),
            200_000_000_000_000 * 86400
        );
    }

    #[test]
    fn bad_text_is_quoted_briefly() {
        let err = HumanDuration::parse(&format!("x{}", "y".repeat(70_000))).unwrap_err();
        assert!(err.len() < 400, "{}", err.len());
        assert!(err.contains("(70001 bytes)"), "{err}");
        let err = HumanDuration::parse("5\u{1b}[2J").unwrap_err();
        assert!(!err.contains('\u{1b}') && err.contains("\\u{1b}"), "{err}");
    }

    #[test]
    fn bounds_name_the_key() {
        let b = DurationBound {
            key: "suspend.ttl",
            zero_ok: false,
            max: HumanDuration::from_secs(365 * 86400),
        };
        let mut problems = Vec::new();
        b.check(HumanDuration::from_secs(365 * 86400), &mut problems);
        assert!(problems.is_empty(), "{problems:?}");
        b.check(HumanDuration::from_secs(365 * 86400 + 1), &mut problems);
        b.check(HumanDuration::from_secs(0), &mut problems);
        assert_eq!(
            problems,
            [
                "suspend.ttl: must be at most 365d (see examples/dormant.toml for why)",
                "suspend.ttl: must be at least 1s"
            ]
        );
    }
}
