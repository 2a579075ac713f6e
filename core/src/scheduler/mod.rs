//! The scheduler: decides, step by step, which sequences run, how many tokens each
//! processes, and where their KV lives. It never executes anything.
//!
//! One rule drives progress: a sequence's computed tokens catch up with its known tokens
//! (prompt + sampled output). A prefill, a prefill chunk, a recompute after preemption and
//! a prefix-cache hit (which simply starts `num_computed` further along) are all that rule.
//!
//! Each step, in this order:
//! 1. running sequences that decode (one token each);
//! 2. running sequences part-way through their prompt (chunks, within the token budget);
//! 3. waiting sequences, first come first served, while the batch, budget and KV allow;
//!    a request's forks (OpenAI's `n`) wait in a lane of their own that alternates with
//!    everyone else's (see [`waiting`]).
//!
//! Under [`SchedulingPolicy::Priority`] (vLLM's), 3 goes in priority then arrival order,
//! and the sequence preempted is one of the lowest priority, though 1 or 2 scheduled it
//! earlier in the step (it is taken back out of the plan).
//!
//! With [`KvAdmission::FreeMargin`] (transformers'), prompt work of 2 and 3 joins a step
//! only while the pool was free enough as it began, or alone; a waiting prompt that does
//! not fit lets the ones behind it go first. With `max_step_read_tokens` (transformers'
//! too), a sequence of 1–3 whose context would take the step's reads past it sits the
//! step out, a waiting one letting those behind it go first.
//!
//! When a running sequence needs a block and none is free, a running sequence not yet
//! scheduled this step ([`KvVictim`]: the newest, as vLLM) is preempted (its KV freed, to
//! be recomputed later) and put at the front of the waiting queue (under priority
//! scheduling: see above, and it waits in its rank's place) — or, with
//! [`KvPreemption::Wait`], the sequence waits, holding its blocks, and sits the step out.
//! Running out of KV is never an error to the request.

mod config;
mod plan;
mod shape;
mod waiting;

use crate::kv::BrokenInvariant;

use rustc_hash::FxHashMap;

pub use config::{
    BatchingMode, KvAdmission, KvBackend, KvPreemption, KvVictim, SchedulerConfig,
    SchedulingPolicy, DEFAULT_MAX_WAITING, MAX_MODEL_LEN,
};
pub use plan::{Event, ScheduledSeq, StepPlan};
pub use shape::{
    graph_bucket, whole_sequence_passes, PassSum, SlotPasses, StepShape, GRAPH_BUCKETS,
    SLOT_KEY_PAD,
};
use waiting::{Rank, WaitQueue};

use crate::kv::{
    blocks_for, BlockId, ContiguousKv, KvEvent, KvManager, PagedKv, PrefixMatch, SeqKv,
};
use crate::request::{FinishReason, Request, RequestId, RequestStats, SeqState, StopConditions};

/// Why a request cannot be accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AddError {
    /// The prompt leaves no room for one output token within `max_model_len`.
    PromptTooLong {
        prompt_tokens: usize,
        max_model_len: usize,
    },
    /// The prompt and the tokens asked for pass `max_model_len` (an OpenAI-style server
    /// refuses the request: see [`completion_budget`]).
    ExceedsContext {
        prompt_tokens: usize,
        max_tokens: usize,
        max_model_len: usize,
    },
    /// The prompt alone needs more KV than the whole pool holds.
    ExceedsKvCapacity {
        needed_tokens: usize,
        capacity_tokens: usize,
    },
    /// The waiting queue is at `max_waiting`.
    QueueFull {
        max_waiting: usize,
    },
    DuplicateId(RequestId),
    EmptyPrompt,
}

impl std::fmt::Display for AddError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AddError::PromptTooLong {
                prompt_tokens,
                max_model_len,
            } => write!(
                f,
                "this model's maximum context length is {max_model_len} tokens, but the prompt \
                 has {prompt_tokens} tokens (at least one output token must fit)"
            ),
            AddError::ExceedsContext {
                prompt_tokens,
                max_tokens,
                max_model_len,
            } => write!(
                f,
                "this model's maximum context length is {max_model_len} tokens, but you \
                 requested {} tokens ({prompt_tokens} in the prompt, {max_tokens} for the \
                 completion)",
                prompt_tokens + max_tokens
            ),
            AddError::ExceedsKvCapacity {
                needed_tokens,
                capacity_tokens,
            } => write!(
                f,
                "the request needs {needed_tokens} tokens of KV cache but the whole pool holds \
                 {capacity_tokens}"
            ),
            AddError::QueueFull { max_waiting } => {
                write!(f, "the waiting queue is full ({max_waiting} requests)")
            }
            AddError::DuplicateId(id) => write!(f, "request id {id} is already in use"),
            AddError::EmptyPrompt => write!(f, "the prompt is empty"),
        }
    }
}

impl std::error::Error for AddError {}

/// The tokens a prompt of `prompt_tokens` may generate within `max_model_len`: `asked`, or
/// as many as fit when none were asked; a prompt that leaves no room, or a request asking
/// for more than fits, is refused, as vLLM's OpenAI server refuses it (400) rather than
/// cut short. The engine's API and the simulator's client both ask here.
pub fn completion_budget(
    max_model_len: usize,
    prompt_tokens: usize,
    asked: Option<usize>,
) -> Result<usize, AddError> {
    if prompt_tokens >= max_model_len {
        return Err(AddError::PromptTooLong {
            prompt_tokens,
            max_model_len,
        });
    }
    match asked {
        Some(max_tokens) if prompt_tokens + max_tokens > max_model_len => {
            Err(AddError::ExceedsContext {
                prompt_tokens,
                max_tokens,
                max_model_len,
            })
        }
        Some(m) => Ok(m),
        None => Ok(max_model_len - prompt_tokens),
    }
}

/// Counters and gauges, as the metrics endpoint and time series report them.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct SchedulerStats {
    pub num_waiting: usize,
    pub num_running: usize,
    pub kv_usage: f64,
    pub num_free_blocks: usize,
    pub num_blocks: usize,
    /// Prompt tokens looked up in the prefix cache, and tokens found (vLLM's counting).
    pub prefix_queries: u64,
    pub prefix_hits: u64,
    pub num_preemptions: u64,
    /// Steps a running sequence skipped waiting for a free block ([`KvPreemption::Wait`]),
    /// summed over sequences.
    pub num_kv_waits: u64,
    pub num_finished: u64,
}

#[derive(Debug)]
struct Sequence {
    id: RequestId,
    /// Prompt followed by sampled output.
    tokens: Vec<u32>,
    prompt_len: usize,
    num_computed: usize,
    stop: StopConditions,
    state: SeqState,
    kv: SeqKv,
    /// The step in which it was last scheduled (to pick preemption victims).
    scheduled_in: u64,
    /// Its place under priority scheduling.
    rank: Rank,
    arrival_time: f64,
    first_scheduled_time: Option<f64>,
    /// Its output tokens' times (see [`RequestStats`]).
    first_token_time: Option<f64>,
    last_token_time: f64,
    itl_sum: f64,
    itl_max: f64,
    cached_tokens: Option<usize>,
    preemptions: u32,
    /// More sequences to sample from this prompt once its first token is sampled (OpenAI's
    /// `n`): each is forked then (see `Scheduler::fork`).
    forks: Vec<RequestId>,
    /// Compute every prompt token, none from the prefix cache (see [`AddOptions`]).
    every_prompt_token: bool,
    /// Its last prefix-cache lookup while waiting: an admission that lets later sequences
    /// by walks the whole queue every step, and would otherwise hash every waiting prompt
    /// each time.
    prefix_memo: Option<PrefixMemo>,
}

/// A waiting sequence's prefix-cache lookup, kept while the index stays as it was and
/// brought up to date when it moves, rather than made again at each step. It lives only
/// while its sequence waits (admission drops it), when the tokens it looked up cannot
/// change.
#[derive(Debug)]
struct PrefixMemo {
    /// The manager's [`KvManager::lookup_version`] as it was made.
    version: Option<u64>,
    found: PrefixMatch,
}

impl PrefixMemo {
    /// The longest cached prefix of `tokens` in `kv`, from the sequence's last lookup.
    fn refresh<'a>(
        memo: &'a mut Option<PrefixMemo>,
        kv: &dyn KvManager,
        tokens: &[u32],
    ) -> &'a PrefixMatch {
        let version = kv.lookup_version();
        let memo = match memo {
            Some(memo) => {
                if version.is_none() || memo.version != version {
                    kv.update_prefix(tokens, &mut memo.found, memo.version);
                    memo.version = version;
                }
                memo
            }
            None => memo.insert(PrefixMemo {
                version,
                found: kv.lookup_prefix(tokens),
            }),
        };
        #[cfg(test)]
        debug_assert_eq!(memo.found, kv.lookup_prefix(tokens), "as a fresh lookup");
        &memo.found
    }
}

/// How a request is queued beyond the request itself.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AddOptions {
    /// Ids of more sequences to sample from the prompt (see [`Scheduler::add_forked`]).
    pub forks: Vec<RequestId>,
    /// Compute every prompt token — none is taken from the prefix cache — because the
    /// driver wants the logits of every prompt position (prompt logprobs, as vLLM also
    /// recomputes a cached prompt for them), until its first token, which carries them (a
    /// sequence preempted after it is re-admitted from the cache). Its blocks are still
    /// registered for others.
    pub every_prompt_token: bool,
    /// Its priority under [`SchedulingPolicy::Priority`], the lowest value first (vLLM's
    /// `priority`; its forks share it); first come, first served ignores it.
    pub priority: i64,
}

impl Sequence {
    fn output_len(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// The most KV positions it can hold: its prompt and every output token `max_tokens`
    /// allows but the last, which is sampled and never computed.
    fn max_kv_len(&self, max_model_len: usize) -> usize {
        let len = self
            .prompt_len
            .saturating_add(self.stop.max_tokens.max(1))
            .min(max_model_len);
        len - 1
    }

    fn is_decode(&self) -> bool {
        self.num_computed >= self.prompt_len && self.num_computed + 1 == self.tokens.len()
    }

    fn stats(&self) -> RequestStats {
        RequestStats {
            prompt_tokens: self.prompt_len,
            output_tokens: self.output_len(),
            cached_tokens: self.cached_tokens.unwrap_or(0),
            preemptions: self.preemptions,
            arrival_time: self.arrival_time,
            first_scheduled_time: self.first_scheduled_time,
            first_token_time: self.first_token_time,
            itl_sum: self.itl_sum,
            itl_max: self.itl_max,
        }
    }
}

pub struct Scheduler {
    cfg: SchedulerConfig,
    kv: Box<dyn KvManager + Send>,
    /// Live sequences by slot; `index` maps request ids to slots.
    seqs: Vec<Option<Sequence>>,
    free_slots: Vec<u32>,
    index: FxHashMap<RequestId, u32>,
    /// Ids of forks not made yet (their parent's first token is to come): taken.
    pending_forks: rustc_hash::FxHashSet<RequestId>,
    waiting: WaitQueue,
    /// In admission order: the newest is last.
    running: Vec<u32>,
    /// Sequences made so far (their [`Rank`]s' order).
    sequences_made: u64,
    step: u64,
    ended_outside: Vec<RequestId>,
    spare: StepPlan,
    stats: SchedulerStats,
    /// Scratch for the running sequences' visiting order.
    order: Vec<u32>,
    last_step_end: f64,
    /// Copy block tables into plans (a driver with no KV memory, the simulator, needs none).
    plan_block_tables: bool,
}

impl Scheduler {
    /// A scheduler for a valid configuration (see [`SchedulerConfig::validate`]).
    pub fn new(cfg: SchedulerConfig) -> Self {
        if let Err((key, reason)) = cfg.validate() {
            panic!("invalid scheduler configuration: {key}: {reason}");
        }
        let kv: Box<dyn KvManager + Send> = match cfg.kv_cache_backend {
            KvBackend::Paged => Box::new(PagedKv::new(
                cfg.num_gpu_blocks,
                cfg.block_size,
                cfg.prefix_caching,
            )),
            KvBackend::Contiguous => Box::new(ContiguousKv::new(
                cfg.num_gpu_blocks * cfg.block_size,
                cfg.max_model_len,
                cfg.prefix_caching,
            )),
        };
        let waiting = WaitQueue::new(cfg.scheduling_policy);
        Scheduler {
            cfg,
            kv,
            seqs: Vec::new(),
            free_slots: Vec::new(),
            index: FxHashMap::default(),
            pending_forks: Default::default(),
            waiting,
            running: Vec::new(),
            sequences_made: 0,
            step: 0,
            ended_outside: Vec::new(),
            spare: StepPlan::default(),
            stats: SchedulerStats::default(),
            plan_block_tables: true,
            order: Vec::new(),
            last_step_end: 0.0,
        }
    }

    /// Leave block tables out of step plans: a driver that moves no KV memory (the
    /// simulator) does not read them, and copying them is most of a planning step's
    /// memory traffic when contexts are long.
    pub fn without_block_tables(mut self) -> Self {
        self.plan_block_tables = false;
        self
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// The KV manager (read-only: routers and metrics look at it).
    pub fn kv(&self) -> &dyn KvManager {
        self.kv.as_ref()
    }

    /// Empty the prefix cache; false (and nothing changes) while a request holds a block —
    /// vLLM refuses the same way.
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.kv.reset_prefix_cache()
    }

    /// Record the prefix cache's events from now on (see [`KvEvent`]).
    pub fn record_kv_events(&mut self) {
        self.kv.record_events();
    }

    /// The prefix cache's events since the last call, oldest first.
    pub fn take_kv_events(&mut self) -> Vec<KvEvent> {
        self.kv.take_events()
    }

    /// Queue a request. `now` is its arrival time on the driver's clock.
    pub fn add_request(&mut self, req: Request, now: f64) -> Result<(), AddError> {
        self.add_forked(req, Vec::new(), now)
    }

    /// Queue a request that samples `1 + forks.len()` sequences from its prompt (OpenAI's
    /// `n`): the prompt is computed once, and when its first token is sampled each of
    /// `forks` becomes a sequence of its own in the forks' lane of the queue, which
    /// alternates with the others' (so a large `n` cannot starve small requests). Admitted
    /// while the parent runs, a fork finds the prompt's full blocks in the prefix cache — the
    /// parent registered them, and holds them — so it computes only the last, partial block and samples its own tokens
    /// (vLLM V1 shares a request's `n` sequences through its prefix cache likewise; without
    /// prefix caching each fork computes the prompt again). Each fork then ends, and
    /// reports, on its own.
    pub fn add_forked(
        &mut self,
        req: Request,
        forks: Vec<RequestId>,
        now: f64,
    ) -> Result<(), AddError> {
        self.add_with(
            req,
            AddOptions {
                forks,
                ..AddOptions::default()
            },
            now,
        )
    }

    /// Queue a request with [`AddOptions`].
    pub fn add_with(&mut self, req: Request, opts: AddOptions, now: f64) -> Result<(), AddError> {
        let AddOptions {
            forks,
            every_prompt_token,
            priority,
        } = opts;
        let n = req.prompt.len();
        if n == 0 {
            return Err(AddError::EmptyPrompt);
        }
        if n + 1 > self.cfg.max_model_len {
            return Err(AddError::PromptTooLong {
                prompt_tokens: n,
                max_model_len: self.cfg.max_model_len,
            });
        }
        let capacity = self.kv.capacity_tokens();
        // (A whole sequence, for whole-sequence admission, is at most max_model_len, which
        // `validate` makes the pool hold.)
        let needed = match self.cfg.kv_cache_backend {
            KvBackend::Paged => n + 1,
            KvBackend::Contiguous => self.cfg.max_model_len,
        };
        if needed > capacity {
            return Err(AddError::ExceedsKvCapacity {
                needed_tokens: needed,
                capacity_tokens: capacity,
            });
        }
        if let Some(max) = self.cfg.max_waiting {
            if self.waiting.len() >= max {
                return Err(AddError::QueueFull { max_waiting: max });
            }
        }
        let mut ids: Vec<RequestId> = std::iter::once(req.id)
            .chain(forks.iter().copied())
            .collect();
        if let Some(&id) = ids
            .iter()
            .find(|id| self.index.contains_key(id) || self.pending_forks.contains(id))
        {
            return Err(AddError::DuplicateId(id));
        }
        ids.sort_unstable_by_key(|id| id.0);
        if let Some(w) = ids.windows(2).find(|w| w[0] == w[1]) {
            return Err(AddError::DuplicateId(w[0]));
        }
        // Room for the whole output up front: appending then never reallocates.
        let mut tokens = req.prompt;
        tokens.reserve_exact(req.stop.max_tokens.min(self.cfg.max_model_len - n));
        let seq = Sequence {
            id: req.id,
            tokens,
            prompt_len: n,
            num_computed: 0,
            stop: req.stop,
            state: SeqState::Waiting,
            kv: self.kv.new_seq(),
            scheduled_in: u64::MAX,
            rank: Rank {
                priority,
                arrival: self.sequences_made,
                seq: self.sequences_made,
            },
            arrival_time: now,
            first_scheduled_time: None,
            first_token_time: None,
            last_token_time: 0.0,
            itl_sum: 0.0,
            itl_max: 0.0,
            cached_tokens: None,
            preemptions: 0,
            forks,
            every_prompt_token,
            prefix_memo: None,
        };
        self.sequences_made += 1;
        self.pending_forks.extend(seq.forks.iter().copied());
        let rank = seq.rank;
        let slot = self.insert(seq, true);
        self.waiting.push_back(slot, rank);
        Ok(())
    }

    /// A live sequence's slot (indexed by its id): a free one if `reuse`, else a new one.
    fn insert(&mut self, seq: Sequence, reuse: bool) -> u32 {
        let id = seq.id;
        let free = if reuse { self.free_slots.pop() } else { None };
        let slot = match free {
            Some(s) => {
                self.seqs[s as usize] = Some(seq);
                s
            }
            None => {
                self.seqs.push(Some(seq));
                (self.seqs.len() - 1) as u32
            }
        };
        self.index.insert(id, slot);
        slot
    }

    /// Fork `ids` from sequence `slot`, whose prompt is computed and first token sampled:
    /// each is a new sequence of the same prompt and stop conditions, in the forks' lane of
    /// the queue (see [`Scheduler::add_forked`]). It holds nothing until then, like any waiting request.
    fn fork(&mut self, slot: u32, ids: Vec<RequestId>, now: f64) {
        for id in ids {
            self.pending_forks.remove(&id);
            let parent = self.seqs[slot as usize].as_ref().expect("live");
            let mut tokens = Vec::with_capacity(parent.tokens.capacity());
            tokens.extend_from_slice(&parent.tokens[..parent.prompt_len]);
            let child = Sequence {
                id,
                tokens,
                prompt_len: parent.prompt_len,
                num_computed: 0,
                stop: parent.stop.clone(),
                state: SeqState::Waiting,
                kv: self.kv.new_seq(),
                scheduled_in: u64::MAX,
                rank: Rank {
                    seq: self.sequences_made,
                    ..parent.rank
                },
                arrival_time: parent.arrival_time,
                first_scheduled_time: Some(now),
                first_token_time: None,
                last_token_time: 0.0,
                itl_sum: 0.0,
                itl_max: 0.0,
                cached_tokens: None,
                preemptions: 0,
                forks: Vec::new(),
                every_prompt_token: false,
                prefix_memo: None,
            };
            // Not a free slot: `complete` frees slots of requests that end in its loop and
            // drops them from `running` only at its end, so one of them may still be listed.
            self.sequences_made += 1;
            let rank = child.rank;
            let child = self.insert(child, false);
            self.waiting.push_fork(child, rank);
        }
    }

    /// Cancel a request (client gone). Its KV is released now.
    pub fn abort(&mut self, id: RequestId) -> Option<RequestStats> {
        self.finish(id, FinishReason::Abort)
    }

    /// End a request from outside (an aborted client, or a stop string the engine matched).
    /// Returns its stats, or `None` if it was not live.
    pub fn finish(&mut self, id: RequestId, reason: FinishReason) -> Option<RequestStats> {
        if self.pending_forks.remove(&id) {
            // A fork not made yet (its parent has no first token): it never will be.
            for seq in self.seqs.iter_mut().flatten() {
                seq.forks.retain(|&f| f != id);
            }
            return None;
        }
        let slot = *self.index.get(&id)?;
        self.waiting.remove(slot);
        if let Some(pos) = self.running.iter().position(|&s| s == slot) {
            self.running.remove(pos);
        }
        let stats = self.release(slot, reason);
        self.ended_outside.push(id);
        Some(stats)
    }

    /// Whether any request is waiting or running.
    pub fn has_unfinished(&self) -> bool {
        !self.index.is_empty()
    }

    pub fn num_unfinished(&self) -> usize {
        self.index.len()
    }

    /// When the last completed step ended (the driver's clock).
    pub fn last_step_end(&self) -> f64 {
        self.last_step_end
    }

    /// Whether the waiting queue has room for `n` more requests: a batch is admitted whole or
    /// not at all, so that a full queue never starts half of it.
    pub fn check_waiting_room(&self, n: usize) -> Result<(), AddError> {
        match self.cfg.max_waiting {
            Some(max) if self.waiting.len() + n > max => {
                Err(AddError::QueueFull { max_waiting: max })
            }
            _ => Ok(()),
        }
    }

    pub fn stats(&self) -> SchedulerStats {
        SchedulerStats {
            num_waiting: self.waiting.len(),
            num_running: self.running.len(),
            kv_usage: self.kv.usage(),
            num_free_blocks: self.kv.num_free_blocks(),
            num_blocks: self.kv.num_blocks(),
            ..self.stats
        }
    }

    /// Plan the next step. The plan must be handed back to [`Scheduler::complete`].
    pub fn schedule(&mut self, now: f64) -> StepPlan {
        self.kv.reclaim_dropped();
        let mut plan = std::mem::take(&mut self.spare);
        self.step += 1;
        plan.reset(self.step, now, self.kv.block_size());
        plan.finished.append(&mut self.ended_outside);
        let chunked = self.cfg.chunked_prefill;
        let mut budget = self.cfg.step_token_budget().unwrap_or(usize::MAX);

        // Free-margin admission looks at the pool as the step begins, before it takes a block
        // (transformers checks its safety margin once per batch).
        let margin = self.cfg.kv_admission == KvAdmission::FreeMargin;
        // (In the pool's own units: a contiguous pool counts slots, not blocks.)
        let under_margin = margin
            && (self.kv.num_free_blocks() as f64)
                < self.cfg.kv_watermark * self.kv.num_blocks() as f64;

        // Context tokens the step may still read from the cache (each sequence's computed
        // tokens).
        let mut reads = self.cfg.max_step_read_tokens.unwrap_or(usize::MAX);

        // 1 and 2: running sequences, decodes before prompt chunks, oldest first.
        let mut order = std::mem::take(&mut self.order);
        order.clear();
        order.extend(
            self.running
                .iter()
                .copied()
                .filter(|&s| self.seq(s).is_decode()),
        );
        order.extend(
            self.running
                .iter()
                .copied()
                .filter(|&s| !self.seq(s).is_decode()),
        );
        // Sequences that sit the step out for want of a block.
        let waiting = loop {
            let mut waiting = 0;
            for &slot in &order {
                if budget == 0 {
                    break;
                }
                let seq = self.seq(slot);
                if seq.state != SeqState::Running {
                    continue; // preempted earlier in this step
                }
                if under_margin && !seq.is_decode() && !plan.is_empty() {
                    break; // prompt work only alone while the pool is under its margin
                }
                let n = (seq.tokens.len() - seq.num_computed).min(budget);
                let read = seq.num_computed;
                if read > reads && !plan.is_empty() {
                    continue; // its context would take the step's reads past the limit
                }
                let (growth, taken_back) = self.grow(slot, n, &mut plan);
                if taken_back > 0 {
                    // Preempted after they were scheduled: the step gives their share back
                    // (the reads left are the limit less what the plan's sequences read).
                    budget += taken_back;
                    reads = self.cfg.max_step_read_tokens.map_or(usize::MAX, |limit| {
                        limit.saturating_sub(plan.seqs.iter().map(|s| s.num_computed).sum())
                    });
                }
                match growth {
                    Growth::Grown => {
                        self.push_to_plan(slot, n, &mut plan);
                        budget -= n;
                        reads = reads.saturating_sub(read);
                    }
                    Growth::Waits => waiting += 1,
                    Growth::Preempted => {}
                }
            }
            // Every running sequence waits for blocks that only a finishing one would free:
            // one gives its blocks up (recompute) and the others try again.
            if waiting > 0 && plan.is_empty() {
                let victim = self.victim().expect("a waiting sequence runs");
                let slot = self.running.remove(victim);
                self.preempt(slot, &mut plan);
                continue;
            }
            break waiting;
        };
        self.stats.num_kv_waits += waiting as u64;
        self.order = order;

        // 3: admit waiting sequences — not in a step that had to preempt or make a sequence
        // wait (memory is short; the admitted would only take the blocks the running need).
        let may_admit = plan.preempted.is_empty()
            && waiting == 0
            && (!under_margin || plan.is_empty())
            && match self.cfg.batching_mode {
                BatchingMode::Continuous => true,
                BatchingMode::Static => self.running.is_empty(),
            };
        let reserve_whole = self.cfg.kv_admission == KvAdmission::WholeSequence
            && self.cfg.kv_cache_backend == KvBackend::Paged;
        // (Free-margin admission reads `kv_watermark` as its margin, checked above.)
        let watermark = if margin {
            0
        } else {
            self.cfg.watermark_blocks()
        };
        // Blocks the running sequences may still take (whole-sequence admission only).
        let mut reserved = if reserve_whole {
            self.running
                .iter()
                .map(|&r| {
                    let seq = self.seq(r);
                    blocks_for(seq.max_kv_len(self.cfg.max_model_len), self.kv.block_size())
                        .saturating_sub(seq.kv.blocks.len())
                })
                .sum()
        } else {
            0
        };
        // A static batch is admitted whole (up to the batch size, as memory allows), its
        // prompts then prefilled over the steps the token budget takes: with chunked prefill
        // one 512-token chunk would otherwise bound the batch to a prompt or two.
        let fill_batch = self.cfg.batching_mode == BatchingMode::Static;
        let no_prefix = PrefixMatch::default();
        while may_admit
            && (budget > 0 || (fill_batch && chunked))
            && self.running.len() < self.cfg.max_batch_size
        {
            let Some(slot) = self.waiting.front() else {
                break;
            };
            let bs = self.kv.block_size();
            let seq = self.seqs[slot as usize].as_mut().expect("live");
            let max_kv_len = seq.max_kv_len(self.cfg.max_model_len);
            // A prompt scored for its logprobs is computed whole until its first token
            // (which carries them); re-admitted after it, it may take its cached blocks.
            let scored = seq.every_prompt_token && seq.output_len() == 0;
            let prefix = if self.cfg.prefix_caching && !scored {
                PrefixMemo::refresh(&mut seq.prefix_memo, &*self.kv, &seq.tokens)
            } else {
                &no_prefix
            };
            let hit = prefix.tokens;
            let rest = seq.tokens.len() - hit;
            if !chunked && rest > budget {
                break; // prefilled whole or not at all; nobody overtakes the head
            }
            let n = rest.min(budget);
            // Tokens whose blocks it takes now: a static batch's prompts all fit at once,
            // whatever this step computes of them.
            let takes = if fill_batch { hit + rest } else { hit + n };
            // (A static batch's member with no work this step reads nothing in it.)
            if n > 0 && hit > reads && !plan.is_empty() {
                self.waiting.pass_over(); // its context would take the reads past the limit
                continue;
            }
            // The watermark keeps headroom for running decodes: with none running there is
            // nothing to keep it for (and a prompt larger than the pool less the watermark
            // would otherwise never be admitted).
            let headroom = if self.running.is_empty() {
                0
            } else {
                watermark
            };
            if reserve_whole || headroom > 0 {
                // The new blocks of its whole sequence (whole-sequence admission) or of its
                // whole prompt (the watermark, as vLLM V0 checks it, though a chunked prompt
                // of a continuous batch takes its first chunk's now), beside what the running
                // still have coming and the watermark's headroom; cached prefix blocks nobody
                // holds sit in the free count and leave it too.
                let needed = if reserve_whole {
                    blocks_for(max_kv_len, bs) - hit / bs
                } else {
                    blocks_for(seq.tokens.len(), bs) - hit / bs
                };
                let revived = prefix
                    .blocks
                    .iter()
                    .filter(|&&b| self.kv.refs(b) == 0)
                    .count();
                if self.kv.num_free_blocks() < reserved + needed + revived + headroom {
                    break; // first come, first served: nobody overtakes the head
                }
                if reserve_whole {
                    // All but what it takes now stays reserved.
                    reserved += needed - blocks_for(takes, bs).saturating_sub(hit / bs);
                }
            }
            if !self.kv.allocate(&mut seq.kv, prefix, takes) {
                if margin {
                    self.waiting.pass_over(); // the next may fit
                    continue;
                }
                break; // first come, first served: nobody overtakes the head
            }
            // A first admission's lookup, as vLLM counts them: not a preempted sequence's
            // again, nor one that computes every prompt token (prompt logprobs: no lookup).
            if self.cfg.prefix_caching && seq.preemptions == 0 && !seq.every_prompt_token {
                self.stats.prefix_queries += seq.tokens.len() as u64;
                self.stats.prefix_hits += hit as u64;
            }
            seq.num_computed = hit;
            seq.cached_tokens.get_or_insert(hit);
            seq.first_scheduled_time.get_or_insert(now);
            seq.state = SeqState::Running;
            seq.prefix_memo = None; // its blocks are its own now
            self.waiting.pop_front();
            self.running.push(slot);
            // (A static batch's member may have no work this step: nothing to plan or read.)
            if n > 0 {
                self.push_to_plan(slot, n, &mut plan);
                budget -= n;
                reads = reads.saturating_sub(hit);
            }
            if under_margin {
                break; // the step's only work
            }
        }
        self.waiting.restore_passed();
        plan
    }

    /// Apply a step's results: one sampled token per sampling sequence of `plan`, in plan
    /// order. Returns the requests' events, which happen at `now` (the end of the step).
    pub fn complete(&mut self, plan: StepPlan, sampled: &[u32], now: f64) -> Vec<Event> {
        self.last_step_end = now;
        assert_eq!(
            sampled.len(),
            plan.num_sampling(),
            "complete() needs one sampled token per sampling sequence"
        );
        let mut events = Vec::with_capacity(sampled.len());
        let mut sampled = sampled.iter();
        let mut any_finished = false;
        for s in &plan.seqs {
            let token = if s.samples {
                sampled.next().copied()
            } else {
                None
            };
            // A request ended between schedule and complete (abort) is skipped.
            let Some(seq) = self.seqs[s.slot as usize].as_mut() else {
                continue;
            };
            if seq.id != s.request || seq.state != SeqState::Running {
                continue;
            }
            seq.num_computed = s.num_computed + s.num_new_tokens;
            self.kv.commit(&mut seq.kv, &seq.tokens, seq.num_computed);
            let Some(token) = token else { continue };
            seq.tokens.push(token);
            let first = seq.output_len() == 1;
            if first && !seq.forks.is_empty() {
                // Before this token can end it: the forks find its prompt blocks in the
                // prefix cache while it still holds them.
                let forks = std::mem::take(&mut seq.forks);
                self.fork(s.slot, forks, now);
            }
            let seq = self.seqs[s.slot as usize].as_mut().expect("live");
            let prev_token_time = if first {
                seq.first_token_time = Some(now);
                None
            } else {
                let gap = now - seq.last_token_time;
                seq.itl_sum += gap;
                seq.itl_max = seq.itl_max.max(gap);
                Some(seq.last_token_time)
            };
            seq.last_token_time = now;
            events.push(Event::Token {
                request: seq.id,
                token,
                prev_token_time,
            });
            if let Some(reason) = stop_reason(seq, token, self.cfg.max_model_len) {
                let stats = self.release(s.slot, reason);
                events.push(Event::Finished {
                    request: s.request,
                    reason,
                    stats,
                });
                any_finished = true;
            }
        }
        if any_finished {
            let seqs = &self.seqs;
            self.running.retain(|&slot| seqs[slot as usize].is_some());
        }
        self.spare = plan;
        events
    }

    /// Hand back a step that could not run (the model failed): every request in it ends
    /// with `Abort` and its KV is freed now; requests outside the step are untouched and
    /// the next `schedule` goes on with them. Returns the requests it ended.
    pub fn fail(&mut self, plan: StepPlan, now: f64) -> Vec<(RequestId, RequestStats)> {
        self.last_step_end = now;
        let mut ended = Vec::with_capacity(plan.seqs.len());
        for s in &plan.seqs {
            // Skipped like in `complete`: a request that ended between schedule and here.
            let live = self.seqs[s.slot as usize]
                .as_ref()
                .is_some_and(|q| q.id == s.request && q.state == SeqState::Running);
            if !live {
                continue;
            }
            if let Some(pos) = self.running.iter().position(|&r| r == s.slot) {
                self.running.remove(pos);
            }
            ended.push((s.request, self.release(s.slot, FinishReason::Abort)));
        }
        self.spare = plan;
        ended
    }

    fn seq(&self, slot: u32) -> &Sequence {
        self.seqs[slot as usize].as_ref().expect("live sequence")
    }

    /// Make room for `n` more tokens of running sequence `slot`: with
    /// [`KvPreemption::Recompute`], preempting running sequences ([`Scheduler::victim`]) as
    /// needed (`slot` itself, perhaps); with [`KvPreemption::Wait`], `slot` waits. Also
    /// returns the tokens it took back from the plan: those of victims scheduled earlier in
    /// the step (as priority scheduling's may be).
    fn grow(&mut self, slot: u32, n: usize, plan: &mut StepPlan) -> (Growth, usize) {
        let mut taken_back = 0;
        loop {
            let seq = self.seqs[slot as usize].as_mut().expect("live");
            let want = seq.num_computed + n;
            if self.kv.allocate(&mut seq.kv, &PrefixMatch::default(), want) {
                return (Growth::Grown, taken_back);
            }
            if self.cfg.kv_preemption == KvPreemption::Wait {
                return (Growth::Waits, taken_back);
            }
            let victim = self.victim().expect("the sequence itself is a candidate");
            let victim_slot = self.running.remove(victim);
            if let Some(back) = plan.remove(victim_slot) {
                taken_back += back.num_new_tokens;
            }
            self.preempt(victim_slot, plan);
            if victim_slot == slot {
                return (Growth::Preempted, taken_back);
            }
        }
    }

    /// The index in `running` of the sequence to preempt, as [`KvVictim`] says: first come,
    /// first served, among those not yet scheduled in this step; priority scheduling, among
    /// every running sequence of the lowest priority, as vLLM, though it was scheduled
    /// earlier in the step ([`Scheduler::grow`] takes it back from the plan).
    fn victim(&self) -> Option<usize> {
        let step = self.step;
        let ranked = self.cfg.scheduling_policy == SchedulingPolicy::Priority;
        let running = self.running.iter().enumerate();
        let lowest = if ranked {
            running
                .clone()
                .map(|(_, &s)| self.seq(s).rank.priority)
                .max()
        } else {
            None
        };
        let candidates = running.filter(|&(_, &s)| {
            let q = self.seq(s);
            match lowest {
                Some(p) => q.rank.priority == p,
                None => q.scheduled_in != step,
            }
        });
        match self.cfg.kv_victim {
            // vLLM's newest: the last admitted, or under priority the latest arrival.
            KvVictim::Newest if ranked => candidates
                .max_by_key(|&(_, &s)| self.seq(s).rank)
                .map(|(i, _)| i),
            KvVictim::Newest => candidates.map(|(i, _)| i).next_back(),
            // A decoding sequence before one part-way through its prompt (SGLang retracts
            // decodes), then fewest outputs, longest prompt, newest.
            KvVictim::FewestOutputs => candidates
                .min_by_key(|&(i, &s)| {
                    let q = self.seq(s);
                    (
                        q.num_computed < q.prompt_len,
                        q.output_len(),
                        std::cmp::Reverse(q.prompt_len),
                        std::cmp::Reverse(i),
                    )
                })
                .map(|(i, _)| i),
        }
    }

    fn preempt(&mut self, slot: u32, plan: &mut StepPlan) {
        let seq = self.seqs[slot as usize].as_mut().expect("live");
        self.kv.free(&mut seq.kv);
        seq.num_computed = 0;
        seq.state = SeqState::Preempted;
        seq.preemptions += 1;
        self.stats.num_preemptions += 1;
        plan.preempted.push(seq.id);
        self.waiting.push_front(slot, seq.rank);
    }

    fn push_to_plan(&mut self, slot: u32, n: usize, plan: &mut StepPlan) {
        let step = self.step;
        let seq = self.seqs[slot as usize].as_mut().expect("live");
        seq.scheduled_in = step;
        let start = seq.num_computed;
        let samples = start + n == seq.tokens.len();
        let blocks: &[BlockId] = if self.plan_block_tables {
            &seq.kv.blocks
        } else {
            &[]
        };
        plan.push(
            seq.id,
            slot,
            start,
            &seq.tokens[start..start + n],
            samples,
            seq.is_decode(),
            seq.cached_tokens.unwrap_or(0),
            seq.kv.blocks.first().copied().unwrap_or(BlockId::MAX),
            blocks,
        );
    }

    /// Drop a sequence that ended (it is already out of the waiting and running queues,
    /// or about to be removed from running by the caller).
    fn release(&mut self, slot: u32, reason: FinishReason) -> RequestStats {
        let mut seq = self.seqs[slot as usize].take().expect("live");
        for &id in &seq.forks {
            // Ended before its first token: its forks will not be made, and the driver
            // hears that they ended (the next plan's `finished`).
            self.pending_forks.remove(&id);
            self.ended_outside.push(id);
        }
        self.kv.free(&mut seq.kv);
        seq.state = SeqState::Finished(reason);
        self.index.remove(&seq.id);
        self.free_slots.push(slot);
        self.stats.num_finished += 1;
        seq.stats()
    }

    /// Check the invariants of `docs/design.md` that are visible from here: INV-1 (a live
    /// request is waiting or running), INV-2, INV-3, INV-4, the batch limit of INV-5 and
    /// INV-7, and through the KV manager's own check INV-3 and INV-8. Tests and debug builds
    /// of both drivers call it every step; a broken one's message starts `INV-n:`.
    pub fn check_invariants(&self) -> Result<(), BrokenInvariant> {
        let kv = self.kv.as_ref();
        kv.check()?;
        // Every block's references are exactly the tables that hold it: a block one
        // sequence holds alone has one owner, a shared prefix block one per sharer.
        let mut owners = vec![0usize; kv.num_blocks()];
        for s in self.seqs.iter().flatten() {
            for &b in &s.kv.blocks {
                owners[b as usize] += 1;
            }
        }
        for (b, &n) in owners.iter().enumerate() {
            if kv.refs(b as BlockId) != n {
                return Err(BrokenInvariant::new(
                    2,
                    format!(
                        "block {b}: {} references but {n} tables hold it",
                        kv.refs(b as BlockId)
                    ),
                ));
            }
        }
        // free + used = total, each counted on its own side.
        let used = owners.iter().filter(|&&n| n > 0).count();
        if used + kv.num_free_blocks() != kv.num_blocks() {
            return Err(BrokenInvariant::new(
                3,
                format!(
                    "{used} used + {} free != {} blocks",
                    kv.num_free_blocks(),
                    kv.num_blocks()
                ),
            ));
        }
        if self.running.len() > self.cfg.max_batch_size {
            return Err(BrokenInvariant::new(
                5,
                format!(
                    "{} running > max_batch_size {}",
                    self.running.len(),
                    self.cfg.max_batch_size
                ),
            ));
        }
        if self.index.is_empty() && kv.num_free_blocks() != kv.num_blocks() {
            return Err(BrokenInvariant::new(
                4,
                format!(
                    "idle but {} of {} blocks are held",
                    kv.num_blocks() - kv.num_free_blocks(),
                    kv.num_blocks()
                ),
            ));
        }
        if self.index.is_empty() && kv.total_refs() != 0 {
            return Err(BrokenInvariant::new(4, "idle but references remain"));
        }
        if self.waiting.len() + self.running.len() != self.index.len() {
            return Err(BrokenInvariant::new(
                1,
                "a live request is neither waiting nor running",
            ));
        }
        for s in self.waiting.iter() {
            if !self.seq(s).kv.blocks.is_empty() {
                return Err(BrokenInvariant::new(
                    7,
                    format!("waiting request {} holds blocks", self.seq(s).id),
                ));
            }
        }
        Ok(())
    }
}

/// What [`Scheduler::grow`] did for a running sequence.
enum Growth {
    /// Its blocks are there: it steps.
    Grown,
    /// No block was free and it waits, holding its blocks ([`KvPreemption::Wait`]).
    Waits,
    /// It was preempted itself to make room for older ones ([`KvPreemption::Recompute`]).
    Preempted,
}

/// Whether `seq`, which has just sampled `token`, is done.
fn stop_reason(seq: &Sequence, token: u32, max_model_len: usize) -> Option<FinishReason> {
    let stop = &seq.stop;
    if stop.stop_token_ids.contains(&token)
        || (!stop.ignore_eos && stop.eos_token_ids.contains(&token))
    {
        return Some(FinishReason::Stop);
    }
    if seq.output_len() >= stop.max_tokens || seq.tokens.len() >= max_model_len {
        return Some(FinishReason::Length);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> SchedulerConfig {
        SchedulerConfig {
            num_gpu_blocks: 64,
            max_model_len: 512,
            ..SchedulerConfig::default()
        }
    }

    /// A broken invariant's message starts with its number in `docs/design.md`: a batch
    /// limit lowered under two running sequences breaks INV-5, a block dropped from a
    /// running sequence's table without releasing its reference breaks INV-2.
    #[test]
    fn a_broken_invariant_names_its_number() {
        let mut s = Scheduler::new(cfg());
        s.add_request(Request::new(1, (0..40).collect(), 4), 0.0)
            .unwrap();
        s.add_request(Request::new(2, (100..140).collect(), 4), 0.0)
            .unwrap();
        let plan = s.schedule(0.0);
        assert_eq!(plan.seqs.len(), 2);
        let sampled = vec![7; plan.num_sampling()];
        s.complete(plan, &sampled, 0.01);
        s.check_invariants().unwrap();

        s.cfg.max_batch_size = 1;
        let e = s.check_invariants().unwrap_err();
        assert!(e.to_string().starts_with("INV-5: "), "{e}");
        assert!(e.0.contains("2 running > max_batch_size 1"), "{e}");
        s.cfg.max_batch_size = cfg().max_batch_size;
        s.check_invariants().unwrap();

        let seq = s.seqs.iter_mut().flatten().next().unwrap();
        let block = seq.kv.blocks.pop().unwrap();
        let e = s.check_invariants().unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("INV-2: block {block}: 1 references but 0 tables hold it")
        );
    }

    /// OpenAI's `n = 3`: the prompt (40 tokens, blocks of 16) is computed once; at its
    /// first token two forks wait in the queue. With prefix caching they find
    /// the prompt's two full blocks (the parent's own) and compute only the last 8 prompt
    /// tokens into blocks of their own; without, they compute the prompt again. Each samples
    /// its own tokens to its own end, the invariants checked each step.
    #[test]
    fn forks_share_the_prompts_full_blocks_and_finish_on_their_own() {
        for prefix_caching in [false, true] {
            let mut s = Scheduler::new(SchedulerConfig {
                prefix_caching,
                ..cfg()
            });
            let prompt: Vec<u32> = (100..140).collect();
            s.add_forked(
                Request::new(1, prompt.clone(), 4),
                vec![RequestId(2), RequestId(3)],
                0.0,
            )
            .unwrap();
            assert_eq!(
                s.add_request(Request::new(3, vec![1; 8], 4), 0.0),
                Err(AddError::DuplicateId(RequestId(3))),
                "fork ids are taken"
            );
            let mut outputs: std::collections::HashMap<u64, Vec<u32>> = Default::default();
            let mut parent_blocks = Vec::new();
            let mut step = 0u32;
            while s.has_unfinished() {
                step += 1;
                assert!(step < 20, "livelock");
                let plan = s.schedule(step as f64);
                for (i, q) in plan.seqs.iter().enumerate() {
                    match q.request.0 {
                        1 if i == 0 && step == 1 => {
                            assert_eq!(q.num_new_tokens, 40, "the prompt, once");
                            parent_blocks = plan.block_table(i)[..2].to_vec();
                        }
                        2 | 3 if !outputs.contains_key(&q.request.0) => {
                            if prefix_caching {
                                assert_eq!((q.num_computed, q.num_new_tokens), (32, 8));
                                assert_eq!(plan.block_table(i)[..2], parent_blocks[..]);
                                assert_ne!(plan.block_table(i)[2], plan.block_table(0)[2]);
                            } else {
                                assert_eq!((q.num_computed, q.num_new_tokens), (0, 40));
                            }
                        }
                        _ => {}
                    }
                }
                let sampled: Vec<u32> = (0..plan.num_sampling() as u32)
                    .map(|k| 7 + step * 10 + k)
                    .collect();
                for e in s.complete(plan, &sampled, step as f64 + 0.5) {
                    if let Event::Token { request, token, .. } = e {
                        outputs.entry(request.0).or_default().push(token);
                    }
                }
                s.check_invariants().unwrap();
            }
            assert_eq!(outputs.len(), 3, "prefix caching {prefix_caching}");
            assert!(outputs.values().all(|o| o.len() == 4));
            assert_ne!(outputs[&1], outputs[&2], "each fork samples its own tokens");
            assert_eq!(s.stats().num_free_blocks, 64);
        }
    }

    /// A decode that finds no free block: A (28-token prompt, 4 tokens out) never needs
    /// more than its 8 blocks; B (30 tokens) needs a 9th in step 4, its third decode, with
    /// none free. `Recompute` preempts B, which later prefills its prompt and output again;
    /// `Wait` leaves B holding its 8 blocks while A steps and finishes, then B decodes on
    /// from where it was.
    #[test]
    fn a_decode_without_a_free_block_is_preempted_or_waits_as_configured() {
        for policy in [KvPreemption::Recompute, KvPreemption::Wait] {
            let mut s = Scheduler::new(SchedulerConfig {
                num_gpu_blocks: 16,
                block_size: 4,
                max_model_len: 64,
                prefix_caching: false,
                kv_preemption: policy,
                ..cfg()
            });
            s.add_request(Request::new(1, vec![3; 28], 4), 0.0).unwrap();
            s.add_request(Request::new(2, vec![4; 30], 8), 0.0).unwrap();
            let mut b_recomputed = false;
            let mut b_preemptions = None;
            for step in 1..30 {
                if !s.has_unfinished() {
                    break;
                }
                let plan = s.schedule(step as f64);
                let ids: Vec<u64> = plan.seqs.iter().map(|q| q.request.0).collect();
                if step == 4 {
                    assert_eq!(ids, vec![1], "{policy:?}: B cannot grow");
                    match policy {
                        KvPreemption::Recompute => {
                            assert_eq!(plan.preempted, vec![RequestId(2)]);
                            assert_eq!(s.stats().num_free_blocks, 8, "B's blocks are freed");
                        }
                        KvPreemption::Wait => {
                            assert!(plan.preempted.is_empty());
                            assert_eq!(s.stats().num_free_blocks, 0, "B keeps its blocks");
                            assert_eq!(s.stats().num_kv_waits, 1);
                        }
                    }
                }
                if let Some(i) = ids.iter().position(|&id| id == 2) {
                    b_recomputed |= step > 1 && plan.seqs[i].num_computed == 0;
                }
                let sampled = vec![9; plan.num_sampling()];
                for e in s.complete(plan, &sampled, step as f64 + 0.5) {
                    if let Event::Finished { request, stats, .. } = e {
                        if request == RequestId(2) {
                            assert_eq!(stats.output_tokens, 8);
                            b_preemptions = Some(stats.preemptions);
                        }
                    }
                }
                s.check_invariants().unwrap();
            }
            let recompute = policy == KvPreemption::Recompute;
            assert_eq!(b_preemptions, Some(recompute as u32), "{policy:?}");
            assert_eq!(b_recomputed, recompute, "{policy:?}");
            assert_eq!(s.stats().num_free_blocks, 16);
        }
    }

    /// `Wait` with every running sequence waiting (both 32-token prompts fill the 16-block
    /// pool, and both need a 9th block for their first decode): no step could ever run, so
    /// the newest is preempted and the oldest steps in the same plan — neither sat the step
    /// out, so no wait is counted.
    /// A prompt scored for its logprobs skips the prefix cache until its first token, which
    /// carries them; preempted after it, it is re-admitted from its own cached blocks.
    #[test]
    fn a_scored_prompt_preempted_after_its_first_token_takes_its_cached_blocks() {
        let mut s = Scheduler::new(SchedulerConfig {
            num_gpu_blocks: 16,
            block_size: 4,
            max_model_len: 64,
            ..cfg()
        });
        s.add_request(Request::new(1, vec![3; 32], 4), 0.0).unwrap();
        let scored = AddOptions {
            every_prompt_token: true,
            ..AddOptions::default()
        };
        s.add_with(Request::new(2, (100..132).collect(), 4), scored, 0.0)
            .unwrap();
        let (mut preempted, mut readmitted_at) = (false, None);
        for step in 0..20 {
            let plan = s.schedule(step as f64);
            preempted |= plan.preempted.contains(&RequestId(2));
            if let Some(q) = plan.seqs.iter().find(|q| q.request == RequestId(2)) {
                if preempted && readmitted_at.is_none() {
                    readmitted_at = Some(q.num_computed);
                }
            }
            let tokens = vec![9; plan.num_sampling()];
            s.complete(plan, &tokens, step as f64 + 0.5);
            s.check_invariants().unwrap();
        }
        assert!(preempted, "the pool forces a preemption");
        let hit = readmitted_at.expect("re-admitted");
        assert!(
            hit >= 16,
            "re-admitted from its cached blocks: {hit} tokens"
        );
    }

    #[test]
    fn when_every_sequence_waits_the_newest_is_preempted() {
        let mut s = Scheduler::new(SchedulerConfig {
            num_gpu_blocks: 16,
            block_size: 4,
            max_model_len: 64,
            prefix_caching: false,
            kv_preemption: KvPreemption::Wait,
            ..cfg()
        });
        s.add_request(Request::new(1, vec![3; 32], 4), 0.0).unwrap();
        s.add_request(Request::new(2, vec![4; 32], 4), 0.0).unwrap();
        let plan = s.schedule(0.0);
        assert_eq!(plan.seqs.len(), 2);
        s.complete(plan, &[9, 9], 0.5);
        let plan = s.schedule(1.0);
        assert_eq!(plan.preempted, vec![RequestId(2)]);
        let ids: Vec<u64> = plan.seqs.iter().map(|q| q.request.0).collect();
        assert_eq!(ids, vec![1]);
        assert_eq!(s.stats().num_kv_waits, 0);
        s.check_invariants().unwrap();
    }

    /// `Wait` admits nothing in a step where a sequence waits: B's prompt (40 tokens,
    /// chunks of 16, blocks of 4) is in; A's second chunk needs 4 more blocks with 3 free,
    /// so A waits — and C, which one block would hold, stays in the queue rather than take
    /// a block A needs.
    #[test]
    fn nothing_is_admitted_while_a_sequence_waits_for_blocks() {
        let mut s = Scheduler::new(SchedulerConfig {
            num_gpu_blocks: 16,
            block_size: 4,
            max_model_len: 64,
            chunked_prefill: true,
            prefill_chunk_size: 16,
            max_batch_size: 4,
            prefix_caching: false,
            kv_preemption: KvPreemption::Wait,
            ..cfg()
        });
        s.add_request(Request::new(1, vec![3; 40], 20), 0.0)
            .unwrap();
        s.add_request(Request::new(2, vec![4; 40], 20), 0.0)
            .unwrap();
        s.add_request(Request::new(3, vec![5; 4], 1), 0.0).unwrap();
        for step in 1..=3 {
            let plan = s.schedule(step as f64);
            let sampled = vec![9; plan.num_sampling()];
            s.complete(plan, &sampled, step as f64 + 0.5);
        }
        let plan = s.schedule(4.0);
        let ids: Vec<u64> = plan.seqs.iter().map(|q| q.request.0).collect();
        assert_eq!(ids, vec![1], "A waits and C is not admitted");
        assert_eq!(s.stats().num_free_blocks, 3);
        assert_eq!((s.stats().num_kv_waits, s.stats().num_waiting), (1, 1));
        s.check_invariants().unwrap();
    }

    /// The victim: A (32-token prompt, 8 blocks) and B (28, 7) fill a pool of 15 blocks in
    /// step 1. In step 2 A's first decode needs a ninth block: `Newest` preempts B; with
    /// `FewestOutputs` both have one output token and A, the longer prompt, gives its own
    /// blocks up while B decodes.
    #[test]
    fn the_victim_is_the_newest_or_the_least_decoded_as_configured() {
        for (victim, runs, preempted) in [(KvVictim::Newest, 1, 2), (KvVictim::FewestOutputs, 2, 1)]
        {
            let mut s = Scheduler::new(SchedulerConfig {
                num_gpu_blocks: 15,
                block_size: 4,
                max_model_len: 60,
                prefix_caching: false,
                kv_victim: victim,
                ..cfg()
            });
            s.add_request(Request::new(1, vec![3; 32], 8), 0.0).unwrap();
            s.add_request(Request::new(2, vec![4; 28], 8), 0.0).unwrap();
            let plan = s.schedule(1.0);
            assert_eq!(plan.seqs.len(), 2);
            assert_eq!(s.stats().num_free_blocks, 0);
            s.complete(plan, &[9, 9], 1.5);
            let plan = s.schedule(2.0);
            let ids: Vec<u64> = plan.seqs.iter().map(|q| q.request.0).collect();
            assert_eq!(ids, vec![runs], "{victim:?}");
            assert_eq!(plan.preempted, vec![RequestId(preempted)], "{victim:?}");
            s.check_invariants().unwrap();
        }
    }

    fn with_priority(priority: i64) -> AddOptions {
        AddOptions {
            priority,
            ..AddOptions::default()
        }
    }

    /// Under priority scheduling the waiting are admitted by priority, the lowest value
    /// first, then by arrival; first come, first served ignores priorities.
    #[test]
    fn priority_scheduling_admits_the_lowest_value_first() {
        for (policy, order) in [
            (SchedulingPolicy::Fcfs, [1, 2, 3, 4]),
            (SchedulingPolicy::Priority, [4, 2, 1, 3]),
        ] {
            let mut s = Scheduler::new(SchedulerConfig {
                max_batch_size: 1,
                scheduling_policy: policy,
                ..cfg()
            });
            for (id, priority) in [(1, 5), (2, 0), (3, 5), (4, -1)] {
                s.add_with(
                    Request::new(id, vec![3; 8], 2),
                    with_priority(priority),
                    0.0,
                )
                .unwrap();
            }
            let mut admitted = Vec::new();
            let mut t = 1.0;
            while s.has_unfinished() {
                for id in step_ids(&mut s, t) {
                    if admitted.last() != Some(&id) {
                        admitted.push(id);
                    }
                }
                t += 1.0;
            }
            assert_eq!(admitted, order, "{policy:?}");
        }
    }

    /// When the pool runs dry, priority scheduling preempts the running sequence of the
    /// highest value, though it was admitted first and already scheduled in the step (first
    /// come, first served preempts the newest not yet scheduled); preempted, it waits behind
    /// a later request of a lower value.
    #[test]
    fn priority_scheduling_preempts_the_highest_value_which_then_waits_its_turn() {
        for (policy, runs, preempted) in [
            (SchedulingPolicy::Fcfs, 1, 2),
            (SchedulingPolicy::Priority, 2, 1),
        ] {
            let mut s = Scheduler::new(SchedulerConfig {
                num_gpu_blocks: 15,
                block_size: 4,
                max_model_len: 60,
                prefix_caching: false,
                scheduling_policy: policy,
                ..cfg()
            });
            // A's 32 tokens and its first output fill 9 blocks, B's 24 the other 6; in the
            // third step A's next token fits its 9th block, and B needs a 7th.
            s.add_with(Request::new(1, vec![3; 32], 8), with_priority(1), 0.0)
                .unwrap();
            assert_eq!(step_ids(&mut s, 1.0), [1]);
            s.add_with(Request::new(2, vec![4; 24], 8), with_priority(0), 1.0)
                .unwrap();
            assert_eq!(step_ids(&mut s, 2.0), [1, 2]);
            assert_eq!(s.stats().num_free_blocks, 0);
            // Both decode, A first (admitted first): under priority scheduling A is taken
            // back out of the step when B finds no block.
            let plan = s.schedule(3.0);
            let ids: Vec<u64> = plan.seqs.iter().map(|q| q.request.0).collect();
            assert_eq!(ids, [runs], "{policy:?}");
            assert_eq!(plan.preempted, [RequestId(preempted)], "{policy:?}");
            assert_eq!(plan.num_tokens(), 1, "one decode's token");
            assert_eq!(plan.tokens(0), [9], "{policy:?}");
            let holder = s.seq(s.running[0]);
            assert_eq!(plan.block_table(0), &holder.kv.blocks[..], "{policy:?}");
            s.complete(plan, &[9], 3.5);
            // A later request: first come, first served readmits the preempted first (it
            // does not fit, and nobody overtakes it); priority admits the later one of
            // value 0 before the preempted of value 1.
            s.add_with(Request::new(5, vec![5; 4], 8), with_priority(0), 4.0)
                .unwrap();
            let expected: &[u64] = match policy {
                SchedulingPolicy::Fcfs => &[1],
                SchedulingPolicy::Priority => &[2, 5],
            };
            assert_eq!(step_ids(&mut s, 4.0), expected, "{policy:?}");
            run_to_end(&mut s, 5.0);
        }
    }

    /// Among running sequences of one priority, priority scheduling's newest victim is the
    /// latest arrival, not the last admitted (an older sequence readmitted after a
    /// preemption), and it may have been scheduled already; first come, first served takes
    /// the last admitted not yet scheduled.
    #[test]
    fn the_priority_victim_is_the_latest_arrival_of_the_lowest_priority() {
        for policy in [SchedulingPolicy::Fcfs, SchedulingPolicy::Priority] {
            let mut s = Scheduler::new(SchedulerConfig {
                scheduling_policy: policy,
                ..cfg()
            });
            for (id, priority) in [(1, 1), (2, 1), (3, 0)] {
                s.add_with(
                    Request::new(id, vec![3; 8], 8),
                    with_priority(priority),
                    0.0,
                )
                .unwrap();
            }
            step_ids(&mut s, 1.0);
            // As if 1 had been preempted and readmitted after 2 and 3.
            let first = s.running.iter().position(|&r| s.seq(r).id.0 == 1).unwrap();
            let slot = s.running.remove(first);
            s.running.push(slot);
            let ids = |s: &Scheduler| s.running.iter().map(|&r| s.seq(r).id.0).collect::<Vec<_>>();
            let admitted = ids(&s);
            s.step += 1; // the next step: nobody is scheduled in it yet
            let victim = |s: &Scheduler| admitted[s.victim().unwrap()];
            match policy {
                SchedulingPolicy::Fcfs => assert_eq!(victim(&s), 1, "{admitted:?}"),
                SchedulingPolicy::Priority => assert_eq!(victim(&s), 2, "{admitted:?}"),
            }
            // Scheduled in this step, it is still priority scheduling's victim.
            for &r in &s.running.clone() {
                s.seqs[r as usize].as_mut().unwrap().scheduled_in = s.step;
            }
            match policy {
                SchedulingPolicy::Fcfs => assert_eq!(s.victim(), None),
                SchedulingPolicy::Priority => assert_eq!(victim(&s), 2),
            }
        }
    }

    /// `FewestOutputs` prefers a decoding sequence to one part-way through its prompt, and
    /// fewer outputs to a longer prompt: A (8-token prompt) decodes first, B (4 tokens)
    /// joins later with fewer outputs, and C (40 tokens, 8-token chunks) is still
    /// prefilling. At the start of the next step, `Newest` would take C, `FewestOutputs` B.
    #[test]
    fn the_least_decoded_victim_is_a_decoding_sequence_with_the_fewest_outputs() {
        let mut s = Scheduler::new(SchedulerConfig {
            block_size: 4,
            max_model_len: 128,
            chunked_prefill: true,
            prefill_chunk_size: 8,
            max_batch_size: 4,
            prefix_caching: false,
            ..cfg()
        });
        let mut step = 0;
        let mut run = |s: &mut Scheduler, n: usize| {
            for _ in 0..n {
                step += 1;
                let plan = s.schedule(step as f64);
                let sampled = vec![9; plan.num_sampling()];
                s.complete(plan, &sampled, step as f64 + 0.5);
            }
        };
        s.add_request(Request::new(1, vec![3; 8], 30), 0.0).unwrap();
        run(&mut s, 3);
        s.add_request(Request::new(2, vec![4; 4], 30), 0.0).unwrap();
        run(&mut s, 2);
        s.add_request(Request::new(3, vec![5; 40], 30), 0.0)
            .unwrap();
        run(&mut s, 1);
        let [a, b, c] = [0, 1, 2].map(|i| s.seq(s.running[i]));
        assert!(
            a.output_len() > b.output_len() && b.output_len() > 0,
            "A and B decode"
        );
        assert!(a.prompt_len > b.prompt_len);
        assert!(
            c.num_computed > 0 && c.num_computed < c.prompt_len,
            "C is mid-prompt"
        );
        s.step += 1; // the next step: nobody is scheduled in it yet
        assert_eq!(s.victim(), Some(2), "newest: C");
        s.cfg.kv_victim = KvVictim::FewestOutputs;
        assert_eq!(s.victim(), Some(1), "fewest outputs: B");
    }

    /// Runs a step at `t` and returns the requests it scheduled.
    fn step_ids(s: &mut Scheduler, t: f64) -> Vec<u64> {
        let plan = s.schedule(t);
        let ids = plan.seqs.iter().map(|q| q.request.0).collect();
        let sampled = vec![9; plan.num_sampling()];
        s.complete(plan, &sampled, t + 0.5);
        s.check_invariants().unwrap();
        ids
    }

    /// Runs steps from `t` until every request has ended, failing on a livelock.
    fn run_to_end(s: &mut Scheduler, mut t: f64) {
        while s.has_unfinished() {
            assert!(t < 30.0, "livelock");
            step_ids(s, t);
            t += 1.0;
        }
    }

    /// Free-margin admission (transformers'): a pool of 16 blocks of 4 tokens with a margin
    /// of a quarter. A (40 tokens) and B (12) leave 2 blocks free: C (4 tokens, one block)
    /// joins their decodes under prompt admission, not under the margin, and runs once A's
    /// blocks come back. A prompt alone runs under the margin: chunk by chunk, D fills the
    /// pool past it without stalling. A waiting prompt that does not fit lets a smaller one
    /// behind it in (E, 32 tokens, and F, 8, beside A), where prompt admission keeps order.
    #[test]
    fn the_free_margin_keeps_prompts_out_of_a_full_pool_but_lets_smaller_ones_by() {
        let pool = |kv_admission, kv_watermark| {
            Scheduler::new(SchedulerConfig {
                num_gpu_blocks: 16,
                block_size: 4,
                max_model_len: 64,
                prefix_caching: false,
                kv_admission,
                kv_watermark,
                ..cfg()
            })
        };
        for (admission, margin, c_joins) in [
            (KvAdmission::Prompt, 0.0, true),
            (KvAdmission::FreeMargin, 0.25, false),
        ] {
            let mut s = pool(admission, margin);
            s.add_request(Request::new(1, vec![3; 40], 8), 0.0).unwrap();
            assert_eq!(step_ids(&mut s, 1.0), [1]);
            s.add_request(Request::new(2, vec![4; 12], 8), 1.0).unwrap();
            assert_eq!(step_ids(&mut s, 2.0), [1, 2]);
            assert_eq!(s.stats().num_free_blocks, 2);
            s.add_request(Request::new(3, vec![5; 4], 2), 2.0).unwrap();
            let ids = step_ids(&mut s, 3.0);
            assert_eq!(ids.contains(&3), c_joins, "{admission:?}: {ids:?}");
            run_to_end(&mut s, 4.0);
            assert_eq!(s.stats().num_free_blocks, 16);
        }
        // Alone, a chunked prompt goes on under the margin: 60 tokens in chunks of 8.
        let mut s = Scheduler::new(SchedulerConfig {
            max_batch_size: 4,
            prefill_chunk_size: 8,
            ..pool(KvAdmission::FreeMargin, 0.25).config().clone()
        });
        s.add_request(Request::new(4, vec![6; 60], 2), 0.0).unwrap();
        for t in 1..=8 {
            assert_eq!(step_ids(&mut s, t as f64), [4], "chunk {t}");
        }
        assert_eq!(s.stats().num_free_blocks, 1);
        // Passing over: E does not fit beside A (11 blocks), F does.
        for (admission, order) in [
            (KvAdmission::Prompt, vec![1]),
            (KvAdmission::FreeMargin, vec![1, 6]),
        ] {
            let mut s = pool(admission, 0.0);
            s.add_request(Request::new(1, vec![3; 40], 4), 0.0).unwrap();
            assert_eq!(step_ids(&mut s, 1.0), [1]);
            s.add_request(Request::new(5, vec![7; 32], 4), 1.0).unwrap();
            s.add_request(Request::new(6, vec![8; 8], 4), 1.0).unwrap();
            assert_eq!(step_ids(&mut s, 2.0), order, "{admission:?}");
            run_to_end(&mut s, 3.0);
            assert_eq!(s.stats().num_free_blocks, 16);
        }
    }

    /// The free margin is a fraction of the pool in its own units: a contiguous pool of 4
    /// slots (64 blocks of 16 tokens, 256 a slot) with one slot taken is 3/4 free, above a
    /// margin of 0.15, so a second prompt joins the first one's decode (compared with the
    /// block count, 3 free slots were always "under" 0.15 × 64 blocks).
    #[test]
    fn the_free_margin_of_a_contiguous_pool_counts_slots() {
        let mut s = Scheduler::new(SchedulerConfig {
            kv_cache_backend: KvBackend::Contiguous,
            num_gpu_blocks: 64,
            block_size: 16,
            max_model_len: 256,
            prefix_caching: false,
            kv_admission: KvAdmission::FreeMargin,
            kv_watermark: 0.15,
            ..cfg()
        });
        s.add_request(Request::new(1, vec![3; 10], 8), 0.0).unwrap();
        assert_eq!(step_ids(&mut s, 1.0), [1]);
        s.add_request(Request::new(2, vec![4; 10], 8), 1.0).unwrap();
        assert_eq!(step_ids(&mut s, 2.0), [1, 2]);
        run_to_end(&mut s, 3.0);
    }

    /// With chunked prefill, `max_num_batched_tokens` is the step's budget in place of
    /// `prefill_chunk_size` (vLLM's meaning): a 200-token prompt goes in chunks of 64.
    #[test]
    fn max_num_batched_tokens_is_the_chunk_budget_when_chunked() {
        let mut s = Scheduler::new(SchedulerConfig {
            chunked_prefill: true,
            prefill_chunk_size: 512,
            max_num_batched_tokens: Some(64),
            max_batch_size: 4,
            ..cfg()
        });
        s.add_request(Request::new(1, vec![3; 200], 2), 0.0)
            .unwrap();
        let mut chunks = Vec::new();
        for t in 0..4 {
            let plan = s.schedule(t as f64);
            chunks.push(plan.num_tokens());
            let sampled = vec![9; plan.num_sampling()];
            s.complete(plan, &sampled, t as f64 + 0.5);
        }
        assert_eq!(chunks, [64, 64, 64, 8]);
    }

    /// A fork aborted before its parent's first token (so before it exists) is never made.
    #[test]
    fn a_fork_aborted_before_it_is_made_never_runs() {
        let mut s = Scheduler::new(cfg());
        s.add_forked(
            Request::new(1, (100..140).collect(), 3),
            vec![RequestId(2), RequestId(3)],
            0.0,
        )
        .unwrap();
        assert_eq!(s.abort(RequestId(2)), None, "not live yet");
        let mut seen = std::collections::BTreeSet::new();
        let mut t = 1.0;
        while s.has_unfinished() {
            assert!(t < 30.0, "livelock");
            seen.extend(step_ids(&mut s, t));
            s.check_invariants().unwrap();
            t += 1.0;
        }
        assert_eq!(seen.into_iter().collect::<Vec<_>>(), [1, 3]);
        assert_eq!(s.stats().num_free_blocks, 64);
    }

    /// The step's reads (transformers' cache budget), at most 40 tokens of computed
    /// context: A (16 tokens), B (30) and C (8) read nothing as they start together; then
    /// A's decode reads 16 and C's 8 while B's 30 would pass the limit beside A's, so B sits
    /// the step out and decodes when they have ended. A context past the limit runs alone:
    /// D (50 tokens) decodes while E (8), started beside its prompt, waits.
    #[test]
    fn a_step_reads_at_most_its_limit_and_a_longer_context_runs_alone() {
        let mut s = Scheduler::new(SchedulerConfig {
            block_size: 4,
            max_model_len: 128,
            prefix_caching: false,
            max_step_read_tokens: Some(40),
            ..cfg()
        });
        s.add_request(Request::new(1, vec![3; 16], 2), 0.0).unwrap();
        s.add_request(Request::new(2, vec![4; 30], 2), 0.0).unwrap();
        s.add_request(Request::new(3, vec![5; 8], 2), 0.0).unwrap();
        assert_eq!(step_ids(&mut s, 1.0), [1, 2, 3]);
        assert_eq!(step_ids(&mut s, 2.0), [1, 3]);
        assert_eq!(step_ids(&mut s, 3.0), [2]);
        run_to_end(&mut s, 4.0);
        s.add_request(Request::new(4, vec![6; 50], 2), 10.0)
            .unwrap();
        s.add_request(Request::new(5, vec![7; 8], 2), 10.0).unwrap();
        assert_eq!(step_ids(&mut s, 11.0), [4, 5]);
        assert_eq!(step_ids(&mut s, 12.0), [4]);
        assert_eq!(step_ids(&mut s, 13.0), [5]);
        run_to_end(&mut s, 14.0);
        assert_eq!(s.stats().num_free_blocks, 64);
    }

    /// The watermark: a pool of 16 blocks of 4 tokens, a quarter kept free at admission.
    /// A (28 tokens, 7 blocks) enters the empty pool; B (24 tokens, 6 blocks) would fit
    /// beside it (9 free) but leave 3, under the watermark's 4, so it waits for A to finish. Without
    /// the watermark both start at once. A prompt of 14 blocks, more than the pool less
    /// the watermark, still enters an empty pool; a chunked prompt is checked whole.
    #[test]
    fn the_watermark_keeps_headroom_for_running_sequences_only() {
        let pool = |kv_watermark| {
            Scheduler::new(SchedulerConfig {
                num_gpu_blocks: 16,
                block_size: 4,
                max_model_len: 64,
                prefix_caching: false,
                kv_watermark,
                ..cfg()
            })
        };
        // B of 24 tokens leaves 3 blocks, of 20 tokens exactly the watermark's 4.
        for (watermark, b_len, together) in [(0.0, 24, true), (0.25, 24, false), (0.25, 20, true)] {
            let mut s = pool(watermark);
            assert_eq!(s.config().watermark_blocks(), (watermark * 16.0) as usize);
            s.add_request(Request::new(1, vec![3; 28], 4), 0.0).unwrap();
            s.add_request(Request::new(2, vec![4; b_len], 4), 0.0)
                .unwrap();
            let plan = s.schedule(1.0);
            let ids: Vec<u64> = plan.seqs.iter().map(|q| q.request.0).collect();
            assert_eq!(ids.len() == 2, together, "watermark {watermark}: {ids:?}");
            let sampled = vec![9; plan.num_sampling()];
            s.complete(plan, &sampled, 1.5);
            let mut step = 1;
            while s.has_unfinished() {
                step += 1;
                assert!(step < 20, "livelock");
                let plan = s.schedule(step as f64);
                let sampled = vec![9; plan.num_sampling()];
                s.complete(plan, &sampled, step as f64 + 0.5);
                s.check_invariants().unwrap();
            }
            assert_eq!(s.stats().num_free_blocks, 16);
        }
        let mut s = pool(0.25);
        s.add_request(Request::new(3, vec![5; 56], 2), 0.0).unwrap();
        let plan = s.schedule(1.0);
        assert_eq!(plan.seqs.len(), 1, "an empty pool admits it");
        // Chunked, the watermark asks for the whole prompt, as vLLM V0: B's first chunk fits
        // beside A (1 block), its 12 blocks would leave 3 of the 4.
        for (watermark, together) in [(0.0, true), (0.25, false)] {
            let mut s = Scheduler::new(SchedulerConfig {
                prefill_chunk_size: 8,
                max_batch_size: 4,
                ..pool(watermark).config().clone()
            });
            s.add_request(Request::new(1, vec![3; 4], 4), 0.0).unwrap();
            s.add_request(Request::new(2, vec![4; 48], 4), 0.0).unwrap();
            let plan = s.schedule(1.0);
            let ids: Vec<u64> = plan.seqs.iter().map(|q| q.request.0).collect();
            assert_eq!(
                ids.len() == 2,
                together,
                "chunked, watermark {watermark}: {ids:?}"
            );
        }
        let bad = SchedulerConfig {
            kv_watermark: 1.0,
            ..cfg()
        };
        assert_eq!(bad.validate().unwrap_err().0, "kv_watermark");
    }

    /// Each token event carries the time of the request's previous token, and its stats
    /// the first token's time and the sum and largest of the gaps (the simulator's ITL).
    #[test]
    fn token_times_are_kept_per_request() {
        let mut s = Scheduler::new(cfg());
        s.add_request(Request::new(1, vec![3; 20], 4), 0.0).unwrap();
        let mut prev = Vec::new();
        let mut stats = None;
        for now in [0.5, 0.6, 0.8, 1.1] {
            let plan = s.schedule(now - 0.05);
            for e in s.complete(plan, &[9], now) {
                match e {
                    Event::Token {
                        prev_token_time, ..
                    } => prev.push(prev_token_time),
                    Event::Finished { stats: st, .. } => stats = Some(st),
                }
            }
        }
        assert_eq!(prev, vec![None, Some(0.5), Some(0.6), Some(0.8)]);
        let st = stats.expect("max_tokens 4");
        assert_eq!(st.first_token_time, Some(0.5));
        assert!((st.itl_sum - 0.6).abs() < 1e-12, "{}", st.itl_sum);
        assert!((st.itl_max - 0.3).abs() < 1e-12, "{}", st.itl_max);
    }

    #[test]
    fn abort_frees_blocks_at_once_and_is_reported_in_the_next_plan() {
        let mut s = Scheduler::new(cfg());
        s.add_request(Request::new(1, vec![3; 40], 10), 0.0)
            .unwrap();
        s.add_request(Request::new(2, vec![4; 40], 10), 0.0)
            .unwrap();
        let plan = s.schedule(0.0);
        assert_eq!(plan.num_sampling(), 2);
        // Aborted between schedule and complete: its sampled token is ignored.
        let stats = s.abort(RequestId(1)).unwrap();
        assert_eq!(stats.output_tokens, 0);
        let events = s.complete(plan, &[7, 8], 0.1);
        assert_eq!(events.len(), 1);
        assert!(matches!(
            events[0],
            Event::Token {
                request: RequestId(2),
                token: 8,
                prev_token_time: None,
            }
        ));
        assert_eq!(s.stats().num_free_blocks, 64 - 3);
        let plan = s.schedule(0.1);
        assert_eq!(plan.finished, vec![RequestId(1)]);
        assert_eq!(plan.seqs.len(), 1);
        s.complete(plan, &[9], 0.2);
        assert!(s.abort(RequestId(1)).is_none());
        s.finish(RequestId(2), FinishReason::Stop).unwrap();
        assert_eq!(s.stats().num_free_blocks, 64);
        s.check_invariants().unwrap();
    }

    #[test]
    fn a_failed_step_ends_its_requests_and_frees_their_blocks_only() {
        let mut s = Scheduler::new(SchedulerConfig {
            max_batch_size: 2,
            ..cfg()
        });
        for id in 1..=3 {
            s.add_request(Request::new(id, vec![3; 40], 10), 0.0)
                .unwrap();
        }
        let plan = s.schedule(0.0);
        assert_eq!(plan.seqs.len(), 2);
        let ended = s.fail(plan, 0.1);
        let ids: Vec<RequestId> = ended.iter().map(|e| e.0).collect();
        assert_eq!(ids, vec![RequestId(1), RequestId(2)]);
        assert_eq!(s.stats().num_free_blocks, 64);
        s.check_invariants().unwrap();
        // The third request was waiting: it runs next, as if nothing happened.
        let plan = s.schedule(0.1);
        assert_eq!(plan.seqs.len(), 1);
        assert_eq!(plan.seqs[0].request, RequestId(3));
        let events = s.complete(plan, &[5], 0.2);
        assert_eq!(events.len(), 1);
        s.check_invariants().unwrap();
    }

    #[test]
    fn without_chunking_the_step_budget_admits_whole_prompts_only() {
        let mut s = Scheduler::new(SchedulerConfig {
            chunked_prefill: false,
            max_num_batched_tokens: Some(600),
            ..cfg()
        });
        for id in 1..=3 {
            s.add_request(Request::new(id, vec![id as u32; 400], 4), 0.0)
                .unwrap();
        }
        // 400 + 400 > 600: one whole prompt, never a piece of the second.
        let plan = s.schedule(0.0);
        assert_eq!(plan.seqs.len(), 1);
        assert_eq!(plan.num_tokens(), 400);
        s.complete(plan, &[7], 0.1);
        // Next: the first one's decode and the second prompt (401 tokens).
        let plan = s.schedule(0.1);
        assert_eq!(plan.seqs.len(), 2);
        assert_eq!(plan.num_tokens(), 401);
        s.complete(plan, &[7, 7], 0.2);
        s.check_invariants().unwrap();
    }

    #[test]
    fn eos_and_stop_tokens_end_requests_unless_ignored() {
        let mut s = Scheduler::new(cfg());
        let stop = |ignore_eos| StopConditions {
            max_tokens: 50,
            ignore_eos,
            eos_token_ids: vec![2],
            stop_token_ids: vec![9],
        };
        s.add_request(
            Request {
                id: RequestId(1),
                prompt: vec![5; 8],
                stop: stop(false),
            },
            0.0,
        )
        .unwrap();
        s.add_request(
            Request {
                id: RequestId(2),
                prompt: vec![6; 8],
                stop: stop(true),
            },
            0.0,
        )
        .unwrap();
        let plan = s.schedule(0.0);
        let ev = s.complete(plan, &[2, 2], 0.1);
        let ended: Vec<_> = ev
            .iter()
            .filter_map(|e| match e {
                Event::Finished {
                    request, reason, ..
                } => Some((*request, *reason)),
                _ => None,
            })
            .collect();
        assert_eq!(ended, vec![(RequestId(1), FinishReason::Stop)]);
        let plan = s.schedule(0.1);
        let ev = s.complete(plan, &[9], 0.2);
        assert!(ev.iter().any(|e| matches!(
            e,
            Event::Finished {
                reason: FinishReason::Stop,
                ..
            }
        )));
        assert!(!s.has_unfinished());
    }

    /// A request sent after an `n = 8` one, on a batch of two, is admitted at the second
    /// free slot, not after the seven forks: the forks' lane alternates with everyone
    /// else's. (With the forks at the head of one queue it ran last.) The forks all run.
    #[test]
    fn a_large_n_shares_the_free_slots_with_later_requests() {
        let mut s = Scheduler::new(SchedulerConfig {
            max_batch_size: 2,
            ..cfg()
        });
        let forks: Vec<RequestId> = (2..9).map(RequestId).collect();
        s.add_forked(Request::new(1, vec![5; 8], 6), forks, 0.0)
            .unwrap();
        let mut first_step: std::collections::HashMap<u64, u32> = Default::default();
        let mut step = 0u32;
        while s.has_unfinished() {
            step += 1;
            assert!(step < 200, "livelock");
            if step == 2 {
                // After the parent's first token: its forks wait.
                s.add_request(Request::new(100, vec![7; 4], 4), step as f64)
                    .unwrap();
            }
            let plan = s.schedule(step as f64);
            for q in &plan.seqs {
                first_step.entry(q.request.0).or_insert(step);
            }
            let sampled = vec![9; plan.num_sampling()];
            s.complete(plan, &sampled, step as f64 + 0.5);
            s.check_invariants().unwrap();
        }
        let forks_before: Vec<u64> = (2..9)
            .filter(|f| first_step[f] < first_step[&100])
            .collect();
        assert_eq!(forks_before, vec![2], "{first_step:?}");
        assert_eq!(first_step.len(), 9, "every sequence ran");
    }

    #[test]
    fn bad_requests_are_refused_with_numbers() {
        let mut s = Scheduler::new(SchedulerConfig {
            max_waiting: Some(1),
            ..cfg()
        });
        let e = s
            .add_request(Request::new(1, vec![1; 512], 4), 0.0)
            .unwrap_err();
        assert_eq!(
            e,
            AddError::PromptTooLong {
                prompt_tokens: 512,
                max_model_len: 512
            }
        );
        assert!(e.to_string().contains("512"));
        assert_eq!(
            s.add_request(Request::new(1, vec![], 4), 0.0),
            Err(AddError::EmptyPrompt)
        );
        assert_eq!(s.check_waiting_room(1), Ok(()));
        assert_eq!(
            s.check_waiting_room(2),
            Err(AddError::QueueFull { max_waiting: 1 })
        );
        s.add_request(Request::new(1, vec![1; 5], 4), 0.0).unwrap();
        assert!(s.check_waiting_room(1).is_err());
        assert_eq!(
            s.add_request(Request::new(1, vec![1; 5], 4), 0.0),
            Err(AddError::QueueFull { max_waiting: 1 })
        );
        let mut s = Scheduler::new(cfg());
        s.add_request(Request::new(1, vec![1; 5], 4), 0.0).unwrap();
        assert_eq!(
            s.add_request(Request::new(1, vec![1; 5], 4), 0.0),
            Err(AddError::DuplicateId(RequestId(1)))
        );
    }
}
