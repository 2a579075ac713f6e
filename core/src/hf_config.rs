//! How a Hugging Face `config.json` reads where it is silent or nested, as transformers 5.25
//! reads it. The engine's model loader and the simulator's reader of a model directory both
//! go through here, so the model a scenario simulates is the model the engine serves.

use serde_json::Value;

/// What transformers' config class of a model family assumes for a key `config.json`
/// leaves out.
#[derive(Debug, Clone, PartialEq)]
pub struct FamilyDefaults {
    /// Shape keys (`vocab_size`, `hidden_size`, ...) where the class's defaults are relied
    /// on (a multimodal Gemma 3's `text_config` leaves them out); elsewhere every published
    /// config gives them and they are required.
    pub shape: &'static [(&'static str, usize)],
    pub max_position_embeddings: usize,
    /// `None`: as many as query heads.
    pub num_kv_heads: Option<usize>,
    /// `None`: `hidden_size / num_attention_heads`.
    pub head_dim: Option<usize>,
    pub rms_norm_eps: f64,
    /// Of the global layers.
    pub rope_theta: f64,
    pub tie_word_embeddings: bool,
    /// The window when `sliding_window` is absent (`null` is none), for the families that
    /// have one.
    pub sliding_window: Option<usize>,
    /// Qwen's first sliding layer when `max_window_layers` is absent.
    pub max_window_layers: usize,
}

impl FamilyDefaults {
    /// The default of shape key `key`, where the family has one.
    pub fn shape(&self, key: &str) -> Option<usize> {
        self.shape.iter().find(|(k, _)| *k == key).map(|&(_, v)| v)
    }
}

/// The defaults of the family `model_type` names (`llama`, `qwen2`, `qwen3`, `mistral`,
/// `gemma3_text` or `gemma3`, `phi3`); any other family gets Llama's.
pub fn family_defaults(model_type: &str) -> FamilyDefaults {
    let llama = FamilyDefaults {
        shape: &[],
        max_position_embeddings: 2048,
        num_kv_heads: None,
        head_dim: None,
        rms_norm_eps: 1e-6,
        rope_theta: 10_000.0,
        tie_word_embeddings: false,
        sliding_window: None,
        max_window_layers: 0,
    };
    let qwen2 = FamilyDefaults {
        max_position_embeddings: 32768,
        num_kv_heads: Some(32),
        sliding_window: Some(4096),
        max_window_layers: 28,
        ..llama.clone()
    };
    match model_type {
        "qwen2" => qwen2,
        "qwen3" => FamilyDefaults {
            head_dim: Some(128),
            ..qwen2
        },
        "mistral" => FamilyDefaults {
            max_position_embeddings: 131072,
            num_kv_heads: Some(8),
            sliding_window: Some(4096),
            ..llama
        },
        "gemma3" | "gemma3_text" => FamilyDefaults {
            shape: &[
                ("vocab_size", 262208),
                ("hidden_size", 2304),
                ("intermediate_size", 9216),
                ("num_hidden_layers", 26),
                ("num_attention_heads", 8),
            ],
            max_position_embeddings: 131072,
            num_kv_heads: Some(4),
            head_dim: Some(256),
            rope_theta: 1_000_000.0,
            tie_word_embeddings: true,
            sliding_window: Some(4096),
            ..llama
        },
        "phi3" => FamilyDefaults {
            max_position_embeddings: 4096,
            rms_norm_eps: 1e-5,
            ..llama
        },
        _ => llama,
    }
}

/// A multimodal Gemma 3 (`Gemma3ForConditionalGeneration`: gemma-3-4b/12b/27b-it) read as
/// its text model, as vLLM serves it to text requests: the keys of its `text_config`,
/// overridden by the top level's where it has them (EOS ids and dtype, which transformers'
/// generation config and vLLM take from there), tied as the top level says (transformers
/// ties by the outer config, default true), `model_type` `gemma3_text`. `None` for any
/// other config.
pub fn multimodal_text_config(j: &Value) -> Option<Value> {
    let gemma3 = j.get("model_type").and_then(Value::as_str) == Some("gemma3")
        || j.get("architectures")
            .and_then(Value::as_array)
            .is_some_and(|a| a.iter().any(|x| x == "Gemma3ForConditionalGeneration"));
    let mut text = j.get("text_config").and_then(Value::as_object)?.clone();
    if !gemma3 {
        return None;
    }
    for key in [
        "eos_token_id",
        "bos_token_id",
        "torch_dtype",
        "dtype",
        "quantization_config",
    ] {
        if let Some(v) = j.get(key).filter(|v| !v.is_null()) {
            text.insert(key.into(), v.clone());
        }
    }
    let tied = j.get("tie_word_embeddings").cloned().unwrap_or(true.into());
    text.insert("tie_word_embeddings".into(), tied);
    text.insert("model_type".into(), "gemma3_text".into());
    Some(Value::Object(text))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn qwen3_is_qwen2_with_a_head_size_and_unknown_families_are_llama() {
        let (q2, q3) = (family_defaults("qwen2"), family_defaults("qwen3"));
        assert_eq!(q3.head_dim, Some(128));
        assert_eq!(
            FamilyDefaults {
                head_dim: None,
                ..q3
            },
            q2
        );
        assert_eq!(family_defaults("olmo"), family_defaults("llama"));
        assert_eq!(family_defaults("gemma3"), family_defaults("gemma3_text"));
        assert_eq!(family_defaults("gemma3").shape("vocab_size"), Some(262208));
        assert_eq!(family_defaults("llama").shape("vocab_size"), None);
    }

    #[test]
    fn only_a_gemma3_with_a_text_config_is_read_nested() {
        let nested = json!({"model_type": "gemma3", "eos_token_id": [1, 106],
            "text_config": {"hidden_size": 2560, "eos_token_id": 1}});
        let text = multimodal_text_config(&nested).unwrap();
        assert_eq!(text["eos_token_id"], json!([1, 106]));
        assert_eq!(text["tie_word_embeddings"], json!(true));
        assert_eq!(text["model_type"], json!("gemma3_text"));
        assert_eq!(
            multimodal_text_config(&json!({"model_type": "gemma3"})),
            None
        );
        let other = json!({"model_type": "llava", "text_config": {"hidden_size": 1}});
        assert_eq!(multimodal_text_config(&other), None);
    }
}
