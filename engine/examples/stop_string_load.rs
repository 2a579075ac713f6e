//! What other streams pay for one client's stop strings: four plain streamed completions
//! (200 tokens, EOS ignored) measured alone, beside eight more plain streams, and beside
//! eight streams that each carry the most stop strings a request may (128 strings, 16 KiB);
//! then eight requests with 4 MB of stop strings, which must be refused. Prints
//! `name: value unit` lines; the ratio that matters is the plain streams' ITL P50 beside
//! the stop-string streams over their ITL P50 beside as many plain ones (the same batch).
//!
//! `cargo run --release -p infer-engine --example stop_string_load`

use std::time::Instant;

use anyhow::Result;
use infer_engine::server::{spawn_local, ServeConfig};
use serde_json::{json, Value};

const TOKENS: usize = 200;
const ROUNDS: usize = 5;

fn main() -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let mut cfg = ServeConfig::new("builtin:tiny");
    // Room for a 4 MB body: the stop strings, not the body's size, must be what is refused.
    cfg.http.max_body_bytes = 8 << 20;
    let (addr, server) = rt.block_on(spawn_local(cfg))?;
    let base = format!("http://{addr}");
    let most_stops: Vec<String> = (0..128)
        .map(|i| format!("{i:03}{}", "~".repeat(125)))
        .collect();
    rt.block_on(async {
        // Warm-up: the first requests pay for lazy set-up.
        measure(&base, 4, 0, json!(null)).await?;
        // Rounds interleaved, so that a noisy moment of the machine hits both sides.
        let (mut alone, mut beside_plain, mut beside_stops) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            alone.push(measure(&base, 4, 0, json!(null)).await?);
            beside_plain.push(measure(&base, 4, 8, json!(null)).await?);
            beside_stops.push(measure(&base, 4, 8, json!(most_stops)).await?);
        }
        let ratios: Vec<f64> = beside_stops
            .iter()
            .zip(&beside_plain)
            .map(|(s, p)| s / p)
            .collect();
        let ms = |v: &[f64]| {
            v.iter()
                .map(|x| format!("{:.3}", x * 1e3))
                .collect::<Vec<_>>()
        };
        println!(
            "plain streams' ITL P50 alone, per round: {:?} ms",
            ms(&alone)
        );
        println!(
            "plain streams' ITL P50 beside 8 plain streams, per round: {:?} ms",
            ms(&beside_plain)
        );
        println!(
            "plain streams' ITL P50 beside 8 streams with 128 stop strings (16 KiB) each, per \
             round: {:?} ms",
            ms(&beside_stops)
        );
        println!(
            "stop-string cost to the others (beside stops / beside plain), median of {ROUNDS} \
             rounds: {:.3}",
            median(ratios)
        );
        let huge: Vec<String> = (0..4).map(|_| "~".repeat(1 << 20)).collect();
        let client = reqwest::Client::new();
        let mut refused = 0;
        for _ in 0..8 {
            let r = client
                .post(format!("{base}/v1/completions"))
                .json(&json!({"prompt": "The harbour", "max_tokens": TOKENS, "stop": huge}))
                .send()
                .await?;
            let status = r.status().as_u16();
            let v: Value = r.json().await.unwrap_or(Value::Null);
            if status == 400 && v["error"]["param"] == "stop" {
                refused += 1;
            }
        }
        println!("requests with 4 MB of stop strings refused (400, param stop): {refused} of 8");
        anyhow::Ok(())
    })?;
    rt.block_on(server.stop());
    Ok(())
}

/// The median gap between streamed chunks of `plain` streams, run beside `others` streams
/// that carry `stop` (JSON null: none), all started together.
async fn measure(base: &str, plain: usize, others: usize, stop: Value) -> Result<f64> {
    let client = reqwest::Client::new();
    let stream = |stop: Value| {
        let (client, base) = (client.clone(), base.to_string());
        tokio::spawn(async move {
            let body = json!({"prompt": "The harbour", "max_tokens": TOKENS, "ignore_eos": true,
                              "stream": true, "stop": stop});
            let mut r = client
                .post(format!("{base}/v1/completions"))
                .json(&body)
                .send()
                .await?;
            anyhow::ensure!(r.status().is_success(), "status {}", r.status());
            let mut gaps = Vec::new();
            let mut last = Instant::now();
            while let Some(_chunk) = r.chunk().await? {
                gaps.push(last.elapsed().as_secs_f64());
                last = Instant::now();
            }
            anyhow::Ok(gaps)
        })
    };
    let background: Vec<_> = (0..others).map(|_| stream(stop.clone())).collect();
    let measured: Vec<_> = (0..plain).map(|_| stream(json!(null))).collect();
    let mut gaps = Vec::new();
    for m in measured {
        // The first gap is the time to the first token, not an inter-token latency.
        gaps.extend(m.await??.into_iter().skip(1));
    }
    for b in background {
        b.await??;
    }
    Ok(median(gaps))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
