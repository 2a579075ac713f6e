// Sampling on the device: one block per sampled row, so only token ids (and the logprobs a
// row asks for) go back to the host. Semantics in crate::sampling; the plain version, which
// sorts where this selects by radix, is reference/sampling.rs.
//
// A row of a 128k vocabulary is 512 KiB of f32 logits: L2-resident, too big for shared
// memory, so every pass re-reads the row and recomputes the weights it needs. Block size: a
// multiple of 32, at most 1024. SAMPLE_MAX_TOP comes from crate::sampling::MAX_TOP_LOGPROBS.
//
// Not for graph capture: the adjustment count changes every step.

#define FULL_MASK 0xffffffffu

// A candidate for the largest logit: larger value first, ties to the lower id; i < 0: none.
struct Best {
    float v;
    int i;
};

__device__ __forceinline__ Best best_of(Best a, Best b) {
    if (b.i < 0) {
        return a;
    }
    if (a.i < 0) {
        return b;
    }
    return (b.v > a.v || (b.v == a.v && b.i < a.i)) ? b : a;
}

// Whether (v, i) comes after `prev` in the order of `best_of` (the next top logprob).
__device__ __forceinline__ bool after(float v, int i, Best prev) {
    return prev.i < 0 || v < prev.v || (v == prev.v && i > prev.i);
}

// Block-wide reductions: every thread gets the result; the trailing barrier lets `scratch`
// ([32]) be reused by the next call.
__device__ Best row_best(Best b, Best* scratch) {
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        Best other;
        other.v = __shfl_xor_sync(FULL_MASK, b.v, o);
        other.i = __shfl_xor_sync(FULL_MASK, b.i, o);
        b = best_of(b, other);
    }
    if (lane == 0) {
        scratch[warp] = b;
    }
    __syncthreads();
    Best r;
    r.v = 0.0f;
    r.i = -1;
    if (lane < (int)(blockDim.x / 32)) {
        r = scratch[lane];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        Best other;
        other.v = __shfl_xor_sync(FULL_MASK, r.v, o);
        other.i = __shfl_xor_sync(FULL_MASK, r.i, o);
        r = best_of(r, other);
    }
    __syncthreads();
    return r;
}

__device__ float row_max(float v, float* scratch) {
    const int lane = threadIdx.x % 32;
    v = warp_reduce_max(v);
    if (lane == 0) {
        scratch[threadIdx.x / 32] = v;
    }
    __syncthreads();
    v = lane < (int)(blockDim.x / 32) ? scratch[lane] : neg_infinity();
    v = warp_reduce_max(v);
    __syncthreads();
    return v;
}

__device__ float row_sum(float v, float* scratch) {
    const int lane = threadIdx.x % 32;
    v = warp_sum(v);
    if (lane == 0) {
        scratch[threadIdx.x / 32] = v;
    }
    __syncthreads();
    v = lane < (int)(blockDim.x / 32) ? scratch[lane] : 0.0f;
    v = warp_sum(v);
    __syncthreads();
    return v;
}

// The exclusive prefix sum of `v` in thread order; `*total` gets the block's sum.
__device__ unsigned long long row_exclusive_scan(unsigned long long v,
                                                 unsigned long long* scratch,
                                                 unsigned long long* total) {
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int num_warps = blockDim.x / 32;
    unsigned long long incl = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned long long n = __shfl_up_sync(FULL_MASK, incl, o);
        if (lane >= o) {
            incl += n;
        }
    }
    if (lane == 31) {
        scratch[warp] = incl;
    }
    __syncthreads();
    if (warp == 0) {
        unsigned long long s = lane < num_warps ? scratch[lane] : 0ull;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const unsigned long long n = __shfl_up_sync(FULL_MASK, s, o);
            if (lane >= o) {
                s += n;
            }
        }
        scratch[lane] = s;
    }
    __syncthreads();
    *total = scratch[num_warps - 1];
    const unsigned long long before = warp > 0 ? scratch[warp - 1] : 0ull;
    __syncthreads();
    return before + incl - v;
}

// Must match crate::sampling::fixed_weight: a weight in [0, 1] times 2^40, truncated.
__device__ __forceinline__ unsigned long long fixed_weight(float w) {
    return (unsigned long long)(w * 1099511627776.0f);
}

// exp((x - max) / T), as reference::weights computes it.
__device__ __forceinline__ float weight(float x, float max, float t) {
    return expf((x - max) / t);
}

// The largest weight bit pattern b such that the tokens with bits >= b, among those with bits
// >= floor, reach `target`: each counting 1 (by_mass false) or its fixed-point weight. 0 when
// all of them together fall short. Four passes of 8 bits, the most significant first (positive
// floats order as their bits). `hist`: [256] shared; `result`: one shared word.
__device__ unsigned int radix_select(const float* x, int vocab, float max, float t,
                                     unsigned int floor, bool by_mass,
                                     unsigned long long target, unsigned long long* hist,
                                     unsigned int* result) {
    unsigned int prefix = 0;
    unsigned int mask = 0;
    unsigned long long above = 0;  // thread 0's: what the bins above the prefix hold
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += blockDim.x) {
            hist[b] = 0ull;
        }
        __syncthreads();
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            const float w = weight(x[i], max, t);
            const unsigned int bits = __float_as_uint(w);
            if (bits >= floor && (bits & mask) == prefix) {
                const unsigned long long add = by_mass ? fixed_weight(w) : 1ull;
                if (add > 0) {
                    atomicAdd(&hist[(bits >> shift) & 255u], add);
                }
            }
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int d = 255;
            for (; d >= 0; --d) {
                if (above + hist[d] >= target) {
                    break;
                }
                above += hist[d];
            }
            *result = d < 0 ? FULL_MASK : (prefix | ((unsigned int)d << shift));
        }
        __syncthreads();
        const unsigned int r = *result;
        if (r == FULL_MASK) {
            return 0;
        }
        prefix = r;
        mask |= 255u << shift;
    }
    return prefix;
}

// logits: f32 [rows, vocab], adjusted in place. params_f: [rows, 4] (temperature, top_p,
// min_p, uniform); params_i: [rows, 2] (top_k, top_logprobs or -1). Row r's adjustments are
// adjust_start[r] .. adjust_start[r + 1] (clamped to [0, n_adjust]) of adjust_token [n] and
// adjust_values [n, 3] (repetition, penalty, bias), each token once per row; adjust_raw [n]
// receives the logits they replaced. Row r's grammar mask, if mask_start[r] < mask_start[r + 1]
// (clamped to [0, n_mask_words]), is those words of mask_words: bit i % 32 of word i / 32
// allows token i, ids past its end are not allowed; every other logit becomes -inf after the
// adjustments. Writes out_token [rows], out_logprob [rows] (NaN unless
// asked), out_top_ids / out_top_logprobs [rows, SAMPLE_MAX_TOP] (-1 / NaN past the count).
// Grid: one block per row.
extern "C" __global__ void __launch_bounds__(1024) sample_rows_f32(
    float* __restrict__ logits, int vocab, const float* __restrict__ params_f,
    const int* __restrict__ params_i, const int* __restrict__ adjust_start,
    const int* __restrict__ adjust_token, const float* __restrict__ adjust_values,
    float* __restrict__ adjust_raw, int n_adjust, const int* __restrict__ mask_start,
    const unsigned int* __restrict__ mask_words, int n_mask_words, int* __restrict__ out_token,
    float* __restrict__ out_logprob, int* __restrict__ out_top_ids,
    float* __restrict__ out_top_logprobs) {
    pdl_begin();
    __shared__ float fscratch[32];
    __shared__ unsigned long long uscratch[32];
    __shared__ Best bscratch[32];
    __shared__ unsigned long long hist[256];
    __shared__ unsigned int selected;
    __shared__ int chosen;

    const int row = blockIdx.x;
    float* x = logits + (long long)row * vocab;
    const float temperature = params_f[4 * row];
    const float top_p = params_f[4 * row + 1];
    const float min_p = params_f[4 * row + 2];
    const float uniform = params_f[4 * row + 3];
    const int top_k = params_i[2 * row];
    const int n_top = min(params_i[2 * row + 1], SAMPLE_MAX_TOP);
    const int a0 = min(max(adjust_start[row], 0), n_adjust);
    const int a1 = min(max(adjust_start[row + 1], a0), n_adjust);
    const int m0 = min(max(mask_start[row], 0), n_mask_words);
    const int m1 = min(max(mask_start[row + 1], m0), n_mask_words);
    const float nan = __uint_as_float(0x7fc00000u);

    // 1. Logprobs of the raw model distribution, before any adjustment.
    float log_z = 0.0f;
    if (n_top >= 0) {
        float m = neg_infinity();
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            m = fmaxf(m, x[i]);
        }
        m = row_max(m, fscratch);
        float s = 0.0f;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            s += expf(x[i] - m);
        }
        log_z = m + logf(row_sum(s, fscratch));
        Best prev;
        prev.v = 0.0f;
        prev.i = -1;
        for (int j = 0; j < n_top; ++j) {
            Best b;
            b.v = 0.0f;
            b.i = -1;
            for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
                if (after(x[i], i, prev)) {
                    Best c;
                    c.v = x[i];
                    c.i = i;
                    b = best_of(b, c);
                }
            }
            b = row_best(b, bscratch);
            if (threadIdx.x == 0) {
                out_top_ids[row * SAMPLE_MAX_TOP + j] = b.i;
                out_top_logprobs[row * SAMPLE_MAX_TOP + j] = b.i >= 0 ? b.v - log_z : nan;
            }
            // Past the vocabulary's end every later slot stays -1 (none would follow "none").
            if (b.i >= 0) {
                prev = b;
            }
        }
    }
    for (int j = max(n_top, 0) + threadIdx.x; j < SAMPLE_MAX_TOP; j += blockDim.x) {
        out_top_ids[row * SAMPLE_MAX_TOP + j] = -1;
        out_top_logprobs[row * SAMPLE_MAX_TOP + j] = nan;
    }

    // 2. Penalties and bias, in place; the replaced logits kept for the logprob.
    for (int j = a0 + threadIdx.x; j < a1; j += blockDim.x) {
        const int t = adjust_token[j];
        if (t < 0 || t >= vocab) {
            continue;
        }
        const float raw = x[t];
        adjust_raw[j] = raw;
        float v = raw;
        const float rep = adjust_values[3 * j];
        // _rn intrinsics: never contracted with the subtraction below into an FMA, so the
        // result is the reference's, rounding for rounding.
        if (rep != 1.0f) {
            v = v > 0.0f ? __fdiv_rn(v, rep) : __fmul_rn(v, rep);
        }
        v -= adjust_values[3 * j + 1];
        v += adjust_values[3 * j + 2];
        x[t] = v;
    }
    __syncthreads();

    // 2b. The grammar mask, after the adjustments (the host sampler's order).
    if (m1 > m0) {
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            const int w = m0 + (i >> 5);
            const unsigned int bits = w < m1 ? mask_words[w] : 0u;
            if (((bits >> (i & 31)) & 1u) == 0u) {
                x[i] = neg_infinity();
            }
        }
        __syncthreads();
    }

    // 3. The token: greedy, or a draw from the kept weights.
    Best greedy;
    greedy.v = 0.0f;
    greedy.i = -1;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        Best c;
        c.v = x[i];
        c.i = i;
        greedy = best_of(greedy, c);
    }
    greedy = row_best(greedy, bscratch);
    int token = greedy.i;
    if (temperature > 0.0f) {
        const float m = greedy.v;  // the largest logit, every thread's
        // A weight of 0 is never drawn; min_p <= 0 (either zero) is off.
        unsigned int floor = min_p > 0.0f ? __float_as_uint(min_p) : 1u;
        if (top_k > 0) {
            const unsigned int kth = radix_select(x, vocab, m, temperature, floor, false,
                                                  (unsigned long long)top_k, hist, &selected);
            floor = max(floor, kth);
        }
        if (top_p < 1.0f) {
            unsigned long long mass = 0;
            for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
                const float w = weight(x[i], m, temperature);
                mass += __float_as_uint(w) >= floor ? fixed_weight(w) : 0ull;
            }
            unsigned long long total;
            row_exclusive_scan(mass, uscratch, &total);
            // Must match reference::mass_target.
            unsigned long long target =
                (unsigned long long)ceil((double)top_p * (double)total);
            target = target > 0ull ? target : 1ull;
            floor = max(floor, radix_select(x, vocab, m, temperature, floor, true, target, hist,
                                            &selected));
        }
        // The draw, in id order: each thread a contiguous chunk of ids.
        const int chunk = (vocab + blockDim.x - 1) / blockDim.x;
        const int begin = min((int)threadIdx.x * chunk, vocab);
        const int end = min(begin + chunk, vocab);
        unsigned long long local = 0;
        for (int i = begin; i < end; ++i) {
            const float w = weight(x[i], m, temperature);
            local += __float_as_uint(w) >= floor ? fixed_weight(w) : 0ull;
        }
        if (threadIdx.x == 0) {
            chosen = -1;
        }
        unsigned long long total;
        const unsigned long long before = row_exclusive_scan(local, uscratch, &total);
        if (total > 0ull) {
            // Must match reference::draw_target.
            unsigned long long target = (unsigned long long)((double)uniform * (double)total);
            target = target < total ? target : total - 1ull;
            if (before <= target && target < before + local) {
                unsigned long long acc = before;
                for (int i = begin; i < end; ++i) {
                    const float w = weight(x[i], m, temperature);
                    acc += __float_as_uint(w) >= floor ? fixed_weight(w) : 0ull;
                    if (acc > target) {
                        chosen = i;
                        break;
                    }
                }
            }
        }
        __syncthreads();
        if (chosen >= 0) {
            token = chosen;
        }
    }

    // 4. The token and its raw logprob.
    if (threadIdx.x == 0) {
        out_token[row] = token;
        float lp = nan;
        if (n_top >= 0 && token >= 0) {
            float raw = x[token];
            for (int j = a0; j < a1; ++j) {
                if (adjust_token[j] == token) {
                    raw = adjust_raw[j];
                    break;
                }
            }
            lp = raw - log_z;
        }
        out_logprob[row] = lp;
    }
}
