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
    (serve(app).await, seen)
}

/// Serves `app` on a free loopback port: its base URL.
async fn serve(app: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{addr}")
}

/// A router whose `/v1/models` lists one model, `mock-model`.
fn with_a_model() -> Router {
    Router::new().route(
        "/v1/models",
        get(|| async { Json(json!({"data": [{"id": "mock-model"}]})) }),
    )
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
        // Long, as pydantic's are: the field's name falls past the 200 characters of the
        // error a failed request keeps.
        let detail = format!(
            "{}Unexpected fields: {k}",
            "The body was refused. ".repeat(10)
        );
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
            && e.contains("HTTP 422")
            && !e.contains("Unexpected fields: ignore_eos")
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

/// How the misbehaving mock answers the requests after the test request (which it
/// answers properly, so that the run starts).
#[derive(Clone, Copy, PartialEq)]
enum Misbehaviour {
    /// `stream: true` ignored: one JSON body, as a misconfigured proxy answers.
    PlainJson,
    /// A token, then the connection closes: no finish_reason, no `[DONE]`.
    CutShort,
    /// A token, then nothing, for ever.
    Stalls,
}

/// A server that answers its first `proper` completions properly (the first of a run is
/// its test request) and the others with `how`. Returns its URL and the number of
/// completions asked.
async fn misbehaving(how: Misbehaviour, proper: usize) -> (String, Arc<Mutex<usize>>) {
    let asked: Arc<Mutex<usize>> = Arc::default();
    let count = asked.clone();
    let app = with_a_model().route(
        "/v1/completions",
        post(move |_body: Bytes| {
            let count = count.clone();
            async move {
                let k = {
                    let mut c = count.lock().unwrap();
                    *c += 1;
                    *c
                };
                let token = |finish: Value| {
                    let c =
                        json!({"choices": [{"index": 0, "text": " w", "finish_reason": finish}]});
                    Bytes::from(format!("data: {c}\n\n"))
                };
                let sse = [("content-type", "text/event-stream")];
                if k <= proper {
                    // The last chunk's JSON over two `data:` lines, as SSE allows.
                    let last =
                        json!({"choices": [{"index": 0, "text": " w", "finish_reason": "length"}]})
                            .to_string();
                    // (The lines are joined by a newline: split where JSON allows one.)
                    let (a, b) = last.split_at(last.find('[').unwrap());
                    let last = format!("data: {a}\ndata: {b}\n\n");
                    let whole = [&token(Value::Null)[..], last.as_bytes()].concat();
                    return (sse, [&whole[..], b"data: [DONE]\n\n"].concat()).into_response();
                }
                match how {
                    Misbehaviour::PlainJson => Json(json!({
                        "choices": [{"index": 0, "text": " w w", "finish_reason": "length"}],
                        "usage": {"prompt_tokens": 3, "completion_tokens": 2}
                    }))
                    .into_response(),
                    // TGI's way: an empty finish_reason until the last chunk.
                    Misbehaviour::CutShort => (sse, token(json!(""))).into_response(),
                    Misbehaviour::Stalls => {
                        let first = futures_util::stream::once(async move {
                            Ok::<_, std::io::Error>(token(Value::Null))
                        });
                        let body =
                            futures_util::StreamExt::chain(first, futures_util::stream::pending());
                        (sse, axum::body::Body::from_stream(body)).into_response()
                    }
                }
            }
        }),
    );
    (serve(app).await, asked)
}

fn small_run(base: &str) -> BenchOptions {
    let mut opts = BenchOptions::new(base, scenario());
    opts.overrides = vec![
        "workload.num_requests=3".into(),
        "workload.warmup_requests=0".into(),
        "workload.output_tokens=2".into(),
        "workload.ignore_eos=false".into(),
    ];
    opts
}

/// A response without a streamed token, a stream cut short and one that stalls are failed
/// requests, each saying why (before, the first two counted as successes with no TTFT or
/// one token, and the third held the run for ever); a server that never streams is told
/// at the test request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_without_tokens_cut_short_or_stalled_are_failures_that_say_why() {
    let (base, _) = misbehaving(Misbehaviour::PlainJson, 0).await;
    let e = loadgen::run(&small_run(&base))
        .await
        .err()
        .expect("refused");
    let e = format!("{e:#}");
    assert!(
        e.contains("initial test request failed") && e.contains("streamed no token"),
        "{e}"
    );
    for (how, why) in [
        (Misbehaviour::PlainJson, "streamed no token"),
        (Misbehaviour::CutShort, "cut short"),
        (Misbehaviour::Stalls, "no end within --request-timeout 1 s"),
    ] {
        let (base, _) = misbehaving(how, 1).await;
        let mut opts = small_run(&base);
        opts.request_timeout = std::time::Duration::from_secs(1);
        let r = loadgen::run(&opts).await.unwrap();
        assert_eq!((r.summary.completed, r.summary.failed), (0, 3), "{why}");
        for rec in &r.records {
            let e = rec.error.as_deref().unwrap_or_default();
            assert!(e.contains(why), "{e}");
        }
    }
}

/// A server within the protocol's letter but odd: `/metrics` accepts and never answers;
/// every chunk carries `"error": null`; the first chunk is empty and the others hold two
/// words each; there is no usage, and after the finish_reason the stream neither sends
/// `[DONE]` nor closes. The run ends (the scrapes time out, the stream is read a short
/// while past its finish), every request completed, its output tokens counted from its
/// text (as vLLM's client counts them without usage), its E2E ending at its last token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_odd_but_valid_server_is_measured_and_its_silent_metrics_do_not_hold_the_run() {
    let app = with_a_model()
        .route("/metrics", get(std::future::pending::<String>))
        .route(
            "/v1/completions",
            post(|_body: Bytes| async {
                let chunk = |text: &str, finish: Value| {
                    let c = json!({"error": null,
                                   "choices": [{"index": 0, "text": text, "finish_reason": finish}]});
                    Ok::<_, std::io::Error>(Bytes::from(format!("data: {c}\n\n")))
                };
                let chunks = vec![
                    chunk("", Value::Null),
                    chunk(" w w", Value::Null),
                    chunk(" w w", json!("length")),
                ];
                let body = futures_util::StreamExt::chain(
                    futures_util::stream::iter(chunks),
                    futures_util::stream::pending(),
                );
                (
                    [("content-type", "text/event-stream")],
                    axum::body::Body::from_stream(body),
                )
                    .into_response()
            }),
        );
    let base = serve(app).await;
    let started = std::time::Instant::now();
    let r = loadgen::run(&small_run(&base)).await.unwrap();
    assert!(
        started.elapsed() < std::time::Duration::from_secs(60),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(
        (r.summary.completed, r.summary.failed),
        (3, 0),
        "{:?}",
        r.failures
    );
    use infer_core::workload::{ApproxTokenizer, Tokenizer};
    let per_request = ApproxTokenizer::default().encode(" w w w w").len();
    assert!(per_request > 0);
    assert_eq!(r.summary.total_output_tokens, 3 * per_request);
    assert!(r.server_counters.is_none(), "no /metrics answered");
    // The stream was held open 2 s past its last token; E2E ends at the token.
    for rec in &r.records {
        assert!(rec.e2e < 1.0, "E2E {} s", rec.e2e);
    }
}

/// A run directory that cannot take the run is refused before any request is sent (before,
/// after the whole run, its results lost).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unusable_run_directory_is_refused_before_the_run() {
    let (base, asked) = misbehaving(Misbehaviour::PlainJson, 1).await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("notes.txt"), "mine").unwrap();
    let mut opts = small_run(&base);
    opts.out = Some(dir.path().to_path_buf());
    let e = format!("{:#}", loadgen::run(&opts).await.err().expect("refused"));
    assert!(e.contains("not a run directory"), "{e}");
    assert_eq!(*asked.lock().unwrap(), 0, "nothing was sent");
}

/// An interrupted run (Ctrl-C) ends at once with what it measured: no request is sent after
/// it, the one in flight is abandoned without a record, and the result and the run
/// directory say so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_run_reports_the_requests_that_ended() {
    // The test request and the first measured one are answered; the second stalls.
    let (base, asked) = misbehaving(Misbehaviour::Stalls, 2).await;
    let dir = tempfile::tempdir().unwrap();
    let mut opts = small_run(&base);
    opts.out = Some(dir.path().join("run"));
    let stop = tokio_util::sync::CancellationToken::new();
    opts.interrupt = Some(stop.clone());
    let run = tokio::spawn(async move { loadgen::run(&opts).await });
    while *asked.lock().unwrap() < 3 {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    stop.cancel();
    let r = tokio::time::timeout(std::time::Duration::from_secs(10), run)
        .await
        .expect("the run ends soon after the interruption")
        .unwrap()
        .unwrap();
    let i = r.interrupted.expect("interrupted");
    assert_eq!((i.sent, i.of, i.cut_off), (2, 3, 1), "{i:?}");
    assert_eq!((r.summary.completed, r.summary.failed), (1, 0));
    assert_eq!(r.records.len(), 1);
    assert_eq!(r.summary.total_output_tokens, 2);
    assert_eq!(
        *asked.lock().unwrap(),
        3,
        "nothing sent after the interruption"
    );
    assert!(r.render().contains("interrupted at"), "{}", r.render());
    let info = std::fs::read_to_string(dir.path().join("run/run.json")).unwrap();
    assert!(
        info.contains("2 of 3 requests sent, 1 in flight abandoned"),
        "{info}"
    );

    // Before the measured run began there is nothing to report.
    let stop = tokio_util::sync::CancellationToken::new();
    stop.cancel();
    let mut opts = small_run(&base);
    opts.interrupt = Some(stop);
    let e = format!("{:#}", loadgen::run(&opts).await.err().expect("refused"));
    assert!(
        e.contains("interrupted before the measured run began"),
        "{e}"
    );
}

/// `engine bench` as a user runs it: Ctrl-C (SIGINT) prints the summary of what ended and
/// exits 130, as a shell reports an interrupted command; a run in which no request
/// completed exits 1 after writing its failures.
#[cfg(unix)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_bench_exits_130_on_ctrl_c_and_1_when_nothing_completed() {
    let bench = |base: &str, out: &std::path::Path| {
        std::process::Command::new(env!("CARGO_BIN_EXE_engine"))
            .args([
                "bench",
                "--server",
                base,
                "--scenario",
                &scenario(),
                "--out",
            ])
            .arg(out)
            .args([
                "--set",
                "workload.num_requests=3",
                "--set",
                "workload.warmup_requests=0",
            ])
            .args([
                "--set",
                "workload.output_tokens=2",
                "--set",
                "workload.ignore_eos=false",
            ])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let dir = tempfile::tempdir().unwrap();

    let (base, asked) = misbehaving(Misbehaviour::Stalls, 2).await;
    let child = bench(&base, &dir.path().join("stalled"));
    while *asked.lock().unwrap() < 3 {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let pid = child.id().to_string();
    assert!(std::process::Command::new("kill")
        .args(["-INT", &pid])
        .status()
        .unwrap()
        .success());
    let out = tokio::task::spawn_blocking(move || child.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(130), "{stdout}");
    assert!(
        stdout.contains("interrupted at") && stdout.contains("run directory"),
        "{stdout}"
    );
    assert!(dir.path().join("stalled/summary.json").is_file());

    let (base, _) = misbehaving(Misbehaviour::CutShort, 1).await;
    let out = bench(&base, &dir.path().join("failed"))
        .wait_with_output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("no request of the run completed"),
        "{stderr}"
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("failed: 3 of 3 requests"));
    assert!(dir.path().join("failed/requests.csv").is_file());
}

/// A conversation's next turn is sent once its previous turn has ended (a chat client's
/// prompt holds the reply), as the simulator's clients send it: with 200 ms replies and
/// arrivals 10 ms apart, each turn waits for the one before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversations_next_turn_waits_for_the_previous_reply() {
    let app = with_a_model().route(
        "/v1/completions",
        post(|_body: Bytes| async {
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            let c = json!({"choices": [{"index": 0, "text": " w", "finish_reason": "length"}]});
            let body = format!("data: {c}\n\ndata: [DONE]\n\n");
            ([("content-type", "text/event-stream")], body).into_response()
        }),
    );
    let mut opts = BenchOptions::new(&serve(app).await, scenario());
    opts.overrides = vec![
        "workload.num_requests=6".into(),
        "workload.warmup_requests=0".into(),
        "workload.prompt_tokens=8".into(),
        "workload.output_tokens=1".into(),
        "workload.ignore_eos=false".into(),
        "workload.conversations={count=2, min_turns=3, max_turns=3}".into(),
        "arrival.kind=\"uniform\"".into(),
        "arrival.rate=100".into(),
    ];
    let r = loadgen::run(&opts).await.unwrap();
    assert_eq!((r.summary.completed, r.summary.failed), (6, 0));
    let text = std::fs::read_to_string(scenario()).unwrap();
    let s = infer_core::workload::Scenario::parse("s", &text, &opts.overrides).unwrap();
    let gen = infer_core::workload::WorkloadGenerator::new(
        s.workload.clone(),
        Arc::new(infer_core::workload::ApproxTokenizer::default()),
    );
    let mut last_end: std::collections::HashMap<usize, f64> = Default::default();
    for rec in &r.records {
        let (c, _) = gen.request(rec.id as usize).turn.expect("a turn");
        if let Some(&end) = last_end.get(&c) {
            assert!(
                rec.start >= end,
                "request {}: sent at {} before {end}",
                rec.id,
                rec.start
            );
        }
        last_end.insert(c, rec.start + rec.e2e);
    }
    // Three turns of 200 ms each, one after another: the run takes at least 0.6 s.
    assert!(r.summary.duration >= 0.6, "{}", r.summary.duration);
}
