// reshape_and_cache: write this step's K/V tokens into the paged pool.
//
// key, value:       [num_tokens, num_kv_heads, head_dim]   (token_len = num_kv_heads * head_dim)
// k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
// slot_mapping:     [num_tokens], slot = block * block_size + offset, < 0 for padding tokens
// num_slots:        num_blocks * block_size; a slot outside [0, num_slots) is skipped (nothing
//                   written), so bad device data can never write outside the pool.
//
// In this pool layout a token's heads are contiguous, so a token is one contiguous copy.
// Grid: one block per token.

extern "C" __global__ void reshape_and_cache_bf16(
    const bf16* __restrict__ key,
    const bf16* __restrict__ value,
    bf16* __restrict__ k_cache,
    bf16* __restrict__ v_cache,
    const int* __restrict__ slot_mapping,
    int token_len,
    int num_slots) {
    const int slot = slot_mapping[blockIdx.x];
    if (slot < 0 || slot >= num_slots) {
        return;
    }
    const long long src = (long long)blockIdx.x * token_len;
    const long long dst = (long long)slot * token_len;
    for (int i = threadIdx.x; i < token_len; i += blockDim.x) {
        k_cache[dst + i] = key[src + i];
        v_cache[dst + i] = value[src + i];
    }
}
