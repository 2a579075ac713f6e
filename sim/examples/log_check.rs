//! Predicted vs published: the benchmark log's Phases 6–8 on the RTX 5080, three models,
//! five workloads, five metrics. `cargo run --release -p infer-sim --example log_check`.
//!
//! Only the Phase 8 baseline TTFT/ITL P50 were used for calibration; every other row is a
//! prediction. Prints one row per figure and the median absolute error per metric.

const MODELS: [&str; 3] = ["llama-3.2-3b", "qwen3-4b", "gemma-3-1b"];
const WORKLOADS: [&str; 5] = [
    "baseline",
    "continuous_batching",
    "paged_attention",
    "chunked_prefill",
    "prefix_caching",
];
const METRICS: [&str; 5] = [
    "throughput tok/s",
    "TTFT P50 ms",
    "TTFT P99 ms",
    "ITL P50 ms",
    "ITL P99 ms",
];

/// PUBLISHED[phase - 6][workload][model] = [throughput, TTFT P50, TTFT P99, ITL P50, ITL P99].
const PUBLISHED: [[[[f64; 5]; 3]; 5]; 3] = [
    [
        [
            [84.1, 40., 41., 12., 13.],
            [62.9, 48., 51., 16., 20.],
            [85.4, 29., 39., 12., 15.],
        ],
        [
            [340.4, 133., 202., 35., 85.],
            [258.8, 190., 3951., 47., 98.],
            [284.5, 146., 1215., 53., 83.],
        ],
        [
            [455.2, 3736., 12278., 45., 90.],
            [317.4, 8286., 22182., 44., 92.],
            [325.2, 4637., 16463., 67., 89.],
        ],
        [
            [22.5, 39099., 285209., 1384., 1562.],
            [16.8, 174046., 393755., 1241., 2203.],
            [276.6, 1318., 12314., 77., 119.],
        ],
        [
            [253.2, 10214., 22173., 83., 208.],
            [29.1, 127742., 278685., 709., 1673.],
            [309.6, 6673., 16762., 73., 100.],
        ],
    ],
    [
        [
            [84.7, 37., 38., 12., 13.],
            [47.2, 45., 60., 15., 37.],
            [86.0, 28., 30., 12., 14.],
        ],
        [
            [345.8, 128., 220., 34., 84.],
            [263.7, 175., 3624., 45., 94.],
            [289.5, 140., 1131., 51., 78.],
        ],
        [
            [469.0, 3618., 11942., 44., 86.],
            [321.5, 8110., 21844., 44., 90.],
            [327.0, 4605., 16347., 67., 86.],
        ],
        [
            [219.3, 3464., 17975., 90., 209.],
            [148.1, 15071., 32236., 92., 207.],
            [272.6, 1525., 12708., 78., 103.],
        ],
        [
            [299.2, 8092., 18189., 70., 163.],
            [206.2, 18157., 36053., 70., 171.],
            [309.4, 6787., 16903., 73., 96.],
        ],
    ],
    [
        [
            [86.4, 37., 38., 12., 13.],
            [64.6, 45., 48., 15., 18.],
            [86.8, 26., 31., 11., 14.],
        ],
        [
            [348.7, 117., 206., 34., 80.],
            [264.9, 175., 3490., 45., 90.],
            [282.3, 154., 1248., 53., 79.],
        ],
        [
            [476.7, 3412., 11614., 44., 84.],
            [325.0, 7915., 21482., 44., 82.],
            [315.7, 4735., 16841., 69., 97.],
        ],
        [
            [220.7, 3327., 17770., 90., 221.],
            [148.7, 14827., 32062., 92., 194.],
            [276.0, 1348., 12393., 77., 102.],
        ],
        [
            [331.3, 5833., 15315., 68., 87.],
            [221.6, 16059., 32515., 70., 92.],
            [309.4, 6314., 16671., 74., 90.],
        ],
    ],
];

fn main() {
    let mut errors: Vec<Vec<f64>> = vec![Vec::new(); METRICS.len()];
    println!(
        "{:<6} {:<20} {:<13} {:<17} {:>10} {:>10} {:>8}",
        "phase", "workload", "model", "metric", "published", "predicted", "error%"
    );
    for (pi, phase) in (6..=8).enumerate() {
        for (wi, w) in WORKLOADS.iter().enumerate() {
            for (mi, m) in MODELS.iter().enumerate() {
                let s = simulate(phase, w, m);
                let predicted = [
                    s.output_throughput,
                    s.ttft.median * 1e3,
                    s.ttft.p99 * 1e3,
                    s.itl.median * 1e3,
                    s.itl.p99 * 1e3,
                ];
                for k in 0..METRICS.len() {
                    let published = PUBLISHED[pi][wi][mi][k];
                    let err = (predicted[k] - published) / published * 100.0;
                    errors[k].push(err.abs());
                    println!(
                        "{:<6} {:<20} {:<13} {:<17} {:>10.1} {:>10.1} {:>+8.0}",
                        phase, w, m, METRICS[k], published, predicted[k], err
                    );
                }
            }
        }
    }
    println!();
    for (k, e) in errors.iter_mut().enumerate() {
        e.sort_by(f64::total_cmp);
        println!(
            "median_abs_error_pct[{}]: {:.0} %",
            METRICS[k],
            e[e.len() / 2]
        );
    }
}

fn simulate(phase: u32, workload: &str, model: &str) -> infer_core::metrics::Summary {
    let (batch, blocks) = match (model, workload) {
        ("qwen3-4b", "prefix_caching") => (16, 1536),
        ("qwen3-4b", _) => (16, 1024),
        _ => (24, 2048),
    };
    let o = vec![
        format!("server.model={model}"),
        format!("server.max_batch_size={batch}"),
        format!("server.num_gpu_blocks={blocks}"),
        format!("server.chunked_prefill={}", phase >= 7),
        format!("server.prefix_caching={}", phase >= 8),
    ];
    let file = format!(
        "{}/../scenarios/{workload}.toml",
        env!("CARGO_MANIFEST_DIR")
    );
    let setup = infer_sim::load(&file, &o).unwrap_or_else(|e| panic!("{e}"));
    infer_sim::run(&setup).summary
}
