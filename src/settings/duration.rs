//! Durations in settings: `"90s"`, `"10m"`, `"2h"`, `"7d"`, or a number of seconds.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Deserializer};

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

    pub fn parse(text: &str) -> Result<Self, String> {
        let t = text.trim();
        let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        let n: u64 = num.parse().map_err(|_| {
            format!("{text:?} is not a duration: write e.g. \"90s\", \"10m\", \"2h\" or \"7d\"")
        })?;
        let mult = match unit.trim() {
            "" | "s" => 1,
            "m" => 60,
            "h" => 3600,
            "d" => 86400,
            other => {
                return Err(format!(
                    "{text:?}: unknown unit {other:?} (use s, m, h or d)"
                ))
            }
        };
        n.checked_mul(mult)
            .map(HumanDuration::from_secs)
            .ok_or_else(|| format!("{text:?} is too long"))
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
        assert!(HumanDuration::parse("").is_err());
        assert_eq!(HumanDuration::from_secs(7 * 86400).to_string(), "7d");
        assert_eq!(HumanDuration::from_secs(61).to_string(), "61s");
    }
}
