//! Helpers shared by the integration tests: tiny generated models, a greedy driver, and a
//! JSON POST to a server.
#![allow(dead_code)]

use anyhow::Result;
use candle_core::DType;
use infer_engine::tools::make_model::{make_model, ModelSpec};
use infer_engine::{load_model_dir, Arch, Device, LoadedModel};
use std::path::PathBuf;

/// A generated model in a fresh temporary directory (kept alive by the returned guard).
pub fn tiny_model(spec: &ModelSpec) -> Result<(tempfile::TempDir, PathBuf)> {
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path().join(spec.arch.name());
    make_model(spec, &dir)?;
    Ok((tmp, dir))
}

pub fn load(dir: &std::path::Path) -> Result<LoadedModel> {
    load_model_dir(dir, Some(DType::F32), Device::Cpu)
}

/// 2 layers, hidden 64, GQA 4:2; larger weights than the default so logits have clear
/// winners and greedy comparisons are not decided by float noise.
pub fn spec(arch: Arch) -> ModelSpec {
    ModelSpec {
        init_std: 0.08,
        seed: 11,
        ..ModelSpec::new(arch)
    }
}

/// Deterministic pseudo-random token ids in `[first, vocab)`.
pub fn prompt(seed: u64, len: usize, vocab: usize) -> Vec<u32> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (10 + (x >> 33) % (vocab as u64 - 10)) as u32
        })
        .collect()
}

/// max |a - b| / max |b|.
pub fn rel_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
    let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    diff / scale
}

/// POST `body` as JSON: the status and the JSON answer (null when the body is not JSON).
pub async fn post(
    client: &reqwest::Client,
    url: &str,
    body: impl serde::Serialize,
) -> (u16, serde_json::Value) {
    let r = client.post(url).json(&body).send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(serde_json::Value::Null))
}
