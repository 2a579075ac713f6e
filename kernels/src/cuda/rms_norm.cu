// RMSNorm over rows: out = x * rsqrt(mean(x^2) + eps) * w, with w = weight or 1 + weight (Gemma).
//
// x, out: [rows, hidden]; weight: [hidden]. Grid: one block per row.
// The sum of squares, the scale and the weight multiply are all f32; the result is rounded to
// bf16 once.

extern "C" __global__ void rms_norm_bf16(
    bf16* __restrict__ out,
    const bf16* __restrict__ x,
    const bf16* __restrict__ weight,
    int hidden,
    float eps,
    int weight_one_plus) {
    pdl_begin();
    const long long row = (long long)blockIdx.x * hidden;
    float sum_sq = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        const float v = bf16_to_f32(x[row + i]);
        sum_sq += v * v;
    }
    const float inv_rms = rsqrtf(block_sum(sum_sq) / (float)hidden + eps);
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        float w = bf16_to_f32(weight[i]);
        if (weight_one_plus) {
            w += 1.0f;
        }
        out[row + i] = f32_to_bf16(bf16_to_f32(x[row + i]) * inv_rms * w);
    }
}

// The pre-norm residual step fused with the next norm:
//   residual = bf16(residual + x);  out = rms_norm(residual)  (the stored bf16 sum is normalised)
// out, residual, x: [rows, hidden]; weight: [hidden]. Grid: one block per row. out may alias x
// (each thread reads x[i] before writing out[i] of the same i); out must not alias residual.
extern "C" __global__ void fused_add_rms_norm_bf16(
    bf16* out,
    bf16* residual,
    const bf16* x,
    const bf16* __restrict__ weight,
    int hidden,
    float eps,
    int weight_one_plus) {
    pdl_begin();
    const long long row = (long long)blockIdx.x * hidden;
    float sum_sq = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        const bf16 r = f32_to_bf16(bf16_to_f32(residual[row + i]) + bf16_to_f32(x[row + i]));
        residual[row + i] = r;
        const float v = bf16_to_f32(r);
        sum_sq += v * v;
    }
    const float inv_rms = rsqrtf(block_sum(sum_sq) / (float)hidden + eps);
    // Same i -> thread mapping as the loop above: each thread rereads only what it wrote.
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        float w = bf16_to_f32(weight[i]);
        if (weight_one_plus) {
            w += 1.0f;
        }
        out[row + i] = f32_to_bf16(bf16_to_f32(residual[row + i]) * inv_rms * w);
    }
}
