//! The OpenAI wire format: request bodies, their validation, and error responses.
//!
//! Bodies are parsed by hand from JSON values (not by a typed extractor) so that every
//! mistake — malformed JSON, a field of the wrong type, an out-of-range value — becomes an
//! OpenAI-style 400 naming the field, never a framework-specific status.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use infer_kernels::sampling::MAX_TOP_LOGPROBS;
use serde_json::{json, Map, Value};

use super::structured::StructuredRequest;
use crate::runtime::model::SamplingDefaults;
use crate::runtime::sampling::SamplingParams;
use crate::runtime::tokenizer::{TemplateOptions, TurnReasoning};

/// An error as OpenAI and vLLM return it: `{"error": {message, type, param, code}}`.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    /// Seconds a client should wait (503).
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn bad_request(param: Option<&str>, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_string),
            retry_after: None,
        }
    }

    pub fn not_found(param: &str, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            ..Self::bad_request(Some(param), message)
        }
    }

    pub fn too_large(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            ..Self::bad_request(None, message)
        }
    }

    pub fn overloaded(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            kind: "service_unavailable_error",
            param: None,
            retry_after: Some(1),
        }
    }

    pub fn internal(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "internal_server_error",
            param: None,
            retry_after: None,
        }
    }

    /// Says which prompt of a batch the error is about (unchanged for a lone prompt).
    pub fn in_prompt(mut self, index: usize, count: usize) -> Self {
        if count > 1 {
            self.message = format!("prompt[{index}]: {}", self.message);
        }
        self
    }

    pub fn body(&self) -> Value {
        json!({ "error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.status.as_u16(),
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut().insert("retry-after", s.into());
        }
        r
    }
}

/// What the client asked for, validated (tokenisation and length checks come later).
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationRequest {
    pub model: String,
    /// At least one; several only for completions (a batch: each prompt its own request
    /// through the scheduler, `n` choices each).
    pub prompts: Vec<Prompt>,
    /// `None`: as many as fit in max_model_len (at most [`Self::default_max_tokens`]).
    pub max_tokens: Option<usize>,
    /// The model's `max_new_tokens` (a chat's default): a cap where `max_tokens` is absent,
    /// never a reason to refuse a prompt (vLLM takes the smaller of it and the room left).
    pub default_max_tokens: Option<usize>,
    pub params: SamplingParams,
    pub stop: Vec<String>,
    /// The stop string that ends a choice ends its text too (vLLM's
    /// `include_stop_str_in_output`).
    pub include_stop_str: bool,
    /// Special tokens are dropped from the text (vLLM's `skip_special_tokens`, default on).
    pub skip_special_tokens: bool,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub stream: bool,
    pub include_usage: bool,
    /// With `include_usage`: every chunk carries its choice's usage so far
    /// (`stream_options.continuous_usage_stats`, as vLLM).
    pub continuous_usage: bool,
    /// Choices to sample from the prompt (OpenAI's `n`), 1 to [`MAX_N`].
    pub n: usize,
    /// Repeat the prompt before the completion (completions only).
    pub echo: bool,
    /// vLLM's `prompt_logprobs`: each prompt token's logprob and rank with this many most
    /// likely alternatives (0: none), in the response beside the choices' logprobs.
    pub prompt_logprobs: Option<usize>,
    /// vLLM's `truncate_prompt_tokens`: each prompt keeps its last this many tokens
    /// (`None` for the model's length: vLLM's -1), after tokenising.
    pub truncate_prompt: Option<Truncation>,
    /// Logprobs name each token `token_id:N` rather than by its text (vLLM's
    /// `return_tokens_as_token_ids`): distinct ids that decode alike stay distinct.
    pub tokens_as_ids: bool,
    /// vLLM's `return_token_ids`: the prompt's token ids and each choice's generated ones
    /// beside the text (streamed: each chunk's own, the prompt's with a choice's first).
    pub return_token_ids: bool,
    /// vLLM's `priority`: under `--scheduling-policy priority`, the lowest value runs first;
    /// otherwise only 0 is accepted.
    pub priority: i64,
    /// vLLM's `bad_words`: words the output must not contain, tokenised into
    /// `params.bad_words` once the tokenizer is at hand (see [`bad_word_ids`]).
    pub bad_words: Vec<String>,
    /// The grammar the output follows (structured output, a forced tool call).
    pub structured: Option<StructuredRequest>,
    /// How a chat is rendered: its `tools`, generation prompt, and template variables.
    pub template: TemplateOptions,
    /// `tool_choice: "auto"` with tools: the server's tool-call parser reads the output.
    pub auto_tools: bool,
    /// `parallel_tool_calls` (default true): with `auto_tools`, false answers one call.
    pub parallel_tool_calls: bool,
    /// What a chat answers of the reasoning a `--reasoning-parser` splits off.
    pub reasoning: ReasoningOptions,
}

/// What a chat answers of a reasoning model's thinking, where the server splits it off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReasoningOptions {
    /// Split it from the content (SGLang's `separate_reasoning`, default true); false
    /// leaves the output whole in the content.
    pub separate: bool,
    /// Answer it (vLLM's `include_reasoning`, default true); false drops it.
    pub include: bool,
    /// Stream it as it is generated (SGLang's `stream_reasoning`, default true); false sends
    /// it whole once the thinking ends.
    pub stream: bool,
}

/// The most choices one request may ask for per prompt.
pub const MAX_N: usize = 64;

/// The most sequences one request may start: its prompts times `n`. A batch is one HTTP
/// request, so this bounds what one client adds to the queue at once.
pub const MAX_SEQUENCES: usize = 256;

#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    Chat(Vec<crate::runtime::tokenizer::ChatMessage>),
}

impl Prompt {
    /// The bytes the tokenizer reads for it (a chat's roles and contents; its template adds
    /// more): what decides whether it can fit `max_model_len` and which tokenizer lane it
    /// waits in. A token prompt is only checked, counted 4 bytes an id.
    pub fn bytes(&self) -> usize {
        match self {
            Prompt::Text(t) => t.len(),
            Prompt::Tokens(t) => 4 * t.len(),
            Prompt::Chat(messages) => messages
                .iter()
                .map(|m| {
                    m.role.len()
                        + m.content.len()
                        + m.tool_calls.as_ref().map_or(0, |c| c.to_string().len())
                })
                .sum(),
        }
    }
}

/// Which endpoint a request came through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

pub fn parse_body(bytes: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let v: Value = serde_json::from_slice(bytes)
        .map_err(|e| ApiError::bad_request(None, format!("malformed JSON body: {e}")))?;
    match v {
        Value::Object(m) => Ok(m),
        other => Err(ApiError::bad_request(
            None,
            format!("the body must be a JSON object, not {}", type_name(&other)),
        )),
    }
}

/// Whether a parameter's value means "not used".
type IsUnused = fn(&Value) -> bool;

/// Parameters this server does not implement, with the value that means "not used": a
/// request that sets one to anything else is refused rather than answered as if it had not
/// (vLLM implements them; clients rely on their effect).
const UNSUPPORTED: &[(&str, IsUnused)] = &[
    ("suffix", |v| v.as_str() == Some("")),
    ("best_of", |v| v.as_u64() == Some(1)),
    ("functions", |v| v.as_array().is_some_and(Vec::is_empty)),
    ("function_call", |v| v == "none"),
    ("use_beam_search", |v| v == &Value::Bool(false)),
    ("logits_processors", |v| {
        v.as_array().is_some_and(Vec::is_empty)
    }),
    ("chat_template", |_| false),
    // vLLM's older name for `structured_outputs.whitespace_pattern`, refused likewise.
    ("guided_whitespace_pattern", |_| false),
    // What routers in front (vllm-router, sglang-router) write into every body they pass
    // on, at SGLang's defaults. The reasoning ones (and vLLM's `include_reasoning`) are
    // read by a chat that a `--reasoning-parser` splits; a completion is never split.
    ("no_stop_trim", |v| v == &Value::Bool(false)),
    ("return_hidden_states", |v| v == &Value::Bool(false)),
    ("separate_reasoning", Value::is_boolean),
    ("stream_reasoning", Value::is_boolean),
    // Beam search's, and vLLM's spacing choice for special tokens written out, which the
    // tokenizers crate's decoder does not offer.
    ("length_penalty", |v| v.as_f64() == Some(1.0)),
    ("early_stopping", |v| v == &Value::Bool(false)),
    ("spaces_between_special_tokens", |v| v == &Value::Bool(true)),
    // vLLM's that change what a request gets: its cache isolation, template documents,
    // response id, embeddings for a prompt, and so on.
    ("cache_salt", |_| false),
    ("documents", |_| false),
    ("request_id", |_| false),
    ("prompt_embeds", |_| false),
    ("mm_processor_kwargs", |_| false),
    ("kv_transfer_params", |_| false),
    ("vllm_xargs", |_| false),
    ("include_reasoning", Value::is_boolean),
];

/// Top-level keys a request may carry beyond those the lists of unsupported parameters
/// name: the ones this server reads, and informational ones that change no output
/// (OpenAI's `user`, `metadata`, `store`, `service_tier`; vLLM's choice of grammar backend).
/// Any other key is refused by name, as OpenAI refuses an unrecognized argument (vLLM
/// accepts it and logs a warning): a misspelled `temprature` must not come back as an
/// answer at the default temperature.
const KNOWN: &[&str] = &[
    "model",
    "n",
    "stream",
    "stream_options",
    "stop",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "stop_token_ids",
    "allowed_token_ids",
    "return_tokens_as_token_ids",
    "return_token_ids",
    "priority",
    "bad_words",
    "ignore_eos",
    "prompt_logprobs",
    "truncate_prompt_tokens",
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "logit_bias",
    "logprobs",
    "echo",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
    "tools",
    "tool_choice",
    "user",
    "metadata",
    "store",
    "service_tier",
];
const KNOWN_COMPLETIONS: &[&str] = &["prompt"];
const KNOWN_CHAT: &[&str] = &[
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
    "max_completion_tokens",
    "top_logprobs",
    "parallel_tool_calls",
    "reasoning_effort",
];

/// Parameters of one endpoint only (the other's, or vLLM's there), with the value this
/// server uses: a prompt's special tokens are added to a completion's prompt (vLLM's
/// default), not to a chat's, whose template writes them.
const UNSUPPORTED_COMPLETIONS: &[(&str, IsUnused)] = &[
    ("add_special_tokens", |v| v == &Value::Bool(true)),
    // Chat's names for max_tokens and logprobs, and its template's reasoning effort.
    ("max_completion_tokens", |_| false),
    ("top_logprobs", |_| false),
    ("reasoning_effort", |_| false),
];
const UNSUPPORTED_CHAT: &[(&str, IsUnused)] =
    &[("add_special_tokens", |v| v == &Value::Bool(false))];

fn refuse_unsupported(body: &Map<String, Value>, endpoint: Endpoint) -> Result<(), ApiError> {
    let (of_endpoint, known_here) = match endpoint {
        Endpoint::Completions => (UNSUPPORTED_COMPLETIONS, KNOWN_COMPLETIONS),
        Endpoint::Chat => (UNSUPPORTED_CHAT, KNOWN_CHAT),
    };
    let listed = |key: &str| {
        KNOWN.contains(&key)
            || known_here.contains(&key)
            || UNSUPPORTED
                .iter()
                .chain(of_endpoint)
                .any(|(k, _)| *k == key)
    };
    // A null is an absent key, known or not.
    if let Some((key, _)) = body.iter().find(|(k, v)| !v.is_null() && !listed(k)) {
        return Err(ApiError::bad_request(
            Some(key),
            format!("Unrecognized request argument supplied: {key}"),
        ));
    }
    for (key, unused) in UNSUPPORTED.iter().chain(of_endpoint) {
        match body.get(*key) {
            None | Some(Value::Null) => {}
            Some(v) if unused(v) => {}
            Some(v) => {
                return Err(ApiError::bad_request(
                    Some(key),
                    format!("{key} is not supported by this server (got {v})"),
                ))
            }
        }
    }
    Ok(())
}

/// Token ids of a JSON list of non-negative integers; an id beyond u32 is an error, never
/// wrapped.
fn u32_ids(list: &[Value], param: &str) -> Result<Vec<u32>, ApiError> {
    list.iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_u64()
                .and_then(|id| u32::try_from(id).ok())
                .ok_or_else(|| {
                    ApiError::bad_request(
                        Some(param),
                        format!(
                            "{param}[{i}] = {v} is not a token id (a whole number from 0 to {})",
                            u32::MAX
                        ),
                    )
                })
        })
        .collect()
}

/// `param`'s list of token ids, each inside the vocabulary.
pub fn token_ids(value: Option<&Value>, param: &str, vocab: usize) -> Result<Vec<u32>, ApiError> {
    let ids = match value {
        Some(Value::Array(a)) if a.iter().all(Value::is_number) => u32_ids(a, param)?,
        _ => {
            return Err(ApiError::bad_request(
                Some(param),
                format!("{param} must be a list of token ids"),
            ))
        }
    };
    within_vocab(param, ids.iter().copied(), vocab)?;
    Ok(ids)
}

/// `param`'s token ids are inside a vocabulary of `vocab`.
pub fn within_vocab(
    param: &str,
    ids: impl IntoIterator<Item = u32>,
    vocab: usize,
) -> Result<(), ApiError> {
    match ids.into_iter().find(|&t| t as usize >= vocab) {
        Some(bad) => Err(ApiError::bad_request(
            Some(param),
            format!("token id {bad} is outside the vocabulary of {vocab}"),
        )),
        None => Ok(()),
    }
}

/// Parse and validate a completions or chat body, at the API's own defaults.
pub fn parse_request(
    body: &Map<String, Value>,
    endpoint: Endpoint,
) -> Result<GenerationRequest, ApiError> {
    parse_request_with(body, endpoint, &SamplingDefaults::default())
}

/// [`parse_request`] where a parameter the request leaves out takes the model's default
/// (its `generation_config.json`, as vLLM serves it): the sampling parameters, and a chat's
/// `max_tokens`.
pub fn parse_request_with(
    body: &Map<String, Value>,
    endpoint: Endpoint,
    defaults: &SamplingDefaults,
) -> Result<GenerationRequest, ApiError> {
    let f = Fields(body);
    let model = f.string("model")?.unwrap_or_default();
    let prompts = match endpoint {
        Endpoint::Completions => parse_prompts(body.get("prompt"))?,
        Endpoint::Chat => vec![Prompt::Chat(parse_messages(body.get("messages"))?)],
    };
    let n = f.uint("n")?.unwrap_or(1);
    if !(1..=MAX_N as u64).contains(&n) {
        return Err(ApiError::bad_request(
            Some("n"),
            format!("n must be between 1 and {MAX_N}, got {n}"),
        ));
    }
    if prompts.len() * n as usize > MAX_SEQUENCES {
        return Err(ApiError::bad_request(
            Some("prompt"),
            format!(
                "{} prompts x n {n} = {} sequences, more than the {MAX_SEQUENCES} one request \
                 may start: send fewer prompts per request",
                prompts.len(),
                prompts.len() * n as usize
            ),
        ));
    }
    refuse_unsupported(body, endpoint)?;
    // `echo`: the completion repeats the prompt (with its logprobs when `logprobs` is set:
    // evaluation harnesses score a text this way, `max_tokens: 0`). Chat's `echo` means
    // something else in vLLM and is not served.
    let echo = f.bool("echo")?.unwrap_or(false);
    if echo && endpoint == Endpoint::Chat {
        return Err(ApiError::bad_request(
            Some("echo"),
            "echo is not supported by this server for chat completions",
        ));
    }
    let (stop, stop_token_ids) = parse_stop(body)?;
    let stream = f.bool("stream")?.unwrap_or(false);
    let prompt_logprobs = f.uint("prompt_logprobs")?.map(|k| k as usize);
    if prompt_logprobs.is_some_and(|k| k > MAX_TOP_LOGPROBS) {
        return Err(ApiError::bad_request(
            Some("prompt_logprobs"),
            format!("prompt_logprobs: at most {MAX_TOP_LOGPROBS} logprobs per token"),
        ));
    }
    // vLLM refuses them with a stream, save 0 (which a stream then does not carry).
    if prompt_logprobs.is_some_and(|k| k > 0) && stream {
        return Err(ApiError::bad_request(
            Some("prompt_logprobs"),
            "`prompt_logprobs` are not available when `stream=True`.",
        ));
    }
    let prompt_logprobs = prompt_logprobs.filter(|_| !stream);
    let truncate_prompt = match f.int("truncate_prompt_tokens")? {
        None => None,
        Some(-1) => Some(Truncation::ModelLength),
        Some(k) if k >= 1 => Some(Truncation::Keep(k as usize)),
        Some(k) => {
            return Err(ApiError::bad_request(
                Some("truncate_prompt_tokens"),
                format!(
                    "truncate_prompt_tokens must be -1 (the model's length) or at least 1, got {k}"
                ),
            ))
        }
    };
    let usage = parse_stream_options(body.get("stream_options"), stream)?;
    let (structured, tools) = super::structured::parse(body, endpoint)?;
    let tokens_as_ids = f.bool("return_tokens_as_token_ids")?.unwrap_or(false);
    let ignore_eos = f.bool("ignore_eos")?.unwrap_or(false);
    if ignore_eos && structured.is_some() {
        return Err(ApiError::bad_request(
            Some("ignore_eos"),
            "ignore_eos cannot be combined with structured output: the grammar ends the output",
        ));
    }
    let max_tokens = parse_max_tokens(&f, endpoint, echo)?;
    let params = parse_sampling(&f, endpoint, defaults)?;
    if params.min_tokens > 0 && structured.is_some() {
        return Err(ApiError::bad_request(
            Some("min_tokens"),
            "min_tokens cannot be combined with structured output: the grammar ends the output",
        ));
    }
    if let Some(max) = max_tokens.filter(|&max| params.min_tokens > max) {
        return Err(min_tokens_past(params.min_tokens, max));
    }
    Ok(GenerationRequest {
        model,
        prompts,
        max_tokens,
        default_max_tokens: defaults.max_tokens.filter(|_| endpoint == Endpoint::Chat),
        params,
        stop,
        include_stop_str: f.bool("include_stop_str_in_output")?.unwrap_or(false),
        skip_special_tokens: f.bool("skip_special_tokens")?.unwrap_or(true),
        stop_token_ids,
        ignore_eos,
        stream,
        include_usage: usage.include,
        continuous_usage: usage.continuous,
        n: n as usize,
        echo,
        prompt_logprobs,
        truncate_prompt,
        tokens_as_ids,
        return_token_ids: f.bool("return_token_ids")?.unwrap_or(false),
        priority: f.int("priority")?.unwrap_or(0),
        bad_words: bad_words(f.get("bad_words"))?,
        structured,
        template: match endpoint {
            Endpoint::Chat => template_options(&f, tools.tools)?,
            Endpoint::Completions => TemplateOptions::default(),
        },
        auto_tools: tools.auto,
        parallel_tool_calls: tools.parallel,
        reasoning: ReasoningOptions {
            separate: f.bool("separate_reasoning")?.unwrap_or(true),
            include: f.bool("include_reasoning")?.unwrap_or(true),
            stream: f.bool("stream_reasoning")?.unwrap_or(true),
        },
    })
}

/// How far a prompt is cut from the left (vLLM's `truncate_prompt_tokens`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Truncation {
    /// To its last this many tokens.
    Keep(usize),
    /// To the model's length (-1).
    ModelLength,
}

/// A `/tokenize` body, as vLLM takes it: a completion's `prompt` (a text) or a chat's
/// `messages` with its `tools`, rendered as `/v1/chat/completions` renders them.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenizeRequest {
    pub prompt: Prompt,
    /// Special tokens added to a text prompt (vLLM's default: yes).
    pub add_special_tokens: bool,
    pub template: TemplateOptions,
    /// Also answer each token's string in the vocabulary (`token_strs`).
    pub return_token_strs: bool,
}

pub fn parse_tokenize(body: &Map<String, Value>) -> Result<TokenizeRequest, ApiError> {
    let f = Fields(body);
    let chat = body.get("messages").is_some_and(|m| !m.is_null());
    // As in generation: a chat's template is this server's, with its generation prompt
    // and without special tokens of its own; other keys are refused by name.
    let mut known = vec!["model", "add_special_tokens", "return_token_strs"];
    known.extend(if chat {
        &[
            "messages",
            "tools",
            "add_generation_prompt",
            "continue_final_message",
            "chat_template_kwargs",
        ][..]
    } else {
        &["prompt"][..]
    });
    if let Some((key, _)) = body
        .iter()
        .find(|(k, v)| !v.is_null() && !known.contains(&k.as_str()))
    {
        return Err(ApiError::bad_request(
            Some(key),
            format!("Unrecognized request argument supplied: {key}"),
        ));
    }
    let add_special_tokens = f.bool("add_special_tokens")?.unwrap_or(!chat);
    let return_token_strs = f.bool("return_token_strs")?.unwrap_or(false);
    if !chat {
        return match body.get("prompt") {
            Some(Value::String(p)) => Ok(TokenizeRequest {
                prompt: Prompt::Text(p.clone()),
                add_special_tokens,
                template: TemplateOptions::default(),
                return_token_strs,
            }),
            _ => Err(ApiError::bad_request(
                Some("prompt"),
                "prompt must be a string",
            )),
        };
    }
    if f.bool("add_special_tokens")? == Some(true) {
        return Err(ApiError::bad_request(
            Some("add_special_tokens"),
            "add_special_tokens: true is not supported by this server for a chat",
        ));
    }
    Ok(TokenizeRequest {
        prompt: Prompt::Chat(parse_messages(body.get("messages"))?),
        add_special_tokens,
        template: template_options(&f, super::structured::template_tools(body)?)?,
        return_token_strs,
    })
}

/// Template variables a request's `chat_template_kwargs` may not set: the conversation
/// and the tokenizer's own (vLLM lets them through, and a kwarg would then replace the
/// request's messages or tools unchecked).
const TEMPLATE_OWN: &[&str] = &["messages", "tools", "bos_token", "eos_token"];

/// A chat's rendering, as vLLM reads it from the request: `add_generation_prompt`
/// (default true), `continue_final_message` (not both), and `chat_template_kwargs`, more
/// variables for the template (Qwen3's `enable_thinking`), which may also set the first
/// two, as vLLM merges them over the fields.
fn template_options(f: &Fields, tools: Option<Value>) -> Result<TemplateOptions, ApiError> {
    let mut kwargs = match f.get("chat_template_kwargs") {
        None => Map::new(),
        Some(Value::Object(m)) => m.clone(),
        Some(v) => return Err(Fields::wrong("chat_template_kwargs", "an object", v)),
    };
    if let Some(key) = kwargs.keys().find(|k| TEMPLATE_OWN.contains(&k.as_str())) {
        return Err(ApiError::bad_request(
            Some("chat_template_kwargs"),
            format!("chat_template_kwargs may not set `{key}`: it is the request's own field"),
        ));
    }
    // As vLLM: the template reads the effort (gpt-oss's, some reasoning models'), unless
    // `chat_template_kwargs` sets it; a template that does not writes the same prompt.
    match f.get("reasoning_effort") {
        None => {}
        Some(Value::String(effort)) => {
            kwargs
                .entry("reasoning_effort")
                .or_insert_with(|| json!(effort));
        }
        Some(v) => return Err(Fields::wrong("reasoning_effort", "a string", v)),
    }
    let mut flag = |key: &str, default: bool| -> Result<bool, ApiError> {
        let field = f.bool(key)?.unwrap_or(default);
        match kwargs.remove(key) {
            None => Ok(field),
            Some(Value::Bool(b)) => Ok(b),
            Some(_) => Err(ApiError::bad_request(
                Some("chat_template_kwargs"),
                format!("chat_template_kwargs.{key} must be true or false"),
            )),
        }
    };
    let add_generation_prompt = flag("add_generation_prompt", true)?;
    let continue_final_message = flag("continue_final_message", false)?;
    if add_generation_prompt && continue_final_message {
        return Err(ApiError::bad_request(
            Some("continue_final_message"),
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
        ));
    }
    Ok(TemplateOptions {
        tools,
        add_generation_prompt,
        continue_final_message,
        kwargs,
    })
}

/// A completion's `prompt`: a text, a list of token ids, or a batch of either (a list of
/// texts, a list of token-id lists), as vLLM takes it.
fn parse_prompts(v: Option<&Value>) -> Result<Vec<Prompt>, ApiError> {
    let bad = |m: String| ApiError::bad_request(Some("prompt"), m);
    let a = match v {
        Some(Value::String(s)) => return Ok(vec![Prompt::Text(s.clone())]),
        Some(Value::Array(a)) if !a.is_empty() => a,
        Some(Value::Array(_)) => return Err(bad("prompt cannot be an empty list".into())),
        Some(other) => {
            return Err(bad(format!(
                "prompt must be a string, a list of token ids, or a list of either, not {}",
                type_name(other)
            )))
        }
        None => return Err(bad("prompt is required".into())),
    };
    if a.iter().all(Value::is_number) {
        return Ok(vec![Prompt::Tokens(u32_ids(a, "prompt")?)]);
    }
    // All texts or all token-id lists, as vLLM's types allow.
    let texts = a[0].is_string();
    a.iter()
        .enumerate()
        .map(|(i, p)| match p {
            Value::String(s) if texts => Ok(Prompt::Text(s.clone())),
            Value::Array(ids) if !texts && !ids.is_empty() && ids.iter().all(Value::is_number) => {
                Ok(Prompt::Tokens(u32_ids(ids, &format!("prompt[{i}]"))?))
            }
            Value::Array(ids) if !texts && ids.is_empty() => {
                Err(bad(format!("prompt[{i}] is empty")))
            }
            other => Err(bad(format!(
                "prompt[{i}] is {}: a batch's prompts are all strings or all lists of token ids",
                type_name(other)
            ))),
        })
        .collect()
}

/// `max_tokens` (or chat's `max_completion_tokens`, named as the client sent it): at least 1,
/// or 0 with `echo`; OpenAI's completions default is 16, chat generates until done.
/// vLLM's refusal of a `min_tokens` past the tokens a request may generate.
pub fn min_tokens_past(min_tokens: usize, max_tokens: usize) -> ApiError {
    ApiError::bad_request(
        Some("min_tokens"),
        format!(
            "min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}"
        ),
    )
}

fn parse_max_tokens(f: &Fields, endpoint: Endpoint, echo: bool) -> Result<Option<usize>, ApiError> {
    let key = match endpoint {
        Endpoint::Chat if f.get("max_completion_tokens").is_some() => {
            // The deprecated name, when given beside it, is still checked.
            f.int("max_tokens")?;
            "max_completion_tokens"
        }
        _ => "max_tokens",
    };
    match f.int(key)? {
        Some(0) if echo => Ok(Some(0)),
        Some(v) if v <= 0 => Err(ApiError::bad_request(
            Some(key),
            format!("{key} must be at least 1 (0 only with echo), got {v}"),
        )),
        Some(v) => Ok(Some(v as usize)),
        None if endpoint == Endpoint::Completions => Ok(Some(16)),
        None => Ok(None),
    }
}

/// The sampling parameters, each checked against vLLM's range.
fn parse_sampling(
    f: &Fields,
    endpoint: Endpoint,
    defaults: &SamplingDefaults,
) -> Result<SamplingParams, ApiError> {
    let mut params = SamplingParams::default();
    let put = |slot: &mut f32, v: Option<f32>| *slot = v.unwrap_or(*slot);
    put(&mut params.temperature, defaults.temperature);
    put(&mut params.top_p, defaults.top_p);
    put(&mut params.min_p, defaults.min_p);
    put(&mut params.repetition_penalty, defaults.repetition_penalty);
    params.top_k = defaults.top_k.unwrap_or(params.top_k);
    if let Some(t) = f.float_in("temperature", "in [0, 2]", |t| (0.0..=2.0).contains(&t))? {
        params.temperature = t as f32;
    }
    if let Some(p) = f.float_in("top_p", "in (0, 1]", |p| p > 0.0 && p <= 1.0)? {
        params.top_p = p as f32;
    }
    if let Some(k) = f.int("top_k")? {
        if k < -1 {
            return Err(ApiError::bad_request(
                Some("top_k"),
                format!("top_k must be -1 (off) or positive, got {k}"),
            ));
        }
        params.top_k = k.max(0) as usize;
    }
    if let Some(m) = f.float_in("min_p", "in [0, 1]", |m| (0.0..=1.0).contains(&m))? {
        params.min_p = m as f32;
    }
    let penalty = |v: f64| (-2.0..=2.0).contains(&v);
    if let Some(v) = f.float_in("presence_penalty", "in [-2, 2]", penalty)? {
        params.presence_penalty = v as f32;
    }
    if let Some(v) = f.float_in("frequency_penalty", "in [-2, 2]", penalty)? {
        params.frequency_penalty = v as f32;
    }
    // Logits are divided or multiplied by it in f32: a value that is 0, subnormal or
    // infinite there would make a logit infinite or NaN.
    let positive_f32 = |v: f64| (v as f32).is_finite() && v as f32 >= f32::MIN_POSITIVE;
    if let Some(v) = f.float_in("repetition_penalty", "> 0, within f32", positive_f32)? {
        params.repetition_penalty = v as f32;
    }
    // Any 64-bit integer, as vLLM takes (a negative one as its two's complement).
    params.seed = match f.get("seed") {
        None => None,
        Some(Value::Number(n)) if n.is_u64() => n.as_u64(),
        Some(Value::Number(n)) if n.is_i64() => n.as_i64().map(|s| s as u64),
        Some(v) => return Err(Fields::wrong("seed", "a 64-bit integer", v)),
    };
    params.logit_bias = logit_bias(f.get("logit_bias"))?;
    params.allowed_token_ids = allowed_token_ids(f.get("allowed_token_ids"))?;
    params.min_tokens = f
        .uint("min_tokens")?
        .map_or(0, |n| n.min(usize::MAX as u64) as usize);
    params.logprobs = match endpoint {
        Endpoint::Completions => f.uint("logprobs")?.map(|n| n as usize),
        Endpoint::Chat => {
            let top = f.uint("top_logprobs")?;
            match f.bool("logprobs")? {
                Some(true) => Some(top.unwrap_or(0) as usize),
                // vLLM's refusal, in its words: a client asking for alternatives without
                // logprobs would otherwise silently get none.
                _ if top.is_some_and(|t| t > 0) => {
                    return Err(ApiError::bad_request(
                        Some("top_logprobs"),
                        "when using `top_logprobs`, `logprobs` must be set to true.",
                    ))
                }
                _ => None,
            }
        }
    };
    if params.logprobs.is_some_and(|n| n > MAX_TOP_LOGPROBS) {
        let key = match endpoint {
            Endpoint::Completions => "logprobs",
            Endpoint::Chat => "top_logprobs",
        };
        return Err(ApiError::bad_request(
            Some(key),
            format!("{key}: at most {MAX_TOP_LOGPROBS} logprobs per token"),
        ));
    }
    Ok(params)
}

/// Stop strings a request may give, in number and in bytes: far beyond any real use
/// (OpenAI takes 4), and small enough that compiling them costs a request well under a
/// millisecond (matching them costs each token its own bytes, whatever they are).
pub const MAX_STOP_STRINGS: usize = 128;
pub const MAX_STOP_BYTES: usize = 16 * 1024;

/// `stop` (a string or a list of non-empty strings) and `stop_token_ids`.
fn parse_stop(body: &Map<String, Value>) -> Result<(Vec<String>, Vec<u32>), ApiError> {
    let stop = match body.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) if a.iter().all(Value::is_string) => a
            .iter()
            .map(|s| s.as_str().unwrap_or_default().to_string())
            .collect(),
        Some(other) => {
            return Err(ApiError::bad_request(
                Some("stop"),
                format!(
                    "stop must be a string or a list of strings, not {}",
                    type_name(other)
                ),
            ))
        }
    };
    if stop.iter().any(String::is_empty) {
        return Err(ApiError::bad_request(
            Some("stop"),
            "stop strings cannot be empty",
        ));
    }
    let bytes: usize = stop.iter().map(String::len).sum();
    if stop.len() > MAX_STOP_STRINGS || bytes > MAX_STOP_BYTES {
        return Err(ApiError::bad_request(
            Some("stop"),
            format!(
                "{} stop strings of {bytes} bytes in all: at most {MAX_STOP_STRINGS} strings \
                 and {MAX_STOP_BYTES} bytes",
                stop.len()
            ),
        ));
    }
    let stop_token_ids = match body.get("stop_token_ids") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) if a.iter().all(Value::is_number) => u32_ids(a, "stop_token_ids")?,
        Some(_) => {
            return Err(ApiError::bad_request(
                Some("stop_token_ids"),
                "stop_token_ids must be a list of token ids",
            ))
        }
    };
    Ok((stop, stop_token_ids))
}

/// What `stream_options` asks of a stream's usage.
#[derive(Default)]
struct StreamUsage {
    /// A last chunk with the whole response's usage.
    include: bool,
    /// Every chunk with its choice's usage so far (only with `include`, as vLLM).
    continuous: bool,
}

/// `stream_options`: `include_usage` and `continuous_usage_stats`, only with `stream`
/// (vLLM refuses a non-empty `stream_options` otherwise, with this message).
fn parse_stream_options(v: Option<&Value>, stream: bool) -> Result<StreamUsage, ApiError> {
    let o = match v {
        None | Some(Value::Null) => return Ok(StreamUsage::default()),
        Some(Value::Object(o)) => o,
        Some(_) => {
            return Err(ApiError::bad_request(
                Some("stream_options"),
                "stream_options must be an object",
            ))
        }
    };
    if !o.is_empty() && !stream {
        return Err(ApiError::bad_request(
            Some("stream_options"),
            "Stream options can only be defined when `stream=True`.",
        ));
    }
    let flag = |key: &str| match o.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::bad_request(
            Some(&format!("stream_options.{key}")),
            "must be a boolean",
        )),
    };
    let include = flag("include_usage")?;
    Ok(StreamUsage {
        include,
        continuous: include && flag("continuous_usage_stats")?,
    })
}

/// The most `bad_words` a request may give, and the longest of them in bytes: each is
/// matched against the output's last tokens at every step of every sequence.
pub const MAX_BAD_WORDS: usize = 128;
pub const MAX_BAD_WORD_BYTES: usize = 256;

/// vLLM's `bad_words`: a list of words (neither empty nor only spaces, which vLLM fails on).
fn bad_words(v: Option<&Value>) -> Result<Vec<String>, ApiError> {
    const PARAM: &str = "bad_words";
    let bad = |m: String| ApiError::bad_request(Some(PARAM), m);
    let list = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(a)) => a,
        Some(other) => {
            return Err(bad(format!(
                "{PARAM} must be a list of strings, not {}",
                type_name(other)
            )))
        }
    };
    if list.len() > MAX_BAD_WORDS {
        return Err(bad(format!(
            "{PARAM} has {} words; at most {MAX_BAD_WORDS} are taken",
            list.len()
        )));
    }
    (list.iter().enumerate())
        .map(|(i, w)| match w.as_str() {
            Some(w) if w.len() > MAX_BAD_WORD_BYTES => Err(bad(format!(
                "{PARAM}[{i}] is {} bytes long; at most {MAX_BAD_WORD_BYTES} are taken",
                w.len()
            ))),
            Some(w) if w.trim_start().is_empty() => {
                Err(bad(format!("{PARAM}[{i}] is empty or only whitespace")))
            }
            Some(w) => Ok(w.to_string()),
            None => Err(bad(format!(
                "{PARAM}[{i}] must be a string, not {}",
                type_name(w)
            ))),
        })
        .collect()
}

/// The token sequences `words` ban, as vLLM makes them (`SamplingParams.update_from_tokenizer`):
/// each word without its leading whitespace, and again after one space where that spelling
/// starts with another token and has as many (the word in the middle of a text).
pub fn bad_word_ids(
    tokenizer: &crate::runtime::tokenizer::TextTokenizer,
    words: &[String],
) -> Result<Vec<Vec<u32>>, ApiError> {
    let encode = |text: &str| {
        tokenizer
            .encode(text, false)
            .map_err(|e| ApiError::bad_request(Some("bad_words"), format!("{text:?}: {e:#}")))
    };
    let mut out: Vec<Vec<u32>> = Vec::with_capacity(2 * words.len());
    for word in words {
        let word = word.trim_start();
        let alone = encode(word)?;
        let spaced = encode(&format!(" {word}"))?;
        if alone.is_empty() {
            return Err(ApiError::bad_request(
                Some("bad_words"),
                format!("{word:?} has no tokens"),
            ));
        }
        let distinct = spaced.first() != alone.first() && spaced.len() == alone.len();
        out.push(alone);
        if distinct {
            out.push(spaced);
        }
    }
    Ok(out)
}

/// vLLM's `allowed_token_ids`: a list of token ids, the only ones that may be sampled
/// (not empty, as vLLM refuses it; the vocabulary is checked once the model is known).
fn allowed_token_ids(v: Option<&Value>) -> Result<Option<Vec<u32>>, ApiError> {
    const PARAM: &str = "allowed_token_ids";
    let mut ids = match v {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(a)) if !a.is_empty() && a.iter().all(Value::is_number) => {
            u32_ids(a, PARAM)?
        }
        Some(_) => {
            return Err(ApiError::bad_request(
                Some(PARAM),
                format!("{PARAM} must be a non-empty list of token ids"),
            ))
        }
    };
    ids.sort_unstable();
    ids.dedup();
    Ok(Some(ids))
}

/// OpenAI's `logit_bias`: `{"token id": bias}`, biases in [-100, 100] (the vocabulary is
/// checked once the model is known).
fn logit_bias(v: Option<&Value>) -> Result<Vec<(u32, f32)>, ApiError> {
    let bad = |m: String| ApiError::bad_request(Some("logit_bias"), m);
    let map = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Object(m)) => m,
        Some(other) => {
            return Err(bad(format!(
                "logit_bias must be an object of token id to bias, not {}",
                type_name(other)
            )))
        }
    };
    let mut out = Vec::with_capacity(map.len());
    let mut keys: std::collections::HashMap<u32, &str> = std::collections::HashMap::new();
    for (k, v) in map {
        let id: u32 = k
            .parse()
            .map_err(|_| bad(format!("logit_bias key `{k}` is not a token id")))?;
        // `"1"` and `"01"` name one token: its bias would be their sum, past the bound.
        if let Some(other) = keys.insert(id, k) {
            return Err(bad(format!(
                "logit_bias keys `{other}` and `{k}` name the same token id {id}"
            )));
        }
        let bias = v
            .as_f64()
            .filter(|b| (-100.0..=100.0).contains(b))
            .ok_or_else(|| {
                bad(format!(
                    "logit_bias[{k}] must be a number in [-100, 100], got {v}"
                ))
            })?;
        out.push((id, bias as f32));
    }
    out.sort_by_key(|&(id, _)| id);
    Ok(out)
}

fn parse_messages(
    v: Option<&Value>,
) -> Result<Vec<crate::runtime::tokenizer::ChatMessage>, ApiError> {
    let arr = match v {
        Some(Value::Array(a)) if !a.is_empty() => a,
        Some(Value::Array(_)) => {
            return Err(ApiError::bad_request(
                Some("messages"),
                "messages cannot be empty",
            ))
        }
        Some(other) => {
            return Err(ApiError::bad_request(
                Some("messages"),
                format!("messages must be a list, not {}", type_name(other)),
            ))
        }
        None => {
            return Err(ApiError::bad_request(
                Some("messages"),
                "messages is required",
            ))
        }
    };
    arr.iter()
        .enumerate()
        .map(|(i, m)| {
            let param = format!("messages[{i}]");
            let role = m.get("role").and_then(Value::as_str).ok_or_else(|| {
                ApiError::bad_request(Some(&param), "each message needs a string role")
            })?;
            let mut parts = None;
            let content = match m.get("content") {
                Some(Value::String(s)) => s.clone(),
                // The list form: the text parts, a line apart (as vLLM joins them for most
                // templates; those that loop over the parts get them as a list).
                Some(Value::Array(list)) => parts
                    .insert(
                        list.iter()
                            .map(|p| {
                                match (
                                    p.get("type").and_then(Value::as_str),
                                    p.get("text").and_then(Value::as_str),
                                ) {
                                    (Some("text"), Some(t)) => Ok(t.to_string()),
                                    _ => Err(ApiError::bad_request(
                                        Some(&param),
                                        "only text content parts are supported",
                                    )),
                                }
                            })
                            .collect::<Result<Vec<_>, _>>()?,
                    )
                    .join("\n"),
                None | Some(Value::Null) => String::new(),
                Some(other) => {
                    return Err(ApiError::bad_request(
                        Some(&param),
                        format!("content must be a string, not {}", type_name(other)),
                    ))
                }
            };
            let mut message = crate::runtime::tokenizer::ChatMessage::new(role, &content);
            message.parts = parts;
            // A conversation that used tools: the calls made and the answers they got.
            message.tool_calls = match m.get("tool_calls") {
                None | Some(Value::Null) => None,
                Some(Value::Array(calls)) => Some(template_tool_calls(calls, &param)?),
                Some(other) => {
                    return Err(ApiError::bad_request(
                        Some(&param),
                        format!("tool_calls must be a list, not {}", type_name(other)),
                    ))
                }
            };
            message.name = match m.get("name") {
                None | Some(Value::Null) => None,
                Some(Value::String(name)) => Some(name.clone()),
                Some(other) => {
                    return Err(ApiError::bad_request(
                        Some(&param),
                        format!("name must be a string, not {}", type_name(other)),
                    ))
                }
            };
            // An assistant turn's thinking, as this server answers it (`reasoning`, vLLM's
            // name) or under vLLM's older name.
            for key in ["reasoning", "reasoning_content"] {
                match m.get(key) {
                    None | Some(Value::Null) => {}
                    Some(Value::String(r)) => {
                        (message.reasoning).get_or_insert_with(|| TurnReasoning(r.clone()));
                    }
                    Some(other) => {
                        return Err(ApiError::bad_request(
                            Some(&param),
                            format!("{key} must be a string, not {}", type_name(other)),
                        ))
                    }
                }
            }
            message.tool_call_id = match m.get("tool_call_id") {
                None | Some(Value::Null) => None,
                Some(Value::String(id)) => Some(id.clone()),
                Some(other) => {
                    return Err(ApiError::bad_request(
                        Some(&param),
                        format!("tool_call_id must be a string, not {}", type_name(other)),
                    ))
                }
            };
            Ok(message)
        })
        .collect()
}

/// An assistant turn's tool calls as a chat template reads them: each call's `arguments`,
/// a JSON text on the wire, parsed into its value (an empty or absent one is `{}`), as vLLM
/// hands them to templates (which write `arguments | tojson`: the text itself would come
/// out quoted twice).
fn template_tool_calls(calls: &[Value], param: &str) -> Result<Value, ApiError> {
    calls
        .iter()
        .enumerate()
        .map(|(j, call)| {
            let mut call = call.clone();
            if let Some(function) = call.get_mut("function").and_then(Value::as_object_mut) {
                let parsed = match function.get("arguments") {
                    None | Some(Value::Null) => json!({}),
                    Some(Value::String(text)) if text.is_empty() => json!({}),
                    Some(Value::String(text)) => serde_json::from_str(text).map_err(|e| {
                        ApiError::bad_request(
                            Some(param),
                            format!("tool_calls[{j}].function.arguments is not valid JSON: {e}"),
                        )
                    })?,
                    Some(value) => value.clone(),
                };
                function.insert("arguments".into(), parsed);
            }
            Ok(call)
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Value::Array)
}

/// Typed access to optional body fields, with OpenAI-style errors naming the field.
struct Fields<'a>(&'a Map<String, Value>);

impl Fields<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }

    fn wrong(key: &str, want: &str, v: &Value) -> ApiError {
        ApiError::bad_request(
            Some(key),
            format!("{key} must be {want}, not {}", type_name(v)),
        )
    }

    fn string(&self, key: &str) -> Result<Option<String>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(v) => Err(Self::wrong(key, "a string", v)),
        }
    }

    fn bool(&self, key: &str) -> Result<Option<bool>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(Self::wrong(key, "a boolean", v)),
        }
    }

    fn float(&self, key: &str) -> Result<Option<f64>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Number(n)) => Ok(n.as_f64()),
            Some(v) => Err(Self::wrong(key, "a number", v)),
        }
    }

    /// A number that must satisfy `ok` ("{key} must be {what}, got …" otherwise).
    fn float_in(
        &self,
        key: &str,
        what: &str,
        ok: impl Fn(f64) -> bool,
    ) -> Result<Option<f64>, ApiError> {
        match self.float(key)? {
            Some(v) if !ok(v) => Err(ApiError::bad_request(
                Some(key),
                // Debug's form: 1e300, not three hundred digits.
                format!("{key} must be {what}, got {v:?}"),
            )),
            v => Ok(v),
        }
    }

    fn int(&self, key: &str) -> Result<Option<i64>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Number(n)) if n.is_i64() => Ok(n.as_i64()),
            Some(Value::Number(n)) if n.is_u64() => Ok(Some(i64::MAX)),
            Some(Value::Number(n)) if n.as_f64().is_some_and(whole) => {
                Ok(n.as_f64().map(|x| x as i64))
            }
            Some(v) => Err(Self::wrong(key, "an integer", v)),
        }
    }

    fn uint(&self, key: &str) -> Result<Option<u64>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Number(n)) if n.is_u64() => Ok(n.as_u64()),
            Some(Value::Number(n)) if n.as_f64().is_some_and(|x| whole(x) && x >= 0.0) => {
                Ok(n.as_f64().map(|x| x as u64))
            }
            Some(v) => Err(Self::wrong(key, "a non-negative integer", v)),
        }
    }
}

/// A whole number written as a float (`1000.0`, `1e3`): an integer field takes it, as vLLM's
/// pydantic does (past 64 bits it saturates, as Rust's casts do, like an integer that large).
fn whole(x: f64) -> bool {
    x.is_finite() && x.fract() == 0.0
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// vLLM's `bad_words` as token sequences: each word as it starts a text (its leading
    /// whitespace dropped) and, where that spelling is other tokens of the same count, after
    /// a space; each sequence spells the word, and a word's leading spaces change nothing.
    #[test]
    fn bad_words_are_tokenised_with_and_without_a_space_before_them() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("qwen");
        let spec = crate::tools::make_model::ModelSpec::new(crate::Arch::Qwen3);
        crate::tools::make_model::make_model(&spec, &dir).unwrap();
        let tok = crate::runtime::tokenizer::TextTokenizer::from_dir(&dir).unwrap();
        let words = ["harbour", "at dawn", "  harbour"].map(String::from);
        let ids = bad_word_ids(&tok, &words).unwrap();
        let mut spellings = Vec::new();
        for seq in &ids {
            assert!(!seq.is_empty());
            spellings.push(tok.decode(seq).unwrap());
        }
        for s in &spellings {
            assert!(
                ["harbour", " harbour", "at dawn", " at dawn"].contains(&s.as_str()),
                "{spellings:?}"
            );
        }
        assert_eq!(spellings[0], "harbour");
        let one = |w: &str| bad_word_ids(&tok, &[w.to_string()]).unwrap();
        assert_eq!(one("  harbour"), one("harbour"));
        assert_eq!(ids[ids.len() - one("harbour").len()..], one("harbour"));
        let spaced = tok.encode(" harbour", false).unwrap();
        let alone = tok.encode("harbour", false).unwrap();
        // (This tokenizer spells " harbour" with other tokens, as many: both are banned.)
        assert!(spaced[0] != alone[0] && spaced.len() == alone.len());
        assert!(ids.contains(&spaced) && ids.contains(&alone), "{ids:?}");
        // Where the spaced spelling has more tokens, vLLM bans the word alone.
        let (a, b) = (
            tok.encode("at dawn", false).unwrap(),
            tok.encode(" at dawn", false).unwrap(),
        );
        assert_eq!(
            ids.contains(&b),
            a[0] != b[0] && a.len() == b.len(),
            "{ids:?}"
        );
    }

    fn parse(s: &str, e: Endpoint) -> Result<GenerationRequest, ApiError> {
        parse_request(&parse_body(s.as_bytes())?, e)
    }

    /// An argument this server does not know is refused by name (a typo must not be
    /// answered at the defaults); a null one is absent; informational ones change nothing;
    /// vLLM's that would change the answer are named as not supported.
    #[test]
    fn unknown_arguments_are_refused_by_name() {
        let refused = |body: &str, e: Endpoint| parse(body, e).unwrap_err();
        let e = refused(r#"{"prompt":"x","temprature":0}"#, Endpoint::Completions);
        assert_eq!(e.param.as_deref(), Some("temprature"));
        assert_eq!(
            e.message,
            "Unrecognized request argument supplied: temprature"
        );
        let chat = r#"{"messages":[{"role":"user","content":"x"}]"#;
        for (extra, param) in [
            (r#""max_token":5"#, "max_token"),
            (r#""prompt":"x""#, "prompt"),
            (r#""cache_salt":"a""#, "cache_salt"),
            (r#""request_id":"r1""#, "request_id"),
        ] {
            let e = refused(&format!("{chat},{extra}}}"), Endpoint::Chat);
            assert_eq!(e.param.as_deref(), Some(param), "{extra}: {}", e.message);
        }
        assert!(
            refused(&format!("{chat},\"cache_salt\":\"a\"}}"), Endpoint::Chat)
                .message
                .contains("not supported")
        );
        let e = refused(r#"{"prompt":"x","messages":[]}"#, Endpoint::Completions);
        assert_eq!(e.param.as_deref(), Some("messages"));
        // Null is absent; informational keys are taken and change nothing.
        let plain = parse(r#"{"prompt":"x"}"#, Endpoint::Completions).unwrap();
        let with = parse(
            r#"{"prompt":"x","temprature":null,"user":"u1","metadata":{"a":"b"},"store":false,
               "service_tier":"auto","guided_decoding_backend":"xgrammar","length_penalty":1.0}"#,
            Endpoint::Completions,
        )
        .unwrap();
        assert_eq!(with, plain);
    }

    /// A parameter the request leaves out takes the model's default, one it sets its own;
    /// a chat's `max_tokens` defaults to the model's, a completion's stays OpenAI's 16.
    #[test]
    fn a_models_defaults_fill_what_a_request_leaves_out() {
        let defaults = SamplingDefaults {
            temperature: Some(0.6),
            top_p: Some(0.9),
            top_k: Some(20),
            max_tokens: Some(300),
            ..SamplingDefaults::default()
        };
        let with = |s: &str, e: Endpoint| {
            parse_request_with(&parse_body(s.as_bytes()).unwrap(), e, &defaults).unwrap()
        };
        let r = with(r#"{"prompt":"x","top_p":0.5}"#, Endpoint::Completions);
        assert_eq!(
            (r.params.temperature, r.params.top_p, r.params.top_k),
            (0.6, 0.5, 20)
        );
        assert_eq!(r.max_tokens, Some(16));
        let r = with(
            r#"{"messages":[{"role":"user","content":"x"}],"temperature":0}"#,
            Endpoint::Chat,
        );
        assert_eq!((r.params.temperature, r.params.top_p), (0.0, 0.9));
        assert_eq!((r.max_tokens, r.default_max_tokens), (None, Some(300)));
        let plain = parse(r#"{"prompt":"x"}"#, Endpoint::Completions).unwrap();
        assert_eq!(plain.params, SamplingParams::default());
    }

    /// Routers in front (vllm-router, sglang-router) re-serialise a request with their own
    /// defaults written out: such a body means what the client's did.
    #[test]
    fn a_routers_rewritten_body_is_the_clients() {
        let router = r#""no_stop_trim":false,"ignore_eos":false,"skip_special_tokens":true,
            "return_hidden_states":false,"echo":false,"n":1,"stream":false"#;
        let completion = format!(r#"{{"model":"m","prompt":"x",{router}}}"#);
        assert_eq!(
            parse(&completion, Endpoint::Completions).unwrap(),
            parse(r#"{"model":"m","prompt":"x"}"#, Endpoint::Completions).unwrap()
        );
        let chat = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"x"}}],{router},
                "continue_final_message":false,"separate_reasoning":true,"stream_reasoning":true,
                "include_reasoning":true,"logprobs":false}}"#
        );
        assert_eq!(
            parse(&chat, Endpoint::Chat).unwrap(),
            parse(
                r#"{"model":"m","messages":[{"role":"user","content":"x"}]}"#,
                Endpoint::Chat
            )
            .unwrap()
        );
    }

    /// `logit_bias` keys that name one token (`"1"`, `"01"`) are refused: their sum could
    /// pass the bound. Chat's `max_tokens` beside `max_completion_tokens` is still checked.
    #[test]
    fn one_token_biased_twice_and_a_bad_deprecated_max_tokens_are_refused() {
        let e = parse(
            r#"{"prompt":"x","logit_bias":{"1":60,"01":60}}"#,
            Endpoint::Completions,
        )
        .unwrap_err();
        assert!(e.message.contains("same token id 1"), "{}", e.message);
        let e = parse(
            r#"{"messages":[{"role":"user","content":"x"}],"max_completion_tokens":4,"max_tokens":"abc"}"#,
            Endpoint::Chat,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        let r = parse(
            r#"{"messages":[{"role":"user","content":"x"}],"max_completion_tokens":4,"max_tokens":9}"#,
            Endpoint::Chat,
        )
        .unwrap();
        assert_eq!(r.max_tokens, Some(4));
    }

    /// A message's `name` reaches the template, and a tool call's `arguments` (JSON text on
    /// the wire) reach it as the value they spell, as vLLM hands them over; an empty one is
    /// `{}`, and one that is not JSON is refused.
    #[test]
    fn chat_messages_reach_the_template_as_vllm_hands_them_over() {
        let r = parse(
            r#"{"messages":[{"role":"user","content":"x","name":"ann"},
                {"role":"assistant","content":null,"tool_calls":[
                  {"id":"c1","type":"function","function":{"name":"f","arguments":"{\"a\": 1}"}},
                  {"id":"c2","type":"function","function":{"name":"g","arguments":""}}]},
                {"role":"tool","content":"2","tool_call_id":"c1"}],"max_completion_tokens":1}"#,
            Endpoint::Chat,
        )
        .unwrap();
        let Prompt::Chat(messages) = &r.prompts[0] else {
            panic!("a chat")
        };
        assert_eq!(messages[0].name.as_deref(), Some("ann"));
        assert_eq!(messages[1].reasoning, None);
        // A turn's thinking, under this server's name or vLLM's older one.
        for key in ["reasoning", "reasoning_content"] {
            let body =
                format!(r#"{{"messages":[{{"role":"assistant","content":"yes","{key}":"hm"}}]}}"#);
            let r = parse(&body, Endpoint::Chat).unwrap();
            let Prompt::Chat(messages) = &r.prompts[0] else {
                panic!("a chat")
            };
            assert_eq!(messages[0].reasoning, Some(TurnReasoning("hm".into())));
            let bad = body.replace(r#""hm""#, "5");
            let e = parse(&bad, Endpoint::Chat).unwrap_err();
            assert!(e.message.starts_with(key), "{}", e.message);
        }
        let calls = messages[1].tool_calls.as_ref().unwrap();
        assert_eq!(calls[0]["function"]["arguments"], json!({"a": 1}));
        assert_eq!(calls[1]["function"]["arguments"], json!({}));
        assert_eq!(calls[0]["id"], "c1");
        let e = parse(
            r#"{"messages":[{"role":"assistant","tool_calls":[{"type":"function",
                "function":{"name":"f","arguments":"{not json"}}]}]}"#,
            Endpoint::Chat,
        )
        .unwrap_err();
        assert!(e.message.contains("not valid JSON"), "{}", e.message);
        // A chat's reasoning effort is a template variable, which its kwargs may set first.
        let chat = parse(
            r#"{"messages":[{"role":"user","content":"x"}],"reasoning_effort":"high"}"#,
            Endpoint::Chat,
        )
        .unwrap();
        assert_eq!(chat.template.kwargs["reasoning_effort"], "high");
        let chat = parse(
            r#"{"messages":[{"role":"user","content":"x"}],"reasoning_effort":"high",
                "chat_template_kwargs":{"reasoning_effort":"low"}}"#,
            Endpoint::Chat,
        )
        .unwrap();
        assert_eq!(chat.template.kwargs["reasoning_effort"], "low");
        for (bad, endpoint) in [
            (
                r#"{"messages":[{"role":"user","content":"x"}],"reasoning_effort":3}"#,
                Endpoint::Chat,
            ),
            (
                r#"{"prompt":"x","reasoning_effort":"high"}"#,
                Endpoint::Completions,
            ),
        ] {
            let e = parse(bad, endpoint).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("reasoning_effort"), "{bad}");
        }
    }

    /// `/tokenize` takes vLLM's bodies: a text prompt, or a chat with its tools; other keys
    /// are refused by name, and so are template settings this server does not have.
    #[test]
    fn tokenize_bodies_are_vllms() {
        let t = |s: &str| parse_tokenize(&parse_body(s.as_bytes()).unwrap());
        let text = t(r#"{"prompt":"hi","return_token_strs":true}"#).unwrap();
        assert_eq!(text.prompt, Prompt::Text("hi".into()));
        assert!(text.add_special_tokens && text.return_token_strs);
        let tools =
            r#"[{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}]"#;
        let chat = t(&format!(
            r#"{{"messages":[{{"role":"user","content":"x"}}],"tools":{tools}}}"#
        ))
        .unwrap();
        assert!(!chat.add_special_tokens);
        assert_eq!(
            chat.template.tools,
            Some(serde_json::from_str(tools).unwrap())
        );
        // The chat's template settings, as generation takes them.
        let chat = t(r#"{"messages":[{"role":"user","content":"x"}],"add_generation_prompt":false,
                         "continue_final_message":true,"chat_template_kwargs":{"enable_thinking":false}}"#)
        .unwrap();
        assert!(!chat.template.add_generation_prompt && chat.template.continue_final_message);
        assert_eq!(chat.template.kwargs["enable_thinking"], false);
        // The kwargs may set the flags too, as vLLM merges them over the fields.
        let chat = t(r#"{"messages":[{"role":"user","content":"x"}],
                         "chat_template_kwargs":{"add_generation_prompt":false,"continue_final_message":true}}"#)
        .unwrap();
        assert!(!chat.template.add_generation_prompt && chat.template.continue_final_message);
        assert!(chat.template.kwargs.is_empty());
        for (body, param) in [
            (r#"{"prompt":"hi","temperature":0}"#, "temperature"),
            (r#"{"prompt":"hi","messages_":[]}"#, "messages_"),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"continue_final_message":true}"#,
                "continue_final_message",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"x"}]}"#,
                "tools",
            ),
        ] {
            let e = t(body).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
        }
    }

    #[test]
    fn vllm_parameters_not_served_are_refused_and_number_forms_taken() {
        for (body, e, param) in [
            (
                r#"{"prompt":"x","truncate_prompt_tokens":0}"#,
                Endpoint::Completions,
                "truncate_prompt_tokens",
            ),
            (
                r#"{"prompt":"x","truncate_prompt_tokens":-2}"#,
                Endpoint::Completions,
                "truncate_prompt_tokens",
            ),
            (
                r#"{"prompt":"x","guided_whitespace_pattern":" "}"#,
                Endpoint::Completions,
                "guided_whitespace_pattern",
            ),
            (
                r#"{"prompt":"x","repetition_penalty":1e300}"#,
                Endpoint::Completions,
                "repetition_penalty",
            ),
            (
                r#"{"prompt":"x","repetition_penalty":1e-60}"#,
                Endpoint::Completions,
                "repetition_penalty",
            ),
            (
                r#"{"prompt":"x","repetition_penalty":1e-40}"#,
                Endpoint::Completions,
                "repetition_penalty",
            ),
            (
                r#"{"prompt":"x","add_special_tokens":false}"#,
                Endpoint::Completions,
                "add_special_tokens",
            ),
            (
                r#"{"prompt":"x","max_completion_tokens":4}"#,
                Endpoint::Completions,
                "max_completion_tokens",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"continue_final_message":true}"#,
                Endpoint::Chat,
                "continue_final_message",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"chat_template_kwargs":{"tools":[]}}"#,
                Endpoint::Chat,
                "chat_template_kwargs",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"chat_template_kwargs":[1]}"#,
                Endpoint::Chat,
                "chat_template_kwargs",
            ),
            (
                r#"{"prompt":"x","chat_template_kwargs":{}}"#,
                Endpoint::Completions,
                "chat_template_kwargs",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"add_special_tokens":true}"#,
                Endpoint::Chat,
                "add_special_tokens",
            ),
        ] {
            let err = parse(body, e).unwrap_err();
            assert_eq!(err.param.as_deref(), Some(param), "{body}");
        }
        // Their defaults, as clients send them, are taken.
        for (body, e) in [
            (
                r#"{"prompt":"x","priority":0,"add_special_tokens":true,"bad_words":[]}"#,
                Endpoint::Completions,
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"add_generation_prompt":true,"add_special_tokens":false,"chat_template_kwargs":{}}"#,
                Endpoint::Chat,
            ),
        ] {
            assert!(parse(body, e).is_ok(), "{body}");
        }
        // A negative seed (vLLM takes any 64-bit one); a whole number written as a float.
        let r = parse(
            r#"{"prompt":"x","seed":-1,"max_tokens":1e3}"#,
            Endpoint::Completions,
        )
        .unwrap();
        assert_eq!(r.params.seed, Some(u64::MAX));
        assert_eq!(r.max_tokens, Some(1000));
        let e = parse(
            r#"{"prompt":"x","temperature":1e300}"#,
            Endpoint::Completions,
        )
        .unwrap_err();
        assert!(e.message.contains("1e300"), "{}", e.message);
    }

    #[test]
    fn parses_completions_and_chat() {
        let r = parse(
            r#"{"model":"m","prompt":"hi","max_tokens":5,"temperature":0,"stop":"\n","stream":true,
               "stream_options":{"include_usage":true},"ignore_eos":true,"seed":3,"top_k":-1}"#,
            Endpoint::Completions,
        )
        .unwrap();
        assert_eq!(r.prompts, vec![Prompt::Text("hi".into())]);
        assert_eq!(r.max_tokens, Some(5));
        assert_eq!(r.params.temperature, 0.0);
        assert_eq!(r.stop, vec!["\n".to_string()]);
        assert!(r.stream && r.include_usage && r.ignore_eos);
        assert_eq!(r.params.seed, Some(3));
        let c = parse(
            r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}],
               "max_completion_tokens":7,"logprobs":true,"top_logprobs":2}"#,
            Endpoint::Chat,
        )
        .unwrap();
        assert_eq!(c.max_tokens, Some(7));
        assert_eq!(c.params.logprobs, Some(2));
        match &c.prompts[..] {
            // A line apart, as vLLM joins text parts.
            [Prompt::Chat(m)] => {
                assert_eq!(m[0].content, "a\nb");
                assert_eq!(m[0].parts, Some(vec!["a".to_string(), "b".to_string()]));
            }
            _ => panic!(),
        }
    }

    #[test]
    fn mistakes_are_400s_naming_the_field() {
        for (body, param) in [
            (r#"{"prompt":"x","max_tokens":"5"}"#, "max_tokens"),
            (r#"{"prompt":"x","max_tokens":0}"#, "max_tokens"),
            (r#"{"prompt":"x","temperature":-1}"#, "temperature"),
            (r#"{"prompt":"x","top_p":0}"#, "top_p"),
            (r#"{"prompt":"x","n":0}"#, "n"),
            (r#"{"prompt":"x","n":65}"#, "n"),
            (r#"{"prompt":7}"#, "prompt"),
            (r#"{"prompt":"x","stop":[1]}"#, "stop"),
            (r#"{"prompt":"x","stream":"yes"}"#, "stream"),
            (r#"{"prompt":[]}"#, "prompt"),
            (r#"{"prompt":[[1],[]]}"#, "prompt"),
            (r#"{"prompt":["a",[1]]}"#, "prompt"),
            (r#"{"prompt":[[1],[-1]]}"#, "prompt[1]"),
            (r#"{"prompt":["a","b","c","d","e"],"n":64}"#, "prompt"),
            (
                r#"{"prompt":"x","stream_options":{"include_usage":true}}"#,
                "stream_options",
            ),
        ] {
            let e = parse(body, Endpoint::Completions).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{body}");
            assert_eq!(e.param.as_deref(), Some(param), "{body}");
            assert_eq!(e.body()["error"]["type"], "invalid_request_error");
        }
        let e = parse("{nope", Endpoint::Completions).unwrap_err();
        assert!(e.message.contains("malformed JSON"));
        let e = parse(r#"{"messages":[]}"#, Endpoint::Chat).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages"));
        // vLLM's refusals, in its words.
        let chat = r#"{"messages":[{"role":"user","content":"x"}],"top_logprobs":2}"#;
        let e = parse(chat, Endpoint::Chat).unwrap_err();
        assert_eq!(
            e.message,
            "when using `top_logprobs`, `logprobs` must be set to true."
        );
        let e = parse(
            r#"{"prompt":"x","stream":false,"stream_options":{"include_usage":false}}"#,
            Endpoint::Completions,
        )
        .unwrap_err();
        assert_eq!(
            e.message,
            "Stream options can only be defined when `stream=True`."
        );
    }

    /// A completions prompt may be a batch, as vLLM and the openai client send it: texts or
    /// token-id lists, one request each.
    #[test]
    fn completions_take_a_batch_of_prompts() {
        let batch = |body: &str| parse(body, Endpoint::Completions).unwrap().prompts;
        assert_eq!(
            batch(r#"{"prompt":["a","b"]}"#),
            vec![Prompt::Text("a".into()), Prompt::Text("b".into())]
        );
        assert_eq!(
            batch(r#"{"prompt":[[1,2],[3]]}"#),
            vec![Prompt::Tokens(vec![1, 2]), Prompt::Tokens(vec![3])]
        );
        // One token list is one prompt, not a batch of numbers.
        assert_eq!(
            batch(r#"{"prompt":[1,2]}"#),
            vec![Prompt::Tokens(vec![1, 2])]
        );
        assert_eq!(batch(r#"{"prompt":["a"]}"#), vec![Prompt::Text("a".into())]);
        // At the limit of sequences a request may start.
        let four = r#"{"prompt":["a","b","c","d"],"n":64}"#;
        assert_eq!(batch(four).len(), 4);
        // Usage stats on every chunk only with include_usage, as vLLM.
        let r = parse(
            r#"{"prompt":"x","stream":true,"stream_options":{"continuous_usage_stats":true}}"#,
            Endpoint::Completions,
        )
        .unwrap();
        assert!(!r.include_usage && !r.continuous_usage);
        let r = parse(
            r#"{"prompt":"x","stream":true,"stream_options":{"include_usage":true,"continuous_usage_stats":true}}"#,
            Endpoint::Completions,
        )
        .unwrap();
        assert!(r.include_usage && r.continuous_usage);
        // An empty stream_options without stream is accepted, as vLLM does.
        parse(
            r#"{"prompt":"x","stream_options":{}}"#,
            Endpoint::Completions,
        )
        .unwrap();
    }
}
