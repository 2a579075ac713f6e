//! The scheduler's knobs: the seed server's flags.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BatchingMode {
    /// A batch is admitted together and runs until all of it finishes.
    Static,
    /// Admit and retire every step.
    Continuous,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvBackend {
    /// Each sequence reserves `max_model_len` tokens.
    Contiguous,
    /// Block tables over a pool of `num_gpu_blocks` blocks.
    Paged,
}

/// How much KV a waiting sequence must find free to be admitted (paged cache; a contiguous
/// slot holds a whole sequence anyway).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvAdmission {
    /// Its prompt's blocks (vLLM): decodes grow into the pool and, when it runs dry,
    /// preempt the newest running sequence, which recomputes later.
    #[default]
    Prompt,
    /// Blocks for its prompt and all its `max_tokens`, beside what the running sequences
    /// still have reserved (TGI's token budget): decodes never run the pool dry, at the
    /// price of admitting fewer at once — a request without `max_tokens` (the server gives
    /// it `max_model_len` less its prompt) reserves a whole `max_model_len`.
    WholeSequence,
    /// Its chunk's blocks, as [`KvAdmission::Prompt`], but prompt work — a waiting prompt or
    /// the next chunk of a running one — joins a step only while `kv_watermark` of the pool
    /// was free when the step began, or as the step's only work; and a waiting prompt that
    /// finds no blocks for its chunk is passed over for the ones behind it. Transformers'
    /// continuous batching (its FIFO scheduler, `safety_margin` 0.15 by default:
    /// `generation/continuous_batching/scheduler.py`).
    FreeMargin,
}

/// What a running sequence does when the paged pool has no free block for its next tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvPreemption {
    /// Preempt a running sequence not yet scheduled this step ([`KvVictim`]: the newest, as
    /// vLLM), until the blocks are found: its KV is freed and, readmitted, it recomputes its
    /// prompt and output.
    #[default]
    Recompute,
    /// The sequence waits: it keeps its blocks and skips steps until finished sequences free
    /// some, and nothing new is admitted meanwhile. Only when no running sequence can step
    /// at all is one preempted ([`KvVictim`]), so that the others go on.
    Wait,
}

/// Which running sequence gives its blocks up when the paged pool runs dry (preemption by
/// recompute): among those not yet scheduled in the step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvVictim {
    /// The newest admitted (vLLM: the lowest priority, last in its running queue).
    #[default]
    Newest,
    /// A decoding sequence (one part-way through its prompt only when none decodes) with
    /// the fewest output tokens so far, the longest prompt among those (SGLang's decode
    /// retraction): the least generated work lost, the most blocks freed.
    FewestOutputs,
}

/// The order waiting sequences are admitted in, and which running sequence a shortage of
/// blocks preempts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SchedulingPolicy {
    /// First come, first served: preempted sequences first, then arrivals in their order
    /// beside a lane of their own for forks (see the waiting queue).
    #[default]
    Fcfs,
    /// By each request's priority, the lowest value first, then by arrival (vLLM's
    /// `--scheduling-policy priority`): a preempted sequence waits in its place by that
    /// order too, and the one preempted when blocks run short is a running sequence of the
    /// highest value, though it was scheduled earlier in the step — by [`KvVictim`] among
    /// equals, the latest arrival for [`KvVictim::Newest`], as vLLM. Running sequences step
    /// in the same order as first come, first served (vLLM's too ignores priorities there),
    /// and a waiting request never preempts a running one, whatever its priority (neither
    /// does vLLM's). A request's forks (`n`) share its priority and arrival, so they wait
    /// before later requests of that priority, without the lane that keeps them from
    /// starving others first come, first served.
    Priority,
}

impl SchedulingPolicy {
    pub fn is_fcfs(&self) -> bool {
        *self == SchedulingPolicy::Fcfs
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SchedulerConfig {
    pub batching_mode: BatchingMode,
    /// Running sequences at most.
    pub max_batch_size: usize,
    pub kv_cache_backend: KvBackend,
    /// KV budget in blocks of `block_size` tokens (contiguous slots are carved from the same
    /// budget: `num_gpu_blocks * block_size / max_model_len` of them).
    pub num_gpu_blocks: usize,
    pub block_size: usize,
    /// With chunked prefill, a step's tokens are budgeted (decodes first, then prefill
    /// chunks): see [`Self::step_token_budget`]. Without it a prompt is prefilled whole, in
    /// one step.
    pub chunked_prefill: bool,
    pub prefill_chunk_size: usize,
    /// Tokens a step processes at most (vLLM's `max_num_batched_tokens`). With chunked
    /// prefill it is the chunk budget, in place of `prefill_chunk_size`; without, prompts
    /// are still prefilled whole, so it must hold one of `max_model_len`. `None`: the
    /// chunk budget `prefill_chunk_size`, or without chunking no limit but the KV pool.
    #[serde(default)]
    pub max_num_batched_tokens: Option<usize>,
    /// Reuse the KV of earlier prompts' prefixes: a paged pool's content-addressed full
    /// blocks (vLLM's), or with contiguous slots each slot's last tokens (llama.cpp's
    /// server's: [`crate::kv::ContiguousKv`]).
    pub prefix_caching: bool,
    /// Longest sequence (prompt + output) in tokens.
    pub max_model_len: usize,
    /// Waiting requests at most; `add_request` refuses more (the server answers 503).
    /// Bounded by default ([`DEFAULT_MAX_WAITING`]): an overloaded server's backlog, and so
    /// the memory its prompts hold, must not grow with the run.
    pub max_waiting: Option<usize>,
    /// What admission asks of the KV pool.
    #[serde(default)]
    pub kv_admission: KvAdmission,
    /// What a running sequence (a decode or a prompt chunk) does when the pool runs dry
    /// (a paged cache with prompt admission).
    #[serde(default)]
    pub kv_preemption: KvPreemption,
    /// Paged cache: the fraction of the pool a waiting sequence's whole prompt must leave
    /// free to be admitted, in whole blocks rounded down (vLLM V0's `watermark`, 0.01
    /// there): headroom for the running sequences' decodes, so that fewer of them preempt.
    /// Waived when nothing runs. 0: none (vLLM V1). With [`KvAdmission::FreeMargin`], the
    /// free fraction below which prompt work runs only alone (transformers: 0.15).
    #[serde(default)]
    pub kv_watermark: f64,
    /// Which running sequence is preempted when the pool runs dry.
    #[serde(default)]
    pub kv_victim: KvVictim,
    /// Context tokens a step may read from the cache at most, each sequence's computed
    /// tokens counted (a prefix shared through the cache once per reader; a prompt just
    /// admitted reads its prefix hit): a sequence that would pass it sits the step out, a
    /// waiting one is passed over for those behind it, and the step's first sequence always
    /// runs. `None`: no limit. Transformers' continuous batching without its decode fast
    /// path (no flash attention: a CPU's case) reads a step's keys through an index of the
    /// pool's size, and skips a request whose context would overflow it (`cache_budget =
    /// max_tokens_read`, `scheduler.py`): with prefixes shared, the running sequences'
    /// contexts can sum past the pool, and some sit out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_step_read_tokens: Option<usize>,
    /// The order of admission and preemption.
    #[serde(default)]
    pub scheduling_policy: SchedulingPolicy,
}

/// The waiting queue's default bound: far beyond what a server drains in any benchmark
/// (minutes of backlog at thousands of requests/s), small enough that the prompts it holds
/// stay within memory (16,384 prompts of 4,096 tokens: 256 MiB of token ids).
pub const DEFAULT_MAX_WAITING: usize = 16_384;

/// The longest `max_model_len` accepted: 16M tokens, past every model's context; a larger
/// one would let a single request's prompt take gigabytes.
pub const MAX_MODEL_LEN: usize = 1 << 24;

impl Default for SchedulerConfig {
    /// The benchmark log's Phase 8 configuration (Llama and Gemma3 rows).
    fn default() -> Self {
        SchedulerConfig {
            batching_mode: BatchingMode::Continuous,
            max_batch_size: 24,
            kv_cache_backend: KvBackend::Paged,
            num_gpu_blocks: 2048,
            block_size: 16,
            chunked_prefill: true,
            prefill_chunk_size: 512,
            max_num_batched_tokens: None,
            prefix_caching: true,
            max_model_len: 4096,
            max_waiting: Some(DEFAULT_MAX_WAITING),
            kv_admission: KvAdmission::Prompt,
            kv_preemption: KvPreemption::Recompute,
            kv_watermark: 0.0,
            kv_victim: KvVictim::Newest,
            max_step_read_tokens: None,
            scheduling_policy: SchedulingPolicy::Fcfs,
        }
    }
}

impl SchedulerConfig {
    /// Tokens of KV the configuration provides.
    pub fn kv_capacity_tokens(&self) -> usize {
        match self.kv_cache_backend {
            KvBackend::Paged => self.num_gpu_blocks * self.block_size,
            KvBackend::Contiguous => {
                self.num_gpu_blocks * self.block_size / self.max_model_len * self.max_model_len
            }
        }
    }

    /// Blocks a waiting sequence must leave free to be admitted (vLLM's
    /// `int(watermark * num_gpu_blocks)`); 0 for a contiguous cache.
    pub fn watermark_blocks(&self) -> usize {
        match self.kv_cache_backend {
            KvBackend::Paged => (self.kv_watermark * self.num_gpu_blocks as f64) as usize,
            KvBackend::Contiguous => 0,
        }
    }

    /// The most tokens one step may hold: with chunked prefill the chunk budget
    /// (`max_num_batched_tokens` when given, as vLLM's, else `prefill_chunk_size`); without,
    /// `max_num_batched_tokens` (`None`: no limit but the KV pool and the batch).
    pub fn step_token_budget(&self) -> Option<usize> {
        if self.chunked_prefill {
            Some(
                self.max_num_batched_tokens
                    .unwrap_or(self.prefill_chunk_size),
            )
        } else {
            self.max_num_batched_tokens
        }
    }

    /// The most tokens one forward pass holds: the step's token budget, or without one a
    /// whole prompt of `max_model_len`. A step of more (several whole prompts, unchunked and
    /// without `max_num_batched_tokens`) runs as several passes, in the engine and in the
    /// simulator's cost models; the engine's memory plan sizes activations for one pass.
    pub fn max_pass_tokens(&self) -> usize {
        self.step_token_budget().unwrap_or(self.max_model_len)
    }

    /// Every inconsistency, as (key, reason).
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        if !(0.0..1.0).contains(&self.kv_watermark) {
            return Err((
                "kv_watermark",
                format!(
                    "must be a fraction of the pool in [0, 1), got {}",
                    self.kv_watermark
                ),
            ));
        }
        let positive = [
            ("max_batch_size", self.max_batch_size),
            ("num_gpu_blocks", self.num_gpu_blocks),
            ("block_size", self.block_size),
            ("max_model_len", self.max_model_len),
        ];
        for (key, v) in positive {
            if v == 0 {
                return Err((key, "must be at least 1".into()));
            }
        }
        if let (true, Some(budget)) = (self.chunked_prefill, self.step_token_budget()) {
            let key = if self.max_num_batched_tokens.is_some() {
                "max_num_batched_tokens"
            } else {
                "prefill_chunk_size"
            };
            if budget == 0 {
                return Err((key, "must be at least 1".into()));
            }
            if budget < self.max_batch_size {
                return Err((
                    key,
                    format!(
                        "the step budget {budget} must be at least max_batch_size {} so that \
                         every running sequence can decode each step",
                        self.max_batch_size
                    ),
                ));
            }
        }
        if self.max_step_read_tokens == Some(0) {
            return Err(("max_step_read_tokens", "must be at least 1".into()));
        }
        if let (false, Some(budget)) = (self.chunked_prefill, self.max_num_batched_tokens) {
            let need = self.max_model_len.max(self.max_batch_size);
            if budget < need {
                return Err((
                    "max_num_batched_tokens",
                    format!(
                        "{budget} cannot hold one whole prompt of max_model_len {} and a decode \
                         for each of max_batch_size {} sequences (needs at least {need})",
                        self.max_model_len, self.max_batch_size
                    ),
                ));
            }
        }
        if self.max_waiting == Some(0) {
            return Err((
                "max_waiting",
                format!(
                    "0 would refuse every request (the default is {DEFAULT_MAX_WAITING}; a \
                     larger number allows a longer queue)"
                ),
            ));
        }
        if self.max_model_len > MAX_MODEL_LEN {
            return Err((
                "max_model_len",
                format!(
                    "{} tokens is beyond any model (at most {MAX_MODEL_LEN})",
                    self.max_model_len
                ),
            ));
        }
        // Block ids are u32, and every count derived from the pool must not overflow.
        if self.num_gpu_blocks > u32::MAX as usize
            || self
                .num_gpu_blocks
                .checked_mul(self.block_size)
                .and_then(|t| t.checked_mul(self.max_model_len.max(1)))
                .is_none()
        {
            return Err((
                "num_gpu_blocks",
                format!(
                    "{} blocks of {} tokens is beyond any device (at most {} blocks)",
                    self.num_gpu_blocks,
                    self.block_size,
                    u32::MAX
                ),
            ));
        }
        // Like vLLM, refuse a pool that cannot hold one sequence of max_model_len tokens:
        // such a sequence, preempted, could never be scheduled again.
        if self.num_gpu_blocks * self.block_size < self.max_model_len {
            return Err((
                "num_gpu_blocks",
                format!(
                    "{} blocks x {} tokens = {} tokens of KV cannot hold one sequence of \
                     max_model_len {} tokens",
                    self.num_gpu_blocks,
                    self.block_size,
                    self.num_gpu_blocks * self.block_size,
                    self.max_model_len
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(cfg: SchedulerConfig) -> &'static str {
        cfg.validate().expect_err("must be refused").0
    }

    #[test]
    fn impossible_configurations_are_refused_with_their_key() {
        let ok = SchedulerConfig::default();
        ok.validate().unwrap();
        let huge = SchedulerConfig {
            num_gpu_blocks: usize::MAX,
            block_size: 2,
            ..ok.clone()
        };
        assert_eq!(key(huge), "num_gpu_blocks");
        let too_many_ids = SchedulerConfig {
            num_gpu_blocks: u32::MAX as usize + 1,
            ..ok.clone()
        };
        assert_eq!(key(too_many_ids), "num_gpu_blocks");
        let no_queue = SchedulerConfig {
            max_waiting: Some(0),
            ..ok.clone()
        };
        assert_eq!(key(no_queue), "max_waiting");
        let small_budget = SchedulerConfig {
            max_num_batched_tokens: Some(1000),
            chunked_prefill: false,
            ..ok.clone()
        };
        assert_eq!(key(small_budget), "max_num_batched_tokens");
        // With chunked prefill it is the chunk budget (vLLM's meaning): no whole prompt
        // needs to fit, but a decode of every running sequence does.
        let chunk_budget = SchedulerConfig {
            max_num_batched_tokens: Some(1000),
            ..ok.clone()
        };
        assert!(chunk_budget.chunked_prefill);
        chunk_budget.validate().unwrap();
        assert_eq!(chunk_budget.step_token_budget(), Some(1000));
        let under_batch = SchedulerConfig {
            max_num_batched_tokens: Some(ok.max_batch_size - 1),
            ..ok.clone()
        };
        assert_eq!(key(under_batch), "max_num_batched_tokens");
        let small = SchedulerConfig {
            num_gpu_blocks: 10,
            ..ok
        };
        assert_eq!(key(small), "num_gpu_blocks");
    }
}
