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

use anyhow::{bail, Context, Result};
use infer_core::kv::KvEvent;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

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
    /// vLLM's ZeroMQ high-water mark; a slow subscriber's batches are dropped past the
    /// socket's own queue, as ZeroMQ PUB does.
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
pub type EventSender = UnboundedSender<Vec<KvEvent>>;

/// Opens the socket and starts the publisher on its own thread; returns where to send
/// events. Fails (naming the endpoint) when the socket cannot be bound or connected.
pub fn start(cfg: &KvEventsConfig) -> Result<EventSender> {
    let (tx, rx) = unbounded_channel();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let cfg = cfg.clone();
    std::thread::Builder::new()
        .name("kv-events".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = ready_tx.send(Err(anyhow::anyhow!(e)));
                    return;
                }
            };
            rt.block_on(publish(cfg, rx, ready_tx));
        })
        .context("cannot start the KV events thread")?;
    ready_rx
        .recv()
        .context("the KV events thread ended before its socket opened")??;
    Ok(tx)
}

async fn publish(
    cfg: KvEventsConfig,
    mut rx: UnboundedReceiver<Vec<KvEvent>>,
    ready: std::sync::mpsc::Sender<Result<()>>,
) {
    use zeromq::{Socket, SocketSend};
    let mut socket = zeromq::PubSocket::new();
    let opened = if cfg.binds() {
        // The zeromq crate reads a wildcard host as a name: bind all interfaces instead.
        let endpoint = cfg.endpoint.replace('*', "0.0.0.0");
        socket.bind(&endpoint).await.map(|_| ())
    } else {
        socket.connect(&cfg.endpoint).await
    };
    if let Err(e) = opened {
        let _ = ready.send(Err(anyhow::anyhow!(
            "--kv-events-config: cannot open {}: {e}",
            cfg.endpoint
        )));
        return;
    }
    let _ = ready.send(Ok(()));
    let topic = bytes::Bytes::from(cfg.topic.clone().into_bytes());
    let mut seq: u64 = 0;
    while let Some(events) = rx.recv().await {
        let ts = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let frames = vec![
            topic.clone(),
            bytes::Bytes::copy_from_slice(&seq.to_be_bytes()),
            bytes::Bytes::from(encode_batch(ts, &events)),
        ];
        let message = zeromq::ZmqMessage::try_from(frames).expect("three frames");
        if let Err(e) = socket.send(message).await {
            eprintln!("kv events: batch {seq} not sent: {e}");
        }
        seq += 1;
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
}
