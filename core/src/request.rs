//! Requests as the drivers submit them, and the reasons they end.

use serde::{Deserialize, Serialize};

/// A request's identity, chosen by the driver; unique among live requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RequestId(pub u64);

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// When generation stops.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StopConditions {
    /// Output tokens at most (the request's `max_tokens`).
    pub max_tokens: usize,
    /// Keep generating past end-of-sequence tokens (benchmarks use it for fixed lengths).
    pub ignore_eos: bool,
    /// The model's end-of-sequence ids.
    pub eos_token_ids: Vec<u32>,
    /// Further ids that end the request (the API's `stop_token_ids`); honoured even with
    /// `ignore_eos`, as vLLM does.
    pub stop_token_ids: Vec<u32>,
}

impl StopConditions {
    pub fn max_tokens(max_tokens: usize) -> Self {
        StopConditions {
            max_tokens,
            ignore_eos: true,
            ..Default::default()
        }
    }
}

/// A request entering the scheduler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub id: RequestId,
    pub prompt: Vec<u32>,
    pub stop: StopConditions,
}

impl Request {
    pub fn new(id: u64, prompt: Vec<u32>, max_tokens: usize) -> Self {
        Request {
            id: RequestId(id),
            prompt,
            stop: StopConditions::max_tokens(max_tokens),
        }
    }
}

/// Why a request ended (OpenAI's `finish_reason`, plus abort).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An end-of-sequence or stop token (or a stop string, reported by the engine).
    Stop,
    /// `max_tokens` or `max_model_len` reached.
    Length,
    /// Cancelled by the client or the driver.
    Abort,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

/// Where a sequence is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqState {
    Waiting,
    Running,
    /// Evicted from the running set to free KV; waits again and recomputes.
    Preempted,
    Finished(FinishReason),
}

/// What the scheduler knows of a request when it ends (for usage and metrics).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RequestStats {
    pub prompt_tokens: usize,
    pub output_tokens: usize,
    /// Prompt tokens served from the prefix cache at first admission.
    pub cached_tokens: usize,
    pub preemptions: u32,
    /// When it was added, and first scheduled (driver's clock).
    pub arrival_time: f64,
    pub first_scheduled_time: Option<f64>,
    /// When its first output token was computed (vLLM's engine-core `first_token_ts`), and
    /// the sum and largest of the gaps between its later tokens (driver's clock).
    pub first_token_time: Option<f64>,
    pub itl_sum: f64,
    pub itl_max: f64,
}
