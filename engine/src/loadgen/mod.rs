//! `engine bench`: a load generator for any OpenAI-compatible server (infer, vLLM, SGLang).
//!
//! It generates the scenario's requests with the core's generator — the very prompts the
//! simulator schedules — sends them with the scenario's arrival process, streams every
//! response and measures with the core's metric definitions (vLLM's). Server errors are
//! failed requests with their text; the client itself does not fail on them.

pub mod probe;
mod prom;

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use futures_util::StreamExt;
use infer_core::metrics::{MetricsRecorder, RequestRecord, Summary, TimePoint};
use infer_core::workload::{
    ApproxTokenizer, GeneratedRequest, Scenario, Tokenizer, WorkloadGenerator,
};
use infer_core::SchedulingPolicy;
use infer_reports::RunInfo;
use serde_json::{json, Value};

/// The API a run's requests go through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BenchEndpoint {
    /// `/v1/completions`: the prompt as the scenario cut it.
    #[default]
    Completions,
    /// `/v1/chat/completions`: the prompt as one user message, which the server's chat
    /// template wraps (its tokens count in the prompt the server reports), as vLLM's
    /// benchmark sends it with `--backend openai-chat` (here with a string content and
    /// `max_tokens`, which more servers take).
    Chat,
}

impl BenchEndpoint {
    pub fn path(self) -> &'static str {
        match self {
            BenchEndpoint::Completions => "/v1/completions",
            BenchEndpoint::Chat => "/v1/chat/completions",
        }
    }
}

/// What to run against which server.
#[derive(Clone)]
pub struct BenchOptions {
    /// Base URL, e.g. `http://127.0.0.1:8000`.
    pub server: String,
    /// Which API the requests go through.
    pub endpoint: BenchEndpoint,
    pub scenario: PathBuf,
    pub overrides: Vec<String>,
    /// The served model name; asked from `/v1/models` when absent.
    pub model: Option<String>,
    /// Run directory; nothing is written when `None`.
    pub out: Option<PathBuf>,
    pub progress: bool,
    /// How often `/metrics` is scraped.
    pub scrape_interval: Duration,
    /// Whose `/metrics` to read (base URLs): the replicas behind a router, whose own
    /// `/metrics` is one replica's or its own. Empty: the server's. Counters are summed;
    /// the timeseries has one row per endpoint (its `replica` column).
    pub metrics_from: Vec<String>,
    /// Cuts prompts in this tokenizer's tokens (default: the approximate tokenizer the
    /// simulator uses for catalog models).
    pub tokenizer: Option<Arc<dyn Tokenizer>>,
    /// Sent as `Authorization: Bearer KEY` with the server's `/v1` requests (a server
    /// started with `--api-key`: vLLM, `engine serve`, an OpenAI-style gateway).
    pub api_key: Option<String>,
    /// Empty the server's prefix cache first (vLLM's `POST /reset_prefix_cache`), so that
    /// the run starts as its simulation does: with nothing cached from earlier runs.
    pub reset_prefix_cache: bool,
    /// OpenAI's `logit_bias` (`{"token id": bias}`), sent with every request:
    /// [`whole_character_bias`] bans the tokens that are part of a character.
    pub logit_bias: Option<Value>,
    /// How long one request may take, send to end (6 hours, as vLLM's benchmark allows):
    /// a stream that stalls fails instead of holding the run for ever.
    pub request_timeout: Duration,
    /// Ends the run early when cancelled (Ctrl-C in `engine bench`): no request is sent
    /// after it, those in flight are abandoned, and the result says so
    /// ([`BenchResult::interrupted`]) over the requests that ended.
    pub interrupt: Option<tokio_util::sync::CancellationToken>,
}

impl BenchOptions {
    pub fn new(server: &str, scenario: impl Into<PathBuf>) -> Self {
        BenchOptions {
            server: server.trim_end_matches('/').to_string(),
            endpoint: BenchEndpoint::default(),
            scenario: scenario.into(),
            overrides: Vec::new(),
            model: None,
            out: None,
            progress: false,
            scrape_interval: Duration::from_millis(250),
            metrics_from: Vec::new(),
            tokenizer: None,
            api_key: None,
            reset_prefix_cache: false,
            logit_bias: None,
            request_timeout: Duration::from_secs(6 * 3600),
            interrupt: None,
        }
    }

    /// The HTTP client every request of a run goes through. It keeps no idle connection:
    /// each request opens its own, as vLLM's `benchmark_serving.py` long did (an aiohttp
    /// session per request). A request sent on a connection the server is closing fails
    /// unsent, and servers close idle ones on schedules of their own (uvicorn, so vLLM,
    /// after 5 s; `engine serve` after 10 s): llama.cpp's server failed 1–2 requests of
    /// some probes even with idle connections dropped after 4 s. A loopback connect costs
    /// tens of microseconds.
    pub fn http_client(&self) -> Result<reqwest::Client> {
        Ok(reqwest::Client::builder()
            .pool_max_idle_per_host(0)
            .build()?)
    }

    /// The `Authorization` header of the API key, sent with the server's `/v1` requests and
    /// `/reset_prefix_cache` only (never to `/metrics`, nor to the `--metrics-from` hosts).
    fn bearer(&self) -> Result<Option<reqwest::header::HeaderValue>> {
        let Some(key) = &self.api_key else {
            return Ok(None);
        };
        let mut value = reqwest::header::HeaderValue::from_str(&format!("Bearer {key}"))
            .map_err(|_| anyhow!("the API key holds characters a header cannot carry"))?;
        value.set_sensitive(true);
        Ok(Some(value))
    }
}

/// `POST /reset_prefix_cache`: vLLM's, which `engine serve` serves too (409 while requests
/// hold cached blocks); other servers answer 404. Its status, or why the server could not be
/// reached.
pub async fn reset_prefix_cache(opts: &BenchOptions) -> Result<reqwest::StatusCode> {
    let url = format!("{}/reset_prefix_cache", opts.server.trim_end_matches('/'));
    let mut req = opts
        .http_client()?
        .post(&url)
        .timeout(std::time::Duration::from_secs(10));
    if let Some(auth) = opts.bearer()? {
        req = req.header(reqwest::header::AUTHORIZATION, auth);
    }
    let r = req
        .send()
        .await
        .with_context(|| format!("{url}: cannot reach the server"))?;
    Ok(r.status())
}

/// `request` with the API key's header, if there is one.
fn authorized(
    request: reqwest::RequestBuilder,
    auth: Option<&reqwest::header::HeaderValue>,
) -> reqwest::RequestBuilder {
    match auth {
        Some(auth) => request.header(reqwest::header::AUTHORIZATION, auth.clone()),
        None => request,
    }
}

/// What to say when the server answers 401.
fn unauthorized_hint(key_sent: bool) -> &'static str {
    if key_sent {
        "the server refused the API key given (--api-key or OPENAI_API_KEY)"
    } else {
        "the server wants an API key: pass --api-key or set OPENAI_API_KEY"
    }
}

/// Counters the server reported (deltas over the measured part of the run).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ServerCounters {
    pub prompt_tokens: f64,
    pub generation_tokens: f64,
    pub request_success: f64,
    pub prefix_cache_queries: f64,
    pub prefix_cache_hits: f64,
    pub num_preemptions: f64,
}

pub struct BenchResult {
    pub scenario: Scenario,
    pub summary: Summary,
    pub records: Vec<RequestRecord>,
    pub timeseries: Vec<TimePoint>,
    /// `None` when the server has no `/metrics`.
    pub server_counters: Option<ServerCounters>,
    /// Set when the run was ended early ([`BenchOptions::interrupt`]).
    pub interrupted: Option<Interruption>,
    /// Why requests failed, in a few lines (empty when none did).
    pub failures: Vec<String>,
}

/// The run was interrupted before its measured part began: nothing to report.
#[derive(Debug)]
pub struct InterruptedBeforeRun;

impl std::fmt::Display for InterruptedBeforeRun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "interrupted before the measured run began: nothing measured"
        )
    }
}

impl std::error::Error for InterruptedBeforeRun {}

/// A run ended early: its figures are over the requests that ended before it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Interruption {
    /// When, seconds from the run's start.
    pub at: f64,
    /// Requests sent before it, of `of`.
    pub sent: usize,
    pub of: usize,
    /// Requests in flight then, abandoned: neither completed nor failed, they have no
    /// record (their inter-token gaps so far stay in the ITL figures).
    pub cut_off: usize,
}

impl Interruption {
    /// What the run directory's warnings and `engine bench` say of it. The figures lean
    /// short: the requests cut off are the ones that had run longest, and the throughput
    /// counts none of their tokens.
    pub fn describe(&self) -> String {
        format!(
            "interrupted at {:.1} s: {} of {} requests sent, {} in flight abandoned; the \
             figures are over the requests that ended (they leave out the longest-running \
             ones, and the throughput counts none of the abandoned requests' tokens)",
            self.at, self.sent, self.of, self.cut_off
        )
    }
}

impl BenchResult {
    /// What `engine bench` prints: the summary, the server's own counters where it has
    /// them, and the most frequent errors of failed requests.
    pub fn render(&self) -> String {
        let mut s = self.summary.render();
        if let Some(c) = &self.server_counters {
            s.push_str(&format!(
                "server counters: {} prompt tokens, {} generated, prefix cache hit rate {:.1}%, \
                 {} preemptions\n",
                c.prompt_tokens,
                c.generation_tokens,
                self.summary.prefix_cache_hit_rate * 100.0,
                c.num_preemptions
            ));
        }
        for line in &self.failures {
            s.push_str(line);
            s.push('\n');
        }
        if let Some(i) = &self.interrupted {
            s.push_str(&i.describe());
            s.push('\n');
        }
        s
    }
}

/// `--whole-characters`: a `logit_bias` of −100 on every token of the tokenizer at `path`
/// (as `--tokenizer`) that alone is part of a character, so that every generated token is
/// whole text. Servers hold streamed text that ends mid-character back until the character
/// completes (llama.cpp's, transformers'); a random-weight model generates runs of such
/// tokens, and their first chunk and gaps then time that holding, not the server's steps
/// (llama.cpp: one request's first chunk 44 s after its first token). Real text seldom
/// splits a character for long.
pub fn whole_character_bias(tok: &crate::runtime::tokenizer::TextTokenizer) -> Value {
    Value::Object(
        tok.partial_character_ids()
            .into_iter()
            .map(|id| (id.to_string(), json!(-100)))
            .collect(),
    )
}

/// `--tokenizer`: a model directory, or its tokenizer.json.
pub fn prompt_tokenizer(
    path: &std::path::Path,
) -> Result<crate::runtime::tokenizer::TextTokenizer> {
    let dir = if path.is_file() {
        path.parent().unwrap_or(path)
    } else {
        path
    };
    crate::runtime::tokenizer::TextTokenizer::from_dir(dir)
}

/// Run a benchmark on a fresh Tokio runtime, as `engine bench` does: the first Ctrl-C ends
/// the run with what it measured (vLLM's benchmark loses the run), a second quits at once.
pub fn run_until_ctrl_c(opts: &BenchOptions) -> Result<BenchResult> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let stop = tokio_util::sync::CancellationToken::new();
    let mut opts = opts.clone();
    opts.interrupt = Some(stop.clone());
    rt.spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            eprintln!(
                "\ninterrupted: ending the run with what it measured (Ctrl-C again to quit now)"
            );
            stop.cancel();
            if tokio::signal::ctrl_c().await.is_ok() {
                std::process::exit(130);
            }
        }
    });
    rt.block_on(run(&opts))
}

pub async fn run(opts: &BenchOptions) -> Result<BenchResult> {
    let (scenario, gen) = load_workload(opts)?;
    // The run directory is claimed first: one that cannot take the run is refused before
    // any request is sent, not after the run.
    let out = opts
        .out
        .as_deref()
        .map(infer_reports::RunDirWriter::create)
        .transpose()?;
    let stop = opts.interrupt.clone().unwrap_or_default();
    let target = tokio::select! {
        target = prepare(opts, &scenario, &gen) => target?,
        _ = stop.cancelled() => return Err(InterruptedBeforeRun.into()),
    };

    let arrivals = gen.arrivals(&scenario.arrival);
    let times: Option<Vec<f64>> = arrivals.times.map(Iterator::collect);
    let n = times
        .as_ref()
        .map_or(scenario.workload.num_requests, Vec::len);
    // Every prompt is cut before the clock starts (as vLLM's benchmark samples its requests
    // first), so that generating them does not take CPU from the server being measured.
    let requests: Arc<Vec<GeneratedRequest>> = Arc::new((0..n).map(|i| gen.request(i)).collect());
    let before = target.scrape().await;
    let recorder = Arc::new(Mutex::new(Timelines {
        metrics: MetricsRecorder::new().with_slo(scenario.slo),
        records: Vec::new(),
    }));
    let bar = progress_bar(n, opts.progress);
    let start = Instant::now();
    // The scraper runs until the requests are done.
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let scraper = {
        let (target, done, before) = (target.clone(), done.clone(), before.clone());
        let interval = opts.scrape_interval;
        tokio::spawn(async move { scrape_loop(target, before, start, interval, done).await })
    };
    let load = Load {
        target: target.clone(),
        previous_turn: previous_turns(&requests),
        ended: (0..n).map(|_| tokio::sync::Notify::new()).collect(),
        requests,
        recorder: recorder.clone(),
        bar: bar.clone(),
        start,
        stop,
        sent: AtomicUsize::new(0),
        cut_off: AtomicUsize::new(0),
    };
    let (duration, interrupted) = load.drive(times, arrivals.max_concurrency).await?;
    bar.finish_and_clear();
    done.store(true, Ordering::SeqCst);
    let timeseries = scraper.await?;
    let after = target.scrape().await;

    let Timelines {
        mut metrics,
        mut records,
    } = Arc::try_unwrap(recorder)
        .map_err(|_| anyhow!("requests still running"))?
        .into_inner()
        .unwrap();
    let failures = metrics.failure_lines();
    let mut summary = metrics.summary(duration);
    summary.max_concurrency = arrivals.max_concurrency;
    let server_counters = match (before, after) {
        (Some(b), Some(a)) => Some(total_counters(&a).delta(&total_counters(&b))),
        _ => None,
    };
    if let Some(c) = server_counters {
        summary.prefix_cache_hit_rate = if c.prefix_cache_queries > 0.0 {
            c.prefix_cache_hits / c.prefix_cache_queries
        } else {
            0.0
        };
        summary.num_preemptions = c.num_preemptions as u64;
    }
    summary.peak_kv_usage = timeseries.iter().map(|p| p.kv_usage).fold(0.0, f64::max);
    records.sort_by_key(|r| r.id);
    let result = BenchResult {
        scenario,
        summary,
        records,
        timeseries,
        server_counters,
        interrupted,
        failures,
    };
    if let Some(out) = out {
        let backend = match target.endpoint {
            BenchEndpoint::Completions => format!("{} ({})", target.base, target.model),
            BenchEndpoint::Chat => format!(
                "{}{} ({})",
                target.base,
                target.endpoint.path(),
                target.model
            ),
        };
        let mut info = RunInfo::new("engine", &result.scenario, backend);
        info.warnings
            .extend(result.interrupted.map(|i| i.describe()));
        out.write_all(&result.summary, &result.records, &result.timeseries, &info)?;
    }
    Ok(result)
}

/// Everything before the measured run: the server found, its prefix cache emptied if asked,
/// the test request and the warm-up requests.
async fn prepare(
    opts: &BenchOptions,
    scenario: &Scenario,
    gen: &WorkloadGenerator,
) -> Result<Target> {
    let mut target = Target::connect(opts, gen.tokenizer().clone()).await?;
    target.send_priority = scenario.server.scheduling_policy == SchedulingPolicy::Priority;
    if opts.reset_prefix_cache {
        let status = reset_prefix_cache(opts).await?;
        if !status.is_success() {
            bail!(
                "{}/reset_prefix_cache answered HTTP {status}: the prefix cache could not be \
                 emptied (409: requests still hold cached blocks; 404: the server has no such \
                 endpoint — leave out --reset-prefix-cache)",
                target.base
            );
        }
    }
    let structured = scenario
        .workload
        .structured_output
        .is_some_and(|s| s.fraction > 0.0);
    // The test request carries a priority the run sends, if any: a server without priority
    // scheduling refuses it at once, not request by request.
    let priority = (0..scenario.workload.num_requests)
        .map(|i| gen.priority_of(i))
        .find(|&p| p != 0 && target.send_priority)
        .unwrap_or(0);
    target
        .check(scenario.workload.ignore_eos, structured, priority)
        .await?;
    // Warm-up, one at a time, not counted.
    for i in 0..scenario.workload.warmup_requests {
        let mut scratch = Timelines::default();
        let mut rec = Recorder::Local(&mut scratch);
        target
            .send(&gen.warmup_request(i), u64::MAX, &mut rec, Instant::now())
            .await;
    }
    Ok(target)
}

/// The scenario (with its overrides) and the generator of its requests, cut with the
/// prompt tokenizer.
fn load_workload(opts: &BenchOptions) -> Result<(Scenario, WorkloadGenerator)> {
    let path = opts.scenario.display().to_string();
    let text = std::fs::read_to_string(&opts.scenario)
        .with_context(|| format!("{path}: cannot read scenario"))?;
    let scenario = Scenario::parse(&path, &text, &opts.overrides)?;
    for w in scenario.arrival.unused_keys() {
        eprintln!("{w}");
    }
    let tokenizer = opts
        .tokenizer
        .clone()
        .unwrap_or_else(|| Arc::new(ApproxTokenizer::default()));
    let mut gen = WorkloadGenerator::new(scenario.workload.clone(), tokenizer);
    if let Some(trace) = infer_core::workload::Trace::of_scenario(&scenario, &path)? {
        gen = gen.with_trace(trace);
    }
    Ok((scenario, gen))
}

/// Each request's previous turn of its conversation (the request before it, in order,
/// of the same conversation), if it has one.
fn previous_turns(requests: &[GeneratedRequest]) -> Vec<Option<usize>> {
    let mut last: std::collections::HashMap<usize, usize> = Default::default();
    requests
        .iter()
        .enumerate()
        .map(|(i, r)| r.turn.and_then(|(c, _)| last.insert(c, i)))
        .collect()
}

/// A run's requests on their way: each one sent, recorded and counted.
struct Load {
    target: Target,
    /// A conversation's turn is sent once the turn before it has ended, as a chat client
    /// sends it (its prompt holds the reply), holding its client's place meanwhile; the
    /// simulator's clients wait alike.
    previous_turn: Vec<Option<usize>>,
    /// Notified when request `i` has ended (a permit kept for the one waiter).
    ended: Vec<tokio::sync::Notify>,
    requests: Arc<Vec<GeneratedRequest>>,
    recorder: Arc<Mutex<Timelines>>,
    bar: indicatif::ProgressBar,
    start: Instant,
    /// Cancelled to end the run early (see [`BenchOptions::interrupt`]).
    stop: tokio_util::sync::CancellationToken,
    /// Requests sent so far, and those abandoned in flight when `stop` came.
    sent: AtomicUsize,
    cut_off: AtomicUsize,
}

impl Load {
    /// Sends every request — at its arrival time (`times`, at most `max_concurrency` in
    /// flight), or, without times, from `max_concurrency` closed-loop clients, each sending
    /// its next request when its previous one ends — until all are sent or `stop` comes.
    /// Returns when the last one ended (seconds since the start), and the interruption if
    /// `stop` came.
    async fn drive(
        self,
        times: Option<Vec<f64>>,
        max_concurrency: Option<usize>,
    ) -> Result<(f64, Option<Interruption>)> {
        let n = self.requests.len();
        let load = Arc::new(self);
        let last_end = Arc::new(Mutex::new(0.0f64));
        let run_one = {
            let (load, last_end) = (load.clone(), last_end.clone());
            move |i: usize| {
                let (load, last_end) = (load.clone(), last_end.clone());
                async move {
                    // `stop` first in each wait: nothing is sent once it came.
                    if let Some(p) = load.previous_turn[i] {
                        tokio::select! {
                            biased;
                            _ = load.stop.cancelled() => return,
                            _ = load.ended[p].notified() => {}
                        }
                    }
                    if load.stop.is_cancelled() {
                        return;
                    }
                    load.sent.fetch_add(1, Ordering::SeqCst);
                    let mut rec = Recorder::Shared(&load.recorder);
                    // Biased: the request is sent (and its start recorded) before `stop` is
                    // looked at, and one that ended is recorded, not abandoned.
                    let end = tokio::select! {
                        biased;
                        end = load.target.send(&load.requests[i], i as u64, &mut rec, load.start) => Some(end),
                        _ = load.stop.cancelled() => None,
                    };
                    match end {
                        Some(end) => {
                            load.ended[i].notify_one();
                            let mut l = last_end.lock().unwrap();
                            *l = l.max(end);
                            load.bar.inc(1);
                        }
                        None => {
                            if rec.with(|r| r.metrics.abandon(i as u64)) {
                                load.cut_off.fetch_add(1, Ordering::SeqCst);
                            }
                        }
                    }
                }
            }
        };
        let mut tasks = Vec::new();
        match times {
            Some(times) => {
                let sem = max_concurrency.map(|c| Arc::new(tokio::sync::Semaphore::new(c)));
                for (i, &t) in times.iter().enumerate().take(n) {
                    let at = load.start + Duration::from_secs_f64(t);
                    tokio::select! {
                        biased;
                        _ = load.stop.cancelled() => break,
                        _ = tokio::time::sleep_until(at.into()) => {}
                    }
                    let permit = match &sem {
                        Some(s) => tokio::select! {
                            biased;
                            _ = load.stop.cancelled() => break,
                            permit = s.clone().acquire_owned() => Some(permit?),
                        },
                        None => None,
                    };
                    let fut = run_one(i);
                    tasks.push(tokio::spawn(async move {
                        fut.await;
                        drop(permit);
                    }));
                }
            }
            None => {
                let next = Arc::new(AtomicUsize::new(0));
                let clients = max_concurrency.unwrap_or(1).min(n.max(1));
                for _ in 0..clients {
                    let (next, run_one, load) = (next.clone(), run_one.clone(), load.clone());
                    tasks.push(tokio::spawn(async move {
                        while !load.stop.is_cancelled() {
                            let i = next.fetch_add(1, Ordering::SeqCst);
                            if i >= n {
                                break;
                            }
                            run_one(i).await;
                        }
                    }));
                }
            }
        }
        for t in tasks {
            t.await?;
        }
        let end = *last_end.lock().unwrap();
        let (sent, cut_off) = (
            load.sent.load(Ordering::SeqCst),
            load.cut_off.load(Ordering::SeqCst),
        );
        // (A stop that came after the last request ended took nothing from the run.)
        let interrupted = (sent < n || cut_off > 0).then(|| Interruption {
            at: load.start.elapsed().as_secs_f64(),
            sent,
            of: n,
            cut_off,
        });
        Ok((end, interrupted))
    }
}

/// Write the run's directory with the one writer of run directories, the simulator's too:
/// both read back alike.
fn progress_bar(n: usize, show: bool) -> indicatif::ProgressBar {
    if !show {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(n as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{elapsed_precise} [{bar:40}] {pos}/{len} requests",
        )
        .expect("valid template"),
    );
    bar
}

#[derive(Clone)]
struct Target {
    client: reqwest::Client,
    /// `Authorization` for the server's `/v1` requests (see [`BenchOptions::bearer`]).
    auth: Option<reqwest::header::HeaderValue>,
    base: String,
    endpoint: BenchEndpoint,
    model: String,
    /// Base URLs whose `/metrics` are read (see [`BenchOptions::metrics_from`]).
    metrics: Vec<String>,
    /// Sent with every request (see [`BenchOptions::logit_bias`]).
    logit_bias: Option<Value>,
    /// See [`BenchOptions::request_timeout`].
    request_timeout: Duration,
    /// Counts a request's output tokens when the server reports none (as vLLM's client:
    /// streamed chunks may hold several tokens, or none).
    tokenizer: Arc<dyn Tokenizer>,
    /// Send each request's priority: the scenario's server schedules by it. First come,
    /// first served, the requests keep their priorities in the records but send none
    /// (vLLM refuses one other than 0 without priority scheduling), so that one workload
    /// runs both ways.
    send_priority: bool,
}

/// The timelines of a run's requests and the records of those that ended.
#[derive(Default)]
struct Timelines {
    metrics: MetricsRecorder,
    records: Vec<RequestRecord>,
}

impl Timelines {
    fn fail(&mut self, id: u64, t: f64, error: String) {
        let record = self.metrics.fail(id, t, error);
        self.records.push(record);
    }
}

enum Recorder<'a> {
    Shared(&'a Arc<Mutex<Timelines>>),
    Local(&'a mut Timelines),
}

impl Recorder<'_> {
    fn with<T>(&mut self, f: impl FnOnce(&mut Timelines) -> T) -> T {
        match self {
            Recorder::Shared(m) => f(&mut m.lock().unwrap()),
            Recorder::Local(m) => f(m),
        }
    }
}

impl Target {
    /// A transport failure, with its causes (reqwest's own message alone says "error
    /// sending request" or "error decoding response body", not that the connection was
    /// reset or refused), or the timeout that ended it.
    fn transport_error(&self, stage: &str, e: &reqwest::Error) -> String {
        if e.is_timeout() {
            return format!(
                "{stage}: no end within --request-timeout {} s",
                self.request_timeout.as_secs_f64()
            );
        }
        let mut why = e.to_string();
        let mut cause = std::error::Error::source(e);
        while let Some(c) = cause {
            why = format!("{why}: {c}");
            cause = c.source();
        }
        format!("{stage}: {}", shortened(&why))
    }

    async fn connect(opts: &BenchOptions, tokenizer: Arc<dyn Tokenizer>) -> Result<Target> {
        let client = opts.http_client()?;
        let auth = opts.bearer()?;
        let base = opts.server.trim_end_matches('/').to_string();
        let model = match &opts.model {
            Some(m) => m.clone(),
            None => served_model(&client, &base, auth.as_ref()).await?,
        };
        let metrics = if opts.metrics_from.is_empty() {
            vec![base.clone()]
        } else {
            opts.metrics_from
                .iter()
                .map(|u| u.trim_end_matches('/').to_string())
                .collect()
        };
        Ok(Target {
            client,
            auth,
            base,
            endpoint: opts.endpoint,
            model,
            metrics,
            // An empty bias is not sent: some servers refuse an empty object.
            logit_bias: opts
                .logit_bias
                .clone()
                .filter(|b| b.as_object().is_some_and(|m| !m.is_empty())),
            request_timeout: opts.request_timeout,
            tokenizer,
            send_priority: false,
        })
    }

    /// One test request first, as vLLM's benchmark sends: a server that refuses what we
    /// send (a field it does not know, a model name) is reported once, clearly, instead of
    /// failing every request of the run.
    async fn check(&self, ignore_eos: bool, structured: bool, priority: i64) -> Result<()> {
        if let Some(e) = self.test_request(ignore_eos, structured, priority).await {
            // Whether `ignore_eos` is what the server refuses: its error names it, or (the
            // name may fall past the 200 characters kept, or be in no message at all) the
            // same request without it goes through.
            // (A structured request is sent without it; a 408 or 429 says nothing of it.)
            let refused = e.starts_with("HTTP 400") || e.starts_with("HTTP 422");
            let refuses_ignore_eos = ignore_eos
                && !structured
                && (e.contains("ignore_eos")
                    || (refused
                        && (self.test_request(false, structured, priority))
                            .await
                            .is_none()));
            let hint = if refuses_ignore_eos {
                " (the scenario asks for ignore_eos, which this server does not take: \
                 --set workload.ignore_eos=false)"
                    .to_string()
            } else if priority != 0 && e.contains("priority") {
                " (the scenario's requests have priorities (workload.priorities, or a replayed \
                 requests.csv's), which this \
                 server takes only with priority scheduling: vLLM's and `engine serve`'s \
                 --scheduling-policy priority; or --set server.scheduling_policy=fcfs to send \
                 none)"
                    .to_string()
            } else if e.starts_with("HTTP 401") {
                format!(" ({})", unauthorized_hint(self.auth.is_some()))
            } else {
                String::new()
            };
            bail!("{}: the initial test request failed{hint}: {e}", self.base);
        }
        Ok(())
    }

    /// A short request (through completions it fills no KV block, so it leaves no prefix
    /// in the server's cache that a simulation of the scenario would not have; through
    /// chat, the template's tokens may, which every chat of the run shares anyway): why it
    /// failed, or `None`.
    async fn test_request(
        &self,
        ignore_eos: bool,
        structured: bool,
        priority: i64,
    ) -> Option<String> {
        let mut probe = Timelines::default();
        let request = GeneratedRequest {
            index: usize::MAX,
            warmup: true,
            prompt: "Hello".into(),
            prompt_ids: Vec::new(),
            max_tokens: 2,
            ignore_eos,
            group: None,
            turn: None,
            structured,
            priority,
        };
        self.send(
            &request,
            0,
            &mut Recorder::Local(&mut probe),
            Instant::now(),
        )
        .await;
        probe.records.into_iter().next().and_then(|r| r.error)
    }

    /// Send one streaming completion and record its timeline. Returns when it ended
    /// (seconds since `start`).
    async fn send(
        &self,
        req: &GeneratedRequest,
        id: u64,
        rec: &mut Recorder<'_>,
        start: Instant,
    ) -> f64 {
        let now = || start.elapsed().as_secs_f64();
        rec.with(|r| {
            r.metrics.start(id, now(), req.prompt_ids.len());
            r.metrics.set_priority(id, req.priority);
        });
        let mut body = json!({
            "model": self.model,
            "max_tokens": req.max_tokens,
            "temperature": 0.0,
            "stream": true,
            "stream_options": { "include_usage": true },
        });
        // (`max_tokens`, which chat servers take still, rather than the newer
        // `max_completion_tokens`, which some do not.)
        match self.endpoint {
            BenchEndpoint::Completions => body["prompt"] = json!(req.prompt),
            BenchEndpoint::Chat => {
                body["messages"] = json!([{"role": "user", "content": req.prompt}]);
            }
        }
        // vLLM's extensions: sent only when asked for, since other servers refuse fields
        // they do not know (transformers serve: 422). A structured request's grammar cannot
        // end before max_tokens, so it needs no ignore_eos (which vLLM refuses beside it).
        if req.structured {
            body["structured_outputs"] = json!({
                "json": crate::runtime::structured::workload_schema(),
                "disable_any_whitespace": true,
            });
        } else if req.ignore_eos {
            body["ignore_eos"] = Value::Bool(true);
        }
        if let Some(bias) = &self.logit_bias {
            body["logit_bias"] = bias.clone();
        }
        if req.priority != 0 && self.send_priority {
            body["priority"] = json!(req.priority);
        }
        let post = (self.client).post(format!("{}{}", self.base, self.endpoint.path()));
        let resp = authorized(post, self.auth.as_ref())
            .timeout(self.request_timeout)
            .json(&body)
            .send()
            .await;
        let resp = match resp {
            Ok(r) => r,
            Err(e) => {
                let t = now();
                let why = self.transport_error("connection", &e);
                rec.with(|r| r.fail(id, t, why));
                return t;
            }
        };
        if !resp.status().is_success() {
            let status = resp.status();
            let text = resp.text().await.unwrap_or_default();
            let t = now();
            rec.with(|r| r.fail(id, t, format!("HTTP {status}: {}", shortened(&text))));
            return t;
        }
        let mut stream = resp.bytes_stream();
        let mut events = SseEvents::default();
        let (mut chunks, mut usage, mut error) = (0usize, None::<Value>, None::<String>);
        // The last token chunk's time (E2E ends there, as vLLM's client measures it: not at
        // a usage chunk or `[DONE]` after it) and the text streamed.
        let (mut last_token, mut text) = (None::<f64>, String::new());
        // How the stream ended: `[DONE]`, or a choice's finish_reason (a server that sends
        // no `[DONE]`); neither, and it was cut short (a server that died mid-run).
        let (mut done, mut finished) = (false, false);
        // Once a choice has finished, the stream has only its usage and `[DONE]` to send: a
        // server that then neither sends them nor closes the connection (or sends only
        // keep-alive comments) has still answered in full by this deadline.
        let mut after_finish = None;
        'read: loop {
            let piece = if finished {
                let deadline =
                    *after_finish.get_or_insert_with(|| tokio::time::Instant::now() + AFTER_FINISH);
                match tokio::time::timeout_at(deadline, stream.next()).await {
                    Ok(p) => p,
                    Err(_) => break,
                }
            } else {
                stream.next().await
            };
            let Some(piece) = piece else { break };
            let piece = match piece {
                Ok(p) => p,
                Err(e) => {
                    error = Some(self.transport_error("stream", &e));
                    break;
                }
            };
            events.extend(&piece);
            while let Some(event) = events.next_event() {
                // An event's data is its `data:` lines joined by newlines (the SSE rule;
                // servers send one line an event, but may split a chunk over several).
                let event = String::from_utf8_lossy(&event);
                let data_lines: Vec<&str> = event
                    .lines()
                    .filter_map(|l| l.strip_prefix("data:"))
                    .map(|d| d.strip_prefix(' ').unwrap_or(d))
                    .collect();
                if !data_lines.is_empty() {
                    let data = data_lines.join("\n");
                    let data = data.trim();
                    if data == "[DONE]" {
                        done = true;
                        break 'read;
                    }
                    let Ok(v) = serde_json::from_str::<Value>(data) else {
                        error = Some(format!("bad stream chunk: {}", shortened(data)));
                        break 'read;
                    };
                    // (Some gateways send `"error": null` in every chunk.)
                    if let Some(e) = v.get("error").filter(|e| !e.is_null()) {
                        error = Some(format!("server error: {}", shortened(&e.to_string())));
                        break 'read;
                    }
                    // Like vLLM's client: every chunk with choices is a token chunk.
                    if let Some(choices) = v
                        .get("choices")
                        .and_then(Value::as_array)
                        .filter(|c| !c.is_empty())
                    {
                        chunks += 1;
                        let t = now();
                        rec.with(|r| r.metrics.chunk(id, t));
                        last_token = Some(t);
                        // A completion's text; a chat's content, and a reasoning model's
                        // thinking (vLLM's field, or its older name), tokens too.
                        let choice = &choices[0];
                        let pieces = [
                            &choice["text"],
                            &choice["delta"]["content"],
                            &choice["delta"]["reasoning"],
                            &choice["delta"]["reasoning_content"],
                        ];
                        for piece in pieces.into_iter().filter_map(Value::as_str) {
                            text.push_str(piece);
                        }
                        // (TGI sends `"finish_reason": ""` until the last chunk.)
                        finished |= choices.iter().any(|c| {
                            c.get("finish_reason")
                                .and_then(Value::as_str)
                                .is_some_and(|f| !f.is_empty())
                        });
                    }
                    if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                        usage = Some(u.clone());
                    }
                }
            }
        }
        let t = now();
        // As vLLM's client: a stream without a token has no TTFT and is a failure.
        let error = error.or_else(|| {
            (chunks == 0).then(|| {
                "the server streamed no token (a server that ignores `stream: true` answers \
                 one JSON body, which has no first-token time)"
                    .to_string()
            })
        });
        let error = error.or_else(|| {
            (!done && !finished).then(|| {
                format!(
                    "the stream ended after {chunks} chunks with neither `[DONE]` nor a \
                     finish_reason: cut short"
                )
            })
        });
        if let Some(e) = error {
            rec.with(|r| r.fail(id, t, e));
            return t;
        }
        let field = |k: &str| {
            usage
                .as_ref()
                .and_then(|u| u.get(k))
                .and_then(Value::as_u64)
        };
        // A server that reports no output tokens (no usage, or 0): the streamed text
        // tokenised, as vLLM's client counts them.
        let output = match field("completion_tokens") {
            Some(n) if n > 0 => n as usize,
            _ => self.tokenizer.encode(&text).len(),
        };
        let cached = usage
            .as_ref()
            .and_then(|u| u.pointer("/prompt_tokens_details/cached_tokens"))
            .and_then(Value::as_u64)
            .unwrap_or(0) as usize;
        rec.with(|r| {
            if let Some(p) = field("prompt_tokens") {
                r.metrics.set_prompt_tokens(id, p as usize);
            }
            let end = last_token.unwrap_or(t);
            if let Some(record) = r.metrics.finish(id, end, output, cached, 0, None, None) {
                r.records.push(record);
            }
        });
        t
    }

    /// Every metrics endpoint's text, or `None` if one does not answer.
    async fn scrape(&self) -> Option<Vec<String>> {
        let mut texts = Vec::with_capacity(self.metrics.len());
        for base in &self.metrics {
            let resp = self
                .client
                .get(format!("{base}/metrics"))
                .timeout(SCRAPE_TIMEOUT)
                .send()
                .await
                .ok()?;
            if !resp.status().is_success() {
                return None;
            }
            texts.push(resp.text().await.ok()?);
        }
        Some(texts)
    }
}

/// How long a `/metrics` read may take: a server that never answers one must not hold the
/// run (the scrapes before and after it, and the one in flight when it ends, are awaited).
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long `/v1/models` may take to answer (the model's name, asked before the run).
const MODELS_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a stream is read after a choice's finish_reason, for its usage and `[DONE]`.
const AFTER_FINISH: Duration = Duration::from_secs(2);

/// A response's bytes cut into SSE events (each ends with a blank line). Each byte is
/// looked at once, however the stream is split: an 8 MB event in 16 KB reads took 10 s to
/// find when every read rescanned the buffer from its start.
#[derive(Default)]
struct SseEvents {
    buf: Vec<u8>,
    /// Bytes of `buf` already searched for an event's end.
    scanned: usize,
}

impl SseEvents {
    fn extend(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// The next complete event, its blank line included.
    fn next_event(&mut self) -> Option<Vec<u8>> {
        // A `\n\n` or `\r\n\r\n` may straddle what was scanned: look back three bytes.
        let from = self.scanned.saturating_sub(3);
        let end = self.buf[from..]
            .windows(2)
            .enumerate()
            .find_map(|(i, w)| match w {
                b"\n\n" => Some(from + i + 2),
                b"\r\n" if self.buf[from + i + 2..].starts_with(b"\r\n") => Some(from + i + 4),
                _ => None,
            });
        match end {
            Some(end) => {
                self.scanned = 0;
                Some(self.buf.drain(..end).collect())
            }
            None => {
                self.scanned = self.buf.len();
                None
            }
        }
    }
}

/// An error body or chunk as a failure records it: at most 200 characters (a server's
/// HTML error page would fill the console and every row of requests.csv).
fn shortened(text: &str) -> String {
    const MAX: usize = 200;
    match text.char_indices().nth(MAX) {
        Some((cut, _)) => format!("{}… ({} bytes)", &text[..cut], text.len()),
        None => text.to_string(),
    }
}

async fn served_model(
    client: &reqwest::Client,
    base: &str,
    auth: Option<&reqwest::header::HeaderValue>,
) -> Result<String> {
    let url = format!("{base}/v1/models");
    let r = authorized(client.get(&url), auth)
        .timeout(MODELS_TIMEOUT)
        .send()
        .await
        .with_context(|| format!("{base}: cannot reach the server"))?;
    let status = r.status();
    let text = r.text().await.unwrap_or_default();
    if status == reqwest::StatusCode::UNAUTHORIZED {
        bail!(
            "{url} answered HTTP {status}: {}",
            unauthorized_hint(auth.is_some())
        );
    }
    if !status.is_success() {
        let shown: String = text.chars().take(200).collect();
        bail!("{url} answered HTTP {status}: {shown}; pass --model to skip it");
    }
    let v: Value = serde_json::from_str(&text)
        .map_err(|e| anyhow!("{url} did not answer JSON ({e}); pass --model to skip it"))?;
    v.pointer("/data/0/id")
        .and_then(Value::as_str)
        .map(str::to_string)
        .ok_or_else(|| anyhow!("{url} lists no model; pass --model"))
}

/// The counters summed over every endpoint's text.
fn total_counters(texts: &[String]) -> ServerCounters {
    texts
        .iter()
        .map(|t| counters(t))
        .fold(ServerCounters::default(), |a, c| a.plus(&c))
}

fn counters(text: &str) -> ServerCounters {
    let v = |name| prom::value(text, name).unwrap_or(0.0);
    ServerCounters {
        prompt_tokens: v("vllm:prompt_tokens"),
        generation_tokens: v("vllm:generation_tokens"),
        request_success: v("vllm:request_success"),
        prefix_cache_queries: v("vllm:prefix_cache_queries"),
        prefix_cache_hits: v("vllm:prefix_cache_hits"),
        num_preemptions: v("vllm:num_preemptions"),
    }
}

impl ServerCounters {
    fn plus(&self, other: &ServerCounters) -> ServerCounters {
        ServerCounters {
            prompt_tokens: self.prompt_tokens + other.prompt_tokens,
            generation_tokens: self.generation_tokens + other.generation_tokens,
            request_success: self.request_success + other.request_success,
            prefix_cache_queries: self.prefix_cache_queries + other.prefix_cache_queries,
            prefix_cache_hits: self.prefix_cache_hits + other.prefix_cache_hits,
            num_preemptions: self.num_preemptions + other.num_preemptions,
        }
    }

    fn delta(&self, before: &ServerCounters) -> ServerCounters {
        ServerCounters {
            prompt_tokens: self.prompt_tokens - before.prompt_tokens,
            generation_tokens: self.generation_tokens - before.generation_tokens,
            request_success: self.request_success - before.request_success,
            prefix_cache_queries: self.prefix_cache_queries - before.prefix_cache_queries,
            prefix_cache_hits: self.prefix_cache_hits - before.prefix_cache_hits,
            num_preemptions: self.num_preemptions - before.num_preemptions,
        }
    }
}

async fn scrape_loop(
    target: Target,
    before: Option<Vec<String>>,
    start: Instant,
    interval: Duration,
    done: Arc<std::sync::atomic::AtomicBool>,
) -> Vec<TimePoint> {
    let mut points = Vec::new();
    let Some(before) = before else { return points };
    let base: Vec<ServerCounters> = before.iter().map(|t| counters(t)).collect();
    while !done.load(Ordering::SeqCst) {
        if let Some(texts) = target.scrape().await {
            let t = start.elapsed().as_secs_f64();
            for (replica, (text, base)) in texts.iter().zip(&base).enumerate() {
                let c = counters(text).delta(base);
                let g = |name| prom::value(text, name).unwrap_or(0.0);
                points.push(TimePoint {
                    t,
                    replica,
                    waiting: g("vllm:num_requests_waiting") as usize,
                    running: g("vllm:num_requests_running") as usize,
                    kv_usage: prom::mean(text, "vllm:kv_cache_usage_perc").unwrap_or(0.0),
                    prefix_queries: c.prefix_cache_queries as u64,
                    prefix_hits: c.prefix_cache_hits as u64,
                    preemptions: c.num_preemptions as u64,
                });
            }
        }
        tokio::time::sleep(interval).await;
    }
    points
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Events come out whole however the bytes are split, with `\n` or `\r\n` line ends,
    /// and each byte is searched once (a 4 MB event in 4 KB reads).
    #[test]
    fn sse_events_are_cut_at_blank_lines_whatever_the_reads() {
        let text = b"data: a\n\ndata: b\r\n\r\n: ping\n\ndata: c\n\n";
        for step in 1..text.len() {
            let mut ev = SseEvents::default();
            let mut got = Vec::new();
            for piece in text.chunks(step) {
                ev.extend(piece);
                while let Some(e) = ev.next_event() {
                    got.push(String::from_utf8(e).unwrap());
                }
            }
            assert_eq!(
                got,
                [
                    "data: a\n\n",
                    "data: b\r\n\r\n",
                    ": ping\n\n",
                    "data: c\n\n"
                ],
                "reads of {step}"
            );
        }
        let mut ev = SseEvents::default();
        let big = vec![b'x'; 4 << 20];
        for piece in big.chunks(4096) {
            ev.extend(piece);
            assert!(ev.next_event().is_none());
            assert_eq!(ev.scanned, ev.buf.len(), "searched up to the end, once");
        }
        ev.extend(b"\n\n");
        assert_eq!(ev.next_event().map(|e| e.len()), Some((4 << 20) + 2));
    }

    #[test]
    fn long_error_texts_are_shortened_to_200_characters() {
        assert_eq!(shortened("boom"), "boom");
        let page = format!("<html>{}</html>", "é".repeat(5000));
        let s = shortened(&page);
        assert!(s.starts_with("<html>é") && s.ends_with(&format!("… ({} bytes)", page.len())));
        assert_eq!(
            s.chars().count(),
            200 + format!("… ({} bytes)", page.len()).chars().count()
        );
    }
}
