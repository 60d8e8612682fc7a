//! The qemu provider with a real VM whose network goes away in the middle of
//! a stage: the guest's link is turned off through QEMU's monitor (QMP
//! `set_link`), as a flaky network or a host's network restart would do, and
//! back on once dormant's connection is surely lost. The script runs on in
//! the VM; `dormant run` re-attaches when the link is back; the job log has
//! every line once, in order, and the script's exit code. One boot.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::harness::*;
use crate::qemu::{env_paths, one_vm, qemu_pids, qemu_rig_full, NoVmLeft, USER};
use crate::reattach::assert_every_line_once;
use dormant::provider::qemu::qmp::Qmp;
use dormant::state::EnvPaths;

/// The guest file the script touches once it prints.
const STARTED: &str = "/tmp/dormant-test-started";

/// `line N` every 100 ms while the script watches its NIC's carrier (the
/// guest's side of `set_link`): once the link has gone down and come back,
/// ten more lines, an unfinished one, and `exit 3`. (A link that never
/// changes ends it with `exit 4` after 5 minutes: a failure, not a hang.)
fn script() -> String {
    format!(
        "nic=$(ls /sys/class/net | grep -vx lo | head -1); seen=0 more=10 i=0\n\
         while :; do\n\
         \x20 i=$((i+1)); echo \"line $i\"\n\
         \x20 [ $i -eq 3 ] && touch {STARTED}\n\
         \x20 c=; read -r c < /sys/class/net/$nic/carrier 2>/dev/null\n\
         \x20 case $seen:$c in 0:1) ;; 0:*) seen=1; echo \"link down seen at $i\";; 1:1) seen=2; echo \"link up seen at $i\";; esac\n\
         \x20 if [ $seen = 2 ]; then more=$((more-1)); [ $more -gt 0 ] || break; fi\n\
         \x20 [ $i -lt 3000 ] || {{ echo 'the link never went down and up'; exit 4; }}\n\
         \x20 sleep 0.1\n\
         done\n\
         printf 'the end, unfinished'; exit 3\n"
    )
}

/// Runs `remote` in the guest over a connection of the test's own (the
/// environment's key and pinned host key), to its end.
fn in_guest(env: &EnvPaths, remote: &str) -> std::process::Output {
    let record = std::fs::read_to_string(&env.record).unwrap();
    let port = record
        .split("\"port\"")
        .nth(1)
        .and_then(|rest| rest.split('"').nth(1))
        .unwrap_or_else(|| panic!("no port in {record}"))
        .to_string();
    Command::new("ssh")
        .args([
            "-F",
            "/dev/null",
            "-o",
            "IdentitiesOnly=yes",
            "-o",
            "BatchMode=yes",
        ])
        .arg("-i")
        .arg(&env.ssh_key)
        .arg("-o")
        .arg(format!("UserKnownHostsFile={}", env.known_hosts.display()))
        .args(["-o", "GlobalKnownHostsFile=/dev/null"])
        .args(["-o", "StrictHostKeyChecking=yes"])
        .arg("-o")
        .arg(format!("HostKeyAlias=dormant-{}", env.id))
        .args(["-p", &port, &format!("{USER}@127.0.0.1"), remote])
        .output()
        .unwrap()
}

/// dormant's SSH masters for this environment (their command lines name its
/// control directory): this test's own, never another ssh on the machine.
fn masters(env: &EnvPaths) -> Vec<i32> {
    let dir = env.control_dir.display().to_string();
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
                let text = String::from_utf8_lossy(&c).replace('\0', " ");
                text.starts_with("ssh ") && text.contains(&dir)
            }) && process_running(*pid)
        })
        .collect()
}

/// The VM's network link up or down (both ends: the NIC sees its carrier go).
fn set_link(env: &EnvPaths, up: bool) {
    let mut qmp = Qmp::connect(&env.dir.join("vm/qmp.sock")).unwrap();
    qmp.execute(
        "set_link",
        Some(serde_json::json!({ "name": "net0", "up": up })),
    )
    .unwrap();
}

#[track_caller]
fn wait_until(what: &str, limit: Duration, done: impl Fn() -> bool) {
    let t = Instant::now();
    while !done() {
        assert!(t.elapsed() < limit, "waited {limit:?} for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_stage_survives_the_vms_network_going_away_for_seconds() {
    let _one = one_vm();
    // Keepalives every 2 s: the master gives the connection up after ~6 s
    // without answers, well inside the link's time off.
    let rig = qemu_rig_full("shutdown", "server_alive_interval = \"2s\"\n", "");
    let j = job(96).script(&script());
    let env = env_paths(&rig, &j);
    let _no_vm = NoVmLeft(env.clone());
    let building = rig.dir.path().join("building");
    let r = std::thread::scope(|s| {
        let run = s.spawn(|| {
            rig.runner
                .run_job_with(&j, &mut |stage| {
                    if stage == "build_script" {
                        std::fs::write(&building, "").unwrap();
                    }
                })
                .unwrap()
        });
        wait_until("the job's build_script", Duration::from_secs(600), || {
            building.exists() || run.is_finished()
        });
        if run.is_finished() {
            return run.join().unwrap();
        }
        // The script runs and prints (one login of the test's own, which
        // waits in the guest: no polling over the network).
        let out = in_guest(
            &env,
            &format!("for i in $(seq 600); do [ -e {STARTED} ] && exit 0; sleep 0.2; done; exit 1"),
        );
        assert!(out.status.success(), "the script never started: {out:?}");
        let before = masters(&env);
        assert!(!before.is_empty(), "dormant's master for the stage");
        set_link(&env, false);
        let down = Instant::now();
        // Until dormant's connection is surely gone (its master gave up),
        // and at least 10 s.
        wait_until(
            "the master to notice the lost connection",
            Duration::from_secs(120),
            || before.iter().all(|p| !process_running(*p)),
        );
        std::thread::sleep(Duration::from_secs(10).saturating_sub(down.elapsed()));
        set_link(&env, true);
        run.join().unwrap()
    });
    assert_result(&r, JobResult::BuildFailure(Some(3)));
    let build = r.call("build_script").unwrap();
    let n = build
        .output
        .lines()
        .filter(|l| l.starts_with("line "))
        .count() as u32;
    assert_every_line_once(&build.output, n, 1);
    // It ran on in the VM while dormant was away: it saw the link go and come.
    for seen in ["link down seen at", "link up seen at"] {
        assert!(
            build.output.lines().any(|l| l.starts_with(seen)),
            "{seen}:\n{}",
            build.output
        );
    }
    assert!(qemu_pids(&env).is_empty(), "{}", r.cleanup_output());
    assert!(!Path::new(&env.dir).exists(), "released");
}
