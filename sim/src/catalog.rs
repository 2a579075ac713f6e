//! The hardware and model catalog: published numbers only, each with its source.
//!
//! Hardware figures are the vendors' dense (no 2:4 sparsity) tensor-core peaks and memory
//! bandwidths. Model figures are the architecture fields of each model's `config.json` on
//! the Hugging Face hub. Everything derived (parameter count, FLOPs and KV bytes per token)
//! is computed here from those fields, so a reader can check each number by hand.

use crate::error::SimError;
use infer_core::{hf_config, FileError};
use std::fmt;

const GB: f64 = 1e9;
/// Bytes in a GiB (memory plans and warnings print GiB).
pub const GIB: f64 = 1024.0 * 1024.0 * 1024.0;
const TFLOPS: f64 = 1e12;

/// Element types of weights and KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    F32,
    Bf16,
    Fp8,
}

impl Dtype {
    pub fn bytes(self) -> f64 {
        match self {
            Dtype::F32 => 4.0,
            Dtype::Bf16 => 2.0,
            Dtype::Fp8 => 1.0,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16",
            Dtype::Fp8 => "fp8",
        }
    }
}

/// One GPU, as the roofline needs it.
#[derive(Debug, Clone, PartialEq)]
pub struct HardwareSpec {
    pub name: &'static str,
    pub description: &'static str,
    /// Device memory in bytes.
    pub memory_bytes: f64,
    /// Memory the runtime never gets: CUDA context, framework workspaces and, on a desktop
    /// card, the display. Our estimate, stated per device.
    pub reserved_bytes: f64,
    /// Peak memory bandwidth, bytes/s.
    pub bandwidth: f64,
    /// Dense tensor-core peak for bf16 inputs with fp32 accumulation, FLOP/s.
    pub bf16_flops: f64,
    /// Dense fp8 peak, FLOP/s; `None` where the tensor cores have no fp8 (A100), in which
    /// case fp8 weights are dequantised and multiplied at the bf16 rate.
    pub fp8_flops: Option<f64>,
    /// Host link for memory spilled out of the device (PCIe), bytes/s, one direction.
    pub host_link: f64,
    /// GPU-to-GPU bandwidth for tensor-parallel all-reduce, bytes/s per direction.
    pub peer_link: f64,
    /// Launch cost of one kernel issued eagerly from the host, seconds.
    pub kernel_launch_s: f64,
    /// Launch cost of replaying one captured CUDA graph, seconds.
    pub graph_launch_s: f64,
}

impl HardwareSpec {
    pub fn flops(&self, dtype: Dtype) -> f64 {
        match dtype {
            // The catalog keeps no f32 peak: the bf16 one, and the fitted efficiencies
            // take the difference (transformers' f32 prompts on two Zen 4 cores reach
            // half the bf16 peak, where AVX-512 f32 FMAs give at most half).
            Dtype::F32 | Dtype::Bf16 => self.bf16_flops,
            Dtype::Fp8 => self.fp8_flops.unwrap_or(self.bf16_flops),
        }
    }
}

/// One model's architecture (decoder-only, gated MLP, grouped-query attention).
#[derive(Debug, Clone, PartialEq)]
pub struct ModelSpec {
    pub name: &'static str,
    pub hf_id: &'static str,
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    pub vocab: usize,
    /// Input embedding and output head share one matrix.
    pub tied_embeddings: bool,
    pub weight_dtype: Dtype,
    pub kv_dtype: Dtype,
    /// Tensor-parallel degree: weights, heads and KV are split over this many GPUs.
    pub tp: usize,
    /// Kernels launched per layer by an eager (non-graph) forward pass: norms, the fused
    /// QKV and output projections, rotary, attention, the MLP's matmuls and activation,
    /// residual adds. Our count; it sets the launch-overhead term.
    pub kernels_per_layer: usize,
}

impl ModelSpec {
    /// Matmul parameters of one layer: Q, K, V, O projections and the gated MLP.
    pub fn layer_params(&self) -> f64 {
        let (h, hd) = (self.hidden as f64, self.head_dim as f64);
        let q = h * self.heads as f64 * hd;
        let kv = 2.0 * h * self.kv_heads as f64 * hd;
        let o = self.heads as f64 * hd * h;
        let mlp = 3.0 * h * self.intermediate as f64;
        q + kv + o + mlp
    }

    /// Parameters every token is multiplied through (all layers, no embedding lookup).
    pub fn linear_params(&self) -> f64 {
        self.layers as f64 * self.layer_params()
    }

    /// The output head (vocab × hidden), applied only to positions that sample.
    pub fn head_params(&self) -> f64 {
        (self.vocab * self.hidden) as f64
    }

    /// All parameters: layers + embedding (+ a separate output head when untied).
    pub fn params(&self) -> f64 {
        let embed = self.head_params();
        self.linear_params()
            + if self.tied_embeddings {
                embed
            } else {
                2.0 * embed
            }
    }

    /// Weight bytes over all GPUs.
    pub fn weight_bytes(&self) -> f64 {
        self.params() * self.weight_dtype.bytes()
    }

    /// KV-cache bytes per token over all GPUs: K and V, every layer, every KV head.
    pub fn kv_bytes_per_token(&self) -> f64 {
        (2 * self.layers * self.kv_heads * self.head_dim) as f64 * self.kv_dtype.bytes()
    }

    /// Activation working set per token in flight in one forward pass, in bytes: the
    /// residual stream and a few hidden-sized temporaries (norm, QKV, attention output)
    /// plus the gated MLP's gate, up and product; about 6 × hidden + 3 × intermediate
    /// values in bf16. Layers run one after another, so this does not scale with depth.
    pub fn activation_bytes_per_token(&self) -> f64 {
        (6 * self.hidden + 3 * self.intermediate) as f64 * 2.0
    }
}

/// Errors naming what was asked for and what exists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownName {
    pub kind: &'static str,
    pub name: String,
    pub valid: Vec<&'static str>,
}

impl fmt::Display for UnknownName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "unknown {} `{}`; valid names: {}",
            self.kind,
            self.name,
            self.valid.join(", ")
        )
    }
}

impl std::error::Error for UnknownName {}

/// The GPUs the simulator knows.
pub fn hardware() -> Vec<HardwareSpec> {
    vec![
        // GeForce RTX 5080 (GB203): 16 GB GDDR7 at 30 Gbps on 256 bits = 960 GB/s (NVIDIA
        // product page). Tensor peak: NVIDIA quotes 1801 AI TOPS for FP4 with sparsity; the
        // RTX Blackwell whitepaper's ladder halves per precision step and for sparsity,
        // giving 450 TFLOPS dense fp8 and 225 dense fp16/bf16 with fp16 accumulation;
        // GeForce parts run fp32 accumulation (what PyTorch uses) at half that: 112.6.
        // Desktop card driving a display: 1.5 GiB reserved (context, allocator, display).
        HardwareSpec {
            name: "rtx-5080",
            description: "NVIDIA GeForce RTX 5080, 16 GB GDDR7, PCIe 5.0",
            memory_bytes: 16.0 * GIB,
            reserved_bytes: 1.5 * GIB,
            bandwidth: 960.0 * GB,
            bf16_flops: 112.6 * TFLOPS,
            fp8_flops: Some(225.1 * TFLOPS),
            host_link: 50.0 * GB, // PCIe 5.0 x16, ~64 GB/s raw, ~50 achieved
            peer_link: 25.0 * GB, // no NVLink: peer traffic over PCIe
            kernel_launch_s: 8e-6,
            graph_launch_s: 20e-6,
        },
        // NVIDIA L4 datasheet: 24 GB GDDR6, 300 GB/s, 121 TFLOPS bf16 and 242.5 fp8 dense
        // (the datasheet's 242 / 485 are with sparsity).
        HardwareSpec {
            name: "l4",
            description: "NVIDIA L4, 24 GB GDDR6, PCIe 4.0",
            memory_bytes: 24.0 * GIB,
            reserved_bytes: 1.0 * GIB,
            bandwidth: 300.0 * GB,
            bf16_flops: 121.0 * TFLOPS,
            fp8_flops: Some(242.5 * TFLOPS),
            host_link: 25.0 * GB,
            peer_link: 25.0 * GB,
            kernel_launch_s: 6e-6,
            graph_launch_s: 15e-6,
        },
        // NVIDIA A100 80GB SXM datasheet: 2,039 GB/s HBM2e, 312 TFLOPS bf16 dense, no fp8
        // tensor cores; NVLink 3: 600 GB/s total, 300 per direction.
        HardwareSpec {
            name: "a100-80gb",
            description: "NVIDIA A100 80GB SXM, HBM2e, NVLink 3",
            memory_bytes: 80.0 * GIB,
            reserved_bytes: 1.0 * GIB,
            bandwidth: 2039.0 * GB,
            bf16_flops: 312.0 * TFLOPS,
            fp8_flops: None,
            host_link: 25.0 * GB,
            peer_link: 300.0 * GB,
            kernel_launch_s: 5e-6,
            graph_launch_s: 15e-6,
        },
        // NVIDIA H100 SXM5 datasheet: 80 GB HBM3 at 3.35 TB/s, 989 TFLOPS bf16 and 1,979
        // fp8 dense (the datasheet's 1,979 / 3,958 are with sparsity); NVLink 4: 900 GB/s
        // total, 450 per direction.
        HardwareSpec {
            name: "h100-80gb",
            description: "NVIDIA H100 80GB SXM5, HBM3, NVLink 4",
            memory_bytes: 80.0 * GIB,
            reserved_bytes: 1.0 * GIB,
            bandwidth: 3350.0 * GB,
            bf16_flops: 989.0 * TFLOPS,
            fp8_flops: Some(1979.0 * TFLOPS),
            host_link: 50.0 * GB,
            peer_link: 450.0 * GB,
            kernel_launch_s: 4e-6,
            graph_launch_s: 12e-6,
        },
        // NVIDIA H200 SXM datasheet: 141 GB HBM3e at 4.8 TB/s; same compute as H100 SXM.
        HardwareSpec {
            name: "h200",
            description: "NVIDIA H200 SXM, 141 GB HBM3e, NVLink 4",
            memory_bytes: 141.0 * GB,
            reserved_bytes: 1.0 * GIB,
            bandwidth: 4800.0 * GB,
            bf16_flops: 989.0 * TFLOPS,
            fp8_flops: Some(1979.0 * TFLOPS),
            host_link: 50.0 * GB,
            peer_link: 450.0 * GB,
            kernel_launch_s: 4e-6,
            graph_launch_s: 12e-6,
        },
        // The project's CPU machine, where `engine serve` runs on candle: 2 cores of an AMD
        // EPYC (Zen 4) with AVX-512 BF16. Peak: 2 cores x 3.7 GHz (boost) x 64 bf16 FLOP a
        // cycle (one 512-bit VDPBF16PS a cycle); bandwidth: the read bandwidth `runner_bench` measures
        // beside its figures (30-57 GB/s on this shared machine). An op's dispatch takes the
        // place of a kernel launch. Nominal numbers: `sim calibrate` fits the efficiencies.
        HardwareSpec {
            name: "cpu-zen4-2c",
            description: "2 cores of an AMD EPYC (Zen 4, AVX-512 BF16), the project's CPU",
            memory_bytes: 24.0 * GIB,
            reserved_bytes: 2.0 * GIB,
            bandwidth: 40.0 * GB,
            bf16_flops: 0.47 * TFLOPS,
            fp8_flops: None,
            host_link: 40.0 * GB,
            peer_link: 10.0 * GB,
            kernel_launch_s: 5e-6,
            graph_launch_s: 5e-6,
        },
    ]
}

/// The models the simulator knows (fields from each model's `config.json`).
pub fn models() -> Vec<ModelSpec> {
    let llama31_8b = ModelSpec {
        name: "llama-3.1-8b",
        hf_id: "meta-llama/Llama-3.1-8B-Instruct",
        layers: 32,
        hidden: 4096,
        heads: 32,
        kv_heads: 8,
        head_dim: 128,
        intermediate: 14336,
        vocab: 128256,
        tied_embeddings: false,
        weight_dtype: Dtype::Bf16,
        kv_dtype: Dtype::Bf16,
        tp: 1,
        kernels_per_layer: 14,
    };
    vec![
        ModelSpec {
            name: "llama-3.2-3b",
            hf_id: "meta-llama/Llama-3.2-3B-Instruct",
            layers: 28,
            hidden: 3072,
            heads: 24,
            kv_heads: 8,
            head_dim: 128,
            intermediate: 8192,
            vocab: 128256,
            tied_embeddings: true,
            ..llama31_8b.clone()
        },
        ModelSpec {
            name: "qwen3-4b",
            hf_id: "Qwen/Qwen3-4B",
            layers: 36,
            hidden: 2560,
            heads: 32,
            kv_heads: 8,
            head_dim: 128,
            intermediate: 9728,
            vocab: 151936,
            tied_embeddings: true,
            kernels_per_layer: 16, // + per-head Q and K norms
            ..llama31_8b.clone()
        },
        ModelSpec {
            // Text-only 1B; 5 of every 6 layers use a 512-token sliding window, which the
            // attention term ignores (prompts here are mostly short of 2k tokens).
            name: "gemma-3-1b",
            hf_id: "google/gemma-3-1b-it",
            layers: 26,
            hidden: 1152,
            heads: 4,
            kv_heads: 1,
            head_dim: 256,
            intermediate: 6912,
            vocab: 262144,
            tied_embeddings: true,
            kernels_per_layer: 20, // pre- and post-norms around both blocks, Q/K norms
            ..llama31_8b.clone()
        },
        ModelSpec {
            name: "qwen2.5-0.5b",
            hf_id: "Qwen/Qwen2.5-0.5B-Instruct",
            layers: 24,
            hidden: 896,
            heads: 14,
            kv_heads: 2,
            head_dim: 64,
            intermediate: 4864,
            vocab: 151936,
            tied_embeddings: true,
            ..llama31_8b.clone()
        },
        llama31_8b.clone(),
        ModelSpec {
            // Neural Magic's FP8 checkpoint, served with --kv-cache-dtype=fp8 (KubeAI seed).
            name: "llama-3.1-8b-fp8",
            hf_id: "neuralmagic/Meta-Llama-3.1-8B-Instruct-FP8",
            weight_dtype: Dtype::Fp8,
            kv_dtype: Dtype::Fp8,
            ..llama31_8b.clone()
        },
        ModelSpec {
            name: "llama-3.1-70b",
            hf_id: "meta-llama/Llama-3.1-70B-Instruct",
            layers: 80,
            hidden: 8192,
            heads: 64,
            kv_heads: 8,
            head_dim: 128,
            intermediate: 28672,
            tp: 4,
            ..llama31_8b.clone()
        },
        ModelSpec {
            name: "phi-3-mini-4k",
            hf_id: "microsoft/Phi-3-mini-4k-instruct",
            layers: 32,
            hidden: 3072,
            heads: 32,
            kv_heads: 32,
            head_dim: 96,
            intermediate: 8192,
            vocab: 32064,
            tied_embeddings: false,
            ..llama31_8b
        },
    ]
}

pub fn find_hardware(name: &str) -> Result<HardwareSpec, UnknownName> {
    let all = hardware();
    let valid = all.iter().map(|h| h.name).collect();
    all.into_iter().find(|h| h.name == name).ok_or(UnknownName {
        kind: "hardware",
        name: name.to_string(),
        valid,
    })
}

pub fn find_model(name: &str) -> Result<ModelSpec, UnknownName> {
    let all = models();
    let valid = all.iter().map(|m| m.name).collect();
    all.into_iter().find(|m| m.name == name).ok_or(UnknownName {
        kind: "model",
        name: name.to_string(),
        valid,
    })
}

/// A model by catalog name, or a local Hugging Face model directory (its `config.json`:
/// decoder-only, gated MLP, grouped-query attention; priced as bf16 weights and KV, as
/// `engine serve --dtype bf16` runs it, unless `[sim] dtype` says otherwise). A directory's model is named by its last path
/// component, which is what calibration files key it by.
pub fn resolve_model(name: &str) -> Result<ModelSpec, SimError> {
    let dir = std::path::Path::new(name);
    if !dir.join("config.json").is_file() {
        return find_model(name).map_err(|e| {
            SimError::Invalid(format!(
                "{e}; or a model directory with a config.json (none at {name})"
            ))
        });
    }
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(FileError::at(&path, "read"))?;
    let top: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| SimError::content(path.display(), format!("not JSON: {e}")))?;
    // Read as the engine reads it (`infer_core::hf_config`): a multimodal Gemma 3 as its
    // text model, keys left out as the family's transformers class has them.
    let c = hf_config::multimodal_text_config(&top).unwrap_or(top);
    let family = c.get("model_type").and_then(|v| v.as_str()).unwrap_or("");
    let d = hf_config::family_defaults(family);
    let field = |key: &str| -> Result<usize, SimError> {
        c.get(key)
            .and_then(|v| v.as_u64())
            .map(|v| v as usize)
            .or_else(|| d.shape(key))
            .ok_or_else(|| {
                SimError::content(path.display(), format!("`{key}` missing or not a count"))
            })
    };
    let (hidden, heads) = (field("hidden_size")?, field("num_attention_heads")?);
    let leak = |s: String| -> &'static str { Box::leak(s.into_boxed_str()) };
    let short = dir
        .file_name()
        .map_or(name.to_string(), |n| n.to_string_lossy().to_string());
    Ok(ModelSpec {
        name: leak(short),
        hf_id: leak(name.to_string()),
        layers: field("num_hidden_layers")?,
        hidden,
        heads,
        kv_heads: field("num_key_value_heads").unwrap_or(d.num_kv_heads.unwrap_or(heads)),
        head_dim: field("head_dim").unwrap_or(d.head_dim.unwrap_or(hidden / heads)),
        intermediate: field("intermediate_size")?,
        vocab: field("vocab_size")?,
        tied_embeddings: c
            .get("tie_word_embeddings")
            .and_then(|v| v.as_bool())
            .unwrap_or(d.tie_word_embeddings),
        weight_dtype: Dtype::Bf16,
        kv_dtype: Dtype::Bf16,
        tp: 1,
        kernels_per_layer: 14,
    })
}

/// The catalog as `sim catalog` prints it.
pub fn render() -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let _ = writeln!(s, "Hardware");
    let _ = writeln!(
        s,
        "  {:<11} {:>8} {:>10} {:>12} {:>11}  description",
        "name", "mem GB", "BW GB/s", "bf16 TFLOPS", "fp8 TFLOPS"
    );
    for h in hardware() {
        let fp8 = h
            .fp8_flops
            .map_or("-".to_string(), |f| format!("{:.1}", f / TFLOPS));
        let _ = writeln!(
            s,
            "  {:<11} {:>8.1} {:>10.0} {:>12.1} {:>11}  {}",
            h.name,
            h.memory_bytes / GB,
            h.bandwidth / GB,
            h.bf16_flops / TFLOPS,
            fp8,
            h.description
        );
    }
    let _ = writeln!(s, "\nModels");
    let _ = writeln!(
        s,
        "  {:<17} {:>7} {:>6} {:>6} {:>9} {:>4} {:>6} {:>10}  hf id",
        "name", "params", "layers", "hidden", "heads/kv", "tp", "dtype", "KV B/tok"
    );
    for m in models() {
        let _ = writeln!(
            s,
            "  {:<17} {:>6.2}B {:>6} {:>6} {:>9} {:>4} {:>6} {:>10.0}  {}",
            m.name,
            m.params() / 1e9,
            m.layers,
            m.hidden,
            format!("{}/{}", m.heads, m.kv_heads),
            m.tp,
            m.weight_dtype.name(),
            m.kv_bytes_per_token(),
            m.hf_id
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_counts_match_the_published_sizes() {
        // Published sizes: 3.21B, 4.02B, 1.00B, 0.49B, 8.03B, 70.6B, 3.82B.
        let expect = [
            ("llama-3.2-3b", 3.21),
            ("qwen3-4b", 4.02),
            ("gemma-3-1b", 1.00),
            ("qwen2.5-0.5b", 0.49),
            ("llama-3.1-8b", 8.03),
            ("llama-3.1-70b", 70.6),
            ("phi-3-mini-4k", 3.82),
        ];
        for (name, billions) in expect {
            let p = find_model(name).unwrap().params() / 1e9;
            assert!(
                (p - billions).abs() / billions < 0.02,
                "{name}: {p:.3}B vs {billions}B"
            );
        }
    }

    #[test]
    fn kv_bytes_per_token_follow_the_architecture() {
        // Qwen3-4B: 36 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes = 147,456 B; the
        // log's 2048 blocks x 16 tokens of it are its "4.5 GB KV pool".
        let q = find_model("qwen3-4b").unwrap();
        assert_eq!(q.kv_bytes_per_token(), 147_456.0);
        let pool_gib = 2048.0 * 16.0 * q.kv_bytes_per_token() / GIB;
        assert!((pool_gib - 4.5).abs() < 0.1, "{pool_gib}");
        let fp8 = find_model("llama-3.1-8b-fp8").unwrap();
        assert_eq!(fp8.kv_bytes_per_token(), 65_536.0);
    }

    /// A model directory's `config.json` leaving out KV heads, head size or tying is read
    /// as the family's transformers class (and the engine) reads it.
    #[test]
    fn a_directory_takes_its_familys_defaults() {
        let dir = std::env::temp_dir().join(format!("infer-sim-tie-{}", std::process::id()));
        for (model_type, kv_heads, head_dim, tied) in [
            ("gemma3_text", 4, 256, true),
            ("mistral", 8, 128, false),
            ("qwen3", 32, 128, false),
            ("llama", 32, 128, false),
            ("gemma3", 4, 256, true),
        ] {
            std::fs::create_dir_all(&dir).unwrap();
            let mut config = serde_json::json!({
                "model_type": model_type, "hidden_size": 4096, "num_attention_heads": 32,
                "num_hidden_layers": 26, "intermediate_size": 6912, "vocab_size": 262144
            });
            if model_type == "gemma3" {
                // The multimodal layout: the text model's keys nested.
                config = serde_json::json!({"model_type": "gemma3", "text_config": config});
            }
            std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
            let m = resolve_model(dir.to_str().unwrap()).unwrap();
            assert_eq!(
                (m.kv_heads, m.head_dim, m.tied_embeddings),
                (kv_heads, head_dim, tied),
                "{model_type}"
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn unknown_names_list_the_valid_ones() {
        let e = find_hardware("rtx-9090").unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("rtx-9090") && msg.contains("rtx-5080") && msg.contains("h200"),
            "{msg}"
        );
        let e = find_model("gpt-5").unwrap_err().to_string();
        assert!(
            e.contains("llama-3.2-3b") && e.contains("phi-3-mini-4k"),
            "{e}"
        );
    }
}
