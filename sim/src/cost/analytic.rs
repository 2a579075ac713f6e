//! The analytic roofline cost model.
//!
//! For one step on one replica (tensor-parallel degree `tp`, per-GPU numbers), each forward
//! pass of the step is priced as a roofline:
//!
//! ```text
//! flops    = 2 × linear_params × tokens               matmuls of every layer
//!          + 2 × vocab × hidden × logit rows          output head
//!          + 4 × layers × heads × head_dim × pairs    QKᵀ and PV over query×key pairs
//! compute  = (matmul flops / compute_efficiency + attention flops / attention_efficiency
//!             + decode attention flops / decode_attention_efficiency)
//!            / tp / peak_flops(weight dtype)
//! bytes    = weight_bytes / tp                        every weight read once per pass
//!          + kv_bytes_per_token / tp × (context + new tokens)   KV read + written
//!          + layers × heads × score elements × 16 / tp   attention_scores = materialized:
//!            every score written and read on its way through the softmax
//!          + 4 × layers × heads × head_dim × kv dtype × expanded keys / tp
//!            packed_attention = masked with grouped-query heads and more than one
//!            query: the pass's keys and values repeated for every query head, written
//!            and read
//! memory   = bytes / (bandwidth × bandwidth_efficiency)
//!          + 2 × layers × heads × head_dim × kv dtype × expanded keys / GiB
//!            × page_fault_s_per_gib / tp   where the calibration has it and one layer's
//!            repeated K (or V) is at least 32 MiB: glibc maps such a block afresh on
//!            every allocation, and its pages fault in one by one
//!            (a decode pass of one sequence: × single_decode_bandwidth_efficiency where
//!            the calibration has one; it runs matrix-vector products, a path of its own)
//! launch   = layers × kernels_per_layer × kernel_launch_s     eager
//!          = graph_launch_s                                   CUDA graphs, decode-only pass
//! pass     = max(compute, memory, launch)       (roofline = "serial": compute + memory)
//!            a decode-only pass replayed from a CUDA graph: the larger of that and
//!            graph_replay_factor × the same roofline without the decode attention's
//!            compute (the replay slows the rest of the pass, KV reads included), then
//!            the max with its launch
//! comm     = tp > 1: 2 all-reduces per layer of new_tokens × hidden × 2 bytes, ring:
//!            2 (tp − 1) / tp × bytes / peer_link + 10 µs each
//! step     = Σ passes + comm + step_overhead_s + per_seq_overhead_s × scheduled sequences
//!            (+ the simulator's random pause of mean step_jitter_s, drawn per step;
//!            under static batching the static_… host costs where the calibration has them)
//! ```
//!
//! A packed engine (vLLM, infer) runs one ragged pass over every new token, with logits
//! for the sampling rows only. With `contiguous_decode = padded` (over a contiguous cache)
//! every decode attends over, and reads, the step's longest decode context: its pairs and
//! KV reads are decodes × that length, not the sum of their contexts. A padded engine runs
//! the step's prompt chunks as their own pass, right-padded to the longest (tokens = prompt
//! sequences × longest chunk, attention pairs scaled by the padding), then the decodes as a
//! second pass; with `logits = all` its prompt pass computes the head for every position.
//!
//! Compute and memory overlap (the roofline), and kernel launches overlap with execution:
//! the host runs ahead of the GPU, so launches only matter when each kernel is shorter than
//! its launch (small models, small batches): hence a third term of the max, not a sum.
//! The step overhead (scheduling, input preparation) and the per-sequence overhead (block
//! tables, sampling, detokenisation) are host work on the step's critical path.
//!
//! Memory: a step's activations are its largest pass's tokens × activation bytes per token
//! plus its logits (rows × vocab, in the weights' dtype) plus, with
//! `attention_scores = materialized`, one layer's score matrices: heads × the pass's query ×
//! key elements × 6 bytes (eager attention's bf16 scores alive beside their fp32 softmax;
//! a padded prompt pass holds sequences × longest chunk × longest context). The simulator tracks each replica's peak (an
//! allocator keeps what it once reserved) and, when weights + KV pool + that peak exceed
//! the device, charges every later step for moving the excess out and back
//! ([`Analytic::spill_time`]): the benchmark log's "VRAM cliff".

use super::{ClientPath, CostModel, StepShape};
use crate::calibration::{
    AttentionScores, Calibration, ContiguousDecode, LogitRows, MicroBatches, PackedAttention,
    PrefillBatching, Roofline,
};
use crate::catalog::{HardwareSpec, ModelSpec, GIB};
use infer_core::scheduler::graph_bucket;
use infer_core::PassSum;

/// Device bytes per attention score while eager attention softmaxes a layer: the bf16
/// scores and their fp32 softmax are alive together.
const SCORE_BYTES: f64 = 6.0;

/// Device memory traffic per attention score of eager attention, bytes: QKᵀ writes the
/// bf16 score (2), the fp32 softmax reads it and writes its result (2 + 4), the cast back
/// reads that and writes bf16 (4 + 2), PV reads it (2). At ~512 FLOPs per score (QKᵀ and
/// PV over a 128-wide head) that is ~32 FLOPs per byte: below the ridge point of any GPU,
/// so materialised attention is bound by this traffic, not by its FLOPs.
const SCORE_TRAFFIC_BYTES: f64 = 16.0;

/// glibc's largest mmap threshold on a 64-bit host (`DEFAULT_MMAP_THRESHOLD_MAX`): a block
/// at least this large is always mapped afresh by malloc and unmapped by free, however often
/// one like it was freed before (below it, the threshold rises to the freed block's size
/// and later blocks are reused from the heap).
const MMAP_THRESHOLD_MAX_BYTES: f64 = 32.0 * 1024.0 * 1024.0;

/// Latency of one all-reduce call, independent of size.
const ALLREDUCE_LATENCY_S: f64 = 10e-6;

#[derive(Debug, Clone)]
pub struct Analytic {
    hw: HardwareSpec,
    model: ModelSpec,
    cal: Calibration,
    /// With CUDA graphs, the largest decode batch captured (the server's `max_batch_size`):
    /// decode steps that fit a bucket of the ladder up to it replay ([`graph_bucket`]).
    graphs_up_to: Option<usize>,
}

/// The terms of one step, for tests and calibration. `compute`, `memory` and `launch` are
/// summed over the step's passes; `gpu` is the sum of each pass's roofline.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Terms {
    pub compute: f64,
    pub memory: f64,
    pub launch: f64,
    pub gpu: f64,
    pub comm: f64,
    pub host: f64,
}

impl Terms {
    pub fn total(&self) -> f64 {
        self.gpu + self.comm + self.host
    }
}

/// One forward pass of a step.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
struct Pass {
    tokens: f64,
    logit_rows: f64,
    /// KV tokens read and written: context plus new.
    kv_tokens: f64,
    attention_pairs: f64,
    /// The part of `attention_pairs` that belongs to decodes (priced at
    /// `decode_attention_efficiency`).
    decode_pairs: f64,
    /// Query × key elements of one head's scores the pass computes, masked ones included
    /// (eager attention computes the whole rectangle): what materialised scores move
    /// through memory, per layer and head.
    score_elements: f64,
    /// Keys the pass repeats for every query head, per layer, keys and values each (a
    /// masked pass with grouped-query heads and more than one query: [`PackedAttention::
    /// Masked`]).
    expanded_keys: f64,
    /// What the pass holds at its peak (for `count` passes: the largest one).
    held: Held,
    decode_only: bool,
    /// Passes of this size the step runs one after another (sequential prefill: one per
    /// prompt, each the prompts' average; otherwise 1).
    count: f64,
}

impl Pass {
    /// The pass run as `n` equal passes one after another (micro-batches): each does
    /// `1/n` of the work and holds `1/n` of the memory, and reads the weights again.
    fn split(self, n: f64) -> Pass {
        Pass {
            tokens: self.tokens / n,
            logit_rows: self.logit_rows / n,
            kv_tokens: self.kv_tokens / n,
            attention_pairs: self.attention_pairs / n,
            decode_pairs: self.decode_pairs / n,
            score_elements: self.score_elements / n,
            expanded_keys: self.expanded_keys / n,
            held: Held {
                tokens: self.held.tokens / n,
                logit_rows: self.held.logit_rows / n,
                score_elements: self.held.score_elements / n,
            },
            decode_only: self.decode_only,
            count: self.count * n,
        }
    }
}

/// What a pass holds in device memory at its peak, beside weights and KV.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
struct Held {
    tokens: f64,
    logit_rows: f64,
    /// Query × key elements of one head's score matrix, summed over the pass's sequences
    /// (padding included): what materialised attention holds per head.
    score_elements: f64,
}

impl Analytic {
    /// "analytic roofline: MODEL on HW[ with CUDA graphs]": how both descriptions start.
    fn name(&self) -> String {
        let graphs = if self.graphs_up_to.is_some() {
            " with CUDA graphs"
        } else {
            ""
        };
        format!(
            "analytic roofline: {} on {}{graphs}",
            self.model.name, self.hw.name
        )
    }

    /// `graphs_up_to`: with CUDA graphs, the server's `max_batch_size`.
    pub fn new(
        hw: HardwareSpec,
        model: ModelSpec,
        cal: Calibration,
        graphs_up_to: Option<usize>,
    ) -> Self {
        Analytic {
            hw,
            model,
            cal,
            graphs_up_to,
        }
    }

    pub fn calibration(&self) -> &Calibration {
        &self.cal
    }

    /// Matmul FLOPs of a step's single packed pass (everything but attention), over all
    /// GPUs.
    pub fn matmul_flops(model: &ModelSpec, s: &StepShape) -> f64 {
        2.0 * model.linear_params() * s.new_tokens() as f64
            + 2.0 * model.head_params() * s.sampled as f64
    }

    pub fn attention_flops(model: &ModelSpec, s: &StepShape) -> f64 {
        4.0 * (model.layers * model.heads * model.head_dim) as f64 * s.attention_pairs
    }

    /// The step's forward passes (one or two).
    fn passes(&self, s: &StepShape) -> [Option<Pass>; 2] {
        let all_logits = self.cal.logits == LogitRows::All;
        let prompt_scores = (s.prefill_seqs * s.max_prefill_chunk * s.max_prefill_context) as f64;
        // The keys the decodes attend over: each its own context, or, padded into one batch
        // tensor, each the longest (the padding is masked, not skipped). Never fewer than
        // their own: a shape built without its longest context stays ragged.
        let decode_keys = match self.cal.contiguous_decode {
            ContiguousDecode::Ragged => s.decode_context_tokens,
            ContiguousDecode::Padded => {
                (s.decode_seqs * s.max_decode_context).max(s.decode_context_tokens)
            }
        } as f64;
        let decode_padding = decode_keys - s.decode_context_tokens as f64;
        // Σ chunk × (computed + chunk) over prompts: the causal pairs plus the masked half
        // of each chunk's square.
        let prompt_rectangles =
            |pairs: f64| (pairs + (s.chunk_self_pairs - s.prefill_tokens as f64) / 2.0).max(0.0);
        // A step of one sampled token per sequence runs as a decode, its prompts' last
        // one-token chunks too: all its pairs are decode attention's.
        let as_decode = s.one_token_each();
        let packed = || {
            let tokens = s.new_tokens() as f64;
            let ragged = Pass {
                tokens,
                logit_rows: if all_logits { tokens } else { s.sampled as f64 },
                kv_tokens: (s.context_tokens + s.new_tokens()) as f64 + decode_padding,
                attention_pairs: s.attention_pairs + decode_padding,
                decode_pairs: if as_decode {
                    s.attention_pairs + decode_padding
                } else {
                    decode_keys
                },
                score_elements: prompt_rectangles(
                    s.attention_pairs - s.decode_context_tokens as f64,
                ) + decode_keys,
                expanded_keys: 0.0,
                held: Held {
                    tokens,
                    logit_rows: if all_logits { tokens } else { s.sampled as f64 },
                    score_elements: prompt_scores + decode_keys,
                },
                decode_only: as_decode,
                count: 1.0,
            };
            match self.cal.packed_attention {
                PackedAttention::Ragged => ragged,
                // One mask over every query × every key of the pass: a prompt's rows are
                // priced over all of them. A decode's row spans them too, but reading the
                // keys bounds it, not its scores, and that read is the ragged one: decode-only
                // steps of transformers' step log grow with the step's keys (308 / 523 / 944
                // / 1,540 ms at 1.5k / 5.2k / 8.7k / 15.8k), not with batch × keys.
                //
                // With grouped-query heads and more than one query, the pass's keys and
                // values are repeated for every query head first (transformers' sdpa with
                // a mask: `repeat_kv`; one query is regrouped instead, `pack_gqa`).
                PackedAttention::Masked => {
                    let prompt_rows = s.prefill_tokens as f64 * s.context_tokens as f64;
                    let grouped = self.model.heads > self.model.kv_heads;
                    Pass {
                        attention_pairs: prompt_rows + decode_keys,
                        decode_pairs: decode_keys,
                        score_elements: prompt_rows + decode_keys,
                        expanded_keys: if grouped && tokens > 1.0 {
                            s.context_tokens as f64
                        } else {
                            0.0
                        },
                        held: Held {
                            score_elements: prompt_rows + decode_keys,
                            ..ragged.held
                        },
                        ..ragged
                    }
                }
            }
        };
        if let Some(p) = self.slot_passes_of(s) {
            return p;
        }
        if self.cal.prefill == PrefillBatching::Packed || s.prefill_tokens == 0 {
            // Micro-batches, and a step past what one pass holds (the engine's forward
            // passes), run as equal passes.
            let pass = packed();
            let micro_batches = match self.cal.micro_batch_tokens {
                Some(u) if pass.tokens > u as f64 => (pass.tokens / u as f64).ceil(),
                _ => 1.0,
            };
            let n = micro_batches.max(s.forward_passes as f64);
            return [Some(if n > 1.0 { pass.split(n) } else { pass }), None];
        }
        let prompt_sampled = s.sampled.saturating_sub(s.decode_seqs) as f64;
        // The K/V the prompts read (their context after the step) and write (their new
        // tokens), as a packed pass counts them.
        let prompt_kv = (s.context_tokens - s.decode_context_tokens + s.prefill_tokens) as f64;
        let prompt_pairs = (s.attention_pairs - s.decode_context_tokens as f64).max(0.0);
        let prompt = if self.cal.prefill == PrefillBatching::Sequential {
            // Each prompt alone, priced as the prompts' average; memory is the largest's.
            let n = s.prefill_seqs as f64;
            let tokens = s.prefill_tokens as f64 / n;
            let largest = s.max_prefill_chunk as f64;
            Pass {
                tokens,
                logit_rows: if all_logits {
                    tokens
                } else {
                    prompt_sampled / n
                },
                kv_tokens: prompt_kv / n,
                attention_pairs: prompt_pairs / n,
                decode_pairs: 0.0,
                score_elements: prompt_rectangles(prompt_pairs) / n,
                expanded_keys: 0.0,
                held: Held {
                    tokens: largest,
                    logit_rows: if all_logits { largest } else { 1.0 },
                    score_elements: largest * s.max_prefill_context as f64,
                },
                decode_only: false,
                count: n,
            }
        } else {
            let padded = (s.prefill_seqs * s.max_prefill_chunk) as f64;
            let pad = padded / s.prefill_tokens as f64;
            Pass {
                tokens: padded,
                logit_rows: if all_logits { padded } else { prompt_sampled },
                kv_tokens: prompt_kv * pad,
                attention_pairs: prompt_pairs * pad,
                decode_pairs: 0.0,
                score_elements: prompt_scores,
                expanded_keys: 0.0,
                held: Held {
                    tokens: padded,
                    logit_rows: if all_logits { padded } else { prompt_sampled },
                    score_elements: prompt_scores,
                },
                decode_only: false,
                count: 1.0,
            }
        };
        let decodes = (s.decode_seqs > 0).then_some(Pass {
            tokens: s.decode_seqs as f64,
            logit_rows: s.decode_seqs as f64,
            kv_tokens: decode_keys + s.decode_seqs as f64,
            attention_pairs: decode_keys,
            decode_pairs: decode_keys,
            score_elements: decode_keys,
            expanded_keys: 0.0,
            held: Held {
                tokens: s.decode_seqs as f64,
                logit_rows: s.decode_seqs as f64,
                score_elements: decode_keys,
            },
            decode_only: true,
            count: 1.0,
        });
        [Some(prompt), decodes]
    }

    /// The step's passes as the driver cut them into runs of consecutive slots
    /// ([`MicroBatches::SlotRuns`]): the single-token passes, then the rest, each class
    /// priced as its average pass.
    fn slot_passes_of(&self, s: &StepShape) -> Option<[Option<Pass>; 2]> {
        if self.cal.micro_batches != MicroBatches::SlotRuns || !s.slot_passes.is_set() {
            return None;
        }
        let all_logits = self.cal.logits == LogitRows::All;
        let class = |c: &PassSum| {
            (c.passes > 0).then(|| {
                let n = c.passes as f64;
                let tokens = c.tokens as f64 / n;
                let logit_rows = if all_logits {
                    tokens
                } else {
                    c.sampled as f64 / n
                };
                let pairs = c.attention_pairs / n;
                Pass {
                    tokens,
                    logit_rows,
                    kv_tokens: c.kv_tokens / n,
                    attention_pairs: pairs,
                    decode_pairs: c.decode_pairs / n,
                    score_elements: pairs,
                    expanded_keys: 0.0,
                    held: Held {
                        tokens: c.max_tokens as f64,
                        logit_rows: if all_logits {
                            c.max_tokens as f64
                        } else {
                            logit_rows.ceil()
                        },
                        score_elements: (c.max_tokens * c.max_keys) as f64,
                    },
                    decode_only: c.prompt_tokens == 0,
                    count: n,
                }
            })
        };
        Some([class(&s.slot_passes.single), class(&s.slot_passes.multi)])
    }

    fn pass_terms(&self, p: &Pass) -> Terms {
        let (m, hw, cal) = (&self.model, &self.hw, &self.cal);
        let tp = m.tp as f64;
        let matmul = 2.0 * m.linear_params() * p.tokens + 2.0 * m.head_params() * p.logit_rows;
        let per_pair = 4.0 * (m.layers * m.heads * m.head_dim) as f64;
        let prompt_attention = per_pair * (p.attention_pairs - p.decode_pairs).max(0.0);
        let decode_attention = per_pair * p.decode_pairs;
        let peak = hw.flops(m.weight_dtype);
        let decode_attention_s = decode_attention / cal.decode_attention_efficiency / tp / peak;
        let other_compute = (matmul / cal.compute_efficiency
            + prompt_attention / cal.attention_efficiency)
            / tp
            / peak;
        let compute = other_compute + decode_attention_s;
        let kv = m.kv_bytes_per_token() * p.kv_tokens;
        let scores = match cal.attention_scores {
            AttentionScores::Fused => 0.0,
            AttentionScores::Materialized => {
                (m.layers * m.heads) as f64 * p.score_elements * SCORE_TRAFFIC_BYTES
            }
        };
        let bandwidth_efficiency = match cal.single_decode_bandwidth_efficiency {
            Some(e) if p.decode_only && p.tokens == 1.0 => e,
            _ => cal.bandwidth_efficiency,
        };
        // Repeated keys and values: written, then read by attention. Each layer's K or V
        // buffer past the mmap threshold is faulted in afresh where the engine's allocator
        // maps it anew (`page_fault_s_per_gib`).
        let expanded_buffer = p.expanded_keys * (m.heads * m.head_dim) as f64 * m.kv_dtype.bytes();
        let expanded = 2.0 * m.layers as f64 * expanded_buffer;
        let faults = match cal.page_fault_s_per_gib {
            Some(s_per_gib) if expanded_buffer >= MMAP_THRESHOLD_MAX_BYTES => {
                expanded / GIB * s_per_gib
            }
            _ => 0.0,
        };
        let memory = (m.weight_bytes() + kv + scores + 2.0 * expanded)
            / tp
            / (hw.bandwidth * bandwidth_efficiency)
            + faults / tp;
        // A decode batch replays the graph of its bucket; one that fits none (past the
        // ladder, or past the server's batch where that falls between buckets) runs
        // eagerly, as in the engine. An average pass of micro-batches rounds up: its larger
        // passes set whether they replay.
        let graph = p.decode_only
            && self
                .graphs_up_to
                .is_some_and(|max| graph_bucket(p.tokens.ceil() as usize, max).is_some());
        let (launch, replay) = if graph {
            (hw.graph_launch_s, cal.graph_replay_factor)
        } else {
            (
                (m.layers * m.kernels_per_layer) as f64 * hw.kernel_launch_s,
                1.0,
            )
        };
        let roofline = |compute: f64| match cal.roofline {
            Roofline::Overlap => compute.max(memory),
            Roofline::Serial => compute + memory,
        };
        let busy = roofline(compute);
        // A graph replays the pass `replay` times slower, but not its decode attention's
        // compute: the log's Phase 9 slowed short-context decodes (baseline ITL +50–82%)
        // and left long-context ones (chunked_prefill, prefix_caching: 0 ± 3% for Llama and
        // Gemma) as they were. Never faster than eager (the factor is at least 1).
        let gpu = busy.max(roofline(other_compute) * replay);
        Terms {
            compute,
            memory,
            launch,
            gpu: gpu.max(launch),
            ..Terms::default()
        }
    }

    pub fn terms(&self, s: &StepShape) -> Terms {
        let (m, hw, cal) = (&self.model, &self.hw, &self.cal);
        let mut t = Terms::default();
        for pass in self.passes(s).iter().flatten() {
            let p = self.pass_terms(pass);
            t.compute += p.compute * pass.count;
            t.memory += p.memory * pass.count;
            t.launch += p.launch * pass.count;
            t.gpu += p.gpu * pass.count;
        }
        let tp = m.tp as f64;
        t.comm = if m.tp > 1 {
            let bytes = (s.new_tokens() * m.hidden) as f64 * 2.0;
            let per_call = 2.0 * (tp - 1.0) / tp * bytes / hw.peer_link + ALLREDUCE_LATENCY_S;
            2.0 * m.layers as f64 * per_call
        } else {
            0.0
        };
        t.host = cal.step_overhead_s + cal.per_seq_overhead_s * s.num_seqs as f64;
        t
    }
}

impl CostModel for Analytic {
    fn step_time(&self, s: &StepShape) -> f64 {
        self.terms(s).total()
    }

    fn activation_bytes(&self, s: &StepShape) -> f64 {
        let m = &self.model;
        let score_bytes = match self.cal.attention_scores {
            AttentionScores::Fused => 0.0,
            AttentionScores::Materialized => m.heads as f64 * SCORE_BYTES,
        };
        self.passes(s)
            .iter()
            .flatten()
            .map(|p| {
                let h = &p.held;
                (h.tokens * m.activation_bytes_per_token()
                    + h.logit_rows * m.vocab as f64 * m.weight_dtype.bytes()
                    + h.score_elements * score_bytes)
                    / m.tp as f64
            })
            .fold(0.0, f64::max)
    }

    fn spill_time(&self, spilled_bytes: f64) -> f64 {
        2.0 * spilled_bytes / self.cal.spill_bandwidth.unwrap_or(self.hw.host_link)
    }

    fn step_jitter(&self) -> f64 {
        self.cal.step_jitter_s
    }

    fn client_path(&self) -> ClientPath {
        self.cal.client
    }

    fn slot_passes(&self) -> Option<(usize, bool)> {
        (self.cal.micro_batches == MicroBatches::SlotRuns).then(|| {
            (
                self.cal.micro_batch_tokens.unwrap_or(usize::MAX),
                self.cal.contiguous_decode == ContiguousDecode::Padded,
            )
        })
    }

    fn static_batch_window(&self) -> f64 {
        self.cal.static_batch_window_s
    }

    fn describe(&self) -> String {
        let c = &self.cal;
        format!(
            "{} (compute eff {:.3}, attention eff {:.3} (decode {:.4}), bandwidth eff {:.2}, \
             step overhead {:.2} ms, per-seq {:.3} ms, client {:.2}+{:.2} ms{}; {})",
            self.name(),
            c.compute_efficiency,
            c.attention_efficiency,
            c.decode_attention_efficiency,
            c.bandwidth_efficiency,
            c.step_overhead_s * 1e3,
            c.per_seq_overhead_s * 1e3,
            c.client.request_s * 1e3,
            c.client.stream_s * 1e3,
            mechanisms(c),
            c.source
        )
    }

    fn summary(&self) -> String {
        let c = &self.cal;
        let mut s = format!(
            "{} (compute eff {:.3}, attention eff {:.3} (decode {:.4}), step overhead {:.2} ms, \
             per-seq {:.3} ms{})\ncalibration: {}",
            self.name(),
            c.compute_efficiency,
            c.attention_efficiency,
            c.decode_attention_efficiency,
            c.step_overhead_s * 1e3,
            c.per_seq_overhead_s * 1e3,
            crate::calibration::jitter_note(c.step_jitter_s),
            c.label
        );
        if let Some(m) = engine_mechanisms(c).strip_prefix(", ") {
            s += &format!("\nmechanisms: {m}");
        }
        s
    }
}

/// The jitter and the mechanisms that differ from a packed, overlapping engine, as ", a, b"
/// (or "").
fn mechanisms(c: &Calibration) -> String {
    crate::calibration::jitter_note(c.step_jitter_s) + &engine_mechanisms(c)
}

/// The mechanisms that differ from a packed, overlapping engine, as ", a, b" (or "").
fn engine_mechanisms(c: &Calibration) -> String {
    let mut out = String::new();
    match c.prefill {
        PrefillBatching::Packed => {}
        PrefillBatching::Padded => out.push_str(", padded prefill"),
        PrefillBatching::Sequential => out.push_str(", one prompt per pass"),
    }
    if c.logits == LogitRows::All {
        out.push_str(", all logits");
    }
    if c.attention_scores == AttentionScores::Materialized {
        out.push_str(", materialised attention scores");
    }
    if c.contiguous_decode == ContiguousDecode::Padded {
        out.push_str(", padded decodes");
    }
    if c.packed_attention == PackedAttention::Masked {
        out.push_str(", masked packed attention");
    }
    if c.roofline == Roofline::Serial {
        out.push_str(", serial roofline");
    }
    if let Some(u) = c.micro_batch_tokens {
        out.push_str(&format!(", micro-batches of {u} tokens"));
    }
    if c.micro_batches == MicroBatches::SlotRuns {
        out.push_str(" of consecutive slots");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::calibration::{
        AttentionScores, Calibration, LogitRows, PackedAttention, PrefillBatching, Roofline,
    };
    use crate::catalog::{find_hardware, find_model};
    use infer_core::SlotPasses;

    fn model(hw: &str, m: &str, graphs: bool) -> Analytic {
        let (hw, m) = (find_hardware(hw).unwrap(), find_model(m).unwrap());
        let cal = Calibration::default_for(&hw);
        Analytic::new(hw, m, cal, graphs.then_some(256))
    }

    fn decode(seqs: usize, ctx: usize) -> StepShape {
        StepShape {
            num_seqs: seqs,
            decode_seqs: seqs,
            sampled: seqs,
            context_tokens: seqs * ctx,
            decode_context_tokens: seqs * ctx,
            max_decode_context: ctx,
            attention_pairs: (seqs * ctx) as f64,
            ..StepShape::default()
        }
    }

    /// Decodes at each of `contexts`, after a prompt of `prompt` tokens (none if 0).
    fn decodes_at(contexts: &[usize], prompt: usize) -> StepShape {
        let total: usize = contexts.iter().sum();
        let mut s = if prompt > 0 {
            prefill(prompt)
        } else {
            StepShape::default()
        };
        s.num_seqs += contexts.len();
        s.decode_seqs = contexts.len();
        s.sampled += contexts.len();
        s.context_tokens += total;
        s.decode_context_tokens = total;
        s.max_decode_context = contexts.iter().copied().max().unwrap_or(0);
        s.attention_pairs += total as f64;
        s
    }

    /// Padded into one batch tensor, every decode attends over and reads the longest
    /// context: decodes at 100 and 900 tokens cost what two at 900 cost ragged, alone and
    /// beside a prompt however prompts are batched, with materialised scores.
    #[test]
    fn padded_decodes_attend_over_the_longest_context() {
        let with = |prefill, decode| {
            rtx5080_llama(|c| Calibration {
                prefill,
                attention_scores: AttentionScores::Materialized,
                decode_attention_efficiency: 0.002,
                contiguous_decode: decode,
                ..c
            })
        };
        for (prefill, prompt) in [
            PrefillBatching::Packed,
            PrefillBatching::Padded,
            PrefillBatching::Sequential,
        ]
        .into_iter()
        .flat_map(|p| [(p, 0), (p, 300)])
        {
            let (ragged, padded) = (
                with(prefill, ContiguousDecode::Ragged),
                with(prefill, ContiguousDecode::Padded),
            );
            let uneven = decodes_at(&[100, 900], prompt);
            let longest = decodes_at(&[900, 900], prompt);
            assert_eq!(
                padded.terms(&uneven),
                ragged.terms(&longest),
                "{prefill:?}, prompt {prompt}"
            );
            assert_eq!(
                padded.activation_bytes(&uneven),
                ragged.activation_bytes(&longest)
            );
            let (r, p) = (ragged.terms(&uneven), padded.terms(&uneven));
            assert!(
                p.compute > r.compute && p.memory > r.memory,
                "{r:?} vs {p:?}"
            );
            // Decodes of one length have nothing to pad; a shape without its longest context
            // (a step log's) is priced ragged, not as free decodes.
            assert_eq!(padded.terms(&longest), ragged.terms(&longest));
            let unknown = StepShape {
                max_decode_context: 0,
                ..uneven
            };
            assert_eq!(padded.terms(&unknown), ragged.terms(&uneven));
        }
    }

    /// Masked packed attention scores every prompt token of a pass against every key it
    /// reads: a lone decode costs what it costs ragged; two 100-token prompts beside a
    /// decode at 900 score 200 × 1,100 pairs where their own keys give 2 × 5,050; the extra
    /// is priced at the prompts' attention rate, the decode's row as ragged. The pass's
    /// 1,100 keys and values, repeated for every query head, are written and read.
    #[test]
    fn masked_attention_scores_every_query_against_every_key() {
        let with = |packed_attention| {
            rtx5080_llama(|c| Calibration {
                attention_efficiency: 0.3,
                decode_attention_efficiency: 0.01,
                packed_attention,
                ..c
            })
        };
        let (ragged, masked) = (with(PackedAttention::Ragged), with(PackedAttention::Masked));
        assert_eq!(masked.terms(&decode(1, 700)), ragged.terms(&decode(1, 700)));
        let mut step = decodes_at(&[900], 100);
        step.num_seqs += 1;
        step.prefill_seqs += 1;
        step.prefill_tokens += 100;
        step.sampled += 1;
        step.context_tokens += 100;
        step.attention_pairs += 5050.0;
        assert_eq!(step.new_tokens(), 201);
        assert_eq!(step.context_tokens, 1100);
        let (r, m) = (ragged.terms(&step), masked.terms(&step));
        let (model, hw) = (&masked.model, &masked.hw);
        let per_pair = 4.0 * (model.layers * model.heads * model.head_dim) as f64
            / hw.flops(model.weight_dtype);
        let expected = per_pair * (200.0 * 1100.0 - 2.0 * 5050.0) / 0.3 / model.tp as f64;
        assert!(
            ((m.compute - r.compute) - expected).abs() < 1e-9 * expected.max(1.0),
            "{} vs {expected}",
            m.compute - r.compute
        );
        let repeated = 2.0
            * (model.layers * model.heads * model.head_dim) as f64
            * 1100.0
            * model.kv_dtype.bytes();
        let traffic = 2.0 * repeated / model.tp as f64 / (hw.bandwidth * 0.8);
        let extra = m.memory - r.memory;
        assert!(
            (extra - traffic).abs() < 1e-9 * traffic,
            "{extra} vs {traffic}"
        );
    }

    /// A masked pass's repeated keys fault in afresh only where the calibration says so
    /// and only once one layer's K passes glibc's 32 MiB mmap threshold: Llama 3.2 3B
    /// repeats 24 heads × 128 × 2 bytes = 6,144 bytes per key, so eight decodes at 682
    /// keys each (5,456) stay under it and at 683 (5,464) pay every repeated byte.
    #[test]
    fn repeated_keys_fault_in_past_the_mmap_threshold() {
        let with = |page_fault_s_per_gib| {
            rtx5080_llama(|c| Calibration {
                packed_attention: PackedAttention::Masked,
                page_fault_s_per_gib,
                ..c
            })
        };
        let (kept, faulted) = (with(None), with(Some(0.25)));
        let under = decode(8, 682);
        assert_eq!(faulted.terms(&under), kept.terms(&under));
        let over = decode(8, 683);
        let m = &faulted.model;
        let repeated = 2.0 * (m.layers * m.heads * m.head_dim) as f64 * 5464.0 * m.kv_dtype.bytes();
        let expected = repeated / GIB * 0.25;
        let extra = faulted.terms(&over).memory - kept.terms(&over).memory;
        assert!(
            (extra - expected).abs() < 1e-9 * expected,
            "{extra} vs {expected}"
        );
        // One sequence's decode regroups its query heads and repeats nothing.
        assert_eq!(
            faulted.terms(&decode(1, 9000)),
            kept.terms(&decode(1, 9000))
        );
    }

    fn prefill(n: usize) -> StepShape {
        StepShape {
            num_seqs: 1,
            prefill_tokens: n,
            prefill_seqs: 1,
            max_prefill_chunk: n,
            max_prefill_context: n,
            sampled: 1,
            context_tokens: n,
            attention_pairs: (n * (n + 1) / 2) as f64,
            ..StepShape::default()
        }
    }

    #[test]
    fn decode_is_memory_bound_and_long_prefill_compute_bound() {
        let a = model("h100-80gb", "llama-3.1-8b", false);
        let t = a.terms(&decode(1, 512));
        assert!(t.memory > t.compute * 10.0, "{t:?}");
        // 16 GB of weights at 3.35 TB/s x efficiency: about 6 ms.
        assert!((4e-3..8e-3).contains(&t.memory), "{t:?}");
        let t = a.terms(&prefill(4096));
        assert!(t.compute > t.memory, "{t:?}");
        // Batching decodes is nearly free until compute catches up with memory.
        let one = a.step_time(&decode(1, 512));
        let many = a.step_time(&decode(64, 512));
        assert!(many < one * 2.0, "{one} vs {many}");
    }

    /// A step with `n` prompt tokens (one prompt of n, or `seqs` of n / seqs) and 8 decodes.
    fn mixed(seqs: usize, n: usize) -> StepShape {
        let chunk = n / seqs;
        StepShape {
            num_seqs: seqs + 8,
            prefill_tokens: n,
            prefill_seqs: seqs,
            max_prefill_chunk: chunk,
            max_prefill_context: chunk,
            decode_seqs: 8,
            sampled: seqs + 8,
            context_tokens: n + 8 * 512,
            decode_context_tokens: 8 * 512,
            attention_pairs: (seqs * chunk * (chunk + 1) / 2 + 8 * 512) as f64,
            ..StepShape::default()
        }
    }

    fn rtx5080_llama(cal: impl FnOnce(Calibration) -> Calibration) -> Analytic {
        let (hw, m) = (
            find_hardware("rtx-5080").unwrap(),
            find_model("llama-3.2-3b").unwrap(),
        );
        let cal = cal(Calibration::default_for(&hw));
        Analytic::new(hw, m, cal, None)
    }

    /// Eager attention holds each layer's scores: a padded pass of four 2,048-token prompts
    /// holds 4 × heads × 2,048² of them (6 bytes each) beyond its other activations, fused
    /// attention none; a 512-token chunk with 2,048 tokens of context holds a sixteenth.
    /// Their time is their traffic: 16 bytes per score, per layer and head, read and
    /// written at the calibrated bandwidth.
    #[test]
    fn materialised_attention_scores_grow_with_query_times_key_length() {
        let padded = |c| Calibration {
            prefill: PrefillBatching::Padded,
            ..c
        };
        let fused = rtx5080_llama(padded);
        let eager = rtx5080_llama(|c| Calibration {
            attention_scores: AttentionScores::Materialized,
            ..padded(c)
        });
        let heads = find_model("llama-3.2-3b").unwrap().heads as f64;
        let whole = mixed(4, 4 * 2048);
        let extra = eager.activation_bytes(&whole) - fused.activation_bytes(&whole);
        let expected = 4.0 * heads * 2048.0 * 2048.0 * 6.0;
        assert!(
            (extra - expected).abs() / expected < 1e-9,
            "{extra} vs {expected}"
        );
        let m = find_model("llama-3.2-3b").unwrap();
        let hw = find_hardware("rtx-5080").unwrap();
        // The prompts' scores and the eight decodes' (one query over 512 keys each).
        let scores = 4.0 * 2048.0 * 2048.0 + 8.0 * 512.0;
        let traffic = (m.layers * m.heads) as f64 * scores * SCORE_TRAFFIC_BYTES
            / (hw.bandwidth * Calibration::default_for(&hw).bandwidth_efficiency);
        let slower = eager.terms(&whole).memory - fused.terms(&whole).memory;
        assert!(
            (slower - traffic).abs() / traffic < 1e-9,
            "{slower} vs {traffic}"
        );
        assert!(eager.step_time(&whole) > fused.step_time(&whole));
        let mut chunk = mixed(1, 512);
        chunk.max_prefill_context = 2048;
        let extra = eager.activation_bytes(&chunk) - fused.activation_bytes(&chunk);
        assert!((extra * 16.0 - expected).abs() / expected < 1e-9, "{extra}");
    }

    /// A packed pass moves the scores it computes: for a 512-token chunk after 1,536
    /// computed tokens, 512 × 2,048 per layer and head — the causal pairs plus the masked
    /// half of the chunk's square — not a peak-memory bound.
    #[test]
    fn packed_score_traffic_is_the_chunks_whole_rectangle() {
        let at = |scores| {
            rtx5080_llama(|c| Calibration {
                attention_scores: scores,
                ..c
            })
        };
        let (fused, eager) = (
            at(AttentionScores::Fused),
            at(AttentionScores::Materialized),
        );
        let (n, c) = (512.0, 1536.0);
        let chunk = StepShape {
            num_seqs: 1,
            prefill_tokens: 512,
            prefill_seqs: 1,
            max_prefill_chunk: 512,
            max_prefill_context: 2048,
            sampled: 1,
            context_tokens: 2048,
            attention_pairs: n * c + n * (n + 1.0) / 2.0,
            chunk_self_pairs: n * n,
            ..StepShape::default()
        };
        let m = find_model("llama-3.2-3b").unwrap();
        let hw = find_hardware("rtx-5080").unwrap();
        let traffic = (m.layers * m.heads) as f64 * n * (c + n) * SCORE_TRAFFIC_BYTES
            / (hw.bandwidth * Calibration::default_for(&hw).bandwidth_efficiency);
        let slower = eager.terms(&chunk).memory - fused.terms(&chunk).memory;
        assert!(
            (slower - traffic).abs() / traffic < 1e-9,
            "{slower} vs {traffic}"
        );
    }

    /// One prompt per pass: four prompts of 1,000 tokens take four passes of one (the
    /// weights read four times) and hold one prompt's activations; padded, one pass holds
    /// all four.
    #[test]
    fn sequential_prefill_runs_one_prompt_per_pass() {
        let prompts = |n: usize| StepShape {
            num_seqs: n,
            prefill_tokens: n * 1000,
            prefill_seqs: n,
            max_prefill_chunk: 1000,
            max_prefill_context: 1000,
            sampled: n,
            context_tokens: n * 1000,
            attention_pairs: (n * 1000 * 1001 / 2) as f64,
            ..StepShape::default()
        };
        let with = |prefill| {
            rtx5080_llama(move |c| Calibration {
                prefill,
                logits: LogitRows::All,
                ..c
            })
        };
        let (seq, padded) = (
            with(PrefillBatching::Sequential),
            with(PrefillBatching::Padded),
        );
        let (one, four) = (prompts(1), prompts(4));
        let (t1, t4) = (seq.terms(&one), seq.terms(&four));
        assert!(
            (t4.gpu - 4.0 * t1.gpu).abs() / t4.gpu < 1e-9,
            "{t1:?} {t4:?}"
        );
        assert!((t4.memory - 4.0 * t1.memory).abs() / t4.memory < 1e-9);
        assert_eq!(seq.activation_bytes(&four), seq.activation_bytes(&one));
        assert!(padded.activation_bytes(&four) > 3.9 * seq.activation_bytes(&four));
        // The same single prompt costs the same however prompts are batched.
        assert_eq!(seq.terms(&one), padded.terms(&one));
    }

    /// llama.cpp's micro-batches: a packed step larger than `u` tokens runs as ⌈T / u⌉
    /// passes, each reading the weights; the work is the same, so a memory-bound step slows
    /// by the passes and a step of at most `u` tokens does not change.
    #[test]
    fn micro_batches_read_the_weights_once_per_pass() {
        let (one, micro) = (
            rtx5080_llama(|c| c),
            rtx5080_llama(|c| Calibration {
                micro_batch_tokens: Some(16),
                ..c
            }),
        );
        let small = decode(16, 512);
        assert_eq!(
            one.terms(&small),
            micro.terms(&small),
            "16 tokens: one pass"
        );
        let batch = decode(48, 512);
        let (t1, t3) = (one.terms(&batch), micro.terms(&batch));
        assert!(t1.memory > t1.compute, "decodes are memory-bound: {t1:?}");
        let weights = one.model.weight_bytes() / (one.hw.bandwidth * one.cal.bandwidth_efficiency);
        assert!(
            (t3.memory - t1.memory - 2.0 * weights).abs() / t3.memory < 1e-9,
            "two more weight reads: {t1:?} {t3:?}"
        );
        assert!(
            (t3.compute - t1.compute).abs() / t1.compute < 1e-9,
            "the same work"
        );
        assert!(
            (t3.launch - 3.0 * t1.launch).abs() < 1e-12,
            "three passes' launches"
        );
        // Its activations are a third's.
        assert!(micro.activation_bytes(&batch) < one.activation_bytes(&batch));
        // Other prefill batchings run their own passes: the option prices packed steps.
        let padded = |u| {
            rtx5080_llama(move |c| Calibration {
                prefill: PrefillBatching::Padded,
                micro_batch_tokens: u,
                ..c
            })
        };
        let s = mixed(1, 64);
        assert_eq!(padded(None).terms(&s), padded(Some(16)).terms(&s));
    }

    /// llama.cpp's passes of consecutive slots: four decodes in slots 0–3 are one pass,
    /// in slots 0, 4, 8 and 12 four, each reading the weights at the single-sequence
    /// decode's efficiency; unset slot passes, or micro-batches of any tokens, leave the
    /// step as before.
    #[test]
    fn slot_runs_price_each_run_of_consecutive_slots_as_a_pass() {
        let cal = |m| {
            rtx5080_llama(move |c| Calibration {
                micro_batch_tokens: Some(512),
                micro_batches: m,
                single_decode_bandwidth_efficiency: Some(0.5),
                ..c
            })
        };
        let (slots, tokens) = (cal(MicroBatches::SlotRuns), cal(MicroBatches::Tokens));
        assert_eq!(slots.slot_passes(), Some((512, false)));
        assert_eq!(tokens.slot_passes(), None);
        let mut shape = decode(4, 512);
        assert_eq!(
            slots.terms(&shape),
            tokens.terms(&shape),
            "not cut by the driver: as before"
        );
        let together = SlotPasses {
            multi: PassSum {
                passes: 1,
                tokens: 4,
                sampled: 4,
                kv_tokens: 4.0 * 513.0,
                attention_pairs: 4.0 * 512.0,
                decode_pairs: 4.0 * 512.0,
                max_tokens: 4,
                max_keys: 512,
                ..PassSum::default()
            },
            ..SlotPasses::default()
        };
        shape.slot_passes = together;
        let one = slots.terms(&shape);
        assert_eq!(
            one,
            tokens.terms(&decode(4, 512)),
            "one run: one packed pass"
        );
        shape.slot_passes = SlotPasses {
            single: PassSum {
                passes: 4,
                tokens: 4,
                sampled: 4,
                kv_tokens: 4.0 * 513.0,
                attention_pairs: 4.0 * 512.0,
                decode_pairs: 4.0 * 512.0,
                max_tokens: 1,
                max_keys: 512,
                ..PassSum::default()
            },
            ..SlotPasses::default()
        };
        let apart = slots.terms(&shape);
        let single = slots.terms(&decode(1, 512));
        for (a, b) in [
            (apart.memory, 4.0 * single.memory),
            (apart.compute, 4.0 * single.compute),
            (apart.launch, 4.0 * single.launch),
        ] {
            assert!(
                (a - b).abs() <= 1e-9 * b,
                "four single passes: {apart:?} {single:?}"
            );
        }
        assert!(apart.total() > 2.0 * one.total(), "{apart:?} {one:?}");
    }

    /// A decode pass of one sequence reads at its own efficiency where the calibration has
    /// one; a pass of two sequences, or one with a prompt, does not; without one, nothing
    /// changes.
    #[test]
    fn a_single_sequence_decode_reads_at_its_own_efficiency() {
        let (plain, gemv) = (
            rtx5080_llama(|c| c),
            rtx5080_llama(|c| Calibration {
                single_decode_bandwidth_efficiency: Some(0.4),
                ..c
            }),
        );
        let one = decode(1, 512);
        let (t, g) = (plain.terms(&one), gemv.terms(&one));
        assert!(
            (g.memory / t.memory - 0.8 / 0.4).abs() < 1e-9,
            "half the bandwidth: {t:?} {g:?}"
        );
        assert_eq!(t.compute, g.compute, "the same work");
        for shape in [decode(2, 512), mixed(1, 64)] {
            assert_eq!(plain.terms(&shape), gemv.terms(&shape), "{shape:?}");
        }
        let tied = rtx5080_llama(|c| Calibration {
            single_decode_bandwidth_efficiency: Some(c.bandwidth_efficiency),
            ..c
        });
        assert_eq!(
            tied.terms(&one),
            t,
            "equal to bandwidth_efficiency: no change"
        );
    }

    #[test]
    fn padded_prefill_runs_prompts_and_decodes_as_two_passes() {
        let (hw, m) = (
            find_hardware("rtx-5080").unwrap(),
            find_model("llama-3.2-3b").unwrap(),
        );
        let packed = Calibration::default_for(&hw);
        let padded = Calibration {
            prefill: PrefillBatching::Padded,
            ..packed.clone()
        };
        let (a, b) = (
            Analytic::new(hw.clone(), m.clone(), packed.clone(), None),
            Analytic::new(hw.clone(), m.clone(), padded.clone(), None),
        );
        // Two passes read the weights twice: a mixed step costs more, a pure one the same.
        let s = mixed(1, 64);
        assert!(
            b.step_time(&s) > a.step_time(&s) * 1.3,
            "{:?} {:?}",
            a.terms(&s),
            b.terms(&s)
        );
        assert_eq!(a.step_time(&decode(8, 512)), b.step_time(&decode(8, 512)));
        // Padding: two prompts of 1000 and 24 tokens cost as two of 1000.
        let mut uneven = mixed(2, 1024);
        uneven.max_prefill_chunk = 1000;
        let mut even = mixed(2, 2000);
        even.max_prefill_chunk = 1000;
        even.attention_pairs = uneven.attention_pairs * 2000.0 / 1024.0;
        let (u, e) = (b.terms(&uneven), b.terms(&even));
        assert!(
            (u.compute - e.compute).abs() / e.compute < 0.01,
            "{u:?} {e:?}"
        );
        // Logits for every position: more memory for activations, more head FLOPs.
        let all = Analytic::new(
            hw.clone(),
            m.clone(),
            Calibration {
                logits: LogitRows::All,
                ..padded
            },
            None,
        );
        let s = mixed(4, 4096);
        assert!(all.activation_bytes(&s) > 3.0 * b.activation_bytes(&s));
        assert!(all.terms(&s).compute > b.terms(&s).compute);
        // Spill: 10 GB out and back over the 50 GB/s host link.
        assert!((a.spill_time(10e9) - 0.4).abs() < 1e-9);
        // A serial roofline adds compute and memory time instead of taking the larger.
        let serial = Analytic::new(
            hw,
            m,
            Calibration {
                roofline: Roofline::Serial,
                ..packed
            },
            None,
        );
        let s = decode(8, 512);
        let (o, t) = (a.terms(&s), serial.terms(&s));
        assert_eq!(o.gpu, o.compute.max(o.memory).max(o.launch));
        assert_eq!(t.gpu, (t.compute + t.memory).max(t.launch));
        assert!(t.gpu > o.gpu);
    }

    #[test]
    fn attention_cost_grows_with_context() {
        let a = model("l4", "llama-3.1-8b", false);
        assert!(a.step_time(&decode(32, 8000)) > a.step_time(&decode(32, 500)) * 1.2);
    }

    /// A decode's attention is priced at `decode_attention_efficiency`: lowering it slows a
    /// decode step by exactly its attention FLOPs at the new rate; a prompt-only step is
    /// unchanged.
    #[test]
    fn decode_attention_has_its_own_efficiency() {
        let at = |e: f64| {
            rtx5080_llama(|c| Calibration {
                decode_attention_efficiency: e,
                ..c
            })
        };
        let (fast, slow) = (at(0.5), at(0.001));
        // 16 decodes over 2,048 tokens each: attention-bound once the kernel is slow.
        let d = decode(16, 2048);
        let m = find_model("llama-3.2-3b").unwrap();
        let hw = find_hardware("rtx-5080").unwrap();
        let flops = 4.0 * (m.layers * m.heads * m.head_dim) as f64 * d.attention_pairs;
        let compute = |a: &Analytic| a.terms(&d).compute;
        let expected = flops / hw.flops(m.weight_dtype) * (1.0 / 0.001 - 1.0 / 0.5);
        let got = compute(&slow) - compute(&fast);
        assert!(
            (got - expected).abs() / expected < 1e-9,
            "{got} vs {expected}"
        );
        assert!(slow.step_time(&d) > fast.step_time(&d));
        let p = prefill(1024);
        assert_eq!(slow.step_time(&p), fast.step_time(&p));
    }

    /// The log's Phase 9: decode steps replayed from CUDA graphs ran ~2x slower than
    /// eager, long-context ones not. The factor scales a graph-replayed decode pass without
    /// its decode attention: prompt passes stay eager, and without graphs it changes
    /// nothing.
    #[test]
    fn a_graph_replay_factor_slows_graph_replayed_decodes_only() {
        // Llama on the RTX 5080 at a replay factor, its decode attention at the default
        // efficiency or at `decode`.
        let replayed = |graphs: bool, factor: f64, decode: Option<f64>| {
            let hw = find_hardware("rtx-5080").unwrap();
            let m = find_model("llama-3.2-3b").unwrap();
            let mut cal = Calibration::default_for(&hw);
            cal.graph_replay_factor = factor;
            if let Some(e) = decode {
                cal.decode_attention_efficiency = e;
            }
            Analytic::new(hw, m, cal, graphs.then_some(24))
        };
        let with_factor = |graphs: bool, factor: f64| replayed(graphs, factor, None);
        let (plain, slow) = (with_factor(true, 1.0), with_factor(true, 2.0));
        let d = decode(8, 512);
        let (t1, t2) = (plain.step_time(&d), slow.step_time(&d));
        let host = plain.terms(&d).host;
        assert!(
            ((t2 - host) / (t1 - host) - 2.0).abs() < 1e-9,
            "GPU time {:.3} ms -> {:.3} ms",
            (t1 - host) * 1e3,
            (t2 - host) * 1e3
        );
        let p = prefill(256);
        assert_eq!(
            plain.step_time(&p),
            slow.step_time(&p),
            "prompt passes stay eager"
        );
        let (e1, e2) = (with_factor(false, 1.0), with_factor(false, 2.0));
        assert_eq!(e1.step_time(&d), e2.step_time(&d), "no graphs, no replay");

        // The decode attention is not replayed slower: a long-context decode whose slow
        // attention kernel outlasts twice the rest of the pass takes its eager time.
        let slow_attention = |factor: f64| replayed(true, factor, Some(0.002));
        let long = decode(24, 2048);
        let t = slow_attention(1.0).terms(&long);
        assert!(t.compute > 2.0 * t.memory, "attention-bound: {t:?}");
        assert_eq!(
            slow_attention(2.0).step_time(&long),
            slow_attention(1.0).step_time(&long)
        );
    }

    #[test]
    fn cuda_graphs_remove_the_launch_floor_of_small_models() {
        let eager = model("h100-80gb", "qwen2.5-0.5b", false);
        let graphs = model("h100-80gb", "qwen2.5-0.5b", true);
        let t = eager.terms(&decode(1, 256));
        assert!(
            t.launch > t.memory,
            "a 0.5B decode is launch-bound eagerly: {t:?}"
        );
        assert!(graphs.step_time(&decode(1, 256)) < eager.step_time(&decode(1, 256)));
        // Prefill stays eager, and so do decode batches past the capture ladder.
        assert_eq!(
            graphs.step_time(&prefill(256)),
            eager.step_time(&prefill(256))
        );
        let (largest, past) = (256, 257);
        assert!(
            graphs.terms(&decode(largest, 16)).launch < eager.terms(&decode(largest, 16)).launch
        );
        assert_eq!(
            graphs.terms(&decode(past, 16)),
            eager.terms(&decode(past, 16))
        );
        // A server of 100 sequences captures the buckets up to 96: 97 to 100 run eagerly.
        let (hw, m) = (
            find_hardware("h100-80gb").unwrap(),
            find_model("qwen2.5-0.5b").unwrap(),
        );
        let up_to_100 = Analytic::new(hw.clone(), m, Calibration::default_for(&hw), Some(100));
        assert_eq!(
            up_to_100.terms(&decode(96, 16)).launch,
            graphs.terms(&decode(96, 16)).launch
        );
        assert_eq!(
            up_to_100.terms(&decode(97, 16)),
            eager.terms(&decode(97, 16))
        );
    }

    /// A step of one sampled token per sequence runs in the engine as a decode, graphs
    /// and decode attention, where a prompt's last chunk is one of those tokens: priced as
    /// the decode step of the same contexts. Two tokens of a prompt make it a prefill step.
    #[test]
    fn a_prompts_last_one_token_chunk_among_decodes_is_priced_as_a_decode() {
        let graphs = model("h100-80gb", "llama-3.2-3b", true);
        let with_chunk = |n: usize| {
            let mut s = decode(7, 512);
            s.num_seqs += 1;
            s.prefill_tokens = n;
            s.prefill_seqs = 1;
            s.max_prefill_chunk = n;
            s.max_prefill_context = 512;
            s.sampled += 1;
            s.context_tokens += 512;
            // n queries over the 512 - n computed tokens, causal within the chunk.
            s.attention_pairs += (n * (512 - n) + n * (n + 1) / 2) as f64;
            s.chunk_self_pairs = (n * n) as f64;
            s
        };
        let one = with_chunk(1);
        assert!(one.one_token_each());
        assert_eq!(graphs.terms(&one), graphs.terms(&decode(8, 512)));
        assert_eq!(graphs.terms(&one).launch, graphs.hw.graph_launch_s);
        let two = with_chunk(2);
        assert!(!two.one_token_each());
        let eager = model("h100-80gb", "llama-3.2-3b", false);
        assert_eq!(graphs.terms(&two).launch, eager.terms(&two).launch);
    }

    /// A step of more tokens than one pass of the server holds (several whole prompts,
    /// unchunked) runs as passes, as in the engine: the weights are read and the kernels
    /// launched once per pass. A step within is priced as before.
    #[test]
    fn a_step_past_what_one_pass_holds_is_priced_as_passes() {
        let a = model("h100-80gb", "llama-3.2-3b", false);
        let mut counted = prefill(1000);
        counted.forward_passes = 1;
        assert_eq!(a.terms(&counted), a.terms(&prefill(1000)));
        let three = StepShape {
            num_seqs: 3,
            prefill_tokens: 1500,
            prefill_seqs: 3,
            max_prefill_chunk: 500,
            max_prefill_context: 500,
            sampled: 3,
            context_tokens: 1500,
            attention_pairs: (3 * 500 * 501 / 2) as f64,
            chunk_self_pairs: (3 * 500 * 500) as f64,
            ..StepShape::default()
        };
        let in_two = StepShape {
            forward_passes: 2,
            ..three
        };
        let (split, whole) = (a.terms(&in_two), a.terms(&three));
        assert_eq!(split.launch, 2.0 * whole.launch);
        let weights = a.model.weight_bytes() / a.hw.bandwidth;
        assert!(
            split.memory - whole.memory > 0.5 * weights,
            "the weights read again: {split:?} vs {whole:?}"
        );
        assert!((split.compute - whole.compute).abs() < 1e-12 * whole.compute.max(1.0));
    }

    /// A prompt reads its context's K/V and writes its own, whichever way prompts are
    /// batched: one prompt alone moves the same bytes packed, padded or sequential.
    #[test]
    fn a_prompts_kv_write_is_counted_however_prompts_are_batched() {
        let priced = |batching: PrefillBatching| {
            let (hw, m) = (
                find_hardware("h100-80gb").unwrap(),
                find_model("llama-3.2-3b").unwrap(),
            );
            let mut cal = Calibration::default_for(&hw);
            cal.prefill = batching;
            cal.attention_scores = AttentionScores::Fused;
            Analytic::new(hw, m, cal, None).terms(&prefill(512)).memory
        };
        let packed = priced(PrefillBatching::Packed);
        for other in [PrefillBatching::Padded, PrefillBatching::Sequential] {
            let got = priced(other);
            assert!(
                (got - packed).abs() < 1e-12 * packed,
                "{other:?}: {got} vs {packed}"
            );
        }
    }

    #[test]
    fn tensor_parallel_splits_work_and_pays_for_all_reduce() {
        let a = model("h100-80gb", "llama-3.1-70b", false);
        let t = a.terms(&decode(8, 9000));
        assert!(t.comm > 0.0);
        // 141 GB of weights over 4 GPUs at 3.35 TB/s: ~10.5 ms at 100%.
        assert!((10e-3..16e-3).contains(&t.memory), "{t:?}");
    }
}
