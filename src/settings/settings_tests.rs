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

#[test]
fn the_shipped_example_parses_and_names_every_top_level_setting() {
    let text = include_str!("../../examples/dormant.toml");
    let parsed = Settings::parse_str(text).unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(parsed.provider, ProviderKind::Local);
    for key in [
        "provider",
        "state_dir",
        "runner_id",
        "system_id",
        "runner_system_id_file",
        "prepare_timeout",
        "[suspend]",
        "enabled",
        "ttl",
        "cleanup_sweep_budget",
        "notify_command",
        "notify_timeout",
        "allow_job_request",
        "[events]",
        "max_file_size",
        "keep_files",
        "[local]",
        "shell",
        "[ssh]",
        "[ec2]",
        "[qemu]",
    ] {
        assert!(
            text.contains(key),
            "examples/dormant.toml does not document {key}"
        );
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
