//! `engine`: the real engine's command line.

use anyhow::{bail, Context, Result};
use candle_core::DType;
use clap::{Args, Parser, Subcommand, ValueEnum};
use infer_core::workload::KvCacheDtype;
use infer_core::{
    BatchingMode, KvAdmission, KvBackend, KvPreemption, KvVictim, SchedulerConfig, SchedulingPolicy,
};
use infer_engine::loadgen::BenchOptions;
use infer_engine::runtime::sampling::SamplingParams;
use infer_engine::server::{serve, ServeConfig};
use infer_engine::tools::generate::{generate, GenerateOptions, GenerateRequest};
use infer_engine::tools::make_model::{make_model, ModelSpec};
use infer_engine::Arch;
use infer_engine::Device;
use std::io::Write;
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "engine",
    about = "infer's real engine: model runner, server, load generator, profiler",
    after_help = "Example: serve the built-in model on 127.0.0.1:8000\n  engine serve"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Write a Hugging Face model directory with deterministic random weights.
    #[command(after_help = "Example:\n  \
        engine make-model --arch llama --layers 2 --hidden 64 --out runs/tiny-llama")]
    MakeModel(MakeModelArgs),
    /// Generate text for one prompt (a manual check of the model runner).
    #[command(after_help = "Example:\n  \
        engine generate --prompt \"The harbour at dawn\" --max-tokens 16")]
    Generate(GenerateArgs),
    /// Serve a model over an OpenAI-compatible HTTP API.
    #[command(
        after_help = "Example: the built-in model as the chunked-prefill scenario's server\n  \
        engine serve --scenario scenarios/chunked_prefill.toml --port 8000"
    )]
    Serve(Box<ServeArgs>),
    /// Drive an OpenAI-compatible server with a scenario and measure it.
    #[command(
        after_help = "Example: against a server on 127.0.0.1:8000 (`engine serve` first)\n  \
        engine bench --scenario scenarios/chunked_prefill.toml --out runs/bench-p8"
    )]
    Bench(BenchArgs),
    /// Run a fixed, short set of probe loads against any OpenAI-compatible server: run
    /// directories for `sim calibrate`.
    #[command(
        after_help = "Example: against a server on 127.0.0.1:8000 (`engine serve` first)\n  \
        engine probe --scenario scenarios/baseline.toml --out runs/probe"
    )]
    Probe(ProbeArgs),
    /// Time model steps over a grid of batch shapes: the simulator's profiled cost model.
    #[command(after_help = "Example:\n  engine profile --quick --out runs/tiny-profile.json")]
    Profile(ProfileArgs),
    /// Predict each scenario with the simulator, measure it on the engine, compare.
    #[command(after_help = "Example (about half a minute on a CPU):\n  \
        engine verify scenarios/chunked_prefill.toml --quick-profile --out runs/verify")]
    Verify(VerifyArgs),
    /// Tables and charts from run directories (the same as `sim report`).
    #[command(after_help = "Example: two runs of `sim run` or `engine bench`\n  \
        engine report runs/p6 runs/p8 --baseline runs/p8 --out runs/p6-vs-p8")]
    Report(ReportArgs),
}

#[derive(Args)]
struct ProfileArgs {
    #[arg(long, default_value = "builtin:tiny")]
    model: String,
    #[arg(long, default_value = "profile.json")]
    out: PathBuf,
    /// A smaller grid (for a quick look).
    #[arg(long)]
    quick: bool,
    #[command(flatten)]
    target: TargetArgs,
}

/// Where a model runs, for the commands that profile or serve it.
#[derive(Args)]
struct TargetArgs {
    /// `cpu`, or `cuda[:N]` (needs a build with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Replay decode steps from CUDA graphs (CUDA only).
    #[arg(long = "cuda-graphs", default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    cuda_graphs: bool,
    /// Sample on the GPU, so only token ids come back (CUDA only; a grammar's mask goes to
    /// the GPU with its row; steps with prompt logprobs still sample on the host).
    #[arg(long = "device-sampling", default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    device_sampling: bool,
}

impl TargetArgs {
    fn target(&self) -> Result<infer_engine::tools::profile::Target> {
        let device = Device::parse(&self.device).context("--device")?;
        if self.cuda_graphs && device.is_cpu() {
            bail!("--cuda-graphs needs --device cuda");
        }
        if self.device_sampling && device.is_cpu() {
            bail!("--device-sampling needs --device cuda");
        }
        Ok(infer_engine::tools::profile::Target {
            device,
            cuda_graphs: self.cuda_graphs,
            device_sampling: self.device_sampling,
        })
    }
}

#[derive(Args)]
struct VerifyArgs {
    /// Scenario files.
    #[arg(required = true)]
    scenarios: Vec<PathBuf>,
    #[arg(long, default_value = "builtin:tiny")]
    model: String,
    /// Reuse a profile written by `engine profile`.
    #[arg(long)]
    profile: Option<PathBuf>,
    #[arg(long)]
    out: Option<PathBuf>,
    /// Overrides for every scenario, `key=value` (repeatable).
    #[arg(long = "set")]
    set: Vec<String>,
    #[arg(long = "quick-profile")]
    quick_profile: bool,
    /// Profile, predict and measure N times and compare the medians (a noisy machine
    /// drifts between runs).
    #[arg(long, default_value_t = 1)]
    repeat: usize,
    /// Seeds each prediction runs under for its 90% interval (as `sim run --seeds`).
    #[arg(long, default_value_t = infer_sim::interval::DEFAULT_SEEDS, value_name = "N")]
    seeds: usize,
    /// Measure nothing: predict again what an earlier `verify --out DIR` measured, each
    /// repetition on its own profile (or `--profile`), to judge a change to the simulator
    /// against the same runs.
    #[arg(long, value_name = "DIR", conflicts_with_all = ["repeat", "quick_profile"])]
    measured: Option<PathBuf>,
    #[command(flatten)]
    target: TargetArgs,
}

#[derive(Args)]
struct ReportArgs {
    /// Run directories.
    #[arg(required = true)]
    runs: Vec<PathBuf>,
    #[arg(long)]
    baseline: Option<PathBuf>,
    /// Report directory (default: runs/report-<unix time>, as `sim report`).
    #[arg(long)]
    out: Option<PathBuf>,
}

/// The seed server's flags. Defaults: the embedded model on 127.0.0.1:8000 with the
/// benchmark log's Phase 8 configuration; booleans take `--flag` or `--flag=false`. vLLM's
/// and SGLang's names for the same settings are accepted (`engine serve MODEL
/// --max-num-seqs 64 --no-enable-prefix-caching`), so a command line carries over.
#[derive(Args)]
struct ServeArgs {
    /// A Hugging Face model directory, or `builtin:tiny` [default: builtin:tiny]; as
    /// `vllm serve MODEL` takes it.
    #[arg(value_name = "MODEL", conflicts_with = "model")]
    model_positional: Option<String>,
    /// The same as MODEL.
    #[arg(long, visible_alias = "model-path")]
    model: Option<String>,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    #[arg(long = "served-model-name")]
    served_model_name: Option<String>,
    /// A chat template to render every chat through in place of the model's, as vLLM's flag:
    /// a file, or the template itself written on one line (`\n` for a newline).
    #[arg(long = "chat-template", value_name = "FILE_OR_TEMPLATE")]
    chat_template: Option<String>,
    /// Run a scenario's `[server]` configuration (batching, KV backend and pool, block size,
    /// chunking, prefix caching, max_model_len): the replica a `sim run` of that scenario
    /// predicts. Its `server.model` names the simulator's model; the engine serves `--model`.
    /// The scheduler flags below then may not be given.
    #[arg(long, value_name = "SCENARIO", conflicts_with_all = [
        "max_batch_size", "batching_mode", "kv_cache_backend", "num_gpu_blocks",
        "gpu_memory_utilization", "block_size", "chunked_prefill", "prefill_chunk_size",
        "max_num_batched_tokens", "prefix_caching", "no_prefix_caching", "no_chunked_prefill",
        "enable_prefix_caching", "enable_chunked_prefill",
        "max_model_len", "kv_admission",
        "kv_preemption", "kv_watermark", "kv_victim", "max_step_read_tokens",
        "scheduling_policy",
    ])]
    scenario: Option<PathBuf>,
    /// Override a key of `--scenario`, e.g. `--set server.max_batch_size=8`.
    #[arg(long = "set", value_name = "KEY=VALUE", requires = "scenario")]
    set: Vec<String>,
    /// Running sequences at most.
    #[arg(long = "max-batch-size", visible_aliases = ["max-num-seqs", "max-running-requests"], default_value_t = 24)]
    max_batch_size: usize,
    #[arg(long = "batching-mode", value_enum, default_value_t = BatchingArg::Continuous)]
    batching_mode: BatchingArg,
    #[arg(long = "kv-cache-backend", value_enum, default_value_t = KvArg::Paged)]
    kv_cache_backend: KvArg,
    /// What admission asks of the KV pool: the prompt's blocks (vLLM; decodes preempt when
    /// it runs dry), the whole sequence's, max_tokens included (TGI; never preempts), or
    /// the prompt's while the pool keeps --kv-watermark of it free, else prompts only alone,
    /// a prompt that does not fit passed over (free-margin: transformers, its margin 0.15).
    #[arg(long = "kv-admission", value_enum, default_value_t = KvAdmissionArg::Prompt)]
    kv_admission: KvAdmissionArg,
    /// What a sequence that finds no free block for its next tokens does: `recompute`
    /// preempts the newest running sequence, which recomputes later (vLLM); `wait` keeps its
    /// blocks and skips steps until finished sequences free some.
    #[arg(long = "kv-preemption", value_enum, default_value_t = KvPreemptionArg::Recompute)]
    kv_preemption: KvPreemptionArg,
    /// The fraction of the paged pool, in [0, 1) and rounded down to whole blocks, a waiting
    /// request's prompt must leave free to be admitted while others run: headroom for their
    /// decodes (vLLM V0's watermark, 0.01 there; default 0). With free-margin admission, the
    /// free fraction under which prompts run only alone.
    #[arg(long = "kv-watermark", default_value_t = 0.0)]
    kv_watermark: f64,
    /// Which running sequence, of those not yet scheduled in the step, a preemption takes:
    /// the newest admitted (vLLM), or a decoding one with the fewest output tokens, the
    /// longest prompt among those (SGLang).
    #[arg(long = "kv-victim", value_enum, default_value_t = KvVictimArg::Newest)]
    kv_victim: KvVictimArg,
    /// The order waiting requests run in: first come first served, or by each request's
    /// `priority`, the lowest value first, then arrival (vLLM's flag). Under `priority` a
    /// shortage of KV blocks preempts a running request of the highest value; under `fcfs` a
    /// request's `priority` must be 0.
    #[arg(long = "scheduling-policy", value_enum, default_value_t = SchedulingPolicyArg::Fcfs)]
    scheduling_policy: SchedulingPolicyArg,
    /// Context tokens a step may read from the cache at most, each sequence's computed
    /// tokens counted: a sequence that would pass it sits the step out, a waiting one lets
    /// those behind it go first (transformers' continuous batching without flash attention:
    /// the pool's size).
    #[arg(long = "max-step-read-tokens")]
    max_step_read_tokens: Option<usize>,
    /// KV pool size in blocks (default 2048); or see --gpu-memory-utilization.
    #[arg(long = "num-gpu-blocks", visible_alias = "num-gpu-blocks-override")]
    num_gpu_blocks: Option<usize>,
    /// Size the KV pool to this fraction of the GPU's memory, less what is already in use
    /// (weights, the measured activation peak, other processes), as vLLM's flag does.
    #[arg(long = "gpu-memory-utilization")]
    gpu_memory_utilization: Option<f64>,
    #[arg(long = "block-size", default_value_t = 16)]
    block_size: usize,
    #[arg(long = "chunked-prefill", default_value_t = true, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    chunked_prefill: bool,
    /// The same as --chunked-prefill (vLLM's spelling: it takes no value, so a MODEL may
    /// follow it).
    #[arg(long = "enable-chunked-prefill", conflicts_with_all = ["chunked_prefill", "no_chunked_prefill"])]
    enable_chunked_prefill: bool,
    /// The same as --chunked-prefill=false.
    #[arg(long = "no-enable-chunked-prefill", conflicts_with = "chunked_prefill")]
    no_chunked_prefill: bool,
    #[arg(long = "prefill-chunk-size", default_value_t = 512)]
    prefill_chunk_size: usize,
    /// Tokens one step processes at most (vLLM's). With chunked prefill, the chunk budget in
    /// place of --prefill-chunk-size; without, prompts stay whole, so at least
    /// --max-model-len. Default: --prefill-chunk-size, or unchunked no limit but the KV pool.
    #[arg(long = "max-num-batched-tokens")]
    max_num_batched_tokens: Option<usize>,
    #[arg(long = "prefix-caching", default_value_t = true, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    prefix_caching: bool,
    /// The same as --prefix-caching (vLLM's spelling, without a value).
    #[arg(long = "enable-prefix-caching", conflicts_with_all = ["prefix_caching", "no_prefix_caching"])]
    enable_prefix_caching: bool,
    /// The same as --prefix-caching=false.
    #[arg(
        long = "no-enable-prefix-caching",
        visible_alias = "disable-radix-cache",
        conflicts_with = "prefix_caching"
    )]
    no_prefix_caching: bool,
    /// Prompt + output tokens a sequence may hold. One longer than the model's context
    /// (`max_position_embeddings`) is refused [default: 4096, or the model's context where
    /// that is shorter].
    #[arg(long = "max-model-len", visible_alias = "context-length")]
    max_model_len: Option<usize>,
    /// Waiting requests at most; beyond it the server answers 503 with Retry-After
    /// [default: 16384].
    #[arg(long = "max-waiting")]
    max_waiting: Option<usize>,
    #[command(flatten)]
    target: TargetArgs,
    /// Every step eager, no CUDA graphs (vLLM's flag; graphs are off unless --cuda-graphs).
    #[arg(long = "enforce-eager")]
    enforce_eager: bool,
    /// Weight dtype. CPU: f32 or bf16 (half the bytes a decode step reads; products of
    /// bf16 weights and bf16-rounded activations accumulate in f32), by default the
    /// checkpoint's `torch_dtype` (bf16 stays bf16, others f32); CUDA: bf16.
    #[arg(long, value_enum)]
    dtype: Option<DTypeArg>,
    /// What the KV cache stores: `auto` (the compute dtype) or `fp8` (alias `fp8_e4m3`:
    /// E4M3, unscaled as vLLM's default: a quarter of the CPU's f32 bytes, half of CUDA's bf16).
    #[arg(long = "kv-cache-dtype")]
    kv_cache_dtype: Option<KvCacheDtype>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Write a CSV trace of every engine step (its shape, forward and step seconds).
    #[arg(long = "step-log")]
    step_log: Option<PathBuf>,
    /// Seconds open requests get to finish after SIGTERM/SIGINT; then (or at a second
    /// signal) they are ended with an error event.
    #[arg(long = "shutdown-timeout", default_value_t = 30.0)]
    shutdown_timeout: f64,
    /// Open connections at most: a new one takes the place of the connection idle the
    /// longest, and is answered 503 only when none is idle.
    #[arg(long = "max-connections", default_value_t = 1024)]
    max_connections: usize,
    /// Open connections at most from one IP address (off by default: behind a router all
    /// traffic comes from one address).
    #[arg(long = "max-connections-per-address", value_name = "N")]
    max_connections_per_address: Option<usize>,
    /// Publish the prefix cache's events for KV-aware routers, as vLLM's flag does:
    /// `{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}`
    /// (ZeroMQ PUB, msgpack `BlockStored`/`BlockRemoved`; see `server/kv_events.rs`).
    #[arg(long = "kv-events-config")]
    kv_events_config: Option<String>,
    /// Requests under /v1 must send `Authorization: Bearer KEY` with this key (repeatable:
    /// any of them), as vLLM's flag; health, metrics and the router endpoints stay open.
    #[arg(long = "api-key", value_name = "KEY")]
    api_key: Vec<String>,
    /// The shape of `GET /get_load`, for the router in front: `vllm` (an object with `load`,
    /// the running and waiting requests) or `sglang` (SGLang's list of
    /// `{dp_rank, num_reqs, num_waiting_reqs, num_tokens}`, which sglang-router reads).
    #[arg(long = "get-load-format", value_enum, default_value_t = LoadFormatArg::Vllm)]
    get_load_format: LoadFormatArg,
    /// Structured JSON output is compact: no optional whitespace between its tokens (vLLM's
    /// `disable_any_whitespace`; by default a model may put whitespace anywhere JSON allows,
    /// which a weak model can repeat until `max_tokens`). A request's
    /// `structured_outputs.disable_any_whitespace` asks the same for itself.
    #[arg(long = "structured-outputs-disable-any-whitespace")]
    structured_outputs_disable_any_whitespace: bool,
    /// Serve `tool_choice: "auto"` (the default when a chat has tools): the model may call
    /// a tool in its own format, which --tool-call-parser finds in the output (vLLM's flag).
    #[arg(long = "enable-auto-tool-choice", requires = "tool_call_parser")]
    enable_auto_tool_choice: bool,
    /// The format the model writes calls in: `hermes` (`<tool_call>…</tool_call>`: Qwen2.5,
    /// Qwen3, Hermes), `llama3_json` (a JSON object per call: Llama 3.1–3.3; also
    /// `llama4_json`), `pythonic` (`[f(a=1)]`: Llama 3.2 and 4; also `llama4_pythonic`),
    /// `mistral` (`[TOOL_CALLS][…]`: Mistral 7B v0.3) or `qwen3_coder`
    /// (`<function=f><parameter=a>…`: Qwen3-Coder). Without --enable-auto-tool-choice it
    /// is not used, as in vLLM.
    #[arg(long = "tool-call-parser", value_enum)]
    tool_call_parser: Option<ToolCallParserArg>,
    /// Split a chat's output into the message's `reasoning` (before `</think>`) and its
    /// `content` (after), as vLLM's flag: `deepseek_r1` (DeepSeek-R1, QwQ), `qwen3` (which
    /// `chat_template_kwargs.enable_thinking: false` turns off) or `deepseek_v3`
    /// (DeepSeek-V3.1, which thinks with `chat_template_kwargs.thinking: true`). Tool calls
    /// and grammars apply to the content.
    #[arg(long = "reasoning-parser", value_enum)]
    reasoning_parser: Option<ReasoningParserArg>,
    /// Where a request leaves a sampling parameter out (temperature, top_p, top_k, min_p,
    /// repetition_penalty; a chat's max_tokens): `auto` takes the model's
    /// `generation_config.json` values, as vLLM does by default; `vllm` the API's own
    /// defaults (temperature 1, no filters).
    #[arg(long = "generation-config", value_enum, default_value_t = GenerationConfigArg::Auto)]
    generation_config: GenerationConfigArg,
}

#[derive(Clone, Copy, ValueEnum)]
enum ToolCallParserArg {
    Hermes,
    #[value(name = "llama3_json", alias = "llama4_json")]
    Llama3Json,
    Mistral,
    #[value(alias = "llama4_pythonic")]
    Pythonic,
    #[value(name = "qwen3_coder")]
    Qwen3Coder,
}

#[derive(Clone, Copy, ValueEnum)]
enum EndpointArg {
    #[value(name = "/v1/completions")]
    Completions,
    #[value(name = "/v1/chat/completions")]
    Chat,
}

#[derive(Clone, Copy, ValueEnum)]
enum ReasoningParserArg {
    // (SGLang's names, `deepseek-r1` and `deepseek-v3`, too.)
    #[value(name = "deepseek_r1", alias = "deepseek-r1")]
    DeepSeekR1,
    Qwen3,
    #[value(name = "deepseek_v3", alias = "deepseek-v3")]
    DeepSeekV3,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum GenerationConfigArg {
    Auto,
    Vllm,
}

#[derive(Clone, Copy, ValueEnum)]
enum LoadFormatArg {
    Vllm,
    Sglang,
}

#[derive(Clone, Copy, ValueEnum)]
enum BatchingArg {
    Static,
    Continuous,
}

#[derive(Clone, Copy, ValueEnum)]
enum KvArg {
    Contiguous,
    Paged,
}

#[derive(Clone, Copy, ValueEnum)]
enum KvAdmissionArg {
    Prompt,
    WholeSequence,
    FreeMargin,
}

#[derive(Clone, Copy, ValueEnum)]
enum KvPreemptionArg {
    Recompute,
    Wait,
}

#[derive(Clone, Copy, ValueEnum)]
enum KvVictimArg {
    Newest,
    FewestOutputs,
}

#[derive(Clone, Copy, ValueEnum)]
enum SchedulingPolicyArg {
    Fcfs,
    Priority,
}

/// The server `bench` and `probe` load.
#[derive(Args)]
struct ServerTarget {
    /// Base URL of an OpenAI-compatible server.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    server: String,
    /// Sent as `Authorization: Bearer KEY` with the server's /v1 requests, for a server
    /// started with an API key (vLLM's benchmark reads the same variable).
    #[arg(
        long = "api-key",
        value_name = "KEY",
        env = "OPENAI_API_KEY",
        hide_env_values = true
    )]
    api_key: Option<String>,
    /// Seconds a request may take, from its send to its stream's end; one that takes
    /// longer fails ("no end within …"). vLLM's benchmark allows 6 hours too.
    #[arg(long = "request-timeout", value_name = "SECONDS", default_value_t = 21600.0,
          value_parser = positive_seconds)]
    request_timeout: f64,
}

/// A positive, finite number of seconds.
fn positive_seconds(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 && v <= 1e9 => Ok(v),
        _ => Err(format!("{s:?} is not a number of seconds in (0, 1e9]")),
    }
}

#[derive(Args)]
struct BenchArgs {
    #[command(flatten)]
    target: ServerTarget,
    /// Empty the server's prefix cache before the run (vLLM's `POST /reset_prefix_cache`),
    /// so that it starts, as its simulation does, with nothing cached by earlier runs.
    #[arg(long = "reset-prefix-cache")]
    reset_prefix_cache: bool,
    #[arg(long)]
    scenario: PathBuf,
    /// The served model name (default: the first of /v1/models).
    #[arg(long)]
    model: Option<String>,
    /// Run directory (default runs/<scenario>-bench-<time>).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Scenario overrides, `key=value` (repeatable).
    #[arg(long = "set")]
    set: Vec<String>,
    /// Service-level objectives for goodput, as vLLM's: `ttft:MS tpot:MS e2el:MS` (any of
    /// them; the scenario's `[slo]` table otherwise).
    #[arg(long, num_args = 1.., value_name = "METRIC:MS")]
    goodput: Vec<String>,
    /// Cut prompts in the served model's own tokens: its Hugging Face directory (or its
    /// tokenizer.json). Default: the simulator's approximate tokenizer (~4 characters a token).
    #[arg(long, value_name = "DIR")]
    tokenizer: Option<PathBuf>,
    /// Ban (`logit_bias` -100) every token of the --tokenizer that alone is part of a
    /// character, so that each token streams as it is generated: servers hold text that
    /// ends mid-character back (llama.cpp's, transformers'), and a random-weight model
    /// generates runs of such tokens.
    #[arg(long = "whole-characters", requires = "tokenizer")]
    whole_characters: bool,
    #[arg(long = "no-progress")]
    no_progress: bool,
    /// Read the server counters (prompt and generated tokens, prefix-cache hits,
    /// preemptions) and the timeseries from these servers' `/metrics` instead of
    /// `--server`'s: the replicas behind a router (whose `/metrics` is one replica's, or
    /// its own). Counters are summed over them.
    #[arg(long = "metrics-from", num_args = 1.., value_name = "URL")]
    metrics_from: Vec<String>,
    /// The API the requests go through (vLLM's benchmark's flag): `/v1/completions`, or
    /// `/v1/chat/completions`, each prompt one user message, which the server's chat
    /// template wraps.
    #[arg(long, value_enum, default_value = "/v1/completions")]
    endpoint: EndpointArg,
}

#[derive(Args)]
struct ProbeArgs {
    #[command(flatten)]
    target: ServerTarget,
    /// A scenario whose `[server]` describes the server (model, GPU, scheduler settings);
    /// the probes bring their own workloads.
    #[arg(long)]
    scenario: PathBuf,
    /// Scenario overrides, `key=value` (repeatable).
    #[arg(long = "set")]
    set: Vec<String>,
    /// The served model name (default: the first of /v1/models).
    #[arg(long)]
    model: Option<String>,
    /// Cut prompts in the served model's own tokens (its Hugging Face directory).
    #[arg(long, value_name = "DIR")]
    tokenizer: Option<PathBuf>,
    /// As `engine bench --whole-characters`.
    #[arg(long = "whole-characters", requires = "tokenizer")]
    whole_characters: bool,
    /// Only these probes, comma-separated (default: all).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Directory for the probes' run directories (default runs/probe-<time>).
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Clone, Copy, ValueEnum)]
enum ArchArg {
    Llama,
    Qwen2,
    Qwen3,
    Mistral,
    Gemma3,
    Phi3,
}

#[derive(Clone, Copy, ValueEnum)]
enum DTypeArg {
    F32,
    Bf16,
}

impl From<DTypeArg> for DType {
    fn from(d: DTypeArg) -> Self {
        match d {
            DTypeArg::F32 => DType::F32,
            DTypeArg::Bf16 => DType::BF16,
        }
    }
}

#[derive(Args)]
struct MakeModelArgs {
    #[arg(long, value_enum)]
    arch: ArchArg,
    #[arg(long, default_value_t = 2)]
    layers: usize,
    #[arg(long, default_value_t = 64)]
    hidden: usize,
    #[arg(long, default_value_t = 4)]
    heads: usize,
    #[arg(long = "kv-heads", default_value_t = 2)]
    kv_heads: usize,
    #[arg(long = "head-dim")]
    head_dim: Option<usize>,
    #[arg(long, default_value_t = 128)]
    intermediate: usize,
    #[arg(long, default_value_t = 512)]
    vocab: usize,
    #[arg(long = "max-pos", default_value_t = 1024)]
    max_pos: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[arg(long, value_enum, default_value_t = DTypeArg::F32)]
    dtype: DTypeArg,
    /// Gemma 3, Mistral and Phi-3: window of the sliding-window layers (every layer of
    /// Mistral's and Phi-3's).
    #[arg(long = "sliding-window", default_value_t = 512)]
    sliding_window: usize,
    #[arg(long)]
    out: PathBuf,
}

#[derive(Args)]
struct GenerateArgs {
    /// A model directory or `builtin:tiny`.
    #[arg(long, default_value = "builtin:tiny")]
    model: String,
    #[arg(long)]
    prompt: String,
    #[arg(long = "max-tokens", default_value_t = 64)]
    max_tokens: usize,
    /// Wrap the prompt as a user message with the model's chat template.
    #[arg(long)]
    chat: bool,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long = "top-p", default_value_t = 1.0)]
    top_p: f32,
    #[arg(long = "top-k", default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Stop strings (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    #[arg(long = "ignore-eos")]
    ignore_eos: bool,
    /// Weight dtype. CPU: f32 or bf16 (half the bytes a decode step reads; products of
    /// bf16 weights and bf16-rounded activations accumulate in f32), by default the
    /// checkpoint's `torch_dtype` (bf16 stays bf16, others f32); CUDA: bf16.
    #[arg(long, value_enum)]
    dtype: Option<DTypeArg>,
    /// What the KV cache stores: `auto` (the compute dtype) or `fp8` (alias `fp8_e4m3`:
    /// E4M3, unscaled as vLLM's default: a quarter of the CPU's f32 bytes, half of CUDA's bf16).
    #[arg(long = "kv-cache-dtype")]
    kv_cache_dtype: Option<KvCacheDtype>,
    #[command(flatten)]
    target: TargetArgs,
}

fn main() -> std::process::ExitCode {
    // Before any thread starts, so that every thread shares the one arena.
    infer_engine::runtime::host::keep_freed_memory();
    // Errors print as one causal chain ("loading …: missing file …"), never as a backtrace.
    match run(Cli::parse()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::MakeModel(a) => {
            let arch = match a.arch {
                ArchArg::Llama => Arch::Llama,
                ArchArg::Qwen2 => Arch::Qwen2,
                ArchArg::Qwen3 => Arch::Qwen3,
                ArchArg::Mistral => Arch::Mistral,
                ArchArg::Gemma3 => Arch::Gemma3,
                ArchArg::Phi3 => Arch::Phi3,
            };
            let spec = ModelSpec {
                layers: a.layers,
                hidden: a.hidden,
                heads: a.heads,
                kv_heads: a.kv_heads,
                head_dim: a.head_dim,
                intermediate: a.intermediate,
                vocab: a.vocab,
                max_pos: a.max_pos,
                seed: a.seed,
                dtype: a.dtype.into(),
                sliding_window: a.sliding_window,
                ..ModelSpec::new(arch)
            };
            make_model(&spec, &a.out)?;
            println!("wrote {} model to {}", arch.name(), a.out.display());
        }
        Command::Generate(a) => run_generate(a)?,
        Command::Serve(a) => run_serve(*a)?,
        Command::Bench(a) => run_bench(a)?,
        Command::Probe(a) => run_probe(a)?,
        Command::Profile(a) => {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?;
            let profile = rt.block_on(infer_engine::tools::profile::profile_model(
                &a.model,
                a.target.target()?,
                a.quick,
            ))?;
            // A profile takes minutes: a missing folder must not lose it.
            if let Some(dir) = a.out.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("{}: cannot create", dir.display()))?;
            }
            std::fs::write(&a.out, serde_json::to_string_pretty(&profile)? + "\n")
                .with_context(|| format!("{}: cannot write", a.out.display()))?;
            print!("{}", infer_engine::tools::profile::describe(&profile));
            println!("wrote {}", a.out.display());
        }
        Command::Verify(a) => {
            let opts = infer_engine::tools::verify::VerifyOptions {
                scenarios: a.scenarios,
                model: a.model,
                target: a.target.target()?,
                profile: a.profile,
                out: a
                    .out
                    .unwrap_or_else(infer_engine::tools::verify::default_out),
                overrides: a.set,
                quick_profile: a.quick_profile,
                repeat: match &a.measured {
                    Some(dir) => infer_engine::tools::verify::kept_repetitions(dir)?.len(),
                    None => a.repeat,
                },
                seeds: a.seeds.max(1),
                measured: a.measured,
            };
            let rt = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?;
            let results = rt.block_on(infer_engine::tools::verify::verify(&opts))?;
            print!(
                "{}",
                infer_engine::tools::verify::write_report(&opts, &results)?
            );
        }
        Command::Report(a) => {
            let out = a
                .out
                .unwrap_or_else(|| infer_reports::default_run_dir("report"));
            infer_reports::write_report(&a.runs, a.baseline.as_deref(), &out)?;
            println!("wrote {}", out.join("report.md").display());
        }
    }
    Ok(())
}

fn run_serve(a: ServeArgs) -> Result<()> {
    let target = a.target.target()?;
    if a.enforce_eager && target.cuda_graphs {
        bail!("--enforce-eager and --cuda-graphs: give one");
    }
    if a.tool_call_parser.is_some() && !a.enable_auto_tool_choice {
        eprintln!(
            "--tool-call-parser without --enable-auto-tool-choice is not used (as in vLLM): \
             tool_choice \"auto\" stays refused"
        );
    }
    let model = a.served_model();
    if a.max_connections == 0 {
        bail!("--max-connections 0 would refuse every connection");
    }
    if a.max_connections_per_address == Some(0) {
        bail!("--max-connections-per-address 0 would refuse every connection");
    }
    if a.gpu_memory_utilization.is_some() && a.num_gpu_blocks.is_some() {
        bail!("--num-gpu-blocks and --gpu-memory-utilization both size the KV pool: give one");
    }
    let (sched, kv_cache_dtype) = match &a.scenario {
        Some(path) => {
            let text =
                std::fs::read_to_string(path).map_err(infer_core::FileError::at(path, "read"))?;
            let scenario =
                infer_core::workload::Scenario::parse(&path.display().to_string(), &text, &a.set)?;
            let sched = SchedulerConfig {
                max_waiting: a.max_waiting.or(scenario.server.max_waiting),
                ..scenario.server.scheduler_config()
            };
            (sched, scenario.server.kv_cache_dtype)
        }
        None => (scheduler_flags(&a), KvCacheDtype::Auto),
    };
    let cfg = ServeConfig {
        served_model_name: a.served_model_name,
        chat_template: a
            .chat_template
            .as_deref()
            .map(infer_engine::runtime::tokenizer::chat_template_arg)
            .transpose()?,
        sched,
        // A scenario's length is its simulated server's, lowered to this model's context.
        max_model_len_is_default: a.scenario.is_some() || a.max_model_len.is_none(),
        seed: a.seed,
        dtype: a.dtype.map(Into::into),
        kv_cache_dtype: a.kv_cache_dtype.unwrap_or(kv_cache_dtype),
        device: target.device,
        cuda_graphs: target.cuda_graphs,
        device_sampling: target.device_sampling,
        gpu_memory_utilization: a.gpu_memory_utilization,
        step_log: a.step_log,
        api_keys: a.api_key,
        compact_json: a.structured_outputs_disable_any_whitespace,
        tool_call_parser: a
            .tool_call_parser
            .filter(|_| a.enable_auto_tool_choice)
            .map(|p| match p {
                ToolCallParserArg::Hermes => {
                    infer_engine::server::tool_parser::ToolCallParser::Hermes
                }
                ToolCallParserArg::Llama3Json => {
                    infer_engine::server::tool_parser::ToolCallParser::Llama3Json
                }
                ToolCallParserArg::Mistral => {
                    infer_engine::server::tool_parser::ToolCallParser::Mistral
                }
                ToolCallParserArg::Pythonic => {
                    infer_engine::server::tool_parser::ToolCallParser::Pythonic
                }
                ToolCallParserArg::Qwen3Coder => {
                    infer_engine::server::tool_parser::ToolCallParser::Qwen3Coder
                }
            }),
        reasoning_parser: a.reasoning_parser.map(|p| match p {
            ReasoningParserArg::DeepSeekR1 => {
                infer_engine::server::reasoning::ReasoningParser::DeepSeekR1
            }
            ReasoningParserArg::Qwen3 => infer_engine::server::reasoning::ReasoningParser::Qwen3,
            ReasoningParserArg::DeepSeekV3 => {
                infer_engine::server::reasoning::ReasoningParser::DeepSeekV3
            }
        }),
        model_sampling_defaults: a.generation_config == GenerationConfigArg::Auto,
        load_format: match a.get_load_format {
            LoadFormatArg::Vllm => infer_engine::server::LoadFormat::Vllm,
            LoadFormatArg::Sglang => infer_engine::server::LoadFormat::Sglang,
        },
        kv_events: a
            .kv_events_config
            .as_deref()
            .map(infer_engine::server::kv_events::KvEventsConfig::parse)
            .transpose()?
            .flatten(),
        shutdown_timeout: std::time::Duration::try_from_secs_f64(a.shutdown_timeout)
            .map_err(|e| anyhow::anyhow!("--shutdown-timeout {}: {e}", a.shutdown_timeout))?,
        http: infer_engine::server::http::HttpLimits {
            max_connections: a.max_connections,
            max_connections_per_address: a.max_connections_per_address,
            ..Default::default()
        },
        ..ServeConfig::new(&model)
    };
    let addr: std::net::SocketAddr = format!("{}:{}", a.host, a.port)
        .parse()
        .map_err(|e| anyhow::anyhow!("--host/--port: {e}"))?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(serve(cfg, addr))
}

impl ServeArgs {
    /// MODEL or --model.
    fn served_model(&self) -> String {
        let given = self.model_positional.as_ref().or(self.model.as_ref());
        given.map_or("builtin:tiny", |m| m).to_string()
    }
}

/// The scheduler as the flags give it.
fn scheduler_flags(a: &ServeArgs) -> SchedulerConfig {
    SchedulerConfig {
        batching_mode: match a.batching_mode {
            BatchingArg::Static => BatchingMode::Static,
            BatchingArg::Continuous => BatchingMode::Continuous,
        },
        max_batch_size: a.max_batch_size,
        kv_cache_backend: match a.kv_cache_backend {
            KvArg::Contiguous => KvBackend::Contiguous,
            KvArg::Paged => KvBackend::Paged,
        },
        num_gpu_blocks: a.num_gpu_blocks.unwrap_or(2048),
        block_size: a.block_size,
        chunked_prefill: a.chunked_prefill && !a.no_chunked_prefill,
        prefill_chunk_size: a.prefill_chunk_size,
        max_num_batched_tokens: a.max_num_batched_tokens,
        prefix_caching: a.prefix_caching && !a.no_prefix_caching,
        max_model_len: a
            .max_model_len
            .unwrap_or(SchedulerConfig::default().max_model_len),
        max_waiting: a
            .max_waiting
            .or(Some(infer_core::scheduler::DEFAULT_MAX_WAITING)),
        kv_admission: match a.kv_admission {
            KvAdmissionArg::Prompt => KvAdmission::Prompt,
            KvAdmissionArg::WholeSequence => KvAdmission::WholeSequence,
            KvAdmissionArg::FreeMargin => KvAdmission::FreeMargin,
        },
        kv_preemption: match a.kv_preemption {
            KvPreemptionArg::Recompute => KvPreemption::Recompute,
            KvPreemptionArg::Wait => KvPreemption::Wait,
        },
        kv_watermark: a.kv_watermark,
        kv_victim: match a.kv_victim {
            KvVictimArg::Newest => KvVictim::Newest,
            KvVictimArg::FewestOutputs => KvVictim::FewestOutputs,
        },
        max_step_read_tokens: a.max_step_read_tokens,
        scheduling_policy: match a.scheduling_policy {
            SchedulingPolicyArg::Fcfs => SchedulingPolicy::Fcfs,
            SchedulingPolicyArg::Priority => SchedulingPolicy::Priority,
        },
    }
}

/// `--tokenizer` (and `--whole-characters`, which needs it): read once, for both.
fn set_tokenizer(
    opts: &mut BenchOptions,
    path: Option<&std::path::Path>,
    whole_characters: bool,
) -> Result<()> {
    if let Some(path) = path {
        let tok = infer_engine::loadgen::prompt_tokenizer(path)?;
        if whole_characters {
            opts.logit_bias = Some(infer_engine::loadgen::whole_character_bias(&tok));
        }
        opts.tokenizer = Some(std::sync::Arc::new(tok));
    }
    Ok(())
}

fn run_bench(a: BenchArgs) -> Result<()> {
    let mut opts = BenchOptions::new(&a.target.server, &a.scenario);
    opts.overrides = a.set;
    opts.overrides
        .extend(infer_core::metrics::Slo::overrides(&a.goodput)?);
    opts.model = a.model;
    opts.api_key = a.target.api_key;
    opts.request_timeout = std::time::Duration::from_secs_f64(a.target.request_timeout);
    opts.reset_prefix_cache = a.reset_prefix_cache;
    opts.progress = !a.no_progress;
    opts.metrics_from = a.metrics_from;
    opts.endpoint = match a.endpoint {
        EndpointArg::Completions => infer_engine::loadgen::BenchEndpoint::Completions,
        EndpointArg::Chat => infer_engine::loadgen::BenchEndpoint::Chat,
    };
    set_tokenizer(&mut opts, a.tokenizer.as_deref(), a.whole_characters)?;
    let name = a
        .scenario
        .file_stem()
        .map_or("bench".to_string(), |s| s.to_string_lossy().to_string());
    let dir = a
        .out
        .unwrap_or_else(|| infer_reports::default_run_dir(&format!("{name}-bench")));
    opts.out = Some(dir.clone());
    let r = match infer_engine::loadgen::run_until_ctrl_c(&opts) {
        Ok(r) => r,
        Err(e) if e.is::<infer_engine::loadgen::InterruptedBeforeRun>() => {
            eprintln!("{e}");
            std::process::exit(130);
        }
        Err(e) => return Err(e),
    };
    print!("{}", r.render());
    println!("run directory: {}", dir.display());
    if r.interrupted.is_some() {
        // As a shell reports a command ended by SIGINT, for scripts that run benches in turn.
        let _ = std::io::stdout().flush();
        std::process::exit(130);
    }
    if r.summary.completed == 0 {
        bail!("no request of the run completed (the failures above say why)");
    }
    Ok(())
}

fn run_probe(a: ProbeArgs) -> Result<()> {
    let mut opts = BenchOptions::new(&a.target.server, &a.scenario);
    opts.overrides = a.set;
    opts.model = a.model;
    opts.api_key = a.target.api_key;
    opts.request_timeout = std::time::Duration::from_secs_f64(a.target.request_timeout);
    set_tokenizer(&mut opts, a.tokenizer.as_deref(), a.whole_characters)?;
    let out = a
        .out
        .unwrap_or_else(|| infer_reports::default_run_dir("probe"));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let runs = rt.block_on(infer_engine::loadgen::probe::run(&opts, &out, &a.only))?;
    print!("{}", infer_engine::loadgen::probe::render(&runs, &out));
    Ok(())
}

fn run_generate(a: GenerateArgs) -> Result<()> {
    let target = a.target.target()?;
    let mut lm = infer_engine::load_model(&a.model, a.dtype.map(Into::into), target.device)?;
    lm.model
        .set_kv_cache_dtype(a.kv_cache_dtype.unwrap_or_default());
    target.apply(&lm.model, 1, lm.config.max_position_embeddings)?;
    let prompt = infer_engine::tools::generate::prompt_tokens(&lm, &a.prompt, a.chat)?;
    let req = GenerateRequest {
        prompt,
        params: SamplingParams {
            temperature: a.temperature,
            top_p: a.top_p,
            top_k: a.top_k,
            seed: Some(a.seed),
            ..Default::default()
        },
        max_tokens: a.max_tokens,
        stop_strings: infer_engine::runtime::detokenize::StopSet::new(&a.stop),
        stop_token_ids: Vec::new(),
        ignore_eos: a.ignore_eos,
        keep_special_tokens: false,
        forks: Vec::new(),
        prompt_logprobs: None,
        constraint: None,
        priority: 0,
    };
    let start = std::time::Instant::now();
    let out = generate(&lm, &[req], GenerateOptions::default(), |_, delta| {
        print!("{delta}");
        let _ = std::io::stdout().flush();
    })?;
    let secs = start.elapsed().as_secs_f64();
    let n = out[0].tokens.len();
    println!();
    eprintln!(
        "[{n} tokens in {secs:.2} s, {:.1} tokens/s, finish: {}]",
        n as f64 / secs,
        out[0].finish.as_str()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::Cli;
    use clap::{CommandFactory, Parser};

    /// Every subcommand's `--help` ends with a command to copy, and that command parses.
    #[test]
    fn every_subcommands_help_has_an_example_that_parses() {
        let mut engine = Cli::command();
        assert!(engine.render_long_help().to_string().contains("Example"));
        // clap's own `help` subcommand aside.
        for sub in engine
            .get_subcommands_mut()
            .filter(|s| s.get_name() != "help")
        {
            let help = sub.render_long_help().to_string();
            let example: Vec<&str> = help
                .lines()
                .skip_while(|l| !l.starts_with("Example"))
                .filter_map(|l| l.trim().strip_prefix("engine "))
                .collect();
            assert!(!example.is_empty(), "engine {}: {help}", sub.get_name());
            for args in example {
                parses(args);
            }
        }
    }

    /// The engine commands the documentation shows parse: their flags and values exist.
    /// Running them needs a model, a server or a port; sim's `docs_commands` test runs the
    /// documentation's cheap commands, and these are the rest of its check.
    #[test]
    fn every_documented_engine_command_parses() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let mut pages = vec![root.join("README.md")];
        for entry in std::fs::read_dir(root.join("docs/guide")).unwrap() {
            pages.push(entry.unwrap().path());
        }
        let mut parsed = 0;
        for page in pages
            .iter()
            .filter(|p| p.extension().is_some_and(|e| e == "md"))
        {
            let mut in_bash = false;
            for line in std::fs::read_to_string(page).unwrap().lines() {
                if line.starts_with("```") {
                    in_bash = line.starts_with("```bash");
                } else if let Some(args) = line
                    .strip_prefix("./target/release/engine ")
                    .filter(|_| in_bash)
                {
                    // A server started in the background: the command is before the `&`.
                    parses(args.trim_end().trim_end_matches('&'));
                    parsed += 1;
                }
            }
        }
        assert!(parsed >= 10, "{parsed} documented engine commands");
    }

    /// `engine ARGS` (shell words: quotes as bash reads them) parses.
    fn parses(args: &str) {
        let words = std::iter::once("engine".to_string()).chain(shell_words(args));
        if let Err(e) = Cli::try_parse_from(words) {
            panic!("engine {args}: {e}");
        }
    }

    /// Split as a shell does, for single and double quotes and backslash escapes (which
    /// here escape any character, in double quotes too).
    fn shell_words(s: &str) -> Vec<String> {
        let mut words = Vec::new();
        // The word being read, once one has begun (`''` is a word, empty).
        let mut word: Option<String> = None;
        let mut quote = None;
        let mut chars = s.chars();
        while let Some(c) = chars.next() {
            match (quote, c) {
                (None, c) if c.is_whitespace() => words.extend(word.take()),
                (None, '\'' | '"') => {
                    quote = Some(c);
                    word.get_or_insert_with(String::new);
                }
                (Some(q), c) if c == q => quote = None,
                (Some('"') | None, '\\') => {
                    word.get_or_insert_with(String::new).extend(chars.next())
                }
                (_, c) => word.get_or_insert_with(String::new).push(c),
            }
        }
        words.extend(word);
        words
    }

    /// A vLLM or SGLang command line configures what ours does with our names.
    #[test]
    fn vllm_and_sglang_flag_names_set_what_ours_do() {
        let serve = |args: &str| {
            let words = std::iter::once("engine".to_string()).chain(shell_words(args));
            match Cli::try_parse_from(words).map(|c| c.command) {
                Ok(super::Command::Serve(a)) => (
                    a.served_model(),
                    super::scheduler_flags(&a),
                    a.target.cuda_graphs,
                ),
                Ok(_) => panic!("{args}: not serve"),
                Err(e) => panic!("{args}: {e}"),
            }
        };
        let ours = serve(
            "serve --model m --max-batch-size 64 --prefix-caching=false \
             --chunked-prefill=false --max-model-len 2048 --num-gpu-blocks 100",
        );
        let vllm = serve(
            "serve m --max-num-seqs 64 --no-enable-prefix-caching --no-enable-chunked-prefill \
             --max-model-len 2048 --num-gpu-blocks-override 100 --enforce-eager",
        );
        let sglang = serve(
            "serve --model-path m --max-running-requests 64 --disable-radix-cache \
             --chunked-prefill=false --context-length 2048 --num-gpu-blocks 100",
        );
        assert_eq!(vllm, ours);
        assert_eq!(sglang, ours);
        assert_ne!(
            serve("serve m").1,
            ours.1,
            "the defaults differ from the settings"
        );
        assert_eq!(serve("serve").0, "builtin:tiny");
        // vLLM's switches take no value: a MODEL after them is the model.
        let (model, on, _) = serve("serve --enable-prefix-caching --enable-chunked-prefill m");
        assert!(on.prefix_caching && on.chunked_prefill && model == "m");
        for clash in [
            "serve m --model n",
            "serve m --prefix-caching --no-enable-prefix-caching",
            "serve m --chunked-prefill=true --no-enable-chunked-prefill",
            "serve m --enable-prefix-caching --disable-radix-cache",
            "serve m --prefix-caching=false --enable-prefix-caching",
            "serve m --enable-auto-tool-choice",
            "serve m --scenario s.toml --max-num-seqs 4",
            "serve m --scenario s.toml --disable-radix-cache",
        ] {
            let words = std::iter::once("engine".to_string()).chain(shell_words(clash));
            assert!(Cli::try_parse_from(words).is_err(), "{clash} parsed");
        }
    }

    #[test]
    fn shell_words_reads_quotes_as_bash() {
        let words = shell_words(r#"serve --x '{"a": 1}' --y "a \"b\"" c\ d '' "#);
        assert_eq!(
            words,
            ["serve", "--x", r#"{"a": 1}"#, "--y", r#"a "b""#, "c d", ""]
        );
    }
}
