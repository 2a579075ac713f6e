//! The benchmark log's tables, measured on this machine: the five seed workloads against
//! servers in the configurations of Phases 4–8 (and 9 on a GPU).
//!
//! `cargo run --release -p infer-engine --example phase_table [-- --quick] [--model M]
//!  [--device cuda] [--out DIR]`
//!
//! Each phase adds one technique, as in the log: P4 static batching + contiguous KV (8 slots
//! of 4,096 tokens = the 32,768-token budget), P5 continuous batching, P6 paged KV (batch 24
//! over 2,048 blocks of 16), P7 chunked prefill (512-token budget), P8 prefix caching, and on
//! a GPU P9: P8 with decode steps replayed from CUDA graphs.
//! Prints one `name: value unit` line per figure, then the tables in the log's layout, and
//! writes every run directory under `DIR` (default `runs/phase-table/`).

use std::path::PathBuf;

use infer_core::metrics::Summary;
use infer_core::{BatchingMode, KvBackend, SchedulerConfig};
use infer_engine::loadgen::{self, BenchOptions};
use infer_engine::server::{spawn_local, ServeConfig};
use infer_engine::Device;

const WORKLOADS: [&str; 5] = [
    "baseline",
    "continuous_batching",
    "paged_attention",
    "chunked_prefill",
    "prefix_caching",
];

fn phases() -> Vec<(&'static str, SchedulerConfig)> {
    let p8 = SchedulerConfig::default();
    let p7 = SchedulerConfig {
        prefix_caching: false,
        ..p8.clone()
    };
    let p6 = SchedulerConfig {
        chunked_prefill: false,
        ..p7.clone()
    };
    let p5 = SchedulerConfig {
        kv_cache_backend: KvBackend::Contiguous,
        max_batch_size: 8,
        ..p6.clone()
    };
    let p4 = SchedulerConfig {
        batching_mode: BatchingMode::Static,
        ..p5.clone()
    };
    vec![("P4", p4), ("P5", p5), ("P6", p6), ("P7", p7), ("P8", p8)]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1).cloned())
    };
    let device = Device::parse(flag("--device").as_deref().unwrap_or("cpu"))?;
    let model = flag("--model").unwrap_or_else(|| "builtin:tiny".to_string());
    let root = PathBuf::from(flag("--out").unwrap_or_else(|| "runs/phase-table".to_string()));
    let mut runs: Vec<(&str, SchedulerConfig, bool)> =
        phases().into_iter().map(|(p, s)| (p, s, false)).collect();
    if device != Device::Cpu {
        let p8 = runs.last().expect("P8").1.clone();
        runs.push(("P9", p8, true));
    }
    let mut results: Vec<(&str, &str, Summary)> = Vec::new();
    for (phase, sched, cuda_graphs) in runs {
        let cfg = ServeConfig {
            sched,
            device,
            cuda_graphs,
            ..ServeConfig::new(&model)
        };
        let (addr, server) = spawn_local(cfg).await?;
        for w in WORKLOADS {
            let path = format!("{}/../scenarios/{w}.toml", env!("CARGO_MANIFEST_DIR"));
            let mut opts = BenchOptions::new(&format!("http://{addr}"), path);
            if quick {
                opts.overrides.push("workload.num_requests=12".into());
            }
            opts.out = Some(root.join(phase).join(w));
            let r = loadgen::run(&opts).await?;
            let s = r.summary;
            for (metric, value, unit) in figures(&s) {
                println!(
                    "phase_table[workload={w},phase={phase},metric={metric}]: {value:.3} {unit}"
                );
            }
            results.push((phase, w, s));
        }
        server.stop().await;
    }
    println!();
    for w in WORKLOADS {
        println!("### {w}\n");
        let cols: Vec<&(&str, &str, Summary)> = results.iter().filter(|r| r.1 == w).collect();
        let header: Vec<String> = cols.iter().map(|c| c.0.to_string()).collect();
        println!("| Metric             | {} |", header.join(" | "));
        println!(
            "|--------------------|{}|",
            vec!["------:"; cols.len()].join("|")
        );
        type Cell = fn(&Summary) -> String;
        let rows: [(&str, Cell); 7] = [
            ("Throughput (tok/s)", |s| {
                format!("{:.1}", s.output_throughput)
            }),
            ("TTFT P50 (ms)", |s| format!("{:.0}", s.ttft.median * 1e3)),
            ("TTFT P99 (ms)", |s| format!("{:.0}", s.ttft.p99 * 1e3)),
            ("ITL P50 (ms)", |s| format!("{:.1}", s.itl.median * 1e3)),
            ("ITL P99 (ms)", |s| format!("{:.1}", s.itl.p99 * 1e3)),
            ("Latency P50 (s)", |s| format!("{:.3}", s.e2el.median)),
            ("Errors", |s| s.failed.to_string()),
        ];
        for (name, cell) in rows {
            let cells: Vec<String> = cols.iter().map(|c| cell(&c.2)).collect();
            println!("| {name:<18} | {} |", cells.join(" | "));
        }
        println!();
    }
    Ok(())
}

fn figures(s: &Summary) -> Vec<(&'static str, f64, &'static str)> {
    vec![
        ("output_throughput", s.output_throughput, "tok/s"),
        ("ttft_p50_ms", s.ttft.median * 1e3, "ms"),
        ("ttft_p99_ms", s.ttft.p99 * 1e3, "ms"),
        ("itl_p50_ms", s.itl.median * 1e3, "ms"),
        ("itl_p99_ms", s.itl.p99 * 1e3, "ms"),
        ("e2e_p50_s", s.e2el.median, "s"),
        ("failed", s.failed as f64, "requests"),
        ("prefix_cache_hit_rate", s.prefix_cache_hit_rate, "fraction"),
    ]
}
