//! `[events]`: how large the event log (`crate::events`) may grow on disk.
//! It is rotated by size: when the current file would pass `max_file_size`,
//! a new one is started, and the oldest files beyond `keep_files` are
//! deleted — never the current one. Sizes are written `"16MiB"`, `"512KiB"`,
//! `"1GiB"` or a number of bytes.

use std::fmt;

use serde::{Deserialize, Deserializer};

use crate::text::excerpt;

/// Smallest file size: one event line is well under 4 KiB (its error text
/// is cut at 2 KiB), so every file holds at least one whole line.
pub const MIN_FILE_SIZE: u64 = 4 * 1024;
/// Largest file size: `dormant events` and `inspect` read whole files; past
/// 1 GiB a log is better shipped elsewhere than kept in the state dir.
pub const MAX_FILE_SIZE: u64 = 1024 * 1024 * 1024;
/// At least the current file and one before it, so a rotation never leaves
/// a follower (`dormant events --follow`, `dormant metrics`) without the lines
/// just before it.
pub const MIN_KEEP_FILES: u32 = 2;
/// A bound on how many files `dormant events` lists and reads.
pub const MAX_KEEP_FILES: u32 = 1000;

#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct EventSettings {
    /// A file is rotated when the next line would take it past this size.
    pub max_file_size: ByteSize,
    /// How many files are kept, the current one included.
    pub keep_files: u32,
}

impl Default for EventSettings {
    fn default() -> Self {
        EventSettings {
            max_file_size: ByteSize(16 * 1024 * 1024),
            keep_files: 4,
        }
    }
}

impl EventSettings {
    pub(super) fn validate(&self, problems: &mut Vec<String>) {
        let size = self.max_file_size.0;
        if !(MIN_FILE_SIZE..=MAX_FILE_SIZE).contains(&size) {
            problems.push(format!(
                "events.max_file_size: {} is out of range: it must be between {} and {} \
                 (see examples/dormant.toml for why)",
                self.max_file_size,
                ByteSize(MIN_FILE_SIZE),
                ByteSize(MAX_FILE_SIZE)
            ));
        }
        if !(MIN_KEEP_FILES..=MAX_KEEP_FILES).contains(&self.keep_files) {
            problems.push(format!(
                "events.keep_files: {} is out of range: it must be between {MIN_KEEP_FILES} and \
                 {MAX_KEEP_FILES} (the current file and at least one before it)",
                self.keep_files
            ));
        }
    }
}

/// A size in bytes, written with a binary unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ByteSize(pub u64);

impl ByteSize {
    /// Parses `"16MiB"`, `"512KiB"`, `"1GiB"`, `"4096B"` or a bare number of
    /// bytes. Decimal units (`MB`) are refused rather than guessed at.
    pub fn parse(text: &str) -> Result<ByteSize, String> {
        let t = text.trim();
        let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        if num.is_empty() {
            return Err(format!(
                "\"{}\" is not a size: write e.g. \"16MiB\", \"512KiB\" or a number of bytes",
                excerpt(text)
            ));
        }
        // Digits only: the one way `parse` fails is a number beyond u64,
        // which the range check then reports by name.
        let n: u64 = num.parse().unwrap_or(u64::MAX);
        let mult: u64 = match unit.trim() {
            "" | "B" => 1,
            "KiB" => 1024,
            "MiB" => 1024 * 1024,
            "GiB" => 1024 * 1024 * 1024,
            other => {
                return Err(format!(
                    "\"{}\": unknown unit \"{}\" (use B, KiB, MiB or GiB)",
                    excerpt(text),
                    excerpt(other)
                ))
            }
        };
        Ok(ByteSize(n.saturating_mul(mult)))
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [(u64, &str); 3] = [(1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")];
        for (size, unit) in UNITS {
            if self.0 >= size && self.0.is_multiple_of(size) {
                return write!(f, "{}{unit}", self.0 / size);
            }
        }
        write!(f, "{}B", self.0)
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Bytes(u64),
            Text(String),
        }
        match Raw::deserialize(d).map_err(|_| {
            serde::de::Error::custom("expected a size such as \"16MiB\" or a number of bytes")
        })? {
            Raw::Bytes(b) => Ok(ByteSize(b)),
            Raw::Text(t) => ByteSize::parse(&t).map_err(serde::de::Error::custom),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::Settings;

    #[test]
    fn sizes_parse_strictly_and_print_back() {
        assert_eq!(ByteSize::parse("16MiB").unwrap(), ByteSize(16 << 20));
        assert_eq!(ByteSize::parse("512KiB").unwrap(), ByteSize(512 << 10));
        assert_eq!(ByteSize::parse("1GiB").unwrap(), ByteSize(1 << 30));
        assert_eq!(ByteSize::parse("4096").unwrap(), ByteSize(4096));
        assert_eq!(ByteSize::parse("4096B").unwrap(), ByteSize(4096));
        for bad in ["16MB", "16 megs", "MiB", "", "-1KiB", "1.5MiB"] {
            assert!(ByteSize::parse(bad).is_err(), "{bad:?} was accepted");
        }
        assert_eq!(ByteSize(16 << 20).to_string(), "16MiB");
        assert_eq!(ByteSize(4097).to_string(), "4097B");
        let err = ByteSize::parse(&format!("1{}", "x".repeat(10_000))).unwrap_err();
        assert!(err.len() < 600, "{}", err.len());
    }

    #[test]
    fn out_of_range_values_are_named_with_every_other_problem() {
        let text = "[events]\nmax_file_size = \"2KiB\"\nkeep_files = 1\n";
        let err = format!("{:#}", Settings::parse_str(text).unwrap_err());
        assert!(
            err.contains("events.max_file_size: 2KiB is out of range"),
            "{err}"
        );
        assert!(
            err.contains("events.keep_files: 1 is out of range"),
            "{err}"
        );
        let err = format!(
            "{:#}",
            Settings::parse_str("[events]\nmax_file_size = \"99999999999999999999GiB\"\n")
                .unwrap_err()
        );
        assert!(err.contains("events.max_file_size"), "{err}");
        let err = format!(
            "{:#}",
            Settings::parse_str("[events]\nmax_file_size = \"16MB\"\n").unwrap_err()
        );
        assert!(
            err.contains("events.max_file_size") && err.contains("MiB"),
            "{err}"
        );
        let example = Settings::parse_str(include_str!("../../examples/dormant.toml")).unwrap();
        let default = EventSettings::default();
        assert_eq!(example.events.max_file_size, default.max_file_size);
        assert_eq!(example.events.keep_files, default.keep_files);
        let ok =
            Settings::parse_str("[events]\nmax_file_size = \"1GiB\"\nkeep_files = 1000\n").unwrap();
        assert_eq!(ok.events.max_file_size, ByteSize(MAX_FILE_SIZE));
    }
}
