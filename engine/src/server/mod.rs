//! `engine serve`: an OpenAI-compatible HTTP server (axum) over the engine loop.
//!
//! Handlers parse and validate, tokenise, and hand the request to the engine thread through
//! a channel; tokens come back through a per-request channel and leave as SSE chunks or one
//! JSON body. A dropped client (stream or not) sends an abort, so its KV is freed at once.

pub mod api;
pub mod engine_loop;
pub mod http;
pub mod kv_events;
pub mod metrics;
pub mod step_log;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::Stream;
use infer_core::{AddError, SchedulerConfig};
use serde_json::{json, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use crate::runtime::engine_core::EngineRequest;
use crate::runtime::engine_core::PromptLogprob;
use api::{ApiError, Endpoint, GenerationRequest, Prompt};
use engine_loop::{Command, EngineLoop, Finish, NewRequest, StreamEvent};
use metrics::ServerMetrics;

use crate::runtime::model::LoadedModel;
use crate::runtime::tokenizer::TextTokenizer;

/// Everything `engine serve` needs.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// A model directory or `builtin:tiny`.
    pub model: String,
    pub served_model_name: Option<String>,
    pub sched: SchedulerConfig,
    pub seed: u64,
    pub dtype: Option<candle_core::DType>,
    pub device: crate::Device,
    /// Replay decode steps from captured CUDA graphs (CUDA only).
    pub cuda_graphs: bool,
    /// Size the KV pool to this fraction of the GPU's memory (minus what is in use),
    /// replacing `sched.num_gpu_blocks` (CUDA only; see `memory_plan`).
    pub gpu_memory_utilization: Option<f64>,
    /// Connection and request limits (413 beyond the body size, 408 past the deadlines).
    pub http: http::HttpLimits,
    /// At shutdown, how long open requests may take to finish before they are ended.
    pub shutdown_timeout: std::time::Duration,
    /// Write a per-step trace here (see [`step_log`]).
    pub step_log: Option<std::path::PathBuf>,
    /// Publish the prefix cache's events, as vLLM's `--kv-events-config` does.
    pub kv_events: Option<kv_events::KvEventsConfig>,
}

impl ServeConfig {
    pub fn new(model: &str) -> Self {
        ServeConfig {
            model: model.to_string(),
            served_model_name: None,
            sched: SchedulerConfig::default(),
            seed: 0,
            dtype: None,
            device: crate::Device::Cpu,
            cuda_graphs: false,
            gpu_memory_utilization: None,
            http: http::HttpLimits::default(),
            shutdown_timeout: std::time::Duration::from_secs(30),
            step_log: None,
            kv_events: None,
        }
    }
}

/// Shared by the handlers.
#[derive(Clone)]
pub struct AppState {
    inner: Arc<Shared>,
}

struct Shared {
    model_name: String,
    max_model_len: usize,
    /// A prompt longer than this in bytes cannot fit `max_model_len` tokens: refused before
    /// it is tokenised (see [`prompt_bytes_limit`]).
    max_prompt_bytes: usize,
    /// Tokenizer jobs at once (half the cores), on the blocking pool: see [`off_thread`].
    tokenizer_permits: Arc<tokio::sync::Semaphore>,
    tokenizer: Arc<TextTokenizer>,
    vocab_size: usize,
    commands: Mutex<mpsc::Sender<Command>>,
    metrics: Arc<Mutex<ServerMetrics>>,
    next_id: AtomicU64,
    created: u64,
    /// The model directory (`/v1/models`' `root`: clients load the tokenizer from it).
    root: String,
    /// Random per server start: response ids stay unique across restarts.
    instance: u32,
    /// `system_fingerprint`: the engine build and the device it computes on.
    fingerprint: String,
    /// Where the prefix cache's events are published, if they are.
    kv_events: Option<kv_events::KvEventsConfig>,
}

/// A running engine: the HTTP app state plus the engine thread.
pub struct Engine {
    pub state: AppState,
    thread: Option<std::thread::JoinHandle<()>>,
    /// A human-readable description of the resolved configuration.
    pub startup_log: String,
}

impl Engine {
    /// Load the model and start the engine thread.
    pub fn start(cfg: &ServeConfig) -> Result<Engine> {
        if cfg.gpu_memory_utilization.is_none() {
            // Before the model loads, for a quick answer (the pool size is final).
            cfg.sched
                .validate()
                .map_err(|(k, r)| anyhow::anyhow!("invalid configuration: {k}: {r}"))?;
        }
        let lm: LoadedModel = crate::runtime::model::load_model(&cfg.model, cfg.dtype, cfg.device)?;
        let model_name = cfg
            .served_model_name
            .clone()
            .unwrap_or_else(|| cfg.model.clone());
        let mut sched = cfg.sched.clone();
        if sched.max_model_len > lm.config.max_position_embeddings {
            sched.max_model_len = lm.config.max_position_embeddings;
        }
        if cfg.cuda_graphs && !cfg.device.is_cpu() {
            lm.model
                .enable_cuda_graphs(sched.max_batch_size, sched.max_model_len)?;
        }
        let memory = crate::runtime::memory_plan::plan(
            &lm.model,
            &mut sched,
            cfg.gpu_memory_utilization,
            cfg.cuda_graphs,
        )?;
        sched
            .validate()
            .map_err(|(k, r)| anyhow::anyhow!("invalid configuration: {k}: {r}"))?;
        let tokenizer = Arc::new(TextTokenizer::from_dir(&lm.dir)?);
        let root = lm.dir.display().to_string();
        let vocab_size = lm.config.vocab_size;
        let metrics = Arc::new(Mutex::new(ServerMetrics::new(
            &model_name,
            sched.block_size,
            sched.num_gpu_blocks,
        )));
        let mut engine = EngineLoop::new(lm, sched.clone(), metrics.clone(), cfg.seed)?;
        if let Some(path) = &cfg.step_log {
            engine.log_steps(step_log::StepLog::create(path)?);
        }
        if let Some(events) = &cfg.kv_events {
            engine.publish_kv_events(kv_events::start(events)?);
        }
        let startup_log = format!(
            "model {} ({}) served as {model_name}\nscheduler {:?}\nKV capacity {} tokens\n{}",
            cfg.model,
            engine_description(&cfg.model, cfg.device),
            sched,
            sched.kv_capacity_tokens(),
            memory.describe(),
        );
        debug_assert_eq!(engine.kv_bytes(), memory.kv_pool);
        let (tx, rx) = mpsc::channel();
        // The loop runs on a worker of the compute pool, so the model's parallel ops start
        // on the spot (see `run_in_compute_pool`).
        let thread = std::thread::Builder::new()
            .name("engine-loop".into())
            .spawn(move || {
                if let Err(e) =
                    crate::runtime::host::run_in_compute_pool("engine", || engine.run(rx))
                {
                    eprintln!("error: cannot start the engine's compute pool: {e}");
                }
            })
            .context("cannot start the engine thread")?;
        let created = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let state = AppState {
            inner: Arc::new(Shared {
                model_name,
                max_model_len: sched.max_model_len,
                max_prompt_bytes: prompt_bytes_limit(&tokenizer, sched.max_model_len),
                // Half the cores at most: the engine's step must keep its own.
                tokenizer_permits: Arc::new(tokio::sync::Semaphore::new(
                    std::thread::available_parallelism().map_or(1, |n| (n.get() / 2).max(1)),
                )),
                tokenizer,
                vocab_size,
                commands: Mutex::new(tx),
                metrics,
                next_id: AtomicU64::new(0),
                created,
                root,
                instance: rand::random(),
                fingerprint: format!(
                    "fp_infer_{}_{}",
                    env!("CARGO_PKG_VERSION"),
                    cfg.device.to_string().replace(':', "")
                ),
                kv_events: cfg.kv_events.clone(),
            }),
        };
        Ok(Engine {
            state,
            thread: Some(thread),
            startup_log,
        })
    }

    pub fn router(&self) -> Router {
        router(self.state.clone())
    }

    /// A handle that ends every live request (each gets an error event) and stops the
    /// engine thread, callable from anywhere.
    pub fn end_requests(&self) -> Box<dyn FnOnce() + Send> {
        let commands = self.state.inner.commands.lock().unwrap().clone();
        Box::new(move || {
            let _ = commands.send(Command::Shutdown);
        })
    }

    /// Stop the engine thread (live requests end with an error).
    pub fn shutdown(&mut self) {
        (self.end_requests())();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }

    /// The rendered `/metrics` text (tests read counters through it).
    pub fn metrics_text(&self) -> String {
        self.state.inner.metrics.lock().unwrap().render()
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn engine_description(model: &str, device: crate::Device) -> String {
    if model.starts_with("builtin:") {
        format!("embedded model, {device}")
    } else {
        device.to_string()
    }
}

/// The routes. Bodies arrive already read, within the limits of [`http::HttpLimits`].
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics_text))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        // What routers in front of replicas read (SGLang's router and vllm-router).
        .route("/get_load", get(get_load))
        .route("/get_model_info", get(get_model_info))
        .route("/get_server_info", get(get_server_info))
        .route("/health_generate", get(health_generate))
        .route("/kv_event_sources", get(kv_event_sources))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .fallback(|uri: axum::http::Uri| async move {
            ApiError::not_found("path", format!("no route for {uri}"))
        })
        .method_not_allowed_fallback(|method: axum::http::Method| async move {
            ApiError {
                status: StatusCode::METHOD_NOT_ALLOWED,
                ..ApiError::bad_request(None, format!("method {method} is not allowed here"))
            }
        })
        // The body is already read, within `HttpLimits::max_body_bytes`.
        .layer(DefaultBodyLimit::disable())
        .with_state(state)
}

/// Serve until SIGINT or SIGTERM.
pub async fn serve(cfg: ServeConfig, addr: SocketAddr) -> Result<()> {
    http::raise_fd_limit();
    let mut engine = tokio::task::block_in_place(|| Engine::start(&cfg))?;
    eprintln!("{}", engine.startup_log);
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))?;
    eprintln!("listening on http://{}", listener.local_addr()?);
    let drain = http::Drain {
        timeout: cfg.shutdown_timeout,
        force: Box::pin(async {
            shutdown_signal().await;
            eprintln!("second signal: ending open requests now");
        }),
        end_requests: engine.end_requests(),
    };
    let first = async {
        shutdown_signal().await;
        eprintln!(
            "shutting down: open requests have {:.0} s to finish (signal again to end them now)",
            cfg.shutdown_timeout.as_secs_f64()
        );
    };
    http::serve(listener, engine.router(), cfg.http, first, drain).await;
    eprintln!("shutting down");
    tokio::task::block_in_place(|| engine.shutdown());
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        if let Ok(mut s) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        {
            s.recv().await;
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
}

async fn models(State(s): State<AppState>) -> Json<Value> {
    let s = &s.inner;
    Json(json!({"object": "list", "data": [{
        "id": s.model_name, "object": "model", "created": s.created, "owned_by": "infer",
        "root": s.root, "parent": null, "max_model_len": s.max_model_len,
    }]}))
}

/// The replica's load as SGLang's router reads it (`load`: requests running or waiting), with
/// the parts.
async fn get_load(State(s): State<AppState>) -> Json<Value> {
    let m = s.inner.metrics.lock().unwrap().sched;
    Json(json!({
        "load": m.num_running + m.num_waiting,
        "num_reqs": m.num_running,
        "num_waiting_reqs": m.num_waiting,
        "kv_cache_usage": m.kv_usage,
    }))
}

async fn get_model_info(State(s): State<AppState>) -> Json<Value> {
    let s = &s.inner;
    Json(json!({
        "model_path": s.root, "tokenizer_path": s.root, "served_model_name": s.model_name,
        "is_generation": true, "max_model_len": s.max_model_len,
    }))
}

async fn get_server_info(State(s): State<AppState>) -> Json<Value> {
    let s = &s.inner;
    let m = s.metrics.lock().unwrap();
    Json(json!({
        "version": env!("CARGO_PKG_VERSION"), "engine": "infer",
        "model_path": s.root, "served_model_name": s.model_name, "model_id": s.model_name,
        // vllm-router's KV index keys a replica's events by model id and block size (it
        // reads `block_size` as its `kv_block_size`, and refuses a body with both).
        "max_model_len": s.max_model_len, "block_size": m.block_size,
        "num_gpu_blocks": m.num_gpu_blocks, "system_fingerprint": s.fingerprint,
    }))
}

/// Where this replica publishes its KV-cache events, as vllm-router's discovery reads it
/// (then it subscribes): an object keyed by data-parallel rank whose entries mirror vLLM's
/// `KVEventsConfig`, empty when events are off. A wildcard host (`tcp://*:5557`) is left for
/// the router to replace with the host it reaches this replica at.
async fn kv_event_sources(State(s): State<AppState>) -> Json<Value> {
    let Some(cfg) = &s.inner.kv_events else {
        return Json(json!({}));
    };
    Json(json!({"0": {
        "endpoint": cfg.endpoint, "replay_endpoint": null, "topic": cfg.topic,
        "publisher": "zmq", "enable_kv_cache_events": true,
    }}))
}

/// vLLM's `POST /reset_prefix_cache` (benchmarks call it between runs): 200 once the prefix
/// cache is empty, 409 while requests hold cached blocks.
async fn reset_prefix_cache(State(s): State<AppState>) -> Response {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let sent = s
        .inner
        .commands
        .lock()
        .unwrap()
        .send(Command::ResetPrefixCache(tx));
    match (sent, rx.await) {
        (Ok(()), Ok(true)) => StatusCode::OK.into_response(),
        (Ok(()), Ok(false)) => ApiError {
            status: StatusCode::CONFLICT,
            ..ApiError::bad_request(
                None,
                "requests are using cached blocks: the prefix cache was not reset",
            )
        }
        .into_response(),
        _ => ApiError::internal("the engine has stopped").into_response(),
    }
}

/// Healthy only if a one-token generation goes through the whole path (SGLang's check).
async fn health_generate(State(s): State<AppState>) -> Response {
    let body = Bytes::from_static(br#"{"prompt": "Hello", "max_tokens": 1}"#);
    match generate(s, Ok(body), Endpoint::Completions).await {
        Ok(r) if r.status().is_success() => StatusCode::OK.into_response(),
        Ok(r) => (StatusCode::SERVICE_UNAVAILABLE, r.into_body()).into_response(),
        Err(e) => ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            ..e
        }
        .into_response(),
    }
}

async fn metrics_text(State(s): State<AppState>) -> Response {
    let text = s.inner.metrics.lock().unwrap().render();
    ([("content-type", "text/plain; version=0.0.4")], text).into_response()
}

/// Bodies larger than this are parsed on the blocking pool (a 4 MiB JSON body takes an
/// HTTP thread ~10 ms), without waiting for a tokenizer permit: a prompt too long by its
/// bytes is still refused at once.
const PARSE_OFF_THREAD_BYTES: usize = 256 << 10;

async fn body_or_error(
    body: Result<Bytes, BytesRejection>,
) -> Result<serde_json::Map<String, Value>, ApiError> {
    match body {
        Ok(b) if b.len() > PARSE_OFF_THREAD_BYTES => tokio::task::spawn_blocking(move || {
            yield_cpu_to_serving();
            api::parse_body(&b)
        })
        .await
        .map_err(|e| ApiError::internal(format!("body parsing failed: {e}")))?,
        Ok(b) => api::parse_body(&b),
        Err(r) if r.status() == StatusCode::PAYLOAD_TOO_LARGE => Err(ApiError::too_large(format!(
            "request body too large: {}",
            r.body_text()
        ))),
        Err(r) => Err(ApiError::bad_request(None, r.body_text())),
    }
}

async fn tokenize(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body_or_error(body).await?;
    let prompt = if body.contains_key("messages") {
        api::parse_request(&body, Endpoint::Chat)?.prompt
    } else {
        match body.get("prompt") {
            Some(Value::String(p)) => Prompt::Text(p.clone()),
            _ => {
                return Err(ApiError::bad_request(
                    Some("prompt"),
                    "prompt must be a string",
                ))
            }
        }
    };
    let add_special = body
        .get("add_special_tokens")
        .and_then(Value::as_bool)
        .unwrap_or(true);
    // Tokenising and writing a long answer both happen off the HTTP threads.
    off_thread(&state, move |s| {
        let tokens = match prompt {
            Prompt::Text(p) => s
                .tokenizer
                .encode(&p, add_special)
                .map_err(|e| ApiError::internal(format!("{e:#}")))?,
            other => prompt_tokens(s, &other)?,
        };
        let body = json!({
            "tokens": tokens, "count": tokens.len(), "max_model_len": s.max_model_len,
        });
        Ok(([("content-type", "application/json")], body.to_string()).into_response())
    })
    .await?
}

async fn detokenize(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let body = body_or_error(body).await?;
    let tokens = api::token_ids(body.get("tokens"), "tokens", state.inner.vocab_size)?;
    let text = off_thread(&state, move |s| {
        s.tokenizer
            .decode(&tokens)
            .map_err(|e| ApiError::internal(format!("{e:#}")))
    })
    .await??;
    Ok(Json(json!({"prompt": text})))
}

async fn completions(State(s): State<AppState>, body: Result<Bytes, BytesRejection>) -> Response {
    generate(s, body, Endpoint::Completions)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn chat_completions(
    State(s): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    generate(s, body, Endpoint::Chat)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// The longest prompt, in bytes, that could still fit `max_model_len` tokens: every token
/// stands for at most `max_token_bytes` bytes, with a factor 2 of slack for normalizers
/// that shorten text (Unicode composition) before it is split.
fn prompt_bytes_limit(tokenizer: &TextTokenizer, max_model_len: usize) -> usize {
    tokenizer
        .max_token_bytes()
        .saturating_mul(max_model_len)
        .saturating_mul(2)
}

/// Runs tokenizer work (templating, encoding, decoding) on the blocking pool, at most one
/// job per two cores at a time, so a large prompt never holds an HTTP thread: `/health` and
/// every stream keep being served while it is tokenised.
async fn off_thread<T: Send + 'static>(
    state: &AppState,
    job: impl FnOnce(&Shared) -> T + Send + 'static,
) -> Result<T, ApiError> {
    let shared = state.inner.clone();
    let permit = shared
        .tokenizer_permits
        .clone()
        .acquire_owned()
        .await
        .map_err(|_| ApiError::internal("the tokenizer pool is closed"))?;
    tokio::task::spawn_blocking(move || {
        yield_cpu_to_serving();
        let out = job(&shared);
        drop(permit);
        out
    })
    .await
    .map_err(|e| ApiError::internal(format!("tokenizer job failed: {e}")))
}

/// Lowers the calling blocking-pool thread's scheduling priority (nice +10, once per
/// thread; Linux nice values are per thread): seconds of tokenizing a huge prompt then
/// take only the CPU that the HTTP threads and the engine loop leave, so on a machine with
/// few cores `/health` and every stream keep their latency.
fn yield_cpu_to_serving() {
    thread_local!(static LOWERED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) });
    LOWERED.with(|lowered| {
        if !lowered.replace(true) {
            #[cfg(target_os = "linux")]
            // SAFETY: setpriority has no memory effects; `who = 0` is this thread.
            unsafe {
                libc::setpriority(libc::PRIO_PROCESS, 0, 10);
            }
        }
    });
}

/// Refuses, by its length alone, a prompt that cannot fit `max_model_len` tokens: a huge
/// prompt is answered at once, without waiting for (or occupying) the tokenizer pool.
fn check_prompt_bytes(s: &Shared, prompt: &Prompt) -> Result<(), ApiError> {
    let bytes = match prompt {
        Prompt::Text(t) => t.len(),
        Prompt::Tokens(_) => 0,
        Prompt::Chat(messages) => messages.iter().map(|m| m.content.len()).sum(),
    };
    if bytes > s.max_prompt_bytes {
        return Err(ApiError::bad_request(
            Some(if matches!(prompt, Prompt::Chat(_)) {
                "messages"
            } else {
                "prompt"
            }),
            format!(
                "this model's maximum context length is {} tokens, but the prompt has {bytes} \
                 bytes, more than {} tokens can hold",
                s.max_model_len, s.max_model_len
            ),
        ));
    }
    Ok(())
}

fn prompt_tokens(s: &Shared, prompt: &Prompt) -> Result<Vec<u32>, ApiError> {
    let tokens = match prompt {
        Prompt::Text(t) => s.tokenizer.encode(t, true),
        Prompt::Tokens(t) => {
            if let Some(bad) = t.iter().find(|&&x| x as usize >= s.vocab_size) {
                return Err(ApiError::bad_request(
                    Some("prompt"),
                    format!(
                        "token id {bad} is outside the vocabulary of {}",
                        s.vocab_size
                    ),
                ));
            }
            Ok(t.clone())
        }
        Prompt::Chat(messages) => {
            let text = s
                .tokenizer
                .apply_chat_template(messages, true)
                .map_err(|e| ApiError::bad_request(Some("messages"), format!("{e:#}")))?;
            s.tokenizer.encode(&text, false)
        }
    };
    let tokens = tokens.map_err(|e| ApiError::internal(format!("{e:#}")))?;
    if tokens.is_empty() {
        return Err(ApiError::bad_request(Some("prompt"), "the prompt is empty"));
    }
    Ok(tokens)
}

/// Aborts the request (each of its `n` sequences) when dropped before it finished (the
/// client went away).
struct AbortOnDrop {
    ids: std::ops::Range<u64>,
    commands: mpsc::Sender<Command>,
    done: bool,
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if !self.done {
            for id in self.ids.clone() {
                let _ = self.commands.send(Command::Abort(id));
            }
        }
    }
}

async fn generate(
    state: AppState,
    body: Result<Bytes, BytesRejection>,
    endpoint: Endpoint,
) -> Result<Response, ApiError> {
    let arrival = Instant::now();
    let body = body_or_error(body).await?;
    let mut req: GenerationRequest = api::parse_request(&body, endpoint)?;
    let s = &state.inner;
    if !req.model.is_empty() && req.model != s.model_name {
        return Err(ApiError::not_found(
            "model",
            format!(
                "the model `{}` does not exist; this server serves `{}`",
                req.model, s.model_name
            ),
        ));
    }
    check_prompt_bytes(s, &req.prompt)?;
    if let Some(&(bad, _)) = req
        .params
        .logit_bias
        .iter()
        .find(|&&(t, _)| t as usize >= s.vocab_size)
    {
        return Err(ApiError::bad_request(
            Some("logit_bias"),
            format!(
                "token id {bad} is outside the vocabulary of {}",
                s.vocab_size
            ),
        ));
    }
    // The prompt as sent, for `echo` (a token prompt is echoed decoded).
    let sent_text = match &req.prompt {
        Prompt::Text(t) if req.echo => Some(t.clone()),
        _ => None,
    };
    let prompt = {
        let p = std::mem::replace(&mut req.prompt, Prompt::Tokens(Vec::new()));
        off_thread(&state, move |s| prompt_tokens(s, &p)).await??
    };
    let s = &state.inner;
    let n = prompt.len();
    if n >= s.max_model_len {
        return Err(ApiError::bad_request(
            Some("prompt"),
            format!(
                "this model's maximum context length is {} tokens, but the prompt has {n} tokens",
                s.max_model_len
            ),
        ));
    }
    let max_tokens = match req.max_tokens {
        Some(m) if n + m > s.max_model_len => {
            return Err(ApiError::bad_request(
                Some("max_tokens"),
                format!(
                    "this model's maximum context length is {} tokens, but you requested {} tokens ({n} in the prompt, {m} for the completion)",
                    s.max_model_len,
                    n + m
                ),
            ))
        }
        Some(m) => m,
        None => s.max_model_len - n,
    };
    // `max_tokens: 0` (with echo): one token is computed, as the step samples one, and
    // not returned.
    let (max_tokens, keep_generated) = if max_tokens == 0 {
        (1, false)
    } else {
        (max_tokens, true)
    };
    let echo = req.echo.then(|| Echo {
        text: sent_text.unwrap_or_else(|| s.tokenizer.decode(&prompt).unwrap_or_default()),
        first_token: prompt[0],
    });
    // One id per choice: the first is the request's, the others its forks'.
    let id = s.next_id.fetch_add(req.n as u64, Ordering::Relaxed);
    let ids = id..id + req.n as u64;
    let (tx, mut rx) = unbounded_channel();
    let commands = s.commands.lock().unwrap().clone();
    let new = NewRequest {
        id,
        request: EngineRequest {
            prompt,
            max_tokens,
            params: req.params.clone(),
            stop_strings: req.stop.clone(),
            stop_token_ids: req.stop_token_ids.clone(),
            ignore_eos: req.ignore_eos,
            forks: ids.clone().skip(1).collect(),
            prompt_logprobs: req.params.logprobs.filter(|_| req.echo),
        },
        arrival,
        events: tx,
    };
    commands
        .send(Command::Add(Box::new(new)))
        .map_err(|_| ApiError::internal("the engine has stopped"))?;
    let guard = AbortOnDrop {
        ids,
        commands,
        done: false,
    };
    match rx.recv().await {
        Some(StreamEvent::Accepted) => {}
        Some(StreamEvent::Rejected(e)) => return Err(rejection(e)),
        _ => return Err(ApiError::internal("the engine dropped the request")),
    }
    let meta = ResponseMeta {
        id: format!(
            "{}-{:08x}{id:08x}",
            if endpoint == Endpoint::Chat {
                "chatcmpl"
            } else {
                "cmpl"
            },
            s.instance
        ),
        created: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        fingerprint: s.fingerprint.clone(),
        model: s.model_name.clone(),
        endpoint,
        logprobs: req.params.logprobs.is_some(),
        tokenizer: s.tokenizer.clone(),
        n: req.n,
        echo,
        keep_generated,
    };
    if req.stream {
        Ok(Sse::new(sse_stream(rx, guard, meta, req.include_usage)).into_response())
    } else {
        collect(rx, guard, meta).await
    }
}

fn rejection(e: AddError) -> ApiError {
    match e {
        AddError::QueueFull { .. } => ApiError::overloaded(format!("{e}; retry later")),
        _ => ApiError::bad_request(Some("prompt"), e.to_string()),
    }
}

struct ResponseMeta {
    id: String,
    /// When the request arrived (Unix seconds), as OpenAI reports it per response.
    created: u64,
    fingerprint: String,
    model: String,
    endpoint: Endpoint,
    logprobs: bool,
    tokenizer: Arc<TextTokenizer>,
    /// Choices the request asked for.
    n: usize,
    /// What `echo` repeats before each choice.
    echo: Option<Echo>,
    /// False for `max_tokens: 0`: the computed token is not returned.
    keep_generated: bool,
}

/// The prompt an `echo` request gets back.
struct Echo {
    text: String,
    /// Its first token, which has no logprob (nothing comes before it).
    first_token: u32,
}

impl ResponseMeta {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.endpoint, chunk) {
            (Endpoint::Completions, _) => "text_completion",
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
        }
    }

    fn usage(prompt: usize, completion: usize, cached: usize) -> Value {
        json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
               "prompt_tokens_details": {"cached_tokens": cached}})
    }

    /// Usage of all choices: the prompt once (the first choice's, which computed it), the
    /// completions summed (none when the computed token is not returned).
    fn usage_of(&self, finished: &[Finish]) -> Value {
        let completion = if self.keep_generated {
            finished.iter().map(|f| f.completion_tokens).sum()
        } else {
            0
        };
        let first = finished[0];
        Self::usage(first.prompt_tokens, completion, first.cached_tokens)
    }

    fn token_logprobs(&self, token: u32, logprob: f32, top: &[(u32, f32)]) -> Value {
        let text = |t: u32| self.tokenizer.decode(&[t]).unwrap_or_default();
        match self.endpoint {
            Endpoint::Completions => json!({
                "tokens": [text(token)], "token_logprobs": [logprob],
                "top_logprobs": [top.iter().map(|&(t, l)| (text(t), json!(l))).collect::<serde_json::Map<String, Value>>()],
            }),
            Endpoint::Chat => json!({"content": [{
                "token": text(token), "logprob": logprob,
                "top_logprobs": top.iter().map(|&(t, l)| json!({"token": text(t), "logprob": l})).collect::<Vec<_>>(),
            }]}),
        }
    }

    fn chunk(
        &self,
        index: usize,
        text: &str,
        logprobs: Value,
        finish: Option<&str>,
        first: bool,
    ) -> Value {
        let choice = match self.endpoint {
            Endpoint::Completions => {
                json!({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish})
            }
            Endpoint::Chat => {
                let delta = if first {
                    json!({"role": "assistant", "content": text})
                } else {
                    json!({"content": text})
                };
                json!({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
            }
        };
        self.body(true, json!([choice]), None)
    }

    /// A response or chunk around `choices` (and `usage` when given).
    fn body(&self, chunk: bool, choices: Value, usage: Option<Value>) -> Value {
        let mut v = json!({"id": self.id, "object": self.object(chunk), "created": self.created,
                           "model": self.model, "system_fingerprint": self.fingerprint,
                           "choices": choices});
        if let Some(u) = usage {
            v["usage"] = u;
        }
        v
    }
}

fn sse_stream(
    mut rx: UnboundedReceiver<StreamEvent>,
    guard: AbortOnDrop,
    meta: ResponseMeta,
    include_usage: bool,
) -> impl Stream<Item = Result<SseEvent, std::convert::Infallible>> {
    async_stream::stream! {
        // Move the whole guard in: dropping the stream (client gone) aborts the request.
        let mut guard = guard;
        // Per choice: whether its first chunk is still to come; the choices that ended.
        let mut first = vec![true; meta.n];
        let mut finished = Vec::with_capacity(meta.n);
        // The prompt's logprobs (they come with the request's first token).
        let mut echoed: Option<Vec<PromptLogprob>> = None;
        while let Some(ev) = rx.recv().await {
            match ev {
                StreamEvent::Token { index, text, token, logprob, top_logprobs, finish, prompt_logprobs } => {
                    if let Some(lps) = prompt_logprobs {
                        echoed = Some(lps);
                    }
                    if first[index] {
                        if let Some(echo) = &meta.echo {
                            // The prompt first, as its own chunk.
                            let lp = match (&echoed, meta.logprobs) {
                                (Some(lps), true) => merge_logprobs(meta.endpoint, &meta.prompt_logprob_parts(echo, lps)),
                                _ => Value::Null,
                            };
                            let chunk = meta.chunk(index, &echo.text, lp, None, true);
                            yield Ok(SseEvent::default().data(chunk.to_string()));
                        }
                    }
                    let (text, lp) = if !meta.keep_generated {
                        (String::new(), Value::Null)
                    } else if meta.logprobs {
                        (text, meta.token_logprobs(token, logprob, &top_logprobs))
                    } else {
                        (text, Value::Null)
                    };
                    let reason = finish.map(|f| f.reason.as_str());
                    let chunk = meta.chunk(index, &text, lp, reason, first[index] && meta.echo.is_none());
                    yield Ok(SseEvent::default().data(chunk.to_string()));
                    first[index] = false;
                    if let Some(f) = finish {
                        finished.push(f);
                        if finished.len() == meta.n {
                            guard.done = true;
                            if include_usage {
                                let usage = meta.usage_of(&finished);
                                let u = meta.body(true, json!([]), Some(usage));
                                yield Ok(SseEvent::default().data(u.to_string()));
                            }
                            break;
                        }
                    }
                }
                StreamEvent::Error(msg) => {
                    // The other choices end with the stream (the guard aborts them).
                    yield Ok(SseEvent::default().data(ApiError::internal(msg).body().to_string()));
                    break;
                }
                StreamEvent::Accepted | StreamEvent::Rejected(_) => {}
            }
        }
        yield Ok(SseEvent::default().data("[DONE]"));
    }
}

/// One choice of a non-streaming response, as it accumulates.
#[derive(Default)]
struct Choice {
    text: String,
    logprobs: Vec<Value>,
    finish: Option<Finish>,
}

async fn collect(
    mut rx: UnboundedReceiver<StreamEvent>,
    mut guard: AbortOnDrop,
    meta: ResponseMeta,
) -> Result<Response, ApiError> {
    let mut choices: Vec<Choice> = (0..meta.n).map(|_| Choice::default()).collect();
    let mut open = meta.n;
    let mut echoed: Option<Vec<PromptLogprob>> = None;
    while let Some(ev) = rx.recv().await {
        match ev {
            StreamEvent::Token {
                index,
                text,
                token,
                logprob,
                top_logprobs,
                finish,
                prompt_logprobs,
            } => {
                if prompt_logprobs.is_some() {
                    echoed = prompt_logprobs;
                }
                let c = &mut choices[index];
                if meta.keep_generated {
                    c.text.push_str(&text);
                    if meta.logprobs {
                        c.logprobs
                            .push(meta.token_logprobs(token, logprob, &top_logprobs));
                    }
                }
                if finish.is_some() {
                    c.finish = finish;
                    open -= 1;
                }
                if open > 0 {
                    continue;
                }
                guard.done = true;
                let finished: Vec<Finish> = choices.iter().filter_map(|c| c.finish).collect();
                if let Some(echo) = &meta.echo {
                    // Each choice repeats the prompt first.
                    let parts = match (&echoed, meta.logprobs) {
                        (Some(lps), true) => meta.prompt_logprob_parts(echo, lps),
                        _ => Vec::new(),
                    };
                    for c in &mut choices {
                        c.text.insert_str(0, &echo.text);
                        c.logprobs.splice(0..0, parts.iter().cloned());
                    }
                }
                let body: Vec<Value> = choices
                    .iter()
                    .enumerate()
                    .map(|(i, c)| meta.choice(i, c))
                    .collect();
                let usage = meta.usage_of(&finished);
                return Ok(Json(meta.body(false, json!(body), Some(usage))).into_response());
            }
            StreamEvent::Error(msg) => return Err(ApiError::internal(msg)),
            StreamEvent::Accepted | StreamEvent::Rejected(_) => {}
        }
    }
    Err(ApiError::internal(
        "the engine stopped before the request finished",
    ))
}

impl ResponseMeta {
    /// The logprob entries of an echoed prompt: its first token without a logprob, then
    /// each token's given the tokens before it.
    fn prompt_logprob_parts(&self, echo: &Echo, lps: &[PromptLogprob]) -> Vec<Value> {
        let text = |t: u32| self.tokenizer.decode(&[t]).unwrap_or_default();
        let first = json!({"tokens": [text(echo.first_token)], "token_logprobs": [null],
                           "top_logprobs": [null]});
        std::iter::once(first)
            .chain(
                lps.iter()
                    .map(|p| self.token_logprobs(p.token, p.logprob, &p.top)),
            )
            .collect()
    }

    /// A finished choice of a non-streaming response.
    fn choice(&self, index: usize, c: &Choice) -> Value {
        let logprobs = if self.logprobs {
            merge_logprobs(self.endpoint, &c.logprobs)
        } else {
            Value::Null
        };
        let reason = c.finish.map(|f| f.reason.as_str());
        match self.endpoint {
            Endpoint::Completions => {
                json!({"index": index, "text": c.text, "logprobs": logprobs, "finish_reason": reason})
            }
            Endpoint::Chat => {
                json!({"index": index, "message": {"role": "assistant", "content": c.text}, "logprobs": logprobs, "finish_reason": reason})
            }
        }
    }
}

/// Per-token logprob objects → one object, as the non-streaming response carries them.
fn merge_logprobs(endpoint: Endpoint, parts: &[Value]) -> Value {
    match endpoint {
        Endpoint::Completions => {
            let cat = |k: &str| {
                parts
                    .iter()
                    .flat_map(|p| p[k].as_array().cloned().unwrap_or_default())
                    .collect::<Vec<_>>()
            };
            json!({"tokens": cat("tokens"), "token_logprobs": cat("token_logprobs"), "top_logprobs": cat("top_logprobs")})
        }
        Endpoint::Chat => {
            json!({"content": parts.iter().flat_map(|p| p["content"].as_array().cloned().unwrap_or_default()).collect::<Vec<_>>()})
        }
    }
}

/// Start a server in this process on `127.0.0.1:0` (tests and `engine verify`):
/// returns its address; it stops when the returned guard is dropped.
pub async fn spawn_local(cfg: ServeConfig) -> Result<(SocketAddr, LocalServer)> {
    let limits = cfg.http;
    let drain_timeout = cfg.shutdown_timeout;
    let engine = tokio::task::spawn_blocking(move || Engine::start(&cfg)).await??;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let app = engine.router();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let drain = http::Drain {
        timeout: drain_timeout,
        force: Box::pin(std::future::pending()),
        end_requests: engine.end_requests(),
    };
    let task = tokio::spawn(http::serve(
        listener,
        app,
        limits,
        async move {
            let _ = stop_rx.await;
        },
        drain,
    ));
    Ok((
        addr,
        LocalServer {
            engine: Some(engine),
            stop: Some(stop_tx),
            task: Some(task),
        },
    ))
}

pub struct LocalServer {
    engine: Option<Engine>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl LocalServer {
    pub fn engine(&self) -> &Engine {
        self.engine.as_ref().expect("running")
    }

    pub async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
        if let Some(mut e) = self.engine.take() {
            tokio::task::spawn_blocking(move || e.shutdown()).await.ok();
        }
    }
}
