//! Fuzz targets for the three readers of untrusted text: the environment key
//! decoder, the job payload reader and the settings parser.
//!
//! Random bytes alone rarely get past the first check of a parser, so each
//! target also takes *valid* inputs and mutates them: byte edits (insert,
//! delete, splice, tokens the format gives meaning to) and, for JSON and TOML,
//! a value anywhere in the tree replaced by a random one of any type. The
//! properties: no panic; keys round-trip (`encode` → `parse` is the identity);
//! what is accepted is within range; no message quotes more than a short
//! excerpt of its input or anything of the payload's secrets.
//!
//! Cases per target: `DORMANT_FUZZ_CASES` (default 2,000 so the test suite
//! stays fast); `scripts/fuzz.sh` runs a million per target in release mode.

use std::time::{Duration, Instant};

use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;
use serde_json::{json, Value};
use uuid::Uuid;

use crate::envkey::{EnvironmentKey, MAX_KEY_LEN};
use crate::job::{Job, JobInput};
use crate::settings::bounds::DURATION_BOUNDS;
use crate::settings::Settings;

fn config() -> ProptestConfig {
    let cases = std::env::var("DORMANT_FUZZ_CASES")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(2_000);
    ProptestConfig {
        cases,
        // Failing inputs are printed, minimised, in the test's output; no
        // regression files are written into the source tree.
        failure_persistence: Some(Box::new(FileFailurePersistence::Off)),
        ..ProptestConfig::default()
    }
}

/// One edit of a byte string; positions are taken modulo the length.
#[derive(Debug, Clone)]
enum Edit {
    Insert(usize, Vec<u8>),
    Token(usize, usize),
    Delete(usize, usize),
    Replace(usize, u8),
    /// Copies `len` bytes from the first position to the second.
    Splice(usize, usize, usize),
}

fn edits(max: usize) -> impl Strategy<Value = Vec<Edit>> {
    let edit = prop_oneof![
        (any::<usize>(), prop::collection::vec(any::<u8>(), 1..6))
            .prop_map(|(p, b)| Edit::Insert(p, b)),
        (any::<usize>(), any::<usize>()).prop_map(|(p, t)| Edit::Token(p, t)),
        (any::<usize>(), 1..16usize).prop_map(|(p, n)| Edit::Delete(p, n)),
        (any::<usize>(), any::<u8>()).prop_map(|(p, b)| Edit::Replace(p, b)),
        (any::<usize>(), any::<usize>(), 1..64usize).prop_map(|(a, b, n)| Edit::Splice(a, b, n)),
    ];
    prop::collection::vec(edit, 0..max)
}

/// After a structured mutation: mostly none, so most inputs still parse as
/// JSON / TOML and reach the checks behind the syntax.
fn few_edits() -> impl Strategy<Value = Vec<Edit>> {
    prop_oneof![3 => Just(Vec::new()), 1 => edits(3)]
}

/// `seed` with `edits` applied; invalid UTF-8 becomes U+FFFD, as the parsers take `&str`.
fn mutate(seed: &str, edits: &[Edit], tokens: &[&str]) -> String {
    let mut b = seed.as_bytes().to_vec();
    for e in edits {
        let at = |p: usize, len: usize| p % (len + 1);
        match e {
            Edit::Insert(p, bytes) => {
                let i = at(*p, b.len());
                b.splice(i..i, bytes.iter().copied());
            }
            Edit::Token(p, t) => {
                let i = at(*p, b.len());
                b.splice(i..i, tokens[t % tokens.len()].bytes());
            }
            Edit::Delete(p, n) => {
                let i = at(*p, b.len());
                let end = (i + n).min(b.len());
                b.drain(i..end);
            }
            Edit::Replace(p, byte) => {
                if !b.is_empty() {
                    let i = p % b.len();
                    b[i] = *byte;
                }
            }
            Edit::Splice(from, to, n) => {
                let i = at(*from, b.len());
                let chunk: Vec<u8> = b[i..(i + n).min(b.len())].to_vec();
                let j = at(*to, b.len());
                b.splice(j..j, chunk);
            }
        }
    }
    String::from_utf8_lossy(&b).into_owned()
}

/// Random text: arbitrary strings, arbitrary bytes, or mutations of `seeds`.
fn text_from(seeds: Vec<String>, tokens: &'static [&'static str]) -> impl Strategy<Value = String> {
    prop_oneof![
        1 => any::<String>(),
        1 => prop::collection::vec(any::<u8>(), 0..512)
            .prop_map(|b| String::from_utf8_lossy(&b).into_owned()),
        6 => (prop::sample::select(seeds), edits(8))
            .prop_map(move |(seed, e)| mutate(&seed, &e, tokens)),
    ]
}

/// Every line of an error: short, whatever the input's size.
fn assert_brief(msg: &str, input: &str) {
    for line in msg.lines() {
        assert!(
            line.len() <= 600,
            "a message line of {} bytes for a {}-byte input: {}",
            line.len(),
            input.len(),
            crate::text::excerpt(line)
        );
    }
}

// ---------------------------------------------------------------- keys

const KEY_TOKENS: &[&str] = &[
    "/",
    "%",
    "%2F",
    "%zz",
    "%C3",
    "%FF",
    "%00",
    "&",
    "=",
    "env=",
    "+",
    "&env=",
    "é",
    " ",
    "\n",
    "0b6e1f52-3c1d-4b8e-9a51-7f2d4f0d9c11",
    "urn:uuid:",
    "provider=ec2",
    "%%",
    "\u{202e}",
];

fn valid_key() -> impl Strategy<Value = EnvironmentKey> {
    (
        "[0-9]{1,9}",
        prop_oneof![
            "s_[0-9a-z]{12}",
            any::<String>().prop_filter("non-empty", |s| !s.is_empty())
        ],
        any::<u128>(),
        prop::collection::btree_map("[a-z][a-z0-9_-]{0,8}", any::<String>(), 0..5),
    )
        .prop_map(|(runner, system, uuid, fields)| {
            let mut key = EnvironmentKey::new(&runner, &system, Uuid::from_u128(uuid));
            for (k, v) in fields {
                if k != "env" {
                    key.fields.insert(k, v);
                }
            }
            key
        })
}

fn key_seeds() -> Vec<String> {
    let id = Uuid::from_u128(0x0b6e1f52_3c1d_4b8e_9a51_7f2d4f0d9c11);
    vec![
        EnvironmentKey::new("42", "s_0123456789ab", id)
            .with_field("provider", "ec2")
            .with_field("instance", "i-0abc")
            .with_field("region", "eu-west-1")
            .encode(),
        EnvironmentKey::new("7", "r_abc/def 100%", id)
            .with_field("provider", "ssh")
            .with_field("host", "build-1")
            .encode(),
        EnvironmentKey::new("1", "s_x", id)
            .with_field("provider", "local")
            .encode(),
    ]
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn fuzz_key_decoder(text in text_from(key_seeds(), KEY_TOKENS)) {
        match EnvironmentKey::parse(&text) {
            Ok(key) => {
                // What parses re-encodes to the same key (if short enough to parse again).
                let again = key.encode();
                if again.len() <= MAX_KEY_LEN {
                    prop_assert_eq!(EnvironmentKey::parse(&again), Ok(key));
                }
            }
            Err(e) => assert_brief(&e.to_string(), &text),
        }
    }

    #[test]
    fn fuzz_key_round_trip(key in valid_key()) {
        let text = key.encode();
        prop_assert_eq!(text.matches('/').count(), 2, "only the two separators are raw slashes: {}", text);
        if text.len() <= MAX_KEY_LEN {
            prop_assert_eq!(EnvironmentKey::parse(&text), Ok(key));
        } else {
            prop_assert!(EnvironmentKey::parse(&text).is_err());
        }
    }
}

// ---------------------------------------------------------------- job payload

const SECRET: &str = "glcbt-FUZZ-SECRET-0123456789";

const JSON_TOKENS: &[&str] = &[
    "{",
    "}",
    "[",
    "]",
    ",",
    ":",
    "\"",
    "null",
    "true",
    "false",
    "-1",
    "1e400",
    "0.5",
    "18446744073709551616",
    "\\u0000",
    "\\",
    "\"suspend_options\":",
    "\"id\":",
    "[true]",
    "é",
];

fn payload_seeds() -> Vec<Value> {
    let vars = json!([
        {"key": "CI_JOB_ID", "value": "77", "public": true},
        {"key": "CI_RUNNER_ID", "value": "12", "public": true},
        {"key": "CI_JOB_TOKEN", "value": SECRET, "public": false, "masked": true},
    ]);
    let full = json!({
        "id": 77, "token": SECRET,
        "job_info": {"name": "t", "stage": "test", "project_id": 5, "project_full_path": "g/p"},
        "git_info": {"repo_url": format!("https://gitlab-ci-token:{SECRET}@example.invalid/x.git")},
        "runner_info": {"timeout": 3600},
        "variables": vars,
        "image": {"name": "debian:12"},
        "steps": [{"name": "script", "script": ["echo hi"], "timeout": 3600}],
        "suspend_options": {"suspend_on_success": true, "suspend_on_failure": false,
                            "runtime_environment_key": "42/s_x/env=0b6e1f52-3c1d-4b8e-9a51-7f2d4f0d9c11",
                            "environment_key": null},
    });
    let mut no_options = full.clone();
    no_options["suspend_options"] = Value::Null;
    vec![
        full,
        no_options,
        json!({"id": 1, "job_info": {"project_id": 2}}),
        json!({}),
    ]
}

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_map(Value::from),
        prop_oneof![
            any::<String>(),
            prop::sample::select(vec!["true", "1", "yes", "", "12", "42/s_x/env=1", SECRET])
                .prop_map(str::to_string),
        ]
        .prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 16, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map(
                prop_oneof![
                    prop::sample::select(vec![
                        "id",
                        "key",
                        "value",
                        "name",
                        "project_id",
                        "suspend_on_success",
                        "runtime_environment_key",
                    ])
                    .prop_map(str::to_string),
                    any::<String>(),
                ],
                inner,
                0..4
            )
            .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// JSON pointers of every value in `v`, the root ("") included.
fn pointers(v: &Value, at: String, out: &mut Vec<String>) {
    match v {
        Value::Array(a) => a
            .iter()
            .enumerate()
            .for_each(|(i, x)| pointers(x, format!("{at}/{i}"), out)),
        Value::Object(m) => m.iter().for_each(|(k, x)| {
            pointers(
                x,
                format!("{at}/{}", k.replace('~', "~0").replace('/', "~1")),
                out,
            )
        }),
        _ => {}
    }
    out.push(at);
}

/// A valid payload with up to three values replaced by random ones, then byte edits.
fn payload_text() -> impl Strategy<Value = String> {
    let structured = (
        prop::sample::select(payload_seeds()),
        prop::collection::vec((any::<usize>(), json_value()), 0..3),
        few_edits(),
    )
        .prop_map(|(mut seed, swaps, e)| {
            for (pick, value) in swaps {
                let mut all = Vec::new();
                pointers(&seed, String::new(), &mut all);
                let ptr = &all[pick % all.len()];
                if let Some(slot) = seed.pointer_mut(ptr) {
                    *slot = value;
                }
            }
            mutate(&seed.to_string(), &e, JSON_TOKENS)
        });
    prop_oneof![
        1 => text_from(payload_seeds().iter().map(Value::to_string).collect(), JSON_TOKENS),
        3 => structured,
    ]
}

/// Job variables a payload falls back on (the suspend triggers, the key) and
/// the ids it must never take from them.
fn job_vars() -> impl Strategy<Value = Job> {
    let names = prop::sample::select(vec![
        "DORMANT_SUSPEND_ON_SUCCESS",
        "DORMANT_SUSPEND_ON_FAILURE",
        "DORMANT_ENVIRONMENT_KEY",
        "CI_SUSPEND_ON_SUCCESS",
        "CI_SUSPEND_ON_FAILURE",
        "CI_SUSPENDABLE_ENVIRONMENT_RESUME_KEY",
        "CI_JOB_ID",
        "CI_PROJECT_ID",
    ]);
    let values = prop_oneof![
        prop::sample::select(vec!["true", "no", "7", " 8 ", "", "maybe"]).prop_map(str::to_string),
        any::<String>(),
        "y{300,1000}",
    ];
    prop::collection::vec((names, values), 0..4).prop_map(|vars| {
        Job::from_map(
            vars.into_iter()
                .map(|(k, v)| (format!("CUSTOM_ENV_{k}"), v)),
        )
    })
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn fuzz_payload_reader(text in payload_text(), job in job_vars()) {
        match JobInput::from_payload(&text, &job) {
            Ok(input) => {
                // Only a JSON object is accepted.
                let parsed: Value = serde_json::from_str(&text).expect("accepted text is JSON");
                prop_assert!(parsed.is_object(), "accepted a non-object: {}", text);
                // A bad trigger variable is kept for prepare to refuse: briefly.
                for msg in input.suspend.invalid.iter().chain(&input.suspend.overridden) {
                    assert_brief(msg, &text);
                    prop_assert!(!msg.contains(SECRET), "a message quotes the payload's secret: {}", msg);
                }
            }
            Err(e) => {
                let msg = format!("{e:#}");
                assert_brief(&msg, &text);
                prop_assert!(!msg.contains(SECRET), "a message quotes the payload's secret: {}", msg);
            }
        }
    }
}

// ---------------------------------------------------------------- settings

const TOML_TOKENS: &[&str] = &[
    "=",
    "\"",
    "'",
    "[",
    "]",
    "[[ssh.hosts]]",
    "[ec2]",
    "\n",
    "#",
    "\"\"\"",
    "{",
    "}",
    ",",
    ".",
    "18446744073709551615",
    "200000000000000d",
    "\"0s\"",
    "\\u",
    "\\",
    "\u{0}",
    "é",
    "-",
];

fn settings_seeds() -> Vec<String> {
    vec![
        include_str!("../examples/dormant.toml").to_string(),
        "provider = \"ssh\"\n[ssh]\nworkspace_root = \"/srv/ws\"\nslot_wait = \"1m\"\n\
         [[ssh.hosts]]\nname = \"b1\"\naddress = \"10.0.0.5\"\nuser = \"ci\"\n\
         identity_file = \"/etc/dormant/id\"\nslots = 3\n"
            .into(),
        "provider = \"ec2\"\nprepare_timeout = \"20m\"\n[suspend]\nttl = \"30d\"\n\
         cleanup_sweep_budget = \"0s\"\n[ec2]\nsubnet_id = \"subnet-1\"\nimage = \"debian-12-*\"\n\
         image_owners = [\"self\"]\nsuspend_mode = \"hibernate\"\nroot_volume_encrypted = true\n\
         root_volume_size_gb = 30\nprepare_timeout = \"5m\"\ntags = { team = \"ci\" }\n"
            .into(),
        String::new(),
    ]
}

fn toml_value() -> impl Strategy<Value = toml::Value> {
    let leaf = prop_oneof![
        prop::sample::select(vec![
            "0s",
            "1s",
            "24h",
            "86401s",
            "365d",
            "366d",
            "18446744073709551615s",
            "200000000000000d",
            "99999999999999999999d",
            "",
            "-1s",
            "1.5h",
            "ssh",
            "ec2",
            "local",
            "gcp",
            "/abs",
            "rel",
            "ami-0abc",
            "debian-*",
            "hibernate",
            "public",
            "127.0.0.1:22",
            "a/b",
        ])
        .prop_map(|s| toml::Value::String(s.into())),
        any::<String>().prop_map(toml::Value::String),
        any::<i64>().prop_map(toml::Value::Integer),
        any::<f64>().prop_map(toml::Value::Float),
        any::<bool>().prop_map(toml::Value::Boolean),
    ];
    leaf.prop_recursive(2, 8, 3, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..3).prop_map(toml::Value::Array),
            prop::collection::btree_map("[a-z_]{1,12}", inner, 0..3)
                .prop_map(|m| toml::Value::Table(m.into_iter().collect())),
        ]
    })
}

/// Paths (`["ssh", "hosts", "0", "port"]`) of every value in a TOML tree.
fn toml_paths(v: &toml::Value, at: Vec<String>, out: &mut Vec<Vec<String>>) {
    match v {
        toml::Value::Table(t) => t.iter().for_each(|(k, x)| {
            let mut p = at.clone();
            p.push(k.clone());
            toml_paths(x, p, out)
        }),
        toml::Value::Array(a) => a.iter().enumerate().for_each(|(i, x)| {
            let mut p = at.clone();
            p.push(i.to_string());
            toml_paths(x, p, out)
        }),
        _ => {}
    }
    out.push(at);
}

fn toml_slot<'a>(v: &'a mut toml::Value, path: &[String]) -> Option<&'a mut toml::Value> {
    path.iter().try_fold(v, |v, part| match v {
        toml::Value::Table(t) => t.get_mut(part),
        toml::Value::Array(a) => a.get_mut(part.parse::<usize>().ok()?),
        _ => None,
    })
}

/// A valid settings file with values replaced (or keys added) at random, then byte edits.
fn settings_text() -> impl Strategy<Value = String> {
    let trees: Vec<toml::Value> = settings_seeds()
        .iter()
        .map(|s| toml::Value::Table(s.parse::<toml::Table>().expect("seed parses")))
        .collect();
    let known = prop::sample::select(vec![
        "prepare_timeout",
        "ttl",
        "cleanup_sweep_budget",
        "connect_timeout",
        "slot_wait",
        "image_cache_ttl",
        "provider",
        "runner_id",
        "state_dir",
        "hosts",
        "suspend",
        "ssh",
        "ec2",
        "enabled",
        "port",
        "slots",
        "colour",
    ]);
    let structured = (
        prop::sample::select(trees),
        prop::collection::vec((any::<usize>(), any::<bool>(), known, toml_value()), 1..4),
        few_edits(),
    )
        .prop_map(|(mut tree, swaps, e)| {
            for (pick, add, name, value) in swaps {
                let mut all = Vec::new();
                toml_paths(&tree, Vec::new(), &mut all);
                let path = all[pick % all.len()].clone();
                if let Some(slot) = toml_slot(&mut tree, &path) {
                    match slot {
                        toml::Value::Table(t) if add => {
                            t.insert(name.to_string(), value);
                        }
                        _ if path.is_empty() => {}
                        _ => *slot = value,
                    }
                }
            }
            let text = toml::to_string(&tree).unwrap_or_default();
            mutate(&text, &e, TOML_TOKENS)
        });
    prop_oneof![
        1 => text_from(settings_seeds(), TOML_TOKENS),
        3 => structured,
    ]
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn fuzz_settings_parser(text in settings_text()) {
        match Settings::parse_str(&text) {
            Ok(settings) => {
                // Every accepted duration is within its bound and fits the clock.
                for (key, value) in settings.durations() {
                    let Some(value) = value else { continue };
                    let bound = DURATION_BOUNDS.iter().find(|b| b.key == key).expect("bounded");
                    prop_assert!(value <= bound.max, "{} = {} accepted", key, value);
                    prop_assert!(Instant::now().checked_add(value.get()).is_some());
                }
                prop_assert!(settings.prepare_timeout.get() > Duration::ZERO);
            }
            Err(e) => assert_brief(&format!("{e:#}"), &text),
        }
    }
}
