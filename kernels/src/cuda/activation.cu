// Gated MLP activations: out = act(gate) * up.
//
// gate_up: [rows, 2 * inter], each row is gate (inter) then up (inter), the layout of a merged
// gate/up projection; out: [rows, inter]. Grid: one block per row. f32 math, one bf16 rounding.

__device__ __forceinline__ float silu(float x) {
    return x / (1.0f + expf(-x));
}

// tanh approximation of GELU (Gemma's gelu_pytorch_tanh).
__device__ __forceinline__ float gelu_tanh(float x) {
    const float sqrt_2_over_pi = 0.7978845608f;
    return 0.5f * x * (1.0f + tanhf(sqrt_2_over_pi * (x + 0.044715f * x * x * x)));
}

// Exact GELU, 0.5 x (1 + erf(x / sqrt 2)) (PyTorch's default gelu).
__device__ __forceinline__ float gelu_erf(float x) {
    return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
}

extern "C" __global__ void silu_and_mul_bf16(
    bf16* __restrict__ out, const bf16* __restrict__ gate_up, int inter) {
    pdl_begin();
    const long long in_row = (long long)blockIdx.x * 2 * inter;
    const long long out_row = (long long)blockIdx.x * inter;
    for (int i = threadIdx.x; i < inter; i += blockDim.x) {
        const float gate = bf16_to_f32(gate_up[in_row + i]);
        const float up = bf16_to_f32(gate_up[in_row + inter + i]);
        out[out_row + i] = f32_to_bf16(silu(gate) * up);
    }
}

extern "C" __global__ void gelu_tanh_and_mul_bf16(
    bf16* __restrict__ out, const bf16* __restrict__ gate_up, int inter) {
    pdl_begin();
    const long long in_row = (long long)blockIdx.x * 2 * inter;
    const long long out_row = (long long)blockIdx.x * inter;
    for (int i = threadIdx.x; i < inter; i += blockDim.x) {
        const float gate = bf16_to_f32(gate_up[in_row + i]);
        const float up = bf16_to_f32(gate_up[in_row + inter + i]);
        out[out_row + i] = f32_to_bf16(gelu_tanh(gate) * up);
    }
}

extern "C" __global__ void gelu_erf_and_mul_bf16(
    bf16* __restrict__ out, const bf16* __restrict__ gate_up, int inter) {
    pdl_begin();
    const long long in_row = (long long)blockIdx.x * 2 * inter;
    const long long out_row = (long long)blockIdx.x * inter;
    for (int i = threadIdx.x; i < inter; i += blockDim.x) {
        const float gate = bf16_to_f32(gate_up[in_row + i]);
        const float up = bf16_to_f32(gate_up[in_row + inter + i]);
        out[out_row + i] = f32_to_bf16(gelu_erf(gate) * up);
    }
}
