//! The CUDA backend's speed, as `name: value unit` lines: device-to-device copy bandwidth,
//! decode tokens/s at batch 1/8/32 with the weight bandwidth each reaches and its fraction of
//! the copy bandwidth, batch-1 ITL eager vs CUDA graphs (medians of interleaved rounds), and
//! prefill tokens/s at 512 and 2,048 tokens — on a generated ~1B-parameter Llama (bf16).
//!
//! `engine/examples/gpu_bench.rs`, run by scripts/gpu-check.sh:
//!   gpu_bench [MODEL_DIR]   (default: generates the model under the builtin cache once)

use std::time::Instant;

use anyhow::Result;
use candle_core::DType;
use infer_engine::tools::builtin;
use infer_engine::tools::make_model::{make_model, ModelSpec};
use infer_engine::{load_model_dir, Arch, Device, ForwardBatch, KvCache, LoadedModel, SeqChunk};
use infer_kernels::cuda::cudarc::driver::CudaContext;

const BLOCK: usize = 16;
const CONTEXT: usize = 512;

fn line(name: &str, value: f64, unit: &str) {
    println!("{name}: {value:.2} {unit}");
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// Copy bandwidth of the device, counting bytes read plus written.
fn copy_bandwidth_gbs() -> Result<f64> {
    let stream = CudaContext::new(0)?.new_stream()?;
    let n = 256 << 20; // u32s: 1 GiB
    let src = stream.alloc_zeros::<u32>(n)?;
    let mut dst = stream.alloc_zeros::<u32>(n)?;
    let mut times = Vec::new();
    for _ in 0..10 {
        stream.synchronize()?;
        let t = Instant::now();
        stream.memcpy_dtod(&src, &mut dst)?;
        stream.synchronize()?;
        times.push(t.elapsed().as_secs_f64());
    }
    Ok(2.0 * (n * 4) as f64 / median(times) / 1e9)
}

/// `batch` sequences, each prefilled to `CONTEXT` tokens in its own blocks.
fn prefilled(lm: &LoadedModel, batch: usize) -> Result<(KvCache, Vec<Vec<u32>>)> {
    let per_seq = (CONTEXT + 64).div_ceil(BLOCK);
    let mut kv = lm.model.new_kv_cache(batch * per_seq, BLOCK)?;
    let tables: Vec<Vec<u32>> = (0..batch)
        .map(|i| ((i * per_seq) as u32..((i + 1) * per_seq) as u32).collect())
        .collect();
    for table in &tables {
        let tokens: Vec<u32> = (0..CONTEXT as u32).map(|t| 10 + t % 1000).collect();
        let b = ForwardBatch {
            seqs: vec![SeqChunk {
                tokens,
                start_pos: 0,
                block_table: table.clone(),
                sample: true,
                all_logits: false,
            }],
        };
        lm.model.forward(&b, &mut kv)?;
    }
    Ok((kv, tables))
}

/// A fresh `len`-token prompt in blocks 0.., sampled.
fn fresh_prompt(len: usize) -> ForwardBatch {
    ForwardBatch {
        seqs: vec![SeqChunk {
            tokens: (0..len as u32).map(|t| 10 + t % 1000).collect(),
            start_pos: 0,
            block_table: (0..len.div_ceil(BLOCK) as u32).collect(),
            sample: true,
            all_logits: false,
        }],
    }
}

/// Seconds per decode step over `steps` steps (after the first, which may capture a graph).
fn decode_step_s(
    lm: &LoadedModel,
    kv: &mut KvCache,
    tables: &[Vec<u32>],
    steps: usize,
) -> Result<f64> {
    let mut times = Vec::new();
    for j in 0..=steps {
        let b = ForwardBatch {
            seqs: tables
                .iter()
                .map(|t| SeqChunk {
                    tokens: vec![42],
                    // Rewrites the same position: the context stays CONTEXT + 1 tokens.
                    start_pos: CONTEXT,
                    block_table: t.clone(),
                    sample: true,
                    all_logits: false,
                })
                .collect(),
        };
        let t = Instant::now();
        lm.model.forward(&b, kv)?;
        if j > 0 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    Ok(median(times))
}

fn main() -> Result<()> {
    let dir = match std::env::args().nth(1) {
        Some(d) => d.into(),
        None => {
            let dir = builtin::cache_dir().join("bench-llama-1b-bf16-v1");
            if !dir.join("model.safetensors").exists() {
                let spec = ModelSpec {
                    layers: 16,
                    hidden: 2048,
                    heads: 32,
                    kv_heads: 8,
                    head_dim: Some(64),
                    intermediate: 8192,
                    vocab: 32768,
                    max_pos: 4096,
                    dtype: DType::BF16,
                    ..ModelSpec::new(Arch::Llama)
                };
                eprintln!("building {} (once)…", dir.display());
                make_model(&spec, &dir)?;
            }
            dir
        }
    };
    let copy = copy_bandwidth_gbs()?;
    line("d2d_copy_bandwidth", copy, "GB/s");
    let lm = load_model_dir(&dir, None, Device::Cuda(0))?;
    let weight_bytes = (lm.config.num_parameters() * 2) as f64;
    line(
        "model_parameters",
        lm.config.num_parameters() as f64 / 1e9,
        "B",
    );

    for batch in [1, 8, 32] {
        let (mut kv, tables) = prefilled(&lm, batch)?;
        let s = decode_step_s(&lm, &mut kv, &tables, 32)?;
        line(
            &format!("decode_tok_s[batch={batch}]"),
            batch as f64 / s,
            "tok/s",
        );
        let gbs = weight_bytes / s / 1e9;
        line(&format!("decode_weight_gbs[batch={batch}]"), gbs, "GB/s");
        // Decode reads each weight once per step: compare with the copy's read half, and
        // (the stricter figure) with the copy's whole traffic, read plus written.
        line(
            &format!("decode_fraction_of_copy_read[batch={batch}]"),
            gbs / (copy / 2.0),
            "",
        );
        line(
            &format!("decode_fraction_of_copy_traffic[batch={batch}]"),
            gbs / copy,
            "",
        );
    }

    // Batch-1 ITL, eager vs graphs, interleaved rounds on the same model and KV.
    let (mut kv, tables) = prefilled(&lm, 1)?;
    let (mut eager, mut graphed) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        lm.model.enable_cuda_graphs(0, 0)?;
        eager.push(decode_step_s(&lm, &mut kv, &tables, 20)?);
        lm.model.enable_cuda_graphs(32, CONTEXT + 64)?;
        graphed.push(decode_step_s(&lm, &mut kv, &tables, 20)?);
    }
    let (e, g) = (median(eager), median(graphed));
    line("itl_batch1_eager", e * 1e3, "ms");
    line("itl_batch1_graphs", g * 1e3, "ms");
    line("itl_batch1_graphs_reduction", (1.0 - g / e) * 100.0, "%");
    let graphs_gbs = weight_bytes / g / 1e9;
    line("decode_weight_gbs[batch=1,graphs]", graphs_gbs, "GB/s");
    line(
        "decode_fraction_of_copy_read[batch=1,graphs]",
        graphs_gbs / (copy / 2.0),
        "",
    );
    line(
        "decode_fraction_of_copy_traffic[batch=1,graphs]",
        graphs_gbs / copy,
        "",
    );
    lm.model.enable_cuda_graphs(0, 0)?;

    for len in [512usize, 2048] {
        let mut kv = lm.model.new_kv_cache(len.div_ceil(BLOCK), BLOCK)?;
        let b = fresh_prompt(len);
        lm.model.forward(&b, &mut kv)?;
        let mut times = Vec::new();
        for _ in 0..5 {
            let t = Instant::now();
            lm.model.forward(&b, &mut kv)?;
            times.push(t.elapsed().as_secs_f64());
        }
        line(
            &format!("prefill_tok_s[{len}]"),
            len as f64 / median(times),
            "tok/s",
        );
    }
    // A prompt length never seen before vs the same lengths again: a served prefill almost
    // always has a new length, so a one-time cost per shape (library heuristics, kernel
    // loading) lands on TTFT although a profile that repeats shapes never sees it.
    let mut kv = lm.model.new_kv_cache(512usize.div_ceil(BLOCK), BLOCK)?;
    let prefill_ms = |len: usize, kv: &mut KvCache| -> Result<f64> {
        let b = fresh_prompt(len);
        let t = Instant::now();
        lm.model.forward(&b, kv)?;
        Ok(t.elapsed().as_secs_f64() * 1e3)
    };
    // As a server starts: one step at each GEMM row bucket (engine::memory_plan).
    for rows in lm.model.gemm_row_buckets(512) {
        prefill_ms(rows, &mut kv)?;
    }
    let lens: Vec<usize> = (0..8).map(|i| 301 + 7 * i).collect();
    let first: Vec<f64> = lens
        .iter()
        .map(|&n| prefill_ms(n, &mut kv))
        .collect::<Result<_>>()?;
    let again: Vec<f64> = lens
        .iter()
        .map(|&n| prefill_ms(n, &mut kv))
        .collect::<Result<_>>()?;
    line(
        "prefill_ms[~330 tokens,new length,warmed buckets]",
        median(first),
        "ms",
    );
    line("prefill_ms[~330 tokens,seen length]", median(again), "ms");

    // The arena after the 2,048-token prefill: one layer's scratch plus the residual
    // stream, not every layer's activations.
    if let Some(bytes) = lm.model.activation_bytes() {
        line(
            "activation_arena",
            bytes as f64 / (1u64 << 20) as f64,
            "MiB",
        );
    }
    Ok(())
}
