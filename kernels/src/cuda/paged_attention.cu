// Paged attention over a block-table KV pool: decode (one query per sequence) and prefill
// (a chunk of query tokens per sequence, causal). bf16 storage, f32 math, online softmax.
//
// q, out:           [tokens, num_heads, head_dim]
// k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
// block_tables:     [num_seqs, max_blocks_per_seq]
// A query at position pos sees keys first..pos of its sequence, first = max(0, pos + 1 - window)
// (window <= 0: no window). The current step's K/V must already be in the pool.
// GQA: query head h reads kv head h / (num_heads / num_kv_heads).
// Scores are q.k * scale, then soft-capped when softcap > 0: softcap * tanh(score / softcap)
// (Gemma 2's attn_logit_softcapping), then softmax. The pools hold bf16 or fp8 E4M3 (the
// `_kvfp8` entry points; read through common.cuh's kv_load8 / kv_to_f32).
//
// Bounds: the kernels never read outside the pools or the table row, whatever the device data
// says. A key whose logical block is past the row (j / block_size >= max_blocks_per_seq) or
// whose table entry is outside [0, num_blocks) is skipped (contributes nothing); a query that
// ends up with no key writes zeros.
//
// Work split: one thread block of ATTN_WARPS warps per (query head, query token). The warps
// take tiles of 32 consecutive keys in turn (warp w: tiles w, w + ATTN_WARPS, ...). Within a
// tile each lane scores its own key, reading the key's row with 16-byte (fp8: 8-byte) loads
// against q held in shared memory, so a warp has 32 rows in flight instead of one; the tile's
// softmax update is two warp reductions. The value rows are then summed key by key with lanes owning HEAD_DIM/32
// contiguous dimensions (coalesced rows). Each warp keeps its own running max / sum /
// accumulator (online softmax: the context length is unbounded and K/V are read once); the
// warps' partial states are merged through shared memory at the end.
// Requires 16-byte aligned pools (checked by the host) and HEAD_DIM a multiple of 32.
//
// CUDA graphs: the grid depends only on (num_heads, tokens) and, for decode, the number of
// splits, which the host derives from the table width (fixed for a graph bucket); sequence
// lengths, positions and block tables are read from device memory, and each split's keys are
// cut from its sequence's real context on the device, so a captured launch stays valid (and
// attends every key) when they change.
// Entries with seq_len <= 0 (decode) or tokens past cu_seqlens_q[num_seqs] (prefill) are
// padding of a graph bucket: their output rows are written as zeros and nothing is read.
//
// ATTN_WARPS is defined by the host (sources.rs) so the launch configuration and the kernel
// cannot disagree.

// Zeros for one head of a padding row.
template <int HEAD_DIM>
__device__ __forceinline__ void zero_head(bf16* out) {
    for (int d = threadIdx.x; d < HEAD_DIM; d += blockDim.x) {
        out[d] = 0;
    }
}

// A result with no key: a split's empty state (max -inf, sum 0: the merge skips it) when
// `partial` is not null, else zeros in `out`.
template <int HEAD_DIM>
__device__ __forceinline__ void write_empty(float* partial, bf16* out) {
    if (partial != nullptr) {
        if (threadIdx.x == 0) {
            partial[0] = neg_infinity();
            partial[1] = 0.0f;
        }
    } else {
        zero_head<HEAD_DIM>(out);
    }
}

// The block's result from its warps' softmax states (each warp's max, sum of exponentials and
// accumulator, in shared memory, written before a barrier): rescaled to the largest max and
// summed into `partial` (a split's state for merge_head: max, sum, unnormalised
// accumulator) when it is not null, else normalised into `out`. A block whose warps saw no key
// writes an empty state (max -inf, sum 0: the merge skips it) or zeros.
template <int HEAD_DIM>
__device__ void write_warps_state(const float* warp_max, const float* warp_sum_exp,
                                  const float (*warp_acc)[HEAD_DIM], float* partial, bf16* out) {
    float global_max = neg_infinity();
#pragma unroll
    for (int w = 0; w < ATTN_WARPS; ++w) {
        global_max = fmaxf(global_max, warp_max[w]);
    }
    if (global_max == neg_infinity()) {
        write_empty<HEAD_DIM>(partial, out);
        return;
    }
    float total = 0.0f;
    float weight[ATTN_WARPS];
#pragma unroll
    for (int w = 0; w < ATTN_WARPS; ++w) {
        weight[w] = expf(warp_max[w] - global_max);
        total += warp_sum_exp[w] * weight[w];
    }
    if (partial != nullptr && threadIdx.x == 0) {
        partial[0] = global_max;
        partial[1] = total;
    }
    for (int d = threadIdx.x; d < HEAD_DIM; d += blockDim.x) {
        float value = 0.0f;
#pragma unroll
        for (int w = 0; w < ATTN_WARPS; ++w) {
            value += warp_acc[w][d] * weight[w];
        }
        if (partial != nullptr) {
            partial[2 + d] = value;
        } else {
            out[d] = f32_to_bf16(value / total);
        }
    }
}

template <int HEAD_DIM, typename KV>
__device__ void attend_one_query(
    bf16* __restrict__ out,
    const bf16* __restrict__ q,
    const KV* __restrict__ k_cache,
    const KV* __restrict__ v_cache,
    const int* __restrict__ block_table,
    int pos,
    int window,
    int split_lo,
    int split_hi,
    float* __restrict__ partial,
    int kv_head,
    int num_kv_heads,
    int block_size,
    int max_blocks_per_seq,
    int num_blocks,
    float scale,
    float softcap) {
    static_assert(HEAD_DIM % 32 == 0, "head_dim must be a multiple of the warp size");
    constexpr int PER_LANE = HEAD_DIM / 32;
    constexpr int VEC = 8;  // elements per kv_load8
    const unsigned full = 0xffffffffu;
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int dim0 = lane * PER_LANE;
    // This block's keys: the query's (window, causal) within [split_lo, split_hi].
    const int first = max(split_lo, window > 0 ? max(0, pos + 1 - window) : 0);
    // Keys past the table row would index outside it: never visit them.
    const int last = (int)min(min((long long)pos, (long long)split_hi),
                              (long long)max_blocks_per_seq * block_size - 1);

    // q with the softmax scale folded in, read by every lane (a broadcast, no bank conflicts).
    __shared__ float q_shared[HEAD_DIM];
    for (int d = threadIdx.x; d < HEAD_DIM; d += blockDim.x) {
        q_shared[d] = bf16_to_f32(q[d]) * scale;
    }
    __syncthreads();

    float running_max = neg_infinity();
    float running_sum = 0.0f;
    float acc[PER_LANE];
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
        acc[i] = 0.0f;
    }

    for (int tile = first + warp * 32; tile <= last; tile += ATTN_WARPS * 32) {
        // This lane's key: its pool slot (-1: no key) and score.
        const int j = tile + lane;
        long long slot = -1;
        float score = neg_infinity();
        if (j <= last) {
            const long long block = block_table[j / block_size];
            if (block >= 0 && block < num_blocks) {
                slot = block * block_size + j % block_size;
                const KV* k_row = k_cache + (slot * num_kv_heads + kv_head) * HEAD_DIM;
                float dot = 0.0f;
#pragma unroll
                for (int c = 0; c < HEAD_DIM / VEC; ++c) {
                    float key[VEC];
                    kv_load8(k_row + c * VEC, key);
#pragma unroll
                    for (int e = 0; e < VEC; ++e) {
                        dot += q_shared[c * VEC + e] * key[e];
                    }
                }
                score = softcap > 0.0f ? softcap * tanhf(dot / softcap) : dot;
            }
        }
        const float tile_max = warp_reduce_max(score);
        if (tile_max == neg_infinity()) {
            continue;  // warp-uniform: no key in this tile
        }
        // Rescale what was accumulated under the old maximum (exp(-inf) = 0 on the first tile).
        const float new_max = fmaxf(running_max, tile_max);
        const float correction = expf(running_max - new_max);
        const float p = slot >= 0 ? expf(score - new_max) : 0.0f;
        running_sum = running_sum * correction + warp_sum(p);
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
            acc[i] *= correction;
        }
#pragma unroll 8
        for (int k = 0; k < 32; ++k) {
            const long long slot_k = __shfl_sync(full, slot, k);
            const float p_k = __shfl_sync(full, p, k);
            if (slot_k >= 0) {  // warp-uniform
                const KV* v_row = v_cache + (slot_k * num_kv_heads + kv_head) * HEAD_DIM + dim0;
#pragma unroll
                for (int i = 0; i < PER_LANE; ++i) {
                    acc[i] += p_k * kv_to_f32(v_row[i]);
                }
            }
        }
        running_max = new_max;
    }

    // Merge the warps: rescale each warp's state to the global maximum. A warp that saw no key
    // has max -inf and sum 0 and contributes nothing; if no warp saw one, the output is zeros.
    __shared__ float warp_max[ATTN_WARPS];
    __shared__ float warp_sum_exp[ATTN_WARPS];
    __shared__ float warp_acc[ATTN_WARPS][HEAD_DIM];
    if (lane == 0) {
        warp_max[warp] = running_max;
        warp_sum_exp[warp] = running_sum;
    }
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
        warp_acc[warp][dim0 + i] = acc[i];
    }
    __syncthreads();
    write_warps_state<HEAD_DIM>(warp_max, warp_sum_exp, warp_acc, partial, out);
}

// The keys split `split` of `num_splits` attends for a query at `pos` whose first visible key
// is `first`: the visible keys cut into num_splits ranges of the same whole number of 32-key
// tiles, the last ones shorter or empty (lo > pos). Mirrors decode_split::split_keys, whose
// tests show the ranges cover every key once for any context and split count.
__device__ __forceinline__ void split_keys(int first, int pos, int split, int num_splits,
                                           int* lo, int* hi) {
    const long long keys = (long long)pos - first + 1;
    const long long per = ((keys + num_splits - 1) / num_splits + 31) / 32 * 32;
    const long long start = first + split * per;
    *lo = (int)min(start, (long long)pos + 1);
    *hi = (int)min(start + per - 1, (long long)pos);
}

// The keys [lo, hi] split `split` of a decode step's `num_splits` attends for a sequence of
// `seq_len` tokens (its query at seq_len - 1), with `window` (<= 0: none): its split_keys
// range, or every key when the step is not split. False when it has none (a padding entry,
// seq_len <= 0, or a split past the sequence's keys).
__device__ __forceinline__ bool decode_split_range(int seq_len, int window, int split,
                                                   int num_splits, int* lo, int* hi) {
    *lo = 0;
    *hi = 0x7fffffff;
    if (seq_len <= 0) {
        return false;
    }
    if (num_splits > 1) {
        const int pos = seq_len - 1;
        const int first = window > 0 ? max(0, pos + 1 - window) : 0;
        split_keys(first, pos, split, num_splits, lo, hi);
    }
    return *lo <= seq_len - 1;
}

// One query head's splits combined into its output row: each split's state rescaled to the
// largest max; zeros when no split saw a key (padding rows). `state` is the head's num_splits
// states [HEAD_DIM + 2] (max, sum, unnormalised accumulator), written by other blocks of this
// launch: read through L2 (__ldcg), never a line this SM's L1 may hold from before.
template <int HEAD_DIM>
__device__ void merge_head(bf16* o, const float* state, int num_splits) {
    float global_max = neg_infinity();
    for (int z = 0; z < num_splits; ++z) {
        global_max = fmaxf(global_max, __ldcg(state + z * (HEAD_DIM + 2)));
    }
    if (global_max == neg_infinity()) {
        zero_head<HEAD_DIM>(o);
        return;
    }
    float total = 0.0f;
    for (int z = 0; z < num_splits; ++z) {
        const float* st = state + z * (HEAD_DIM + 2);
        // An empty split: 0 * exp(-inf) = 0.
        total += __ldcg(st + 1) * expf(__ldcg(st) - global_max);
    }
    for (int d = threadIdx.x; d < HEAD_DIM; d += blockDim.x) {
        float value = 0.0f;
        for (int z = 0; z < num_splits; ++z) {
            const float* st = state + z * (HEAD_DIM + 2);
            const float m = __ldcg(st);
            if (m != neg_infinity()) {
                value += __ldcg(st + 2 + d) * expf(m - global_max);
            }
        }
        o[d] = f32_to_bf16(value / total);
    }
}

// The split merge, fused into the decode launch: every block of a split decode calls this once
// its split's state for the `heads` query heads it serves is written (the unit: one query head,
// or a GQA group). The block that completes the unit's count — the last of its num_splits to
// get there — merges the unit's heads into `out` and resets the count to 0 for the next launch
// (so a captured graph replays with the counts it was captured with). No block waits for
// another: a unit whose count never completes would leave its rows unwritten, not hang.
// Memory order: each thread fences its own state writes before the barrier, the ticket is
// taken after it, and the last block reads the other blocks' states through L2.
template <int HEAD_DIM>
__device__ void merge_if_last(int* count, int heads, bf16* out, const float* states,
                              int num_splits) {
    __shared__ int last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(count, 1) == num_splits - 1;
    }
    __syncthreads();
    if (!last) {
        return;  // block-uniform
    }
    __threadfence();
    for (int h = 0; h < heads; ++h) {
        merge_head<HEAD_DIM>(out + (long long)h * HEAD_DIM,
                             states + (long long)h * num_splits * (HEAD_DIM + 2), num_splits);
    }
    if (threadIdx.x == 0) {
        *count = 0;
    }
}

// paged_attention_decode's work before the merge: this block's split state (or, unsplit, its
// output row).
template <int HEAD_DIM, typename KV>
__device__ void paged_attention_decode_split(
    bf16* out, float* partials, const bf16* q, const KV* k_cache, const KV* v_cache,
    const int* block_tables, const int* seq_lens, int max_blocks_per_seq, int num_blocks,
    int num_heads, int num_kv_heads, int block_size, float scale, int window, float softcap) {
    const int head = blockIdx.x;
    const int seq = blockIdx.y;
    const int split = blockIdx.z;
    const int seq_len = seq_lens[seq];
    const long long row = ((long long)seq * num_heads + head) * HEAD_DIM;
    float* partial = gridDim.z == 1
        ? nullptr
        : partials + (((long long)seq * num_heads + head) * gridDim.z + split) * (HEAD_DIM + 2);
    int lo;
    int hi;
    if (!decode_split_range(seq_len, window, split, gridDim.z, &lo, &hi)) {
        write_empty<HEAD_DIM>(partial, out + row);
        return;
    }
    attend_one_query<HEAD_DIM, KV>(
        out + row, q + row, k_cache, v_cache,
        block_tables + (long long)seq * max_blocks_per_seq, seq_len - 1, window, lo, hi,
        partial, head / (num_heads / num_kv_heads), num_kv_heads, block_size,
        max_blocks_per_seq, num_blocks, scale, softcap);
}

// Grid (num_heads, num_seqs, num_splits). seq_lens[s] counts the query's own token: it sits at
// seq_len - 1. With num_splits == 1 each block attends the whole context and writes `out`.
// Otherwise (flash-decoding: few sequences, long contexts, too few blocks to fill the GPU)
// split z attends its range of the sequence's visible keys (split_keys) and writes its softmax
// state to partials[(seq * num_heads + head) * num_splits + z][HEAD_DIM + 2]; the last split
// of each (sequence, head) to finish combines them into `out` (merge_if_last, counting in
// split_counts[seq * num_heads + head], zeros between launches).
template <int HEAD_DIM, typename KV>
__device__ void paged_attention_decode(
    bf16* out, float* partials, int* split_counts, const bf16* q, const KV* k_cache,
    const KV* v_cache, const int* block_tables, const int* seq_lens, int max_blocks_per_seq,
    int num_blocks, int num_heads, int num_kv_heads, int block_size, float scale, int window,
    float softcap) {
    paged_attention_decode_split<HEAD_DIM, KV>(
        out, partials, q, k_cache, v_cache, block_tables, seq_lens, max_blocks_per_seq,
        num_blocks, num_heads, num_kv_heads, block_size, scale, window, softcap);
    if (gridDim.z > 1) {
        const long long unit = (long long)blockIdx.y * num_heads + blockIdx.x;
        merge_if_last<HEAD_DIM>(split_counts + unit, 1, out + unit * HEAD_DIM,
                                partials + unit * gridDim.z * (HEAD_DIM + 2), gridDim.z);
    }
}

// Decode serving a whole GQA group per block: grid (num_kv_heads, num_seqs, num_splits), one
// block per (KV head, sequence, split) attending for all `group = num_heads / num_kv_heads`
// query heads of the KV head (group <= DECODE_MAX_GROUP, checked by the host), so each key and
// value row is read once per step instead of once per query head. The walk is
// attend_one_query's (warps take 32-key tiles in turn, a lane scores its own key, lanes own
// contiguous dimensions of the value rows) with the group's scores, softmax states and
// accumulators side by side; the warps' states are merged head by head at the end. Splits,
// padding and partial states are the per-head decode's: the same merge combines them, the
// last split of each (sequence, KV head) merging its group's heads (split_counts[seq *
// num_kv_heads + kv_head]).
template <int HEAD_DIM, typename KV>
__device__ void paged_attention_decode_grouped_split(
    bf16* out, float* partials, const bf16* q, const KV* k_cache, const KV* v_cache,
    const int* block_tables, const int* seq_lens, int max_blocks_per_seq, int num_blocks,
    int num_heads, int num_kv_heads, int block_size, float scale, int window, float softcap) {
    static_assert(HEAD_DIM % 32 == 0, "head_dim must be a multiple of the warp size");
    constexpr int G = DECODE_MAX_GROUP;
    constexpr int PER_LANE = HEAD_DIM / 32;
    constexpr int VEC = 8;  // elements per kv_load8
    const unsigned full = 0xffffffffu;
    const int kv_head = blockIdx.x;
    const int seq = blockIdx.y;
    const int split = blockIdx.z;
    const int group = num_heads / num_kv_heads;
    const int head0 = kv_head * group;
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int dim0 = lane * PER_LANE;
    const int seq_len = seq_lens[seq];
    // Where head h's result goes: its split's state, or (unsplit: no state) its output row.
    auto out_row = [&](int h) {
        return out + ((long long)seq * num_heads + head0 + h) * HEAD_DIM;
    };
    auto partial_of = [&](int h) -> float* {
        return gridDim.z == 1
            ? nullptr
            : partials +
                (((long long)seq * num_heads + head0 + h) * gridDim.z + split) * (HEAD_DIM + 2);
    };
    int lo;
    int hi;
    if (!decode_split_range(seq_len, window, split, gridDim.z, &lo, &hi)) {
        for (int h = 0; h < group; ++h) {
            write_empty<HEAD_DIM>(partial_of(h), out_row(h));
        }
        return;
    }
    const int pos = seq_len - 1;
    const int first = max(lo, window > 0 ? max(0, pos + 1 - window) : 0);
    const int last = (int)min(min((long long)pos, (long long)hi),
                              (long long)max_blocks_per_seq * block_size - 1);
    const int* table = block_tables + (long long)seq * max_blocks_per_seq;

    // The group's queries with the softmax scale folded in (broadcast reads).
    __shared__ float q_shared[G][HEAD_DIM];
    for (int i = threadIdx.x; i < group * HEAD_DIM; i += blockDim.x) {
        q_shared[i / HEAD_DIM][i % HEAD_DIM] =
            bf16_to_f32(q[((long long)seq * num_heads + head0) * HEAD_DIM + i]) * scale;
    }
    __syncthreads();

    float running_max[G];
    float running_sum[G];
    float acc[G][PER_LANE];
#pragma unroll
    for (int h = 0; h < G; ++h) {
        running_max[h] = neg_infinity();
        running_sum[h] = 0.0f;
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
            acc[h][i] = 0.0f;
        }
    }

    for (int tile = first + warp * 32; tile <= last; tile += ATTN_WARPS * 32) {
        // This lane's key: its pool slot (-1: no key) and its score for each head of the group.
        const int j = tile + lane;
        long long slot = -1;
        float score[G];
#pragma unroll
        for (int h = 0; h < G; ++h) {
            score[h] = neg_infinity();
        }
        if (j <= last) {
            const long long block = table[j / block_size];
            if (block >= 0 && block < num_blocks) {
                slot = block * block_size + j % block_size;
                const KV* k_row = k_cache + (slot * num_kv_heads + kv_head) * HEAD_DIM;
                float dot[G];
#pragma unroll
                for (int h = 0; h < G; ++h) {
                    dot[h] = 0.0f;
                }
#pragma unroll
                for (int c = 0; c < HEAD_DIM / VEC; ++c) {
                    float key[VEC];
                    kv_load8(k_row + c * VEC, key);
#pragma unroll
                    for (int h = 0; h < G; ++h) {
                        if (h < group) {
#pragma unroll
                            for (int e = 0; e < VEC; ++e) {
                                dot[h] += q_shared[h][c * VEC + e] * key[e];
                            }
                        }
                    }
                }
#pragma unroll
                for (int h = 0; h < G; ++h) {
                    score[h] = softcap > 0.0f ? softcap * tanhf(dot[h] / softcap) : dot[h];
                }
            }
        }
        if (__ballot_sync(full, slot >= 0) == 0) {
            continue;  // warp-uniform: no key in this tile
        }
        // Each head's online softmax update (every valid key has a finite score for every head).
        float p[G];
#pragma unroll
        for (int h = 0; h < G; ++h) {
            p[h] = 0.0f;
            if (h < group) {
                const float new_max = fmaxf(running_max[h], warp_reduce_max(score[h]));
                const float correction = expf(running_max[h] - new_max);
                p[h] = slot >= 0 ? expf(score[h] - new_max) : 0.0f;
                running_sum[h] = running_sum[h] * correction + warp_sum(p[h]);
#pragma unroll
                for (int i = 0; i < PER_LANE; ++i) {
                    acc[h][i] *= correction;
                }
                running_max[h] = new_max;
            }
        }
        // Each value row once, weighed for every head.
#pragma unroll 4
        for (int k = 0; k < 32; ++k) {
            const long long slot_k = __shfl_sync(full, slot, k);
            if (slot_k >= 0) {  // warp-uniform
                const KV* v_row = v_cache + (slot_k * num_kv_heads + kv_head) * HEAD_DIM + dim0;
                float value[PER_LANE];
#pragma unroll
                for (int i = 0; i < PER_LANE; ++i) {
                    value[i] = kv_to_f32(v_row[i]);
                }
#pragma unroll
                for (int h = 0; h < G; ++h) {
                    if (h < group) {  // block-uniform: every lane shuffles or none
                        const float p_k = __shfl_sync(full, p[h], k);
#pragma unroll
                        for (int i = 0; i < PER_LANE; ++i) {
                            acc[h][i] += p_k * value[i];
                        }
                    }
                }
            }
        }
    }

    // Merge the warps, one head at a time through the same shared buffers (as
    // attend_one_query does for its one head).
    __shared__ float warp_max[ATTN_WARPS];
    __shared__ float warp_sum_exp[ATTN_WARPS];
    __shared__ float warp_acc[ATTN_WARPS][HEAD_DIM];
#pragma unroll
    for (int h = 0; h < G; ++h) {
        if (h >= group) {
            break;  // block-uniform
        }
        __syncthreads();  // the previous head's merge is done reading
        if (lane == 0) {
            warp_max[warp] = running_max[h];
            warp_sum_exp[warp] = running_sum[h];
        }
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
            warp_acc[warp][dim0 + i] = acc[h][i];
        }
        __syncthreads();
        write_warps_state<HEAD_DIM>(warp_max, warp_sum_exp, warp_acc, partial_of(h), out_row(h));
    }
}

template <int HEAD_DIM, typename KV>
__device__ void paged_attention_decode_grouped(
    bf16* out, float* partials, int* split_counts, const bf16* q, const KV* k_cache,
    const KV* v_cache, const int* block_tables, const int* seq_lens, int max_blocks_per_seq,
    int num_blocks, int num_heads, int num_kv_heads, int block_size, float scale, int window,
    float softcap) {
    paged_attention_decode_grouped_split<HEAD_DIM, KV>(
        out, partials, q, k_cache, v_cache, block_tables, seq_lens, max_blocks_per_seq,
        num_blocks, num_heads, num_kv_heads, block_size, scale, window, softcap);
    if (gridDim.z > 1) {
        const int group = num_heads / num_kv_heads;
        const long long unit = (long long)blockIdx.y * num_kv_heads + blockIdx.x;
        const long long head0 = (long long)blockIdx.y * num_heads + (long long)blockIdx.x * group;
        merge_if_last<HEAD_DIM>(split_counts + unit, group, out + head0 * HEAD_DIM,
                                partials + head0 * gridDim.z * (HEAD_DIM + 2), gridDim.z);
    }
}

// Grid (num_heads, min(num_tokens, 65535)): block y attends tokens y, y + gridDim.y, ... (a
// grid's y dimension stops at 65535; a step may hold more tokens). Sequence s owns query tokens
// cu_seqlens_q[s] .. cu_seqlens_q[s+1] and its first query token is at position start_pos[s].
template <int HEAD_DIM, typename KV>
__device__ void paged_attention_prefill(
    bf16* out, const bf16* q, const KV* k_cache, const KV* v_cache,
    const int* block_tables, const int* cu_seqlens_q, const int* start_pos, int num_seqs,
    int num_tokens, int max_blocks_per_seq, int num_blocks, int num_heads, int num_kv_heads,
    int block_size, float scale, int window, float softcap) {
    const int head = blockIdx.x;
    // Block-uniform loop bounds: every thread reaches attend_one_query's barriers together.
    for (int token = blockIdx.y; token < num_tokens; token += gridDim.y) {
        const long long row = ((long long)token * num_heads + head) * HEAD_DIM;
        if (token >= cu_seqlens_q[num_seqs]) {
            zero_head<HEAD_DIM>(out + row);
            continue;
        }
        // The owning sequence is the last s with cu_seqlens_q[s] <= token (skips empty
        // sequences).
        int lo = 0;
        int hi = num_seqs - 1;
        while (lo < hi) {
            const int mid = (lo + hi + 1) / 2;
            if (cu_seqlens_q[mid] <= token) {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        const int seq = lo;
        const int pos = start_pos[seq] + token - cu_seqlens_q[seq];
        attend_one_query<HEAD_DIM, KV>(
            out + row, q + row, k_cache, v_cache,
            block_tables + (long long)seq * max_blocks_per_seq, pos, window, 0, 0x7fffffff,
            nullptr, head / (num_heads / num_kv_heads), num_kv_heads, block_size,
            max_blocks_per_seq, num_blocks, scale, softcap);
        // attend_one_query's shared state (q, the warps' partial sums) is rewritten by the
        // next token: all threads must be done reading it.
        __syncthreads();
    }
}

// One extern "C" entry point per supported head_dim and pool element (the Rust side picks by
// name): bf16 pools, and fp8 E4M3 pools (`_kvfp8`).
#define DEFINE_PAGED_ATTENTION_KV(D, KV, SUFFIX)                                                \
    extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32)                               \
        paged_attention_decode_bf16##SUFFIX##_d##D(                                             \
            bf16* out, float* partials, int* split_counts, const bf16* q, const KV* k_cache,    \
            const KV* v_cache, const int* block_tables, const int* seq_lens,                    \
            int max_blocks_per_seq, int num_blocks, int num_heads, int num_kv_heads,            \
            int block_size, float scale, int window, float softcap) {                           \
        pdl_begin();                                                                            \
        paged_attention_decode<D, KV>(out, partials, split_counts, q, k_cache, v_cache,         \
                                      block_tables, seq_lens, max_blocks_per_seq, num_blocks,   \
                                      num_heads, num_kv_heads, block_size, scale, window,       \
                                      softcap);                                                 \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32)                               \
        paged_attention_decode_grouped_bf16##SUFFIX##_d##D(                                     \
            bf16* out, float* partials, int* split_counts, const bf16* q, const KV* k_cache,    \
            const KV* v_cache, const int* block_tables, const int* seq_lens,                    \
            int max_blocks_per_seq, int num_blocks, int num_heads, int num_kv_heads,            \
            int block_size, float scale, int window, float softcap) {                           \
        pdl_begin();                                                                            \
        paged_attention_decode_grouped<D, KV>(out, partials, split_counts, q, k_cache,          \
                                              v_cache, block_tables, seq_lens,                  \
                                              max_blocks_per_seq, num_blocks, num_heads,        \
                                              num_kv_heads, block_size, scale, window,          \
                                              softcap);                                         \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32)                               \
        paged_attention_prefill_bf16##SUFFIX##_d##D(                                            \
            bf16* out, const bf16* q, const KV* k_cache, const KV* v_cache,                     \
            const int* block_tables, const int* cu_seqlens_q, const int* start_pos,             \
            int num_seqs, int num_tokens, int max_blocks_per_seq, int num_blocks,               \
            int num_heads, int num_kv_heads, int block_size, float scale, int window,           \
            float softcap) {                                                                    \
        pdl_begin();                                                                            \
        paged_attention_prefill<D, KV>(out, q, k_cache, v_cache, block_tables, cu_seqlens_q,    \
                                       start_pos, num_seqs, num_tokens, max_blocks_per_seq,     \
                                       num_blocks, num_heads, num_kv_heads, block_size, scale,  \
                                       window, softcap);                                        \
    }

#define DEFINE_PAGED_ATTENTION(D)                                                               \
    DEFINE_PAGED_ATTENTION_KV(D, bf16, )                                                        \
    DEFINE_PAGED_ATTENTION_KV(D, fp8_e4m3, _kvfp8)

DEFINE_PAGED_ATTENTION(64)
DEFINE_PAGED_ATTENTION(96)
DEFINE_PAGED_ATTENTION(128)
DEFINE_PAGED_ATTENTION(256)
