//! The engine loop: one thread owns the model, the KV store and the core scheduler.
//! Requests arrive and tokens leave through channels; each iteration is one step:
//! `schedule` → one batched forward → sample → `complete` → stream the events.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::Result;
use infer_core::{
    AddError, Event, FinishReason, Request, RequestId, Scheduler, SchedulerConfig, StepPlan,
    StopConditions,
};
use tokio::sync::mpsc::UnboundedSender;

use super::metrics::ServerMetrics;
use crate::batch::{ForwardBatch, SeqChunk};
use crate::detokenize::{OutputStream, StopConditions as TextStops};
use crate::model::LoadedModel;
use crate::sampling::{Sampler, SamplingParams};

/// A request handed to the engine loop (already tokenised and validated).
pub struct NewRequest {
    pub id: u64,
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub params: SamplingParams,
    pub stop_strings: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub arrival: Instant,
    pub events: UnboundedSender<StreamEvent>,
}

pub enum Command {
    Add(Box<NewRequest>),
    /// The client went away: free its KV now.
    Abort(u64),
    Shutdown,
}

/// What a request's stream receives, in order: `Accepted` or `Rejected`, then one `Token`
/// per generated token — the last one carrying `finish` — or an `Error`.
#[derive(Debug, Clone, PartialEq)]
pub enum StreamEvent {
    Accepted,
    Rejected(AddError),
    Token {
        text: String,
        token: u32,
        logprob: f32,
        top_logprobs: Vec<(u32, f32)>,
        finish: Option<Finish>,
    },
    Error(String),
}

/// How a request ended, with its usage.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Finish {
    pub reason: FinishReason,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
}

struct Live {
    sampler: Sampler,
    output: OutputStream,
    events: UnboundedSender<StreamEvent>,
    arrival: Instant,
    last_token: Option<Instant>,
    want_logprobs: bool,
}

pub struct EngineLoop {
    model: LoadedModel,
    kv: crate::KvCache,
    sched: Scheduler,
    live: HashMap<u64, Live>,
    metrics: Arc<Mutex<ServerMetrics>>,
    default_seed: u64,
    start: Instant,
    step_log: Option<super::step_log::StepLog>,
}

impl EngineLoop {
    pub fn new(
        model: LoadedModel,
        cfg: SchedulerConfig,
        metrics: Arc<Mutex<ServerMetrics>>,
        seed: u64,
    ) -> Result<Self> {
        let sched = Scheduler::new(cfg);
        let kv = model
            .model
            .new_kv_cache(sched.kv().num_blocks(), sched.kv().block_size())?;
        Ok(EngineLoop {
            model,
            kv,
            sched,
            live: HashMap::new(),
            metrics,
            default_seed: seed,
            start: Instant::now(),
            step_log: None,
        })
    }

    /// Bytes of the KV store.
    pub fn kv_bytes(&self) -> usize {
        self.kv.size_bytes()
    }

    /// Trace every step from now on.
    pub fn log_steps(&mut self, log: super::step_log::StepLog) {
        self.step_log = Some(log);
    }

    /// Serve commands until `Shutdown` or until every sender is gone.
    pub fn run(mut self, rx: std::sync::mpsc::Receiver<Command>) {
        loop {
            // Idle: block for work. Busy: take what has arrived and step.
            if !self.sched.has_unfinished() {
                match rx.recv() {
                    Ok(cmd) => {
                        if !self.handle(cmd) {
                            break;
                        }
                    }
                    Err(_) => break,
                }
            }
            let mut stop = false;
            while let Ok(cmd) = rx.try_recv() {
                if !self.handle(cmd) {
                    stop = true;
                    break;
                }
            }
            if stop {
                break;
            }
            if self.sched.has_unfinished() {
                self.step();
            }
            self.metrics.lock().unwrap().sched = self.sched.stats();
        }
        // Shutdown: end whatever is still live.
        let ids: Vec<u64> = self.live.keys().copied().collect();
        for id in ids {
            self.end_with_error(id, "the server is shutting down");
        }
        if let Some(log) = &mut self.step_log {
            log.flush();
        }
    }

    fn now(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    /// False on shutdown.
    fn handle(&mut self, cmd: Command) -> bool {
        match cmd {
            Command::Add(r) => self.add(*r),
            Command::Abort(id) => {
                if self.live.remove(&id).is_some() && self.sched.abort(RequestId(id)).is_some() {
                    self.metrics.lock().unwrap().finished(FinishReason::Abort);
                }
            }
            Command::Shutdown => return false,
        }
        true
    }

    fn add(&mut self, r: NewRequest) {
        let mut eos = if r.ignore_eos {
            Vec::new()
        } else {
            self.model.eos_token_ids.clone()
        };
        eos.sort_unstable();
        let stop = StopConditions {
            max_tokens: r.max_tokens,
            ignore_eos: r.ignore_eos,
            eos_token_ids: eos,
            stop_token_ids: r.stop_token_ids.clone(),
        };
        let req = Request {
            id: RequestId(r.id),
            prompt: r.prompt.clone(),
            stop,
        };
        if let Err(e) = self
            .sched
            .add_request(req, r.arrival.duration_since(self.start).as_secs_f64())
        {
            let _ = r.events.send(StreamEvent::Rejected(e));
            return;
        }
        // Token stops and lengths are the scheduler's; the text side only handles stop strings.
        let text_stops = TextStops {
            max_tokens: usize::MAX,
            stop_token_ids: Vec::new(),
            stop: r.stop_strings,
            ignore_eos: true,
        };
        let want_logprobs = r.params.logprobs.is_some();
        let live = Live {
            sampler: Sampler::new(r.params, &r.prompt, self.default_seed),
            output: OutputStream::new(text_stops),
            events: r.events,
            arrival: r.arrival,
            last_token: None,
            want_logprobs,
        };
        let _ = live.events.send(StreamEvent::Accepted);
        self.live.insert(r.id, live);
    }

    fn step(&mut self) {
        let t_start = Instant::now();
        let plan = self.sched.schedule(self.now());
        if plan.is_empty() {
            let now = self.now();
            self.sched.complete(plan, &[], now);
            std::thread::sleep(std::time::Duration::from_millis(1));
            return;
        }
        let shape = self
            .step_log
            .is_some()
            .then(|| infer_sim::cost::StepShape::of(&plan));
        let batch = to_batch(&plan);
        let t_forward = Instant::now();
        let sampled = match self.forward_and_sample(&batch, &plan) {
            Ok(s) => s,
            Err(e) => {
                // The step failed: fail its requests, keep serving the others.
                let ids: Vec<u64> = plan.seqs.iter().map(|s| s.request.0).collect();
                let now = self.now();
                self.sched.complete(plan, &[], now).clear();
                for id in ids {
                    self.end_with_error(id, &format!("model step failed: {e:#}"));
                }
                return;
            }
        };
        let forward_s = t_forward.elapsed().as_secs_f64();
        let tokens: Vec<u32> = sampled.iter().map(|s| s.1.token).collect();
        let now = self.now();
        let events = self.sched.complete(plan, &tokens, now);
        // Before any token leaves: a client that reads /metrics on its first token must see
        // the KV its request holds.
        self.metrics.lock().unwrap().sched = self.sched.stats();
        let logprobs: HashMap<u64, crate::sampling::SampledToken> = sampled.into_iter().collect();
        let mut events = events.into_iter().peekable();
        while let Some(e) = events.next() {
            match e {
                Event::Token {
                    request,
                    token,
                    first,
                } => {
                    // The scheduler reports a finish right after the token that caused it:
                    // send both as one event, as vLLM's last chunk carries finish_reason.
                    let finish = match events.peek() {
                        Some(Event::Finished { request: r, .. }) if *r == request => match events
                            .next()
                        {
                            Some(Event::Finished { reason, stats, .. }) => Some((reason, stats)),
                            _ => None,
                        },
                        _ => None,
                    };
                    self.on_token(request.0, token, first, logprobs.get(&request.0), finish);
                }
                // Every finish follows a token; nothing else to stream.
                Event::Finished { request, .. } => {
                    self.live.remove(&request.0);
                }
            }
        }
        if let (Some(log), Some(shape)) = (&mut self.step_log, shape) {
            log.record(&super::step_log::StepRecord {
                t_s: t_start.duration_since(self.start).as_secs_f64(),
                shape,
                forward_s,
                step_s: t_start.elapsed().as_secs_f64(),
            });
        }
    }

    fn forward_and_sample(
        &mut self,
        batch: &ForwardBatch,
        plan: &StepPlan,
    ) -> Result<Vec<(u64, crate::sampling::SampledToken)>> {
        let logits = self.model.model.forward(batch, &mut self.kv)?;
        let mut out = Vec::with_capacity(logits.rows());
        let sampling = plan.seqs.iter().filter(|s| s.samples);
        for (s, row) in sampling.zip(logits.iter()) {
            let id = s.request.0;
            let live = self
                .live
                .get_mut(&id)
                .ok_or_else(|| anyhow::anyhow!("request {id} has no state"))?;
            out.push((id, live.sampler.sample(row)));
        }
        Ok(out)
    }

    fn on_token(
        &mut self,
        id: u64,
        token: u32,
        first: bool,
        sampled: Option<&crate::sampling::SampledToken>,
        mut finish: Option<(FinishReason, infer_core::RequestStats)>,
    ) {
        let now = Instant::now();
        let Some(live) = self.live.get_mut(&id) else {
            return;
        };
        {
            let mut m = self.metrics.lock().unwrap();
            m.generation_tokens += 1;
            if first {
                m.ttft
                    .observe(now.duration_since(live.arrival).as_secs_f64());
            } else if let Some(last) = live.last_token {
                m.itl.observe(now.duration_since(last).as_secs_f64());
            }
        }
        live.last_token = Some(now);
        let mut text = live
            .output
            .push(&self.model.tokenizer, token)
            .unwrap_or_default();
        if finish.is_none() && live.output.finished().is_some() {
            // A stop string matched: the scheduler ends the request now.
            finish = self
                .sched
                .finish(RequestId(id), FinishReason::Stop)
                .map(|s| (FinishReason::Stop, s));
        }
        let live = self.live.get_mut(&id).expect("checked above");
        if finish.is_some() {
            text.push_str(
                &live
                    .output
                    .finish(&self.model.tokenizer)
                    .unwrap_or_default(),
            );
        }
        let (logprob, top_logprobs) = match (live.want_logprobs, sampled) {
            (true, Some(s)) => (s.logprob, s.top_logprobs.clone()),
            _ => (0.0, Vec::new()),
        };
        let end = finish.map(|(reason, stats)| Finish {
            reason,
            prompt_tokens: stats.prompt_tokens,
            completion_tokens: stats.output_tokens,
            cached_tokens: stats.cached_tokens,
        });
        // Count a finished request before the client can see its end, so that a client
        // reading /metrics right after its last chunk sees it.
        if let Some((reason, stats)) = finish {
            let mut m = self.metrics.lock().unwrap();
            m.finished(reason);
            m.prompt_tokens += stats.prompt_tokens as u64;
            m.e2e.observe(live.arrival.elapsed().as_secs_f64());
            if let Some(t) = stats.first_scheduled_time {
                m.queue.observe((t - stats.arrival_time).max(0.0));
            }
            m.sched = self.sched.stats();
        }
        let delivered = live
            .events
            .send(StreamEvent::Token {
                text,
                token,
                logprob,
                top_logprobs,
                finish: end,
            })
            .is_ok();
        if finish.is_some() {
            self.live.remove(&id);
        } else if !delivered {
            // The client is gone: free its KV before the next step.
            self.live.remove(&id);
            self.sched.abort(RequestId(id));
            self.metrics.lock().unwrap().finished(FinishReason::Abort);
        }
    }

    fn end_with_error(&mut self, id: u64, msg: &str) {
        if let Some(live) = self.live.remove(&id) {
            let _ = live.events.send(StreamEvent::Error(msg.to_string()));
        }
        if self.sched.abort(RequestId(id)).is_some() {
            self.metrics.lock().unwrap().finished(FinishReason::Abort);
        }
    }
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
                }
            })
            .collect(),
    }
}
