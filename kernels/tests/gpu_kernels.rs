//! Every CUDA kernel against its CPU reference on random inputs: relative error ≤ 1e-2
//! (max-abs error over max-abs reference, the references fed the same bf16-rounded inputs).
//!
//! Needs an NVIDIA GPU and driver, so the tests are ignored by default. Run on a GPU machine:
//!   kernels/fetch-nvrtc.sh   # unless a CUDA toolkit provides libnvrtc
//!   cargo test --release -p infer-kernels --features cuda --test gpu_kernels -- --ignored
#![cfg(feature = "cuda")]

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use infer_kernels::bf16;
use infer_kernels::cuda::{
    DecodeKernel, DeviceBlockTables, DeviceKv, DeviceSampledRows, DeviceSamplingBatch, Gemm,
    Kernels, PrefillKernel, Span,
};
use infer_kernels::fp8;
use infer_kernels::layout::{AttentionConfig, BlockTables, KvCacheShape, KvDtype};
use infer_kernels::reference::{self, PagedKv, RmsWeight, RopeTable};
use infer_kernels::sampling::{
    Adjustment, RowParams, SampledRows, SamplingBatch, MAX_TOP_LOGPROBS,
};

const TOLERANCE: f32 = 1e-2;

fn kernels() -> (Kernels, Arc<CudaStream>) {
    let ctx = CudaContext::new(0).expect("a CUDA device");
    let stream = ctx.new_stream().unwrap();
    (
        Kernels::load(stream.clone()).expect("kernels compile and load"),
        stream,
    )
}

/// Uniforms in [0, 1) from a fixed generator, at f32's full 24 bits (the sampling tests' draws:
/// bf16-rounded ones, as [`random`]'s, would give rare tokens all or nothing).
fn uniforms(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32
        })
        .collect()
}

/// Deterministic values in [-scale, scale), already rounded to bf16 so the GPU (bf16 storage)
/// and the reference (f32) see the very same numbers.
fn random(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    uniforms(n, seed)
        .into_iter()
        .map(|unit| bf16::round((2.0 * unit - 1.0) * scale))
        .collect()
}

fn upload(stream: &Arc<CudaStream>, xs: &[f32]) -> CudaSlice<u16> {
    stream.clone_htod(&bf16::slice_from_f32(xs)).unwrap()
}

fn download(stream: &Arc<CudaStream>, xs: &CudaSlice<u16>) -> Vec<f32> {
    bf16::slice_to_f32(&stream.clone_dtoh(xs).unwrap())
}

fn span<T>(xs: &CudaSlice<T>) -> Span<T> {
    Span::of(xs)
}

/// A KV pool of `dtype` holding `xs` (values it represents exactly), as raw bytes.
fn kv_upload(stream: &Arc<CudaStream>, xs: &[f32], dtype: KvDtype) -> CudaSlice<u8> {
    let bytes: Vec<u8> = match dtype {
        KvDtype::Bf16 => bf16::slice_from_f32(xs)
            .into_iter()
            .flat_map(u16::to_le_bytes)
            .collect(),
        KvDtype::Fp8E4m3 => xs.iter().map(|&x| fp8::from_f32(x)).collect(),
    };
    stream.clone_htod(&bytes).unwrap()
}

/// A KV pool's values.
fn kv_download(stream: &Arc<CudaStream>, pool: &CudaSlice<u8>, dtype: KvDtype) -> Vec<f32> {
    let bytes = stream.clone_dtoh(pool).unwrap();
    match dtype {
        KvDtype::Bf16 => bf16::slice_to_f32(
            &bytes
                .chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]]))
                .collect::<Vec<_>>(),
        ),
        KvDtype::Fp8E4m3 => bytes.into_iter().map(fp8::to_f32).collect(),
    }
}

/// What a pool of `dtype` holds of the (bf16) values `xs`.
fn kv_round(xs: &[f32], dtype: KvDtype) -> Vec<f32> {
    match dtype {
        KvDtype::Bf16 => xs.to_vec(),
        KvDtype::Fp8E4m3 => xs.iter().map(|&x| fp8::round(x)).collect(),
    }
}

/// The decode kernels for `cfg`: the grouped one where it serves the group, and the per-head.
fn decode_kernels(cfg: &AttentionConfig) -> Vec<DecodeKernel> {
    match Kernels::decode_kernel(cfg) {
        DecodeKernel::Grouped => vec![DecodeKernel::Grouped, DecodeKernel::PerHead],
        DecodeKernel::PerHead => vec![DecodeKernel::PerHead],
    }
}

/// Decode attention with `kernel` and `splits` (None: the kernels' own choice) into an output
/// that starts as garbage (so rows the kernel must zero really are written), downloaded.
#[allow(clippy::too_many_arguments)]
fn decode(
    kernels: &Kernels,
    stream: &Arc<CudaStream>,
    kernel: DecodeKernel,
    q: &CudaSlice<u16>,
    kv: &DeviceKv,
    tables: &DeviceBlockTables,
    lens: &CudaSlice<i32>,
    cfg: &AttentionConfig,
    splits: Option<usize>,
) -> Vec<f32> {
    let num_seqs = lens.len();
    let splits = splits.unwrap_or_else(|| {
        kernels.decode_splits_with(kernel, num_seqs, tables, cfg, kv.shape.block_size)
    });
    let scratch = stream
        .alloc_zeros::<f32>(Kernels::decode_scratch_len(num_seqs, cfg, splits).max(1))
        .unwrap();
    let out = upload(stream, &random(q.len(), 4, 1.0));
    kernels
        .paged_attention_decode_with(
            kernel,
            span(&out),
            span(q),
            kv,
            tables,
            span(lens),
            cfg,
            splits,
            span(&scratch),
        )
        .unwrap();
    download(stream, &out)
}

/// The prefill kernels this device runs: the tensor-core one (sm_80+) and the row kernel.
fn prefill_kernels(kernels: &Kernels) -> Vec<PrefillKernel> {
    match kernels.prefill_kernel() {
        PrefillKernel::Flash => vec![PrefillKernel::Flash, PrefillKernel::Rows],
        PrefillKernel::Rows => vec![PrefillKernel::Rows],
    }
}

/// Prefill attention with `kernel` into an output first filled with noise (so that an
/// unwritten row shows); returns the whole output.
#[allow(clippy::too_many_arguments)]
fn prefill(
    kernels: &Kernels,
    stream: &Arc<CudaStream>,
    kernel: PrefillKernel,
    q: &CudaSlice<u16>,
    kv: &DeviceKv,
    tables: &DeviceBlockTables,
    cu: &[i32],
    start: &[i32],
    cfg: &AttentionConfig,
) -> Vec<f32> {
    let out = upload(stream, &random(q.len(), 6, 1.0));
    let (cu_dev, start_dev) = (
        stream.clone_htod(cu).unwrap(),
        stream.clone_htod(start).unwrap(),
    );
    kernels
        .paged_attention_prefill_with(
            kernel,
            span(&out),
            span(q),
            kv,
            tables,
            span(&cu_dev),
            span(&start_dev),
            cfg,
        )
        .unwrap();
    download(stream, &out)
}

fn assert_close(name: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{name}: length");
    let max_ref = want
        .iter()
        .fold(0f32, |m, v| m.max(v.abs()))
        .max(f32::MIN_POSITIVE);
    let max_err = got
        .iter()
        .zip(want)
        .fold(0f32, |m, (g, w)| m.max((g - w).abs()));
    let rel = max_err / max_ref;
    println!("{name}: relative error {rel:.2e}");
    assert!(
        rel <= TOLERANCE,
        "{name}: relative error {rel} > {TOLERANCE}"
    );
}

/// A pool filled with random K/V and block tables that scatter each sequence over shuffled
/// blocks, on both sides.
#[derive(Clone)]
struct PagedSetup {
    shape: KvCacheShape,
    k: Vec<f32>,
    v: Vec<f32>,
    /// What the device pools hold; `k` and `v` are values it represents exactly.
    dtype: KvDtype,
    table: Vec<i32>,
    max_blocks_per_seq: usize,
}

impl PagedSetup {
    fn new(num_kv_heads: usize, head_dim: usize, seq_capacity: &[usize], seed: u64) -> Self {
        let block_size = 16;
        let max_blocks_per_seq = seq_capacity.iter().max().unwrap().div_ceil(block_size);
        let num_blocks = seq_capacity.len() * max_blocks_per_seq + 3;
        let shape = KvCacheShape {
            num_blocks,
            block_size,
            num_kv_heads,
            head_dim,
        };
        // Hand out blocks in a scrambled order (stride coprime with num_blocks).
        let stride = (1..num_blocks)
            .rev()
            .find(|s| gcd(*s, num_blocks) == 1)
            .unwrap();
        let table = (0..seq_capacity.len() * max_blocks_per_seq)
            .map(|i| ((i * stride + 1) % num_blocks) as i32)
            .collect();
        Self {
            k: random(shape.len(), seed, 1.0),
            v: random(shape.len(), seed + 1, 1.0),
            dtype: KvDtype::Bf16,
            shape,
            table,
            max_blocks_per_seq,
        }
    }

    /// This setup with bf16 pools and with fp8 pools (the values rounded to fp8 on both
    /// sides, so the reference reads what the kernels read).
    fn both_dtypes(self) -> [Self; 2] {
        let fp8 = Self {
            k: kv_round(&self.k, KvDtype::Fp8E4m3),
            v: kv_round(&self.v, KvDtype::Fp8E4m3),
            dtype: KvDtype::Fp8E4m3,
            ..self.clone()
        };
        [self, fp8]
    }

    /// Upload the pools and the table; the returned slices own the memory the spans point at.
    fn device(
        &self,
        stream: &Arc<CudaStream>,
    ) -> (
        DeviceKv,
        DeviceBlockTables,
        [CudaSlice<u8>; 2],
        CudaSlice<i32>,
    ) {
        let k = kv_upload(stream, &self.k, self.dtype);
        let v = kv_upload(stream, &self.v, self.dtype);
        let table = stream.clone_htod(&self.table).unwrap();
        let kv = DeviceKv::of(&k, &v, self.dtype, self.shape);
        let tables = DeviceBlockTables {
            table: span(&table),
            max_blocks_per_seq: self.max_blocks_per_seq,
        };
        (kv, tables, [k, v], table)
    }

    fn cpu(&self) -> (PagedKv<'_>, BlockTables<'_>) {
        let kv = PagedKv {
            k_cache: &self.k,
            v_cache: &self.v,
            shape: self.shape,
        };
        let tables = BlockTables {
            table: &self.table,
            max_blocks_per_seq: self.max_blocks_per_seq,
        };
        (kv, tables)
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

fn configs() -> Vec<AttentionConfig> {
    let mut all = Vec::new();
    for head_dim in [64, 96, 128, 256] {
        all.push(AttentionConfig::new(8, 2, head_dim));
        all.push(AttentionConfig::new(4, 4, head_dim).with_sliding_window(24));
        // Scores of these inputs are O(1): a cap of 1 bends them hard.
        all.push(AttentionConfig::new(8, 4, head_dim).with_softcap(1.0));
        // The widest group the grouped decode serves, and one past it (the per-head decode).
        all.push(AttentionConfig::new(16, 2, head_dim));
        all.push(AttentionConfig::new(16, 1, head_dim));
    }
    all
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn paged_attention_decode_matches_reference() {
    let (kernels, stream) = kernels();
    for cfg in configs() {
        // The last one is graph-bucket padding; 1,500 keys take several splits.
        let seq_lens = [1, 17, 100, 333, 1500, 0];
        let real = seq_lens.len() - 1;
        for setup in PagedSetup::new(cfg.num_kv_heads, cfg.head_dim, &seq_lens, 7).both_dtypes() {
            let row = cfg.num_heads * cfg.head_dim;
            let q = random(seq_lens.len() * row, 3, 1.0);

            let (kv, tables) = setup.cpu();
            let mut want = vec![0.0; real * row];
            reference::paged_attention_decode(
                &mut want,
                &q[..real * row],
                &kv,
                &tables,
                &seq_lens[..real]
                    .iter()
                    .map(|&l| l as i32)
                    .collect::<Vec<_>>(),
                &cfg,
            );

            let (kv_dev, tables_dev, _pools, _table) = setup.device(&stream);
            let lens = stream.clone_htod(&seq_lens.map(|l| l as i32)).unwrap();
            let q_dev = upload(&stream, &q);
            let auto = kernels.decode_splits(seq_lens.len(), &tables_dev, &cfg, 16);
            assert!(auto > 1, "these shapes should split: {auto}");
            // One split (whole contexts), the kernels' choice, and more splits than keys need.
            for (kernel, splits) in decode_kernels(&cfg)
                .into_iter()
                .flat_map(|k| [Some(1), None, Some(9)].map(|s| (k, s)))
            {
                let got = decode(
                    &kernels,
                    &stream,
                    kernel,
                    &q_dev,
                    &kv_dev,
                    &tables_dev,
                    &lens,
                    &cfg,
                    splits,
                );
                assert_close(
                    &format!(
                        "decode {kernel:?} splits {splits:?} {:?} {cfg:?}",
                        setup.dtype
                    ),
                    &got[..real * row],
                    &want,
                );
                assert!(
                    got[real * row..].iter().all(|&x| x == 0.0),
                    "{kernel:?}: padding row not zeroed (splits {splits:?})"
                );
            }
        }
    }
}

/// The shapes users run: 32 query heads over 8 KV heads, contexts of 600 to 8,000 keys at
/// batch 1-8, block tables as wide as a graph bucket pads them (8,192 keys) — where splits
/// of a fixed 256 keys once ignored every key past 256 × splits.
#[test]
#[ignore = "needs a CUDA GPU"]
fn paged_attention_decode_long_contexts_at_32_heads() {
    let (kernels, stream) = kernels();
    for head_dim in [64, 128] {
        let cfg = AttentionConfig::new(32, 8, head_dim);
        let row = cfg.num_heads * cfg.head_dim;
        for lens in [
            vec![8_000usize],
            vec![3_000, 8_000],
            vec![600, 1_500, 3_000, 8_000],
            vec![600, 1_500, 3_000, 8_000, 8_000, 3_000, 1_500, 600],
        ] {
            let setups = PagedSetup::new(cfg.num_kv_heads, head_dim, &vec![8_192; lens.len()], 17);
            for setup in setups.both_dtypes() {
                let lens_i32: Vec<i32> = lens.iter().map(|&l| l as i32).collect();
                let q = random(lens.len() * row, 5, 1.0);
                let (kv, tables) = setup.cpu();
                let mut want = vec![0.0; q.len()];
                reference::paged_attention_decode(&mut want, &q, &kv, &tables, &lens_i32, &cfg);

                let (kv_dev, tables_dev, _pools, _table) = setup.device(&stream);
                let lens_dev = stream.clone_htod(&lens_i32).unwrap();
                let q_dev = upload(&stream, &q);
                for kernel in decode_kernels(&cfg) {
                    let auto =
                        kernels.decode_splits_with(kernel, lens.len(), &tables_dev, &cfg, 16);
                    println!(
                        "batch {} head_dim {head_dim} {kernel:?}: {auto} splits",
                        lens.len()
                    );
                    // The chosen count again last: the fused merge's counters are back at
                    // zero after every split launch.
                    for splits in [None, Some(1), Some(auto + 5), None] {
                        let got = decode(
                            &kernels,
                            &stream,
                            kernel,
                            &q_dev,
                            &kv_dev,
                            &tables_dev,
                            &lens_dev,
                            &cfg,
                            splits,
                        );
                        assert_close(
                            &format!(
                            "decode {kernel:?} lens {lens:?} d{head_dim} splits {splits:?} {:?}",
                            setup.dtype
                        ),
                            &got,
                            &want,
                        );
                    }
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn paged_attention_prefill_matches_reference() {
    let (kernels, stream) = kernels();
    for cfg in configs() {
        // Sequence 0: chunk of 40 after 60 cached tokens; 1: empty; 2: fresh prompt of 70;
        // 3: one token after 200 cached. Grid has 4 padding tokens past the end.
        let cu = [0, 40, 40, 110, 111];
        let start = [60, 5, 0, 200];
        let capacity = [100, 5, 70, 201];
        for setup in PagedSetup::new(cfg.num_kv_heads, cfg.head_dim, &capacity, 11).both_dtypes() {
            let row = cfg.num_heads * cfg.head_dim;
            let (real, padded) = (111, 115);
            let q = random(padded * row, 5, 1.0);

            let (kv, tables) = setup.cpu();
            let mut want = vec![0.0; real * row];
            reference::paged_attention_prefill(
                &mut want,
                &q[..real * row],
                &kv,
                &tables,
                &cu,
                &start,
                &cfg,
            );

            let (kv_dev, tables_dev, _pools, _table) = setup.device(&stream);
            let q_dev = upload(&stream, &q);
            for kernel in prefill_kernels(&kernels) {
                let got = prefill(
                    &kernels,
                    &stream,
                    kernel,
                    &q_dev,
                    &kv_dev,
                    &tables_dev,
                    &cu,
                    &start,
                    &cfg,
                );
                assert_close(
                    &format!("prefill {kernel:?} {:?} {cfg:?}", setup.dtype),
                    &got[..real * row],
                    &want,
                );
                assert!(
                    got[real * row..].iter().all(|&x| x == 0.0),
                    "{kernel:?}: padding tokens not zeroed"
                );
            }
        }
    }
}

/// Prefill at the shapes users run: 32 query heads over 8 KV heads, a fresh 2,048-token
/// prompt, a 512-token chunk after 1,536 cached tokens, and a step that mixes both with short
/// prompts and single tokens (several query tiles per sequence, tiles ending mid-sequence),
/// with and without a sliding window.
#[test]
#[ignore = "needs a CUDA GPU"]
fn paged_attention_prefill_at_user_shapes() {
    let (kernels, stream) = kernels();
    let steps: [(&[i32], &[i32]); 3] = [
        (&[2048], &[0]),
        (&[512], &[1536]),
        (&[700, 1, 512, 65, 3], &[0, 4000, 1536, 64, 0]),
    ];
    for head_dim in [64, 128] {
        for cfg in [
            AttentionConfig::new(32, 8, head_dim),
            AttentionConfig::new(32, 8, head_dim).with_sliding_window(1000),
        ] {
            let row = cfg.num_heads * cfg.head_dim;
            for (lens, start) in steps {
                let cu: Vec<i32> = std::iter::once(0)
                    .chain(lens.iter().scan(0, |sum, &l| {
                        *sum += l;
                        Some(*sum)
                    }))
                    .collect();
                let capacity: Vec<usize> = lens
                    .iter()
                    .zip(start)
                    .map(|(&l, &s)| (l + s) as usize)
                    .collect();
                let setups = PagedSetup::new(cfg.num_kv_heads, head_dim, &capacity, 31);
                for setup in setups.both_dtypes() {
                    let real = *cu.last().unwrap() as usize;
                    let q = random((real + 5) * row, 9, 1.0);
                    let (kv, tables) = setup.cpu();
                    let mut want = vec![0.0; real * row];
                    reference::paged_attention_prefill(
                        &mut want,
                        &q[..real * row],
                        &kv,
                        &tables,
                        &cu,
                        start,
                        &cfg,
                    );
                    let (kv_dev, tables_dev, _pools, _table) = setup.device(&stream);
                    let q_dev = upload(&stream, &q);
                    for kernel in prefill_kernels(&kernels) {
                        let got = prefill(
                            &kernels,
                            &stream,
                            kernel,
                            &q_dev,
                            &kv_dev,
                            &tables_dev,
                            &cu,
                            start,
                            &cfg,
                        );
                        assert_close(
                            &format!(
                                "prefill {kernel:?} lens {lens:?} after {start:?} {:?} {cfg:?}",
                                setup.dtype
                            ),
                            &got[..real * row],
                            &want,
                        );
                        assert!(got[real * row..].iter().all(|&x| x == 0.0));
                    }
                }
            }
        }
    }
}

/// Both pool elements: bf16 pools get the very values (a copy), fp8 pools each value rounded
/// as the host reference rounds it (bit for bit).
#[test]
#[ignore = "needs a CUDA GPU"]
fn reshape_and_cache_matches_reference() {
    let (kernels, stream) = kernels();
    let shape = KvCacheShape {
        num_blocks: 9,
        block_size: 16,
        num_kv_heads: 4,
        head_dim: 128,
    };
    let token = shape.num_kv_heads * shape.head_dim;
    // -1: padding; 144 (= num_slots) and 10_000: past the pool, must be skipped too.
    let slots: Vec<i32> = vec![5, 140, -1, 16, 0, 143, 144, 77, 10_000];
    // Up to ±600: fp8 saturates past 448.
    let key = random(slots.len() * token, 1, 600.0);
    let value = random(slots.len() * token, 2, 2.0);
    for dtype in [KvDtype::Bf16, KvDtype::Fp8E4m3] {
        let mut k_want = kv_round(&random(shape.len(), 3, 1.0), dtype);
        let mut v_want = kv_round(&random(shape.len(), 4, 1.0), dtype);

        let k_dev = kv_upload(&stream, &k_want, dtype);
        let v_dev = kv_upload(&stream, &v_want, dtype);
        let (key_dev, value_dev) = (upload(&stream, &key), upload(&stream, &value));
        let slots_dev = stream.clone_htod(&slots).unwrap();
        kernels
            .reshape_and_cache(
                span(&key_dev),
                span(&value_dev),
                &DeviceKv::of(&k_dev, &v_dev, dtype, shape),
                span(&slots_dev),
            )
            .unwrap();
        reference::reshape_and_cache(&key, &value, &mut k_want, &mut v_want, &slots, &shape);
        // Exact: a copy, or the same rounding.
        assert_eq!(
            kv_download(&stream, &k_dev, dtype),
            kv_round(&k_want, dtype),
            "{dtype:?} K"
        );
        assert_eq!(
            kv_download(&stream, &v_dev, dtype),
            kv_round(&v_want, dtype),
            "{dtype:?} V"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn rms_norm_matches_reference() {
    let (kernels, stream) = kernels();
    for (hidden, style) in [
        (3072, RmsWeight::Scale),
        (2560, RmsWeight::OnePlus),
        (128, RmsWeight::Scale),
    ] {
        let rows = 37;
        let x = random(rows * hidden, 1, 4.0);
        let w = random(hidden, 2, 1.0);
        let mut want = vec![0.0; x.len()];
        reference::rms_norm(&mut want, &x, &w, 1e-6, style);
        let (x_dev, w_dev) = (upload(&stream, &x), upload(&stream, &w));
        let out = stream.alloc_zeros::<u16>(x.len()).unwrap();
        kernels
            .rms_norm(span(&out), span(&x_dev), span(&w_dev), 1e-6, style)
            .unwrap();
        assert_close(
            &format!("rms_norm {hidden} {style:?}"),
            &download(&stream, &out),
            &want,
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn rope_matches_reference() {
    let (kernels, stream) = kernels();
    let (heads, kv_heads, head_dim) = (24, 8, 128);
    let table = RopeTable::new(&reference::default_inv_freq(head_dim, 500_000.0), 4096);
    // -1 and 4096 are outside the table: those tokens must come back unchanged.
    let positions: Vec<i32> = vec![0, 1, 2, 17, 1000, 4095, 3, -1, 4096];
    let n = positions.len();
    let mut q = random(n * heads * head_dim, 1, 2.0);
    let mut k = random(n * kv_heads * head_dim, 2, 2.0);
    let (q_dev, k_dev) = (upload(&stream, &q), upload(&stream, &k));
    let pos_dev = stream.clone_htod(&positions).unwrap();
    let cos = stream.clone_htod(&table.cos).unwrap();
    let sin = stream.clone_htod(&table.sin).unwrap();
    kernels
        .rope_neox(
            span(&q_dev),
            span(&k_dev),
            span(&pos_dev),
            span(&cos),
            span(&sin),
            heads,
            kv_heads,
        )
        .unwrap();
    reference::rope_neox(&mut q, &positions, heads, &table);
    reference::rope_neox(&mut k, &positions, kv_heads, &table);
    assert_close("rope q", &download(&stream, &q_dev), &q);
    assert_close("rope k", &download(&stream, &k_dev), &k);
}

/// The fused QKV split + RoPE + K/V write against its reference, and against the three
/// kernels it replaces (column copies, `rope_neox`, `reshape_and_cache`): the same bits, bad
/// positions (Q and K unrotated) and bad slots (nothing written) included, into bf16 pools
/// and into fp8 pools (where the reference, rotating in f32, may land one fp8 step away).
#[test]
#[ignore = "needs a CUDA GPU"]
fn qkv_rope_and_cache_matches_reference_and_the_unfused_kernels() {
    let (kernels, stream) = kernels();
    let (heads, kv_heads, head_dim) = (32, 8, 64);
    let shape = KvCacheShape {
        num_blocks: 9,
        block_size: 16,
        num_kv_heads: kv_heads,
        head_dim,
    };
    let table = RopeTable::new(&reference::default_inv_freq(head_dim, 500_000.0), 4096);
    let positions: Vec<i32> = vec![0, 1, 2, 17, 1000, 4095, 3, -1, 4096, 5];
    let slots: Vec<i32> = vec![5, 140, -1, 16, 0, 143, 144, 77, 10_000, 6];
    let n = positions.len();
    let (nq, nkv) = (heads * head_dim, kv_heads * head_dim);
    let qkv = random(n * (nq + 2 * nkv), 1, 2.0);
    let qkv_dev = upload(&stream, &qkv);
    let (pos_dev, slots_dev) = (
        stream.clone_htod(&positions).unwrap(),
        stream.clone_htod(&slots).unwrap(),
    );
    let cos = stream.clone_htod(&table.cos).unwrap();
    let sin = stream.clone_htod(&table.sin).unwrap();
    for dtype in [KvDtype::Bf16, KvDtype::Fp8E4m3] {
        let pools = (
            kv_round(&random(shape.len(), 3, 1.0), dtype),
            kv_round(&random(shape.len(), 4, 1.0), dtype),
        );
        let mut q_want = vec![0.0; n * nq];
        let (mut k_want, mut v_want) = pools.clone();
        reference::qkv_rope_and_cache(
            &mut q_want,
            &qkv,
            &mut k_want,
            &mut v_want,
            &positions,
            &slots,
            heads,
            &table,
            &shape,
        );
        let upload_pools = || {
            (
                kv_upload(&stream, &pools.0, dtype),
                kv_upload(&stream, &pools.1, dtype),
            )
        };
        // Fused.
        let q_fused = upload(&stream, &vec![0.0; n * nq]);
        let (k_fused, v_fused) = upload_pools();
        kernels
            .qkv_rope_and_cache(
                span(&q_fused),
                span(&qkv_dev),
                &DeviceKv::of(&k_fused, &v_fused, dtype, shape),
                span(&pos_dev),
                span(&slots_dev),
                span(&cos),
                span(&sin),
                heads,
            )
            .unwrap();
        // Unfused, as the model ran before.
        let parts: Vec<CudaSlice<u16>> = [nq, nkv, nkv]
            .iter()
            .map(|&w| upload(&stream, &vec![0.0; n * w]))
            .collect();
        for (part, col0) in parts.iter().zip([0, nq, nq + nkv]) {
            kernels
                .copy_columns(span(part), span(&qkv_dev), nq + 2 * nkv, col0)
                .unwrap();
        }
        let (k_unfused, v_unfused) = upload_pools();
        kernels
            .rope_neox(
                span(&parts[0]),
                span(&parts[1]),
                span(&pos_dev),
                span(&cos),
                span(&sin),
                heads,
                kv_heads,
            )
            .unwrap();
        kernels
            .reshape_and_cache(
                span(&parts[1]),
                span(&parts[2]),
                &DeviceKv::of(&k_unfused, &v_unfused, dtype, shape),
                span(&slots_dev),
            )
            .unwrap();

        let (q_got, k_got, v_got) = (
            download(&stream, &q_fused),
            kv_download(&stream, &k_fused, dtype),
            kv_download(&stream, &v_fused, dtype),
        );
        assert_close("fused q", &q_got, &q_want);
        match dtype {
            KvDtype::Bf16 => {
                assert_close("fused k cache", &k_got, &k_want);
                assert_close("fused v cache", &v_got, &v_want);
            }
            KvDtype::Fp8E4m3 => {
                // V is copied: its rounding is the reference's. K is rotated in f32 by both,
                // then rounded to bf16 and to fp8 (3 mantissa bits: a step is at most 1/8 of
                // the value, 2^-9 among the subnormals).
                assert_eq!(v_got, kv_round(&v_want, dtype), "fused v cache");
                for (i, (&got, &want)) in k_got.iter().zip(&k_want).enumerate() {
                    assert!(
                        (got - want).abs() <= want.abs() / 8.0 + 2f32.powi(-9),
                        "fused k cache [{i}]: {got} vs {want}"
                    );
                }
            }
        }
        assert_eq!(q_got, download(&stream, &parts[0]), "fused q != unfused");
        assert_eq!(
            k_got,
            kv_download(&stream, &k_unfused, dtype),
            "{dtype:?}: fused k != unfused"
        );
        assert_eq!(
            v_got,
            kv_download(&stream, &v_unfused, dtype),
            "{dtype:?}: fused v != unfused"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gated_activations_match_reference() {
    let (kernels, stream) = kernels();
    let (rows, inter) = (19, 8192);
    let gate_up = random(rows * 2 * inter, 9, 6.0);
    let gate_up_dev = upload(&stream, &gate_up);
    let out = stream.alloc_zeros::<u16>(rows * inter).unwrap();
    let mut want = vec![0.0; rows * inter];

    kernels
        .silu_and_mul(span(&out), span(&gate_up_dev), inter)
        .unwrap();
    reference::silu_and_mul(&mut want, &gate_up, inter);
    assert_close("silu_and_mul", &download(&stream, &out), &want);

    kernels
        .gelu_tanh_and_mul(span(&out), span(&gate_up_dev), inter)
        .unwrap();
    reference::gelu_tanh_and_mul(&mut want, &gate_up, inter);
    assert_close("gelu_tanh_and_mul", &download(&stream, &out), &want);

    kernels
        .gelu_erf_and_mul(span(&out), span(&gate_up_dev), inter)
        .unwrap();
    reference::gelu_erf_and_mul(&mut want, &gate_up, inter);
    assert_close("gelu_erf_and_mul", &download(&stream, &out), &want);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn paged_attention_skips_bad_blocks() {
    let (kernels, stream) = kernels();
    let cfg = AttentionConfig::new(8, 2, 128).with_sliding_window(200);
    let row = cfg.num_heads * cfg.head_dim;
    let capacity = [100, 40, 16, 64];
    let mut setup = PagedSetup::new(cfg.num_kv_heads, cfg.head_dim, &capacity, 21);
    let (mpb, num_blocks) = (setup.max_blocks_per_seq, setup.shape.num_blocks as i32);
    // Sequence 0 loses its 2nd block (-1) and its 4th (past the pool); sequence 2's only block
    // is bad, so its queries see nothing and must output zeros.
    setup.table[1] = -1;
    setup.table[3] = num_blocks + 7;
    setup.table[2 * mpb] = i32::MIN;
    let (kv, tables) = setup.cpu();
    let (kv_dev, tables_dev, _pools, _table) = setup.device(&stream);

    // Decode; sequence 3 claims more tokens than its table row holds (mpb blocks of 16):
    // keys past the row are skipped, not read.
    let seq_lens = [100, 40, 16, (mpb * 16 + 50) as i32];
    let q = random(seq_lens.len() * row, 8, 1.0);
    let mut want = vec![f32::NAN; q.len()];
    reference::paged_attention_decode(&mut want, &q, &kv, &tables, &seq_lens, &cfg);
    assert!(want[2 * row..3 * row].iter().all(|&x| x == 0.0));
    let (q_dev, lens) = (upload(&stream, &q), stream.clone_htod(&seq_lens).unwrap());
    for (kernel, splits) in decode_kernels(&cfg)
        .into_iter()
        .flat_map(|k| [1, 3].map(|s| (k, s)))
    {
        let got = decode(
            &kernels,
            &stream,
            kernel,
            &q_dev,
            &kv_dev,
            &tables_dev,
            &lens,
            &cfg,
            Some(splits),
        );
        assert_close(
            &format!("decode {kernel:?}, bad blocks, {splits} splits"),
            &got,
            &want,
        );
    }

    // Prefill over the same tables: whole sequences 0 and 2 as chunks.
    let cu = [0, 100, 100, 116, 116];
    let start = [0, 0, 0, 0];
    let q = random(116 * row, 10, 1.0);
    let mut want = vec![f32::NAN; q.len()];
    reference::paged_attention_prefill(&mut want, &q, &kv, &tables, &cu, &start, &cfg);
    let q_dev = upload(&stream, &q);
    for kernel in prefill_kernels(&kernels) {
        let got = prefill(
            &kernels,
            &stream,
            kernel,
            &q_dev,
            &kv_dev,
            &tables_dev,
            &cu,
            &start,
            &cfg,
        );
        assert_close(&format!("prefill {kernel:?}, bad blocks"), &got, &want);
        assert!(
            got[100 * row..].iter().all(|&x| x == 0.0),
            "{kernel:?}: no visible key: zeros"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fused_add_rms_norm_matches_reference() {
    let (kernels, stream) = kernels();
    for (hidden, style) in [(3072, RmsWeight::Scale), (2560, RmsWeight::OnePlus)] {
        let rows = 37;
        let mut residual = random(rows * hidden, 1, 4.0);
        let x = random(rows * hidden, 2, 4.0);
        let w = random(hidden, 3, 1.0);
        let (res_dev, x_dev, w_dev) = (
            upload(&stream, &residual),
            upload(&stream, &x),
            upload(&stream, &w),
        );
        let out = stream.alloc_zeros::<u16>(x.len()).unwrap();
        kernels
            .fused_add_rms_norm(
                span(&out),
                span(&res_dev),
                span(&x_dev),
                span(&w_dev),
                1e-6,
                style,
            )
            .unwrap();
        let mut want = vec![0.0; x.len()];
        reference::fused_add_rms_norm(&mut want, &mut residual, &x, &w, 1e-6, style);
        let tag = format!("fused_add_rms_norm {hidden} {style:?}");
        assert_close(
            &format!("{tag} residual"),
            &download(&stream, &res_dev),
            &residual,
        );
        assert_close(&format!("{tag} out"), &download(&stream, &out), &want);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn embedding_matches_reference() {
    let (kernels, stream) = kernels();
    let (vocab, hidden) = (1000, 2048);
    let table = random(vocab * hidden, 1, 1.0);
    // -1 and vocab are out of range: zero rows.
    let ids: Vec<i32> = vec![0, 999, 17, -1, 1000, 17, 512];
    let table_dev = upload(&stream, &table);
    let ids_dev = stream.clone_htod(&ids).unwrap();
    // Gemma's normaliser: sqrt(hidden) rounded to bf16, then an f32 multiply.
    for scale in [1.0, bf16::round((hidden as f32).sqrt())] {
        let out = upload(&stream, &random(ids.len() * hidden, 2, 1.0));
        kernels
            .embedding(span(&out), span(&table_dev), span(&ids_dev), hidden, scale)
            .unwrap();
        let mut want = vec![f32::NAN; ids.len() * hidden];
        reference::embedding(&mut want, &table, &ids, hidden, scale);
        let got = download(&stream, &out);
        if scale == 1.0 {
            assert_eq!(got, want, "a plain embedding is a copy");
        }
        assert_close(&format!("embedding scale {scale}"), &got, &want);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn residual_and_bias_add_match_reference() {
    let (kernels, stream) = kernels();
    // 3_000_001 elements: more than the flat grid's threads, so the grid-stride loop runs.
    for n in [1, 1003, 3_000_001] {
        let mut x = random(n, 1, 4.0);
        let y = random(n, 2, 4.0);
        let (x_dev, y_dev) = (upload(&stream, &x), upload(&stream, &y));
        kernels.add(span(&x_dev), span(&y_dev)).unwrap();
        reference::add(&mut x, &y);
        assert_close(&format!("add {n}"), &download(&stream, &x_dev), &x);
    }

    let (rows, cols) = (13, 5120);
    let mut x = random(rows * cols, 3, 4.0);
    let bias = random(cols, 4, 1.0);
    let (x_dev, bias_dev) = (upload(&stream, &x), upload(&stream, &bias));
    kernels.bias_add(span(&x_dev), span(&bias_dev)).unwrap();
    reference::bias_add(&mut x, &bias);
    assert_close("bias_add", &download(&stream, &x_dev), &x);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn copy_columns_and_gather_rows_match_reference() {
    let (kernels, stream) = kernels();
    // A fused QKV product [rows, q 3072 | k 1024 | v 1024]: take k.
    let (rows, cols, col0, width) = (9, 5120, 3072, 1024);
    let x = random(rows * cols, 1, 2.0);
    let x_dev = upload(&stream, &x);
    let out = stream.alloc_zeros::<u16>(rows * width).unwrap();
    kernels
        .copy_columns(span(&out), span(&x_dev), cols, col0)
        .unwrap();
    let mut want = vec![0.0; rows * width];
    reference::copy_columns(&mut want, &x, cols, col0);
    assert_eq!(download(&stream, &out), want, "copy_columns is a copy");

    // Last token of each sequence before the LM head; -1 and 9 (= rows) give zero rows.
    let idx: Vec<i32> = vec![8, 0, 3, -1, 9, 3];
    let idx_dev = stream.clone_htod(&idx).unwrap();
    let out = upload(&stream, &random(idx.len() * cols, 2, 1.0));
    kernels
        .gather_rows(span(&out), span(&x_dev), span(&idx_dev), cols)
        .unwrap();
    let mut want = vec![f32::NAN; idx.len() * cols];
    reference::gather_rows(&mut want, &x, &idx, cols);
    assert_eq!(download(&stream, &out), want, "gather_rows is a copy");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn logits_match_reference() {
    let (kernels, stream) = kernels();
    let n = 2 * 262_144 + 7; // two rows of Gemma 3's vocabulary, and a ragged end
    let x = random(n, 1, 60.0);
    let x_dev = upload(&stream, &x);
    let out = stream.alloc_zeros::<f32>(n).unwrap();
    for cap in [None, Some(30.0)] {
        kernels.logits_f32(span(&out), span(&x_dev), cap).unwrap();
        let got = stream.clone_dtoh(&out).unwrap();
        let mut want = vec![0.0; n];
        reference::logits(&mut want, &x, cap);
        if cap.is_none() {
            assert_eq!(got, want, "uncapped logits are the bf16 values widened");
        }
        assert_close(&format!("logits softcap {cap:?}"), &got, &want);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gemm_matches_reference() {
    let (_kernels, stream) = kernels();
    let gemm = Gemm::new(stream.clone()).expect("cuBLAS loads");
    for (m, n, k) in [
        (1, 4096, 3072),
        (37, 1536, 2048),
        (200, 256, 1152),
        (3, 5, 7),
    ] {
        let x = random(m * k, 1, 1.0);
        let w = random(n * k, 2, 1.0);
        // x and out live in one arena (as the engine's activations do), each at a 128-byte
        // aligned offset, with garbage around them; w on its own.
        let out_at = (m * k).next_multiple_of(64);
        let arena = upload(
            &stream,
            &[x.clone(), random(out_at - m * k + m * n + 64, 3, 1.0)].concat(),
        );
        let w_dev = upload(&stream, &w);
        let (x_span, out_span) = (
            span(&arena).slice(0, m * k),
            span(&arena).slice(out_at, m * n),
        );
        gemm.matmul_bf16(out_span, x_span, span(&w_dev), m, n, k)
            .unwrap();
        let all = download(&stream, &arena);
        let mut want = vec![0.0; m * n];
        reference::matmul_xwt(&mut want, &x, &w, m, n, k);
        assert_close(
            &format!("matmul {m}x{n}x{k}"),
            &all[out_at..][..m * n],
            &want,
        );
        assert_eq!(&all[..m * k], &x[..], "input untouched");
    }
}

/// The skinny GEMM at every row count it takes and every k split, at Llama-3.2-1B's projection shapes, at the
/// column count of a 128k-vocabulary LM head, and at ragged ones (a column count that is no whole block of warps,
/// a k whose words are no whole unrolled stride of the warp), against the reference and
/// within the same arena layout as the cuBLAS test.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gemv_matches_reference() {
    let (kernels, stream) = kernels();
    let shapes = [
        (3072, 2048),
        (2048, 8192),
        (128_256, 256), // an LM head's column count (a narrow k keeps the reference quick)
        (1001, 8 * 1025),
        (3, 8),
        (5, 24),
    ];
    for (n, k) in shapes {
        let w = random(n * k, 2, 1.0);
        let w_dev = upload(&stream, &w);
        for m in 1..=infer_kernels::cuda::sources::GEMV_MAX_ROWS {
            // The large shapes at the row counts that differ most; every count on small ones.
            if n * k > 4 << 20 && ![1, 3, 8].contains(&m) {
                continue;
            }
            let x = random(m * k, 10 + m as u64, 1.0);
            let out_at = (m * k).next_multiple_of(64);
            let garbage = random(out_at - m * k + m * n + 64, 3, 1.0);
            let before = [x.clone(), garbage].concat();
            let mut arena = upload(&stream, &before);
            let (x_span, out_span) = (
                span(&arena).slice(0, m * k),
                span(&arena).slice(out_at, m * n),
            );
            assert!(Kernels::gemv_applies(x_span, span(&w_dev), m, k));
            let mut want = vec![0.0; m * n];
            reference::matmul_xwt(&mut want, &x, &w, m, n, k);
            // The split this device picks, then every split (warps past k's strides idle).
            let chosen = kernels.gemv_k_split(m, n, k);
            for k_split in [chosen, 1, 2, 4] {
                // Fresh garbage where the output goes, so no split passes on its predecessor's.
                stream
                    .memcpy_htod(&bf16::slice_from_f32(&before), &mut arena)
                    .unwrap();
                kernels
                    .gemv_bf16_split(out_span, x_span, span(&w_dev), m, n, k, k_split)
                    .unwrap();
                let all = download(&stream, &arena);
                let got = &all[out_at..][..m * n];
                assert_close(&format!("gemv {m}x{n}x{k} k_split {k_split}"), got, &want);
                assert_eq!(&all[..out_at], &before[..out_at], "input untouched");
                assert_eq!(
                    &all[out_at + m * n..],
                    &before[out_at + m * n..],
                    "nothing written past out"
                );
            }
            if m == 1 && n * k > 4 << 20 {
                println!("gemv {n}x{k}: k_split {chosen} on this device");
            }
        }
    }
}

/// Runs the sampling kernel on `logits` (`[batch.rows(), vocab]`): what it returns and the
/// logits as it left them (adjusted in place).
fn device_sample(
    kernels: &Kernels,
    stream: &Arc<CudaStream>,
    logits: &[f32],
    vocab: usize,
    batch: &SamplingBatch,
) -> (SampledRows, Vec<f32>) {
    let rows = batch.rows();
    let n = batch.adjustments();
    let dev_logits = stream.clone_htod(logits).unwrap();
    let floats = stream.clone_htod(&batch.floats).unwrap();
    let ints = stream.clone_htod(&batch.ints).unwrap();
    let start = stream.clone_htod(&batch.adjust_start).unwrap();
    // Empty arrays are allocated with one element: a span needs an address.
    let token = stream
        .clone_htod(&[batch.adjust_token.clone(), vec![0]].concat())
        .unwrap();
    let values = stream
        .clone_htod(&[batch.adjust_values.clone(), vec![0.0; 3]].concat())
        .unwrap();
    let raw = stream.alloc_zeros::<f32>(n + 1).unwrap();
    let mask_start = stream.clone_htod(&batch.mask_start).unwrap();
    let mask_words = stream
        .clone_htod(&[batch.mask_words.clone(), vec![0]].concat())
        .unwrap();
    let out_tokens = stream.alloc_zeros::<i32>(rows).unwrap();
    let out_lp = stream.alloc_zeros::<f32>(rows).unwrap();
    let out_ids = stream.alloc_zeros::<i32>(rows * MAX_TOP_LOGPROBS).unwrap();
    let out_top = stream.alloc_zeros::<f32>(rows * MAX_TOP_LOGPROBS).unwrap();
    let input = DeviceSamplingBatch {
        floats: span(&floats),
        ints: span(&ints),
        adjust_start: span(&start),
        adjust_token: span(&token).slice(0, n),
        adjust_values: span(&values).slice(0, 3 * n),
        adjust_raw: span(&raw).slice(0, n),
        mask_start: span(&mask_start),
        mask_words: span(&mask_words).slice(0, batch.mask_words.len()),
    };
    let out = DeviceSampledRows {
        tokens: span(&out_tokens),
        logprobs: span(&out_lp),
        top_ids: span(&out_ids),
        top_logprobs: span(&out_top),
    };
    kernels
        .sample_rows(span(&dev_logits), vocab, &input, &out)
        .unwrap();
    let sampled = SampledRows {
        tokens: stream.clone_dtoh(&out_tokens).unwrap(),
        logprobs: stream.clone_dtoh(&out_lp).unwrap(),
        top_ids: stream.clone_dtoh(&out_ids).unwrap(),
        top_logprobs: stream.clone_dtoh(&out_top).unwrap(),
    };
    (sampled, stream.clone_dtoh(&dev_logits).unwrap())
}

/// The rows the sampling tests run: greedy and every filter alone and together, with and
/// without logprobs and penalties.
fn sampling_params(uniform: f32, i: usize) -> RowParams {
    let base = RowParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        uniform,
        top_logprobs: None,
    };
    match i % 8 {
        0 => RowParams {
            temperature: 0.0,
            top_logprobs: Some(5),
            ..base
        },
        1 => base,
        2 => RowParams {
            temperature: 0.7,
            top_k: 50,
            ..base
        },
        3 => RowParams {
            top_p: 0.9,
            top_logprobs: Some(20),
            ..base
        },
        4 => RowParams { min_p: 0.1, ..base },
        5 => RowParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            top_logprobs: Some(0),
            ..base
        },
        6 => RowParams {
            temperature: 1.5,
            top_k: 1,
            ..base
        },
        _ => RowParams {
            temperature: 0.0,
            ..base
        },
    }
}

/// The same tokens as the reference at Llama 3's 128,256-token vocabulary, on bf16-valued
/// logits (ties everywhere, as a real head's output has): greedy, every filter, penalties,
/// logit bias, grammar masks (every third row, over and beside its penalties) and top
/// logprobs. A draw may differ only where `expf` and Rust's `exp` round a
/// weight differently at the exact boundary of the draw (about one chance in a thousand per
/// draw): at most one of the 128 rows.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sampling_matches_reference_at_a_128k_vocabulary() {
    let (kernels, stream) = kernels();
    let vocab = 128_256;
    let rows = 128;
    let logits = random(rows * vocab, 11, 12.0);
    let u = uniforms(rows, 12);
    let mut batch = SamplingBatch::new();
    for (r, &u) in u.iter().enumerate() {
        // Odd rows: 300 penalised tokens and a bias, one token past the vocabulary.
        let adjust: Vec<Adjustment> = match r % 2 {
            1 => (0..300u32)
                .map(|j| Adjustment {
                    token: j * 401 + r as u32,
                    repetition: 1.3,
                    penalty: 0.4,
                    bias: if j % 7 == 0 { 5.0 } else { 0.0 },
                })
                .chain([Adjustment {
                    token: vocab as u32 + 5,
                    repetition: 2.0,
                    penalty: 0.0,
                    bias: 1.0,
                }])
                .collect(),
            _ => Vec::new(),
        };
        // Every third row: a grammar mask allowing about one token in five, shorter than
        // the vocabulary (the ids past its end are masked too).
        let mask: Option<Vec<u32>> = (r % 3 == 2).then(|| {
            (0..(vocab - 1000).div_ceil(32))
                .map(|w| (w as u32).wrapping_mul(2_654_435_761) & 0x2108_4210 | 1)
                .collect()
        });
        batch
            .push_masked(&sampling_params(u, r), &adjust, mask.as_deref())
            .unwrap();
    }
    let (got, adjusted) = device_sample(&kernels, &stream, &logits, vocab, &batch);
    let mut want_logits = logits.clone();
    let want = reference::sample_rows(&mut want_logits, vocab, &batch);
    assert_eq!(adjusted, want_logits, "the adjusted logits");
    let mut differ = 0;
    for r in 0..rows {
        let (p, _) = batch.row(r);
        assert!(
            batch.allows(r, got.tokens[r] as usize),
            "row {r}: token {} is masked",
            got.tokens[r]
        );
        if got.tokens[r] != want.tokens[r] {
            assert!(p.temperature > 0.0, "row {r}: greedy tokens differ");
            differ += 1;
        }
        assert_eq!(got.top(r).len(), want.top(r).len(), "row {r}");
        for ((gt, gl), (wt, wl)) in got.top(r).into_iter().zip(want.top(r)) {
            assert_eq!(gt, wt, "row {r}: top logprob ids");
            assert!((gl - wl).abs() < 1e-3, "row {r}: top logprob {gl} vs {wl}");
        }
        match p.top_logprobs {
            Some(_) if got.tokens[r] == want.tokens[r] => assert!(
                (got.logprobs[r] - want.logprobs[r]).abs() < 1e-3,
                "row {r}: logprob {} vs {}",
                got.logprobs[r],
                want.logprobs[r]
            ),
            Some(_) => {}
            None => assert!(got.logprobs[r].is_nan(), "row {r}: a logprob not asked for"),
        }
    }
    assert!(differ <= 1, "{differ} of {rows} draws differ");
}

/// Draws from fixed logits follow the distribution the filters leave: a chi-square test over
/// 40,000 draws for each filter on and off (p = 0.001).
#[test]
#[ignore = "needs a CUDA GPU"]
fn sampling_draws_follow_the_filtered_distribution() {
    let (kernels, stream) = kernels();
    let vocab = 64;
    let draws = 40_000;
    let row = random(vocab, 21, 3.0);
    for i in 1..7 {
        let mut batch = SamplingBatch::new();
        for u in uniforms(draws, 100 + i as u64) {
            batch.push(&sampling_params(u, i), &[]).unwrap();
        }
        let all: Vec<f32> = (0..draws).flat_map(|_| row.iter().cloned()).collect();
        let (got, _) = device_sample(&kernels, &stream, &all, vocab, &batch);
        let (p, _) = batch.row(0);
        let w = reference::weights(&row, p.temperature);
        let floor = reference::keep_threshold(&w, &p);
        let kept: Vec<f64> = w
            .iter()
            .map(|&x| if x.to_bits() >= floor { x as f64 } else { 0.0 })
            .collect();
        let total: f64 = kept.iter().sum();
        let mut counts = vec![0usize; vocab];
        for &t in &got.tokens {
            counts[t as usize] += 1;
        }
        let (mut chi2, mut bins, mut rare_expected, mut rare_seen) = (0.0, 0, 0.0, 0usize);
        for (k, &c) in kept.iter().zip(&counts) {
            let expected = k / total * draws as f64;
            if expected == 0.0 {
                assert_eq!(c, 0, "filter {i}: a filtered-out token was drawn");
            } else if expected < 5.0 {
                rare_expected += expected;
                rare_seen += c;
            } else {
                chi2 += (c as f64 - expected).powi(2) / expected;
                bins += 1;
            }
        }
        if rare_expected > 0.0 {
            chi2 += (rare_seen as f64 - rare_expected).powi(2) / rare_expected;
            bins += 1;
        }
        // Wilson-Hilferty: the chi-square quantile at p = 0.001 (z = 3.09).
        let df = (bins as f64 - 1.0).max(1.0);
        let h = 2.0 / (9.0 * df);
        let critical = df * (1.0 - h + 3.09 * h.sqrt()).powi(3);
        assert!(
            chi2 < critical,
            "filter {i} ({p:?}): chi-square {chi2:.1} over {bins} bins, critical {critical:.1}"
        );
    }
}
