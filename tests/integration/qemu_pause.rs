//! Pausing a job on qemu in `hibernate` mode (issue 31, docs/pause.md), one
//! boot: a script that asks (`dormant-ask`) ends its job's stage
//! successfully, cleanup hibernates the VM with the script waiting in its
//! memory, and a later job that restored it (its clock set forward past the
//! time it was hibernated) answers with `dormant-continue`: the same
//! process, a value only its memory held, the answer byte for byte, nothing
//! before the ask run again, the script's exit code carried; the resuming
//! job has no trigger, so the environment is released and nothing is left.
//! The same boot then has a second round paused from the host: the
//! resuming job keeps the environment (it suspends on failure), a third job
//! runs a counter that `dormant pause JOB_ID` freezes mid-run, the VM
//! hibernates again with it frozen, and a fourth job's `dormant-continue`
//! wakes it: every line exactly once across the two logs, its exit code
//! carried; that job keeps it (suspends on failure), and a hot round
//! follows on the same boot (`hot_round`): a continue within the hot window
//! takes the running VM, the window's end hibernates it without a job, and
//! a cold continue restores the same process, which asks again and stays
//! hot; then a new job that needs the one slot (`max_environments = 1`)
//! hibernates it rather than waiting (`give_way_round`: refused for its
//! image right after, it boots nothing), and a last continue restores the
//! same process, which asks again and stays hot; with the settings switched
//! to `suspend_mode = "shutdown"` a job needing the slot ends that window
//! by powering the VM off, the record says the paused script was lost
//! (`lost_round`), and the environment is released: nothing is left. The
//! protocol's other cases are on the ssh provider (`pause.rs`,
//! `pause_host.rs`).

use std::time::{Duration, Instant};

use crate::harness::*;
use crate::pause_host::{numbers, text};
use crate::qemu::{env_paths, field, one_vm, qemu_pids, qemu_rig_full};

#[test]
fn qemu_hibernate_keeps_a_paused_script_and_a_resumed_job_continues_it() {
    let _one = one_vm();
    let rig = qemu_rig_full("hibernate", "", "");
    // No trigger: the ask alone keeps the environment. The value is only in
    // the script's memory; /tmp/runs counts the runs of what precedes the ask.
    let first = job(98).script(
        "v=$RANDOM$RANDOM; echo \"value-in-memory $v\"; echo \"script-pid $BASHPID\"; \
         echo before-the-ask >> /tmp/runs; echo 'line before'; a=$(dormant-ask 'Deploy to prod?'); \
         echo \"answer=[$a] v=$v pid=$BASHPID runs=$(wc -l < /tmp/runs)\"; exit 7",
    );
    let env = env_paths(&rig, &first);
    let r = rig.run(&first);
    assert_result(&r, JobResult::Success);
    let key = r.key.clone().expect("the ask suspends the environment");
    let log = r.log();
    assert!(
        log.lines()
            .any(|l| l == format!("dormant-ask: paused key={key} question=\"Deploy to prod?\"")),
        "the job log shows the question and the key on one line:\n{log}"
    );
    assert!(!log.contains("answer="), "{log}");
    assert_eq!(rig.status(&key).as_deref(), Some("suspended"));
    assert!(
        r.cleanup_output().contains("hibernated"),
        "{}",
        r.cleanup_output()
    );
    assert!(qemu_pids(&env).is_empty(), "hibernation quits QEMU");
    let value = field(&log, "value-in-memory");
    let pid = field(&log, "script-pid");

    // Long enough that the restored guest's clock jumps forward.
    std::thread::sleep(Duration::from_secs(30));

    // Suspends on failure (exit 7): the host round below runs on this boot.
    let second = job(98)
        .resume(&key)
        .suspend_on(false, true)
        .script("dormant-continue \"$(printf 'yes\\n second line')\"");
    let r2 = rig.run(&second);
    let log2 = r2.log();
    assert_result(&r2, JobResult::BuildFailure(Some(7)));
    assert!(log2.contains("restored"), "{log2}");
    assert!(log2.contains("guest clock set from its RTC"), "{log2}");
    assert!(
        log2.contains(&format!(
            "answer=[yes\n second line] v={value} pid={pid} runs=1\n"
        )),
        "the answer byte for byte, the value the process held in memory, the \
         same process, nothing before the ask run again:\n{log2}"
    );
    assert!(!log2.contains("line before"), "nothing twice:\n{log2}");
    assert_eq!(rig.status(&key).as_deref(), Some("suspended"));
    assert!(qemu_pids(&env).is_empty(), "hibernated again");

    // The host round: a counter (it gives up by itself after ~300 s, so a
    // pause that never lands cannot hang the test), paused by its job id as
    // soon as it runs its script (until then `dormant pause` refuses: 3 not
    // found, 5 no job, 8 not in a script).
    let third = job(98).resume(&key).script(
        "i=0; while :; do i=$((i+1)); echo \"line $i\"; [ -e /tmp/release ] && break; \
         [ $i -ge 3000 ] && break; sleep 0.1; done; echo end; exit 3",
    );
    let third_id = third.id.to_string();
    let r3 = std::thread::scope(|s| {
        let running = s.spawn(|| rig.run(&third));
        let deadline = Instant::now() + Duration::from_secs(600);
        loop {
            let out = rig.dormant(&["pause", &third_id, "--reason", "host round"]);
            if out.status.success() {
                break;
            }
            let code = out.status.code();
            assert!(
                matches!(code, Some(3 | 5 | 8))
                    && !running.is_finished()
                    && Instant::now() < deadline,
                "dormant pause of job {third_id}: {code:?} {}",
                text(&out)
            );
            std::thread::sleep(Duration::from_millis(500));
        }
        running.join().unwrap()
    });
    assert_result(&r3, JobResult::Success);
    let log3 = r3.log();
    let want =
        format!("dormant-ask: paused key={key} question=\"paused by dormant pause: host round\"");
    assert!(log3.lines().any(|l| l == want), "{want}\n{log3}");
    assert!(!log3.contains("end\n"), "{log3}");
    assert!(
        r3.cleanup_output().contains("hibernated"),
        "{}",
        r3.cleanup_output()
    );
    assert_eq!(rig.status(&key).as_deref(), Some("suspended"));
    assert!(
        qemu_pids(&env).is_empty(),
        "hibernated with the script frozen"
    );

    // Suspends on failure (exit 3): the hot round below runs on this boot.
    let fourth = job(98)
        .resume(&key)
        .suspend_on(false, true)
        .script("touch /tmp/release; dormant-continue");
    let r4 = rig.run(&fourth);
    let log4 = r4.log();
    assert_result(&r4, JobResult::BuildFailure(Some(3)));
    assert!(log4.contains("restored"), "{log4}");
    assert!(log4.contains("end\n"), "{log4}");
    let lines: Vec<u64> = numbers(&log3).into_iter().chain(numbers(&log4)).collect();
    let n = lines.len() as u64;
    assert!(
        n >= 1 && lines == (1..=n).collect::<Vec<_>>(),
        "every line exactly once across the two logs:\n{log3}\n---\n{log4}"
    );
    assert!(qemu_pids(&env).is_empty(), "hibernated again");
    hot_round(&rig, &key, &env);
}

/// The hot window on the same boot (docs/pause.md, "The hot window"): with
/// `suspend.hot_for`, a job that asks leaves the VM running (no
/// hibernation); the next job continues it hot (no restore) and asks again;
/// with a short window, the detached `dormant cool` hibernates the VM
/// without a job; a job restores it and continues the same process cold,
/// which asks again and stays hot for `give_way_round`. Prints the resuming
/// jobs' time to the first byte after the answer, hot and hibernated (one
/// run).
fn hot_round(rig: &Rig, key: &str, env: &dormant::model::EnvPaths) {
    set_hot_for(rig, "5m");
    let fifth = job(98).resume(key).script(
        "a=$(dormant-ask 'hot?'); echo \"hot-answer=[$a] pid=$BASHPID\"; \
         b=$(dormant-ask 'cold?'); echo \"cold-answer=[$b] pid=$BASHPID\"; \
         c=$(dormant-ask 'give way?'); echo \"give-answer=[$c] pid=$BASHPID\"; \
         d=$(dormant-ask 'lost?'); echo \"never=[$d]\"; exit 5",
    );
    let r5 = rig.run(&fifth);
    assert_result(&r5, JobResult::Success);
    let log5 = r5.log();
    assert!(
        log5.contains("dormant-ask: the machine stays running 5m after this job"),
        "{log5}"
    );
    assert!(
        !r5.cleanup_output().contains("hibernated"),
        "{}",
        r5.cleanup_output()
    );
    assert!(!qemu_pids(env).is_empty(), "the VM runs in its hot window");
    let rec = rig.record(key).unwrap();
    assert_eq!(rec["status"], "suspended", "{rec}");
    assert!(rec["hot_until"].is_u64(), "{rec}");

    // The continue takes the running VM; its own ask gets a short window.
    set_hot_for(rig, "5s");
    let sixth = job(98).resume(key).script("dormant-continue yes");
    let r6 = rig.run(&sixth);
    assert_result(&r6, JobResult::Success);
    let log6 = r6.log();
    assert!(
        log6.contains("is hot: taking its running machine"),
        "{log6}"
    );
    assert!(!log6.contains("restored"), "no restore:\n{log6}");
    assert!(log6.contains("hot-answer=[yes] pid="), "{log6}");
    let pid = field(&log6.replace("hot-answer=[yes] pid=", "pid "), "pid");
    let hot = crate::pause_bench::prepare_to_line(&r6, "build_script", "hot-answer=");
    eprintln!("where the hot continue's time went:");
    breakdown(&r6, "hot-answer=");

    // The window passes with no job: the waiter hibernates the VM.
    let deadline = Instant::now() + Duration::from_secs(600);
    while !(qemu_pids(env).is_empty()
        && rig
            .record(key)
            .is_some_and(|r| r["hot_until"].is_null() && r["status"] == "suspended"))
    {
        assert!(Instant::now() < deadline, "the hot window never ended");
        std::thread::sleep(Duration::from_millis(200));
    }
    let events =
        String::from_utf8_lossy(&rig.dormant(&["events", "--json", key]).stdout).into_owned();
    assert!(
        events
            .lines()
            .any(|l| l.contains("\"event\":\"suspended\"") && l.contains("\"cause\":\"cooled\"")),
        "{events}"
    );

    // The cold continue: restored, the same process; it asks again and,
    // with a long window, stays hot.
    set_hot_for(rig, "5m");
    let seventh = job(98).resume(key).script("dormant-continue no");
    let r7 = rig.run(&seventh);
    let log7 = r7.log();
    assert_result(&r7, JobResult::Success);
    assert!(log7.contains("restored"), "{log7}");
    assert!(
        log7.contains(&format!("cold-answer=[no] pid={pid}\n")),
        "{log7}"
    );
    let cold = crate::pause_bench::prepare_to_line(&r7, "build_script", "cold-answer=");
    eprintln!(
        "qemu (TCG) continue, resuming job's first call to the first byte after the answer: \
         hot {} s, hibernated {} s",
        hot.map(secs).unwrap_or_default(),
        cold.map(secs).unwrap_or_default()
    );
    assert!(!qemu_pids(env).is_empty(), "hot again");
    give_way_round(rig, key, env, pid);
}

/// The capacity give-way on the same boot (`lifecycle::hot::give_way`):
/// at `max_environments = 1` a new job finds the one slot taken by the hot
/// VM and hibernates it rather than waiting. That job asks for an image the
/// runner does not offer, so its prepare is refused right after the
/// give-way, before a boot of its own (no second VM in this test). A last
/// job restores the hibernated VM and continues the same process; having no
/// trigger, it releases the environment.
fn give_way_round(rig: &Rig, key: &str, env: &dormant::model::EnvPaths, pid: u64) {
    let started = Instant::now();
    let mut new = job(99).script("echo never-runs");
    new.image = Some("not-offered".into());
    let other = env_paths(rig, &new);
    let r = rig.run(&new);
    let log = r.log();
    assert_result(&r, JobResult::BuildFailure(None));
    let id = env.id;
    assert!(
        log.contains(&format!(
            "no free slot: hot environment {id} (its window ending first) was suspended for this job"
        )),
        "{log}"
    );
    assert!(
        log.contains("\"not-offered\""),
        "refused for its image:\n{log}"
    );
    assert!(!log.contains("never-runs"), "{log}");
    assert!(qemu_pids(env).is_empty(), "the hot VM was hibernated");
    assert!(qemu_pids(&other).is_empty(), "no VM of its own");
    let rec = rig.record(key).unwrap();
    assert_eq!(rec["status"], "suspended", "{rec}");
    assert!(rec["hot_until"].is_null(), "{rec}");
    let events =
        String::from_utf8_lossy(&rig.dormant(&["events", "--json", key]).stdout).into_owned();
    assert!(
        events
            .lines()
            .any(|l| l.contains("\"cause\":\"cooled\"")
                && l.contains(dormant::lifecycle::hot::GAVE_WAY)),
        "{events}"
    );

    // The script paused in the hibernated VM is continued; it asks again,
    // and stays hot for `lost_round`.
    let last = job(98).resume(key).script("dormant-continue given");
    let r = rig.run(&last);
    let log = r.log();
    assert_result(&r, JobResult::Success);
    assert!(log.contains("restored"), "{log}");
    assert!(
        log.contains(&format!("give-answer=[given] pid={pid}\n")),
        "{log}"
    );
    assert!(!qemu_pids(env).is_empty(), "hot again");
    eprintln!(
        "the give-way round (its job, the hibernation, the cold continue) took {} s",
        secs(started.elapsed())
    );
    lost_round(rig, key, env);
}

/// Where memory cannot be kept (`qemu.suspend_mode = "shutdown"`, docs/pause.md
/// "The hot window"), a hot window ends as that mode suspends: the VM is
/// powered off and the record says the paused script was lost. On the same
/// boot: the settings switch to shutdown while the VM is hot, and a job
/// needing its slot ends the window (the give-way; the timer's end is the
/// same `lifecycle::hot` cooling). Then the environment is released: nothing
/// left. (The next `dormant-continue` failing at once on such a record is
/// `ec2_hot.rs`'s, in EC2's stop mode.)
fn lost_round(rig: &Rig, key: &str, env: &dormant::model::EnvPaths) {
    let started = Instant::now();
    let settings = std::fs::read_to_string(&rig.settings_path).unwrap();
    std::fs::write(
        &rig.settings_path,
        settings.replace(
            "suspend_mode = \"hibernate\"",
            "suspend_mode = \"shutdown\"",
        ),
    )
    .unwrap();
    let mut new = job(99).script("echo never-runs");
    new.image = Some("not-offered".into());
    let r = rig.run(&new);
    let log = r.log();
    assert_result(&r, JobResult::BuildFailure(None));
    assert!(
        log.contains(&format!("no free slot: hot environment {}", env.id)),
        "{log}"
    );
    assert!(qemu_pids(env).is_empty(), "the hot VM was powered off");
    let rec = rig.record(key).unwrap();
    assert_eq!(rec["status"], "suspended", "{rec}");
    assert!(rec["hot_until"].is_null(), "{rec}");
    let lost = rec["paused"]["lost"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        lost.contains("shutdown"),
        "the paused script is lost: {rec}"
    );
    let list = text(&rig.dormant(&["list"]));
    assert!(list.contains("paused script lost"), "{list}");
    let out = rig.dormant(&["release", key]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(qemu_pids(env).is_empty());
    assert!(!env.dir.exists(), "release left {}", env.dir.display());
    eprintln!(
        "the shutdown-mode window's end (its job, the power-off, the release) took {} s",
        secs(started.elapsed())
    );
}

/// Sets `suspend.hot_for` in the rig's settings (the next dormant call
/// reads it).
fn set_hot_for(rig: &Rig, hot_for: &str) {
    let text = std::fs::read_to_string(&rig.settings_path).unwrap();
    let base = text.split("[suspend]\n").next().unwrap().to_string();
    std::fs::write(
        &rig.settings_path,
        format!("{base}[suspend]\nhot_for = \"{hot_for}\"\n"),
    )
    .unwrap();
}

/// Where a continue's time went: each call from the first prepare until
/// the stage that printed `marker`, prepare's lines and that stage's first
/// lines with their arrival times (from each call's start).
fn breakdown(r: &dormant::runner_sim::JobReport, marker: &str) {
    let Some(first) = r.calls.iter().position(|c| c.name.starts_with("prepare#")) else {
        return;
    };
    for c in &r.calls[first..] {
        eprintln!("  {} {:.3} s", c.name, c.elapsed.as_secs_f64());
        let last = c.is_stage() && c.arrived(marker).is_some();
        if c.name.starts_with("prepare#") || last {
            for (at, line) in c.arrivals.iter().take(if last { 8 } else { 40 }) {
                eprintln!("    +{:.3} s: {line}", at.as_secs_f64());
            }
        }
        if last {
            break;
        }
    }
}

/// Seconds, two decimals.
fn secs(d: Duration) -> String {
    format!("{:.2}", d.as_secs_f64())
}

/// From the start of the job's first `prepare` call until `text` arrived
/// in a stage's output: the calls before it (prepare, the stages before)
/// one after another, then the line's arrival in its call.
fn until_line(r: &dormant::runner_sim::JobReport, text: &str) -> Option<Duration> {
    let first = r
        .calls
        .iter()
        .position(|c| c.name.starts_with("prepare#"))?;
    let mut at = Duration::ZERO;
    for c in &r.calls[first..] {
        if c.is_stage() {
            if let Some(t) = c.arrived(text) {
                return Some(at + t);
            }
        }
        at += c.elapsed;
    }
    None
}

/// The first number in the line of `call` that contains `text` (dormant's
/// own "restored in 0.3 s", "hibernated in 2.1 s").
fn logged_secs(r: &dormant::runner_sim::JobReport, call: &str, text: &str) -> String {
    r.calls
        .iter()
        .filter(|c| c.name.starts_with(call))
        .flat_map(|c| c.output.lines())
        .find_map(|l| {
            let rest = &l[l.find(text)? + text.len()..];
            rest.split_whitespace().next().map(str::to_string)
        })
        .unwrap_or_else(|| "-".into())
}

/// The pause benchmark (`scripts/bench-pause.sh`): one boot, a script that
/// asks in a loop, then `DORMANT_BENCH_RUNS` rounds (default 3) of a resumed
/// job answering it from the hibernated VM, then (with `suspend.hot_for`
/// set, the VM kept running) as many rounds answering it hot; the same
/// script on the same boot, so the hot and hibernated rows are one run.
/// Prints per round: the resuming job's first prepare call to the continued
/// script's first output byte after the answer; the machine's restore as
/// dormant logs it; the resume's prepare; the paused job's suspend (its
/// cleanup: a hibernation, or the hot window's bookkeeping) and the
/// hibernation as dormant logs it. The first round of each kind also prints
/// where its time went.
#[test]
#[ignore = "a benchmark: scripts/bench-pause.sh runs it"]
fn bench_pause_and_continue() {
    let runs: usize = std::env::var("DORMANT_BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let _one = one_vm();
    let rig = qemu_rig_full("hibernate", "", "");
    let first = job(97).script(
        "n=0; while :; do n=$((n+1)); a=$(dormant-ask \"round $n\"); echo \"answer=[$a] round=$n\"; done",
    );
    let env = env_paths(&rig, &first);
    let r = rig.run(&first);
    assert_result(&r, JobResult::Success);
    let key = r.key.clone().expect("the ask suspends the environment");
    let suspend_of = |r: &dormant::runner_sim::JobReport| {
        r.calls
            .iter()
            .filter(|c| c.is_cleanup())
            .map(|c| c.elapsed)
            .sum::<Duration>()
    };
    let mut rows = vec![(
        "0 (the job that first asked)".to_string(),
        "-".to_string(),
        "-".to_string(),
        "-".to_string(),
        secs(suspend_of(&r)),
        logged_secs(&r, "cleanup#", "hibernated in "),
    )];
    // Rounds 1..=runs from the hibernated VM; the last of them leaves the
    // VM hot (hot_for set before it), and the next `runs` rounds are hot.
    let mut round = 0;
    for hot in [false, true] {
        for i in 1..=runs {
            round += 1;
            if !hot && i == runs {
                set_hot_for(&rig, "10m");
            }
            let next = job(97).resume(&key).script("dormant-continue yes");
            let r = rig.run(&next);
            assert_result(&r, JobResult::Success);
            let answered = format!("answer=[yes] round={round}");
            if i == 1 {
                eprintln!("where round {round}'s time went (hot: {hot}):");
                breakdown(&r, &answered);
            }
            assert_eq!(
                r.log().contains("is hot: taking its running machine"),
                hot,
                "{}",
                r.log()
            );
            let first_byte = until_line(&r, &answered)
                .unwrap_or_else(|| panic!("no {answered:?} in the resumed job:\n{}", r.log()));
            let prepare: Duration = r
                .calls
                .iter()
                .filter(|c| c.name.starts_with("prepare#"))
                .map(|c| c.elapsed)
                .sum();
            rows.push((
                format!("{round} ({})", if hot { "hot" } else { "hibernated" }),
                secs(first_byte),
                logged_secs(&r, "prepare#", "restored in "),
                secs(prepare),
                secs(suspend_of(&r)),
                logged_secs(&r, "cleanup#", "hibernated in "),
            ));
        }
    }
    // Released: no trigger, no continue.
    let last = rig.run(&job(97).resume(&key).script("true"));
    assert_result(&last, JobResult::Success);
    assert!(qemu_pids(&env).is_empty());

    println!(
        "\nqemu, TCG, hibernate, 2 vCPUs, 1 GiB guest: a paused script answered by a resumed job, \
         {runs} round(s) from the hibernated VM, then {runs} hot (suspend.hot_for = \"10m\"), on one boot"
    );
    println!(
        "| round | prepare call → first byte after the answer s | machine restore s (dormant's log) \
         | resume prepare s | suspend of the paused job s | hibernation s (dormant's log) |"
    );
    println!("|---|---:|---:|---:|---:|---:|");
    for (round, byte, restore, prepare, suspend, hib) in &rows {
        println!("| {round} | {byte} | {restore} | {prepare} | {suspend} | {hib} |");
    }
}
