//! How often the seeds' part of an interval holds on the simulator itself:
//! `cargo run --release -p infer-sim --example seed_coverage [-- SCENARIO… --bases K]`.
//!
//! An interval without calibration errors (a profiled cost model, an uncalibrated pair) is
//! the workload's randomness alone, and claims that another draw of the workload lands
//! inside 90% of the time. This checks the claim where it can be checked exactly: for `K`
//! base seeds (default 200) of each scenario (default: four of the five seed workloads;
//! baseline's figures do not move with the seed: fixed lengths, one request at a time), the interval
//! of 5 seeds from that base is built as `sim run` builds it (the calibration's recorded
//! errors and coefficient draws left out, so the seeds are all there is), and the figures of
//! a fresh seed, used by no interval, are tested against it. Beside it, the rule before
//! (a normal of the seeds' spread around the given seed's figure, over 41 points whose
//! interpolated 5th and 95th percentiles were the normal's at 2.5/41 and 38.5/41: ±1.546
//! standard deviations).

use std::collections::BTreeMap;

use infer_sim::interval::{seeded_summaries, RunIntervals};

/// The figures the calibrations fit, and end-to-end latency.
const KEYS: [&str; 7] = [
    "output_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "median_e2el_ms",
    "p99_e2el_ms",
];

const SEEDS: usize = 5;

fn main() {
    let mut scenarios = Vec::new();
    let mut bases = 200u64;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--bases" => bases = args.next().and_then(|k| k.parse().ok()).expect("--bases K"),
            _ => scenarios.push(a),
        }
    }
    if scenarios.is_empty() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../scenarios");
        for s in [
            "continuous_batching",
            "paged_attention",
            "chunked_prefill",
            "prefix_caching",
        ] {
            scenarios.push(format!("{dir}/{s}.toml"));
        }
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    // The standard normal's quantile at 38.5/41, by bisection.
    let old_reach = {
        let (mut lo, mut hi) = (0.0f64, 4.0f64);
        for _ in 0..100 {
            let mid = 0.5 * (lo + hi);
            if 0.5 * libm::erfc(-mid / std::f64::consts::SQRT_2) < 38.5 / 41.0 {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        lo
    };
    // (inside now, inside before, figures) per key, over every scenario.
    let mut tally: BTreeMap<&str, (usize, usize, usize)> = BTreeMap::new();
    for file in &scenarios {
        let mut setup = infer_sim::load(file, &[]).unwrap_or_else(|e| panic!("{e}"));
        if let Some(mut cal) = setup.calibration.clone() {
            cal.draws = std::sync::Arc::from([]);
            cal.residuals = std::sync::Arc::from([]);
            setup
                .set_calibration(cal)
                .expect("the same coefficients fit");
        }
        let first = setup.scenario.workload.seed;
        let (mut now, mut before, mut of) = (0, 0, 0);
        for b in 0..bases {
            let mut base = setup.clone();
            // Bases 100 apart: no two share a seed, nor any with a fresh seed.
            base.scenario.workload.seed = first.wrapping_add(100 * b);
            let central = infer_sim::run(&base).expect("runs").summary;
            let others = seeded_summaries(&base, SEEDS, cores).expect("runs");
            let mut fresh = base.clone();
            fresh.scenario.workload.seed = first.wrapping_add(100 * b + 50);
            let fresh = infer_sim::run(&fresh).expect("runs").summary;
            let run = RunIntervals::of_summaries(&central, &others, &[], None);
            let figure = |s: &infer_core::metrics::Summary, key: &str| {
                s.entries().into_iter().find(|(k, _)| k == key).map(|e| e.1)
            };
            for key in KEYS {
                let (Some(iv), Some(x)) = (run.get(key), figure(&fresh, key)) else {
                    continue;
                };
                // The rule before: ±1.546 sd of the seeds' log figures around the given one.
                let logs: Vec<f64> = std::iter::once(0.0)
                    .chain(
                        others
                            .iter()
                            .filter_map(|o| figure(o, key))
                            .map(|v| (v / iv.value).ln()),
                    )
                    .collect();
                let n = logs.len() as f64;
                let mean = logs.iter().sum::<f64>() / n;
                let sd = (logs.iter().map(|l| (l - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt();
                let old_in = ((x / iv.value).ln()).abs() <= old_reach * sd;
                let t = tally.entry(key).or_default();
                t.0 += usize::from(iv.contains(x));
                t.1 += usize::from(old_in);
                t.2 += 1;
                now += usize::from(iv.contains(x));
                before += usize::from(old_in);
                of += 1;
            }
        }
        let name = std::path::Path::new(file)
            .file_stem()
            .map_or(file.clone(), |s| s.to_string_lossy().into_owned());
        println!(
            "{name}: {now} of {of} inside ({:.0}%), before {before} ({:.0}%)",
            100.0 * now as f64 / of as f64,
            100.0 * before as f64 / of as f64
        );
    }
    println!("\n| metric | inside | before | of |\n|---|---:|---:|---:|");
    let (mut now, mut before, mut of) = (0, 0, 0);
    for (key, (n, b, o)) in &tally {
        let pct = |x: usize| 100.0 * x as f64 / *o as f64;
        println!(
            "| {key} | {n} ({:.0}%) | {b} ({:.0}%) | {o} |",
            pct(*n),
            pct(*b)
        );
        now += n;
        before += b;
        of += o;
    }
    let pct = |x: usize| 100.0 * x as f64 / of as f64;
    println!(
        "| **pooled** | **{now} ({:.0}%)** | {before} ({:.0}%) | {of} |",
        pct(now),
        pct(before)
    );
}
