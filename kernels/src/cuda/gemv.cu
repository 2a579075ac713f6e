// Skinny GEMMs for small decode batches: out[m, n] = x[m, k] @ w[n, k]^T, bf16 in and out, f32
// accumulation, for m = 1..GEMV_MAX_ROWS (a template over m; one entry point per row count).
//
// A decode step's GEMMs read each weight once and little else, so the weight's bytes over a
// read-only kernel's bandwidth is their floor; at a few rows cuBLAS's kernels need not reach
// it (kernel_bench's gemm_fraction_of_read_only). Here one warp computes one output column:
// its lanes stream the column's weight row in 16-byte words, GEMV_UNROLL words per lane in
// flight before any is used, and read the same words of every x row (the same for every warp,
// so they stay in L1/L2; the weight is read streaming, evict-first, not to displace them).
// The lanes' partial sums are reduced by shuffles and lane r writes row r. The launcher
// checks k % 8 == 0 and 16-byte aligned w and x.
// Grid: ceil(n / GEMV_WARPS) blocks of GEMV_WARPS warps.

#define GEMV_UNROLL 4

// acc[r] += w_word · x[r]'s word `i` (eight products each), x rows `words` words apart.
template <int M>
__device__ __forceinline__ void gemv_word(float* acc, const uint4 w_word,
                                          const uint4* __restrict__ x, int words, int i) {
    float wf[8];
    bf16x8_to_f32(w_word, wf);
#pragma unroll
    for (int r = 0; r < M; ++r) {
        float xf[8];
        bf16x8_to_f32(__ldg(x + (long long)r * words + i), xf);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            acc[r] = fmaf(wf[e], xf[e], acc[r]);
        }
    }
}

template <int M>
__device__ __forceinline__ void gemv_rows(bf16* __restrict__ out, const bf16* __restrict__ w,
                                          const bf16* __restrict__ x, int n, int k) {
    const int lane = threadIdx.x % 32;
    const int col = blockIdx.x * GEMV_WARPS + threadIdx.x / 32;
    if (col >= n) {
        return;
    }
    const int words = k / 8;
    const uint4* __restrict__ w_row = reinterpret_cast<const uint4*>(w) + (long long)col * words;
    const uint4* __restrict__ x_words = reinterpret_cast<const uint4*>(x);
    float acc[M];
#pragma unroll
    for (int r = 0; r < M; ++r) {
        acc[r] = 0.0f;
    }
    int i = lane;
    for (; i + 32 * (GEMV_UNROLL - 1) < words; i += 32 * GEMV_UNROLL) {
        uint4 w_words[GEMV_UNROLL];
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u) {
            w_words[u] = __ldcs(w_row + i + 32 * u);
        }
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u) {
            gemv_word<M>(acc, w_words[u], x_words, words, i + 32 * u);
        }
    }
    for (; i < words; i += 32) {
        gemv_word<M>(acc, __ldcs(w_row + i), x_words, words, i);
    }
    // Every lane ends with every row's sum; lane r keeps row r's (a register array indexed
    // by a constant in the unrolled loop, not by the lane, so it stays in registers).
    float mine = 0.0f;
#pragma unroll
    for (int r = 0; r < M; ++r) {
        const float sum = warp_sum(acc[r]);
        if (lane == r) {
            mine = sum;
        }
    }
    if (lane < M) {
        out[(long long)lane * n + col] = f32_to_bf16(mine);
    }
}

#define GEMV_ARGS \
    bf16 *__restrict__ out, const bf16 *__restrict__ w, const bf16 *__restrict__ x, int n, int k

extern "C" __global__ void gemv_bf16_m1(GEMV_ARGS) { pdl_begin(); gemv_rows<1>(out, w, x, n, k); }
extern "C" __global__ void gemv_bf16_m2(GEMV_ARGS) { pdl_begin(); gemv_rows<2>(out, w, x, n, k); }
extern "C" __global__ void gemv_bf16_m3(GEMV_ARGS) { pdl_begin(); gemv_rows<3>(out, w, x, n, k); }
extern "C" __global__ void gemv_bf16_m4(GEMV_ARGS) { pdl_begin(); gemv_rows<4>(out, w, x, n, k); }
extern "C" __global__ void gemv_bf16_m5(GEMV_ARGS) { pdl_begin(); gemv_rows<5>(out, w, x, n, k); }
extern "C" __global__ void gemv_bf16_m6(GEMV_ARGS) { pdl_begin(); gemv_rows<6>(out, w, x, n, k); }
extern "C" __global__ void gemv_bf16_m7(GEMV_ARGS) { pdl_begin(); gemv_rows<7>(out, w, x, n, k); }
extern "C" __global__ void gemv_bf16_m8(GEMV_ARGS) { pdl_begin(); gemv_rows<8>(out, w, x, n, k); }
