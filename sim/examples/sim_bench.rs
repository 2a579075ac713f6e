//! Simulator speed: `cargo run --release -p infer-sim --example sim_bench`.
//!
//! Prints `sim_wall_s[case]: value s` and `sim_requests_per_s[case]: value req/s` for
//! (a) the five seed workloads, (b) 100,000 Poisson requests on one replica and (c) the
//! 8,000-request, 8-replica KubeAI scenario; then the process's peak resident memory.
//! Targets: (b) under 5 s, (c) under 2 s.

use std::time::Instant;

use infer_core::workload::Scenario;

fn scenario_path(name: &str) -> String {
    format!("{}/../scenarios/{name}.toml", env!("CARGO_MANIFEST_DIR"))
}

fn bench(case: &str, file: &str, text: &str, overrides: &[&str]) {
    let o: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    let scenario = Scenario::parse(file, text, &o).unwrap_or_else(|e| panic!("{e}"));
    let setup = infer_sim::prepare(file, scenario).unwrap_or_else(|e| panic!("{e}"));
    let t = Instant::now();
    let r = infer_sim::run(&setup).expect("the run ends");
    let wall = t.elapsed().as_secs_f64();
    let n = r.summary.completed + r.summary.failed;
    println!("sim_wall_s[{case}]: {wall:.3} s");
    println!("sim_requests_per_s[{case}]: {:.0} req/s", n as f64 / wall);
}

fn bench_file(case: &str, name: &str, overrides: &[&str]) {
    let file = scenario_path(name);
    let text = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{file}: {e}"));
    bench(case, &file, &text, overrides);
}

/// Poisson requests on one H100 replica of Llama-3.1-8B (about 30 in flight); 100,000 here.
const POISSON_100K: &str = include_str!("poisson_h100.toml");

fn main() {
    for w in [
        "baseline",
        "continuous_batching",
        "paged_attention",
        "chunked_prefill",
        "prefix_caching",
    ] {
        bench_file(w, w, &[]);
    }
    bench("poisson_100k", "poisson_100k.toml", POISSON_100K, &[]);
    bench_file("kubeai_8x_8000", "kubeai_prefix_routing", &[]);
    if let Some(kb) = peak_rss_kb() {
        println!("sim_peak_rss_mb[all]: {:.1} MB", kb as f64 / 1024.0);
    }
}

/// VmHWM from /proc (Linux only).
fn peak_rss_kb() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}
