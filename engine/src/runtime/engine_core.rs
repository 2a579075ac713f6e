//! The engine core: the one loop body every driver runs. It owns the model's KV store, the
//! core scheduler and each request's sampler and text stream; a step is
//! `schedule` → one batched forward → sample → `complete` → text deltas and finishes.
//!
//! `engine serve` wraps it in a thread fed by channels (`server::engine_loop`);
//! `engine generate` and the runner tests call it directly (`generate`). There is no
//! other way to run the model over requests, so what the tests check is what serving runs.

use std::borrow::Borrow;
use std::collections::HashMap;
use std::time::Instant;

use anyhow::{anyhow, ensure, Result};
use infer_core::{
    AddError, Event, FinishReason, Request, RequestId, RequestStats, Scheduler, SchedulerConfig,
    SchedulerStats, StepPlan, StepShape, StopConditions,
};

use crate::runtime::batch::{ForwardBatch, Pass, SeqChunk};
use crate::runtime::detokenize::{OutputStream, StopSet};
use crate::runtime::model::{KvCache, LoadedModel};
use crate::runtime::sampling::{SampledToken, Sampler, SamplingParams};
use crate::runtime::structured::{Constraint, STRUCTURED_FAILURE};
use infer_kernels::sampling::{PackError, RowParams, SamplingBatch};

/// A tokenised request.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineRequest {
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    pub max_tokens: usize,
    /// Text that ends generation; the output stops right before it.
    pub stop_strings: StopSet,
    /// Token ids that end generation, honoured even with `ignore_eos` (as vLLM does).
    pub stop_token_ids: Vec<u32>,
    /// Generate past the model's end-of-sequence tokens.
    pub ignore_eos: bool,
    /// Special tokens are written out in the text (vLLM's `skip_special_tokens: false`).
    pub keep_special_tokens: bool,
    /// Ids of more sequences to sample from the same prompt (OpenAI's `n` - 1): forked
    /// from this one once its prompt is computed (see `Scheduler::add_forked`). Fork `i` (from 0) samples with `seed + i + 1` when the
    /// request has a seed.
    pub forks: Vec<u64>,
    /// Report the logprob of every prompt token but the first, with this many most likely
    /// alternatives (`echo` with `logprobs`): every prompt token is then computed, none
    /// taken from the prefix cache.
    pub prompt_logprobs: Option<usize>,
    /// The grammar every sequence's output follows (structured output), fresh.
    pub constraint: Option<Constraint>,
    /// Its place under priority scheduling, the lowest value first (vLLM's `priority`).
    pub priority: i64,
}

/// The logprob of one token given the tokens before it (a prompt's, or a generated one's).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    /// The most likely tokens at that position, most likely first.
    pub top: Vec<(u32, f32)>,
    /// 1 + the tokens more likely than this one, where known (a prompt token's, for vLLM's
    /// `prompt_logprobs`).
    pub rank: Option<usize>,
}

/// One generated token of one request.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenOutput {
    pub id: u64,
    pub token: u32,
    /// The request's first output token.
    pub first: bool,
    /// Text completed by this token (possibly empty); the last token of a request also
    /// carries the text held back until then. A stop token's own text is not emitted.
    pub text: String,
    /// Logprob of `token` and the most likely alternatives, when the request asked.
    pub logprob: f32,
    pub top_logprobs: Vec<(u32, f32)>,
    /// The request ended with this token.
    pub finish: Option<(FinishReason, RequestStats)>,
    /// With the first token of a request that asked: prompt positions 1.. in order.
    pub prompt_logprobs: Option<Vec<TokenLogprob>>,
    /// What ended a request that stopped, when not its end-of-sequence token.
    pub stop_reason: Option<StopReason>,
}

/// vLLM's `stop_reason`: the stop string or stop token id that ended a request (the
/// tokenizer's end-of-sequence token, a length or an abort has none; a generation config's
/// other end-of-sequence ids name themselves, as vLLM counts them among the stop tokens).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopReason {
    Text(String),
    Token(u32),
}

/// Why a request ended before it finished.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestFailure {
    pub cause: FailureCause,
    /// What went wrong, for the client (shown with its cause in the log).
    pub message: String,
}

/// Whose fault a failure is: the server answers a request's own as a 400, the rest as 500.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureCause {
    /// The request's grammar failed (a parser row past llguidance's limit, a state it
    /// cannot leave).
    Grammar,
    /// The model step, the device or the engine failed.
    Server,
}

impl RequestFailure {
    pub fn grammar(e: &anyhow::Error) -> Self {
        RequestFailure {
            cause: FailureCause::Grammar,
            message: format!("{e:#}"),
        }
    }

    pub fn server(message: impl Into<String>) -> Self {
        RequestFailure {
            cause: FailureCause::Server,
            message: message.into(),
        }
    }
}

impl std::fmt::Display for RequestFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.cause {
            FailureCause::Grammar => write!(f, "{STRUCTURED_FAILURE}{}", self.message),
            FailureCause::Server => f.write_str(&self.message),
        }
    }
}

/// What one step did.
#[derive(Debug, Default)]
pub struct StepOutput {
    /// Nothing was scheduled (every unfinished request is waiting for memory).
    pub idle: bool,
    pub tokens: Vec<TokenOutput>,
    /// Requests the step could not run: ended (KV freed), with the error.
    pub failed: Vec<(u64, RequestStats, RequestFailure)>,
    /// Requests that ended outside a step since the last one (aborted, or forks whose
    /// parent ended before forking them).
    pub ended: Vec<u64>,
    /// The step's shape in the simulator's terms, when tracing.
    pub shape: Option<StepShape>,
    /// Tokens the step processed (prompt chunks and decodes).
    pub num_tokens: usize,
    /// Seconds in the model's forward and sampling.
    pub forward_s: f64,
    /// Of those, seconds of structured output's grammar work (part of sampling).
    pub constraint_s: f64,
    /// The step failed because the device is lost ([`crate::runtime::backend::DeviceLost`]):
    /// no later step can run.
    pub fatal: Option<String>,
}

/// A request's state outside the scheduler.
struct Live {
    sampler: Sampler,
    output: OutputStream,
    want_logprobs: bool,
    /// The token ids that name themselves as the `stop_reason` when they end the request:
    /// its stop token ids, and the model's end-of-sequence ids other than its tokenizer's
    /// own (a generation config's extra ones, as vLLM adds them to the stop tokens); the
    /// tokenizer's end-of-sequence token ends it with no `stop_reason`, as in vLLM.
    stop_tokens: Vec<u32>,
    /// (the prompt, alternatives per position, logprobs of positions 1.. as computed) when
    /// the request asked for prompt logprobs.
    prompt_logprobs: Option<(Vec<u32>, usize, Vec<Option<TokenLogprob>>)>,
}

/// The loop body. `M` is the model, owned (a server) or borrowed (a one-off run).
pub struct EngineCore<M: Borrow<LoadedModel> = LoadedModel> {
    model: M,
    kv: KvCache,
    sched: Scheduler,
    live: HashMap<u64, Live>,
    default_seed: u64,
    start: Instant,
    trace: bool,
    /// Sequences whose sampling failed this step (their grammar), with why.
    sample_failed: HashMap<u64, RequestFailure>,
    /// Seconds and tokens of structured output's host work so far.
    constraint_cost: (f64, u64),
    /// Tokens one forward pass holds at most: the step the memory plan sized the device's
    /// activations and GEMM algorithms for. A larger step (several whole prompts, unchunked
    /// and without `max_num_batched_tokens`) runs as several passes.
    max_pass_tokens: usize,
    /// Rows of logits one forward pass returns at most: those of the planned step, one per
    /// sequence. A prompt whose every row is asked for (prompt logprobs) runs in pieces of
    /// this many tokens, so no prompt's length sets what a step holds.
    max_pass_rows: usize,
    /// The next forward's error, in place of running it.
    #[cfg(test)]
    pub(crate) inject_failure: Option<anyhow::Error>,
    /// Take the device-sampling path on the CPU backend (its reference sampler).
    #[cfg(test)]
    pub(crate) force_device_sampling: bool,
    /// Forward passes run on the host-logits path so far.
    #[cfg(test)]
    pub(crate) passes_run: usize,
}

impl<M: Borrow<LoadedModel>> EngineCore<M> {
    /// A core over a valid scheduler configuration; the KV store is allocated here.
    /// `default_seed` seeds requests that bring none.
    pub fn new(model: M, cfg: SchedulerConfig, default_seed: u64) -> Result<Self> {
        cfg.validate()
            .map_err(|(k, r)| anyhow!("invalid scheduler configuration: {k}: {r}"))?;
        let max_pass_tokens = cfg.max_pass_tokens();
        let max_pass_rows =
            crate::runtime::memory_plan::planned_logit_rows(&cfg, model.borrow().model.config());
        let sched = Scheduler::new(cfg);
        let kv = model
            .borrow()
            .model
            .new_kv_cache(sched.kv().num_blocks(), sched.kv().block_size())?;
        Ok(EngineCore {
            model,
            kv,
            sched,
            live: HashMap::new(),
            default_seed,
            start: Instant::now(),
            trace: false,
            sample_failed: HashMap::new(),
            constraint_cost: (0.0, 0),
            max_pass_tokens,
            max_pass_rows,
            #[cfg(test)]
            inject_failure: None,
            #[cfg(test)]
            force_device_sampling: false,
            #[cfg(test)]
            passes_run: 0,
        })
    }

    pub fn model(&self) -> &LoadedModel {
        self.model.borrow()
    }

    /// When the core started: the scheduler's clock reads seconds since then.
    pub fn start(&self) -> Instant {
        self.start
    }

    /// Captures the CUDA graph of every decode bucket now, on this core's KV pool, rather than
    /// at each bucket's first decode step (where the capture's cost would land on a request's
    /// latency). Call before the first request: each bucket runs one decode step whose K/V go
    /// to slot 0 of block 0, which no sequence holds yet. Returns the buckets captured.
    pub fn capture_decode_graphs(&mut self) -> Result<usize> {
        // Nothing admitted yet, so nothing holds or has cached block 0.
        let stats = self.stats();
        ensure!(
            self.live.is_empty()
                && stats.num_waiting + stats.num_running == 0
                && stats.num_finished == 0
                && stats.prefix_queries == 0,
            "decode graphs are captured before the first request"
        );
        let buckets = self.model.borrow().model.cuda_graph_buckets();
        for &seqs in &buckets {
            let model = &self.model.borrow().model;
            model
                .forward(&graph_warmup_batch(seqs), &mut self.kv)
                .map_err(|e| anyhow!("capturing the decode graph of {seqs} sequences: {e:#}"))?;
        }
        Ok(buckets.len())
    }

    /// Report each step's shape (for `--step-log`).
    pub fn trace_steps(&mut self, on: bool) {
        self.trace = on;
    }

    /// Empty the prefix cache (see `Scheduler::reset_prefix_cache`).
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.sched.reset_prefix_cache()
    }

    /// Record the prefix cache's events from now on (see [`Self::take_kv_events`]).
    pub fn record_kv_events(&mut self) {
        self.sched.record_kv_events();
    }

    /// The prefix cache's events since the last call, oldest first.
    pub fn take_kv_events(&mut self) -> Vec<infer_core::kv::KvEvent> {
        self.sched.take_kv_events()
    }

    /// Bytes of the KV store.
    pub fn kv_bytes(&self) -> usize {
        self.kv.size_bytes()
    }

    /// Seconds the grammars of structured output took on this thread, and the tokens they
    /// constrained, since the core started.
    pub fn constraint_cost(&self) -> (f64, u64) {
        self.constraint_cost
    }

    /// See [`Scheduler::check_waiting_room`].
    pub fn check_waiting_room(&self, n: usize) -> Result<(), AddError> {
        self.sched.check_waiting_room(n)
    }

    pub fn stats(&self) -> SchedulerStats {
        self.sched.stats()
    }

    pub fn has_unfinished(&self) -> bool {
        self.sched.has_unfinished()
    }

    /// Queue a request that arrived at `arrival`. The model's end-of-sequence tokens end
    /// it unless `ignore_eos`.
    pub fn add(&mut self, id: u64, r: EngineRequest, arrival: Instant) -> Result<(), AddError> {
        let mut eos = if r.ignore_eos {
            Vec::new()
        } else {
            self.model().eos_token_ids.clone()
        };
        eos.sort_unstable();
        let tokenizer = &self.model().tokenizer;
        let own_eos = tokenizer.eos_token().and_then(|e| tokenizer.token_to_id(e));
        // What min_tokens holds back: every token that could end the output, the model's
        // end-of-sequence ones even under ignore_eos (vLLM's rule).
        let ending: Vec<u32> = (self.model().eos_token_ids.iter())
            .chain(&r.stop_token_ids)
            .copied()
            .collect();
        let stop_tokens: Vec<u32> = r
            .stop_token_ids
            .iter()
            .copied()
            .filter(|t| eos.binary_search(t).is_err())
            .chain(eos.iter().copied().filter(|&t| Some(t) != own_eos))
            .collect();
        let req = Request {
            id: RequestId(id),
            prompt: r.prompt,
            stop: StopConditions {
                max_tokens: r.max_tokens,
                ignore_eos: r.ignore_eos,
                eos_token_ids: eos,
                stop_token_ids: r.stop_token_ids,
            },
        };
        // One sampler per sequence; a seeded request's forks take the seeds after its own.
        let lives: Vec<(u64, Live)> = std::iter::once(id)
            .chain(r.forks.iter().copied())
            .enumerate()
            .map(|(i, sid)| {
                let mut params = r.params.clone();
                params.seed = params.seed.map(|s| s.wrapping_add(i as u64));
                let min_tokens = params.min_tokens;
                let mut sampler =
                    Sampler::new(params, &req.prompt, request_seed(self.default_seed, sid));
                sampler.hold_stops(&ending);
                if let Some(c) = &r.constraint {
                    sampler.constrain(c.clone());
                }
                let want_logprobs = sampler.params().logprobs.is_some();
                let prompt_logprobs = r.prompt_logprobs.filter(|_| i == 0).map(|k| {
                    (
                        req.prompt.clone(),
                        k,
                        vec![None; req.prompt.len().saturating_sub(1)],
                    )
                });
                let output = OutputStream::new(r.stop_strings.clone(), &req.prompt, min_tokens);
                let output = if r.keep_special_tokens {
                    output.keeping_special_tokens()
                } else {
                    output
                };
                let live = Live {
                    sampler,
                    output,
                    want_logprobs,
                    stop_tokens: stop_tokens.clone(),
                    prompt_logprobs,
                };
                (sid, live)
            })
            .collect();
        let arrival_s = arrival.saturating_duration_since(self.start).as_secs_f64();
        let opts = infer_core::AddOptions {
            forks: r.forks.iter().map(|&f| RequestId(f)).collect(),
            every_prompt_token: r.prompt_logprobs.is_some(),
            priority: r.priority,
        };
        self.sched.add_with(req, opts, arrival_s)?;
        self.live.extend(lives);
        Ok(())
    }

    /// End a request now and free its KV. `None` if it was not live.
    pub fn abort(&mut self, id: u64) -> Option<RequestStats> {
        self.live.remove(&id);
        self.sched.abort(RequestId(id))
    }

    /// Run one step.
    pub fn step(&mut self) -> StepOutput {
        let now = self.now();
        let plan = self.sched.schedule(now);
        let ended: Vec<u64> = plan.finished.iter().map(|id| id.0).collect();
        for id in &ended {
            self.live.remove(id);
        }
        if plan.is_empty() {
            self.sched.complete(plan, &[], now);
            return StepOutput {
                idle: true,
                ended,
                ..StepOutput::default()
            };
        }
        let shape = self.trace.then(|| {
            let mut shape = StepShape::of(&plan);
            // Its forward passes, as the simulator counts them (a prompt scored for its
            // prompt logprobs, which the simulator does not model, may run in more).
            if shape.new_tokens() > self.max_pass_tokens {
                shape.forward_passes = infer_core::scheduler::whole_sequence_passes(
                    plan.seqs.iter().map(|q| q.num_new_tokens),
                    self.max_pass_tokens,
                );
            }
            shape.constrained_seqs = plan
                .seqs
                .iter()
                .filter(|q| q.samples)
                .filter_map(|q| self.live.get(&q.request.0))
                .filter(|l| l.sampler.constraint().is_some())
                .count();
            shape
        });
        let num_tokens = plan.num_tokens();
        let t_forward = Instant::now();
        let sampled = match self.forward_and_sample(&plan) {
            Ok(s) => s,
            Err(e) => {
                // The step failed: end its requests, keep serving the others (unless the
                // device is lost: then the caller stops).
                let fatal =
                    crate::runtime::backend::DeviceLost::caused(&e).then(|| format!("{e:#}"));
                let now = self.now();
                // A grammar that failed before the step did ends with the step's error.
                for s in &plan.seqs {
                    self.sample_failed.remove(&s.request.0);
                }
                let failed = self
                    .sched
                    .fail(plan, now)
                    .into_iter()
                    .map(|(id, stats)| {
                        self.live.remove(&id.0);
                        let why = RequestFailure::server(format!("model step failed: {e:#}"));
                        (id.0, stats, why)
                    })
                    .collect();
                return StepOutput {
                    failed,
                    ended,
                    shape,
                    num_tokens,
                    forward_s: t_forward.elapsed().as_secs_f64(),
                    fatal,
                    ..StepOutput::default()
                };
            }
        };
        let forward_s = t_forward.elapsed().as_secs_f64();
        let constraint_s = sampled.iter().map(|s| s.1.constraint_s).sum();
        let tokens: Vec<u32> = sampled.iter().map(|s| s.1.token).collect();
        let now = self.now();
        let events = self.sched.complete(plan, &tokens, now);
        // Debug builds (the tests) check the scheduler's invariants after every step.
        #[cfg(debug_assertions)]
        if let Err(e) = self.sched.check_invariants() {
            panic!("scheduler invariant broken: {e}");
        }
        let mut sampled = sampled.into_iter();
        let mut out = Vec::with_capacity(tokens.len());
        let mut failed = Vec::new();
        let mut events = events.into_iter().peekable();
        while let Some(e) = events.next() {
            let Event::Token {
                request,
                token,
                prev_token_time,
            } = e
            else {
                // Every finish follows its request's token, and is taken with it below.
                continue;
            };
            // Events come in plan order, so the sampled tokens are met in order.
            let Some((_, s)) = sampled.by_ref().find(|s| s.0 == request.0) else {
                continue;
            };
            debug_assert_eq!(s.token, token);
            let finish = match events.peek() {
                Some(Event::Finished { request: r, .. }) if *r == request => match events.next() {
                    Some(Event::Finished { reason, stats, .. }) => Some((reason, stats)),
                    _ => None,
                },
                _ => None,
            };
            if let Some(why) = self.sample_failed.remove(&request.0) {
                self.live.remove(&request.0);
                let stats = match finish {
                    Some((_, stats)) => Some(stats),
                    None => self.sched.abort(request),
                };
                failed.extend(stats.map(|stats| (request.0, stats, why)));
                continue;
            }
            let first = prev_token_time.is_none();
            out.push(self.token_output(request.0, s, first, finish));
        }
        StepOutput {
            idle: false,
            tokens: out,
            ended,
            failed,
            shape,
            num_tokens,
            forward_s,
            constraint_s,
            fatal: None,
        }
    }

    fn now(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    /// Each sampling sequence's token, in plan order, with its request id.
    fn forward_and_sample(&mut self, plan: &StepPlan) -> Result<Vec<(u64, SampledToken)>> {
        #[cfg(test)]
        if let Some(e) = self.inject_failure.take() {
            return Err(e);
        }
        let mut batch = to_batch(plan);
        // Prompt chunks of requests that report prompt logprobs return every row.
        for (chunk, s) in batch.seqs.iter_mut().zip(&plan.seqs) {
            if let Some(Some((prompt, ..))) =
                self.live.get(&s.request.0).map(|l| &l.prompt_logprobs)
            {
                chunk.all_logits = s.num_computed + 1 < prompt.len();
            }
        }
        if self.samples_on_device(&batch) {
            return self.forward_and_sample_on_device(plan, &batch);
        }
        // Each sampling sequence's token, by its index in the plan: a pass's rows are used
        // (prompt logprobs computed, tokens sampled) before the next pass runs, so a step
        // never holds more logits than one pass returns.
        let mut sampled: Vec<Option<(u64, SampledToken)>> = vec![None; plan.seqs.len()];
        let model = &self.model.borrow().model;
        for pass in self.passes(batch) {
            #[cfg(test)]
            {
                self.passes_run += 1;
            }
            let logits = model.forward(&pass.batch, &mut self.kv)?;
            let mut rows = logits.iter();
            for (&i, chunk) in pass.origin.iter().zip(&pass.batch.seqs) {
                let id = plan.seqs[i].request.0;
                let live = self
                    .live
                    .get_mut(&id)
                    .ok_or_else(|| anyhow!("request {id} has no state"))?;
                let mut last = None;
                for j in chunk.logit_rows() {
                    let row = rows
                        .next()
                        .ok_or_else(|| anyhow!("fewer logits rows than asked"))?;
                    // Row j predicts the token after position `start_pos + j`.
                    let next = chunk.start_pos + j + 1;
                    if let Some((prompt, k, lps)) = &mut live.prompt_logprobs {
                        if chunk.all_logits && next < prompt.len() {
                            let (logprob, top) =
                                crate::runtime::sampling::raw_logprobs(row, prompt[next], *k);
                            lps[next - 1] = Some(TokenLogprob {
                                token: prompt[next],
                                logprob,
                                top,
                                rank: Some(crate::runtime::sampling::rank_of(row, prompt[next])),
                            });
                        }
                    }
                    last = Some(row);
                }
                if !chunk.sample {
                    continue;
                }
                let row = last.ok_or_else(|| anyhow!("no logits for a sampled row"))?;
                sampled[i] = Some(match live.sampler.sample(row) {
                    Ok(t) => {
                        if live.sampler.constraint().is_some() {
                            self.constraint_cost.0 += t.constraint_s;
                            self.constraint_cost.1 += 1;
                        }
                        (id, t)
                    }
                    Err(e) => {
                        // Only a grammar fails here: this request ends with the error after
                        // the step (its placeholder token is never shown), the others go on.
                        self.sample_failed.insert(id, RequestFailure::grammar(&e));
                        (id, SampledToken::placeholder())
                    }
                });
            }
        }
        let out: Vec<(u64, SampledToken)> = sampled.into_iter().flatten().collect();
        ensure!(
            out.len() == plan.num_sampling(),
            "{} tokens sampled for {} sampling sequences",
            out.len(),
            plan.num_sampling()
        );
        Ok(out)
    }

    /// Whether this step samples on the device: the model was told to, and no row needs
    /// every logit on the host (prompt logprobs). A grammar's mask goes to the device with
    /// its row.
    fn samples_on_device(&self, batch: &ForwardBatch) -> bool {
        #[cfg(test)]
        let forced = self.force_device_sampling;
        #[cfg(not(test))]
        let forced = false;
        (forced || self.model.borrow().model.samples_on_device())
            && batch.seqs.iter().all(|c| !c.all_logits)
            && batch.total_tokens() <= self.max_pass_tokens
    }

    /// The step's forward passes: the batch as it is, or where it holds more tokens or rows
    /// of logits than the memory plan sized a pass for, several
    /// ([`ForwardBatch::passes`]).
    fn passes(&self, batch: ForwardBatch) -> Vec<Pass> {
        if batch.total_tokens() <= self.max_pass_tokens
            && batch.num_logit_rows() <= self.max_pass_rows
        {
            let origin = (0..batch.seqs.len()).collect();
            return vec![Pass { batch, origin }];
        }
        batch.passes(self.max_pass_tokens, self.max_pass_rows)
    }

    /// [`Self::forward_and_sample`] with the sampling done where the logits are: each
    /// sampler gives its row's parameters, draw and grammar mask, and accepts the token that
    /// comes back. A grammar that fails ends its request after the step, as on the host.
    fn forward_and_sample_on_device(
        &mut self,
        plan: &StepPlan,
        batch: &ForwardBatch,
    ) -> Result<Vec<(u64, SampledToken)>> {
        let mut ids = Vec::with_capacity(plan.num_sampling());
        // Per row: the grammar's seconds so far, when a grammar constrains it.
        let mut grammar_s = Vec::with_capacity(plan.num_sampling());
        // The rows are packed once the step is queued: on a GPU the grammars compute their
        // masks while the forward runs.
        let (live, failed) = (&mut self.live, &mut self.sample_failed);
        let mut rows = || -> Result<SamplingBatch> {
            let mut sampling = SamplingBatch::new();
            for s in plan.seqs.iter().filter(|s| s.samples) {
                let id = s.request.0;
                let live = live
                    .get_mut(&id)
                    .ok_or_else(|| anyhow!("request {id} has no state"))?;
                match live.sampler.device_row() {
                    Ok(row) => {
                        match sampling.push_masked(&row.params, row.adjust, row.mask.as_deref()) {
                            Ok(()) => {
                                grammar_s.push(row.mask.is_some().then_some(row.constraint_s))
                            }
                            // A row that cannot be sampled (its grammar allows no token) ends
                            // its own request, as a failed grammar does, not the step.
                            Err(e) => {
                                let failure = match e {
                                    PackError::EmptyMask => {
                                        RequestFailure::grammar(&anyhow!("{e}"))
                                    }
                                    _ => RequestFailure::server(e.to_string()),
                                };
                                failed.insert(id, failure);
                                sampling.push(&RowParams::greedy(), &[])?;
                                grammar_s.push(None);
                            }
                        }
                    }
                    Err(e) => {
                        // Its grammar failed: a greedy row holds its place, its token unused.
                        failed.insert(id, RequestFailure::grammar(&e));
                        sampling.push(&RowParams::greedy(), &[])?;
                        grammar_s.push(None);
                    }
                }
                ids.push(id);
            }
            Ok(sampling)
        };
        let sampled = self
            .model
            .borrow()
            .model
            .forward_sampled(batch, &mut self.kv, &mut rows)?;
        anyhow::ensure!(
            sampled.rows() == ids.len(),
            "{} tokens sampled for {} sequences",
            sampled.rows(),
            ids.len()
        );
        let mut out = Vec::with_capacity(ids.len());
        for (r, id) in ids.into_iter().enumerate() {
            if self.sample_failed.contains_key(&id) {
                out.push((id, SampledToken::placeholder()));
                continue;
            }
            let token = u32::try_from(sampled.tokens[r])
                .map_err(|_| anyhow!("the device sampled no token for request {id}"))?;
            let live = self.live.get_mut(&id).expect("looked up above");
            let accept_s = match live.sampler.accept_device(token) {
                Ok(s) => s,
                Err(e) => {
                    self.sample_failed.insert(id, RequestFailure::grammar(&e));
                    out.push((id, SampledToken::placeholder()));
                    continue;
                }
            };
            let constraint_s = grammar_s[r].map(|mask_s| mask_s + accept_s);
            if let Some(seconds) = constraint_s {
                self.constraint_cost.0 += seconds;
                self.constraint_cost.1 += 1;
            }
            let asked = live.sampler.params().logprobs.is_some();
            out.push((
                id,
                SampledToken {
                    token,
                    logprob: asked.then_some(sampled.logprobs[r]),
                    top_logprobs: sampled.top(r),
                    constraint_s: constraint_s.unwrap_or(0.0),
                },
            ));
        }
        Ok(out)
    }

    /// The text side of one token: detokenise, match stop strings (which end the request
    /// here), release held-back text at the end.
    fn token_output(
        &mut self,
        id: u64,
        sampled: SampledToken,
        first: bool,
        mut finish: Option<(FinishReason, RequestStats)>,
    ) -> TokenOutput {
        let tokenizer = &self.model.borrow().tokenizer;
        let live = self
            .live
            .get_mut(&id)
            .expect("a token event for a live request");
        // A stop token ends the request without its own text (vLLM's rule), unless the
        // request keeps its stop (`include_stop_str_in_output`).
        let stop_token = matches!(finish, Some((FinishReason::Stop, _)));
        let mut text = if stop_token && !live.output.keeps_stop() {
            String::new()
        } else {
            live.output
                .push(tokenizer, sampled.token)
                .unwrap_or_default()
        };
        if finish.is_none() && live.output.stopped() {
            finish = self
                .sched
                .finish(RequestId(id), FinishReason::Stop)
                .map(|s| (FinishReason::Stop, s));
        }
        if finish.is_some() {
            text.push_str(&live.output.finish(tokenizer).unwrap_or_default());
        }
        // A stop string completed by the token that reached the length limit (or by the
        // text held back until the end) cut the text: the request stopped on it (vLLM's
        // reason too).
        if let Some((reason @ FinishReason::Length, _)) = &mut finish {
            if live.output.stopped() {
                *reason = FinishReason::Stop;
            }
        }
        let (logprob, top_logprobs) = if live.want_logprobs {
            let lp = sampled
                .logprob
                .expect("the sampler computes logprobs when asked");
            (lp, sampled.top_logprobs)
        } else {
            (0.0, Vec::new())
        };
        let prompt_logprobs = if first {
            live.prompt_logprobs.take().map(|(_, _, lps)| {
                lps.into_iter()
                    .map(|lp| lp.expect("every prompt position was computed"))
                    .collect()
            })
        } else {
            None
        };
        let stop_reason = match finish {
            Some((FinishReason::Stop, _)) => match live.output.matched_stop() {
                Some(text) => Some(StopReason::Text(text.to_string())),
                None => live
                    .stop_tokens
                    .contains(&sampled.token)
                    .then_some(StopReason::Token(sampled.token)),
            },
            _ => None,
        };
        if finish.is_some() {
            self.live.remove(&id);
        }
        TokenOutput {
            id,
            token: sampled.token,
            first,
            text,
            logprob,
            top_logprobs,
            finish,
            prompt_logprobs,
            stop_reason,
        }
    }
}

/// The seed of a request that brings none: its own for each request (two unseeded
/// requests do not sample alike), reproducible from the engine's seed and the request id.
fn request_seed(engine_seed: u64, id: u64) -> u64 {
    // SplitMix64 of the pair: neighbouring ids give unrelated seeds.
    let mut z = engine_seed ^ id.wrapping_add(1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The model's view of a step plan.
pub fn to_batch(plan: &StepPlan) -> ForwardBatch {
    ForwardBatch {
        seqs: (0..plan.seqs.len())
            .map(|i| {
                let s = &plan.seqs[i];
                SeqChunk {
                    tokens: plan.tokens(i).to_vec(),
                    start_pos: s.num_computed,
                    block_table: plan.block_table(i).to_vec(),
                    sample: s.samples,
                    all_logits: false,
                }
            })
            .collect(),
    }
}

/// A decode step of `seqs` sequences that writes nowhere a sequence lives yet: each decodes
/// token 0 at position 0 into block 0 (the graph warm-up of [`EngineCore::capture_decode_graphs`]).
fn graph_warmup_batch(seqs: usize) -> ForwardBatch {
    ForwardBatch {
        seqs: (0..seqs)
            .map(|_| SeqChunk {
                tokens: vec![0],
                start_pos: 0,
                block_table: vec![0],
                sample: true,
                all_logits: false,
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::model::{load_model_dir, Arch};
    use crate::tools::make_model::{make_model, ModelSpec};
    use crate::Device;
    use infer_core::SchedulingPolicy;

    fn tiny() -> Result<(tempfile::TempDir, LoadedModel)> {
        let tmp = tempfile::tempdir()?;
        let dir = tmp.path().join("llama");
        make_model(&ModelSpec::new(Arch::Llama), &dir)?;
        let lm = load_model_dir(&dir, Some(candle_core::DType::F32), Device::Cpu)?;
        Ok((tmp, lm))
    }

    fn request(len: usize, max_tokens: usize) -> EngineRequest {
        EngineRequest {
            prompt: (0..len as u32).map(|i| 10 + i % 50).collect(),
            params: SamplingParams::greedy(),
            max_tokens,
            stop_strings: StopSet::default(),
            stop_token_ids: Vec::new(),
            ignore_eos: true,
            keep_special_tokens: false,
            forks: Vec::new(),
            prompt_logprobs: None,
            constraint: None,
            priority: 0,
        }
    }

    fn config() -> SchedulerConfig {
        SchedulerConfig {
            max_batch_size: 2,
            num_gpu_blocks: 64,
            max_model_len: 256,
            ..SchedulerConfig::default()
        }
    }

    /// Steps until nothing is left; returns each request's token count.
    fn drain(core: &mut EngineCore<&LoadedModel>) -> HashMap<u64, usize> {
        let mut counts = HashMap::new();
        while core.has_unfinished() {
            let out = core.step();
            assert!(out.failed.is_empty());
            for t in out.tokens {
                *counts.entry(t.id).or_insert(0) += 1;
            }
        }
        counts
    }

    #[test]
    fn a_failed_step_fails_its_requests_only_and_the_engine_goes_on() -> Result<()> {
        let (_tmp, lm) = tiny()?;
        let mut core = EngineCore::new(&lm, config(), 0)?;
        let now = Instant::now();
        for id in 0..3 {
            core.add(id, request(20, 4), now).unwrap();
        }
        core.inject_failure = Some(anyhow!("injected forward failure"));
        // A grammar that failed while the step's rows were packed: the step's error ends
        // the request, and nothing of it stays behind.
        core.sample_failed
            .insert(1, RequestFailure::grammar(&anyhow!("failed")));
        let out = core.step();
        let failed: Vec<u64> = out.failed.iter().map(|f| f.0).collect();
        assert_eq!(failed, vec![0, 1], "the two scheduled requests fail");
        for f in &out.failed {
            assert_eq!(
                f.2.cause,
                FailureCause::Server,
                "the step's error, not the grammar's"
            );
            assert!(f.2.message.contains("injected forward failure"));
        }
        assert!(core.sample_failed.is_empty());
        assert!(out.fatal.is_none(), "an ordinary step error");
        assert!(out.tokens.is_empty());
        assert_eq!(core.stats().num_running, 0);
        assert_eq!(core.stats().num_free_blocks, 64, "their KV is freed");
        // The waiting request and a new one run to the end.
        core.add(3, request(9, 5), Instant::now()).unwrap();
        let counts = drain(&mut core);
        assert_eq!(counts, HashMap::from([(2, 4), (3, 5)]));
        assert_eq!(core.stats().num_free_blocks, 64);
        assert!(core.live.is_empty());
        Ok(())
    }

    /// A request's `priority` reaches the scheduler: under priority scheduling, requests
    /// waiting together run the lowest value first; first come, first served runs them in
    /// their order.
    #[test]
    fn requests_run_in_priority_order_under_priority_scheduling() -> Result<()> {
        let (_tmp, lm) = tiny()?;
        for (policy, order) in [
            (SchedulingPolicy::Fcfs, [0, 1, 2]),
            (SchedulingPolicy::Priority, [2, 1, 0]),
        ] {
            let cfg = SchedulerConfig {
                max_batch_size: 1,
                scheduling_policy: policy,
                ..config()
            };
            let mut core = EngineCore::new(&lm, cfg, 0)?;
            let now = Instant::now();
            for (id, priority) in [5, 0, -1].into_iter().enumerate() {
                let r = EngineRequest {
                    priority,
                    ..request(12, 3)
                };
                core.add(id as u64, r, now).unwrap();
            }
            let mut started = Vec::new();
            while core.has_unfinished() {
                for t in core.step().tokens {
                    if !started.contains(&t.id) {
                        started.push(t.id);
                    }
                }
            }
            assert_eq!(started, order, "{policy:?}");
        }
        Ok(())
    }

    /// Without chunking and without `max_num_batched_tokens`, one step may hold several
    /// whole prompts, more tokens than the memory plan sized a pass for: it runs as passes
    /// of whole sequences within the plan, and computes what one pass would.
    #[test]
    fn a_step_past_the_planned_tokens_runs_in_passes_and_computes_the_same() -> Result<()> {
        let (_tmp, lm) = tiny()?;
        let cfg = SchedulerConfig {
            max_batch_size: 3,
            chunked_prefill: false,
            max_model_len: 64,
            ..config()
        };
        // (the first step's tokens, its forward passes, each request's tokens)
        let run = |max_pass_tokens: Option<usize>| -> Result<(usize, usize, Vec<Vec<u32>>)> {
            let mut core = EngineCore::new(&lm, cfg.clone(), 0)?;
            if let Some(n) = max_pass_tokens {
                core.max_pass_tokens = n;
            }
            let now = Instant::now();
            for (id, len) in [40, 33, 20].into_iter().enumerate() {
                let mut r = request(len, 6);
                r.prompt.iter_mut().for_each(|t| *t += id as u32);
                core.add(id as u64, r, now).unwrap();
            }
            let mut tokens = vec![Vec::new(); 3];
            let first = core.step();
            let (first_tokens, first_passes) = (first.num_tokens, core.passes_run);
            let mut out = first;
            loop {
                assert!(out.failed.is_empty());
                for t in &out.tokens {
                    tokens[t.id as usize].push(t.token);
                }
                if !core.has_unfinished() {
                    break;
                }
                out = core.step();
            }
            Ok((first_tokens, first_passes, tokens))
        };
        let (first, passes, in_passes) = run(None)?;
        assert_eq!(first, 93, "the three prompts in one step");
        assert_eq!(cfg.max_pass_tokens(), 64);
        assert_eq!(passes, 2, "40 tokens, then 33 + 20");
        let (_, passes, in_one) = run(Some(usize::MAX))?;
        assert_eq!(passes, 1);
        assert_eq!(in_passes, in_one);
        assert!(in_passes.iter().all(|t| t.len() == 6));
        Ok(())
    }

    /// A prompt whose every row is asked for (prompt logprobs) returns a row of logits per
    /// token: past the rows the memory plan sized a pass for, it runs in consecutive pieces
    /// of that many tokens, each pass's rows used before the next, and computes what one
    /// pass would.
    #[test]
    fn prompt_logprobs_past_the_planned_rows_run_in_pieces_and_compute_the_same() -> Result<()> {
        let (_tmp, lm) = tiny()?;
        let cfg = SchedulerConfig {
            chunked_prefill: false,
            ..config()
        };
        // 256 tokens a pass, each with 128 values of the MLP's intermediate and 512 of
        // vocabulary: 64 rows of logits fit where the MLP's activations were.
        let rows = crate::runtime::memory_plan::planned_logit_rows(&cfg, lm.model.config());
        assert_eq!(rows, 64);
        type Run = (usize, Vec<TokenLogprob>, Vec<u32>, Vec<u32>);
        // (the first step's passes, request 0's prompt logprobs, each request's tokens)
        let run = |max_pass_rows: usize| -> Result<Run> {
            let mut core = EngineCore::new(&lm, cfg.clone(), 0)?;
            assert_eq!(core.max_pass_rows, rows);
            core.max_pass_rows = max_pass_rows;
            let now = Instant::now();
            let mut scored = request(37, 4);
            scored.prompt_logprobs = Some(3);
            core.add(0, scored, now).unwrap();
            core.add(1, request(9, 4), now).unwrap();
            let mut out = core.step();
            let passes = core.passes_run;
            let (mut prompt, mut tokens) = (None, [Vec::new(), Vec::new()]);
            loop {
                assert!(out.failed.is_empty());
                for t in out.tokens {
                    prompt = prompt.or(t.prompt_logprobs);
                    tokens[t.id as usize].push(t.token);
                }
                if !core.has_unfinished() {
                    break;
                }
                out = core.step();
            }
            let [a, b] = tokens;
            Ok((passes, prompt.expect("prompt logprobs"), a, b))
        };
        let (passes, in_pieces, a, b) = run(2)?;
        // 37 rows in 19 pieces of 2; the last, of 1 row, samples and shares its pass with
        // the other prompt (1 row).
        assert_eq!(passes, 19);
        let (one_pass, whole, a1, b1) = run(usize::MAX)?;
        assert_eq!(one_pass, 1);
        assert_eq!((a, b), (a1, b1));
        assert_eq!(
            in_pieces.len(),
            36,
            "a logprob for each prompt token after the first"
        );
        assert_eq!(whole.len(), 36);
        for (p, w) in in_pieces.iter().zip(&whole) {
            assert_eq!(p.token, w.token);
            assert!((p.logprob - w.logprob).abs() < 1e-4, "{p:?} vs {w:?}");
            let ids = |l: &TokenLogprob| l.top.iter().map(|t| t.0).collect::<Vec<_>>();
            assert_eq!(ids(p), ids(w));
        }
        Ok(())
    }

    /// An end-of-sequence id of the generation config other than the tokenizer's own ends a
    /// request naming itself as the stop reason, as vLLM reports it; the tokenizer's own
    /// ends it with none.
    #[test]
    fn a_generation_configs_other_eos_ids_are_named_as_the_stop_reason() -> Result<()> {
        let (_tmp, lm) = tiny()?;
        let id = |t: &str| lm.tokenizer.token_to_id(t).expect("a special token");
        let (own, other) = (id("<|eot_id|>"), id("<|end_of_text|>"));
        assert!(lm.eos_token_ids.contains(&own) && lm.eos_token_ids.contains(&other));
        for (forced, reason) in [(other, Some(StopReason::Token(other))), (own, None)] {
            let mut core = EngineCore::new(&lm, config(), 0)?;
            let mut r = request(8, 5);
            r.ignore_eos = false;
            r.params.logit_bias = vec![(forced, 100.0)];
            core.add(0, r, Instant::now()).unwrap();
            let mut last = None;
            while core.has_unfinished() {
                let out = core.step();
                assert!(out.failed.is_empty());
                last = out.tokens.into_iter().last().or(last);
            }
            let last = last.expect("a token");
            assert_eq!((last.token, last.stop_reason), (forced, reason));
        }
        Ok(())
    }

    /// The graph warm-up of each bucket is a decode step of exactly that bucket, laid out as
    /// the CUDA backend lays it out, and writes only slot 0 (block 0).
    #[test]
    fn graph_warmups_are_decode_steps_of_their_bucket_writing_slot_0() {
        use crate::runtime::backend::step_inputs::{
            graph_bucket, is_decode_only, Padding, StepInputs, GRAPH_BUCKETS,
        };
        for bucket in GRAPH_BUCKETS {
            let batch = graph_warmup_batch(bucket);
            assert!(is_decode_only(&batch));
            assert_eq!(graph_bucket(batch.seqs.len(), 256), Some(bucket));
            let padding = Padding {
                bucket,
                max_blocks: 4,
            };
            let inputs = StepInputs::build(&batch, 16, 1, Some(padding)).unwrap();
            assert!(inputs.decode_only);
            let slots = &inputs.data[inputs.at.slots..][..bucket];
            assert!(slots.iter().all(|&s| s == 0), "{slots:?}");
        }
    }

    /// Capturing the graphs writes into block 0: refused once a request has come, and a no-op
    /// on the CPU.
    #[test]
    fn decode_graphs_are_captured_before_the_first_request_only() -> Result<()> {
        let (_tmp, lm) = tiny()?;
        let mut core = EngineCore::new(&lm, config(), 0)?;
        assert_eq!(core.capture_decode_graphs()?, 0, "no graphs on the CPU");
        core.add(0, request(20, 2), Instant::now()).unwrap();
        let e = core.capture_decode_graphs().unwrap_err();
        assert!(e.to_string().contains("before the first request"), "{e}");
        drain(&mut core);
        assert!(
            core.capture_decode_graphs().is_err(),
            "blocks may be cached now"
        );
        Ok(())
    }

    #[test]
    fn a_lost_device_is_fatal() -> Result<()> {
        let (_tmp, lm) = tiny()?;
        let mut core = EngineCore::new(&lm, config(), 0)?;
        core.add(0, request(20, 4), Instant::now()).unwrap();
        let lost = crate::runtime::backend::DeviceLost("CUDA_ERROR_ILLEGAL_ADDRESS".into());
        core.inject_failure = Some(anyhow::Error::new(lost).context("layer 3 attention"));
        let out = core.step();
        assert_eq!(out.failed.len(), 1);
        let fatal = out.fatal.expect("a lost device ends the engine");
        assert!(fatal.contains("unrecoverable"), "{fatal}");
        Ok(())
    }

    #[test]
    fn unseeded_requests_sample_differently_and_reproducibly() -> Result<()> {
        let (_tmp, lm) = tiny()?;
        let sample = |seed: u64| -> Result<HashMap<u64, Vec<u32>>> {
            let mut core = EngineCore::new(&lm, config(), seed)?;
            for id in 0..2 {
                let mut r = request(8, 12);
                r.params = SamplingParams {
                    temperature: 1.0,
                    ..SamplingParams::default()
                };
                core.add(id, r, Instant::now()).unwrap();
            }
            let mut out: HashMap<u64, Vec<u32>> = HashMap::new();
            while core.has_unfinished() {
                for t in core.step().tokens {
                    out.entry(t.id).or_default().push(t.token);
                }
            }
            Ok(out)
        };
        let a = sample(0)?;
        assert_ne!(a[&0], a[&1], "same prompt, no seed: different samples");
        assert_eq!(sample(0)?, a, "the same engine seed reproduces them");
        assert_ne!(sample(1)?, a);
        Ok(())
    }

    /// The device-sampling path (packed rows, the batched sampler, the tokens recorded back)
    /// gives what the host samplers give: the same greedy tokens, logprobs and alternatives,
    /// step after step, with penalties and bias moving the choices, and a grammar's mask
    /// (JSON) applied to its own row only.
    #[test]
    fn device_sampling_gives_the_host_samplers_tokens() -> Result<()> {
        let (_tmp, lm) = tiny()?;
        let json = crate::runtime::structured::GrammarCompiler::new(
            &lm.tokenizer,
            lm.config.vocab_size,
            &lm.eos_token_ids,
        )?
        .compile(&crate::runtime::structured::Grammar::json_object(true))?;
        // (request, token, logprob, alternatives, text) of every token, in order.
        type Tokens = Vec<(u64, u32, f32, Vec<(u32, f32)>, String)>;
        let run = |device: bool| -> Result<Tokens> {
            let mut core = EngineCore::new(&lm, config(), 0)?;
            core.force_device_sampling = device;
            for id in 0..3u64 {
                let mut r = request(12 + 5 * id as usize, 10);
                r.params = SamplingParams {
                    repetition_penalty: 1.2,
                    presence_penalty: 0.3 * id as f32,
                    frequency_penalty: 0.2,
                    logit_bias: vec![(17, 0.5), (23, -1.0)],
                    logprobs: Some(id as usize * 2),
                    ..SamplingParams::greedy()
                };
                // The last one writes JSON, beside the others.
                if id == 2 {
                    r.constraint = Some(json.clone());
                }
                core.add(id, r, Instant::now()).unwrap();
            }
            let mut out = Vec::new();
            while core.has_unfinished() {
                let step = core.step();
                assert!(step.failed.is_empty());
                out.extend(
                    step.tokens
                        .into_iter()
                        .map(|t| (t.id, t.token, t.logprob, t.top_logprobs, t.text)),
                );
            }
            Ok(out)
        };
        let host = run(false)?;
        assert_eq!(host.len(), 30);
        assert_eq!(run(true)?, host);
        let text = |id| -> String {
            host.iter()
                .filter(|t| t.0 == id)
                .map(|t| t.4.as_str())
                .collect()
        };
        assert!(text(2).trim_start().starts_with('{'), "{:?}", text(2));
        assert!(!text(0).trim_start().starts_with('{'), "{:?}", text(0));
        Ok(())
    }

    #[test]
    fn abort_frees_kv_and_forgets_the_request() -> Result<()> {
        let (_tmp, lm) = tiny()?;
        let mut core = EngineCore::new(&lm, config(), 0)?;
        core.add(7, request(40, 50), Instant::now()).unwrap();
        core.add(8, request(10, 3), Instant::now()).unwrap();
        core.step();
        assert!(core.stats().num_free_blocks < 64);
        assert!(core.abort(7).is_some());
        assert!(core.abort(7).is_none());
        assert_eq!(drain(&mut core), HashMap::from([(8, 2)]));
        assert_eq!(core.stats().num_free_blocks, 64);
        assert!(core.live.is_empty());
        Ok(())
    }
}
