//! `/v1/completions` and `/v1/chat/completions`: a parsed request becomes engine requests
//! (one per choice), and their tokens leave as SSE chunks or one JSON body. A dropped client
//! aborts its requests, so their KV is freed at once.

use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{Stream, StreamExt};
use infer_core::AddError;
use serde_json::{json, Value};

use super::api::{self, ApiError, Endpoint, GenerationRequest, Prompt};
use super::engine_loop::{Command, Finish, NewRequest, StreamEvent};
use super::outbox::{outbox, Inbox};
use super::prompt::{body_or_error, check_prompt_bytes, off_thread, prompt_tokens};
use super::reasoning::ReasoningSplit;
use super::structured::{self, ToolChoice};
use super::tool_parser::{tool_call_values, CallStream, ToolCallParser, ToolParameters};
use super::AppState;
use crate::runtime::detokenize::StopSet;
use crate::runtime::engine_core::{
    EngineRequest, FailureCause, RequestFailure, StopReason, TokenLogprob,
};
use crate::runtime::tokenizer::TextTokenizer;
use infer_kernels::sampling::MAX_TOP_LOGPROBS;

pub(super) async fn completions(
    State(s): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    generate(s, body, Endpoint::Completions)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

pub(super) async fn chat_completions(
    State(s): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    generate(s, body, Endpoint::Chat)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// Aborts the request's sequences (each prompt's `n`) when dropped before they finished
/// (the client went away).
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

/// One prompt of a request, tokenised and within the model's length.
struct Planned {
    tokens: Vec<u32>,
    max_tokens: usize,
    /// Tokens were cut from its start (`truncate_prompt_tokens`).
    truncated: bool,
}

pub(super) async fn generate(
    state: AppState,
    body: Result<Bytes, BytesRejection>,
    endpoint: Endpoint,
) -> Result<Response, ApiError> {
    let arrival = Instant::now();
    // In the request path until the engine has it (or the request is refused).
    let in_path = state.inner.request_path.enter();
    let body = body_or_error(body).await?;
    let started = start(&state, &body, endpoint, arrival, in_path).await?;
    if started.stream {
        Ok(Sse::new(sse_stream(started)).into_response())
    } else {
        collect(started).await
    }
}

/// A request the engine has taken: where its answer is read from.
pub(super) struct Started {
    rx: Inbox,
    /// Aborts the request's sequences if the answer is dropped before they end.
    guard: AbortOnDrop,
    meta: ResponseMeta,
    /// The request asked for a stream of chunks.
    pub stream: bool,
}

impl Started {
    /// The response's id (`chatcmpl-…`, `cmpl-…`).
    pub fn id(&self) -> &str {
        &self.meta.id
    }

    /// Whether its output is a reasoning model's, split at `</think>` (a chat's).
    pub fn splits_reasoning(&self) -> bool {
        self.meta.reasoning.is_some()
    }
}

/// Parses a completion or chat request (`body`), checks it, and hands it to the engine,
/// which has accepted or refused every prompt of it when this returns. `in_path` is held
/// until then.
pub(super) async fn start(
    state: &AppState,
    body: &serde_json::Map<String, Value>,
    endpoint: Endpoint,
    arrival: Instant,
    in_path: super::request_path::InPath,
) -> Result<Started, ApiError> {
    let s = &state.inner;
    let mut req: GenerationRequest = api::parse_request_with(body, endpoint, &s.sampling_defaults)?;
    if !req.model.is_empty() {
        s.check_model(&req.model)?;
    }
    if req.priority != 0 && s.scheduling_policy.is_fcfs() {
        // vLLM's words.
        return Err(ApiError::bad_request(
            Some("priority"),
            format!(
                "Got priority {} but Priority scheduling is not enabled (serve with \
                 --scheduling-policy priority)",
                req.priority
            ),
        ));
    }
    let tool_parser =
        match (req.auto_tools, s.tool_call_parser) {
            (false, _) => None,
            (true, Some(parser)) => Some(parser),
            (true, None) => return Err(ApiError::bad_request(
                Some("tool_choice"),
                "\"auto\" tool choice requires --enable-auto-tool-choice and --tool-call-parser \
                 to be set (or use \"required\" or name a function)",
            )),
        };
    // A reasoning model's chat: its thinking split off, the grammar (if any) after it
    // (unless the prompt has ended the thinking already: checked once it is tokenised).
    let reasoning = s.reasoning.as_ref().filter(|(parser, _)| {
        endpoint == Endpoint::Chat && req.reasoning.separate && parser.thinks(&req.template.kwargs)
    });
    let count = req.prompts.len();
    // More prompts than the queue can ever hold: a 503 would be retried for ever.
    if let Some(max) = s.max_waiting.filter(|&max| count > max) {
        return Err(ApiError::bad_request(
            Some("prompt"),
            format!(
                "{count} prompts in one request, more than the waiting queue holds \
                 (--max-waiting {max}): send at most {max}"
            ),
        ));
    }
    // A prompt to be cut may be longer than the context: its text is bounded by the body's
    // size alone (it is tokenised off the engine's thread).
    if req.truncate_prompt.is_none() {
        for (i, p) in req.prompts.iter().enumerate() {
            check_prompt_bytes(s, p).map_err(|e| e.in_prompt(i, count))?;
        }
    }
    // Which prompts are texts, whose BOS a cut keeps (as the tokenizer, cutting from the
    // left, adds it after the cut in vLLM).
    let text_prompts: Vec<bool> = (req.prompts.iter())
        .map(|p| matches!(p, Prompt::Text(_)))
        .collect();
    // Token ids the request names, now that the vocabulary is known.
    let biased = req.params.logit_bias.iter().map(|&(t, _)| t);
    api::within_vocab("logit_bias", biased, s.vocab_size)?;
    let allowed = req.params.allowed_token_ids.iter().flatten().copied();
    api::within_vocab("allowed_token_ids", allowed, s.vocab_size)?;
    api::within_vocab(
        "stop_token_ids",
        req.stop_token_ids.iter().copied(),
        s.vocab_size,
    )?;
    if !req.bad_words.is_empty() {
        req.params.bad_words = api::bad_word_ids(&s.tokenizer, &req.bad_words)?;
        let ids = req.params.bad_words.iter().flatten().copied();
        api::within_vocab("bad_words", ids, s.vocab_size)?;
        // Every token allowed is a word of one token, banned at every step: nothing could be
        // sampled (vLLM samples from a row of −∞ then).
        let banned = |t: &u32| req.params.bad_words.iter().any(|w| w[..] == [*t]);
        if (req.params.allowed_token_ids.as_ref()).is_some_and(|a| a.iter().all(banned)) {
            return Err(ApiError::bad_request(
                Some("bad_words"),
                "bad_words bans every token allowed_token_ids allows",
            ));
        }
    }
    // The prompts as sent, for `echo` (a token prompt is echoed decoded).
    let sent_texts: Vec<Option<String>> = req
        .prompts
        .iter()
        .map(|p| match p {
            Prompt::Text(t) if req.echo => Some(t.clone()),
            _ => None,
        })
        .collect();
    // Tokenising and compiling the grammar and the stop strings take a blocking thread,
    // never the engine's (the stop strings are compiled once, for every prompt and
    // sequence of the request).
    let tool_parameters;
    let (tokenized, mut constraint, stops) = {
        let prompts = std::mem::take(&mut req.prompts);
        let stop = req.stop.clone();
        let keep_stop = req.include_stop_str;
        let template = std::mem::take(&mut req.template);
        tool_parameters = Arc::new(match tool_parser.is_some_and(|p| p.reads_tool_schemas()) {
            true => ToolParameters::of(template.tools.as_ref()),
            false => ToolParameters::default(),
        });
        let compact = s.compact_json;
        let grammar = req.structured.as_ref().map(|r| {
            let mut g = r.grammar.clone();
            if compact {
                g.disable_any_whitespace();
            }
            (g, r.param)
        });
        // A grammar's compile takes time with its size, as a prompt's tokenising does: a
        // large one takes the large jobs' lane, not a short prompt's.
        let grammar_bytes = match &grammar {
            Some((g, param)) => g
                .checked_bytes()
                .map_err(|e| ApiError::bad_request(Some(*param), e.to_string()))?,
            None => 0,
        };
        let bytes = prompts.iter().map(Prompt::bytes).sum::<usize>()
            + template.tools.as_ref().map_or(0, |t| t.to_string().len())
            + Value::Object(template.kwargs.clone()).to_string().len()
            + grammar_bytes
            + stop.iter().map(String::len).sum::<usize>();
        off_thread(state, bytes, move |s| {
            let tokens = prompts
                .iter()
                .enumerate()
                .map(|(i, p)| prompt_tokens(s, p, &template).map_err(|e| e.in_prompt(i, count)))
                .collect::<Result<Vec<_>, _>>()?;
            let constraint = match grammar {
                Some((g, param)) => Some(s.grammars()?.compile(&g).map_err(|e| {
                    ApiError::bad_request(Some(param), format!("invalid grammar: {e:#}"))
                })?),
                None => None,
            };
            let stops = StopSet::new(&stop);
            let stops = if keep_stop {
                stops.keeping_the_match()
            } else {
                stops
            };
            Ok::<_, ApiError>((tokens, constraint, stops))
        })
        .await??
    };
    let s = &state.inner;
    // vLLM's rule: a prompt is cut to leave room for `max_tokens` (-1: all the room there
    // is); a cut longer than that room is refused. (A `max_tokens` past the context is
    // refused below, as without a cut.)
    let room = s.max_model_len.checked_sub(req.max_tokens.unwrap_or(0));
    let keep = match (req.truncate_prompt, room) {
        (None, _) | (_, None) => None,
        (Some(api::Truncation::ModelLength), Some(room)) => Some(room),
        (Some(api::Truncation::Keep(k)), Some(room)) if k > room => {
            return Err(ApiError::bad_request(
                Some("truncate_prompt_tokens"),
                format!(
                    "truncate_prompt_tokens={k} cannot be greater than max_model_len - \
                     max_tokens = {room}. Please request a smaller truncation size."
                ),
            ))
        }
        (Some(api::Truncation::Keep(k)), Some(_)) => Some(k),
    };
    let bos = (s.tokenizer.bos_token()).and_then(|b| s.tokenizer.token_to_id(b));
    let planned = tokenized
        .into_iter()
        .enumerate()
        .map(|(i, mut tokens)| {
            // The prompt's last `keep` tokens; a text prompt's BOS and its last `keep - 1`.
            let kept_bos =
                usize::from(text_prompts[i] && bos.is_some() && tokens.first().copied() == bos);
            let cut = keep.map_or(0, |k| tokens.len().saturating_sub(k.max(kept_bos)));
            tokens.drain(kept_bos..kept_bos + cut);
            let room = completion_budget(s.max_model_len, tokens.len(), req.max_tokens)
                .map_err(|e| e.in_prompt(i, count))?;
            let max_tokens = match (req.max_tokens, req.default_max_tokens) {
                (None, Some(default)) => room.min(default),
                _ => room,
            };
            if req.params.min_tokens > max_tokens {
                return Err(
                    api::min_tokens_past(req.params.min_tokens, max_tokens).in_prompt(i, count)
                );
            }
            Ok(Planned {
                tokens,
                max_tokens,
                truncated: cut > 0,
            })
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    check_response_size(&req, endpoint, &planned, s.max_model_len)?;
    // A prompt (as cut) that ends with the thinking done (a template that turns thinking
    // off, an answer being continued) is answered at once, as vLLM reads it.
    let reasoning =
        reasoning.filter(|(_, markers)| !planned.iter().any(|p| markers.ends_thinking(&p.tokens)));
    if let Some((_, markers)) = reasoning {
        constraint = constraint.map(|c| c.starting_after(markers.end));
    }
    // `max_tokens: 0` (with echo): one token is computed, as the step samples one, and
    // not returned.
    let keep_generated = req.max_tokens != Some(0);
    let echoes = if req.echo {
        planned
            .iter()
            .zip(sent_texts)
            .map(|(p, sent)| Echo {
                // A cut prompt is echoed as it ran.
                text: sent
                    .filter(|_| !p.truncated)
                    .unwrap_or_else(|| s.tokenizer.decode(&p.tokens).unwrap_or_default()),
                first_token: p.tokens[0],
            })
            .collect()
    } else {
        Vec::new()
    };
    let prompt_lens: Vec<usize> = planned.iter().map(|p| p.tokens.len()).collect();
    let prompt_token_ids =
        (req.return_token_ids).then(|| planned.iter().map(|p| p.tokens.clone()).collect());
    // One id per sequence, prompt by prompt: each prompt's request, then its forks.
    let choices = count * req.n;
    let id = s.next_id.fetch_add(choices as u64, Ordering::Relaxed);
    let ids = id..id + choices as u64;
    let (tx, mut rx) = outbox();
    if let Some(why) = s.health.lost() {
        return Err(ApiError {
            status: axum::http::StatusCode::SERVICE_UNAVAILABLE,
            ..ApiError::internal(why)
        });
    }
    let commands = s.commands.lock().unwrap().clone();
    let batch = planned
        .into_iter()
        .enumerate()
        .map(|(i, p)| {
            let first = id + (i * req.n) as u64;
            NewRequest {
                id: first,
                request: EngineRequest {
                    prompt: p.tokens,
                    max_tokens: if keep_generated { p.max_tokens } else { 1 },
                    params: req.params.clone(),
                    stop_strings: stops.clone(),
                    stop_token_ids: req.stop_token_ids.clone(),
                    ignore_eos: req.ignore_eos,
                    // vLLM's hermes parser reads `<tool_call>`, which some tokenizers mark
                    // special: a request it parses keeps special tokens in its text.
                    keep_special_tokens: !req.skip_special_tokens
                        || tool_parser.is_some_and(ToolCallParser::keeps_special_tokens)
                        || reasoning.is_some_and(|(_, markers)| markers.special),
                    forks: (first + 1..first + req.n as u64).collect(),
                    // Both `echo` with `logprobs` and `prompt_logprobs` score the prompt, with
                    // `prompt_logprobs`' alternatives where given (vLLM's rule).
                    prompt_logprobs: req
                        .prompt_logprobs
                        .or(req.params.logprobs.filter(|_| req.echo)),
                    constraint: constraint.clone(),
                    priority: req.priority,
                },
                first_index: i * req.n,
                arrival,
                events: tx.clone(),
                thinking_end: reasoning.map(|(_, markers)| markers.end),
            }
        })
        .collect();
    drop(tx);
    commands
        .send(Command::Add(batch))
        .map_err(|_| ApiError::internal("the engine has stopped"))?;
    drop(in_path);
    let guard = AbortOnDrop {
        ids,
        commands,
        done: false,
    };
    // Every prompt is answered before any of them runs a step (one command adds them all).
    for _ in 0..count {
        match rx.recv().await {
            Some(StreamEvent::Accepted) => {}
            Some(StreamEvent::Rejected(e)) => return Err(rejection(e)),
            _ => return Err(ApiError::internal("the engine dropped the request")),
        }
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
        logprobs: req.params.logprobs,
        tokens_as_ids: req.tokens_as_ids,
        prompt_token_ids,
        prompt_logprobs: req.prompt_logprobs,
        tokenizer: s.tokenizer.clone(),
        n: req.n,
        prompt_lens,
        echoes,
        keep_generated,
        continuous_usage: req.continuous_usage,
        include_usage: req.include_usage,
        tool: req.structured.as_ref().and_then(|r| r.tool.clone()),
        tool_parser,
        tool_parameters,
        call_id: super::tool_parser::call_ids(s.tool_call_parser),
        parallel_tool_calls: req.parallel_tool_calls,
        grammar_param: req.structured.as_ref().map(|r| r.param),
        reasoning: reasoning.map(|_| req.reasoning),
    };
    Ok(Started {
        rx,
        guard,
        meta,
        stream: req.stream,
    })
}

/// The tokens a prompt of `prompt_len` may generate: `asked`, or as many as fit (the
/// core's rule, which the simulator's client follows too).
fn completion_budget(
    max_model_len: usize,
    prompt_len: usize,
    asked: Option<usize>,
) -> Result<usize, ApiError> {
    infer_core::scheduler::completion_budget(max_model_len, prompt_len, asked).map_err(|e| {
        let param = match e {
            AddError::ExceedsContext { .. } => "max_tokens",
            _ => "prompt",
        };
        ApiError::bad_request(Some(param), e.to_string())
    })
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
    /// The choices' logprobs, with this many alternatives a token (`logprobs` /
    /// `top_logprobs`), when asked.
    logprobs: Option<usize>,
    /// Logprobs name tokens `token_id:N` (`return_tokens_as_token_ids`).
    tokens_as_ids: bool,
    /// `return_token_ids`: each prompt's token ids, and the choices' generated ones.
    prompt_token_ids: Option<Vec<Vec<u32>>>,
    /// vLLM's `prompt_logprobs`: alternatives per prompt token, when asked.
    prompt_logprobs: Option<usize>,
    tokenizer: Arc<TextTokenizer>,
    /// Choices per prompt: choice `i` is prompt `i / n`'s.
    n: usize,
    /// Each prompt's tokens.
    prompt_lens: Vec<usize>,
    /// What `echo` repeats before each choice, per prompt (none without `echo`).
    echoes: Vec<Echo>,
    /// False for `max_tokens: 0`: the computed token is not returned.
    keep_generated: bool,
    /// Every chunk carries its choice's usage so far.
    continuous_usage: bool,
    /// `stream_options.include_usage`: a last chunk carries the usage, and every other chunk
    /// `"usage": null`, as OpenAI's do.
    include_usage: bool,
    /// The output is a forced tool call, answered as `tool_calls` (chat).
    tool: Option<ToolChoice>,
    /// The output may call tools (`tool_choice: "auto"`), which this parser finds.
    tool_parser: Option<ToolCallParser>,
    /// The request's tools' parameters, which the parser may type the calls' values by.
    tool_parameters: Arc<ToolParameters>,
    /// Names each tool call, forced or found (see [`super::tool_parser::call_ids`]).
    call_id: fn() -> String,
    /// More than one of those calls may be answered (`parallel_tool_calls`).
    parallel_tool_calls: bool,
    /// The field the request's grammar came from, if it has one.
    grammar_param: Option<&'static str>,
    /// A reasoning model's chat, split at `</think>` (see [`super::reasoning`]): what it
    /// answers of the thinking. `None`: the output is all content.
    reasoning: Option<api::ReasoningOptions>,
}

/// [`ResponseMeta::failure`], given the field the request's grammar came from.
fn failure_error(f: RequestFailure, grammar_param: Option<&'static str>) -> ApiError {
    match (f.cause, grammar_param) {
        (FailureCause::Grammar, Some(param)) => ApiError::bad_request(
            Some(param),
            format!("the grammar failed during generation: {}", f.message),
        ),
        _ => ApiError::internal(f.message),
    }
}

/// The prompt an `echo` request gets back.
struct Echo {
    text: String,
    /// Its first token, which has no logprob (nothing comes before it).
    first_token: u32,
}

impl ResponseMeta {
    /// What a request that failed while it ran is answered: its grammar's failure (a parser
    /// row past llguidance's limit, a state it cannot leave) is the request's, a 400 naming
    /// the field; anything else is the server's.
    fn failure(&self, f: RequestFailure) -> ApiError {
        failure_error(f, self.grammar_param)
    }

    /// Choices in all: `n` per prompt.
    fn choices(&self) -> usize {
        self.n * self.prompt_lens.len()
    }

    fn echo(&self, choice: usize) -> Option<&Echo> {
        self.echoes.get(choice / self.n)
    }

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

    /// Usage of all choices (`finished` by choice index): each prompt once (its first
    /// choice's, which computed it), the completions summed (none when the computed token
    /// is not returned). A reasoning model's chat tells how many of those tokens thought
    /// (`reasoning_tokens`, summed likewise), as OpenAI's usage does.
    fn usage_of(&self, finished: &[Option<Finish>]) -> Value {
        let (mut prompt, mut completion, mut cached, mut reasoning) = (0, 0, 0, 0);
        for (i, f) in finished.iter().enumerate() {
            let Some(f) = f else { continue };
            if i % self.n == 0 {
                prompt += f.prompt_tokens;
                cached += f.cached_tokens;
            }
            if self.keep_generated {
                completion += f.completion_tokens;
                reasoning += f.reasoning_tokens;
            }
        }
        let mut usage = Self::usage(prompt, completion, cached);
        if self.reasoning.is_some() {
            usage["completion_tokens_details"] = json!({ "reasoning_tokens": reasoning });
        }
        usage
    }

    /// How logprobs name a token: its own text, special tokens included, or `token_id:N` as
    /// vLLM writes it (asked for, or for an id that has no text: distinct tokens must not
    /// share the empty name, as they are keys of a completion's `top_logprobs`).
    fn token_name(&self, token: u32) -> String {
        match self.tokens_as_ids {
            true => None,
            false => self.tokenizer.token_text(token),
        }
        .unwrap_or_else(|| format!("token_id:{token}"))
    }

    /// One token's logprobs. A completion's `top_logprobs` holds the sampled token too, as
    /// OpenAI's legacy API and vLLM return it (up to `logprobs` + 1 entries); a chat's holds
    /// the `top_logprobs` most likely only, each with its `bytes`, as OpenAI's.
    fn token_logprobs(&self, l: &TokenLogprob) -> Value {
        let (token, logprob, top) = (l.token, l.logprob, &l.top);
        let text = |t: u32| self.token_name(t);
        match self.endpoint {
            Endpoint::Completions => {
                let mut alternatives = serde_json::Map::new();
                alternatives.insert(text(token), json!(logprob));
                // An alternative that reads as the sampled token does (two byte tokens shown
                // as "�") never hides the sampled token's logprob.
                for &(t, l) in top.iter().filter(|&&(t, _)| t != token) {
                    alternatives.entry(text(t)).or_insert(json!(l));
                }
                json!({
                    "tokens": [text(token)], "token_logprobs": [logprob],
                    "top_logprobs": [alternatives],
                })
            }
            Endpoint::Chat => {
                let entry = |t: u32, l: f32| {
                    let name = text(t);
                    json!({"token": name, "logprob": l, "bytes": name.as_bytes()})
                };
                let mut sampled = entry(token, logprob);
                sampled["top_logprobs"] = top.iter().map(|&(t, l)| entry(t, l)).collect();
                json!({ "content": [sampled] })
            }
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
                return self.chat_chunk(index, delta, logprobs, finish);
            }
        };
        self.body(true, json!([choice]), None)
    }

    fn chat_chunk(
        &self,
        index: usize,
        delta: Value,
        logprobs: Value,
        finish: Option<&str>,
    ) -> Value {
        let choice =
            json!({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish});
        self.body(true, json!([choice]), None)
    }

    /// A chat chunk of a forced tool call, as vLLM streams it: a named function's
    /// arguments as they are generated (its name and id with the first); `required`'s
    /// calls whole at the end (their names are inside the list being generated), the
    /// tokens before sent only for their logprobs or running usage, when asked. `held`
    /// gathers the text so far.
    fn tool_chunk(
        &self,
        index: usize,
        text: &str,
        held: &mut String,
        logprobs: Value,
        finish: Option<&'static str>,
        first: bool,
    ) -> Option<Value> {
        let tool = self.tool.as_ref()?;
        held.push_str(text);
        let silent = matches!(tool, ToolChoice::Required)
            && finish.is_none()
            && !first
            && logprobs.is_null()
            && !self.continuous_usage;
        if silent {
            return None;
        }
        // Whether the text so far is a whole list of calls (asked only at the end).
        let mut whole_calls = false;
        let mut delta = match tool {
            ToolChoice::Named(name) if first => json!({"tool_calls": [{
                "index": 0, "id": (self.call_id)(), "type": "function",
                "function": {"name": name, "arguments": text}}]}),
            ToolChoice::Named(_) => {
                json!({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
            }
            ToolChoice::Required => {
                match finish.and_then(|_| structured::tool_calls(tool, held, self.call_id)) {
                    Some(calls) => {
                        whole_calls = true;
                        let calls: Vec<Value> = calls
                            .into_iter()
                            .enumerate()
                            .map(|(i, mut c)| {
                                c["index"] = json!(i);
                                c
                            })
                            .collect();
                        json!({"tool_calls": calls})
                    }
                    // Cut short: what was generated goes out as text.
                    None if finish.is_some() => json!({"content": held}),
                    None => json!({}),
                }
            }
        };
        if first {
            delta["role"] = json!("assistant");
        }
        let finish = finish.map(|f| tool_finish_reason(tool, f, whole_calls));
        Some(self.chat_chunk(index, delta, logprobs, finish))
    }

    /// A chat chunk of choice `c` under `tool_choice: "auto"`: the content as it is
    /// generated, up to where a call may begin; each call once it has a name and its
    /// arguments have begun, then its arguments as they are generated ([`CallStream`]); at
    /// the end, what the parser finds
    /// in the whole output (any content before the calls not yet sent, the rest of the
    /// calls), or the rest as content where no call was sent, so that a well-formed
    /// output's chunks add up to the non-streamed answer.
    #[allow(clippy::too_many_arguments)]
    fn auto_tool_chunk(
        &self,
        parser: ToolCallParser,
        index: usize,
        c: &mut StreamedChoice,
        text: &str,
        logprobs: Value,
        finish: Option<&'static str>,
        first: bool,
    ) -> Option<Value> {
        let (held, sent) = (&mut c.held, &mut c.content_sent);
        let calls = c.calls.get_or_insert_with(|| {
            CallStream::new(
                parser,
                self.parallel_tool_calls,
                self.tool_parameters.clone(),
            )
        });
        held.push_str(text);
        let mut reason = finish;
        let parallel = self.parallel_tool_calls;
        let parsed = finish.and_then(|_| parser.parse(held, parallel, &self.tool_parameters));
        let upto = match (&parsed, finish) {
            (_, None) => parser.streamable_len(held, *sent).max(*sent),
            (Some(p), _) => p.content.as_ref().map_or(0, String::len).max(*sent),
            // The calls sent stay as far as they went (see [`CallStream`]).
            (None, Some(_)) if calls.started() => *sent,
            (None, Some(_)) => held.len(),
        };
        let mut delta = json!({"content": &held[*sent..upto]});
        *sent = upto;
        let entries = match &parsed {
            Some(p) => calls.finish(p, self.call_id),
            // A stream that has begun a call reads its last text too; one that has not
            // ends as the non-streamed answer, all content.
            None if finish.is_none() || calls.started() => calls.advance(held, self.call_id),
            None => Vec::new(),
        };
        if parsed.is_some() {
            reason = Some("tool_calls");
        }
        if !entries.is_empty() {
            if delta["content"] == "" {
                delta = json!({});
            }
            delta["tool_calls"] = entries.into();
        } else if delta["content"] == "" && finish.is_none() {
            let needed = first || !logprobs.is_null() || self.continuous_usage;
            if !needed {
                return None;
            }
        }
        if first {
            delta["role"] = json!("assistant");
        }
        Some(self.chat_chunk(index, delta, logprobs, reason))
    }

    /// A chunk of generated `text` of choice `c`, as the request answers it: plain, a
    /// forced call's, or one that may call tools. `first`: the first text of the choice (its
    /// role and a named function's id go with it). `None` where nothing is to be sent yet,
    /// which is never where `logprobs` is not null.
    fn content_chunk(
        &self,
        index: usize,
        c: &mut StreamedChoice,
        text: &str,
        logprobs: Value,
        finish: Option<&'static str>,
        first: bool,
    ) -> Option<Value> {
        match (&self.tool, self.tool_parser) {
            (Some(_), _) => self.tool_chunk(index, text, &mut c.held, logprobs, finish, first),
            (None, Some(parser)) => {
                self.auto_tool_chunk(parser, index, c, text, logprobs, finish, first)
            }
            (None, None) => Some(self.chunk(index, text, logprobs, finish, first)),
        }
    }

    /// A chunk of a reasoning model's generated `text` of choice `c` (see
    /// [`Thinking`]): once the thinking has ended, the content's chunk, with the reasoning
    /// beside it; while thinking, the reasoning's, where there is one to send or the chunk
    /// is needed (the choice's first, logprobs, running usage, the end). `first`: the
    /// choice's first chunk, which alone carries the role.
    fn thinking_chunk(
        &self,
        index: usize,
        c: &mut StreamedChoice,
        text: &str,
        logprobs: Value,
        finish: Option<&'static str>,
        first: bool,
    ) -> Option<Value> {
        let thinking = c.thinking.as_mut().expect("a reasoning model's choice");
        let ThinkingPiece { reasoning, content } = thinking.next(text, finish.is_some());
        let first_content =
            thinking.split.answering() && !std::mem::replace(&mut thinking.content_started, true);
        let (mut chunk, logprobs) = if thinking.split.answering() {
            // `None` only where the logprobs were null.
            let chunk = self.content_chunk(index, c, &content, logprobs, finish, first_content);
            (chunk, Value::Null)
        } else {
            (None, logprobs)
        };
        let needed = reasoning.is_some()
            || first
            || !logprobs.is_null()
            || self.continuous_usage
            || finish.is_some();
        if chunk.is_none() && needed {
            chunk = Some(self.chat_chunk(index, json!({}), logprobs, finish));
        }
        let delta = &mut chunk.as_mut()?["choices"][0]["delta"];
        // The answer's first chunk says so (a content, if only empty, or calls), for a
        // reader that tells the thinking's tokens from the answer's (the Responses API's
        // logprobs).
        if first_content && delta.get("content").is_none() && delta.get("tool_calls").is_none() {
            delta["content"] = json!("");
        }
        if let Some(r) = reasoning {
            delta["reasoning"] = json!(r);
        }
        // The role goes with the choice's first chunk alone.
        if let Some(d) = delta.as_object_mut() {
            match first {
                true => d.insert("role".into(), json!("assistant")),
                false => d.remove("role"),
            };
        }
        chunk
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

    /// `continuous_usage_stats`: a chunk of choice `index` carries its prompt's tokens and
    /// the tokens the choice has generated so far, as vLLM's chunks do; otherwise, with
    /// `include_usage`, a null usage.
    fn with_running_usage(&self, mut chunk: Value, index: usize, generated: usize) -> Value {
        if self.continuous_usage {
            let prompt = self.prompt_lens[index / self.n];
            chunk["usage"] = json!({"prompt_tokens": prompt, "completion_tokens": generated,
                                    "total_tokens": prompt + generated});
        } else if self.include_usage {
            chunk["usage"] = Value::Null;
        }
        chunk
    }
}

/// Where each streamed choice stands.
struct StreamedChoice {
    /// Its first chunk is still to come.
    first: bool,
    /// Characters sent so far: where its next chunk's `text_offset` starts.
    sent_chars: usize,
    /// Tokens it has generated (and returned) so far.
    generated: usize,
    finish: Option<Finish>,
    /// The text of a forced tool call so far, or of an output that may call tools.
    held: String,
    /// Bytes of `held` sent as content (`tool_choice: "auto"`).
    content_sent: usize,
    /// The calls found in `held` so far (`tool_choice: "auto"`).
    calls: Option<CallStream>,
    /// A reasoning model's output, split as it comes (see [`ResponseMeta::reasoning`]).
    thinking: Option<Thinking>,
    /// `return_token_ids`: the generated tokens not yet sent (a chunk held back carries
    /// none; the next one carries them), and whether the prompt's have been.
    unsent_ids: Vec<u32>,
    prompt_ids_sent: bool,
}

/// Where a reasoning model's output stands, streamed or gathered.
struct Thinking {
    split: ReasoningSplit,
    /// What the request answers of the reasoning.
    answer: api::ReasoningOptions,
    /// Reasoning to be answered and not yet sent (all of it when not streamed).
    unsent: String,
    /// Content (or a call) has been streamed: the content's first chunk is past.
    content_started: bool,
}

/// The next piece of a reasoning model's output, split.
struct ThinkingPiece {
    /// The reasoning to send now: as it comes, or whole once the thinking ends where it is
    /// not streamed; none where it is not answered.
    reasoning: Option<String>,
    content: String,
}

impl Thinking {
    fn new(answer: api::ReasoningOptions) -> Self {
        Thinking {
            split: ReasoningSplit::default(),
            answer,
            unsent: String::new(),
            content_started: false,
        }
    }

    /// Splits the next `text` of the output (its last when `last`).
    fn next(&mut self, text: &str, last: bool) -> ThinkingPiece {
        let mut pieces = self.split.push(text);
        if last {
            let rest = self.split.finish();
            pieces.reasoning += &rest.reasoning;
            pieces.content += &rest.content;
        }
        if self.answer.include {
            self.unsent += &pieces.reasoning;
        }
        let send = self.answer.stream || last || self.split.answering();
        ThinkingPiece {
            reasoning: (send && !self.unsent.is_empty()).then(|| std::mem::take(&mut self.unsent)),
            content: pieces.content,
        }
    }
}

/// A started request's answer as SSE: its chunks, then `[DONE]`.
fn sse_stream(started: Started) -> impl Stream<Item = Result<SseEvent, std::convert::Infallible>> {
    chunks(started)
        .map(|chunk| Ok(SseEvent::default().data(chunk.to_string())))
        .chain(futures_util::stream::once(async {
            Ok(SseEvent::default().data("[DONE]"))
        }))
}

/// A started request's chunks as they are generated, the last carrying the usage when
/// asked; an error body ends them early. Dropping the stream (the client went away) aborts
/// the request.
pub(super) fn chunks(started: Started) -> impl Stream<Item = Value> {
    let Started {
        mut rx,
        guard,
        meta,
        ..
    } = started;
    async_stream::stream! {
        // Move the whole guard in: dropping the stream (client gone) aborts the request.
        let mut guard = guard;
        let mut choices: Vec<StreamedChoice> = (0..meta.choices())
            .map(|_| StreamedChoice { first: true, sent_chars: 0, generated: 0, finish: None, held: String::new(), content_sent: 0, calls: None, thinking: meta.reasoning.map(Thinking::new), unsent_ids: Vec::new(), prompt_ids_sent: false })
            .collect();
        let mut open = choices.len();
        // Each prompt's logprobs (they come with its request's first token).
        let mut echoed: Vec<Option<Vec<TokenLogprob>>> = vec![None; meta.prompt_lens.len()];
        while let Some(ev) = rx.recv().await {
            match ev {
                StreamEvent::Token { index, text, token_ids, logprobs, finish, prompt_logprobs, stop_reason } => {
                    if let Some(lps) = prompt_logprobs {
                        echoed[index / meta.n] = Some(lps);
                    }
                    let c = &mut choices[index];
                    if c.first {
                        if let Some(echo) = meta.echo(index) {
                            // The prompt first, as its own chunk.
                            let lp = match (&echoed[index / meta.n], meta.logprobs.is_some()) {
                                (Some(lps), true) => merge_logprobs(meta.endpoint, &meta.prompt_logprob_parts(echo, lps), 0, None),
                                _ => Value::Null,
                            };
                            let chunk = meta.chunk(index, &echo.text, lp, None, true);
                            let chunk = meta.with_running_usage(chunk, index, 0);
                            let chunk = meta.with_token_ids(chunk, index, c);
                            c.sent_chars += echo.text.chars().count();
                            yield chunk;
                        }
                    }
                    let (text, lp) = if !meta.keep_generated {
                        (String::new(), Value::Null)
                    } else if meta.logprobs.is_some() {
                        let parts: Vec<Value> = logprobs.iter().map(|l| meta.token_logprobs(&l.logprob)).collect();
                        let widths: Vec<usize> = logprobs.iter().map(|l| l.chars).collect();
                        (text, merge_logprobs(meta.endpoint, &parts, c.sent_chars, Some(&widths)))
                    } else {
                        (text, Value::Null)
                    };
                    if meta.keep_generated {
                        c.generated += token_ids.len();
                        if meta.prompt_token_ids.is_some() {
                            c.unsent_ids.extend(token_ids);
                        }
                    }
                    let reason = finish.map(|f| f.reason.as_str());
                    let first = c.first && meta.echo(index).is_none();
                    let chunk = match c.thinking {
                        None => meta.content_chunk(index, c, &text, lp, reason, first),
                        Some(_) => meta.thinking_chunk(index, c, &text, lp, reason, first),
                    };
                    if let Some(mut chunk) = chunk {
                        if finish.is_some() {
                            chunk["choices"][0]["stop_reason"] = stop_reason_json(stop_reason.as_ref());
                        }
                        let chunk = meta.with_running_usage(chunk, index, c.generated);
                        let chunk = meta.with_token_ids(chunk, index, c);
                        yield chunk;
                    }
                    c.first = false;
                    c.sent_chars += text.chars().count();
                    if finish.is_some() {
                        c.finish = finish;
                        open -= 1;
                        if open == 0 {
                            guard.done = true;
                            if meta.include_usage {
                                let finished: Vec<Option<Finish>> = choices.iter().map(|c| c.finish).collect();
                                let u = meta.body(true, json!([]), Some(meta.usage_of(&finished)));
                                yield u;
                            }
                            break;
                        }
                    }
                }
                StreamEvent::Error(msg) => {
                    // The other choices end with the stream (the guard aborts them).
                    yield meta.failure(msg).body();
                    break;
                }
                StreamEvent::Accepted | StreamEvent::Rejected(_) => {}
            }
        }
    }
}

/// One choice of a non-streaming response, as it accumulates.
#[derive(Default)]
struct Choice {
    /// Its text: a reasoning model's content, after its thinking.
    text: String,
    /// Its generated tokens (`return_token_ids`).
    token_ids: Vec<u32>,
    logprobs: Vec<Value>,
    finish: Option<Finish>,
    stop_reason: Option<StopReason>,
    /// A reasoning model's output, split as it comes, and the reasoning to answer.
    thinking: Option<Thinking>,
    reasoning: String,
}

/// vLLM's `stop_reason`: the stop string, the stop token's id, or null.
fn stop_reason_json(r: Option<&StopReason>) -> Value {
    match r {
        Some(StopReason::Text(t)) => json!(t),
        Some(StopReason::Token(t)) => json!(t),
        None => Value::Null,
    }
}

async fn collect(started: Started) -> Result<Response, ApiError> {
    let Started {
        mut rx,
        mut guard,
        meta,
        ..
    } = started;
    let mut choices: Vec<Choice> = (0..meta.choices())
        .map(|_| Choice {
            thinking: meta.reasoning.map(Thinking::new),
            ..Choice::default()
        })
        .collect();
    let mut open = choices.len();
    let mut echoed: Vec<Option<Vec<TokenLogprob>>> = vec![None; meta.prompt_lens.len()];
    while let Some(ev) = rx.recv().await {
        match ev {
            StreamEvent::Token {
                index,
                text,
                token_ids,
                logprobs,
                finish,
                prompt_logprobs,
                stop_reason,
            } => {
                if prompt_logprobs.is_some() {
                    echoed[index / meta.n] = prompt_logprobs;
                }
                let c = &mut choices[index];
                if meta.keep_generated {
                    match &mut c.thinking {
                        Some(thinking) => {
                            let piece = thinking.next(&text, finish.is_some());
                            c.text.push_str(&piece.content);
                            c.reasoning
                                .push_str(piece.reasoning.as_deref().unwrap_or_default());
                        }
                        None => c.text.push_str(&text),
                    }
                    if meta.logprobs.is_some() {
                        c.logprobs
                            .extend(logprobs.iter().map(|l| meta.token_logprobs(&l.logprob)));
                    }
                    if meta.prompt_token_ids.is_some() {
                        c.token_ids.extend(token_ids);
                    }
                }
                if finish.is_some() {
                    c.finish = finish;
                    c.stop_reason = stop_reason;
                    open -= 1;
                }
                if open > 0 {
                    continue;
                }
                guard.done = true;
                let finished: Vec<Option<Finish>> = choices.iter().map(|c| c.finish).collect();
                for (i, c) in choices.iter_mut().enumerate() {
                    // Each choice repeats its prompt first.
                    let Some(echo) = meta.echo(i) else { break };
                    let parts = match (&echoed[i / meta.n], meta.logprobs.is_some()) {
                        (Some(lps), true) => meta.prompt_logprob_parts(echo, lps),
                        _ => Vec::new(),
                    };
                    c.text.insert_str(0, &echo.text);
                    c.logprobs.splice(0..0, parts);
                }
                let mut body: Vec<Value> = choices
                    .iter()
                    .enumerate()
                    .map(|(i, c)| meta.choice(i, c))
                    .collect();
                let mut top_level = None;
                if meta.prompt_logprobs.is_some() {
                    let mut scored: Vec<Value> = echoed
                        .iter()
                        .map(|lps| meta.prompt_logprobs_json(lps.as_deref().unwrap_or(&[])))
                        .collect();
                    // A completion's choices carry their prompt's (the last one moved, not
                    // copied); a chat's response its one.
                    match meta.endpoint {
                        Endpoint::Completions => {
                            for (i, choice) in body.iter_mut().enumerate() {
                                let last = (i + 1) % meta.n == 0;
                                choice["prompt_logprobs"] = if last {
                                    std::mem::take(&mut scored[i / meta.n])
                                } else {
                                    scored[i / meta.n].clone()
                                };
                            }
                        }
                        Endpoint::Chat => top_level = scored.into_iter().next(),
                    }
                }
                // `return_token_ids`: as vLLM answers them, each choice its generated tokens, and
                // a completion's choices their prompt's, a chat's response its one.
                if let Some(prompts) = &meta.prompt_token_ids {
                    for (i, (choice, c)) in body.iter_mut().zip(&choices).enumerate() {
                        choice["token_ids"] = json!(c.token_ids);
                        if meta.endpoint == Endpoint::Completions {
                            choice["prompt_token_ids"] = json!(prompts[i / meta.n]);
                        }
                    }
                }
                let usage = meta.usage_of(&finished);
                let mut response = meta.body(false, Value::Array(body), Some(usage));
                if let Some(scored) = top_level {
                    response["prompt_logprobs"] = scored;
                }
                if let (Some(prompts), Endpoint::Chat) = (&meta.prompt_token_ids, meta.endpoint) {
                    response["prompt_token_ids"] = json!(prompts[0]);
                }
                return Ok(Json(response).into_response());
            }
            StreamEvent::Error(msg) => return Err(meta.failure(msg)),
            StreamEvent::Accepted | StreamEvent::Rejected(_) => {}
        }
    }
    Err(ApiError::internal(
        "the engine stopped before the request finished",
    ))
}

impl ResponseMeta {
    /// `return_token_ids`: a streamed `chunk` of choice `index` with the generated tokens
    /// not yet sent, and, the choice's first, its prompt's (a completion's choice carries
    /// them, a chat's chunk), as vLLM's chunks carry them.
    fn with_token_ids(&self, mut chunk: Value, index: usize, c: &mut StreamedChoice) -> Value {
        let Some(prompts) = &self.prompt_token_ids else {
            return chunk;
        };
        chunk["choices"][0]["token_ids"] = json!(std::mem::take(&mut c.unsent_ids));
        if !std::mem::replace(&mut c.prompt_ids_sent, true) {
            let prompt = json!(prompts[index / self.n]);
            match self.endpoint {
                Endpoint::Completions => chunk["choices"][0]["prompt_token_ids"] = prompt,
                Endpoint::Chat => chunk["prompt_token_ids"] = prompt,
            }
        }
        chunk
    }

    /// The logprob entries of an echoed prompt: its first token without a logprob, then
    /// each token's given the tokens before it.
    fn prompt_logprob_parts(&self, echo: &Echo, lps: &[TokenLogprob]) -> Vec<Value> {
        let first = json!({"tokens": [self.token_name(echo.first_token)], "token_logprobs": [null],
                           "top_logprobs": [null]});
        // As vLLM shows them: the prompt's token, then up to `logprobs` others of the
        // alternatives the prompt was scored with (`prompt_logprobs`' when asked).
        let own = |p: &TokenLogprob| TokenLogprob {
            top: (p.top.iter())
                .filter(|&&(t, _)| t != p.token)
                .take(self.logprobs.unwrap_or(0))
                .copied()
                .collect(),
            ..p.clone()
        };
        std::iter::once(first)
            .chain(lps.iter().map(|p| self.token_logprobs(&own(p))))
            .collect()
    }

    /// vLLM's `prompt_logprobs` of one prompt: null for its first token, then per token a
    /// map from token id to its logprob, rank and text: the prompt's own token, then the
    /// `prompt_logprobs` most likely (ranked 1, 2, …).
    fn prompt_logprobs_json(&self, lps: &[TokenLogprob]) -> Value {
        let k = self.prompt_logprobs.unwrap_or(0);
        // vLLM's `decoded_token`: the token decoded alone, whatever names tokens elsewhere.
        let entry = |t: u32, logprob: f32, rank: Option<usize>| {
            let text = self.tokenizer.token_text(t).unwrap_or_default();
            json!({"logprob": logprob, "rank": rank, "decoded_token": text})
        };
        let positions = lps.iter().map(|p| {
            let top = &p.top[..p.top.len().min(k)];
            // The prompt's token first; among the most likely, it takes its place there.
            let rank = match top.iter().position(|&(t, _)| t == p.token) {
                Some(i) => Some(i + 1),
                None => p.rank,
            };
            let mut m = serde_json::Map::new();
            m.insert(p.token.to_string(), entry(p.token, p.logprob, rank));
            for (i, &(t, l)) in top.iter().enumerate() {
                m.entry(t.to_string())
                    .or_insert_with(|| entry(t, l, Some(i + 1)));
            }
            Value::Object(m)
        });
        std::iter::once(Value::Null).chain(positions).collect()
    }

    /// A finished choice of a non-streaming response.
    fn choice(&self, index: usize, c: &Choice) -> Value {
        let logprobs = if self.logprobs.is_some() {
            merge_logprobs(self.endpoint, &c.logprobs, 0, None)
        } else {
            Value::Null
        };
        let reason = c.finish.map(|f| f.reason.as_str());
        let stop_reason = stop_reason_json(c.stop_reason.as_ref());
        match self.endpoint {
            Endpoint::Completions => {
                json!({"index": index, "text": c.text, "logprobs": logprobs, "finish_reason": reason,
                       "stop_reason": stop_reason})
            }
            Endpoint::Chat => {
                let calls = self.tool.as_ref().and_then(|tool| {
                    let calls = structured::tool_calls(tool, &c.text, self.call_id)?;
                    Some((calls, reason.map(|r| tool_finish_reason(tool, r, true))))
                });
                let parsed = self.tool_parser.and_then(|p| {
                    p.parse(&c.text, self.parallel_tool_calls, &self.tool_parameters)
                });
                let (message, reason) = match (calls, parsed) {
                    // vLLM's shape: an empty content beside the calls.
                    (Some((calls, reason)), _) => (
                        json!({"role": "assistant", "content": "", "tool_calls": calls}),
                        reason,
                    ),
                    // The model called tools: vLLM's `tool_calls` whatever ended the output.
                    (None, Some(p)) => (
                        json!({"role": "assistant", "content": p.content,
                        "tool_calls": tool_call_values(&p.calls, false, || {
                            (self.call_id)()
                        })}),
                        Some("tool_calls"),
                    ),
                    // A reasoning model that wrote nothing after its thinking: no content.
                    (None, None) if c.thinking.is_some() && c.text.is_empty() => {
                        (json!({"role": "assistant", "content": null}), reason)
                    }
                    (None, None) => (json!({"role": "assistant", "content": c.text}), reason),
                };
                let mut message = message;
                if c.thinking.is_some() {
                    message["reasoning"] = match c.reasoning.as_str() {
                        "" => Value::Null,
                        r => json!(r),
                    };
                }
                json!({"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason,
                       "stop_reason": stop_reason})
            }
        }
    }
}

/// vLLM's finish reason of a forced tool call: `tool_calls` when `required` produced
/// `whole_calls`, the generation's own otherwise (a named function's call ends with `stop`).
fn tool_finish_reason(tool: &ToolChoice, reason: &'static str, whole_calls: bool) -> &'static str {
    match tool {
        ToolChoice::Required if reason == "stop" && whole_calls => "tool_calls",
        _ => reason,
    }
}

/// Per-token logprob objects → one object, as a response or chunk carries them. A
/// completion's also gets `text_offset`: where each token starts in the choice's text, in
/// characters, the first at `start` (what the choice sent before), each token taking
/// `widths[i]` characters where the text each released is known (a stream's, so that a
/// chunk of several tokens reads as one chunk each), else its own text's, as vLLM counts.
fn merge_logprobs(
    endpoint: Endpoint,
    parts: &[Value],
    start: usize,
    widths: Option<&[usize]>,
) -> Value {
    match endpoint {
        Endpoint::Completions => {
            let cat = |k: &str| {
                parts
                    .iter()
                    .flat_map(|p| p[k].as_array().cloned().unwrap_or_default())
                    .collect::<Vec<_>>()
            };
            let tokens = cat("tokens");
            let text_offset: Vec<usize> = tokens
                .iter()
                .enumerate()
                .scan(start, |at, (i, t)| {
                    let here = *at;
                    *at += match widths {
                        Some(w) => w[i],
                        None => t.as_str().map_or(0, |t| t.chars().count()),
                    };
                    Some(here)
                })
                .collect();
            json!({"tokens": tokens, "token_logprobs": cat("token_logprobs"),
                   "top_logprobs": cat("top_logprobs"), "text_offset": text_offset})
        }
        Endpoint::Chat => {
            json!({"content": parts.iter().flat_map(|p| p["content"].as_array().cloned().unwrap_or_default()).collect::<Vec<_>>()})
        }
    }
}

/// Log-probabilities a response may carry: about 25 MB of JSON. A response's size follows
/// `n` × (echoed prompt + completion) × (1 + top log-probabilities), summed over its
/// prompts, so without a bound a 22 KB request (`echo`, `logprobs: 20`, `n: 64`, a
/// 4,000-token prompt) makes the server build 124 MB. One choice of one prompt may instead
/// reach the whole context with 20 top log-probabilities a token (a chat request asking
/// for `top_logprobs` without `max_tokens` on a 128k model, some 70 MB): the bound is on
/// what `n` and several prompts multiply.
pub const MAX_LOGPROB_ENTRIES: usize = 1 << 20;

/// Refuses a request whose log-probabilities would pass [`MAX_LOGPROB_ENTRIES`], naming
/// what multiplies to it.
fn check_response_size(
    req: &GenerationRequest,
    endpoint: Endpoint,
    planned: &[Planned],
    max_model_len: usize,
) -> Result<(), ApiError> {
    let prompt_tokens: usize = planned.iter().map(|p| p.tokens.len()).sum();
    // vLLM's `prompt_logprobs`: every choice of a completion carries its prompt's, a chat's
    // response one; an entry (id, logprob, rank, text) weighs about 3 of the others.
    let copies = match endpoint {
        Endpoint::Chat => 1,
        Endpoint::Completions => req.n,
    };
    let scored = req.prompt_logprobs.map_or(0, |k| {
        copies
            .saturating_mul(prompt_tokens)
            .saturating_mul(k.saturating_add(1))
            .saturating_mul(3)
    });
    let top = req.params.logprobs.unwrap_or(0);
    let positions: usize = match req.params.logprobs {
        None => 0,
        Some(_) => planned
            .iter()
            .map(|p| p.max_tokens + if req.echo { p.tokens.len() } else { 0 })
            .sum(),
    };
    let sampled = req
        .n
        .saturating_mul(positions)
        .saturating_mul(top.saturating_add(1));
    let entries = sampled.saturating_add(scored);
    let one_sequence = req.n == 1 && planned.len() == 1;
    let bound = if one_sequence {
        MAX_LOGPROB_ENTRIES.max(max_model_len.saturating_mul(1 + MAX_TOP_LOGPROBS))
    } else {
        MAX_LOGPROB_ENTRIES
    };
    if entries <= bound {
        return Ok(());
    }
    if scored >= sampled {
        return Err(ApiError::bad_request(
            Some("prompt_logprobs"),
            format!(
                "{copies} x {prompt_tokens} prompt tokens x (1 + {} top log-probabilities), \
                 weighed 3 each = {scored}{}, more than the {bound} a response may carry: \
                 lower prompt_logprobs{}, or send fewer prompt tokens",
                req.prompt_logprobs.unwrap_or(0),
                if sampled > 0 {
                    format!(", and {sampled} for logprobs")
                } else {
                    String::new()
                },
                if copies > 1 { " or n" } else { "" },
            ),
        ));
    }
    let max_tokens: usize = planned.iter().map(|p| p.max_tokens).sum();
    Err(ApiError::bad_request(
        Some("logprobs"),
        format!(
            "n {} x {positions} positions ({}max_tokens {max_tokens}{}{}) x (1 + {top} top \
             log-probabilities) = {sampled} log-probabilities{}, more than the {bound} \
             a response may carry: lower n, logprobs or max_tokens",
            req.n,
            if req.echo {
                format!("the echoed prompt's {prompt_tokens} and ")
            } else {
                String::new()
            },
            if planned.len() > 1 {
                format!(" over {} prompts", planned.len())
            } else {
                String::new()
            },
            if req.max_tokens.is_none() {
                ", not given: the context left"
            } else {
                ""
            },
            if scored > 0 {
                format!(" and {scored} for prompt_logprobs")
            } else {
                String::new()
            },
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::super::engine_loop::SampledLogprob;
    use super::*;
    use axum::http::StatusCode;

    /// A request started with `events` already sent by the engine, answered with `meta`.
    fn started(events: Vec<StreamEvent>, meta: ResponseMeta, stream: bool) -> Started {
        let (tx, rx) = outbox();
        for e in events {
            tx.send(e).unwrap();
        }
        let guard = AbortOnDrop {
            ids: 0..1,
            commands: mpsc::channel().0,
            done: false,
        };
        Started {
            rx,
            guard,
            meta,
            stream,
        }
    }

    /// A stream's chunks read back as the client sees them.
    async fn streamed(events: Vec<StreamEvent>, meta: ResponseMeta) -> Vec<Value> {
        let started = started(events, meta, true);
        let body = Sse::new(sse_stream(started)).into_response().into_body();
        let bytes = axum::body::to_bytes(body, usize::MAX).await.unwrap();
        String::from_utf8(bytes.to_vec())
            .unwrap()
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .map(|d| serde_json::from_str(d).unwrap())
            .collect()
    }

    /// A non-streamed answer's body.
    async fn collected(events: Vec<StreamEvent>, meta: ResponseMeta) -> Value {
        let started = started(events, meta, false);
        let body = collect(started).await.unwrap().into_body();
        let bytes = axum::body::to_bytes(body, usize::MAX).await.unwrap();
        serde_json::from_slice(&bytes).unwrap()
    }

    /// A chat's answer of one choice, as [`ResponseMeta`] sets it up.
    fn chat_meta(
        tokenizer: &Arc<TextTokenizer>,
        reasoning: Option<api::ReasoningOptions>,
        tool_parser: Option<ToolCallParser>,
    ) -> ResponseMeta {
        ResponseMeta {
            id: "chatcmpl-1".into(),
            created: 0,
            fingerprint: "fp".into(),
            model: "m".into(),
            endpoint: Endpoint::Chat,
            logprobs: None,
            tokens_as_ids: false,
            prompt_token_ids: None,
            prompt_logprobs: None,
            tokenizer: tokenizer.clone(),
            n: 1,
            prompt_lens: vec![3],
            echoes: Vec::new(),
            keep_generated: true,
            continuous_usage: false,
            include_usage: true,
            tool: None,
            tool_parser,
            tool_parameters: Default::default(),
            call_id: crate::server::tool_parser::openai_call_id,
            parallel_tool_calls: true,
            grammar_param: None,
            reasoning,
        }
    }

    /// One event per text, the last finishing the output.
    fn text_events(texts: &[&str]) -> Vec<StreamEvent> {
        (texts.iter().enumerate())
            .map(|(i, t)| StreamEvent::Token {
                index: 0,
                token_ids: vec![1],
                logprobs: Vec::new(),
                text: t.to_string(),
                finish: (i + 1 == texts.len()).then_some(Finish {
                    reason: infer_core::FinishReason::Stop,
                    prompt_tokens: 3,
                    completion_tokens: texts.len(),
                    cached_tokens: 0,
                    // As the engine counts them: up to and with `</think>`.
                    reasoning_tokens: 4,
                }),
                prompt_logprobs: None,
                stop_reason: None,
            })
            .collect()
    }

    /// A reasoning model's chat: its thinking is `reasoning`, the rest `content` (which
    /// alone the tool parser reads), streamed as it comes or whole, adding up alike.
    #[tokio::test]
    async fn a_reasoning_models_thinking_is_split_from_its_answer() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("qwen");
        let spec = crate::tools::make_model::ModelSpec::new(crate::Arch::Qwen3);
        crate::tools::make_model::make_model(&spec, &dir).unwrap();
        let tokenizer = Arc::new(TextTokenizer::from_dir(&dir).unwrap());
        let options = |include, stream| api::ReasoningOptions {
            separate: true,
            include,
            stream,
        };
        let texts = [
            "<think>",
            "Hm",
            " so</th",
            "ink>",
            "\n\nOs",
            "lo <tool_call>{\"name\": \"f\", \"arguments\": {}}",
            "</tool_call>",
        ];
        // (reasoning options, tool parser, reasoning chunks, content, calls)
        let cases = [
            (
                options(true, true),
                None,
                2,
                "\n\nOslo <tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>",
                0,
            ),
            (
                options(true, false),
                None,
                1,
                "\n\nOslo <tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>",
                0,
            ),
            (
                options(false, true),
                None,
                0,
                "\n\nOslo <tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>",
                0,
            ),
            (
                options(true, true),
                Some(ToolCallParser::Hermes),
                2,
                "\n\nOslo ",
                1,
            ),
        ];
        for (answer, parser, reasoning_chunks, content, calls) in cases {
            let case = format!("{answer:?} {parser:?}");
            let chunks = streamed(
                text_events(&texts),
                chat_meta(&tokenizer, Some(answer), parser),
            )
            .await;
            let deltas: Vec<&Value> = chunks
                .iter()
                .filter_map(|c| c["choices"].get(0))
                .map(|c| &c["delta"])
                .collect();
            assert_eq!(deltas[0]["role"], "assistant", "{case}");
            assert!(
                deltas[1..].iter().all(|d| d.get("role").is_none()),
                "{case}"
            );
            let reasoning: Vec<&str> = deltas
                .iter()
                .filter_map(|d| d["reasoning"].as_str())
                .collect();
            assert_eq!(reasoning.len(), reasoning_chunks, "{case}: {reasoning:?}");
            let want_reasoning = if answer.include { "Hm so" } else { "" };
            assert_eq!(reasoning.concat(), want_reasoning, "{case}");
            let streamed_content: String = deltas
                .iter()
                .filter_map(|d| d["content"].as_str())
                .collect();
            assert_eq!(streamed_content, content, "{case}");
            let streamed_calls = deltas
                .iter()
                .filter_map(|d| d["tool_calls"].as_array())
                .flatten()
                .count();
            assert_eq!(streamed_calls, calls, "{case}");
            let usage = &chunks.last().unwrap()["usage"];
            assert_eq!(
                usage["completion_tokens_details"]["reasoning_tokens"], 4,
                "{case}"
            );
            // The whole answer says the same.
            let whole = collected(
                text_events(&texts),
                chat_meta(&tokenizer, Some(answer), parser),
            )
            .await;
            let message = &whole["choices"][0]["message"];
            assert_eq!(
                message["reasoning"],
                json!(answer.include.then_some("Hm so")),
                "{case}"
            );
            assert_eq!(message["content"], content, "{case}");
            assert_eq!(
                message["tool_calls"].as_array().map_or(0, Vec::len),
                calls,
                "{case}"
            );
            assert_eq!(whole["usage"], *usage, "{case}");
        }
        // Cut while thinking: all reasoning, no content.
        let whole = collected(
            text_events(&["Hm", " so"]),
            chat_meta(&tokenizer, Some(options(true, true)), None),
        )
        .await;
        let message = &whole["choices"][0]["message"];
        assert_eq!(
            (&message["reasoning"], &message["content"]),
            (&json!("Hm so"), &Value::Null)
        );
        // Without a parser, the output is all content, and no reasoning is told of.
        let whole = collected(text_events(&texts[..5]), chat_meta(&tokenizer, None, None)).await;
        let message = &whole["choices"][0]["message"];
        assert_eq!(message["content"], "<think>Hm so</think>\n\nOs");
        assert!(
            message.get("reasoning").is_none()
                && whole["usage"].get("completion_tokens_details").is_none()
        );
    }

    /// Under `tool_choice: "auto"`, a call streams once it has a name and its arguments
    /// have begun, then its arguments piece by piece; the chunks add up to the whole answer. A call cut short
    /// stays in the stream as far as it went, where the whole answer is content.
    #[tokio::test]
    async fn found_calls_stream_piece_by_piece_and_add_up_to_the_whole_answer() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("llama");
        let spec = crate::tools::make_model::ModelSpec::new(crate::Arch::Llama);
        crate::tools::make_model::make_model(&spec, &dir).unwrap();
        let tokenizer = Arc::new(TextTokenizer::from_dir(&dir).unwrap());
        let texts = [
            "Let me",
            " look.<tool",
            "_call>\n{\"na",
            "me\": \"get_",
            "weather\", \"argu",
            "ments\": {\"city\": \"Os",
            "lo\", \"days\": 3",
            "}}\n</tool_call>",
            "<tool_call>{\"name\": \"now\", \"arguments\": {}}</tool_call>",
        ];
        let meta = || chat_meta(&tokenizer, None, Some(ToolCallParser::Hermes));
        let chunks = streamed(text_events(&texts), meta()).await;
        let choices: Vec<&Value> = chunks.iter().filter_map(|c| c["choices"].get(0)).collect();
        let mut content = String::new();
        let mut calls: Vec<(Value, String, String)> = Vec::new();
        let mut chunks_with_calls = 0;
        for c in &choices {
            content.push_str(c["delta"]["content"].as_str().unwrap_or_default());
            let entries = c["delta"]["tool_calls"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            chunks_with_calls += usize::from(!entries.is_empty());
            for e in entries {
                let i = e["index"].as_u64().unwrap() as usize;
                if i == calls.len() {
                    let name = e["function"]["name"].as_str().unwrap().to_string();
                    calls.push((e["id"].clone(), name, String::new()));
                }
                calls[i]
                    .2
                    .push_str(e["function"]["arguments"].as_str().unwrap());
            }
        }
        // The first call went out with the chunk that began its arguments (`{"city": "Os`),
        // the rest of them over two more; the second call whole, in the chunk that held it.
        assert_eq!(chunks_with_calls, 4, "{chunks:#?}");
        assert_eq!(choices.last().unwrap()["finish_reason"], "tool_calls");
        let whole = collected(text_events(&texts), meta()).await;
        let message = &whole["choices"][0]["message"];
        assert_eq!(message["content"], content);
        assert_eq!(content, "Let me look.");
        let whole_calls = message["tool_calls"].as_array().unwrap();
        assert_eq!(whole_calls.len(), calls.len());
        for (w, (id, name, arguments)) in whole_calls.iter().zip(&calls) {
            assert!(id.as_str().unwrap().starts_with("chatcmpl-tool-"));
            assert_eq!(
                (&w["function"]["name"], &w["function"]["arguments"]),
                (&json!(name), &json!(arguments))
            );
        }
        assert_eq!(calls[0].2, r#"{"city": "Oslo", "days": 3}"#);

        // Cut in the first call's arguments: streamed as far as it went, and no more
        // content; the whole answer is all content, as vLLM answers it.
        let mut events = text_events(&texts[..7]);
        if let Some(StreamEvent::Token {
            finish: Some(f), ..
        }) = events.last_mut()
        {
            f.reason = infer_core::FinishReason::Length;
        }
        let cut: Vec<StreamEvent> = events.clone();
        let chunks = streamed(events, meta()).await;
        let last = chunks
            .iter()
            .filter_map(|c| c["choices"].get(0))
            .next_back()
            .unwrap();
        assert_eq!(last["finish_reason"], "length");
        let sent: String = chunks
            .iter()
            .filter_map(|c| c["choices"].get(0))
            .filter_map(|c| c["delta"]["tool_calls"][0]["function"]["arguments"].as_str())
            .collect();
        assert_eq!(sent, r#"{"city": "Oslo", "days": "#);
        let streamed_content: String = chunks
            .iter()
            .filter_map(|c| c["choices"].get(0))
            .filter_map(|c| c["delta"]["content"].as_str())
            .collect();
        assert_eq!(streamed_content, "Let me look.");
        let whole = collected(cut, meta()).await;
        assert_eq!(
            whole["choices"][0]["message"]["content"],
            texts[..7].concat()
        );
        assert_eq!(whole["choices"][0]["finish_reason"], "length");
    }

    /// What the client reads of a stream's choice: its text, each logprob entry (tokens
    /// with their offsets, or chat's content entries), its finish and the usage.
    fn read(chunks: &[Value], endpoint: Endpoint) -> (String, Vec<Value>, Value, Value) {
        let (mut text, mut logprobs, mut finish, mut usage) =
            (String::new(), Vec::new(), Value::Null, Value::Null);
        for c in chunks {
            if !c["usage"].is_null() {
                usage = c["usage"].clone();
            }
            let Some(choice) = c["choices"].get(0) else {
                continue;
            };
            let (t, lp) = match endpoint {
                Endpoint::Completions => (&choice["text"], &choice["logprobs"]),
                Endpoint::Chat => (&choice["delta"]["content"], &choice["logprobs"]),
            };
            text.push_str(t.as_str().unwrap_or(""));
            match endpoint {
                Endpoint::Completions => {
                    let at = |k: &str, i: usize| lp[k][i].clone();
                    for i in 0..lp["tokens"].as_array().unwrap().len() {
                        logprobs.push(json!([
                            at("tokens", i),
                            at("token_logprobs", i),
                            at("top_logprobs", i),
                            at("text_offset", i)
                        ]));
                    }
                }
                Endpoint::Chat => logprobs.extend(lp["content"].as_array().unwrap().clone()),
            }
            if !choice["finish_reason"].is_null() {
                finish = choice["finish_reason"].clone();
            }
        }
        (text, logprobs, finish, usage)
    }

    /// A stream whose tokens merged (a lagging reader's) says what the unmerged one says:
    /// the same text, the same logprob entries with the same offsets, the same end and
    /// usage — only in fewer chunks.
    #[tokio::test]
    async fn a_merged_stream_reads_as_the_unmerged_one() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("llama");
        crate::tools::make_model::make_model(
            &crate::tools::make_model::ModelSpec::new(crate::Arch::Llama),
            &dir,
        )
        .unwrap();
        let tokenizer = Arc::new(TextTokenizer::from_dir(&dir).unwrap());
        let total = 12;
        // Texts unlike the tokens' names, as a stop string's held-back text, a special
        // token's or a character split across tokens make them: offsets follow the text.
        let token = |i: usize| {
            let id = 40 + 7 * i as u32;
            let text = match i % 3 {
                1 => String::new(),
                _ => format!("t{i}·"),
            };
            StreamEvent::Token {
                index: 0,
                token_ids: vec![1],
                logprobs: vec![SampledLogprob {
                    logprob: TokenLogprob {
                        token: id,
                        logprob: -0.5 * i as f32,
                        top: vec![(id, -0.5 * i as f32), (id + 1, -3.0)],
                        rank: None,
                    },
                    chars: text.chars().count(),
                }],
                text,
                finish: (i + 1 == total).then_some(Finish {
                    reason: infer_core::FinishReason::Length,
                    prompt_tokens: 3,
                    completion_tokens: total,
                    cached_tokens: 0,
                    reasoning_tokens: 0,
                }),
                prompt_logprobs: None,
                stop_reason: None,
            }
        };
        let one_by_one: Vec<StreamEvent> = (0..total).map(token).collect();
        // Groups of 1, 3, 1, 5 and 2 tokens.
        let mut merged: Vec<StreamEvent> = Vec::new();
        for (i, e) in one_by_one.iter().cloned().enumerate() {
            match merged.last_mut() {
                Some(last) if ![0, 1, 4, 5, 10].contains(&i) => {
                    assert!(last.absorb(e).is_none())
                }
                _ => merged.push(e),
            }
        }
        assert_eq!(merged.len(), 5);
        let cases = [Endpoint::Completions, Endpoint::Chat]
            .into_iter()
            .flat_map(|e| [(e, false, false), (e, true, true)]);
        for (endpoint, tokens_as_ids, continuous_usage) in cases {
            let meta = || ResponseMeta {
                id: "cmpl-1".into(),
                created: 0,
                fingerprint: "fp".into(),
                model: "m".into(),
                endpoint,
                logprobs: Some(1),
                tokens_as_ids,
                prompt_token_ids: None,
                prompt_logprobs: None,
                tokenizer: tokenizer.clone(),
                n: 1,
                prompt_lens: vec![3],
                echoes: Vec::new(),
                keep_generated: true,
                continuous_usage,
                include_usage: true,
                tool: None,
                tool_parser: None,
                tool_parameters: Default::default(),
                call_id: crate::server::tool_parser::openai_call_id,
                parallel_tool_calls: true,
                grammar_param: None,
                reasoning: None,
            };
            let whole = streamed(one_by_one.clone(), meta()).await;
            let lagging = streamed(merged.clone(), meta()).await;
            assert_eq!((whole.len(), lagging.len()), (total + 1, 5 + 1));
            let want = read(&whole, endpoint);
            assert_eq!(want.1.len(), total);
            assert_eq!(want.3["completion_tokens"], total);
            let case = format!("{endpoint:?}, ids {tokens_as_ids}");
            assert_eq!(read(&lagging, endpoint), want, "{case}");
            if continuous_usage {
                // The running usage of the last token chunk counts every token.
                for chunks in [&whole, &lagging] {
                    let last = &chunks[chunks.len() - 2];
                    assert_eq!(last["usage"]["completion_tokens"], total, "{case}");
                }
            }
        }
    }

    /// A chat asking for 20 top log-probabilities without max_tokens on a 128k-context
    /// model is one sequence as long as the context: answered, not refused for size. What
    /// `n` multiplies past the bound is refused, saying max_tokens was the context left.
    #[test]
    fn one_sequence_of_the_whole_context_is_never_refused_for_its_logprobs() {
        let body = |n: usize| {
            let v = json!({"messages": [{"role": "user", "content": "hi"}], "logprobs": true,
                           "top_logprobs": 20, "n": n});
            v.as_object().unwrap().clone()
        };
        let context = 131_072;
        let planned = |tokens: usize| {
            vec![Planned {
                tokens: vec![1; tokens],
                max_tokens: completion_budget(context, tokens, None).unwrap(),
                truncated: false,
            }]
        };
        let one = api::parse_request(&body(1), Endpoint::Chat).unwrap();
        check_response_size(&one, Endpoint::Completions, &planned(10), context).unwrap();
        let two = api::parse_request(&body(2), Endpoint::Chat).unwrap();
        let e =
            check_response_size(&two, Endpoint::Completions, &planned(10), context).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("logprobs"));
        assert!(
            e.message.contains("not given: the context left"),
            "{}",
            e.message
        );
    }

    /// The cause decides the status, not the words: a step's error that happens to read like
    /// a grammar's is still the server's.
    #[test]
    fn a_grammar_failure_is_the_requests_and_a_step_failure_the_servers() {
        let grammar = RequestFailure::grammar(&anyhow::anyhow!("parser row too large"));
        let e = failure_error(grammar.clone(), Some("response_format"));
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.param.as_deref(), Some("response_format"));
        assert!(e.message.contains("parser row too large"), "{}", e.message);
        assert!(!e.message.contains("structured output: "), "{}", e.message);
        assert_eq!(
            grammar.to_string(),
            "structured output: parser row too large"
        );

        let step = RequestFailure::server("structured output: model step failed: boom");
        let e = failure_error(step, Some("response_format"));
        assert_eq!(e.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(e.param, None);
        // Without a grammar field to name, even a grammar's failure is reported as the server's.
        let e = failure_error(grammar, None);
        assert_eq!(e.status, StatusCode::INTERNAL_SERVER_ERROR);
    }
}
