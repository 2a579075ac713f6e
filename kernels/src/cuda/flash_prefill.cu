// Prefill attention, FlashAttention-2 style: the same contract as paged_attention_prefill
// (paged_attention.cu: paged K/V through the block table, causal from each sequence's
// start position, GQA, sliding window, soft-cap, padding tokens written as zeros, bad block ids
// skipped), computed a tile of queries at a time on the tensor cores.
//
// Work split: one thread block of FLASH_WARPS warps per (tile of BLOCK_M = 16 * FLASH_WARPS
// query tokens of one sequence, query head); warp w owns the tile's rows 16w .. 16w + 15. The
// block walks the keys its queries see in tiles of BLOCK_N: all threads copy the tile's K and
// V rows (gathered through the block table, 16-byte loads; 8-byte from an fp8 pool, widened to
// bf16) into shared memory, then each warp
// computes its 16 x BLOCK_N scores with mma.sync m16n8k16 (bf16 in, f32 accumulate), applies
// the scale, soft-cap and mask, updates its rows' online softmax (running max and sum in f32),
// rounds the probabilities to bf16 and accumulates P V with mma.sync, V's fragments read with
// ldmatrix.trans. Q's fragments stay in registers for the whole walk; each K/V byte is read once
// per (query tile, head). A warp skips the key tiles its rows cannot see (causal, window), and
// tiles wholly inside every row's visible range skip the mask.
//
// Fragment layouts (PTX ISA, mma.m16n8k16, .bf16): lane = 4 * g + t. A (16 x 16, row): a0 =
// (row g, cols 2t, 2t+1), a1 = (row g+8, same cols), a2 = (row g, cols 2t+8, 2t+9), a3 = (row
// g+8, cols 2t+8, 2t+9). B (16 x 8, col): b0 = (rows 2t, 2t+1, col g), b1 = (rows 2t+8, 2t+9,
// col g). C (16 x 8, f32): c0, c1 = (row g, cols 2t, 2t+1), c2, c3 = (row g+8, same cols). So
// the scores of key columns 16k .. 16k+15 (two C tiles) are, packed to bf16 pairs, the A
// fragment of P for the k-th 16-key step: no shuffle between the two products.
//
// Shared rows are padded by 8 bf16 (16 bytes): the 8 rows a fragment load or an ldmatrix phase
// touches then start in distinct banks for every head_dim here (64, 96, 128, 256).
//
// Needs sm_80 or newer (bf16 mma.sync, ldmatrix, cvt.bf16x2); the host launches it only there
// and keeps the row-per-block kernel elsewhere. FLASH_WARPS is defined by the host (sources.rs).

#define FLASH_BLOCK_M (FLASH_WARPS * 16)

// Keys per tile: two tiles (K and V) of padded rows stay under the 48 KiB of static shared
// memory at every head_dim (head_dim 128: 34 KiB; 256: 33 KiB).
template <int HEAD_DIM>
struct FlashTile {
    static constexpr int BLOCK_N = HEAD_DIM <= 128 ? 64 : 32;
    static constexpr int STRIDE = HEAD_DIM + 8;
};

#if __CUDA_ARCH__ >= 800

// Two f32 rounded to nearest-even bf16, `lo` in the low half (the lower column / row).
__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
    unsigned packed;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(hi), "f"(lo));
    return packed;
}

// c += a * b on the tensor cores, one 16 x 8 x 16 product per warp.
__device__ __forceinline__ void mma_16816(float c[4], const unsigned a[4], unsigned b0,
                                          unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8 x 8 bf16 matrices from shared memory, transposed: lane l gives the row address of
// matrix l / 8, row l % 8; register i receives matrix i's (rows 2t, 2t+1; column g).
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned r[4], const bf16* row) {
    const unsigned address = (unsigned)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address)
                 : "memory");
}

__device__ __forceinline__ unsigned load_pair(const bf16* p) {
    return *reinterpret_cast<const unsigned*>(p);
}

#endif

template <int HEAD_DIM, typename KV>
__device__ void flash_prefill(
    bf16* __restrict__ out, const bf16* __restrict__ q, const KV* __restrict__ k_cache,
    const KV* __restrict__ v_cache, const int* __restrict__ block_tables,
    const int* __restrict__ cu_seqlens_q, const int* __restrict__ start_pos, int num_seqs,
    int num_tokens, int max_blocks_per_seq, int num_blocks, int num_heads, int num_kv_heads,
    int block_size, float scale, int window, float softcap) {
#if __CUDA_ARCH__ >= 800
    static_assert(HEAD_DIM % 16 == 0 && (HEAD_DIM / 8) % 2 == 0, "head_dim: whole k-steps");
    constexpr int BLOCK_M = FLASH_BLOCK_M;
    constexpr int BLOCK_N = FlashTile<HEAD_DIM>::BLOCK_N;
    constexpr int STRIDE = FlashTile<HEAD_DIM>::STRIDE;
    constexpr int K_STEPS = HEAD_DIM / 16;  // k-steps of the score product
    constexpr int D_TILES = HEAD_DIM / 8;   // n-tiles of the output
    constexpr int N_TILES = BLOCK_N / 8;    // n-tiles of the scores
    constexpr int CHUNKS = HEAD_DIM / 8;    // 8-element pieces of a K/V row
    constexpr float LOG2E = 1.4426950408889634f;
    __shared__ __align__(16) bf16 k_tile[BLOCK_N * STRIDE];
    __shared__ __align__(16) bf16 v_tile[BLOCK_N * STRIDE];
    __shared__ int key_ok[BLOCK_N];
    __shared__ int tile_of_block[2];

    const int head = blockIdx.y;
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int g = lane / 4;
    const int t = lane % 4;

    // This block's tile: the sequences' tiles numbered in order, each sequence's last tile
    // (the most keys) first. A block past them all zeroes padding rows.
    if (threadIdx.x == 0) {
        int b = blockIdx.x;
        int seq = -1;
        int first_row = 0;
        for (int s = 0; s < num_seqs; ++s) {
            // Rows past num_tokens (bad device data) are never read or written.
            const int len = max(0, min(cu_seqlens_q[s + 1], num_tokens) - cu_seqlens_q[s]);
            const int tiles = (len + BLOCK_M - 1) / BLOCK_M;
            if (b < tiles) {
                seq = s;
                first_row = (tiles - 1 - b) * BLOCK_M;
                break;
            }
            b -= tiles;
        }
        tile_of_block[0] = seq;
        tile_of_block[1] = seq >= 0 ? first_row : b;
    }
    __syncthreads();
    const int seq = tile_of_block[0];
    if (seq < 0) {
        // Padding blocks (the host launches at least one): zero the rows past the last
        // sequence's tokens, this head's columns, striding over the padding blocks.
        const int pad_index = tile_of_block[1];
        const int pad_blocks = gridDim.x - (blockIdx.x - pad_index);
        for (int token = cu_seqlens_q[num_seqs] + pad_index; token < num_tokens;
             token += pad_blocks) {
            bf16* row = out + ((long long)token * num_heads + head) * HEAD_DIM;
            for (int d = threadIdx.x; d < HEAD_DIM; d += blockDim.x) {
                row[d] = 0;
            }
        }
        return;
    }

    const int seq_begin = cu_seqlens_q[seq];
    const int q_len = min(cu_seqlens_q[seq + 1], num_tokens) - seq_begin;
    const int first_row = tile_of_block[1];
    const int rows = min(BLOCK_M, q_len - first_row);
    const int pos0 = start_pos[seq] + first_row;  // position of the tile's row 0
    const int* table = block_tables + (long long)seq * max_blocks_per_seq;
    const int kv_head = head / (num_heads / num_kv_heads);
    // Keys any row of the tile sees, never past the table row.
    const long long key_limit = (long long)max_blocks_per_seq * block_size;
    const int kv_hi = (int)min((long long)pos0 + rows - 1, key_limit - 1);
    const int kv_lo = window > 0 ? max(0, pos0 + 1 - window) : 0;

    // This lane's two rows (g and g + 8 of the warp's 16) and the keys each sees: [first, pos].
    const int row_a = warp * 16 + g;
    const int row_b = row_a + 8;
    const bool live_a = row_a < rows;
    const bool live_b = row_b < rows;
    const int pos_a = pos0 + row_a;
    const int pos_b = pos0 + row_b;
    const int first_a = window > 0 ? max(0, pos_a + 1 - window) : 0;
    const int first_b = window > 0 ? max(0, pos_b + 1 - window) : 0;
    // The warp's rows (warp-uniform): keys its first live row sees first, its last sees last.
    const int warp_rows = min(16, rows - warp * 16);  // <= 0: the warp has no row
    const int warp_pos_lo = pos0 + warp * 16;
    const int warp_pos_hi = warp_pos_lo + warp_rows - 1;
    const int warp_first_lo = window > 0 ? max(0, warp_pos_lo + 1 - window) : 0;
    const int warp_first_hi = window > 0 ? max(0, warp_pos_hi + 1 - window) : 0;

    // Q's A fragments, read once from global memory (rows past the tile: zeros).
    unsigned qf[K_STEPS][4];
    {
        const bf16* q_a = q + ((long long)(seq_begin + first_row + row_a) * num_heads + head) * HEAD_DIM;
        const bf16* q_b = q_a + (long long)8 * num_heads * HEAD_DIM;
#pragma unroll
        for (int ks = 0; ks < K_STEPS; ++ks) {
            const int c = ks * 16 + 2 * t;
            qf[ks][0] = live_a ? load_pair(q_a + c) : 0u;
            qf[ks][1] = live_b ? load_pair(q_b + c) : 0u;
            qf[ks][2] = live_a ? load_pair(q_a + c + 8) : 0u;
            qf[ks][3] = live_b ? load_pair(q_b + c + 8) : 0u;
        }
    }

    float o[D_TILES][4];
#pragma unroll
    for (int d = 0; d < D_TILES; ++d) {
        o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.0f;
    }
    // Running max (log2 units) and this lane's share of the running sum, per row.
    float max_a = neg_infinity();
    float max_b = neg_infinity();
    float sum_a = 0.0f;
    float sum_b = 0.0f;

    for (int kt = kv_lo / BLOCK_N * BLOCK_N; kt <= kv_hi; kt += BLOCK_N) {
        __syncthreads();  // every warp is done with the previous tile
        // Gather the tile's K and V rows; a key past kv_hi or in a bad block is zeros, masked.
        bool tile_ok = true;
        for (int i = threadIdx.x; i < BLOCK_N * CHUNKS; i += blockDim.x) {
            const int r = i / CHUNKS;
            const int c = i % CHUNKS;
            const int j = kt + r;
            uint4 k_piece = {0u, 0u, 0u, 0u};
            uint4 v_piece = {0u, 0u, 0u, 0u};
            bool ok = false;
            if (j <= kv_hi) {
                const long long block = table[j / block_size];
                if (block >= 0 && block < num_blocks) {
                    const long long offset =
                        ((block * block_size + j % block_size) * num_kv_heads + kv_head) * HEAD_DIM + c * 8;
                    k_piece = kv_load8_bf16(k_cache + offset);
                    v_piece = kv_load8_bf16(v_cache + offset);
                    ok = true;
                }
            }
            *reinterpret_cast<uint4*>(&k_tile[r * STRIDE + c * 8]) = k_piece;
            *reinterpret_cast<uint4*>(&v_tile[r * STRIDE + c * 8]) = v_piece;
            if (c == 0) {
                key_ok[r] = ok;
            }
            tile_ok = tile_ok && ok;
        }
        // Every key of the tile exists: then a tile inside every row's range needs no mask.
        const bool all_keys = __syncthreads_and(tile_ok);

        // Warp-uniform: skip a tile none of the warp's rows sees.
        if (warp_rows <= 0 || kt > warp_pos_hi || kt + BLOCK_N - 1 < warp_first_lo) {
            continue;
        }
        const bool masked =
            !all_keys || kt < warp_first_hi || kt + BLOCK_N - 1 > warp_pos_lo;

        float s[N_TILES][4];
#pragma unroll
        for (int n = 0; n < N_TILES; ++n) {
            s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
        }
#pragma unroll
        for (int ks = 0; ks < K_STEPS; ++ks) {
#pragma unroll
            for (int n = 0; n < N_TILES; ++n) {
                const bf16* k_row = &k_tile[(n * 8 + g) * STRIDE + ks * 16 + 2 * t];
                mma_16816(s[n], qf[ks], load_pair(k_row), load_pair(k_row + 8));
            }
        }

        // Scale, soft-cap, mask; the scores go to log2 units for exp2.
        float tile_max_a = neg_infinity();
        float tile_max_b = neg_infinity();
#pragma unroll
        for (int n = 0; n < N_TILES; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float x = s[n][e] * scale;
                if (softcap > 0.0f) {
                    x = softcap * tanhf(x / softcap);
                }
                x *= LOG2E;
                if (masked) {
                    const int key = n * 8 + 2 * t + (e & 1);
                    const int j = kt + key;
                    const bool visible = e < 2
                        ? live_a && j >= first_a && j <= pos_a
                        : live_b && j >= first_b && j <= pos_b;
                    if (!visible || !key_ok[key]) {
                        x = neg_infinity();
                    }
                }
                s[n][e] = x;
            }
            tile_max_a = fmaxf(tile_max_a, fmaxf(s[n][0], s[n][1]));
            tile_max_b = fmaxf(tile_max_b, fmaxf(s[n][2], s[n][3]));
        }
        // The four lanes of a row (same g) hold its columns.
        tile_max_a = fmaxf(tile_max_a, __shfl_xor_sync(0xffffffffu, tile_max_a, 1));
        tile_max_a = fmaxf(tile_max_a, __shfl_xor_sync(0xffffffffu, tile_max_a, 2));
        tile_max_b = fmaxf(tile_max_b, __shfl_xor_sync(0xffffffffu, tile_max_b, 1));
        tile_max_b = fmaxf(tile_max_b, __shfl_xor_sync(0xffffffffu, tile_max_b, 2));
        const float new_max_a = fmaxf(max_a, tile_max_a);
        const float new_max_b = fmaxf(max_b, tile_max_b);
        // A row with no visible key yet keeps max -inf: subtract 0 so that exp2 gives 0, not NaN.
        const float base_a = new_max_a == neg_infinity() ? 0.0f : new_max_a;
        const float base_b = new_max_b == neg_infinity() ? 0.0f : new_max_b;
        const float correction_a = exp2f(max_a - base_a);
        const float correction_b = exp2f(max_b - base_b);
        max_a = new_max_a;
        max_b = new_max_b;
        sum_a *= correction_a;
        sum_b *= correction_b;
#pragma unroll
        for (int d = 0; d < D_TILES; ++d) {
            o[d][0] *= correction_a;
            o[d][1] *= correction_a;
            o[d][2] *= correction_b;
            o[d][3] *= correction_b;
        }
#pragma unroll
        for (int n = 0; n < N_TILES; ++n) {
            s[n][0] = exp2f(s[n][0] - base_a);
            s[n][1] = exp2f(s[n][1] - base_a);
            s[n][2] = exp2f(s[n][2] - base_b);
            s[n][3] = exp2f(s[n][3] - base_b);
            sum_a += s[n][0] + s[n][1];
            sum_b += s[n][2] + s[n][3];
        }

        // O += P V, 16 keys at a time.
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
            const unsigned p[4] = {
                pack_bf16x2(s[2 * kk][0], s[2 * kk][1]),
                pack_bf16x2(s[2 * kk][2], s[2 * kk][3]),
                pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]),
            };
            // ldmatrix rows: matrices 0 / 1 = keys 0-7 / 8-15 of the step at output tile d,
            // matrices 2 / 3 the same at tile d + 1.
            const int v_row = kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
#pragma unroll
            for (int d = 0; d < D_TILES; d += 2) {
                unsigned v[4];
                ldmatrix_x4_trans(v, &v_tile[v_row * STRIDE + (d + lane / 16) * 8]);
                mma_16816(o[d], p, v[0], v[1]);
                mma_16816(o[d + 1], p, v[2], v[3]);
            }
        }
    }

    // Normalise and write this lane's columns of its two rows (a row that saw no key: zeros).
    sum_a += __shfl_xor_sync(0xffffffffu, sum_a, 1);
    sum_a += __shfl_xor_sync(0xffffffffu, sum_a, 2);
    sum_b += __shfl_xor_sync(0xffffffffu, sum_b, 1);
    sum_b += __shfl_xor_sync(0xffffffffu, sum_b, 2);
    const float inv_a = sum_a > 0.0f ? 1.0f / sum_a : 0.0f;
    const float inv_b = sum_b > 0.0f ? 1.0f / sum_b : 0.0f;
    bf16* out_a = out + ((long long)(seq_begin + first_row + row_a) * num_heads + head) * HEAD_DIM;
    bf16* out_b = out_a + (long long)8 * num_heads * HEAD_DIM;
#pragma unroll
    for (int d = 0; d < D_TILES; ++d) {
        const int c = d * 8 + 2 * t;
        if (live_a) {
            *reinterpret_cast<unsigned*>(out_a + c) = pack_bf16x2(o[d][0] * inv_a, o[d][1] * inv_a);
        }
        if (live_b) {
            *reinterpret_cast<unsigned*>(out_b + c) = pack_bf16x2(o[d][2] * inv_b, o[d][3] * inv_b);
        }
    }
#else
    asm volatile("trap;");
#endif
}

// Grid (flash_prefill_blocks(num_tokens, num_seqs), num_heads), FLASH_WARPS * 32 threads. One
// entry point per head_dim and pool element: bf16, and fp8 E4M3 (`_kvfp8`: each piece widened
// to bf16, exactly, on its way into the shared tiles).
#define DEFINE_FLASH_PREFILL_KV(D, KV, SUFFIX)                                                  \
    extern "C" __global__ void __launch_bounds__(FLASH_WARPS * 32)                              \
        flash_prefill_bf16##SUFFIX##_d##D(                                                      \
            bf16* out, const bf16* q, const KV* k_cache, const KV* v_cache,                     \
            const int* block_tables, const int* cu_seqlens_q, const int* start_pos,             \
            int num_seqs, int num_tokens, int max_blocks_per_seq, int num_blocks,               \
            int num_heads, int num_kv_heads, int block_size, float scale, int window,           \
            float softcap) {                                                                    \
        pdl_begin();                                                                            \
        flash_prefill<D, KV>(out, q, k_cache, v_cache, block_tables, cu_seqlens_q, start_pos,   \
                             num_seqs, num_tokens, max_blocks_per_seq, num_blocks, num_heads,   \
                             num_kv_heads, block_size, scale, window, softcap);                 \
    }

#define DEFINE_FLASH_PREFILL(D)                                                                 \
    DEFINE_FLASH_PREFILL_KV(D, bf16, )                                                          \
    DEFINE_FLASH_PREFILL_KV(D, fp8_e4m3, _kvfp8)

DEFINE_FLASH_PREFILL(64)
DEFINE_FLASH_PREFILL(96)
DEFINE_FLASH_PREFILL(128)
DEFINE_FLASH_PREFILL(256)
