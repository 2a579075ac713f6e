//! The server end to end, in process on 127.0.0.1 with the embedded model: the five seed
//! scenarios through the bench client, streaming vs non-streaming, the chat template,
//! every bad-input case, client disconnects and overload.

mod common;

use std::time::{Duration, Instant};

use common::post;
use infer_core::{SchedulerConfig, SchedulingPolicy};
use infer_engine::loadgen::{self, BenchOptions};
use infer_engine::server::{spawn_local, ServeConfig};
use serde_json::{json, Value};

fn scenario(name: &str) -> String {
    format!("{}/../scenarios/{name}.toml", env!("CARGO_MANIFEST_DIR"))
}

/// `builtin:tiny`'s own tokenizer, for cutting prompts in the served model's tokens.
fn tiny_tokenizer() -> std::sync::Arc<dyn infer_core::workload::Tokenizer> {
    let dir = infer_engine::tools::builtin::resolve("builtin:tiny").unwrap();
    std::sync::Arc::new(infer_engine::runtime::tokenizer::TextTokenizer::from_dir(&dir).unwrap())
}

/// `base` with `extra`'s keys set over it.
fn with(mut base: Value, extra: Value) -> Value {
    let extra = extra.as_object().expect("an object").clone();
    base.as_object_mut().expect("an object").extend(extra);
    base
}

/// The ids of the first choice's tokens, its logprobs naming them `token_id:N`
/// (`return_tokens_as_token_ids`).
fn token_ids(v: &Value) -> Vec<u32> {
    v["choices"][0]["logprobs"]["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap()["token_id:".len()..].parse().unwrap())
        .collect()
}

/// `engine bench` of scenario `name` against `base`, cut short: `requests` requests of
/// `output_tokens` tokens, no warm-up.
fn short_bench(base: &str, name: &str, requests: usize, output_tokens: usize) -> BenchOptions {
    let mut opts = BenchOptions::new(base, scenario(name));
    opts.overrides = vec![
        format!("workload.num_requests={requests}"),
        "workload.warmup_requests=0".into(),
        format!("workload.output_tokens={output_tokens}"),
    ];
    opts
}

fn config(sched: SchedulerConfig) -> ServeConfig {
    ServeConfig {
        sched,
        ..ServeConfig::new("builtin:tiny")
    }
}

async fn metric(client: &reqwest::Client, base: &str, name: &str) -> f64 {
    let text = client
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A GET's status and JSON body (null when the body is not JSON).
async fn get_json(client: &reqwest::Client, url: String) -> (u16, Value) {
    let r = client.get(url).send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json::<Value>().await.unwrap_or(Value::Null))
}

/// A streamed response: its text and its `data:` chunks but `[DONE]`, parsed.
async fn stream(client: &reqwest::Client, url: &str, body: &Value) -> (String, Vec<Value>) {
    let text = client
        .post(url)
        .json(body)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let chunks = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    (text, chunks)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seed_scenarios_run_clean_and_counts_match_the_server() {
    let (addr, server) = spawn_local(config(SchedulerConfig::default()))
        .await
        .unwrap();
    let base = format!("http://{addr}");
    for name in [
        "baseline",
        "continuous_batching",
        "paged_attention",
        "chunked_prefill",
        "prefix_caching",
    ] {
        let mut opts = BenchOptions::new(&base, scenario(name));
        // Scaled down: fewer, shorter requests; the shapes and arrival processes stay.
        opts.overrides = vec![
            "workload.num_requests=6".into(),
            "workload.warmup_requests=1".into(),
            "workload.output_tokens={ uniform = [4, 12] }".into(),
        ];
        if name == "chunked_prefill" {
            opts.overrides.push("workload.prompt_tokens={ mix = [ { weight = 0.5, uniform = [600, 900] }, { weight = 0.5, uniform = [64, 128] } ] }".into());
        }
        // Goodput against one objective every request meets and one none can.
        let slo = match name {
            "baseline" => Some(("slo.e2el_ms=600000", 1.0)),
            "paged_attention" => Some(("slo.ttft_ms=0.000001", 0.0)),
            _ => None,
        };
        if let Some((set, _)) = slo {
            opts.overrides.push(set.into());
        }
        opts.scrape_interval = Duration::from_millis(50);
        let r = loadgen::run(&opts).await.unwrap();
        let s = &r.summary;
        assert_eq!(
            (s.completed, s.failed),
            (6, 0),
            "{name}: {:?}",
            r.records.iter().find(|r| r.error.is_some())
        );
        let c = r.server_counters.expect("the server has /metrics");
        assert_eq!(
            s.total_output_tokens as f64, c.generation_tokens,
            "{name}: output tokens"
        );
        assert_eq!(
            s.total_input_tokens as f64, c.prompt_tokens,
            "{name}: prompt tokens"
        );
        assert_eq!(c.request_success, 6.0, "{name}");
        match (slo, s.goodput) {
            (Some((_, attained)), Some(g)) => {
                assert_eq!(g.slo_attainment, attained, "{name}");
                let want = attained * s.request_throughput;
                assert!((g.request_goodput - want).abs() < 1e-9, "{name}");
            }
            (None, None) => {}
            other => panic!("{name}: goodput {other:?}"),
        }
        assert!(s.ttft.median > 0.0 && s.itl.median > 0.0, "{name}");
        if name == "prefix_caching" {
            assert!(
                s.prefix_cache_hit_rate > 0.5,
                "shared prefix hits: {}",
                s.prefix_cache_hit_rate
            );
        }
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_fp8_kv_cache_serves_shared_prefixes_and_chunked_prompts() {
    let (addr, server) = spawn_local(ServeConfig {
        kv_cache_dtype: infer_core::workload::KvCacheDtype::Fp8,
        ..config(SchedulerConfig::default())
    })
    .await
    .unwrap();
    let base = format!("http://{addr}");
    // Shared prefix blocks are read by many sequences (and copied on write); chunked
    // prompts are written over several steps and read back by the prefill path.
    for name in ["prefix_caching", "chunked_prefill"] {
        let mut opts = BenchOptions::new(&base, scenario(name));
        opts.overrides = vec![
            "workload.num_requests=6".into(),
            "workload.warmup_requests=1".into(),
            "workload.output_tokens={ uniform = [4, 12] }".into(),
        ];
        let r = loadgen::run(&opts).await.unwrap();
        assert_eq!((r.summary.completed, r.summary.failed), (6, 0), "{name}");
        if name == "prefix_caching" {
            assert!(r.summary.prefix_cache_hit_rate > 0.5, "{name}");
        }
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_and_non_streaming_agree_and_chat_uses_the_template() {
    let (addr, server) = spawn_local(config(SchedulerConfig::default()))
        .await
        .unwrap();
    let base = format!("http://{addr}");
    let client = reqwest::Client::new();
    let body = json!({"prompt": "The harbour at dawn was quiet", "max_tokens": 20, "temperature": 0, "ignore_eos": true});
    let (status, whole) = post(&client, &format!("{base}/v1/completions"), body.clone()).await;
    assert_eq!(status, 200);
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let (text, chunks) = stream(&client, &format!("{base}/v1/completions"), &streamed).await;
    assert!(text.trim_end().ends_with("data: [DONE]"));
    let joined: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(joined, whole["choices"][0]["text"].as_str().unwrap());
    let token_chunks = chunks
        .iter()
        .filter(|c| !c["choices"].as_array().unwrap().is_empty())
        .count();
    assert_eq!(
        token_chunks, 20,
        "one chunk per token, the last with finish_reason"
    );
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 20);
    // Every other chunk says `"usage": null`, as OpenAI's stream does.
    for c in &chunks[..chunks.len() - 1] {
        assert!(c.get("usage").is_some_and(Value::is_null), "{c}");
    }

    // Chat: the template wraps the message, so the prompt is longer than the content, and the
    // same tokens sent as a completion give the same greedy reply.
    let messages = json!([{"role": "user", "content": "Tell me about the lighthouse"}]);
    let (status, tok) = post(
        &client,
        &format!("{base}/tokenize"),
        json!({"messages": messages}),
    )
    .await;
    assert_eq!(status, 200);
    let (_, raw) = post(
        &client,
        &format!("{base}/tokenize"),
        json!({"prompt": "Tell me about the lighthouse"}),
    )
    .await;
    assert!(
        tok["count"].as_u64().unwrap() > raw["count"].as_u64().unwrap() + 2,
        "{tok} vs {raw}"
    );
    // With each token's string in the vocabulary, as vLLM's `return_token_strs`.
    let (status, strs) = post(
        &client,
        &format!("{base}/tokenize"),
        json!({"prompt": "Tell me about the lighthouse", "return_token_strs": true}),
    )
    .await;
    assert_eq!(status, 200, "{strs}");
    assert_eq!(strs["tokens"], raw["tokens"]);
    let token_strs = strs["token_strs"].as_array().unwrap();
    assert_eq!(token_strs.len(), raw["tokens"].as_array().unwrap().len());
    assert!(token_strs.iter().all(Value::is_string), "{strs}");
    let (status, chat) = post(
        &client,
        &format!("{base}/v1/chat/completions"),
        json!({"messages": messages, "max_tokens": 12, "temperature": 0, "ignore_eos": true}),
    )
    .await;
    assert_eq!(status, 200, "{chat}");
    assert_eq!(chat["usage"]["prompt_tokens"], tok["count"]);
    let (_, same) = post(
        &client,
        &format!("{base}/v1/completions"),
        json!({"prompt": tok["tokens"], "max_tokens": 12, "temperature": 0, "ignore_eos": true}),
    )
    .await;
    assert_eq!(
        chat["choices"][0]["message"]["content"],
        same["choices"][0]["text"]
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_inputs_get_openai_errors_and_the_server_keeps_serving() {
    let sched = SchedulerConfig {
        max_model_len: 256,
        ..SchedulerConfig::default()
    };
    let mut cfg = config(sched);
    cfg.http.max_body_bytes = 64 << 10;
    let (addr, server) = spawn_local(cfg).await.unwrap();
    let base = format!("http://{addr}");
    let client = reqwest::Client::new();
    let url = format!("{base}/v1/completions");
    let long_prompt = "harbour ".repeat(400);
    let cases: Vec<(&str, reqwest::RequestBuilder, u16, &str)> = vec![
        (
            "malformed JSON",
            client.post(&url).body("{\"prompt\": "),
            400,
            "invalid_request_error",
        ),
        (
            "wrong type",
            client
                .post(&url)
                .json(&json!({"prompt": "x", "max_tokens": "5"})),
            400,
            "invalid_request_error",
        ),
        (
            "unknown model",
            client
                .post(&url)
                .json(&json!({"model": "gpt-9", "prompt": "x"})),
            404,
            "invalid_request_error",
        ),
        (
            "prompt too long",
            client
                .post(&url)
                .json(&json!({"prompt": long_prompt, "max_tokens": 4})),
            400,
            "invalid_request_error",
        ),
        (
            "max_tokens 0",
            client
                .post(&url)
                .json(&json!({"prompt": "x", "max_tokens": 0})),
            400,
            "invalid_request_error",
        ),
        (
            "max_tokens negative",
            client
                .post(&url)
                .json(&json!({"prompt": "x", "max_tokens": -3})),
            400,
            "invalid_request_error",
        ),
        (
            "temperature",
            client
                .post(&url)
                .json(&json!({"prompt": "x", "temperature": 7})),
            400,
            "invalid_request_error",
        ),
        (
            "top_p",
            client
                .post(&url)
                .json(&json!({"prompt": "x", "top_p": 1.5})),
            400,
            "invalid_request_error",
        ),
        (
            "n",
            client.post(&url).json(&json!({"prompt": "x", "n": 100})),
            400,
            "invalid_request_error",
        ),
        (
            "oversize body",
            client
                .post(&url)
                .json(&json!({"prompt": "y".repeat(100_000)})),
            413,
            "invalid_request_error",
        ),
        (
            "bad chat",
            client
                .post(format!("{base}/v1/chat/completions"))
                .json(&json!({"messages": "hi"})),
            400,
            "invalid_request_error",
        ),
    ];
    for (what, req, status, kind) in cases {
        let r = req
            .header("content-type", "application/json")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), status, "{what}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["type"], kind, "{what}: {v}");
        assert_eq!(v["error"]["code"], status, "{what}");
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{what}"
        );
        if what == "prompt too long" {
            let m = v["error"]["message"].as_str().unwrap();
            assert!(m.contains("256") && m.contains("prompt has"), "{m}");
        }
    }
    let (status, ok) = post(
        &client,
        &url,
        json!({"prompt": "The harbour", "max_tokens": 5}),
    )
    .await;
    assert_eq!(status, 200, "{ok}");
    assert_eq!(ok["usage"]["completion_tokens"], 5);
    assert_eq!(
        metric(&client, &base, "vllm:kv_cache_usage_perc").await,
        0.0,
        "no KV held when idle"
    );
    assert_eq!(
        metric(&client, &base, "vllm:num_requests_running").await,
        0.0
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_dropping_its_stream_frees_its_blocks() {
    let (addr, server) = spawn_local(config(SchedulerConfig::default()))
        .await
        .unwrap();
    let base = format!("http://{addr}");
    let client = reqwest::Client::new();
    let body = json!({"prompt": "A long story about the sea", "max_tokens": 3000, "ignore_eos": true, "stream": true});
    let mut resp = client
        .post(format!("{base}/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let first = resp.chunk().await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(&first).contains("data:"));
    assert!(
        metric(&client, &base, "vllm:kv_cache_usage_perc").await > 0.0,
        "the request holds KV"
    );
    drop(resp);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let usage = metric(&client, &base, "vllm:kv_cache_usage_perc").await;
        let running = metric(&client, &base, "vllm:num_requests_running").await;
        if usage == 0.0 && running == 0.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "KV still held: usage {usage}, running {running}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let aborted = metric(
        &client,
        &base,
        "vllm:request_success_total{model_name=\"builtin:tiny\",engine=\"0\",finished_reason=\"abort\"}",
    )
    .await;
    assert_eq!(aborted, 1.0);
    // Its prompt ran, and is counted as vLLM counts it, with the tokens it generated.
    let (_, tok) = post(
        &client,
        &format!("{base}/tokenize"),
        json!({"prompt": body["prompt"]}),
    )
    .await;
    assert_eq!(
        metric(&client, &base, "vllm:prompt_tokens_total").await,
        tok["count"].as_f64().unwrap()
    );
    assert!(metric(&client, &base, "vllm:generation_tokens_total").await >= 1.0);
    server.stop().await;
}

/// llama.cpp's slots as infer serves them (contiguous slots with prefix caching): a prompt
/// that shares most of a slot's last tokens reuses them, and its output is the one a server
/// without any reuse gives — the slot's KV beyond the shared prefix is overwritten, not read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contiguous_slots_reuse_their_last_tokens_without_changing_outputs() {
    let slots = |prefix_caching| SchedulerConfig {
        kv_cache_backend: infer_core::KvBackend::Contiguous,
        num_gpu_blocks: 64,
        block_size: 16,
        max_model_len: 256,
        prefix_caching,
        ..SchedulerConfig::default()
    };
    let client = reqwest::Client::new();
    let a: Vec<u32> = (10..110).collect();
    let b: Vec<u32> = (10..90).chain(500..530).collect();
    let mut outputs = Vec::new();
    for reuse in [false, true] {
        let (addr, server) = spawn_local(config(slots(reuse))).await.unwrap();
        let url = format!("http://{addr}/v1/completions");
        let mut cached = Vec::new();
        let mut texts = Vec::new();
        for p in [&a, &b, &b] {
            let body = json!({"prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": true});
            let (status, v) = post(&client, &url, body).await;
            assert_eq!(status, 200, "{v}");
            cached.push(
                v["usage"]["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap_or(0),
            );
            texts.push(v["choices"][0]["text"].as_str().unwrap().to_string());
        }
        if reuse {
            // b shares 80 of its 110 tokens with a's slot; then all of its own but the last.
            assert_eq!(cached, [0, 80, 109], "cached tokens per request");
        } else {
            assert_eq!(cached, [0, 0, 0]);
        }
        outputs.push(texts);
        server.stop().await;
    }
    assert_eq!(outputs[0], outputs[1], "reuse changes no output");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_gets_503s_and_every_accepted_request_completes() {
    let sched = SchedulerConfig {
        max_batch_size: 2,
        max_waiting: Some(3),
        ..SchedulerConfig::default()
    };
    let (addr, server) = spawn_local(config(sched)).await.unwrap();
    let base = format!("http://{addr}");
    let client = reqwest::Client::new();
    let url = format!("{base}/v1/completions");
    let sends = (0..24).map(|i| {
        let (client, url) = (client.clone(), url.clone());
        tokio::spawn(async move {
            let r = client
                .post(&url)
                .json(&json!({"prompt": format!("Request {i} about the harbour"), "max_tokens": 24, "ignore_eos": true}))
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            let retry = r.headers().get("retry-after").is_some();
            let v: Value = r.json().await.unwrap();
            (status, retry, v)
        })
    });
    let results = tokio::time::timeout(
        Duration::from_secs(120),
        futures_util::future::join_all(sends),
    )
    .await
    .expect("nothing hangs");
    let (mut ok, mut busy) = (0, 0);
    for r in results {
        let (status, retry, v) = r.unwrap();
        match status {
            200 => {
                ok += 1;
                assert_eq!(v["usage"]["completion_tokens"], 24);
            }
            503 => {
                busy += 1;
                assert!(retry, "503 carries Retry-After");
                assert_eq!(v["error"]["type"], "service_unavailable_error");
            }
            other => panic!("unexpected status {other}: {v}"),
        }
    }
    assert!(busy > 0, "the burst exceeds running + waiting capacity");
    assert!(ok >= 3, "at least a full waiting queue was served: {ok}");
    assert_eq!(ok + busy, 24);
    assert_eq!(
        metric(&client, &base, "vllm:kv_cache_usage_perc").await,
        0.0
    );
    // More prompts in one request than the queue holds could never be served: a 400, not a
    // 503 that a client would retry for ever. A full queue's worth is served.
    let batch = |k: usize| json!({"prompt": vec!["The harbour"; k], "max_tokens": 2});
    let (status, v) = post(&client, &url, batch(4)).await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "prompt");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("--max-waiting 3"));
    let (status, v) = post(&client, &url, batch(3)).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"].as_array().unwrap().len(), 3);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_carry_unique_ids_their_time_a_fingerprint_and_the_model_root() {
    let (addr, server) = spawn_local(config(SchedulerConfig::default()))
        .await
        .unwrap();
    let base = format!("http://{addr}");
    let client = reqwest::Client::new();
    let now = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs()
    };
    let before = now();
    let body = json!({"prompt": "The harbour", "max_tokens": 3});
    let (_, a) = post(&client, &format!("{base}/v1/completions"), body.clone()).await;
    let (_, b) = post(&client, &format!("{base}/v1/completions"), body).await;
    let after = now();
    assert_ne!(a["id"], b["id"]);
    assert!(a["id"].as_str().unwrap().starts_with("cmpl-"), "{a}");
    let created = a["created"].as_u64().unwrap();
    assert!(
        (before..=after).contains(&created),
        "{created} not in {before}..={after}"
    );
    assert!(a["system_fingerprint"]
        .as_str()
        .unwrap()
        .starts_with("fp_infer_"));
    let models: Value = client
        .get(format!("{base}/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let m = &models["data"][0];
    let root = std::path::PathBuf::from(m["root"].as_str().unwrap());
    assert!(root.join("tokenizer.json").exists(), "{m}");
    assert_eq!(m["max_model_len"], 4096);
    server.stop().await;
}

/// With the served model's tokenizer (`engine bench --tokenizer DIR`), prompts arrive at the
/// lengths they were cut to — the cut leaves room for the BOS the server adds — within one
/// token where re-encoding the joined text tokenizes a segment boundary differently (cut
/// with the approximate tokenizer, 128 tokens are ~110 of a real one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompts_cut_with_the_models_tokenizer_arrive_at_their_length() {
    use infer_core::workload::WorkloadGenerator;
    let (addr, server) = spawn_local(config(SchedulerConfig::default()))
        .await
        .unwrap();
    let tokenizer = tiny_tokenizer();
    let mut opts = short_bench(&format!("http://{addr}"), "paged_attention", 8, 2);
    opts.tokenizer = Some(tokenizer.clone());
    let r = loadgen::run(&opts).await.unwrap();
    let gen = WorkloadGenerator::new(r.scenario.workload.clone(), tokenizer);
    for rec in &r.records {
        let cut = gen.request(rec.id as usize).prompt_ids.len();
        assert!(
            rec.prompt_tokens.abs_diff(cut) <= 1,
            "{cut} vs {}",
            rec.prompt_tokens
        );
    }
    server.stop().await;
}

/// The endpoints routers in front of replicas call (SGLang's router, vllm-router): load while
/// a request runs and after, model and server info, and a health check that generates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn router_facing_endpoints_report_load_and_health() {
    let (addr, server) = spawn_local(config(SchedulerConfig::default()))
        .await
        .unwrap();
    let base = format!("http://{addr}");
    let client = reqwest::Client::new();
    let get = |path: &str| get_json(&client, format!("{base}{path}"));
    let (status, idle) = get("/get_load").await;
    assert_eq!((status, idle["load"].as_u64()), (200, Some(0)), "{idle}");
    let body =
        json!({"prompt": "A long story", "max_tokens": 3000, "ignore_eos": true, "stream": true});
    let mut resp = client
        .post(format!("{base}/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    resp.chunk().await.unwrap().unwrap();
    let (_, busy) = get("/get_load").await;
    assert_eq!(busy["load"], 1, "{busy}");
    assert_eq!(busy["num_reqs"], 1, "{busy}");
    // SGLang's token load: the KV tokens the running request holds (a block or more).
    let tokens = busy["aggregate"]["total_tokens"].as_u64().unwrap();
    assert!(tokens >= 16, "{busy}");
    assert_eq!(busy["loads"][0]["num_total_tokens"], tokens, "{busy}");
    assert_eq!(
        get("/v1/loads").await.1["aggregate"]["total_tokens"],
        tokens
    );
    assert_eq!(idle["aggregate"]["total_tokens"], 0, "{idle}");
    drop(resp);
    let (status, info) = get("/get_model_info").await;
    assert_eq!(status, 200);
    assert_eq!(info["is_generation"], true);
    assert!(
        info["model_path"].as_str().is_some_and(|p| !p.is_empty()),
        "{info}"
    );
    assert_eq!(get("/model_info").await.1, info, "SGLang's newer name");
    let (status, info) = get("/get_server_info").await;
    assert_eq!(status, 200);
    assert_eq!(info["engine"], "infer");
    assert_eq!(get("/server_info").await.1["engine"], "infer");
    assert!(info["max_model_len"].as_u64().is_some(), "{info}");
    let (status, _) = get("/health_generate").await;
    assert_eq!(status, 200);
    let deadline = Instant::now() + Duration::from_secs(10);
    while get("/get_load").await.1["load"] != 0 {
        assert!(Instant::now() < deadline, "the dropped stream still counts");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // vLLM's per-request and per-step histograms saw both requests (the health check's
    // ran to its end).
    for (name, at_least) in [
        ("vllm:request_params_n_count", 2.0),
        ("vllm:request_params_max_tokens_count", 2.0),
        ("vllm:iteration_tokens_total_count", 2.0),
        ("vllm:request_prompt_tokens_count", 1.0),
        ("vllm:request_generation_tokens_count", 1.0),
        ("vllm:request_inference_time_seconds_count", 1.0),
        ("vllm:request_prefill_time_seconds_count", 1.0),
        ("vllm:request_decode_time_seconds_count", 1.0),
    ] {
        let v = metric(&client, &base, name).await;
        assert!(v >= at_least, "{name} = {v}");
    }
    server.stop().await;
}

/// `logit_bias` as OpenAI defines it: +100 on one token makes greedy decoding pick it every
/// time; -100 on the unbiased choice makes it never appear. vLLM's `allowed_token_ids`:
/// nothing else is sampled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logit_bias_and_allowed_token_ids_are_honoured() {
    let (addr, server) = spawn_local(config(SchedulerConfig::default()))
        .await
        .unwrap();
    let base = format!("http://{addr}");
    let client = reqwest::Client::new();
    let url = format!("{base}/v1/completions");
    let body = |bias: Value| {
        json!({"prompt": "The harbour at dawn", "max_tokens": 4,
                                    "temperature": 0, "logit_bias": bias})
    };
    let (status, forced) = post(&client, &url, body(json!({"42": 100}))).await;
    assert_eq!(status, 200, "{forced}");
    let (_, want) = post(
        &client,
        &format!("{base}/detokenize"),
        json!({"tokens": [42, 42, 42, 42]}),
    )
    .await;
    assert_eq!(forced["choices"][0]["text"], want["prompt"], "{forced}");
    // Ban the first token greedy decoding picks: the first token changes.
    let (_, plain) = post(&client, &url, body(json!({}))).await;
    let first = |v: &Value| v["choices"][0]["text"].as_str().unwrap().to_string();
    let (_, ids) = post(
        &client,
        &format!("{base}/tokenize"),
        json!({"prompt": first(&plain), "add_special_tokens": false}),
    )
    .await;
    let banned = ids["tokens"][0].as_u64().unwrap();
    let (_, other) = post(&client, &url, body(json!({ banned.to_string(): -100 }))).await;
    let (_, other_ids) = post(
        &client,
        &format!("{base}/tokenize"),
        json!({"prompt": first(&other), "add_special_tokens": false}),
    )
    .await;
    assert_ne!(other_ids["tokens"][0].as_u64(), Some(banned), "{other}");
    // vLLM's bad_words: the same first token, banned as a word (its text, which the server
    // tokenises as vLLM does, with and without a space before it).
    let (_, word) = post(
        &client,
        &format!("{base}/detokenize"),
        json!({ "tokens": [banned] }),
    )
    .await;
    let word = word["prompt"].as_str().unwrap().to_string();
    let (status, worded) = post(
        &client,
        &url,
        with(body(json!({})), json!({ "bad_words": [word] })),
    )
    .await;
    assert_eq!(status, 200, "{worded}");
    let (_, worded_ids) = post(
        &client,
        &format!("{base}/tokenize"),
        json!({"prompt": first(&worded), "add_special_tokens": false}),
    )
    .await;
    assert_ne!(worded_ids["tokens"][0].as_u64(), Some(banned), "{worded}");
    // vLLM's allowed_token_ids: only those are sampled, greedy or drawn, and the ids must
    // be a non-empty list within the vocabulary.
    let allowed = [7u32, 42, 300];
    for temperature in [0.0, 1.0] {
        let body = json!({"prompt": "The harbour at dawn", "max_tokens": 12, "ignore_eos": true,
                          "temperature": temperature, "seed": 3, "allowed_token_ids": allowed,
                          "logprobs": 0, "return_tokens_as_token_ids": true});
        let (status, v) = post(&client, &url, body).await;
        assert_eq!(status, 200, "{v}");
        let ids = token_ids(&v);
        assert_eq!(ids.len(), 12);
        assert!(ids.iter().all(|t| allowed.contains(t)), "{ids:?}");
    }
    for bad in [json!("harbour"), json!([""]), json!(["  "]), json!([7])] {
        let (status, v) = post(&client, &url, json!({"prompt": "x", "bad_words": bad})).await;
        assert_eq!(status, 400, "{v}");
        assert_eq!(v["error"]["param"], "bad_words", "{v}");
    }
    // Every token allowed banned: nothing could be sampled.
    let only = json!({"prompt": "x", "allowed_token_ids": [banned], "bad_words": [word]});
    let (status, v) = post(&client, &url, only).await;
    assert_eq!(status, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("every token"),
        "{v}"
    );
    for bad in [json!([]), json!([1_000_000]), json!("42")] {
        let (status, v) = post(
            &client,
            &url,
            json!({"prompt": "x", "allowed_token_ids": bad}),
        )
        .await;
        assert_eq!(status, 400, "{v}");
        assert_eq!(v["error"]["param"], "allowed_token_ids", "{v}");
    }
    server.stop().await;
}

/// vLLM's `priority`: any integer under `--scheduling-policy priority`, on each of the
/// three generating endpoints; under first come, first served only 0, anything else refused
/// with vLLM's words (the order it sets is the scheduler's tests').
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn priority_is_taken_only_under_priority_scheduling() {
    let client = reqwest::Client::new();
    for policy in [SchedulingPolicy::Fcfs, SchedulingPolicy::Priority] {
        let (addr, server) = spawn_local(config(SchedulerConfig {
            scheduling_policy: policy,
            ..SchedulerConfig::default()
        }))
        .await
        .unwrap();
        let base = format!("http://{addr}");
        for (path, body) in [
            (
                "completions",
                json!({"prompt": "The harbour", "max_tokens": 2}),
            ),
            (
                "chat/completions",
                json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
            ),
            ("responses", json!({"input": "Hi", "max_output_tokens": 2})),
        ] {
            let url = format!("{base}/v1/{path}");
            for priority in [0, -3, 7] {
                let (status, v) = post(
                    &client,
                    &url,
                    with(body.clone(), json!({"priority": priority})),
                )
                .await;
                if priority == 0 || policy == SchedulingPolicy::Priority {
                    assert_eq!(status, 200, "{path} {policy:?} {priority}: {v}");
                } else {
                    assert_eq!(status, 400, "{path} {priority}: {v}");
                    assert_eq!(v["error"]["param"], "priority", "{v}");
                    let message = v["error"]["message"].as_str().unwrap();
                    assert!(
                        message.contains("Priority scheduling is not enabled"),
                        "{message}"
                    );
                }
            }
            let (status, v) = post(&client, &url, with(body, json!({"priority": "high"}))).await;
            assert_eq!(status, 400, "{path}: {v}");
        }
        // `engine bench` of a workload of two priorities: sent to a priority-scheduled
        // server, not to a first-come-first-served one (which would refuse them), the
        // records keeping each request's priority either way; a scenario that says the
        // server schedules by priority when it does not fails at the test request, saying so.
        let base = format!("http://{addr}");
        let bench = |scenario_policy: &str| {
            let mut opts = short_bench(&base, "priority_cpu", 12, 2);
            opts.overrides
                .push(format!("server.scheduling_policy={scenario_policy}"));
            opts
        };
        let name = match policy {
            SchedulingPolicy::Fcfs => "fcfs",
            SchedulingPolicy::Priority => "priority",
        };
        let r = loadgen::run(&bench(name)).await.unwrap();
        assert_eq!(r.summary.failed, 0, "{policy:?}");
        assert!(r.records.iter().all(|q| [0, 1].contains(&q.priority)));
        assert!(r.records.iter().any(|q| q.priority == 1), "{:?}", r.records);
        if policy == SchedulingPolicy::Fcfs {
            let Err(e) = loadgen::run(&bench("priority")).await else {
                panic!("priorities sent to a first-come-first-served server");
            };
            assert!(
                format!("{e:#}").contains("--scheduling-policy priority"),
                "{e:#}"
            );
        }
        server.stop().await;
    }
}

/// OpenAI's `n`: the choices of one request are forks of one prompt computation. Greedy,
/// every choice is exactly the `n = 1` answer (a fork reads the KV its parent computed);
/// seeded sampling gives choice 0 the `n = 1` answer of the same seed and the others their
/// own; usage counts the prompt once and every choice's tokens; a stream carries every
/// choice to its finish; and the KV is all given back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_choices_are_forks_of_one_prompt() {
    let (addr, _server) = spawn_local(config(SchedulerConfig::default()))
        .await
        .unwrap();
    let base = format!("http://{addr}");
    let url = format!("{base}/v1/completions");
    let client = reqwest::Client::new();
    // 40+ tokens: the forks share two full blocks.
    let prompt = "The harbour at dawn was quiet; the boats rocked on their moorings while \
                  the gulls circled over the grey water and the fishermen mended their nets";
    let texts = |v: &Value| -> Vec<String> {
        v["choices"]
            .as_array()
            .unwrap()
            .iter()
            .enumerate()
            .map(|(i, c)| {
                assert_eq!(c["index"], i);
                c["text"].as_str().unwrap().to_string()
            })
            .collect()
    };
    for (temperature, seed) in [(0.0, None), (1.0, Some(11))] {
        let body = |n: usize| {
            json!({"prompt": prompt, "max_tokens": 12, "n": n, "temperature": temperature,
                   "seed": seed, "ignore_eos": true})
        };
        let (status, one) = post(&client, &url, body(1)).await;
        assert_eq!(status, 200, "{one}");
        let (status, three) = post(&client, &url, body(3)).await;
        assert_eq!(status, 200, "{three}");
        let (one_text, three_texts) = (texts(&one), texts(&three));
        assert_eq!(three_texts.len(), 3);
        assert_eq!(three_texts[0], one_text[0], "choice 0 is the n = 1 answer");
        if temperature == 0.0 {
            assert!(
                three_texts.iter().all(|t| t == &one_text[0]),
                "{three_texts:?}"
            );
        } else {
            assert!(three_texts[1] != three_texts[0] || three_texts[2] != three_texts[0]);
        }
        let u = &three["usage"];
        assert_eq!(u["prompt_tokens"], one["usage"]["prompt_tokens"]);
        assert_eq!(u["completion_tokens"], 36);
    }
    let mut streamed = json!({"prompt": prompt, "max_tokens": 5, "n": 2, "ignore_eos": true,
                              "stream": true, "stream_options": {"include_usage": true}});
    streamed["temperature"] = json!(0);
    let (text, chunks) = stream(&client, &url, &streamed).await;
    for index in 0..2 {
        let finishes = chunks
            .iter()
            .filter(|c| c["choices"].get(0).is_some_and(|ch| ch["index"] == index))
            .filter(|c| c["choices"][0]["finish_reason"] == "length")
            .count();
        assert_eq!(finishes, 1, "choice {index} finishes once: {text}");
    }
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 10);
    assert!(text.trim_end().ends_with("data: [DONE]"));
    assert_eq!(
        metric(&client, &base, "vllm:kv_cache_usage_perc").await,
        0.0
    );
    assert_eq!(
        metric(&client, &base, "vllm:num_requests_running").await,
        0.0
    );
}

/// Trace replay in both drivers: the shipped fixture (`scenarios/trace_replay.toml`) gives
/// the simulator every row's arrival time and lengths exactly, and the load generator sends
/// each row on its time with its lengths (cut in the served model's tokens; the server's
/// count is within its BOS token and a merge at a segment boundary).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trace_replays_the_same_arrivals_and_lengths_in_both_drivers() {
    let file = scenario("trace_replay");
    // Its first 12 rows (the whole trace is 40).
    let first = vec!["workload.num_requests=12".to_string()];
    let setup = infer_sim::load(&file, &first).unwrap();
    let trace = setup.trace.clone().expect("the scenario replays a trace");
    assert_eq!(trace.rows.len(), 40);
    let (_, predicted) = infer_sim::run_collect(&setup).unwrap();
    assert_eq!(predicted.records.len(), 12);
    for (row, rec) in trace.rows.iter().zip(&predicted.records) {
        assert!(
            (rec.start - row.t_s).abs() < 1e-9,
            "{} vs {}",
            rec.start,
            row.t_s
        );
        assert_eq!(
            (rec.prompt_tokens, rec.output_tokens),
            (row.prompt_tokens, row.output_tokens)
        );
    }

    let (addr, server) = spawn_local(config(SchedulerConfig::default()))
        .await
        .unwrap();
    let tokenizer = tiny_tokenizer();
    let mut opts = BenchOptions::new(&format!("http://{addr}"), &file);
    opts.tokenizer = Some(tokenizer);
    opts.overrides = first;
    let measured = loadgen::run(&opts).await.unwrap();
    server.stop().await;
    assert_eq!(measured.records.len(), 12);
    for rec in &measured.records {
        let row = trace.rows[rec.id as usize];
        assert!(rec.success(), "{rec:?}");
        assert_eq!(rec.output_tokens, row.output_tokens, "request {}", rec.id);
        assert!(
            rec.prompt_tokens.abs_diff(row.prompt_tokens) <= 2,
            "request {}: {} vs {}",
            rec.id,
            rec.prompt_tokens,
            row.prompt_tokens
        );
        // Sent on its time (this machine is shared: a generous bound).
        assert!(
            (rec.start - row.t_s).abs() < 0.5,
            "request {} sent at {} for {}",
            rec.id,
            rec.start,
            row.t_s
        );
    }
}

/// Behind a router, `engine bench --metrics-from` reads the replicas' own counters: summed
/// over them, one timeseries row per replica. Here the load goes to one server and the
/// counters come from it and an idle second one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_sums_the_counters_of_every_metrics_endpoint() {
    let (a, server_a) = spawn_local(config(SchedulerConfig::default()))
        .await
        .unwrap();
    let (b, server_b) = spawn_local(config(SchedulerConfig::default()))
        .await
        .unwrap();
    let mut opts = BenchOptions::new(&format!("http://{a}"), scenario("continuous_batching"));
    opts.overrides = vec![
        "workload.num_requests=4".into(),
        "workload.output_tokens=6".into(),
    ];
    opts.metrics_from = vec![format!("http://{a}"), format!("http://{b}/")];
    opts.scrape_interval = Duration::from_millis(20);
    let r = loadgen::run(&opts).await.unwrap();
    server_a.stop().await;
    server_b.stop().await;
    let c = r.server_counters.expect("both answer /metrics");
    assert_eq!(c.generation_tokens, r.summary.total_output_tokens as f64);
    assert_eq!(c.prompt_tokens, r.summary.total_input_tokens as f64);
    assert_eq!(c.request_success, 4.0);
    let replicas: std::collections::BTreeSet<usize> =
        r.timeseries.iter().map(|p| p.replica).collect();
    assert_eq!(replicas, [0, 1].into(), "one row per endpoint and sample");
    assert!(r
        .timeseries
        .iter()
        .filter(|p| p.replica == 1)
        .all(|p| p.running == 0 && p.prefix_queries == 0));
}

/// Recorded conversations (`scenarios/sharegpt_replay.toml`) replay alike in both drivers
/// when both cut text with the served model's tokenizer: the same requests, the same output
/// lengths, prompts within the server's special tokens, and later turns hitting the prefix
/// cache in the simulator and in the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recorded_conversations_replay_alike_in_both_drivers() {
    let file = scenario("sharegpt_replay");
    // Every first turn (10) and four second turns.
    let first = vec!["workload.num_requests=14".to_string()];
    let tokenizer = tiny_tokenizer();
    let setup = infer_sim::load(&file, &first).unwrap();
    let mut predicted = infer_sim::Rows::default();
    let p = infer_sim::run_with(&setup, tokenizer.clone(), &mut predicted).unwrap();
    predicted.records.sort_by_key(|r| r.id);

    let sched = SchedulerConfig {
        prefix_caching: true,
        ..SchedulerConfig::default()
    };
    let (addr, server) = spawn_local(config(sched)).await.unwrap();
    let mut opts = BenchOptions::new(&format!("http://{addr}"), &file);
    opts.tokenizer = Some(tokenizer);
    opts.overrides = first;
    let measured = loadgen::run(&opts).await.unwrap();
    server.stop().await;
    assert_eq!(predicted.records.len(), 14);
    assert_eq!(measured.records.len(), 14);
    for (p, m) in predicted.records.iter().zip(&measured.records) {
        assert_eq!(p.id, m.id);
        assert!(m.success(), "{m:?}");
        assert_eq!(p.output_tokens, m.output_tokens, "request {}", m.id);
        assert!(
            p.prompt_tokens.abs_diff(m.prompt_tokens) <= 2,
            "request {}: {} vs {}",
            m.id,
            p.prompt_tokens,
            m.prompt_tokens
        );
    }
    assert!(
        p.summary.prefix_cache_hit_rate > 0.05,
        "{}",
        p.summary.prefix_cache_hit_rate
    );
    assert!(
        measured.summary.prefix_cache_hit_rate > 0.05,
        "{}",
        measured.summary.prefix_cache_hit_rate
    );
}

/// `return_tokens_as_token_ids` (vLLM's): every token a logprob entry names, generated,
/// echoed or in a top list, is `token_id:N`, N the very id (the generated ones are the ids a
/// plain request returns as text), in completions and chat alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_name_tokens_by_id_on_request() {
    let (addr, server) = spawn_local(config(SchedulerConfig::default()))
        .await
        .unwrap();
    let client = reqwest::Client::new();
    let completions = format!("http://{addr}/v1/completions");
    let ids: Vec<u32> = (0..12).map(|i| 300 + (i * 37) % 900).collect();
    let ask = |as_ids: bool| {
        json!({"prompt": ids, "max_tokens": 5, "echo": true, "logprobs": 3, "temperature": 0,
               "ignore_eos": true, "return_tokens_as_token_ids": as_ids})
    };
    let (status, by_id) = post(&client, &completions, ask(true)).await;
    assert_eq!(status, 200, "{by_id}");
    let (_, by_text) = post(&client, &completions, ask(false)).await;
    let id_of = |name: &str| -> u32 {
        name.strip_prefix("token_id:")
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{name:?} is not token_id:N"))
    };
    let lp = &by_id["choices"][0]["logprobs"];
    let tokens: Vec<u32> = lp["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| id_of(t.as_str().unwrap()))
        .collect();
    assert_eq!(tokens.len(), 12 + 5);
    assert_eq!(tokens[..12], ids[..], "the echoed prompt, id for id");
    let text_lp = &by_text["choices"][0]["logprobs"];
    assert_eq!(
        lp["token_logprobs"], text_lp["token_logprobs"],
        "only the names change"
    );
    let tokenizer_says = |id: u32| {
        let body = json!({"tokens": [id]});
        let url = format!("http://{addr}/detokenize");
        let client = client.clone();
        async move {
            let (_, v) = post(&client, &url, body).await;
            v["prompt"].as_str().unwrap().to_string()
        }
    };
    for (i, &id) in tokens.iter().enumerate().skip(12) {
        // A token is named by its own text; `/detokenize` drops special tokens, and an id
        // with no text at all is named by its id (random weights sample such ids).
        let (said, name) = (
            tokenizer_says(id).await,
            text_lp["tokens"][i].as_str().unwrap(),
        );
        if said.is_empty() {
            assert!(
                name == format!("token_id:{id}") || name.starts_with("<|"),
                "generated token {i} ({id}): {name:?}"
            );
        } else {
            assert_eq!(said, name, "generated token {i}");
        }
        let top = lp["top_logprobs"][i].as_object().unwrap();
        assert_eq!(top.len(), 3);
        assert!(top.keys().all(|k| id_of(k) < 1 << 20));
        assert!(
            top.contains_key(&format!("token_id:{id}")),
            "greedy: the token is the top"
        );
    }
    let (status, chat) = post(
        &client,
        &format!("http://{addr}/v1/chat/completions"),
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": true,
               "top_logprobs": 2, "temperature": 0, "return_tokens_as_token_ids": true}),
    )
    .await;
    assert_eq!(status, 200, "{chat}");
    for entry in chat["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
    {
        id_of(entry["token"].as_str().unwrap());
        for t in entry["top_logprobs"].as_array().unwrap() {
            id_of(t["token"].as_str().unwrap());
        }
    }
    // A completion's top list always holds the sampled token, as OpenAI's legacy API and
    // vLLM's do: `logprobs: 0` gives it alone. A chat's entries carry their UTF-8 `bytes`.
    let (status, sampled) = post(
        &client,
        &completions,
        json!({"prompt": "The harbour", "max_tokens": 6, "logprobs": 0, "temperature": 1.0,
               "seed": 7, "ignore_eos": true}),
    )
    .await;
    assert_eq!(status, 200, "{sampled}");
    let lp = &sampled["choices"][0]["logprobs"];
    for (i, token) in lp["tokens"].as_array().unwrap().iter().enumerate() {
        let top = lp["top_logprobs"][i].as_object().unwrap();
        assert_eq!(top.len(), 1, "{top:?}");
        assert_eq!(top[token.as_str().unwrap()], lp["token_logprobs"][i]);
    }
    let (_, chat) = post(
        &client,
        &format!("http://{addr}/v1/chat/completions"),
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": true,
               "top_logprobs": 2}),
    )
    .await;
    for entry in chat["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
    {
        let tops = entry["top_logprobs"].as_array().unwrap();
        for e in std::iter::once(entry).chain(tops) {
            let bytes: Vec<u8> = serde_json::from_value(e["bytes"].clone()).unwrap();
            assert_eq!(bytes, e["token"].as_str().unwrap().as_bytes(), "{e}");
        }
    }
    server.stop().await;
}

/// vLLM's `stop_reason`: the stop string or stop token id that ended a choice, null for a
/// length (or end-of-sequence) finish, in responses and in a stream's last chunk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_string_or_token_is_named_as_the_stop_reason() {
    let (addr, server) = spawn_local(config(SchedulerConfig::default()))
        .await
        .unwrap();
    let client = reqwest::Client::new();
    let url = format!("http://{addr}/v1/completions");
    let ask = |extra: Value| {
        let body = json!({"prompt": "The harbour at dawn", "max_tokens": 12, "temperature": 0,
                          "ignore_eos": true, "logprobs": 0,
                          "return_tokens_as_token_ids": true});
        with(body, extra)
    };
    let (status, free) = post(&client, &url, ask(json!({}))).await;
    assert_eq!(status, 200, "{free}");
    assert_eq!(free["choices"][0]["finish_reason"], "length");
    assert_eq!(free["choices"][0]["stop_reason"], Value::Null);
    let ids = token_ids(&free);
    // The fourth token as a stop token: the choice ends there, naming it.
    let (_, v) = post(&client, &url, ask(json!({"stop_token_ids": [ids[3]]}))).await;
    let first = ids.iter().position(|&t| t == ids[3]).unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    assert_eq!(v["choices"][0]["stop_reason"], ids[3], "{v}");
    assert_eq!(v["usage"]["completion_tokens"], first + 1);
    // A stop string from the greedy text, streamed: the last chunk names it.
    let text = {
        let body = json!({"prompt": "The harbour at dawn", "max_tokens": 12, "temperature": 0,
                          "ignore_eos": true});
        let (_, v) = post(&client, &url, body).await;
        v["choices"][0]["text"].as_str().unwrap().to_string()
    };
    let stop: String = text
        .chars()
        .skip(text.chars().count() / 2)
        .take(2)
        .collect();
    let mut body = json!({"prompt": "The harbour at dawn", "max_tokens": 12, "temperature": 0,
                          "ignore_eos": true, "stop": [stop.clone(), "\u{1}never"], "stream": true});
    let (_, chunks) = stream(&client, &url, &body).await;
    let last = chunks
        .iter()
        .rfind(|c| !c["choices"].as_array().unwrap().is_empty())
        .unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "stop", "{last}");
    assert_eq!(last["choices"][0]["stop_reason"], stop.as_str(), "{last}");
    body["stream"] = json!(false);
    let (_, v) = post(&client, &url, body).await;
    assert_eq!(v["choices"][0]["stop_reason"], stop.as_str(), "{v}");
    // A stop string that the last allowed token completes: cut there, and a stop.
    // The shortest ending of the text that appears nowhere before its end.
    let tail = text
        .char_indices()
        .rev()
        .map(|(i, _)| &text[i..])
        .find(|t| text.find(t) == Some(text.len() - t.len()))
        .unwrap()
        .to_string();
    let body = json!({"prompt": "The harbour at dawn", "max_tokens": 12, "temperature": 0,
                      "ignore_eos": true, "stop": [tail.clone()]});
    let (_, v) = post(&client, &url, body).await;
    assert_eq!(
        format!("{}{tail}", v["choices"][0]["text"].as_str().unwrap()),
        text,
        "{tail:?} first completes with the twelfth token"
    );
    assert_eq!(v["usage"]["completion_tokens"], 12);
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    assert_eq!(v["choices"][0]["stop_reason"], tail.as_str(), "{v}");
    server.stop().await;
}

/// `echo` with `logprobs` and `max_tokens: 0` (how evaluation harnesses score a text): the
/// completion is the prompt, its first token has no logprob and every other one has its
/// logprob given the tokens before it — the same whatever follows it (a prefix of the
/// prompt scores its tokens alike) and whether the prompt is in the prefix cache or not
/// (such a request computes every prompt token); nothing generated is returned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_returns_the_prompt_with_the_logprob_of_each_of_its_tokens() {
    let (addr, server) = spawn_local(config(SchedulerConfig::default()))
        .await
        .unwrap();
    let url = format!("http://{addr}/v1/completions");
    let client = reqwest::Client::new();
    let ids: Vec<u32> = (0..40).map(|i| 300 + (i * 37) % 900).collect();
    let score = |prompt: &[u32]| json!({"prompt": prompt, "max_tokens": 0, "echo": true, "logprobs": 2, "temperature": 0});
    let logprobs = |v: &Value| -> Vec<Option<f64>> {
        v["choices"][0]["logprobs"]["token_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(Value::as_f64)
            .collect()
    };
    let (status, whole) = post(&client, &url, score(&ids)).await;
    assert_eq!(status, 200, "{whole}");
    let lps = logprobs(&whole);
    assert_eq!(lps.len(), 40, "one entry per prompt token");
    assert_eq!(lps[0], None, "nothing comes before the first token");
    assert!(lps[1..].iter().all(|l| l.is_some_and(|l| l < 0.0)));
    let lp = &whole["choices"][0]["logprobs"];
    for i in 1..40 {
        let best = lp["top_logprobs"][i]
            .as_object()
            .unwrap()
            .values()
            .filter_map(Value::as_f64)
            .fold(f64::MIN, f64::max);
        assert!(
            best >= lps[i].unwrap() - 1e-6,
            "position {i}: the top is the most likely"
        );
    }
    assert_eq!(whole["usage"]["completion_tokens"], 0);
    assert_eq!(whole["usage"]["prompt_tokens"], 40);
    assert_eq!(whole["choices"][0]["finish_reason"], "length");
    // The same prompt again is in the prefix cache: its logprobs are computed anyway.
    let (_, again) = post(&client, &url, score(&ids)).await;
    assert_eq!(logprobs(&again), lps);
    // A prefix scores its tokens as the whole prompt does.
    let (_, prefix) = post(&client, &url, score(&ids[..17])).await;
    for (i, (a, b)) in logprobs(&prefix).iter().zip(&lps).enumerate().skip(1) {
        assert!(
            (a.unwrap() - b.unwrap()).abs() < 1e-4,
            "position {i}: {a:?} vs {b:?}"
        );
    }
    // echo without logprobs repeats the text before what is generated.
    let text = "The harbour at dawn";
    let (_, plain) = post(
        &client,
        &url,
        json!({"prompt": text, "max_tokens": 3, "echo": true, "temperature": 0, "ignore_eos": true}),
    )
    .await;
    let (_, gen) = post(
        &client,
        &url,
        json!({"prompt": text, "max_tokens": 3, "temperature": 0, "ignore_eos": true}),
    )
    .await;
    assert_eq!(
        plain["choices"][0]["text"].as_str().unwrap(),
        format!("{text}{}", gen["choices"][0]["text"].as_str().unwrap())
    );
    // Chat has no echo here, and max_tokens 0 needs echo.
    let chat = format!("http://{addr}/v1/chat/completions");
    let (status, _) = post(
        &client,
        &chat,
        json!({"messages": [{"role": "user", "content": "hi"}], "echo": true}),
    )
    .await;
    assert_eq!(status, 400);
    let (status, e) = post(&client, &url, json!({"prompt": "x", "max_tokens": 0})).await;
    assert_eq!(
        (status, e["error"]["param"].as_str()),
        (400, Some("max_tokens"))
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_write_run_directories_that_sim_calibrate_can_fit() {
    let (addr, server) = spawn_local(config(SchedulerConfig::default()))
        .await
        .unwrap();
    let out = tempfile::tempdir().unwrap();
    let opts = BenchOptions::new(&format!("http://{addr}"), scenario("baseline"));
    let only = ["single-128".to_string(), "decode-4".to_string()];
    let runs = loadgen::probe::run(&opts, out.path(), &only).await.unwrap();
    assert_eq!(runs.len(), 2);
    for r in &runs {
        assert_eq!(r.summary.failed, 0, "{}", r.name);
        assert!(r.summary.completed >= 4, "{}", r.name);
        // A run directory the simulator can replay: its scenario and its figures.
        let target = infer_sim::fit::load_run_dir(&r.dir.display().to_string(), false).unwrap();
        assert_eq!(target.setup.scenario.name, format!("probe-{}", r.name));
        let base = std::fs::read_to_string(scenario("baseline")).unwrap();
        let base = infer_core::workload::Scenario::parse("baseline", &base, &[]).unwrap();
        assert_eq!(target.setup.scenario.server, base.server, "{}", r.name);
        assert!(target.measured.iter().any(|(m, _)| m == "median_ttft_ms"));
    }
    let e = loadgen::probe::run(&opts, out.path(), &["nope".to_string()])
        .await
        .err()
        .unwrap();
    assert!(e.to_string().contains("unknown probe `nope`"), "{e}");
    server.stop().await;
}

/// `--api-key` as vLLM's: `/v1` wants one of the keys as a bearer token (401 with an
/// OpenAI-style error otherwise), health, metrics and the router endpoints stay open, and
/// `engine bench` sends the key it is given — or says why the server refused it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_key_guards_v1_and_bench_sends_it() {
    let cfg = ServeConfig {
        api_keys: vec!["sk-one".into(), "sk-two".into()],
        ..config(SchedulerConfig::default())
    };
    let (addr, server) = spawn_local(cfg).await.unwrap();
    let base = format!("http://{addr}");
    let client = reqwest::Client::new();
    let body = json!({"prompt": "hello", "max_tokens": 2});
    let url = format!("{base}/v1/completions");
    for auth in [
        None,
        Some("Bearer sk-three"),
        Some("sk-one"),
        Some("Bearer "),
    ] {
        let mut req = client.post(&url).json(&body);
        if let Some(a) = auth {
            req = req.header("authorization", a);
        }
        let r = req.send().await.unwrap();
        assert_eq!(r.status(), 401, "{auth:?}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["code"], 401, "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains("API key"));
    }
    for auth in ["Bearer sk-one", "Bearer sk-two", "bearer sk-one"] {
        let r = client
            .post(&url)
            .header("authorization", auth)
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{auth}");
    }
    let models = client
        .get(format!("{base}/v1/models"))
        .send()
        .await
        .unwrap();
    assert_eq!(models.status(), 401);
    for open in ["/health", "/metrics", "/get_load", "/v1/loads"] {
        let r = client.get(format!("{base}{open}")).send().await.unwrap();
        assert_eq!(r.status(), 200, "{open} needs no key");
    }
    // The one state-changing path outside `/v1` wants the key too.
    let reset = format!("{base}/reset_prefix_cache");
    let r = client.post(&reset).send().await.unwrap();
    assert_eq!(r.status(), 401, "emptying the cache needs a key");
    let r = client
        .post(&reset)
        .header("authorization", "Bearer sk-one")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // Refused before the body is read: a request announcing a body over the 4 MiB limit gets
    // 401, not 413, with only 1 KiB of it sent (a server that waited for the body would never
    // answer). On a raw socket: a client writing the whole body may see the early answer or,
    // as the server closes, a broken pipe, depending on timing.
    {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let head = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n",
            5 << 20
        );
        s.write_all(head.as_bytes()).await.unwrap();
        s.write_all(&[b'x'; 1024]).await.unwrap();
        let mut answer = vec![0u8; 64];
        let n = tokio::time::timeout(std::time::Duration::from_secs(30), s.read(&mut answer))
            .await
            .expect("answered before the body arrived")
            .unwrap();
        let status = String::from_utf8_lossy(&answer[..n]).to_string();
        assert!(status.starts_with("HTTP/1.1 401"), "{status}");
    }

    let mut opts = short_bench(&base, "baseline", 2, 4);
    // Refused, and why: `/v1/models` answers 401, or with `--model` the test request does.
    for (key, model, why) in [
        (None, None, "wants an API key"),
        (Some("sk-wrong"), None, "refused the API key"),
        (
            Some("sk-wrong"),
            Some("builtin:tiny"),
            "refused the API key",
        ),
    ] {
        opts.api_key = key.map(str::to_string);
        opts.model = model.map(str::to_string);
        let e = loadgen::run(&opts).await.err().expect("refused");
        assert!(format!("{e:#}").contains(why), "{key:?} {model:?}: {e:#}");
    }
    opts.api_key = Some("sk-two".into());
    opts.reset_prefix_cache = true;
    let r = loadgen::run(&opts).await.unwrap();
    assert_eq!((r.summary.completed, r.summary.failed), (2, 0));
    server.stop().await;

    let empty = ServeConfig {
        api_keys: vec![String::new()],
        ..config(SchedulerConfig::default())
    };
    let e = spawn_local(empty)
        .await
        .err()
        .expect("an empty key is refused");
    assert!(format!("{e:#}").contains("--api-key"), "{e:#}");
}

/// `engine bench --endpoint /v1/chat/completions`: the scenario's prompts as user messages,
/// which the chat template wraps (the server counts its tokens), timed as completions are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_sends_chats_through_the_chat_endpoint() {
    let (addr, server) = spawn_local(config(SchedulerConfig::default()))
        .await
        .unwrap();
    let mut opts = short_bench(&format!("http://{addr}"), "paged_attention", 3, 4);
    opts.tokenizer = Some(tiny_tokenizer());
    let completions = loadgen::run(&opts).await.unwrap();
    opts.endpoint = loadgen::BenchEndpoint::Chat;
    let chats = loadgen::run(&opts).await.unwrap();
    server.stop().await;
    assert_eq!(chats.summary.completed, 3, "{:?}", chats.failures);
    for (chat, completion) in chats.records.iter().zip(&completions.records) {
        // The same prompt, wrapped in the chat template's tokens, which the server counts.
        assert!(
            chat.prompt_tokens > completion.prompt_tokens,
            "{} vs {}",
            chat.prompt_tokens,
            completion.prompt_tokens
        );
        assert_eq!(chat.output_tokens, 4);
        assert!(chat.ttft.is_some() && chat.itl_mean.is_some());
    }
    // The server's own counters agree with what the chats reported.
    let counters = chats.server_counters.unwrap();
    assert_eq!(counters.generation_tokens as usize, 12);
    assert_eq!(
        counters.prompt_tokens as usize,
        chats.summary.total_input_tokens
    );
}

/// `engine bench --reset-prefix-cache` starts a run from an empty prefix cache: the same
/// prompts benched again find their blocks cached, unless the cache is emptied first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_can_empty_the_prefix_cache_first() {
    let (addr, server) = spawn_local(config(SchedulerConfig::default()))
        .await
        .unwrap();
    let mut opts = short_bench(&format!("http://{addr}"), "paged_attention", 3, 2);
    let hits = |r: &loadgen::BenchResult| r.server_counters.unwrap().prefix_cache_hits;
    let cold = loadgen::run(&opts).await.unwrap();
    let warm = loadgen::run(&opts).await.unwrap();
    opts.reset_prefix_cache = true;
    let reset = loadgen::run(&opts).await.unwrap();
    server.stop().await;
    assert!(
        hits(&warm) > hits(&cold),
        "{} vs {}",
        hits(&warm),
        hits(&cold)
    );
    assert_eq!(hits(&reset), hits(&cold));
}

/// A completions `prompt` may be a batch (texts or token-id lists), as vLLM and the openai
/// client send it, and lm-eval always does: each prompt runs as its own request, its `n`
/// choices numbered after the previous prompt's, the usage summed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_prompts_answers_each_as_its_own_request() {
    let (addr, server) = spawn_local(config(SchedulerConfig::default()))
        .await
        .unwrap();
    let base = format!("http://{addr}");
    let url = format!("{base}/v1/completions");
    let client = reqwest::Client::new();
    let prompts: Vec<Vec<u32>> = [9, 23, 40]
        .iter()
        .map(|&len| (0..len).map(|i| 300 + (i * 37 + len) % 900).collect())
        .collect();
    let greedy = |prompt: Value, n: usize| json!({"prompt": prompt, "max_tokens": 4, "n": n, "temperature": 0, "ignore_eos": true});
    let mut alone = Vec::new();
    for p in &prompts {
        let (status, one) = post(&client, &url, greedy(json!(p), 1)).await;
        assert_eq!(status, 200, "{one}");
        alone.push(one["choices"][0]["text"].as_str().unwrap().to_string());
    }
    let (status, batch) = post(&client, &url, greedy(json!(prompts), 2)).await;
    assert_eq!(status, 200, "{batch}");
    let choices = batch["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 6, "{batch}");
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i, "in index order");
        assert_eq!(c["text"], alone[i / 2], "choice {i} is prompt {}'s", i / 2);
    }
    let u = &batch["usage"];
    assert_eq!(
        u["prompt_tokens"],
        9 + 23 + 40,
        "each prompt counted once: {u}"
    );
    assert_eq!(u["completion_tokens"], 6 * 4, "{u}");
    // Texts too, the openai client's `prompt=[...]`.
    let texts = json!(["The harbour at dawn", "A long story"]);
    let (status, by_text) = post(&client, &url, greedy(texts.clone(), 1)).await;
    assert_eq!(status, 200, "{by_text}");
    for (i, t) in ["The harbour at dawn", "A long story"].iter().enumerate() {
        let (_, one) = post(&client, &url, greedy(json!(t), 1)).await;
        assert_eq!(by_text["choices"][i]["text"], one["choices"][0]["text"]);
    }
    // Streamed: the choices interleave, each whole and finished once, then the usage.
    let mut streamed = greedy(json!(prompts), 2);
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let (text, chunks) = stream(&client, &url, &streamed).await;
    let mut got = vec![String::new(); 6];
    let mut finished = vec![0; 6];
    for c in chunks.iter().filter_map(|c| c["choices"].get(0)) {
        let i = c["index"].as_u64().unwrap() as usize;
        got[i].push_str(c["text"].as_str().unwrap());
        finished[i] += c["finish_reason"].is_string() as usize;
    }
    assert_eq!(finished, vec![1; 6], "{text}");
    for (i, g) in got.iter().enumerate() {
        assert_eq!(g, &alone[i / 2], "streamed choice {i}");
    }
    assert_eq!(chunks.last().unwrap()["usage"], batch["usage"]);
    // lm-eval's scoring request: token-id prompts, echo, one logprob, one token.
    let score = |prompt: Value| json!({"prompt": prompt, "max_tokens": 1, "echo": true, "logprobs": 1, "temperature": 0});
    let (status, scored) = post(&client, &url, score(json!(prompts))).await;
    assert_eq!(status, 200, "{scored}");
    for (i, p) in prompts.iter().enumerate() {
        let (_, one) = post(&client, &url, score(json!(p))).await;
        let (lp, lp_one) = (
            &scored["choices"][i]["logprobs"],
            &one["choices"][0]["logprobs"],
        );
        let values = |v: &Value| -> Vec<f64> {
            v["token_logprobs"]
                .as_array()
                .unwrap()
                .iter()
                .skip(1)
                .map(|x| x.as_f64().unwrap())
                .collect()
        };
        assert_eq!(
            values(lp).len(),
            p.len(),
            "prompt {i}: its tokens and the one generated"
        );
        for (a, b) in values(lp).iter().zip(values(lp_one)) {
            assert!((a - b).abs() < 1e-4, "prompt {i}: {a} vs {b}");
        }
        // `text_offset`: where each token starts in the choice's text, as vLLM counts it.
        let tokens = lp["tokens"].as_array().unwrap();
        let offsets: Vec<u64> = lp["text_offset"]
            .as_array()
            .unwrap()
            .iter()
            .map(|o| o.as_u64().unwrap())
            .collect();
        let mut at = 0;
        for (t, &o) in tokens.iter().zip(&offsets) {
            assert_eq!(o, at, "prompt {i}: {lp}");
            at += t.as_str().unwrap().chars().count() as u64;
        }
        assert_eq!(offsets.len(), tokens.len());
    }
    // Mistakes name the prompt; nothing of a refused batch runs.
    let too_long = json!([
        [5, 6],
        (0..5000).map(|i| 300 + i % 900).collect::<Vec<u32>>()
    ]);
    let (status, e) = post(&client, &url, greedy(too_long, 1)).await;
    assert_eq!(status, 400, "{e}");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("prompt[1]: "),
        "{e}"
    );
    let many = json!(vec!["a"; 5]);
    let (status, e) = post(&client, &url, greedy(many, 64)).await;
    assert_eq!(
        (status, e["error"]["param"].as_str()),
        (400, Some("prompt")),
        "{e}"
    );
    assert_eq!(
        metric(&client, &base, "vllm:num_requests_running").await
            + metric(&client, &base, "vllm:num_requests_waiting").await,
        0.0
    );
    server.stop().await;
}

/// What vLLM serves and clients call beside generation (`/version`, `/ping`,
/// `/v1/models/{id}`, `/tokenizer_info`), its refusals in its words, usage on every chunk,
/// and `/get_load` in SGLang's form for sglang-router.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_endpoints_checks_and_sglang_loads() {
    let cfg = ServeConfig {
        load_format: infer_engine::server::LoadFormat::Sglang,
        ..config(SchedulerConfig::default())
    };
    let (addr, server) = spawn_local(cfg).await.unwrap();
    let base = format!("http://{addr}");
    let client = reqwest::Client::new();
    let get = |path: &str| get_json(&client, format!("{base}{path}"));
    let (status, v) = get("/version").await;
    assert_eq!(
        (status, v["version"].as_str()),
        (200, Some(env!("CARGO_PKG_VERSION")))
    );
    assert_eq!(get("/ping").await.0, 200);
    let ping = client.post(format!("{base}/ping")).send().await.unwrap();
    assert_eq!(ping.status(), 200);
    let (status, card) = get("/v1/models/builtin:tiny").await;
    assert_eq!(
        (status, card["id"].as_str()),
        (200, Some("builtin:tiny")),
        "{card}"
    );
    assert_eq!(card, get("/v1/models").await.1["data"][0]);
    let (status, e) = get("/v1/models/gpt-4").await;
    assert_eq!(
        (status, e["error"]["param"].as_str()),
        (404, Some("model")),
        "{e}"
    );
    // What lm-eval's remote tokenizer reads.
    let (status, info) = get("/tokenizer_info").await;
    assert_eq!(status, 200);
    assert_eq!(info["eos_token"], "<|eot_id|>", "{info}");
    assert_eq!(info["bos_token"], "<|begin_of_text|>", "{info}");
    assert!(info["chat_template"]
        .as_str()
        .is_some_and(|t| t.contains("messages")));
    // vLLM's refusals, with its messages.
    let url = format!("{base}/v1/completions");
    let chat = format!("{base}/v1/chat/completions");
    let (status, e) = post(
        &client,
        &url,
        json!({"prompt": "x", "stream_options": {"include_usage": true}}),
    )
    .await;
    assert_eq!(status, 400);
    assert_eq!(
        e["error"]["message"],
        "Stream options can only be defined when `stream=True`."
    );
    let (status, e) = post(
        &client,
        &chat,
        json!({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}),
    )
    .await;
    assert_eq!(
        (status, e["error"]["param"].as_str()),
        (400, Some("top_logprobs"))
    );
    // continuous_usage_stats: each chunk says its choice's tokens so far.
    let body = json!({"prompt": "The harbour", "max_tokens": 5, "ignore_eos": true,
                      "stream": true, "stream_options": {"include_usage": true,
                      "continuous_usage_stats": true}});
    let (text, chunks) = stream(&client, &url, &body).await;
    let running: Vec<u64> = chunks
        .iter()
        .filter(|c| !c["choices"].as_array().unwrap().is_empty())
        .map(|c| c["usage"]["completion_tokens"].as_u64().unwrap())
        .collect();
    assert_eq!(running, vec![1, 2, 3, 4, 5], "{text}");
    let prompt_tokens = chunks.last().unwrap()["usage"]["prompt_tokens"].clone();
    assert!(chunks
        .iter()
        .all(|c| c["usage"]["prompt_tokens"] == prompt_tokens));
    // SGLang's /get_load: a list per data-parallel rank; /v1/loads keeps its object.
    let (_, idle) = get("/get_load").await;
    assert_eq!(
        idle,
        json!([{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}])
    );
    let body =
        json!({"prompt": "A long story", "max_tokens": 3000, "ignore_eos": true, "stream": true});
    let mut resp = client.post(&url).json(&body).send().await.unwrap();
    resp.chunk().await.unwrap().unwrap();
    let (_, busy) = get("/get_load").await;
    assert_eq!(busy[0]["num_reqs"], 1, "{busy}");
    let tokens = busy[0]["num_tokens"].as_u64().unwrap();
    assert!(tokens >= 16, "the KV tokens held: {busy}");
    assert_eq!(
        get("/v1/loads").await.1["aggregate"]["total_tokens"],
        tokens
    );
    drop(resp);
    server.stop().await;
}

/// Structured output end to end: sampled JSON always validates against its schema; a
/// grammar that allows any text changes no greedy token; forced tool calls come back as
/// `tool_calls`, streamed as generated; choices, and every malformed or unsupported ask a
/// 400 naming its field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn structured_output_follows_its_grammar_and_changes_nothing_it_allows() {
    let (addr, server) = spawn_local(ServeConfig {
        compact_json: true,
        ..config(SchedulerConfig::default())
    })
    .await
    .unwrap();
    let base = format!("http://{addr}");
    let client = reqwest::Client::new();
    let chat = format!("{base}/v1/chat/completions");
    let completions = format!("{base}/v1/completions");
    let user = |text: &str| json!([{"role": "user", "content": text}]);

    // Sampled (temperature 1, a seed each): every output parses and validates.
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 10},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["admin", "user", "guest"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3}
        },
        "required": ["name", "age", "role", "tags"],
        "additionalProperties": false
    });
    for seed in 0..12 {
        let body = json!({"messages": user("A person, please."), "max_tokens": 120,
            "temperature": 1.0, "seed": seed,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "person", "schema": schema, "strict": true}}});
        let (status, v) = post(&client, &chat, body).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
        let text = v["choices"][0]["message"]["content"].as_str().unwrap();
        let p: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        let o = p.as_object().unwrap();
        assert_eq!(o.len(), 4, "{text}");
        assert!(p["name"].as_str().unwrap().chars().count() <= 10, "{text}");
        assert!((0..=120).contains(&p["age"].as_i64().unwrap()), "{text}");
        assert!(
            ["admin", "user", "guest"].contains(&p["role"].as_str().unwrap()),
            "{text}"
        );
        let tags = p["tags"].as_array().unwrap();
        assert!(
            tags.len() <= 3
                && tags
                    .iter()
                    .all(|t| t.as_str().unwrap().chars().count() <= 5)
        );
    }

    // A grammar that allows any text and every token without text (builtin:tiny's five
    // special tokens, ids 0-4, and the ids past its tokenizer's vocabulary up to the 4,096
    // logits: a random model picks those too): greedy output is the unconstrained one,
    // token for token. Only right if every token's bytes are (the text lexeme is matched
    // on them).
    let dir = infer_engine::tools::builtin::resolve("builtin:tiny").unwrap();
    let words = infer_engine::runtime::tokenizer::TextTokenizer::from_dir(&dir)
        .unwrap()
        .vocab_size();
    let any_text = format!("start: (TEXT | <[0-4,{words}-4095]>)*\nTEXT: /(.|\\n)+/");
    for prompt in ["The harbour at dawn", "Once upon", "1, 2, 3,", "{\"a\":"] {
        let body = |structured: bool| {
            let mut b = json!({"prompt": prompt, "max_tokens": 40, "temperature": 0,
                               "logprobs": 0});
            if structured {
                b["structured_outputs"] = json!({"grammar": any_text.clone()});
            }
            b
        };
        let (_, free) = post(&client, &completions, body(false)).await;
        let (_, constrained) = post(&client, &completions, body(true)).await;
        assert_eq!(
            free["choices"][0]["logprobs"]["tokens"],
            constrained["choices"][0]["logprobs"]["tokens"],
            "{prompt:?}"
        );
        assert_eq!(
            free["choices"][0]["text"],
            constrained["choices"][0]["text"]
        );
    }

    // One of the choices, exactly.
    let (_, v) = post(
        &client,
        &completions,
        json!({"prompt": "Colour:", "max_tokens": 10,
        "temperature": 1.0, "seed": 3, "structured_outputs": {"choice": ["red", "green", "blue"]}}),
    )
    .await;
    assert!(
        ["red", "green", "blue"].contains(&v["choices"][0]["text"].as_str().unwrap()),
        "{v}"
    );

    // Forced tool calls.
    let tools = json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "get_time", "parameters": {
            "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"], "additionalProperties": false}}}
    ]);
    let body = |choice: Value, stream: bool| {
        json!({"messages": user("Weather in Oslo?"), "max_tokens": 80, "temperature": 0,
               "tools": tools, "tool_choice": choice, "stream": stream})
    };
    let (status, v) = post(&client, &chat, body(json!("required"), false)).await;
    assert_eq!(status, 200, "{v}");
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    let calls = choice["message"]["tool_calls"].as_array().unwrap();
    assert!(!calls.is_empty());
    for c in calls {
        assert_eq!(c["type"], "function");
        assert!(c["id"].as_str().unwrap().starts_with("chatcmpl-tool-"));
        let name = c["function"]["name"].as_str().unwrap();
        assert!(["get_weather", "get_time"].contains(&name), "{v}");
        let args: Value =
            serde_json::from_str(c["function"]["arguments"].as_str().unwrap()).unwrap();
        assert!(
            args.get(if name == "get_weather" {
                "city"
            } else {
                "zone"
            })
            .is_some(),
            "{v}"
        );
    }
    let named = json!({"type": "function", "function": {"name": "get_time"}});
    let (_, v) = post(&client, &chat, body(named.clone(), false)).await;
    let call = &v["choices"][0]["message"]["tool_calls"][0];
    assert_eq!(call["function"]["name"], "get_time", "{v}");
    let args = call["function"]["arguments"].as_str().unwrap().to_string();
    let zone: Value = serde_json::from_str(&args).unwrap();
    assert!(zone["zone"] == "UTC" || zone["zone"] == "CET", "{v}");
    // Streamed, the arguments arrive as they are generated and add up to the same call.
    let (_, chunks) = stream(&client, &chat, &body(named, true)).await;
    let first = &chunks[0]["choices"][0]["delta"]["tool_calls"][0];
    assert_eq!(first["function"]["name"], "get_time");
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"].as_str())
        .collect();
    assert_eq!(streamed, args);
    // `required` streams its calls whole, at the end.
    let (_, chunks) = stream(&client, &chat, &body(json!("required"), true)).await;
    let last = chunks
        .iter()
        .rev()
        .find(|c| !c["choices"][0].is_null())
        .unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "tool_calls", "{last}");
    assert_eq!(
        last["choices"][0]["delta"]["tool_calls"]
            .as_array()
            .map(Vec::len),
        Some(calls.len())
    );

    // Refusals, each naming its field.
    let cases = [
        (
            json!({"prompt": "x", "structured_outputs": {"regex": "("}}),
            "structured_outputs",
        ),
        (
            json!({"prompt": "x", "structured_outputs": {"grammar": "start: nope"}}),
            "structured_outputs",
        ),
        (
            json!({"prompt": "x", "response_format": {"type": "json_object"}, "ignore_eos": true}),
            "ignore_eos",
        ),
        (json!({"prompt": "x", "tools": tools}), "tools"),
        (
            json!({"messages": user("x"), "tools": tools}),
            "tool_choice",
        ),
    ];
    for (body, param) in cases {
        let url = if body.get("messages").is_some() {
            &chat
        } else {
            &completions
        };
        let (status, v) = post(&client, url, body.clone()).await;
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], param, "{body}: {v}");
    }
    // The server goes on serving.
    let (status, _) = post(
        &client,
        &completions,
        json!({"prompt": "x", "max_tokens": 2}),
    )
    .await;
    assert_eq!(status, 200);
    server.stop().await;
}

/// A model whose `generation_config.json` recommends sampling parameters is served with them
/// where a request leaves them out, as vLLM serves it (`--generation-config auto`): here
/// temperature 0, so requests with different seeds answer alike; with the API's own
/// defaults (`--generation-config vllm`) they sample at temperature 1 and differ. Its
/// `max_new_tokens`, past the room a chat's prompt leaves, caps the chat at that room
/// rather than refusing it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_models_generation_config_sets_the_sampling_defaults() {
    use infer_engine::runtime::model::Arch;
    use infer_engine::tools::make_model::{make_model, ModelSpec};
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("llama");
    make_model(&ModelSpec::new(Arch::Llama), &dir).unwrap();
    let path = dir.join("generation_config.json");
    let mut gen: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    gen["temperature"] = json!(0.0);
    gen["max_new_tokens"] = json!(100_000);
    std::fs::write(&path, gen.to_string()).unwrap();
    let mut texts = Vec::new();
    for model_defaults in [true, false] {
        let (addr, server) = spawn_local(ServeConfig {
            model_sampling_defaults: model_defaults,
            sched: SchedulerConfig {
                max_model_len: 96,
                ..SchedulerConfig::default()
            },
            ..ServeConfig::new(dir.to_str().unwrap())
        })
        .await
        .unwrap();
        let client = reqwest::Client::new();
        let mut answers = Vec::new();
        for seed in [1, 2, 3] {
            let (status, r) = post(
                &client,
                &format!("http://{addr}/v1/completions"),
                json!({"prompt": "The harbour", "max_tokens": 12, "seed": seed, "ignore_eos": true}),
            )
            .await;
            assert_eq!(status, 200, "{r}");
            answers.push(r["choices"][0]["text"].as_str().unwrap().to_string());
        }
        texts.push(answers);
        let (status, r) = post(
            &client,
            &format!("http://{addr}/v1/chat/completions"),
            json!({"messages": [{"role": "user", "content": "Hi"}], "ignore_eos": true}),
        )
        .await;
        assert_eq!(status, 200, "{r}");
        let usage = &r["usage"];
        assert_eq!(
            usage["prompt_tokens"].as_u64().unwrap() + usage["completion_tokens"].as_u64().unwrap(),
            96,
            "{r}"
        );
        server.stop().await;
    }
    assert!(
        texts[0].iter().all(|t| t == &texts[0][0]),
        "greedy: {:?}",
        texts[0]
    );
    assert!(
        texts[1].iter().any(|t| t != &texts[1][0]),
        "sampled: {:?}",
        texts[1]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_max_model_len_past_the_models_context_is_refused_unless_defaulted() {
    use infer_engine::runtime::model::Arch;
    use infer_engine::tools::make_model::{make_model, ModelSpec};
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("llama");
    let spec = ModelSpec::new(Arch::Llama);
    make_model(&spec, &dir).unwrap();
    let asked = |max_model_len_is_default| ServeConfig {
        max_model_len_is_default,
        sched: SchedulerConfig {
            max_model_len: 2 * spec.max_pos,
            ..SchedulerConfig::default()
        },
        ..ServeConfig::new(dir.to_str().unwrap())
    };
    let err = match spawn_local(asked(false)).await {
        Ok(_) => panic!("a --max-model-len of twice the model's context was served"),
        Err(e) => format!("{e:#}"),
    };
    let expected = format!(
        "--max-model-len {} is longer than the model's context of {} tokens",
        2 * spec.max_pos,
        spec.max_pos
    );
    assert!(err.contains(&expected), "{err}");
    // Left at its default, the length is lowered to the model's context and said so.
    let (addr, server) = spawn_local(asked(true)).await.unwrap();
    let (status, models) =
        get_json(&reqwest::Client::new(), format!("http://{addr}/v1/models")).await;
    assert_eq!(status, 200, "{models}");
    assert_eq!(
        models["data"][0]["max_model_len"],
        json!(spec.max_pos),
        "{models}"
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_template_flag_renders_every_chat_in_place_of_the_models() {
    // As `--chat-template` hands it over: one line, with escaped newlines (main.rs reads the
    // flag; `chat_template_arg` is unit-tested).
    let template = infer_engine::runtime::tokenizer::chat_template_arg(
        r"{% for m in messages %}<{{ m.role }}> {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}{% if note is defined %}{{ note }}{% endif %}",
    )
    .unwrap();
    let (addr, server) = spawn_local(ServeConfig {
        chat_template: Some(template),
        ..ServeConfig::new("builtin:tiny")
    })
    .await
    .unwrap();
    let client = reqwest::Client::new();
    let base = format!("http://{addr}");
    let rendered = "<user> Tell me about the lighthouse\n<assistant>";
    let (_, expected) = post(
        &client,
        &format!("{base}/tokenize"),
        json!({"prompt": rendered, "add_special_tokens": false}),
    )
    .await;
    let messages = json!([{"role": "user", "content": "Tell me about the lighthouse"}]);
    // With tools too: the flag's template replaces the model's tool_use one as well.
    let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {}}}]);
    for body in [
        json!({"messages": messages}),
        json!({"messages": messages, "tools": tools}),
    ] {
        let (status, got) = post(&client, &format!("{base}/tokenize"), body).await;
        assert_eq!(status, 200, "{got}");
        assert_eq!(got["tokens"], expected["tokens"], "{got} vs {expected}");
    }
    // A request's template variables and a continued last message, in generation too.
    let tokenize = |body: Value| {
        let client = client.clone();
        let url = format!("{base}/tokenize");
        async move { post(&client, &url, body).await }
    };
    let (_, noted) =
        tokenize(json!({"prompt": format!("{rendered}[x]"), "add_special_tokens": false})).await;
    let (status, got) =
        tokenize(json!({"messages": messages, "chat_template_kwargs": {"note": "[x]"}})).await;
    assert_eq!(status, 200, "{got}");
    assert_eq!(got["tokens"], noted["tokens"], "{got}");
    let continued = json!([{"role": "user", "content": "Tell me about the lighthouse"},
                           {"role": "assistant", "content": "The lighthouse"}]);
    let (_, cut) = tokenize(json!({"prompt": "<user> Tell me about the lighthouse\n<assistant> The lighthouse", "add_special_tokens": false})).await;
    let body = json!({"messages": continued, "add_generation_prompt": false,
                      "continue_final_message": true});
    let (_, got) = tokenize(body.clone()).await;
    assert_eq!(got["tokens"], cut["tokens"], "{got}");
    let mut generate = body;
    generate["max_tokens"] = json!(3);
    let (status, v) = post(&client, &format!("{base}/v1/chat/completions"), generate).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], cut["count"], "{v}");
    let (_, info) = get_json(&client, format!("{base}/tokenizer_info")).await;
    assert!(
        info["chat_template"]
            .as_str()
            .unwrap()
            .starts_with("{% for m in"),
        "{info}"
    );
    server.stop().await;
    let broken = ServeConfig {
        chat_template: Some("{% for m in messages %}".into()),
        ..ServeConfig::new("builtin:tiny")
    };
    let err = match spawn_local(broken).await {
        Ok(_) => panic!("an unclosed template was served"),
        Err(e) => format!("{e:#}"),
    };
    assert!(err.contains("invalid --chat-template"), "{err}");
}

/// `tool_choice: "auto"` with a tool-call parser: an output holding calls in the model's
/// format is answered as `tool_calls` (the text before them as content), one without as
/// content, and a stream adds up to the same message. A random model writes no calls of
/// its own, so a regex makes it write these outputs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_tool_choice_answers_the_calls_the_parser_finds() {
    use infer_engine::server::tool_parser::ToolCallParser;
    let tools = json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}},
        {"type": "function", "function": {"name": "get_time", "parameters": {
            "type": "object", "properties": {"zone": {"type": "string"}}}}}
    ]);
    let hermes = r#"Checking\. <tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Oslo"\}\}\n</tool_call><tool_call>\{"name":"get_time","arguments":\{\}\}</tool_call>"#;
    let llama = r#"\{"name": "get_time", "parameters": \{"zone": "UTC"\}\}"#;
    let pythonic = r#"\[get_time\(zone="UTC"\), get_weather\(city='Oslo', days=\[1, 2\]\)\]"#;
    let mistral =
        r#"Sure\. \[TOOL_CALLS\]\[\{"name": "get_time", "arguments": \{"zone": "CET"\}\}\]"#;
    // Each value typed by the request's tool: `days` an integer, `city` a string.
    let qwen3_coder = r"<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>";
    let cases = [
        (
            ToolCallParser::Hermes,
            hermes,
            Value::from("Checking. "),
            vec![("get_weather", r#"{"city": "Oslo"}"#), ("get_time", "{}")],
        ),
        (
            ToolCallParser::Llama3Json,
            llama,
            Value::Null,
            vec![("get_time", r#"{"zone": "UTC"}"#)],
        ),
        (
            ToolCallParser::Pythonic,
            pythonic,
            Value::Null,
            vec![
                ("get_time", r#"{"zone": "UTC"}"#),
                ("get_weather", r#"{"city": "Oslo", "days": [1, 2]}"#),
            ],
        ),
        (
            ToolCallParser::Mistral,
            mistral,
            Value::from("Sure. "),
            vec![("get_time", r#"{"zone": "CET"}"#)],
        ),
        (
            ToolCallParser::Qwen3Coder,
            qwen3_coder,
            Value::Null,
            vec![("get_weather", r#"{"city": "42", "days": 3}"#)],
        ),
        (
            ToolCallParser::Hermes,
            r"Sunny\.",
            Value::from("Sunny."),
            vec![],
        ),
        (
            ToolCallParser::Llama3Json,
            r"\{Sunny\}",
            Value::from("{Sunny}"),
            vec![],
        ),
    ];
    for (parser, regex, content, expected) in cases {
        let (addr, server) = spawn_local(ServeConfig {
            tool_call_parser: Some(parser),
            ..ServeConfig::new("builtin:tiny")
        })
        .await
        .unwrap();
        let client = reqwest::Client::new();
        let chat = format!("http://{addr}/v1/chat/completions");
        let body = |stream: bool| {
            json!({"messages": [{"role": "user", "content": "Weather in Oslo?"}],
                   "tools": tools, "max_tokens": 100, "temperature": 0, "stream": stream,
                   "structured_outputs": {"regex": regex}})
        };
        let (status, v) = post(&client, &chat, body(false)).await;
        assert_eq!(status, 200, "{v}");
        let message = &v["choices"][0]["message"];
        assert_eq!(message["content"], content, "{parser:?}: {v}");
        let calls: Vec<(String, String)> = message["tool_calls"]
            .as_array()
            .map(|calls| {
                calls
                    .iter()
                    .map(|c| {
                        let id = c["id"].as_str().unwrap();
                        if parser == ToolCallParser::Mistral {
                            // Mistral's templates take back nothing else.
                            assert!(
                                id.len() == 9 && id.chars().all(|c| c.is_ascii_alphanumeric()),
                                "{id}"
                            );
                        } else {
                            assert!(id.starts_with("chatcmpl-tool-"), "{id}");
                        }
                        assert_eq!(c["type"], "function");
                        let f = &c["function"];
                        (
                            f["name"].as_str().unwrap().into(),
                            f["arguments"].as_str().unwrap().into(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        let want: Vec<(String, String)> = expected
            .iter()
            .map(|(n, a)| (n.to_string(), a.to_string()))
            .collect();
        assert_eq!(calls, want, "{parser:?}: {v}");
        let reason = if want.is_empty() {
            "stop"
        } else {
            "tool_calls"
        };
        assert_eq!(v["choices"][0]["finish_reason"], reason, "{v}");

        // Streamed: the content as it comes, each call once it has a name and its arguments
        // have begun, then its arguments piece by piece (Qwen3-Coder's a parameter at a
        // time).
        let (_, chunks) = stream(&client, &chat, &body(true)).await;
        let deltas: Vec<&Value> = chunks
            .iter()
            .filter(|c| !c["choices"][0].is_null())
            .map(|c| &c["choices"][0]["delta"])
            .collect();
        let streamed: String = deltas
            .iter()
            .filter_map(|d| d["content"].as_str())
            .collect();
        assert_eq!(
            streamed,
            content.as_str().unwrap_or(""),
            "{parser:?}: {chunks:?}"
        );
        let mut streamed_calls: Vec<(String, String)> = Vec::new();
        let mut chunks_with_calls = 0;
        for entries in deltas.iter().filter_map(|d| d["tool_calls"].as_array()) {
            chunks_with_calls += 1;
            for c in entries {
                let i = c["index"].as_u64().unwrap() as usize;
                let f = &c["function"];
                if i == streamed_calls.len() {
                    assert!(c["id"].is_string(), "{c}");
                    streamed_calls.push((f["name"].as_str().unwrap().into(), String::new()));
                }
                streamed_calls[i]
                    .1
                    .push_str(f["arguments"].as_str().unwrap());
            }
        }
        assert_eq!(streamed_calls, want, "{chunks:?}");
        // Each call in a chunk of its own at least, and its arguments over more.
        let least = want.len() + usize::from(!want.is_empty());
        assert!(chunks_with_calls >= least, "{parser:?}: {chunks:?}");
        let last = chunks
            .iter()
            .rev()
            .find(|c| !c["choices"][0].is_null())
            .unwrap();
        assert_eq!(last["choices"][0]["finish_reason"], reason, "{last}");
        // parallel_tool_calls: false answers the first call only.
        if want.len() > 1 {
            let mut one = body(false);
            one["parallel_tool_calls"] = json!(false);
            let (_, v) = post(&client, &chat, one).await;
            let calls = v["choices"][0]["message"]["tool_calls"].as_array().unwrap();
            assert_eq!(calls.len(), 1, "{v}");
            assert_eq!(calls[0]["function"]["name"], want[0].0.as_str(), "{v}");
        }
        server.stop().await;
    }
}

/// `min_tokens` as vLLM serves it: the stop tokens (and end of sequence) cannot be sampled
/// before that many tokens are out, and a stop string counts only once more are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn min_tokens_and_include_stop_str_in_output_as_vllm_serves_them() {
    let (addr, server) = spawn_local(config(SchedulerConfig::default()))
        .await
        .unwrap();
    let client = reqwest::Client::new();
    let url = format!("http://{addr}/v1/completions");
    let ask = |extra: Value| {
        let body = json!({"prompt": "The harbour", "max_tokens": 12, "temperature": 0,
                          "logprobs": 0, "return_tokens_as_token_ids": true});
        with(body, extra)
    };
    let ids = token_ids;
    let (status, free) = post(&client, &url, ask(json!({"ignore_eos": true}))).await;
    assert_eq!(status, 200, "{free}");
    let first = ids(&free)[0];
    // The greedy first token as a stop token ends the output at once...
    let (_, stopped) = post(&client, &url, ask(json!({"stop_token_ids": [first]}))).await;
    assert_eq!(stopped["choices"][0]["stop_reason"], first, "{stopped}");
    assert_eq!(stopped["usage"]["completion_tokens"], 1, "{stopped}");
    // ...and with min_tokens it cannot be sampled until 6 tokens are out.
    let (status, held) = post(
        &client,
        &url,
        ask(json!({"stop_token_ids": [first], "min_tokens": 6})),
    )
    .await;
    assert_eq!(status, 200, "{held}");
    let tokens = ids(&held);
    assert!(tokens.len() >= 6, "{held}");
    assert!(!tokens[..6].contains(&first), "{tokens:?}");
    // A stop string made of the first token's text ends nothing until more than
    // min_tokens (4) tokens are out.
    let text = free["choices"][0]["text"].as_str().unwrap();
    let (_, one) = post(
        &client,
        &format!("http://{addr}/detokenize"),
        json!({"tokens": [first]}),
    )
    .await;
    let stop = one["prompt"].as_str().unwrap().to_string();
    assert!(text.starts_with(&stop), "{text:?} {stop:?}");
    let (_, cut) = post(
        &client,
        &url,
        ask(json!({"stop": [stop], "ignore_eos": true})),
    )
    .await;
    assert_eq!(cut["choices"][0]["text"], "", "{cut}");
    let (_, late) = post(
        &client,
        &url,
        ask(json!({"stop": [stop], "ignore_eos": true, "min_tokens": 4})),
    )
    .await;
    // include_stop_str_in_output: the output ends with the stop string, not before it.
    let (_, kept) = post(
        &client,
        &url,
        ask(json!({"stop": [stop], "ignore_eos": true, "include_stop_str_in_output": true})),
    )
    .await;
    assert_eq!(kept["choices"][0]["text"], stop.as_str(), "{kept}");
    assert_eq!(kept["choices"][0]["stop_reason"], stop.as_str(), "{kept}");
    // ...and a stop token's own text, which is otherwise dropped.
    let (_, kept) = post(
        &client,
        &url,
        ask(json!({"stop_token_ids": [first], "include_stop_str_in_output": true})),
    )
    .await;
    assert_eq!(kept["choices"][0]["text"], stop.as_str(), "{kept}");
    assert_eq!(stopped["choices"][0]["text"], "", "{stopped}");
    let late_tokens = ids(&late);
    assert!(late_tokens.len() >= 4, "{late}");
    assert_eq!(
        late_tokens[..4],
        ids(&free)[..4],
        "greedy, nothing held back: {late}"
    );
    // Refused as vLLM refuses them.
    for (extra, needle) in [
        (
            json!({"min_tokens": 13}),
            "less than or equal to max_tokens=12",
        ),
        (
            json!({"min_tokens": 2, "structured_outputs": {"regex": "a+"}}),
            "structured output",
        ),
        (json!({"min_tokens": -1}), "min_tokens"),
    ] {
        let (status, v) = post(&client, &url, ask(extra.clone())).await;
        assert_eq!(status, 400, "{extra}: {v}");
        assert_eq!(v["error"]["param"], "min_tokens", "{extra}: {v}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains(needle),
            "{v}"
        );
    }
    server.stop().await;
}

/// vLLM's `prompt_logprobs`: per prompt token its logprob (the echoed prompt's, as
/// `echo` scores it), rank and text, with the most likely alternatives; on every choice of
/// a completion, at the top of a chat's response; refused with `stream`, as vLLM does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_logprobs_score_the_prompt_as_vllm_answers_them() {
    let (addr, server) = spawn_local(config(SchedulerConfig::default()))
        .await
        .unwrap();
    let client = reqwest::Client::new();
    let completions = format!("http://{addr}/v1/completions");
    let body = json!({"prompt": "The harbour at dawn was quiet", "max_tokens": 1, "n": 2,
                      "echo": true, "logprobs": 0, "prompt_logprobs": 2, "temperature": 0});
    let (status, v) = post(&client, &completions, body).await;
    assert_eq!(status, 200, "{v}");
    let prompt_tokens = v["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
    let echoed = &v["choices"][0]["logprobs"];
    for choice in v["choices"].as_array().unwrap() {
        let scored = choice["prompt_logprobs"].as_array().unwrap();
        assert_eq!(scored.len(), prompt_tokens, "{v}");
        assert!(scored[0].is_null());
        for (i, position) in scored.iter().enumerate().skip(1) {
            let entries = position.as_object().unwrap();
            // The prompt's own token first, then at most 2 alternatives.
            let (own_id, own) = entries.iter().next().unwrap();
            assert!(entries.len() <= 3, "{position}");
            let logprob = own["logprob"].as_f64().unwrap();
            let echo_lp = echoed["token_logprobs"][i].as_f64().unwrap();
            assert!(
                (logprob - echo_lp).abs() < 1e-6,
                "{i}: {logprob} vs {echo_lp}"
            );
            let (_, alone) = post(
                &client,
                &format!("http://{addr}/detokenize"),
                json!({"tokens": [own_id.parse::<u32>().unwrap()]}),
            )
            .await;
            assert_eq!(own["decoded_token"], alone["prompt"], "{i}");
            let rank = own["rank"].as_u64().unwrap();
            let best = entries
                .values()
                .map(|e| e["logprob"].as_f64().unwrap())
                .fold(f64::NEG_INFINITY, f64::max);
            assert_eq!(rank == 1, logprob >= best, "{i}: {position}");
            let mut alternatives: Vec<u64> = entries
                .iter()
                .filter(|(id, _)| *id != own_id)
                .map(|(_, e)| e["rank"].as_u64().unwrap())
                .collect();
            alternatives.sort_unstable();
            assert!(
                alternatives.iter().all(|&r| (1..=2).contains(&r)),
                "{position}"
            );
            // The 2 most likely are there, the prompt's token among them or not.
            let ranks: Vec<u64> = entries
                .values()
                .map(|e| e["rank"].as_u64().unwrap())
                .collect();
            assert!(ranks.contains(&1) && ranks.contains(&2), "{position}");
        }
        // `echo`'s own list keeps its own width: no alternatives for logprobs 0.
        assert!(
            choice["logprobs"]["top_logprobs"][1]
                .as_object()
                .unwrap()
                .len()
                == 1,
            "{v}"
        );
    }
    // Several prompts, the same one twice (the second a prefix-cache hit, which must not
    // skip computing it), and one of a single token (nothing to score).
    let body = json!({"prompt": ["The harbour at dawn", "The harbour at dawn"], "max_tokens": 1,
                      "prompt_logprobs": 1});
    let (status, v) = post(&client, &completions, body.clone()).await;
    assert_eq!(status, 200, "{v}");
    let (_, again) = post(&client, &completions, body).await;
    let lists: Vec<&Value> = (v["choices"].as_array().unwrap().iter())
        .chain(again["choices"].as_array().unwrap())
        .map(|c| &c["prompt_logprobs"])
        .collect();
    assert!(lists.iter().all(|l| *l == lists[0]), "{v} {again}");
    assert!(lists[0].as_array().unwrap().len() > 2);
    let (_, one) = post(
        &client,
        &completions,
        json!({"prompt": [5], "max_tokens": 1, "prompt_logprobs": 3}),
    )
    .await;
    assert_eq!(one["choices"][0]["prompt_logprobs"], json!([null]), "{one}");
    // Echo shows its own width of the alternatives prompt_logprobs computed: the prompt's
    // token and up to `logprobs` others, of the 1 most likely here.
    let (_, narrow) = post(
        &client,
        &completions,
        json!({"prompt": "The harbour at dawn", "max_tokens": 1, "echo": true, "logprobs": 3,
               "prompt_logprobs": 1}),
    )
    .await;
    let tops = narrow["choices"][0]["logprobs"]["top_logprobs"]
        .as_array()
        .unwrap();
    let prompt_len = narrow["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
    assert!(
        tops[1..prompt_len]
            .iter()
            .all(|t| t.as_object().unwrap().len() == 2),
        "{narrow}"
    );
    // A chat's come once, beside the choices.
    let chat = format!("http://{addr}/v1/chat/completions");
    let (status, v) = post(
        &client,
        &chat,
        json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
               "prompt_logprobs": 0}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let scored = v["prompt_logprobs"].as_array().unwrap();
    assert_eq!(
        scored.len() as u64,
        v["usage"]["prompt_tokens"].as_u64().unwrap()
    );
    assert!(
        scored[1..]
            .iter()
            .all(|p| p.as_object().unwrap().len() == 1),
        "{v}"
    );
    // 0 with a stream is taken, as vLLM takes it (the stream carries none).
    let (_, chunks) = stream(
        &client,
        &completions,
        &json!({"prompt": "x", "max_tokens": 2, "prompt_logprobs": 0, "stream": true}),
    )
    .await;
    assert!(!chunks.is_empty() && chunks.iter().all(|c| c.get("error").is_none()));
    for (body, url) in [
        (
            json!({"prompt": "x", "prompt_logprobs": 1, "stream": true}),
            &completions,
        ),
        (json!({"prompt": "x", "prompt_logprobs": 21}), &completions),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 1,
                "stream": true}),
            &chat,
        ),
    ] {
        let (status, v) = post(&client, url, body.clone()).await;
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], "prompt_logprobs", "{v}");
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_responses_api_answers_as_the_chat_it_stands_for() {
    let (addr, server) = spawn_local(config(SchedulerConfig::default()))
        .await
        .unwrap();
    let base = format!("http://{addr}");
    let client = reqwest::Client::new();
    let (status, chat) = post(
        &client,
        &format!("{base}/v1/chat/completions"),
        json!({"messages": [{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "Tell me about the lighthouse"}],
               "max_tokens": 8, "temperature": 0, "ignore_eos": true}),
    )
    .await;
    assert_eq!(status, 200, "{chat}");
    let text = chat["choices"][0]["message"]["content"].as_str().unwrap();

    let ask = json!({"instructions": "Be brief.", "input": "Tell me about the lighthouse",
                     "max_output_tokens": 8, "temperature": 0, "ignore_eos": true});
    let (status, whole) = post(&client, &format!("{base}/v1/responses"), ask.clone()).await;
    assert_eq!(status, 200, "{whole}");
    assert_eq!(whole["object"], "response");
    assert_eq!(whole["output"][0]["content"][0]["text"], text);
    assert_eq!(whole["status"], "incomplete");
    assert_eq!(whole["output"][0]["status"], "incomplete");
    assert_eq!(
        whole["usage"]["input_tokens"],
        chat["usage"]["prompt_tokens"]
    );
    assert_eq!(whole["usage"]["output_tokens"], 8);
    assert_eq!(whole["store"], false);

    // Streamed: each event named in its `event:` line, numbered in order, the deltas adding
    // up to the same text, and the last event the whole response; no `[DONE]`.
    let mut streamed = ask.clone();
    streamed["stream"] = json!(true);
    let (raw, events) = stream(&client, &format!("{base}/v1/responses"), &streamed).await;
    assert!(!raw.contains("[DONE]"));
    let names: Vec<&str> = raw
        .lines()
        .filter_map(|l| l.strip_prefix("event: "))
        .collect();
    let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(names, kinds);
    assert_eq!(kinds[..2], ["response.created", "response.in_progress"]);
    for (i, e) in events.iter().enumerate() {
        assert_eq!(e["sequence_number"], i, "{e}");
    }
    let deltas: String = events
        .iter()
        .filter(|e| e["type"] == "response.output_text.delta")
        .map(|e| e["delta"].as_str().unwrap())
        .collect();
    assert_eq!(deltas, text);
    let last = events.last().unwrap();
    assert_eq!(last["type"], "response.incomplete");
    assert_eq!(last["response"]["id"], events[0]["response"]["id"]);
    assert_eq!(last["response"]["output"][0]["content"][0]["text"], text);
    assert_eq!(last["response"]["usage"], whole["usage"]);

    // Errors in this endpoint's names.
    for (body, code, param) in [
        (
            json!({"input": "x", "max_output_tokens": 1_000_000}),
            400,
            "max_output_tokens",
        ),
        (json!({"input": "x", "model": "other"}), 404, "model"),
        (json!({"input": "x", "n": 2}), 400, "n"),
        (
            json!({"input": "x", "previous_response_id": "resp_1"}),
            404,
            "previous_response_id",
        ),
    ] {
        let (status, v) = post(&client, &format!("{base}/v1/responses"), body.clone()).await;
        assert_eq!(status, code, "{body}: {v}");
        assert_eq!(v["error"]["param"], param, "{v}");
    }
    let (status, _) = get_json(&client, format!("{base}/v1/responses/resp_1")).await;
    assert_eq!(status, 404);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncate_prompt_tokens_keeps_the_prompts_last_tokens() {
    let sched = SchedulerConfig {
        max_model_len: 96,
        ..SchedulerConfig::default()
    };
    let (addr, server) = spawn_local(config(sched)).await.unwrap();
    let base = format!("http://{addr}");
    let client = reqwest::Client::new();
    let ids_of = |v: &Value| -> Vec<u64> {
        (v["tokens"].as_array().unwrap().iter())
            .map(|t| t.as_u64().unwrap())
            .collect()
    };
    let text = "The harbour at dawn was quiet and grey";
    let (_, tok) = post(
        &client,
        &format!("{base}/tokenize"),
        json!({"prompt": text}),
    )
    .await;
    let ids = ids_of(&tok);
    let (_, plain) = post(
        &client,
        &format!("{base}/tokenize"),
        json!({"prompt": text, "add_special_tokens": false}),
    )
    .await;
    assert_eq!(
        ids_of(&plain).len() + 1,
        ids.len(),
        "the tokenizer adds a BOS"
    );
    // A text keeps its BOS and its last k - 1 tokens, as vLLM's tokenizer cuts it.
    let kept = [vec![ids[0]], ids[ids.len() - 2..].to_vec()].concat();
    let greedy = json!({"max_tokens": 6, "temperature": 0, "ignore_eos": true});
    let url = format!("{base}/v1/completions");
    let (status, cut) = post(
        &client,
        &url,
        with(
            greedy.clone(),
            json!({"prompt": text, "truncate_prompt_tokens": 3, "echo": true}),
        ),
    )
    .await;
    assert_eq!(status, 200, "{cut}");
    assert_eq!(cut["usage"]["prompt_tokens"], 3);
    let (_, alone) = post(&client, &url, with(greedy.clone(), json!({"prompt": kept}))).await;
    // The echo is the prompt as it ran, decoded.
    let (_, echoed) = post(
        &client,
        &format!("{base}/detokenize"),
        json!({"tokens": kept}),
    )
    .await;
    assert_eq!(
        cut["choices"][0]["text"].as_str().unwrap(),
        format!(
            "{}{}",
            echoed["prompt"].as_str().unwrap(),
            alone["choices"][0]["text"].as_str().unwrap()
        )
    );
    // Token ids keep exactly their last k.
    let (_, by_ids) = post(
        &client,
        &url,
        with(
            greedy.clone(),
            json!({"prompt": ids, "truncate_prompt_tokens": 2}),
        ),
    )
    .await;
    assert_eq!(by_ids["usage"]["prompt_tokens"], 2, "{by_ids}");
    // A prompt past the context: -1 leaves max_tokens their room; a cut longer than that
    // room is refused.
    let long = "harbour ".repeat(200);
    let (status, v) = post(
        &client,
        &url,
        with(
            greedy.clone(),
            json!({"prompt": long, "truncate_prompt_tokens": -1}),
        ),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], 90);
    let (status, v) = post(
        &client,
        &url,
        with(
            greedy,
            json!({"prompt": long, "truncate_prompt_tokens": 91}),
        ),
    )
    .await;
    assert_eq!(status, 400);
    assert_eq!(v["error"]["param"], "truncate_prompt_tokens");
    server.stop().await;
}

/// `--reasoning-parser`: a reasoning model's thinking (up to `</think>`) is the message's
/// `reasoning`, the rest its `content`, streamed or whole; a grammar applies after the
/// thinking; `enable_thinking: false` and `separate_reasoning: false` leave it all content.
/// The generated Qwen3 has Qwen3's markers as tokens of their own; a bias says when the
/// random model ends its thinking.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reasoning_parser_splits_the_thinking_from_the_answer() {
    use infer_engine::server::reasoning::ReasoningParser;
    // A model without the markers is refused at start, as vLLM refuses it.
    let refused = spawn_local(ServeConfig {
        reasoning_parser: Some(ReasoningParser::DeepSeekR1),
        ..ServeConfig::new("builtin:tiny")
    })
    .await;
    let e = refused.err().expect("no markers: no start").to_string();
    assert!(e.contains("deepseek_r1") && e.contains("<think>"), "{e}");

    let (_tmp, dir) = common::tiny_model(&common::spec(infer_engine::Arch::Qwen3)).unwrap();
    let tokenizer = infer_engine::runtime::tokenizer::TextTokenizer::from_dir(&dir).unwrap();
    let end = tokenizer.token_to_id("</think>").unwrap().to_string();
    let (addr, server) = spawn_local(ServeConfig {
        reasoning_parser: Some(ReasoningParser::Qwen3),
        ..ServeConfig::new(dir.to_str().unwrap())
    })
    .await
    .unwrap();
    let client = reqwest::Client::new();
    let chat = format!("http://{addr}/v1/chat/completions");
    let ask = |extra: Value| {
        with(
            json!({"messages": [{"role": "user", "content": "Is it raining?"}],
                   "temperature": 0, "max_tokens": 6}),
            extra,
        )
    };
    let streamed = |body: Value| {
        with(
            body,
            json!({"stream": true, "stream_options": {"include_usage": true}}),
        )
    };
    let joined = |chunks: &[Value], field: &str| -> String {
        (chunks.iter())
            .filter_map(|c| c["choices"][0]["delta"][field].as_str())
            .collect()
    };

    // Never ending its thinking: all of it is reasoning, streamed or whole.
    let never = json!({"logit_bias": {&end: -100}, "ignore_eos": true});
    let (status, v) = post(&client, &chat, ask(never.clone())).await;
    assert_eq!(status, 200, "{v}");
    let message = &v["choices"][0]["message"];
    let thought = message["reasoning"].as_str().unwrap().to_string();
    assert!(!thought.is_empty() && message["content"].is_null(), "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(
        v["usage"]["completion_tokens_details"]["reasoning_tokens"],
        6
    );
    let (_, chunks) = stream(&client, &chat, &streamed(ask(never.clone()))).await;
    assert_eq!(joined(&chunks, "reasoning"), thought);
    assert_eq!(joined(&chunks, "content"), "");
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(
        usage["completion_tokens_details"],
        v["usage"]["completion_tokens_details"]
    );
    // Thinking turned off, or not to be separated: the same output is all content.
    for off in [
        json!({"chat_template_kwargs": {"enable_thinking": false}}),
        json!({"separate_reasoning": false}),
    ] {
        let (status, v) = post(&client, &chat, ask(with(never.clone(), off.clone()))).await;
        assert_eq!(status, 200, "{v}");
        let message = &v["choices"][0]["message"];
        assert_eq!(message["content"], thought.as_str(), "{off}");
        assert!(message.get("reasoning").is_none(), "{off}: {v}");
    }

    // `</think>` first, then a grammar's answer: the grammar waited for the thinking's end
    // (from the first token, it would have forbidden `</think>`).
    let answer = json!({"logit_bias": {&end: 100},
                        "structured_outputs": {"choice": ["yes", "no"]}});
    let (status, v) = post(&client, &chat, ask(answer.clone())).await;
    assert_eq!(status, 200, "{v}");
    let message = &v["choices"][0]["message"];
    let content = message["content"].as_str().unwrap().to_string();
    assert!(["yes", "no"].contains(&content.as_str()), "{v}");
    assert!(message["reasoning"].is_null(), "{v}");
    assert_eq!(
        v["usage"]["completion_tokens_details"]["reasoning_tokens"],
        1
    );
    let (_, chunks) = stream(&client, &chat, &streamed(ask(answer.clone()))).await;
    assert_eq!(joined(&chunks, "content"), content);
    assert_eq!(joined(&chunks, "reasoning"), "");
    // Not separated, the grammar applies from the first token.
    let whole = with(answer, json!({"separate_reasoning": false}));
    let (status, v) = post(&client, &chat, ask(whole)).await;
    assert_eq!(status, 200, "{v}");
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(["yes", "no"].contains(&content), "{v}");

    // A prompt that has ended the thinking (an answer continued after `</think>`): the
    // output is all answer, the grammar from its first token.
    let continued = json!({"messages": [{"role": "user", "content": "Is it raining?"},
                                        {"role": "assistant", "content": "<think>\n\n</think>\n\n"}],
                           "continue_final_message": true, "add_generation_prompt": false,
                           "temperature": 0, "max_tokens": 6,
                           "logit_bias": {&end: 100},
                           "structured_outputs": {"choice": ["yes", "no"]}});
    let (status, v) = post(&client, &chat, continued).await;
    assert_eq!(status, 200, "{v}");
    let message = &v["choices"][0]["message"];
    assert!(
        ["yes", "no"].contains(&message["content"].as_str().unwrap()),
        "{v}"
    );
    assert!(message.get("reasoning").is_none(), "{v}");

    // An earlier turn's thinking in the prompt does not end this turn's.
    let again = json!({"messages": [{"role": "user", "content": "Is it raining?"},
                                    {"role": "assistant", "content": "<think>Hm</think>No."},
                                    {"role": "user", "content": "Sure?"}],
                       "temperature": 0, "max_tokens": 3, "logit_bias": {&end: -100}});
    let (status, v) = post(&client, &chat, again).await;
    assert_eq!(status, 200, "{v}");
    assert!(v["choices"][0]["message"]["reasoning"].is_string(), "{v}");

    // The Responses API: the thinking is a reasoning item before the answer.
    let (status, r) = post(
        &client,
        &format!("http://{addr}/v1/responses"),
        json!({"input": "Is it raining?", "temperature": 0, "max_output_tokens": 6,
               "logit_bias": {&end: -100}, "ignore_eos": true}),
    )
    .await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["output"][0]["type"], "reasoning");
    assert_eq!(r["output"][0]["content"][0]["text"], thought.as_str());
    assert_eq!(r["usage"]["output_tokens_details"]["reasoning_tokens"], 6);

    // A turn's thinking sent back (as answered, or as vLLM's older name) is taken.
    for field in ["reasoning", "reasoning_content"] {
        let mut turn = json!({"role": "assistant", "content": "No."});
        turn[field] = json!(thought);
        let body = json!({"messages": [{"role": "user", "content": "Is it raining?"}, turn,
                                       {"role": "user", "content": "Sure?"}],
                          "max_tokens": 2});
        let (status, v) = post(&client, &chat, body).await;
        assert_eq!(status, 200, "{field}: {v}");
    }
    server.stop().await;
}

/// vLLM's `return_token_ids`, as RL trainers read it: the prompt's ids as the server ran
/// them, and each choice's generated ids, the same streamed (each chunk its own, none lost
/// where a chunk's text is held back) as not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn return_token_ids_gives_the_prompt_and_every_generated_token() {
    use infer_engine::server::tool_parser::ToolCallParser;
    let (addr, server) = spawn_local(ServeConfig {
        tool_call_parser: Some(ToolCallParser::Hermes),
        ..ServeConfig::new("builtin:tiny")
    })
    .await
    .unwrap();
    let base = format!("http://{addr}");
    let client = reqwest::Client::new();
    let tokenize = |body: Value| {
        let (client, url) = (client.clone(), format!("{base}/tokenize"));
        async move {
            let (status, v) = post(&client, &url, body).await;
            assert_eq!(status, 200, "{v}");
            serde_json::from_value::<Vec<u32>>(v["tokens"].clone()).unwrap()
        }
    };
    // Completions: two prompts, two choices each; the ids are those the logprobs name.
    let url = format!("{base}/v1/completions");
    let prompts = ["The harbour", "A quiet morning by the sea"];
    let body = json!({"prompt": prompts, "n": 2, "max_tokens": 6, "temperature": 0,
                      "logprobs": 0, "return_tokens_as_token_ids": true, "return_token_ids": true});
    let (status, v) = post(&client, &url, body.clone()).await;
    assert_eq!(status, 200, "{v}");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4);
    let mut whole = Vec::new();
    for (i, c) in choices.iter().enumerate() {
        let prompt = tokenize(json!({"prompt": prompts[i / 2]})).await;
        assert_eq!(c["prompt_token_ids"], json!(prompt), "{c}");
        let ids: Vec<u32> = serde_json::from_value(c["token_ids"].clone()).unwrap();
        assert_eq!(ids, token_ids(&json!({"choices": [c]})), "{c}");
        assert_eq!(ids.len(), 6);
        whole.push(ids);
    }
    // Streamed: each chunk its tokens; a choice's first chunk its prompt's.
    let (_, chunks) = stream(&client, &url, &with(body, json!({"stream": true}))).await;
    let mut streamed = vec![Vec::new(); 4];
    let mut prompts_sent = vec![0; 4];
    for chunk in &chunks {
        let c = &chunk["choices"][0];
        let i = c["index"].as_u64().unwrap() as usize;
        let ids: Vec<u32> = serde_json::from_value(c["token_ids"].clone()).unwrap();
        streamed[i].extend(ids);
        prompts_sent[i] += usize::from(c.get("prompt_token_ids").is_some());
    }
    assert_eq!(streamed, whole);
    assert_eq!(prompts_sent, [1; 4]);
    // A chat whose answer a tool-call parser holds back until it ends: every generated
    // token still comes back, streamed too; the prompt's ids are the rendered chat's.
    let url = format!("{base}/v1/chat/completions");
    let messages = json!([{"role": "user", "content": "Weather in Oslo?"}]);
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]);
    let regex =
        r#"<tool_call>\{"name": "get_weather", "arguments": \{"city": "Oslo"\}\}</tool_call>"#;
    let body = json!({"messages": messages, "tools": tools, "max_tokens": 60, "temperature": 0,
                      "return_token_ids": true, "structured_outputs": {"regex": regex}});
    let (status, v) = post(&client, &url, body.clone()).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");
    let prompt = tokenize(json!({"messages": messages, "tools": tools})).await;
    assert_eq!(v["prompt_token_ids"], json!(prompt));
    let ids: Vec<u32> = serde_json::from_value(v["choices"][0]["token_ids"].clone()).unwrap();
    assert_eq!(
        ids.len() as u64,
        v["usage"]["completion_tokens"].as_u64().unwrap()
    );
    let (_, chunks) = stream(&client, &url, &with(body, json!({"stream": true}))).await;
    let streamed: Vec<u32> = (chunks.iter())
        .filter(|c| !c["choices"][0].is_null())
        .flat_map(|c| {
            serde_json::from_value::<Vec<u32>>(c["choices"][0]["token_ids"].clone()).unwrap()
        })
        .collect();
    assert_eq!(streamed, ids);
    let with_prompt: Vec<&Value> = (chunks.iter())
        .filter(|c| c.get("prompt_token_ids").is_some())
        .collect();
    assert_eq!(with_prompt.len(), 1);
    assert_eq!(with_prompt[0]["prompt_token_ids"], json!(prompt));
    server.stop().await;
}
