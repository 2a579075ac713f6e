//! `/v1/responses`: OpenAI's Responses API, text in and text out, as vLLM serves it. A
//! request is read as the chat completion it asks for (`instructions` and `input` become
//! the messages), which then runs as any chat does; the chat's chunks are told as the
//! Responses API's events, or gathered into its one response object, by one [`Answer`], so
//! that a stream and a whole answer agree. Nothing is stored: a response says `store:
//! false`, and a `previous_response_id` or a retrieval is answered 404, as vLLM answers
//! them unless its store is enabled.

use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::StreamExt;
use serde_json::{json, Map, Value};

use super::api::{ApiError, Endpoint};
use super::completions::{chunks, start};
use super::prompt::body_or_error;
use super::AppState;
use infer_kernels::sampling::MAX_TOP_LOGPROBS;

/// `include` values: the one this server honours.
const OUTPUT_LOGPROBS: &str = "message.output_text.logprobs";

/// The value a field takes where the request left it out.
type IfAbsent = fn() -> Value;

/// Fields a response repeats from its request, with the value it says when the request
/// left them out. `store` is always false (nothing is kept) and `truncation` "disabled".
const ECHOED: &[(&str, IfAbsent)] = &[
    ("instructions", || Value::Null),
    ("max_output_tokens", || Value::Null),
    ("max_tool_calls", || Value::Null),
    ("metadata", || Value::Null),
    ("parallel_tool_calls", || json!(true)),
    ("prompt_cache_key", || Value::Null),
    ("reasoning", || Value::Null),
    ("safety_identifier", || Value::Null),
    ("service_tier", || json!("auto")),
    ("text", || json!({"format": {"type": "text"}})),
    ("tool_choice", || json!("auto")),
    ("tools", || json!([])),
    ("top_logprobs", || json!(0)),
    ("user", || Value::Null),
];

/// vLLM's sampling fields beyond OpenAI's, taken by this endpoint as by a chat.
const PASSED_TO_CHAT: &[&str] = &[
    "model",
    "temperature",
    "top_p",
    "parallel_tool_calls",
    "stop",
    "ignore_eos",
    "seed",
    "top_k",
    "min_p",
    "min_tokens",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "stop_token_ids",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "structured_outputs",
    "priority",
];

/// Fields read here, beside [`ECHOED`] and [`PASSED_TO_CHAT`].
const READ_HERE: &[&str] = &[
    "input",
    "stream",
    "stream_options",
    "store",
    "include",
    "previous_response_id",
    "background",
    "truncation",
    "prompt",
    "conversation",
    "chat_template_kwargs",
];

pub(super) async fn responses(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    respond(state, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// `GET /v1/responses/{id}`: nothing is stored, so no response is found.
pub(super) async fn retrieve(Path(id): Path<String>) -> ApiError {
    not_stored("response_id", &id)
}

fn not_stored(param: &str, id: &str) -> ApiError {
    ApiError::not_found(
        param,
        format!("Response with id '{id}' not found: this server stores no responses"),
    )
}

async fn respond(
    state: AppState,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let arrival = Instant::now();
    let in_path = state.inner.request_path.enter();
    let body = body_or_error(body).await?;
    let defaults = &state.inner.sampling_defaults;
    let defaults: Map<String, Value> = [
        ("temperature", defaults.temperature),
        ("top_p", defaults.top_p),
    ]
    .into_iter()
    // Written as the config wrote them (0.6, not 0.6000000238418579).
    .filter_map(|(k, v)| Some((k.to_string(), json!(v?.to_string().parse::<f64>().ok()?))))
    .collect();
    let request = read_request(&body, &defaults)?;
    let started = start(&state, &request.chat, Endpoint::Chat, arrival, in_path)
        .await
        .map_err(as_responses_error)?;
    let suffix = started.id().trim_start_matches("chatcmpl-").to_string();
    let created_at = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let thinking = started.splits_reasoning();
    let mut answer = Answer::new(
        &suffix,
        created_at,
        &state.inner.model_name,
        request.echo,
        thinking,
    );
    let mut chunks = Box::pin(chunks(started));
    if !request.stream {
        while let Some(chunk) = chunks.next().await {
            if let Some(e) = chunk.get("error") {
                return Err(error_of(e));
            }
            answer.take(&chunk);
        }
        if answer.finish.is_none() {
            return Err(stopped());
        }
        // The last event holds the whole response.
        let mut ending = answer.end();
        let mut last = ending.pop().expect("end() ends with the response");
        return Ok(Json(last["response"].take()).into_response());
    }
    let events = async_stream::stream! {
        for event in answer.opening() {
            yield event;
        }
        while let Some(chunk) = chunks.next().await {
            if let Some(e) = chunk.get("error") {
                for event in answer.fail(&error_of(e)) {
                    yield event;
                }
                return;
            }
            for event in answer.take(&chunk) {
                yield event;
            }
        }
        let ending = match answer.finish {
            Some(_) => answer.end(),
            None => answer.fail(&stopped()),
        };
        for event in ending {
            yield event;
        }
    };
    // Each event named in its `event:` line too, as OpenAI sends them; no `[DONE]`.
    let sse = events.map(|e: Value| {
        let kind = e["type"].as_str().unwrap_or_default().to_string();
        Ok::<_, std::convert::Infallible>(SseEvent::default().event(kind).data(e.to_string()))
    });
    Ok(Sse::new(sse).into_response())
}

/// An error the chat path raised, told in this endpoint's names.
fn as_responses_error(mut e: ApiError) -> ApiError {
    e.param = e.param.map(|p| {
        match p.as_str() {
            "max_tokens" | "max_completion_tokens" => "max_output_tokens",
            "response_format" => "text",
            "logprobs" => "top_logprobs",
            "prompt" => "input",
            _ if p.starts_with("messages") => "input",
            _ => return p,
        }
        .to_string()
    });
    e
}

/// An error body that arrived in the chat's stream (a grammar that failed during
/// generation is the request's; anything else the server's), as this endpoint's error.
fn error_of(e: &Value) -> ApiError {
    let status = e["code"]
        .as_u64()
        .and_then(|c| axum::http::StatusCode::from_u16(c as u16).ok())
        .unwrap_or(axum::http::StatusCode::INTERNAL_SERVER_ERROR);
    let message = e["message"].as_str().unwrap_or("generation failed");
    let of_kind = match e["type"].as_str() {
        Some("invalid_request_error") => ApiError::bad_request(None, message),
        _ => ApiError::internal(message),
    };
    as_responses_error(ApiError {
        status,
        param: e["param"].as_str().map(str::to_string),
        ..of_kind
    })
}

/// The chat's stream ended before its output did: the engine stopped (a forced shutdown).
fn stopped() -> ApiError {
    ApiError::internal("the engine stopped before the request finished")
}

/// A Responses request, read.
#[derive(Debug)]
struct ResponsesRequest {
    /// The chat completion request it asks for (always streamed, with its usage).
    chat: Map<String, Value>,
    /// What its response repeats ([`ECHOED`]).
    echo: Map<String, Value>,
    stream: bool,
}

fn bad(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::bad_request(Some(param), message)
}

/// Reads a Responses request into the chat request it asks for. `defaults` are the model's
/// sampling defaults (`temperature`, `top_p`), which the response repeats where the request
/// set none.
fn read_request(
    body: &Map<String, Value>,
    defaults: &Map<String, Value>,
) -> Result<ResponsesRequest, ApiError> {
    let known = |k: &str| {
        ECHOED.iter().any(|(e, _)| *e == k) || PASSED_TO_CHAT.contains(&k) || READ_HERE.contains(&k)
    };
    if let Some((key, _)) = body.iter().find(|(k, v)| !v.is_null() && !known(k)) {
        return Err(bad(
            key,
            format!("Unrecognized request argument supplied: {key}"),
        ));
    }
    let given = |k: &str| body.get(k).filter(|v| !v.is_null());
    if let Some(id) = given("previous_response_id") {
        return Err(not_stored(
            "previous_response_id",
            id.as_str().unwrap_or_default(),
        ));
    }
    for (key, why) in [
        ("prompt", "prompt templates are not supported"),
        (
            "conversation",
            "conversations are not supported: this server stores no state; send the turns in input",
        ),
    ] {
        if given(key).is_some() {
            return Err(bad(key, why));
        }
    }
    if given("background").is_some_and(|v| v != &json!(false)) {
        return Err(bad(
            "background",
            "background responses are not supported: this server stores no responses",
        ));
    }
    // "auto": vLLM's reading, the prompt cut from the left to leave `max_output_tokens`
    // their room (OpenAI drops whole items from the conversation's start instead).
    let truncate = match given("truncation").map(|v| v.as_str()) {
        None | Some(Some("disabled")) => false,
        Some(Some("auto")) => true,
        Some(_) => return Err(bad("truncation", "truncation must be auto or disabled")),
    };
    if let Some(store) = given("store") {
        store
            .as_bool()
            .ok_or_else(|| bad("store", "store must be a boolean"))?;
    }
    let stream = match given("stream") {
        None => false,
        Some(v) => v
            .as_bool()
            .ok_or_else(|| bad("stream", "stream must be a boolean"))?,
    };
    if let Some(options) = given("stream_options") {
        if !stream {
            return Err(bad("stream_options", "stream_options requires stream"));
        }
        if !options.is_object() {
            return Err(bad("stream_options", "stream_options must be an object"));
        }
        let obfuscation = options.get("include_obfuscation");
        let other = options.as_object().and_then(|o| {
            o.keys()
                .find(|k| k.as_str() != "include_obfuscation")
                .cloned()
        });
        if let Some(key) = other {
            return Err(bad(
                "stream_options",
                format!("unknown stream option {key}"),
            ));
        }
        if obfuscation.is_some_and(|v| v == &json!(true)) {
            return Err(bad(
                "stream_options",
                "include_obfuscation is not supported: events carry no padding",
            ));
        }
    }
    let logprobs = match given("include") {
        None => false,
        Some(Value::Array(list)) => {
            for item in list {
                if item.as_str() != Some(OUTPUT_LOGPROBS) {
                    return Err(bad(
                        "include",
                        format!("{item} is not supported; only \"{OUTPUT_LOGPROBS}\" is"),
                    ));
                }
            }
            !list.is_empty()
        }
        Some(_) => return Err(bad("include", "include must be a list")),
    };

    // Checked whether or not `include` asks for logprobs (OpenAI's range).
    if let Some(k) = given("top_logprobs") {
        if k.as_u64().is_none_or(|k| k as usize > MAX_TOP_LOGPROBS) {
            return Err(bad(
                "top_logprobs",
                format!("top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}"),
            ));
        }
    }
    // One tier: the ones that ask for another are refused.
    if let Some(tier) = given("service_tier") {
        if !matches!(tier.as_str(), Some("auto" | "default")) {
            return Err(bad(
                "service_tier",
                format!("service_tier {tier} is not supported: this server has one tier (auto, default)"),
            ));
        }
    }
    let mut chat = Map::new();
    for key in PASSED_TO_CHAT {
        if let Some(v) = given(key) {
            chat.insert(key.to_string(), v.clone());
        }
    }
    let (messages, continue_final) = messages(given("instructions"), body.get("input"))?;
    chat.insert("messages".into(), Value::Array(messages));
    if continue_final {
        chat.insert("continue_final_message".into(), json!(true));
        chat.insert("add_generation_prompt".into(), json!(false));
    }
    chat.insert("stream".into(), json!(true));
    chat.insert("stream_options".into(), json!({"include_usage": true}));
    if let Some(max) = given("max_output_tokens") {
        chat.insert("max_tokens".into(), max.clone());
    }
    if truncate {
        chat.insert("truncate_prompt_tokens".into(), json!(-1));
    }
    if logprobs {
        chat.insert("logprobs".into(), json!(true));
        if let Some(k) = given("top_logprobs") {
            chat.insert("top_logprobs".into(), k.clone());
        }
    }
    if let Some(format) = given("text") {
        if let Some(format) = response_format(format)? {
            chat.insert("response_format".into(), format);
        }
    }
    if let Some(tools) = given("tools") {
        chat.insert("tools".into(), chat_tools(tools)?);
    }
    if let Some(choice) = given("tool_choice") {
        chat.insert("tool_choice".into(), chat_tool_choice(choice)?);
    }
    let mut kwargs = match given("chat_template_kwargs") {
        None => Map::new(),
        Some(Value::Object(m)) => m.clone(),
        Some(_) => {
            return Err(bad(
                "chat_template_kwargs",
                "chat_template_kwargs must be an object",
            ))
        }
    };
    if let Some(reasoning) = given("reasoning") {
        let Some(r) = reasoning.as_object() else {
            return Err(bad("reasoning", "reasoning must be an object"));
        };
        for (key, value) in r.iter().filter(|(_, v)| !v.is_null()) {
            match key.as_str() {
                // As vLLM: the template reads the effort (gpt-oss's, Qwen3's …).
                "effort" => {
                    kwargs.insert("reasoning_effort".into(), value.clone());
                }
                _ => {
                    return Err(bad(
                        "reasoning",
                        format!("reasoning.{key} is not supported; only effort is"),
                    ))
                }
            }
        }
    }
    if !kwargs.is_empty() {
        chat.insert("chat_template_kwargs".into(), Value::Object(kwargs));
    }

    let mut echo = Map::new();
    for (key, default) in ECHOED {
        echo.insert(key.to_string(), given(key).cloned().unwrap_or_else(default));
    }
    for key in ["temperature", "top_p"] {
        let value = given(key)
            .or_else(|| defaults.get(key))
            .cloned()
            .unwrap_or(json!(1.0));
        echo.insert(key.into(), value);
    }
    echo.insert("store".into(), json!(false));
    echo.insert(
        "truncation".into(),
        json!(if truncate { "auto" } else { "disabled" }),
    );
    echo.insert("background".into(), json!(false));
    echo.insert("previous_response_id".into(), Value::Null);
    Ok(ResponsesRequest { chat, echo, stream })
}

/// The chat messages of `instructions` and `input`, and whether the model continues the
/// last one (an assistant message `in_progress` or `incomplete`, as vLLM reads it).
fn messages(
    instructions: Option<&Value>,
    input: Option<&Value>,
) -> Result<(Vec<Value>, bool), ApiError> {
    let mut out = Vec::new();
    match instructions {
        None => {}
        Some(Value::String(s)) => out.push(json!({"role": "system", "content": s})),
        Some(_) => return Err(bad("instructions", "instructions must be a string")),
    }
    let items = match input {
        Some(Value::String(s)) => {
            out.push(json!({"role": "user", "content": s}));
            return Ok((out, false));
        }
        Some(Value::Array(items)) if !items.is_empty() => items,
        Some(Value::Array(_)) => return Err(bad("input", "input cannot be empty")),
        None | Some(Value::Null) => return Err(bad("input", "input is required")),
        Some(_) => return Err(bad("input", "input must be a string or a list of items")),
    };
    let mut continue_final = false;
    for (i, item) in items.iter().enumerate() {
        let param = format!("input[{i}]");
        let kind = item.get("type").and_then(Value::as_str);
        let field = |k: &str| -> Result<String, ApiError> {
            match item.get(k) {
                Some(Value::String(s)) => Ok(s.clone()),
                _ => Err(bad(
                    &param,
                    format!("a {} item needs a string {k}", kind.unwrap_or("message")),
                )),
            }
        };
        continue_final = false;
        match kind {
            None | Some("message") => {
                let role = match item.get("role").and_then(Value::as_str) {
                    Some("developer") => "system",
                    Some(role @ ("user" | "system" | "assistant")) => role,
                    _ => {
                        return Err(bad(
                            &param,
                            "a message's role must be user, system, developer or assistant",
                        ))
                    }
                };
                if item.get("content").is_none_or(Value::is_null) {
                    return Err(bad(&param, "a message needs its content"));
                }
                let text = chat_content(item.get("content"), &param)?;
                continue_final = role == "assistant"
                    && matches!(
                        item.get("status").and_then(Value::as_str),
                        Some("in_progress" | "incomplete")
                    );
                match out.last_mut() {
                    // The answer its reasoning item began.
                    Some(last) if role == "assistant" && thought_only(last) => {
                        last["content"] = text
                    }
                    _ => out.push(json!({"role": role, "content": text})),
                }
            }
            Some("reasoning") => {
                // A turn's thinking (as this server answers it): the next assistant
                // message's, or its calls'.
                // OpenAI's own items may carry a summary alone (no content).
                let parts = match item.get("content") {
                    None | Some(Value::Null) => &Vec::new(),
                    Some(Value::Array(parts)) => parts,
                    Some(_) => {
                        return Err(bad(
                            &param,
                            "a reasoning item's content is a list of reasoning_text parts",
                        ))
                    }
                };
                let texts = parts.iter().map(|p| {
                    match (p.get("type").and_then(Value::as_str), p.get("text")) {
                        (Some("reasoning_text"), Some(Value::String(t))) => Ok(t.as_str()),
                        _ => Err(bad(
                            &param,
                            "a reasoning item's content is a list of reasoning_text parts",
                        )),
                    }
                });
                let text = texts.collect::<Result<Vec<_>, _>>()?.concat();
                out.push(json!({"role": "assistant", "content": "", "reasoning": text}));
            }
            Some("function_call") => {
                let call = json!({"id": field("call_id")?, "type": "function",
                    "function": {"name": field("name")?, "arguments": field("arguments")?}});
                // Calls made in one turn are one assistant message's.
                match out.last_mut() {
                    Some(last) if last["role"] == "assistant" => {
                        match last.get_mut("tool_calls").and_then(Value::as_array_mut) {
                            Some(calls) => calls.push(call),
                            None => last["tool_calls"] = json!([call]),
                        }
                    }
                    _ => {
                        out.push(json!({"role": "assistant", "content": "", "tool_calls": [call]}))
                    }
                }
            }
            Some("function_call_output") => {
                if item.get("output").is_none_or(Value::is_null) {
                    return Err(bad(&param, "a function_call_output item needs its output"));
                }
                let output = chat_content(item.get("output"), &param)?;
                out.push(
                    json!({"role": "tool", "tool_call_id": field("call_id")?, "content": output}),
                );
            }
            Some(other) => {
                return Err(bad(
                    &param,
                    format!(
                        "{other} items are not supported: input takes messages, reasoning, \
                         function_call and function_call_output items"
                    ),
                ))
            }
        }
    }
    Ok((out, continue_final))
}

/// Whether a chat message is an assistant turn of thinking alone, so far.
fn thought_only(m: &Value) -> bool {
    m["role"] == "assistant"
        && m.get("reasoning").is_some()
        && m["content"] == ""
        && m.get("tool_calls").is_none()
}

/// A message's content as a chat takes it: a text, or its text parts (`input_text`,
/// `output_text`) as the chat's `text` parts, which the chat path joins, or hands to a
/// template that loops over them, as it does its own.
fn chat_content(content: Option<&Value>, param: &str) -> Result<Value, ApiError> {
    match content {
        Some(Value::String(s)) => Ok(json!(s)),
        Some(Value::Array(parts)) => parts
            .iter()
            .map(|p| {
                match (
                    p.get("type").and_then(Value::as_str),
                    p.get("text").and_then(Value::as_str),
                ) {
                    (Some("input_text" | "output_text" | "text"), Some(t)) => {
                        Ok(json!({"type": "text", "text": t}))
                    }
                    (kind, _) => Err(bad(
                        param,
                        format!(
                            "only text content parts are supported, not {}",
                            kind.unwrap_or("a part without a type")
                        ),
                    )),
                }
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Value::Array),
        None | Some(Value::Null) => Ok(json!("")),
        Some(_) => Err(bad(param, "content must be a string or a list of parts")),
    }
}

/// `text.format` as a chat's `response_format` (none for plain text).
fn response_format(text: &Value) -> Result<Option<Value>, ApiError> {
    let Some(text) = text.as_object() else {
        return Err(bad("text", "text must be an object"));
    };
    // `verbosity` at OpenAI's default asks for nothing.
    let no_op = |k: &str, v: &Value| k == "format" || (k == "verbosity" && v == "medium");
    if let Some((key, _)) = text.iter().find(|(k, v)| !v.is_null() && !no_op(k, v)) {
        return Err(bad("text", format!("text.{key} is not supported")));
    }
    let Some(format) = text.get("format").filter(|f| !f.is_null()) else {
        return Ok(None);
    };
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json!({"type": "json_object"}))),
        Some("json_schema") => {
            let mut schema = format.clone();
            let object = schema.as_object_mut().expect("an object: it has a type");
            object.remove("type");
            Ok(Some(json!({"type": "json_schema", "json_schema": schema})))
        }
        _ => Err(bad(
            "text",
            "text.format.type must be text, json_object or json_schema",
        )),
    }
}

/// Function tools (`{"type": "function", "name", "description", "parameters", "strict"}`)
/// as a chat's (`{"type": "function", "function": {…}}`).
fn chat_tools(tools: &Value) -> Result<Value, ApiError> {
    let Some(tools) = tools.as_array() else {
        return Err(bad("tools", "tools must be a list"));
    };
    tools
        .iter()
        .map(|t| {
            if t.get("type").and_then(Value::as_str) != Some("function") {
                return Err(bad(
                    "tools",
                    format!(
                        "only function tools are supported, not {}",
                        t.get("type").unwrap_or(&Value::Null)
                    ),
                ));
            }
            let mut function = t.as_object().cloned().unwrap_or_default();
            function.remove("type");
            Ok(json!({"type": "function", "function": function}))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Value::Array)
}

/// `tool_choice` as a chat's: the same words, or a named function.
fn chat_tool_choice(choice: &Value) -> Result<Value, ApiError> {
    match choice {
        Value::String(s) if ["auto", "none", "required"].contains(&s.as_str()) => {
            Ok(choice.clone())
        }
        Value::Object(o) if o.get("type").and_then(Value::as_str) == Some("function") => {
            match o.get("name").and_then(Value::as_str) {
                Some(name) => Ok(json!({"type": "function", "function": {"name": name}})),
                None => Err(bad("tool_choice", "a function tool choice needs a name")),
            }
        }
        _ => Err(bad(
            "tool_choice",
            "tool_choice must be auto, none, required or {\"type\": \"function\", \"name\": …}",
        )),
    }
}

/// How many of the logprob `entries`, in the order given, have tokens whose text makes at
/// most `bytes` bytes.
fn covering<'a>(entries: impl Iterator<Item = &'a Value>, bytes: usize) -> usize {
    let mut covered = 0;
    entries
        .take_while(|entry| {
            covered += entry["bytes"].as_array().map_or(0, Vec::len);
            covered <= bytes
        })
        .count()
}

/// Where the reasoning item is in `output`: first, as thinking comes before the answer.
const REASONING_INDEX: usize = 0;

/// One item of a response's `output`.
enum Item {
    /// A reasoning model's thinking (`--reasoning-parser`), before its answer.
    Reasoning,
    Message,
    /// A function call, by its place in [`Answer::calls`].
    Call(usize),
}

struct Call {
    id: String,
    call_id: String,
    name: String,
    arguments: String,
}

/// A response as the chat's chunks build it: its events as they come, and the whole.
struct Answer {
    /// What every id of the response ends with.
    suffix: String,
    created_at: u64,
    model: String,
    echo: Map<String, Value>,
    output: Vec<Item>,
    /// The output is a reasoning model's, which thinks before it answers: until the answer
    /// begins, the tokens' logprobs are its thinking's, which OpenAI does not give.
    thinking: bool,
    reasoning: String,
    /// The reasoning item is open (its text may grow).
    reasoning_open: bool,
    /// The message is open (its text may grow).
    message_open: bool,
    text: String,
    logprobs: Vec<Value>,
    /// Logprobs of tokens whose text has not been sent yet.
    pending_logprobs: Vec<Value>,
    calls: Vec<Call>,
    /// The chat's finish reason.
    finish: Option<String>,
    usage: Option<Value>,
    /// Why the response failed, as OpenAI's `error` object (`code`, `message`).
    error: Option<Value>,
    /// Items of `output` done (they close in order): on a failure, the rest are cut short.
    items_done: usize,
    sequence: u64,
}

impl Answer {
    fn new(
        suffix: &str,
        created_at: u64,
        model: &str,
        echo: Map<String, Value>,
        thinking: bool,
    ) -> Self {
        Answer {
            suffix: suffix.to_string(),
            created_at,
            model: model.to_string(),
            echo,
            output: Vec::new(),
            thinking,
            reasoning: String::new(),
            reasoning_open: false,
            message_open: false,
            text: String::new(),
            logprobs: Vec::new(),
            pending_logprobs: Vec::new(),
            calls: Vec::new(),
            finish: None,
            usage: None,
            error: None,
            items_done: 0,
            sequence: 0,
        }
    }

    fn message_id(&self) -> String {
        format!("msg_{}", self.suffix)
    }

    fn reasoning_id(&self) -> String {
        format!("rs_{}", self.suffix)
    }

    /// The reasoning item, as OpenAI's open-weight models' (its text in `content`, no
    /// summary).
    fn reasoning_item(&self, status: &str) -> Value {
        // Cut at `max_output_tokens` before the answer began: the thinking was cut.
        let status = match status {
            "completed" if self.thinking && self.finish.as_deref() == Some("length") => {
                "incomplete"
            }
            _ => status,
        };
        let content = if status == "in_progress" {
            json!([])
        } else {
            json!([{"type": "reasoning_text", "text": self.reasoning}])
        };
        json!({"type": "reasoning", "id": self.reasoning_id(), "summary": [], "content": content,
               "encrypted_content": null, "status": status})
    }

    fn open_reasoning(&mut self) -> Vec<Value> {
        self.reasoning_open = true;
        self.output.push(Item::Reasoning);
        // The chat's thinking comes before its answer: nothing is in the output yet.
        debug_assert_eq!(self.output.len() - 1, REASONING_INDEX);
        let (index, id) = (REASONING_INDEX, self.reasoning_id());
        let item = self.reasoning_item("in_progress");
        vec![
            self.event(
                "response.output_item.added",
                json!({"output_index": index, "item": item}),
            ),
            self.event(
                "response.content_part.added",
                json!({"output_index": index, "item_id": id, "content_index": 0,
                       "part": {"type": "reasoning_text", "text": ""}}),
            ),
        ]
    }

    fn close_reasoning(&mut self) -> Vec<Value> {
        self.reasoning_open = false;
        self.items_done += 1;
        let id = self.reasoning_id();
        let part = json!({"type": "reasoning_text", "text": self.reasoning});
        let item = self.reasoning_item("completed");
        vec![
            self.event(
                "response.reasoning_text.done",
                json!({"output_index": REASONING_INDEX, "item_id": id, "content_index": 0,
                       "text": self.reasoning}),
            ),
            self.event(
                "response.content_part.done",
                json!({"output_index": REASONING_INDEX, "item_id": id, "content_index": 0, "part": part}),
            ),
            self.event(
                "response.output_item.done",
                json!({"output_index": REASONING_INDEX, "item": item}),
            ),
        ]
    }

    /// An event of `kind` with `fields`, numbered.
    fn event(&mut self, kind: &str, fields: Value) -> Value {
        let mut e = json!({"type": kind, "sequence_number": self.sequence});
        self.sequence += 1;
        if let (Some(e), Value::Object(fields)) = (e.as_object_mut(), fields) {
            e.extend(fields);
        }
        e
    }

    /// The events that open a stream: the response created, and in progress.
    fn opening(&mut self) -> Vec<Value> {
        let response = self.response("in_progress");
        vec![
            self.event("response.created", json!({"response": response.clone()})),
            self.event("response.in_progress", json!({"response": response})),
        ]
    }

    fn message_index(&self) -> usize {
        self.output
            .iter()
            .position(|i| matches!(i, Item::Message))
            .expect("the message is open")
    }

    /// The message's text (`logprobs` empty unless asked, as OpenAI's).
    fn part(&self) -> Value {
        json!({"type": "output_text", "text": self.text, "annotations": [],
               "logprobs": self.logprobs})
    }

    /// The message item; a finished one cut at `max_output_tokens` is `incomplete`, as
    /// OpenAI marks it (sent back as input, it is continued).
    fn message_item(&self, status: &str) -> Value {
        let status = match status {
            "completed" if self.finish.as_deref() == Some("length") => "incomplete",
            _ => status,
        };
        let content = if status == "in_progress" {
            json!([])
        } else {
            json!([self.part()])
        };
        json!({"type": "message", "id": self.message_id(), "status": status, "role": "assistant",
               "content": content})
    }

    /// A function call item; one cut at `max_output_tokens` is `incomplete` (its
    /// arguments may not parse), as the message is.
    fn call_item(&self, index: usize, status: &str) -> Value {
        let status = match status {
            "completed" if self.finish.as_deref() == Some("length") => "incomplete",
            _ => status,
        };
        let c = &self.calls[index];
        json!({"type": "function_call", "id": c.id, "call_id": c.call_id, "name": c.name,
               "arguments": if status == "in_progress" { "" } else { c.arguments.as_str() },
               "status": status})
    }

    fn open_message(&mut self) -> Vec<Value> {
        self.message_open = true;
        self.output.push(Item::Message);
        let (index, id) = (self.output.len() - 1, self.message_id());
        let item = self.message_item("in_progress");
        vec![
            self.event(
                "response.output_item.added",
                json!({"output_index": index, "item": item}),
            ),
            self.event(
                "response.content_part.added",
                json!({"output_index": index, "item_id": id, "content_index": 0,
                       "part": {"type": "output_text", "text": "", "annotations": [],
                                "logprobs": []}}),
            ),
        ]
    }

    fn close_message(&mut self) -> Vec<Value> {
        self.message_open = false;
        self.items_done += 1;
        let (index, id) = (self.message_index(), self.message_id());
        self.logprobs.append(&mut self.pending_logprobs);
        let part = self.part();
        let item = self.message_item("completed");
        let done = json!({"output_index": index, "item_id": id, "content_index": 0,
                          "text": self.text, "logprobs": self.logprobs});
        vec![
            self.event("response.output_text.done", done),
            self.event(
                "response.content_part.done",
                json!({"output_index": index, "item_id": id, "content_index": 0, "part": part}),
            ),
            self.event(
                "response.output_item.done",
                json!({"output_index": index, "item": item}),
            ),
        ]
    }

    /// A chat chunk: its text, its tool calls, its finish and its usage; the events that
    /// tell them.
    fn take(&mut self, chunk: &Value) -> Vec<Value> {
        let mut events = Vec::new();
        if let Some(usage) = chunk.get("usage").filter(|u| !u.is_null()) {
            self.usage = Some(usage.clone());
        }
        let Some(choice) = chunk["choices"].get(0) else {
            return events;
        };
        if let Some(entries) = choice["logprobs"]["content"].as_array() {
            self.pending_logprobs.extend(entries.iter().cloned());
        }
        let delta = &choice["delta"];
        let text = delta["content"].as_str().unwrap_or_default();
        let calls = delta["tool_calls"].as_array().filter(|c| !c.is_empty());
        let thought = delta["reasoning"].as_str().unwrap_or_default();
        if !thought.is_empty() {
            if !self.reasoning_open {
                events.extend(self.open_reasoning());
            }
            self.reasoning.push_str(thought);
            let id = self.reasoning_id();
            events.push(self.event(
                "response.reasoning_text.delta",
                json!({"output_index": REASONING_INDEX, "item_id": id, "content_index": 0, "delta": thought}),
            ));
        }
        if self.thinking {
            // The thinking's tokens (`</think>` with them) have no logprobs here. The chat's
            // answer begins with a chunk that has a content (if only empty) or calls: of its
            // logprobs, the last ones, those its text's bytes cover, are the answer's.
            let answering = delta["content"].is_string() || calls.is_some();
            let kept = if answering {
                self.pending_covering_last(text.len())
            } else {
                Vec::new()
            };
            self.pending_logprobs = kept;
            if answering {
                self.thinking = false;
                if self.reasoning_open {
                    events.extend(self.close_reasoning());
                }
            }
        }
        if !text.is_empty() {
            if !self.message_open {
                events.extend(self.open_message());
            }
            self.text.push_str(text);
            // Beside calls, the tokens held back were the text's and then the calls'
            // markup: the text takes those its bytes cover.
            let logprobs = match calls {
                None => std::mem::take(&mut self.pending_logprobs),
                Some(_) => self.pending_covering(text.len()),
            };
            self.logprobs.extend(logprobs.iter().cloned());
            let (index, id) = (self.message_index(), self.message_id());
            events.push(self.event(
                "response.output_text.delta",
                json!({"output_index": index, "item_id": id, "content_index": 0,
                       "delta": text, "logprobs": logprobs}),
            ));
        }
        for call in calls.into_iter().flatten() {
            let at = call["index"].as_u64().unwrap_or(0) as usize;
            if at >= self.calls.len() {
                // Calls follow the message: it is whole once they begin, and the tokens
                // still without text were the calls'. Each call is whole once the next
                // begins.
                self.pending_logprobs.clear();
                if self.message_open {
                    events.extend(self.close_message());
                }
                if let Some(previous) = self.calls.len().checked_sub(1) {
                    events.extend(self.close_call(previous));
                }
                let call_id = call["id"].as_str().unwrap_or_default().to_string();
                self.calls.push(Call {
                    id: format!("fc_{}_{}", self.suffix, self.calls.len()),
                    call_id,
                    name: call["function"]["name"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string(),
                    arguments: String::new(),
                });
                let index = self.calls.len() - 1;
                self.output.push(Item::Call(index));
                let item = self.call_item(index, "in_progress");
                let output_index = self.output.len() - 1;
                events.push(self.event(
                    "response.output_item.added",
                    json!({"output_index": output_index, "item": item}),
                ));
            }
            let piece = call["function"]["arguments"].as_str().unwrap_or_default();
            if !piece.is_empty() {
                let index = at.min(self.calls.len() - 1);
                self.calls[index].arguments.push_str(piece);
                let output_index = self.output_index_of_call(index);
                let id = self.calls[index].id.clone();
                events.push(self.event(
                    "response.function_call_arguments.delta",
                    json!({"output_index": output_index, "item_id": id, "delta": piece}),
                ));
            }
        }
        if let Some(reason) = choice["finish_reason"].as_str() {
            self.finish = Some(reason.to_string());
        }
        events
    }

    /// The pending logprobs of the tokens whose text makes the next `bytes` bytes.
    fn pending_covering(&mut self, bytes: usize) -> Vec<Value> {
        let count = covering(self.pending_logprobs.iter(), bytes);
        self.pending_logprobs.drain(..count).collect()
    }

    /// The last pending logprobs whose tokens' text makes the last `bytes` bytes.
    fn pending_covering_last(&mut self, bytes: usize) -> Vec<Value> {
        let count = covering(self.pending_logprobs.iter().rev(), bytes);
        let from = self.pending_logprobs.len() - count;
        self.pending_logprobs.split_off(from)
    }

    fn close_call(&mut self, index: usize) -> Vec<Value> {
        self.items_done += 1;
        let output_index = self.output_index_of_call(index);
        let c = &self.calls[index];
        let done = json!({"output_index": output_index, "item_id": c.id,
                          "name": c.name, "arguments": c.arguments});
        let item = self.call_item(index, "completed");
        vec![
            self.event("response.function_call_arguments.done", done),
            self.event(
                "response.output_item.done",
                json!({"output_index": output_index, "item": item}),
            ),
        ]
    }

    /// The response failed (`e`): OpenAI's `error` event, then `response.failed`.
    fn fail(&mut self, e: &ApiError) -> Vec<Value> {
        // OpenAI's codes: the server's failure, or the request's.
        let code = if e.status.is_server_error() {
            "server_error"
        } else {
            "invalid_prompt"
        };
        self.error = Some(json!({"code": code, "message": e.message}));
        let mut error = json!({"code": code, "message": e.message, "param": e.param});
        // The openai SDK raises on an event's `error` field: the whole error object, there.
        error["error"] = e.body()["error"].clone();
        let response = self.response("failed");
        vec![
            self.event("error", error),
            self.event("response.failed", json!({"response": response})),
        ]
    }

    fn output_index_of_call(&self, index: usize) -> usize {
        self.output
            .iter()
            .position(|i| matches!(i, Item::Call(c) if *c == index))
            .expect("every call is in the output")
    }

    /// The chat has ended: the items are closed (an answer with neither text nor calls is
    /// an empty message), and the response is whole.
    fn end(&mut self) -> Vec<Value> {
        let mut events = Vec::new();
        if self.reasoning_open {
            events.extend(self.close_reasoning());
        }
        // An answer of no text, no calls and no thinking is an empty message (one cut while
        // thinking is its reasoning alone, as vLLM answers it).
        if self.output.is_empty() {
            events.extend(self.open_message());
        }
        if self.message_open {
            events.extend(self.close_message());
        }
        if let Some(last) = self.calls.len().checked_sub(1) {
            events.extend(self.close_call(last));
        }
        let response = self.response("completed");
        let status = response["status"]
            .as_str()
            .unwrap_or("completed")
            .to_string();
        // OpenAI's last event names how the response ended.
        events.push(self.event(&format!("response.{status}"), json!({"response": response})));
        events
    }

    /// The response object: `in_progress` while it runs, `failed`, else `completed`, or
    /// `incomplete` where the output reached `max_output_tokens`.
    fn response(&self, running: &str) -> Value {
        let length = self.finish.as_deref() == Some("length");
        let (status, incomplete) = match running {
            "in_progress" => ("in_progress", Value::Null),
            "failed" => ("failed", Value::Null),
            _ if length => ("incomplete", json!({"reason": "max_output_tokens"})),
            _ => ("completed", Value::Null),
        };
        let output: Vec<Value> = if running == "in_progress" {
            Vec::new()
        } else {
            self.output
                .iter()
                .enumerate()
                .map(|(at, item)| {
                    // A failure cuts short the items not yet done.
                    let status = match running {
                        "failed" if at >= self.items_done => "incomplete",
                        _ => "completed",
                    };
                    match item {
                        Item::Reasoning => self.reasoning_item(status),
                        Item::Message => self.message_item(status),
                        Item::Call(i) => self.call_item(*i, status),
                    }
                })
                .collect()
        };
        let usage = self.usage.as_ref().map(|u| {
            json!({
                "input_tokens": u["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"],
                                         "cache_write_tokens": 0},
                "output_tokens": u["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens":
                    u["completion_tokens_details"]["reasoning_tokens"].as_u64().unwrap_or(0)},
                "total_tokens": u["total_tokens"],
            })
        });
        let mut r = json!({
            "id": format!("resp_{}", self.suffix), "object": "response",
            "created_at": self.created_at, "status": status, "error": self.error,
            "incomplete_details": incomplete, "model": self.model, "output": output,
            "usage": usage,
        });
        let object = r.as_object_mut().expect("an object");
        for (k, v) in &self.echo {
            object.insert(k.clone(), v.clone());
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(body: Value) -> Result<ResponsesRequest, ApiError> {
        read_request(body.as_object().unwrap(), &Map::new())
    }

    #[test]
    fn instructions_and_input_become_the_chat_messages() {
        let r =
            request(json!({"instructions": "Be brief.", "input": "Hi", "max_output_tokens": 7}))
                .unwrap();
        assert_eq!(
            r.chat["messages"],
            json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
        );
        assert_eq!(r.chat["max_tokens"], json!(7));
        assert_eq!(r.chat["stream"], json!(true));
        assert_eq!(r.echo["max_output_tokens"], json!(7));
        assert_eq!(r.echo["store"], json!(false));
        assert_eq!(r.echo["temperature"], json!(1.0));
        assert!(!r.stream);

        let r = request(json!({"input": [
            {"role": "developer", "content": "Rules."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                            {"type": "input_text", "text": "b"}]},
            {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "call_2", "name": "g", "arguments": "{\"x\":1}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "42"},
        ]}))
        .unwrap();
        assert_eq!(
            r.chat["messages"],
            json!([
                {"role": "system", "content": "Rules."},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                    {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": "{\"x\":1}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "42"},
            ])
        );
        assert!(r.chat.get("continue_final_message").is_none());

        // An assistant message still in progress is continued, not answered.
        let r = request(json!({"input": [{"role": "user", "content": "Count"},
            {"role": "assistant", "content": [{"type": "output_text", "text": "1, 2,"}],
             "status": "in_progress"}]}))
        .unwrap();
        assert_eq!(r.chat["continue_final_message"], json!(true));
        assert_eq!(r.chat["add_generation_prompt"], json!(false));
    }

    #[test]
    fn tools_formats_and_logprobs_are_read_as_a_chat_reads_them() {
        let r = request(json!({"input": "x", "stream": true,
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": true}],
            "tool_choice": {"type": "function", "name": "f"},
            "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}}},
            "include": [OUTPUT_LOGPROBS], "top_logprobs": 3,
            "reasoning": {"effort": "low"}, "seed": 5, "ignore_eos": true}))
        .unwrap();
        assert!(r.stream);
        assert_eq!(
            r.chat["tools"],
            json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": true}}])
        );
        assert_eq!(
            r.chat["tool_choice"],
            json!({"type": "function", "function": {"name": "f"}})
        );
        assert_eq!(
            r.chat["response_format"],
            json!({"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}})
        );
        assert_eq!(
            (&r.chat["logprobs"], &r.chat["top_logprobs"]),
            (&json!(true), &json!(3))
        );
        assert_eq!(
            r.chat["chat_template_kwargs"],
            json!({"reasoning_effort": "low"})
        );
        assert_eq!(
            (&r.chat["seed"], &r.chat["ignore_eos"]),
            (&json!(5), &json!(true))
        );
        // The response repeats the tools as they were sent.
        assert_eq!(r.echo["tools"][0]["name"], json!("f"));

        // "auto" truncation: vLLM's, the prompt cut to leave the output its room.
        let r = request(json!({"input": "x", "truncation": "auto"})).unwrap();
        assert_eq!(r.chat["truncate_prompt_tokens"], json!(-1));
        assert_eq!(r.echo["truncation"], json!("auto"));

        // Without `include`, top_logprobs asks for nothing (OpenAI's rule).
        let r = request(json!({"input": "x", "top_logprobs": 3})).unwrap();
        assert!(r.chat.get("logprobs").is_none());
    }

    #[test]
    fn what_it_cannot_honour_is_refused_naming_the_field() {
        for (body, param, status) in [
            (
                json!({"input": "x", "previous_response_id": "resp_1"}),
                "previous_response_id",
                404,
            ),
            (json!({"input": "x", "background": true}), "background", 400),
            (
                json!({"input": "x", "truncation": "left"}),
                "truncation",
                400,
            ),
            (
                json!({"input": "x", "include": ["file_search_call.results"]}),
                "include",
                400,
            ),
            (
                json!({"input": "x", "tools": [{"type": "web_search"}]}),
                "tools",
                400,
            ),
            (json!({"input": "x", "prompt": {"id": "p"}}), "prompt", 400),
            (
                json!({"input": "x", "conversation": "c"}),
                "conversation",
                400,
            ),
            (
                json!({"input": "x", "reasoning": {"summary": "auto"}}),
                "reasoning",
                400,
            ),
            (
                json!({"input": "x", "text": {"verbosity": "low"}}),
                "text",
                400,
            ),
            (
                json!({"input": "x", "stream_options": {}}),
                "stream_options",
                400,
            ),
            (json!({"input": "x", "n": 2}), "n", 400),
            (
                json!({"input": [{"type": "input_image", "image_url": "u"}]}),
                "input[0]",
                400,
            ),
            (
                json!({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}),
                "input[0]",
                400,
            ),
            (json!({"input": []}), "input", 400),
            (
                json!({"input": "x", "top_logprobs": 21}),
                "top_logprobs",
                400,
            ),
            (
                json!({"input": "x", "service_tier": "priority"}),
                "service_tier",
                400,
            ),
            (
                json!({"input": "x", "stream": true, "stream_options": "x"}),
                "stream_options",
                400,
            ),
            (json!({"input": [{"role": "user"}]}), "input[0]", 400),
            (
                json!({"input": [{"type": "function_call_output", "call_id": "c"}]}),
                "input[0]",
                400,
            ),
            (json!({}), "input", 400),
        ] {
            let e = request(body.clone()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {e:?}");
            assert_eq!(e.status.as_u16(), status, "{body}");
        }
        // Accepted and answered truthfully: nothing is stored.
        let r = request(json!({"input": "x", "store": true, "background": false,
                               "truncation": "disabled", "stream": true,
                               "text": {"format": {"type": "text"}, "verbosity": "medium"},
                               "service_tier": "default",
                               "stream_options": {"include_obfuscation": false}}))
        .unwrap();
        assert_eq!(r.echo["store"], json!(false));
    }

    fn chat_chunk(delta: Value, logprobs: Value, finish: Value) -> Value {
        json!({"choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]})
    }

    fn usage_chunk() -> Value {
        json!({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                                         "prompt_tokens_details": {"cached_tokens": 2}}})
    }

    /// Every event a stream of `chunks` sends, and the response a whole answer gives.
    fn told(chunks: &[Value]) -> (Vec<Value>, Value) {
        told_of(chunks, false)
    }

    /// [`told`] of a reasoning model's chunks (`thinking`), or not.
    fn told_of(chunks: &[Value], thinking: bool) -> (Vec<Value>, Value) {
        let echo = request(json!({"input": "x"})).unwrap().echo;
        let mut a = Answer::new("ab12", 9, "m", echo.clone(), thinking);
        let mut events = a.opening();
        for c in chunks {
            events.extend(a.take(c));
        }
        events.extend(a.end());
        let mut whole = Answer::new("ab12", 9, "m", echo, thinking);
        for c in chunks {
            whole.take(c);
        }
        // As a whole answer is given: the last event's response.
        let mut last = whole.end().pop().unwrap();
        (events, last["response"].take())
    }

    #[test]
    fn a_text_answer_is_told_as_openai_streams_it_and_adds_up_to_the_whole() {
        let (events, whole) = told(&[
            chat_chunk(
                json!({"role": "assistant", "content": "Hel"}),
                Value::Null,
                Value::Null,
            ),
            chat_chunk(json!({"content": ""}), Value::Null, Value::Null),
            chat_chunk(json!({"content": "lo"}), Value::Null, json!("length")),
            usage_chunk(),
        ]);
        let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
        assert_eq!(
            kinds,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.incomplete",
            ]
        );
        let numbers: Vec<u64> = events
            .iter()
            .map(|e| e["sequence_number"].as_u64().unwrap())
            .collect();
        assert_eq!(numbers, (0..events.len() as u64).collect::<Vec<_>>());
        let deltas: String = events
            .iter()
            .filter(|e| e["type"] == "response.output_text.delta")
            .map(|e| e["delta"].as_str().unwrap())
            .collect();
        assert_eq!(deltas, "Hello");
        assert_eq!(events[0]["response"]["status"], "in_progress");
        assert_eq!(events.last().unwrap()["response"], whole);
        assert_eq!(whole["status"], "incomplete");
        assert_eq!(
            whole["incomplete_details"],
            json!({"reason": "max_output_tokens"})
        );
        assert_eq!(whole["id"], "resp_ab12");
        assert_eq!(whole["output"][0]["id"], "msg_ab12");
        assert_eq!(whole["output"][0]["content"][0]["text"], "Hello");
        assert_eq!(
            whole["usage"],
            json!({"input_tokens": 5, "input_tokens_details": {"cached_tokens": 2, "cache_write_tokens": 0},
                   "output_tokens": 3, "output_tokens_details": {"reasoning_tokens": 0},
                   "total_tokens": 8})
        );
    }

    #[test]
    fn a_reasoning_models_thinking_is_a_reasoning_item_before_the_message() {
        let entry = |t: &str| json!({"token": t, "logprob": -0.5, "bytes": t.as_bytes(), "top_logprobs": []});
        let (events, whole) = told_of(
            &[
                chat_chunk(
                    json!({"role": "assistant", "reasoning": "Hm,"}),
                    json!({"content": [entry("Hm,")]}),
                    Value::Null,
                ),
                chat_chunk(json!({"reasoning": " yes."}), Value::Null, Value::Null),
                // `</think>` alone, then the answer.
                chat_chunk(
                    json!({"content": ""}),
                    json!({"content": [entry("</think>")]}),
                    Value::Null,
                ),
                chat_chunk(
                    json!({"content": "Oslo"}),
                    json!({"content": [entry("Oslo")]}),
                    json!("stop"),
                ),
                json!({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9,
                       "prompt_tokens_details": {"cached_tokens": 0},
                       "completion_tokens_details": {"reasoning_tokens": 3}}}),
            ],
            true,
        );
        let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
        assert_eq!(
            kinds,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.reasoning_text.delta",
                "response.reasoning_text.delta",
                "response.reasoning_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        assert_eq!(events.last().unwrap()["response"], whole);
        assert_eq!(
            whole["output"][0],
            json!({"type": "reasoning", "id": "rs_ab12", "summary": [],
                   "content": [{"type": "reasoning_text", "text": "Hm, yes."}],
                   "encrypted_content": null, "status": "completed"})
        );
        assert_eq!(events[6]["text"], "Hm, yes.");
        assert_eq!(whole["output"][1]["content"][0]["text"], "Oslo");
        // The answer's logprobs alone: the thinking's, `</think>`'s included, are not given.
        assert_eq!(
            whole["output"][1]["content"][0]["logprobs"],
            json!([entry("Oslo")])
        );
        assert_eq!(
            whole["usage"]["output_tokens_details"],
            json!({"reasoning_tokens": 3})
        );
        // Cut while thinking: the reasoning alone, incomplete as the response is.
        let (_, cut) = told_of(
            &[chat_chunk(
                json!({"role": "assistant", "reasoning": "Hm"}),
                Value::Null,
                json!("length"),
            )],
            true,
        );
        assert_eq!(cut["status"], "incomplete");
        assert_eq!(cut["output"].as_array().unwrap().len(), 1);
        assert_eq!(cut["output"][0]["type"], "reasoning");
        assert_eq!(cut["output"][0]["status"], "incomplete");
        // Cut right after `</think>`: the thinking was whole.
        let (_, cut) = told_of(
            &[
                chat_chunk(
                    json!({"role": "assistant", "reasoning": "Hm"}),
                    Value::Null,
                    Value::Null,
                ),
                chat_chunk(json!({"content": ""}), Value::Null, json!("length")),
            ],
            true,
        );
        assert_eq!(cut["output"][0]["status"], "completed");
        // An answer held back (an auto tool parser's, where a call may begin) keeps the
        // logprobs of its tokens, which came with empty chunks after the thinking's end.
        let (_, held) = told_of(
            &[
                chat_chunk(
                    json!({"role": "assistant", "reasoning": "Hm"}),
                    json!({"content": [entry("Hm")]}),
                    Value::Null,
                ),
                chat_chunk(
                    json!({"content": ""}),
                    json!({"content": [entry("</think>")]}),
                    Value::Null,
                ),
                chat_chunk(
                    json!({"content": ""}),
                    json!({"content": [entry("<")]}),
                    Value::Null,
                ),
                chat_chunk(
                    json!({"content": "<b"}),
                    json!({"content": [entry("b")]}),
                    json!("stop"),
                ),
            ],
            true,
        );
        assert_eq!(
            held["output"][1]["content"][0]["logprobs"],
            json!([entry("<"), entry("b")])
        );
    }

    #[test]
    fn tool_calls_become_function_call_items_after_the_message() {
        let (events, whole) = told(&[
            chat_chunk(
                json!({"role": "assistant", "content": "Let me check."}),
                Value::Null,
                Value::Null,
            ),
            chat_chunk(
                json!({"tool_calls": [
                    {"index": 0, "id": "call_a", "type": "function", "function": {"name": "f", "arguments": "{\"x\":"}}]}),
                Value::Null,
                Value::Null,
            ),
            chat_chunk(
                json!({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}},
                    {"index": 1, "id": "call_b", "type": "function", "function": {"name": "g", "arguments": "{}"}}]}),
                Value::Null,
                json!("tool_calls"),
            ),
            usage_chunk(),
        ]);
        assert_eq!(whole["status"], "completed");
        let output = whole["output"].as_array().unwrap();
        assert_eq!(output.len(), 3);
        assert_eq!(output[0]["content"][0]["text"], "Let me check.");
        assert_eq!(
            output[1],
            json!({"type": "function_call", "id": "fc_ab12_0", "call_id": "call_a", "name": "f",
                   "arguments": "{\"x\":1}", "status": "completed"})
        );
        assert_eq!(output[2]["call_id"], "call_b");
        let at = |kind: &str, index: u64| {
            events
                .iter()
                .position(|e| e["type"] == kind && e["output_index"] == index)
                .unwrap()
        };
        // The message is done before the first call is added, each call before the next.
        assert!(at("response.output_item.done", 0) < at("response.output_item.added", 1));
        assert!(at("response.output_item.done", 1) < at("response.output_item.added", 2));
        let arguments: String = events
            .iter()
            .filter(|e| {
                e["type"] == "response.function_call_arguments.delta" && e["output_index"] == 1
            })
            .map(|e| e["delta"].as_str().unwrap())
            .collect();
        assert_eq!(arguments, "{\"x\":1}");
        assert_eq!(events.last().unwrap()["type"], "response.completed");
    }

    #[test]
    fn logprobs_go_with_the_text_they_belong_to() {
        let entry = |t: &str| json!({"token": t, "logprob": -0.5, "bytes": t.as_bytes(), "top_logprobs": []});
        // The first token's text is held back (half a character): its logprob waits for it.
        let (events, whole) = told(&[
            chat_chunk(
                json!({"role": "assistant", "content": ""}),
                json!({"content": [entry("\u{fffd}")]}),
                Value::Null,
            ),
            chat_chunk(
                json!({"content": "é!"}),
                json!({"content": [entry("!")]}),
                json!("stop"),
            ),
            usage_chunk(),
        ]);
        let delta = events
            .iter()
            .find(|e| e["type"] == "response.output_text.delta")
            .unwrap();
        assert_eq!(delta["logprobs"].as_array().unwrap().len(), 2);
        assert_eq!(
            whole["output"][0]["content"][0]["logprobs"]
                .as_array()
                .unwrap()
                .len(),
            2
        );
        // No text and no calls: an empty message, as OpenAI answers.
        let (_, whole) = told(&[
            chat_chunk(json!({"content": ""}), Value::Null, json!("stop")),
            usage_chunk(),
        ]);
        assert_eq!(whole["output"][0]["content"][0]["text"], "");
    }

    #[test]
    fn a_cut_call_is_incomplete_and_its_markup_has_no_text_logprobs() {
        let entry = |t: &str| json!({"token": t, "logprob": -0.5, "bytes": t.as_bytes(), "top_logprobs": []});
        // "Hi" was held back with the call's markup; it comes out beside the call.
        let (events, whole) = told(&[
            chat_chunk(
                json!({"role": "assistant", "content": ""}),
                json!({"content": [entry("Hi")]}),
                Value::Null,
            ),
            chat_chunk(
                json!({"content": ""}),
                json!({"content": [entry("<tool_call>")]}),
                Value::Null,
            ),
            chat_chunk(
                json!({"content": "Hi", "tool_calls": [{"index": 0, "id": "c", "function": {"name": "f", "arguments": "{\"x"}}]}),
                json!({"content": [entry("{\"x")]}),
                json!("length"),
            ),
            usage_chunk(),
        ]);
        let text_logprobs = &whole["output"][0]["content"][0]["logprobs"];
        assert_eq!(
            text_logprobs.as_array().unwrap().len(),
            1,
            "{text_logprobs}"
        );
        assert_eq!(text_logprobs[0]["token"], "Hi");
        assert_eq!(whole["output"][1]["status"], "incomplete");
        assert_eq!(whole["status"], "incomplete");
        assert_eq!(events.last().unwrap()["type"], "response.incomplete");
    }

    #[test]
    fn a_failure_is_an_error_event_then_response_failed() {
        let echo = request(json!({"input": "x"})).unwrap().echo;
        let mut a = Answer::new("ab12", 9, "m", echo, false);
        a.opening();
        a.take(&chat_chunk(
            json!({"content": "Hi"}),
            Value::Null,
            Value::Null,
        ));
        // A grammar that failed is the request's error, in this API's names.
        let e = error_of(
            &json!({"message": "no way on", "type": "invalid_request_error",
                                 "param": "response_format", "code": 400}),
        );
        assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, Some("text")));
        let events = a.fail(&e);
        assert_eq!(events[0]["type"], "error");
        assert_eq!(events[0]["message"], "no way on");
        assert_eq!(events[0]["code"], "invalid_prompt");
        assert_eq!(events[0]["error"]["param"], "text");
        assert_eq!(events[1]["type"], "response.failed");
        assert_eq!(events[1]["response"]["status"], "failed");
        assert_eq!(events[1]["response"]["error"]["message"], "no way on");
        // The message was cut short: it is not done.
        assert_eq!(events[1]["response"]["output"][0]["status"], "incomplete");
    }
}
