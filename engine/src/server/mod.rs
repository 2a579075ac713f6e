//! `engine serve`: an OpenAI-compatible HTTP server (axum) over the engine loop.
//!
//! Handlers parse and validate, tokenise, and hand the request to the engine thread through
//! a channel; tokens come back through a per-request channel and leave as SSE chunks or one
//! JSON body. A dropped client (stream or not) sends an abort, so its KV is freed at once.

pub mod api;
mod auth;
mod completions;
mod connections;
pub mod engine_loop;
mod health;
pub mod http;
pub mod kv_events;
pub mod metrics;
mod outbox;
mod pace;
mod prompt;
pub mod reasoning;
pub mod request_path;
mod responses;
mod routes;
pub mod step_log;
pub mod structured;
pub mod tool_parser;

use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{mpsc, Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use axum::extract::DefaultBodyLimit;
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::Router;
use infer_core::{SchedulerConfig, SchedulingPolicy};

use api::ApiError;
use engine_loop::{Command, EngineLoop};
use metrics::ServerMetrics;

use crate::runtime::model::LoadedModel;
use crate::runtime::structured::GrammarCompiler;
use crate::runtime::tokenizer::TextTokenizer;

/// Everything `engine serve` needs.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// A model directory or `builtin:tiny`.
    pub model: String,
    pub served_model_name: Option<String>,
    /// Every chat renders through this template in place of the model's (`--chat-template`).
    pub chat_template: Option<String>,
    pub sched: SchedulerConfig,
    /// `sched.max_model_len` is a default, lowered to the model's context where that is
    /// shorter; `false`: it was asked for, and one past the model's context is refused, as
    /// vLLM refuses it (positions the model was never trained at, past its RoPE tables).
    pub max_model_len_is_default: bool,
    pub seed: u64,
    pub dtype: Option<candle_core::DType>,
    /// What the KV cache stores (`--kv-cache-dtype`).
    pub kv_cache_dtype: infer_core::workload::KvCacheDtype,
    pub device: crate::Device,
    /// Replay decode steps from captured CUDA graphs (CUDA only).
    pub cuda_graphs: bool,
    /// Sample on the GPU: only token ids come back (CUDA only).
    pub device_sampling: bool,
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
    /// Keys of which a request under `/v1` must present one (see [`auth`]); none: open.
    pub api_keys: Vec<String>,
    /// The shape of `GET /get_load`.
    pub load_format: LoadFormat,
    /// Structured JSON output without optional whitespace, for every request.
    pub compact_json: bool,
    /// Reads `tool_choice: "auto"` outputs for calls (`--enable-auto-tool-choice
    /// --tool-call-parser`); `None`: such requests are refused, as vLLM refuses them.
    pub tool_call_parser: Option<tool_parser::ToolCallParser>,
    /// Splits a chat's output into its `reasoning` and `content` (`--reasoning-parser`);
    /// `None`: the output is all content.
    pub reasoning_parser: Option<reasoning::ReasoningParser>,
    /// Sample with the model's `generation_config.json` defaults where a request leaves a
    /// parameter out (vLLM's `--generation-config auto`, its default); `false`: the API's
    /// own defaults (`--generation-config vllm`).
    pub model_sampling_defaults: bool,
}

/// The shape of `GET /get_load`: vllm-router and sglang-router poll the same path and read
/// incompatible answers, so the server is told which router it stands behind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LoadFormat {
    /// An object whose `load` is the requests running or waiting (vllm-router), with
    /// SGLang's newer token-load keys beside it.
    #[default]
    Vllm,
    /// A list with one `{dp_rank, num_reqs, num_waiting_reqs, num_tokens}` per
    /// data-parallel rank, as SGLang serves it (sglang-router 0.3 sums `num_tokens`).
    Sglang,
}

impl ServeConfig {
    pub fn new(model: &str) -> Self {
        ServeConfig {
            model: model.to_string(),
            served_model_name: None,
            chat_template: None,
            sched: SchedulerConfig::default(),
            max_model_len_is_default: true,
            seed: 0,
            dtype: None,
            kv_cache_dtype: Default::default(),
            device: crate::Device::Cpu,
            cuda_graphs: false,
            device_sampling: false,
            gpu_memory_utilization: None,
            http: http::HttpLimits::default(),
            shutdown_timeout: std::time::Duration::from_secs(30),
            step_log: None,
            kv_events: None,
            api_keys: Vec::new(),
            load_format: LoadFormat::default(),
            compact_json: false,
            tool_call_parser: None,
            reasoning_parser: None,
            model_sampling_defaults: true,
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
    /// The waiting queue's bound (`--max-waiting`): one request's prompts all wait at once.
    max_waiting: Option<usize>,
    /// `--scheduling-policy`: whether a request's `priority` may be other than 0.
    scheduling_policy: SchedulingPolicy,
    /// Tokenizer jobs at once in each lane (half the cores), small and large: see
    /// [`prompt::off_thread`].
    tokenizer_small: Arc<tokio::sync::Semaphore>,
    tokenizer_large: Arc<tokio::sync::Semaphore>,
    /// The large lane's bytes in flight, in KiB ([`prompt::LARGE_LANE_KIB`]).
    tokenizer_large_kib: Arc<tokio::sync::Semaphore>,
    tokenizer: Arc<TextTokenizer>,
    vocab_size: usize,
    /// The model's end-of-sequence ids (a finished grammar asks for them).
    eos_token_ids: Vec<u32>,
    /// Structured output's compiler, built at the first request that needs it.
    grammars: std::sync::OnceLock<Result<GrammarCompiler, String>>,
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
    /// `--api-key`: what `/v1` requests must present.
    api_keys: Option<auth::ApiKeys>,
    load_format: LoadFormat,
    /// `--structured-outputs-disable-any-whitespace`.
    compact_json: bool,
    tool_call_parser: Option<tool_parser::ToolCallParser>,
    /// `--reasoning-parser`, with its markers' ids in the served tokenizer.
    reasoning: Option<(reasoning::ReasoningParser, reasoning::ReasoningTokens)>,
    /// What a request that leaves a sampling parameter out samples with.
    sampling_defaults: crate::runtime::model::SamplingDefaults,
    /// Set when the device is lost: the server stops.
    health: Arc<health::Health>,
    /// Requests between their handler's start and the engine (the step log's clock of it).
    request_path: Arc<request_path::RequestPath>,
}

impl Shared {
    /// The grammar compiler of the served vocabulary (built once, on a blocking thread).
    fn grammars(&self) -> Result<&GrammarCompiler, ApiError> {
        self.grammars
            .get_or_init(|| {
                GrammarCompiler::new(&self.tokenizer, self.vocab_size, &self.eos_token_ids)
                    .map_err(|e| format!("structured output is unavailable for this model: {e:#}"))
            })
            .as_ref()
            .map_err(|e| ApiError::bad_request(None, e.clone()))
    }

    /// A request naming a model must name the served one (404 otherwise, as OpenAI).
    fn check_model(&self, id: &str) -> Result<(), ApiError> {
        if id == self.model_name {
            return Ok(());
        }
        Err(ApiError::not_found(
            "model",
            format!(
                "the model `{id}` does not exist; this server serves `{}`",
                self.model_name
            ),
        ))
    }
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
        let api_keys = auth::ApiKeys::new(&cfg.api_keys)?;
        if cfg.gpu_memory_utilization.is_none() {
            // Before the model loads, for a quick answer (the pool size is final).
            cfg.sched
                .validate()
                .map_err(|(k, r)| anyhow::anyhow!("invalid configuration: {k}: {r}"))?;
        }
        let mut lm: LoadedModel =
            crate::runtime::model::load_model(&cfg.model, cfg.dtype, cfg.device)?;
        // Before the memory plan: its warm-up pool and the engine's are made in this dtype.
        lm.model.set_kv_cache_dtype(cfg.kv_cache_dtype);
        let model_name = cfg
            .served_model_name
            .clone()
            .unwrap_or_else(|| cfg.model.clone());
        let mut sched = cfg.sched.clone();
        let context = lm.config.max_position_embeddings;
        if sched.max_model_len > context {
            if !cfg.max_model_len_is_default {
                anyhow::bail!(
                    "--max-model-len {} is longer than the model's context of {context} tokens \
                     (max_position_embeddings in {}/config.json, with any rope scaling): \
                     positions past it were never trained; lower --max-model-len",
                    sched.max_model_len,
                    lm.dir.display()
                );
            }
            sched.max_model_len = context;
        }
        let memory = crate::runtime::memory_plan::plan(
            &lm.model,
            &mut sched,
            cfg.gpu_memory_utilization,
            cfg.cuda_graphs,
        )?;
        // Only now: the plan's warm-up steps run over a scratch KV pool, and a graph captured
        // there would replay against freed memory (the graphs refuse another pool; see
        // `graph_set`). The engine's own pool is allocated next and every bucket's graph is
        // captured on it before the first request.
        if cfg.cuda_graphs && !cfg.device.is_cpu() {
            lm.model
                .enable_cuda_graphs(sched.max_batch_size, sched.max_model_len)?;
        }
        if cfg.device_sampling {
            lm.model.enable_device_sampling()?;
        }
        sched
            .validate()
            .map_err(|(k, r)| anyhow::anyhow!("invalid configuration: {k}: {r}"))?;
        let mut tokenizer = TextTokenizer::from_dir(&lm.dir)?;
        if let Some(template) = &cfg.chat_template {
            tokenizer = tokenizer.with_chat_template(template.clone())?;
        }
        let reasoning = cfg
            .reasoning_parser
            .map(|p| Ok::<_, anyhow::Error>((p, p.tokens(&tokenizer)?)))
            .transpose()?;
        let tokenizer = Arc::new(tokenizer);
        let root = lm.dir.display().to_string();
        let vocab_size = lm.config.vocab_size;
        let eos_token_ids = lm.eos_token_ids.clone();
        let sampling_defaults = if cfg.model_sampling_defaults {
            lm.sampling_defaults
        } else {
            Default::default()
        };
        let mut defaults_log = if sampling_defaults.is_empty() {
            String::new()
        } else {
            format!(
                "\ndefault sampling from the model's generation_config.json: {} (--generation-config \
                 vllm: the API's own)",
                sampling_defaults.describe()
            )
        };
        if cfg.chat_template.is_some() {
            defaults_log += "\nchats render through --chat-template, not the model's template";
        }
        if let Some(parser) = cfg.tool_call_parser {
            defaults_log += &format!(
                "\ntool_choice \"auto\": the {} parser reads calls from the output",
                parser.name()
            );
        }
        if let Some(parser) = cfg.reasoning_parser {
            defaults_log += &format!(
                "\nchats' reasoning: the {} parser splits it from the content at </think>",
                parser.name()
            );
        }
        let metrics = Arc::new(Mutex::new(ServerMetrics::new(
            &model_name,
            sched.block_size,
            sched.num_gpu_blocks,
        )));
        let health = Arc::new(health::Health::default());
        let request_path = Arc::new(request_path::RequestPath::default());
        let launch_log = lm
            .model
            .launch_description()
            .map(|d| format!("\n{d}"))
            .unwrap_or_default();
        let mut engine =
            EngineLoop::new(lm, sched.clone(), metrics.clone(), health.clone(), cfg.seed)?;
        let started = std::time::Instant::now();
        let graphs = engine.capture_decode_graphs()?;
        let graphs_log = if graphs > 0 {
            format!(
                "\ncaptured {graphs} decode graphs in {:.0} ms",
                started.elapsed().as_secs_f64() * 1e3
            )
        } else {
            String::new()
        };
        if let Some(path) = &cfg.step_log {
            engine.log_steps(step_log::StepLog::create(path)?, request_path.clone());
        }
        if let Some(events) = &cfg.kv_events {
            engine.publish_kv_events(kv_events::start(events)?);
        }
        let startup_log = format!(
            "model {} ({}) served as {model_name}\nscheduler: {}\nKV capacity {} tokens\n{}{launch_log}{graphs_log}{defaults_log}",
            cfg.model,
            engine_description(&cfg.model, cfg.device),
            scheduler_settings(&sched),
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
                max_prompt_bytes: prompt::prompt_bytes_limit(&tokenizer, sched.max_model_len),
                max_waiting: sched.max_waiting,
                scheduling_policy: sched.scheduling_policy,
                // Half the cores at most a lane: the engine's step must keep its own.
                tokenizer_small: Arc::new(tokio::sync::Semaphore::new(half_the_cores())),
                tokenizer_large: Arc::new(tokio::sync::Semaphore::new(half_the_cores())),
                tokenizer_large_kib: Arc::new(tokio::sync::Semaphore::new(
                    prompt::LARGE_LANE_KIB as usize,
                )),
                tokenizer,
                vocab_size,
                eos_token_ids,
                grammars: std::sync::OnceLock::new(),
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
                api_keys,
                load_format: cfg.load_format,
                compact_json: cfg.compact_json,
                tool_call_parser: cfg.tool_call_parser,
                reasoning,
                sampling_defaults,
                health,
                request_path,
            }),
        };
        Ok(Engine {
            state,
            thread: Some(thread),
            startup_log,
        })
    }

    /// The routes as served: bodies read within `limits`, and, outermost, the API keys.
    pub fn app(&self, limits: http::HttpLimits) -> Router {
        let app = http::with_body_limits(router(self.state.clone(), limits), limits);
        auth::guard(app, self.state.inner.api_keys.as_ref())
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

fn half_the_cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| (n.get() / 2).max(1))
}

fn engine_description(model: &str, device: crate::Device) -> String {
    if model.starts_with("builtin:") {
        format!("embedded model, {device}")
    } else {
        device.to_string()
    }
}

/// The routes. Bodies arrive already read, within the limits of [`http::HttpLimits`]; the
/// cheap ones are paced at its `cheap_per_second` (see [`pace`]).
fn router(state: AppState, limits: http::HttpLimits) -> Router {
    use completions::{chat_completions, completions};
    use routes::*;
    let pacer = std::sync::Arc::new(pace::Pacer::new(
        limits.cheap_per_second,
        limits.cheap_per_second / 10,
    ));
    let cheap = Router::new()
        .route("/health", get(health))
        // SageMaker's health check, as vLLM serves it.
        .route("/ping", get(health).post(health))
        .route("/version", get(version))
        .route("/v1/models", get(models))
        .route("/v1/models/{model}", get(model))
        .route("/tokenizer_info", get(tokenizer_info))
        .route("/metrics", get(metrics_text))
        // What routers in front of replicas read (SGLang's router and vllm-router).
        .route("/get_load", get(get_load))
        .route("/v1/loads", get(loads))
        .route("/get_model_info", get(get_model_info))
        .route("/model_info", get(get_model_info))
        .route("/get_server_info", get(get_server_info))
        .route("/server_info", get(get_server_info))
        .route("/kv_event_sources", get(kv_event_sources))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .route("/v1/responses/{id}", get(responses::retrieve))
        .fallback(|uri: axum::http::Uri| async move {
            ApiError::not_found("path", format!("no route for {uri}"))
        })
        .layer(axum::middleware::from_fn_with_state(pacer, pace::paced));
    let work = Router::new()
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/responses", post(responses::responses))
        .route("/health_generate", get(health_generate));
    cheap
        .merge(work)
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
    let health = engine.state.inner.health.clone();
    let first = async {
        tokio::select! {
            _ = shutdown_signal() => eprintln!(
                "shutting down: open requests have {:.0} s to finish (signal again to end them \
                 now)",
                cfg.shutdown_timeout.as_secs_f64()
            ),
            _ = health.wait_lost() => eprintln!("shutting down: the device is lost"),
        }
    };
    http::serve(listener, engine.app(cfg.http), cfg.http, first, drain).await;
    eprintln!("shutting down");
    let stopping = std::time::Instant::now();
    tokio::task::block_in_place(|| engine.shutdown());
    // Says where a slow exit is: in the engine (its loop, the model's device memory) or after.
    eprintln!(
        "engine stopped, its device memory released, in {:.1} s",
        stopping.elapsed().as_secs_f64()
    );
    match engine.state.inner.health.lost() {
        // A supervisor restarts a server that exits with an error, not one that goes on.
        Some(why) => anyhow::bail!("{why}"),
        None => Ok(()),
    }
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

/// Start a server in this process on `127.0.0.1:0` (tests and `engine verify`):
/// returns its address; it stops when the returned guard is dropped.
pub async fn spawn_local(cfg: ServeConfig) -> Result<(SocketAddr, LocalServer)> {
    let limits = cfg.http;
    let drain_timeout = cfg.shutdown_timeout;
    let engine = tokio::task::spawn_blocking(move || Engine::start(&cfg)).await??;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let app = engine.app(limits);
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

/// The scheduler's settings as `key=value`, by the names scenario files and `sim` use
/// (unset ones left out).
fn scheduler_settings(sched: &SchedulerConfig) -> String {
    let Ok(serde_json::Value::Object(fields)) = serde_json::to_value(sched) else {
        return format!("{sched:?}");
    };
    fields
        .into_iter()
        .filter(|(_, v)| !v.is_null())
        .map(|(k, v)| match v {
            serde_json::Value::String(s) => format!("{k}={s}"),
            v => format!("{k}={v}"),
        })
        .collect::<Vec<_>>()
        .join(" ")
}
