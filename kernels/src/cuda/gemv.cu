// Skinny GEMMs for small decode batches: out[m, n] = x[m, k] @ w[n, k]^T, bf16 in and out, f32
// accumulation, for m = 1..GEMV_MAX_ROWS (a template over m; one entry point per row count).
//
// A decode step's GEMMs read each weight once and little else, so the weight's bytes over a
// read-only kernel's bandwidth is their floor; at a few rows cuBLAS's kernels need not reach
// it (kernel_bench's gemm_fraction_of_read_only). Here `k_split` warps of a block share C
// output columns (GEMV_COLUMNS_<m>, from the host), each warp a strided share of the k
// dimension: its lanes stream those columns' weight rows in 16-byte words, four words per
// lane in flight before any is used (read streaming, evict-first), and read the same words of
// every x row (the same for every warp: L1/L2 hits). Each x word serves C weight words: at 8
// rows one weight word alone would need 8 x words from L1, more than L1 delivers per byte of
// HBM, so wider batches take more columns per warp; `k_split` (from the host) gives a narrow
// matrix enough warps to keep the memory busy. Each warp reduces its sums by shuffles (lane
// c * m + r keeps column c's row r), the warps of a column group add theirs through shared
// memory, and the first writes. The launcher checks k % 8 == 0 and 16-byte aligned w and x.
// Grid: ceil(n / (C * GEMV_WARPS / k_split)) blocks of GEMV_WARPS warps; k_split divides
// GEMV_WARPS.

// acc[c][r] += w[c] · word i of x's row r (eight products each), x rows `words` words apart.
template <int M, int C>
__device__ __forceinline__ void gemv_word(float (&acc)[C][M], const uint4 (&w)[C],
                                          const uint4* __restrict__ x, int words, int i) {
    float wf[C][8];
#pragma unroll
    for (int c = 0; c < C; ++c) {
        bf16x8_to_f32(w[c], wf[c]);
    }
#pragma unroll
    for (int r = 0; r < M; ++r) {
        float xf[8];
        // Cached in L1 (each word serves every column of the warp), but not a read-only
        // (non-coherent) load: x is the output of the kernel before, which may still be
        // running until griddepcontrol.wait, and a load the compiler deems invariant may
        // be moved above that wait.
        bf16x8_to_f32(__ldca(x + (long long)r * words + i), xf);
#pragma unroll
        for (int c = 0; c < C; ++c) {
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                acc[c][r] = fmaf(wf[c][e], xf[e], acc[c][r]);
            }
        }
    }
}

template <int M, int C>
__device__ __forceinline__ void gemv_rows(bf16* __restrict__ out, const bf16* __restrict__ w,
                                          const bf16* __restrict__ x, int n, int k,
                                          int k_split) {
    static_assert(C * M <= 32, "a lane per (column, row) sum");
    // Weight words per lane per column in flight: four in all.
    constexpr int U = C >= 4 ? 1 : 4 / C;
    __shared__ float partial[GEMV_WARPS][32];
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int part = warp % k_split;
    const int col0 = (blockIdx.x * (GEMV_WARPS / k_split) + warp / k_split) * C;
    const int words = k / 8;
    // Columns past n (the last group's) read column n - 1's row again and write nothing; no
    // warp returns early, as all of them meet at the barrier below.
    const uint4* w_rows[C];
#pragma unroll
    for (int c = 0; c < C; ++c) {
        w_rows[c] = reinterpret_cast<const uint4*>(w) + (long long)min(col0 + c, n - 1) * words;
    }
    const uint4* __restrict__ x_words = reinterpret_cast<const uint4*>(x);
    float acc[C][M];
#pragma unroll
    for (int c = 0; c < C; ++c) {
#pragma unroll
        for (int r = 0; r < M; ++r) {
            acc[c][r] = 0.0f;
        }
    }
    const int stride = 32 * k_split;
    int i = lane + 32 * part;
    for (; i + stride * (U - 1) < words; i += stride * U) {
        uint4 w_words[U][C];
#pragma unroll
        for (int u = 0; u < U; ++u) {
#pragma unroll
            for (int c = 0; c < C; ++c) {
                w_words[u][c] = __ldcs(w_rows[c] + i + stride * u);
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            gemv_word<M, C>(acc, w_words[u], x_words, words, i + stride * u);
        }
    }
    for (; i < words; i += stride) {
        uint4 w_words[C];
#pragma unroll
        for (int c = 0; c < C; ++c) {
            w_words[c] = __ldcs(w_rows[c] + i);
        }
        gemv_word<M, C>(acc, w_words, x_words, words, i);
    }
    // Every lane ends with every sum of its warp's share; lane c * M + r keeps column c's
    // row r (the register arrays are indexed by constants of the unrolled loops, not by the
    // lane, so they stay in registers).
    float mine = 0.0f;
#pragma unroll
    for (int c = 0; c < C; ++c) {
#pragma unroll
        for (int r = 0; r < M; ++r) {
            const float sum = warp_sum(acc[c][r]);
            if (lane == c * M + r) {
                mine = sum;
            }
        }
    }
    if (k_split > 1) {
        partial[warp][lane] = mine;
        __syncthreads();
        if (part == 0) {
            for (int p = 1; p < k_split; ++p) {
                mine += partial[warp + p][lane];
            }
        }
    }
    const int c = lane / M;
    const int r = lane % M;
    if (part == 0 && c < C && col0 + c < n) {
        out[(long long)r * n + col0 + c] = f32_to_bf16(mine);
    }
}

#define GEMV_ARGS                                                                              \
    bf16 *__restrict__ out, const bf16 *__restrict__ w, const bf16 *__restrict__ x, int n,      \
        int k, int k_split
#define GEMV_CALL(M) gemv_rows<M, GEMV_COLUMNS_##M>(out, w, x, n, k, k_split)

extern "C" __global__ void gemv_bf16_m1(GEMV_ARGS) { pdl_begin(); GEMV_CALL(1); }
extern "C" __global__ void gemv_bf16_m2(GEMV_ARGS) { pdl_begin(); GEMV_CALL(2); }
extern "C" __global__ void gemv_bf16_m3(GEMV_ARGS) { pdl_begin(); GEMV_CALL(3); }
extern "C" __global__ void gemv_bf16_m4(GEMV_ARGS) { pdl_begin(); GEMV_CALL(4); }
extern "C" __global__ void gemv_bf16_m5(GEMV_ARGS) { pdl_begin(); GEMV_CALL(5); }
extern "C" __global__ void gemv_bf16_m6(GEMV_ARGS) { pdl_begin(); GEMV_CALL(6); }
extern "C" __global__ void gemv_bf16_m7(GEMV_ARGS) { pdl_begin(); GEMV_CALL(7); }
extern "C" __global__ void gemv_bf16_m8(GEMV_ARGS) { pdl_begin(); GEMV_CALL(8); }
