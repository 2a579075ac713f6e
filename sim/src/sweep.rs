//! Sweeps: the grid of `--vary key=v1,v2,…` axes, run in parallel on std threads.

use crate::error::SimError;
use std::fmt::Write as _;
use std::io::Write as _;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use infer_core::metrics::{PrioritySummary, Summary};
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

/// The most points a sweep may have, as many as a plan's configurations
/// ([`crate::plan::MAX_CONFIGS`]): a larger grid is a typo (an axis of a thousand values)
/// more often than a sweep, and its list of points alone can outgrow memory.
pub const MAX_POINTS: usize = crate::plan::MAX_CONFIGS;

/// How many points the grid of `axes` has, times `times` (a plan's named configurations);
/// `None` past what a `usize` counts.
pub fn grid_size(axes: &[Axis], times: usize) -> Option<usize> {
    axes.iter()
        .try_fold(times, |n, a| n.checked_mul(a.values.len()))
}

/// [`grid_size`] for an error: exact, or roughly (`1.8e19`) past what a `usize` counts.
pub fn grid_size_text(axes: &[Axis], times: usize) -> String {
    match grid_size(axes, times) {
        Some(n) => n.to_string(),
        None => {
            let n = axes
                .iter()
                .fold(times as f64, |n, a| n * a.values.len() as f64);
            format!("{n:.1e}")
        }
    }
}

/// `key (n values) × …`: what a grid too large to run is made of.
pub fn axis_sizes(axes: &[Axis]) -> String {
    let sizes: Vec<String> = axes
        .iter()
        .map(|a| format!("{} ({} values)", a.key, a.values.len()))
        .collect();
    sizes.join(" × ")
}

/// Refuse a key varied twice: only its last axis's values would run, under two columns.
pub fn check_distinct(axes: &[Axis]) -> Result<(), SimError> {
    for (i, a) in axes.iter().enumerate() {
        if axes[..i].iter().any(|b| b.key == a.key) {
            return Err(SimError::Invalid(format!(
                "--vary {}: the key is varied twice",
                a.key
            )));
        }
    }
    Ok(())
}

/// Check a sweep's grid before it is listed: distinct keys, at most [`MAX_POINTS`] points.
pub fn check_grid(axes: &[Axis]) -> Result<(), SimError> {
    check_distinct(axes)?;
    if grid_size(axes, 1).is_none_or(|n| n > MAX_POINTS) {
        return Err(SimError::Invalid(format!(
            "the sweep has {} points, more than {MAX_POINTS}: {}",
            grid_size_text(axes, 1),
            axis_sizes(axes)
        )));
    }
    Ok(())
}

/// Check each varied value alone on the scenario (`file`'s `text` with `overrides`), as a
/// point would run it: a key the scenario has not, or a value that does not parse, is
/// refused before anything runs rather than found on every row.
pub fn check_values(
    file: &str,
    text: &str,
    overrides: &[String],
    axes: &[Axis],
) -> Result<(), SimError> {
    for a in axes {
        for v in &a.values {
            let mut o = overrides.to_vec();
            o.push(format!("{}={v}", a.key));
            Scenario::parse(file, text, &o)
                .map_err(SimError::from)
                .and_then(|sc| crate::setup::prepare(file, sc))
                .map_err(|e| SimError::Invalid(format!("--vary {}={v}: {e}", a.key)))?;
        }
    }
    Ok(())
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

const COLUMNS: [&str; 15] = [
    "completed",
    "failed",
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

/// The leading [`COLUMNS`] that count requests (written without decimals).
const COUNT_COLUMNS: usize = 2;

/// The figures of [`COLUMNS`]; goodput is NaN (an empty CSV field) without an SLO.
fn values(s: &Summary, st: &RunStats) -> [f64; 15] {
    let g = s.goodput;
    [
        s.completed as f64,
        s.failed as f64,
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

/// Each priority's figures, for a workload of several (`[[workload.priorities]]`): the
/// column's name after `priority_P_`, and its value.
const PRIORITY_COLUMNS: [(&str, PriorityFigure); 4] = [
    ("ttft_p50_ms", |c| latency_ms(c, c.ttft.median)),
    ("ttft_p99_ms", |c| latency_ms(c, c.ttft.p99)),
    ("e2el_p50_ms", |c| latency_ms(c, c.e2el.median)),
    ("slo_attainment", |c| c.slo_attainment.unwrap_or(f64::NAN)),
];

/// One figure of a priority's requests.
type PriorityFigure = fn(&PrioritySummary) -> f64;

/// A priority's latency `s` in ms; NaN (an empty field) when none of its requests completed.
fn latency_ms(c: &PrioritySummary, s: f64) -> f64 {
    if c.completed > 0 {
        s * 1e3
    } else {
        f64::NAN
    }
}

/// The priorities any point's requests had, lowest first (none for a workload of one).
fn priorities(points: &[Point]) -> Vec<i64> {
    let mut all: Vec<i64> = (points.iter())
        .filter_map(|p| p.outcome.as_ref().ok())
        .flat_map(|(s, _)| s.by_priority.iter().map(|c| c.priority))
        .collect();
    all.sort_unstable();
    all.dedup();
    all
}

/// Point `s`'s figure `f` of priority `p`: NaN where it had none of that priority.
fn priority_value(s: &Summary, p: i64, f: PriorityFigure) -> f64 {
    (s.by_priority.iter())
        .find(|c| c.priority == p)
        .map_or(f64::NAN, f)
}

/// The sweep as CSV: one column per axis, then the figures (fixed formatting), each
/// priority's figures (`priority_P_ttft_p50_ms`, …) for a workload of several, then, where
/// any point has intervals, `COLUMN_lo` and `COLUMN_hi` of the figures that have them.
pub fn csv(axes: &[Axis], points: &[Point]) -> String {
    let mut s = String::new();
    let with_intervals = points.iter().any(|p| !p.intervals.is_empty());
    let bounds: Vec<String> = INTERVAL_COLUMNS
        .iter()
        .filter(|_| with_intervals)
        .flat_map(|(c, _)| [format!("{c}_lo"), format!("{c}_hi")])
        .collect();
    let classes = priorities(points);
    let class_heads: Vec<String> = (classes.iter())
        .flat_map(|p| PRIORITY_COLUMNS.map(|(c, _)| format!("priority_{p}_{c}")))
        .collect();
    let head: Vec<&str> = axes
        .iter()
        .map(|a| a.key.as_str())
        .chain(COLUMNS)
        .chain(class_heads.iter().map(String::as_str))
        .chain(["error"])
        .chain(bounds.iter().map(String::as_str))
        .collect();
    let number = |v: f64| {
        if v.is_nan() {
            String::new()
        } else {
            format!("{v:.4}")
        }
    };
    let _ = writeln!(s, "{}", head.join(","));
    for p in points {
        let mut row: Vec<String> = p.assignment.iter().map(|(_, v)| csv_field(v)).collect();
        match &p.outcome {
            Ok((sum, st)) => {
                row.extend(values(sum, st).iter().enumerate().map(|(c, v)| {
                    if v.is_nan() {
                        String::new()
                    } else if c < COUNT_COLUMNS {
                        format!("{v:.0}")
                    } else {
                        format!("{v:.4}")
                    }
                }));
                for &p in &classes {
                    row.extend(PRIORITY_COLUMNS.map(|(_, f)| number(priority_value(sum, p, f))));
                }
                row.push(String::new());
            }
            Err(e) => {
                row.extend(COLUMNS.iter().map(|_| String::new()));
                row.extend(class_heads.iter().map(|_| String::new()));
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
    let shown = [0usize, 1, 3, 4, 5, 7, 8, 9, 11];
    let classes = priorities(points);
    for a in axes {
        let _ = write!(s, "{:>24} ", a.key);
    }
    for &c in &shown {
        let _ = write!(s, "{:>14} ", COLUMNS[c]);
    }
    for p in &classes {
        let _ = write!(s, "{:>14} ", format!("p{p}_ttft_p50"));
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
                    let decimals = if c < COUNT_COLUMNS { 0 } else { 2 };
                    let _ = write!(s, "{:>14.decimals$} ", v[c]);
                }
                for &p in &classes {
                    match priority_value(sum, p, PRIORITY_COLUMNS[0].1) {
                        ttft if ttft.is_nan() => _ = write!(s, "{:>14} ", "-"),
                        ttft => _ = write!(s, "{ttft:>14.2} "),
                    }
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

    /// A priority none of whose requests completed has no latencies (empty fields, `-` in
    /// the console), not 0 ms; a point without a priority others had, empty fields too.
    #[test]
    fn a_priority_without_completed_requests_has_no_latency() {
        let class = |priority, completed| PrioritySummary {
            priority,
            completed,
            failed: 3,
            ..Default::default()
        };
        let point = |by_priority| Point {
            assignment: vec![("k".into(), "v".into())],
            outcome: Ok((
                Summary {
                    by_priority,
                    ..Default::default()
                },
                RunStats::default(),
            )),
            intervals: Vec::new(),
        };
        let axes = [parse_axis("k=v").unwrap()];
        let points = [
            point(vec![class(0, 2), class(1, 0)]),
            point(vec![class(0, 2)]),
        ];
        let csv = csv(&axes, &points);
        let rows: Vec<Vec<&str>> = csv.lines().map(|l| l.split(',').collect()).collect();
        let col = |name: &str| rows[0].iter().position(|c| *c == name).unwrap();
        assert_eq!(rows[1][col("priority_0_ttft_p50_ms")], "0.0000");
        assert_eq!(rows[1][col("priority_1_ttft_p50_ms")], "");
        assert_eq!(rows[2][col("priority_1_e2el_p50_ms")], "");
        assert_eq!(rows[1].len(), rows[0].len());
        assert!(table(&axes, &points)
            .lines()
            .nth(1)
            .unwrap()
            .trim_end()
            .ends_with('-'));
    }

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

    #[test]
    fn grids_too_large_or_with_a_key_twice_are_refused() {
        let axis = |key: &str, n: usize| {
            let values: Vec<String> = (1..=n).map(|v| v.to_string()).collect();
            parse_axis(&format!("{key}={}", values.join(","))).unwrap()
        };
        check_grid(&[axis("server.max_batch_size", 8), axis("arrival.rate", 4)]).unwrap();
        let e = check_grid(&[
            axis("server.max_batch_size", 8),
            axis("server.max_batch_size", 4),
        ])
        .unwrap_err()
        .to_string();
        assert_eq!(e, "--vary server.max_batch_size: the key is varied twice");
        // 5 axes × 100 values: 10^10 points, refused before they are listed.
        let big: Vec<Axis> = (0..5).map(|k| axis(&format!("k{k}"), 100)).collect();
        let e = check_grid(&big).unwrap_err().to_string();
        assert!(
            e.starts_with("the sweep has 10000000000 points, more than 100000: k0 (100 values)"),
            "{e}"
        );
        // 16 axes × 16 values: more than a usize counts.
        let huge: Vec<Axis> = (0..16).map(|k| axis(&format!("k{k}"), 16)).collect();
        assert_eq!(grid_size(&huge, 1), None);
        let e = check_grid(&huge).unwrap_err().to_string();
        assert!(e.starts_with("the sweep has 1.8e19 points"), "{e}");
    }

    #[test]
    fn a_varied_key_the_scenario_has_not_is_refused_before_any_point_runs() {
        let file = format!("{}/../scenarios/baseline.toml", env!("CARGO_MANIFEST_DIR"));
        let text = std::fs::read_to_string(&file).unwrap();
        let good = [parse_axis("server.max_batch_size=1,2").unwrap()];
        check_values(&file, &text, &[], &good).unwrap();
        let bogus = [parse_axis("server.bogus=1,2").unwrap()];
        let e = check_values(&file, &text, &[], &bogus)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("--vary server.bogus=1: ") && e.contains("unknown field `bogus`"),
            "{e}"
        );
    }
}
