//! `dormant adopt` SIGKILLed at every step of a take-over (`adopt:staged`
//! before the tag write, `adopt:tagged` before the record, `adopt:recorded`
//! after it), then run again: every environment ends with exactly one
//! record whose ownership epoch is the one its tags carry (so it resumes),
//! a third run adopts nothing, and the machine-mode environment still
//! resumes with the key printed before the loss. Moto behind the proxy,
//! the loopback sshd for every instance, the guest seam for data volumes.

use crate::crash::arm;
use crate::ec2_adopt::{adopt, resume_finds_the_file, suspend_one, SYSTEM};
use crate::ec2_rig::instance_tags;
use crate::ec2_rig::{key_field, volume, Ec2Env};

use std::os::unix::process::ExitStatusExt;

#[test]
fn adopt_killed_at_every_step_then_run_again_takes_each_environment_over_once() {
    let env = Ec2Env::start();
    let settings = env.settings(&env.connect_address(), "");
    let machine_key = suspend_one(&env.rig("7", SYSTEM, &settings));
    let volume_key = suspend_one(&env.volume_rig("7", SYSTEM, &env.volume_settings("", "")));
    let instance = key_field(&machine_key, "instance").unwrap();
    let vol = key_field(&volume_key, "volume").unwrap();

    let mut last = None;
    for point in ["adopt:staged", "adopt:tagged", "adopt:recorded"] {
        // A new host each time (a fresh state dir), killed in its first take-over.
        let mut new = env.rig("7", SYSTEM, &settings);
        arm(&mut new, Some(point), false);
        let out = new.dormant(&["adopt"]);
        assert_eq!(out.status.signal(), Some(9), "{point}: {out:?}");
        arm(&mut new, None, false);
        let again = adopt(&new);
        let third = adopt(&new);
        assert!(
            third.contains("adopted 0, left alone 2"),
            "{point}: nothing adopted twice: {third}"
        );
        let m = new
            .record(&machine_key)
            .unwrap_or_else(|| panic!("{point}: {again}"));
        let v = new
            .record(&volume_key)
            .unwrap_or_else(|| panic!("{point}: {again}"));
        assert_eq!(
            (&m["status"], &v["status"]),
            (&"suspended".into(), &"suspended".into())
        );
        assert_eq!(m["key"], machine_key.as_str(), "{point}");
        assert_eq!(v["key"], volume_key.as_str(), "{point}");
        // The record's epoch is the tags': the record can act on it.
        let tags = instance_tags(&env, &instance);
        assert_eq!(
            m["machine"]["fields"]["epoch"].as_str(),
            tags.get("dormant:epoch").map(String::as_str),
            "{point}: {m}"
        );
        let public =
            std::fs::read_to_string(new.env_dir(&machine_key).join("id_ed25519.pub")).unwrap();
        assert_eq!(
            tags.get("dormant:authorized-key").map(String::as_str),
            Some(public.trim()),
            "{point}: the tag holds the key of the record that stands"
        );
        let vtag = volume(&env, &vol)
            .unwrap()
            .tags()
            .iter()
            .find(|t| t.key() == Some("dormant:epoch"))
            .and_then(|t| t.value().map(str::to_string));
        assert_eq!(
            v["volume"]["volume"]["fields"]["epoch"].as_str(),
            vtag.as_deref(),
            "{point}: {v}"
        );
        last = Some(new);
    }
    // Nothing lost: the last host resumes it with the key printed before the loss.
    resume_finds_the_file(last.as_ref().unwrap(), &machine_key);
}
