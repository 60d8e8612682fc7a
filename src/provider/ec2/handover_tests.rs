//! The hand-over tags read back, and the boot hook run for real (`/bin/sh`)
//! against a loopback stand-in for the instance metadata service.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use super::*;

const ED: &str = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIJb5kG0r9Yd7m1t8j1oT0p9H2l9mX0c6w2k8b0a1c2d3";

fn tags(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[test]
fn the_pinned_host_key_is_the_key_of_the_one_known_hosts_line() {
    let line = format!("dormant-9b2c {ED}\n");
    assert_eq!(pinned_host_key(&line).as_deref(), Some(ED));
    assert_eq!(pinned_host_key(""), None);
    assert_eq!(pinned_host_key(&format!("{line}{line}")), None, "two pins");
    let rsa = format!("dormant-9b2c ssh-rsa {}\n", "A".repeat(544));
    assert_eq!(pinned_host_key(&rsa), None, "too long for a tag");
    assert_eq!(pinned_host_key("dormant-9b2c ssh-ed25519 AA$(x)\n"), None);
}

#[test]
fn only_an_ed25519_key_line_goes_into_the_authorized_key_tag() {
    assert_eq!(
        authorized_key_tag(&format!("{ED} dormant-env\n")),
        Some(format!("{ED} dormant-env"))
    );
    assert_eq!(authorized_key_tag("ssh-rsa AAAAB3 x"), None);
    assert_eq!(authorized_key_tag(&format!("command=\"sh\" {ED}")), None);
    assert_eq!(authorized_key_tag(&format!("{ED}\n{ED}")), None);
}

#[test]
fn an_instance_without_the_entry_or_the_host_key_is_not_enterable() {
    let ok = tags(&[(tag::ENTRY, tag::ENTRY_IMDS_KEY), (tag::HOST_KEY, ED)]);
    assert_eq!(
        entry(&ok),
        Ok(Entry {
            host_key: ED.to_string()
        })
    );
    let old = entry(&tags(&[(tag::HOST_KEY, ED)])).unwrap_err();
    assert!(
        old.contains("made before dormant could hand environments over"),
        "{old}"
    );
    let unknown = entry(&tags(&[(tag::ENTRY, "v9"), (tag::HOST_KEY, ED)])).unwrap_err();
    assert!(unknown.contains("\"v9\""), "{unknown}");
    let unpinned = entry(&tags(&[(tag::ENTRY, tag::ENTRY_IMDS_KEY)])).unwrap_err();
    assert!(unpinned.contains("no dormant:host-key tag"), "{unpinned}");
    let bad = entry(&tags(&[
        (tag::ENTRY, tag::ENTRY_IMDS_KEY),
        (tag::HOST_KEY, "not a key"),
    ]))
    .unwrap_err();
    assert!(bad.contains("not one SSH public key"), "{bad}");
}

#[test]
fn number_tags_parse_or_say_which_tag_is_bad() {
    assert_eq!(number(&tags(&[]), tag::EPOCH), Ok(None));
    assert_eq!(number(&tags(&[(tag::EPOCH, "3")]), tag::EPOCH), Ok(Some(3)));
    let e = number(
        &tags(&[(tag::SUSPENDED_AT, "yesterday")]),
        tag::SUSPENDED_AT,
    )
    .unwrap_err();
    assert!(
        e.contains("dormant:suspended-at") && e.contains("\"yesterday\""),
        "{e}"
    );
}

#[test]
fn the_boot_hook_is_one_bootcmd_entry_of_the_cloud_config() {
    let doc = format!("#cloud-config\n{}", boot_hook_yaml("admin"));
    let out = std::process::Command::new("python3")
        .args([
            "-c",
            "import sys, yaml; d = yaml.safe_load(sys.stdin); \
             assert list(d) == ['bootcmd'] and len(d['bootcmd']) == 1; sys.stdout.write(d['bootcmd'][0])",
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            c.stdin.take().unwrap().write_all(doc.as_bytes())?;
            c.wait_with_output()
        })
        .expect("python3 with PyYAML parses the user-data (scripts/install-test-deps.sh)");
    assert!(out.status.success(), "{doc}\n{out:?}");
    assert_eq!(
        String::from_utf8(out.stdout).unwrap(),
        boot_hook("admin", IMDS)
    );
}

/// A loopback stand-in for IMDSv2: a token for a PUT with a TTL header, the
/// tag (or 404 without one) for a GET that carries that token, 401 else.
fn imds(tag_value: Option<&'static str>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            let mut reader = BufReader::new(conn.try_clone().unwrap());
            let mut first = String::new();
            reader.read_line(&mut first).unwrap();
            let mut headers = Vec::new();
            loop {
                let mut h = String::new();
                reader.read_line(&mut h).unwrap();
                if h.trim().is_empty() {
                    break;
                }
                headers.push(h.trim().to_ascii_lowercase());
            }
            let has = |h: &str| headers.iter().any(|x| x == h);
            let (status, body) = if first.starts_with("PUT /latest/api/token ")
                && has("x-aws-ec2-metadata-token-ttl-seconds: 60")
            {
                ("200 OK", "tok-1".to_string())
            } else if first.starts_with(&format!(
                "GET /latest/meta-data/tags/instance/{} ",
                tag::AUTHORIZED_KEY
            )) && has("x-aws-ec2-metadata-token: tok-1")
            {
                match tag_value {
                    Some(v) => ("200 OK", v.to_string()),
                    None => ("404 Not Found", String::new()),
                }
            } else {
                ("401 Unauthorized", String::new())
            };
            let _ = write!(
                conn,
                "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    url
}

/// Runs the hook for `root` with `getent` answering `home` (or nothing).
fn run_hook(dir: &Path, home: Option<&Path>, imds_url: &str) {
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let getent = bin.join("getent");
    let answer = match home {
        Some(h) => format!("echo 'root:x:0:0:root:{}:/bin/sh'", h.display()),
        None => "exit 2".to_string(),
    };
    std::fs::write(&getent, format!("#!/bin/sh\n{answer}\n")).unwrap();
    std::fs::set_permissions(&getent, std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = std::process::Command::new("/bin/sh")
        .arg("-c")
        .arg(boot_hook("root", imds_url))
        .env(
            "PATH",
            format!("{}:{}", bin.display(), std::env::var("PATH").unwrap()),
        )
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
}

#[test]
fn the_boot_hook_makes_the_tag_the_one_authorized_key() {
    let dir = tempfile::tempdir().unwrap();
    let home = dir.path().join("home");
    std::fs::create_dir_all(home.join(".ssh")).unwrap();
    let keys = home.join(".ssh/authorized_keys");
    std::fs::write(&keys, "ssh-ed25519 AAAAold old-host\n").unwrap();

    run_hook(
        dir.path(),
        Some(&home),
        &imds(Some("ssh-ed25519 AAAAnew new-host")),
    );
    assert_eq!(
        std::fs::read_to_string(&keys).unwrap(),
        "ssh-ed25519 AAAAnew new-host\n"
    );
    assert_eq!(
        std::fs::metadata(&keys).unwrap().permissions().mode() & 0o777,
        0o600
    );
}

#[test]
fn the_boot_hook_leaves_the_keys_alone_without_a_usable_tag() {
    let dir = tempfile::tempdir().unwrap();
    let home = dir.path().join("home");
    std::fs::create_dir_all(home.join(".ssh")).unwrap();
    let keys = home.join(".ssh/authorized_keys");
    let old = "ssh-ed25519 AAAAold old-host\n";
    for tag_value in [
        None,
        Some("ssh-rsa AAAAB3 not-ed25519"),
        Some("command=\"sh\" ssh-ed25519 AAAA x"),
        Some("ssh-ed25519 AAAA a\nssh-ed25519 AAAA b"),
    ] {
        std::fs::write(&keys, old).unwrap();
        run_hook(dir.path(), Some(&home), &imds(tag_value));
        assert_eq!(
            std::fs::read_to_string(&keys).unwrap(),
            old,
            "{tag_value:?}"
        );
    }
    // No metadata service at all (a closed port).
    let closed = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    run_hook(dir.path(), Some(&home), &closed);
    assert_eq!(std::fs::read_to_string(&keys).unwrap(), old);
    // The first boot: no user yet, nothing written anywhere.
    run_hook(dir.path(), None, &imds(Some("ssh-ed25519 AAAAnew x")));
    assert_eq!(std::fs::read_to_string(&keys).unwrap(), old);
    let mut left: Vec<_> = std::fs::read_dir(home.join(".ssh"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    left.sort();
    assert_eq!(left, ["authorized_keys"]);
}

#[test]
fn a_record_acts_only_with_the_epoch_the_tags_carry() {
    // Made with epochs: equal or refused.
    assert!(epoch_matches(Some("1"), Some("1")));
    assert!(epoch_matches(Some("3"), Some("3")));
    assert!(!epoch_matches(Some("1"), Some("2")), "taken over since");
    assert!(!epoch_matches(Some("2"), None));
    // Made before epochs (or a volume's record from its creation): only
    // while nobody took it over.
    assert!(epoch_matches(None, None));
    assert!(epoch_matches(None, Some("1")));
    assert!(!epoch_matches(None, Some("2")));
    // A take-over always lands above the first epoch, whatever it found.
    assert_eq!(next_epoch(0), 2);
    assert_eq!(next_epoch(1), 2);
    assert_eq!(next_epoch(2), 3);
    assert!(!epoch_matches(None, Some(&next_epoch(0).to_string())));
}

#[test]
fn two_hosts_that_wrote_the_same_epoch_number_do_not_both_match() {
    let (a, b) = (new_owner_id(), new_owner_id());
    assert_ne!(a, b);
    let (va, vb) = (epoch_value(2, &a), epoch_value(2, &b));
    assert_eq!(epoch_number(&va), Some(2));
    assert_eq!(epoch_owner(&va), Some(a.as_str()));
    assert_eq!(epoch_number("7"), Some(7));
    assert_eq!(epoch_owner("7"), None);
    assert_eq!(epoch_number("x/y"), None);
    // The tag kept b's write: only b's record may act.
    assert!(epoch_matches(Some(&vb), Some(&vb)));
    assert!(
        !epoch_matches(Some(&va), Some(&vb)),
        "the same number, another owner"
    );
    assert!(
        !epoch_matches(Some("2"), Some(&vb)),
        "a number alone is not the owner's"
    );
    assert!(!epoch_matches(Some(&va), Some("2")));
    assert!(
        !epoch_matches(None, Some(&vb)),
        "taken over: above the first epoch"
    );
    // Values written before owner ids still match themselves.
    assert!(epoch_matches(Some(" 3"), Some("3")));
}
