//! `dormant metrics`: the registry as Prometheus text, for a node-exporter
//! textfile collector or a cron job: environments by status and provider, and
//! the age of the oldest suspended one (what a stopped VM's disks cost).

use std::collections::BTreeMap;
use std::io::Write;

use anyhow::Result;

use crate::state::{now_unix, EnvStatus, StateStore};

pub fn metrics(store: &StateStore, out: &mut dyn Write) -> Result<()> {
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
        metrics(&store, &mut out).unwrap();
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
}
