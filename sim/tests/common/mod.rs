//! Shared helpers: load a scenario from the workspace's scenarios/ and simulate it.

#![allow(dead_code)]

use infer_sim::{Setup, SimResult};

pub fn path(name: &str) -> String {
    format!("{}/../scenarios/{name}.toml", env!("CARGO_MANIFEST_DIR"))
}

pub fn setup(name: &str, overrides: &[&str]) -> Setup {
    let o: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    infer_sim::load(&path(name), &o).unwrap_or_else(|e| panic!("{e}"))
}

/// What a replay must reproduce of scenario `name` under `overrides`: the summary as
/// JSON, requests.csv, and each request's workload — when it was sent (to the µs: the clock
/// starts when the warm-ups end, which random step times move), its prompt and output
/// tokens — which a cost model's random draws must not change.
pub fn replay(name: &str, overrides: &[&str]) -> (String, String, Vec<(i64, usize, usize)>) {
    let (r, rows) = infer_sim::run_collect(&setup(name, overrides)).unwrap();
    (
        serde_json::to_string(&r.summary).unwrap(),
        infer_sim::output::requests_csv(&rows.records),
        rows.records
            .iter()
            .map(|r| {
                (
                    (r.start * 1e6).round() as i64,
                    r.prompt_tokens,
                    r.output_tokens,
                )
            })
            .collect(),
    )
}

pub fn run(name: &str, overrides: &[&str]) -> SimResult {
    let s = setup(name, overrides);
    let r = infer_sim::run(&s).unwrap_or_else(|e| panic!("{name} {overrides:?}: {e}"));
    assert_eq!(r.summary.failed, 0, "{name} {overrides:?}: failed requests");
    r
}

/// The log's per-model server settings of Phases 6–8 (batch, blocks), for one workload.
pub fn phase_config(model: &str, workload: &str) -> Vec<String> {
    let (batch, blocks) = match (model, workload) {
        ("qwen3-4b", "prefix_caching") => (16, 1536),
        ("qwen3-4b", _) => (16, 1024),
        _ => (24, 2048),
    };
    vec![
        format!("server.model={model}"),
        format!("server.max_batch_size={batch}"),
        format!("server.num_gpu_blocks={blocks}"),
    ]
}

pub fn with(base: &[String], extra: &[&str]) -> Vec<String> {
    base.iter()
        .cloned()
        .chain(extra.iter().map(|s| s.to_string()))
        .collect()
}

pub fn run_owned(name: &str, overrides: &[String]) -> SimResult {
    let o: Vec<&str> = overrides.iter().map(|s| s.as_str()).collect();
    run(name, &o)
}

pub const SEED_MODELS: [&str; 3] = ["llama-3.2-3b", "qwen3-4b", "gemma-3-1b"];
