//! `dormant metrics`: Prometheus text for a node-exporter textfile collector
//! or a cron job. Gauges of the registry as it is now (environments by status
//! and provider, the age of the oldest suspended one — what a stopped VM's
//! disks cost — and unreadable records), then the counters and histograms of
//! what happened, folded from the event log (`crate::events::tally`, which
//! says why that stays cheap as the log grows).

use std::collections::BTreeMap;
use std::io::Write;

use anyhow::Result;

use crate::context::JobLog;
use crate::events::tally::Tally;
use crate::state::{now_unix, EnvStatus, StateStore};

/// Prints every metric to `out`; warnings (a checkpoint that could not be
/// saved or was rebuilt) go to `log`, never into the Prometheus text.
pub fn metrics(store: &StateStore, log: &JobLog, out: &mut dyn Write) -> Result<()> {
    let mut counts: BTreeMap<(String, &'static str), u64> = BTreeMap::new();
    let mut oldest_suspended: u64 = 0;
    let mut unreadable = 0u64;
    let now = now_unix();
    for id in store.environment_ids()? {
        match crate::state::registry::peek(&store.env_paths(id)) {
            Ok(Some(rec)) => {
                *counts
                    .entry((rec.provider.clone(), rec.status().as_str()))
                    .or_default() += 1;
                if rec.status() == EnvStatus::Suspended {
                    let age = now.saturating_sub(rec.suspended_at.unwrap_or(rec.created_at));
                    oldest_suspended = oldest_suspended.max(age);
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
    writeln!(out, "# HELP dormant_unreadable_records Environment records that cannot be read (corrupt or newer format).")?;
    writeln!(out, "# TYPE dormant_unreadable_records gauge")?;
    writeln!(out, "dormant_unreadable_records {unreadable}")?;
    let (tally, warnings) = Tally::update(&crate::events::dir(store.root()))?;
    for w in warnings {
        log.warn(format!("metrics checkpoint: {w}"));
    }
    tally.render(out)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
        metrics(&store, &JobLog::capture().0, &mut out).unwrap();
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
    }

    /// Names `dormant_*` in a PromQL expression.
    fn metric_names(expr: &str) -> Vec<String> {
        let mut out = Vec::new();
        let mut rest = expr;
        while let Some(i) = rest.find("dormant_") {
            let tail = &rest[i..];
            let end = tail
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(tail.len());
            out.push(tail[..end].to_string());
            rest = &tail[end..];
        }
        out
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

    /// The sample names (without labels) of Prometheus text.
    fn sample_names(text: &str) -> std::collections::BTreeSet<String> {
        text.lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
            .map(|l| l.split(['{', ' ']).next().unwrap().to_string())
            .collect()
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
        metrics(&store, &JobLog::capture().0, &mut out).unwrap();
        let printed = sample_names(&String::from_utf8(out).unwrap());

        let dashboard: serde_json::Value =
            serde_json::from_str(include_str!("../../examples/grafana-dashboard.json"))
                .expect("examples/grafana-dashboard.json is JSON");
        let mut all = Vec::new();
        exprs(&dashboard, &mut all);
        let named: std::collections::BTreeSet<String> =
            all.iter().flat_map(|e| metric_names(e)).collect();
        assert!(named.len() >= 8, "{named:?}");
        let missing: Vec<&String> = named.iter().filter(|n| !printed.contains(*n)).collect();
        assert!(
            missing.is_empty(),
            "the dashboard plots {missing:?}, which dormant metrics does not print ({printed:?})"
        );
        // What the dashboard is for: resume latency percentiles, failures,
        // environments by status, the oldest suspension.
        let joined = all.join("\n");
        for needle in [
            "histogram_quantile(0.9, sum by (le) (rate(dormant_prepare_seconds_bucket{provider=~\"$provider\",mode=\"resume\"}",
            "dormant_failures_total",
            "sum by (status) (dormant_environments",
            "dormant_oldest_suspended_seconds",
        ] {
            assert!(joined.contains(needle), "the dashboard does not plot {needle}");
        }
    }
}
