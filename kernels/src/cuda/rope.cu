// Rotary embedding, NeoX style: dimension j pairs with j + head_dim/2. Applied in place to the
// query and key of each token in one launch.
//
// q: [num_tokens, num_heads, head_dim]; k: [num_tokens, num_kv_heads, head_dim]
// positions: [num_tokens]; cos_table, sin_table: [max_positions, head_dim/2], f32 (precomputed on
// the host so model-specific frequency scaling never reaches the kernel).
// A position outside [0, max_positions) (bad device data) leaves that token's q and k unchanged
// instead of reading past the tables.
// Grid: one block per token; each thread owns whole (x1, x2) pairs, so updating in place is safe.

extern "C" __global__ void rope_neox_bf16(
    bf16* __restrict__ q,
    bf16* __restrict__ k,
    const int* __restrict__ positions,
    const float* __restrict__ cos_table,
    const float* __restrict__ sin_table,
    int num_heads,
    int num_kv_heads,
    int head_dim,
    int max_positions) {
    pdl_begin();
    const int token = blockIdx.x;
    const int half = head_dim / 2;
    const int position = positions[token];
    if (position < 0 || position >= max_positions) {
        return;
    }
    const long long angles = (long long)position * half;
    const int q_pairs = num_heads * half;
    const int all_pairs = (num_heads + num_kv_heads) * half;
    for (int p = threadIdx.x; p < all_pairs; p += blockDim.x) {
        bf16* head;
        int j;
        if (p < q_pairs) {
            head = q + ((long long)token * num_heads + p / half) * head_dim;
            j = p % half;
        } else {
            const int kp = p - q_pairs;
            head = k + ((long long)token * num_kv_heads + kp / half) * head_dim;
            j = kp % half;
        }
        rotate_pair(head, head, j, half, cos_table[angles + j], sin_table[angles + j]);
    }
}
