//! `y = x @ W^T` for the CPU backend: f32 activations against weights `W` (`[out, in]` as
//! HF checkpoints store them) held in f32 or bf16.
//!
//! - f32 weights: f32 products, fused multiply-adds in 16 f32 lanes (8 with AVX2).
//! - bf16 weights: what a bf16 checkpoint computes in PyTorch, and llama.cpp on a bf16 GGUF:
//!   the activations are rounded to bf16 (to nearest even) once per step, products of two
//!   bf16 numbers are exact in f32 and accumulate in f32 — with the CPU's native BF16 dot
//!   products (`vdpbf16ps`, two products per f32 lane) where it has them.
//!
//! One dot-product kernel serves every step shape. Each output element is the dot product
//! of one activation row with one weight row, accumulated in f32 lanes over the input in
//! order and reduced the same way whatever else is in the batch: a token's result is
//! bit-identical alone or batched with any number of others, in a decode or a prefill.
//!
//! Weights are packed once, at load, in the kernel's order ([`Packed`]): a register tile of
//! [`TILE_W`] weight rows is one sequential stream, multiplied with up to [`TILE_X`]
//! activation rows while it is in registers — a decode step reads each weight once, as fast
//! as memory delivers it. Prefill-shaped steps are blocked so a block of weight tiles stays
//! in L2 while every activation block passes over it. Threads split the output columns
//! into one contiguous run each, on the calling rayon pool (the engine loop runs on it).
//!
//! AVX-512 (F, BW, VL; BF16 for the native dot products) is used when the CPU has it,
//! AVX2 with FMA on other x86 CPUs, detected once at run time; elsewhere a portable loop
//! computes the same products. (Each kernel sums in its own fixed order, so results are
//! bit-identical across batches on one machine, not across kernels.)

use half::bf16;
use rayon::prelude::*;
use std::borrow::Cow;
use std::sync::OnceLock;

/// Weight rows per register tile (and per packed tile).
const TILE_W: usize = 4;
/// Activation rows per register tile.
const TILE_X: usize = 4;
/// Bytes of weight tiles kept in L2 while activation blocks pass over them, and bytes of
/// one activation block.
const BLOCK_BYTES: usize = 256 << 10;

/// One register tile's results: `[activation row][weight row]`.
type Acc = [[f32; TILE_W]; TILE_X];

/// A weight matrix `[rows, cols]` (`rows` outputs of `cols` inputs each), packed.
pub struct Weights {
    rows: usize,
    cols: usize,
    data: Data,
}

enum Data {
    F32(Packed<f32>),
    Bf16(Packed<bf16>),
}

impl Weights {
    pub fn f32(rows: usize, cols: usize, data: &[f32]) -> Self {
        Self {
            rows,
            cols,
            data: Data::F32(Packed::new(rows, cols, data)),
        }
    }

    pub fn bf16(rows: usize, cols: usize, data: &[bf16]) -> Self {
        Self {
            rows,
            cols,
            data: Data::Bf16(Packed::new(rows, cols, data)),
        }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// `y[m, rows] = x[m, cols] @ W^T`.
    pub fn matmul_t(&self, x: &[f32], m: usize, y: &mut [f32]) {
        self.matmul_t_with(kernel(), x, m, y)
    }

    fn matmul_t_with(&self, kernel: Kernel, x: &[f32], m: usize, y: &mut [f32]) {
        let (n, k) = (self.rows, self.cols);
        assert_eq!(x.len(), m * k, "activations of {m}x{k}");
        assert_eq!(y.len(), m * n, "output of {m}x{n}");
        if m == 0 || n == 0 {
            return;
        }
        if k == 0 {
            // An empty sum.
            y.fill(0.0);
            return;
        }
        match &self.data {
            Data::F32(w) => {
                let tile: TileFn<f32, f32> = match kernel {
                    #[cfg(target_arch = "x86_64")]
                    Kernel::Avx512 | Kernel::Avx512Bf16 => avx512::f32_tiles,
                    #[cfg(target_arch = "x86_64")]
                    Kernel::Avx2 => avx2::f32_tiles,
                    _ => portable,
                };
                let x = if w.k_pad == k {
                    Cow::Borrowed(x)
                } else {
                    Cow::Owned(pad_rows(x, m, k, w.k_pad, |v| v))
                };
                product(w, n, &x, m, y, tile)
            }
            Data::Bf16(w) => {
                let tile: TileFn<bf16, bf16> = match kernel {
                    #[cfg(target_arch = "x86_64")]
                    Kernel::Avx512Bf16 => avx512::bf16_dot_tiles,
                    #[cfg(target_arch = "x86_64")]
                    Kernel::Avx512 => avx512::bf16_wide_tiles,
                    #[cfg(target_arch = "x86_64")]
                    Kernel::Avx2 => avx2::bf16_tiles,
                    _ => portable,
                };
                product(w, n, &to_bf16(kernel, x, m, k, w.k_pad), m, y, tile)
            }
        }
    }
}

/// Which kernels this CPU runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kernel {
    Portable,
    /// AVX2 and FMA: eight f32 lanes.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    Avx2,
    /// AVX-512 F, BW and VL.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    Avx512,
    /// ... and AVX-512 BF16.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    Avx512Bf16,
}

fn kernel() -> Kernel {
    static KERNEL: OnceLock<Kernel> = OnceLock::new();
    *KERNEL.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            use std::is_x86_feature_detected as has;
            if has!("avx512f") && has!("avx512bw") && has!("avx512vl") {
                return if has!("avx512bf16") {
                    Kernel::Avx512Bf16
                } else {
                    Kernel::Avx512
                };
            }
            if has!("avx2") && has!("fma") {
                return Kernel::Avx2;
            }
        }
        Kernel::Portable
    })
}

/// A weight or activation element the kernels read.
trait Elem: Copy + Send + Sync + 'static {
    const ZERO: Self;
    /// Elements of one row per kernel step: one 512-bit register's worth.
    const STEP: usize;
    fn to_f32(self) -> f32;
}

impl Elem for f32 {
    const ZERO: Self = 0.0;
    const STEP: usize = 16;
    fn to_f32(self) -> f32 {
        self
    }
}

impl Elem for bf16 {
    const ZERO: Self = bf16::ZERO;
    const STEP: usize = 32;
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

/// Weight rows in the kernel's order. Rows are grouped in tiles of [`TILE_W`]; within a
/// tile, the rows' `STEP`-element chunks lie side by side, chunk after chunk, so the kernel
/// reads a tile as one sequential stream. Rows are padded with zero rows to whole tiles
/// and columns with zeros to whole steps (`k_pad`); zeros add nothing to a dot product.
struct Packed<W> {
    data: Vec<W>,
    k_pad: usize,
}

impl<W: Elem> Packed<W> {
    fn new(rows: usize, cols: usize, src: &[W]) -> Self {
        assert_eq!(src.len(), rows * cols, "weights of {rows}x{cols}");
        let k_pad = cols.div_ceil(W::STEP) * W::STEP;
        let mut data = vec![W::ZERO; rows.div_ceil(TILE_W) * TILE_W * k_pad];
        for (r, row) in src.chunks_exact(cols.max(1)).enumerate().take(rows) {
            let (tile, c) = (r / TILE_W, r % TILE_W);
            for (s, chunk) in row.chunks(W::STEP).enumerate() {
                let at = tile * TILE_W * k_pad + s * TILE_W * W::STEP + c * W::STEP;
                data[at..at + chunk.len()].copy_from_slice(chunk);
            }
        }
        Self { data, k_pad }
    }

    fn tiles(&self) -> usize {
        self.data.len() / (TILE_W * self.k_pad).max(1)
    }

    fn tile(&self, t: usize) -> &[W] {
        let len = TILE_W * self.k_pad;
        &self.data[t * len..(t + 1) * len]
    }
}

/// `m` rows of `k` elements as rows of `k_pad`, zero-padded, converted by `f`.
fn pad_rows<A: Copy, B: Elem>(
    x: &[A],
    m: usize,
    k: usize,
    k_pad: usize,
    f: impl Fn(A) -> B,
) -> Vec<B> {
    let mut out = vec![B::ZERO; m * k_pad];
    for (o, i) in out.chunks_exact_mut(k_pad).zip(x.chunks_exact(k)) {
        for (d, &s) in o.iter_mut().zip(i) {
            *d = f(s);
        }
    }
    out
}

/// Activations rounded to bf16 (to nearest even), in rows of `k_pad`.
fn to_bf16(kernel: Kernel, x: &[f32], m: usize, k: usize, k_pad: usize) -> Vec<bf16> {
    #[cfg(target_arch = "x86_64")]
    if kernel == Kernel::Avx512Bf16 {
        let mut out = vec![bf16::ZERO; m * k_pad];
        for (o, i) in out.chunks_exact_mut(k_pad).zip(x.chunks_exact(k)) {
            // SAFETY: the CPU has AVX-512 BF16 (detected); `o` holds at least `k` elements.
            unsafe { avx512::round_to_bf16(i, &mut o[..k]) };
        }
        return out;
    }
    let _ = kernel;
    pad_rows(x, m, k, k_pad, bf16::from_f32)
}

/// Computes one register tile: `acc[i][c] = x_i · w_c` for the `nx` activation rows of `x`
/// and the packed weight tile `w`, rows `k_pad` long.
///
/// # Safety
/// The CPU has the kernel's instruction set; `nx <= TILE_X`; `w` is one packed tile and `x`
/// holds `nx * k_pad` elements.
type TileFn<W, X> = unsafe fn(w: &[W], x: &[X], nx: usize, k_pad: usize, acc: &mut Acc);

/// The output matrix, written by several threads at disjoint columns.
#[derive(Clone, Copy)]
struct Out {
    ptr: *mut f32,
    stride: usize,
}

// SAFETY: threads write disjoint column ranges of the output (see `product`).
unsafe impl Send for Out {}
unsafe impl Sync for Out {}

fn product<W: Elem, X: Elem>(
    w: &Packed<W>,
    n: usize,
    x: &[X],
    m: usize,
    y: &mut [f32],
    tile: TileFn<W, X>,
) {
    let out = Out {
        ptr: y.as_mut_ptr(),
        stride: n,
    };
    // One contiguous run of weight tiles per thread.
    let tiles = w.tiles();
    let threads = rayon::current_num_threads().max(1);
    let per = tiles.div_ceil(threads);
    (0..tiles.div_ceil(per)).into_par_iter().for_each(|part| {
        let (t0, t1) = (part * per, ((part + 1) * per).min(tiles));
        // SAFETY: tiles `t0..t1` are this task's own output columns; the shapes were
        // checked by `matmul_t_with`, and `tile` was chosen for this CPU.
        unsafe { columns(w, n, x, m, out, t0, t1, tile) };
    });
}

/// The output columns of weight tiles `t0..t1`, blocked for the caches (see the module
/// notes).
///
/// # Safety
/// No other thread writes these columns of `out`; `tile` runs on this CPU.
#[allow(clippy::too_many_arguments)]
unsafe fn columns<W: Elem, X: Elem>(
    w: &Packed<W>,
    n: usize,
    x: &[X],
    m: usize,
    out: Out,
    t0: usize,
    t1: usize,
    tile: TileFn<W, X>,
) {
    let k_pad = w.k_pad;
    let block_w = (BLOCK_BYTES / (TILE_W * k_pad * size_of::<W>())).max(1);
    let block_x = (BLOCK_BYTES / (k_pad * size_of::<X>())).max(TILE_X) / TILE_X * TILE_X;
    for b0 in (t0..t1).step_by(block_w) {
        let b1 = (b0 + block_w).min(t1);
        for r0 in (0..m).step_by(block_x) {
            let r1 = (r0 + block_x).min(m);
            for t in b0..b1 {
                let ws = w.tile(t);
                let (j, nw) = (t * TILE_W, TILE_W.min(n - t * TILE_W));
                for r in (r0..r1).step_by(TILE_X) {
                    let nx = TILE_X.min(r1 - r);
                    let mut acc = [[0f32; TILE_W]; TILE_X];
                    tile(ws, &x[r * k_pad..(r + nx) * k_pad], nx, k_pad, &mut acc);
                    for (i, row) in acc.iter().enumerate().take(nx) {
                        let dst = out.ptr.add((r + i) * out.stride + j);
                        for (c, &v) in row.iter().enumerate().take(nw) {
                            *dst.add(c) = v;
                        }
                    }
                }
            }
        }
    }
}

/// The kernels' arithmetic without SIMD: products widened to f32, accumulated in 16 lanes
/// over the input in order, then summed.
fn portable<W: Elem, X: Elem>(w: &[W], x: &[X], nx: usize, k_pad: usize, acc: &mut Acc) {
    const LANES: usize = 16;
    for (i, xr) in x.chunks_exact(k_pad).take(nx).enumerate() {
        for (c, a) in acc[i].iter_mut().enumerate() {
            let mut lanes = [0f32; LANES];
            for (s, xc) in xr.chunks_exact(W::STEP).enumerate() {
                let wc = &w[(s * TILE_W + c) * W::STEP..][..W::STEP];
                for (e, (&p, &q)) in xc.iter().zip(wc).enumerate() {
                    lanes[e % LANES] += p.to_f32() * q.to_f32();
                }
            }
            *a = lanes.iter().sum();
        }
    }
}

/// A register tile kernel running `$step` over the row (its sums, `Sums<NX>`, start at
/// `$zero` and are reduced by `$reduce`), and its dispatcher over the number of activation
/// rows, at most `$pass` of them in registers at once (with 16 AVX2 registers, four rows'
/// 16 sums beside the 4 weight vectors would spill to the stack).
#[cfg(target_arch = "x86_64")]
macro_rules! tiles {
    ($dispatch:ident, $tile:ident, $features:literal, $pass:literal, $e:ty, $step:ident, $zero:expr, $reduce:ident) => {
        #[target_feature(enable = $features)]
        unsafe fn $tile<const NX: usize>(
            w: *const $e,
            x: *const $e,
            k: usize,
            acc: &mut [[f32; TILE_W]],
        ) {
            let mut sum: Sums<NX> = [[$zero; TILE_W]; NX];
            let mut i = 0;
            while i < k {
                $step(&mut sum, w.add(i * TILE_W), x.add(i), k);
                i += <$e as Elem>::STEP;
            }
            for (r, s) in sum.iter().enumerate() {
                for (c, v) in s.iter().enumerate() {
                    acc[r][c] = $reduce(*v);
                }
            }
        }

        /// # Safety
        /// See [`super::TileFn`].
        pub(super) unsafe fn $dispatch(w: &[$e], x: &[$e], nx: usize, k: usize, acc: &mut Acc) {
            debug_assert!(w.len() == TILE_W * k && x.len() >= nx * k);
            debug_assert!(k % <$e as Elem>::STEP == 0);
            let (w, x) = (w.as_ptr(), x.as_ptr());
            // Each sum's order is the same in any pass: results do not depend on `nx`.
            let mut r = 0;
            while r < nx {
                let (x, acc) = (x.add(r * k), &mut acc[r..]);
                let rows = (nx - r).min($pass);
                match rows {
                    4 => $tile::<4>(w, x, k, acc),
                    3 => $tile::<3>(w, x, k, acc),
                    2 => $tile::<2>(w, x, k, acc),
                    1 => $tile::<1>(w, x, k, acc),
                    _ => unreachable!("a tile of {nx} activation rows"),
                }
                r += rows;
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{Acc, Elem, TILE_W, TILE_X};
    use half::bf16;
    use std::arch::x86_64::*;

    type Sums<const NX: usize> = [[__m512; TILE_W]; NX];

    /// One step of f32 tiles: 16 elements of each row.
    #[inline(always)]
    unsafe fn step_f32<const NX: usize>(s: &mut Sums<NX>, w: *const f32, x: *const f32, k: usize) {
        let wv: [__m512; TILE_W] = [
            _mm512_loadu_ps(w),
            _mm512_loadu_ps(w.add(16)),
            _mm512_loadu_ps(w.add(32)),
            _mm512_loadu_ps(w.add(48)),
        ];
        for (r, sr) in s.iter_mut().enumerate() {
            let xv = _mm512_loadu_ps(x.add(r * k));
            for (c, v) in sr.iter_mut().enumerate() {
                *v = _mm512_fmadd_ps(xv, wv[c], *v);
            }
        }
    }

    /// Sixteen bf16 widened to f32 (exactly: bf16 is the top half of an f32).
    #[inline(always)]
    unsafe fn wide(p: *const bf16) -> __m512 {
        let h = _mm256_loadu_si256(p as *const __m256i);
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
    }

    /// One step of bf16 tiles without native dot products: 32 elements of each row,
    /// widened to f32 and multiplied-added as two halves.
    #[inline(always)]
    unsafe fn step_bf16_wide<const NX: usize>(
        s: &mut Sums<NX>,
        w: *const bf16,
        x: *const bf16,
        k: usize,
    ) {
        for half in [0, 16] {
            let wv: [__m512; TILE_W] = [
                wide(w.add(half)),
                wide(w.add(32 + half)),
                wide(w.add(64 + half)),
                wide(w.add(96 + half)),
            ];
            for (r, sr) in s.iter_mut().enumerate() {
                let xv = wide(x.add(r * k + half));
                for (c, v) in sr.iter_mut().enumerate() {
                    *v = _mm512_fmadd_ps(xv, wv[c], *v);
                }
            }
        }
    }

    #[inline(always)]
    unsafe fn pairs(p: *const bf16) -> __m512bh {
        std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(p as *const __m512i))
    }

    /// One step of bf16 tiles with native dot products: 32 elements of each row.
    #[inline(always)]
    unsafe fn step_bf16_dot<const NX: usize>(
        s: &mut Sums<NX>,
        w: *const bf16,
        x: *const bf16,
        k: usize,
    ) {
        let wv: [__m512bh; TILE_W] = [
            pairs(w),
            pairs(w.add(32)),
            pairs(w.add(64)),
            pairs(w.add(96)),
        ];
        for (r, sr) in s.iter_mut().enumerate() {
            let xv = pairs(x.add(r * k));
            for (c, v) in sr.iter_mut().enumerate() {
                *v = _mm512_dpbf16_ps(*v, xv, wv[c]);
            }
        }
    }

    const _: () = assert!(
        TILE_W == 4 && TILE_X == 4,
        "the steps load four weight rows"
    );

    /// The sum of a register's lanes.
    #[inline(always)]
    unsafe fn reduce(v: __m512) -> f32 {
        _mm512_reduce_add_ps(v)
    }

    tiles!(
        f32_tiles,
        f32_tile,
        "avx512f,avx512bw,avx512vl",
        4,
        f32,
        step_f32,
        _mm512_setzero_ps(),
        reduce
    );
    tiles!(
        bf16_wide_tiles,
        bf16_wide_tile,
        "avx512f,avx512bw,avx512vl",
        4,
        bf16,
        step_bf16_wide,
        _mm512_setzero_ps(),
        reduce
    );
    tiles!(
        bf16_dot_tiles,
        bf16_dot_tile,
        "avx512f,avx512bw,avx512vl,avx512bf16",
        4,
        bf16,
        step_bf16_dot,
        _mm512_setzero_ps(),
        reduce
    );

    /// `out = x` rounded to bf16 (to nearest even), sixteen at a time.
    ///
    /// # Safety
    /// The CPU has AVX-512 F/BW/VL and BF16; `out.len() == x.len()`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    pub(super) unsafe fn round_to_bf16(x: &[f32], out: &mut [bf16]) {
        debug_assert_eq!(x.len(), out.len());
        let mut i = 0;
        while i < x.len() {
            let left = x.len() - i;
            let m: u16 = if left >= 16 {
                u16::MAX
            } else {
                (1 << left) - 1
            };
            let v = _mm512_maskz_loadu_ps(m, x.as_ptr().add(i));
            let h: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(v));
            _mm256_mask_storeu_epi16(out.as_mut_ptr().add(i) as *mut i16, m, h);
            i += 16;
        }
    }
}

/// The AVX2 + FMA kernels, for x86 CPUs without AVX-512: the same packed tiles, eight f32
/// lanes a register, each step's 16 (f32) or 32 (bf16) elements in halves (a bf16 half as
/// its even and its odd elements), two activation rows at a time.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{Acc, Elem, TILE_W};
    use half::bf16;
    use std::arch::x86_64::*;

    type Sums<const NX: usize> = [[__m256; TILE_W]; NX];

    /// One step of f32 tiles: 16 elements of each row, as two halves.
    #[inline(always)]
    unsafe fn step_f32<const NX: usize>(s: &mut Sums<NX>, w: *const f32, x: *const f32, k: usize) {
        for half in [0, 8] {
            let wv: [__m256; TILE_W] = [
                _mm256_loadu_ps(w.add(half)),
                _mm256_loadu_ps(w.add(16 + half)),
                _mm256_loadu_ps(w.add(32 + half)),
                _mm256_loadu_ps(w.add(48 + half)),
            ];
            for (r, sr) in s.iter_mut().enumerate() {
                let xv = _mm256_loadu_ps(x.add(r * k + half));
                for (c, v) in sr.iter_mut().enumerate() {
                    *v = _mm256_fmadd_ps(xv, wv[c], *v);
                }
            }
        }
    }

    /// Sixteen bf16 at `p` as f32 (exactly: bf16 is the top half of an f32), in two
    /// registers: the even elements, then the odd ones. The even ones are shifted into
    /// place and the odd ones masked, one instruction each, where widening in order takes
    /// a shuffle and a shift per eight. A weight row and an activation row split alike, so
    /// their products pair up as in order; only the order of the sums changes.
    #[inline(always)]
    unsafe fn even_odd(p: *const bf16) -> [__m256; 2] {
        let v = _mm256_loadu_si256(p as *const __m256i);
        let high = _mm256_set1_epi32(0xffff_0000_u32 as i32);
        [
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(v)),
            _mm256_castsi256_ps(_mm256_and_si256(v, high)),
        ]
    }

    /// One step of bf16 tiles: 32 elements of each row, as two halves, each widened to
    /// f32 as its even and its odd elements.
    #[inline(always)]
    unsafe fn step_bf16<const NX: usize>(
        s: &mut Sums<NX>,
        w: *const bf16,
        x: *const bf16,
        k: usize,
    ) {
        for half in [0, 16] {
            for part in 0..2 {
                let wv: [__m256; TILE_W] = [
                    even_odd(w.add(half))[part],
                    even_odd(w.add(32 + half))[part],
                    even_odd(w.add(64 + half))[part],
                    even_odd(w.add(96 + half))[part],
                ];
                for (r, sr) in s.iter_mut().enumerate() {
                    let xv = even_odd(x.add(r * k + half))[part];
                    for (c, v) in sr.iter_mut().enumerate() {
                        *v = _mm256_fmadd_ps(xv, wv[c], *v);
                    }
                }
            }
        }
    }

    /// The sum of a register's lanes, always in the same order.
    #[inline(always)]
    unsafe fn reduce(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<1>(s, s)))
    }

    tiles!(
        f32_tiles,
        f32_tile,
        "avx2,fma",
        2,
        f32,
        step_f32,
        _mm256_setzero_ps(),
        reduce
    );
    tiles!(
        bf16_tiles,
        bf16_tile,
        "avx2,fma",
        2,
        bf16,
        step_bf16,
        _mm256_setzero_ps(),
        reduce
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn random(n: usize, rng: &mut impl Rng) -> Vec<f32> {
        (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect()
    }

    fn round(v: &[f32]) -> Vec<f32> {
        v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect()
    }

    /// The product in f64, to compare the kernels against.
    fn reference(w: &[f32], n: usize, k: usize, x: &[f32], m: usize) -> Vec<f64> {
        let mut y = vec![0f64; m * n];
        for r in 0..m {
            for j in 0..n {
                y[r * n + j] = (0..k)
                    .map(|i| x[r * k + i] as f64 * w[j * k + i] as f64)
                    .sum();
            }
        }
        y
    }

    /// The kernels this CPU can run.
    fn kernels_here() -> Vec<Kernel> {
        let mut here = vec![Kernel::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            use std::is_x86_feature_detected as has;
            // A virtual machine may hide FMA even beside AVX-512.
            if has!("avx2") && has!("fma") {
                here.push(Kernel::Avx2);
            }
        }
        match kernel() {
            Kernel::Portable | Kernel::Avx2 => {}
            Kernel::Avx512 => here.push(Kernel::Avx512),
            Kernel::Avx512Bf16 => here.extend([Kernel::Avx512, Kernel::Avx512Bf16]),
        }
        here
    }

    /// Every step shape the models use (decode rows 1–64, prefill chunks) on their widths,
    /// plus odd sizes that reach every tile and lane tail; both weight dtypes, every kernel
    /// this CPU has. bf16 weights multiply activations rounded to bf16, exactly, in f32.
    #[test]
    fn products_match_the_f64_reference_on_every_shape() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let shapes = [
            (1, 64, 64),
            (3, 1536, 1024),
            (8, 1024, 1024),
            (32, 160, 4096),
            (65, 200, 896),
            (130, 72, 136),
            (1, 13, 7),
            (5, 9, 33),
            (17, 66, 250),
            (2, 5, 0),
        ];
        for &(m, n, k) in &shapes {
            let x = random(m * k, &mut rng);
            let w = random(n * k, &mut rng);
            let w16: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
            let cases = [
                ("f32", Weights::f32(n, k, &w), reference(&w, n, k, &x, m)),
                (
                    "bf16",
                    Weights::bf16(n, k, &w16),
                    reference(&round(&w), n, k, &round(&x), m),
                ),
            ];
            for kernel in kernels_here() {
                for (name, weights, want) in &cases {
                    let mut y = vec![f32::NAN; m * n];
                    weights.matmul_t_with(kernel, &x, m, &mut y);
                    // f32 accumulation of k products below 1 in magnitude.
                    let tol = 4e-6 * (k as f64).sqrt();
                    for (i, (&g, &e)) in y.iter().zip(want).enumerate() {
                        assert!(
                            (g as f64 - e).abs() <= tol * (1.0 + e.abs()),
                            "{name} {kernel:?} {m}x{n}x{k}: element {i}: {g} vs {e}"
                        );
                    }
                }
            }
        }
    }

    /// A token's output does not depend on the batch around it, bit for bit.
    #[test]
    fn each_rows_result_is_bit_identical_alone_and_in_any_batch() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let (n, k) = (136, 200);
        let w16: Vec<bf16> = random(n * k, &mut rng)
            .into_iter()
            .map(bf16::from_f32)
            .collect();
        for weights in [
            Weights::f32(n, k, &random(n * k, &mut rng)),
            Weights::bf16(n, k, &w16),
        ] {
            let x = random(150 * k, &mut rng);
            for kernel in kernels_here() {
                let mut all = vec![0f32; 150 * n];
                weights.matmul_t_with(kernel, &x, 150, &mut all);
                for (start, m) in [(0, 1), (7, 1), (3, 5), (60, 9), (149, 1)] {
                    let mut y = vec![0f32; m * n];
                    weights.matmul_t_with(kernel, &x[start * k..(start + m) * k], m, &mut y);
                    assert!(
                        y.iter()
                            .zip(&all[start * n..(start + m) * n])
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{kernel:?}: rows {start}..{} differ alone vs in the batch of 150",
                        start + m
                    );
                }
            }
        }
    }
}
