//! `engine bench` against a server that is not infer: a mock in the manner of
//! `transformers serve` (no `/metrics`, refuses fields it does not know with 422, counts
//! prompt tokens its own way).

use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use infer_engine::loadgen::{self, BenchOptions};
use serde_json::{json, Value};

/// Bodies the mock received.
type Seen = Arc<Mutex<Vec<Value>>>;

async fn mock(models_status: StatusCode) -> (String, Seen) {
    let seen: Seen = Arc::default();
    let log = seen.clone();
    let app = Router::new()
        .route(
            "/v1/models",
            get(move || async move {
                (
                    models_status,
                    Json(json!({"object": "list", "data": [{"id": "mock-model"}]})),
                )
            }),
        )
        .route(
            "/v1/completions",
            post(move |body: Bytes| {
                let log = log.clone();
                async move {
                    let v: Value = serde_json::from_slice(&body).unwrap();
                    log.lock().unwrap().push(v.clone());
                    completion(&v)
                }
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}"), seen)
}

fn completion(v: &Value) -> Response {
    let known = [
        "model",
        "prompt",
        "max_tokens",
        "temperature",
        "stream",
        "stream_options",
        // transformers serve takes it (and, on /v1/completions, ignores it).
        "logit_bias",
    ];
    if let Some(k) = v
        .as_object()
        .unwrap()
        .keys()
        .find(|k| !known.contains(&k.as_str()))
    {
        let detail = format!("Unexpected fields: {k}");
        return (
            StatusCode::UNPROCESSABLE_ENTITY,
            Json(json!({ "detail": detail })),
        )
            .into_response();
    }
    let n = v["max_tokens"].as_u64().unwrap();
    let prompt_tokens = v["prompt"].as_str().unwrap().split_whitespace().count();
    let mut out = String::new();
    for _ in 0..n {
        let chunk = json!({"choices": [{"index": 0, "text": " w", "finish_reason": null}]});
        out += &format!("data: {chunk}\n\n");
    }
    let usage =
        json!({"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n}});
    out += &format!("data: {usage}\n\ndata: [DONE]\n\n");
    ([("content-type", "text/event-stream")], out).into_response()
}

fn scenario() -> String {
    format!("{}/../scenarios/baseline.toml", env!("CARGO_MANIFEST_DIR"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_refuses_ignore_eos_is_benched_without_it_or_told_clearly() {
    let (base, seen) = mock(StatusCode::OK).await;
    let mut opts = BenchOptions::new(&base, scenario());
    opts.overrides = vec![
        "workload.num_requests=4".into(),
        "workload.warmup_requests=1".into(),
        "workload.output_tokens=5".into(),
        "workload.ignore_eos=false".into(),
    ];
    let r = loadgen::run(&opts).await.unwrap();
    assert_eq!((r.summary.completed, r.summary.failed), (4, 0));
    assert_eq!(r.summary.total_output_tokens, 20);
    assert!(r.server_counters.is_none(), "the mock has no /metrics");
    assert!(seen
        .lock()
        .unwrap()
        .iter()
        .all(|b| b.get("ignore_eos").is_none()));

    // The seed scenario asks for ignore_eos: one clear error before the run, with the fix.
    opts.overrides.pop();
    let e = loadgen::run(&opts)
        .await
        .err()
        .expect("refused")
        .to_string();
    assert!(
        e.contains("initial test request failed")
            && e.contains("Unexpected fields: ignore_eos")
            && e.contains("--set workload.ignore_eos=false"),
        "{e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_logit_bias_goes_with_every_request_and_an_empty_one_with_none() {
    let (base, seen) = mock(StatusCode::OK).await;
    let mut opts = BenchOptions::new(&base, scenario());
    opts.overrides = vec![
        "workload.num_requests=3".into(),
        "workload.warmup_requests=1".into(),
        "workload.output_tokens=4".into(),
        "workload.ignore_eos=false".into(),
    ];
    let bias = json!({"7": -100, "9": -100});
    opts.logit_bias = Some(bias.clone());
    let r = loadgen::run(&opts).await.unwrap();
    assert_eq!((r.summary.completed, r.summary.failed), (3, 0));
    let bodies = std::mem::take(&mut *seen.lock().unwrap());
    // The test request, the warm-up and the three measured.
    assert_eq!(bodies.len(), 5);
    assert!(bodies.iter().all(|b| b["logit_bias"] == bias), "{bodies:?}");

    opts.logit_bias = Some(json!({}));
    loadgen::run(&opts).await.unwrap();
    assert!(seen
        .lock()
        .unwrap()
        .iter()
        .all(|b| b.get("logit_bias").is_none()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_models_endpoint_is_reported_with_url_and_status() {
    let (base, _) = mock(StatusCode::SERVICE_UNAVAILABLE).await;
    let opts = BenchOptions::new(&base, scenario());
    let e = loadgen::run(&opts)
        .await
        .err()
        .expect("refused")
        .to_string();
    assert!(
        e.contains(&format!("{base}/v1/models")) && e.contains("503") && e.contains("--model"),
        "{e}"
    );
}
