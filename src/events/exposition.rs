//! The Prometheus text exposition of a [`Tally`] (what `dormant metrics`
//! prints): every family with its help, and a zero for every series dormant
//! knows but has not counted yet, so a fresh install already shows what a
//! dashboard plots. What is counted, and how the count is kept, is
//! `tally.rs`.

use std::collections::BTreeMap;
use std::io::{self, Write};

use super::tally::{key, label, split, Tally, BUCKETS};

impl Tally {
    /// The Prometheus text of everything counted, with a zero (an empty
    /// histogram) for every label value dormant knows but has not counted
    /// yet, for each of `providers` and every provider already counted: a
    /// fresh install prints every series a dashboard plots, and a counter's
    /// first increment is seen by `rate` (see [`Tally::with_zeros`]).
    pub fn render(&self, providers: &[&str], out: &mut dyn Write) -> io::Result<()> {
        self.with_zeros(providers).render_counted(out)
    }

    /// This tally plus zeros for the known label values: for each provider
    /// (those given and those seen in the log), every (event, cause) pair
    /// dormant writes, every failed step, every histogram with its modes or
    /// scopes, and the sweeps' unvisited counters. Prometheus' instrumentation
    /// guidance asks for this: a series that appears only when it first
    /// changes leaves panels empty and hides its first increment.
    pub fn with_zeros(&self, providers: &[&str]) -> Tally {
        let mut t = self.clone();
        let mut all: std::collections::BTreeSet<String> =
            providers.iter().map(|p| label(p).to_string()).collect();
        for k in self
            .events
            .keys()
            .chain(self.failures.keys())
            .chain(self.sweep_unvisited.keys())
            .chain(self.warm_idle_s.keys())
            .chain(self.hot_s.keys())
        {
            all.insert(split::<1>(k)[0].to_string());
        }
        for k in self.histograms.keys() {
            all.insert(split::<2>(k)[1].to_string());
        }
        for p in &all {
            for (event, cause) in crate::events::known_causes() {
                t.events.entry(key(&[p, event, cause])).or_default();
            }
            for step in crate::events::Step::ALL {
                t.failures.entry(key(&[p, step.as_str()])).or_default();
            }
            let mut empty = |metric: &str, extra: &str| {
                t.histograms
                    .entry(format!("{metric}\t{p}\t{extra}"))
                    .or_default();
            };
            for mode in ["new", "new_warm", "resume", "resume_warm", "shell"] {
                empty("prepare", mode);
            }
            empty("suspend", "");
            empty("suspended_before_resume", "");
            for scope in crate::events::SWEEP_SCOPES {
                empty("sweep", scope);
                t.sweep_unvisited.entry(key(&[p, scope])).or_default();
            }
            t.warm_idle_s.entry(p.clone()).or_default();
            t.hot_s.entry(p.clone()).or_default();
            for path in ["hot", "cold"] {
                t.continues.entry(key(&[p, path])).or_default();
            }
        }
        t
    }

    /// The Prometheus text of what this tally holds (every family, also empty).
    fn render_counted(&self, out: &mut dyn Write) -> io::Result<()> {
        family(
            out,
            "dormant_events_total",
            "counter",
            "Lifecycle events in the event log, by provider, event and cause (for failed: the step).",
        )?;
        for (k, n) in &self.events {
            let [p, e, c] = split::<3>(k);
            writeln!(
                out,
                "dormant_events_total{{provider=\"{p}\",event=\"{e}\",cause=\"{c}\"}} {n}"
            )?;
        }
        counter_by(
            out,
            "dormant_failures_total",
            "Failed steps (create, start, connect, stop, delete), by provider and step.",
            "step",
            &self.failures,
        )?;
        self.histogram(out, "prepare", "mode", "Prepare time in seconds: a new environment made (mode new; new_warm when it took a warm machine), a suspended one resumed for a job (resume; resume_warm on a warm machine) or a shell (shell).")?;
        self.histogram(
            out,
            "suspend",
            "",
            "Suspend time in seconds: stopping the machine at the end of a job.",
        )?;
        self.histogram(
            out,
            "suspended_before_resume",
            "",
            "How long an environment had been suspended when it was resumed, in seconds.",
        )?;
        self.histogram(
            out,
            "sweep",
            "scope",
            "Sweep time in seconds: dormant sweep (scope full) or a cleanup's slice (slice).",
        )?;
        counter_by(
            out,
            "dormant_sweep_unvisited_total",
            "Environments a sweep did not reach before its time bound ran out.",
            "scope",
            &self.sweep_unvisited,
        )?;
        family(
            out,
            "dormant_warm_idle_seconds_total",
            "counter",
            "Machine-seconds warm machines waited ready in the pool, unused (from ready to taken or retired; counted when each leaves the pool).",
        )?;
        for (p, s) in &self.warm_idle_s {
            writeln!(
                out,
                "dormant_warm_idle_seconds_total{{provider=\"{p}\"}} {}",
                (s * 1000.0).round() / 1000.0
            )?;
        }
        family(
            out,
            "dormant_hot_seconds_total",
            "counter",
            "Machine-seconds paused environments' machines ran in their hot window (suspend.hot_for), a cost like \
             dormant_warm_idle_seconds_total (counted when each window ends).",
        )?;
        for (p, s) in &self.hot_s {
            writeln!(
                out,
                "dormant_hot_seconds_total{{provider=\"{p}\"}} {}",
                (s * 1000.0).round() / 1000.0
            )?;
        }
        family(
            out,
            "dormant_continues_total",
            "counter",
            "Resumes of an environment whose script waits paused, by path: hot (its machine ran: the hot \
             window) or cold (started, restored).",
        )?;
        for (k, n) in &self.continues {
            let [p, path] = split::<2>(k);
            writeln!(
                out,
                "dormant_continues_total{{provider=\"{p}\",path=\"{path}\"}} {n}"
            )?;
        }
        family(
            out,
            "dormant_last_full_sweep_timestamp_seconds",
            "gauge",
            "When the last full sweep (dormant sweep) ended, Unix time; 0 if none is in the log.",
        )?;
        writeln!(
            out,
            "dormant_last_full_sweep_timestamp_seconds {}",
            self.last_full_sweep_ms as f64 / 1000.0
        )?;
        family(
            out,
            "dormant_event_lines_damaged_total",
            "counter",
            "Event log lines that could not be read (torn or corrupt), skipped.",
        )?;
        writeln!(out, "dormant_event_lines_damaged_total {}", self.damaged)?;
        family(
            out,
            "dormant_event_files_missed_total",
            "counter",
            "Event log files rotated away before dormant metrics counted them (run it more often, or raise events.keep_files).",
        )?;
        writeln!(
            out,
            "dormant_event_files_missed_total {}",
            self.missed_files
        )
    }

    fn histogram(
        &self,
        out: &mut dyn Write,
        metric: &str,
        extra: &str,
        help: &str,
    ) -> io::Result<()> {
        let name = format!("dormant_{metric}_seconds");
        family(out, &name, "histogram", help)?;
        for (k, h) in &self.histograms {
            let [m, p, x] = split::<3>(k);
            if m != metric {
                continue;
            }
            let labels = if extra.is_empty() {
                format!("provider=\"{p}\"")
            } else {
                format!("provider=\"{p}\",{extra}=\"{x}\"")
            };
            let mut cumulative = 0;
            for (i, bound) in BUCKETS.iter().enumerate() {
                cumulative += h.counts.get(i).copied().unwrap_or(0);
                writeln!(out, "{name}_bucket{{{labels},le=\"{bound}\"}} {cumulative}")?;
            }
            writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", h.count)?;
            writeln!(out, "{name}_sum{{{labels}}} {}", h.sum)?;
            writeln!(out, "{name}_count{{{labels}}} {}", h.count)?;
        }
        Ok(())
    }
}

fn family(out: &mut dyn Write, name: &str, kind: &str, help: &str) -> io::Result<()> {
    writeln!(out, "# HELP {name} {help}")?;
    writeln!(out, "# TYPE {name} {kind}")
}

/// A counter family of `counts` keyed by provider and one more label,
/// `label`.
fn counter_by(
    out: &mut dyn Write,
    name: &str,
    help: &str,
    label: &str,
    counts: &BTreeMap<String, u64>,
) -> io::Result<()> {
    family(out, name, "counter", help)?;
    for (k, n) in counts {
        let [p, v] = split::<2>(k);
        writeln!(out, "{name}{{provider=\"{p}\",{label}=\"{v}\"}} {n}")?;
    }
    Ok(())
}
