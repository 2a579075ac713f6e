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
use futures_util::stream::Stream;
use infer_core::AddError;
use serde_json::{json, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use super::api::{self, ApiError, Endpoint, GenerationRequest, Prompt};
use super::engine_loop::{Command, Finish, NewRequest, StreamEvent};
use super::prompt::{body_or_error, check_prompt_bytes, off_thread, prompt_tokens};
use super::AppState;
use crate::runtime::engine_core::{EngineRequest, PromptLogprob};
use crate::runtime::tokenizer::TextTokenizer;

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

pub(super) async fn generate(
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
    // Token ids the request names, now that the vocabulary is known.
    let biased = req.params.logit_bias.iter().map(|&(t, _)| t);
    api::within_vocab("logit_bias", biased, s.vocab_size)?;
    api::within_vocab(
        "stop_token_ids",
        req.stop_token_ids.iter().copied(),
        s.vocab_size,
    )?;
    // The prompt as sent, for `echo` (a token prompt is echoed decoded).
    let sent_text = match &req.prompt {
        Prompt::Text(t) if req.echo => Some(t.clone()),
        _ => None,
    };
    let prompt = {
        let p = std::mem::replace(&mut req.prompt, Prompt::Tokens(Vec::new()));
        off_thread(&state, p.bytes(), move |s| prompt_tokens(s, &p)).await??
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
    check_response_size(&req, n, max_tokens)?;
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
    if let Some(why) = s.health.lost() {
        return Err(ApiError {
            status: axum::http::StatusCode::SERVICE_UNAVAILABLE,
            ..ApiError::internal(why)
        });
    }
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

/// Log-probabilities a response may carry: about 25 MB of JSON. A response's size follows
/// `n` × (echoed prompt + completion) × (1 + top log-probabilities), so without a bound a
/// 22 KB request (`echo`, `logprobs: 20`, `n: 64`, a 4,000-token prompt) makes the server
/// build 124 MB.
pub const MAX_LOGPROB_ENTRIES: usize = 1 << 20;

/// Refuses a request whose log-probabilities would pass [`MAX_LOGPROB_ENTRIES`], naming
/// what multiplies to it.
fn check_response_size(
    req: &GenerationRequest,
    prompt_tokens: usize,
    max_tokens: usize,
) -> Result<(), ApiError> {
    let Some(top) = req.params.logprobs else {
        return Ok(());
    };
    let positions = max_tokens + if req.echo { prompt_tokens } else { 0 };
    let entries = req
        .n
        .saturating_mul(positions)
        .saturating_mul(top.saturating_add(1));
    if entries <= MAX_LOGPROB_ENTRIES {
        return Ok(());
    }
    Err(ApiError::bad_request(
        Some("logprobs"),
        format!(
            "n {} x {positions} positions ({}max_tokens {max_tokens}) x (1 + {top} top \
             log-probabilities) = {entries} log-probabilities, more than the {MAX_LOGPROB_ENTRIES} \
             a response may carry: lower n, logprobs or max_tokens",
            req.n,
            if req.echo {
                format!("the echoed prompt's {prompt_tokens} and ")
            } else {
                String::new()
            },
        ),
    ))
}
