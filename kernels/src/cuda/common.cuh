// Prelude compiled in front of every kernel source (see sources.rs). NVRTC is given no include
// path, so nothing here includes a header: bf16 is handled as raw bits.

// bf16 storage type: the upper 16 bits of an f32. All arithmetic is done in f32.
typedef unsigned short bf16;

__device__ __forceinline__ float bf16_to_f32(bf16 x) {
    return __uint_as_float(((unsigned int)x) << 16);
}

// Round to nearest, ties to even; NaN stays NaN. Must match crate::bf16::from_f32.
__device__ __forceinline__ bf16 f32_to_bf16(float x) {
    unsigned int bits = __float_as_uint(x);
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
        return (bf16)((bits >> 16) | 0x0040u);
    }
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (bf16)(bits >> 16);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, offset);
    }
    return v;
}

__device__ __forceinline__ float warp_reduce_max(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    }
    return v;
}

// Sum over the whole block; every thread gets the result. blockDim.x must be a multiple of 32.
// Call at most once per kernel (it reuses one shared buffer without a trailing barrier).
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float partial[32];
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    v = warp_sum(v);
    if (lane == 0) {
        partial[warp] = v;
    }
    __syncthreads();
    const int num_warps = blockDim.x / 32;
    v = lane < num_warps ? partial[lane] : 0.0f;
    return warp_sum(v);
}

__device__ __forceinline__ float neg_infinity() {
    return __uint_as_float(0xff800000u);
}

// NeoX rotary embedding of one (x1, x2) pair of a head — dimension j with j + half — from
// `src` into `dst` (the same head in place, or another), by the angle whose cosine and sine
// are c and s. rope.cu and kv_cache.cu's fused kernel both rotate through it: the same bits.
__device__ __forceinline__ void rotate_pair(const bf16* src, bf16* dst, int j, int half, float c,
                                            float s) {
    const float x1 = bf16_to_f32(src[j]);
    const float x2 = bf16_to_f32(src[j + half]);
    dst[j] = f32_to_bf16(x1 * c - x2 * s);
    dst[j + half] = f32_to_bf16(x2 * c + x1 * s);
}
