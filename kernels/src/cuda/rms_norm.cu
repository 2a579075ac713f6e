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
