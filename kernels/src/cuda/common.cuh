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

// ---- KV pool elements: bf16, or fp8 E4M3 (fp8.cuh, compiled in front of this file) ----
// The attention and cache kernels are templates over the pool's element; these overloads are
// all that differs.

__device__ __forceinline__ float kv_to_f32(bf16 x) {
    return bf16_to_f32(x);
}

__device__ __forceinline__ float kv_to_f32(fp8_e4m3 x) {
    return fp8_e4m3_to_f32(x);
}

// A bf16 value as the pool holds it: an fp8 pool rounds it (to nearest even, saturated).
__device__ __forceinline__ void kv_store(bf16* dst, bf16 x) {
    *dst = x;
}

__device__ __forceinline__ void kv_store(fp8_e4m3* dst, bf16 x) {
    *dst = f32_to_fp8_e4m3(bf16_to_f32(x));
}

// Eight bf16 values packed in a 16-byte word as f32. Element 0 sits in the lowest bits
// (little-endian).
__device__ __forceinline__ void bf16x8_to_f32(const uint4 packed, float* out) {
    const unsigned int words[4] = {packed.x, packed.y, packed.z, packed.w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
        out[2 * w] = __uint_as_float(words[w] << 16);
        out[2 * w + 1] = __uint_as_float(words[w] & 0xffff0000u);
    }
}

// Eight consecutive elements as f32: one 16-byte load of bf16, one 8-byte load of fp8 (`p`
// aligned to it). Element 0 sits in the lowest bits (little-endian).
__device__ __forceinline__ void kv_load8(const bf16* p, float* out) {
    bf16x8_to_f32(*reinterpret_cast<const uint4*>(p), out);
}

__device__ __forceinline__ void kv_load8(const fp8_e4m3* p, float* out) {
    const uint2 packed = *reinterpret_cast<const uint2*>(p);
    const unsigned int words[2] = {packed.x, packed.y};
#pragma unroll
    for (int w = 0; w < 2; ++w) {
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            out[4 * w + b] = fp8_e4m3_to_f32((fp8_e4m3)((words[w] >> (8 * b)) & 0xffu));
        }
    }
}

// Eight consecutive elements as the bf16 bits a 16-byte bf16 load gives (exact for fp8, whose
// values have at most 4 significant bits): the tensor-core prefill's shared tiles are bf16.
__device__ __forceinline__ uint4 kv_load8_bf16(const bf16* p) {
    return *reinterpret_cast<const uint4*>(p);
}

__device__ __forceinline__ uint4 kv_load8_bf16(const fp8_e4m3* p) {
    float f[8];
    kv_load8(p, f);
    unsigned int words[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
        words[w] =
            (__float_as_uint(f[2 * w]) >> 16) | (__float_as_uint(f[2 * w + 1]) & 0xffff0000u);
    }
    return make_uint4(words[0], words[1], words[2], words[3]);
}

// Programmatic dependent launch (sm_90+). A kernel launched with it may be scheduled before
// the kernel ahead of it in the stream has finished; it first waits for that kernel to
// complete with its memory visible (griddepcontrol.wait), then lets the kernel after it be
// scheduled in turn (griddepcontrol.launch_dependents: that one waits the same way, so nothing
// is read early). Every entry point begins with it; launched without the attribute, or
// compiled for an older architecture, it does nothing. What it buys: the next kernel's launch
// and block scheduling overlap this one's tail instead of following it, the gap between the
// ~150 small kernels of a decode step.
__device__ __forceinline__ void pdl_begin() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
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
// `src` into `dst` (the same head in place, or another; bf16, or a KV pool's element), by the
// angle whose cosine and sine are c and s, rounded to bf16 first. rope.cu and kv_cache.cu's
// fused kernel both rotate through it: the same bits.
template <typename T>
__device__ __forceinline__ void rotate_pair(const bf16* src, T* dst, int j, int half, float c,
                                            float s) {
    const float x1 = bf16_to_f32(src[j]);
    const float x2 = bf16_to_f32(src[j + half]);
    kv_store(dst + j, f32_to_bf16(x1 * c - x2 * s));
    kv_store(dst + j + half, f32_to_bf16(x2 * c + x1 * s));
}
