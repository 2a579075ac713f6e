//! Per-workload tables in the benchmark log's layout (one row per metric, one column per
//! run), and the table that says what each run was.

use crate::markdown::Table;
use crate::metric::LOG_ROWS;
use crate::run::Run;

/// The log's per-workload table: Throughput, TTFT P50/P99, ITL P50/P99, Latency P50,
/// Errors, one column per run headed by `labels`; a prediction's figures with their 90%
/// intervals.
pub fn workload_table(runs: &[&Run], labels: &[String]) -> Table {
    let mut t = Table::new(std::iter::once("Metric".to_string()).chain(labels.iter().cloned()));
    for m in LOG_ROWS {
        t.row(std::iter::once(m.name.to_string()).chain(runs.iter().map(|r| m.cell(r))));
    }
    t
}

/// Runs grouped by scenario, in order of first appearance.
pub fn by_scenario<'a>(runs: &[&'a Run]) -> Vec<(String, Vec<&'a Run>)> {
    let mut groups: Vec<(String, Vec<&Run>)> = Vec::new();
    for r in runs {
        let s = r.scenario();
        match groups.iter_mut().find(|(name, _)| *name == s) {
            Some((_, g)) => g.push(r),
            None => groups.push((s, vec![r])),
        }
    }
    groups
}

/// One line per run: its label and what produced it, in cells short enough to read as a
/// table; the long fields (directory, backend) are [`run_details`]'s.
pub fn runs_table(runs: &[&Run], labels: &[String]) -> Table {
    let mut t = Table::text([
        "Run", "Source", "Scenario", "Phase", "Model", "Hardware", "Arrival", "Replicas",
    ]);
    for (r, label) in runs.iter().zip(labels) {
        let cells = match &r.info {
            Some(i) => vec![
                i.source.clone(),
                i.scenario.clone(),
                i.phase.clone(),
                i.server.model.clone(),
                i.server.hardware.clone(),
                arrival(r),
                match r.router().as_str() {
                    "" => i.replicas.to_string(),
                    router => format!("{} ({router})", i.replicas),
                },
            ],
            None => vec!["?".to_string(); 7],
        };
        t.row(std::iter::once(label.clone()).chain(cells));
    }
    t
}

/// Per run, the fields too long for a table cell: its directory and its backend in full
/// (the cost model with every coefficient and the calibration's provenance, or the
/// engine's device and model), and its warnings, as a Markdown list.
pub fn run_details(runs: &[&Run], labels: &[String]) -> String {
    let mut s = String::new();
    for (r, label) in runs.iter().zip(labels) {
        s += &format!("- **{label}**: `{}`", r.dir.display());
        if let Some(i) = &r.info {
            s += &format!("; backend: {}", i.backend);
        }
        s += "\n";
        // What the run said of itself: a prediction's fragility, a measurement cut short
        // (an interrupted `engine bench`). A table of its figures does not show it.
        for w in r.info.iter().flat_map(|i| &i.warnings) {
            s += &format!("  - ⚠ {w}\n");
        }
    }
    s
}

fn arrival(r: &Run) -> String {
    let Some(i) = &r.info else {
        return String::new();
    };
    let a = &i.arrival;
    let kind = serde_json::to_value(a.kind)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_else(|| format!("{:?}", a.kind));
    let mut s = kind;
    if let Some(rate) = a.rate {
        s += &format!(" {rate} req/s");
    }
    if let Some(c) = a.max_concurrency {
        s += &format!(" max {c} in flight");
    }
    if !a.stages.is_empty() {
        s += &format!(" {} stages", a.stages.len());
    }
    s
}
