//! The memory plan made at start: does weights + KV pool + activations fit on one GPU?
//!
//! Per GPU (a tensor-parallel model splits weights and KV evenly):
//!
//! ```text
//! weights     = params × weight dtype bytes / tp
//! kv_pool     = num_gpu_blocks × block_size × KV bytes per token / tp
//! activations = T_max × activation bytes per token + max_batch_size × vocab × 4
//!               (T_max = tokens of the largest step: the chunk budget with chunked
//!                prefill, otherwise min(KV capacity, max_batch_size × max_model_len,
//!                max_num_batched_tokens);
//!                the second term is the fp32 logits of one sampled row per sequence)
//! usable      = device memory − reserved (context, allocator, display)
//! ```
//!
//! The cost model, when it prices activations, replaces that estimate with its own bytes for
//! the largest step the configuration and the workload allow ([`largest_step`]: the token
//! budget filled with the workload's longest prompts), so padding, all-position logits and
//! materialised scores count ([`MemoryPlan::with_activations`]).
//!
//! A plan whose weights and KV pool alone exceed `usable` cannot start: an error. One that
//! fits only without the largest step's activations gets a warning: the benchmark log's
//! "VRAM cliff". What a run pays is decided step by step: each replica keeps its actual
//! activation peak ([`ActivationPeak`], from the cost model's bytes per step), and once
//! weights + KV pool + peak exceed `usable` the excess lives in host memory (the
//! Windows/WSL driver pages device allocations out rather than failing) and every later
//! step pays for moving it out and back (`CostModel::spill_time`).
//! A KV pool that cannot hold one `max_model_len` sequence is refused.
//!
//! A contiguous cache that grows as it fills (`contiguous_kv = "grown"`, Hugging Face's
//! `DynamicCache`) takes none of its pool up front: each step's peak then counts the KV
//! tokens in flight beside the activations, and the allocator keeps the largest sum.

use infer_core::{KvBackend, SchedulerConfig, StepShape};

use crate::calibration::ContiguousKv;
use crate::catalog::{HardwareSpec, ModelSpec, GIB};

#[derive(Debug, Clone, PartialEq)]
pub struct MemoryPlan {
    pub usable: f64,
    pub weights: f64,
    pub kv_pool: f64,
    pub activations: f64,
    /// Bytes beyond `usable` at the activation peak (0 when everything fits).
    pub spill: f64,
    /// KV bytes per token held when the cache grows as it fills (then `kv_pool` is its
    /// largest size, not memory taken up front); 0 for a pool allocated at start.
    pub grown_kv_per_token: f64,
}

impl MemoryPlan {
    /// Bytes left for activations (and a grown cache) once weights and the KV pool
    /// allocated at start are in.
    pub fn headroom(&self) -> f64 {
        let upfront = if self.grown_kv_per_token > 0.0 {
            0.0
        } else {
            self.kv_pool
        };
        self.usable - self.weights - upfront
    }

    pub fn total(&self) -> f64 {
        self.weights + self.kv_pool + self.activations
    }

    /// The numbers, in GiB, on one line.
    pub fn describe(&self) -> String {
        format!(
            "weights {:.2} GiB + KV pool {:.2} GiB{} + activations {:.2} GiB = {:.2} GiB of {:.2} GiB usable",
            self.weights / GIB,
            self.kv_pool / GIB,
            if self.grown_kv_per_token > 0.0 {
                " (grown as used)"
            } else {
                ""
            },
            self.activations / GIB,
            self.total() / GIB,
            self.usable / GIB
        )
    }

    /// The same plan with the largest step's activations put at `bytes`.
    pub fn with_activations(self, bytes: f64) -> MemoryPlan {
        let spill = (self.weights + self.kv_pool + bytes - self.usable).max(0.0);
        MemoryPlan {
            activations: bytes,
            spill,
            ..self
        }
    }

    /// A warning for a configuration past the cliff, if it is.
    pub fn warning(&self) -> Option<String> {
        (self.spill > 0.0).then(|| {
            format!(
                "warning: memory over-committed by {:.2} GiB at the largest step ({});\n  \
                 once a step that large runs, its excess spills to host memory and every later \
                 step pays for it (expect a throughput collapse)",
                self.spill / GIB,
                self.describe()
            )
        })
    }
}

/// A replica's activation peak: allocators keep what they once reserved, so once a step
/// needed more than the headroom, every later step runs with the excess spilled.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ActivationPeak {
    headroom: f64,
    grown_kv_per_token: f64,
    peak: f64,
}

impl ActivationPeak {
    pub fn new(plan: &MemoryPlan) -> Self {
        ActivationPeak {
            headroom: plan.headroom(),
            grown_kv_per_token: plan.grown_kv_per_token,
            peak: 0.0,
        }
    }

    /// Record a step's activation bytes and the KV tokens it holds (they count only in a
    /// grown cache); returns the bytes spilled while it runs.
    pub fn observe(&mut self, bytes: f64, kv_tokens: usize) -> f64 {
        let step = bytes + kv_tokens as f64 * self.grown_kv_per_token;
        self.peak = self.peak.max(step);
        (self.peak - self.headroom).max(0.0)
    }
}

/// Why a configuration cannot start: what does not fit where.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct DoesNotFit(pub String);

/// Plan memory for `cfg` serving `model` on `hw`, or say why it cannot start.
pub fn plan(
    hw: &HardwareSpec,
    model: &ModelSpec,
    cfg: &SchedulerConfig,
    contiguous_kv: ContiguousKv,
) -> Result<MemoryPlan, DoesNotFit> {
    let capacity_tokens = cfg.num_gpu_blocks * cfg.block_size;
    if capacity_tokens < cfg.max_model_len {
        return Err(DoesNotFit(format!(
            "the KV pool of {} blocks x {} tokens = {} tokens cannot hold one sequence of \
             max_model_len {} tokens",
            cfg.num_gpu_blocks, cfg.block_size, capacity_tokens, cfg.max_model_len
        )));
    }
    let tp = model.tp as f64;
    let weights = model.weight_bytes() / tp;
    let kv_pool = capacity_tokens as f64 * model.kv_bytes_per_token() / tp;
    let usable = hw.memory_bytes - hw.reserved_bytes;
    let activations = estimated_activations(model, step_tokens(cfg), cfg.max_batch_size);
    if weights + kv_pool > usable {
        return Err(DoesNotFit(format!(
            "{} on {} does not fit: weights {:.2} GiB + KV pool {:.2} GiB ({} blocks) = {:.2} \
             GiB, but only {:.2} GiB of {:.2} GiB is usable",
            model.name,
            hw.name,
            weights / GIB,
            kv_pool / GIB,
            cfg.num_gpu_blocks,
            (weights + kv_pool) / GIB,
            usable / GIB,
            hw.memory_bytes / GIB
        )));
    }
    let grows =
        cfg.kv_cache_backend == KvBackend::Contiguous && contiguous_kv == ContiguousKv::Grown;
    let plan = MemoryPlan {
        grown_kv_per_token: if grows {
            model.kv_bytes_per_token() / tp
        } else {
            0.0
        },
        usable,
        weights,
        kv_pool,
        activations: 0.0,
        spill: 0.0,
    };
    Ok(plan.with_activations(activations))
}

/// What a step of `tokens` tokens holds beside weights and KV by the model's activation
/// bytes per token, with `logit_rows` rows of f32 logits: the estimate where the cost model
/// prices no activations.
fn estimated_activations(model: &ModelSpec, tokens: usize, logit_rows: usize) -> f64 {
    tokens as f64 * model.activation_bytes_per_token() / model.tp as f64
        + (logit_rows * model.vocab) as f64 * 4.0
}

/// `plan` (the estimate of [`plan`]) with the activations of one forward pass of the
/// engine, which runs a step of more tokens than
/// [`infer_core::SchedulerConfig::max_pass_tokens`] as several passes: the plan of a server
/// priced by its measured profile, which prices no activations.
pub fn with_engine_passes(
    plan: MemoryPlan,
    model: &ModelSpec,
    cfg: &SchedulerConfig,
) -> MemoryPlan {
    let tokens = step_tokens(cfg).min(cfg.max_pass_tokens());
    let rows = cfg.max_batch_size.min(tokens);
    plan.with_activations(estimated_activations(model, tokens, rows))
}

/// Tokens of the largest step `cfg` lets the scheduler plan: the chunk budget with chunked
/// prefill, otherwise min(KV capacity, max_batch_size × max_model_len,
/// max_num_batched_tokens).
fn step_tokens(cfg: &SchedulerConfig) -> usize {
    if let (true, Some(budget)) = (cfg.chunked_prefill, cfg.step_token_budget()) {
        return budget;
    }
    let unbounded = cfg
        .kv_capacity_tokens()
        .min(cfg.max_batch_size * cfg.max_model_len);
    cfg.max_num_batched_tokens
        .map_or(unbounded, |b| b.min(unbounded))
}

/// The largest step `cfg` lets the scheduler plan for prompts of `shortest..=longest`
/// tokens: as many prompts as the token budget admits at the shortest (with chunked
/// prefill, plus the tail of one begun in the step before and the head of one that goes on
/// in the next), each chunk as long as the longest allows — what a padded pass holds —
/// attending to a whole longest prompt (the largest score matrix), and the rest of the
/// batch decoding at that length as far as the KV pool holds them.
pub fn largest_step(cfg: &SchedulerConfig, (shortest, longest): (usize, usize)) -> StepShape {
    let len = longest.clamp(1, cfg.max_model_len);
    let budget = step_tokens(cfg).max(1);
    let chunk = budget.min(len);
    let split = if cfg.chunked_prefill { 2 } else { 0 };
    let prompts = (budget / shortest.max(1) + split).clamp(1, cfg.max_batch_size);
    let decodes = cfg.max_batch_size - prompts;
    let decode_context =
        (decodes * len).min(cfg.kv_capacity_tokens().saturating_sub(prompts * len));
    let (c, n) = (chunk as f64, len as f64);
    let prefill_tokens = (prompts * chunk).min(budget);
    StepShape {
        num_seqs: prompts + decodes,
        prefill_tokens,
        prefill_seqs: prompts,
        max_prefill_chunk: chunk,
        max_prefill_context: len,
        decode_seqs: decodes,
        sampled: prompts + decodes,
        context_tokens: prompts * len + decode_context,
        decode_context_tokens: decode_context,
        max_decode_context: if decode_context > 0 { len } else { 0 },
        decode_shared_context_tokens: 0,
        attention_pairs: prompts as f64 * (c * (n - c) + c * (c + 1.0) / 2.0)
            + decode_context as f64,
        chunk_self_pairs: prompts as f64 * c * c,
        // Activations do not depend on it.
        constrained_seqs: 0,
        // Unset: the step priced as its tokens cut into passes, whose largest is at least
        // as large as a pass of consecutive slots.
        slot_passes: Default::default(),
        // The chunks as the step holds them (their tokens capped by the budget), then the
        // decodes.
        forward_passes: infer_core::scheduler::whole_sequence_passes(
            (0..prompts)
                .map(|i| chunk.min(prefill_tokens.saturating_sub(i * chunk)))
                .filter(|&n| n > 0)
                .chain(std::iter::repeat_n(1, decodes)),
            cfg.max_pass_tokens(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::{find_hardware, find_model};
    use infer_core::KvBackend;

    fn cfg(batch: usize, blocks: usize, chunked: bool) -> SchedulerConfig {
        SchedulerConfig {
            max_batch_size: batch,
            num_gpu_blocks: blocks,
            chunked_prefill: chunked,
            ..SchedulerConfig::default()
        }
    }

    /// The engine runs a step past what one pass holds as several: priced by its profile,
    /// a server without a token budget holds one `max_model_len` pass of activations, not
    /// its whole batch of prompts.
    #[test]
    fn the_engines_plan_holds_one_pass_of_activations() {
        let hw = find_hardware("rtx-5080").unwrap();
        let qwen = find_model("qwen3-4b").unwrap();
        // The log's Phase 6 cliff: 24 sequences, 2,048 blocks of 16 tokens.
        let c = SchedulerConfig {
            max_model_len: 2048,
            ..cfg(24, 2048, false)
        };
        let whole = plan(&hw, &qwen, &c, ContiguousKv::Reserved).unwrap();
        let engine = with_engine_passes(whole.clone(), &qwen, &c);
        let per_token = qwen.activation_bytes_per_token() / qwen.tp as f64;
        let logits = (24 * qwen.vocab) as f64 * 4.0;
        // The whole step: as many prompt tokens as the KV pool holds.
        let step = c.kv_capacity_tokens().min(24 * 2048);
        assert_eq!(whole.activations, step as f64 * per_token + logits);
        assert_eq!(engine.activations, 2048.0 * per_token + logits);
        assert!(
            whole.spill > 0.0 && engine.spill == 0.0,
            "{}",
            engine.describe()
        );
    }

    #[test]
    fn the_logs_vram_cliff_is_flagged_and_its_tuned_configs_are_not() {
        // Phase 6 sweep on Qwen3-4B (no chunking): 12/768, 16/1024, 20/1280 ran fine,
        // 24/2048 collapsed 3x.
        let hw = find_hardware("rtx-5080").unwrap();
        let qwen = find_model("qwen3-4b").unwrap();
        for (b, n) in [(12, 768), (16, 1024), (20, 1280), (16, 1536)] {
            let p = plan(&hw, &qwen, &cfg(b, n, false), ContiguousKv::Reserved).unwrap();
            assert_eq!(p.spill, 0.0, "{b}/{n}: {}", p.describe());
        }
        let cliff = plan(&hw, &qwen, &cfg(24, 2048, false), ContiguousKv::Reserved).unwrap();
        assert!(cliff.spill > 0.0, "{}", cliff.describe());
        let w = cliff.warning().unwrap();
        assert!(w.contains("GiB") && w.contains("KV pool 4.50 GiB"), "{w}");
        // Llama-3.2-3B and Gemma3-1B run 24/2048 in the log.
        for m in ["llama-3.2-3b", "gemma-3-1b"] {
            let p = plan(
                &hw,
                &find_model(m).unwrap(),
                &cfg(24, 2048, false),
                ContiguousKv::Reserved,
            )
            .unwrap();
            assert_eq!(p.spill, 0.0, "{m}: {}", p.describe());
        }
    }

    /// Without chunking the budget admits whole prompts at the shortest length, each padded
    /// to the longest; with chunking a 512-token budget holds the tail of one prompt, the
    /// whole prompts that fit and the head of another, the chunk attending to a whole
    /// longest prompt.
    #[test]
    fn the_largest_step_fills_the_budget_with_the_workloads_prompts() {
        let whole = largest_step(&cfg(16, 1024, false), (128, 384));
        assert_eq!(
            (whole.prefill_seqs, whole.max_prefill_chunk),
            (16, 384),
            "batch-bound"
        );
        assert_eq!((whole.decode_seqs, whole.max_prefill_context), (0, 384));
        let chunked = SchedulerConfig {
            prefill_chunk_size: 512,
            ..cfg(24, 2048, true)
        };
        let s = largest_step(&chunked, (128, 2048));
        assert_eq!((s.prefill_seqs, s.max_prefill_chunk), (512 / 128 + 2, 512));
        assert_eq!((s.prefill_tokens, s.max_prefill_context), (512, 2048));
        assert_eq!(s.decode_seqs, 24 - 6);
        assert!(s.context_tokens <= 2048 * 16, "within the KV pool");
        // Its passes are those of what it holds: the budget's 512 prompt tokens, then the
        // decodes, which do not fit beside them.
        assert_eq!(s.forward_passes, 2);
        // Unchunked, 16 whole prompts of 384 tokens in passes of one 1,024-token prompt:
        // two prompts a pass.
        let unchunked = SchedulerConfig {
            max_model_len: 1024,
            ..cfg(16, 1024, false)
        };
        assert_eq!(largest_step(&unchunked, (128, 384)).forward_passes, 8);
    }

    #[test]
    fn the_activation_peak_sticks_and_spills_only_past_the_headroom() {
        let hw = find_hardware("rtx-5080").unwrap();
        let p = plan(
            &hw,
            &find_model("llama-3.2-3b").unwrap(),
            &cfg(24, 2048, true),
            ContiguousKv::Reserved,
        )
        .unwrap();
        let room = p.headroom();
        assert!(room > 0.0 && (p.usable - p.weights - p.kv_pool - room).abs() < 1.0);
        let mut peak = ActivationPeak::new(&p);
        assert_eq!(peak.observe(room * 0.5, 1000), 0.0);
        assert_eq!(peak.observe(room + 1e9, 1000), 1e9);
        // A small step later still runs with the excess out: the allocator kept it.
        assert_eq!(peak.observe(1.0, 0), 1e9);
    }

    #[test]
    fn impossible_plans_are_refused_with_numbers() {
        let hw = find_hardware("rtx-5080").unwrap();
        let e = plan(
            &hw,
            &find_model("llama-3.1-8b").unwrap(),
            &cfg(24, 8192, true),
            ContiguousKv::Reserved,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("does not fit") && e.contains("GiB"), "{e}");
        let small = SchedulerConfig {
            num_gpu_blocks: 100,
            ..cfg(8, 100, true)
        };
        let e = plan(
            &hw,
            &find_model("llama-3.2-3b").unwrap(),
            &small,
            ContiguousKv::Reserved,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("1600 tokens") && e.contains("4096"), "{e}");
        let contiguous = SchedulerConfig {
            kv_cache_backend: KvBackend::Contiguous,
            ..cfg(8, 2048, false)
        };
        let llama = find_model("llama-3.2-3b").unwrap();
        assert!(plan(&hw, &llama, &contiguous, ContiguousKv::Reserved).is_ok());
    }

    /// A contiguous cache allocated up front leaves its pool out of the headroom; one that
    /// grows as it fills leaves the headroom whole and counts the tokens each step holds.
    #[test]
    fn a_grown_contiguous_cache_counts_the_tokens_in_flight() {
        let hw = find_hardware("rtx-5080").unwrap();
        let qwen = find_model("qwen3-4b").unwrap();
        let contiguous = SchedulerConfig {
            kv_cache_backend: KvBackend::Contiguous,
            ..cfg(8, 2048, false)
        };
        let reserved = plan(&hw, &qwen, &contiguous, ContiguousKv::Reserved).unwrap();
        let grown = plan(&hw, &qwen, &contiguous, ContiguousKv::Grown).unwrap();
        assert!((grown.headroom() - reserved.headroom() - reserved.kv_pool).abs() < 1.0);
        assert!(
            grown.describe().contains("grown as used"),
            "{}",
            grown.describe()
        );
        let per_token = qwen.kv_bytes_per_token();
        let mut up_front = ActivationPeak::new(&reserved);
        let mut as_used = ActivationPeak::new(&grown);
        // 2,000 tokens in flight and activations that fill the reserved plan's headroom
        // plus 1 GB: the reserved cache spills the gigabyte; the grown one has room.
        let bytes = reserved.headroom() + 1e9;
        assert!((up_front.observe(bytes, 2000) - 1e9).abs() < 1.0);
        assert_eq!(as_used.observe(bytes, 2000), 0.0);
        // Its whole pool in flight, the grown cache spills as much as the reserved one.
        let full = contiguous.num_gpu_blocks * contiguous.block_size;
        let spilled = as_used.observe(bytes, full);
        assert!((spilled - 1e9).abs() < 1e3 * per_token, "{spilled}");
        // A plan whose backend is paged ignores the mechanism.
        let paged = plan(&hw, &qwen, &cfg(8, 2048, false), ContiguousKv::Grown).unwrap();
        assert_eq!(paged.grown_kv_per_token, 0.0);
    }
}
