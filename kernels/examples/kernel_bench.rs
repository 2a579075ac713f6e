//! Kernel micro-benchmarks on the GPU, printed as `name: value unit` lines.
//!
//!   cargo run --release -p infer-kernels --features cuda --example kernel_bench
//!
//! Shapes are Llama-3.2-3B's (24 query heads, 8 KV heads, head_dim 128, hidden 3072,
//! intermediate 8192), block size 16. Decode attention is also timed as a replayed CUDA graph,
//! the Phase 9 question: does a captured launch run as fast as an eager one? The cuBLAS GEMMs
//! are timed at its and Llama-3.2-1B's projection shapes, decode batches as a fraction of a
//! read-only kernel's bandwidth. Prefill attention, each kernel the device runs
//! (the tensor-core one and the row kernel), is also timed at Llama-3.2-1B's heads (32 over 8,
//! head_dim 64): a fresh 2,048-token prompt and a 512-token chunk after 1,536 cached tokens.
//! Decode attention over an fp8 KV pool (`--kv-cache-dtype fp8`) is timed beside the bf16 one
//! (names ending `,kv=fp8`): it reads half the bytes.

use std::sync::Arc;

use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use infer_kernels::cuda::{
    DecodeKernel, DeviceBlockTables, DeviceKv, Gemm, Kernels, PrefillKernel, Span,
};
use infer_kernels::layout::{AttentionConfig, KvCacheShape, KvDtype};
use infer_kernels::reference::{default_inv_freq, RmsWeight, RopeTable};

const WARMUP: usize = 5;
const ITERS: usize = 50;
const CONTEXT: usize = 1024;
const BLOCK_SIZE: usize = 16;

/// Mean milliseconds per call of `step` over `ITERS` calls, timed with CUDA events.
fn time_ms<E: std::fmt::Debug>(
    stream: &Arc<CudaStream>,
    mut step: impl FnMut() -> Result<(), E>,
) -> f64 {
    for _ in 0..WARMUP {
        step().unwrap();
    }
    let start = stream
        .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .unwrap();
    for _ in 0..ITERS {
        step().unwrap();
    }
    let end = stream
        .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .unwrap();
    end.synchronize().unwrap();
    start.elapsed_ms(&end).unwrap() as f64 / ITERS as f64
}

fn bf16_buffer(stream: &Arc<CudaStream>, len: usize) -> CudaSlice<u16> {
    // 0x3c00 = bf16 0.0078125: finite, nonzero, the same everywhere (timing only).
    stream.clone_htod(&vec![0x3c00u16; len]).unwrap()
}

/// A K or V pool of `len` elements of `dtype`, as bytes: bf16 0.0078125 (0x3c00) or fp8
/// 0.03125 (0x10), finite and nonzero, the same everywhere (timing only).
fn kv_buffer(stream: &Arc<CudaStream>, len: usize, dtype: KvDtype) -> CudaSlice<u8> {
    let bytes: Vec<u8> = match dtype {
        KvDtype::Bf16 => [0x00u8, 0x3c].repeat(len),
        KvDtype::Fp8E4m3 => vec![0x10u8; len],
    };
    stream.clone_htod(&bytes).unwrap()
}

fn main() {
    let ctx = CudaContext::new(0).expect("a CUDA device");
    let stream = ctx.new_stream().unwrap();
    let kernels = Kernels::load(stream.clone()).expect("kernels compile and load");
    // Each kernel timed on its own, as before programmatic dependent launch: with it, a launch
    // would overlap the tail of the same kernel's previous run. What it buys the engine's
    // chain of different kernels is gpu_bench's pdl_step_speedup.
    kernels.set_programmatic_launch(false);
    println!(
        "# device {} sm_{}{}",
        ctx.name().unwrap(),
        kernels.arch.major,
        kernels.arch.minor
    );

    let cfg = AttentionConfig::new(24, 8, 128);
    let llama_1b = AttentionConfig::new(32, 8, 64);
    for attention in [&cfg, &llama_1b] {
        for batch in [1usize, 8, 32] {
            for kernel in [DecodeKernel::Grouped, DecodeKernel::PerHead] {
                for dtype in [KvDtype::Bf16, KvDtype::Fp8E4m3] {
                    bench_decode(&kernels, &stream, attention, batch, kernel, dtype);
                }
            }
        }
    }
    for (attention, tokens, start) in [
        (&cfg, 512, 0),
        (&cfg, 2048, 0),
        (&llama_1b, 2048, 0),
        (&llama_1b, 512, 1536),
    ] {
        bench_prefill(&kernels, &stream, attention, tokens, start);
    }
    bench_elementwise(&kernels, &stream, &cfg, 512);
    bench_gemm(&kernels, &stream);
}

fn bench_decode(
    kernels: &Kernels,
    stream: &Arc<CudaStream>,
    cfg: &AttentionConfig,
    batch: usize,
    kernel: DecodeKernel,
    dtype: KvDtype,
) {
    let blocks_per_seq = CONTEXT / BLOCK_SIZE;
    let shape = KvCacheShape {
        num_blocks: batch * blocks_per_seq,
        block_size: BLOCK_SIZE,
        num_kv_heads: cfg.num_kv_heads,
        head_dim: cfg.head_dim,
    };
    let (k, v) = (
        kv_buffer(stream, shape.len(), dtype),
        kv_buffer(stream, shape.len(), dtype),
    );
    let table: Vec<i32> = (0..(batch * blocks_per_seq) as i32).collect();
    let table = stream.clone_htod(&table).unwrap();
    let lens = stream.clone_htod(&vec![CONTEXT as i32; batch]).unwrap();
    let q = bf16_buffer(stream, batch * cfg.num_heads * cfg.head_dim);
    let out = bf16_buffer(stream, q.len());
    let kv = DeviceKv::of(&k, &v, dtype, shape);
    let tables = DeviceBlockTables {
        table: Span::of(&table),
        max_blocks_per_seq: blocks_per_seq,
    };
    let splits = kernels.decode_splits_with(kernel, batch, &tables, cfg, kv.shape.block_size);
    let scratch = stream
        .alloc_zeros::<f32>(Kernels::decode_scratch_len(batch, cfg, splits).max(1))
        .unwrap();
    let tag = format!(
        "{kernel:?},heads={}/{},head_dim={},batch={batch},ctx={CONTEXT}{}",
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        if dtype == KvDtype::Fp8E4m3 {
            ",kv=fp8"
        } else {
            ""
        }
    );
    println!("paged_attention_decode_splits[{tag}]: {splits}");
    let launch = || {
        kernels.paged_attention_decode_with(
            kernel,
            Span::of(&out),
            Span::of(&q),
            &kv,
            &tables,
            Span::of(&lens),
            cfg,
            splits,
            Span::of(&scratch),
        )
    };
    let eager = time_ms(stream, &launch);
    // Unique K+V bytes each step must read at least once.
    let bytes = (2 * batch * CONTEXT * cfg.num_kv_heads * cfg.head_dim * 2) as f64;
    println!("paged_attention_decode_us[{tag}]: {:.1} us", eager * 1e3);
    println!(
        "paged_attention_decode_gbps[{tag}]: {:.1} GB/s",
        bytes / (eager * 1e-3) / 1e9
    );

    // The same launch captured into a graph and replayed (cudarc's cross-stream event
    // tracking is not capturable, hence turned off around the capture).
    let ctx = stream.context().clone();
    unsafe { ctx.disable_event_tracking() };
    let graph = stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .and_then(|_| launch())
        .and_then(|_| {
            stream.end_capture(
                CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
            )
        });
    unsafe { ctx.enable_event_tracking() };
    match graph {
        Ok(Some(graph)) => {
            let replay = time_ms(stream, || graph.launch());
            println!(
                "paged_attention_decode_graph_us[{tag}]: {:.1} us",
                replay * 1e3
            );
            println!(
                "paged_attention_decode_graph_vs_eager[{tag}]: {:.2} x",
                replay / eager
            );
        }
        Ok(None) => println!("# graph capture returned no graph"),
        Err(e) => println!("# graph capture failed: {e}"),
    }
}

/// Prefill attention over one sequence: `tokens` queries after `start` cached keys, each kernel
/// this device runs. TFLOP/s count the work causal attention must do: 4 · head_dim FLOPs per
/// (query, visible key) and head (Q·K and P·V), for a fresh n-token prompt 2 · n² · head_dim
/// per head (the causal half).
fn bench_prefill(
    kernels: &Kernels,
    stream: &Arc<CudaStream>,
    cfg: &AttentionConfig,
    tokens: usize,
    start: usize,
) {
    let blocks = (start + tokens).div_ceil(BLOCK_SIZE);
    let shape = KvCacheShape {
        num_blocks: blocks,
        block_size: BLOCK_SIZE,
        num_kv_heads: cfg.num_kv_heads,
        head_dim: cfg.head_dim,
    };
    let (k, v) = (
        kv_buffer(stream, shape.len(), KvDtype::Bf16),
        kv_buffer(stream, shape.len(), KvDtype::Bf16),
    );
    let table = stream
        .clone_htod(&(0..blocks as i32).collect::<Vec<_>>())
        .unwrap();
    let cu = stream.clone_htod(&[0, tokens as i32]).unwrap();
    let start_pos = stream.clone_htod(&[start as i32]).unwrap();
    let q = bf16_buffer(stream, tokens * cfg.num_heads * cfg.head_dim);
    let out = bf16_buffer(stream, q.len());
    let kv = DeviceKv::of(&k, &v, KvDtype::Bf16, shape);
    let tables = DeviceBlockTables {
        table: Span::of(&table),
        max_blocks_per_seq: blocks,
    };
    let visible_keys: usize = (1..=tokens).map(|i| start + i).sum();
    let flops = 4.0 * (visible_keys * cfg.num_heads * cfg.head_dim) as f64;
    let mut kinds = vec![PrefillKernel::Rows];
    if kernels.prefill_kernel() == PrefillKernel::Flash {
        kinds.insert(0, PrefillKernel::Flash);
    }
    for kernel in kinds {
        let ms = time_ms(stream, || {
            kernels.paged_attention_prefill_with(
                kernel,
                Span::of(&out),
                Span::of(&q),
                &kv,
                &tables,
                Span::of(&cu),
                Span::of(&start_pos),
                cfg,
            )
        });
        let tag = format!(
            "{kernel:?},heads={}/{},head_dim={},tokens={tokens},cached={start}",
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        );
        println!("paged_attention_prefill_us[{tag}]: {:.1} us", ms * 1e3);
        println!(
            "paged_attention_prefill_tflops[{tag}]: {:.2} TFLOP/s",
            flops / (ms * 1e-3) / 1e12
        );
    }
}

fn bench_elementwise(
    kernels: &Kernels,
    stream: &Arc<CudaStream>,
    cfg: &AttentionConfig,
    tokens: usize,
) {
    let (hidden, inter) = (3072, 8192);
    let gbps = |bytes: usize, ms: f64| bytes as f64 / (ms * 1e-3) / 1e9;

    let x = bf16_buffer(stream, tokens * hidden);
    let w = bf16_buffer(stream, hidden);
    let y = bf16_buffer(stream, x.len());
    let ms = time_ms(stream, || {
        kernels.rms_norm(
            Span::of(&y),
            Span::of(&x),
            Span::of(&w),
            1e-5,
            RmsWeight::Scale,
        )
    });
    println!(
        "rms_norm_gbps[tokens={tokens},hidden={hidden}]: {:.1} GB/s",
        gbps(4 * x.len(), ms)
    );

    let residual = bf16_buffer(stream, x.len());
    let ms = time_ms(stream, || {
        kernels.fused_add_rms_norm(
            Span::of(&y),
            Span::of(&residual),
            Span::of(&x),
            Span::of(&w),
            1e-5,
            RmsWeight::Scale,
        )
    });
    // Reads residual and x, writes residual and out.
    println!(
        "fused_add_rms_norm_gbps[tokens={tokens},hidden={hidden}]: {:.1} GB/s",
        gbps(8 * x.len(), ms)
    );

    let gate_up = bf16_buffer(stream, tokens * 2 * inter);
    let act = bf16_buffer(stream, tokens * inter);
    let ms = time_ms(stream, || {
        kernels.silu_and_mul(Span::of(&act), Span::of(&gate_up), inter)
    });
    println!(
        "silu_and_mul_gbps[tokens={tokens},inter={inter}]: {:.1} GB/s",
        gbps(6 * tokens * inter, ms)
    );

    let table = RopeTable::new(&default_inv_freq(cfg.head_dim, 500_000.0), 4096);
    let (cos, sin) = (
        stream.clone_htod(&table.cos).unwrap(),
        stream.clone_htod(&table.sin).unwrap(),
    );
    let positions = stream
        .clone_htod(&(0..tokens as i32).collect::<Vec<_>>())
        .unwrap();
    let q = bf16_buffer(stream, tokens * cfg.num_heads * cfg.head_dim);
    let k = bf16_buffer(stream, tokens * cfg.num_kv_heads * cfg.head_dim);
    let ms = time_ms(stream, || {
        kernels.rope_neox(
            Span::of(&q),
            Span::of(&k),
            Span::of(&positions),
            Span::of(&cos),
            Span::of(&sin),
            cfg.num_heads,
            cfg.num_kv_heads,
        )
    });
    println!(
        "rope_neox_gbps[tokens={tokens}]: {:.1} GB/s",
        gbps(4 * (q.len() + k.len()), ms)
    );

    let shape = KvCacheShape {
        num_blocks: tokens / BLOCK_SIZE,
        block_size: BLOCK_SIZE,
        num_kv_heads: cfg.num_kv_heads,
        head_dim: cfg.head_dim,
    };
    let (kc, vc) = (
        kv_buffer(stream, shape.len(), KvDtype::Bf16),
        kv_buffer(stream, shape.len(), KvDtype::Bf16),
    );
    let slots = stream
        .clone_htod(&(0..tokens as i32).collect::<Vec<_>>())
        .unwrap();
    let key = bf16_buffer(stream, shape.len());
    let ms = time_ms(stream, || {
        kernels.reshape_and_cache(
            Span::of(&key),
            Span::of(&key),
            &DeviceKv::of(&kc, &vc, KvDtype::Bf16, shape),
            Span::of(&slots),
        )
    });
    println!(
        "reshape_and_cache_gbps[tokens={tokens}]: {:.1} GB/s",
        gbps(8 * shape.len(), ms)
    );
}

/// The bandwidth a read-only kernel reaches over 1 GiB (GB/s): the ceiling of anything
/// that only reads, as a decode step's GEMMs do.
fn read_only_gbs(kernels: &Kernels, stream: &Arc<CudaStream>) -> f64 {
    let bytes = 1usize << 30;
    let src = stream.alloc_zeros::<u8>(bytes).unwrap();
    let sink = stream
        .alloc_zeros::<u32>(Kernels::read_only_sink_len())
        .unwrap();
    let ms = time_ms(stream, || {
        kernels.read_only(Span::of(&src), Span::of(&sink))
    });
    bytes as f64 / (ms * 1e-3) / 1e9
}

/// `x @ w^T` at Llama-3.2-3B's and Llama-3.2-1B's projection shapes (fused QKV, o_proj,
/// fused gate/up, down), at decode batches 1-32 and a 512-row prefill. A decode batch's GEMM
/// reads its weight once: its bytes over the read-only bandwidth say whether cuBLAS is at
/// bandwidth there (issue 35's question for a GEMV path at batches of 8 or fewer).
fn bench_gemm(kernels: &Kernels, stream: &Arc<CudaStream>) {
    let gemm = match Gemm::new(stream.clone()) {
        Ok(gemm) => gemm,
        Err(e) => {
            println!("# gemm skipped: {e}");
            return;
        }
    };
    let read = read_only_gbs(kernels, stream);
    println!("read_only_bandwidth: {read:.1} GB/s");
    let shapes = |model: &'static str, hidden: usize, inter: usize, kv: usize| {
        [
            (model, "qkv", hidden + 2 * kv, hidden),
            (model, "o", hidden, hidden),
            (model, "gate_up", 2 * inter, hidden),
            (model, "down", hidden, inter),
            // The LM head at Llama 3's vocabulary: the largest single read of a decode step.
            (model, "lm_head", 128_256, hidden),
        ]
    };
    let all = [
        shapes("3b", 3072, 8192, 1024),
        shapes("1b", 2048, 8192, 512),
    ];
    for (model, name, n, k) in all.into_iter().flatten() {
        // Copies of the weight cycled through, 256 MiB in all: in a decode step every layer's
        // weights stream past, so none is still in L2 (50 MB on an H100) when read again.
        let copies = (256usize << 20).div_ceil(2 * n * k);
        let ws: Vec<CudaSlice<u16>> = (0..copies).map(|_| bf16_buffer(stream, n * k)).collect();
        for m in [1usize, 2, 4, 8, 16, 32, 512] {
            let x = bf16_buffer(stream, m * k);
            let out = bf16_buffer(stream, m * n);
            let mut next = 0;
            let ms = time_ms(stream, || {
                next = (next + 1) % copies;
                gemm.matmul_bf16(Span::of(&out), Span::of(&x), Span::of(&ws[next]), m, n, k)
            });
            let tag = format!("{model},{name},m={m},n={n},k={k}");
            println!(
                "gemm_tflops[{tag}]: {:.2} TFLOP/s",
                2.0 * (m * n * k) as f64 / (ms * 1e-3) / 1e12
            );
            // Small m is weight-bandwidth bound.
            let gbs = (2 * (n * k + m * k + m * n)) as f64 / (ms * 1e-3) / 1e9;
            println!("gemm_gbps[{tag}]: {gbs:.1} GB/s");
            if m <= 32 {
                println!("gemm_fraction_of_read_only[{tag}]: {:.2}", gbs / read);
            }
            // The skinny GEMM the engine may pick instead at these rows (the CUDA backend
            // times both at start).
            if Kernels::gemv_applies(Span::of(&x), Span::of(&ws[0]), m, k) {
                let gemv_ms = time_ms(stream, || {
                    next = (next + 1) % copies;
                    let w = Span::of(&ws[next]);
                    kernels.gemv_bf16(Span::of(&out), Span::of(&x), w, m, n, k)
                });
                let gemv_gbs = (2 * (n * k + m * k + m * n)) as f64 / (gemv_ms * 1e-3) / 1e9;
                println!("gemv_fraction_of_read_only[{tag}]: {:.2}", gemv_gbs / read);
                println!("gemv_speedup_over_cublas[{tag}]: {:.2}x", ms / gemv_ms);
            }
        }
    }
}
