//! Unit tests of the event log: lines, appends under concurrency, rotation,
//! torn lines, readers keeping their place, and the metrics checkpoint.
//! (Killing a writer at each point of an append: `tests/integration/events.rs`.)

use std::collections::BTreeMap;
use std::time::Duration;

use super::read::{read_from, segments, Line, Position};
use super::tally::Tally;
use super::*;
use crate::context::{Ctx, JobLog};
use crate::settings::events::{ByteSize, EventSettings};

fn ctx() -> Ctx {
    Ctx::new(
        JobLog::capture().0,
        Default::default(),
        Duration::from_secs(30),
    )
}

fn log_in(root: &std::path::Path, size: u64, keep: u32) -> EventLog {
    EventLog::new(
        root,
        &EventSettings {
            max_file_size: ByteSize(size),
            keep_files: keep,
        },
    )
}

/// An event telling which writer wrote it and its number.
fn numbered(writer: u64, n: u64) -> Event {
    let mut e = Event::new(Kind::Created, "job", "local").duration(Duration::from_millis(n));
    e.job = Some(writer);
    e.project = Some(n);
    e
}

/// Every line of every file: (parsed events, damaged lines).
fn read_all(dir: &std::path::Path) -> (Vec<Event>, Vec<String>) {
    let (mut good, mut bad) = (Vec::new(), Vec::new());
    read_from(dir, None, &mut |line| match line {
        Line::Event(e, _) => good.push(*e),
        Line::Damaged(t) => bad.push(t.to_string()),
    })
    .unwrap();
    (good, bad)
}

#[test]
fn a_line_holds_what_an_operator_asks_about() {
    let dir = tempfile::tempdir().unwrap();
    let store = crate::state::StateStore::open(dir.path()).unwrap();
    let id = uuid::Uuid::new_v4();
    let rec = crate::state::testing::place(
        &store,
        id,
        crate::state::EnvStatus::Suspended,
        None,
        0,
        None,
    )
    .unwrap();
    let job = crate::state::Holder::Job {
        runner_id: "1".into(),
        job_id: 77,
        mode: crate::state::Mode::New,
        suspend_on_failure: false,
    };
    let e = Event::about(Kind::Suspended, SuspendCause::Triggers.as_str(), &rec)
        .by(&job)
        .duration(Duration::from_millis(1234))
        .error(&anyhow::anyhow!("x").context("y\nz"));
    let line: serde_json::Value = serde_json::from_str(&e.to_line()).unwrap();
    for field in [
        "time",
        "env",
        "key",
        "job",
        "project",
        "provider",
        "event",
        "cause",
        "duration_s",
    ] {
        assert!(line.get(field).is_some(), "no {field} in {line}");
    }
    assert_eq!(line["event"], "suspended");
    assert_eq!(line["cause"], "triggers");
    assert_eq!(line["env"], id.to_string());
    assert_eq!(line["job"], 77);
    assert_eq!(line["project"], 5);
    assert_eq!(line["duration_s"], 1.234);
    assert_eq!(line["error"], "y\nz: x");
    assert!(!e.to_line().contains('\n'), "one line: {}", e.to_line());
    let t = line["time"].as_str().unwrap();
    assert!(
        t.len() == 24 && t.ends_with('Z') && t.as_bytes()[19] == b'.',
        "{t}"
    );
    // A huge error is cut, so a line always fits the smallest file.
    let huge = Event::new(Kind::Failed, "stop", "local").error_text(&"é".repeat(10_000));
    assert!(huge.to_line().len() < 3000, "{}", huge.to_line().len());
}

#[test]
fn sixteen_writers_at_once_never_interleave_and_rotation_loses_no_event() {
    let dir = tempfile::tempdir().unwrap();
    const WRITERS: u64 = 16;
    const EACH: u64 = 120;
    // Small files: the writers rotate the log many times while they race.
    std::thread::scope(|scope| {
        for w in 0..WRITERS {
            let root = dir.path().to_path_buf();
            scope.spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                // Its own handle: its own open file descriptions, as another process has.
                let log = log_in(&root, 4096, 1000);
                rt.block_on(async {
                    for n in 0..EACH {
                        log.append(&numbered(w, n), &ctx()).await.unwrap();
                    }
                });
            });
        }
    });
    let events_dir = dir.path().join("events");
    let files = segments(&events_dir).unwrap();
    assert!(files.len() > 10, "rotated only {} times", files.len());
    for (_, path) in &files {
        let text = std::fs::read_to_string(path).unwrap();
        assert!(text.ends_with('\n'), "{} ends mid-line", path.display());
        assert!(
            text.len() <= 4096,
            "{} is {} bytes",
            path.display(),
            text.len()
        );
        for line in text.lines() {
            serde_json::from_str::<Event>(line)
                .unwrap_or_else(|e| panic!("interleaved or torn line {line:?}: {e}"));
        }
    }
    let (events, damaged) = read_all(&events_dir);
    assert!(damaged.is_empty(), "{damaged:?}");
    let mut seen: BTreeMap<(u64, u64), u32> = BTreeMap::new();
    for e in &events {
        *seen
            .entry((e.job.unwrap(), e.project.unwrap()))
            .or_default() += 1;
    }
    assert_eq!(
        events.len() as u64,
        WRITERS * EACH,
        "lost or doubled events"
    );
    assert!(seen.values().all(|n| *n == 1), "an event written twice");
    // Each writer's own events are in its order.
    for w in 0..WRITERS {
        let mine: Vec<u64> = events
            .iter()
            .filter(|e| e.job == Some(w))
            .map(|e| e.project.unwrap())
            .collect();
        assert_eq!(mine, (0..EACH).collect::<Vec<_>>(), "writer {w}");
    }
}

#[tokio::test]
async fn rotation_drops_the_oldest_file_never_the_current_one() {
    let dir = tempfile::tempdir().unwrap();
    let log = log_in(dir.path(), 4096, 2);
    for n in 0..200 {
        log.append(&numbered(1, n), &ctx()).await.unwrap();
    }
    let files = segments(log.dir()).unwrap();
    assert_eq!(files.len(), 2, "{files:?}");
    let (events, _) = read_all(log.dir());
    assert_eq!(
        events.last().unwrap().project,
        Some(199),
        "the newest is kept"
    );
    let numbers: Vec<u64> = events.iter().map(|e| e.project.unwrap()).collect();
    let first = numbers[0];
    assert_eq!(
        numbers,
        (first..200).collect::<Vec<_>>(),
        "no gap inside the kept files"
    );
    // The files are 0600 in a 0700 directory, as every state file.
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(log.dir()), 0o700);
    for (_, f) in files {
        assert_eq!(mode(&f), 0o600);
    }
}

#[tokio::test]
async fn a_torn_line_is_never_read_and_is_cut_off_by_the_next_writer() {
    let dir = tempfile::tempdir().unwrap();
    let log = log_in(dir.path(), 1 << 20, 4);
    log.append(&numbered(1, 0), &ctx()).await.unwrap();
    let file = segments(log.dir()).unwrap()[0].1.clone();
    // What a writer killed half-way through its line would leave.
    let half = &numbered(1, 1).to_line()[..40];
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&file)
        .unwrap();
    std::io::Write::write_all(&mut f, half.as_bytes()).unwrap();
    let (events, damaged) = read_all(log.dir());
    assert_eq!(
        (events.len(), damaged.len()),
        (1, 0),
        "the fragment is not read"
    );
    let pos = read_from(log.dir(), None, &mut |_| {})
        .unwrap()
        .pos
        .unwrap();
    log.append(&numbered(1, 2), &ctx()).await.unwrap();
    let text = std::fs::read_to_string(&file).unwrap();
    let whole = format!(
        "{}\n{}\n",
        numbered(1, 0).to_line(),
        numbered(1, 2).to_line()
    );
    assert_eq!(text.len(), whole.len(), "the fragment was kept: {text}");
    for line in text.lines() {
        serde_json::from_str::<Event>(line).unwrap_or_else(|e| panic!("{line:?}: {e}"));
    }
    // A reader that stopped before the fragment goes on with the next line.
    let mut next = Vec::new();
    read_from(log.dir(), Some(pos), &mut |l| {
        if let Line::Event(e, _) = l {
            next.push(e.project)
        }
    })
    .unwrap();
    assert_eq!(next, [Some(2)]);
}

#[tokio::test]
async fn a_torn_line_in_an_older_file_is_counted_damaged_and_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let log = log_in(dir.path(), 4096, 100);
    log.append(&numbered(1, 0), &ctx()).await.unwrap();
    let first = segments(log.dir()).unwrap()[0].1.clone();
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&first)
        .unwrap();
    std::io::Write::write_all(&mut f, b"{\"v\":1,\"ti").unwrap();
    std::io::Write::write_all(&mut f, b"\nnot json\n").unwrap();
    std::fs::write(super::read::segment_path(log.dir(), 2), "").unwrap();
    log.append(&numbered(1, 1), &ctx()).await.unwrap();
    let (events, damaged) = read_all(log.dir());
    assert_eq!(events.len(), 2);
    assert_eq!(damaged.len(), 2, "{damaged:?}");
    let progress = read_from(log.dir(), None, &mut |_| {}).unwrap();
    assert_eq!(progress.damaged, 2);
}

#[tokio::test]
async fn a_reader_goes_on_where_it_stopped_across_rotations() {
    let dir = tempfile::tempdir().unwrap();
    let log = log_in(dir.path(), 4096, 1000);
    let mut pos: Option<Position> = None;
    let mut got = Vec::new();
    for round in 0..5u64 {
        for n in 0..30 {
            log.append(&numbered(1, round * 30 + n), &ctx())
                .await
                .unwrap();
        }
        let p = read_from(log.dir(), pos, &mut |l| {
            if let Line::Event(e, _) = l {
                got.push(e.project.unwrap())
            }
        })
        .unwrap();
        assert_eq!(p.missed_files, 0);
        pos = p.pos;
    }
    assert_eq!(
        got,
        (0..150).collect::<Vec<_>>(),
        "each line read once, in order"
    );
    assert!(segments(log.dir()).unwrap().len() > 3);
}

#[tokio::test]
async fn a_reader_left_behind_by_rotation_says_how_many_files_it_missed() {
    let dir = tempfile::tempdir().unwrap();
    let log = log_in(dir.path(), 4096, 2);
    log.append(&numbered(1, 0), &ctx()).await.unwrap();
    let pos = read_from(log.dir(), None, &mut |_| {}).unwrap().pos;
    for n in 1..200 {
        log.append(&numbered(1, n), &ctx()).await.unwrap();
    }
    let p = read_from(log.dir(), pos, &mut |_| {}).unwrap();
    let first = segments(log.dir()).unwrap()[0].0;
    assert_eq!(p.missed_files, first - 1);
    assert!(p.missed_files > 0);
}

/// Counts by hand: (event, cause) → n.
fn by_hand(events: &[Event]) -> BTreeMap<(String, String), u64> {
    let mut m = BTreeMap::new();
    for e in events {
        *m.entry((e.event.clone(), e.cause.clone())).or_default() += 1;
    }
    m
}

fn tally_counts(t: &Tally) -> BTreeMap<(String, String), u64> {
    t.events
        .iter()
        .map(|(k, n)| {
            let parts: Vec<&str> = k.split('\t').collect();
            ((parts[1].to_string(), parts[2].to_string()), *n)
        })
        .collect()
}

fn mixed(n: u64) -> Event {
    let (kind, cause) = match n % 5 {
        0 => (Kind::Created, "job"),
        1 => (Kind::Suspended, "triggers"),
        2 => (Kind::Resumed, "job"),
        3 => (Kind::Released, "ttl"),
        _ => (Kind::Failed, "stop"),
    };
    let mut e = Event::new(kind, cause, "local").duration(Duration::from_millis(n * 10));
    if kind == Kind::Resumed {
        e = e.suspended_for(3600 * n);
    }
    e
}

#[tokio::test]
async fn counters_and_histograms_equal_the_events_and_survive_rotation() {
    let dir = tempfile::tempdir().unwrap();
    let log = log_in(dir.path(), 4096, 2);
    let mut all = Vec::new();
    for n in 0..300 {
        let e = mixed(n);
        log.append(&e, &ctx()).await.unwrap();
        all.push(e);
        if n % 20 == 19 {
            // The metrics timer runs between appends; rotation drops files.
            let (_, warnings) = Tally::update(log.dir()).unwrap();
            assert!(warnings.is_empty(), "{warnings:?}");
        }
    }
    let (t, _) = Tally::update(log.dir()).unwrap();
    assert_eq!(t.missed_files, 0);
    assert_eq!(
        tally_counts(&t),
        by_hand(&all),
        "counted from files long deleted"
    );
    assert!(segments(log.dir()).unwrap().len() == 2);
    assert_eq!(t.failures.get("local\tstop"), Some(&60));
    let resumes = &t.histograms["prepare\tlocal\tresume"];
    assert_eq!(resumes.count, 60);
    let created = &t.histograms["prepare\tlocal\tnew"];
    // durations 0, 50, 100, ... 2950 ms: ≤ 0.1 s are n = 0, 5, 10.
    assert_eq!(created.counts[0], 3);
    assert_eq!(created.count, 60);
    let waited = &t.histograms["suspended_before_resume\tlocal\t"];
    assert_eq!(waited.count, 60);
}

#[tokio::test]
async fn a_metrics_run_reads_only_what_was_appended_since_the_last() {
    let dir = tempfile::tempdir().unwrap();
    let log = log_in(dir.path(), 1 << 20, 4);
    for n in 0..50 {
        log.append(&mixed(n), &ctx()).await.unwrap();
    }
    let (first, _) = Tally::update(log.dir()).unwrap();
    // Scribble over what was counted: a run that re-read it would see damage
    // (and lose counts). Only the 10 new lines are read.
    let file = segments(log.dir()).unwrap()[0].1.clone();
    let len = std::fs::metadata(&file).unwrap().len() as usize;
    let mut scribbled = vec![b'#'; len - 1];
    scribbled.push(b'\n');
    std::fs::write(&file, scribbled).unwrap();
    for n in 50..60 {
        log.append(&mixed(n), &ctx()).await.unwrap();
    }
    let (second, _) = Tally::update(log.dir()).unwrap();
    assert_eq!(second.damaged, 0, "it read the old lines again");
    let total = |t: &Tally| t.events.values().sum::<u64>();
    assert_eq!(total(&first), 50);
    assert_eq!(total(&second), 60);
}

#[tokio::test]
async fn a_damaged_checkpoint_is_set_aside_and_counted_again() {
    let dir = tempfile::tempdir().unwrap();
    let log = log_in(dir.path(), 1 << 20, 4);
    for n in 0..7 {
        log.append(&mixed(n), &ctx()).await.unwrap();
    }
    Tally::update(log.dir()).unwrap();
    std::fs::write(log.dir().join(super::tally::CHECKPOINT), "{ not json").unwrap();
    let (t, warnings) = Tally::update(log.dir()).unwrap();
    assert_eq!(t.events.values().sum::<u64>(), 7);
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].contains("metrics.json.damaged"), "{warnings:?}");
    assert!(log.dir().join("metrics.json.damaged").exists());
    let (again, warnings) = Tally::update(log.dir()).unwrap();
    assert!(warnings.is_empty());
    assert_eq!(again.events.values().sum::<u64>(), 7);
}

#[test]
fn no_log_yet_is_empty_metrics_not_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let (t, warnings) = Tally::update(&dir.path().join("events")).unwrap();
    assert!(warnings.is_empty());
    assert!(t.events.is_empty() && t.pos.is_none());
    let mut out = Vec::new();
    t.render(&["ec2"], &mut out).unwrap();
    let text = String::from_utf8(out).unwrap();
    assert!(
        text.contains("# TYPE dormant_events_total counter"),
        "{text}"
    );
    // Nothing happened yet, and every series is there for the configured
    // provider: zeros and empty histograms.
    for sample in [
        "dormant_events_total{provider=\"ec2\",event=\"resumed\",cause=\"job\"} 0",
        "dormant_events_total{provider=\"ec2\",event=\"released\",cause=\"ttl\"} 0",
        "dormant_failures_total{provider=\"ec2\",step=\"start\"} 0",
        "dormant_prepare_seconds_bucket{provider=\"ec2\",mode=\"resume\",le=\"+Inf\"} 0",
        "dormant_prepare_seconds_count{provider=\"ec2\",mode=\"new\"} 0",
        "dormant_suspend_seconds_sum{provider=\"ec2\"} 0",
        "dormant_sweep_seconds_count{provider=\"ec2\",scope=\"slice\"} 0",
        "dormant_sweep_unvisited_total{provider=\"ec2\",scope=\"full\"} 0",
    ] {
        assert!(text.lines().any(|l| l == sample), "no {sample} in:\n{text}");
    }
    assert!(
        text.contains("dormant_last_full_sweep_timestamp_seconds 0"),
        "{text}"
    );
    assert!(
        !dir.path().join("events").exists(),
        "metrics created the log"
    );
}

#[test]
fn zeros_never_hide_or_change_what_was_counted() {
    let mut t = Tally::default();
    t.fold(&Event::new(Kind::Failed, "start", "local"));
    t.fold(&Event::new(Kind::Created, "job", "local").duration(std::time::Duration::from_secs(3)));
    let z = t.with_zeros(&["ec2"]);
    // The provider seen in the log gets its zeros too, beside the configured one.
    assert_eq!(z.failures["local\tstart"], 1);
    assert_eq!(z.failures["local\tstop"], 0);
    assert_eq!(z.failures["ec2\tstart"], 0);
    assert_eq!(z.events["local\tcreated\tjob"], 1);
    assert_eq!(z.histograms["prepare\tlocal\tnew"].count, 1);
    assert_eq!(z.histograms["prepare\tec2\tresume"].count, 0);
    // Every pair the vocabulary names, for each provider.
    let pairs = super::known_causes().len();
    assert_eq!(z.events.len(), 2 * pairs, "{:?}", z.events.keys());
    assert_eq!(
        z.events.values().sum::<u64>(),
        2,
        "the two events folded, nothing more"
    );
}

/// A `warm` line of machine `id` at `ts_ms`.
fn warm_line(cause: &str, id: uuid::Uuid, ts_ms: u64) -> Event {
    let mut e = Event::new(Kind::Warm, cause, "qemu");
    e.warm = Some(id);
    e.ts_ms = ts_ms;
    e
}

/// A warm machine's idle time runs from its `ready` line to its `taken` or
/// `retired` one, across metrics runs (the checkpoint remembers which
/// machines wait); one retired before it was ready, or still waiting, adds
/// nothing yet.
#[tokio::test]
async fn warm_idle_seconds_run_from_ready_to_taken_or_retired_across_runs() {
    let dir = tempfile::tempdir().unwrap();
    let log = log_in(dir.path(), 1 << 20, 4);
    let [a, b, c, d] = [(); 4].map(|_| uuid::Uuid::new_v4());
    for e in [
        warm_line("launched", a, 500),
        warm_line("ready", a, 1_000),
        warm_line("ready", b, 2_000),
        warm_line("retired", c, 2_500), // never ready: its launch was killed
    ] {
        log.append(&e, &ctx()).await.unwrap();
    }
    let (first, _) = Tally::update(log.dir()).unwrap();
    assert_eq!(
        first.warm_idle_s.get("qemu"),
        None,
        "none left the pool yet"
    );
    for e in [
        warm_line("taken", a, 61_000),
        warm_line("retired", b, 3_500),
        warm_line("ready", d, 4_000), // still waiting
    ] {
        log.append(&e, &ctx()).await.unwrap();
    }
    let (second, _) = Tally::update(log.dir()).unwrap();
    assert_eq!(second.warm_idle_s["qemu"], 60.0 + 1.5);
    assert_eq!(second.warm_waiting.len(), 1, "{:?}", second.warm_waiting);
    let mut out = Vec::new();
    second.render(&["qemu"], &mut out).unwrap();
    let text = String::from_utf8(out).unwrap();
    assert!(
        text.lines()
            .any(|l| l == "dormant_warm_idle_seconds_total{provider=\"qemu\"} 61.5"),
        "{text}"
    );
    // A fresh install has the series, at zero.
    let mut out = Vec::new();
    Tally::default().render(&["ec2"], &mut out).unwrap();
    let text = String::from_utf8(out).unwrap();
    assert!(
        text.lines()
            .any(|l| l == "dormant_warm_idle_seconds_total{provider=\"ec2\"} 0"),
        "{text}"
    );
}

/// A line of kind `kind` and cause `cause` about environment `env` at `ts_ms`.
fn env_line(kind: Kind, cause: &str, env: uuid::Uuid, ts_ms: u64) -> Event {
    let mut e = Event::new(kind, cause, "ec2");
    e.env = Some(env);
    e.ts_ms = ts_ms;
    e
}

/// The hot window's machine-seconds run from the `suspended` line that made
/// it hot to its end (a hot resume, a cooling, a release); continues are
/// counted hot or cold by the `resumed` lines' `hot`; a fresh install has
/// every series at zero.
#[test]
fn hot_seconds_and_continues_hot_or_cold_are_counted() {
    let [a, b, c] = [(); 3].map(|_| uuid::Uuid::new_v4());
    let mut t = Tally::default();
    let hot_line = |env, ts| {
        let mut e = env_line(Kind::Suspended, "paused", env, ts);
        e.hot_until = Some("2026-11-28T20:10:00Z".into());
        e
    };
    let mut hot_resume = env_line(Kind::Resumed, "hot", a, 5_000);
    hot_resume.hot = Some(true);
    let mut cold_resume = env_line(Kind::Resumed, "job", b, 90_000);
    cold_resume.hot = Some(false);
    for e in [
        hot_line(a, 1_000),
        hot_line(b, 2_000),
        hot_line(c, 3_000),
        hot_resume,
        env_line(Kind::Suspended, "cooled", b, 62_000),
        cold_resume,
        // A plain resume (nothing paused) is no continue.
        env_line(Kind::Resumed, "job", a, 95_000),
    ] {
        t.fold(&e);
    }
    assert_eq!(t.hot_s["ec2"], 4.0 + 60.0, "c still runs hot");
    assert_eq!(t.continues["ec2\thot"], 1);
    assert_eq!(t.continues["ec2\tcold"], 1);
    t.fold(&env_line(Kind::Released, "ttl", c, 13_000));
    assert_eq!(t.hot_s["ec2"], 4.0 + 60.0 + 10.0);
    let mut out = Vec::new();
    t.render(&["ec2"], &mut out).unwrap();
    let text = String::from_utf8(out).unwrap();
    for want in [
        "dormant_hot_seconds_total{provider=\"ec2\"} 74",
        "dormant_continues_total{provider=\"ec2\",path=\"hot\"} 1",
        "dormant_continues_total{provider=\"ec2\",path=\"cold\"} 1",
    ] {
        assert!(text.lines().any(|l| l == want), "{want} in:\n{text}");
    }
    let mut out = Vec::new();
    Tally::default().render(&["qemu"], &mut out).unwrap();
    let text = String::from_utf8(out).unwrap();
    for want in [
        "dormant_hot_seconds_total{provider=\"qemu\"} 0",
        "dormant_continues_total{provider=\"qemu\",path=\"hot\"} 0",
        "dormant_continues_total{provider=\"qemu\",path=\"cold\"} 0",
    ] {
        assert!(text.lines().any(|l| l == want), "{want} in:\n{text}");
    }
}
