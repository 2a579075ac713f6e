//! Model-runner throughput on this machine, printed as `name: value unit` lines:
//! memory bandwidth and matmul GFLOP/s (the roofline), then decode tokens/s at batch 1, 8
//! and 32 and prefill tokens/s at 512 for `builtin:tiny` and a generated ~0.5B Llama, each
//! with weights held in f32 and in bf16, with the fraction of the roofline each reaches
//! (at batch 1: of the measured memory-read bandwidth).
//!
//! `cargo run --release -p infer-engine --example runner_bench [-- --quick | --kernels | --kv]`
//! (`--quick` skips the 0.5B model, whose first run also writes ~2 GB into the cache;
//! `--kernels` stops after the linear kernel's own figures; `--kv` times only the 0.5B
//! model's decode at 2,048 tokens of context with its KV cache in f32 and in fp8).

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use infer_core::workload::KvCacheDtype;
use infer_engine::tools::builtin;
use infer_engine::tools::make_model::{make_model, ModelSpec};
use infer_engine::{load_model, Arch, ForwardBatch, LoadedModel, SeqChunk};
use std::time::Instant;

fn line(name: &str, value: f64, unit: &str) {
    println!("{name}: {value:.2} {unit}");
}

/// Best-of-n wall time of `f`, in seconds.
fn best_of(n: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    let mut best = f64::INFINITY;
    for _ in 0..n {
        let t = Instant::now();
        f()?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(best)
}

/// Memory bandwidth with all cores: each thread streams its share of `src` (pre-touched,
/// far larger than the caches). Returns (read GB/s, copy GB/s counting bytes read plus
/// written).
fn memory_bandwidth_gbs(src: &[u64]) -> (f64, f64) {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let n = src.len();
    let mut dst: Vec<u64> = vec![1; n];
    let chunk = n.div_ceil(threads);
    let read = read_bandwidth_gbs(src);
    let copy = best_of_plain(5, || {
        std::thread::scope(|s| {
            for (d, part) in dst.chunks_mut(chunk).zip(src.chunks(chunk)) {
                s.spawn(move || d.copy_from_slice(part));
            }
        })
    });
    (read, 2.0 * (n * 8) as f64 / copy / 1e9)
}

/// Read bandwidth now, in GB/s: the best of 3 passes of all cores over `buf` (far larger
/// than the caches). This machine's bandwidth drifts with its neighbours' load, so a
/// decode is compared with the bandwidth measured next to it, not at the start of the run.
fn read_bandwidth_gbs(buf: &[u64]) -> f64 {
    use rayon::prelude::*;
    let threads = rayon::current_num_threads().max(1);
    let secs = best_of_plain(3, || {
        // Integer adds vectorise (they are associative), so this is load-bound.
        let sum = buf
            .par_chunks(buf.len().div_ceil(threads))
            .map(|part| part.iter().fold(0u64, |a, &x| a.wrapping_add(x)))
            .reduce(|| 0, u64::wrapping_add);
        std::hint::black_box(sum);
    });
    std::mem::size_of_val(buf) as f64 / secs / 1e9
}

fn best_of_plain(n: usize, mut f: impl FnMut()) -> f64 {
    let mut best = f64::INFINITY;
    for _ in 0..n {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_secs_f64());
    }
    best
}

/// The CPU backend's linear kernel alone on the 0.5B model's MLP shapes: at 1 row the bytes
/// of weights it reads per second, at more rows its GFLOP/s. Each timed pass cycles through
/// 256 MiB of weight copies, so that, as in a model, no weight is still in cache.
fn linear_kernel_lines() -> [f64; 2] {
    let mut peak = [0f64; 2];
    use infer_kernels::cpu_matmul::Weights;
    for (n, k) in [(8192, 1024), (1024, 4096)] {
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i % 97) as f32 - 48.0) / 97.0)
            .collect();
        for (label, bytes) in [("f32", 4), ("bf16", 2)] {
            let copies = ((256 << 20) / (n * k * bytes)).max(1);
            let weights: Vec<Weights> = (0..copies)
                .map(|_| match bytes {
                    4 => Weights::f32(n, k, &w),
                    _ => Weights::bf16(
                        n,
                        k,
                        &w.iter()
                            .map(|&v| half::bf16::from_f32(v))
                            .collect::<Vec<_>>(),
                    ),
                })
                .collect();
            for m in [1, 8, 32, 512] {
                let x = vec![0.5f32; m * k];
                let mut y = vec![0f32; m * n];
                let secs = best_of_plain(3, || {
                    for w in &weights {
                        w.matmul_t(&x, m, &mut y);
                    }
                }) / copies as f64;
                let name = format!("linear[{label},{m}x{n}x{k}]");
                if m == 1 {
                    line(&name, (n * k * bytes) as f64 / secs / 1e9, "GB/s");
                } else {
                    let gflops = 2.0 * (m * n * k) as f64 / secs / 1e9;
                    let p = &mut peak[usize::from(bytes == 2)];
                    *p = p.max(gflops);
                    line(&name, gflops, "GFLOP/s");
                }
            }
        }
    }
    peak
}

fn matmul_gflops(m: usize, k: usize, n: usize) -> Result<f64> {
    let a = Tensor::ones((m, k), DType::F32, &Device::Cpu)?;
    let b = Tensor::ones((n, k), DType::F32, &Device::Cpu)?;
    let secs = best_of(5, || {
        a.matmul(&b.t()?)?;
        Ok(())
    })?;
    Ok(2.0 * (m * k * n) as f64 / secs / 1e9)
}

/// Decode step time with `batch` sequences of `ctx` tokens already in the cache.
fn decode_tokens_per_s(
    lm: &LoadedModel,
    batch: usize,
    ctx: usize,
    steps: usize,
) -> Result<(f64, f64)> {
    let bs = 16;
    let blocks_per_seq = (ctx + steps + 1).div_ceil(bs);
    let mut cache = lm.model.new_kv_cache(batch * blocks_per_seq, bs)?;
    let vocab = lm.config.vocab_size as u32;
    let tables: Vec<Vec<u32>> = (0..batch)
        .map(|i| ((i * blocks_per_seq) as u32..((i + 1) * blocks_per_seq) as u32).collect())
        .collect();
    // Prefill each sequence (not timed).
    for t in &tables {
        let tokens = (0..ctx as u32)
            .map(|i| 10 + (i * 7919) % (vocab - 10))
            .collect();
        let b = ForwardBatch {
            seqs: vec![SeqChunk {
                tokens,
                start_pos: 0,
                block_table: t.clone(),
                sample: false,
                all_logits: false,
            }],
        };
        lm.model.forward(&b, &mut cache)?;
    }
    let start = Instant::now();
    for s in 0..steps {
        let b = ForwardBatch {
            seqs: tables
                .iter()
                .map(|t| SeqChunk {
                    tokens: vec![11 + s as u32],
                    start_pos: ctx + s,
                    block_table: t.clone(),
                    sample: true,
                    all_logits: false,
                })
                .collect(),
        };
        lm.model.forward(&b, &mut cache)?;
    }
    let step = start.elapsed().as_secs_f64() / steps as f64;
    Ok((batch as f64 / step, step))
}

fn prefill_tokens_per_s(lm: &LoadedModel, len: usize) -> Result<f64> {
    let bs = 16;
    let mut cache = lm.model.new_kv_cache(len.div_ceil(bs), bs)?;
    let vocab = lm.config.vocab_size as u32;
    let tokens: Vec<u32> = (0..len as u32)
        .map(|i| 10 + (i * 104729) % (vocab - 10))
        .collect();
    let table: Vec<u32> = (0..len.div_ceil(bs) as u32).collect();
    let secs = best_of(2, || {
        let b = ForwardBatch {
            seqs: vec![SeqChunk {
                tokens: tokens.clone(),
                start_pos: 0,
                block_table: table.clone(),
                sample: true,
                all_logits: false,
            }],
        };
        lm.model.forward(&b, &mut cache)?;
        Ok(())
    })?;
    Ok(len as f64 / secs)
}

fn bench_model(
    name: &str,
    lm: &LoadedModel,
    bw_buf: &[u64],
    peak_gflops: f64,
    ctx: usize,
    prefill_len: usize,
    steps: usize,
) -> Result<()> {
    let c = &lm.config;
    let params = c.num_parameters() as f64;
    let table = (c.vocab_size * c.hidden_size) as f64;
    // What a step multiplies: every weight but the embedding table, which is only gathered
    // (the LM head — the same table when tied — is read for sampled rows only).
    let head = if c.tie_word_embeddings { 0.0 } else { table };
    let body = params - table - head;
    let weight_bytes = lm.model.weight_dtype().size_in_bytes() as f64;
    let kv_bytes_per_elem = lm.model.kv_dtype().size_in_bytes() as f64;
    line(&format!("params[{name}]"), params / 1e6, "M");
    for batch in [1, 8, 32] {
        // Batch 1 is timed over more steps, between two bandwidth measurements.
        let before = read_bandwidth_gbs(bw_buf);
        let steps = if batch == 1 { steps.max(16) } else { steps };
        let (tps, step) = decode_tokens_per_s(lm, batch, ctx, steps)?;
        let bw_gbs = before.max(read_bandwidth_gbs(bw_buf));
        // Roofline of a decode step: the slower of reading every multiplied weight once
        // plus each sequence's KV at the measured read bandwidth, and 2 FLOPs per weight
        // per sequence at the measured matmul peak.
        let kv_bytes = (batch * (ctx + steps / 2) * 2 * c.num_layers * c.num_kv_heads * c.head_dim)
            as f64
            * kv_bytes_per_elem;
        let memory_floor = ((body + table) * weight_bytes + kv_bytes) / (bw_gbs * 1e9);
        let compute_floor = batch as f64 * 2.0 * (body + table) / (peak_gflops * 1e9);
        let floor = memory_floor.max(compute_floor);
        line(
            &format!("decode_tokens_per_s[{name},batch={batch},ctx={ctx}]"),
            tps,
            "tok/s",
        );
        line(
            &format!("decode_step_ms[{name},batch={batch}]"),
            step * 1e3,
            "ms",
        );
        line(
            &format!("decode_roofline_fraction[{name},batch={batch}]"),
            floor / step,
            "",
        );
        if batch == 1 {
            line(
                &format!("read_bandwidth_next_to_it[{name}]"),
                bw_gbs,
                "GB/s",
            );
        }
    }
    let tps = prefill_tokens_per_s(lm, prefill_len)?;
    line(
        &format!("prefill_tokens_per_s[{name},len={prefill_len}]"),
        tps,
        "tok/s",
    );
    line(
        &format!("prefill_roofline_fraction[{name}]"),
        tps * 2.0 * body / 1e9 / peak_gflops,
        "",
    );
    Ok(())
}

fn main() -> Result<()> {
    // As `engine serve` runs a model: freed memory kept, every op on a compute-pool worker.
    infer_engine::runtime::host::keep_freed_memory();
    infer_engine::runtime::host::run_in_compute_pool("bench", bench)?
}

fn bench() -> Result<()> {
    let quick = std::env::args().any(|a| a == "--quick");
    let bw_buf: Vec<u64> = (0..64u64 << 20).collect(); // 512 MiB
    let (bw, copy_bw) = memory_bandwidth_gbs(&bw_buf);
    line("memory_read_bandwidth", bw, "GB/s");
    line("memory_copy_bandwidth", copy_bw, "GB/s");
    let peak = matmul_gflops(1024, 1024, 1024)?;
    line("matmul_gflops[1024x1024x1024]", peak, "GFLOP/s");
    line(
        "matmul_gflops[32x1024x4096]",
        matmul_gflops(32, 1024, 4096)?,
        "GFLOP/s",
    );

    // The compute roof of each weight dtype: the faster of candle's f32 GEMM and our kernel.
    let [f32_peak, bf16_peak] = linear_kernel_lines();
    if std::env::args().any(|a| a == "--kernels") {
        return Ok(());
    }
    let dtypes = [
        ("f32", DType::F32, peak.max(f32_peak)),
        ("bf16", DType::BF16, peak.max(bf16_peak)),
    ];
    if std::env::args().any(|a| a == "--kv") {
        // bf16 weights, so the KV is a large share of what a step reads.
        let dir = llama_05b()?;
        for (label, kv) in [("f32", KvCacheDtype::Auto), ("fp8", KvCacheDtype::Fp8)] {
            let mut lm = load_model(
                dir.to_str().unwrap(),
                Some(DType::BF16),
                infer_engine::Device::Cpu,
            )?;
            lm.model.set_kv_cache_dtype(kv);
            let name = format!("llama-0.5b,bf16,kv={label}");
            bench_model(&name, &lm, &bw_buf, peak.max(bf16_peak), 2048, 512, 4)?;
        }
        return Ok(());
    }
    for (label, dtype, peak) in dtypes {
        let tiny = load_model(builtin::TINY, Some(dtype), infer_engine::Device::Cpu)?;
        bench_model(
            &format!("builtin:tiny,{label}"),
            &tiny,
            &bw_buf,
            peak,
            128,
            512,
            16,
        )?;
    }

    if !quick {
        let dir = llama_05b()?;
        for (label, dtype, peak) in dtypes {
            let lm = load_model(
                dir.to_str().unwrap(),
                Some(dtype),
                infer_engine::Device::Cpu,
            )?;
            bench_model(
                &format!("llama-0.5b,{label}"),
                &lm,
                &bw_buf,
                peak,
                128,
                512,
                4,
            )?;
        }
    }
    Ok(())
}

/// The generated ~0.5B Llama under the builtin cache, built once.
fn llama_05b() -> Result<std::path::PathBuf> {
    let dir = builtin::cache_dir().join("bench-llama-0.5b-v1");
    if !dir.join("model.safetensors").exists() {
        let spec = ModelSpec {
            layers: 28,
            hidden: 1024,
            heads: 16,
            kv_heads: 4,
            intermediate: 4096,
            vocab: 32768,
            max_pos: 4096,
            ..ModelSpec::new(Arch::Llama)
        };
        eprintln!("building {} (once)…", dir.display());
        make_model(&spec, &dir)?;
    }
    Ok(dir)
}
