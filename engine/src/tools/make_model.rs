//! Generated models: a real Hugging Face directory (config, safetensors, tokenizer, chat
//! template, generation config) with deterministic random weights, for tests, benchmarks
//! and `builtin:tiny`. Nothing here is downloaded: the tokenizer is a byte-level BPE
//! trained on the embedded corpus.

use crate::runtime::model::Arch;
use anyhow::{bail, ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Mutex;

#[derive(Debug, Clone, PartialEq)]
pub struct ModelSpec {
    pub arch: Arch,
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    /// Defaults to `hidden / heads`.
    pub head_dim: Option<usize>,
    pub intermediate: usize,
    pub vocab: usize,
    pub max_pos: usize,
    pub seed: u64,
    pub dtype: DType,
    /// Standard deviation of the random weights.
    pub init_std: f32,
    /// Window of the sliding layers (Gemma 3's, and Mistral's and Phi-3's on every layer) and
    /// Gemma 3's layer pattern.
    pub sliding_window: usize,
    pub sliding_window_pattern: usize,
}

impl ModelSpec {
    /// Small defaults for `arch`, overridable field by field.
    pub fn new(arch: Arch) -> Self {
        Self {
            arch,
            layers: 2,
            hidden: 64,
            heads: 4,
            kv_heads: 2,
            head_dim: None,
            intermediate: 128,
            vocab: 512,
            max_pos: 1024,
            seed: 0,
            dtype: DType::F32,
            init_std: 0.02,
            sliding_window: 512,
            sliding_window_pattern: 6,
        }
    }

    fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.hidden / self.heads)
    }
}

/// Per architecture: special tokens (in id order from 0), chat template, BOS and EOS.
struct TokenFormat {
    specials: &'static [&'static str],
    /// Added tokens after the special ones that are text, not special (decoded whatever
    /// `skip_special_tokens` says): Qwen3's thinking markers, as its tokenizer has them.
    added_text: &'static [&'static str],
    bos: Option<&'static str>,
    /// `tokenizer_config.json`'s eos_token.
    eos: &'static str,
    /// `generation_config.json`'s eos ids (by token).
    stop: &'static [&'static str],
    chat_template: &'static str,
}

fn token_format(arch: Arch) -> TokenFormat {
    match arch {
        Arch::Llama => TokenFormat {
            specials: &["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
            added_text: &[],
            bos: Some("<|begin_of_text|>"),
            eos: "<|eot_id|>",
            stop: &["<|end_of_text|>", "<|eot_id|>"],
            chat_template: "{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}",
        },
        Arch::Qwen2 | Arch::Qwen3 => TokenFormat {
            specials: &["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            added_text: if arch == Arch::Qwen3 { &["<think>", "</think>"] } else { &[] },
            bos: None,
            eos: "<|im_end|>",
            stop: &["<|im_end|>", "<|endoftext|>"],
            chat_template: "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
        },
        Arch::Mistral => TokenFormat {
            specials: &["<unk>", "<s>", "</s>", "[INST]", "[/INST]"],
            added_text: &[],
            bos: Some("<s>"),
            eos: "</s>",
            stop: &["</s>"],
            chat_template: "{{- bos_token }}{%- for message in messages %}{%- if message['role'] == 'assistant' %}{{- ' ' + message['content'] | trim + eos_token }}{%- else %}{{- '[INST] ' + message['content'] | trim + ' [/INST]' }}{%- endif %}{%- endfor %}",
        },
        Arch::Phi3 => TokenFormat {
            specials: &["<unk>", "<s>", "</s>", "<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>", "<|system|>"],
            added_text: &[],
            bos: Some("<s>"),
            eos: "<|endoftext|>",
            stop: &["<|endoftext|>", "<|assistant|>", "<|end|>"],
            chat_template: "{{- bos_token }}{%- for message in messages %}{{- '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|assistant|>\n' }}{%- endif %}",
        },
        Arch::Gemma3 => TokenFormat {
            specials: &["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"],
            added_text: &[],
            bos: Some("<bos>"),
            eos: "<eos>",
            stop: &["<eos>", "<end_of_turn>"],
            chat_template: "{{- bos_token }}{%- for message in messages %}{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}{{- '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}",
        },
    }
}

fn special_id(fmt: &TokenFormat, token: &str) -> u32 {
    fmt.specials
        .iter()
        .position(|t| *t == token)
        .expect("special token listed") as u32
}

/// Writes a complete model directory for `spec` into `out` (created if needed).
pub fn make_model(spec: &ModelSpec, out: &Path) -> Result<()> {
    if spec.kv_heads == 0 || !spec.heads.is_multiple_of(spec.kv_heads) {
        bail!(
            "heads ({}) must be a multiple of kv-heads ({})",
            spec.heads,
            spec.kv_heads
        );
    }
    if !spec.head_dim().is_multiple_of(2) {
        bail!("head_dim must be even for rotary embeddings");
    }
    ensure!(
        matches!(spec.dtype, DType::F32 | DType::BF16),
        "dtype must be f32 or bf16"
    );
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let fmt = token_format(spec.arch);
    let tokenizer_json = trained_tokenizer(spec.arch, spec.vocab)?;
    std::fs::write(out.join("tokenizer.json"), &tokenizer_json)?;
    write_json(&out.join("tokenizer_config.json"), &tokenizer_config(&fmt))?;
    write_json(&out.join("config.json"), &config_json(spec, &fmt))?;
    let stop: Vec<u32> = fmt.stop.iter().map(|t| special_id(&fmt, t)).collect();
    let mut gen = json!({ "eos_token_id": stop });
    if let Some(bos) = fmt.bos {
        gen["bos_token_id"] = json!(special_id(&fmt, bos));
    }
    write_json(&out.join("generation_config.json"), &gen)?;
    let tensors = random_weights(spec)?;
    candle_core::safetensors::save(&tensors, out.join("model.safetensors"))
        .context("writing model.safetensors")?;
    Ok(())
}

fn write_json(path: &Path, v: &Value) -> Result<()> {
    std::fs::write(path, serde_json::to_string_pretty(v)?)
        .with_context(|| format!("cannot write {}", path.display()))
}

fn tokenizer_config(fmt: &TokenFormat) -> Value {
    let added: serde_json::Map<String, Value> = (fmt.specials.iter().map(|t| (t, true)))
        .chain(fmt.added_text.iter().map(|t| (t, false)))
        .enumerate()
        .map(|(i, (t, special))| {
            (i.to_string(), json!({"content": t, "lstrip": false, "normalized": false, "rstrip": false, "single_word": false, "special": special}))
        })
        .collect();
    json!({
        "added_tokens_decoder": added,
        "bos_token": fmt.bos,
        "eos_token": fmt.eos,
        "chat_template": fmt.chat_template,
        "clean_up_tokenization_spaces": false,
        "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast",
    })
}

fn config_json(s: &ModelSpec, fmt: &TokenFormat) -> Value {
    let dtype = if s.dtype == DType::BF16 {
        "bfloat16"
    } else {
        "float32"
    };
    let eos = special_id(fmt, fmt.stop[0]);
    let bos = fmt.bos.map(|b| special_id(fmt, b)).unwrap_or(eos);
    let common = json!({
        "vocab_size": s.vocab,
        "hidden_size": s.hidden,
        "intermediate_size": s.intermediate,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim(),
        "max_position_embeddings": s.max_pos,
        "rms_norm_eps": 1e-6,
        "attention_bias": false,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": dtype,
        "initializer_range": s.init_std,
    });
    let specific = match s.arch {
        Arch::Llama => json!({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_act": "silu", "mlp_bias": false, "tie_word_embeddings": false,
            "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        }),
        Arch::Qwen2 => json!({
            "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
            "hidden_act": "silu", "tie_word_embeddings": true, "rope_theta": 1000000.0,
            "use_sliding_window": false, "sliding_window": s.max_pos, "max_window_layers": s.layers,
        }),
        Arch::Mistral => json!({
            "architectures": ["MistralForCausalLM"], "model_type": "mistral",
            "hidden_act": "silu", "tie_word_embeddings": false, "rope_theta": 1000000.0,
            "sliding_window": s.sliding_window,
        }),
        Arch::Phi3 => json!({
            "architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
            "hidden_act": "silu", "tie_word_embeddings": false, "rope_theta": 10000.0,
            "rope_scaling": null, "sliding_window": s.sliding_window,
            "original_max_position_embeddings": s.max_pos,
        }),
        Arch::Qwen3 => json!({
            "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
            "hidden_act": "silu", "tie_word_embeddings": true, "rope_theta": 1000000.0,
            "use_sliding_window": false, "sliding_window": null, "max_window_layers": s.layers,
        }),
        Arch::Gemma3 => json!({
            "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
            "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": true,
            "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
            "query_pre_attn_scalar": s.head_dim(), "sliding_window": s.sliding_window,
            "sliding_window_pattern": s.sliding_window_pattern,
            "final_logit_softcapping": null, "attn_logit_softcapping": null,
        }),
    };
    let mut v = common;
    v.as_object_mut()
        .unwrap()
        .extend(specific.as_object().unwrap().clone());
    v
}

/// Normal(0, std) samples from a seeded stream (Box–Muller), so weights are identical on
/// every machine for the same seed.
fn normals(rng: &mut ChaCha8Rng, n: usize, std: f32) -> Vec<f32> {
    let mut out = Vec::with_capacity(n + 1);
    while out.len() < n {
        let u1: f32 = rng.gen_range(f32::EPSILON..1.0);
        let u2: f32 = rng.gen();
        let r = (-2.0 * u1.ln()).sqrt() * std;
        let t = 2.0 * std::f32::consts::PI * u2;
        out.push(r * t.cos());
        out.push(r * t.sin());
    }
    out.truncate(n);
    out
}

fn random_weights(s: &ModelSpec) -> Result<HashMap<String, Tensor>> {
    let dev = Device::Cpu;
    let mut rng = ChaCha8Rng::seed_from_u64(s.seed);
    let (h, d, i) = (s.hidden, s.head_dim(), s.intermediate);
    let mut tensors = HashMap::new();
    let mut add = |name: String, shape: &[usize], values: Vec<f32>| -> Result<()> {
        let t = Tensor::from_vec(values, shape, &dev)?.to_dtype(s.dtype)?;
        tensors.insert(name, t);
        Ok(())
    };
    // Norm weights are perturbed around their neutral value so that a wrongly wired norm
    // changes the output (and tests notice). Gemma stores w with scale (1 + w).
    let gemma = s.arch == Arch::Gemma3;
    let norm = |rng: &mut ChaCha8Rng, n: usize| -> Vec<f32> {
        normals(rng, n, 0.1)
            .into_iter()
            .map(|x| if gemma { x } else { 1.0 + x })
            .collect()
    };
    let std = s.init_std;
    add(
        "model.embed_tokens.weight".into(),
        &[s.vocab, h],
        normals(&mut rng, s.vocab * h, std),
    )?;
    for l in 0..s.layers {
        let p = format!("model.layers.{l}");
        add(
            format!("{p}.self_attn.q_proj.weight"),
            &[s.heads * d, h],
            normals(&mut rng, s.heads * d * h, std),
        )?;
        add(
            format!("{p}.self_attn.k_proj.weight"),
            &[s.kv_heads * d, h],
            normals(&mut rng, s.kv_heads * d * h, std),
        )?;
        add(
            format!("{p}.self_attn.v_proj.weight"),
            &[s.kv_heads * d, h],
            normals(&mut rng, s.kv_heads * d * h, std),
        )?;
        if s.arch == Arch::Qwen2 {
            // Biases as large as the norms' perturbation, so a bias left out shows.
            for (proj, n) in [
                ("q", s.heads * d),
                ("k", s.kv_heads * d),
                ("v", s.kv_heads * d),
            ] {
                add(
                    format!("{p}.self_attn.{proj}_proj.bias"),
                    &[n],
                    normals(&mut rng, n, 0.1),
                )?;
            }
        }
        add(
            format!("{p}.self_attn.o_proj.weight"),
            &[h, s.heads * d],
            normals(&mut rng, h * s.heads * d, std),
        )?;
        add(
            format!("{p}.mlp.gate_proj.weight"),
            &[i, h],
            normals(&mut rng, i * h, std),
        )?;
        add(
            format!("{p}.mlp.up_proj.weight"),
            &[i, h],
            normals(&mut rng, i * h, std),
        )?;
        add(
            format!("{p}.mlp.down_proj.weight"),
            &[h, i],
            normals(&mut rng, h * i, std),
        )?;
        add(
            format!("{p}.input_layernorm.weight"),
            &[h],
            norm(&mut rng, h),
        )?;
        add(
            format!("{p}.post_attention_layernorm.weight"),
            &[h],
            norm(&mut rng, h),
        )?;
        if matches!(s.arch, Arch::Qwen3 | Arch::Gemma3) {
            add(
                format!("{p}.self_attn.q_norm.weight"),
                &[d],
                norm(&mut rng, d),
            )?;
            add(
                format!("{p}.self_attn.k_norm.weight"),
                &[d],
                norm(&mut rng, d),
            )?;
        }
        if gemma {
            add(
                format!("{p}.pre_feedforward_layernorm.weight"),
                &[h],
                norm(&mut rng, h),
            )?;
            add(
                format!("{p}.post_feedforward_layernorm.weight"),
                &[h],
                norm(&mut rng, h),
            )?;
        }
    }
    add("model.norm.weight".into(), &[h], norm(&mut rng, h))?;
    if matches!(s.arch, Arch::Llama | Arch::Mistral | Arch::Phi3) {
        add(
            "lm_head.weight".into(),
            &[s.vocab, h],
            normals(&mut rng, s.vocab * h, std),
        )?;
    }
    if s.arch == Arch::Phi3 {
        fuse(
            &mut tensors,
            s.layers,
            "self_attn",
            &["q_proj", "k_proj", "v_proj"],
            "qkv_proj",
        )?;
        fuse(
            &mut tensors,
            s.layers,
            "mlp",
            &["gate_proj", "up_proj"],
            "gate_up_proj",
        )?;
    }
    Ok(tensors)
}

/// Replaces each layer's `parts` of `module` by one `fused` weight, their rows stacked in
/// order (how Phi-3 stores q, k, v and gate, up).
fn fuse(
    tensors: &mut HashMap<String, Tensor>,
    layers: usize,
    module: &str,
    parts: &[&str],
    fused: &str,
) -> Result<()> {
    for l in 0..layers {
        let name = |part: &str| format!("model.layers.{l}.{module}.{part}.weight");
        let stacked = parts
            .iter()
            .map(|p| tensors.remove(&name(p)).context("a part to fuse"))
            .collect::<Result<Vec<_>>>()?;
        tensors.insert(name(fused), Tensor::cat(&stacked, 0)?);
    }
    Ok(())
}

/// `tokenizer.json` text of a byte-level BPE trained on the corpus with `arch`'s special
/// tokens. Training is deterministic; results are memoised per process because tests
/// build many models.
pub fn trained_tokenizer(arch: Arch, vocab: usize) -> Result<String> {
    static CACHE: Mutex<Vec<((Arch, usize), String)>> = Mutex::new(Vec::new());
    if let Some((_, json)) = CACHE
        .lock()
        .unwrap()
        .iter()
        .find(|(k, _)| *k == (arch, vocab))
    {
        return Ok(json.clone());
    }
    let json = train_tokenizer(&token_format(arch), vocab)?;
    CACHE.lock().unwrap().push(((arch, vocab), json.clone()));
    Ok(json)
}

fn train_tokenizer(fmt: &TokenFormat, vocab: usize) -> Result<String> {
    use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
    use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::processors::template::TemplateProcessing;
    use tokenizers::{AddedToken, Tokenizer};

    let min_vocab = 256 + fmt.specials.len() + fmt.added_text.len();
    if vocab < min_vocab {
        bail!("vocab {vocab} too small: a byte-level tokenizer needs at least {min_vocab} tokens");
    }
    let byte_level = ByteLevel::default().add_prefix_space(false);
    let mut tok = Tokenizer::new(BPE::default());
    tok.with_pre_tokenizer(Some(byte_level));
    tok.with_decoder(Some(ByteLevelDecoder::default()));
    // The text tokens are trained as special ones (whole, never merged into), then marked
    // text below.
    let specials: Vec<AddedToken> = (fmt.specials.iter().chain(fmt.added_text))
        .map(|t| AddedToken::from(t.to_string(), true))
        .collect();
    let mut trainer: tokenizers::models::TrainerWrapper = BpeTrainerBuilder::new()
        .vocab_size(vocab)
        .min_frequency(2)
        .show_progress(false)
        .special_tokens(specials)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build()
        .into();
    let texts = crate::tools::corpus::texts();
    let lines = texts
        .iter()
        .flat_map(|t| t.lines())
        .filter(|l| !l.trim().is_empty());
    tok.train(&mut trainer, lines)
        .map_err(|e| anyhow::anyhow!("training tokenizer: {e}"))?;
    if let Some(bos) = fmt.bos {
        let post = TemplateProcessing::builder()
            .try_single(format!("{bos} $A"))
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .special_tokens(vec![(bos.to_string(), special_id(fmt, bos))])
            .build()?;
        tok.with_post_processor(Some(post));
    }
    let json = tok
        .to_string(true)
        .map_err(|e| anyhow::anyhow!("serialising tokenizer: {e}"))?;
    if fmt.added_text.is_empty() {
        return Ok(json);
    }
    let mut v: Value = serde_json::from_str(&json)?;
    for t in v["added_tokens"].as_array_mut().into_iter().flatten() {
        if fmt.added_text.iter().any(|a| t["content"] == *a) {
            t["special"] = json!(false);
        }
    }
    Ok(serde_json::to_string_pretty(&v)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokenizer_training_is_deterministic_and_round_trips() -> Result<()> {
        let a = train_tokenizer(&token_format(Arch::Llama), 600)?;
        let b = train_tokenizer(&token_format(Arch::Llama), 600)?;
        assert_eq!(a, b);
        let tok =
            tokenizers::Tokenizer::from_bytes(a.as_bytes()).map_err(|e| anyhow::anyhow!("{e}"))?;
        let text = "The scheduler decides, at every step — naïve 日本 ✓";
        let ids = tok
            .encode(text, true)
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .get_ids()
            .to_vec();
        assert_eq!(ids[0], 0, "BOS prepended");
        assert!(ids.len() < text.len(), "merges learned");
        assert_eq!(
            tok.decode(&ids, true).map_err(|e| anyhow::anyhow!("{e}"))?,
            text
        );
        // Special tokens in text are single tokens.
        let eot = tok
            .encode("<|eot_id|>", false)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        assert_eq!(eot.get_ids(), &[4]);
        Ok(())
    }

    #[test]
    fn normals_have_the_requested_spread() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let v = normals(&mut rng, 20_000, 0.5);
        let mean = v.iter().sum::<f32>() / v.len() as f32;
        let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / v.len() as f32;
        assert!(
            mean.abs() < 0.02 && (var.sqrt() - 0.5).abs() < 0.02,
            "mean {mean} std {}",
            var.sqrt()
        );
    }
}
