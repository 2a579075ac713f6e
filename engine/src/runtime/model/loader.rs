//! Loading a Hugging Face model directory (or `builtin:tiny`) into a ready model.

use super::config::ModelConfig;
use super::dispatch::Model;
use super::weights::WeightStore;
use crate::runtime::backend::Device;
use crate::runtime::tokenizer::TextTokenizer;
use anyhow::{bail, Context, Result};
use candle_core::DType;
use serde_json::Value;
use std::path::{Path, PathBuf};

pub struct LoadedModel {
    pub dir: PathBuf,
    pub config: ModelConfig,
    pub model: Model,
    pub tokenizer: TextTokenizer,
    /// Token ids that end generation: `generation_config.json`, `config.json` and the
    /// tokenizer's eos token, merged.
    pub eos_token_ids: Vec<u32>,
}

/// Loads `spec`: a model directory path, or `builtin:tiny` (built into a cache on first use).
/// `dtype`: the CPU computes in f32 (candle's CPU backend has no bf16 matmul); CUDA in bf16.
/// `None` picks the device's; asking for another is an error. Weights stored in any of
/// f32/bf16/f16 are converted on load.
pub fn load_model(spec: &str, dtype: Option<DType>, device: Device) -> Result<LoadedModel> {
    let dir = crate::tools::builtin::resolve(spec)?;
    load_model_dir(&dir, dtype, device)
}

pub fn load_model_dir(dir: &Path, dtype: Option<DType>, device: Device) -> Result<LoadedModel> {
    if !dir.is_dir() {
        anyhow::bail!("model directory {} does not exist", dir.display());
    }
    let config_path = dir.join("config.json");
    if !config_path.exists() {
        anyhow::bail!("missing model config {}", config_path.display());
    }
    let config = ModelConfig::from_file(&config_path)?;
    // The CPU holds weights in f32 or bf16 (by default as the checkpoint has them, like
    // vLLM's `--dtype auto`; f16 checkpoints widen to f32); CUDA is bf16.
    let weights = match (device, dtype) {
        (Device::Cpu, None) if config.dtype == Some(DType::BF16) => DType::BF16,
        (Device::Cpu, None) => DType::F32,
        (Device::Cpu, Some(d @ (DType::F32 | DType::BF16))) => d,
        (Device::Cuda(_), None | Some(DType::BF16)) => DType::BF16,
        (_, Some(asked)) => bail!("--dtype {asked:?}: not supported on {device}"),
    };
    let tokenizer = TextTokenizer::from_dir(dir)?;
    let weights = WeightStore::open(dir, weights)?;
    let model = Model::load(&config, &weights, device)
        .with_context(|| format!("loading model weights from {}", dir.display()))?;

    let mut eos_token_ids = generation_eos(dir)?;
    eos_token_ids.extend(&config.eos_token_ids);
    if let Some(id) = tokenizer.eos_token().and_then(|t| tokenizer.token_to_id(t)) {
        eos_token_ids.push(id);
    }
    eos_token_ids.sort_unstable();
    eos_token_ids.dedup();
    Ok(LoadedModel {
        dir: dir.to_path_buf(),
        config,
        model,
        tokenizer,
        eos_token_ids,
    })
}

/// `generation_config.json`'s `eos_token_id` (an int or a list), when the file exists.
fn generation_eos(dir: &Path) -> Result<Vec<u32>> {
    let path = dir.join("generation_config.json");
    if !path.exists() {
        return Ok(vec![]);
    }
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let json: Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", path.display()))?;
    match json.get("eos_token_id") {
        Some(v) => {
            super::config::token_id_list(v).with_context(|| format!("in {}", path.display()))
        }
        None => Ok(vec![]),
    }
}
