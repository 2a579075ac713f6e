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
    /// The sampling parameters `generation_config.json` recommends, which a server applies
    /// where a request leaves them out (vLLM's `--generation-config auto`).
    pub sampling_defaults: SamplingDefaults,
}

/// The sampling parameters a model's `generation_config.json` sets to other than
/// transformers' defaults (vLLM takes the same: `GenerationConfig.to_diff_dict()` of
/// `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`, `max_new_tokens`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SamplingDefaults {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    /// The default `max_tokens` of a chat completion (`max_new_tokens`).
    pub max_tokens: Option<usize>,
}

impl SamplingDefaults {
    /// From a `generation_config.json`'s object, with a warning (naming `file` and the key)
    /// for each value a request could not set, which is left out: such a file still loads,
    /// its eos ids and other defaults used.
    pub fn from_json(json: &Value, file: &str) -> (SamplingDefaults, Vec<String>) {
        let mut warnings = Vec::new();
        // A key absent, null, or at transformers' own default sets nothing.
        let mut number = |key: &str, default: Option<f64>, ok: fn(f64) -> bool| -> Option<f64> {
            let v = json.get(key).filter(|v| !v.is_null())?;
            match v.as_f64() {
                Some(x) if Some(x) == default => None,
                Some(x) if ok(x) => Some(x),
                _ => {
                    warnings.push(format!(
                        "warning: {file}: {key} = {v} is outside what a request may set: not \
                         used as a default"
                    ));
                    None
                }
            }
        };
        let defaults = SamplingDefaults {
            temperature: number("temperature", Some(1.0), |t| (0.0..=2.0).contains(&t))
                .map(|t| t as f32),
            top_p: number("top_p", Some(1.0), |p| p > 0.0 && p <= 1.0).map(|p| p as f32),
            top_k: number("top_k", Some(50.0), |k| k.fract() == 0.0 && k >= -1.0)
                .map(|k| k.max(0.0) as usize),
            min_p: number("min_p", None, |m| (0.0..=1.0).contains(&m)).map(|m| m as f32),
            repetition_penalty: number("repetition_penalty", Some(1.0), |r| {
                (r as f32).is_finite() && r as f32 >= f32::MIN_POSITIVE
            })
            .map(|r| r as f32),
            max_tokens: number("max_new_tokens", None, |n| n.fract() == 0.0 && n >= 1.0)
                .map(|n| n as usize),
        };
        (defaults, warnings)
    }

    pub fn is_empty(&self) -> bool {
        *self == SamplingDefaults::default()
    }

    /// `temperature=0.6, top_p=0.9`: what is set.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        let mut put = |k: &str, v: Option<String>| parts.extend(v.map(|v| format!("{k}={v}")));
        put("temperature", self.temperature.map(|v| v.to_string()));
        put("top_p", self.top_p.map(|v| v.to_string()));
        put("top_k", self.top_k.map(|v| v.to_string()));
        put("min_p", self.min_p.map(|v| v.to_string()));
        put(
            "repetition_penalty",
            self.repetition_penalty.map(|v| v.to_string()),
        );
        put("max_tokens", self.max_tokens.map(|v| v.to_string()));
        parts.join(", ")
    }
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

    let generation = generation_config(dir)?;
    let gen_file = dir.join("generation_config.json").display().to_string();
    let mut eos_token_ids = match generation.as_ref().and_then(|g| g.get("eos_token_id")) {
        Some(v) => super::config::token_id_list(v).with_context(|| format!("in {gen_file}"))?,
        None => Vec::new(),
    };
    let sampling_defaults = match &generation {
        Some(g) => {
            let (defaults, warnings) = SamplingDefaults::from_json(g, &gen_file);
            for w in warnings {
                eprintln!("{w}");
            }
            defaults
        }
        None => SamplingDefaults::default(),
    };
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
        sampling_defaults,
    })
}

/// `generation_config.json`, when the file exists.
fn generation_config(dir: &Path) -> Result<Option<Value>> {
    let path = dir.join("generation_config.json");
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let json: Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", path.display()))?;
    Ok(Some(json))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// What vLLM takes from a generation config: the listed keys set to other than
    /// transformers' own defaults (`to_diff_dict`); `max_new_tokens` as `max_tokens`.
    #[test]
    fn sampling_defaults_are_the_keys_set_off_transformers_defaults() {
        let llama = json!({"do_sample": true, "temperature": 0.6, "top_p": 0.9,
                           "bos_token_id": 128000, "eos_token_id": [128001, 128009]});
        let d = SamplingDefaults::from_json(&llama, "g.json").0;
        assert_eq!(
            (d.temperature, d.top_p, d.top_k),
            (Some(0.6), Some(0.9), None)
        );
        assert_eq!(d.describe(), "temperature=0.6, top_p=0.9");
        let at_defaults = json!({"temperature": 1.0, "top_p": 1.0, "top_k": 50,
                                 "repetition_penalty": 1.0, "min_p": null});
        assert!(SamplingDefaults::from_json(&at_defaults, "g.json")
            .0
            .is_empty());
        let more = json!({"top_k": 20, "min_p": 0.0, "repetition_penalty": 1.05,
                          "max_new_tokens": 2048});
        let d = SamplingDefaults::from_json(&more, "g.json").0;
        assert_eq!(d.top_k, Some(20));
        assert_eq!(d.min_p, Some(0.0));
        assert_eq!(d.repetition_penalty, Some(1.05));
        assert_eq!(d.max_tokens, Some(2048));
        // A value a request could not set is left out, with a warning naming file and key;
        // the others stand.
        for bad in [
            json!({"temperature": 3}),
            json!({"top_k": 1.5}),
            json!({"top_p": 0}),
        ] {
            let mut with_good = bad.clone();
            with_good["min_p"] = json!(0.1);
            let (d, warnings) = SamplingDefaults::from_json(&with_good, "g.json");
            let key = bad.as_object().unwrap().keys().next().unwrap().clone();
            assert_eq!(d.describe(), "min_p=0.1", "{bad}");
            assert_eq!(warnings.len(), 1);
            assert!(
                warnings[0].contains("g.json: ") && warnings[0].contains(&key),
                "{warnings:?}"
            );
        }
    }
}
