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
