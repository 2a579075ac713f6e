//! KV-cache events end to end: `engine serve` with `--kv-events-config` publishes, over a
//! ZeroMQ PUB socket on 127.0.0.1, what its prefix cache registers and evicts, and a
//! subscriber reads vLLM's wire format back (the real router check is a documented command:
//! docs/guide/engine.md, "Routers in front of replicas").

mod common;

use std::time::Duration;

use common::post;
use infer_core::SchedulerConfig;
use infer_engine::server::kv_events::KvEventsConfig;
use infer_engine::server::{spawn_local, ServeConfig};
use serde_json::{json, Value};
use zeromq::{Socket, SocketRecv};

/// One batch off the socket: (seq, payload decoded).
async fn next_batch(sub: &mut zeromq::SubSocket) -> (u64, Value) {
    let msg = tokio::time::timeout(Duration::from_secs(10), sub.recv())
        .await
        .expect("a batch within 10 s")
        .expect("a message");
    let frames = msg.into_vec();
    assert_eq!(frames.len(), 3, "[topic, seq, payload]");
    assert_eq!(&frames[0][..], b"kv", "the configured topic");
    let seq = u64::from_be_bytes(frames[1][..].try_into().expect("8-byte seq"));
    (seq, rmp_serde::from_slice(&frames[2]).expect("msgpack"))
}

/// The events of the next batch that has any of type `kind`.
async fn next_of(
    sub: &mut zeromq::SubSocket,
    kind: &str,
    last_seq: &mut Option<u64>,
) -> Vec<Value> {
    loop {
        let (seq, batch) = next_batch(sub).await;
        if let Some(last) = *last_seq {
            assert_eq!(seq, last + 1, "sequence numbers have no gaps");
        }
        *last_seq = Some(seq);
        let events: Vec<Value> = batch[1]
            .as_array()
            .expect("[ts, events]")
            .iter()
            .filter(|e| e["type"] == kind)
            .cloned()
            .collect();
        if !events.is_empty() {
            return events;
        }
    }
}

async fn complete(base: &str, prompt: &[u32]) -> Value {
    let body = json!({"prompt": prompt, "max_tokens": 1, "temperature": 0});
    let url = format!("{base}/v1/completions");
    let (status, v) = post(&reqwest::Client::new(), &url, body).await;
    assert_eq!(status, 200, "{v}");
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_prefix_caches_stores_and_evictions_are_published_as_vllm_does() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let events = KvEventsConfig::parse(&format!(
        r#"{{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:{port}", "topic": "kv"}}"#
    ))
    .unwrap();
    // Six blocks of 16: three 40-token prompts make the third evict the first's blocks.
    let cfg = ServeConfig {
        sched: SchedulerConfig {
            num_gpu_blocks: 6,
            block_size: 16,
            max_model_len: 96,
            ..SchedulerConfig::default()
        },
        kv_events: events,
        ..ServeConfig::new("builtin:tiny")
    };
    let (addr, _server) = spawn_local(cfg).await.unwrap();
    let base = format!("http://{addr}");
    let sources: Value = reqwest::get(format!("{base}/kv_event_sources"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(sources["0"]["endpoint"], format!("tcp://*:{port}"));
    assert_eq!(sources["0"]["publisher"], "zmq");

    let mut sub = zeromq::SubSocket::new();
    sub.connect(&format!("tcp://127.0.0.1:{port}"))
        .await
        .unwrap();
    sub.subscribe("kv").await.unwrap();
    // A PUB socket drops what it sends before a subscription reaches it.
    tokio::time::sleep(Duration::from_millis(500)).await;

    let prompt = |first: u32| (first..first + 40).collect::<Vec<u32>>();
    let mut seq = None;
    complete(&base, &prompt(100)).await;
    let stored = next_of(&mut sub, "BlockStored", &mut seq).await;
    assert_eq!(stored.len(), 1, "one chain: {stored:?}");
    let a = &stored[0];
    assert_eq!(a["block_size"], 16);
    assert_eq!(a["parent_block_hash"], Value::Null);
    assert_eq!(a["token_ids"], json!(prompt(100)[..32]));
    let a_hashes = a["block_hashes"].as_array().unwrap().clone();
    assert_eq!(a_hashes.len(), 2);

    // The same prompt again is served from the cache and stores nothing new.
    let again = complete(&base, &prompt(100)).await;
    assert_eq!(again["usage"]["prompt_tokens_details"]["cached_tokens"], 32);

    complete(&base, &prompt(300)).await;
    let b = next_of(&mut sub, "BlockStored", &mut seq).await;
    assert_eq!(b[0]["token_ids"], json!(prompt(300)[..32]));
    // The third prompt needs the blocks the first one left cached.
    complete(&base, &prompt(500)).await;
    let removed = next_of(&mut sub, "BlockRemoved", &mut seq).await;
    let gone: Vec<Value> = removed
        .iter()
        .flat_map(|e| e["block_hashes"].as_array().unwrap().clone())
        .collect();
    for h in &a_hashes {
        assert!(gone.contains(h), "{h} evicted: {removed:?}");
    }

    // vLLM's reset endpoint empties the cache and says so on the wire.
    let reset = reqwest::Client::new()
        .post(format!("{base}/reset_prefix_cache"))
        .send()
        .await
        .unwrap();
    assert_eq!(reset.status(), 200);
    next_of(&mut sub, "AllBlocksCleared", &mut seq).await;
    let after = complete(&base, &prompt(500)).await;
    assert_eq!(after["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
}
