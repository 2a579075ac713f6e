//! Figures against offered load: per stage of a staged run (inference-perf's per-QPS
//! results), per run of a rate sweep, and per run of a concurrency sweep.

use crate::markdown::Table;
use crate::run::{Frame, Run};

/// One load level: a stage of a staged run, or a whole run at a fixed rate.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadPoint {
    /// Offered requests per second.
    pub qps: f64,
    pub requests: usize,
    /// Output tokens per second.
    pub output_throughput: f64,
    pub ttft_p90_s: f64,
    pub ttft_mean_s: f64,
    pub e2e_p50_s: f64,
    pub e2e_mean_s: f64,
}

/// The load points of a run: one per stage when its arrival is staged, else one for the
/// whole run when it has a rate, else none.
///
/// A stage holds the successful requests *sent* during it (by `start_s`), wherever they
/// finished, and its throughput is their output tokens over the stage's duration: the
/// offered output load, as inference-perf's per-stage reports and `sim run` count it.
pub fn load_points(run: &Run) -> Vec<LoadPoint> {
    let Some(info) = &run.info else {
        return Vec::new();
    };
    let ok = run.successful();
    if info.arrival.stages.is_empty() {
        return match info.arrival.rate {
            Some(rate) => vec![point(
                &ok,
                rate,
                run.metric("output_throughput").unwrap_or(0.0),
            )],
            None => Vec::new(),
        };
    }
    let starts = ok.values("start_s");
    let mut begin = 0.0;
    info.arrival
        .stages
        .iter()
        .map(|st| {
            let end = begin + st.duration_s;
            let mask: Vec<bool> = starts.iter().map(|&t| t >= begin && t < end).collect();
            begin = end;
            let rows = ok.filter(&mask);
            let tokens: f64 = rows.values("output_tokens").iter().sum();
            point(&rows, st.rate, tokens / st.duration_s)
        })
        .collect()
}

fn point(rows: &Frame, qps: f64, output_throughput: f64) -> LoadPoint {
    let s = |v: Option<f64>| v.unwrap_or(f64::NAN) / 1e3;
    LoadPoint {
        qps,
        requests: rows.height(),
        output_throughput,
        ttft_p90_s: s(rows.quantile("ttft_ms", 0.9)),
        ttft_mean_s: s(rows.mean("ttft_ms")),
        e2e_p50_s: s(rows.quantile("e2e_ms", 0.5)),
        e2e_mean_s: s(rows.mean("e2e_ms")),
    }
}

/// inference-perf's per-QPS table for one run.
pub fn load_table(points: &[LoadPoint]) -> Table {
    let mut t = Table::new([
        "QPS",
        "Requests",
        "Output tok/s",
        "TTFT p90 (s)",
        "TTFT mean (s)",
        "Latency P50 (s)",
        "Latency mean (s)",
    ]);
    for p in points {
        t.row([
            format!("{:.1}", p.qps),
            p.requests.to_string(),
            format!("{:.1}", p.output_throughput),
            format!("{:.3}", p.ttft_p90_s),
            format!("{:.3}", p.ttft_mean_s),
            format!("{:.3}", p.e2e_p50_s),
            format!("{:.3}", p.e2e_mean_s),
        ]);
    }
    t
}

/// The concurrency sweep table (as the L4 log's): one row per run of a closed-loop
/// `concurrency` arrival, ordered by client count.
pub fn concurrency_table(runs: &[&Run], labels: &[String]) -> Table {
    let mut t = Table::new([
        "Run",
        "Concurrency",
        "req/s",
        "out tok/s",
        "TTFT p50 (ms)",
        "TTFT p95 (ms)",
        "ITL p50 (ms)",
        "ITL p95 (ms)",
        "E2E p50 (ms)",
        "E2E p95 (ms)",
    ]);
    let mut rows: Vec<(usize, &String, &Run)> = runs
        .iter()
        .zip(labels)
        .filter_map(|(r, l)| Some((r.concurrency()?, l, *r)))
        .collect();
    rows.sort_by_key(|(c, _, _)| *c);
    for (c, label, r) in rows {
        let f = |key: &str, d: usize| r.metric(key).map_or("–".into(), |v| format!("{v:.d$}"));
        t.row([
            label.clone(),
            c.to_string(),
            f("request_throughput", 1),
            f("output_throughput", 0),
            f("median_ttft_ms", 1),
            f("p95_ttft_ms", 1),
            f("median_itl_ms", 1),
            f("p95_itl_ms", 1),
            f("median_e2el_ms", 0),
            f("p95_e2el_ms", 0),
        ]);
    }
    t
}
