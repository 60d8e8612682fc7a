//! `dormant metrics`: Prometheus text for a node-exporter textfile collector
//! or a cron job. Gauges of the registry as it is now (environments by status
//! and provider, the age of the oldest suspended one, the storage suspended
//! environments keep — `crate::provider::kept`, from the records it reads
//! anyway, a few `stat`s on qemu and no call —, the suspended environments
//! whose script waits paused for an answer (docs/pause.md) and the age of
//! the oldest such question, and unreadable records), then
//! the counters and histograms of what happened, folded from the event log
//! (`crate::events::tally`, which says why that stays cheap as the log grows).

use std::collections::BTreeMap;
use std::io::Write;

use anyhow::Result;

use crate::context::JobLog;
use crate::events::tally::Tally;
use crate::model::StorageMode;
use crate::settings::Settings;
use crate::state::{now_unix, EnvStatus, StateStore};

/// Prints every metric to `out`; warnings (a checkpoint that could not be
/// saved or was rebuilt) go to `log`, never into the Prometheus text.
/// The provider the settings name gets every series (zeros, empty
/// histograms) even before anything happened, and so does every provider
/// met in the registry or the log (Prometheus' instrumentation guidance:
/// export a zero for every known label value, or a dashboard's panels say
/// "No data" on a fresh install and `rate` misses a counter's first
/// increment).
pub fn metrics(
    settings: &Settings,
    store: &StateStore,
    log: &JobLog,
    out: &mut dyn Write,
) -> Result<()> {
    let provider = settings.provider.as_str();
    let mut counts: BTreeMap<(String, &'static str), u64> = BTreeMap::new();
    for status in EnvStatus::ALL {
        counts.insert((provider.to_string(), status.as_str()), 0);
    }
    // (provider, storage) → (bytes kept, suspended environments not counted)
    let mut kept: BTreeMap<(String, &'static str), (u64, u64)> = BTreeMap::new();
    for mode in [StorageMode::Machine, StorageMode::Volume] {
        kept.insert((provider.to_string(), mode.as_str()), (0, 0));
    }
    let mut oldest_suspended: u64 = 0;
    // provider → suspended environments holding a paused script (their
    // record's `paused`: a question waits for an answer).
    let mut paused: BTreeMap<String, u64> = BTreeMap::new();
    paused.insert(provider.to_string(), 0);
    let mut oldest_paused: u64 = 0;
    // provider → paused environments whose machine still runs (the hot window).
    let mut hot: BTreeMap<String, u64> = BTreeMap::new();
    hot.insert(provider.to_string(), 0);
    let mut unreadable = 0u64;
    let now = now_unix();
    for id in store.environment_ids()? {
        match crate::state::registry::peek(&store.env_paths(id)) {
            Ok(Some(rec)) => {
                if !counts.contains_key(&(rec.provider.clone(), EnvStatus::Active.as_str())) {
                    for status in EnvStatus::ALL {
                        counts.insert((rec.provider.clone(), status.as_str()), 0);
                    }
                    paused.entry(rec.provider.clone()).or_default();
                    hot.entry(rec.provider.clone()).or_default();
                }
                *counts
                    .entry((rec.provider.clone(), rec.status().as_str()))
                    .or_default() += 1;
                if rec.status() == EnvStatus::Suspended {
                    let age = now.saturating_sub(rec.suspended_at.unwrap_or(rec.created_at));
                    oldest_suspended = oldest_suspended.max(age);
                    // (A pause whose script was lost with the machine's
                    // memory is no longer waiting: `list` shows it suspended.)
                    if let Some(p) = rec.paused.as_ref().filter(|p| p.lost.is_none()) {
                        *paused.entry(rec.provider.clone()).or_default() += 1;
                        oldest_paused = oldest_paused.max(now.saturating_sub(p.at));
                    }
                    if rec.hot_until().is_some() {
                        *hot.entry(rec.provider.clone()).or_default() += 1;
                    }
                    let k = kept
                        .entry((rec.provider.clone(), rec.storage.as_str()))
                        .or_default();
                    match crate::provider::kept::kept_bytes(settings, store, &rec) {
                        Some(b) => k.0 += b,
                        None => k.1 += 1,
                    }
                }
            }
            Ok(None) => {}
            Err(_) => unreadable += 1,
        }
    }
    writeln!(
        out,
        "# HELP dormant_environments Environments in the registry, by provider and status."
    )?;
    writeln!(out, "# TYPE dormant_environments gauge")?;
    for ((provider, status), n) in &counts {
        writeln!(
            out,
            "dormant_environments{{provider=\"{provider}\",status=\"{status}\"}} {n}"
        )?;
    }
    writeln!(
        out,
        "# HELP dormant_oldest_suspended_seconds Age of the oldest suspended environment."
    )?;
    writeln!(out, "# TYPE dormant_oldest_suspended_seconds gauge")?;
    writeln!(out, "dormant_oldest_suspended_seconds {oldest_suspended}")?;
    writeln!(
        out,
        "# HELP dormant_paused_environments Suspended environments whose job script waits paused for an answer \
         (dormant-ask or dormant pause), by provider."
    )?;
    writeln!(out, "# TYPE dormant_paused_environments gauge")?;
    for (provider, n) in &paused {
        writeln!(
            out,
            "dormant_paused_environments{{provider=\"{provider}\"}} {n}"
        )?;
    }
    writeln!(
        out,
        "# HELP dormant_oldest_paused_seconds Age of the oldest question a paused environment waits to have answered \
         (0 when none waits)."
    )?;
    writeln!(out, "# TYPE dormant_oldest_paused_seconds gauge")?;
    writeln!(out, "dormant_oldest_paused_seconds {oldest_paused}")?;
    writeln!(
        out,
        "# HELP dormant_hot_environments Paused environments whose machine still runs in its hot window \
         (suspend.hot_for), by provider: each holds a slot and costs a running machine."
    )?;
    writeln!(out, "# TYPE dormant_hot_environments gauge")?;
    for (provider, n) in &hot {
        writeln!(
            out,
            "dormant_hot_environments{{provider=\"{provider}\"}} {n}"
        )?;
    }
    writeln!(
        out,
        "# HELP dormant_suspended_storage_bytes Storage suspended environments keep, by provider and storage mode: \
         EC2 the provisioned EBS bytes of stopped instances' root volumes (machine) and data volumes (volume); \
         qemu the bytes allocated on disk by overlays, memory images and data disks."
    )?;
    writeln!(out, "# TYPE dormant_suspended_storage_bytes gauge")?;
    for ((provider, storage), (bytes, _)) in &kept {
        writeln!(
            out,
            "dormant_suspended_storage_bytes{{provider=\"{provider}\",storage=\"{storage}\"}} {bytes}"
        )?;
    }
    writeln!(
        out,
        "# HELP dormant_suspended_storage_unknown Suspended environments whose storage dormant_suspended_storage_bytes \
         does not count (local and ssh; an EC2 root volume of unknown size: set ec2.root_volume_size_gb)."
    )?;
    writeln!(out, "# TYPE dormant_suspended_storage_unknown gauge")?;
    for ((provider, storage), (_, unknown)) in &kept {
        writeln!(
            out,
            "dormant_suspended_storage_unknown{{provider=\"{provider}\",storage=\"{storage}\"}} {unknown}"
        )?;
    }
    writeln!(out, "# HELP dormant_unreadable_records Environment records that cannot be read (corrupt or newer format).")?;
    writeln!(out, "# TYPE dormant_unreadable_records gauge")?;
    writeln!(out, "dormant_unreadable_records {unreadable}")?;
    let mut warm: BTreeMap<&'static str, u64> = ["launching", "ready", "taken", "retiring"]
        .into_iter()
        .map(|s| (s, 0))
        .collect();
    for (_, entry) in crate::state::pool::Pool::new(store).entries()? {
        if let Ok(Some(e)) = entry {
            *warm.entry(e.status.as_str()).or_default() += 1;
        }
    }
    writeln!(
        out,
        "# HELP dormant_warm_machines Warm machines in the pool, by status (launching: booting)."
    )?;
    writeln!(out, "# TYPE dormant_warm_machines gauge")?;
    for (status, n) in &warm {
        writeln!(
            out,
            "dormant_warm_machines{{provider=\"{provider}\",status=\"{status}\"}} {n}"
        )?;
    }
    let (tally, warnings) = Tally::update(&crate::events::dir(store.root()))?;
    for w in warnings {
        log.warn(format!("metrics checkpoint: {w}"));
    }
    let providers: std::collections::BTreeSet<&str> =
        counts.keys().map(|(p, _)| p.as_str()).collect();
    tally.render(&providers.into_iter().collect::<Vec<_>>(), out)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Default settings naming `provider`.
    fn settings(provider: &str) -> Settings {
        Settings {
            provider: serde_json::from_value(serde_json::json!(provider)).unwrap(),
            ..Default::default()
        }
    }

    #[test]
    fn counts_by_status_and_reports_the_oldest_suspension() {
        let dir = tempfile::tempdir().unwrap();
        let store = StateStore::open(dir.path()).unwrap();
        for (status, age) in [
            (EnvStatus::Suspended, 100),
            (EnvStatus::Suspended, 500),
            (EnvStatus::Active, 0),
        ] {
            crate::state::testing::place(&store, uuid::Uuid::new_v4(), status, None, age, None)
                .unwrap();
        }
        let bad = store.env_paths(uuid::Uuid::new_v4());
        std::fs::create_dir(&bad.dir).unwrap();
        std::fs::write(&bad.record, "{").unwrap();
        let mut out = Vec::new();
        metrics(&settings("local"), &store, &JobLog::capture().0, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(
            text.contains("dormant_environments{provider=\"local\",status=\"suspended\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("dormant_environments{provider=\"local\",status=\"active\"} 1"),
            "{text}"
        );
        let oldest: u64 = text
            .lines()
            .find_map(|l| l.strip_prefix("dormant_oldest_suspended_seconds "))
            .unwrap()
            .parse()
            .unwrap();
        assert!((500..510).contains(&oldest), "{oldest}");
        assert!(text.contains("dormant_unreadable_records 1"), "{text}");
        // Statuses no environment has are zeros, not missing.
        assert!(
            text.contains("dormant_environments{provider=\"local\",status=\"releasing\"} 0"),
            "{text}"
        );
    }

    /// A suspended environment whose script waits paused counts in
    /// `dormant_paused_environments` of its provider, and its question's age
    /// is `dormant_oldest_paused_seconds`; one suspended without a question,
    /// an active one whose record still has the question (a resumed job
    /// that has not continued it yet: no one is waiting for a human), and one
    /// whose paused script was lost with the machine's memory, do not.
    #[test]
    fn counts_paused_environments_and_the_oldest_question() {
        let dir = tempfile::tempdir().unwrap();
        let store = StateStore::open(dir.path()).unwrap();
        let ask = |age: u64| crate::state::Paused {
            question: "Deploy?".into(),
            job_id: 9,
            at: now_unix() - age,
            lost: None,
            ended: None,
        };
        let lost = crate::state::Paused {
            lost: Some("the hibernation fell back to a power-off".into()),
            ..ask(5000)
        };
        for (status, question) in [
            (EnvStatus::Suspended, Some(lost)),
            (EnvStatus::Suspended, Some(ask(300))),
            (EnvStatus::Suspended, Some(ask(40))),
            (EnvStatus::Suspended, None),
            (EnvStatus::Active, Some(ask(900))),
        ] {
            let id = uuid::Uuid::new_v4();
            crate::state::testing::place(&store, id, status, None, 1000, None).unwrap();
            crate::state::testing::rewrite(&store, id, |_, _, rec| rec.paused = question).unwrap();
        }
        let mut out = Vec::new();
        metrics(&settings("ssh"), &store, &JobLog::capture().0, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(
            text.contains("dormant_paused_environments{provider=\"local\"} 2\n"),
            "{text}"
        );
        // The configured provider shows a zero, not "No data".
        assert!(
            text.contains("dormant_paused_environments{provider=\"ssh\"} 0\n"),
            "{text}"
        );
        let oldest: u64 = text
            .lines()
            .find_map(|l| l.strip_prefix("dormant_oldest_paused_seconds "))
            .unwrap_or_else(|| panic!("no dormant_oldest_paused_seconds:\n{text}"))
            .parse()
            .unwrap();
        assert!((300..310).contains(&oldest), "{oldest}");
    }

    /// The series selectors of a PromQL expression: each `dormant_*` name
    /// with its label matchers (`label="v"` or `label=~"v"`; both are taken
    /// as equality, with `$provider` standing for `provider`).
    fn selectors(expr: &str, provider: &str) -> Vec<(String, Vec<(String, String)>)> {
        let mut out = Vec::new();
        let mut rest = expr;
        while let Some(i) = rest.find("dormant_") {
            let tail = &rest[i..];
            let end = tail
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(tail.len());
            let name = tail[..end].to_string();
            let mut labels = Vec::new();
            rest = &tail[end..];
            if let Some(body) = rest.strip_prefix('{') {
                let close = body.find('}').expect("a selector's braces close");
                for m in body[..close].split(',').filter(|m| !m.trim().is_empty()) {
                    let (k, v) = m.split_once('=').expect("a label matcher");
                    let v = v.trim_start_matches('~').trim_matches('"');
                    labels.push((k.trim().to_string(), v.replace("$provider", provider)));
                }
                rest = &body[close..];
            }
            out.push((name, labels));
        }
        out
    }

    /// Whether Prometheus text has a sample of `name` with all of `labels`.
    fn has_sample(text: &str, name: &str, labels: &[(String, String)]) -> bool {
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .filter(|l| l.split(['{', ' ']).next() == Some(name))
            .any(|l| {
                labels
                    .iter()
                    .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
            })
    }

    fn exprs(v: &serde_json::Value, out: &mut Vec<String>) {
        match v {
            serde_json::Value::Object(m) => {
                for (k, v) in m {
                    match (k.as_str(), v) {
                        ("expr" | "definition", serde_json::Value::String(e)) => {
                            out.push(e.clone())
                        }
                        ("query", serde_json::Value::String(e)) => out.push(e.clone()),
                        _ => exprs(v, out),
                    }
                }
            }
            serde_json::Value::Array(a) => a.iter().for_each(|v| exprs(v, out)),
            _ => {}
        }
    }

    /// The dashboard's expressions (panels and template variables).
    fn dashboard_exprs() -> Vec<String> {
        let dashboard: serde_json::Value =
            serde_json::from_str(include_str!("../../examples/grafana-dashboard.json"))
                .expect("examples/grafana-dashboard.json is JSON");
        let mut all = Vec::new();
        exprs(&dashboard, &mut all);
        all
    }

    /// The selectors of the dashboard that `text` has no sample for.
    fn unplotted(text: &str, provider: &str) -> Vec<String> {
        let all = dashboard_exprs();
        let sel: Vec<_> = all.iter().flat_map(|e| selectors(e, provider)).collect();
        let names: std::collections::BTreeSet<&String> = sel.iter().map(|(n, _)| n).collect();
        assert!(names.len() >= 12, "{names:?}");
        sel.iter()
            .filter(|(n, l)| !has_sample(text, n, l))
            .map(|(n, l)| format!("{n}{l:?}"))
            .collect()
    }

    /// A fresh install (an empty state dir: no environment, no event log):
    /// every series every panel of the dashboard selects is printed for the
    /// configured provider, so no panel says "No data".
    #[test]
    fn every_series_the_dashboard_plots_is_printed_on_a_fresh_install() {
        let dir = tempfile::tempdir().unwrap();
        let store = StateStore::open(dir.path()).unwrap();
        let mut out = Vec::new();
        metrics(&settings("ec2"), &store, &JobLog::capture().0, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        let missing = unplotted(&text, "ec2");
        assert!(
            missing.is_empty(),
            "on an empty state dir, the dashboard selects {missing:?}, which dormant metrics \
             does not print:\n{text}"
        );
    }

    #[tokio::test]
    async fn every_metric_the_dashboard_plots_is_one_dormant_metrics_prints() {
        use crate::events::{Event, EventLog, Kind, SweepCounts};
        let dir = tempfile::tempdir().unwrap();
        let store = StateStore::open(dir.path()).unwrap();
        crate::state::testing::place(
            &store,
            uuid::Uuid::new_v4(),
            EnvStatus::Suspended,
            None,
            60,
            None,
        )
        .unwrap();
        // One event of every kind that feeds a metric.
        let log = EventLog::new(store.root(), &Default::default());
        let ctx = crate::context::Ctx::new(
            JobLog::capture().0,
            Default::default(),
            std::time::Duration::from_secs(5),
        );
        let d = std::time::Duration::from_secs(2);
        for e in [
            Event::new(Kind::Created, "job", "local").duration(d),
            Event::new(Kind::Resumed, "job", "local")
                .duration(d)
                .suspended_for(7200),
            Event::new(Kind::Suspended, "triggers", "local").duration(d),
            Event::new(Kind::Failed, "start", "local"),
            Event::new(Kind::Sweep, "full", "local")
                .duration(d)
                .sweep(SweepCounts::default()),
        ] {
            log.append(&e, &ctx).await.unwrap();
        }
        let mut out = Vec::new();
        metrics(&settings("local"), &store, &JobLog::capture().0, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        let missing = unplotted(&text, "local");
        assert!(
            missing.is_empty(),
            "the dashboard selects {missing:?}, which dormant metrics does not print:\n{text}"
        );
        // What the dashboard is for: resume latency percentiles, failures,
        // environments by status, the oldest suspension, what suspensions
        // keep, what the warm pool idles, and the paused jobs waiting for
        // an answer.
        let joined = dashboard_exprs().join("\n");
        for needle in [
            "histogram_quantile(0.9, sum by (le) (rate(dormant_prepare_seconds_bucket{provider=~\"$provider\",mode=\"resume\"}",
            "dormant_failures_total",
            "sum by (status) (dormant_environments",
            "dormant_oldest_suspended_seconds",
            "sum by (provider, storage) (dormant_suspended_storage_bytes",
            "increase(dormant_warm_idle_seconds_total",
            "sum by (provider) (dormant_paused_environments{provider=~\"$provider\"})",
            "dormant_oldest_paused_seconds",
        ] {
            assert!(joined.contains(needle), "the dashboard does not plot {needle}");
        }
    }
}
