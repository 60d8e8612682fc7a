//! The range of every duration setting, checked when the settings are read.
//!
//! A duration is added to the clock (`Instant::now() + prepare_timeout`), so a
//! value like `"18446744073709551615s"` that parses fine would panic in every
//! prepare or cleanup. Each key gets a maximum that is generous for any real
//! use and far from overflow; the reasons are in `examples/dormant.toml` next
//! to each key. `Settings::validate` reports every value out of range at once,
//! as `key: must be at most ...`.

use super::duration::{DurationBound, HumanDuration};
use super::Settings;

const fn hours(h: u64) -> HumanDuration {
    HumanDuration::from_secs(h * 3600)
}

const fn days(d: u64) -> HumanDuration {
    HumanDuration::from_secs(d * 86400)
}

const fn bound(key: &'static str, zero_ok: bool, max: HumanDuration) -> DurationBound {
    DurationBound { key, zero_ok, max }
}

/// Every duration setting and its range. Why each maximum:
/// - waits inside one stage (`prepare_timeout`, `ssh.ready_timeout`,
///   `ssh.slot_wait`, `ec2.prepare_timeout`): 24 h. GitLab Runner's own
///   `prepare_exec_timeout` (1 h by default) ends a prepare first; a day leaves
///   room for an operator who raised it, and no job waits longer for a machine.
/// - `suspend.cleanup_sweep_budget`: 1 h, the runner's default
///   `cleanup_exec_timeout`; a longer budget would be cut by the runner anyway.
/// - `suspend.claim_grace`: 7 d, the default TTL: a holder gone longer than
///   that would have its environment swept anyway. Not 0: between two stages
///   of a job no process runs for a moment, and that must not look gone.
/// - `suspend.ttl`: 365 d. A suspended environment costs disk (or an EBS
///   volume) while it waits; a year is the longest any pipeline pauses.
/// - `suspend.hot_for` (the hot window after a pause): 0 (off) to 24 h; a
///   machine left running longer than a day for an answer costs more than
///   any restore saves.
/// - `suspend.notify_timeout`: 1 min; the hook runs inside a job's prepare
///   and cleanup, which it must not hold up.
/// - `ssh.connect_timeout` (one connect attempt): 10 min; a handshake that has
///   not finished by then never will.
/// - `ssh.control_persist` (an idle master's lifetime): 24 h; the gap between
///   two stages of a job is milliseconds.
/// - `ssh.server_alive_interval`: 1 h; three missed answers declare the
///   connection dead, so longer would hide a dead machine for hours.
/// - `ssh.reconnect_timeout` (a run re-attaching after a lost connection): 0
///   (off) to 1 h; the script keeps running on the machine meanwhile, and a
///   job waiting longer than that for a machine is better failed and retried.
/// - `qemu.shutdown_timeout` (ACPI power-down before QEMU is quit): 1 h; a
///   guest that has not powered off by then will not.
/// - `qemu.boot_timeout`: 24 h, like every prepare bound (the runner's
///   `prepare_exec_timeout` ends a prepare first).
/// - `qemu.warm_max_age`: 7 d; a warm VM is retired at this age so that a
///   handed-out machine is never much older than its image (at least 10 min,
///   checked with the qemu settings: younger would retire VMs as they boot).
/// - `ec2.warm_max_age`: 7 d, like `qemu.warm_max_age` (at least 10 min,
///   checked with the ec2 settings).
/// - `ec2.image_cache_ttl`: 30 d; an image pattern's newest match changes when
///   images (with security fixes) are published. Pin an AMI id to keep one.
pub const DURATION_BOUNDS: &[DurationBound] = &[
    bound("prepare_timeout", false, hours(24)),
    bound("suspend.ttl", false, days(365)),
    bound("suspend.cleanup_sweep_budget", true, hours(1)),
    bound("suspend.claim_grace", false, days(7)),
    bound("suspend.hot_for", true, hours(24)),
    bound(
        "suspend.notify_timeout",
        false,
        HumanDuration::from_secs(60),
    ),
    bound("ssh.connect_timeout", false, HumanDuration::from_secs(600)),
    bound("ssh.ready_timeout", false, hours(24)),
    bound("ssh.control_persist", false, hours(24)),
    bound("ssh.server_alive_interval", false, hours(1)),
    bound("ssh.reconnect_timeout", true, hours(1)),
    bound("ssh.slot_wait", true, hours(24)),
    bound("ec2.image_cache_ttl", true, days(30)),
    bound("ec2.prepare_timeout", false, hours(24)),
    bound("ec2.warm_max_age", false, days(7)),
    bound("qemu.shutdown_timeout", false, hours(1)),
    bound("qemu.boot_timeout", false, hours(24)),
    bound("qemu.warm_max_age", false, days(7)),
];

impl Settings {
    /// Every duration setting's value by its key (`None`: unset, the default of another).
    pub fn durations(&self) -> Vec<(&'static str, Option<HumanDuration>)> {
        vec![
            ("prepare_timeout", Some(self.prepare_timeout)),
            ("suspend.ttl", Some(self.suspend.ttl)),
            (
                "suspend.cleanup_sweep_budget",
                Some(self.suspend.cleanup_sweep_budget),
            ),
            ("suspend.claim_grace", Some(self.suspend.claim_grace)),
            ("suspend.hot_for", Some(self.suspend.hot_for)),
            ("suspend.notify_timeout", Some(self.suspend.notify_timeout)),
            ("ssh.connect_timeout", Some(self.ssh.connect_timeout)),
            ("ssh.ready_timeout", Some(self.ssh.ready_timeout)),
            ("ssh.control_persist", Some(self.ssh.control_persist)),
            (
                "ssh.server_alive_interval",
                Some(self.ssh.server_alive_interval),
            ),
            ("ssh.reconnect_timeout", Some(self.ssh.reconnect_timeout)),
            ("ssh.slot_wait", Some(self.ssh.slot_wait)),
            ("ec2.image_cache_ttl", Some(self.ec2.image_cache_ttl)),
            ("ec2.prepare_timeout", self.ec2.prepare_timeout),
            ("ec2.warm_max_age", Some(self.ec2.warm_max_age)),
            ("qemu.shutdown_timeout", Some(self.qemu.shutdown_timeout)),
            ("qemu.boot_timeout", Some(self.qemu.boot_timeout)),
            ("qemu.warm_max_age", Some(self.qemu.warm_max_age)),
        ]
    }

    /// Appends `key: problem` for every duration out of its range.
    pub(super) fn check_durations(&self, problems: &mut Vec<String>) {
        for (key, value) in self.durations() {
            let Some(value) = value else { continue };
            match DURATION_BOUNDS.iter().find(|b| b.key == key) {
                Some(b) => b.check(value, problems),
                // A key without a bound is a bug caught by the tests below;
                // refuse rather than let a value reach the clock unchecked.
                None => problems.push(format!("{key}: has no allowed range (a bug)")),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn section_and_name(key: &str) -> (Option<&str>, &str) {
        match key.split_once('.') {
            Some((s, n)) => (Some(s), n),
            None => (None, key),
        }
    }

    /// The settings text that sets `key` to `value`.
    fn text_setting(key: &str, value: &str) -> String {
        match section_and_name(key) {
            (Some(section), name) => format!("[{section}]\n{name} = \"{value}\"\n"),
            (None, name) => format!("{name} = \"{value}\"\n"),
        }
    }

    fn problems(text: &str) -> String {
        match Settings::parse_str(text) {
            Ok(_) => String::new(),
            Err(e) => format!("{e:#}"),
        }
    }

    #[test]
    fn every_bounded_key_takes_its_maximum_and_refuses_a_second_more() {
        for b in DURATION_BOUNDS {
            let at_max = text_setting(b.key, &format!("{}s", b.max.as_secs()));
            assert_eq!(problems(&at_max), "", "{}", b.key);
            let over = text_setting(b.key, &format!("{}s", b.max.as_secs() + 1));
            let text = problems(&over);
            assert!(
                text.contains(&format!("{}: must be at most {}", b.key, b.max)),
                "{}: {text}",
                b.key
            );
        }
    }

    #[test]
    fn every_bounded_key_refuses_values_no_clock_can_hold() {
        // The values of the issue: they passed `dormant config`, then every
        // prepare or cleanup panicked adding them to the clock.
        for value in ["18446744073709551615s", "200000000000000d"] {
            for b in DURATION_BOUNDS {
                let text = problems(&text_setting(b.key, value));
                assert!(
                    text.contains(&format!("{}: must be at most", b.key)),
                    "{} = {value}: {text}",
                    b.key
                );
            }
        }
    }

    #[test]
    fn zero_is_refused_where_it_would_mean_never() {
        for b in DURATION_BOUNDS {
            let text = problems(&text_setting(b.key, "0s"));
            assert_eq!(
                text.contains(&format!("{}: must be at least 1s", b.key)),
                !b.zero_ok,
                "{}: {text}",
                b.key
            );
        }
    }

    #[test]
    fn all_out_of_range_durations_are_reported_at_once() {
        let text = problems(
            "prepare_timeout = \"18446744073709551615s\"\n\
             [suspend]\nttl = \"400d\"\ncleanup_sweep_budget = \"200000000000000d\"\n\
             [ssh]\nconnect_timeout = \"1d\"\n[ec2]\nprepare_timeout = \"2d\"\n",
        );
        for key in [
            "prepare_timeout:",
            "suspend.ttl:",
            "suspend.cleanup_sweep_budget:",
            "ssh.connect_timeout:",
            "ec2.prepare_timeout:",
        ] {
            assert!(text.contains(key), "missing {key} in {text}");
        }
        assert!(text.starts_with("5 problem(s)"), "{text}");
    }

    #[test]
    fn every_duration_field_has_a_bound() {
        // Scans the settings structs' source for duration fields, so a new
        // one cannot be added without a range.
        let sources = [
            (None, include_str!("mod.rs")),
            (Some("ssh"), include_str!("ssh.rs")),
            (Some("ec2"), include_str!("ec2.rs")),
            (Some("qemu"), include_str!("qemu.rs")),
        ];
        let nested = [("suspend", "SuspendSettings")];
        let mut fields = Vec::new();
        for (section, src) in sources {
            let mut current_struct = "";
            for line in src.lines() {
                let line = line.trim();
                if let Some(rest) = line.strip_prefix("pub struct ") {
                    current_struct = rest.split_whitespace().next().unwrap_or("");
                }
                let Some(rest) = line.strip_prefix("pub ") else {
                    continue;
                };
                let Some((name, ty)) = rest.split_once(':') else {
                    continue;
                };
                if !ty.contains("HumanDuration") || name.contains(' ') {
                    continue;
                }
                let prefix = nested
                    .iter()
                    .find(|(_, s)| *s == current_struct)
                    .map(|(p, _)| *p)
                    .or(section);
                fields.push(match prefix {
                    Some(p) => format!("{p}.{name}"),
                    None => name.to_string(),
                });
            }
        }
        let mut bounded: Vec<String> = DURATION_BOUNDS.iter().map(|b| b.key.to_string()).collect();
        let mut listed: Vec<String> = Settings::default()
            .durations()
            .into_iter()
            .map(|(k, _)| k.to_string())
            .collect();
        fields.sort();
        bounded.sort();
        listed.sort();
        assert_eq!(fields, bounded, "duration fields vs DURATION_BOUNDS");
        assert_eq!(listed, bounded, "Settings::durations vs DURATION_BOUNDS");
    }

    #[test]
    fn the_defaults_are_within_bounds_and_the_example_states_each_maximum() {
        let mut problems = Vec::new();
        Settings::default().check_durations(&mut problems);
        assert!(problems.is_empty(), "{problems:?}");
        let example = include_str!("../../examples/dormant.toml");
        for b in DURATION_BOUNDS {
            let (section, name) = section_and_name(b.key);
            // The key's own section: from its header to the next header.
            let body = match section {
                None => example.split("\n[").next().unwrap_or(""),
                Some(s) => example
                    .split(&format!("\n[{s}]\n"))
                    .nth(1)
                    .and_then(|rest| rest.split("\n[").next())
                    .unwrap_or(""),
            };
            let lines: Vec<&str> = body.lines().collect();
            let at = lines
                .iter()
                .position(|l| {
                    l.starts_with(&format!("{name} = ")) || l.starts_with(&format!("# {name} = "))
                })
                .unwrap_or_else(|| panic!("examples/dormant.toml lacks {}", b.key));
            // The comment lines right above the key's line.
            let comment: Vec<&str> = lines[..at]
                .iter()
                .rev()
                .take_while(|l| l.starts_with('#') && !l.contains(" = "))
                .copied()
                .collect();
            // As the error says it ("1d"), or in hours for timeouts ("24h").
            let max = format!("at most {}", b.max);
            let in_hours = format!("at most {}h", b.max.as_secs() / 3600);
            assert!(
                comment
                    .iter()
                    .any(|l| l.contains(&max)
                        || (b.max.as_secs() % 3600 == 0 && l.contains(&in_hours))),
                "examples/dormant.toml: the comment above {} does not say `{max}`",
                b.key
            );
        }
    }
}
