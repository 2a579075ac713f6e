//! The discrete-event loop: clients, a router and replicas on one logical clock.
//!
//! Events, ordered by (time, class, sequence number) so that ties replay exactly:
//!
//! * class 0, client side: an open-loop arrival (the request is routed as it is sent); a
//!   request reaching its replica's scheduler after the replica's request path (HTTP,
//!   tokenisation; one request at a time, in the order routed there), where it is queued;
//!   a client seeing a request finish (closed-loop clients then send their next one);
//! * class 1: a replica starts a step — after every client event of the same instant, so
//!   requests arriving together are batched together;
//! * class 2: a timeseries sample.
//!
//! A replica repeats `schedule(now)` → cost model → `complete(plan, sampled, now + dt)` while
//! it has work, and idles otherwise. Where the cost model has a spread of served steps
//! (a profile's), `dt` is the typical time times a factor drawn from it; where it has a
//! step jitter, `dt` adds a pause; each drawn from its own stream seeded by the workload's
//! seed, in event order. Clients: open-loop arrivals (optionally capped at
//! `max_concurrency` in flight, arrivals beyond the cap waiting in order) and closed-loop
//! ones (sequential = 1 client, `concurrency` = N) are one mechanism: closed-loop requests
//! all "arrive" at the start and the cap releases them. Warm-up requests run first, one at
//! a time, and are not measured; the measured run's clock starts when they are done.
//!
//! Memory follows the requests in flight, not the run: arrival times are drawn and prompts
//! generated as they are sent, prompts live only from send to admission (the scheduler
//! then owns the tokens), and a request's metrics are folded into the summary and handed
//! to a [`RunSink`] (a run directory, or memory) when it ends.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, VecDeque};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rustc_hash::{FxHashMap, FxHashSet};
use std::sync::Arc;

use infer_core::metrics::{MetricsRecorder, RequestRecord, Summary, TimePoint, Timeline};
use infer_core::router::{ReplicaSnapshot, RouteRequest, Router};
use infer_core::scheduler::whole_sequence_passes;
use infer_core::workload::{
    ApproxTokenizer, ArrivalKind, ArrivalTimes, GeneratedRequest, Tokenizer, WorkloadGenerator,
};
use infer_core::{
    AddOptions, BatchingMode, Event, Request, Scheduler, SlotPasses, StepPlan, StopConditions,
};

use crate::catalog::GIB;
use crate::cost::{
    AfterIdle, AfterPrefill, ClientPath, CostModel, SincePrefill, StepShape, StepSpread,
};
use crate::error::SimError;
use crate::memory::ActivationPeak;
use crate::setup::Setup;
use crate::stages::{StageRow, StageTally};

/// A run's figures (its rows went to a [`RunSink`]).
#[derive(Debug, Clone)]
pub struct SimResult {
    pub summary: Summary,
    pub stats: RunStats,
    /// One per stage of a staged arrival schedule, else empty.
    pub stages: Vec<StageRow>,
    /// Why requests failed, in a few lines (empty when none did).
    pub failures: Vec<String>,
}

/// Where a run's rows go as they are produced: one record per measured request when it
/// ends (in finishing order), one timeseries point per replica and sample.
pub trait RunSink {
    fn request(&mut self, r: RequestRecord);
    fn sample(&mut self, p: TimePoint);
    /// Why the rows can no longer be kept (a full disk, an output limit): the run stops
    /// with this as its error.
    fn stop_reason(&self) -> Option<String> {
        None
    }
}

/// Rows kept in memory (tests, small runs).
#[derive(Debug, Clone, Default)]
pub struct Rows {
    /// Sorted by id once the run is over.
    pub records: Vec<RequestRecord>,
    pub timeseries: Vec<TimePoint>,
}

impl RunSink for Rows {
    fn request(&mut self, r: RequestRecord) {
        self.records.push(r);
    }

    fn sample(&mut self, p: TimePoint) {
        self.timeseries.push(p);
    }
}

/// Rows no one asked for.
struct Discard;

impl RunSink for Discard {
    fn request(&mut self, _: RequestRecord) {}
    fn sample(&mut self, _: TimePoint) {}
}

/// Run-wide figures beyond the summary (the console's extra line).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct RunStats {
    pub replicas: usize,
    pub steps: u64,
    pub peak_kv_usage: f64,
    pub mean_kv_usage: f64,
    pub peak_waiting: usize,
    pub mean_waiting: f64,
    pub mean_queue_time: f64,
    pub prefix_queries: u64,
    pub prefix_hits: u64,
    pub preemptions: u64,
    /// Steps sequences skipped waiting for a free block (`server.kv_preemption = "wait"`).
    pub kv_waits: u64,
    /// The largest step's activations on any replica, bytes per GPU.
    pub peak_activation_bytes: f64,
    /// Device memory spilled to the host at the end of the run (largest replica).
    pub spilled_bytes: f64,
}

impl RunStats {
    pub fn prefix_hit_rate(&self) -> f64 {
        if self.prefix_queries == 0 {
            0.0
        } else {
            self.prefix_hits as f64 / self.prefix_queries as f64
        }
    }

    /// Two lines: KV use, queueing and prefix hits; preemptions, steps and activations.
    pub fn lines(&self) -> String {
        let spill = if self.spilled_bytes > 0.0 {
            format!(
                " | activations peak {:.2} GiB, {:.2} GiB spilled to the host",
                self.peak_activation_bytes / GIB,
                self.spilled_bytes / GIB
            )
        } else if self.peak_activation_bytes > 0.0 {
            format!(
                " | activations peak {:.2} GiB",
                self.peak_activation_bytes / GIB
            )
        } else {
            String::new()
        };
        // No lookups: prefix caching is off (or no prompt ran).
        let prefix = if self.prefix_queries == 0 {
            "prefix cache not looked up".to_string()
        } else {
            format!(
                "prefix cache {} of {} prompt tokens hit ({:.1}%)",
                self.prefix_hits,
                self.prefix_queries,
                self.prefix_hit_rate() * 100.0
            )
        };
        format!(
            "KV usage peak {:.1}% mean {:.1}% | waiting peak {} mean {:.1}, queue time mean {:.1} ms | \
             {prefix}\npreemptions {}{} | steps {} on {} replica(s){}",
            self.peak_kv_usage * 100.0,
            self.mean_kv_usage * 100.0,
            self.peak_waiting,
            self.mean_waiting,
            self.mean_queue_time * 1e3,
            self.preemptions,
            if self.kv_waits > 0 {
                format!(", waits for a block {}", self.kv_waits)
            } else {
                String::new()
            },
            self.steps,
            self.replicas,
            spill
        )
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ev {
    Arrival,
    ServerIn(u64),
    /// Request `id`'s client saw its end (its last token, or its error).
    ClientDone(u64),
    StepStart(usize),
    StepEnd(usize),
    Sample,
}

impl Ev {
    fn class(self) -> u8 {
        match self {
            Ev::Arrival | Ev::ServerIn(_) | Ev::ClientDone(_) => 0,
            Ev::StepStart(_) | Ev::StepEnd(_) => 1,
            Ev::Sample => 2,
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    time: f64,
    class: u8,
    seq: u64,
    ev: Ev,
}

impl PartialEq for Entry {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Entry {}
impl PartialOrd for Entry {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Entry {
    /// Reversed: `BinaryHeap` pops the greatest, we want the earliest.
    fn cmp(&self, o: &Self) -> Ordering {
        o.time
            .total_cmp(&self.time)
            .then(o.class.cmp(&self.class))
            .then(o.seq.cmp(&self.seq))
    }
}

struct Replica {
    sched: Scheduler,
    /// A step is running or about to start.
    busy: bool,
    /// When the replica last ran out of work (`None`: it has not, or has started since).
    idle_since: Option<f64>,
    plan: Option<StepPlan>,
    /// (time, state) as the router sees it after `metrics_delay_s`.
    history: VecDeque<(f64, ReplicaSnapshot)>,
    activations: ActivationPeak,
    /// When the server's request path (HTTP, tokenisation) is next free. It takes requests
    /// one at a time, in the order they were routed to it, as vLLM's and SGLang's tokenizer
    /// process do by default, and this engine's tokenizer lane on a machine of 2-3 cores.
    /// Were each request's path its own, a burst would reach the scheduler shortest prompt
    /// first: every prompt sent at once, each arriving after its own tokenisation. A
    /// scheduler that serves first come first served then admits the shortest half first,
    /// and a burst's median TTFT came out 26% short of the served one.
    request_path_free: f64,
    /// Where its steps stand after its last one with prompt tokens.
    since_prefill: SincePrefill,
}

impl Replica {
    fn snapshot(&self) -> ReplicaSnapshot {
        let s = self.sched.stats();
        ReplicaSnapshot {
            waiting: s.num_waiting,
            running: s.num_running,
            kv_usage: s.kv_usage,
        }
    }

    fn record(&mut self, now: f64, delay: f64) {
        if delay > 0.0 {
            let snap = self.snapshot();
            self.history.push_back((now, snap));
            self.snapshot_at(now - delay); // forget what no one can ask for any more
        }
    }

    /// The state as of `t` (the newest record not after it).
    fn snapshot_at(&mut self, t: f64) -> ReplicaSnapshot {
        while self.history.len() >= 2 && self.history[1].0 <= t {
            self.history.pop_front();
        }
        match self.history.front() {
            Some(&(at, s)) if at <= t => s,
            _ => ReplicaSnapshot::default(),
        }
    }
}

/// The release schedule of the measured requests.
struct Clients {
    /// Requests to send: `num_requests`, or fewer once a staged schedule has ended.
    count: usize,
    /// Arrival offsets from the measured start; `None` = closed loop (all at once).
    times: Option<ArrivalTimes>,
    cap: usize,
    arrived: usize,
    next_send: usize,
    in_flight: usize,
    /// Conversations' turns waiting for the turn before them to end.
    turns: TurnGate,
}

/// A conversation's next turn is sent only once its previous turn has ended, as a chat
/// client sends it (its prompt holds the reply). A turn that arrives while the one before
/// is in flight waits, holding its client's place among `max_concurrency` (the client is
/// busy with its conversation), and is sent when that one ends. `engine bench` waits alike.
#[derive(Default)]
struct TurnGate {
    /// The conversations with a turn in flight, and each such turn's conversation (by
    /// request id).
    in_flight: FxHashSet<usize>,
    conversation_of: FxHashMap<u64, usize>,
    /// Turns waiting, in arrival order, per conversation.
    held: FxHashMap<usize, std::collections::VecDeque<GeneratedRequest>>,
}

impl TurnGate {
    /// Whether `req` may be sent now; if not, it is held.
    fn admit(&mut self, req: GeneratedRequest) -> Option<GeneratedRequest> {
        let Some((c, _)) = req.turn else {
            return Some(req);
        };
        if self.in_flight.contains(&c) {
            self.held.entry(c).or_default().push_back(req);
            return None;
        }
        self.in_flight.insert(c);
        self.conversation_of.insert(req.index as u64, c);
        Some(req)
    }

    /// Request `id` ended: the next turn of its conversation, if one waits, now in flight.
    fn ended(&mut self, id: u64) -> Option<GeneratedRequest> {
        let c = self.conversation_of.remove(&id)?;
        self.in_flight.remove(&c);
        let next = self.held.get_mut(&c)?.pop_front()?;
        self.in_flight.insert(c);
        self.conversation_of.insert(next.index as u64, c);
        Some(next)
    }
}

/// The pending events, earliest first.
#[derive(Default)]
struct EventQueue {
    heap: BinaryHeap<Entry>,
    /// Pushes so far: the tie-breaker that makes equal times replay in push order.
    seq: u64,
}

impl EventQueue {
    fn push(&mut self, time: f64, ev: Ev) {
        self.seq += 1;
        self.heap.push(Entry {
            time,
            class: ev.class(),
            seq: self.seq,
            ev,
        });
    }

    fn pop(&mut self) -> Option<Entry> {
        self.heap.pop()
    }

    /// When the next event happens.
    fn next_time(&self) -> Option<f64> {
        self.heap.peek().map(|e| e.time)
    }
}

/// The replicas and the router in front of them.
struct Cluster {
    replicas: Vec<Replica>,
    router: Option<Router>,
    /// How old the replica state is that the router sees.
    metrics_delay: f64,
    /// Static batching: an idle replica's wait before a batch starts.
    batch_window: f64,
    /// Scratch, reused per routed request: the replicas as the router sees them.
    snapshots: Vec<ReplicaSnapshot>,
    /// The scenario has a `[cluster]` (records then name their replica).
    configured: bool,
}

impl Cluster {
    /// The replica that takes `req` arriving at `now`.
    fn route(&mut self, req: &GeneratedRequest, now: f64) -> usize {
        let Some(router) = &mut self.router else {
            return 0;
        };
        let delay = self.metrics_delay;
        let snaps = &mut self.snapshots;
        snaps.clear();
        if router.kind().reads_replica_state() {
            snaps.extend(self.replicas.iter_mut().map(|rep| {
                if delay > 0.0 {
                    rep.snapshot_at(now - delay)
                } else {
                    rep.snapshot()
                }
            }));
        } else {
            // Not read: visiting every replica would make each request cost
            // O(replicas) cache misses.
            snaps.resize(self.replicas.len(), ReplicaSnapshot::default());
        }
        let replicas = &self.replicas;
        let cached = |r: usize, hashes: &[u64]| replicas[r].sched.kv().cached_prefix_blocks(hashes);
        let route = RouteRequest {
            prompt_ids: &req.prompt_ids,
            prompt_text: &req.prompt,
        };
        router.route(&route, snaps, &cached)
    }

    /// Replica `r` no longer holds a request (the router's load count).
    fn finished(&mut self, r: usize) {
        if let Some(router) = &mut self.router {
            router.finished(r);
        }
    }

    /// (prefix queries, prefix hits, preemptions, waits for a block) over all replicas.
    fn counters(&self) -> (u64, u64, u64, u64) {
        self.replicas.iter().fold((0, 0, 0, 0), |acc, r| {
            let s = r.sched.stats();
            (
                acc.0 + s.prefix_queries,
                acc.1 + s.prefix_hits,
                acc.2 + s.num_preemptions,
                acc.3 + s.num_kv_waits,
            )
        })
    }
}

/// The run-wide figures as they accumulate.
#[derive(Default)]
struct Tally {
    stats: RunStats,
    /// Sums over the timeseries samples (one per replica and sample), for the means.
    kv_sum: f64,
    waiting_sum: f64,
    samples: u64,
    queue_sum: f64,
    queue_n: u64,
    /// Counters at the measured start, to subtract.
    base: (u64, u64, u64, u64),
}

impl Tally {
    /// The figures at the end, given the counters then.
    fn finish(mut self, (q, h, p, w): (u64, u64, u64, u64)) -> RunStats {
        self.stats.prefix_queries = q - self.base.0;
        self.stats.prefix_hits = h - self.base.1;
        self.stats.preemptions = p - self.base.2;
        self.stats.kv_waits = w - self.base.3;
        let n = (self.samples * self.stats.replicas as u64).max(1) as f64;
        self.stats.mean_kv_usage = self.kv_sum / n;
        self.stats.mean_waiting = self.waiting_sum / n;
        self.stats.mean_queue_time = if self.queue_n > 0 {
            self.queue_sum / self.queue_n as f64
        } else {
            0.0
        };
        self.stats
    }
}

struct Sim<'a> {
    gen: WorkloadGenerator,
    sink: &'a mut dyn RunSink,
    /// The sink asked to stop when it took a request.
    sink_stopped: bool,
    stages: Option<StageTally>,
    cost: Arc<dyn CostModel>,
    client: ClientPath,
    cluster: Cluster,
    ignore_eos: bool,
    events: EventQueue,
    clients: Clients,
    /// Warm-up requests to run first, one at a time, and how many have ended.
    warmups: usize,
    warmups_done: usize,
    /// Absolute time the measured run started (`None` during warm-up).
    t0: Option<f64>,
    /// Requests on their way to a replica's scheduler, with the replica.
    transit: FxHashMap<u64, (GeneratedRequest, usize)>,
    /// Per-step scratch, reused: the sampled tokens.
    sampled: Vec<u32>,
    live: FxHashSet<u64>,
    /// Live requests whose output follows a grammar (structured output).
    constrained: FxHashSet<u64>,
    metrics: MetricsRecorder,
    interval: f64,
    tally: Tally,
    last_done: f64,
    noise: StepNoise,
    limits: Limits,
    /// Prompt tokens (plus a per-request allowance) generated since memory was last looked
    /// at: the events between two periodic looks can generate any number of requests at
    /// once (a closed loop of many clients sends them all at its start).
    generated_since_check: usize,
    /// The resident bytes seen past the limit while requests were generated: nothing more
    /// is sent, and the event loop ends the run with the error.
    over_memory: Option<u64>,
}

/// What a run may reach before it ends with an error (`[sim]`'s bounds): a run that would
/// go on for ever or outgrow the machine is a mistake in its input, and must say so.
struct Limits {
    /// The scenario file, for the error.
    file: String,
    max_simulated_s: f64,
    max_memory_bytes: u64,
}

impl Limits {
    /// Events between two looks at the sink and at the process's memory: often enough to
    /// stop well before a limit is far behind, rarely enough to cost nothing.
    const CHECK_EVERY: u64 = 1 << 12;
    /// Prompt tokens generated between two looks at memory: about 8 MiB of token ids and
    /// text, so generation passes the limit by about that much at most (one look costs
    /// tens of microseconds; generating this many tokens, milliseconds).
    const CHECK_EVERY_TOKENS: usize = 1 << 20;
    /// What a request holds beyond its prompt (its entries in the maps of requests in
    /// transit and live, its metrics), counted as this many prompt tokens, so that a
    /// stream of tiny prompts is looked at too.
    const REQUEST_AS_TOKENS: usize = 64;

    /// The resident bytes, where they are past the limit.
    fn over_memory(&self) -> Option<u64> {
        resident_bytes().filter(|&rss| rss > self.max_memory_bytes)
    }

    fn exceeded(&self, key: &str, reason: String) -> SimError {
        infer_core::workload::ScenarioError {
            file: self.file.clone(),
            key: key.to_string(),
            reason,
        }
        .into()
    }
}

/// The process's resident memory, where the system tells it (Linux).
fn resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// What a step takes beyond its typical time: a factor drawn from the cost model's spread
/// of served steps (or, for the first step after an idle spell, the cost model's factor
/// for it), a random host pause (exponential with the cost model's mean), and, for the
/// decode steps just after a prefill, the cost model's extra seconds for them. Each random
/// one drawn from its own stream, only where the cost model has it, so that a run without
/// them is exactly what it was before they existed.
struct StepNoise {
    jitter_mean_s: f64,
    jitter: ChaCha8Rng,
    spread: Option<(StepSpread, ChaCha8Rng)>,
    after_idle: Option<AfterIdle>,
    after_prefill: Option<AfterPrefill>,
}

impl StepNoise {
    fn new(cost: &dyn CostModel, seed: u64) -> StepNoise {
        // Their own streams: arrivals and prompts draw the same with and without them.
        const JITTER: u64 = 0x57e9_7177_e500_0001;
        const SPREAD: u64 = 0x57e9_5b7e_add0_0002;
        StepNoise {
            jitter_mean_s: cost.step_jitter(),
            jitter: ChaCha8Rng::seed_from_u64(seed ^ JITTER),
            spread: cost.step_spread().map(|s| {
                (
                    s.scaled_to_mean_one(),
                    ChaCha8Rng::seed_from_u64(seed ^ SPREAD),
                )
            }),
            after_idle: cost.after_idle(),
            after_prefill: cost.after_prefill().cloned(),
        }
    }

    /// Extra seconds of a decode step that stands `at` after a prefill.
    fn after_prefill(&self, at: SincePrefill) -> f64 {
        self.after_prefill.as_ref().map_or(0.0, |a| a.extra(at))
    }

    /// A step of typical time `typical_s`, after `idle_s` seconds without work (`None`:
    /// straight after another step): its time, and the seconds of pause after it.
    fn draw(&mut self, typical_s: f64, idle_s: Option<f64>) -> (f64, f64) {
        let mut t = typical_s;
        let cold = self
            .after_idle
            .filter(|a| idle_s.is_some_and(|i| i >= a.idle_s));
        if let Some(a) = cold {
            t *= a.factor;
        } else if let Some((spread, rng)) = &mut self.spread {
            t *= spread.factor(typical_s, rng.gen());
        }
        let mut pause = 0.0;
        if self.jitter_mean_s > 0.0 {
            let u: f64 = self.jitter.gen();
            pause = -self.jitter_mean_s * (1.0 - u).ln();
        }
        (t, pause)
    }
}

/// The approximate tokenizer (about four characters per token) of the catalog model.
pub fn approx_tokenizer(setup: &Setup) -> Arc<dyn Tokenizer> {
    Arc::new(ApproxTokenizer {
        vocab_size: setup.model.vocab.min(u32::MAX as usize) as u32,
    })
}

/// Simulate the scenario of `setup` for its figures only.
pub fn run(setup: &Setup) -> Result<SimResult, SimError> {
    run_with(setup, approx_tokenizer(setup), &mut Discard)
}

/// Simulate and keep the rows in memory, records sorted by id.
pub fn run_collect(setup: &Setup) -> Result<(SimResult, Rows), SimError> {
    let mut rows = Rows::default();
    let result = run_with(setup, approx_tokenizer(setup), &mut rows)?;
    rows.records.sort_by_key(|r| r.id);
    Ok((result, rows))
}

/// Simulate with prompts cut by `tokenizer` (a real model's, when the prediction is to be
/// compared with that model served by the engine), handing rows to `sink` as they come.
/// A run that passes one of `[sim]`'s bounds (simulated time, memory, or what `sink` can
/// hold) ends with an error naming it.
pub fn run_with(
    setup: &Setup,
    tokenizer: Arc<dyn Tokenizer>,
    sink: &mut dyn RunSink,
) -> Result<SimResult, SimError> {
    let sc = &setup.scenario;
    let cfg = sc.server.scheduler_config();
    let mut gen = WorkloadGenerator::new(sc.workload.clone(), tokenizer);
    if let Some(trace) = &setup.trace {
        gen = gen.with_trace(trace.clone());
    }
    let arrivals = gen.arrivals(&sc.arrival);
    let count = sc.workload.num_requests;
    let n_replicas = sc.cluster.as_ref().map_or(1, |c| c.replicas);
    let router = sc
        .cluster
        .as_ref()
        .map(|c| Router::new(c.router, c.replicas, cfg.block_size, c.router_seed));
    let limits = Limits {
        file: setup.file.clone(),
        max_simulated_s: setup.settings.max_simulated_s(),
        max_memory_bytes: setup.settings.max_memory_bytes(),
    };
    let mut replicas = Vec::with_capacity(n_replicas);
    for i in 0..n_replicas {
        replicas.push(Replica {
            sched: Scheduler::new(cfg.clone()).without_block_tables(),
            busy: false,
            idle_since: None,
            plan: None,
            history: VecDeque::new(),
            activations: ActivationPeak::new(&setup.memory),
            request_path_free: 0.0,
            since_prefill: SincePrefill::default(),
        });
        // Each replica's KV pool is built whole before the first event: look after each,
        // so that a cluster of large pools stops one pool past the limit, not all of them.
        if let Some(rss) = limits.over_memory() {
            return Err(limits.exceeded(
                "sim.max_memory_mib",
                format!(
                    "the simulator's memory reached {} MiB building replica {} of {n_replicas} \
                     (a KV pool of {} blocks each), beyond the limit of {} MiB: fewer blocks \
                     or replicas (server.num_gpu_blocks, cluster.replicas), or raise the limit",
                    rss >> 20,
                    i + 1,
                    cfg.num_gpu_blocks,
                    limits.max_memory_bytes >> 20
                ),
            ));
        }
    }
    let mut sim = Sim {
        cost: setup.cost.clone(),
        client: setup.cost.client_path(),
        cluster: Cluster {
            replicas,
            router,
            metrics_delay: sc.cluster.as_ref().map_or(0.0, |c| c.metrics_delay_s),
            batch_window: setup.cost.static_batch_window(),
            snapshots: Vec::new(),
            configured: sc.cluster.is_some(),
        },
        ignore_eos: sc.workload.ignore_eos,
        events: EventQueue::default(),
        clients: Clients {
            count,
            times: arrivals.times,
            cap: arrivals.max_concurrency.unwrap_or(usize::MAX),
            arrived: 0,
            next_send: 0,
            in_flight: 0,
            turns: TurnGate::default(),
        },
        warmups: sc.workload.warmup_requests,
        warmups_done: 0,
        t0: None,
        transit: FxHashMap::default(),
        sampled: Vec::new(),
        live: FxHashSet::default(),
        constrained: FxHashSet::default(),
        metrics: MetricsRecorder::new().with_slo(sc.slo),
        interval: setup.settings.timeseries_interval(),
        sink,
        sink_stopped: false,
        stages: (sc.arrival.kind == ArrivalKind::Stages).then(|| StageTally::new(&sc.arrival)),
        tally: Tally {
            stats: RunStats {
                replicas: n_replicas,
                ..RunStats::default()
            },
            ..Tally::default()
        },
        last_done: 0.0,
        noise: StepNoise::new(setup.cost.as_ref(), sc.workload.seed),
        limits,
        generated_since_check: 0,
        over_memory: None,
        gen,
    };
    sim.start();
    sim.event_loop()?;
    Ok(sim.finish(arrivals.max_concurrency))
}

impl Sim<'_> {
    fn push(&mut self, time: f64, ev: Ev) {
        self.events.push(time, ev);
    }

    fn start(&mut self) {
        if self.warmups > 0 {
            self.send(self.gen.warmup_request(0), 0.0);
        } else {
            self.start_measured(0.0);
        }
    }

    fn start_measured(&mut self, now: f64) {
        self.t0 = Some(now);
        self.tally.base = self.cluster.counters();
        match self.clients.times.as_mut().map(Iterator::next) {
            Some(Some(first)) => self.push(now + first, Ev::Arrival),
            Some(None) => self.clients.count = 0,
            None => self.clients.arrived = self.clients.count,
        }
        self.release(now);
        self.push(now, Ev::Sample);
    }

    /// Whether request `id` is one of the measured run's (not a warm-up, not past the end of
    /// a staged schedule).
    fn measured(&self, id: u64) -> bool {
        self.t0.is_some() && (id as usize) < self.clients.count
    }

    fn rel(&self, t: f64) -> f64 {
        t - self.t0.unwrap_or(0.0)
    }

    /// Send waiting arrivals while the concurrency cap allows.
    fn release(&mut self, now: f64) {
        while self.clients.next_send < self.clients.arrived
            && self.clients.in_flight < self.clients.cap
            && self.over_memory.is_none()
        {
            let req = self.gen.request(self.clients.next_send);
            self.clients.next_send += 1;
            self.clients.in_flight += 1;
            if let Some(req) = self.clients.turns.admit(req) {
                self.send_measured(req, now);
            }
        }
    }

    /// Send a measured request, its clock starting now.
    fn send_measured(&mut self, req: GeneratedRequest, now: f64) {
        let id = req.index as u64;
        self.metrics.start(id, self.rel(now), req.prompt_ids.len());
        self.metrics.set_priority(id, req.priority);
        self.send(req, now);
    }

    fn send(&mut self, req: GeneratedRequest, now: f64) {
        let id = req.index as u64;
        self.generated_since_check += req.prompt_ids.len() + Limits::REQUEST_AS_TOKENS;
        if self.generated_since_check >= Limits::CHECK_EVERY_TOKENS {
            self.generated_since_check = 0;
            self.over_memory = self.limits.over_memory();
        }
        // A router in front of the replicas routes a request as it comes; the replica's
        // own request path then takes it.
        let r = self.cluster.route(&req, now);
        let path = &mut self.cluster.replicas[r].request_path_free;
        let at = now.max(*path) + self.client.request_delay(req.prompt_ids.len());
        *path = at;
        self.transit.insert(id, (req, r));
        self.push(at, Ev::ServerIn(id));
    }

    fn event_loop(&mut self) -> Result<(), SimError> {
        self.check_limits()?;
        let mut handled: u64 = 0;
        while let Some(e) = self.events.pop() {
            let now = e.time;
            handled += 1;
            if self.sink_stopped
                || self.over_memory.is_some()
                || handled.is_multiple_of(Limits::CHECK_EVERY)
            {
                self.check_limits()?;
            }
            let t = self.rel(now);
            if t > self.limits.max_simulated_s || t.is_nan() {
                let done = self.clients.next_send - self.clients.in_flight;
                let unfinished = self.clients.count.saturating_sub(done);
                return Err(self.limits.exceeded(
                    "sim.max_simulated_s",
                    format!(
                        "the run reached {:.3e} s of simulated time with {unfinished} requests \
                         unfinished, beyond the limit of {} s: an arrival rate, trace time, \
                         time_scale or [sim] cost is far off (raise the limit if not)",
                        t,
                        crate::settings::readable(self.limits.max_simulated_s)
                    ),
                ));
            }
            match e.ev {
                Ev::Arrival => self.on_arrival(now),
                Ev::ServerIn(id) => self.on_server_in(id, now),
                Ev::ClientDone(id) => self.on_client_done(id, now),
                Ev::StepStart(r) => self.on_step_start(r, now),
                Ev::StepEnd(r) => self.on_step_end(r, now),
                Ev::Sample => self.on_sample(now),
            }
        }
        Ok(())
    }

    /// The bounds that are costly to look at: what the sink can hold, and memory.
    fn check_limits(&self) -> Result<(), SimError> {
        if let Some(reason) = self.sink.stop_reason() {
            return Err(SimError::Output(reason));
        }
        let max = self.limits.max_memory_bytes;
        // Generation that saw the limit passed stopped sending: the run ends here even if
        // memory has since dropped, as it cannot go on with requests left unsent.
        match self.over_memory.or_else(resident_bytes) {
            Some(rss) if rss > max => {
                let waiting: usize = self
                    .cluster
                    .replicas
                    .iter()
                    .map(|r| r.sched.stats().num_waiting)
                    .sum();
                Err(self.limits.exceeded(
                    "sim.max_memory_mib",
                    format!(
                        "the simulator's memory reached {} MiB, beyond the limit of {} MiB \
                         ({waiting} requests waiting, {} in flight): bound the backlog \
                         (server.max_waiting, arrival.max_concurrency), shorten the run, or \
                         raise the limit",
                        rss >> 20,
                        max >> 20,
                        self.live.len() + self.transit.len()
                    ),
                ))
            }
            _ => Ok(()),
        }
    }

    fn on_arrival(&mut self, now: f64) {
        self.clients.arrived += 1;
        let t0 = self.t0.expect("arrivals are measured");
        match self.clients.times.as_mut().and_then(Iterator::next) {
            Some(next) => self.push(t0 + next, Ev::Arrival),
            // The schedule is over: that was the last request.
            None => self.clients.count = self.clients.arrived,
        }
        self.release(now);
    }

    fn on_server_in(&mut self, id: u64, now: f64) {
        let (req, r) = self.transit.remove(&id).expect("in transit");
        let stop = StopConditions {
            max_tokens: req.max_tokens,
            ignore_eos: req.ignore_eos || self.ignore_eos,
            ..Default::default()
        };
        let request = Request {
            id: infer_core::RequestId(id),
            prompt: req.prompt_ids,
            stop,
        };
        let delay = self.cluster.metrics_delay;
        let rep = &mut self.cluster.replicas[r];
        // The server's API first: a request asking for more tokens than fit is refused, as
        // the engine's (and vLLM's) refuses it, not cut short.
        let max_model_len = rep.sched.config().max_model_len;
        let added = infer_core::scheduler::completion_budget(
            max_model_len,
            request.prompt.len(),
            Some(request.stop.max_tokens),
        )
        .and_then(|_| {
            let opts = AddOptions {
                priority: req.priority,
                ..AddOptions::default()
            };
            rep.sched.add_with(request, opts, now)
        });
        match added {
            Ok(()) => {
                self.live.insert(id);
                if req.structured {
                    self.constrained.insert(id);
                }
                rep.record(now, delay);
                if !rep.busy {
                    rep.busy = true;
                    let wait = match rep.sched.config().batching_mode {
                        BatchingMode::Static => self.cluster.batch_window,
                        BatchingMode::Continuous => 0.0,
                    };
                    self.push(now + wait, Ev::StepStart(r));
                }
            }
            Err(e) => {
                self.cluster.finished(r);
                let t = now + self.client.stream_s;
                if self.t0.is_some() {
                    let record = self.metrics.fail(id, self.rel(t), e.to_string());
                    self.emit(record);
                }
                self.push(t, Ev::ClientDone(id));
            }
        }
    }

    fn on_client_done(&mut self, id: u64, now: f64) {
        self.last_done = self.last_done.max(now);
        if self.t0.is_none() {
            self.warmups_done += 1;
            if self.warmups_done < self.warmups {
                let req = self.gen.warmup_request(self.warmups_done);
                self.send(req, now);
            } else {
                self.start_measured(now);
            }
            return;
        }
        self.clients.in_flight -= 1;
        if let Some(next) = self.clients.turns.ended(id) {
            self.send_measured(next, now);
        }
        self.release(now);
    }

    fn on_step_start(&mut self, r: usize, now: f64) {
        let delay = self.cluster.metrics_delay;
        let rep = &mut self.cluster.replicas[r];
        let plan = rep.sched.schedule(now);
        if plan.is_empty() {
            rep.sched.complete(plan, &[], now);
            rep.busy = false;
            rep.idle_since.get_or_insert(now);
            return;
        }
        let idle_s = rep.idle_since.take().map(|t| now - t);
        let mut shape = StepShape::of(&plan);
        // A step past what one pass holds runs as several, as in the engine.
        let max_pass_tokens = rep.sched.config().max_pass_tokens();
        if shape.new_tokens() > max_pass_tokens {
            shape.forward_passes =
                whole_sequence_passes(plan.seqs.iter().map(|q| q.num_new_tokens), max_pass_tokens);
        }
        if let Some((tokens, padded)) = self.cost.slot_passes() {
            let slot_tokens = rep.sched.config().max_model_len;
            shape.slot_passes = SlotPasses::of(&plan, tokens, slot_tokens, padded);
        }
        if !self.constrained.is_empty() {
            shape.constrained_seqs = plan
                .seqs
                .iter()
                .filter(|q| q.samples && self.constrained.contains(&q.request.0))
                .count();
        }
        let bytes = self.cost.activation_bytes(&shape);
        let spilled = rep.activations.observe(bytes, shape.context_tokens);
        let stats = &mut self.tally.stats;
        stats.peak_activation_bytes = stats.peak_activation_bytes.max(bytes);
        stats.spilled_bytes = stats.spilled_bytes.max(spilled);
        let (step_s, pause_s) = self.noise.draw(self.cost.step_time(&shape), idle_s);
        let after_prefill_s = self
            .noise
            .after_prefill(rep.since_prefill.next(shape.prefill_tokens));
        // A request in the server's path shares the cores with the step.
        let overlap_s = self
            .client
            .overlap_late(step_s + after_prefill_s, rep.request_path_free - now);
        let dt = step_s + self.cost.spill_time(spilled) + pause_s + after_prefill_s + overlap_s;
        rep.plan = Some(plan);
        rep.record(now, delay);
        if self.t0.is_some() {
            let s = rep.sched.stats();
            stats.steps += 1;
            stats.peak_kv_usage = stats.peak_kv_usage.max(s.kv_usage);
            stats.peak_waiting = stats.peak_waiting.max(s.num_waiting);
        }
        self.push(now + dt, Ev::StepEnd(r));
    }

    fn on_step_end(&mut self, r: usize, now: f64) {
        let delay = self.cluster.metrics_delay;
        let plan = self.cluster.replicas[r]
            .plan
            .take()
            .expect("a step is running");
        // Any token will do: the simulator has no model. Mix request and step so that
        // generated blocks differ between requests (they never match a later prompt).
        self.sampled.clear();
        self.sampled.extend(
            plan.seqs.iter().filter(|s| s.samples).map(|s| {
                1 + ((s.request.0.wrapping_mul(2_654_435_761) ^ plan.step) % 30_000) as u32
            }),
        );
        let events = self.cluster.replicas[r]
            .sched
            .complete(plan, &self.sampled, now);
        // Debug builds (the tests) check the scheduler's invariants, which cost a pass over
        // the pool: after every step for pools up to 2,048 blocks (every seed scenario),
        // every (blocks / 256)-th step for larger ones (multi-replica runs of big GPUs).
        #[cfg(debug_assertions)]
        {
            let sched = &self.cluster.replicas[r].sched;
            let blocks = sched.kv().num_blocks();
            let every = if blocks <= 2048 {
                1
            } else {
                (blocks / 256) as u64
            };
            if self.tally.stats.steps.is_multiple_of(every) {
                if let Err(e) = sched.check_invariants() {
                    panic!("replica {r}: scheduler invariant broken: {e}");
                }
            }
        }
        let seen = now + self.client.stream_s;
        let seen_rel = self.rel(seen);
        for e in events {
            match e {
                // The gap since the request's previous token, as its client sees them: the
                // scheduler keeps the token times, so no per-request lookup per token.
                Event::Token {
                    request,
                    prev_token_time: Some(prev),
                    ..
                } if self.measured(request.0) => {
                    let gap = seen_rel - self.rel(prev + self.client.stream_s);
                    self.metrics.gap(gap);
                }
                Event::Token { .. } => {}
                Event::Finished { request, stats, .. } => {
                    let id = request.0;
                    self.live.remove(&id);
                    self.constrained.remove(&id);
                    self.cluster.finished(r);
                    let queue = stats.first_scheduled_time.map(|f| f - stats.arrival_time);
                    if self.measured(id) {
                        if let Some(q) = queue {
                            self.tally.queue_sum += q;
                            self.tally.queue_n += 1;
                        }
                        let replica = self.cluster.configured.then_some(r);
                        let timeline = Timeline {
                            first: stats
                                .first_token_time
                                .map(|f| self.rel(f + self.client.stream_s)),
                            chunks: stats.output_tokens,
                            itl_sum: stats.itl_sum,
                            itl_max: stats.itl_max,
                        };
                        if let Some(record) = self.metrics.finish_timed(
                            id,
                            seen_rel,
                            timeline,
                            stats.output_tokens,
                            stats.cached_tokens,
                            stats.preemptions,
                            queue,
                            replica,
                        ) {
                            self.emit(record);
                        }
                    }
                    self.push(seen, Ev::ClientDone(id));
                }
            }
        }
        let rep = &mut self.cluster.replicas[r];
        rep.record(now, delay);
        if rep.sched.has_unfinished() {
            self.push(now, Ev::StepStart(r));
        } else {
            rep.busy = false;
            rep.idle_since = Some(now);
        }
    }

    /// A row per replica every `interval`, except across a stretch where nothing can change
    /// (no event before the next one, e.g. an idle server waiting for a distant arrival):
    /// its rows would all repeat this one, so only its last is written, and the means count
    /// the skipped ones. A run's rows then follow what happens, not how long it lasts.
    fn on_sample(&mut self, now: f64) {
        let t = self.rel(now);
        let (mut kv, mut waiting) = (0.0, 0.0);
        for (i, rep) in self.cluster.replicas.iter().enumerate() {
            let s = rep.sched.stats();
            kv += s.kv_usage;
            waiting += s.num_waiting as f64;
            self.sink.sample(TimePoint {
                t,
                replica: i,
                waiting: s.num_waiting,
                running: s.num_running,
                kv_usage: s.kv_usage,
                prefix_queries: s.prefix_queries,
                prefix_hits: s.prefix_hits,
                preemptions: s.num_preemptions,
            });
        }
        self.tally.kv_sum += kv;
        self.tally.waiting_sum += waiting;
        self.tally.samples += 1;
        let pending = self.clients.next_send < self.clients.count || self.clients.in_flight > 0;
        // Without another event nothing will ever change: no more rows.
        let (true, Some(next_event)) = (pending, self.events.next_time()) else {
            return;
        };
        // The last sample time before the next event sees what this one saw (a sample at
        // the event's own time comes after it: samples are the last class of an instant).
        let unchanged = ((next_event - now) / self.interval).ceil() - 1.0;
        let mut next = now + self.interval;
        if unchanged >= 2.0 {
            let skipped = unchanged - 1.0;
            self.tally.kv_sum += skipped * kv;
            self.tally.waiting_sum += skipped * waiting;
            self.tally.samples += skipped as u64;
            next = now + unchanged * self.interval;
        }
        self.push(next, Ev::Sample);
    }

    fn emit(&mut self, record: RequestRecord) {
        if let Some(s) = &mut self.stages {
            s.add(&record);
        }
        self.sink.request(record);
        // A sink that has seen enough stops the run at once (a search's, whose answer can
        // no longer change), not at the next periodic check.
        self.sink_stopped = self.sink_stopped || self.sink.stop_reason().is_some();
    }

    fn finish(mut self, max_concurrency: Option<usize>) -> SimResult {
        // Requests nothing will ever schedule (cannot happen with a valid configuration,
        // but a run must end with every request accounted for).
        let mut stuck: Vec<u64> = self.live.drain().collect();
        stuck.sort_unstable();
        let end = self.rel(self.last_done);
        for id in stuck {
            if (id as usize) < self.clients.count {
                let record =
                    self.metrics
                        .fail(id, end, "never scheduled (simulation ended)".into());
                self.emit(record);
            }
        }
        let stats = self.tally.finish(self.cluster.counters());
        let duration = self.metrics.last_end();
        let mut summary = self.metrics.summary(duration);
        summary.prefix_cache_hit_rate = stats.prefix_hit_rate();
        summary.num_preemptions = stats.preemptions;
        summary.peak_kv_usage = stats.peak_kv_usage;
        summary.max_concurrency = max_concurrency;
        SimResult {
            summary,
            stats,
            stages: self.stages.map_or(Vec::new(), StageTally::rows),
            failures: self.metrics.failure_lines(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cost model with only a jitter, a spread and a cost after idling.
    struct Noisy(f64, Option<StepSpread>, Option<AfterIdle>);

    impl CostModel for Noisy {
        fn step_time(&self, _: &StepShape) -> f64 {
            1e-3
        }
        fn step_jitter(&self) -> f64 {
            self.0
        }
        fn step_spread(&self) -> Option<&StepSpread> {
            self.1.as_ref()
        }
        fn after_idle(&self) -> Option<AfterIdle> {
            self.2
        }
        fn client_path(&self) -> ClientPath {
            ClientPath::default()
        }
        fn describe(&self) -> String {
            "noisy".into()
        }
    }

    /// Served at 1x to 3x, evenly.
    fn spread() -> StepSpread {
        let steps: Vec<(f64, f64)> = (0..200)
            .map(|i| (1e-3, 1e-3 * (1.0 + 2.0 * i as f64 / 199.0)))
            .collect();
        StepSpread::measure(&steps).unwrap()
    }

    #[test]
    fn a_tiny_time_limit_reads_as_a_person_writes_it() {
        let file = concat!(env!("CARGO_MANIFEST_DIR"), "/../scenarios/baseline.toml");
        let text = std::fs::read_to_string(file).unwrap();
        let set = ["sim.max_simulated_s=1e-300".to_string()];
        let sc = infer_core::workload::Scenario::parse(file, &text, &set).unwrap();
        let setup = crate::setup::prepare(file, sc).unwrap();
        let e = run(&setup).unwrap_err().to_string();
        assert!(
            e.contains("key `sim.max_simulated_s`") && e.contains("beyond the limit of 1e-300 s"),
            "{e}"
        );
    }

    #[test]
    fn a_step_without_noise_takes_its_typical_time_exactly() {
        let mut n = StepNoise::new(&Noisy(0.0, None, None), 7);
        for t in [1e-6, 3.3e-4, 0.25] {
            assert_eq!(n.draw(t, None), (t, 0.0));
            assert_eq!(n.draw(t, Some(10.0)), (t, 0.0));
        }
    }

    #[test]
    fn the_pause_draws_the_same_with_and_without_a_spread() {
        let mut jitter = StepNoise::new(&Noisy(2e-3, None, None), 7);
        let mut both = StepNoise::new(&Noisy(2e-3, Some(spread()), None), 7);
        let mut spread_only = StepNoise::new(&Noisy(0.0, Some(spread()), None), 7);
        for _ in 0..100 {
            let (t, pause) = jitter.draw(1e-3, None);
            let (u, same_pause) = both.draw(1e-3, None);
            let (v, none) = spread_only.draw(1e-3, None);
            assert_eq!(t, 1e-3);
            assert_eq!(pause, same_pause, "the pause has its own stream");
            assert_eq!(u, v, "so has the spread");
            assert_eq!(none, 0.0);
            // Factors 1..3 over a mean of 2.
            assert!((0.5e-3..=1.5e-3).contains(&u), "{u}");
        }
    }

    #[test]
    fn the_first_step_after_an_idle_spell_takes_the_cold_factor() {
        let cold = AfterIdle {
            idle_s: 0.02,
            factor: 1.5,
            steps: 10,
        };
        let mut n = StepNoise::new(&Noisy(0.0, Some(spread()), Some(cold)), 7);
        assert_eq!(n.draw(1e-3, Some(0.5)), (1.5e-3, 0.0));
        assert_eq!(n.draw(1e-3, Some(0.02)), (1.5e-3, 0.0));
        // A short wait, or none, draws from the spread as before.
        let mut spread_only = StepNoise::new(&Noisy(0.0, Some(spread()), None), 7);
        for idle in [Some(0.019), None] {
            assert_eq!(n.draw(1e-3, idle), spread_only.draw(1e-3, idle));
        }
    }
}
