//! Scenario files: workload + arrivals + server configuration (+ cluster), parsed from
//! TOML with `--set key=value` overrides. Every error names the file, the key and the
//! reason. Parsing takes the text, not a path: reading files is the drivers' job.

use serde::{Deserialize, Serialize};

use super::arrival::ArrivalSpec;
use super::dist::LengthDist;
use crate::router::RouterKind;
use crate::scheduler::{
    BatchingMode, KvAdmission, KvBackend, KvPreemption, KvVictim, SchedulerConfig, SchedulingPolicy,
};

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    pub name: String,
    #[serde(default)]
    pub description: String,
    pub workload: WorkloadSpec,
    pub arrival: ArrivalSpec,
    #[serde(default)]
    pub server: ServerSpec,
    #[serde(default)]
    pub cluster: Option<ClusterSpec>,
    /// Service-level objectives: a request within all of them counts toward goodput.
    #[serde(default)]
    pub slo: Option<crate::metrics::Slo>,
    /// Simulator-only settings (cost model, …), checked by the simulator.
    #[serde(default)]
    pub sim: Option<toml::Table>,
    /// A deployment plan (`sim plan`: objectives' attainment, keys to vary, named
    /// configurations), checked by the simulator.
    #[serde(default)]
    pub plan: Option<toml::Table>,
    /// The whole scenario as parsed, overrides applied: what a run directory keeps
    /// (`scenario.toml`) so that the run can be simulated again (`sim calibrate`).
    #[serde(skip)]
    pub resolved: toml::Table,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkloadSpec {
    pub num_requests: usize,
    #[serde(default)]
    pub warmup_requests: usize,
    /// Any u64: TOML integers stop at 2^63 - 1, so larger seeds are written as strings
    /// (`seed = "18446744073709551615"`, as `--seed` does).
    #[serde(default = "default_seed", deserialize_with = "seed_of")]
    pub seed: u64,
    /// Tokens of each prompt's unique part (the question, the user turn). Required but with
    /// a trace, which gives every length (unset reads as 0 tokens).
    #[serde(default = "unset")]
    pub prompt_tokens: LengthDist,
    /// The request's `max_tokens` (and, in conversations, the length of earlier replies).
    #[serde(default = "unset")]
    pub output_tokens: LengthDist,
    #[serde(default)]
    pub ignore_eos: bool,
    /// One prefix of this many tokens shared by every prompt.
    #[serde(default)]
    pub shared_prefix_tokens: Option<usize>,
    #[serde(default)]
    pub groups: Option<GroupsSpec>,
    #[serde(default)]
    pub conversations: Option<ConversationsSpec>,
    /// Replay a recorded trace's arrivals and lengths (with `[arrival] kind = "trace"`);
    /// drivers read the file ([`super::Trace::load`]).
    #[serde(default)]
    pub trace: Option<super::TraceSpec>,
    /// Some requests ask for structured output (a JSON schema their output follows).
    #[serde(default)]
    pub structured_output: Option<StructuredOutputSpec>,
    /// Requests of several priorities (vLLM's `priority`, which a server with
    /// `scheduling_policy = "priority"` runs the lowest first), each drawn from the seed:
    /// `[[workload.priorities]]` tables of a `priority` and the `fraction` of requests that
    /// have it, the fractions summing to 1. Absent: every request has priority 0.
    #[serde(default)]
    pub priorities: Option<Vec<PriorityClass>>,
}

/// The share of a workload's requests with one priority.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PriorityClass {
    pub priority: i64,
    /// In (0, 1].
    pub fraction: f64,
}

/// Requests whose output follows a grammar: in `engine bench` they send
/// `structured_outputs` with a fixed JSON schema that cannot end before `max_tokens`
/// (so their lengths are the workload's, as `ignore_eos` would make them); in the
/// simulator each of their tokens pays the profiled grammar cost.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StructuredOutputSpec {
    /// The share of requests that are constrained, 0 to 1 (each drawn from the seed).
    pub fraction: f64,
}

fn default_seed() -> u64 {
    42
}

fn unset() -> LengthDist {
    LengthDist::Fixed(0)
}

/// G groups × P prompts: each group shares a system prompt (llm-d's shared_prefix data).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GroupsSpec {
    pub count: usize,
    pub prompts_per_group: usize,
    pub system_tokens: usize,
    /// The order the G×P prompts are sent in, each time through the set.
    #[serde(default)]
    pub order: RequestOrder,
}

/// The order of a workload's shared-prefix requests (groups' prompts, conversations'
/// turns).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RequestOrder {
    /// A seeded random order (SGLang's generated-shared-prefix data is shuffled): groups,
    /// or a round's conversations, come in no pattern a router could fall in step with.
    #[default]
    Shuffled,
    /// Strictly in turn (group 0, 1, …, G−1, then again): a round-robin router over R
    /// replicas sends each group to the same replica when R divides G and never when it
    /// does not, and a least-recently-used cache meets its worst case.
    Interleaved,
}

/// Multi-turn conversations: turn t's prompt holds every earlier turn and reply.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConversationsSpec {
    pub count: usize,
    pub min_turns: usize,
    #[serde(default)]
    pub max_turns: Option<usize>,
    /// A system prompt opening every conversation, in tokens.
    #[serde(default)]
    pub system_tokens: usize,
    /// The order of each round's conversations (turn t of every conversation still comes
    /// before turn t+1 of any).
    #[serde(default)]
    pub order: RequestOrder,
}

/// What the KV cache stores (vLLM's `--kv-cache-dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvCacheDtype {
    /// The model's own: what the server computes attention in.
    #[default]
    Auto,
    /// FP8 E4M3 (1 byte per element), unscaled (vLLM's default scales of 1.0), rounded to
    /// nearest and saturated at ±448: half of bf16's bytes, so twice the tokens per GiB and
    /// half the KV a decode step reads.
    #[serde(alias = "fp8_e4m3")]
    Fp8,
}

impl KvCacheDtype {
    pub fn is_auto(&self) -> bool {
        *self == KvCacheDtype::Auto
    }
}

/// vLLM's names, as a flag takes them: `auto`, `fp8`, `fp8_e4m3`; its `fp8_e5m2` (and
/// anything else) is refused. A scenario's key reads the same names through serde.
impl std::str::FromStr for KvCacheDtype {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(KvCacheDtype::Auto),
            "fp8" | "fp8_e4m3" => Ok(KvCacheDtype::Fp8),
            other => Err(format!(
                "`{other}` is not a KV cache dtype this engine stores (auto, fp8, fp8_e4m3)"
            )),
        }
    }
}

/// The seed server's flags, snake_case. Defaults are the benchmark log's Phase 8.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerSpec {
    /// A catalog name (sim) or a model directory / `builtin:tiny` (engine).
    pub model: String,
    /// A catalog name (sim only).
    pub hardware: String,
    pub batching_mode: BatchingMode,
    pub kv_cache_backend: KvBackend,
    pub max_batch_size: usize,
    pub num_gpu_blocks: usize,
    pub block_size: usize,
    pub chunked_prefill: bool,
    pub prefill_chunk_size: usize,
    pub max_num_batched_tokens: Option<usize>,
    pub prefix_caching: bool,
    pub cuda_graphs: bool,
    pub max_model_len: usize,
    pub max_waiting: Option<usize>,
    /// `prompt` (vLLM) or `whole_sequence` (reserve `max_tokens` too; see [`KvAdmission`]).
    pub kv_admission: KvAdmission,
    /// `recompute` (vLLM) or `wait` (see [`KvPreemption`]).
    pub kv_preemption: KvPreemption,
    /// Fraction of the paged pool admission leaves free (vLLM V0's `watermark`).
    pub kv_watermark: f64,
    /// `newest` (vLLM) or `fewest_outputs` (SGLang; see [`KvVictim`]).
    pub kv_victim: KvVictim,
    /// Context tokens a step may read at most (see [`SchedulerConfig`]); absent: no limit.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_step_read_tokens: Option<usize>,
    /// What the KV cache stores: `auto` or `fp8` (see [`KvCacheDtype`]).
    #[serde(skip_serializing_if = "KvCacheDtype::is_auto")]
    pub kv_cache_dtype: KvCacheDtype,
    /// `fcfs` or `priority` (vLLM's `--scheduling-policy`; see [`SchedulingPolicy`]).
    #[serde(skip_serializing_if = "SchedulingPolicy::is_fcfs")]
    pub scheduling_policy: SchedulingPolicy,
}

impl Default for ServerSpec {
    fn default() -> Self {
        let s = SchedulerConfig::default();
        ServerSpec {
            model: "llama-3.2-3b".into(),
            hardware: "rtx-5080".into(),
            batching_mode: s.batching_mode,
            kv_cache_backend: s.kv_cache_backend,
            max_batch_size: s.max_batch_size,
            num_gpu_blocks: s.num_gpu_blocks,
            block_size: s.block_size,
            chunked_prefill: s.chunked_prefill,
            prefill_chunk_size: s.prefill_chunk_size,
            max_num_batched_tokens: s.max_num_batched_tokens,
            prefix_caching: s.prefix_caching,
            cuda_graphs: false,
            max_model_len: s.max_model_len,
            max_waiting: s.max_waiting,
            kv_admission: s.kv_admission,
            kv_preemption: s.kv_preemption,
            kv_watermark: s.kv_watermark,
            kv_victim: s.kv_victim,
            max_step_read_tokens: s.max_step_read_tokens,
            kv_cache_dtype: KvCacheDtype::Auto,
            scheduling_policy: s.scheduling_policy,
        }
    }
}

impl ServerSpec {
    pub fn scheduler_config(&self) -> SchedulerConfig {
        SchedulerConfig {
            batching_mode: self.batching_mode,
            max_batch_size: self.max_batch_size,
            kv_cache_backend: self.kv_cache_backend,
            num_gpu_blocks: self.num_gpu_blocks,
            block_size: self.block_size,
            chunked_prefill: self.chunked_prefill,
            prefill_chunk_size: self.prefill_chunk_size,
            max_num_batched_tokens: self.max_num_batched_tokens,
            prefix_caching: self.prefix_caching,
            max_model_len: self.max_model_len,
            max_waiting: self.max_waiting,
            kv_admission: self.kv_admission,
            kv_preemption: self.kv_preemption,
            kv_watermark: self.kv_watermark,
            kv_victim: self.kv_victim,
            max_step_read_tokens: self.max_step_read_tokens,
            scheduling_policy: self.scheduling_policy,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterSpec {
    pub replicas: usize,
    pub router: RouterKind,
    /// The router sees replica state this many seconds old (stale metrics).
    #[serde(default)]
    pub metrics_delay_s: f64,
    #[serde(default = "default_router_seed")]
    pub router_seed: u64,
}

fn seed_of<'de, D: serde::Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    // The last two catch what is no seed, so that the error says what a seed is rather
    // than serde's "did not match any variant".
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Seed {
        Int(u64),
        Text(String),
        Negative(i64),
        Other(serde::de::IgnoredAny),
    }
    let what = format!("a whole number from 0 to {}", u64::MAX);
    let refuse = |reason: String| Err(serde::de::Error::custom(reason));
    match Seed::deserialize(d)? {
        Seed::Int(n) => Ok(n),
        Seed::Text(t) => match t.trim().parse() {
            Ok(n) => Ok(n),
            Err(_) => refuse(format!("`{t}` is not a seed ({what})")),
        },
        Seed::Negative(n) => refuse(format!("`{n}` is not a seed ({what})")),
        Seed::Other(_) => refuse(format!(
            "a seed is {what} (past 2^63 - 1 written as a string)"
        )),
    }
}

fn default_router_seed() -> u64 {
    7
}

/// The most replicas a cluster may have: each is a whole scheduler and KV pool in memory,
/// and a thousand already spans any one deployment a simulation answers questions about.
pub const MAX_REPLICAS: usize = 1024;

/// A scenario problem: the file, the key and the reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScenarioError {
    pub file: String,
    pub key: String,
    pub reason: String,
}

impl std::fmt::Display for ScenarioError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.key.is_empty() {
            write!(f, "{}: {}", self.file, self.reason)
        } else {
            write!(f, "{}: key `{}`: {}", self.file, self.key, self.reason)
        }
    }
}

impl std::error::Error for ScenarioError {}

impl Scenario {
    /// The fewest tokens a prompt can bring to a step and the longest prompt the workload
    /// can send: its shared prefix or system prompt plus the smallest and the largest
    /// `prompt_tokens` — without the prefix for the fewest when prefix caching may serve it.
    /// A trace's or a conversation's (whose turns carry their history) are bounded by 1 and
    /// `max_model_len` alone.
    pub fn prompt_range(&self) -> (usize, usize) {
        let w = &self.workload;
        let bound = self.server.max_model_len.saturating_sub(1).max(1);
        if w.trace.is_some() || w.conversations.is_some() {
            return (1, bound);
        }
        let prefix = w.shared_prefix_tokens.unwrap_or(0) + w.groups.map_or(0, |g| g.system_tokens);
        let cached = if self.server.prefix_caching {
            prefix
        } else {
            0
        };
        (
            (prefix - cached + w.prompt_tokens.min()).clamp(1, bound),
            (prefix + w.prompt_tokens.max()).clamp(1, bound),
        )
    }

    /// Parse `text` (from `file`, named in errors), apply `overrides` (`key=value`, dotted
    /// keys, TOML values; bare words are taken as strings) and validate.
    pub fn parse(file: &str, text: &str, overrides: &[String]) -> Result<Scenario, ScenarioError> {
        let err = |key: &str, reason: String| ScenarioError {
            file: file.to_string(),
            key: key.to_string(),
            reason,
        };
        let mut table: toml::Table = toml::from_str(text).map_err(|e| {
            let at = e.span().map_or(String::new(), |span| {
                let before = &text[..span.start.min(text.len())];
                let line = before.matches('\n').count() + 1;
                let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
                format!(" at line {line}, column {column}")
            });
            err("", format!("invalid TOML{at}: {}", e.message().trim()))
        })?;
        for o in overrides {
            let (key, value) = o
                .split_once('=')
                .ok_or_else(|| err(o, "an override must look like key=value".into()))?;
            let named = if key.trim().is_empty() { o } else { key.trim() };
            set_path(&mut table, key.trim(), parse_value(value.trim()))
                .map_err(|reason| err(named, reason))?;
        }
        let resolved = table.clone();
        let mut scenario: Scenario = serde_path_to_error::deserialize(toml::Value::Table(table))
            .map_err(|e| {
                let path = e.path().to_string();
                let key = if path == "." { String::new() } else { path };
                err(&key, e.into_inner().message().to_string())
            })?;
        scenario
            .validate()
            .map_err(|(key, reason)| err(&key, reason))?;
        scenario.resolved = with_absolute_paths(resolved, file);
        Ok(scenario)
    }

    fn validate(&self) -> Result<(), (String, String)> {
        let w = &self.workload;
        let at = |section: &str, key: &str| format!("{section}.{key}");
        if w.num_requests == 0 {
            return Err((at("workload", "num_requests"), "must be at least 1".into()));
        }
        if w.warmup_requests >= w.num_requests {
            return Err((
                at("workload", "warmup_requests"),
                format!(
                    "{} warm-up requests leave none of the {} requests to measure",
                    w.warmup_requests, w.num_requests
                ),
            ));
        }
        if let Some(s) = &w.structured_output {
            if !(0.0..=1.0).contains(&s.fraction) {
                return Err((
                    at("workload", "structured_output.fraction"),
                    format!("must be between 0 and 1, got {}", s.fraction),
                ));
            }
        }
        if let Some(classes) = &w.priorities {
            let key = at("workload", "priorities");
            if classes.is_empty() {
                return Err((key, "needs at least one priority (or leave it out)".into()));
            }
            for (i, c) in classes.iter().enumerate() {
                if !(c.fraction > 0.0 && c.fraction <= 1.0) {
                    return Err((
                        format!("{key}[{i}].fraction"),
                        format!("must be in (0, 1], got {}", c.fraction),
                    ));
                }
                if classes[..i].iter().any(|d| d.priority == c.priority) {
                    return Err((
                        format!("{key}[{i}].priority"),
                        format!("priority {} is listed twice", c.priority),
                    ));
                }
            }
            let sum: f64 = classes.iter().map(|c| c.fraction).sum();
            if (sum - 1.0).abs() > 1e-6 {
                return Err((key, format!("the fractions must sum to 1, got {sum}")));
            }
        }
        if w.trace.is_some() {
            for (key, dist) in [
                ("prompt_tokens", &w.prompt_tokens),
                ("output_tokens", &w.output_tokens),
            ] {
                if *dist != unset() {
                    return Err((
                        at("workload", key),
                        "a trace gives every request's lengths: leave it out".into(),
                    ));
                }
            }
        } else if w.output_tokens.min() == 0 {
            return Err((
                at("workload", "output_tokens"),
                "is required, at least 1 token".into(),
            ));
        }
        let forms = [
            w.shared_prefix_tokens.is_some(),
            w.groups.is_some(),
            w.conversations.is_some(),
            w.trace.is_some(),
        ];
        if forms.iter().filter(|&&f| f).count() > 1 {
            return Err((
                "workload".into(),
                "choose at most one of shared_prefix_tokens, groups, conversations, trace".into(),
            ));
        }
        if let Some(t) = &w.trace {
            t.validate()
                .map_err(|(k, r)| (format!("workload.trace.{k}"), r))?;
        }
        let trace_arrivals = self.arrival.kind == super::ArrivalKind::Trace;
        let timed = w.trace.as_ref().is_some_and(|t| t.format.is_timed());
        if trace_arrivals != timed {
            let reason = if w.trace.is_some() && !timed {
                "a sharegpt trace has no times: its arrivals come from [arrival] (poisson, \
                 concurrency, …), not kind = \"trace\""
            } else {
                "kind = \"trace\" and a timed [workload] trace (azure, requests) go together"
            };
            return Err(("arrival.kind".into(), reason.into()));
        }
        if let Some(t) = w.trace.as_ref().filter(|t| !t.format.is_timed()) {
            if t.time_scale != 1.0 {
                return Err((
                    "workload.trace.time_scale".into(),
                    "a sharegpt trace has no times to scale: set [arrival]'s rate instead".into(),
                ));
            }
        }
        if let Some(g) = w.groups {
            if g.count == 0 || g.prompts_per_group == 0 {
                return Err((
                    at("workload", "groups"),
                    "count and prompts_per_group must be >= 1".into(),
                ));
            }
            // The generator cycles through count × prompts_per_group prompts: the product
            // has to be a number it can count to.
            if g.count.checked_mul(g.prompts_per_group).is_none() {
                return Err((
                    at("workload", "groups"),
                    format!(
                        "count {} × prompts_per_group {} is more prompts than can be counted",
                        g.count, g.prompts_per_group
                    ),
                ));
            }
        }
        if let Some(c) = w.conversations {
            if c.count == 0 || c.min_turns == 0 {
                return Err((
                    at("workload", "conversations"),
                    "count and min_turns must be >= 1".into(),
                ));
            }
            if c.max_turns.is_some_and(|m| m < c.min_turns) {
                return Err((
                    at("workload", "conversations"),
                    "max_turns is below min_turns".into(),
                ));
            }
        }
        // A shared prefix or a group's system prompt fills a prompt whose own part is empty.
        if w.prompt_tokens.min() == 0
            && w.shared_prefix_tokens.unwrap_or(0) == 0
            && w.groups.is_none_or(|g| g.system_tokens == 0)
            && w.trace.is_none()
        {
            return Err((
                at("workload", "prompt_tokens"),
                "prompts need at least 1 token".into(),
            ));
        }
        // The server first: the lengths below are checked against its max_model_len.
        self.server
            .scheduler_config()
            .validate()
            .map_err(|(k, r)| (at("server", k), r))?;
        // Lengths must fit the server: a heavy tail without a clip (a lognormal without
        // `max`) or a fixed length past max_model_len is a mistake, not a workload.
        let max_len = self.server.max_model_len;
        let prefix = w.shared_prefix_tokens.unwrap_or(0)
            + w.groups.map_or(0, |g| g.system_tokens)
            + w.conversations.map_or(0, |c| c.system_tokens);
        let (prefix_key, prefix_what) = match (w.shared_prefix_tokens, w.groups, w.conversations) {
            (Some(_), _, _) => ("shared_prefix_tokens", "the shared prefix"),
            (_, Some(_), _) => ("groups", "the group's system prompt"),
            _ => ("conversations", "the system prompt"),
        };
        if prefix >= max_len {
            return Err((
                at("workload", prefix_key),
                format!(
                    "{prefix_what} alone is {prefix} tokens, not below server.max_model_len \
                     {max_len}"
                ),
            ));
        }
        let longest = w.prompt_tokens.max().saturating_add(prefix);
        if longest >= max_len {
            return Err((
                at("workload", "prompt_tokens"),
                format!(
                    "prompts reach {longest} tokens{}, not below server.max_model_len {max_len}: \
                     bound the distribution (its `max`) below {}",
                    if prefix > 0 {
                        format!(" ({prefix} of them {prefix_what})")
                    } else {
                        String::new()
                    },
                    max_len - prefix
                ),
            ));
        }
        if w.output_tokens.max() > max_len {
            return Err((
                at("workload", "output_tokens"),
                format!(
                    "outputs reach {} tokens, beyond server.max_model_len {max_len}: bound the \
                     distribution (its `max`)",
                    w.output_tokens.max()
                ),
            ));
        }
        // A request whose prompt and max_tokens pass max_model_len is refused by the server
        // (400, as vLLM's): a workload none of whose requests fits is a mistake.
        let shortest = prefix + w.prompt_tokens.min() + w.output_tokens.min();
        if w.trace.is_none() && shortest > max_len {
            return Err((
                at("workload", "output_tokens"),
                format!(
                    "every request asks for more than server.max_model_len {max_len}: its \
                     shortest prompt and output make {shortest} tokens, and a server refuses \
                     such a request (400) rather than cut it short"
                ),
            ));
        }
        self.arrival
            .validate()
            .map_err(|(k, r)| (at("arrival", k), r))?;
        if let Some(c) = &self.cluster {
            if !(1..=MAX_REPLICAS).contains(&c.replicas) {
                return Err((
                    at("cluster", "replicas"),
                    format!("must be 1 to {MAX_REPLICAS}, got {}", c.replicas),
                ));
            }
            if !(c.metrics_delay_s >= 0.0 && c.metrics_delay_s.is_finite()) {
                return Err((at("cluster", "metrics_delay_s"), "must be >= 0".into()));
            }
        }
        if let Some(slo) = &self.slo {
            slo.validate().map_err(|(k, r)| (at("slo", k), r))?;
        }
        Ok(())
    }
}

/// A command-line value: TOML if it parses as one (numbers, booleans, arrays, tables),
/// otherwise a plain string.
fn parse_value(s: &str) -> toml::Value {
    toml::from_str::<toml::Table>(&format!("v = {s}"))
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(s.to_string()))
}

fn set_path(table: &mut toml::Table, key: &str, value: toml::Value) -> Result<(), String> {
    let parts: Vec<&str> = key.split('.').collect();
    if parts.iter().any(|p| p.is_empty()) {
        return Err("empty key segment".into());
    }
    let mut cur = table;
    for p in &parts[..parts.len() - 1] {
        let entry = cur
            .entry(p.to_string())
            .or_insert_with(|| toml::Value::Table(Default::default()));
        cur = entry
            .as_table_mut()
            .ok_or_else(|| format!("`{p}` is not a table, cannot set a key inside it"))?;
    }
    cur.insert(parts[parts.len() - 1].to_string(), value);
    Ok(())
}

/// Where a file a scenario names is: the path as given if it exists there (or is absolute),
/// else next to the scenario file. Every driver resolves `[workload] trace.path`,
/// `[sim] profile` and `[sim] calibration` so.
pub fn resolve_path(path: &str, scenario_file: &str) -> std::path::PathBuf {
    let given = std::path::PathBuf::from(path);
    if given.exists() || given.is_absolute() {
        return given;
    }
    std::path::Path::new(scenario_file)
        .parent()
        .map_or(given.clone(), |dir| dir.join(&given))
}

/// The files a scenario names, as keys of its table.
const PATH_KEYS: [&[&str]; 3] = [
    &["workload", "trace", "path"],
    &["sim", "profile"],
    &["sim", "calibration"],
];

/// `table` with the files it names made absolute ([`resolve_path`] from `file`): a run
/// directory keeps it as `scenario.toml`, which is read again from another directory (`sim
/// calibrate RUN`, `engine verify --measured`), where a path relative to the scenario's own
/// folder would name nothing.
fn with_absolute_paths(mut table: toml::Table, file: &str) -> toml::Table {
    for keys in PATH_KEYS {
        let (last, parents) = keys.split_last().expect("a key");
        let mut at = Some(&mut table);
        for k in parents {
            at = at
                .and_then(|t| t.get_mut(*k))
                .and_then(toml::Value::as_table_mut);
        }
        if let Some(toml::Value::String(p)) = at.and_then(|t| t.get_mut(*last)) {
            if let Ok(absolute) = std::path::absolute(resolve_path(p, file)) {
                *p = absolute.display().to_string();
            }
        }
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_cache_dtypes_take_vllms_names_and_refuse_e5m2() {
        assert_eq!("auto".parse(), Ok(KvCacheDtype::Auto));
        assert_eq!("fp8".parse(), Ok(KvCacheDtype::Fp8));
        assert_eq!("fp8_e4m3".parse(), Ok(KvCacheDtype::Fp8));
        let refused = "fp8_e5m2".parse::<KvCacheDtype>().unwrap_err();
        assert!(refused.contains("fp8_e5m2"), "{refused}");
    }

    const BASE: &str = r#"
name = "t"
[workload]
num_requests = 10
prompt_tokens = 256
output_tokens = { uniform = [64, 256] }
[arrival]
kind = "poisson"
rate = 6.0
[server]
prefill_chunk_size = 512
"#;

    fn parse(extra: &[&str]) -> Result<Scenario, ScenarioError> {
        let o: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        Scenario::parse("scenarios/t.toml", BASE, &o)
    }

    #[test]
    fn parses_with_defaults_and_overrides() {
        let s = parse(&[
            "server.prefix_caching=false",
            "arrival.rate=8",
            "workload.num_requests=100000",
        ])
        .unwrap();
        assert!(!s.server.prefix_caching);
        assert_eq!(s.arrival.rate, Some(8.0));
        assert_eq!(s.workload.num_requests, 100_000);
        assert_eq!(s.workload.seed, 42);
        assert_eq!(s.server.block_size, 16);
        let s = parse(&["server.model=builtin:tiny"]).unwrap();
        assert_eq!(s.server.model, "builtin:tiny");
    }

    #[test]
    fn errors_name_file_key_and_reason() {
        let e = parse(&["server.bogus=1"]).unwrap_err();
        assert_eq!(e.file, "scenarios/t.toml");
        assert!(e.reason.contains("unknown field `bogus`"), "{e}");
        assert!(e.to_string().starts_with("scenarios/t.toml: "), "{e}");

        let e = parse(&["server.max_batch_size=\"many\""]).unwrap_err();
        assert_eq!(e.key, "server.max_batch_size");
        assert!(e.reason.contains("invalid type"), "{e}");

        let e = parse(&["server.prefill_chunk_size=0"]).unwrap_err();
        assert_eq!(e.key, "server.prefill_chunk_size");

        let e = parse(&["workload.prompt_tokens={ mix = [] }"]).unwrap_err();
        assert_eq!(e.key, "workload.prompt_tokens");
        assert!(e.reason.contains("empty"), "{e}");

        let e = parse(&["arrival.rate=-2"]).unwrap_err();
        assert_eq!(e.key, "arrival.rate");
        assert!(e.reason.contains("positive"), "{e}");

        let e = Scenario::parse("x.toml", "name = ", &[]).unwrap_err();
        assert!(e.reason.contains("invalid TOML"), "{e}");
        assert!(e.reason.contains("line 1, column"), "{e}");
        let e = Scenario::parse("x.toml", "name = \"t\"\n[workload\n", &[]).unwrap_err();
        assert!(e.reason.contains("line 2, column"), "{e}");
    }

    #[test]
    fn priority_classes_are_distinct_with_fractions_summing_to_one() {
        let with = |classes: &str| parse(&[&format!("workload.priorities=[{classes}]")]);
        let s =
            with("{ priority = -1, fraction = 0.25 }, { priority = 3, fraction = 0.75 }").unwrap();
        let classes = s.workload.priorities.unwrap();
        assert_eq!((classes[0].priority, classes[1].fraction), (-1, 0.75));
        for (classes, key, why) in [
            ("", "workload.priorities", "at least one"),
            (
                "{ priority = 0, fraction = 0.5 }, { priority = 1, fraction = 0.4 }",
                "workload.priorities",
                "sum to 1, got 0.9",
            ),
            (
                "{ priority = 0, fraction = 0.5 }, { priority = 0, fraction = 0.5 }",
                "workload.priorities[1].priority",
                "listed twice",
            ),
            (
                "{ priority = 0, fraction = 1.5 }, { priority = 1, fraction = -0.5 }",
                "workload.priorities[0].fraction",
                "(0, 1]",
            ),
            (
                "{ priority = 0.5, fraction = 1 }",
                "workload.priorities[0].priority",
                "invalid type",
            ),
            (
                "{ priority = 0, share = 1 }",
                "workload.priorities[0].share",
                "unknown field `share`",
            ),
        ] {
            let e = with(classes).unwrap_err();
            assert_eq!(e.key, key, "{classes}: {e}");
            assert!(e.reason.contains(why), "{classes}: {e}");
        }
    }

    #[test]
    fn groups_too_many_to_count_are_refused() {
        let e = parse(&[
            "workload.groups={ count = 4294967296, prompts_per_group = 4294967296, \
             system_tokens = 100 }",
        ])
        .unwrap_err();
        assert_eq!(e.key, "workload.groups");
        assert!(e.reason.contains("more prompts than can be counted"), "{e}");
    }

    #[test]
    fn seeds_that_are_no_seed_say_what_a_seed_is() {
        let max = "18446744073709551615";
        assert_eq!(
            parse(&[&format!("workload.seed=\"{max}\"")])
                .unwrap()
                .workload
                .seed,
            u64::MAX
        );
        for (seed, says) in [
            (
                "-1",
                format!("`-1` is not a seed (a whole number from 0 to {max})"),
            ),
            (
                "\"x\"",
                format!("`x` is not a seed (a whole number from 0 to {max})"),
            ),
            (
                "1.5",
                format!(
                    "a seed is a whole number from 0 to {max} (past 2^63 - 1 written as a string)"
                ),
            ),
        ] {
            let e = parse(&[&format!("workload.seed={seed}")]).unwrap_err();
            assert_eq!(e.key, "workload.seed");
            assert_eq!(e.reason, says, "{seed}");
        }
    }

    #[test]
    fn empty_prompts_are_refused_unless_a_system_prompt_fills_them() {
        let groups = |system: usize| {
            format!(
                "workload.groups={{ count = 1, prompts_per_group = 1, system_tokens = {system} }}"
            )
        };
        let e = parse(&["workload.prompt_tokens=0", &groups(0)]).unwrap_err();
        assert_eq!(e.key, "workload.prompt_tokens");
        assert_eq!(e.reason, "prompts need at least 1 token");
        parse(&["workload.prompt_tokens=0", &groups(100)]).unwrap();
    }

    #[test]
    fn lengths_beyond_the_server_are_refused_with_their_key() {
        let key = |o: &[&str]| parse(o).unwrap_err().key;
        // A heavy tail without a clip.
        let tail = "workload.prompt_tokens={ lognormal = { median = 300, sigma = 60 } }";
        assert_eq!(key(&[tail]), "workload.prompt_tokens");
        let clipped =
            "workload.prompt_tokens={ lognormal = { median = 300, sigma = 60, max = 4000 } }";
        parse(&[clipped]).unwrap();
        assert_eq!(
            key(&["workload.prompt_tokens=10000000000"]),
            "workload.prompt_tokens"
        );
        assert_eq!(
            key(&["workload.prompt_tokens=4096"]),
            "workload.prompt_tokens"
        );
        assert_eq!(
            key(&["workload.output_tokens=5000"]),
            "workload.output_tokens"
        );
        assert_eq!(
            key(&["workload.shared_prefix_tokens=10000000000"]),
            "workload.shared_prefix_tokens"
        );
        // A prefix and a prompt that each fit but not together.
        let e = parse(&["workload.shared_prefix_tokens=3900"]).unwrap_err();
        assert_eq!(e.key, "workload.prompt_tokens");
        assert!(e.reason.contains("3900 of them the shared prefix"), "{e}");
        assert_eq!(
            key(&["workload.warmup_requests=10"]),
            "workload.warmup_requests"
        );
    }
}
