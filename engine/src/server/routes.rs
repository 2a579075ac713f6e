//! The endpoints around generation: the model list, tokenizer endpoints, `/metrics`, and
//! what routers in front of replicas read (load, model and server info, KV-event sources,
//! prefix-cache reset, a health check through the whole generation path).

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::api::{self, ApiError, Endpoint, Prompt};
use super::completions::generate;
use super::engine_loop::Command;
use super::prompt::{body_or_error, off_thread, prompt_tokens};
use super::{AppState, LoadFormat, Shared};

fn model_card(s: &Shared) -> Value {
    json!({
        "id": s.model_name, "object": "model", "created": s.created, "owned_by": "infer",
        "root": s.root, "parent": null, "max_model_len": s.max_model_len,
    })
}

pub(super) async fn models(State(s): State<AppState>) -> Json<Value> {
    Json(json!({"object": "list", "data": [model_card(&s.inner)]}))
}

/// OpenAI's `GET /v1/models/{model}`: the served model's card, or 404.
pub(super) async fn model(
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    s.inner.check_model(&id)?;
    Ok(Json(model_card(&s.inner)))
}

/// vLLM's `GET /version`.
pub(super) async fn version() -> Json<Value> {
    Json(json!({"version": env!("CARGO_PKG_VERSION"), "engine": "infer"}))
}

/// vLLM's `/tokenizer_info`: the tokenizer's special tokens and chat template, so that a
/// client (lm-eval's remote tokenizer) tokenises as the server does without the files.
pub(super) async fn tokenizer_info(State(s): State<AppState>) -> Json<Value> {
    Json(s.inner.tokenizer.info(s.inner.max_model_len))
}

/// The replica's load as routers read it, at `/get_load` in the form `--get-load-format`
/// names (the two routers read incompatible ones; see [`LoadFormat`]). SGLang's newer
/// `/v1/loads` always has its own form.
pub(super) async fn get_load(State(s): State<AppState>) -> Json<Value> {
    match s.inner.load_format {
        LoadFormat::Vllm => loads(State(s)).await,
        LoadFormat::Sglang => {
            let (m, used_tokens) = load_now(&s.inner);
            // One entry per data-parallel rank, as SGLang's scheduler answers; `num_tokens`:
            // the KV tokens held, what sglang-router's power-of-two compares.
            Json(json!([{
                "dp_rank": 0, "num_reqs": m.num_running, "num_waiting_reqs": m.num_waiting,
                "num_tokens": used_tokens,
            }]))
        }
    }
}

/// The scheduler's counts now, and the KV tokens its used blocks hold.
fn load_now(s: &Shared) -> (infer_core::SchedulerStats, usize) {
    let metrics = s.metrics.lock().unwrap();
    let (m, block_size) = (metrics.sched, metrics.block_size);
    drop(metrics);
    (m, (m.num_blocks - m.num_free_blocks) * block_size)
}

/// `load` (requests running or waiting: vllm-router) beside SGLang's newer token load
/// (`loads[].num_total_tokens` per data-parallel rank and `aggregate.total_tokens`: here the
/// KV tokens held), at `/v1/loads` and, by default, `/get_load`.
pub(super) async fn loads(State(s): State<AppState>) -> Json<Value> {
    let (m, used_tokens) = load_now(&s.inner);
    Json(json!({
        "load": m.num_running + m.num_waiting,
        "num_reqs": m.num_running,
        "num_waiting_reqs": m.num_waiting,
        "kv_cache_usage": m.kv_usage,
        "loads": [{
            "dp_rank": 0, "num_reqs": m.num_running, "num_waiting_reqs": m.num_waiting,
            "num_used_tokens": used_tokens, "num_total_tokens": used_tokens,
        }],
        "aggregate": {"total_tokens": used_tokens},
    }))
}

pub(super) async fn get_model_info(State(s): State<AppState>) -> Json<Value> {
    let s = &s.inner;
    Json(json!({
        "model_path": s.root, "tokenizer_path": s.root, "served_model_name": s.model_name,
        "is_generation": true, "max_model_len": s.max_model_len,
    }))
}

pub(super) async fn get_server_info(State(s): State<AppState>) -> Json<Value> {
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
pub(super) async fn kv_event_sources(State(s): State<AppState>) -> Json<Value> {
    let Some(cfg) = &s.inner.kv_events else {
        return Json(json!({}));
    };
    Json(json!({"0": {
        "endpoint": cfg.endpoint, "replay_endpoint": null, "topic": cfg.topic,
        "publisher": "zmq", "enable_kv_cache_events": true,
    }}))
}

/// vLLM's `POST /reset_prefix_cache` (benchmarks call it between runs): 200 once the prefix
/// cache is empty, 409 while requests hold KV blocks.
pub(super) async fn reset_prefix_cache(State(s): State<AppState>) -> Response {
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
/// `/health`: 200 while the engine can compute, 503 with the reason once its device is lost.
pub(super) async fn health(State(s): State<AppState>) -> Response {
    match s.inner.health.lost() {
        None => StatusCode::OK.into_response(),
        Some(why) => (StatusCode::SERVICE_UNAVAILABLE, why.to_string()).into_response(),
    }
}

pub(super) async fn health_generate(State(s): State<AppState>) -> Response {
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

pub(super) async fn metrics_text(State(s): State<AppState>) -> Response {
    // Rendered from a copy: the engine loop takes the same lock every step.
    let snapshot = s.inner.metrics.lock().unwrap().clone();
    let text = snapshot.render();
    ([("content-type", "text/plain; version=0.0.4")], text).into_response()
}

pub(super) async fn tokenize(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body_or_error(body).await?;
    let req = api::parse_tokenize(&body)?;
    // Tokenising and writing a long answer both happen off the HTTP threads.
    off_thread(&state, req.prompt.bytes(), move |s| {
        let tokens = match &req.prompt {
            Prompt::Text(p) => s
                .tokenizer
                .encode(p, req.add_special_tokens)
                .map_err(|e| ApiError::internal(format!("{e:#}")))?,
            other => prompt_tokens(s, other, &req.template)?,
        };
        let mut body = json!({
            "tokens": tokens, "count": tokens.len(), "max_model_len": s.max_model_len,
        });
        if req.return_token_strs {
            let strs: Vec<Option<String>> =
                tokens.iter().map(|&t| s.tokenizer.token_str(t)).collect();
            body["token_strs"] = json!(strs);
        }
        Ok(([("content-type", "application/json")], body.to_string()).into_response())
    })
    .await?
}

pub(super) async fn detokenize(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let body = body_or_error(body).await?;
    let tokens = api::token_ids(body.get("tokens"), "tokens", state.inner.vocab_size)?;
    let text = off_thread(&state, 4 * tokens.len(), move |s| {
        s.tokenizer
            .decode(&tokens)
            .map_err(|e| ApiError::internal(format!("{e:#}")))
    })
    .await??;
    Ok(Json(json!({"prompt": text})))
}
