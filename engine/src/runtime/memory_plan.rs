//! The memory plan a server makes at start, in the simulator's terms (`infer_sim::memory`):
//! weights + KV pool + activations within the usable device memory.
//!
//! On CUDA the activation peak is measured, as vLLM does, before the KV pool exists: one
//! step of the largest shape the scheduler plans (its token budget spread over
//! `max_batch_size` sequences, each sampled) runs over a scratch KV store, and the step
//! arena keeps what it grew to. With `--gpu-memory-utilization F` the pool then takes what
//! is left of F × device memory:
//!
//! ```text
//! blocks = (F × total − used) / bytes per block
//! ```
//!
//! where `used` is everything on the device at that point — weights, the activation arena,
//! cuBLAS' workspace, the CUDA context, and other processes' memory (counted against this
//! server, so the plan never takes memory that is not free). A step larger than the one
//! measured (several whole prompts in one step without chunked prefill and without
//! `--max-num-batched-tokens`, or a prompt whose every row of logits is asked for) runs as
//! several forward passes within it ([`SchedulerConfig::max_pass_tokens`],
//! [`planned_logit_rows`]).

use anyhow::{bail, Result};
use infer_core::SchedulerConfig;

use crate::runtime::batch::{ForwardBatch, SeqChunk};
use crate::runtime::model::{Model, ModelConfig};
use crate::Device;

const GIB: f64 = (1u64 << 30) as f64;

#[derive(Debug, Clone, PartialEq)]
pub struct MemoryPlan {
    pub device: Device,
    pub weights: usize,
    pub kv_pool: usize,
    pub kv_blocks: usize,
    pub block_size: usize,
    /// What the KV pool stores.
    pub kv_dtype: candle_core::DType,
    /// The measured activation peak; `None` where activations are allocated per step.
    pub activations: Option<usize>,
    /// Device memory the plan may use (F × total, or the total); `None` on the CPU.
    pub usable: Option<usize>,
    /// Decode batches up to this size replay CUDA graphs.
    pub cuda_graphs: Option<usize>,
}

impl MemoryPlan {
    /// One line, in GiB.
    pub fn describe(&self) -> String {
        let gib = |b: usize| b as f64 / GIB;
        let activations = match self.activations {
            Some(a) => format!("{:.2} GiB (measured peak step)", gib(a)),
            None => "allocated per step".into(),
        };
        let total = self.weights + self.kv_pool + self.activations.unwrap_or(0);
        let usable = match self.usable {
            Some(u) => format!(" = {:.2} GiB of {:.2} GiB usable", gib(total), gib(u)),
            None => String::new(),
        };
        let graphs = match self.cuda_graphs {
            Some(n) => format!("on for decode batches up to {n}"),
            None => "off".into(),
        };
        format!(
            "memory plan on {}: weights {:.2} GiB + KV pool {:.2} GiB ({} blocks of {} tokens, \
             {}) + activations {activations}{usable}; CUDA graphs {graphs}",
            self.device,
            gib(self.weights),
            gib(self.kv_pool),
            self.kv_blocks,
            self.block_size,
            dtype_name(self.kv_dtype),
        )
    }
}

/// The largest forward pass `cfg` can run, as a batch over a scratch KV store: its
/// [`SchedulerConfig::max_pass_tokens`] split as evenly as they go over up to
/// `max_batch_size` sequences of at most `max_model_len` tokens, every one sampled. Returns
/// the batch and the blocks its tables use.
pub fn peak_step(cfg: &SchedulerConfig, vocab: usize) -> (ForwardBatch, usize) {
    spread_step(cfg, cfg.max_pass_tokens(), vocab)
}

/// Rows of logits a forward pass may return (a prompt whose every row is asked for runs in
/// pieces of this many tokens): one per sequence of the planned pass, or T × intermediate /
/// vocab for a pass of T tokens, about the bytes its MLP's buffers take (within each layer
/// the gate and up projections and their gated product, 3 × intermediate values a token,
/// against a row of logits' head output and f32 copy). On CUDA the plan runs such a pass
/// before sizing the KV pool ([`scored_prompt_pass`]), so the arena holds it however its
/// chunks fall.
pub fn planned_logit_rows(cfg: &SchedulerConfig, model: &ModelConfig) -> usize {
    let sampled = cfg.max_batch_size.min(cfg.max_pass_tokens());
    let in_mlp_room = cfg.max_pass_tokens() * model.intermediate_size / model.vocab_size.max(1);
    sampled.max(in_mlp_room).max(1)
}

/// A pass of one prompt returning [`planned_logit_rows`] rows of logits (scored for its
/// prompt logprobs; at most `max_model_len` tokens), with the blocks its table uses.
pub fn scored_prompt_pass(cfg: &SchedulerConfig, model: &ModelConfig) -> (ForwardBatch, usize) {
    let len = planned_logit_rows(cfg, model).min(cfg.max_model_len).max(1);
    let blocks = len.div_ceil(cfg.block_size);
    let vocab = model.vocab_size.max(1);
    let seq = SeqChunk {
        tokens: (0..len).map(|k| (k * 7 % vocab) as u32).collect(),
        start_pos: 0,
        block_table: (0..blocks as u32).collect(),
        sample: true,
        all_logits: true,
    };
    (ForwardBatch { seqs: vec![seq] }, blocks)
}

/// `budget` tokens spread as evenly as they go over up to `max_batch_size` sequences of at
/// most `max_model_len` tokens, every one sampled, with the blocks their tables use.
fn spread_step(cfg: &SchedulerConfig, budget: usize, vocab: usize) -> (ForwardBatch, usize) {
    let seqs = cfg.max_batch_size.min(budget).max(1);
    let tokens = budget.min(seqs * cfg.max_model_len);
    let mut next_block = 0u32;
    let batch = ForwardBatch {
        seqs: (0..seqs)
            .map(|i| {
                let len = tokens / seqs + usize::from(i < tokens % seqs);
                let blocks = len.div_ceil(cfg.block_size) as u32;
                let block_table = (next_block..next_block + blocks).collect();
                next_block += blocks;
                SeqChunk {
                    tokens: (0..len).map(|k| ((i * 31 + k) % vocab) as u32).collect(),
                    start_pos: 0,
                    block_table,
                    sample: true,
                    all_logits: false,
                }
            })
            .collect(),
    };
    (batch, next_block as usize)
}

/// KV blocks that fit in `utilization` × `total` bytes when `used` bytes are taken.
pub fn blocks_within(
    utilization: f64,
    total: usize,
    used: usize,
    bytes_per_block: usize,
) -> Result<usize> {
    if !(utilization > 0.0 && utilization <= 1.0) {
        bail!("--gpu-memory-utilization {utilization}: must be in (0, 1]");
    }
    let allowed = (utilization * total as f64) as usize;
    if allowed <= used {
        bail!(
            "--gpu-memory-utilization {utilization}: {:.2} GiB of the device's {:.2} GiB is \
             allowed, but {:.2} GiB is already in use (weights, activations, CUDA context and \
             other processes); raise the fraction or free the GPU",
            allowed as f64 / GIB,
            total as f64 / GIB,
            used as f64 / GIB
        );
    }
    Ok((allowed - used) / bytes_per_block.max(1))
}

/// Measure the activation peak (CUDA), size the KV pool — from `utilization` of the
/// device's memory when given, which sets `sched.num_gpu_blocks` — and return the plan.
/// The KV pool itself is allocated later, by the engine.
pub fn plan(
    model: &Model,
    sched: &mut SchedulerConfig,
    utilization: Option<f64>,
    cuda_graphs: bool,
) -> Result<MemoryPlan> {
    let device = model.device();
    let on_gpu = model.device_memory()?.is_some();
    if utilization.is_some() && !on_gpu {
        bail!(
            "--gpu-memory-utilization sizes the KV pool from GPU memory: it needs --device cuda \
             (on the CPU, size the pool with --num-gpu-blocks)"
        );
    }
    let per_block = model.kv_bytes_per_block(sched.block_size);
    let (mut activations, mut usable) = (None, None);
    // Memory free for the pool: on the GPU once the peak step has grown the arena, on the
    // CPU what the host has available.
    let free = if on_gpu {
        let vocab = model.config().vocab_size;
        let (batch, blocks) = peak_step(sched, vocab);
        // Then one step at each GEMM row bucket a step can reach, so that cuBLAS has chosen
        // its algorithms before the first request instead of on its TTFT (see
        // `Gemm::padded_rows`); the largest bucket may round past the peak.
        let warm_up: Vec<(ForwardBatch, usize)> = model
            .gemm_row_buckets(sched.max_pass_tokens())
            .into_iter()
            .map(|rows| spread_step(sched, rows, vocab))
            .collect();
        // And the pass of the most rows of logits one returns, a prompt scored for its
        // prompt logprobs: its head output and f32 logits are the arena's too.
        let scored = scored_prompt_pass(sched, model.config());
        let scratch_blocks = warm_up
            .iter()
            .chain([&scored])
            .map(|w| w.1)
            .fold(blocks, usize::max);
        let mut scratch = model.new_kv_cache(scratch_blocks, sched.block_size)?;
        model.forward(&batch, &mut scratch)?;
        for (step, _) in warm_up.iter().chain([&scored]) {
            model.forward(step, &mut scratch)?;
        }
        drop(scratch);
        activations = model.activation_bytes();
        let (free, total) = model.device_memory()?.expect("a device with memory");
        usable = Some(total);
        if let Some(f) = utilization {
            let blocks = blocks_within(f, total, total - free, per_block)?;
            let needed = sched.max_model_len.div_ceil(sched.block_size);
            if blocks < needed {
                bail!(
                    "--gpu-memory-utilization {f}: the KV pool gets {blocks} blocks of {} \
                     tokens, fewer than one sequence of --max-model-len {} needs ({needed}); \
                     raise the fraction or lower --max-model-len",
                    sched.block_size,
                    sched.max_model_len
                );
            }
            sched.num_gpu_blocks = blocks;
            usable = Some((f * total as f64) as usize);
        }
        Some(free)
    } else {
        crate::runtime::host::available_memory()
    };
    // A pool sized in blocks must fit what is free (sized by utilization, it does).
    let kv_pool = sched.num_gpu_blocks.checked_mul(per_block);
    if let Some(free) = free {
        if kv_pool.is_none_or(|bytes| bytes > free) {
            bail!(
                "--num-gpu-blocks {}: a KV pool of {} blocks x {} tokens needs {:.2} GiB, but \
                 {} has {:.2} GiB free",
                sched.num_gpu_blocks,
                sched.num_gpu_blocks,
                sched.block_size,
                sched.num_gpu_blocks as f64 * per_block as f64 / GIB,
                if on_gpu { "the GPU" } else { "the host" },
                free as f64 / GIB
            );
        }
    }
    Ok(MemoryPlan {
        device,
        weights: model.config().num_parameters() * model.weight_dtype().size_in_bytes(),
        kv_pool: kv_pool.unwrap_or(usize::MAX),
        kv_blocks: sched.num_gpu_blocks,
        block_size: sched.block_size,
        kv_dtype: model.kv_dtype(),
        activations,
        usable,
        cuda_graphs: (cuda_graphs && !device.is_cpu()).then_some(sched.max_batch_size),
    })
}

/// The name users give a dtype (`--dtype`, `--kv-cache-dtype`).
fn dtype_name(d: candle_core::DType) -> &'static str {
    match d {
        candle_core::DType::F8E4M3 => "fp8",
        other => other.as_str(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peak_step_spreads_the_budget_over_the_batch_within_max_model_len() {
        let cfg = SchedulerConfig {
            max_batch_size: 24,
            prefill_chunk_size: 512,
            block_size: 16,
            ..SchedulerConfig::default()
        };
        let (b, blocks) = peak_step(&cfg, 1000);
        assert_eq!(b.seqs.len(), 24);
        assert_eq!(b.total_tokens(), 512);
        assert_eq!(b.num_logit_rows(), 24);
        let lens: Vec<usize> = b.seqs.iter().map(|s| s.tokens.len()).collect();
        assert!(lens.iter().all(|&l| l == 21 || l == 22), "{lens:?}");
        // Disjoint tables, numbered 0..blocks, each covering its sequence.
        let mut all: Vec<u32> = b.seqs.iter().flat_map(|s| s.block_table.clone()).collect();
        all.sort_unstable();
        assert_eq!(all, (0..blocks as u32).collect::<Vec<_>>());
        for s in &b.seqs {
            assert!(s.block_table.len() * 16 >= s.tokens.len());
            assert!(s.tokens.iter().all(|&t| t < 1000));
        }

        // Unchunked: one whole prompt at the longest; a budget beyond the batch's lengths
        // is cut to them.
        let whole = SchedulerConfig {
            chunked_prefill: false,
            max_model_len: 4096,
            ..cfg.clone()
        };
        let (b, _) = peak_step(&whole, 1000);
        assert_eq!(b.total_tokens(), 4096);
        assert!(b.seqs.iter().all(|s| s.tokens.len() <= 4096));
        let short = SchedulerConfig {
            max_batch_size: 2,
            max_model_len: 100,
            prefill_chunk_size: 512,
            ..cfg
        };
        let (b, _) = peak_step(&short, 1000);
        assert_eq!(b.total_tokens(), 200);
    }

    /// The plan's scored pass returns the most rows of logits a pass may, from one prompt
    /// within `max_model_len` over its own blocks.
    #[test]
    fn the_scored_prompt_pass_returns_the_planned_rows_of_logits() {
        let dir = tempfile::tempdir().unwrap();
        crate::tools::make_model::make_model(
            &crate::tools::make_model::ModelSpec::new(crate::runtime::model::Arch::Llama),
            dir.path(),
        )
        .unwrap();
        let model =
            crate::runtime::model::load_model_dir(dir.path(), None, crate::Device::Cpu).unwrap();
        let config = model.model.config();
        let cfg = SchedulerConfig {
            max_batch_size: 8,
            prefill_chunk_size: 512,
            block_size: 16,
            ..SchedulerConfig::default()
        };
        // 512 tokens a pass x 128 intermediate / 512 vocabulary.
        assert_eq!(planned_logit_rows(&cfg, config), 128);
        let (b, blocks) = scored_prompt_pass(&cfg, config);
        assert_eq!(b.num_logit_rows(), 128);
        assert_eq!(blocks, 8);
        assert_eq!(b.seqs[0].block_table, (0..8).collect::<Vec<u32>>());
        assert!(b.seqs[0]
            .tokens
            .iter()
            .all(|&t| (t as usize) < config.vocab_size));
        // Never a prompt longer than a sequence may be.
        let short = SchedulerConfig {
            max_model_len: 100,
            ..cfg
        };
        assert_eq!(scored_prompt_pass(&short, config).0.total_tokens(), 100);
        // It runs: its rows come back.
        let mut kv = model.model.new_kv_cache(blocks, 16).unwrap();
        assert_eq!(model.model.forward(&b, &mut kv).unwrap().rows(), 128);
    }

    #[test]
    fn kv_blocks_take_what_the_fraction_leaves() {
        let gib = 1usize << 30;
        // 80 GiB device, 0.9 allowed = 72 GiB, 20 GiB used: 52 GiB of 1 MiB blocks.
        assert_eq!(
            blocks_within(0.9, 80 * gib, 20 * gib, 1 << 20).unwrap(),
            52 * 1024
        );
        let e = blocks_within(0.2, 80 * gib, 20 * gib, 1 << 20).unwrap_err();
        assert!(e.to_string().contains("already in use"), "{e}");
        for bad in [0.0, -0.5, 1.5, f64::NAN] {
            assert!(blocks_within(bad, 80 * gib, 0, 1).is_err(), "{bad}");
        }
    }

    #[test]
    fn cpu_plan_reports_the_pool_and_refuses_a_utilization() -> Result<()> {
        let tmp = tempfile::tempdir()?;
        let dir = tmp.path().join("m");
        crate::tools::make_model::make_model(
            &crate::tools::make_model::ModelSpec::new(crate::runtime::model::Arch::Qwen3),
            &dir,
        )?;
        let lm = crate::runtime::model::load_model_dir(&dir, None, Device::Cpu)?;
        let mut sched = SchedulerConfig {
            num_gpu_blocks: 40,
            max_model_len: 256,
            ..SchedulerConfig::default()
        };
        let p = plan(&lm.model, &mut sched, None, true)?;
        // The pool the plan reports is the pool the engine allocates.
        let kv = lm.model.new_kv_cache(40, sched.block_size)?;
        assert_eq!(p.kv_pool, kv.size_bytes());
        assert_eq!(
            (p.kv_blocks, p.activations, p.cuda_graphs),
            (40, None, None)
        );
        assert!(p.describe().contains("40 blocks of 16 tokens"));
        let e = plan(&lm.model, &mut sched, Some(0.9), false).unwrap_err();
        assert!(e.to_string().contains("--device cuda"), "{e}");
        // A pool beyond the host's memory is refused before anything is allocated.
        if crate::runtime::host::available_memory().is_some() {
            let mut huge = SchedulerConfig {
                num_gpu_blocks: u32::MAX as usize,
                ..sched
            };
            let e = plan(&lm.model, &mut huge, None, false).unwrap_err();
            assert!(e.to_string().contains("GiB free"), "{e}");
        }
        Ok(())
    }
}
