// Flat element-wise kernels. Grid: a shape-only number of blocks striding over the elements
// (see grid::flat), 64-bit indices. f32 math, one bf16 rounding per stored value.

// Residual add in place: x[i] = bf16(x[i] + y[i]), x and y: [n].
extern "C" __global__ void add_bf16(bf16* x, const bf16* y, int n) {
    pdl_begin();
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        x[i] = f32_to_bf16(bf16_to_f32(x[i]) + bf16_to_f32(y[i]));
    }
}

// The sampler's input: out[i] = x[i] as f32, soft-capped when softcap > 0:
// softcap * tanh(x / softcap) (Gemma 2's final_logit_softcapping). out: f32 [n]; x: bf16 [n].
extern "C" __global__ void logits_f32(
    float* __restrict__ out, const bf16* __restrict__ x, int n, float softcap) {
    pdl_begin();
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float v = bf16_to_f32(x[i]);
        out[i] = softcap > 0.0f ? softcap * tanhf(v / softcap) : v;
    }
}

// Bias add in place: x[r, c] = bf16(x[r, c] + bias[c]); x: [rows, cols], bias: [cols].
// Grid: one block per row.
extern "C" __global__ void bias_add_bf16(
    bf16* __restrict__ x, const bf16* __restrict__ bias, int rows, int cols) {
    pdl_begin();
    const int row = blockIdx.x;
    if (row >= rows) {
        return;
    }
    const long long base = (long long)row * cols;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        x[base + i] = f32_to_bf16(bf16_to_f32(x[base + i]) + bf16_to_f32(bias[i]));
    }
}

// Reads src ([n] 16-byte words) once and writes one word per warp to out
// ([gridDim.x * blockDim.x / 32]): a read-only kernel, whose bandwidth is the ceiling of a
// decode step (which only reads), unlike a copy's. The XOR keeps the reads from being
// optimised away.
extern "C" __global__ void read_only_u128(const uint4* __restrict__ src, long long n,
                                          unsigned int* __restrict__ out) {
    pdl_begin();
    const long long stride = (long long)gridDim.x * blockDim.x;
    unsigned int acc = 0;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const uint4 v = src[i];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
        acc ^= __shfl_xor_sync(0xffffffffu, acc, offset);
    }
    if (threadIdx.x % 32 == 0) {
        out[((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32] = acc;
    }
}
