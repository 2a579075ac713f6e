//! What one client can take from the others: a plain stream (200 tokens, EOS ignored) and a
//! plain short request, measured on a quiet server and beside each of
//!
//! - floods of `/health` and of `/metrics` (16 keep-alive connections asking as fast as they
//!   are answered, from a runtime of their own);
//! - four 4 MiB `/tokenize` calls, and four chat requests of 3.9 MB each;
//! - an `n = 64` streamed request on a pool of 8 sequences;
//! - `--max-connections` idle sockets.
//!
//! Prints `name: value unit` lines (docs/results/reliability-cpu.md records them).
//!
//! `cargo run --release -p infer-engine --example fair_admission_load`

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use infer_core::SchedulerConfig;
use infer_engine::server::{spawn_local, ServeConfig};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const TOKENS: usize = 200;
const ROUNDS: usize = 5;

fn main() -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let mut cfg = ServeConfig::new("builtin:tiny");
    cfg.http.max_body_bytes = 8 << 20;
    let (addr, server) = rt.block_on(spawn_local(cfg))?;
    rt.block_on(async {
        stream(addr).await?; // warm-up
        let quiet = stream(addr).await?;
        report("quiet", quiet);
        for path in ["/health", "/metrics"] {
            // Rounds of quiet then flooded, so that a noisy moment of the machine hits both.
            let (mut ratios, mut rates) = (Vec::new(), Vec::new());
            for _ in 0..ROUNDS {
                let quiet = stream(addr).await?;
                let flood = Flood::start(addr, path, 16);
                // Past any burst the server allows: the steady flood.
                tokio::time::sleep(Duration::from_millis(300)).await;
                let beside = stream(addr).await?;
                let (answered, secs) = flood.stop();
                ratios.push(beside.itl_p50 / quiet.itl_p50);
                rates.push(answered as f64 / secs);
            }
            let fmt = |v: &[f64], digits: usize| {
                v.iter()
                    .map(|x| format!("{x:.digits$}"))
                    .collect::<Vec<_>>()
                    .join(" / ")
            };
            println!(
                "stream ITL P50 beside a {path} flood over quiet, per round: {} (median {:.2})",
                fmt(&ratios, 2),
                median(ratios.clone())
            );
            println!("  {path} answers a second, per round: {}", fmt(&rates, 0));
        }
        // Four 4 MiB prompts to /tokenize (no length limit there), then a short request.
        let huge = "harbour lights ".repeat(4 << 20 >> 4);
        let calls: Vec<_> = (0..4)
            .map(|_| {
                let huge = huge.clone();
                tokio::spawn(async move {
                    reqwest::Client::new()
                        .post(format!("http://{addr}/tokenize"))
                        .json(&json!({"prompt": huge}))
                        .send()
                        .await?
                        .bytes()
                        .await?;
                    anyhow::Ok(())
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(300)).await;
        let beside = short(addr).await?;
        println!("short request (4 tokens) beside four 4 MiB /tokenize calls: {beside:.3} s");
        for c in calls {
            c.await??;
        }
        for (what, messages) in [
            ("one message", one_message(3_900_000)),
            ("130,000 empty messages", empty_messages(3_900_000)),
        ] {
            let chats = big_chats(addr, 4, messages);
            tokio::time::sleep(Duration::from_millis(50)).await;
            let beside = stream(addr).await?;
            report(
                &format!("beside four 3.9 MB chat requests of {what}"),
                beside,
            );
            let statuses = chats.await?;
            println!("  their statuses: {statuses:?}");
        }
        anyhow::Ok(())
    })?;
    rt.block_on(server.stop());

    // A pool of 8 sequences: one n = 64 request holds it for its forks' whole lives.
    let cfg = ServeConfig {
        sched: SchedulerConfig {
            max_batch_size: 8,
            ..SchedulerConfig::default()
        },
        ..ServeConfig::new("builtin:tiny")
    };
    let (addr, server) = rt.block_on(spawn_local(cfg))?;
    rt.block_on(async {
        short(addr).await?; // warm-up
        let quiet = short(addr).await?;
        println!("short request (4 tokens), quiet: {:.3} s", quiet);
        let big = tokio::spawn(async move {
            let t = Instant::now();
            let body = json!({"prompt": "The harbour", "max_tokens": 256, "ignore_eos": true,
                              "n": 64});
            let r = reqwest::Client::new()
                .post(format!("http://{addr}/v1/completions"))
                .json(&body)
                .send()
                .await?;
            anyhow::ensure!(r.status().is_success(), "n = 64: {}", r.status());
            r.bytes().await?;
            anyhow::Ok(t.elapsed().as_secs_f64())
        });
        // After the parent's first token: its 63 forks wait.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let beside = short(addr).await?;
        let big = big.await??;
        println!("short request (4 tokens) sent after an n = 64 request (256 tokens each) on a pool of 8: {beside:.3} s");
        println!("  the n = 64 request: {big:.3} s");
        anyhow::Ok(())
    })?;
    rt.block_on(server.stop());

    let mut cfg = ServeConfig::new("builtin:tiny");
    cfg.http.max_connections = 1024;
    let (addr, server) = rt.block_on(spawn_local(cfg))?;
    rt.block_on(async {
        let mut idle = Vec::new();
        for _ in 0..1024 {
            idle.push(TcpStream::connect(addr).await?);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let (mut served, mut times) = (0, Vec::new());
        for _ in 0..20 {
            let t = Instant::now();
            // A refused connection may be answered 503 before the request is sent, which
            // the client reports as an error.
            if let Ok(r) = reqwest::Client::new()
                .post(format!("http://{addr}/v1/completions"))
                .json(&json!({"prompt": "The harbour", "max_tokens": 4}))
                .send()
                .await
            {
                if r.status().is_success() && r.bytes().await.is_ok() {
                    served += 1;
                }
            }
            times.push(t.elapsed().as_secs_f64());
        }
        println!(
            "short requests served beside 1,024 idle sockets (the connection limit): {served} of 20, \
             median {:.3} s",
            median(times)
        );
        drop(idle);
        anyhow::Ok(())
    })?;
    rt.block_on(server.stop());
    Ok(())
}

#[derive(Clone, Copy)]
struct Stream {
    ttft: f64,
    itl_p50: f64,
    total: f64,
}

fn report(what: &str, s: Stream) {
    println!(
        "stream {what}: TTFT {:.1} ms, ITL P50 {:.3} ms, total {:.3} s",
        s.ttft * 1e3,
        s.itl_p50 * 1e3,
        s.total
    );
}

/// A streamed completion of `TOKENS` tokens: its time to first token and median gap.
async fn stream(addr: SocketAddr) -> Result<Stream> {
    let body = json!({"prompt": "The harbour", "max_tokens": TOKENS, "ignore_eos": true,
                      "stream": true});
    let t = Instant::now();
    let mut r = reqwest::Client::new()
        .post(format!("http://{addr}/v1/completions"))
        .json(&body)
        .send()
        .await?;
    anyhow::ensure!(r.status().is_success(), "status {}", r.status());
    let mut gaps = Vec::new();
    let mut last = t;
    while let Some(_chunk) = r.chunk().await? {
        gaps.push(last.elapsed().as_secs_f64());
        last = Instant::now();
    }
    Ok(Stream {
        ttft: gaps[0],
        itl_p50: median(gaps[1..].to_vec()),
        total: t.elapsed().as_secs_f64(),
    })
}

/// A 4-token completion: its whole time.
async fn short(addr: SocketAddr) -> Result<f64> {
    let t = Instant::now();
    let r = reqwest::Client::new()
        .post(format!("http://{addr}/v1/completions"))
        .json(&json!({"prompt": "The harbour", "max_tokens": 4}))
        .send()
        .await?;
    anyhow::ensure!(r.status().is_success(), "status {}", r.status());
    r.bytes().await?;
    Ok(t.elapsed().as_secs_f64())
}

/// About `bytes` of JSON: one user message.
fn one_message(bytes: usize) -> serde_json::Value {
    json!([{"role": "user", "content": "harbour lights ".repeat(bytes / 15)}])
}

/// About `bytes` of JSON: empty messages.
fn empty_messages(bytes: usize) -> serde_json::Value {
    let one = json!({"role": "user", "content": ""});
    json!(vec![one; bytes / 30])
}

/// `count` chat requests of `messages` each, sent at once: their statuses.
fn big_chats(
    addr: SocketAddr,
    count: usize,
    messages: serde_json::Value,
) -> tokio::task::JoinHandle<Result<Vec<u16>>> {
    tokio::spawn(async move {
        let jobs: Vec<_> = (0..count)
            .map(|_| {
                let body = json!({"messages": messages, "max_tokens": 4});
                tokio::spawn(async move {
                    let r = reqwest::Client::new()
                        .post(format!("http://{addr}/v1/chat/completions"))
                        .json(&body)
                        .send()
                        .await?;
                    anyhow::Ok(r.status().as_u16())
                })
            })
            .collect();
        let mut statuses = Vec::new();
        for j in jobs {
            statuses.push(j.await??);
        }
        Ok(statuses)
    })
}

/// Keep-alive connections that each send `GET path` as soon as the last answer is read,
/// on threads of their own, with as little client work as a request can take.
struct Flood {
    stop: Arc<AtomicBool>,
    answered: Arc<AtomicU64>,
    thread: std::thread::JoinHandle<()>,
    start: Instant,
}

impl Flood {
    fn start(addr: SocketAddr, path: &'static str, connections: usize) -> Flood {
        let stop = Arc::new(AtomicBool::new(false));
        let answered = Arc::new(AtomicU64::new(0));
        let (s, a) = (stop.clone(), answered.clone());
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let jobs: Vec<_> = (0..connections)
                    .map(|_| tokio::spawn(flood_one(addr, path, s.clone(), a.clone())))
                    .collect();
                for j in jobs {
                    let _ = j.await;
                }
            });
        });
        Flood {
            stop,
            answered,
            thread,
            start: Instant::now(),
        }
    }

    /// Its answers, and the seconds it ran.
    fn stop(self) -> (u64, f64) {
        let secs = self.start.elapsed().as_secs_f64();
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.thread.join();
        (self.answered.load(Ordering::Relaxed), secs)
    }
}

async fn flood_one(
    addr: SocketAddr,
    path: &str,
    stop: Arc<AtomicBool>,
    answered: Arc<AtomicU64>,
) -> Result<()> {
    let request = format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n");
    let mut conn = TcpStream::connect(addr).await?;
    let mut buf = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        conn.write_all(request.as_bytes()).await?;
        read_response(&mut conn, &mut buf).await?;
        answered.fetch_add(1, Ordering::Relaxed);
    }
    Ok(())
}

/// Reads one response with a `content-length` (whatever its status) off a keep-alive
/// connection.
async fn read_response(conn: &mut TcpStream, buf: &mut Vec<u8>) -> Result<()> {
    buf.clear();
    let mut chunk = [0u8; 64 << 10];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .context("no content-length")?
                .trim()
                .parse()?;
            while buf.len() < end + 4 + len {
                let n = conn.read(&mut chunk).await?;
                anyhow::ensure!(n > 0, "closed");
                buf.extend_from_slice(&chunk[..n]);
            }
            return Ok(());
        }
        let n = conn.read(&mut chunk).await?;
        anyhow::ensure!(n > 0, "closed");
        buf.extend_from_slice(&chunk[..n]);
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
