//! `config.json` of a Hugging Face model directory, normalised into one description that
//! the single transformer code path reads. Architecture differences become data here
//! (which norms exist, rope tables per layer, soft-capping, embedding scale), not code.

use anyhow::{bail, ensure, Context, Result};
use candle_core::DType;
use infer_core::hf_config::{family_defaults, multimodal_text_config, FamilyDefaults};
use serde_json::Value;
use std::path::Path;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    /// Llama with biased q, k and v projections (Qwen2, Qwen2.5).
    Qwen2,
    Qwen3,
    /// Llama whose every layer may slide (`sliding_window`, Mistral 7B v0.1).
    Mistral,
    Gemma3,
    /// Llama with fused `qkv_proj` and `gate_up_proj` weights, every layer sliding when it
    /// has a window (Phi-3-mini-4k's 2,047).
    Phi3,
}

impl Arch {
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Mistral => "mistral",
            Arch::Gemma3 => "gemma3",
            Arch::Phi3 => "phi3",
        }
    }

    /// What transformers' config class of the architecture assumes for a key `config.json`
    /// leaves out ([`family_defaults`] of its `model_type`).
    fn defaults(self) -> FamilyDefaults {
        family_defaults(self.name())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    Silu,
    /// gelu with the tanh approximation (`gelu_pytorch_tanh`, `gelu_new`).
    GeluTanh,
    /// exact gelu (`gelu`).
    GeluErf,
}

/// How rotary frequencies are rescaled for long context.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    /// `rope_type: "linear"`: every frequency divided by `factor`.
    Linear {
        factor: f64,
    },
    /// `rope_type: "llama3"`: low frequencies divided by `factor`, high ones kept,
    /// smooth interpolation between.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: usize,
    },
    /// `rope_type: "yarn"` (Qwen2.5's and Qwen3's long context): frequencies blended
    /// between kept and divided by `factor` over a ramp of dimensions, and cos and sin
    /// multiplied by `attention_factor`.
    Yarn {
        factor: f64,
        original_max_position_embeddings: usize,
        beta_fast: f64,
        beta_slow: f64,
        attention_factor: f64,
        /// The ramp's ends rounded outwards to whole dimensions.
        truncate: bool,
    },
}

impl RopeScaling {
    /// What cos and sin are multiplied by (YaRN's attention factor; 1 otherwise).
    pub fn attention_scaling(&self) -> f32 {
        match *self {
            RopeScaling::Yarn {
                attention_factor, ..
            } => attention_factor as f32,
            _ => 1.0,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub activation: Activation,
    /// Biases on the q, k and v projections (`attention_bias` of Llama, Qwen3 and Gemma 3;
    /// always in Qwen2, never in Mistral).
    pub qkv_bias: bool,
    /// A bias on the output projection (`attention_bias` as above; never in Qwen2).
    pub o_proj_bias: bool,
    /// Biases on the MLP's projections (Llama's `mlp_bias`).
    pub mlp_bias: bool,
    /// q, k and v stored as one `qkv_proj`, gate and up as one `gate_up_proj` (Phi-3).
    pub fused_projections: bool,
    /// Rope base and scaling of full-attention layers.
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    /// Rope base of sliding-window layers when it differs (Gemma 3's `rope_local_base_freq`).
    pub rope_local_theta: Option<f64>,
    /// Window size; a query at position p sees keys k with `p - k < window`.
    pub sliding_window: Option<usize>,
    /// Per layer: whether it uses the sliding window.
    pub layer_sliding: Vec<bool>,
    /// Attention scores are multiplied by `query_pre_attn_scalar ** -0.5`.
    pub query_pre_attn_scalar: f64,
    pub attn_logit_softcapping: Option<f64>,
    pub final_logit_softcapping: Option<f64>,
    /// Embeddings multiplied by `sqrt(hidden_size)` (Gemma).
    pub scale_embeddings: bool,
    /// RMSNorm multiplies by `(1 + weight)` (Gemma).
    pub norm_weight_plus_one: bool,
    /// Per-head RMSNorm of q and k before rope (Qwen3, Gemma 3).
    pub qk_norm: bool,
    /// Extra norms after attention and around the MLP (Gemma's "sandwich" norms).
    pub sandwich_norms: bool,
    /// `torch_dtype` / `dtype` from the file, when it is one we run.
    pub dtype: Option<DType>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

impl ModelConfig {
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read model config {}", path.display()))?;
        let json: Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not valid JSON", path.display()))?;
        Self::from_json(&json).with_context(|| format!("in model config {}", path.display()))
    }

    pub fn from_json(j: &Value) -> Result<Self> {
        let arch = detect_arch(j)?;
        let text;
        let j = match multimodal_text_config(j) {
            Some(t) => {
                text = t;
                &text
            }
            None => j,
        };
        let d = arch.defaults();
        if let Some(q) = j.get("quantization_config").filter(|q| !q.is_null()) {
            let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("?");
            bail!("quantized checkpoints are not supported (quantization_config: {method})");
        }
        let get_usize = |key: &str| -> Result<usize> {
            j.get(key)
                .and_then(Value::as_u64)
                .map(|v| v as usize)
                .or_else(|| d.shape(key))
                .with_context(|| format!("missing or non-integer field `{key}`"))
        };
        let opt_usize = |key: &str| j.get(key).and_then(Value::as_u64).map(|v| v as usize);
        let opt_f64 = |key: &str| j.get(key).and_then(Value::as_f64);
        let opt_bool = |key: &str| j.get(key).and_then(Value::as_bool);

        let hidden_size = get_usize("hidden_size")?;
        let num_heads = get_usize("num_attention_heads")?;
        let num_kv_heads = opt_usize("num_key_value_heads")
            .or(d.num_kv_heads)
            .unwrap_or(num_heads);
        if num_heads % num_kv_heads != 0 {
            bail!("num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}");
        }
        let head_dim = opt_usize("head_dim")
            .or(d.head_dim)
            .unwrap_or(hidden_size / num_heads);
        let num_layers = get_usize("num_hidden_layers")?;

        let act_name = j
            .get("hidden_activation")
            .or_else(|| j.get("hidden_act"))
            .and_then(Value::as_str)
            .unwrap_or(if arch == Arch::Gemma3 {
                "gelu_pytorch_tanh"
            } else {
                "silu"
            });
        let activation = match act_name {
            "silu" | "swish" => Activation::Silu,
            "gelu_pytorch_tanh" | "gelu_new" | "gelu_fast" => Activation::GeluTanh,
            "gelu" => Activation::GeluErf,
            other => bail!("unsupported activation `{other}`"),
        };

        let max_position_embeddings =
            opt_usize("max_position_embeddings").unwrap_or(d.max_position_embeddings);
        let rope = Rope::of(j, arch, &d, max_position_embeddings)?;

        // Absent: the class's default; `null`: no window.
        let window = match j.get("sliding_window") {
            None => d.sliding_window,
            Some(_) => opt_usize("sliding_window"),
        };
        // Transformers keeps a Gemma 3 without a window's sliding layers on their own rope
        // base, which the kinds here (a window and a rope each) cannot say.
        ensure!(
            arch != Arch::Gemma3 || window.is_some(),
            "a Gemma 3 config with `sliding_window: null` is not supported"
        );
        let sliding_window = match arch {
            Arch::Llama => None,
            Arch::Qwen2 | Arch::Qwen3 if !opt_bool("use_sliding_window").unwrap_or(false) => None,
            _ => window,
        };
        let layer_sliding = layer_sliding(j, arch, &d, num_layers, sliding_window.is_some())?;

        let gemma = arch == Arch::Gemma3;
        // Which keys each architecture's transformers code reads; the others' biases are
        // fixed: Qwen2 has them on q, k and v only, Mistral nowhere.
        let attention_bias = matches!(arch, Arch::Llama | Arch::Qwen3 | Arch::Gemma3)
            && opt_bool("attention_bias").unwrap_or(false);
        let mlp_bias = arch == Arch::Llama && opt_bool("mlp_bias").unwrap_or(false);
        let eos_token_ids = match j.get("eos_token_id") {
            Some(v) => token_id_list(v)?,
            None => vec![],
        };
        Ok(Self {
            arch,
            vocab_size: get_usize("vocab_size")?,
            hidden_size,
            intermediate_size: get_usize("intermediate_size")?,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: opt_f64("rms_norm_eps").unwrap_or(d.rms_norm_eps),
            // YaRN serves its factor times the positions it was trained on, and linear
            // scaling its factor times `max_position_embeddings` save in Gemma 3, whose
            // config already counts them (vLLM's rule; transformers has no limit).
            max_position_embeddings: match rope.scaling {
                RopeScaling::Yarn {
                    factor,
                    original_max_position_embeddings: n,
                    ..
                } => max_position_embeddings.max((n as f64 * factor) as usize),
                RopeScaling::Linear { factor } if !gemma => {
                    (max_position_embeddings as f64 * factor) as usize
                }
                _ => max_position_embeddings,
            },
            tie_word_embeddings: opt_bool("tie_word_embeddings").unwrap_or(d.tie_word_embeddings),
            activation,
            qkv_bias: arch == Arch::Qwen2 || attention_bias,
            o_proj_bias: attention_bias,
            mlp_bias,
            fused_projections: arch == Arch::Phi3,
            rope_theta: rope.theta,
            rope_scaling: rope.scaling,
            rope_local_theta: rope.local_theta,
            sliding_window,
            layer_sliding,
            query_pre_attn_scalar: if gemma {
                // Gemma3TextConfig's default, whatever the head size.
                opt_f64("query_pre_attn_scalar").unwrap_or(256.0)
            } else {
                head_dim as f64
            },
            attn_logit_softcapping: if gemma {
                opt_f64("attn_logit_softcapping")
            } else {
                None
            },
            final_logit_softcapping: if gemma {
                opt_f64("final_logit_softcapping")
            } else {
                None
            },
            scale_embeddings: gemma,
            norm_weight_plus_one: gemma,
            qk_norm: matches!(arch, Arch::Qwen3 | Arch::Gemma3),
            sandwich_norms: gemma,
            dtype: parse_dtype(j.get("torch_dtype").or_else(|| j.get("dtype"))),
            bos_token_id: j
                .get("bos_token_id")
                .and_then(Value::as_u64)
                .map(|v| v as u32),
            eos_token_ids,
        })
    }

    /// Parameters in the weights (embeddings counted once when tied).
    pub fn num_parameters(&self) -> usize {
        let (h, i, d) = (self.hidden_size, self.intermediate_size, self.head_dim);
        let qkv_out = d * (self.num_heads + 2 * self.num_kv_heads);
        let attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
            + if self.qkv_bias { qkv_out } else { 0 }
            + if self.o_proj_bias { h } else { 0 };
        let mlp = 3 * h * i + if self.mlp_bias { 2 * i + h } else { 0 };
        let norms =
            h * if self.sandwich_norms { 4 } else { 2 } + if self.qk_norm { 2 * d } else { 0 };
        let embed = self.vocab_size * h * if self.tie_word_embeddings { 1 } else { 2 };
        self.num_layers * (attn + mlp + norms) + embed + h
    }

    /// Bytes one decode step must read from device memory, at `weight_bytes` per parameter
    /// and `kv_bytes` per cached element, for sequences whose contexts (the new token
    /// included) are `contexts`: every parameter but the embedding table, which is gathered
    /// (one row per sequence) rather than read; the output head in full (the table itself
    /// when tied); each sequence's K and V once (an ideal kernel reads each KV head once, not
    /// once per query head). Activations and logits are left out: at decode they are
    /// kilobytes to a few megabytes. The denominator of an honest bandwidth fraction.
    pub fn decode_read_bytes(
        &self,
        contexts: &[usize],
        weight_bytes: usize,
        kv_bytes: usize,
    ) -> usize {
        let table = self.vocab_size * self.hidden_size;
        let untied_head = if self.tie_word_embeddings { 0 } else { table };
        // All parameters but the table, plus the head read in full once.
        let weights = self.num_parameters() - table - untied_head + table;
        let gathered = contexts.len() * self.hidden_size;
        let kv_per_token = self.num_layers * 2 * self.num_kv_heads * self.head_dim;
        let kv: usize = contexts.iter().map(|c| c * kv_per_token).sum();
        (weights + gathered) * weight_bytes + kv * kv_bytes
    }
}

fn detect_arch(j: &Value) -> Result<Arch> {
    let archs: Vec<&str> = j
        .get("architectures")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let model_type = j.get("model_type").and_then(Value::as_str).unwrap_or("");
    for a in &archs {
        match *a {
            "LlamaForCausalLM" => return Ok(Arch::Llama),
            "Qwen2ForCausalLM" => return Ok(Arch::Qwen2),
            "Qwen3ForCausalLM" => return Ok(Arch::Qwen3),
            "MistralForCausalLM" => return Ok(Arch::Mistral),
            "Phi3ForCausalLM" => return Ok(Arch::Phi3),
            "Gemma3ForCausalLM" | "Gemma3ForConditionalGeneration" => return Ok(Arch::Gemma3),
            _ => {}
        }
    }
    match model_type {
        "llama" => Ok(Arch::Llama),
        "qwen2" => Ok(Arch::Qwen2),
        "qwen3" => Ok(Arch::Qwen3),
        "mistral" => Ok(Arch::Mistral),
        "gemma3_text" | "gemma3" => Ok(Arch::Gemma3),
        "phi3" => Ok(Arch::Phi3),
        _ => bail!(
            "unknown architecture {archs:?} (model_type `{model_type}`): supported are \
             LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM, \
             Gemma3ForCausalLM (gemma3_text), Phi3ForCausalLM"
        ),
    }
}

/// Rotary settings as transformers 5.25 resolves them from what transformers 4 wrote
/// (`rope_theta`, `rope_scaling`, `rope_local_base_freq`) and what transformers 5 writes
/// (`rope_parameters`: one dict with `rope_theta` beside the scaling, or one per layer type,
/// Gemma 3's). Left unread, a checkpoint saved by transformers 5 would run with the default
/// base and no scaling.
struct Rope {
    theta: f64,
    scaling: RopeScaling,
    /// Of sliding layers (Gemma 3).
    local_theta: Option<f64>,
}

impl Rope {
    /// Outside Gemma 3 (`standardize_rope_params`): a non-empty `rope_scaling` replaces
    /// `rope_parameters`; the dict's own `rope_theta` wins over the top-level one. Gemma 3
    /// (`convert_rope_params_to_dict`): per-layer-type dicts, `rope_scaling` merged into the
    /// global one (its `type` does not override the `rope_type` already there), each theta
    /// from its dict, else `rope_theta` / `rope_local_base_freq`, else the class's.
    fn of(j: &Value, arch: Arch, d: &FamilyDefaults, max_positions: usize) -> Result<Rope> {
        let dict = |key: &str| {
            j.get(key)
                .and_then(Value::as_object)
                .filter(|o| !o.is_empty())
                .cloned()
        };
        let top = |key: &str| j.get(key).and_then(Value::as_f64);
        let theta_in =
            |p: &serde_json::Map<String, Value>| p.get("rope_theta").and_then(Value::as_f64);
        // Transformers gives a top-level `original_max_position_embeddings` (Phi-3 writes
        // one) priority over the dict's.
        // Written as an integer or a float (`8192.0`), as transformers takes either.
        let original = j
            .get("original_max_position_embeddings")
            .and_then(Value::as_f64)
            .map(|n| n as usize);
        let scaling_of = |p: &serde_json::Map<String, Value>, key: &str| {
            parse_rope_scaling(p, key, original, max_positions)
        };
        check_full_rotary(j)?;
        if arch == Arch::Gemma3 {
            let nested = |t: &str| {
                dict("rope_parameters")
                    .and_then(|p| p.get(t).and_then(Value::as_object).cloned())
                    .unwrap_or_else(|| {
                        serde_json::Map::from_iter([("rope_type".into(), "default".into())])
                    })
            };
            let mut global = nested("full_attention");
            if let Some(s) = dict("rope_scaling") {
                // Transformers 4 scaled by a `type`; 5 keeps the `rope_type` already there
                // and does not. Which was meant cannot be told: refused, as vLLM refuses it.
                let kind = s.get("type").and_then(Value::as_str);
                ensure!(
                    s.contains_key("rope_type") || kind.is_none_or(|k| k == "default"),
                    "rope_scaling gives `type: {}` without `rope_type`, which transformers 4 \
                     and 5 read differently for Gemma 3: write `rope_type`",
                    kind.unwrap_or_default()
                );
                global.extend(s);
            }
            let local = nested("sliding_attention");
            for p in [&global, &local] {
                check_full_rotary(&Value::Object(p.clone()))?;
            }
            ensure!(
                scaling_of(&local, "rope_parameters.sliding_attention")? == RopeScaling::None,
                "scaled rotary embeddings on sliding layers are not supported"
            );
            return Ok(Rope {
                theta: theta_in(&global)
                    .or(top("rope_theta"))
                    .unwrap_or(d.rope_theta),
                scaling: scaling_of(&global, "rope_scaling")?,
                local_theta: Some(
                    theta_in(&local)
                        .or(top("rope_local_base_freq"))
                        .unwrap_or(10_000.0),
                ),
            });
        }
        let (params, key) = match dict("rope_scaling") {
            Some(s) => (Some(s), "rope_scaling"),
            None => (dict("rope_parameters"), "rope_parameters"),
        };
        if let Some(p) = &params {
            check_full_rotary(&Value::Object(p.clone()))?;
        }
        Ok(Rope {
            theta: params
                .as_ref()
                .and_then(theta_in)
                .or(top("rope_theta"))
                .unwrap_or(d.rope_theta),
            scaling: match &params {
                Some(p) => scaling_of(p, key)?,
                None => RopeScaling::None,
            },
            local_theta: None,
        })
    }
}

/// A rotary over part of each head (`partial_rotary_factor` below 1, Phi-4-mini's 0.75) is
/// refused wherever it is given.
fn check_full_rotary(v: &Value) -> Result<()> {
    if let Some(f) = v.get("partial_rotary_factor").and_then(Value::as_f64) {
        ensure!(
            f == 1.0,
            "partial rotary embeddings (partial_rotary_factor {f}) are not supported"
        );
    }
    Ok(())
}

/// `v`: a `rope_scaling` dict or `rope_parameters` (whose `rope_theta` is not read here),
/// `key` naming it in errors. `original` (a top-level `original_max_position_embeddings`)
/// overrides the dict's, which defaults to `max_positions`, as transformers reads them.
fn parse_rope_scaling(
    v: &serde_json::Map<String, Value>,
    key: &str,
    original: Option<usize>,
    max_positions: usize,
) -> Result<RopeScaling> {
    let kind = v
        .get("rope_type")
        .or_else(|| v.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let f = |name: &str| {
        v.get(name)
            .and_then(Value::as_f64)
            .with_context(|| format!("{key}.{name} missing"))
    };
    // Python's `or`: absent, null or 0 take the default.
    let or = |name: &str, default: f64| {
        v.get(name)
            .and_then(Value::as_f64)
            .filter(|x| *x != 0.0)
            .unwrap_or(default)
    };
    let original_max_position_embeddings = original
        .or(v
            .get("original_max_position_embeddings")
            .and_then(Value::as_f64)
            .map(|n| n as usize))
        .unwrap_or(max_positions);
    Ok(match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear {
            factor: f("factor")?,
        },
        "llama3" => RopeScaling::Llama3 {
            factor: f("factor")?,
            low_freq_factor: f("low_freq_factor")?,
            high_freq_factor: f("high_freq_factor")?,
            original_max_position_embeddings,
        },
        "yarn" => {
            let factor = f("factor")?;
            // The paper's 0.1 ln(s) + 1, or its ratio of two such where both are given
            // (DeepSeek's), unless the config fixes it.
            let mscale = |m: f64| {
                if factor <= 1.0 {
                    1.0
                } else {
                    0.1 * m * factor.ln() + 1.0
                }
            };
            let attention_factor = match v.get("attention_factor").and_then(Value::as_f64) {
                Some(a) => a,
                None => match (or("mscale", 0.0), or("mscale_all_dim", 0.0)) {
                    (m, all) if m != 0.0 && all != 0.0 => mscale(m) / mscale(all),
                    _ => mscale(1.0),
                },
            };
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast: or("beta_fast", 32.0),
                beta_slow: or("beta_slow", 1.0),
                attention_factor,
                truncate: v.get("truncate").and_then(Value::as_bool).unwrap_or(true),
            }
        }
        other => {
            bail!("unsupported {key} type `{other}` (supported: default, linear, llama3, yarn)")
        }
    })
}

fn layer_sliding(
    j: &Value,
    arch: Arch,
    d: &FamilyDefaults,
    num_layers: usize,
    has_window: bool,
) -> Result<Vec<bool>> {
    if !has_window {
        return Ok(vec![false; num_layers]);
    }
    // Transformers' Mistral and Phi-3 slide every layer, whatever `layer_types` says.
    if matches!(arch, Arch::Mistral | Arch::Phi3) {
        return Ok(vec![true; num_layers]);
    }
    if let Some(types) = j.get("layer_types").and_then(Value::as_array) {
        if types.len() != num_layers {
            bail!(
                "layer_types has {} entries for {num_layers} layers",
                types.len()
            );
        }
        return types
            .iter()
            .map(|t| match t.as_str() {
                Some("sliding_attention") => Ok(true),
                Some("full_attention") => Ok(false),
                other => bail!("unknown layer type {other:?}"),
            })
            .collect();
    }
    Ok(match arch {
        // Gemma 3: every `sliding_window_pattern`-th layer is global.
        Arch::Gemma3 => {
            // transformers 5 writes `_sliding_window_pattern` (beside `layer_types`).
            let pattern = j
                .get("sliding_window_pattern")
                .or_else(|| j.get("_sliding_window_pattern"))
                .and_then(Value::as_u64)
                .unwrap_or(6) as usize;
            (0..num_layers)
                .map(|i| (i + 1) % pattern.max(1) != 0)
                .collect()
        }
        // Qwen: layers from `max_window_layers` on use the window.
        _ => {
            let from = j
                .get("max_window_layers")
                .and_then(Value::as_u64)
                .map_or(d.max_window_layers, |n| n as usize);
            (0..num_layers).map(|i| i >= from).collect()
        }
    })
}

fn parse_dtype(v: Option<&Value>) -> Option<DType> {
    match v.and_then(Value::as_str)? {
        "float32" => Some(DType::F32),
        "bfloat16" => Some(DType::BF16),
        "float16" => Some(DType::F16),
        _ => None,
    }
}

/// `eos_token_id` may be one integer or a list of them.
pub fn token_id_list(v: &Value) -> Result<Vec<u32>> {
    match v {
        Value::Null => Ok(vec![]),
        Value::Number(n) => Ok(vec![n
            .as_u64()
            .context("token id must be a non-negative integer")?
            as u32]),
        Value::Array(a) => a
            .iter()
            .map(|x| {
                x.as_u64()
                    .map(|n| n as u32)
                    .context("token id must be a non-negative integer")
            })
            .collect(),
        other => bail!("expected a token id or a list of them, found {other}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// `base` with the keys of `extra` set.
    fn with(base: &Value, extra: Value) -> Value {
        let mut c = base.clone();
        if let (Some(c), Value::Object(extra)) = (c.as_object_mut(), extra) {
            c.extend(extra);
        }
        c
    }

    #[test]
    fn gemma3_layer_pattern_and_defaults() {
        let c = ModelConfig::from_json(&json!({
            "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
            "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 1,
            "head_dim": 32, "sliding_window": 16, "sliding_window_pattern": 3,
            "query_pre_attn_scalar": 24, "final_logit_softcapping": 30.0
        }))
        .unwrap();
        assert_eq!(c.arch, Arch::Gemma3);
        assert_eq!(c.layer_sliding, vec![true, true, false, true, true, false]);
        assert!(c.tie_word_embeddings && c.scale_embeddings && c.qk_norm && c.sandwich_norms);
        assert_eq!(c.activation, Activation::GeluTanh);
        assert_eq!(c.query_pre_attn_scalar, 24.0);
        assert_eq!(c.final_logit_softcapping, Some(30.0));
        assert_eq!(c.rope_local_theta, Some(10_000.0));
    }

    #[test]
    fn explicit_layer_types_override_the_pattern() {
        let c = ModelConfig::from_json(&json!({
            "model_type": "gemma3_text", "vocab_size": 100, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
            "sliding_window": 8, "sliding_window_pattern": 2,
            "layer_types": ["full_attention", "sliding_attention", "sliding_attention"]
        }))
        .unwrap();
        assert_eq!(c.layer_sliding, vec![false, true, true]);
        assert_eq!(c.sliding_window, Some(8));
        // Qwen3 without use_sliding_window has no window at all.
        let q = ModelConfig::from_json(&json!({
            "architectures": ["Qwen3ForCausalLM"], "vocab_size": 100, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 4, "head_dim": 32, "sliding_window": 8, "use_sliding_window": false
        }))
        .unwrap();
        assert_eq!(
            (q.sliding_window, q.layer_sliding),
            (None, vec![false, false])
        );
        assert_eq!(q.head_dim, 32);
    }

    #[test]
    fn llama3_rope_scaling_and_eos_list() {
        let c = ModelConfig::from_json(&json!({
            "architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "eos_token_id": [1, 7], "torch_dtype": "bfloat16",
            "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        }))
        .unwrap();
        assert_eq!(c.head_dim, 16);
        assert_eq!(c.num_kv_heads, 4);
        assert_eq!(c.eos_token_ids, vec![1, 7]);
        assert_eq!(c.dtype, Some(DType::BF16));
        assert!(matches!(c.rope_scaling, RopeScaling::Llama3 { factor, .. } if factor == 32.0));
        assert!(!c.tie_word_embeddings && !c.qk_norm);
    }

    /// Llama-3.2-1B's shape with a 32,768 vocabulary, bf16: 2.08 GB of weights a step reads
    /// (the review's figure), the same tied or not, plus 32 KiB of KV per token of context.
    #[test]
    fn decode_reads_every_weight_but_the_gathered_table() {
        let shape = |tied: bool| {
            ModelConfig::from_json(&json!({
                "architectures": ["LlamaForCausalLM"], "vocab_size": 32768,
                "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
                "tie_word_embeddings": tied
            }))
            .unwrap()
        };
        let (untied, tied) = (shape(false), shape(true));
        let weights = untied.decode_read_bytes(&[], 2, 2);
        assert_eq!(weights, tied.decode_read_bytes(&[], 2, 2));
        assert!((weights as f64 / 1e9 - 2.08).abs() < 0.005, "{weights}");
        // Untied: all parameters but one table; tied: all of them.
        assert_eq!(weights, (untied.num_parameters() - 32768 * 2048) * 2);
        assert_eq!(weights, tied.num_parameters() * 2);
        // Two sequences of 512 and 2,048 tokens: two gathered rows and 16 x 2 x 8 x 64
        // bf16 elements of K and V per token.
        let step = untied.decode_read_bytes(&[512, 2048], 2, 2);
        assert_eq!(
            step - weights,
            2 * 2048 * 2 + (512 + 2048) * 16 * 2 * 8 * 64 * 2
        );
    }

    /// Qwen2.5-7B-Instruct's config.json as published: biased q, k and v (not o), no
    /// window (`use_sliding_window: false`), untied; 7,615,616,512 parameters, the model
    /// card's 7.61B.
    #[test]
    fn qwen2_has_qkv_biases_and_its_published_parameter_count() {
        let c = ModelConfig::from_json(&json!({
            "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0,
            "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu",
            "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944,
            "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2",
            "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
            "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072,
            "tie_word_embeddings": false, "torch_dtype": "bfloat16", "use_cache": true,
            "use_sliding_window": false, "vocab_size": 152064
        }))
        .unwrap();
        assert_eq!(c.arch, Arch::Qwen2);
        assert!(c.qkv_bias && !c.o_proj_bias && !c.mlp_bias && !c.qk_norm);
        assert_eq!((c.sliding_window, c.head_dim), (None, 128));
        assert_eq!(c.num_parameters(), 7_615_616_512);
    }

    /// Mistral-7B-Instruct-v0.3 (`sliding_window: null`, 7,248,023,552 parameters) and
    /// v0.1 (a window of 4,096 on every layer); a Mistral config without the key has
    /// transformers' default window.
    #[test]
    fn mistral_slides_every_layer_when_it_has_a_window() {
        let v03 = json!({
            "architectures": ["MistralForCausalLM"], "attention_dropout": 0.0,
            "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096,
            "initializer_range": 0.02, "intermediate_size": 14336,
            "max_position_embeddings": 32768, "model_type": "mistral",
            "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
            "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": null,
            "tie_word_embeddings": false, "torch_dtype": "bfloat16", "vocab_size": 32768
        });
        let c = ModelConfig::from_json(&v03).unwrap();
        assert_eq!(c.arch, Arch::Mistral);
        assert!(!c.qkv_bias && !c.o_proj_bias && !c.qk_norm && !c.tie_word_embeddings);
        assert_eq!(c.num_parameters(), 7_248_023_552);
        assert_eq!((c.sliding_window, c.layer_sliding), (None, vec![false; 32]));
        let mut v01 = v03;
        v01["sliding_window"] = json!(4096);
        let c = ModelConfig::from_json(&v01).unwrap();
        assert_eq!(
            (c.sliding_window, c.layer_sliding),
            (Some(4096), vec![true; 32])
        );
        // layer_types does not stop a layer sliding (transformers warns and slides it).
        v01["layer_types"] = json!(vec!["full_attention"; 32]);
        assert_eq!(
            ModelConfig::from_json(&v01).unwrap().layer_sliding,
            vec![true; 32]
        );
        v01.as_object_mut().unwrap().remove("sliding_window");
        assert_eq!(
            ModelConfig::from_json(&v01).unwrap().sliding_window,
            Some(4096)
        );
    }

    /// The bias keys reach the projections each architecture's transformers code gives them
    /// to, and no others.
    #[test]
    fn bias_keys_as_each_architecture_reads_them() {
        let cfg = |arch: &str| {
            ModelConfig::from_json(&json!({
                "architectures": [arch], "vocab_size": 100, "hidden_size": 64,
                "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 4, "attention_bias": true, "mlp_bias": true
            }))
            .unwrap()
        };
        let l = cfg("LlamaForCausalLM");
        assert!(l.qkv_bias && l.o_proj_bias && l.mlp_bias);
        for arch in ["Qwen3ForCausalLM", "Gemma3ForCausalLM"] {
            let c = cfg(arch);
            assert!(c.qkv_bias && c.o_proj_bias && !c.mlp_bias, "{arch}");
        }
        let m = cfg("MistralForCausalLM");
        assert!(!m.qkv_bias && !m.o_proj_bias && !m.mlp_bias);
        let q = cfg("Qwen2ForCausalLM");
        assert!(q.qkv_bias && !q.o_proj_bias && !q.mlp_bias);
    }

    /// Phi-3-mini-4k-instruct's config.json: a window of 2,047 on every layer, 3,821,079,552
    /// parameters (the model card's 3.8B); its 128k siblings' longrope is refused by name.
    #[test]
    fn phi3_mini_4k_and_its_window() {
        let mut phi = json!({
            "architectures": ["Phi3ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
            "embd_pdrop": 0.0, "eos_token_id": 32000, "hidden_act": "silu",
            "hidden_size": 3072, "initializer_range": 0.02, "intermediate_size": 8192,
            "max_position_embeddings": 4096, "model_type": "phi3", "num_attention_heads": 32,
            "num_hidden_layers": 32, "num_key_value_heads": 32,
            "original_max_position_embeddings": 4096, "pad_token_id": 32000,
            "resid_pdrop": 0.0, "rms_norm_eps": 1e-05, "rope_scaling": null,
            "rope_theta": 10000.0, "sliding_window": 2047, "tie_word_embeddings": false,
            "torch_dtype": "bfloat16", "use_cache": true, "attention_bias": false,
            "vocab_size": 32064
        });
        let c = ModelConfig::from_json(&phi).unwrap();
        assert_eq!(c.arch, Arch::Phi3);
        assert!(c.fused_projections && !c.qkv_bias && !c.qk_norm);
        assert_eq!(c.head_dim, 96);
        assert_eq!(c.num_parameters(), 3_821_079_552);
        assert_eq!(
            (c.sliding_window, c.layer_sliding),
            (Some(2047), vec![true; 32])
        );
        phi["rope_scaling"] =
            json!({"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]});
        let err = format!("{:#}", ModelConfig::from_json(&phi).unwrap_err());
        assert!(err.contains("`longrope`"), "{err}");
    }

    /// What transformers 5.25's `save_pretrained` writes: `rope_parameters` instead of
    /// `rope_theta` and `rope_scaling` (per layer type for Gemma 3), `layer_types`, `dtype`.
    #[test]
    fn transformers_5_rope_parameters_are_read() {
        let llama = ModelConfig::from_json(&json!({
            "architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "max_position_embeddings": 131072, "dtype": "bfloat16",
            "rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                "rope_theta": 500000.0}
        }))
        .unwrap();
        assert_eq!(llama.rope_theta, 500_000.0);
        assert!(matches!(llama.rope_scaling, RopeScaling::Llama3 { factor, .. } if factor == 8.0));
        assert_eq!(llama.dtype, Some(DType::BF16));
        let qwen = ModelConfig::from_json(&json!({
            "architectures": ["Qwen2ForCausalLM"], "vocab_size": 100, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "use_sliding_window": false, "sliding_window": null,
            "max_window_layers": 28, "layer_types": ["full_attention", "full_attention"],
            "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}
        }))
        .unwrap();
        assert_eq!(
            (qwen.rope_theta, qwen.rope_scaling),
            (1e6, RopeScaling::None)
        );
        let gemma = ModelConfig::from_json(&json!({
            "architectures": ["Gemma3ForCausalLM"], "vocab_size": 100, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4,
            "num_key_value_heads": 1, "head_dim": 16, "sliding_window": 512,
            "_sliding_window_pattern": 3,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}
            }
        }))
        .unwrap();
        assert_eq!((gemma.rope_theta, gemma.rope_local_theta), (1e6, Some(1e4)));
        assert_eq!(gemma.rope_scaling, RopeScaling::Linear { factor: 8.0 });
        assert_eq!(
            gemma.layer_sliding,
            vec![true, true, false, true, true, false]
        );
    }

    /// What cannot run right is refused, not run wrong: a rotary over part of each head
    /// (Phi-4-mini's 0.75), a quantized checkpoint, scaled rope on sliding layers.
    #[test]
    fn partial_rotary_and_quantized_checkpoints_are_refused() {
        let base = json!({
            "architectures": ["Phi3ForCausalLM"], "vocab_size": 100, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4
        });
        let refused = |patch: Value| {
            format!(
                "{:#}",
                ModelConfig::from_json(&with(&base, patch)).unwrap_err()
            )
        };
        assert!(
            refused(json!({"partial_rotary_factor": 0.75})).contains("partial_rotary_factor 0.75")
        );
        assert!(refused(
            json!({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}})
        )
        .contains("partial_rotary_factor 0.5"));
        assert!(
            refused(json!({"quantization_config": {"quant_method": "fp8"}}))
                .contains("quantized checkpoints are not supported (quantization_config: fp8)")
        );
        assert!(ModelConfig::from_json(&json!({
            "architectures": ["Gemma3ForCausalLM"], "vocab_size": 100, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                "full_attention": {"rope_type": "default", "rope_theta": 1e6}
            }
        }))
        .unwrap_err()
        .to_string()
        .contains("scaled rotary embeddings on sliding layers are not supported"));
        let mut fine = base.clone();
        fine["partial_rotary_factor"] = json!(1.0);
        ModelConfig::from_json(&fine).unwrap();
    }

    /// Keys a config leaves out take the defaults of the architecture's transformers class.
    #[test]
    fn absent_keys_take_the_architectures_defaults() {
        let minimal = |arch: &str, extra: Value| {
            let base = json!({
                "architectures": [arch], "vocab_size": 100, "hidden_size": 1024,
                "intermediate_size": 128, "num_hidden_layers": 30, "num_attention_heads": 32
            });
            ModelConfig::from_json(&with(&base, extra)).unwrap()
        };
        let m = minimal("MistralForCausalLM", json!({}));
        assert_eq!((m.num_kv_heads, m.max_position_embeddings), (8, 131072));
        assert_eq!(m.sliding_window, Some(4096));
        let q = minimal("Qwen2ForCausalLM", json!({"use_sliding_window": true}));
        assert_eq!((q.num_kv_heads, q.max_position_embeddings), (32, 32768));
        // Transformers' max_window_layers of 28: layers 28 and 29 of 30 slide.
        assert_eq!(q.sliding_window, Some(4096));
        assert_eq!(q.layer_sliding.iter().filter(|&&s| s).count(), 2);
        assert!(q.layer_sliding[28] && q.layer_sliding[29] && !q.layer_sliding[27]);
        let l = minimal(
            "LlamaForCausalLM",
            json!({"use_sliding_window": true, "sliding_window": 8}),
        );
        assert_eq!((l.num_kv_heads, l.max_position_embeddings), (32, 2048));
        assert_eq!(l.sliding_window, None);
        let p = minimal("Phi3ForCausalLM", json!({}));
        assert_eq!((p.rms_norm_eps, p.sliding_window), (1e-5, None));
        let g = minimal("Gemma3ForCausalLM", json!({}));
        assert_eq!(
            (g.num_kv_heads, g.rope_theta, g.tie_word_embeddings),
            (4, 1e6, true)
        );
    }

    /// Where a config gives rope settings twice, the one transformers 5.25 keeps wins.
    #[test]
    fn rope_precedence_is_transformers() {
        let base = json!({
            "architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4
        });
        let llama = |extra: Value| ModelConfig::from_json(&with(&base, extra)).unwrap();
        // The dict's own base wins over the top-level one.
        let c = llama(json!({"rope_theta": 1e4,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}));
        assert_eq!(c.rope_theta, 1e6);
        // A rope_scaling replaces rope_parameters whole (its base goes with it) ...
        let c = llama(
            json!({"rope_scaling": {"rope_type": "linear", "factor": 2.0},
            "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}),
        );
        assert_eq!(
            (c.rope_theta, c.rope_scaling),
            (1e4, RopeScaling::Linear { factor: 2.0 })
        );
        // Linear scaling serves its factor times the positions, as vLLM derives them.
        assert_eq!(c.max_position_embeddings, 2 * 2048);
        // ... unless it is empty (falsy in Python).
        let c = llama(json!({"rope_scaling": {},
            "rope_parameters": {"rope_type": "linear", "factor": 3.0, "rope_theta": 5e5}}));
        assert_eq!(
            (c.rope_theta, c.rope_scaling),
            (5e5, RopeScaling::Linear { factor: 3.0 })
        );
        // llama3 without its pretraining length takes the top-level one, else the positions.
        let llama3 = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0});
        let length = |c: ModelConfig| match c.rope_scaling {
            RopeScaling::Llama3 {
                original_max_position_embeddings: n,
                ..
            } => n,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            length(llama(
                json!({"rope_scaling": llama3, "max_position_embeddings": 4096})
            )),
            4096
        );
        assert_eq!(
            length(llama(json!({"rope_scaling": llama3,
            "original_max_position_embeddings": 1024}))),
            1024
        );
        // Written as a float, as some configs have it.
        let mut llama3_float = llama3.clone();
        llama3_float["original_max_position_embeddings"] = json!(8192.0);
        assert_eq!(
            length(llama(json!({"rope_scaling": llama3_float,
                "max_position_embeddings": 131072}))),
            8192
        );
    }

    /// Gemma 3: a `rope_scaling` with `type` only is refused (transformers 4 scaled by it, 5
    /// ignores it); the head size and attention scalar left out are the class's 256; no
    /// window is refused.
    #[test]
    fn gemma3_rope_and_head_defaults() {
        let base = json!({
            "architectures": ["Gemma3ForCausalLM"], "vocab_size": 100,
            "hidden_size": 3840, "intermediate_size": 128, "num_hidden_layers": 6,
            "num_attention_heads": 16, "num_key_value_heads": 8
        });
        let gemma = |extra: Value| ModelConfig::from_json(&with(&base, extra));
        let err = gemma(json!({"rope_scaling": {"type": "linear", "factor": 8.0}}))
            .unwrap_err()
            .to_string();
        assert!(err.contains("write `rope_type`"), "{err}");
        let c = gemma(json!({})).unwrap();
        assert_eq!((c.head_dim, c.query_pre_attn_scalar), (256, 256.0));
        let c = gemma(
            json!({"rope_scaling": {"rope_type": "linear", "factor": 8.0},
            "rope_theta": 2e6, "rope_local_base_freq": 2e4}),
        )
        .unwrap();
        assert_eq!(c.rope_scaling, RopeScaling::Linear { factor: 8.0 });
        assert_eq!((c.rope_theta, c.rope_local_theta), (2e6, Some(2e4)));
        // Its positions already count the scaling (vLLM does not multiply them).
        assert_eq!(c.max_position_embeddings, 131072);
        let err = gemma(json!({"sliding_window": null}))
            .unwrap_err()
            .to_string();
        assert!(err.contains("sliding_window: null"), "{err}");
    }

    /// Qwen2.5's recommended long-context setting: YaRN ×4 over 32,768 positions serves
    /// 131,072 (vLLM's rule) with cos and sin scaled by 0.1 ln 4 + 1.
    #[test]
    fn yarn_extends_the_positions_and_scales_attention() {
        let c = ModelConfig::from_json(&json!({
            "architectures": ["Qwen2ForCausalLM"], "vocab_size": 100, "hidden_size": 3584,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 28,
            "num_key_value_heads": 4, "max_position_embeddings": 32768, "rope_theta": 1e6,
            "rope_scaling": {"type": "yarn", "factor": 4.0,
                "original_max_position_embeddings": 32768}
        }))
        .unwrap();
        assert_eq!(c.max_position_embeddings, 131072);
        assert!((c.rope_scaling.attention_scaling() - 1.138_629_4).abs() < 1e-6);
        assert!(
            matches!(c.rope_scaling, RopeScaling::Yarn { beta_fast, beta_slow, truncate: true, .. }
            if beta_fast == 32.0 && beta_slow == 1.0)
        );
    }

    /// gemma-3-4b-it's config.json as published: the text model from the few keys its
    /// `text_config` keeps and Gemma3TextConfig's defaults (values transformers 5.25 gives),
    /// the EOS ids from the top level.
    #[test]
    fn multimodal_gemma3_reads_its_text_config() {
        let c = ModelConfig::from_json(&json!({
            "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
            "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
            "initializer_range": 0.02, "mm_tokens_per_image": 256, "model_type": "gemma3",
            "text_config": {
                "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                "sliding_window": 1024, "eos_token_id": 1, "tie_word_embeddings": false
            },
            "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
            "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                "model_type": "siglip_vision_model", "num_attention_heads": 16,
                "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": false}
        }))
        .unwrap();
        assert_eq!(c.arch, Arch::Gemma3);
        assert_eq!(
            (
                c.vocab_size,
                c.hidden_size,
                c.num_layers,
                c.num_heads,
                c.num_kv_heads,
                c.head_dim
            ),
            (262208, 2560, 34, 8, 4, 256)
        );
        assert_eq!(
            (c.query_pre_attn_scalar, c.sliding_window),
            (256.0, Some(1024))
        );
        assert_eq!(c.rope_scaling, RopeScaling::Linear { factor: 8.0 });
        assert_eq!((c.rope_theta, c.rope_local_theta), (1e6, Some(1e4)));
        assert_eq!(
            &c.layer_sliding[..7],
            &[true, true, true, true, true, false, true]
        );
        // The top level's EOS ids and tying win over the text config's.
        assert_eq!(c.eos_token_ids, vec![1, 106]);
        assert_eq!(c.dtype, Some(DType::BF16));
        assert!(c.tie_word_embeddings);
        // A flat Gemma 3 config that says model_type "gemma3" is read flat.
        let flat = ModelConfig::from_json(&json!({
            "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3",
            "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1
        }))
        .unwrap();
        assert_eq!((flat.hidden_size, flat.num_layers), (64, 2));
    }

    #[test]
    fn unknown_architecture_is_named() {
        let err = ModelConfig::from_json(
            &json!({"architectures": ["MambaForCausalLM"], "model_type": "mamba"}),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("MambaForCausalLM"), "{err}");
    }
}
