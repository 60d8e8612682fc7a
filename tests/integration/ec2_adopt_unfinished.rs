//! `dormant adopt` failing after its tag write was sent (issue 30 item 7:
//! no cloud change without its record): the read-back of the epoch tag
//! fails (DescribeInstances answering 503 past dormant's retries), or the
//! unreadable record cannot be moved aside (`quarantine` in the state dir is
//! a file). Either way the run fails naming the instance and what to run,
//! the key whose public half the tag now holds is kept (in
//! `adopting/<id>/`, beside the epoch it wrote), and the next run, once the
//! cause is gone, finishes that take-over: no second tag write, and the
//! record it writes carries the epoch and key the tags carry, so the key
//! printed before the loss resumes it.
//!
//! Moto behind the test proxy (which injects the errors), the loopback sshd
//! for every instance.

use std::process::Output;

use crate::ec2_adopt::{adopt, resume_finds_the_file, suspend_one};
use crate::ec2_rig::{instance_tags, key_field, Ec2Env};

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

const DAMAGED: &[u8] = b"{\"v\": 2, \"id\": \"trunc";

#[test]
fn an_adopt_failing_after_its_tag_write_is_finished_by_the_next_run() {
    let env = Ec2Env::start();
    let settings = env.settings(&env.connect_address(), "");
    for (case, system) in [
        ("read-back fails", "s_0000000000c1"),
        ("quarantine fails", "s_0000000000c2"),
    ] {
        let old = env.rig("7", system, &settings);
        let key = suspend_one(&old);
        let instance = key_field(&key, "instance").unwrap();
        let env_id = dormant::envkey::EnvironmentKey::parse(&key).unwrap().env_id;
        let new = env.rig("7", system, &settings);
        let before = instance_tags(&env, &instance);
        if case == "read-back fails" {
            // The region's listing and the check before the write pass; the
            // read-back after it fails, every attempt.
            env.proxy
                .fail("DescribeInstances", 2, 1000, 503, "Unavailable");
        } else {
            // A copy of the old host's directory with a damaged record, and
            // no way to make `quarantine/`.
            let dir = new.state_dir.join("environments").join(env_id.to_string());
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("record.json"), DAMAGED).unwrap();
            std::fs::write(new.state_dir.join("quarantine"), b"in the way").unwrap();
        }
        let out = new.dormant(&["adopt"]);
        env.proxy.clear_faults();
        let t = text(&out);
        assert_eq!(out.status.code(), Some(2), "{case}: {t}");
        let written = instance_tags(&env, &instance);
        let epoch = written.get("dormant:epoch").cloned();
        assert_ne!(
            epoch,
            before.get("dormant:epoch").cloned(),
            "{case}: the failure came after the tag write: {t}"
        );
        let staged = new.state_dir.join("adopting").join(env_id.to_string());
        // It says what happened: the instance, the change sent, where it is
        // kept, what to run.
        assert!(
            t.contains(&instance)
                && t.contains("its take-over was sent to EC2")
                && t.contains(&staged.display().to_string())
                && t.contains("run `dormant adopt` again"),
            "{case}: {t}"
        );
        let record = new.env_dir(&key).join("record.json");
        if case == "quarantine fails" {
            assert_eq!(
                std::fs::read(&record).unwrap(),
                DAMAGED,
                "{case}: left as it was"
            );
        } else {
            assert!(!record.exists(), "{case}");
        }
        // The tags and what this host holds agree: the key the tag names is
        // kept, beside the epoch it wrote.
        let public = std::fs::read_to_string(staged.join("id_ed25519.pub"))
            .unwrap_or_else(|e| panic!("{case}: the new key was not kept: {e}: {t}"));
        assert_eq!(
            written.get("dormant:authorized-key").map(String::as_str),
            Some(public.trim()),
            "{case}"
        );
        let intent = std::fs::read_to_string(staged.join("intent.json")).unwrap();
        assert!(
            intent.contains(epoch.as_deref().unwrap()),
            "{case}: {intent}"
        );

        if case == "quarantine fails" {
            std::fs::remove_file(new.state_dir.join("quarantine")).unwrap();
        }
        let writes = env.proxy.count("CreateTags");
        let again = adopt(&new);
        assert!(
            again.contains("finishing the take-over of")
                && again.contains("adopted 1, left alone 0"),
            "{case}: {again}"
        );
        assert_eq!(
            env.proxy.count("CreateTags"),
            writes,
            "{case}: finished without a second tag write"
        );
        assert_eq!(instance_tags(&env, &instance), written, "{case}");
        let rec = new
            .record(&key)
            .unwrap_or_else(|| panic!("{case}: {again}"));
        assert_eq!(rec["status"], "suspended", "{case}: {rec}");
        assert_eq!(
            rec["machine"]["fields"]["epoch"].as_str(),
            epoch.as_deref(),
            "{case}: {rec}"
        );
        let recorded = std::fs::read_to_string(new.env_dir(&key).join("id_ed25519.pub")).unwrap();
        assert_eq!(recorded, public, "{case}: the record's key is the tag's");
        assert!(!new.env_dir(&key).join("intent.json").exists(), "{case}");
        assert!(!staged.exists(), "{case}");
        if case == "quarantine fails" {
            let kept = std::fs::read_dir(new.state_dir.join("quarantine"))
                .unwrap()
                .count();
            assert_eq!(kept, 1, "{case}: the unreadable record is kept aside");
        }
        assert!(
            adopt(&new).contains("adopted 0, left alone 1"),
            "{case}: once"
        );
        resume_finds_the_file(&new, &key);
    }
}
