//! Unit tests of the core settings: strict parsing, every problem at once, the shipped example.
use super::*;
use crate::job::Job;

#[test]
fn empty_file_gives_defaults() {
    let s = Settings::parse_str("").unwrap();
    assert_eq!(s.provider, ProviderKind::Local);
    assert_eq!(s.suspend.ttl.as_secs(), 7 * 24 * 3600);
    assert!(s.suspend.enabled);
}

/// The shipped example parses, and names every setting and nothing else:
/// table by table, the keys it sets or shows commented out are exactly the
/// fields of the settings structs.
#[test]
fn the_shipped_example_parses_and_names_every_top_level_setting() {
    let text = include_str!("../../examples/dormant.toml");
    let parsed = Settings::parse_str(text).unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(parsed.provider, ProviderKind::Local);
    let structs = keys::of_the_settings_structs();
    let example = keys::in_the_example(text);
    for table in [
        "",
        "suspend",
        "events",
        "local",
        "ssh",
        "ssh.hosts",
        "ec2",
        "qemu",
    ] {
        assert!(
            structs.contains_key(table),
            "no table {table:?} found in {structs:?}"
        );
    }
    let mut problems = Vec::new();
    for (table, fields) in &structs {
        let shown = example.get(table).cloned().unwrap_or_default();
        let missing: Vec<&String> = fields.difference(&shown).collect();
        let extra: Vec<&String> = shown.difference(fields).collect();
        if !missing.is_empty() || !extra.is_empty() {
            problems.push(format!(
                "table [{table}]: settings it does not name: {missing:?}; keys that are no setting: {extra:?}"
            ));
        }
    }
    // A table of the example that is no struct is a setting whose value is a
    // table of names (`[qemu.images]`).
    for table in example.keys().filter(|t| !structs.contains_key(*t)) {
        let (parent, key) = table.rsplit_once('.').unwrap_or(("", table));
        if !structs.get(parent).is_some_and(|f| f.contains(key)) {
            problems.push(format!("a table [{table}] that is no setting"));
        }
    }
    assert!(
        problems.is_empty(),
        "examples/dormant.toml:\n  {}",
        problems.join("\n  ")
    );
}

/// Keys table by table (`""` is the top level, `ssh.hosts` the table of each host).
mod keys {
    use std::cell::RefCell;
    use std::collections::{BTreeMap, BTreeSet};

    use serde::de::{
        self, DeserializeSeed, Deserializer, IntoDeserializer, MapAccess, SeqAccess, Visitor,
    };
    use serde::Deserialize;

    use super::Settings;

    type Tables = BTreeMap<String, BTreeSet<String>>;
    type Error = de::value::Error;
    type Found = RefCell<Option<(String, &'static [&'static str])>>;

    /// The fields of every settings struct, as serde knows them (its own
    /// list of each struct's fields): deserializing from [`Probe`], which
    /// follows one path of keys into the structs and records the fields of
    /// the struct at its end, once for every path.
    pub fn of_the_settings_structs() -> Tables {
        let mut tables = Tables::new();
        let mut paths: Vec<Vec<&'static str>> = vec![Vec::new()];
        while let Some(path) = paths.pop() {
            let found = Found::default();
            // Always an error: the probe stops where it finds the struct, and
            // at any plain value (a field that is no table).
            let _ = Settings::deserialize(Probe {
                table: String::new(),
                rest: &path,
                found: &found,
            });
            if let Some((table, fields)) = found.into_inner() {
                for field in fields {
                    let mut deeper = path.clone();
                    deeper.push(*field);
                    paths.push(deeper);
                }
                tables.insert(table, fields.iter().map(|f| f.to_string()).collect());
            }
        }
        tables
    }

    /// The keys the example sets or shows commented out (`# key = value`, a
    /// line that is TOML by itself); a table header (`[a.b]`, `[[a.b]]`,
    /// commented or not) is key `b` of table `a`.
    pub fn in_the_example(text: &str) -> Tables {
        let mut tables = Tables::new();
        let mut table = String::new();
        for line in text.lines() {
            let line = line
                .strip_prefix('#')
                .map_or(line, str::trim_start)
                .trim_end();
            let header = line
                .strip_prefix("[[")
                .and_then(|l| l.strip_suffix("]]"))
                .or_else(|| line.strip_prefix('[').and_then(|l| l.strip_suffix(']')));
            if let Some(name) = header.filter(|n| {
                n.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '.')
            }) {
                let (parent, key) = name.rsplit_once('.').unwrap_or(("", name));
                tables
                    .entry(parent.to_string())
                    .or_default()
                    .insert(key.to_string());
                table = name.to_string();
                tables.entry(table.clone()).or_default();
            } else if let Ok(one) = toml::from_str::<toml::Table>(line) {
                if one.len() == 1 {
                    tables
                        .entry(table.clone())
                        .or_default()
                        .extend(one.keys().cloned());
                }
            }
        }
        tables
    }

    struct Probe<'a> {
        table: String,
        rest: &'a [&'static str],
        found: &'a Found,
    }

    impl<'de> Deserializer<'de> for Probe<'_> {
        type Error = Error;

        fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Error> {
            Err(de::Error::custom("a plain value"))
        }

        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _: &'static str,
            fields: &'static [&'static str],
            visitor: V,
        ) -> Result<V::Value, Error> {
            let Some((key, rest)) = self.rest.split_first() else {
                *self.found.borrow_mut() = Some((self.table, fields));
                return Err(de::Error::custom("found"));
            };
            let table = match self.table.as_str() {
                "" => key.to_string(),
                t => format!("{t}.{key}"),
            };
            visitor.visit_map(OneEntry {
                key: Some(key),
                value: Some(Probe {
                    table,
                    rest,
                    found: self.found,
                }),
            })
        }

        fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
            visitor.visit_some(self)
        }

        fn deserialize_newtype_struct<V: Visitor<'de>>(
            self,
            _: &'static str,
            visitor: V,
        ) -> Result<V::Value, Error> {
            visitor.visit_newtype_struct(self)
        }

        /// A list of tables (`[[ssh.hosts]]`): one element.
        fn deserialize_seq<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
            visitor.visit_seq(OneElement(Some(self)))
        }

        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string
            bytes byte_buf unit unit_struct tuple tuple_struct map enum identifier
            ignored_any
        }
    }

    struct OneEntry<'a> {
        key: Option<&'static str>,
        value: Option<Probe<'a>>,
    }

    impl<'de> MapAccess<'de> for OneEntry<'_> {
        type Error = Error;

        fn next_key_seed<K: DeserializeSeed<'de>>(
            &mut self,
            seed: K,
        ) -> Result<Option<K::Value>, Error> {
            self.key
                .take()
                .map(|k| seed.deserialize(k.into_deserializer()))
                .transpose()
        }

        fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, Error> {
            seed.deserialize(self.value.take().expect("one value per key"))
        }
    }

    struct OneElement<'a>(Option<Probe<'a>>);

    impl<'de> SeqAccess<'de> for OneElement<'_> {
        type Error = Error;

        fn next_element_seed<T: DeserializeSeed<'de>>(
            &mut self,
            seed: T,
        ) -> Result<Option<T::Value>, Error> {
            self.0.take().map(|p| seed.deserialize(p)).transpose()
        }
    }
}

#[test]
fn every_problem_is_reported_at_once_naming_the_key() {
    let err = Settings::parse_str(
        "colour = 1\nprepare_timeout = \"0s\"\n[suspend]\nttl = \"0s\"\nbogus = true\n",
    )
    .unwrap_err();
    let text = format!("{err:#}");
    for needle in [
        "colour: unknown setting",
        "suspend.bogus: unknown setting",
        "prepare_timeout: must be",
        "suspend.ttl: must be",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in {text}");
    }
}

#[test]
fn values_that_do_not_parse_are_all_reported_with_the_keys_after_them() {
    // serde stops at the first value that does not parse: ec2.market comes
    // first, and suspend.ttl and the unknown key after it were never seen.
    let err = Settings::parse_str(
        "[ec2]\nmarket = \"spott\"\n[suspend]\nttl = \"seven days\"\nwibble = true\n",
    )
    .unwrap_err();
    let text = format!("{err:#}");
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some("3 problem(s):"), "{text}");
    let mut problems: Vec<&str> = lines.map(str::trim_start).collect();
    problems.sort_unstable();
    assert_eq!(
        problems,
        [
            "ec2.market: unknown variant `spott`, expected `on-demand` or `spot`",
            "suspend.ttl: \"seven days\" is not a duration: write e.g. \"90s\", \"10m\", \"2h\" or \"7d\"",
            "suspend.wibble: unknown setting (see examples/dormant.toml for every setting)",
        ],
        "{text}"
    );
}

#[test]
fn bad_values_join_the_checks_of_the_others_once_each() {
    // Bad elements of two lists keep their own indices; a bad value is not
    // reported again by a check of the default standing in for it; the
    // checks of the other keys still run.
    let err = Settings::parse_str(
        "provider = \"ssh\"\nruner_id = \"x\"\nstate_dir = \"rel\"\n\
         [ec2]\nsubnet_ids = [\"a\", 1, 2]\nsecurity_group_ids = [\"b\", \"c\", true]\n\
         [[ssh.hosts]]\naddress = \"h\"\nuser = \"u\"\nidentity_file = 5\nport = 70000\n",
    )
    .unwrap_err();
    let text = format!("{err:#}");
    let problems: Vec<&str> = text.lines().skip(1).map(str::trim_start).collect();
    for expected in [
        "runer_id: unknown setting",
        "ec2.subnet_ids[1]: invalid type: integer `1`, expected a string",
        "ec2.security_group_ids[2]: invalid type: boolean `true`, expected a string",
        "ssh.hosts[0].identity_file: invalid type: integer `5`, expected path string",
        "ssh.hosts[0].port: invalid value: integer `70000`, expected u16",
        "state_dir: rel must be an absolute path",
    ] {
        assert_eq!(
            problems.iter().filter(|p| p.starts_with(expected)).count(),
            1,
            "{expected:?} in {text}"
        );
    }
    assert_eq!(problems.len(), 6, "{text}");
    assert!(text.starts_with("6 problem(s):\n"), "{text}");
}

#[test]
fn one_bad_value_is_reported_as_before() {
    let err = Settings::parse_str("provider = \"gcp\"\n").unwrap_err();
    assert_eq!(
        format!("{err:#}"),
        "1 problem(s):\n  provider: unknown variant `gcp`, expected one of `local`, `ssh`, `ec2`, `qemu`"
    );
}

#[test]
fn bad_values_name_the_key() {
    let err = Settings::parse_str("provider = \"gcp\"\n").unwrap_err();
    assert!(format!("{err:#}").contains("provider"), "{err:#}");
    let err = Settings::parse_str("colour = 1\n[suspend]\nttl = \"seven days\"\n").unwrap_err();
    let text = format!("{err:#}");
    assert!(
        text.contains("suspend.ttl: \"seven days\" is not a duration"),
        "{text}"
    );
    assert!(
        text.contains("colour: unknown setting"),
        "unknown keys before a bad value are reported too: {text}"
    );
    let err = Settings::parse_str("runner_id = \"a/b\"\n").unwrap_err();
    assert!(format!("{err:#}").contains("runner_id"), "{err:#}");
}

#[test]
fn notify_and_job_request_settings_are_read_and_bounded() {
    let s = Settings::parse_str(
        "[suspend]\nnotify_command = [\"/usr/local/bin/hook\", \"--mr\"]\nnotify_timeout = \"3s\"\nallow_job_request = false\n",
    )
    .unwrap();
    assert_eq!(s.suspend.notify_command, ["/usr/local/bin/hook", "--mr"]);
    assert_eq!(s.suspend.notify_timeout.as_secs(), 3);
    assert!(!s.suspend.allow_job_request);
    let d = Settings::parse_str("").unwrap();
    assert!(d.suspend.notify_command.is_empty() && d.suspend.allow_job_request);
    let err =
        Settings::parse_str("[suspend]\nnotify_command = [\"hook\"]\nnotify_timeout = \"10m\"\n")
            .unwrap_err();
    let text = format!("{err:#}");
    assert!(
        text.contains("suspend.notify_command: the program \"hook\" must be an absolute path"),
        "{text}"
    );
    assert!(
        text.contains("suspend.notify_timeout: must be at most 1m"),
        "{text}"
    );
    let err = Settings::parse_str("[suspend]\nnotify_timeout = \"0s\"\n").unwrap_err();
    assert!(
        format!("{err:#}").contains("suspend.notify_timeout: must be at least 1s"),
        "{err:#}"
    );
}

#[test]
fn huge_values_are_quoted_briefly() {
    let huge = "x/".repeat(32_768);
    for text in [
        format!("runner_id = \"{huge}\"\n"),
        format!("state_dir = \"{huge}\"\n"),
        format!("provider = \"{huge}\"\n"),
        format!("[ssh]\nconnect_timeout = [\"{huge}\"]\n"),
        format!("[suspend]\nttl = \"{huge}\"\n"),
        format!("\"{huge}\" = 1\n"),
        format!("colour = \"{huge}\n"),
        format!("[ssh]\nworkspace_root = \"{huge}\"\n"),
        format!("[ec2]\nendpoint_url = \"{huge}\"\n"),
    ] {
        let err = format!("{:#}", Settings::parse_str(&text).unwrap_err());
        for line in err.lines() {
            assert!(line.len() < 400, "{} bytes: {line}", line.len());
        }
    }
}

#[test]
fn state_dir_env_overrides_and_runner_tmpdir_is_refused() {
    let s = Settings::parse_str("state_dir = \"/srv/dormant\"\n").unwrap();
    assert_eq!(
        s.state_dir(&Job::default()).unwrap(),
        PathBuf::from("/srv/dormant")
    );
    let job = Job::from_map([("DORMANT_STATE_DIR", "/x/state")]);
    assert_eq!(s.state_dir(&job).unwrap(), PathBuf::from("/x/state"));
    let job = Job::from_map([
        ("DORMANT_STATE_DIR", "/tmp/custom-executor1/s"),
        ("TMPDIR", "/tmp/custom-executor1"),
    ]);
    assert!(format!("{:#}", s.state_dir(&job).unwrap_err()).contains("deleted after"));
}

#[test]
fn a_state_dir_too_long_for_qemu_sockets_fails_naming_the_limit() {
    let max = super::qemu::max_state_dir_len();
    // <dir>/environments/<36-char id>/vm/qmp.sock fills a 107-byte socket path exactly.
    assert_eq!(
        max + "/environments/".len() + 36 + "/vm/qmp.sock".len(),
        107
    );
    let fits = format!("/{}", "d".repeat(max - 1));
    let too_long = format!("/{}", "d".repeat(max));
    let qemu =
        Settings::parse_str("provider = \"qemu\"\n[qemu]\nimage = \"/img/base.qcow2\"\n").unwrap();
    let job = Job::from_map([("DORMANT_STATE_DIR", fits.as_str())]);
    assert_eq!(qemu.state_dir(&job).unwrap(), PathBuf::from(&fits));
    let job = Job::from_map([("DORMANT_STATE_DIR", too_long.as_str())]);
    let e = format!("{:#}", qemu.state_dir(&job).unwrap_err());
    assert!(
        e.contains(&too_long)
            && e.contains(&format!("at most {max} bytes"))
            && e.contains("shorter path"),
        "{e}"
    );
    // Other providers have no such socket.
    let local = Settings::parse_str("").unwrap();
    assert!(local.state_dir(&job).is_ok());
}

#[test]
fn the_hot_window_is_read_bounded_and_off_by_default() {
    assert!(Settings::default().suspend.hot_for.is_zero());
    let s = Settings::parse_str("[suspend]\nhot_for = \"10m\"\n").unwrap();
    assert_eq!(s.suspend.hot_for.as_secs(), 600);
    let s = Settings::parse_str("[suspend]\nhot_for = \"0s\"\n").unwrap();
    assert!(s.suspend.hot_for.is_zero(), "0s turns it off");
    let err = Settings::parse_str("[suspend]\nhot_for = \"ten minutes\"\n").unwrap_err();
    let text = format!("{err:#}");
    assert!(
        text.contains("suspend.hot_for: \"ten minutes\" is not a duration"),
        "{text}"
    );
    let err = Settings::parse_str("[suspend]\nhot_for = \"2d\"\n").unwrap_err();
    let text = format!("{err:#}");
    assert!(text.contains("suspend.hot_for"), "{text}");
}
