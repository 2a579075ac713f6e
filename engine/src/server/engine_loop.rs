//! The serving thread: it owns the engine core and runs it, fed by channels. Requests
//! arrive as commands; each iteration takes what has arrived and runs one step; tokens
//! leave on each request's stream, and the server's metrics are updated on the way.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::Result;
use infer_core::{AddError, FinishReason, RequestStats, SchedulerConfig};

use super::metrics::ServerMetrics;
use super::outbox::Outbox;
use crate::runtime::engine_core::{
    EngineCore, EngineRequest, RequestFailure, TokenLogprob, TokenOutput,
};
use crate::runtime::model::LoadedModel;

/// A request handed to the engine loop (already tokenised and validated).
pub struct NewRequest {
    pub id: u64,
    pub request: EngineRequest,
    /// The response's choice index of its first sequence (its forks follow): a batch of
    /// prompts numbers its choices prompt by prompt, `n` each.
    pub first_index: usize,
    pub arrival: Instant,
    pub events: Outbox,
    /// A reasoning model's `</think>`: each sequence's tokens up to it (and it) are its
    /// reasoning, counted in its [`Finish`].
    pub thinking_end: Option<u32>,
}

pub enum Command {
    /// The prompts of one HTTP request, added together: each gets `Accepted` or `Rejected`
    /// before any of them runs a step.
    Add(Vec<NewRequest>),
    /// The client went away: free its KV now.
    Abort(u64),
    /// Empty the prefix cache; the answer says whether it was (not while in use).
    ResetPrefixCache(tokio::sync::oneshot::Sender<bool>),
    Shutdown,
}

/// What an HTTP request's stream receives, in order: `Accepted` or `Rejected` for each of
/// its prompts, then a `Token` per generated token of each choice (several tokens each
/// once a lagging reader's merge: see [`super::outbox`]) — a choice's last carrying
/// `finish` — or an `Error`.
#[derive(Debug, Clone, PartialEq)]
pub enum StreamEvent {
    Accepted,
    Rejected(AddError),
    Token {
        /// Which of the response's choices these tokens belong to.
        index: usize,
        text: String,
        /// The generated tokens the text came from.
        token_ids: Vec<u32>,
        /// Each token's logprobs, in order, when the request asked for them.
        logprobs: Vec<SampledLogprob>,
        finish: Option<Finish>,
        /// With a request's first token, when it asked for prompt logprobs.
        prompt_logprobs: Option<Vec<TokenLogprob>>,
        /// With the last token of a request that a stop string or stop token ended.
        stop_reason: Option<crate::runtime::engine_core::StopReason>,
    },
    Error(RequestFailure),
}

impl StreamEvent {
    /// Take a later token of the same choice into this one, as if both had come as one;
    /// hands it back if this is not a token of that choice or has ended it.
    pub fn absorb(&mut self, later: StreamEvent) -> Option<StreamEvent> {
        let StreamEvent::Token {
            index,
            text,
            token_ids,
            logprobs,
            finish: finish @ None,
            prompt_logprobs,
            stop_reason,
        } = self
        else {
            return Some(later);
        };
        match later {
            StreamEvent::Token {
                index: later_index,
                text: later_text,
                token_ids: later_tokens,
                logprobs: later_logprobs,
                finish: later_finish,
                prompt_logprobs: later_prompt,
                stop_reason: later_stop,
            } if later_index == *index => {
                text.push_str(&later_text);
                token_ids.extend(later_tokens);
                logprobs.extend(later_logprobs);
                if prompt_logprobs.is_none() {
                    *prompt_logprobs = later_prompt;
                }
                *stop_reason = later_stop;
                *finish = later_finish;
                None
            }
            other => Some(other),
        }
    }
}

/// One generated token's logprobs, with the characters of text that came with it (where a
/// completion's next `text_offset` starts).
#[derive(Debug, Clone, PartialEq)]
pub struct SampledLogprob {
    pub logprob: TokenLogprob,
    pub chars: usize,
}

/// How a request ended, with its usage.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Finish {
    pub reason: FinishReason,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
    /// Of the completion's tokens, those a reasoning model thought with (up to and with its
    /// `</think>`; all of them if it never wrote it); 0 where no thinking is counted.
    pub reasoning_tokens: usize,
}

/// A sequence's client side: where its tokens go (one channel per HTTP request, shared by
/// all its choices), and its timings for the metrics.
struct Client {
    events: Outbox,
    /// Its choice among the response's.
    index: usize,
    /// It asked for its tokens' logprobs.
    logprobs: bool,
    arrival: Instant,
    /// Its prompt's tokens, counted in `vllm:prompt_tokens` once its prefill is done.
    prompt_tokens: usize,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    /// A reasoning model's: its thinking's end token, and whether it has been sampled.
    thinking: Option<(u32, bool)>,
    /// Tokens generated while thinking.
    reasoning_tokens: usize,
}

pub struct EngineLoop {
    core: EngineCore,
    clients: HashMap<u64, Client>,
    metrics: Arc<Mutex<ServerMetrics>>,
    step_log: Option<super::step_log::StepLog>,
    /// The request path's busy clock, read at each logged step's start.
    request_path: Option<Arc<super::request_path::RequestPath>>,
    /// Where each step's prefix-cache events go (`--kv-events-config`).
    kv_events: Option<super::kv_events::EventSender>,
    health: Arc<super::health::Health>,
}

impl EngineLoop {
    pub fn new(
        model: LoadedModel,
        cfg: SchedulerConfig,
        metrics: Arc<Mutex<ServerMetrics>>,
        health: Arc<super::health::Health>,
        seed: u64,
    ) -> Result<Self> {
        Ok(EngineLoop {
            core: EngineCore::new(model, cfg, seed)?,
            clients: HashMap::new(),
            metrics,
            step_log: None,
            request_path: None,
            kv_events: None,
            health,
        })
    }

    /// Bytes of the KV store.
    pub fn kv_bytes(&self) -> usize {
        self.core.kv_bytes()
    }

    /// Captures every decode bucket's CUDA graph on the engine's KV pool (see
    /// [`EngineCore::capture_decode_graphs`]); before the first request.
    pub fn capture_decode_graphs(&mut self) -> Result<usize> {
        self.core.capture_decode_graphs()
    }

    /// Trace every step from now on, with how long `path` had been busy at its start.
    pub fn log_steps(
        &mut self,
        log: super::step_log::StepLog,
        path: Arc<super::request_path::RequestPath>,
    ) {
        self.core.trace_steps(true);
        self.step_log = Some(log);
        self.request_path = Some(path);
    }

    /// Hand the prefix cache's new events to the publisher, if there is one.
    fn flush_kv_events(&mut self) {
        if let Some(to) = &self.kv_events {
            let events = self.core.take_kv_events();
            if !events.is_empty() {
                // The publisher outlives the loop; if it is gone, events have nowhere to go.
                let _ = to.send(events);
            }
        }
    }

    /// Send each step's prefix-cache events to `to` from now on.
    pub fn publish_kv_events(&mut self, to: super::kv_events::EventSender) {
        self.core.record_kv_events();
        self.kv_events = Some(to);
    }

    /// Serve commands until `Shutdown` or until every sender is gone.
    pub fn run(mut self, rx: std::sync::mpsc::Receiver<Command>) {
        loop {
            // Idle: block for work. Busy: take what has arrived and step.
            if !self.core.has_unfinished() {
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
            if self.core.has_unfinished() && !self.step() {
                break;
            }
            self.metrics.lock().unwrap().sched = self.core.stats();
        }
        // Shutdown: end whatever is still live.
        let ids: Vec<u64> = self.clients.keys().copied().collect();
        for id in ids {
            self.end_with_error(id, "the server is shutting down");
        }
        if let Some(log) = &mut self.step_log {
            log.flush();
        }
    }

    /// False on shutdown.
    fn handle(&mut self, cmd: Command) -> bool {
        match cmd {
            Command::Add(batch) => {
                // All of an HTTP request's prompts, or none: a full queue refuses them all
                // rather than starting some that its client will then abort.
                if let Err(e) = self.core.check_waiting_room(batch.len()) {
                    for r in batch {
                        let _ = r.events.send(StreamEvent::Rejected(e.clone()));
                    }
                    return true;
                }
                for r in batch {
                    self.add(r);
                }
            }
            Command::Abort(id) => {
                if self.clients.remove(&id).is_some() && self.core.abort(id).is_some() {
                    self.metrics.lock().unwrap().finished(FinishReason::Abort);
                }
            }
            Command::ResetPrefixCache(answer) => {
                let done = self.core.reset_prefix_cache();
                self.flush_kv_events();
                let _ = answer.send(done);
            }
            Command::Shutdown => return false,
        }
        true
    }

    fn add(&mut self, r: NewRequest) {
        let max_tokens = r.request.max_tokens;
        let prompt_tokens = r.request.prompt.len();
        let logprobs = r.request.params.logprobs.is_some();
        let ids: Vec<u64> = std::iter::once(r.id)
            .chain(r.request.forks.iter().copied())
            .collect();
        if let Err(e) = self.core.add(r.id, r.request, r.arrival) {
            let _ = r.events.send(StreamEvent::Rejected(e));
            return;
        }
        let _ = r.events.send(StreamEvent::Accepted);
        {
            let mut m = self.metrics.lock().unwrap();
            m.params_n.observe(ids.len() as f64);
            m.params_max_tokens.observe(max_tokens as f64);
        }
        for (fork, id) in ids.into_iter().enumerate() {
            let client = Client {
                events: r.events.clone(),
                index: r.first_index + fork,
                logprobs,
                arrival: r.arrival,
                prompt_tokens,
                first_token: None,
                last_token: None,
                thinking: r.thinking_end.map(|end| (end, false)),
                reasoning_tokens: 0,
            };
            self.clients.insert(id, client);
        }
    }

    /// One step; false when the device is lost and the loop must stop.
    fn step(&mut self) -> bool {
        let t_start = Instant::now();
        let path_busy_s = self.request_path.as_ref().map(|p| p.busy_s(t_start));
        let out = self.core.step();
        for id in &out.ended {
            self.clients.remove(id);
        }
        if out.idle {
            std::thread::sleep(std::time::Duration::from_millis(1));
            return true;
        }
        self.flush_kv_events();
        for (id, _, error) in &out.failed {
            // The core has already ended it; the client gets the error.
            self.metrics.lock().unwrap().finished(FinishReason::Abort);
            if let Some(c) = self.clients.remove(id) {
                let _ = c.events.send(StreamEvent::Error(error.clone()));
            }
        }
        if let Some(why) = out.fatal {
            // Every later step would fail the same way: end everything and stop.
            eprintln!("error: {why}; the server stops");
            self.health.lose(why.clone());
            let ids: Vec<u64> = self.clients.keys().copied().collect();
            for id in ids {
                self.end_with_error(id, &why);
            }
            return false;
        }
        // Before any token leaves: a client that reads /metrics on its first token must see
        // the KV its request holds.
        {
            let mut m = self.metrics.lock().unwrap();
            m.sched = self.core.stats();
            m.iteration_tokens.observe(out.num_tokens as f64);
        }
        for t in out.tokens {
            self.deliver(t);
        }
        if let (Some(log), Some(shape)) = (&mut self.step_log, out.shape) {
            log.record(&super::step_log::StepRecord {
                t_s: t_start.duration_since(self.core.start()).as_secs_f64(),
                shape,
                forward_s: out.forward_s,
                constraint_s: out.constraint_s,
                step_s: t_start.elapsed().as_secs_f64(),
                path_busy_s,
            });
        }
        true
    }

    fn deliver(&mut self, t: TokenOutput) {
        let now = Instant::now();
        let Some(client) = self.clients.get_mut(&t.id) else {
            return;
        };
        {
            let mut m = self.metrics.lock().unwrap();
            m.generation_tokens += 1;
            if t.first {
                // As vLLM counts them: when the prefill is done, so that a request aborted
                // after it counts the prompt it ran, as it counts its generated tokens.
                m.prompt_tokens += client.prompt_tokens as u64;
                m.ttft
                    .observe(now.duration_since(client.arrival).as_secs_f64());
                client.first_token = Some(now);
            } else if let Some(last) = client.last_token {
                m.itl.observe(now.duration_since(last).as_secs_f64());
            }
        }
        client.last_token = Some(now);
        if let Some((end, ended)) = &mut client.thinking {
            if !*ended {
                client.reasoning_tokens += 1;
                *ended = t.token == *end;
            }
        }
        let end = t.finish.map(|(reason, stats)| Finish {
            reason,
            prompt_tokens: stats.prompt_tokens,
            completion_tokens: stats.output_tokens,
            cached_tokens: stats.cached_tokens,
            reasoning_tokens: client.reasoning_tokens,
        });
        // Count a finished request before the client can see its end, so that a client
        // reading /metrics right after its last chunk sees it.
        if let Some((reason, stats)) = &t.finish {
            self.count_finished(*reason, stats, t.id);
        }
        let client = self.clients.get(&t.id).expect("checked above");
        let logprobs = if client.logprobs {
            vec![SampledLogprob {
                logprob: TokenLogprob {
                    token: t.token,
                    logprob: t.logprob,
                    top: t.top_logprobs,
                    rank: None,
                },
                chars: t.text.chars().count(),
            }]
        } else {
            Vec::new()
        };
        let delivered = client
            .events
            .send(StreamEvent::Token {
                index: client.index,
                text: t.text,
                token_ids: vec![t.token],
                logprobs,
                finish: end,
                prompt_logprobs: t.prompt_logprobs,
                stop_reason: t.stop_reason,
            })
            .is_ok();
        if end.is_some() {
            self.clients.remove(&t.id);
        } else if !delivered {
            // The client is gone: free its KV before the next step.
            self.clients.remove(&t.id);
            self.core.abort(t.id);
            self.metrics.lock().unwrap().finished(FinishReason::Abort);
        }
    }

    /// Count a request that ended in the scheduler.
    fn count_finished(&self, reason: FinishReason, stats: &RequestStats, id: u64) {
        let mut m = self.metrics.lock().unwrap();
        m.finished(reason);
        m.request_prompt_tokens.observe(stats.prompt_tokens as f64);
        m.request_generation_tokens
            .observe(stats.output_tokens as f64);
        let now = Instant::now();
        if let Some(c) = self.clients.get(&id) {
            m.e2e.observe(now.duration_since(c.arrival).as_secs_f64());
            if let Some(first) = c.first_token {
                m.decode_time
                    .observe(now.duration_since(first).as_secs_f64());
            }
            if let Some(t) = stats.first_scheduled_time {
                // The driver's clock counts seconds from the core's start.
                let scheduled = self.core.start() + std::time::Duration::from_secs_f64(t);
                m.inference_time
                    .observe(now.saturating_duration_since(scheduled).as_secs_f64());
                if let Some(first) = c.first_token {
                    m.prefill_time
                        .observe(first.saturating_duration_since(scheduled).as_secs_f64());
                }
            }
        }
        if let Some(t) = stats.first_scheduled_time {
            m.queue.observe((t - stats.arrival_time).max(0.0));
        }
        m.sched = self.core.stats();
    }

    fn end_with_error(&mut self, id: u64, msg: &str) {
        if let Some(c) = self.clients.remove(&id) {
            let _ = c
                .events
                .send(StreamEvent::Error(RequestFailure::server(msg)));
        }
        if self.core.abort(id).is_some() {
            self.metrics.lock().unwrap().finished(FinishReason::Abort);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::backend::DeviceLost;
    use crate::runtime::sampling::SamplingParams;
    use crate::tools::make_model::{make_model, ModelSpec};
    use crate::{load_model_dir, Arch, Device};

    /// An engine loop on a generated Llama (the directory lives as long as the guard) and
    /// its health.
    fn engine(
        sched: SchedulerConfig,
    ) -> Result<(
        tempfile::TempDir,
        EngineLoop,
        Arc<super::super::health::Health>,
    )> {
        let tmp = tempfile::tempdir()?;
        let dir = tmp.path().join("llama");
        make_model(&ModelSpec::new(Arch::Llama), &dir)?;
        let lm = load_model_dir(&dir, Some(candle_core::DType::F32), Device::Cpu)?;
        let metrics = Arc::new(Mutex::new(ServerMetrics::new("m", 16, 64)));
        let health = Arc::new(super::super::health::Health::default());
        let engine = EngineLoop::new(lm, sched, metrics, health.clone(), 0)?;
        Ok((tmp, engine, health))
    }

    /// Request `id`: 20 prompt tokens, `max_tokens` generated (EOS ignored), its events
    /// to `events`.
    fn request(id: u64, params: SamplingParams, max_tokens: usize, events: Outbox) -> NewRequest {
        NewRequest {
            id,
            request: EngineRequest {
                prompt: (0..20).map(|i| 10 + i).collect(),
                params,
                max_tokens,
                stop_strings: Default::default(),
                stop_token_ids: Vec::new(),
                ignore_eos: true,
                keep_special_tokens: false,
                forks: Vec::new(),
                prompt_logprobs: None,
                constraint: None,
                priority: 0,
            },
            first_index: 0,
            arrival: Instant::now(),
            events,
            thinking_end: None,
        }
    }

    /// A request whose reader reads nothing runs to its end (the loop never waits on a
    /// reader), and what queues for it merges: `MERGE_AFTER` token events, holding every
    /// token's text and logprobs in order.
    #[test]
    fn an_unread_request_runs_to_its_end_and_its_tokens_merge() -> Result<()> {
        use super::super::outbox::MERGE_AFTER;
        let (_dir, mut engine, _) = engine(SchedulerConfig {
            num_gpu_blocks: 64,
            max_model_len: 512,
            ..SchedulerConfig::default()
        })?;
        let tokens = 4 * MERGE_AFTER;
        let (tx, mut rx) = super::super::outbox::outbox();
        let mut params = SamplingParams::greedy();
        params.logprobs = Some(2);
        engine.add(request(0, params, tokens, tx));
        let mut steps = 0;
        while !engine.clients.is_empty() {
            assert!(engine.step());
            steps += 1;
            assert!(steps <= 2 * tokens, "the request did not end");
        }
        let events: Vec<StreamEvent> = std::iter::from_fn(|| rx.try_recv()).collect();
        assert_eq!(events[0], StreamEvent::Accepted);
        assert_eq!(
            events.len(),
            1 + MERGE_AFTER,
            "Accepted, then merged tokens"
        );
        let (mut count, mut logprobs, mut end) = (0, Vec::new(), None);
        for e in &events[1..] {
            let StreamEvent::Token {
                token_ids,
                logprobs: l,
                finish,
                ..
            } = e
            else {
                panic!("{e:?}")
            };
            assert!(end.is_none(), "nothing after the end");
            count += token_ids.len();
            logprobs.extend(l.iter().map(|l| (l.logprob.token, l.logprob.top.len())));
            end = *finish;
        }
        assert_eq!(count, tokens);
        assert_eq!(end.map(|f| f.completion_tokens), Some(tokens));
        assert_eq!(logprobs.len(), tokens);
        assert!(logprobs.iter().all(|&(_, top)| top == 2));
        Ok(())
    }

    /// A lost device ends every request, not only the step's, marks the server unhealthy and
    /// stops the loop.
    #[test]
    fn a_lost_device_stops_the_loop_and_marks_the_server_unhealthy() -> Result<()> {
        let (_dir, mut engine, health) = engine(SchedulerConfig {
            max_batch_size: 1,
            num_gpu_blocks: 64,
            max_model_len: 256,
            ..SchedulerConfig::default()
        })?;
        let mut streams = Vec::new();
        for id in [0, 10] {
            let (tx, rx) = super::super::outbox::outbox();
            engine.add(request(id, SamplingParams::greedy(), 4, tx));
            streams.push(rx);
        }
        // A step that works, then one whose device is lost.
        assert!(engine.step());
        assert!(health.lost().is_none());
        let lost = DeviceLost("CUDA_ERROR_ILLEGAL_ADDRESS".into());
        engine.core.inject_failure = Some(anyhow::Error::new(lost));
        assert!(!engine.step(), "the loop stops");
        assert!(health.lost().is_some_and(|w| w.contains("unrecoverable")));
        // Both requests end with the reason: the running one and the one still waiting.
        for rx in &mut streams {
            let mut last = None;
            while let Some(e) = rx.try_recv() {
                last = Some(e);
            }
            match last {
                Some(StreamEvent::Error(e)) => {
                    assert_eq!(e.cause, crate::runtime::engine_core::FailureCause::Server);
                    assert!(e.message.contains("unrecoverable"), "{e}")
                }
                other => panic!("expected an error, got {other:?}"),
            }
        }
        assert!(engine.clients.is_empty());
        Ok(())
    }
}
