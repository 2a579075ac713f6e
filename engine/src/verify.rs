//! `engine verify`: predict → verify in one command. Profile the engine (or reuse a
//! profile), predict each scenario with the simulator on that profile, run the real server
//! and the bench client on the same scenario and seed, and write a predicted-vs-measured
//! table with overlaid charts. Both sides run the same core scheduler and the same prompts
//! (cut in the served model's own tokens), so the error measures the cost model.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{anyhow, Context, Result};
use infer_core::metrics::RunInfo;
use infer_core::workload::{Scenario, Tokenizer};

use crate::bench::{self, BenchOptions};
use crate::profile::{profile_model, ProfileClient};
use crate::serve::{spawn_local, ServeConfig};

pub struct VerifyOptions {
    pub scenarios: Vec<PathBuf>,
    pub model: String,
    /// Reuse this profile instead of measuring one.
    pub profile: Option<PathBuf>,
    pub out: PathBuf,
    /// Overrides applied to every scenario (`key=value`).
    pub overrides: Vec<String>,
    /// A smaller profiling grid.
    pub quick_profile: bool,
}

/// One scenario's outcome.
pub struct VerifyResult {
    pub scenario: String,
    pub verification: infer_reports::Verification,
    pub report: PathBuf,
}

pub async fn verify(opts: &VerifyOptions) -> Result<Vec<VerifyResult>> {
    std::fs::create_dir_all(&opts.out)
        .with_context(|| format!("{}: cannot create", opts.out.display()))?;
    let model = opts.model.clone();
    let lm = tokio::task::spawn_blocking(move || {
        crate::model::load_model(&model, None, &candle_core::Device::Cpu)
    })
    .await??;
    let tokenizer: Arc<dyn Tokenizer> =
        Arc::new(crate::tokenizer::TextTokenizer::from_dir(&lm.dir)?);

    let profile_path = match &opts.profile {
        Some(p) => p.clone(),
        None => {
            let path = opts.out.join("profile.json");
            eprintln!("profiling {} …", opts.model);
            let profile = profile_model(&opts.model, opts.quick_profile).await?;
            std::fs::write(&path, serde_json::to_string_pretty(&profile)? + "\n")
                .with_context(|| format!("{}: cannot write", path.display()))?;
            path
        }
    };
    let profile_abs = std::fs::canonicalize(&profile_path)
        .with_context(|| format!("{}: not found", profile_path.display()))?;

    let mut results = Vec::new();
    for scenario_path in &opts.scenarios {
        let file = scenario_path.display().to_string();
        let text = std::fs::read_to_string(scenario_path)
            .with_context(|| format!("{file}: cannot read scenario"))?;
        let scenario =
            Scenario::parse(&file, &text, &opts.overrides).map_err(|e| anyhow!("{e}"))?;
        let dir = opts.out.join(&scenario.name);

        // Predict.
        let mut sim_overrides = opts.overrides.clone();
        sim_overrides.push("sim.cost_model=\"profiled\"".into());
        sim_overrides.push(format!(
            "sim.profile={:?}",
            profile_abs.display().to_string()
        ));
        let setup = infer_sim::load(&file, &sim_overrides).map_err(|e| anyhow!("{e}"))?;
        let predicted = infer_sim::run_with_tokenizer(&setup, tokenizer.clone());
        let info = RunInfo::new("sim", &setup.scenario, setup.cost.describe());
        infer_sim::output::write_run(&dir.join("predicted"), &predicted, &info)
            .map_err(|e| anyhow!("{e}"))?;

        // Measure.
        let cfg = ServeConfig {
            sched: scenario.server.scheduler_config(),
            seed: 0,
            ..ServeConfig::new(&opts.model)
        };
        let (addr, server) = spawn_local(cfg).await?;
        let mut b = BenchOptions::new(&format!("http://{addr}"), scenario_path);
        b.overrides = opts.overrides.clone();
        b.tokenizer = Some(tokenizer.clone());
        b.out = Some(dir.join("measured"));
        let measured = bench::run(&b).await;
        server.stop().await;
        measured?;

        let report =
            infer_reports::write_verify_report(&dir.join("predicted"), &dir.join("measured"), &dir)
                .map_err(|e| anyhow!("{e}"))?;
        let p = infer_reports::Run::load(dir.join("predicted")).map_err(|e| anyhow!("{e}"))?;
        let m = infer_reports::Run::load(dir.join("measured")).map_err(|e| anyhow!("{e}"))?;
        let verification = infer_reports::predicted_vs_measured(&p, &m);
        results.push(VerifyResult {
            scenario: scenario.name.clone(),
            verification,
            report,
        });
    }
    Ok(results)
}

/// The serving path around the model step, measured on an in-process server with the bench
/// client beside it (as `engine verify` runs them, sharing this machine's cores):
///
/// * per step and per running sequence: streamed inter-token gaps at batch 1 and 8 minus the
///   profiled decode steps of the same shape (scheduling, sampling, detokenising, SSE);
/// * per request: TTFT of a one-token completion minus its prefill step and the step
///   overhead (HTTP, tokenisation).
///
/// The step overheads are added to every profiled point (they are part of an engine step).
pub(crate) async fn measure_client_path(
    model: &str,
    points: &mut [crate::profile::ProfilePoint],
) -> Result<ProfileClient> {
    let (addr, server) = spawn_local(ServeConfig::new(model)).await?;
    let client = reqwest::Client::new();
    let url = format!("http://{addr}/v1/completions");
    let decode_step = |b: usize| {
        points
            .iter()
            .filter(|p| p.decode_seqs == b && p.prefill_tokens == 0)
            .min_by_key(|p| p.context_tokens)
            .map_or(0.0, |p| p.step_s)
    };
    let itl1 = stream_itl(&client, &url, 1).await?;
    let itl8 = stream_itl(&client, &url, 8).await?;
    let (o1, o8) = (
        (itl1 - decode_step(1)).max(0.0),
        (itl8 - decode_step(8)).max(0.0),
    );
    let per_seq = ((o8 - o1) / 7.0).max(0.0);
    let per_step = (o1 - per_seq).max(0.0);
    let mut ttfts = Vec::new();
    let mut prompt_tokens = 0;
    for i in 0..9 {
        let body = serde_json::json!({"prompt": format!("Probe {i}: a short prompt."), "max_tokens": 1, "temperature": 0});
        let t = Instant::now();
        let v: serde_json::Value = client.post(&url).json(&body).send().await?.json().await?;
        ttfts.push(t.elapsed().as_secs_f64());
        prompt_tokens = v["usage"]["prompt_tokens"].as_u64().unwrap_or(8) as usize;
    }
    server.stop().await;
    ttfts.sort_by(f64::total_cmp);
    let ttft = ttfts[ttfts.len() / 2];
    let prefill = points
        .iter()
        .filter(|p| p.decode_seqs == 0 && p.prefill_tokens > 0)
        .min_by_key(|p| p.prefill_tokens.abs_diff(prompt_tokens))
        .map_or(0.0, |p| p.step_s);
    for p in points.iter_mut() {
        let seqs = p.decode_seqs + usize::from(p.prefill_tokens > 0);
        p.step_s += per_step + per_seq * seqs as f64;
    }
    eprintln!(
        "serving overhead: {:.3} ms per step + {:.3} ms per sequence (ITL at batch 1 {:.3} ms, at batch 8 {:.3} ms)",
        per_step * 1e3,
        per_seq * 1e3,
        itl1 * 1e3,
        itl8 * 1e3
    );
    Ok(ProfileClient {
        request_s: (ttft - prefill - per_step - per_seq).max(0.0),
        per_prompt_token_s: 0.0,
        stream_s: 0.0,
    })
}

/// Median gap between streamed chunks with `n` concurrent greedy streams.
async fn stream_itl(client: &reqwest::Client, url: &str, n: usize) -> Result<f64> {
    use futures_util::StreamExt;
    let runs = (0..n).map(|i| {
        let (client, url) = (client.clone(), url.to_string());
        async move {
            let body = serde_json::json!({"prompt": format!("Stream {i} about the harbour and its boats at dawn."),
                "max_tokens": 96, "temperature": 0, "ignore_eos": true, "stream": true});
            let resp = client.post(&url).json(&body).send().await?;
            let mut stream = resp.bytes_stream();
            let mut times = Vec::new();
            while let Some(piece) = stream.next().await {
                let piece = piece?;
                let k = piece.windows(5).filter(|w| w == b"data:").count();
                times.extend(std::iter::repeat_n(Instant::now(), k));
            }
            anyhow::Ok(times)
        }
    });
    let mut gaps = Vec::new();
    for times in futures_util::future::join_all(runs).await {
        let times = times?;
        // Skip the first chunk (TTFT) and the trailing usage/[DONE] chunks.
        for w in times.windows(2).skip(1).take(times.len().saturating_sub(4)) {
            gaps.push(w[1].duration_since(w[0]).as_secs_f64());
        }
    }
    anyhow::ensure!(!gaps.is_empty(), "no streamed tokens to time");
    gaps.sort_by(f64::total_cmp);
    Ok(gaps[gaps.len() / 2])
}

/// The fidelity table over several scenarios, in markdown.
pub fn fidelity_table(results: &[VerifyResult]) -> String {
    let mut s = String::from(
        "| scenario | metric | predicted | measured | error % |\n|---|---|---:|---:|---:|\n",
    );
    for r in results {
        for row in &r.verification.rows {
            let f = |v: Option<f64>| v.map_or("–".to_string(), |x| format!("{x:.1}"));
            s.push_str(&format!(
                "| {} | {} | {} | {} | {} |\n",
                r.scenario,
                row.metric.name,
                f(row.predicted),
                f(row.measured),
                row.error_pct
                    .map_or("–".to_string(), |e| format!("{e:+.1}"))
            ));
        }
    }
    s
}

pub fn default_out() -> PathBuf {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    Path::new("runs").join(format!("verify-{secs}"))
}
