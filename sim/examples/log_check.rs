//! Predicted vs published: the benchmark log's Phases 4–9 on the RTX 5080 (three models,
//! five workloads, five figures each), predicted with the shipped calibration
//! (`sim/calibrations/rtx5080-seed-server.toml`, fitted by `sim calibrate` to Phases 4–5
//! only), the log's headline phase effects, and Phase 9 (CUDA graphs) against Phase 8.
//!
//! ```text
//! cargo run --release -p infer-sim --example log_check [-- [--calibration FILE] KEY=VALUE …]
//! ```
//! Extra `KEY=VALUE` overrides apply to every run (try a mechanism against the log, e.g.
//! `sim.logits=all`). Prints every figure, the median |error| per metric over the held-out
//! Phases 6–8, and each headline effect: published change, predicted change, whether the
//! sign matches and the prediction is within a factor of two of it (or no further from it than
//! the log's own repeat spread of the metric, a second count); then the same for Phase
//! 9 vs 8 on every workload (the log's comparison tables: throughput and ITL P50).

use infer_sim::calibration::CalibrationFile;
use infer_sim::fit::{self, Fit, Row, FIT_METRICS};

const PUBLISHED: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/calibrations/rtx5080-benchmark-log.toml"
);
const PHASE9: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/calibrations/rtx5080-benchmark-log-phase9.toml"
);
const SHIPPED: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/calibrations/rtx5080-seed-server.toml"
);

/// The log's headline comparisons: (workload, earlier phase, later phase).
const HEADLINES: [(&str, u32, u32); 4] = [
    ("continuous_batching", 4, 5),
    ("paged_attention", 5, 6),
    ("chunked_prefill", 6, 7),
    ("prefix_caching", 7, 8),
];

fn main() {
    let mut extra: Vec<String> = std::env::args().skip(1).collect();
    // `--calibration FILE` checks another calibration file than the shipped one.
    let calibration = match extra.iter().position(|a| a.starts_with("--calibration")) {
        Some(i) => match extra.remove(i).strip_prefix("--calibration=") {
            Some(file) => file.to_string(),
            None if i < extra.len() => extra.remove(i),
            None => panic!("--calibration needs a file"),
        },
        None => SHIPPED.to_string(),
    };
    let mut targets = fit::load_published(PUBLISHED).unwrap_or_else(|e| panic!("{e}"));
    targets.extend(fit::load_published(PHASE9).unwrap_or_else(|e| panic!("{e}")));
    if !extra.is_empty() {
        for t in &mut targets {
            let mut scenario = t.setup.scenario.clone();
            let text = toml::to_string(&scenario.resolved).expect("a scenario serialises");
            scenario = infer_core::workload::Scenario::parse(&t.setup.file, &text, &extra)
                .unwrap_or_else(|e| panic!("{e}"));
            t.setup = infer_sim::prepare(&t.setup.file, scenario).unwrap_or_else(|e| panic!("{e}"));
        }
    }
    let text =
        std::fs::read_to_string(&calibration).unwrap_or_else(|e| panic!("{calibration}: {e}"));
    let file = CalibrationFile::parse(&calibration, &text).unwrap_or_else(|e| panic!("{e}"));
    // `[sim]` overrides given on the command line apply on top (`Target::predict`).
    let fit = Fit::of_file(&file);
    let rows = fit::rows(&mut targets, &fit);
    // Rows follow targets, one per published metric: Phases 4–8 first, then Phase 9.
    let split = rows
        .iter()
        .position(|r| r.label.starts_with("P9 "))
        .unwrap_or(rows.len());
    assert!(rows[split..].iter().all(|r| r.label.starts_with("P9 ")));
    let (log, phase9) = rows.split_at(split);

    println!(
        "{:<40} {:<18} {:>10} {:>10} {:>7}",
        "run", "metric", "published", "predicted", "error%"
    );
    for r in &rows {
        println!(
            "{:<40} {:<18} {:>10.1} {:>10.1} {:>+7.0}",
            r.label,
            r.metric,
            r.measured,
            r.predicted,
            r.error_pct()
        );
    }
    println!("\nheld out (Phases 6-8), median |error| per metric:");
    for (m, e) in fit::median_errors(log, true) {
        println!("  {m:<18} {:>4.0} %", e.unwrap_or(f64::NAN));
    }
    println!("fitted (Phases 4-5), median |error| per metric:");
    for (m, e) in fit::median_errors(log, false) {
        println!("  {m:<18} {:>4.0} %", e.unwrap_or(f64::NAN));
    }

    println!("\nthe log's repeat spread (90th percentile of |change| where it reports none):");
    let spreads: Vec<(&str, f64)> = FIT_METRICS
        .iter()
        .map(|&m| (m, repeat_spread(log, m)))
        .collect();
    let spread = |metric: &str| {
        spreads
            .iter()
            .find(|(m, _)| *m == metric)
            .map(|&(_, s)| s)
            .unwrap_or_else(|| panic!("no spread for {metric}"))
    };
    for (metric, s) in &spreads {
        println!("  {metric:<18} {:>4.1} %", s * 100.0);
    }
    println!(
        "\nheadline effects: {:<34} {:<18} {:>10} {:>10}  sign  within 2x  or spread",
        "", "metric", "published", "predicted"
    );
    let mut tally = Tally::default();
    for (workload, a, b) in HEADLINES {
        for model in ["llama-3.2-3b", "qwen3-4b", "gemma-3-1b"] {
            for metric in FIT_METRICS {
                let find = |phase: u32| -> &Row {
                    let label = format!("P{phase} {workload} {model}");
                    log.iter()
                        .find(|r| r.label == label && r.metric == metric)
                        .unwrap_or_else(|| panic!("no row {label} {metric}"))
                };
                let e = tally.count(find(a), find(b), spread(metric));
                println!(
                    "P{b} vs P{a} {workload:<20} {model:<13} {metric:<18} {}",
                    e.columns()
                );
            }
        }
    }
    println!("{}", tally.line("headline effects"));

    println!("\nPhase 9 (CUDA graphs, held out), median |error| per metric:");
    for (m, e) in fit::median_errors(phase9, true) {
        println!("  {m:<18} {:>4.0} %", e.unwrap_or(f64::NAN));
    }
    let mut tally = Tally::default();
    for p9 in phase9
        .iter()
        .filter(|r| ["output_throughput", "median_itl_ms"].contains(&r.metric.as_str()))
    {
        let label = p9.label.replacen("P9 ", "P8 ", 1);
        let p8 = log
            .iter()
            .find(|r| r.label == label && r.metric == p9.metric)
            .unwrap_or_else(|| panic!("no row {label} {}", p9.metric));
        let e = tally.count(p8, p9, spread(&p9.metric));
        println!(
            "P9 vs P8 {:<34} {:<18} {}",
            &p9.label[3..],
            p9.metric,
            e.columns()
        );
    }
    println!("{}", tally.line("Phase 9 vs 8"));
}

/// The workloads the log reports unchanged by a phase (Phase 7: "negligible change";
/// Phase 8: "no regression"): (earlier phase, later phase, workloads).
const UNCHANGED: [(u32, u32, &[&str]); 2] = [
    (
        6,
        7,
        &["baseline", "continuous_batching", "paged_attention"],
    ),
    (
        7,
        8,
        &[
            "baseline",
            "continuous_batching",
            "paged_attention",
            "chunked_prefill",
        ],
    ),
];

/// The log's own run-to-run spread of a metric: the 90th percentile of its |change| over
/// the runs the log reports unchanged (three models each). A predicted change that far
/// from the published one cannot be told from it by the log's figures.
fn repeat_spread(log: &[Row], metric: &str) -> f64 {
    let mut changes = Vec::new();
    for (a, b, workloads) in UNCHANGED {
        for workload in workloads {
            for model in ["llama-3.2-3b", "qwen3-4b", "gemma-3-1b"] {
                let find = |phase: u32| {
                    let label = format!("P{phase} {workload} {model}");
                    log.iter()
                        .find(|r| r.label == label && r.metric == metric)
                        .unwrap_or_else(|| panic!("no row {label} {metric}"))
                        .measured
                };
                changes.push((find(b) / find(a) - 1.0).abs());
            }
        }
    }
    changes.sort_by(f64::total_cmp);
    changes[(0.9 * changes.len() as f64) as usize]
}

/// A phase effect: the published and the predicted change from one run to another, and
/// the log's repeat spread of its metric.
struct Effect {
    published: f64,
    predicted: f64,
    spread: f64,
}

impl Effect {
    fn right_sign(&self) -> bool {
        self.published.signum() == self.predicted.signum()
    }

    /// The right sign and within a factor of two of the published change.
    fn within_2x(&self) -> bool {
        self.right_sign() && (0.5..=2.0).contains(&(self.predicted / self.published))
    }

    /// Within a factor of two, or no further from the published change than the log's
    /// own repeat spread of the metric.
    fn within_2x_or_spread(&self) -> bool {
        self.within_2x() || (self.predicted - self.published).abs() <= self.spread
    }

    /// Published %, predicted %, sign, within 2x, within 2x or the spread: the columns of
    /// an effect's line.
    fn columns(&self) -> String {
        let yes = |b: bool| if b { "yes" } else { "no" };
        format!(
            "{:>+9.0}% {:>+9.0}%  {:<4}  {:<9}  {}",
            self.published * 100.0,
            self.predicted * 100.0,
            if self.right_sign() { "yes" } else { "NO" },
            yes(self.within_2x()),
            yes(self.within_2x_or_spread())
        )
    }
}

/// Effects counted: how many, with the right sign, within a factor of two (or the spread).
#[derive(Default)]
struct Tally {
    right_sign: usize,
    within: usize,
    within_or_spread: usize,
    total: usize,
}

impl Tally {
    /// The effect from `before` to `after`, counted; `spread` is its metric's repeat spread.
    fn count(&mut self, before: &Row, after: &Row, spread: f64) -> Effect {
        let e = Effect {
            published: after.measured / before.measured - 1.0,
            predicted: after.predicted / before.predicted - 1.0,
            spread,
        };
        self.total += 1;
        self.right_sign += e.right_sign() as usize;
        self.within += e.within_2x() as usize;
        self.within_or_spread += e.within_2x_or_spread() as usize;
        e
    }

    fn line(&self, what: &str) -> String {
        format!(
            "{what} with the right sign: {} of {}; within a factor of two: {} of {}; within a \
             factor of two or the log's repeat spread: {} of {}",
            self.right_sign, self.total, self.within, self.total, self.within_or_spread, self.total
        )
    }
}
