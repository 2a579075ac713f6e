//! A cost model checked step by step against a step log (`engine serve --step-log FILE`):
//! which steps it prices wrong, binned by what they held.
//!
//! ```text
//! cargo run --release -p infer-engine --example step_check -- STEPS.csv SCENARIO.toml [KEY=VALUE …]
//! ```
//! SCENARIO and the overrides give the cost model exactly as `sim run` would build it (its
//! calibration file with `sim.calibration=FILE`).

use std::path::Path;

use anyhow::{Context, Result};
use infer_engine::server::step_log;
use infer_engine::tools::verify::step_fidelity;

/// The steps of one bin: how many, and their summed seconds.
#[derive(Default)]
struct Bin {
    steps: usize,
    measured_s: f64,
    predicted_s: f64,
    forward_s: f64,
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [steps, scenario, overrides @ ..] = args.as_slice() else {
        anyhow::bail!("usage: step_check STEPS.csv SCENARIO.toml [KEY=VALUE …]");
    };
    let steps = step_log::read(Path::new(steps))?;
    let setup = infer_sim::load(scenario, overrides).with_context(|| scenario.clone())?;
    let cost = setup.cost.as_ref();
    println!("{}", cost.describe());
    println!(
        "{:<8} {:>6} {:>11} {:>12} {:>14}",
        "kind", "steps", "measured s", "predicted s", "median error%"
    );
    for f in step_fidelity(&steps, cost) {
        println!(
            "{:<8} {:>6} {:>11.2} {:>12.2} {:>+14.0}",
            f.kind, f.steps, f.measured_s, f.predicted_s, f.median_error_pct
        );
    }
    // Every step by kind, decodes (bins of up to 1, 2, 4, …) and mean context per decode.
    println!(
        "\n{:<8} {:>7} {:>9} {:>6} {:>12} {:>13} {:>10} {:>7}",
        "kind",
        "decodes",
        "ctx/seq",
        "steps",
        "measured ms",
        "predicted ms",
        "forward ms",
        "error%"
    );
    let mut bins: std::collections::BTreeMap<(&str, usize, usize), Bin> = Default::default();
    for r in &steps {
        let s = &r.shape;
        let kind = match (s.prefill_tokens > 0, s.decode_seqs > 0) {
            (false, _) => "decode",
            (true, false) => "prefill",
            (true, true) => "mixed",
        };
        let per_seq = s.decode_context_tokens / s.decode_seqs.max(1);
        // Bins of decodes 0, 1, 2, 4, 8, …: each holds up to its count.
        let decodes = match s.decode_seqs {
            0 => 0,
            n => n.next_power_of_two(),
        };
        let key = (kind, decodes, (per_seq / 256) * 256);
        let e = bins.entry(key).or_default();
        e.steps += 1;
        e.measured_s += r.step_s;
        // The step's mean random pause included, as in the measured step.
        e.predicted_s += cost.step_time(s) + cost.step_jitter();
        e.forward_s += r.forward_s;
    }
    for ((kind, seqs, ctx), b) in bins {
        let (n, m, p, f) = (b.steps, b.measured_s, b.predicted_s, b.forward_s);
        let k = n as f64;
        println!(
            "{kind:<8} {:>7} {:>9} {n:>6} {:>12.1} {:>13.1} {:>10.1} {:>+7.0}",
            format!("<={seqs}"),
            format!("{ctx}+"),
            m / k * 1e3,
            p / k * 1e3,
            f / k * 1e3,
            (p / m - 1.0) * 100.0
        );
    }
    Ok(())
}
