//! Run directories (summary.json, requests.csv, timeseries.csv) and console text.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

pub use infer_core::metrics::{requests_csv, timeseries_csv};
use infer_core::metrics::{RequestRecord, RunInfo, Stats, Summary, TimePoint};
use infer_core::workload::{ArrivalKind, ArrivalSpec};

use crate::setup::Setup;
use crate::simulate::SimResult;

/// `runs/<name>-<unix time>`, with a `-k` suffix if that exists already: where every run
/// directory goes by default (`sim run`, `sim sweep`, `engine bench`, `engine verify`).
pub fn default_run_dir(name: &str) -> PathBuf {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let base = format!("runs/{name}-{secs}");
    let mut dir = PathBuf::from(&base);
    let mut k = 1;
    while dir.exists() {
        dir = PathBuf::from(format!("{base}-{k}"));
        k += 1;
    }
    dir
}

/// Write a run's files into `dir` (created if needed): summary.json, requests.csv,
/// timeseries.csv, and run.json (what produced it). The one writer of run directories:
/// simulated and measured runs read back alike.
pub fn write_run_files(
    dir: &Path,
    summary: &Summary,
    records: &[RequestRecord],
    timeseries: &[TimePoint],
    info: &RunInfo,
) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: cannot create: {e}", dir.display()))?;
    let write = |name: &str, text: String| {
        let p = dir.join(name);
        std::fs::write(&p, text).map_err(|e| format!("{}: cannot write: {e}", p.display()))
    };
    let json = serde_json::to_string_pretty(summary).map_err(|e| format!("summary.json: {e}"))?;
    write("summary.json", json + "\n")?;
    write("requests.csv", requests_csv(records))?;
    write("timeseries.csv", timeseries_csv(timeseries))?;
    let info = serde_json::to_string_pretty(info).map_err(|e| format!("run.json: {e}"))?;
    write("run.json", info + "\n")?;
    Ok(())
}

/// A simulated run's files (see [`write_run_files`]).
pub fn write_run(dir: &Path, result: &SimResult, info: &RunInfo) -> Result<(), String> {
    write_run_files(
        dir,
        &result.summary,
        &result.records,
        &result.timeseries,
        info,
    )
}

/// What `sim run` prints: the setup, warnings, vLLM's block, the extra line and, for a
/// staged arrival schedule, one row per stage.
pub fn console(setup: &Setup, result: &SimResult) -> String {
    let mut s = String::new();
    let sc = &setup.scenario;
    let replicas = sc.cluster.as_ref().map_or(String::new(), |c| {
        format!(
            ", {} replicas behind {:?} router (metrics delay {} s)",
            c.replicas, c.router, c.metrics_delay_s
        )
    });
    let _ = writeln!(s, "scenario {} ({}){}", sc.name, setup.file, replicas);
    let _ = writeln!(s, "cost model: {}", setup.cost.describe());
    let _ = writeln!(s, "memory per GPU: {}", setup.memory.describe());
    for w in &setup.warnings {
        let _ = writeln!(s, "{w}");
    }
    s.push_str(&result.summary.render());
    let _ = writeln!(s, "{}", result.stats.line());
    if sc.arrival.kind == ArrivalKind::Stages {
        s.push_str(&stage_table(&result.records, &sc.arrival));
    }
    s
}

/// Per-stage figures of a staged run. Requests are grouped by the stage they were sent in;
/// `output_throughput` is their output tokens over the stage's duration (offered output
/// load, as inference-perf's per-stage reports count it), wherever they finished.
#[derive(Debug, Clone, PartialEq)]
pub struct StageRow {
    pub stage: usize,
    pub rate: f64,
    pub requests: usize,
    pub output_throughput: f64,
    pub ttft: Stats,
    pub tpot: Stats,
}

pub fn stage_rows(records: &[RequestRecord], arrival: &ArrivalSpec) -> Vec<StageRow> {
    arrival
        .stages
        .iter()
        .enumerate()
        .map(|(i, st)| {
            let rs: Vec<&RequestRecord> = records
                .iter()
                .filter(|r| r.success() && arrival.stage_of(r.start) == Some(i))
                .collect();
            let out: usize = rs.iter().map(|r| r.output_tokens).sum();
            StageRow {
                stage: i,
                rate: st.rate,
                requests: rs.len(),
                output_throughput: out as f64 / st.duration_s,
                ttft: Stats::of(rs.iter().filter_map(|r| r.ttft)),
                tpot: Stats::of(rs.iter().filter_map(|r| r.tpot())),
            }
        })
        .collect()
}

pub fn stage_table(records: &[RequestRecord], arrival: &ArrivalSpec) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:>5} {:>6} {:>8} {:>12} {:>13} {:>13} {:>13}",
        "stage", "QPS", "requests", "out tok/s", "TTFT p90 (s)", "TTFT mean (s)", "TPOT mean (ms)"
    );
    for r in stage_rows(records, arrival) {
        let _ = writeln!(
            s,
            "{:>5} {:>6.1} {:>8} {:>12.1} {:>13.3} {:>13.3} {:>13.1}",
            r.stage,
            r.rate,
            r.requests,
            r.output_throughput,
            r.ttft.p90,
            r.ttft.mean,
            r.tpot.mean * 1e3
        );
    }
    s
}
