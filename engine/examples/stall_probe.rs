//! How long other clients wait while some send huge prompts: the server (embedded model,
//! its own runtime) serves a stream and `/health` polls while four clients send 4 MiB
//! prompts — two completions (refused by their length, untokenised) and two `/tokenize`
//! calls (tokenised on the blocking pool) — three rounds. Prints `name: value unit` lines.
//!
//! `cargo run --release -p infer-engine --example stall_probe`

use std::time::{Duration, Instant};

use anyhow::Result;
use infer_engine::server::{spawn_local, ServeConfig};
use serde_json::{json, Value};

fn line(name: &str, value: f64, unit: &str) {
    println!("{name}: {value:.1} {unit}");
}

fn main() -> Result<()> {
    let server_rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let mut cfg = ServeConfig::new("builtin:tiny");
    cfg.http.max_body_bytes = 8 << 20;
    let (addr, server) = server_rt.block_on(spawn_local(cfg))?;
    let base = format!("http://{addr}");
    let client_rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    // The bystanders (health poller, stream reader) run on their own thread and runtime, as
    // another client process would: the senders' work on 4 MiB bodies (building them,
    // parsing a million-token answer) must not be counted as the server's stall.
    let (done_tx, done_rx) = tokio::sync::watch::channel(false);
    let bystanders = {
        let base = base.clone();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            rt.block_on(bystanders(base, done_rx))
        })
    };
    client_rt.block_on(async {
        let client = reqwest::Client::new();
        let huge = "harbour lights ".repeat((4 << 20) / 15);
        let (mut refused, mut tokenized) = (Vec::new(), Vec::new());
        for _ in 0..3 {
            let jobs: Vec<_> = (0..4)
                .map(|i| {
                    let (client, base) = (client.clone(), base.clone());
                    let body = if i % 2 == 0 {
                        json!({"prompt": huge, "max_tokens": 4})
                    } else {
                        json!({"prompt": huge})
                    };
                    let path = if i % 2 == 0 {
                        "/v1/completions"
                    } else {
                        "/tokenize"
                    };
                    tokio::spawn(async move {
                        let t = Instant::now();
                        let r = client
                            .post(format!("{base}{path}"))
                            .json(&body)
                            .send()
                            .await?;
                        let status = r.status().as_u16();
                        let _: Value = r.json().await?;
                        anyhow::Ok((i, status, t.elapsed().as_secs_f64()))
                    })
                })
                .collect();
            for j in jobs {
                let (i, status, secs) = j.await??;
                anyhow::ensure!(status == if i % 2 == 0 { 400 } else { 200 });
                if i % 2 == 0 {
                    refused.push(secs);
                } else {
                    tokenized.push(secs);
                }
            }
        }
        done_tx.send(true)?;
        let (worst_health, mut gaps) = bystanders
            .join()
            .map_err(|_| anyhow::anyhow!("bystander thread panicked"))??;
        gaps.sort_by(f64::total_cmp);
        let max = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
        line("health_worst", worst_health.as_secs_f64() * 1e3, "ms");
        line("stream_gap_worst", max(&gaps) * 1e3, "ms");
        line("stream_gap_p50", gaps[gaps.len() / 2] * 1e3, "ms");
        line("huge_prompt_refused_worst", max(&refused) * 1e3, "ms");
        line("tokenize_4mib_worst", max(&tokenized) * 1e3, "ms");
        anyhow::Ok(())
    })?;
    server_rt.block_on(server.stop());
    Ok(())
}

/// Polls `/health` every 5 ms and reads streamed completions until `done`: the worst
/// health answer time and every inter-chunk gap.
async fn bystanders(
    base: String,
    done: tokio::sync::watch::Receiver<bool>,
) -> Result<(Duration, Vec<f64>)> {
    let client = reqwest::Client::new();
    let health = {
        let (client, base, done) = (client.clone(), base.clone(), done.clone());
        async move {
            let mut worst = Duration::ZERO;
            while !*done.borrow() {
                let t = Instant::now();
                client.get(format!("{base}/health")).send().await?;
                worst = worst.max(t.elapsed());
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            anyhow::Ok(worst)
        }
    };
    let stream = async move {
        let mut gaps = Vec::new();
        while !*done.borrow() {
            let body = json!({"prompt": "The harbour", "max_tokens": 400,
                              "ignore_eos": true, "stream": true});
            let mut r = client
                .post(format!("{base}/v1/completions"))
                .json(&body)
                .send()
                .await?;
            let mut last = Instant::now();
            while let Some(_chunk) = r.chunk().await? {
                gaps.push(last.elapsed().as_secs_f64());
                last = Instant::now();
            }
        }
        anyhow::Ok(gaps)
    };
    let (worst, gaps) = tokio::join!(health, stream);
    Ok((worst?, gaps?))
}
