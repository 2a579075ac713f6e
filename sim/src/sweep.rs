//! Sweeps: the grid of `--vary key=v1,v2,…` axes, run in parallel on std threads.

use crate::error::SimError;
use std::fmt::Write as _;
use std::io::Write as _;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use infer_core::metrics::Summary;
use infer_core::workload::Scenario;

use crate::interval::{self, Interval};
use crate::simulate::RunStats;

/// One `--vary` axis.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Axis {
    pub key: String,
    pub values: Vec<String>,
}

/// Parse `key=v1,v2,…`; commas inside brackets, braces or quotes do not split.
pub fn parse_axis(s: &str) -> Result<Axis, SimError> {
    let (key, values) = s
        .split_once('=')
        .ok_or_else(|| SimError::Invalid(format!("--vary `{s}`: expected key=v1,v2,…")))?;
    let values = split_list(values);
    if key.trim().is_empty() || values.iter().any(|v| v.is_empty()) {
        return Err(SimError::Invalid(format!(
            "--vary `{s}`: empty key or value"
        )));
    }
    Ok(Axis {
        key: key.trim().to_string(),
        values,
    })
}

/// Split `a,b,c` on the commas outside brackets, braces and quotes; each part trimmed.
pub fn split_list(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let (mut depth, mut quoted, mut cur) = (0i32, false, String::new());
    for c in s.chars() {
        match c {
            '"' => quoted = !quoted,
            '[' | '{' if !quoted => depth += 1,
            ']' | '}' if !quoted => depth -= 1,
            ',' if depth == 0 && !quoted => {
                out.push(std::mem::take(&mut cur).trim().to_string());
                continue;
            }
            _ => {}
        }
        cur.push(c);
    }
    out.push(cur.trim().to_string());
    out
}

/// Every combination, the first axis varying slowest.
pub fn grid(axes: &[Axis]) -> Vec<Vec<(String, String)>> {
    let mut points = vec![Vec::new()];
    for a in axes {
        points = points
            .into_iter()
            .flat_map(|p| {
                a.values.iter().map(move |v| {
                    let mut q = p.clone();
                    q.push((a.key.clone(), v.clone()));
                    q
                })
            })
            .collect();
    }
    points
}

/// One grid point's outcome.
#[derive(Debug)]
pub struct Point {
    pub assignment: Vec<(String, String)>,
    pub outcome: Result<(Summary, RunStats), SimError>,
    /// The figures' 90% intervals (`--seeds` above 1 only).
    pub intervals: Vec<Interval>,
}

/// Simulate the scenario `text` (from `file`) with `overrides`: its summary and run
/// statistics.
pub fn simulate(
    file: &str,
    text: &str,
    overrides: &[String],
) -> Result<(Summary, RunStats), SimError> {
    simulate_with_intervals(file, text, overrides, 1).map(|(summary, stats, _)| (summary, stats))
}

/// Run every point of the grid over `threads` workers; `progress` draws a bar on stderr.
/// With `seeds` above 1, each point also runs under the next `seeds − 1` seeds for its
/// figures' 90% intervals (as `sim run --seeds`).
pub fn run(
    file: &str,
    text: &str,
    base: &[String],
    axes: &[Axis],
    threads: usize,
    progress: bool,
    seeds: usize,
) -> Vec<Point> {
    let points = grid(axes);
    par_map(
        &points,
        threads,
        progress.then_some("sweep"),
        |assignment| {
            let mut overrides = base.to_vec();
            overrides.extend(assignment.iter().map(|(k, v)| format!("{k}={v}")));
            let (outcome, intervals) = match simulate_with_intervals(file, text, &overrides, seeds)
            {
                Ok((summary, stats, intervals)) => (Ok((summary, stats)), intervals),
                Err(e) => (Err(e), Vec::new()),
            };
            Point {
                assignment: assignment.clone(),
                outcome,
                intervals,
            }
        },
    )
}

/// [`simulate`], and the figures' intervals from `seeds` seeds (none for one), the other
/// seeds run on this thread (a sweep's points already take every core).
fn simulate_with_intervals(
    file: &str,
    text: &str,
    overrides: &[String],
    seeds: usize,
) -> Result<(Summary, RunStats, Vec<Interval>), SimError> {
    let setup = crate::setup::prepare(file, Scenario::parse(file, text, overrides)?)?;
    let r = crate::simulate::run(&setup)?;
    if seeds <= 1 {
        return Ok((r.summary, r.stats, Vec::new()));
    }
    let others = interval::seeded_summaries(&setup, seeds, 1)?;
    let intervals = interval::intervals(&r.summary, &others, interval::residuals_of(&setup), None);
    Ok((r.summary, r.stats, intervals))
}

/// `f` of every item, in order, computed by `threads` workers taking the next item as they
/// finish one; with a `label`, a progress bar on stderr.
pub fn par_map<T: Sync, R: Send>(
    items: &[T],
    threads: usize,
    label: Option<&str>,
    f: impl Fn(&T) -> R + Sync,
) -> Vec<R> {
    let total = items.len();
    let next = AtomicUsize::new(0);
    let done = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<R>>> = Mutex::new((0..total).map(|_| None).collect());
    let draw = |n: usize| {
        if let Some(label) = label {
            let width = 30;
            let filled = n * width / total.max(1);
            let bar = "#".repeat(filled) + &".".repeat(width - filled);
            let mut err = std::io::stderr().lock();
            let _ = write!(err, "\r{label} [{bar}] {n}/{total}");
            if n == total {
                let _ = writeln!(err);
            }
        }
    };
    draw(0);
    std::thread::scope(|s| {
        for _ in 0..threads.clamp(1, total.max(1)) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= total {
                    break;
                }
                let r = f(&items[i]);
                results.lock().expect("no panics while held")[i] = Some(r);
                draw(done.fetch_add(1, Ordering::SeqCst) + 1);
            });
        }
    });
    results
        .into_inner()
        .expect("workers done")
        .into_iter()
        .map(|r| r.expect("every item ran"))
        .collect()
}

const COLUMNS: [&str; 14] = [
    "completed",
    "duration_s",
    "req_per_s",
    "out_tok_per_s",
    "ttft_p50_ms",
    "ttft_p90_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "e2el_p50_ms",
    "peak_kv_usage",
    "prefix_hit_rate",
    "goodput_req_per_s",
    "slo_attainment",
];

/// The summary key of each column that has an interval.
const INTERVAL_COLUMNS: [(&str, &str); 8] = [
    ("req_per_s", "request_throughput"),
    ("out_tok_per_s", "output_throughput"),
    ("ttft_p50_ms", "median_ttft_ms"),
    ("ttft_p90_ms", "p90_ttft_ms"),
    ("ttft_p99_ms", "p99_ttft_ms"),
    ("itl_p50_ms", "median_itl_ms"),
    ("itl_p99_ms", "p99_itl_ms"),
    ("e2el_p50_ms", "median_e2el_ms"),
];

/// The figures of [`COLUMNS`]; goodput is NaN (an empty CSV field) without an SLO.
fn values(s: &Summary, st: &RunStats) -> [f64; 14] {
    let g = s.goodput;
    [
        s.completed as f64,
        s.duration,
        s.request_throughput,
        s.output_throughput,
        s.ttft.median * 1e3,
        s.ttft.p90 * 1e3,
        s.ttft.p99 * 1e3,
        s.itl.median * 1e3,
        s.itl.p99 * 1e3,
        s.e2el.median * 1e3,
        st.peak_kv_usage,
        st.prefix_hit_rate(),
        g.map_or(f64::NAN, |g| g.request_goodput),
        g.map_or(f64::NAN, |g| g.slo_attainment),
    ]
}

/// The sweep as CSV: one column per axis, then the figures (fixed formatting), then, where
/// any point has intervals, `COLUMN_lo` and `COLUMN_hi` of the figures that have them.
pub fn csv(axes: &[Axis], points: &[Point]) -> String {
    let mut s = String::new();
    let with_intervals = points.iter().any(|p| !p.intervals.is_empty());
    let bounds: Vec<String> = INTERVAL_COLUMNS
        .iter()
        .filter(|_| with_intervals)
        .flat_map(|(c, _)| [format!("{c}_lo"), format!("{c}_hi")])
        .collect();
    let head: Vec<&str> = axes
        .iter()
        .map(|a| a.key.as_str())
        .chain(COLUMNS)
        .chain(["error"])
        .chain(bounds.iter().map(String::as_str))
        .collect();
    let _ = writeln!(s, "{}", head.join(","));
    for p in points {
        let mut row: Vec<String> = p.assignment.iter().map(|(_, v)| csv_field(v)).collect();
        match &p.outcome {
            Ok((sum, st)) => {
                row.extend(values(sum, st).iter().map(|v| {
                    if v.is_nan() {
                        String::new()
                    } else {
                        format!("{v:.4}")
                    }
                }));
                row.push(String::new());
            }
            Err(e) => {
                row.extend(COLUMNS.iter().map(|_| String::new()));
                row.push(csv_field(&e.to_string()));
            }
        }
        if with_intervals {
            for (_, key) in INTERVAL_COLUMNS {
                match p.intervals.iter().find(|i| i.key == key) {
                    Some(i) => row.extend([format!("{:.4}", i.lo), format!("{:.4}", i.hi)]),
                    None => row.extend([String::new(), String::new()]),
                }
            }
        }
        let _ = writeln!(s, "{}", row.join(","));
    }
    s
}

/// A CSV field, quoted where it must be.
pub fn csv_field(v: &str) -> String {
    if v.contains([',', '"', '\n']) {
        format!("\"{}\"", v.replace('"', "\"\"").replace('\n', " "))
    } else {
        v.to_string()
    }
}

/// The sweep as an aligned console table.
pub fn table(axes: &[Axis], points: &[Point]) -> String {
    let mut s = String::new();
    let shown = [0usize, 2, 3, 4, 6, 7, 8, 10];
    for a in axes {
        let _ = write!(s, "{:>24} ", a.key);
    }
    for &c in &shown {
        let _ = write!(s, "{:>14} ", COLUMNS[c]);
    }
    s.push('\n');
    for p in points {
        for (_, v) in &p.assignment {
            let _ = write!(s, "{v:>24} ");
        }
        match &p.outcome {
            Ok((sum, st)) => {
                let v = values(sum, st);
                for &c in &shown {
                    let _ = write!(s, "{:>14.2} ", v[c]);
                }
            }
            Err(e) => {
                let _ = write!(s, "error: {e}");
            }
        }
        s.push('\n');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn axes_split_on_top_level_commas_and_grids_multiply() {
        let a = parse_axis("server.max_batch_size=8,16,24").unwrap();
        assert_eq!(a.values, vec!["8", "16", "24"]);
        let b = parse_axis("workload.prompt_tokens={ uniform = [64, 512] },256").unwrap();
        assert_eq!(b.values, vec!["{ uniform = [64, 512] }", "256"]);
        let g = grid(&[a, b]);
        assert_eq!(g.len(), 6);
        assert_eq!(g[1][0].1, "8");
        assert_eq!(g[1][1].1, "256");
        assert!(parse_axis("novalue").is_err());
    }
}
