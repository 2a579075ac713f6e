//! KV-cache events as vLLM publishes them (`--kv-events-config`), so that KV-aware routers
//! (vllm-router's `kv_aware` policy, llm-d's precise-prefix scorer) see each replica's real
//! prefix cache.
//!
//! The wire, as vLLM's `ZmqEventPublisher` sends it: a ZeroMQ PUB socket, one multipart
//! message per engine step that changed the cache — `[topic, seq, payload]`, `seq` an
//! 8-byte big-endian counter from 0 (a subscriber that sees a gap knows it missed a batch),
//! `payload` the msgpack batch `[ts, [event, …]]`. Each event is a map tagged by `type`:
//! `BlockStored {block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
//! lora_name}` and `BlockRemoved {block_hashes, medium}`. Block hashes are this engine's own
//! (64-bit, chained over the prompt's blocks); consumers treat them as opaque keys and match
//! requests by the events' `token_ids`.
//!
//! The socket is libzmq's (the `zmq` crate builds it from source), the library vLLM's pyzmq
//! wraps, because the socket faces whoever can reach the port: libzmq refuses a frame longer
//! than `ZMQ_MAXMSGSIZE` before allocating it, connects and reconnects in the background,
//! and drops a slow subscriber's batches at the high-water mark. What is ours, the thread
//! that encodes and sends, is restarted if it panics, and reopens the socket when libzmq
//! gives up a connect-mode endpoint (`supervise`).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use infer_core::kv::KvEvent;
use serde::{Deserialize, Serialize};

/// vLLM's `--kv-events-config` JSON. Every key vLLM accepts parses; those this engine does
/// not honour are refused when set to something other than their default.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvEventsConfig {
    #[serde(default)]
    pub enable_kv_cache_events: bool,
    /// `zmq` or `null` (no publisher).
    #[serde(default = "default_publisher")]
    pub publisher: String,
    /// Bound when it holds `*` (all interfaces), else connected to (a subscriber that binds).
    #[serde(default = "default_endpoint")]
    pub endpoint: String,
    /// Topic frame of every message (subscribers filter on its prefix).
    #[serde(default)]
    pub topic: String,
    /// Replay of missed batches: not supported (must be null).
    #[serde(default)]
    pub replay_endpoint: Option<String>,
    /// vLLM's replay buffer length; unused without replay.
    #[serde(default)]
    pub buffer_steps: Option<u64>,
    /// Batches queued for one subscriber before its next ones are dropped, as ZeroMQ PUB
    /// does (vLLM's default when unset, 0 for no limit).
    #[serde(default)]
    pub hwm: Option<u64>,
    #[serde(default)]
    pub max_queue_size: Option<u64>,
}

fn default_publisher() -> String {
    "null".into()
}

fn default_endpoint() -> String {
    "tcp://*:5557".into()
}

impl KvEventsConfig {
    /// Parses `--kv-events-config`; `Ok(None)` when events are off.
    pub fn parse(json: &str) -> Result<Option<Self>> {
        let cfg: Self = serde_json::from_str(json).context("--kv-events-config")?;
        if !cfg.enable_kv_cache_events || cfg.publisher == "null" {
            return Ok(None);
        }
        if cfg.publisher != "zmq" {
            bail!(
                "--kv-events-config: publisher `{}` is not supported (zmq or null)",
                cfg.publisher
            );
        }
        if cfg.replay_endpoint.is_some() {
            bail!("--kv-events-config: replay_endpoint is not supported (leave it null)");
        }
        if !cfg.endpoint.starts_with("tcp://") {
            bail!(
                "--kv-events-config: endpoint `{}` must be tcp://HOST:PORT",
                cfg.endpoint
            );
        }
        Ok(Some(cfg))
    }

    /// Whether the publisher binds (vLLM's rule: a wildcard host) or connects.
    fn binds(&self) -> bool {
        self.endpoint.contains('*') || self.endpoint.contains("::")
    }
}

/// The messages of one step's events, as the wire carries them.
#[derive(Serialize)]
#[serde(tag = "type")]
enum WireEvent<'a> {
    BlockStored {
        block_hashes: &'a [u64],
        parent_block_hash: Option<u64>,
        token_ids: &'a [u32],
        block_size: usize,
        lora_id: Option<i64>,
        medium: Option<&'a str>,
        lora_name: Option<&'a str>,
    },
    BlockRemoved {
        block_hashes: &'a [u64],
        medium: Option<&'a str>,
    },
    AllBlocksCleared {},
}

impl<'a> From<&'a KvEvent> for WireEvent<'a> {
    fn from(e: &'a KvEvent) -> Self {
        match e {
            KvEvent::Stored {
                hashes,
                parent,
                token_ids,
                block_size,
            } => WireEvent::BlockStored {
                block_hashes: hashes,
                parent_block_hash: *parent,
                token_ids,
                block_size: *block_size,
                lora_id: None,
                medium: None,
                lora_name: None,
            },
            KvEvent::Removed { hashes } => WireEvent::BlockRemoved {
                block_hashes: hashes,
                medium: None,
            },
            KvEvent::AllCleared => WireEvent::AllBlocksCleared {},
        }
    }
}

/// The msgpack payload of one batch: `[ts, [event, …]]`, events as tagged maps.
pub fn encode_batch(ts: f64, events: &[KvEvent]) -> Vec<u8> {
    let wire: Vec<WireEvent<'_>> = events.iter().map(WireEvent::from).collect();
    let mut out = Vec::new();
    let mut ser = rmp_serde::Serializer::new(&mut out).with_struct_map();
    (ts, wire)
        .serialize(&mut ser)
        .expect("msgpack into a Vec cannot fail");
    out
}

/// Where the engine loop sends each step's events.
pub type EventSender = Sender<Vec<KvEvent>>;

/// The largest frame a peer may send. A PUB socket reads only the handshake's READY command
/// and subscriptions (topic prefixes), both tiny; libzmq checks each frame's announced
/// length against this before allocating anything, and drops a peer that exceeds it.
const MAX_PEER_FRAME: i64 = 64 * 1024;

/// vLLM's `hwm` when the config leaves it out.
const DEFAULT_HWM: u64 = 100_000;

/// The wait before retrying, doubled after each failure up to `RETRY_MAX`: libzmq's
/// reconnection in connect mode (and its limit on one connection attempt), and the
/// publisher's restart after a failure.
const RETRY_FIRST: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(5);

/// Connect mode: how long libzmq may stay silent after a disconnection before the publisher
/// takes the endpoint to be given up (a reconnection is announced at once), and how often
/// an idle publisher checks.
const GIVE_UP_AFTER: Duration = Duration::from_secs(1);

/// An open PUB socket.
struct PubSocket {
    socket: zmq::Socket,
    endpoint: String,
    /// Raised in connect mode when libzmq stops reconnecting to the endpoint, as it does
    /// after a protocol error (a frame over `MAX_PEER_FRAME`, say); a new socket connects
    /// again.
    given_up: Arc<AtomicBool>,
}

/// Opens the socket and starts the publisher on its own thread; returns where to send
/// events. Fails (naming the endpoint) when the endpoint cannot be bound; connect mode
/// does not wait for a subscriber.
pub fn start(cfg: &KvEventsConfig) -> Result<EventSender> {
    let first = open(cfg)?;
    let (tx, rx) = channel();
    let cfg = cfg.clone();
    std::thread::Builder::new()
        .name("kv-events".into())
        .spawn(move || {
            let mut socket = Some(first);
            // Outside the restarts: a subscriber sees a batch lost to one as a gap.
            let mut seq = 0;
            supervise(|| {
                let socket = match socket.take() {
                    Some(s) => s,
                    None => open(&cfg)?,
                };
                publish(socket, cfg.topic.as_bytes(), &rx, &mut seq)
            });
        })
        .context("cannot start the KV events thread")?;
    Ok(tx)
}

/// A PUB socket bound or connected to the configured endpoint. Binding fails at once (a
/// port in use, say); connecting returns at once and libzmq connects in the background,
/// again after every failure or hang-up.
fn open(cfg: &KvEventsConfig) -> Result<PubSocket> {
    let ms = |d: Duration| d.as_millis() as i32;
    let ctx = zmq::Context::new();
    let socket = ctx.socket(zmq::PUB)?;
    socket.set_maxmsgsize(MAX_PEER_FRAME)?;
    let hwm = cfg.hwm.unwrap_or(DEFAULT_HWM);
    socket.set_sndhwm(i32::try_from(hwm).unwrap_or(i32::MAX))?;
    // Batches still queued when the publisher closes are dropped, not waited for: a
    // stalled subscriber must not hold up the server's exit or the publisher's restart.
    socket.set_linger(0)?;
    // libzmq resolves a bracketed (IPv6) host only with IPv6 on, as vLLM sets it.
    socket.set_ipv6(cfg.endpoint.contains('['))?;
    let given_up = Arc::new(AtomicBool::new(false));
    let opened = if cfg.binds() {
        socket.bind(&cfg.endpoint)
    } else {
        socket.set_reconnect_ivl(ms(RETRY_FIRST))?;
        socket.set_reconnect_ivl_max(ms(RETRY_MAX))?;
        socket.set_connect_timeout(ms(RETRY_MAX))?;
        watch_connection(&ctx, &socket, &cfg.endpoint, given_up.clone())?;
        socket.connect(&cfg.endpoint)
    };
    opened.with_context(|| format!("--kv-events-config: cannot open {}", cfg.endpoint))?;
    Ok(PubSocket {
        socket,
        endpoint: cfg.endpoint.clone(),
        given_up,
    })
}

/// Connect mode's watch, from a thread that reads the socket's libzmq monitor until the
/// socket closes: it logs the first failed attempt of an outage (no subscriber listening
/// yet, say) and the connection that ends it, once each (libzmq's retries in between are
/// silent), and raises `given_up` when libzmq stops reconnecting.
fn watch_connection(
    ctx: &zmq::Context,
    socket: &zmq::Socket,
    endpoint: &str,
    given_up: Arc<AtomicBool>,
) -> Result<()> {
    use std::sync::atomic::AtomicU64;
    use zmq::SocketEvent::{CONNECTED, CONNECT_RETRIED, DISCONNECTED, MONITOR_STOPPED};
    static MONITORS: AtomicU64 = AtomicU64::new(0);
    let address = format!(
        "inproc://kv-events-monitor-{}",
        MONITORS.fetch_add(1, Ordering::Relaxed)
    );
    let events = CONNECTED.to_raw()
        | CONNECT_RETRIED.to_raw()
        | DISCONNECTED.to_raw()
        | MONITOR_STOPPED.to_raw();
    socket.monitor(&address, i32::from(events))?;
    let monitor = ctx.socket(zmq::PAIR)?;
    monitor.connect(&address)?;
    let endpoint = endpoint.to_string();
    std::thread::Builder::new()
        .name("kv-events-monitor".into())
        .spawn(move || {
            let mut failing = false;
            // Each event is two frames: its id (u16) and a value (u32), then an address.
            while let Ok(frames) = monitor.recv_multipart(0) {
                let Some(&[a, b, ..]) = frames.first().map(Vec::as_slice) else {
                    continue;
                };
                let event = u16::from_ne_bytes([a, b]);
                if event == CONNECT_RETRIED.to_raw() && !failing {
                    failing = true;
                    eprintln!(
                        "kv events: cannot connect to {endpoint} (no subscriber listening?); \
                         retrying in the background, every {RETRY_MAX:?} at most"
                    );
                } else if event == CONNECTED.to_raw() && failing {
                    failing = false;
                    eprintln!("kv events: connected to {endpoint}");
                } else if event == DISCONNECTED.to_raw()
                    // A reconnection is announced at once; none means libzmq gave up.
                    && monitor.poll(zmq::POLLIN, GIVE_UP_AFTER.as_millis() as i64) == Ok(0)
                {
                    given_up.store(true, Ordering::Relaxed);
                } else if event == MONITOR_STOPPED.to_raw() {
                    break;
                }
            }
        })
        .context("cannot start the KV events monitor thread")?;
    Ok(())
}

/// Sends each step's events as one message until the engine hangs up, or fails when libzmq
/// has given up the endpoint. The socket is closed when this returns or panics.
fn publish(
    socket: PubSocket,
    topic: &[u8],
    events: &Receiver<Vec<KvEvent>>,
    seq: &mut u64,
) -> Result<()> {
    loop {
        if socket.given_up.load(Ordering::Relaxed) {
            bail!(
                "libzmq gave up reconnecting to {}, as it does after a protocol error",
                socket.endpoint
            );
        }
        let batch = match events.recv_timeout(GIVE_UP_AFTER) {
            Ok(batch) => batch,
            Err(RecvTimeoutError::Timeout) => continue,
            Err(RecvTimeoutError::Disconnected) => return Ok(()),
        };
        let ts = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let payload = encode_batch(ts, &batch);
        // A PUB socket does not block: past a subscriber's high-water mark, libzmq drops
        // that subscriber's copy.
        let frames: [&[u8]; 3] = [topic, &seq.to_be_bytes(), &payload];
        if let Err(e) = socket.socket.send_multipart(frames, zmq::DONTWAIT) {
            eprintln!("kv events: batch {seq} not sent: {e}");
        }
        *seq += 1;
    }
}

/// Runs `publisher` until it returns, restarting it, after a wait that doubles up to
/// `RETRY_MAX`, each time it panics or fails (to reopen the socket, say): a bug on the
/// events thread costs batches, which subscribers see as a gap, and never the server.
fn supervise(mut publisher: impl FnMut() -> Result<()>) {
    let mut wait = RETRY_FIRST;
    loop {
        let failure = match catch_unwind(AssertUnwindSafe(&mut publisher)) {
            Ok(Ok(())) => return,
            Ok(Err(e)) => format!("{e:#}"),
            Err(panic) => {
                let message = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                format!("the publisher panicked: {message}")
            }
        };
        eprintln!("kv events: {failure}; restarting the publisher in {wait:?}");
        std::thread::sleep(wait);
        wait = (wait * 2).min(RETRY_MAX);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_parses_vllms_keys_and_refuses_what_it_cannot_honour() {
        let on = |extra: &str| {
            KvEventsConfig::parse(&format!(
                r#"{{"enable_kv_cache_events": true, "publisher": "zmq"{extra}}}"#
            ))
        };
        let cfg = on(
            r#", "endpoint": "tcp://*:5557", "topic": "kv", "buffer_steps": 10000, "hwm": 100000"#,
        )
        .unwrap()
        .unwrap();
        assert_eq!(cfg.endpoint, "tcp://*:5557");
        assert!(cfg.binds());
        assert!(!on(r#", "endpoint": "tcp://indexer:5557""#)
            .unwrap()
            .unwrap()
            .binds());
        assert_eq!(
            KvEventsConfig::parse(r#"{"publisher": "zmq"}"#).unwrap(),
            None
        );
        let err = |extra: &str| on(extra).unwrap_err().to_string();
        assert!(err(r#", "replay_endpoint": "tcp://*:5558""#).contains("replay_endpoint"));
        assert!(err(r#", "endpoint": "ipc:///tmp/kv""#).contains("tcp://"));
        assert!(format!("{:#}", on(r#", "color": 1"#).unwrap_err()).contains("color"));
        assert!(
            KvEventsConfig::parse(r#"{"enable_kv_cache_events": true, "publisher": "kafka"}"#)
                .unwrap_err()
                .to_string()
                .contains("kafka")
        );
    }

    /// The payload decodes as vLLM's subscribers read it: a two-element array, events as
    /// maps with their `type` and vLLM's field names.
    #[test]
    fn batches_encode_as_vllms_msgpack() {
        let events = vec![
            KvEvent::Stored {
                hashes: vec![7, 9],
                parent: None,
                token_ids: vec![1, 2, 3, 4],
                block_size: 2,
            },
            KvEvent::Removed { hashes: vec![5] },
        ];
        let bytes = encode_batch(1.5, &events);
        let v: serde_json::Value = rmp_serde::from_slice(&bytes).unwrap();
        assert_eq!(
            v,
            serde_json::json!([
                1.5,
                [
                    {"type": "BlockStored", "block_hashes": [7, 9], "parent_block_hash": null,
                     "token_ids": [1, 2, 3, 4], "block_size": 2, "lora_id": null,
                     "medium": null, "lora_name": null},
                    {"type": "BlockRemoved", "block_hashes": [5], "medium": null}
                ]
            ])
        );
    }

    /// A panic or a failure restarts the publisher; its return ends the supervision.
    #[test]
    fn the_publisher_is_restarted_after_a_panic_or_a_failure_until_it_returns() {
        let mut runs = 0;
        supervise(|| {
            runs += 1;
            match runs {
                1 => panic!("a bug on the events thread"),
                2 => bail!("the port is taken"),
                _ => Ok(()),
            }
        });
        assert_eq!(runs, 3);
    }
}
