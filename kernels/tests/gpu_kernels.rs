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
use infer_kernels::cuda::kernels::{DeviceBlockTables, DeviceKv};
use infer_kernels::cuda::Kernels;
use infer_kernels::layout::{AttentionConfig, BlockTables, KvCacheShape};
use infer_kernels::reference::{self, PagedKv, RmsWeight, RopeTable};

const TOLERANCE: f32 = 1e-2;

fn kernels() -> (Kernels, Arc<CudaStream>) {
    let ctx = CudaContext::new(0).expect("a CUDA device");
    let stream = ctx.new_stream().unwrap();
    (
        Kernels::load(stream.clone()).expect("kernels compile and load"),
        stream,
    )
}

/// Deterministic values in [-scale, scale), already rounded to bf16 so the GPU (bf16 storage)
/// and the reference (f32) see the very same numbers.
fn random(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let unit = (state >> 40) as f32 / (1u64 << 24) as f32;
            bf16::round((2.0 * unit - 1.0) * scale)
        })
        .collect()
}

fn upload(stream: &Arc<CudaStream>, xs: &[f32]) -> CudaSlice<u16> {
    stream.clone_htod(&bf16::slice_from_f32(xs)).unwrap()
}

fn download(stream: &Arc<CudaStream>, xs: &CudaSlice<u16>) -> Vec<f32> {
    bf16::slice_to_f32(&stream.clone_dtoh(xs).unwrap())
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
struct PagedSetup {
    shape: KvCacheShape,
    k: Vec<f32>,
    v: Vec<f32>,
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
            shape,
            table,
            max_blocks_per_seq,
        }
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
    }
    all
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn paged_attention_decode_matches_reference() {
    let (kernels, stream) = kernels();
    for cfg in configs() {
        let seq_lens = [1, 17, 100, 333, 0]; // the last one is graph-bucket padding
        let setup = PagedSetup::new(cfg.num_kv_heads, cfg.head_dim, &seq_lens, 7);
        let row = cfg.num_heads * cfg.head_dim;
        let q = random(seq_lens.len() * row, 3, 1.0);

        let (kv, tables) = setup.cpu();
        let mut want = vec![0.0; 4 * row];
        reference::paged_attention_decode(
            &mut want,
            &q[..4 * row],
            &kv,
            &tables,
            &[1, 17, 100, 333],
            &cfg,
        );

        let (k, v) = (upload(&stream, &setup.k), upload(&stream, &setup.v));
        let table = stream.clone_htod(&setup.table).unwrap();
        let lens = stream.clone_htod(&seq_lens.map(|l| l as i32)).unwrap();
        let q_dev = upload(&stream, &q);
        let mut out = stream.alloc_zeros::<u16>(q.len()).unwrap();
        let kv_dev = DeviceKv {
            k_cache: k.as_view(),
            v_cache: v.as_view(),
            shape: setup.shape,
        };
        let tables_dev = DeviceBlockTables {
            table: table.as_view(),
            max_blocks_per_seq: setup.max_blocks_per_seq,
        };
        kernels
            .paged_attention_decode(
                &mut out.as_view_mut(),
                &q_dev.as_view(),
                &kv_dev,
                &tables_dev,
                &lens.as_view(),
                &cfg,
            )
            .unwrap();
        let got = download(&stream, &out);
        assert_close(&format!("decode {cfg:?}"), &got[..4 * row], &want);
        assert!(
            got[4 * row..].iter().all(|&x| x == 0.0),
            "padding row written"
        );
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
        let setup = PagedSetup::new(cfg.num_kv_heads, cfg.head_dim, &capacity, 11);
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

        let (k, v) = (upload(&stream, &setup.k), upload(&stream, &setup.v));
        let table = stream.clone_htod(&setup.table).unwrap();
        let cu_dev = stream.clone_htod(&cu).unwrap();
        let start_dev = stream.clone_htod(&start).unwrap();
        let q_dev = upload(&stream, &q);
        let mut out = stream.alloc_zeros::<u16>(q.len()).unwrap();
        let kv_dev = DeviceKv {
            k_cache: k.as_view(),
            v_cache: v.as_view(),
            shape: setup.shape,
        };
        let tables_dev = DeviceBlockTables {
            table: table.as_view(),
            max_blocks_per_seq: setup.max_blocks_per_seq,
        };
        kernels
            .paged_attention_prefill(
                &mut out.as_view_mut(),
                &q_dev.as_view(),
                &kv_dev,
                &tables_dev,
                &cu_dev.as_view(),
                &start_dev.as_view(),
                &cfg,
            )
            .unwrap();
        let got = download(&stream, &out);
        assert_close(&format!("prefill {cfg:?}"), &got[..real * row], &want);
        assert!(
            got[real * row..].iter().all(|&x| x == 0.0),
            "padding tokens written"
        );
    }
}

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
    let slots: Vec<i32> = vec![5, 140, -1, 16, 0, 143, 77];
    let key = random(slots.len() * token, 1, 2.0);
    let value = random(slots.len() * token, 2, 2.0);
    let mut k_want = random(shape.len(), 3, 1.0);
    let mut v_want = random(shape.len(), 4, 1.0);

    let mut k_dev = upload(&stream, &k_want);
    let mut v_dev = upload(&stream, &v_want);
    let (key_dev, value_dev) = (upload(&stream, &key), upload(&stream, &value));
    let slots_dev = stream.clone_htod(&slots).unwrap();
    kernels
        .reshape_and_cache(
            &key_dev.as_view(),
            &value_dev.as_view(),
            &mut k_dev.as_view_mut(),
            &mut v_dev.as_view_mut(),
            &slots_dev.as_view(),
            &shape,
        )
        .unwrap();
    reference::reshape_and_cache(&key, &value, &mut k_want, &mut v_want, &slots, &shape);
    // A copy: exact.
    assert_eq!(download(&stream, &k_dev), k_want);
    assert_eq!(download(&stream, &v_dev), v_want);
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
        let mut out = stream.alloc_zeros::<u16>(x.len()).unwrap();
        kernels
            .rms_norm(
                &mut out.as_view_mut(),
                &x_dev.as_view(),
                &w_dev.as_view(),
                1e-6,
                style,
            )
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
    let positions: Vec<i32> = vec![0, 1, 2, 17, 1000, 4095, 3];
    let n = positions.len();
    let mut q = random(n * heads * head_dim, 1, 2.0);
    let mut k = random(n * kv_heads * head_dim, 2, 2.0);
    let (mut q_dev, mut k_dev) = (upload(&stream, &q), upload(&stream, &k));
    let pos_dev = stream.clone_htod(&positions).unwrap();
    let cos = stream.clone_htod(&table.cos).unwrap();
    let sin = stream.clone_htod(&table.sin).unwrap();
    kernels
        .rope_neox(
            &mut q_dev.as_view_mut(),
            &mut k_dev.as_view_mut(),
            &pos_dev.as_view(),
            &cos.as_view(),
            &sin.as_view(),
            heads,
            kv_heads,
        )
        .unwrap();
    reference::rope_neox(&mut q, &positions, heads, &table);
    reference::rope_neox(&mut k, &positions, kv_heads, &table);
    assert_close("rope q", &download(&stream, &q_dev), &q);
    assert_close("rope k", &download(&stream, &k_dev), &k);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gated_activations_match_reference() {
    let (kernels, stream) = kernels();
    let (rows, inter) = (19, 8192);
    let gate_up = random(rows * 2 * inter, 9, 6.0);
    let gate_up_dev = upload(&stream, &gate_up);
    let mut out = stream.alloc_zeros::<u16>(rows * inter).unwrap();
    let mut want = vec![0.0; rows * inter];

    kernels
        .silu_and_mul(&mut out.as_view_mut(), &gate_up_dev.as_view(), inter)
        .unwrap();
    reference::silu_and_mul(&mut want, &gate_up, inter);
    assert_close("silu_and_mul", &download(&stream, &out), &want);

    kernels
        .gelu_tanh_and_mul(&mut out.as_view_mut(), &gate_up_dev.as_view(), inter)
        .unwrap();
    reference::gelu_tanh_and_mul(&mut want, &gate_up, inter);
    assert_close("gelu_tanh_and_mul", &download(&stream, &out), &want);
}
