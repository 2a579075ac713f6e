// reshape_and_cache: write this step's K/V tokens into the paged pool.
//
// key, value:       [num_tokens, num_kv_heads, head_dim]   (token_len = num_kv_heads * head_dim)
// k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], of bf16 or of fp8 E4M3
//                   (`_kvfp8` entry points: each bf16 rounded to it, kv_store)
// slot_mapping:     [num_tokens], slot = block * block_size + offset, < 0 for padding tokens
// num_slots:        num_blocks * block_size; a slot outside [0, num_slots) is skipped (nothing
//                   written), so bad device data can never write outside the pool.
//
// In this pool layout a token's heads are contiguous, so a token is one contiguous copy.
// Grid: one block per token.

template <typename KV>
__device__ void reshape_and_cache(
    const bf16* __restrict__ key,
    const bf16* __restrict__ value,
    KV* __restrict__ k_cache,
    KV* __restrict__ v_cache,
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
        kv_store(k_cache + dst + i, key[src + i]);
        kv_store(v_cache + dst + i, value[src + i]);
    }
}

// Dimensions j and j + half of a head from `src` into `dst` (bf16, or a pool's element):
// rotated at `angles` where `rotate`, else copied.
template <typename T>
__device__ __forceinline__ void rope_or_copy_pair(const bf16* src, T* dst, int j, int half,
                                                  bool rotate, const float* cos_table,
                                                  const float* sin_table, long long angles) {
    if (rotate) {
        rotate_pair(src, dst, j, half, cos_table[angles + j], sin_table[angles + j]);
    } else {
        kv_store(dst + j, src[j]);
        kv_store(dst + j + half, src[j + half]);
    }
}

// qkv_rope_cache: a fused QKV product's three parts as attention takes them, in one launch —
// the column split, rope.cu's NeoX rotation of Q and K (the same rotate_pair) and
// reshape_and_cache's write of K and V into the pool.
//
// qkv:       [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]  (Q | K | V per token)
// q_out:     [num_tokens, num_heads * head_dim], written: Q rotated
// positions: [num_tokens]; a position outside [0, max_positions) leaves Q and K unrotated, as
//            rope_neox_bf16 does; cos_table, sin_table: [max_positions, head_dim / 2], f32
// slot_mapping: [num_tokens]; a slot outside [0, num_slots) writes nothing to the pool (Q is
//            still written), as reshape_and_cache_bf16 does
// Grid: one block per token; each thread owns whole (x1, x2) pairs, then V's elements.
template <typename KV>
__device__ void qkv_rope_cache(
    const bf16* __restrict__ qkv,
    bf16* __restrict__ q_out,
    KV* __restrict__ k_cache,
    KV* __restrict__ v_cache,
    const int* __restrict__ positions,
    const int* __restrict__ slot_mapping,
    const float* __restrict__ cos_table,
    const float* __restrict__ sin_table,
    int num_heads,
    int num_kv_heads,
    int head_dim,
    int max_positions,
    int num_slots) {
    const int token = blockIdx.x;
    const int half = head_dim / 2;
    const long long kv_len = (long long)num_kv_heads * head_dim;
    const bf16* row = qkv + (long long)token * (num_heads * head_dim + 2 * kv_len);
    const int position = positions[token];
    const bool rotate = position >= 0 && position < max_positions;
    const int slot = slot_mapping[token];
    const bool write = slot >= 0 && slot < num_slots;
    const long long angles = (long long)(rotate ? position : 0) * half;
    const int q_pairs = num_heads * half;
    const int all_pairs = (num_heads + num_kv_heads) * half;
    for (int p = threadIdx.x; p < all_pairs; p += blockDim.x) {
        if (p < q_pairs) {
            const bf16* src = row + (long long)(p / half) * head_dim;
            bf16* dst = q_out + ((long long)token * num_heads + p / half) * head_dim;
            rope_or_copy_pair(src, dst, p % half, half, rotate, cos_table, sin_table, angles);
        } else {
            if (!write) {
                break;  // the K pairs come last: nothing more to write
            }
            const int kp = p - q_pairs;
            const bf16* src =
                row + (long long)num_heads * head_dim + (long long)(kp / half) * head_dim;
            KV* dst = k_cache + (long long)slot * kv_len + (long long)(kp / half) * head_dim;
            rope_or_copy_pair(src, dst, kp % half, half, rotate, cos_table, sin_table, angles);
        }
    }
    if (write) {
        const bf16* v = row + (long long)num_heads * head_dim + kv_len;
        for (long long i = threadIdx.x; i < kv_len; i += blockDim.x) {
            kv_store(v_cache + (long long)slot * kv_len + i, v[i]);
        }
    }
}

// One entry point per pool element: bf16, and fp8 E4M3 (`_kvfp8`).
#define DEFINE_KV_CACHE(KV, SUFFIX)                                                             \
    extern "C" __global__ void reshape_and_cache_bf16##SUFFIX(                                  \
        const bf16* key, const bf16* value, KV* k_cache, KV* v_cache, const int* slot_mapping,  \
        int token_len, int num_slots) {                                                         \
        pdl_begin();                                                                            \
        reshape_and_cache<KV>(key, value, k_cache, v_cache, slot_mapping, token_len, num_slots); \
    }                                                                                           \
    extern "C" __global__ void qkv_rope_cache_bf16##SUFFIX(                                     \
        const bf16* qkv, bf16* q_out, KV* k_cache, KV* v_cache, const int* positions,           \
        const int* slot_mapping, const float* cos_table, const float* sin_table, int num_heads, \
        int num_kv_heads, int head_dim, int max_positions, int num_slots) {                     \
        pdl_begin();                                                                            \
        qkv_rope_cache<KV>(qkv, q_out, k_cache, v_cache, positions, slot_mapping, cos_table,    \
                           sin_table, num_heads, num_kv_heads, head_dim, max_positions,         \
                           num_slots);                                                          \
    }

DEFINE_KV_CACHE(bf16, )
DEFINE_KV_CACHE(fp8_e4m3, _kvfp8)
