//! Decode attention read in place from the paged KV store, on the CPU.
//!
//! A decode has one query per head and attends to every earlier position of its own
//! sequence. Batched as a padded matmul (the path prefill chunks take), a step of decodes
//! must first gather each sequence's K and V into a padded tensor: a copy of the whole
//! context, plus padding that depends on which other sequences share the step. This kernel
//! instead walks each sequence's block table and reads K and V where they lie — what a
//! GPU paged-attention kernel does — so a step's attention costs one pass over Σ context,
//! whatever the mix of lengths, and a sequence's result never depends on its neighbours.
//!
//! Per (sequence, KV head): scores for the `g` query heads sharing that KV head, a softmax
//! (with Gemma's soft cap when set), then the weighted sum of V. (Sequence, KV head) pairs
//! run in parallel.

use float8::F8E4M3;
use half::{bf16, f16};
use rayon::prelude::*;

/// The decodes of a step: which query rows, and the KV slots each attends to.
pub(crate) struct DecodeSet {
    /// Row of each decode in the step's flattened queries.
    pub rows: Vec<u32>,
    /// `slots[offsets[i]..offsets[i + 1]]`: the slots decode `i` attends to, in position order.
    pub slots: Vec<u32>,
    pub offsets: Vec<usize>,
}

impl DecodeSet {
    pub fn new() -> Self {
        DecodeSet {
            rows: Vec::new(),
            slots: Vec::new(),
            offsets: vec![0],
        }
    }

    pub fn push(&mut self, row: u32, slots: impl IntoIterator<Item = u32>) {
        self.rows.push(row);
        self.slots.extend(slots);
        self.offsets.push(self.slots.len());
    }

    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }
}

/// A KV element type read as f32.
pub(crate) trait KvElem: Copy + Send + Sync {
    fn f32(self) -> f32;

    /// `row` as f32, once per row for every query head of its group: widened into `buf`,
    /// or (f32) the row itself.
    #[inline(always)]
    fn widen<'a>(row: &'a [Self], buf: &'a mut [f32]) -> &'a [f32] {
        widen_each(row, buf)
    }
}

/// `row` widened into `buf` one element at a time.
#[inline(always)]
fn widen_each<'a, T: KvElem>(row: &[T], buf: &'a mut [f32]) -> &'a [f32] {
    for (out, x) in buf.iter_mut().zip(row) {
        *out = x.f32();
    }
    buf
}
impl KvElem for f32 {
    #[inline(always)]
    fn f32(self) -> f32 {
        self
    }

    #[inline(always)]
    fn widen<'a>(row: &'a [f32], _buf: &'a mut [f32]) -> &'a [f32] {
        row
    }
}
impl KvElem for bf16 {
    #[inline(always)]
    fn f32(self) -> f32 {
        self.to_f32()
    }
}
impl KvElem for f16 {
    #[inline(always)]
    fn f32(self) -> f32 {
        self.to_f32()
    }
}
/// Branch-free (selects only), so that widening a row vectorises: the crate's conversion
/// goes through f16 with branches, and a table lookup per element gathers.
impl KvElem for F8E4M3 {
    #[inline(always)]
    fn f32(self) -> f32 {
        let bits = self.to_bits() as u32;
        let (sign, magnitude) = ((bits & 0x80) << 24, bits & 0x7f);
        // Normal: the exponent rebiased (7 to 127), the 3 mantissa bits moved up.
        let normal = f32::from_bits(sign | ((magnitude << 20) + (120 << 23)));
        // Exponent 0: m × 2^-9.
        let subnormal = f32::from_bits(sign | (magnitude as f32 * (1.0 / 512.0)).to_bits());
        let value = if magnitude < 8 { subnormal } else { normal };
        if magnitude == 0x7f {
            f32::NAN
        } else {
            value
        }
    }

    #[inline(always)]
    fn widen<'a>(row: &'a [F8E4M3], buf: &'a mut [f32]) -> &'a [f32] {
        #[cfg(target_arch = "x86_64")]
        if fp8_simd::available() {
            // SAFETY: the features it is compiled for were detected.
            unsafe { fp8_simd::widen(row, buf) };
            return buf;
        }
        widen_each(row, buf)
    }
}

/// E4M3 to f32 eight at a time through the f16 converter (F16C): a code's 7 magnitude bits
/// shifted up by 7 are an f16 of the same mantissa whose exponent is biased 15 rather than 7,
/// subnormals included, so the f16's value times 2^8 is the code's, exactly; the NaN codes
/// (magnitude 0x7f) are selected apart.
#[cfg(target_arch = "x86_64")]
mod fp8_simd {
    use float8::F8E4M3;
    use std::arch::x86_64::*;

    pub fn available() -> bool {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c")
    }

    /// `out[i] = row[i]` as f32 for `i < row.len().min(out.len())`.
    ///
    /// # Safety
    /// The CPU has AVX2 and F16C ([`available`]).
    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn widen(row: &[F8E4M3], out: &mut [f32]) {
        let n = row.len().min(out.len());
        let (sign_bit, magnitude_bits) = (_mm_set1_epi16(0x80), _mm_set1_epi16(0x7f));
        let nan_code = _mm_set1_epi16(0x7f << 7);
        let scale = _mm256_set1_ps(256.0);
        let nan = _mm256_set1_ps(f32::NAN);
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: `i + 8 <= n`, within both slices; F8E4M3 is one byte.
            let bytes = _mm_loadl_epi64(row.as_ptr().add(i) as *const __m128i);
            let x = _mm_cvtepu8_epi16(bytes);
            let magnitude = _mm_slli_epi16::<7>(_mm_and_si128(x, magnitude_bits));
            let sign = _mm_slli_epi16::<8>(_mm_and_si128(x, sign_bit));
            let value = _mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(sign, magnitude)), scale);
            let is_nan =
                _mm256_castsi256_ps(_mm256_cvtepi16_epi32(_mm_cmpeq_epi16(magnitude, nan_code)));
            _mm256_storeu_ps(
                out.as_mut_ptr().add(i),
                _mm256_blendv_ps(value, nan, is_nan),
            );
            i += 8;
        }
        for j in i..n {
            out[j] = super::KvElem::f32(row[j]);
        }
    }
}

/// Shapes of one call.
#[derive(Clone, Copy)]
pub(crate) struct Dims {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Slots per KV head in the store (`num_blocks * block_size`).
    pub slots_per_head: usize,
}

/// `q`: `[decodes, heads, head_dim]` f32 (the set's rows, in its order); `k`, `v`: one
/// layer of the store, `[kv_heads, slots, head_dim]`. Returns `[decodes, heads * head_dim]`.
pub(crate) fn decode_attention<T: KvElem>(
    q: &[f32],
    k: &[T],
    v: &[T],
    set: &DecodeSet,
    dims: Dims,
    scale: f32,
    softcap: Option<f32>,
) -> Vec<f32> {
    let Dims {
        heads,
        kv_heads,
        head_dim: d,
        slots_per_head,
    } = dims;
    let g = heads / kv_heads;
    let mut out = vec![0f32; set.len() * heads * d];
    // One task per (sequence, KV head): its `g` query heads are a contiguous `g × d` piece
    // of the output. Even one long decode then uses every core.
    out.par_chunks_mut(g * d)
        .enumerate()
        .for_each(|(task, out_h)| {
            let (i, h) = (task / kv_heads, task % kv_heads);
            let slots = &set.slots[set.offsets[i]..set.offsets[i + 1]];
            let ctx = slots.len();
            let mut scores = vec![0f32; g * ctx];
            let mut widened = vec![0f32; d];
            let head_k = &k[h * slots_per_head * d..(h + 1) * slots_per_head * d];
            let head_v = &v[h * slots_per_head * d..(h + 1) * slots_per_head * d];
            let q_h = &q[(i * heads + h * g) * d..(i * heads + (h + 1) * g) * d];
            for (c, &slot) in slots.iter().enumerate() {
                if let Some(&ahead) = slots.get(c + PREFETCH_AHEAD) {
                    prefetch(&head_k[ahead as usize * d..][..d]);
                }
                let k_row = T::widen(&head_k[slot as usize * d..][..d], &mut widened);
                for j in 0..g {
                    let mut s = dot(&q_h[j * d..(j + 1) * d], k_row) * scale;
                    if let Some(cap) = softcap {
                        s = (s / cap).tanh() * cap;
                    }
                    scores[j * ctx + c] = s;
                }
            }
            for j in 0..g {
                softmax_in_place(&mut scores[j * ctx..(j + 1) * ctx]);
            }
            for (c, &slot) in slots.iter().enumerate() {
                if let Some(&ahead) = slots.get(c + PREFETCH_AHEAD) {
                    prefetch(&head_v[ahead as usize * d..][..d]);
                }
                let v_row = T::widen(&head_v[slot as usize * d..][..d], &mut widened);
                for j in 0..g {
                    axpy(&mut out_h[j * d..(j + 1) * d], scores[j * ctx + c], v_row);
                }
            }
        });
    out
}

/// How many positions ahead rows are prefetched. Blocks are scattered through the store, so
/// the hardware prefetcher, which stops at page boundaries, restarts cold at every block;
/// asking for the rows one block (16 positions) ahead hides that.
const PREFETCH_AHEAD: usize = 16;

/// Hint the cache lines of `row` into L1.
#[inline(always)]
fn prefetch<T>(row: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let bytes = std::mem::size_of_val(row);
        let p = row.as_ptr() as *const i8;
        for off in (0..bytes).step_by(64) {
            // SAFETY: a prefetch is only a hint; the address is inside `row`.
            unsafe { _mm_prefetch(p.add(off), _MM_HINT_T0) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = row;
}

/// Eight independent partial sums, so the compiler can vectorise.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

#[inline(always)]
fn axpy(out: &mut [f32], a: f32, x: &[f32]) {
    for (o, v) in out.iter_mut().zip(x) {
        *o += a * v;
    }
}

fn softmax_in_place(s: &mut [f32]) {
    let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for x in s.iter_mut() {
        *x = (*x - max).exp();
        sum += *x;
    }
    let inv = 1.0 / sum;
    for x in s.iter_mut() {
        *x *= inv;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_reads_as_the_float8_crate_converts_every_code() {
        for bits in 0..=255u8 {
            let x = F8E4M3::from_bits(bits);
            let (got, want) = (x.f32(), x.to_f32());
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{bits:#04x}: {got} vs {want}"
            );
        }
    }

    /// A row widened at once (eight codes per step where the CPU has F16C, the rest one by
    /// one) reads every code as the one-by-one conversion does, bit for bit, at every
    /// offset of the eight-wide steps and for rows that do not fill the last one.
    #[test]
    fn fp8_rows_widen_as_each_code_converts() {
        let codes: Vec<F8E4M3> = (0..=255u8)
            .cycle()
            .take(256 + 13)
            .map(F8E4M3::from_bits)
            .collect();
        for len in [1, 7, 8, 9, 64, 100, codes.len()] {
            for start in [0, 3] {
                let row = &codes[start..(start + len).min(codes.len())];
                let mut buf = vec![0f32; row.len()];
                let got = F8E4M3::widen(row, &mut buf);
                for (x, g) in row.iter().zip(got) {
                    let want = x.f32();
                    assert!(
                        g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()),
                        "{:#04x}: {g} vs {want} (len {len})",
                        x.to_bits()
                    );
                }
            }
        }
    }

    use infer_kernels::layout::{AttentionConfig, BlockTables, KvCacheShape};
    use infer_kernels::reference::{paged_attention_decode, PagedKv};

    /// The kernels crate's reference (the oracle of the CUDA kernels too) on the same
    /// values: its pool is `[slot, kv_head, head_dim]` with blocks of one slot, so each
    /// decode's table row is its list of slots.
    fn oracle(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        set: &DecodeSet,
        dims: Dims,
        scale: f32,
        softcap: Option<f32>,
    ) -> Vec<f32> {
        let Dims {
            heads,
            kv_heads,
            head_dim: d,
            slots_per_head,
        } = dims;
        let shape = KvCacheShape {
            num_blocks: slots_per_head,
            block_size: 1,
            num_kv_heads: kv_heads,
            head_dim: d,
        };
        let repack = |t: &[f32]| {
            let mut out = vec![0.0; shape.len()];
            for slot in 0..slots_per_head {
                for h in 0..kv_heads {
                    out[shape.offset(slot, h)..][..d]
                        .copy_from_slice(&t[(h * slots_per_head + slot) * d..][..d]);
                }
            }
            out
        };
        let (k_cache, v_cache) = (repack(k), repack(v));
        let width = (0..set.len())
            .map(|i| set.offsets[i + 1] - set.offsets[i])
            .max()
            .unwrap_or(0);
        let mut table = vec![-1i32; set.len() * width];
        let mut seq_lens = Vec::new();
        for i in 0..set.len() {
            let slots = &set.slots[set.offsets[i]..set.offsets[i + 1]];
            for (j, &slot) in slots.iter().enumerate() {
                table[i * width + j] = slot as i32;
            }
            seq_lens.push(slots.len() as i32);
        }
        let mut cfg = AttentionConfig::new(heads, kv_heads, d);
        cfg.scale = scale;
        if let Some(cap) = softcap {
            cfg = cfg.with_softcap(cap);
        }
        let mut out = vec![0.0; q.len()];
        let kv = PagedKv {
            k_cache: &k_cache,
            v_cache: &v_cache,
            shape,
        };
        let tables = BlockTables {
            table: &table,
            max_blocks_per_seq: width,
        };
        paged_attention_decode(&mut out, q, &kv, &tables, &seq_lens, &cfg);
        out
    }

    #[test]
    fn matches_the_reference_through_scattered_slots() {
        let (heads, kv_heads, d, slots_per_head) = (4, 2, 12, 40);
        let val = |i: usize| ((i * 37 % 101) as f32 / 50.0) - 1.0;
        let k: Vec<f32> = (0..kv_heads * slots_per_head * d).map(val).collect();
        let v: Vec<f32> = (0..kv_heads * slots_per_head * d)
            .map(|i| val(i + 7))
            .collect();
        let mut set = DecodeSet::new();
        set.push(3, [5u32, 17, 2, 30, 31]);
        set.push(0, [9u32]);
        let q: Vec<f32> = (0..2 * heads * d).map(|i| val(i + 3)).collect();
        let dims = Dims {
            heads,
            kv_heads,
            head_dim: d,
            slots_per_head,
        };
        for softcap in [None, Some(0.5)] {
            let out = decode_attention(&q, &k, &v, &set, dims, 0.3, softcap);
            let want = oracle(&q, &k, &v, &set, dims, 0.3, softcap);
            for (i, (a, b)) in out.iter().zip(&want).enumerate() {
                assert!((a - b).abs() < 1e-5, "{softcap:?} element {i}: {a} vs {b}");
            }
        }
        // bf16 storage reads the same values rounded.
        let out = decode_attention(&q, &k, &v, &set, dims, 0.3, None);
        let kb: Vec<bf16> = k.iter().map(|&x| bf16::from_f32(x)).collect();
        let vb: Vec<bf16> = v.iter().map(|&x| bf16::from_f32(x)).collect();
        let outb = decode_attention(&q, &kb, &vb, &set, dims, 0.3, None);
        for (a, b) in outb.iter().zip(&out) {
            assert!((a - b).abs() < 2e-2, "{a} vs {b}");
        }
    }
}
