//! KV-cache events end to end: `engine serve` with `--kv-events-config` publishes, over a
//! ZeroMQ PUB socket on 127.0.0.1, what its prefix cache registers and evicts, and a
//! subscriber reads vLLM's wire format back (the real router check is a documented command:
//! docs/guide/engine.md, "Routers in front of replicas"). The subscribers here are another
//! ZeroMQ implementation (the pure-Rust `zeromq` crate) than the publisher's, so these tests
//! check the wire rather than one library's agreement with itself.

mod common;

use std::future::Future;
use std::io::{Read, Write};
use std::time::{Duration, Instant};

use common::post;
use infer_core::SchedulerConfig;
use infer_engine::server::kv_events::KvEventsConfig;
use infer_engine::server::{spawn_local, ServeConfig};
use serde_json::{json, Value};
use zeromq::{Socket, SocketRecv};

/// The next batch off the socket within `limit`: (seq, payload decoded).
async fn batch_within(sub: &mut zeromq::SubSocket, limit: Duration) -> Option<(u64, Value)> {
    let msg = tokio::time::timeout(limit, sub.recv())
        .await
        .ok()?
        .expect("a message");
    let frames = msg.into_vec();
    assert_eq!(frames.len(), 3, "[topic, seq, payload]");
    assert_eq!(&frames[0][..], b"kv", "the configured topic");
    let seq = u64::from_be_bytes(frames[1][..].try_into().expect("8-byte seq"));
    Some((seq, rmp_serde::from_slice(&frames[2]).expect("msgpack")))
}

async fn next_batch(sub: &mut zeromq::SubSocket) -> (u64, Value) {
    batch_within(sub, Duration::from_secs(10))
        .await
        .expect("a batch within 10 s")
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

/// A subscriber to `kv` topics, connected to a bind-mode publisher on `port`, its
/// subscription in place.
async fn subscriber(port: u16) -> zeromq::SubSocket {
    let mut sub = zeromq::SubSocket::new();
    sub.connect(&format!("tcp://127.0.0.1:{port}"))
        .await
        .unwrap();
    sub.subscribe("kv").await.unwrap();
    // A PUB socket drops what it sends before a subscription reaches it.
    tokio::time::sleep(Duration::from_millis(500)).await;
    sub
}

async fn complete(base: &str, prompt: &[u32]) -> Value {
    let body = json!({"prompt": prompt, "max_tokens": 1, "temperature": 0});
    let url = format!("{base}/v1/completions");
    let (status, v) = post(&reqwest::Client::new(), &url, body).await;
    assert_eq!(status, 200, "{v}");
    v
}

/// A 40-token prompt: two full blocks of 16.
fn prompt(first: u32) -> Vec<u32> {
    (first..first + 40).collect()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A server publishing on `endpoint` under the topic `kv`, with six blocks of 16: three
/// 40-token prompts make the third evict the first's blocks.
fn serve_config(endpoint: &str) -> ServeConfig {
    let events = KvEventsConfig::parse(&format!(
        r#"{{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "{endpoint}", "topic": "kv"}}"#
    ))
    .unwrap();
    ServeConfig {
        sched: SchedulerConfig {
            num_gpu_blocks: 6,
            block_size: 16,
            max_model_len: 96,
            ..SchedulerConfig::default()
        },
        kv_events: events,
        ..ServeConfig::new("builtin:tiny")
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_prefix_caches_stores_and_evictions_are_published_as_vllm_does() {
    let port = free_port();
    let cfg = serve_config(&format!("tcp://*:{port}"));
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

    let mut sub = subscriber(port).await;

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

/// Runs an async test on a runtime of its own that is abandoned, not waited for, when the
/// test ends: a server whose start-up blocks (connect mode once waited for a subscriber
/// inside `Engine::start`) then fails the test instead of hanging it.
fn bounded<F: Future<Output = ()>>(test: F) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| rt.block_on(test)));
    rt.shutdown_timeout(Duration::from_secs(1));
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

/// Connect mode (no `*` in the endpoint: the subscriber binds, the server connects) with
/// nobody listening yet: the server serves at once, and a subscriber that binds later gets
/// the events.
#[test]
fn connect_mode_serves_at_once_and_publishes_once_a_subscriber_binds() {
    bounded(async {
        let port = free_port();
        let cfg = serve_config(&format!("tcp://127.0.0.1:{port}"));
        let (addr, _server) = tokio::time::timeout(Duration::from_secs(20), spawn_local(cfg))
            .await
            .expect("serving starts without waiting for a subscriber")
            .unwrap();
        let base = format!("http://{addr}");
        tokio::time::timeout(Duration::from_secs(20), complete(&base, &prompt(100)))
            .await
            .expect("a request is answered while no subscriber is there");

        binding_subscriber_gets_a_batch(&base, port).await;
    });
}

/// A subscriber that binds `port` receives a batch. The publisher finds it at its next
/// retry, and a PUB socket drops what it sends before the subscription reaches it: requests
/// (each evicting and storing blocks) until a batch arrives.
async fn binding_subscriber_gets_a_batch(base: &str, port: u16) {
    let mut sub = zeromq::SubSocket::new();
    sub.bind(&format!("tcp://127.0.0.1:{port}")).await.unwrap();
    sub.subscribe("kv").await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    for round in 0u32.. {
        assert!(
            Instant::now() < deadline,
            "no batch within 30 s of the subscriber binding"
        );
        complete(base, &prompt(1000 + 100 * (round % 4))).await;
        if let Some((_, batch)) = batch_within(&mut sub, Duration::from_millis(500)).await {
            assert!(!batch[1].as_array().expect("[ts, events]").is_empty());
            return;
        }
    }
}

/// Panics anywhere in this process from the first call on. A hostile peer must not cause
/// one, even a caught one; every test of this file that fails by panicking is counted
/// too, which only adds a failure to a run that has one.
fn panics_so_far() -> usize {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static PANICS: AtomicUsize = AtomicUsize::new(0);
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            PANICS.fetch_add(1, Ordering::SeqCst);
            previous(info);
        }));
    });
    PANICS.load(Ordering::SeqCst)
}

/// A ZMTP 3.0 greeting: signature, version, the NULL mechanism, as a client.
fn zmtp_greeting() -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3;
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// The READY command a SUB socket sends after the greeting.
fn zmtp_ready_sub() -> Vec<u8> {
    let mut body = vec![5];
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&3u32.to_be_bytes());
    body.extend_from_slice(b"SUB");
    let mut frame = vec![0x04, body.len() as u8];
    frame.extend_from_slice(&body);
    frame
}

/// A long frame's header announcing `len` bytes (none of which follow).
fn zmtp_long_frame_header(command: bool, len: u64) -> Vec<u8> {
    let mut header = vec![if command { 0x06 } else { 0x02 }];
    header.extend_from_slice(&len.to_be_bytes());
    header
}

/// Peers that announce frames of 2^63−1 bytes and of a TiB, in place of the handshake's
/// READY command and in place of a subscription: each is hung up on, nothing panics, the
/// server keeps serving, and a well-behaved subscriber beside them keeps receiving every
/// batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_announcing_huge_frames_cannot_hurt_a_bind_mode_publisher() {
    let panics_before = panics_so_far();
    let port = free_port();
    let (addr, _server) = spawn_local(serve_config(&format!("tcp://*:{port}")))
        .await
        .unwrap();
    let base = format!("http://{addr}");
    let mut sub = subscriber(port).await;
    let mut seq = None;
    complete(&base, &prompt(100)).await;
    next_of(&mut sub, "BlockStored", &mut seq).await;

    for (after_ready, len) in [
        (false, i64::MAX as u64),
        (false, 1 << 40),
        (true, i64::MAX as u64),
        (true, 1 << 40),
    ] {
        let mut wire = zmtp_greeting().to_vec();
        if after_ready {
            wire.extend(zmtp_ready_sub());
        }
        wire.extend(zmtp_long_frame_header(!after_ready, len));
        let hung_up = tokio::task::spawn_blocking(move || {
            let mut peer = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
            peer.set_read_timeout(Some(Duration::from_secs(10)))
                .unwrap();
            peer.write_all(&wire).unwrap();
            // Whatever the publisher says, then the end of the stream (or a reset).
            let mut sink = Vec::new();
            match peer.read_to_end(&mut sink) {
                Ok(_) => true,
                Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
            }
        })
        .await
        .unwrap();
        assert!(hung_up, "a peer announcing {len} bytes is hung up on");
    }

    // Stored, stored, then evicted: every batch still arrives, in sequence.
    complete(&base, &prompt(300)).await;
    next_of(&mut sub, "BlockStored", &mut seq).await;
    complete(&base, &prompt(500)).await;
    next_of(&mut sub, "BlockRemoved", &mut seq).await;
    assert_eq!(
        panics_so_far(),
        panics_before,
        "nothing panicked (see the output above)"
    );
}

/// Connect mode whose first peer at the endpoint breaks the protocol (a frame of 2^63−1
/// bytes in place of READY): libzmq gives up such an endpoint for good, so the publisher
/// reopens its socket, and the subscriber that binds the endpoint next gets the events.
#[test]
fn connect_mode_recovers_from_a_peer_that_breaks_the_protocol() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    bounded(async {
        let hostile = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = hostile.local_addr().unwrap().port();
        let cfg = serve_config(&format!("tcp://127.0.0.1:{port}"));
        let (addr, _server) = tokio::time::timeout(Duration::from_secs(20), spawn_local(cfg))
            .await
            .expect("serving starts without waiting for the peer")
            .unwrap();
        let (mut peer, _) = tokio::time::timeout(Duration::from_secs(10), hostile.accept())
            .await
            .expect("the publisher connects")
            .unwrap();
        let mut wire = zmtp_greeting().to_vec();
        wire.extend(zmtp_long_frame_header(true, i64::MAX as u64));
        peer.write_all(&wire).await.unwrap();
        let mut sink = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(10), peer.read_to_end(&mut sink))
            .await
            .expect("the publisher hangs up");
        drop((peer, hostile));

        binding_subscriber_gets_a_batch(&format!("http://{addr}"), port).await;
    });
}
