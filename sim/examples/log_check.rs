//! Predicted vs published: the benchmark log's Phases 4–8 on the RTX 5080 (three models,
//! five workloads, five figures each), predicted with the shipped calibration
//! (`sim/calibrations/rtx5080-seed-server.toml`, fitted by `sim calibrate` to Phases 4–5
//! only), and the log's headline phase effects.
//!
//! ```text
//! cargo run --release -p infer-sim --example log_check [-- KEY=VALUE …]
//! ```
//! Extra `KEY=VALUE` overrides apply to every run (try a mechanism against the log, e.g.
//! `sim.logits=all`). Prints every figure, the median |error| per metric over the held-out
//! Phases 6–8, and each headline effect: published change, predicted change, whether the
//! sign matches and the prediction is within a factor of two of it.

use infer_sim::calibration::CalibrationFile;
use infer_sim::fit::{self, Fit, Row, FIT_METRICS};

const PUBLISHED: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/calibrations/rtx5080-benchmark-log.toml"
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
    let extra: Vec<String> = std::env::args().skip(1).collect();
    let mut targets = fit::load_published(PUBLISHED).unwrap_or_else(|e| panic!("{e}"));
    if !extra.is_empty() {
        for t in &mut targets {
            let mut scenario = t.setup.scenario.clone();
            let text = toml::to_string(&scenario.resolved).expect("a scenario serialises");
            scenario = infer_core::workload::Scenario::parse(&t.setup.file, &text, &extra)
                .unwrap_or_else(|e| panic!("{e}"));
            t.setup = infer_sim::prepare(&t.setup.file, scenario).unwrap_or_else(|e| panic!("{e}"));
        }
    }
    let text = std::fs::read_to_string(SHIPPED).expect("the shipped calibration");
    let file = CalibrationFile::parse(SHIPPED, &text).unwrap_or_else(|e| panic!("{e}"));
    // `[sim]` overrides given on the command line apply on top (`Target::predict`).
    let fit = Fit::of_file(&file);
    let rows = fit::rows(&mut targets, &fit);

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
    for (m, e) in fit::median_errors(&rows, true) {
        println!("  {m:<18} {:>4.0} %", e.unwrap_or(f64::NAN));
    }
    println!("fitted (Phases 4-5), median |error| per metric:");
    for (m, e) in fit::median_errors(&rows, false) {
        println!("  {m:<18} {:>4.0} %", e.unwrap_or(f64::NAN));
    }

    println!(
        "\nheadline effects: {:<34} {:<18} {:>10} {:>10}  sign  within 2x",
        "", "metric", "published", "predicted"
    );
    let (mut right_sign, mut within, mut total) = (0, 0, 0);
    for (workload, a, b) in HEADLINES {
        for model in ["llama-3.2-3b", "qwen3-4b", "gemma-3-1b"] {
            for metric in FIT_METRICS {
                let find = |phase: u32| -> &Row {
                    let label = format!("P{phase} {workload} {model}");
                    rows.iter()
                        .find(|r| r.label == label && r.metric == metric)
                        .unwrap_or_else(|| panic!("no row {label} {metric}"))
                };
                let (before, after) = (find(a), find(b));
                let published = after.measured / before.measured - 1.0;
                let predicted = after.predicted / before.predicted - 1.0;
                let sign = published.signum() == predicted.signum();
                let ratio = predicted / published;
                let close = sign && (0.5..=2.0).contains(&ratio);
                total += 1;
                right_sign += sign as usize;
                within += close as usize;
                println!(
                    "P{b} vs P{a} {workload:<20} {model:<13} {metric:<18} {:>+9.0}% {:>+9.0}%  {:<4}  {}",
                    published * 100.0,
                    predicted * 100.0,
                    if sign { "yes" } else { "NO" },
                    if close { "yes" } else { "no" }
                );
            }
        }
    }
    println!(
        "headline effects with the right sign: {right_sign} of {total}; within a factor of two: \
         {within} of {total}"
    );
}
