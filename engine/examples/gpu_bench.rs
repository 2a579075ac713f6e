//! The CUDA backend's speed, as `name: value unit` lines, on generated models of
//! Llama-3.2-1B's shape (bf16, random weights) with a 32,768 and a 128,256 vocabulary:
//! - the bandwidth a read-only kernel reaches (the ceiling of a decode step, which only
//!   reads) and, for reference, a device-to-device copy's (read plus written);
//! - decode steps at batch 1 / 8 / 32 / 64 and contexts 512 / 2,048 / 4,096, eager and with
//!   CUDA graphs, greedy and at temperature 1 with top-p 0.9, sampled on the host and on the
//!   device (sampling is part of a step), and at context 512 greedy with one row of the
//!   batch constrained to JSON (its grammar's mask computed on the host, applied where the
//!   step samples):
//!   ms per step, tok/s, the bytes the step must read (every weight but the gathered
//!   embedding table, the output head, each sequence's K/V once) per second, and their
//!   fraction of the read-only bandwidth;
//! - graphed decode steps at batch 1 / 2 / 4 / 8 with the GEMMs chosen at load (cuBLAS or the
//!   skinny GEMM kernel, timed per shape) beside cuBLAS everywhere;
//! - decode steps at batch 1 / 8 / 32, eager and graphed, with programmatic dependent launch
//!   off and on;
//! - a graphed decode step with graphs sized for 4,160 and for 131,072 tokens of context;
//! - prefill tokens/s and ms at 512 and 2,048 tokens, a 512-token chunk after 1,536 cached
//!   tokens, and a new prompt length vs a seen one.
//!
//! `engine/examples/gpu_bench.rs`, run by scripts/gpu-check.sh:
//!   gpu_bench [MODEL_DIR]   (default: generates the models under the builtin cache once)

use std::time::Instant;

use anyhow::Result;
use candle_core::DType;
use infer_engine::runtime::backend::gemv_choice::GemvMode;
use infer_engine::runtime::sampling::{Sampler, SamplingParams};
use infer_engine::runtime::structured::{Grammar, GrammarCompiler};
use infer_engine::tools::builtin;
use infer_engine::tools::make_model::{make_model, ModelSpec};
use infer_engine::{load_model_dir, Arch, Device, ForwardBatch, KvCache, LoadedModel, SeqChunk};
use infer_kernels::cuda::cudarc::driver::CudaContext;
use infer_kernels::cuda::{Kernels, Span};
use infer_kernels::sampling::SamplingBatch;

const BLOCK: usize = 16;

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

/// Seconds per decode step (the forward and sampling each row, on the host or the device)
/// over `steps` steps, after one that may capture a graph. Every step rewrites position
/// `context`, so the context stays `context + 1` tokens.
fn decode_step_s(
    lm: &LoadedModel,
    kv: &mut KvCache,
    tables: &[Vec<u32>],
    context: usize,
    steps: usize,
    samplers: &mut [Sampler],
    on_device: bool,
) -> Result<f64> {
    let mut times = Vec::new();
    for j in 0..=steps {
        let b = ForwardBatch {
            seqs: tables
                .iter()
                .map(|t| SeqChunk {
                    tokens: vec![42],
                    start_pos: context,
                    block_table: t.clone(),
                    sample: true,
                    all_logits: false,
                })
                .collect(),
        };
        let t = Instant::now();
        if on_device {
            // Packed once the step is queued, as the engine does.
            let mut rows = || -> Result<SamplingBatch> {
                let mut batch = SamplingBatch::new();
                for sampler in samplers.iter_mut() {
                    let row = sampler.device_row()?;
                    batch.push_masked(&row.params, row.adjust, row.mask.as_deref())?;
                }
                Ok(batch)
            };
            let out = lm.model.forward_sampled(&b, kv, &mut rows)?;
            for (&token, sampler) in out.tokens.iter().zip(samplers.iter_mut()) {
                sampler.accept_device(token as u32)?;
            }
        } else {
            let logits = lm.model.forward(&b, kv)?;
            for (row, sampler) in logits.iter().zip(samplers.iter_mut()) {
                std::hint::black_box(sampler.sample(row).unwrap());
            }
        }
        if j > 0 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    Ok(median(times))
}

/// A KV pool holding a fill pattern for `batch` sequences of `context + 1` tokens, and
/// their block tables (consecutive blocks each): a decode step's cost does not depend on
/// the values.
fn decode_pool(lm: &LoadedModel, batch: usize, context: usize) -> Result<(KvCache, Vec<Vec<u32>>)> {
    let per_seq = (context + 1).div_ceil(BLOCK);
    let mut kv = lm.model.new_kv_cache(batch * per_seq, BLOCK)?;
    lm.model.fill_pattern(&mut kv)?;
    let tables = (0..batch)
        .map(|i| ((i * per_seq) as u32..((i + 1) * per_seq) as u32).collect())
        .collect();
    Ok((kv, tables))
}

/// A generated model of Llama-3.2-1B's shape with `vocab` tokens under the builtin cache,
/// built once.
fn model_dir(name: &str, vocab: usize) -> Result<std::path::PathBuf> {
    let dir = builtin::cache_dir().join(name);
    if !dir.join("model.safetensors").exists() {
        let spec = ModelSpec {
            layers: 16,
            hidden: 2048,
            heads: 32,
            kv_heads: 8,
            head_dim: Some(64),
            intermediate: 8192,
            vocab,
            max_pos: 8192,
            dtype: DType::BF16,
            ..ModelSpec::new(Arch::Llama)
        };
        eprintln!("building {} (once)…", dir.display());
        make_model(&spec, &dir)?;
    }
    Ok(dir)
}

/// What a read-only kernel reaches (the ceiling of a decode step, which only reads): the
/// median of 10 passes over 2 GiB.
fn read_only_bandwidth_gbs() -> Result<f64> {
    let stream = CudaContext::new(0)?.new_stream()?;
    let kernels = Kernels::load(stream.clone()).map_err(|e| anyhow::anyhow!("{e}"))?;
    let bytes = 2usize << 30;
    let src = stream.alloc_zeros::<u8>(bytes)?;
    let sink = stream.alloc_zeros::<u32>(Kernels::read_only_sink_len())?;
    let mut times = Vec::new();
    for pass in 0..11 {
        stream.synchronize()?;
        let t = Instant::now();
        kernels.read_only(Span::of(&src), Span::of(&sink))?;
        stream.synchronize()?;
        if pass > 0 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    Ok(bytes as f64 / median(times) / 1e9)
}

/// Decode steps at batch 1 / 8 / 32 / 64 and contexts 512 / 2,048 / 4,096, eager and graphed,
/// greedy and sampled at temperature 1 with top-p 0.9, on the host (logits copied back) and
/// on the device: the step's time (forward + sampling every row), the bytes it must read
/// (`ModelConfig::decode_read_bytes`) over that time, and their fraction of `read_gbs`.
fn decode_grid(lm: &LoadedModel, label: &str, read_gbs: f64) -> Result<()> {
    const CONTEXTS: [usize; 3] = [512, 2048, 4096];
    let json = GrammarCompiler::new(&lm.tokenizer, lm.config.vocab_size, &lm.eos_token_ids)?
        .compile(&Grammar::json_object(true))?;
    let top_p = SamplingParams {
        temperature: 1.0,
        top_p: 0.9,
        ..SamplingParams::default()
    };
    for batch in [1, 8, 32, 64] {
        for context in CONTEXTS {
            let (mut kv, tables) = decode_pool(lm, batch, context)?;
            let bytes = lm.config.decode_read_bytes(&vec![context + 1; batch], 2, 2);
            for graphs in [false, true] {
                let max_context = CONTEXTS[2] + 64;
                lm.model
                    .enable_cuda_graphs(if graphs { 64 } else { 0 }, max_context)?;
                let mut cases = vec![
                    ("greedy", SamplingParams::greedy(), false),
                    ("top_p", top_p.clone(), false),
                    ("greedy_device", SamplingParams::greedy(), true),
                    ("top_p_device", top_p.clone(), true),
                ];
                if context == CONTEXTS[0] {
                    cases.push(("one_json", SamplingParams::greedy(), false));
                    cases.push(("one_json_device", SamplingParams::greedy(), true));
                }
                for (sampling, params, on_device) in cases {
                    let mut samplers: Vec<Sampler> = (0..batch)
                        .map(|_| Sampler::new(params.clone(), &[], 0))
                        .collect();
                    if sampling.starts_with("one_json") {
                        samplers[0].constrain(json.clone());
                    }
                    let s =
                        decode_step_s(lm, &mut kv, &tables, context, 10, &mut samplers, on_device)?;
                    let at = format!(
                        "[{label},batch={batch},ctx={context},{},{sampling}]",
                        if graphs { "graphs" } else { "eager" }
                    );
                    line(&format!("decode_step_ms{at}"), s * 1e3, "ms");
                    line(&format!("decode_tok_s{at}"), batch as f64 / s, "tok/s");
                    let gbs = bytes as f64 / s / 1e9;
                    line(&format!("decode_read_gbs{at}"), gbs, "GB/s");
                    line(
                        &format!("decode_fraction_of_read_only{at}"),
                        gbs / read_gbs,
                        "",
                    );
                }
            }
        }
    }
    lm.model.enable_cuda_graphs(0, 0)?;
    Ok(())
}

/// A decode step's seconds with every row greedy, sampled on the device (20 steps).
fn greedy_device_step_s(
    lm: &LoadedModel,
    kv: &mut KvCache,
    tables: &[Vec<u32>],
    context: usize,
) -> Result<f64> {
    let mut samplers: Vec<Sampler> = (0..tables.len())
        .map(|_| Sampler::new(SamplingParams::greedy(), &[], 0))
        .collect();
    decode_step_s(lm, kv, tables, context, 20, &mut samplers, true)
}

/// What the skinny GEMM kernel buys a decode step (issue 35's GEMV path): batches 1 to 8 at
/// 512 tokens of context, graphed, greedy on the device, with the GEMMs the backend chose at
/// load (each shape and batch timed both ways) beside cuBLAS everywhere. The choice itself is
/// printed first.
fn gemv_ab(lm: &LoadedModel, label: &str) -> Result<()> {
    if let Some(choice) = lm.model.launch_description() {
        for l in choice.lines() {
            println!("# {label}: {l}");
        }
    }
    let context = 512;
    for batch in [1usize, 2, 4, 8] {
        let (mut kv, tables) = decode_pool(lm, batch, context)?;
        let mut ms = Vec::new();
        for mode in [GemvMode::Never, GemvMode::Measured] {
            lm.model.set_gemv_mode(mode)?;
            // Graphs captured anew with this mode's GEMMs.
            lm.model.enable_cuda_graphs(64, context + 64)?;
            let s = greedy_device_step_s(lm, &mut kv, &tables, context)?;
            let name = if mode == GemvMode::Never {
                "cublas"
            } else {
                "chosen"
            };
            line(
                &format!("decode_step_ms[{label},batch={batch},ctx={context},graphs,greedy_device,gemm={name}]"),
                s * 1e3,
                "ms",
            );
            ms.push(s);
        }
        line(
            &format!("gemv_step_speedup[{label},batch={batch},ctx={context}]"),
            ms[0] / ms[1],
            "x",
        );
    }
    lm.model.set_gemv_mode(GemvMode::Measured)?;
    lm.model.enable_cuda_graphs(0, 0)?;
    Ok(())
}

/// What programmatic dependent launch buys a decode step (the next kernel scheduled during
/// the tail of the one before): batch 1 / 8 / 32 at 512 tokens of context, eager and graphed,
/// greedy on the device, with it off and on (where the device allows it).
fn pdl_ab(lm: &LoadedModel, label: &str) -> Result<()> {
    let context = 512;
    for batch in [1usize, 8, 32] {
        let (mut kv, tables) = decode_pool(lm, batch, context)?;
        for graphs in [false, true] {
            let mut ms = Vec::new();
            for on in [false, true] {
                lm.model.set_programmatic_launch(on)?;
                // Graphs captured anew with these launches.
                lm.model
                    .enable_cuda_graphs(if graphs { 64 } else { 0 }, context + 64)?;
                let s = greedy_device_step_s(lm, &mut kv, &tables, context)?;
                let mode = if graphs { "graphs" } else { "eager" };
                let pdl = if on { "on" } else { "off" };
                line(
                    &format!("decode_step_ms[{label},batch={batch},ctx={context},{mode},greedy_device,pdl={pdl}]"),
                    s * 1e3,
                    "ms",
                );
                ms.push(s);
            }
            line(
                &format!(
                    "pdl_step_speedup[{label},batch={batch},ctx={context},{}]",
                    if graphs { "graphs" } else { "eager" }
                ),
                ms[0] / ms[1],
                "x",
            );
        }
    }
    lm.model.set_programmatic_launch(true)?;
    lm.model.enable_cuda_graphs(0, 0)?;
    Ok(())
}

/// What a graph's table width costs a decode step: graphs sized for 4,160 tokens and for
/// 131,072 (`--max-model-len` at Llama 3's context), the same step at 512 tokens of context,
/// batch 1 and 64, greedy on the device. The host copies each table row only as wide as the
/// step needs, so the two should match.
fn graph_table_width(lm: &LoadedModel) -> Result<()> {
    let context: usize = 512;
    for batch in [1usize, 64] {
        let (mut kv, tables) = decode_pool(lm, batch, context)?;
        for max_context in [4_160, 131_072] {
            lm.model.enable_cuda_graphs(64, max_context)?;
            let s = greedy_device_step_s(lm, &mut kv, &tables, context)?;
            line(
                &format!(
                    "decode_step_ms[vocab=32768,batch={batch},ctx={context},graphs,max_context={max_context}]"
                ),
                s * 1e3,
                "ms",
            );
        }
    }
    lm.model.enable_cuda_graphs(0, 0)?;
    Ok(())
}

fn main() -> Result<()> {
    let dir = match std::env::args().nth(1) {
        Some(d) => d.into(),
        None => model_dir("bench-llama-1b-bf16-v1", 32_768)?,
    };
    let copy = copy_bandwidth_gbs()?;
    line("d2d_copy_bandwidth", copy, "GB/s");
    let lm = load_model_dir(&dir, None, Device::Cuda(0))?;
    line(
        "model_parameters",
        lm.config.num_parameters() as f64 / 1e9,
        "B",
    );

    // Decode steps over the grid users run, each beside what it must read. The KV holds a
    // fill pattern, not a prefill: a decode step's cost does not depend on the values.
    let read = read_only_bandwidth_gbs()?;
    line("read_only_bandwidth", read, "GB/s");
    decode_grid(&lm, "vocab=32768", read)?;
    gemv_ab(&lm, "vocab=32768")?;
    graph_table_width(&lm)?;
    drop(lm);
    let big = model_dir("bench-llama-1b-v128k-bf16-v1", 128_256)?;
    let lm_big = load_model_dir(&big, None, Device::Cuda(0))?;
    decode_grid(&lm_big, "vocab=128256", read)?;
    gemv_ab(&lm_big, "vocab=128256")?;
    pdl_ab(&lm_big, "vocab=128256")?;
    drop(lm_big);
    let lm = load_model_dir(&dir, None, Device::Cuda(0))?;

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
        let s = median(times);
        line(&format!("prefill_tok_s[{len}]"), len as f64 / s, "tok/s");
        line(&format!("prefill_ms[{len}]"), s * 1e3, "ms");
    }
    // A 512-token chunk after 1,536 cached tokens (chunked prefill's steady state).
    {
        let mut kv = lm.model.new_kv_cache(2048 / BLOCK, BLOCK)?;
        lm.model.forward(&fresh_prompt(1536), &mut kv)?;
        let chunk = ForwardBatch {
            seqs: vec![SeqChunk {
                tokens: (0..512u32).map(|t| 10 + t % 1000).collect(),
                start_pos: 1536,
                block_table: (0..(2048 / BLOCK) as u32).collect(),
                sample: true,
                all_logits: false,
            }],
        };
        lm.model.forward(&chunk, &mut kv)?;
        let mut times = Vec::new();
        for _ in 0..5 {
            let t = Instant::now();
            lm.model.forward(&chunk, &mut kv)?;
            times.push(t.elapsed().as_secs_f64());
        }
        line("prefill_ms[512 after 1536]", median(times) * 1e3, "ms");
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
