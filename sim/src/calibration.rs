//! What the simulator knows about one engine on one GPU: the coefficients of the analytic
//! model and the mechanisms the engine runs by, read from calibration files.
//!
//! A calibration file (TOML) is written by `sim calibrate` and referenced by a scenario
//! (`[sim] calibration = "…"`):
//!
//! ```toml
//! hardware = "rtx-5080"
//! engine = "what was measured"
//! source = "how the numbers were found"
//!
//! [mechanisms]                 # how the engine runs; each optional
//! prefill_batching = "padded"  # packed | padded | sequential
//! logits = "all"               # sampled | all
//! attention_scores = "materialized"  # fused | materialized (eager attention's score matrix)
//! contiguous_kv = "grown"       # reserved | grown (a contiguous cache allocated as used)
//! contiguous_decode = "padded"  # ragged | padded (decodes over a contiguous cache as one
//!                              #   batch tensor, padded to the longest context)
//! packed_attention = "masked"  # ragged | masked (a packed pass's sequences as one, kept
//!                              #   apart by a mask: every prompt token against every key)
//! roofline = "overlap"         # overlap | serial (compute and memory time summed)
//! spill_bandwidth_gb_s = 50    # host paging once device memory spills
//! reserved_gib = 2.5           # device memory the engine never gets (a desktop's display)
//! graph_replay_factor = 2.1    # a CUDA-graph decode pass: × its eager time w/o decode attention (>= 1)
//! micro_batch_tokens = 512     # a packed step runs as passes of at most this many tokens
//!                              #   (llama.cpp's n_ubatch), each reading the weights
//! micro_batches = "slot_runs"  # tokens | slot_runs (a pass holds only sequences in
//!                              #   consecutive slots of a contiguous cache: llama.cpp's)
//!
//! [models."llama-3.2-3b"]      # one table per model, every coefficient required
//! compute_efficiency = 0.45
//! attention_efficiency = 0.3
//! decode_attention_efficiency = 0.003  # optional (default: attention_efficiency)
//! bandwidth_efficiency = 0.85
//! single_decode_bandwidth_efficiency = 0.6  # optional: a decode pass of one sequence
//!                              #   (matrix-vector products; default: bandwidth_efficiency)
//! step_overhead_s = 0.003
//! per_seq_overhead_s = 0.0013
//! client_request_s = 0.003
//! client_per_prompt_token_s = 1e-6
//! client_stream_s = 0.001
//! static_batch_window_s = 0    # optional: static batching's fill window
//! static_step_overhead_s = 0.002     # optional: static batching's host costs (default:
//! static_per_seq_overhead_s = 0.001  #   step_overhead_s and per_seq_overhead_s)
//! step_jitter_s = 0.001        # optional: mean host pause per step (default 0)
//! page_fault_s_per_gib = 0.2   # optional: faulting in a buffer past the allocator's mmap
//!                              #   threshold (default: none is faulted)
//! ```
//!
//! A pair with no calibration file named gets the shipped one for its hardware when it
//! lists the model (`sim/calibrations/`: the RTX 5080 with the benchmark log's server), and
//! otherwise generic coefficients of a vLLM-class server. `[sim]` keys override single
//! values on top.

use crate::error::SimError;
use std::collections::BTreeMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::catalog::{HardwareSpec, ModelSpec};
use crate::cost::{ClientPath, ProfileCoverage};
use crate::interval::Residual;
use crate::settings::readable;
use infer_core::{BatchingMode, KvBackend, SchedulerConfig};

#[derive(Debug, Clone, PartialEq)]
pub struct Calibration {
    /// Fraction of the tensor-core peak the matmuls reach.
    pub compute_efficiency: f64,
    /// Fraction of the tensor-core peak attention's QKᵀ and PV reach (lower than the
    /// matmuls' where attention materialises scores or pads: long prompts cost more than
    /// their FLOPs at `compute_efficiency`).
    pub attention_efficiency: f64,
    /// The same for a decode's attention (one query over its whole context): a paged
    /// decode kernel walking scattered blocks can sit far below the roofline, so a long
    /// context costs a decode more than its KV reads.
    pub decode_attention_efficiency: f64,
    /// Fraction of the peak memory bandwidth streaming reads reach.
    pub bandwidth_efficiency: f64,
    /// The same for a decode pass of a single sequence, where it differs (`None`:
    /// `bandwidth_efficiency`). Engines run that pass as matrix-vector products, a kernel
    /// path of its own, and on a CPU it can sit far off the line through larger batches:
    /// llama.cpp's server decodes one sequence of the generated 0.5B Llama in 66 ms, four
    /// in 159 and sixteen in 196 (two cores; docs/results/foreign-servers-cpu.md).
    pub single_decode_bandwidth_efficiency: Option<f64>,
    /// Host time per step not hidden behind the GPU (scheduling, input preparation).
    pub step_overhead_s: f64,
    /// Host time per scheduled sequence (block tables, sampling, detokenising).
    pub per_seq_overhead_s: f64,
    /// Mean of a random pause every step pays on top of its modelled time (exponentially
    /// distributed: garbage collection, the OS scheduling other work, a Python server's
    /// event loop): a mean m puts a single stream's ITL P99 about 3.9 m above its P50
    /// (m ln 100 − m ln 2). The log's single-request baselines have ITL P99 2–5 ms above
    /// the P50 while their TTFT P99, a whole prompt pass, sits only 1–3 ms above its P50:
    /// a pause that does not grow with the step.
    pub step_jitter_s: f64,
    /// Seconds to fault in a GiB of a buffer the allocator maps afresh, where the engine
    /// allocates such buffers every pass (`None`: none; an engine that keeps its buffers,
    /// as every GPU engine's caching allocator does). On a CPU, glibc's malloc maps every
    /// block past its mmap threshold (at most 32 MiB) anew and unmaps it on free, so each
    /// allocation touches fresh pages; the only such buffers priced are a masked pass's
    /// keys and values repeated for every query head ([`PackedAttention::Masked`]).
    /// transformers serving on two cores: a decode step's time per key of context jumps
    /// from 30 to 71 µs once those buffers pass 32 MiB, and back to 30 with the
    /// threshold raised (`MALLOC_MMAP_THRESHOLD_`; docs/results/foreign-servers-cpu.md).
    pub page_fault_s_per_gib: Option<f64>,
    pub client: ClientPath,
    /// Static batching only: how long the engine, idle, waits after a request arrives for
    /// more to fill the batch before starting it.
    pub static_batch_window_s: f64,
    /// Static batching's host time per step, where it differs from continuous batching's
    /// (`None`: `step_overhead_s`). A static engine builds its batch once and loops over
    /// it; a continuous one rebuilds it every step (admission, each sequence's inputs and
    /// cache gathered again). The benchmark log's server decodes a batch of 8 4–6 ms per
    /// token slower with Phase 5's continuous scheduler than with Phase 4's static one
    /// (ITL P50, continuous_batching and paged_attention).
    pub static_step_overhead_s: Option<f64>,
    /// Static batching's host time per scheduled sequence (`None`: `per_seq_overhead_s`).
    pub static_per_seq_overhead_s: Option<f64>,
    /// How the engine batches prompt work with decodes.
    pub prefill: PrefillBatching,
    /// Which positions of a prompt get logits.
    pub logits: LogitRows,
    /// Whether attention keeps its score matrices in memory.
    pub attention_scores: AttentionScores,
    /// Whether a contiguous KV cache takes its memory up front or as it fills.
    pub contiguous_kv: ContiguousKv,
    /// How decodes attend over a contiguous KV cache (a paged one is always ragged:
    /// [`Calibration::for_server`]).
    pub contiguous_decode: ContiguousDecode,
    /// Which keys a packed pass's queries are scored against.
    pub packed_attention: PackedAttention,
    /// Whether a pass's compute and memory traffic overlap.
    pub roofline: Roofline,
    /// Bytes/s at which memory spilled out of the device moves back and forth (host
    /// paging); `None`: the hardware's host link.
    pub spill_bandwidth: Option<f64>,
    /// Device memory the engine never gets, GiB; `None`: the catalog's estimate for the
    /// hardware.
    pub reserved_gib: Option<f64>,
    /// With CUDA graphs, a decode pass replayed from a graph takes this many times its
    /// eager GPU time without its decode attention, never less than eager (1: graphs only
    /// save launches, as in vLLM; the benchmark log's decode steps replayed 1.8× slower at
    /// batch 1 and 2.4× at batch 8, its long-context workloads not at all).
    pub graph_replay_factor: f64,
    /// A packed step of more new tokens than this runs as that many physical passes, each
    /// as large as the others and each reading the weights (llama.cpp's server splits its
    /// logical batch, `n_batch`, into micro-batches of `n_ubatch` tokens and samples after
    /// the last: `llama-batch.cpp`, `server-context.cpp`). `None`: one pass (vLLM, infer).
    pub micro_batch_tokens: Option<usize>,
    /// Which sequences a micro-batch may hold (with `micro_batch_tokens`).
    pub micro_batches: MicroBatches,
    /// Where the numbers come from, in full (the calibration file and the `sim calibrate`
    /// commands that made it: run.json keeps it).
    pub source: String,
    /// The same in one short line: the file's name, what was measured and how many runs
    /// the fit used (the console's).
    pub label: String,
    /// The file's model errors on the runs it was fitted and checked on (every model's:
    /// the intervals pool them).
    pub residuals: Arc<[Residual]>,
    /// This model's coefficients refitted on bootstrap resamples of the fitted runs: how far
    /// they could move on other measurements like these (an interval's seeds each take one).
    pub draws: Arc<[Coefficients]>,
    /// How far the file's runs reached (steps, batch, context): beyond it, a warning.
    pub reach: Option<ProfileCoverage>,
}

/// How an engine runs a step that has both prompt work and decodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum PrefillBatching {
    /// One ragged forward pass over every new token (vLLM, SGLang, infer).
    #[default]
    Packed,
    /// Prompts run as their own forward pass, right-padded to the longest chunk, then the
    /// decodes as a second pass (a Hugging Face `generate`-style server: the benchmark
    /// log's Phases 5–9 "right-padded to the longest prompt").
    Padded,
    /// Each prompt runs as its own forward pass, one after another, then the decodes as a
    /// pass (the benchmark log's Phase 4: batched prefill came with Phase 5).
    Sequential,
}

/// Which positions an engine computes logits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum LogitRows {
    /// Only positions that sample a token (vLLM, infer).
    #[default]
    Sampled,
    /// Every position of the pass (a Hugging Face model's forward without
    /// `logits_to_keep`): extra head FLOPs and vocab logits of memory per token.
    All,
}

/// Whether an engine's attention holds the query × key score matrix in device memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum AttentionScores {
    /// Fused kernels (flash attention, paged decode kernels) stream the scores through
    /// on-chip memory: nothing per query × key pair stays in device memory.
    #[default]
    Fused,
    /// Eager attention (Hugging Face's `eager`, PyTorch's math SDPA) writes each layer's
    /// scores for every head, query and key, masked ones included, and softmaxes them in
    /// fp32: a prompt pass's activations grow with sequences × heads × query × key length.
    Materialized,
}

/// How a contiguous KV cache (`kv_cache_backend = "contiguous"`) takes device memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum ContiguousKv {
    /// Every slot's `max_model_len` tokens up front (a preallocated cache: infer's).
    #[default]
    Reserved,
    /// Each sequence's cache grows with its tokens (Hugging Face's `DynamicCache`): the
    /// device holds the tokens in flight, and activations get the rest.
    Grown,
}

/// How an engine's decodes attend over a contiguous KV cache (`kv_cache_backend =
/// "contiguous"`; a paged decode kernel reads each sequence's own blocks: always ragged).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum ContiguousDecode {
    /// Each decode attends over its own context (a varlen kernel: infer's, vLLM's).
    #[default]
    Ragged,
    /// The step's decodes are gathered into one batch tensor, right-padded to the longest
    /// context, and attention runs over all of it with the padding masked: every decode
    /// reads and attends over the longest context (Hugging Face attention over a batched
    /// cache; the benchmark log's Phases 4–5, whose Phase 6 Triton kernel "fuses
    /// gather+attention during decode, reading K/V directly from scattered blocks").
    Padded,
}

/// Which keys the queries of a packed pass (every sequence's new tokens in one forward pass)
/// are scored against.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum PackedAttention {
    /// Each sequence's queries against its own keys (a varlen or paged kernel: vLLM,
    /// SGLang, llama.cpp, infer).
    #[default]
    Ragged,
    /// The pass's sequences concatenated into one, kept apart by a dense block-diagonal
    /// mask: every prompt token of the pass is scored against every key the pass reads, the
    /// masked pairs included. Transformers' continuous batching with `sdpa` or `paged|eager`
    /// attention (what it runs without flash attention, a CPU's case): `build_attention_mask`
    /// fills one mask of the step's query tokens × all its sequences' keys
    /// (`continuous_batching/input_outputs.py`). A step of many prompts then costs far more
    /// than the prompts apart: nine prompts of 3,186 tokens beside seven decodes score 15
    /// million pairs per head and layer where their own keys give 0.6 million, and took
    /// 15.9 s where six prompts of 1,017 tokens took 3.4 s. A decode's row, bound by reading
    /// the keys, is priced as ragged: decode-only steps grow with the step's keys.
    Masked,
}

/// Which of a step's sequences one micro-batch (a pass of at most `micro_batch_tokens`)
/// may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum MicroBatches {
    /// Any: the step's tokens cut into equal passes.
    #[default]
    Tokens,
    /// Only sequences in consecutive slots of a contiguous cache, an equal number of
    /// tokens each ([`infer_core::SlotPasses`]): llama.cpp's server with a KV stream per
    /// slot, where decodes in slots 0, 4, 8 and 12 run as four passes. Over a paged cache,
    /// `tokens`.
    SlotRuns,
}

/// How a forward pass's compute and memory time combine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Roofline {
    /// The larger of the two: memory streams while the tensor cores compute (a GPU).
    #[default]
    Overlap,
    /// Their sum: the cores wait for memory (a CPU engine on few cores, where the same
    /// cores that compute also move the data).
    Serial,
}

/// A calibration file, as read and as `sim calibrate` writes it.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CalibrationFile {
    pub hardware: String,
    #[serde(default)]
    pub engine: String,
    #[serde(default)]
    pub source: String,
    /// How many runs the fit used and how many it held out (`sim calibrate` writes them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runs_fitted: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runs_held_out: Option<usize>,
    #[serde(default)]
    pub mechanisms: Mechanisms,
    pub models: BTreeMap<String, Coefficients>,
    /// `ln(measured / predicted)` of each run the fit was fitted or checked on (`sim
    /// calibrate` writes them): the model-error part of a prediction's interval.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub residuals: Vec<Residual>,
    /// Each model's coefficients refitted on bootstrap resamples of its fitted runs (`sim
    /// calibrate --bootstrap N`): the coefficients' spread.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub draws: Vec<Draw>,
    /// How far the runs it was fitted to or checked on reached: their largest step's new
    /// tokens, decode batch and sequence context (`sim calibrate` writes it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reach: Option<ProfileCoverage>,
}

/// One bootstrap refit of one model's coefficients.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Draw {
    pub model: String,
    pub coefficients: Coefficients,
}

#[derive(Debug, Clone, Copy, PartialEq, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Mechanisms {
    #[serde(default)]
    pub prefill_batching: PrefillBatching,
    #[serde(default)]
    pub logits: LogitRows,
    #[serde(default)]
    pub attention_scores: AttentionScores,
    #[serde(default)]
    pub contiguous_kv: ContiguousKv,
    #[serde(default)]
    pub contiguous_decode: ContiguousDecode,
    #[serde(default)]
    pub packed_attention: PackedAttention,
    #[serde(default)]
    pub roofline: Roofline,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spill_bandwidth_gb_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reserved_gib: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub graph_replay_factor: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub micro_batch_tokens: Option<usize>,
    #[serde(default, skip_serializing_if = "is_default")]
    pub micro_batches: MicroBatches,
}

fn is_default<T: Default + PartialEq>(v: &T) -> bool {
    *v == T::default()
}

impl Mechanisms {
    /// Every mechanism, `key=value`, on one line.
    pub fn describe(&self) -> String {
        format!(
            "prefill_batching={:?} logits={:?} attention_scores={:?} contiguous_kv={:?} \
             contiguous_decode={:?} packed_attention={:?} roofline={:?} spill_bandwidth_gb_s={} reserved_gib={} \
             graph_replay_factor={} micro_batch_tokens={} micro_batches={:?}",
            self.prefill_batching,
            self.logits,
            self.attention_scores,
            self.contiguous_kv,
            self.contiguous_decode,
            self.packed_attention,
            self.roofline,
            self.spill_bandwidth_gb_s
                .map_or("host link".to_string(), |v| v.to_string()),
            self.reserved_gib
                .map_or("the catalog's".to_string(), |v| v.to_string()),
            self.graph_replay_factor.unwrap_or(1.0),
            self.micro_batch_tokens
                .map_or("none".to_string(), |v| v.to_string()),
            self.micro_batches
        )
    }
}

/// One model's fitted coefficients (the fields of [`Calibration`] that are numbers).
#[derive(Debug, Clone, Copy, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Coefficients {
    pub compute_efficiency: f64,
    pub attention_efficiency: f64,
    /// Absent: as `attention_efficiency` (files written before it existed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_attention_efficiency: Option<f64>,
    pub bandwidth_efficiency: f64,
    /// Absent: as `bandwidth_efficiency`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub single_decode_bandwidth_efficiency: Option<f64>,
    pub step_overhead_s: f64,
    pub per_seq_overhead_s: f64,
    pub client_request_s: f64,
    pub client_per_prompt_token_s: f64,
    pub client_stream_s: f64,
    #[serde(default)]
    pub static_batch_window_s: f64,
    /// Absent: as `step_overhead_s`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub static_step_overhead_s: Option<f64>,
    /// Absent: as `per_seq_overhead_s`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub static_per_seq_overhead_s: Option<f64>,
    /// Absent: 0 (files written before it existed).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub step_jitter_s: f64,
    /// Absent: no buffer is faulted in afresh.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub page_fault_s_per_gib: Option<f64>,
}

fn is_zero(v: &f64) -> bool {
    *v == 0.0
}

/// ", step jitter X ms" where a calibration has one, else "" (for the printed lines).
pub fn jitter_note(step_jitter_s: f64) -> String {
    if step_jitter_s > 0.0 {
        format!(", step jitter {:.2} ms", step_jitter_s * 1e3)
    } else {
        String::new()
    }
}

/// The calibration files shipped in the binary: (name, text).
const SHIPPED: [(&str, &str); 1] = [(
    "sim/calibrations/rtx5080-seed-server.toml",
    include_str!("../calibrations/rtx5080-seed-server.toml"),
)];

/// The shipped files, parsed once (a run's checks prepare the scenario a dozen times, and a
/// file with its residuals and refits takes about a millisecond to parse).
fn shipped() -> Result<&'static [(&'static str, CalibrationFile)], SimError> {
    type Parsed = Result<Vec<(&'static str, CalibrationFile)>, String>;
    static PARSED: std::sync::OnceLock<Parsed> = std::sync::OnceLock::new();
    PARSED
        .get_or_init(|| {
            SHIPPED
                .iter()
                .map(|&(name, text)| CalibrationFile::parse(name, text).map(|f| (name, f)))
                .collect::<Result<_, _>>()
                .map_err(|e| e.to_string())
        })
        .as_ref()
        .map(Vec::as_slice)
        .map_err(|e| SimError::Invalid(e.clone()))
}

/// The largest |`ln(measured / predicted)`| a calibration file's `[[residuals]]` may hold:
/// a prediction off by a factor of e^20 (about 5e8) is no calibration's error but a broken
/// run or a typo.
const MAX_LOG_ERROR: f64 = 20.0;

impl CalibrationFile {
    /// Parse and check a calibration file; errors name the file and the key.
    pub fn parse(file: &str, text: &str) -> Result<CalibrationFile, SimError> {
        let f: CalibrationFile =
            toml::from_str(text).map_err(|e| SimError::content(file, e.to_string().trim_end()))?;
        let at = |key: String, reason: String| SimError::Key {
            file: file.to_string(),
            key,
            reason,
        };
        for (name, c) in &f.models {
            c.check()
                .map_err(|(key, reason)| at(format!("models.{name}.{key}"), reason))?;
        }
        // A bootstrap draw prices a prediction's seeds as the models' coefficients do.
        for (i, d) in f.draws.iter().enumerate() {
            d.coefficients
                .check()
                .map_err(|(key, reason)| at(format!("draws[{i}].coefficients.{key}"), reason))?;
        }
        // An error multiplies a figure by its exponential: a NaN or a huge one would make
        // every interval NaN or infinite.
        for (i, r) in f.residuals.iter().enumerate() {
            let bound = -MAX_LOG_ERROR..=MAX_LOG_ERROR;
            if let Some((metric, e)) = r.errors.iter().find(|(_, e)| !bound.contains(*e)) {
                return Err(at(
                    format!("residuals[{i}].errors.{metric}"),
                    format!(
                        "must be ln(measured / predicted) from -{MAX_LOG_ERROR} to \
                         {MAX_LOG_ERROR} (a factor of e^{MAX_LOG_ERROR}, about 5e8), got {}",
                        readable(*e)
                    ),
                ));
            }
        }
        if let Some(v) = f.mechanisms.spill_bandwidth_gb_s {
            if !(v > 0.0 && v.is_finite()) {
                return Err(SimError::Key {
                    file: file.to_string(),
                    key: "mechanisms.spill_bandwidth_gb_s".into(),
                    reason: format!("must be > 0 GB/s, got {v}"),
                });
            }
        }
        if let Some(v) = f.mechanisms.reserved_gib {
            if !(v >= 0.0 && v.is_finite()) {
                return Err(SimError::Key {
                    file: file.to_string(),
                    key: "mechanisms.reserved_gib".into(),
                    reason: format!("must be >= 0 GiB, got {v}"),
                });
            }
        }
        if f.mechanisms.micro_batch_tokens == Some(0) {
            return Err(SimError::Key {
                file: file.to_string(),
                key: "mechanisms.micro_batch_tokens".into(),
                reason: "must be at least 1 token".into(),
            });
        }
        if let Some(reason) = f
            .mechanisms
            .graph_replay_factor
            .and_then(graph_replay_refusal)
        {
            return Err(SimError::Key {
                file: file.to_string(),
                key: "mechanisms.graph_replay_factor".into(),
                reason,
            });
        }
        Ok(f)
    }

    /// The calibration of `model` on `hw` this file gives, or why it gives none.
    pub fn calibration(
        &self,
        file: &str,
        hw: &HardwareSpec,
        model: &ModelSpec,
    ) -> Result<Calibration, SimError> {
        if self.hardware != hw.name {
            return Err(SimError::content(
                file,
                format!("calibrates hardware `{}`, not `{}`", self.hardware, hw.name),
            ));
        }
        let c = self.models.get(model.name).ok_or_else(|| {
            SimError::content(
                file,
                format!(
                    "has no model `{}` (it has: {})",
                    model.name,
                    self.models.keys().cloned().collect::<Vec<_>>().join(", ")
                ),
            )
        })?;
        let mut cal = Calibration::default_for(hw).with(&self.mechanisms, c);
        cal.source = format!("{file}: {}", self.source);
        cal.label = self.label(file);
        cal.residuals = Arc::from(self.residuals.clone());
        cal.draws = self
            .draws
            .iter()
            .filter(|d| d.model == model.name)
            .map(|d| d.coefficients)
            .collect();
        cal.reach = self.reach;
        Ok(cal)
    }

    /// The file in one line: its name (the path is in the full source), what was measured
    /// and the fit's size, e.g. "x.toml (a vLLM server; 12 runs fitted, 3 held out)".
    fn label(&self, file: &str) -> String {
        let name = std::path::Path::new(file)
            .file_name()
            .map_or(file.into(), |n| n.to_string_lossy());
        let runs = match (self.runs_fitted, self.runs_held_out) {
            (Some(f), Some(h)) => format!("{f} runs fitted, {h} held out"),
            (Some(f), None) => format!("{f} runs fitted"),
            _ => String::new(),
        };
        let about: Vec<&str> = [self.engine.as_str(), &runs]
            .into_iter()
            .filter(|s| !s.is_empty())
            .collect();
        match about.is_empty() {
            true => name.into_owned(),
            false => format!("{name} ({})", about.join("; ")),
        }
    }

    /// The file as TOML text: the residuals last, one `[[residuals]]` entry per run with its
    /// errors on one line.
    pub fn to_toml(&self) -> String {
        let head = CalibrationFile {
            residuals: Vec::new(),
            draws: Vec::new(),
            ..self.clone()
        };
        let mut text = toml::to_string(&head).expect("a calibration file serialises");
        if !self.draws.is_empty() {
            text.push_str(
                "\n# Each model's coefficients refitted on bootstrap resamples of its fitted runs:\n\
                 # how far they could move (a prediction's seeds each take one).\n",
            );
        }
        for d in &self.draws {
            let c = toml::Value::try_from(d.coefficients).expect("coefficients serialise");
            text.push_str(&format!(
                "\n[[draws]]\nmodel = {}\ncoefficients = {c}\n",
                toml::Value::String(d.model.clone()),
            ));
        }
        if !self.residuals.is_empty() {
            text.push_str(
                "\n# ln(measured / predicted) of each run the coefficients were fitted to or \
                 checked on:\n# the model's error in a prediction's interval (`group`: runs of \
                 one configuration).\n",
            );
        }
        for r in &self.residuals {
            let errors: toml::Table = r
                .errors
                .iter()
                .map(|(k, v)| (k.clone(), toml::Value::Float(*v)))
                .collect();
            text.push_str(&format!(
                "\n[[residuals]]\nrun = {}\ngroup = {}\nheld_out = {}\nerrors = {}\n",
                toml::Value::String(r.run.clone()),
                toml::Value::String(r.group.clone()),
                r.held_out,
                toml::Value::Table(errors)
            ));
        }
        text
    }
}

impl Coefficients {
    /// Why the coefficients cannot be used, if they cannot: (the key, the reason).
    fn check(&self) -> Result<(), (&'static str, String)> {
        let c = self;
        for (key, v) in [
            ("compute_efficiency", c.compute_efficiency),
            ("attention_efficiency", c.attention_efficiency),
            (
                "decode_attention_efficiency",
                c.decode_attention_efficiency
                    .unwrap_or(c.attention_efficiency),
            ),
            ("bandwidth_efficiency", c.bandwidth_efficiency),
            (
                "single_decode_bandwidth_efficiency",
                c.single_decode_bandwidth_efficiency
                    .unwrap_or(c.bandwidth_efficiency),
            ),
        ] {
            if !(v > 0.0 && v <= 1.0) {
                return Err((key, format!("must be in (0, 1], got {v}")));
            }
        }
        for (key, v) in [
            ("step_overhead_s", c.step_overhead_s),
            ("per_seq_overhead_s", c.per_seq_overhead_s),
            ("client_request_s", c.client_request_s),
            ("client_per_prompt_token_s", c.client_per_prompt_token_s),
            ("client_stream_s", c.client_stream_s),
            ("static_batch_window_s", c.static_batch_window_s),
            ("static_step_overhead_s", c.static_host().0),
            ("static_per_seq_overhead_s", c.static_host().1),
            ("step_jitter_s", c.step_jitter_s),
            (
                "page_fault_s_per_gib",
                c.page_fault_s_per_gib.unwrap_or(0.0),
            ),
        ] {
            if !(v >= 0.0 && v.is_finite()) {
                return Err((key, format!("must be >= 0 seconds, got {v}")));
            }
        }
        Ok(())
    }

    /// Static batching's host time per step and per sequence: its own where the file sets
    /// them, else continuous batching's.
    pub fn static_host(&self) -> (f64, f64) {
        (
            self.static_step_overhead_s.unwrap_or(self.step_overhead_s),
            self.static_per_seq_overhead_s
                .unwrap_or(self.per_seq_overhead_s),
        )
    }

    /// Every value to four significant digits (what a written file needs; the fit is not
    /// better than that).
    pub fn rounded(mut self) -> Coefficients {
        let round = |v: &mut f64| {
            *v = format!("{:.3e}", *v)
                .parse()
                .expect("a number prints as one")
        };
        for v in [
            &mut self.decode_attention_efficiency,
            &mut self.single_decode_bandwidth_efficiency,
            &mut self.static_step_overhead_s,
            &mut self.static_per_seq_overhead_s,
            &mut self.page_fault_s_per_gib,
        ]
        .into_iter()
        .flatten()
        {
            round(v);
        }
        for v in [
            &mut self.compute_efficiency,
            &mut self.attention_efficiency,
            &mut self.bandwidth_efficiency,
            &mut self.step_overhead_s,
            &mut self.per_seq_overhead_s,
            &mut self.client_request_s,
            &mut self.client_per_prompt_token_s,
            &mut self.client_stream_s,
            &mut self.static_batch_window_s,
            &mut self.step_jitter_s,
        ] {
            round(v);
        }
        self
    }

    pub fn of(c: &Calibration) -> Coefficients {
        Coefficients {
            compute_efficiency: c.compute_efficiency,
            attention_efficiency: c.attention_efficiency,
            // Tied (absent) unless it differs from the prompts' efficiency.
            decode_attention_efficiency: (c.decode_attention_efficiency != c.attention_efficiency)
                .then_some(c.decode_attention_efficiency),
            bandwidth_efficiency: c.bandwidth_efficiency,
            single_decode_bandwidth_efficiency: c.single_decode_bandwidth_efficiency,
            step_overhead_s: c.step_overhead_s,
            per_seq_overhead_s: c.per_seq_overhead_s,
            client_request_s: c.client.request_s,
            client_per_prompt_token_s: c.client.per_prompt_token_s,
            client_stream_s: c.client.stream_s,
            static_batch_window_s: c.static_batch_window_s,
            static_step_overhead_s: c.static_step_overhead_s,
            static_per_seq_overhead_s: c.static_per_seq_overhead_s,
            step_jitter_s: c.step_jitter_s,
            page_fault_s_per_gib: c.page_fault_s_per_gib,
        }
    }
}

impl Mechanisms {
    pub fn of(c: &Calibration) -> Mechanisms {
        Mechanisms {
            prefill_batching: c.prefill,
            logits: c.logits,
            attention_scores: c.attention_scores,
            contiguous_kv: c.contiguous_kv,
            contiguous_decode: c.contiguous_decode,
            packed_attention: c.packed_attention,
            roofline: c.roofline,
            spill_bandwidth_gb_s: c.spill_bandwidth.map(|b| b / 1e9),
            reserved_gib: c.reserved_gib,
            graph_replay_factor: (c.graph_replay_factor != 1.0).then_some(c.graph_replay_factor),
            micro_batch_tokens: c.micro_batch_tokens,
            micro_batches: c.micro_batches,
        }
    }
}

/// The `source` of [`Calibration::default_for`]'s coefficients.
pub const UNCALIBRATED: &str = "uncalibrated defaults";

impl Calibration {
    /// Generic coefficients for a pair nobody calibrated: a vLLM-class server.
    pub fn default_for(hw: &HardwareSpec) -> Calibration {
        let _ = hw;
        Calibration {
            compute_efficiency: 0.5,
            attention_efficiency: 0.5,
            decode_attention_efficiency: 0.5,
            bandwidth_efficiency: 0.8,
            single_decode_bandwidth_efficiency: None,
            step_overhead_s: 1.0e-3,
            per_seq_overhead_s: 30e-6,
            step_jitter_s: 0.0,
            page_fault_s_per_gib: None,
            client: ClientPath {
                request_s: 2e-3,
                per_prompt_token_s: 1e-6,
                stream_s: 0.3e-3,
                overlap_step_loss: 0.0,
            },
            static_batch_window_s: 0.0,
            static_step_overhead_s: None,
            static_per_seq_overhead_s: None,
            prefill: PrefillBatching::Packed,
            logits: LogitRows::Sampled,
            attention_scores: AttentionScores::Fused,
            contiguous_kv: ContiguousKv::Reserved,
            contiguous_decode: ContiguousDecode::Ragged,
            packed_attention: PackedAttention::Ragged,
            roofline: Roofline::Overlap,
            spill_bandwidth: None,
            reserved_gib: None,
            graph_replay_factor: 1.0,
            micro_batch_tokens: None,
            micro_batches: MicroBatches::Tokens,
            source: UNCALIBRATED.into(),
            label: "uncalibrated defaults".into(),
            residuals: Arc::from([]),
            draws: Arc::from([]),
            reach: None,
        }
    }

    /// The calibration for a pair: from the shipped file that lists it, else the defaults.
    pub fn for_pair(hw: &HardwareSpec, model: &ModelSpec) -> Result<Calibration, SimError> {
        for (name, f) in shipped()? {
            if f.hardware == hw.name && f.models.contains_key(model.name) {
                return f.calibration(name, hw, model);
            }
        }
        Ok(Calibration::default_for(hw))
    }

    /// The calibration a server configured by `cfg` prices its steps with: under static
    /// batching, its own host costs where the calibration has them; over a paged KV cache,
    /// ragged decodes and micro-batches of any sequences.
    pub fn for_server(mut self, cfg: &SchedulerConfig) -> Calibration {
        if cfg.kv_cache_backend != KvBackend::Contiguous {
            self.contiguous_decode = ContiguousDecode::Ragged;
            self.micro_batches = MicroBatches::Tokens;
        }
        if cfg.batching_mode == BatchingMode::Static {
            self.step_overhead_s = self.static_step_overhead_s.unwrap_or(self.step_overhead_s);
            self.per_seq_overhead_s = self
                .static_per_seq_overhead_s
                .unwrap_or(self.per_seq_overhead_s);
        }
        self
    }

    /// The same calibration with `mechanisms` and `c` put in.
    pub fn with(&self, mechanisms: &Mechanisms, c: &Coefficients) -> Calibration {
        Calibration {
            compute_efficiency: c.compute_efficiency,
            attention_efficiency: c.attention_efficiency,
            decode_attention_efficiency: c
                .decode_attention_efficiency
                .unwrap_or(c.attention_efficiency),
            bandwidth_efficiency: c.bandwidth_efficiency,
            single_decode_bandwidth_efficiency: c.single_decode_bandwidth_efficiency,
            step_overhead_s: c.step_overhead_s,
            per_seq_overhead_s: c.per_seq_overhead_s,
            step_jitter_s: c.step_jitter_s,
            page_fault_s_per_gib: c.page_fault_s_per_gib,
            client: ClientPath {
                request_s: c.client_request_s,
                per_prompt_token_s: c.client_per_prompt_token_s,
                stream_s: c.client_stream_s,
                overlap_step_loss: 0.0,
            },
            static_batch_window_s: c.static_batch_window_s,
            static_step_overhead_s: c.static_step_overhead_s,
            static_per_seq_overhead_s: c.static_per_seq_overhead_s,
            prefill: mechanisms.prefill_batching,
            logits: mechanisms.logits,
            attention_scores: mechanisms.attention_scores,
            contiguous_kv: mechanisms.contiguous_kv,
            contiguous_decode: mechanisms.contiguous_decode,
            packed_attention: mechanisms.packed_attention,
            roofline: mechanisms.roofline,
            spill_bandwidth: mechanisms.spill_bandwidth_gb_s.map(|g| g * 1e9),
            reserved_gib: mechanisms.reserved_gib,
            graph_replay_factor: mechanisms.graph_replay_factor.unwrap_or(1.0),
            micro_batch_tokens: mechanisms.micro_batch_tokens,
            micro_batches: mechanisms.micro_batches,
            source: self.source.clone(),
            label: self.label.clone(),
            residuals: self.residuals.clone(),
            draws: self.draws.clone(),
            reach: self.reach,
        }
    }
}

/// Why a graph replay factor is refused, if it is: below 1 it would claim a graph runs the
/// GPU's work faster than eager (what graphs save, launches, is priced apart).
pub fn graph_replay_refusal(v: f64) -> Option<String> {
    (!(v >= 1.0 && v.is_finite()))
        .then(|| format!("must be >= 1 (graphs save launches, not GPU time), got {v}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::{find_hardware, find_model};
    use infer_core::workload::Scenario;

    #[test]
    fn shipped_coefficients_are_physically_plausible() {
        let hw = find_hardware("rtx-5080").unwrap();
        for m in ["llama-3.2-3b", "qwen3-4b", "gemma-3-1b"] {
            let c = Calibration::for_pair(&hw, &find_model(m).unwrap()).unwrap();
            assert!(c.source.contains("rtx5080-seed-server"), "{m}: {c:?}");
            assert!((0.1..0.9).contains(&c.compute_efficiency), "{m}: {c:?}");
            assert!((0.5e-3..10e-3).contains(&c.step_overhead_s), "{m}: {c:?}");
            assert!((0.1e-3..5e-3).contains(&c.per_seq_overhead_s), "{m}: {c:?}");
            let (step, per_seq) = (c.static_step_overhead_s, c.static_per_seq_overhead_s);
            assert!(
                step.is_some_and(|s| (0.5e-3..10e-3).contains(&s)),
                "{m}: {c:?}"
            );
            assert!(
                per_seq.is_some_and(|s| (0.1e-3..5e-3).contains(&s)),
                "{m}: {c:?}"
            );
        }
        // A pair no file lists gets the generic defaults.
        let h100 = find_hardware("h100-80gb").unwrap();
        let c = Calibration::for_pair(&h100, &find_model("llama-3.2-3b").unwrap()).unwrap();
        assert_eq!(c, Calibration::default_for(&h100));
    }

    #[test]
    fn a_calibrations_label_names_its_file_engine_and_fit_size_in_short() {
        let hw = find_hardware("rtx-5080").unwrap();
        let llama = find_model("llama-3.2-3b").unwrap();
        let c = Calibration::for_pair(&hw, &llama).unwrap();
        assert_eq!(
            c.label,
            "rtx5080-seed-server.toml (the benchmark log's Python server (Phases 4-8); \
             34 runs fitted, 45 held out)"
        );
        assert!(
            c.source.len() > 500,
            "the full provenance stays: {}",
            c.source
        );
        let bare = CalibrationFile {
            engine: String::new(),
            runs_fitted: None,
            runs_held_out: None,
            ..CalibrationFile::parse(SHIPPED[0].0, SHIPPED[0].1).unwrap()
        };
        let c = bare.calibration("runs/mine.toml", &hw, &llama).unwrap();
        assert_eq!(c.label, "mine.toml");
        assert_eq!(Calibration::default_for(&hw).label, "uncalibrated defaults");
    }

    #[test]
    fn calibration_files_round_trip_and_bad_ones_name_the_key() {
        let hw = find_hardware("rtx-5080").unwrap();
        let llama = find_model("llama-3.2-3b").unwrap();
        let (name, text) = SHIPPED[0];
        let f = CalibrationFile::parse(name, text).unwrap();
        let again = CalibrationFile::parse("again.toml", &f.to_toml()).unwrap();
        assert_eq!(f, again);
        let c = again.calibration("again.toml", &hw, &llama).unwrap();
        assert_eq!(Coefficients::of(&c), f.models["llama-3.2-3b"]);
        let bad = text.replace("compute_efficiency = ", "compute_efficiency = 1");
        let e = CalibrationFile::parse("bad.toml", &bad)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("bad.toml") && e.contains("compute_efficiency"),
            "{e}"
        );
        let negative = text.replacen(
            "static_per_seq_overhead_s = ",
            "static_per_seq_overhead_s = -",
            1,
        );
        assert_ne!(
            negative, text,
            "the shipped file sets static batching's host costs"
        );
        let e = CalibrationFile::parse("neg.toml", &negative)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("neg.toml") && e.contains("static_per_seq_overhead_s"),
            "{e}"
        );
        let e = CalibrationFile::parse("x.toml", "hardware = \"rtx-5080\"\nbogus = 1\n[models]\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("x.toml") && e.contains("bogus"), "{e}");
        let slower = text.replace("graph_replay_factor = 2.1", "graph_replay_factor = 0.5");
        assert_ne!(slower, text, "the shipped file sets a replay factor");
        let e = CalibrationFile::parse("fast.toml", &slower)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("fast.toml") && e.contains("graph_replay_factor"),
            "{e}"
        );
        // Micro-batches: kept through a round trip and into the calibration; 0 refused.
        let micro = text.replace(
            "graph_replay_factor = 2.1",
            "graph_replay_factor = 2.1\nmicro_batch_tokens = 512",
        );
        let m = CalibrationFile::parse("micro.toml", &micro).unwrap();
        assert_eq!(m.mechanisms.micro_batch_tokens, Some(512));
        assert_eq!(
            CalibrationFile::parse("again.toml", &m.to_toml()).unwrap(),
            m
        );
        let c = m.calibration("micro.toml", &hw, &llama).unwrap();
        assert_eq!(c.micro_batch_tokens, Some(512));
        assert_eq!(Mechanisms::of(&c).micro_batch_tokens, Some(512));
        let zero = micro.replace("micro_batch_tokens = 512", "micro_batch_tokens = 0");
        let e = CalibrationFile::parse("zero.toml", &zero)
            .unwrap_err()
            .to_string();
        assert!(e.contains("mechanisms.micro_batch_tokens"), "{e}");
        // A single sequence's decode bandwidth: kept through a round trip and into the
        // calibration (the file's first model, Gemma 3); outside (0, 1] refused naming the
        // key.
        let gemv = text.replacen(
            "bandwidth_efficiency = ",
            "single_decode_bandwidth_efficiency = 0.314\nbandwidth_efficiency = ",
            1,
        );
        let g = CalibrationFile::parse("gemv.toml", &gemv).unwrap();
        assert_eq!(
            CalibrationFile::parse("again.toml", &g.to_toml()).unwrap(),
            g
        );
        let gemma = find_model("gemma-3-1b").unwrap();
        let c = g.calibration("gemv.toml", &hw, &gemma).unwrap();
        assert_eq!(c.single_decode_bandwidth_efficiency, Some(0.314));
        let e = CalibrationFile::parse("fast.toml", &gemv.replace("= 0.314", "= 1.5"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("single_decode_bandwidth_efficiency"), "{e}");
        let e = f
            .calibration(name, &find_hardware("l4").unwrap(), &llama)
            .unwrap_err()
            .to_string();
        assert!(e.contains("rtx-5080") && e.contains("l4"), "{e}");
        let e = f
            .calibration(name, &hw, &find_model("llama-3.1-8b").unwrap())
            .unwrap_err()
            .to_string();
        assert!(e.contains("llama-3.1-8b") && e.contains("qwen3-4b"), "{e}");
    }

    #[test]
    fn bad_draws_and_residuals_are_refused_naming_the_entry_and_key() {
        let (_, text) = SHIPPED[0];
        let err = |bad: &str| {
            assert_ne!(bad, text, "the replacement applies");
            CalibrationFile::parse("bad.toml", bad)
                .unwrap_err()
                .to_string()
        };
        // The first draw's host costs and efficiencies, checked as the models' are.
        let e = err(&text.replacen(
            "step_overhead_s = 0.006036 }",
            "step_overhead_s = -0.006 }",
            1,
        ));
        assert_eq!(
            e,
            "bad.toml: key `draws[0].coefficients.step_overhead_s`: must be >= 0 seconds, \
             got -0.006"
        );
        let e = err(&text.replacen(
            "{ attention_efficiency = 0.8,",
            "{ attention_efficiency = 1.8,",
            1,
        ));
        assert!(
            e.contains("key `draws[0].coefficients.attention_efficiency`: must be in (0, 1]"),
            "{e}"
        );
        // The first residual's errors: NaN, and one far past any model's error.
        let e = err(&text.replacen("median_itl_ms = -0.08945", "median_itl_ms = nan", 1));
        assert!(
            e.contains("key `residuals[0].errors.median_itl_ms`: must be ln(measured / predicted)")
                && e.ends_with("got NaN"),
            "{e}"
        );
        let e = err(&text.replacen("median_itl_ms = -0.08945", "median_itl_ms = 1e300", 1));
        assert!(
            e.contains("residuals[0].errors.median_itl_ms") && e.ends_with("got 1e300"),
            "{e}"
        );
    }

    #[test]
    fn overrides_in_the_sim_table_reach_the_calibration() {
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../scenarios/baseline.toml"
        ))
        .unwrap();
        let s = Scenario::parse(
            "baseline.toml",
            &text,
            &["sim.step_overhead_s=0.002".into()],
        )
        .unwrap();
        let settings = crate::settings::SimSettings::from_scenario(&s).unwrap();
        assert_eq!(settings.step_overhead_s, Some(0.002));
    }
}
