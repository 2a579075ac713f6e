//! The server against hostile clients, in process on 127.0.0.1 with the embedded model:
//! huge prompts must not stall anyone else, slow or half-open connections are cut off,
//! connections beyond the limit are refused, token ids never wrap. Every case ends with
//! the server still serving and no KV block held.

mod common;

use std::time::{Duration, Instant};

use common::post;
use infer_core::SchedulerConfig;
use infer_engine::server::{spawn_local, ServeConfig};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn config() -> ServeConfig {
    let mut cfg = ServeConfig {
        sched: SchedulerConfig {
            max_model_len: 256,
            ..SchedulerConfig::default()
        },
        ..ServeConfig::new("builtin:tiny")
    };
    cfg.http.max_body_bytes = 8 << 20;
    cfg
}

/// A greedy streamed completion of `max_tokens` tokens (EOS ignored), its response open.
async fn stream_completion(
    client: &reqwest::Client,
    base: &str,
    max_tokens: usize,
) -> reqwest::Response {
    let body = json!({"prompt": "The harbour", "max_tokens": max_tokens, "ignore_eos": true,
                      "stream": true, "temperature": 0});
    client
        .post(format!("{base}/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap()
}

/// Runs `clients` on a runtime of their own and waits for them. The server under test
/// serves on the test's runtime; the hostile clients' own work (their JSON is compiled
/// unoptimised here: parsing one 4 MiB prompt's `/tokenize` answer held a thread for about
/// half a second) must not take its HTTP threads, or a stall of the test's making reads
/// as the server's.
async fn apart<T: Send + 'static>(
    clients: impl std::future::Future<Output = T> + Send + 'static,
) -> T {
    let thread = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(clients)
    });
    tokio::task::spawn_blocking(move || thread.join().unwrap())
        .await
        .unwrap()
}

/// Polls `/health` every 5 ms until `done` and returns the longest answer time.
async fn worst_health(base: String, done: tokio::sync::watch::Receiver<bool>) -> Duration {
    let client = reqwest::Client::new();
    let mut worst = Duration::ZERO;
    while !*done.borrow() {
        let t = Instant::now();
        let r = client.get(format!("{base}/health")).send().await.unwrap();
        assert_eq!(r.status(), 200);
        worst = worst.max(t.elapsed());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    worst
}

/// The sum of a metric's samples whose line starts with `name` and contains `with`.
fn metric(server: &infer_engine::server::LocalServer, name: &str, with: &str) -> f64 {
    server
        .engine()
        .metrics_text()
        .lines()
        .filter(|l| l.starts_with(name) && l.contains(with))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

async fn kv_blocks_in_use(server: &infer_engine::server::LocalServer) -> f64 {
    metric(server, "vllm:kv_cache_usage_perc", "")
}

/// After a hostile case: an ordinary request is served, and no KV block is held.
async fn still_serves_and_holds_no_kv(server: &infer_engine::server::LocalServer, base: &str) {
    let (status, v) = post(
        &reqwest::Client::new(),
        &format!("{base}/v1/completions"),
        &json!({"prompt": "The harbour", "max_tokens": 5}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(kv_blocks_in_use(server).await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_prompts_are_refused_or_tokenised_without_stalling_anyone() {
    let (addr, server) = spawn_local(config()).await.unwrap();
    let base = format!("http://{addr}");
    let client = reqwest::Client::new();
    let (done_tx, done_rx) = tokio::sync::watch::channel(false);
    let health = tokio::spawn(worst_health(base.clone(), done_rx));
    // A stream that runs alongside: its tokens must keep coming.
    let stream = {
        let (client, base) = (client.clone(), base.clone());
        tokio::spawn(async move {
            let mut r = stream_completion(&client, &base, 200).await;
            let (mut last, mut worst_gap) = (Instant::now(), Duration::ZERO);
            while let Some(chunk) = r.chunk().await.unwrap() {
                assert!(!chunk.is_empty());
                worst_gap = worst_gap.max(last.elapsed());
                last = Instant::now();
            }
            worst_gap
        })
    };

    let huge = "harbour lights ".repeat(4 << 20 >> 4); // 4 MiB
    let (client, base) = (client.clone(), base.clone());
    apart(async move {
        let mut jobs = Vec::new();
        for i in 0..4 {
            let (client, base, huge) = (client.clone(), base.clone(), huge.clone());
            jobs.push(tokio::spawn(async move {
                if i % 2 == 0 {
                    // Cannot fit max_model_len: refused by its length, before tokenisation.
                    let t = Instant::now();
                    let body = json!({"prompt": huge, "max_tokens": 4});
                    let (status, v) = post(&client, &format!("{base}/v1/completions"), &body).await;
                    assert_eq!(status, 400, "{v}");
                    assert_eq!(v["error"]["param"], "prompt");
                    assert!(v["error"]["message"].as_str().unwrap().contains("bytes"));
                    // Without waiting for the tokenizer pool the /tokenize calls occupy.
                    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
                    t.elapsed()
                } else {
                    // /tokenize has no length limit: it is tokenised, off the HTTP threads.
                    let t = Instant::now();
                    let (status, v) = post(
                        &client,
                        &format!("{base}/tokenize"),
                        &json!({"prompt": huge}),
                    )
                    .await;
                    assert_eq!(status, 200);
                    assert!(v["count"].as_u64().unwrap() > 100_000);
                    t.elapsed()
                }
            }));
        }
        for j in jobs {
            j.await.unwrap();
        }
    })
    .await;
    let gap = stream.await.unwrap();
    done_tx.send(true).unwrap();
    let worst = health.await.unwrap();
    eprintln!("worst /health {worst:?}, worst stream gap {gap:?}");
    // Functional bounds with a wide margin: before the fix both stalled for seconds, as
    // long as tokenising the prompts took (the measured figures are in
    // docs/results/reliability-cpu.md).
    assert!(worst < Duration::from_secs(1), "/health took {worst:?}");
    assert!(gap < Duration::from_secs(1), "a stream stalled {gap:?}");
    assert_eq!(kv_blocks_in_use(&server).await, 0.0);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_and_half_open_clients_are_cut_off() {
    let mut cfg = config();
    cfg.http.header_timeout = Duration::from_millis(300);
    cfg.http.body_timeout = Duration::from_millis(300);
    let (addr, server) = spawn_local(cfg).await.unwrap();

    // Headers that never finish: the server closes each connection after the deadline.
    let mut slow = Vec::new();
    for _ in 0..16 {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            .await
            .unwrap();
        slow.push(s);
    }
    for mut s in slow {
        let mut buf = [0u8; 1024];
        let closed = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await
            .expect("closed by the server within the header deadline");
        // Closed (0 bytes, or a reset); at most an error response first.
        if let Ok(n) = closed {
            let text = String::from_utf8_lossy(&buf[..n]);
            assert!(n == 0 || text.starts_with("HTTP/1.1 408"), "{text}");
        }
    }

    // A body that stops halfway: 408 after the body deadline.
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n\
          content-length: 100\r\n\r\n{\"prompt\": \"hel",
    )
    .await
    .unwrap();
    let mut answer = String::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_string(&mut answer))
        .await
        .expect("answered within the body deadline")
        .unwrap();
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("did not arrive"), "{answer}");

    // Everyone else is served.
    still_serves_and_holds_no_kv(&server, &format!("http://{addr}")).await;
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_ids_beyond_u32_are_refused_not_wrapped() {
    let (addr, server) = spawn_local(config()).await.unwrap();
    let base = format!("http://{addr}");
    let client = reqwest::Client::new();
    let cases = [
        (
            "/v1/completions",
            json!({"prompt": [4294967301u64, 6], "max_tokens": 2}),
            "prompt",
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "max_tokens": 2, "stop_token_ids": [4294967301u64]}),
            "stop_token_ids",
        ),
        ("/detokenize", json!({"tokens": [4294967301u64]}), "tokens"),
        ("/detokenize", json!({"tokens": [100000]}), "tokens"),
    ];
    for (path, body, param) in cases {
        let (status, v) = post(&client, &format!("{base}{path}"), &body).await;
        assert_eq!(status, 400, "{path} {body}: {v}");
        assert_eq!(v["error"]["param"], param, "{v}");
    }
    let (status, v) = post(
        &client,
        &format!("{base}/detokenize"),
        &json!({"tokens": [5, 6]}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsupported_parameters_are_refused_and_errors_name_what_was_sent() {
    let (addr, server) = spawn_local(config()).await.unwrap();
    let base = format!("http://{addr}");
    let client = reqwest::Client::new();
    let with = |mut body: Value, extra: Value| {
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        body
    };
    let completion = |extra| with(json!({"prompt": "hi", "max_tokens": 2}), extra);
    let chat = |extra| {
        with(
            json!({"messages": [{"role": "user", "content": "hi"}]}),
            extra,
        )
    };
    let refused = [
        (
            "/v1/completions",
            completion(json!({"logit_bias": {"5": 101}})),
            "logit_bias",
        ),
        ("/v1/chat/completions", chat(json!({"echo": true})), "echo"),
        (
            "/v1/completions",
            completion(json!({"best_of": 3})),
            "best_of",
        ),
        (
            "/v1/completions",
            completion(json!({"suffix": "end"})),
            "suffix",
        ),
        (
            "/v1/completions",
            completion(json!({"min_tokens": 4})),
            "min_tokens",
        ),
        (
            "/v1/completions",
            completion(json!({"guided_json": 5})),
            "guided_json",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"response_format": {"type": "json_schema"}})),
            "response_format",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"tools": [{"type": "function", "function": {"name": "f"}}]})),
            "tool_choice",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"max_completion_tokens": 0})),
            "max_completion_tokens",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"logprobs": true, "top_logprobs": 50})),
            "top_logprobs",
        ),
        (
            "/v1/completions",
            completion(json!({"logprobs": 50})),
            "logprobs",
        ),
    ];
    for (path, body, param) in refused {
        let (status, v) = post(&client, &format!("{base}{path}"), &body).await;
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], param, "{body}: {v}");
    }
    // Their "not used" values are accepted.
    let accepted = [
        completion(json!({"logit_bias": {}, "echo": false, "best_of": 1, "suffix": null})),
        chat(json!({"response_format": {"type": "text"}, "tools": [], "tool_choice": "none"})),
    ];
    for body in accepted {
        let path = if body.get("messages").is_some() {
            "/v1/chat/completions"
        } else {
            "/v1/completions"
        };
        let (status, v) = post(&client, &format!("{base}{path}"), &body).await;
        assert_eq!(status, 200, "{body}: {v}");
    }
    // Unknown paths and methods answer OpenAI error JSON.
    let r = client
        .get(format!("{base}/v1/nothing"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], 404);
    let r = client
        .get(format!("{base}/v1/completions"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 405);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], 405);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_lets_short_requests_finish_and_ends_long_ones_at_the_deadline() {
    let config_4k = || {
        let mut cfg = config();
        cfg.sched.max_model_len = 4096;
        cfg
    };
    let client = reqwest::Client::new();
    let stream = |base: String, max_tokens: usize| {
        let client = client.clone();
        async move {
            let mut r = stream_completion(&client, &base, max_tokens).await;
            let mut text = String::new();
            while let Some(chunk) = r.chunk().await.unwrap() {
                text.push_str(&String::from_utf8_lossy(&chunk));
            }
            text
        }
    };
    // The deadline follows this machine's speed: twenty times what a 3-token request takes
    // alone on a fresh server (a slow shared machine took over 500 ms in a debug build),
    // at least 1 s; a 4,000-token request takes hundreds of times longer anywhere. (At five
    // times, a CI run whose other tests loaded both cores saw the short request cut after
    // two tokens: during the shutdown it shares each step with the long one.)
    let alone = {
        let (addr, server) = spawn_local(config_4k()).await.unwrap();
        let t = Instant::now();
        stream(format!("http://{addr}"), 3).await;
        let took = t.elapsed();
        server.stop().await;
        took
    };
    let deadline = (alone * 20).max(Duration::from_secs(1));
    let mut cfg = config_4k();
    cfg.shutdown_timeout = deadline;
    let (addr, server) = spawn_local(cfg).await.unwrap();
    let base = format!("http://{addr}");
    // Long enough to outlast the deadline; short enough to end within it.
    let long = tokio::spawn(stream(base.clone(), 4000));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let short = tokio::spawn(stream(base.clone(), 3));
    tokio::time::sleep(Duration::from_millis(50)).await;
    let t = Instant::now();
    server.stop().await;
    let took = t.elapsed();
    let (long, short) = (long.await.unwrap(), short.await.unwrap());
    assert!(
        took < deadline + Duration::from_secs(3),
        "shutdown took {took:?}"
    );
    assert!(short.contains("\"finish_reason\":\"length\""), "{short}");
    assert!(long.contains("shutting down"), "{long}");
    assert!(long.trim_end().ends_with("data: [DONE]"), "{long}");
}

/// One hostile request: method, path, raw body, and the status it must get.
struct BadCase {
    what: String,
    method: reqwest::Method,
    path: &'static str,
    body: Vec<u8>,
    status: u16,
}

impl BadCase {
    fn post(what: impl Into<String>, path: &'static str, body: &Value) -> Self {
        BadCase {
            what: what.into(),
            method: reqwest::Method::POST,
            path,
            body: body.to_string().into_bytes(),
            status: 400,
        }
    }

    fn status(mut self, status: u16) -> Self {
        self.status = status;
        self
    }
}

/// The bad-input catalogue (roles and contents are as free as vLLM's: any role, a missing
/// content is empty): every field of the generation endpoints with values of the
/// wrong type and out of range, every unsupported parameter switched on, malformed bodies,
/// bad prompts, messages and token ids, unknown routes and methods. Each case is invalid
/// (a valid one would be answered 200 and fail the test).
fn bad_cases() -> Vec<BadCase> {
    const COMPLETIONS: &str = "/v1/completions";
    const CHAT: &str = "/v1/chat/completions";
    let with = |key: &str, v: Value| {
        let mut body = json!({"prompt": "The harbour", "max_tokens": 2});
        body[key] = v;
        body
    };
    let mut cases = Vec::new();
    // Numeric fields: values of the wrong type.
    let numeric = [
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "seed",
        "logprobs",
        "n",
    ];
    for key in numeric {
        for v in [json!("5"), json!(true), json!([1]), json!({"v": 1})] {
            cases.push(BadCase::post(
                format!("{key} = {v}"),
                COMPLETIONS,
                &with(key, v),
            ));
        }
    }
    // Numeric fields: out of range.
    let out_of_range: [(&str, &[Value]); 11] = [
        ("max_tokens", &[json!(0), json!(-1), json!(2.5)]),
        ("temperature", &[json!(-0.1), json!(2.5), json!(1e9)]),
        ("top_p", &[json!(0), json!(-1), json!(1.01)]),
        ("top_k", &[json!(-2), json!(-100), json!(1.5)]),
        ("min_p", &[json!(-0.1), json!(1.5)]),
        ("presence_penalty", &[json!(-3), json!(2.1)]),
        ("frequency_penalty", &[json!(3), json!(-2.5)]),
        ("repetition_penalty", &[json!(0), json!(-1)]),
        ("seed", &[json!(1.5), json!(1e30)]),
        ("logprobs", &[json!(21), json!(-1), json!(100)]),
        ("n", &[json!(0), json!(65), json!(1.5)]),
    ];
    for (key, values) in out_of_range {
        for v in values {
            cases.push(BadCase::post(
                format!("{key} = {v}"),
                COMPLETIONS,
                &with(key, v.clone()),
            ));
        }
    }
    // Booleans and options of the wrong type.
    for key in ["stream", "ignore_eos"] {
        for v in [json!("yes"), json!(1), json!([])] {
            cases.push(BadCase::post(
                format!("{key} = {v}"),
                COMPLETIONS,
                &with(key, v),
            ));
        }
    }
    for v in [json!(1), json!("x"), json!({"include_usage": "yes"})] {
        let what = format!("stream_options = {v}");
        cases.push(BadCase::post(what, COMPLETIONS, &with("stream_options", v)));
    }
    // Stop strings and stop token ids.
    for v in [
        json!(5),
        json!([1]),
        json!([""]),
        json!(""),
        json!({"s": 1}),
        json!([null]),
    ] {
        cases.push(BadCase::post(
            format!("stop = {v}"),
            COMPLETIONS,
            &with("stop", v),
        ));
    }
    for v in [
        json!("1"),
        json!([-1]),
        json!([1.5]),
        json!([4_294_967_296u64]),
        json!(7),
    ] {
        let what = format!("stop_token_ids = {v}");
        cases.push(BadCase::post(what, COMPLETIONS, &with("stop_token_ids", v)));
    }
    // Prompts.
    let long = "harbour ".repeat(400);
    for v in [
        json!(5),
        json!(true),
        json!({}),
        json!([]),
        json!([[1, 2], []]),
        json!(["a", [1]]),
        json!([[1], [-1]]),
        json!([-1]),
        json!([1.5]),
        json!([4_294_967_301u64, 6]),
        json!([999_999_999]),
        json!(long),
    ] {
        let what = format!("prompt = {}", &v.to_string()[..v.to_string().len().min(40)]);
        cases.push(BadCase::post(what, COMPLETIONS, &with("prompt", v)));
    }
    cases.push(BadCase::post(
        "no prompt",
        COMPLETIONS,
        &json!({"max_tokens": 2}),
    ));
    // Parameters this server does not implement, switched on, and structured output asked
    // for in ways that cannot work.
    for (key, v) in [
        ("echo", json!("yes")), // a boolean, not a string
        ("suffix", json!("end")),
        ("best_of", json!(3)),
        ("response_format", json!({"type": "yaml"})),
        ("tools", json!([{"type": "function"}])),
        ("tool_choice", json!("auto")),
        ("functions", json!([{"name": "f"}])),
        ("function_call", json!("auto")),
        ("prompt_logprobs", json!(21)),
        ("use_beam_search", json!(true)),
        ("truncate_prompt_tokens", json!(0)),
        ("allowed_token_ids", json!([])), // vLLM refuses an empty list too
        ("bad_words", json!("harbour")),  // a list, not a string
        ("bad_words", json!([" "])),
        ("logits_processors", json!(["f"])),
        ("return_token_ids", json!("yes")), // a boolean, not a string
        ("priority", json!(1)),
        ("add_special_tokens", json!(false)),
        // Chat's names, on completions.
        ("max_completion_tokens", json!(7)),
        ("top_logprobs", json!(2)),
        // A grammar that allows nothing, one past the size a request may send, and one
        // that fails once it runs (3,000 optional properties: a parser row of 12,007 items,
        // past llguidance's 2,000), which is the request's failure, not the server's.
        ("guided_json", json!({"$ref": "#"})),
        (
            "guided_json",
            json!({"type": "object", "properties": (0..3000)
                .map(|i| (format!("p{i}"), json!({"type": "string"})))
                .collect::<serde_json::Map<String, Value>>()}),
        ),
        ("guided_regex", json!("a".repeat((256 << 10) + 1))),
        ("guided_json", json!(5)),
        ("guided_regex", json!("(")),
        ("guided_choice", json!([])),
        ("guided_grammar", json!("start: undefined_rule")),
        ("structured_outputs", json!({"json": {}, "regex": "a"})),
        (
            "structured_outputs",
            json!({"json": {"type": "no-such-type"}}),
        ),
    ] {
        cases.push(BadCase::post(
            format!("{key} = {v}"),
            COMPLETIONS,
            &with(key, v),
        ));
    }
    // Token biases: keys that are not token ids, values out of [-100, 100], ids outside
    // the vocabulary.
    for v in [
        json!({"x": 1}),
        json!({"5": 101}),
        json!({"5": "a"}),
        json!([1]),
        json!({"99999999": 1}),
    ] {
        let what = format!("logit_bias = {v}");
        cases.push(BadCase::post(what, COMPLETIONS, &with("logit_bias", v)));
    }
    // Models.
    cases.push(
        BadCase::post("model gpt-9", COMPLETIONS, &with("model", json!("gpt-9"))).status(404),
    );
    for v in [json!(5), json!([])] {
        cases.push(BadCase::post(
            format!("model = {v}"),
            COMPLETIONS,
            &with("model", v),
        ));
    }
    // Malformed bodies.
    let deep = "[".repeat(10_000) + &"]".repeat(10_000);
    for (what, body) in [
        ("empty body", b"".to_vec()),
        ("truncated JSON", b"{".to_vec()),
        ("a list", b"[]".to_vec()),
        ("null", b"null".to_vec()),
        ("a number", b"5".to_vec()),
        ("a string", b"\"s\"".to_vec()),
        ("missing value", b"{\"prompt\": }".to_vec()),
        ("invalid UTF-8", b"{\"prompt\": \"\xff\xfe\"}".to_vec()),
        ("trailing garbage", b"{\"prompt\": \"x\"} x".to_vec()),
        ("nested 10,000 deep", deep.into_bytes()),
    ] {
        for path in [COMPLETIONS, CHAT] {
            cases.push(BadCase {
                what: format!("{what} to {path}"),
                method: reqwest::Method::POST,
                path,
                body: body.clone(),
                status: 400,
            });
        }
    }
    cases.push(
        BadCase::post(
            "oversize body",
            COMPLETIONS,
            &with("prompt", json!("y".repeat(9 << 20))),
        )
        .status(413),
    );
    // Chat messages and chat-only fields.
    let msg = |m: Value| json!({"messages": m, "max_tokens": 2});
    for m in [
        json!("hi"),
        json!([]),
        json!([{}]),
        json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        json!([{"role": "user", "content": [{"type": "text"}]}]),
        json!([{"role": "user", "content": 5}]),
        json!([{"role": 5, "content": "hi"}]),
        json!([5]),
    ] {
        cases.push(BadCase::post(format!("messages = {m}"), CHAT, &msg(m)));
    }
    cases.push(BadCase::post(
        "no messages",
        CHAT,
        &json!({"max_tokens": 2}),
    ));
    let hi = json!([{"role": "user", "content": "hi"}]);
    for (key, v) in [
        ("logprobs", json!("yes")),
        ("max_completion_tokens", json!(0)),
        ("max_completion_tokens", json!("8")),
        ("add_generation_prompt", json!("no")),
        // Beside the default add_generation_prompt: true.
        ("continue_final_message", json!(true)),
        ("chat_template", json!("{{ messages }}")),
        ("chat_template_kwargs", json!({"messages": []})),
        ("chat_template_kwargs", json!(5)),
        ("add_special_tokens", json!(true)),
    ] {
        let mut body = json!({"messages": hi});
        body[key] = v.clone();
        cases.push(BadCase::post(format!("chat {key} = {v}"), CHAT, &body));
    }
    cases.push(BadCase::post(
        "chat top_logprobs = 21",
        CHAT,
        &json!({"messages": hi, "logprobs": true, "top_logprobs": 21}),
    ));
    // Tokenizer endpoints.
    for body in [
        json!({"tokens": "x"}),
        json!({"tokens": [-1]}),
        json!({"tokens": [4_294_967_296u64]}),
        json!({}),
    ] {
        cases.push(BadCase::post(
            format!("detokenize {body}"),
            "/detokenize",
            &body,
        ));
    }
    for body in [
        json!({"prompt": 5}),
        json!({}),
        json!({"prompt": "hi", "add_special_tokens": "no"}),
    ] {
        cases.push(BadCase::post(
            format!("tokenize {body}"),
            "/tokenize",
            &body,
        ));
    }
    // Stop strings past their bounds, and stop tokens past the vocabulary.
    let many: Vec<String> = (0..129).map(|i| format!("s{i}")).collect();
    cases.push(BadCase::post(
        "129 stop strings",
        COMPLETIONS,
        &with("stop", json!(many)),
    ));
    cases.push(BadCase::post(
        "stop strings of 20,000 bytes",
        COMPLETIONS,
        &with("stop", json!(["x".repeat(20_000)])),
    ));
    cases.push(BadCase::post(
        "stop_token_ids past the vocabulary",
        COMPLETIONS,
        &with("stop_token_ids", json!([3, 1_000_000])),
    ));
    // Routes and methods.
    for (method, path, status) in [
        (reqwest::Method::POST, "/v1/nothing", 404),
        (reqwest::Method::POST, "/v2/completions", 404),
        (reqwest::Method::GET, "/v1/completions", 405),
        (reqwest::Method::PUT, "/v1/chat/completions", 405),
        (reqwest::Method::DELETE, "/health", 405),
    ] {
        cases.push(BadCase {
            what: format!("{method} {path}"),
            method,
            path,
            body: Vec::new(),
            status,
        });
    }
    cases
}

/// At least 150 bad requests, each answered with its status and an OpenAI error body (never
/// a 5xx, never a hang), then the server still serves and holds no KV.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_bad_request_of_the_catalogue_gets_an_openai_error() {
    let (addr, server) = spawn_local(config()).await.unwrap();
    let base = format!("http://{addr}");
    // A fresh connection per case: some cases end with the server closing the connection
    // (a refused body it does not read), and a pooled connection reused right then fails
    // to send — a property of HTTP/1.1 keep-alive, not of the answer under test.
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let cases = bad_cases();
    assert!(cases.len() >= 150, "{} cases", cases.len());
    let mut passed = 0;
    for c in &cases {
        let r = client
            .request(c.method.clone(), format!("{base}{}", c.path))
            .header("content-type", "application/json")
            .body(c.body.clone())
            .timeout(Duration::from_secs(30))
            .send()
            .await
            .unwrap_or_else(|e| panic!("{}: {e}", c.what));
        let status = r.status().as_u16();
        let v: Value = r.json().await.unwrap_or(Value::Null);
        assert_eq!(status, c.status, "{}: {v}", c.what);
        let e = &v["error"];
        assert_eq!(e["code"], status, "{}: {v}", c.what);
        assert!(
            e["type"].as_str().is_some_and(|t| !t.is_empty()),
            "{}",
            c.what
        );
        assert!(
            e["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{}",
            c.what
        );
        passed += 1;
    }
    still_serves_and_holds_no_kv(&server, &base).await;
    println!(
        "reliability: bad HTTP input: {passed} of {} cases answered with OpenAI errors",
        cases.len()
    );
    server.stop().await;
}

/// At least 150 clients that go away at random points — while connecting, before the
/// response headers, after k streamed chunks, during a non-streamed generation, or by
/// closing a raw socket right after the request — eight at a time. Afterwards no request
/// is running, no KV block is held and the server answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_vanishing_at_random_points_leak_nothing() {
    use rand::{Rng, SeedableRng};
    let (addr, server) = spawn_local(config()).await.unwrap();
    let base = format!("http://{addr}");
    let client = reqwest::Client::new();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    const CASES: usize = 160;
    let plans: Vec<(usize, usize, u64)> = (0..CASES)
        .map(|i| (i % 4, rng.gen_range(4..64), rng.gen_range(0..4000)))
        .collect();
    for batch in plans.chunks(8) {
        let runs = batch.iter().map(|&(kind, max_tokens, r)| {
            let (client, base) = (client.clone(), base.clone());
            tokio::spawn(async move {
                let body = json!({"prompt": "The harbour at dawn", "max_tokens": max_tokens,
                                  "ignore_eos": true, "stream": kind != 2});
                let url = format!("{base}/v1/completions");
                match kind {
                    // After k chunks.
                    0 => {
                        let mut resp = client.post(&url).json(&body).send().await.unwrap();
                        for _ in 0..r % 8 {
                            if resp.chunk().await.unwrap().is_none() {
                                break;
                            }
                        }
                    }
                    // Anywhere from connecting to streaming: the future is dropped.
                    1 | 2 => {
                        let wait = Duration::from_micros(r * if kind == 1 { 1 } else { 10 });
                        let _ = tokio::time::timeout(wait, async {
                            let resp = client.post(&url).json(&body).send().await?;
                            resp.bytes().await
                        })
                        .await;
                    }
                    // A raw socket closed right after its request.
                    _ => {
                        let text = body.to_string();
                        let mut s = TcpStream::connect(addr).await.unwrap();
                        let head = format!(
                            "POST /v1/completions HTTP/1.1\r\nHost: x\r\n\
                             content-type: application/json\r\ncontent-length: {}\r\n\r\n",
                            text.len()
                        );
                        s.write_all(head.as_bytes()).await.unwrap();
                        s.write_all(text.as_bytes()).await.unwrap();
                        tokio::time::sleep(Duration::from_micros(r)).await;
                    }
                }
            })
        });
        for r in futures_util::future::join_all(runs).await {
            r.unwrap();
        }
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (kv, running, waiting) = (
            metric(&server, "vllm:kv_cache_usage_perc", ""),
            metric(&server, "vllm:num_requests_running", ""),
            metric(&server, "vllm:num_requests_waiting", ""),
        );
        if kv == 0.0 && running == 0.0 && waiting == 0.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "still held: KV {kv}, running {running}, waiting {waiting}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    still_serves_and_holds_no_kv(&server, &base).await;
    // The disconnects did land mid-request: the engine aborted many of them.
    let aborted = metric(&server, "vllm:request_success_total", "\"abort\"");
    assert!(aborted >= (CASES / 4) as f64, "only {aborted} aborted");
    println!(
        "reliability: cancellation: {CASES} of {CASES} random-point disconnects ({aborted} \
         aborted mid-generation), no KV held after"
    );
    server.stop().await;
}

/// Small ones from the hostile catalogue (issue 40): each refused with a message that says
/// what is wrong with what was sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_say_what_is_wrong_with_what_was_sent() {
    let (addr, server) = spawn_local(config()).await.unwrap();
    let base = format!("http://{addr}");
    let client = reqwest::Client::new();
    let url = format!("{base}/v1/completions");
    for (prompt, says) in [
        (json!([-1]), "prompt[0] = -1 is not a token id"),
        (json!([5e0]), "prompt[0] = 5.0 is not a token id"),
        (json!([5, -1, 7]), "prompt[1] = -1 is not a token id"),
    ] {
        let (status, v) = post(&client, &url, json!({"prompt": prompt, "max_tokens": 1})).await;
        let m = v["error"]["message"].as_str().unwrap_or_default();
        assert!(status == 400 && m.contains(says), "{prompt}: {status} {v}");
    }
    let (status, v) = post(
        &client,
        &url,
        json!({"prompt": "hi", "max_tokens": 1, "stop_token_ids": [1_000_000]}),
    )
    .await;
    let m = v["error"]["message"].as_str().unwrap_or_default();
    assert!(
        status == 400 && v["error"]["param"] == "stop_token_ids" && m.contains("vocabulary"),
        "{v}"
    );
    let (status, v) = post(
        &client,
        &format!("{base}/tokenize"),
        json!({"prompt": "hi", "add_special_tokens": "no"}),
    )
    .await;
    assert!(
        status == 400 && v["error"]["param"] == "add_special_tokens",
        "{v}"
    );
    // `false` is honoured: no BOS.
    let with = |add: bool| {
        let (client, base) = (client.clone(), base.clone());
        async move {
            let (_, v) = post(
                &client,
                &format!("{base}/tokenize"),
                json!({"prompt": "hi", "add_special_tokens": add}),
            )
            .await;
            v["count"].as_u64().unwrap()
        }
    };
    assert_eq!(with(true).await, with(false).await + 1);
    server.stop().await;
}

/// One small request cannot make the server build a huge response: `echo` + `logprobs: 20`
/// + `n: 64` on a 4,000-token prompt (5.4 million log-probabilities, 124 MB of JSON) is
/// refused naming the parameters; one choice of a shorter prompt is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_is_bounded_in_size() {
    let mut cfg = config();
    cfg.sched.max_model_len = 8192;
    cfg.sched.num_gpu_blocks = 1024;
    let (addr, server) = spawn_local(cfg).await.unwrap();
    let url = format!("http://{addr}/v1/completions");
    let client = reqwest::Client::new();
    let body = |n: usize, prompt: usize| {
        json!({"prompt": vec![5u32; prompt], "echo": true, "logprobs": 20, "n": n,
               "max_tokens": 1})
    };
    let (status, v) = post(&client, &url, body(64, 4000)).await;
    let m = v["error"]["message"].as_str().unwrap_or_default();
    assert!(
        status == 400 && v["error"]["param"] == "logprobs" && m.contains("n 64"),
        "{status} {v}"
    );
    // Within the bound (a shorter prompt: the answer is computed in a debug build).
    let (status, v) = post(&client, &url, body(1, 600)).await;
    assert_eq!(status, 200, "{v}");
    let tokens = v["choices"][0]["logprobs"]["tokens"].as_array().unwrap();
    assert_eq!(tokens.len(), 601);
    server.stop().await;
}

/// A streamed completion of `tokens` tokens whose first event has arrived: its response,
/// still open.
async fn started_stream(base: &str, tokens: usize) -> reqwest::Response {
    // A client of its own: a connection of its own.
    let mut r = stream_completion(&reqwest::Client::new(), base, tokens).await;
    assert_eq!(r.status(), 200);
    assert!(r.chunk().await.unwrap().is_some(), "a first event");
    r
}

/// Reads a stream to its end: whether it ended with `[DONE]`.
async fn ends_whole(mut r: reqwest::Response) -> bool {
    let mut text = Vec::new();
    while let Some(chunk) = r.chunk().await.unwrap() {
        text.extend_from_slice(&chunk);
    }
    String::from_utf8_lossy(&text)
        .trim_end()
        .ends_with("data: [DONE]")
}

/// A raw connection's whole answer (the server closes it), from a client that sends a
/// request and part of its body before it reads: a server that closed with the request
/// unread would reset the connection and lose its answer (it did, 9 times in 10, before
/// the refusal's lingering close).
async fn answer_to_a_new_connection(addr: std::net::SocketAddr) -> String {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n",
        1 << 20
    );
    // As an HTTP client library sends: the head, then the body in parts. The server has
    // answered by the time the body goes; it must still take it (before, the second part
    // met a reset: a broken pipe, and the client never read its 503).
    s.write_all(head.as_bytes()).await.unwrap();
    for _ in 0..2 {
        tokio::time::sleep(Duration::from_millis(150)).await;
        s.write_all(&[b' '; 1024])
            .await
            .expect("the refused client's body is taken");
    }
    let mut answer = String::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_string(&mut answer))
        .await
        .expect("answered promptly")
        .unwrap();
    answer
}

/// Idle sockets filling the connection limit give way to clients with requests (before,
/// 1,024 of them got every other client 503 for 10 s, again and again); connections in the
/// middle of a request are never cut for a new one, which is refused instead; and a limit
/// per address, when set, refuses only that address, after reaping its own idle sockets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_give_way_and_busy_ones_are_never_cut() {
    let mut cfg = config();
    cfg.http.max_connections = 16;
    let (addr, server) = spawn_local(cfg).await.unwrap();
    let base = format!("http://{addr}");
    let mut idle = Vec::new();
    for _ in 0..16 {
        idle.push(TcpStream::connect(addr).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    for i in 0..20 {
        // A new client: a new connection each time.
        let (status, v) = post(
            &reqwest::Client::new(),
            &format!("{base}/v1/completions"),
            &json!({"prompt": "The harbour", "max_tokens": 2}),
        )
        .await;
        assert_eq!(status, 200, "request {i} beside the idle sockets: {v}");
    }
    // The first idle socket gave way: the server closed it.
    let mut buf = [0u8; 64];
    let first = tokio::time::timeout(Duration::from_secs(1), idle[0].read(&mut buf)).await;
    assert!(matches!(first, Ok(Ok(0)) | Ok(Err(_))), "{first:?}");
    drop(idle);
    tokio::time::sleep(Duration::from_millis(100)).await;

    // Long enough that none ends (and its connection turns idle, to be reaped) before the
    // last has started on a loaded machine.
    let mut streams = Vec::new();
    for _ in 0..16 {
        streams.push(started_stream(&base, 240).await);
    }
    let answer = answer_to_a_new_connection(addr).await;
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(answer.contains("too many open connections"), "{answer}");
    for s in streams {
        assert!(ends_whole(s).await, "a busy connection was cut");
    }
    server.stop().await;

    let mut cfg = config();
    cfg.http.max_connections_per_address = Some(2);
    let (addr, server) = spawn_local(cfg).await.unwrap();
    let base = format!("http://{addr}");
    let _idle = [
        TcpStream::connect(addr).await.unwrap(),
        TcpStream::connect(addr).await.unwrap(),
    ];
    tokio::time::sleep(Duration::from_millis(100)).await;
    let busy = [
        started_stream(&base, 60).await,
        started_stream(&base, 60).await,
    ];
    let answer = answer_to_a_new_connection(addr).await;
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(answer.contains("from this address"), "{answer}");
    for s in busy {
        assert!(ends_whole(s).await);
    }
    still_serves_and_holds_no_kv(&server, &base).await;
    server.stop().await;
}

/// On a batch of 8, a 4-token request sent once an `n = 64` request has its first token is
/// admitted as soon as a slot frees, not after the 63 forks: it finishes well within the
/// large request's time (before, at 0.85 of it). A second `n = 64` request's first token
/// comes before the first request ends, too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_n_does_not_starve_small_requests() {
    let cfg = ServeConfig {
        sched: SchedulerConfig {
            max_model_len: 256,
            max_batch_size: 8,
            ..SchedulerConfig::default()
        },
        ..ServeConfig::new("builtin:tiny")
    };
    let (addr, server) = spawn_local(cfg).await.unwrap();
    let base = format!("http://{addr}");
    let large = |base: String| async move {
        let body = json!({"prompt": "The harbour", "max_tokens": 48, "ignore_eos": true,
                          "n": 64, "stream": true});
        let mut r = reqwest::Client::new()
            .post(format!("{base}/v1/completions"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert!(r.chunk().await.unwrap().is_some(), "a first event");
        r
    };
    let t = Instant::now();
    let first = large(base.clone()).await;
    let first = tokio::spawn(async move {
        assert!(ends_whole(first).await);
        Instant::now()
    });
    let sent = Instant::now();
    let (status, v) = post(
        &reqwest::Client::new(),
        &format!("{base}/v1/completions"),
        &json!({"prompt": "The harbour", "max_tokens": 4}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let small = sent.elapsed();
    let second = large(base.clone()).await;
    let second_started = Instant::now();
    let first_ended = first.await.unwrap();
    assert!(ends_whole(second).await);
    let large_took = first_ended - t;
    eprintln!("4-token request {small:?}; the first n = 64 request {large_took:?}");
    assert!(
        small < large_took / 2,
        "the small request took {small:?}, the n = 64 one {large_took:?}"
    );
    assert!(
        second_started < first_ended,
        "the second n = 64 request waited for the first"
    );
    still_serves_and_holds_no_kv(&server, &base).await;
    server.stop().await;
}

/// Four 4 MiB `/tokenize` calls do not hold a short prompt's tokenisation (it waits in
/// the small jobs' lane: before, behind them, for seconds); a chat of 130,000 empty
/// messages is refused by its bytes, roles counted, before its template is rendered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_prompts_do_not_wait_behind_huge_ones_and_every_message_counts() {
    let (addr, server) = spawn_local(config()).await.unwrap();
    let base = format!("http://{addr}");
    let huge = "harbour lights ".repeat(4 << 20 >> 4);
    let hostile = base.clone();
    let tokenizing = tokio::spawn(apart(async move {
        let mut jobs = Vec::new();
        for _ in 0..4 {
            let (base, huge) = (hostile.clone(), huge.clone());
            jobs.push(tokio::spawn(async move {
                let client = reqwest::Client::new();
                let (status, _) = post(
                    &client,
                    &format!("{base}/tokenize"),
                    &json!({"prompt": huge}),
                )
                .await;
                assert_eq!(status, 200);
            }));
        }
        for j in jobs {
            j.await.unwrap();
        }
    }));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let t = Instant::now();
    let (status, v) = post(
        &reqwest::Client::new(),
        &format!("{base}/v1/completions"),
        &json!({"prompt": "The harbour", "max_tokens": 2}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let short = t.elapsed();
    let messages = vec![json!({"role": "user", "content": ""}); 130_000];
    let (status, v) = post(
        &reqwest::Client::new(),
        &format!("{base}/v1/chat/completions"),
        &json!({"messages": messages, "max_tokens": 2}),
    )
    .await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "messages");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("bytes"),
        "{v}"
    );
    let all_done = Instant::now();
    tokenizing.await.unwrap();
    eprintln!(
        "a short prompt beside four 4 MiB /tokenize calls: {short:?} (they took {:?} more)",
        all_done.elapsed()
    );
    assert!(short < Duration::from_secs(1), "{short:?}");
    server.stop().await;
}

/// A grammar of 2,000 chained rules is served and the server stays up: llguidance compiles
/// a chain one nested call a link, and a pool thread's 2 MiB stack overflowed at 800 links,
/// which aborted the whole process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deep_grammar_is_served_and_the_server_stays_up() {
    let (addr, server) = spawn_local(config()).await.unwrap();
    let base = format!("http://{addr}");
    let links: Vec<String> = (0..2000).map(|i| format!("r{i}: r{}", i + 1)).collect();
    let grammar = format!("start: r0\n{}\nr2000: \"harbour\"", links.join("\n"));
    let (status, v) = post(
        &reqwest::Client::new(),
        &format!("{base}/v1/completions"),
        &json!({"prompt": "The", "max_tokens": 16, "guided_grammar": grammar}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["text"], "harbour", "{v}");
    still_serves_and_holds_no_kv(&server, &base).await;
    server.stop().await;
}

/// Sixteen connections asking for `/health` as fast as they are answered get the cheap
/// endpoints' pace (here 200 a second), every answer a 200; `/metrics` is answered beside
/// them. (Before, they got every answer they asked for: tens of thousands a second, a
/// stream beside them stretched up to 12×; the figures are the `fair_admission_load`
/// example's.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cheap_endpoint_floods_are_paced() {
    let mut cfg = config();
    cfg.http.cheap_per_second = 200;
    let (addr, server) = spawn_local(cfg).await.unwrap();
    let base = format!("http://{addr}");
    let (done_tx, done_rx) = tokio::sync::watch::channel(false);
    let flood_start = Instant::now();
    let flood: Vec<_> = (0..16)
        .map(|_| {
            let (base, done) = (base.clone(), done_rx.clone());
            tokio::spawn(async move {
                let client = reqwest::Client::new();
                let mut answered = 0u32;
                while !*done.borrow() {
                    let r = client.get(format!("{base}/health")).send().await.unwrap();
                    assert_eq!(r.status(), 200);
                    answered += 1;
                }
                answered
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let t = Instant::now();
    let r = reqwest::get(format!("{base}/metrics")).await.unwrap();
    assert_eq!(r.status(), 200);
    let metrics_took = t.elapsed();
    tokio::time::sleep(Duration::from_millis(700)).await;
    done_tx.send(true).unwrap();
    let mut answered = 0;
    for f in flood {
        answered += f.await.unwrap();
    }
    let flood_s = flood_start.elapsed().as_secs_f64();
    // At 200 a second after a burst of 20, the scrape among them, and the last request of
    // each connection: before, tens of thousands.
    let most = (200.0 * flood_s) as u32 + 20 + 1 + 16;
    eprintln!(
        "/health answers in {flood_s:.2} s of flood: {answered} (at most {most}); /metrics \
         beside it {metrics_took:?}"
    );
    assert!(answered <= most, "{answered} answers");
    assert!(
        answered >= 100,
        "{answered} answers: the flood is paced, not refused"
    );
    assert!(metrics_took < Duration::from_secs(1), "{metrics_took:?}");
    server.stop().await;
}
