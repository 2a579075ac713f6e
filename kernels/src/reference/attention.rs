//! Paged attention: queries attend to K/V stored in the paged pool through block tables.
//!
//! The caller has already written the current step's K/V into the pool (reshape_and_cache), so
//! a query at position `p` reads keys `first_visible(p) ..= p` of its own sequence from the pool.
//! This reference computes each query row independently with a plain two-pass softmax
//! (max, then sum of exponentials) so that it checks the kernels' online softmax rather than
//! repeating it.
//!
//! Bounds, as the kernels: a key whose block-table entry is not a block of the pool (outside
//! `[0, num_blocks)`) or whose logical block lies past the table row is skipped, and a query
//! that sees no key at all outputs zeros. Scores are soft-capped when `cfg.softcap` is set.

use super::elementwise::softcap;
use crate::layout::{AttentionConfig, BlockTables, KvCacheShape};

/// One layer's K and V pools, each shaped by `shape`.
#[derive(Clone, Copy, Debug)]
pub struct PagedKv<'a> {
    pub k_cache: &'a [f32],
    pub v_cache: &'a [f32],
    pub shape: KvCacheShape,
}

/// Decode: one query token per sequence.
///
/// `q`, `out`: `[num_seqs, num_heads, head_dim]`. `seq_lens[s]`: tokens of sequence `s` in the
/// pool, the query's own included (so the query is at position `seq_lens[s] - 1`); a length
/// `<= 0` marks a padding entry, whose output row is zeros.
pub fn paged_attention_decode(
    out: &mut [f32],
    q: &[f32],
    kv: &PagedKv,
    tables: &BlockTables,
    seq_lens: &[i32],
    cfg: &AttentionConfig,
) {
    let row = cfg.num_heads * cfg.head_dim;
    assert_eq!(q.len(), seq_lens.len() * row);
    assert_eq!(out.len(), q.len());
    for (s, &len) in seq_lens.iter().enumerate() {
        if len <= 0 {
            out[s * row..][..row].fill(0.0);
            continue;
        }
        let pos = len as usize - 1;
        attend_token(
            &mut out[s * row..][..row],
            &q[s * row..][..row],
            kv,
            tables,
            s,
            pos,
            cfg,
        );
    }
}

/// Decode as the CUDA kernel runs it when `splits > 1` (flash-decoding): each (sequence, head)
/// pair's visible keys are cut into `splits` ranges by [`crate::decode_split::split_keys`],
/// each range's softmax state (max, sum of exponentials, unnormalised value sum) computed on
/// its own, then the states merged, rescaled to the largest max. Equal to
/// [`paged_attention_decode`] up to rounding: what checks, without a GPU, that the ranges
/// leave out no key and the merge weighs them right.
pub fn paged_attention_decode_split(
    out: &mut [f32],
    q: &[f32],
    kv: &PagedKv,
    tables: &BlockTables,
    seq_lens: &[i32],
    cfg: &AttentionConfig,
    splits: usize,
) {
    let (d, row) = (cfg.head_dim, cfg.num_heads * cfg.head_dim);
    let shape = &kv.shape;
    assert_eq!(q.len(), seq_lens.len() * row);
    assert_eq!(out.len(), q.len());
    for (s, &len) in seq_lens.iter().enumerate() {
        out[s * row..][..row].fill(0.0);
        if len <= 0 {
            continue;
        }
        let pos = len as usize - 1;
        for h in 0..cfg.num_heads {
            let kv_head = cfg.kv_head(h);
            let q_h = &q[s * row + h * d..][..d];
            // Each split's state: (max, sum, accumulator); empty splits are left out.
            let states: Vec<(f32, f32, Vec<f32>)> = (0..splits)
                .filter_map(|z| {
                    crate::decode_split::split_keys(cfg.first_visible(pos), pos, z, splits)
                })
                .filter_map(|keys| {
                    let slots: Vec<usize> = keys
                        .filter_map(|j| tables.slot_checked(s, j, shape))
                        .collect();
                    let scores: Vec<f32> = slots
                        .iter()
                        .map(|&slot| {
                            let k = &kv.k_cache[shape.offset(slot, kv_head)..][..d];
                            let dot: f32 = q_h.iter().zip(k).map(|(a, b)| a * b).sum();
                            softcap(cfg.scale * dot, cfg.softcap)
                        })
                        .collect();
                    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    if max == f32::NEG_INFINITY {
                        return None;
                    }
                    let mut acc = vec![0.0; d];
                    let mut sum = 0.0;
                    for (&slot, score) in slots.iter().zip(&scores) {
                        let w = (score - max).exp();
                        sum += w;
                        let v = &kv.v_cache[shape.offset(slot, kv_head)..][..d];
                        for i in 0..d {
                            acc[i] += w * v[i];
                        }
                    }
                    Some((max, sum, acc))
                })
                .collect();
            let max = states.iter().map(|s| s.0).fold(f32::NEG_INFINITY, f32::max);
            let total: f32 = states.iter().map(|(m, sum, _)| sum * (m - max).exp()).sum();
            let out_h = &mut out[s * row + h * d..][..d];
            for (m, _, acc) in &states {
                let w = (m - max).exp() / total;
                for i in 0..d {
                    out_h[i] += w * acc[i];
                }
            }
        }
    }
}

/// Prefill (a chunk of each sequence's prompt), causal within the chunk and over the cached
/// prefix before it.
///
/// `q`, `out`: `[num_tokens, num_heads, head_dim]`, sequences packed one after another;
/// sequence `s` owns tokens `cu_seqlens_q[s] .. cu_seqlens_q[s + 1]` (`num_seqs + 1` entries,
/// starting at 0) and its first query token is at position `start_pos[s]` (the number of its
/// tokens already cached before this chunk, e.g. a prefix-cache hit or earlier chunks).
pub fn paged_attention_prefill(
    out: &mut [f32],
    q: &[f32],
    kv: &PagedKv,
    tables: &BlockTables,
    cu_seqlens_q: &[i32],
    start_pos: &[i32],
    cfg: &AttentionConfig,
) {
    let row = cfg.num_heads * cfg.head_dim;
    assert_eq!(cu_seqlens_q.len(), start_pos.len() + 1);
    assert_eq!(q.len(), *cu_seqlens_q.last().unwrap() as usize * row);
    assert_eq!(out.len(), q.len());
    for s in 0..start_pos.len() {
        for t in cu_seqlens_q[s] as usize..cu_seqlens_q[s + 1] as usize {
            let pos = start_pos[s] as usize + t - cu_seqlens_q[s] as usize;
            attend_token(
                &mut out[t * row..][..row],
                &q[t * row..][..row],
                kv,
                tables,
                s,
                pos,
                cfg,
            );
        }
    }
}

/// All heads of one query token of sequence `seq` at position `pos`.
fn attend_token(
    out: &mut [f32],
    q: &[f32],
    kv: &PagedKv,
    tables: &BlockTables,
    seq: usize,
    pos: usize,
    cfg: &AttentionConfig,
) {
    let d = cfg.head_dim;
    let shape = &kv.shape;
    assert_eq!(shape.head_dim, d);
    assert_eq!(shape.num_kv_heads, cfg.num_kv_heads);
    let slots: Vec<usize> = (cfg.first_visible(pos)..=pos)
        .filter_map(|j| tables.slot_checked(seq, j, shape))
        .collect();
    for h in 0..cfg.num_heads {
        let kv_head = cfg.kv_head(h);
        let q_h = &q[h * d..][..d];
        let scores: Vec<f32> = slots
            .iter()
            .map(|&slot| {
                let k = &kv.k_cache[shape.offset(slot, kv_head)..][..d];
                let score = cfg.scale * q_h.iter().zip(k).map(|(a, b)| a * b).sum::<f32>();
                softcap(score, cfg.softcap)
            })
            .collect();
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let weights: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
        let total: f32 = weights.iter().sum();
        let out_h = &mut out[h * d..][..d];
        out_h.fill(0.0);
        if slots.is_empty() {
            continue;
        }
        for (&slot, w) in slots.iter().zip(&weights) {
            let v = &kv.v_cache[shape.offset(slot, kv_head)..][..d];
            for i in 0..d {
                out_h[i] += w / total * v[i];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::reshape_and_cache;

    /// Textbook attention over contiguous per-sequence K/V (`[len, num_kv_heads, d]`), used as
    /// the oracle for the paged versions.
    fn naive_attention(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        pos: usize,
        cfg: &AttentionConfig,
    ) -> Vec<f32> {
        let (d, hk) = (cfg.head_dim, cfg.num_kv_heads);
        let mut out = vec![0.0; cfg.num_heads * d];
        for h in 0..cfg.num_heads {
            let g = cfg.kv_head(h);
            let keys = cfg.first_visible(pos)..=pos;
            let logits: Vec<f32> = keys
                .clone()
                .map(|j| {
                    (0..d)
                        .map(|i| q[h * d + i] * k[(j * hk + g) * d + i])
                        .sum::<f32>()
                        * cfg.scale
                })
                .map(|l| softcap(l, cfg.softcap))
                .collect();
            let probs: Vec<f32> = {
                let e: Vec<f32> = logits.iter().map(|l| l.exp()).collect();
                let sum: f32 = e.iter().sum();
                e.iter().map(|x| x / sum).collect()
            };
            for (p, j) in probs.iter().zip(keys) {
                for i in 0..d {
                    out[h * d + i] += p * v[(j * hk + g) * d + i];
                }
            }
        }
        out
    }

    /// Deterministic pseudo-random values in [-1, 1).
    fn values(n: usize, seed: u32) -> Vec<f32> {
        let mut state = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
        (0..n)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                (state >> 8) as f32 / (1u32 << 23) as f32 - 1.0
            })
            .collect()
    }

    fn assert_close(a: &[f32], b: &[f32]) {
        assert_eq!(a.len(), b.len());
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!((x - y).abs() < 1e-5, "element {i}: {x} vs {y}");
        }
    }

    #[test]
    fn hand_computed_two_keys() {
        // d = 2, scale 1, q = (1, 0), keys (0, 0) and (ln 3, 0): weights 1/4 and 3/4.
        let shape = KvCacheShape {
            num_blocks: 1,
            block_size: 2,
            num_kv_heads: 1,
            head_dim: 2,
        };
        let k = [0.0, 0.0, 3f32.ln(), 0.0];
        let v = [4.0, 0.0, 0.0, 8.0];
        let kv = PagedKv {
            k_cache: &k,
            v_cache: &v,
            shape,
        };
        let tables = BlockTables {
            table: &[0],
            max_blocks_per_seq: 1,
        };
        let cfg = AttentionConfig {
            scale: 1.0,
            ..AttentionConfig::new(1, 1, 2)
        };
        let mut out = [0.0; 2];
        paged_attention_decode(&mut out, &[1.0, 0.0], &kv, &tables, &[2], &cfg);
        assert_close(&out, &[1.0, 6.0]);
        // Window 1: the query sees only its own token.
        let cfg = cfg.with_sliding_window(1);
        paged_attention_decode(&mut out, &[1.0, 0.0], &kv, &tables, &[2], &cfg);
        assert_close(&out, &[0.0, 8.0]);
        // Soft-cap 1: scores 0 and tanh(ln 3) = 0.8, so weights 1 : e^0.8.
        let cfg = AttentionConfig {
            sliding_window: None,
            ..cfg
        }
        .with_softcap(1.0);
        paged_attention_decode(&mut out, &[1.0, 0.0], &kv, &tables, &[2], &cfg);
        let w1 = 0.8f32.exp() / (1.0 + 0.8f32.exp());
        assert_close(&out, &[4.0 * (1.0 - w1), 8.0 * w1]);
    }

    /// Bad block ids are skipped, a query with no valid key and a padding sequence (length 0)
    /// output zeros.
    #[test]
    fn bad_blocks_and_padding() {
        let shape = KvCacheShape {
            num_blocks: 2,
            block_size: 2,
            num_kv_heads: 1,
            head_dim: 2,
        };
        // Block 0: keys (0, 0) and (ln 3, 0); block 1: never valid below.
        let k = [0.0, 0.0, 3f32.ln(), 0.0, 9.0, 9.0, 9.0, 9.0];
        let v = [4.0, 0.0, 0.0, 8.0, 100.0, 100.0, 100.0, 100.0];
        let kv = PagedKv {
            k_cache: &k,
            v_cache: &v,
            shape,
        };
        let cfg = AttentionConfig {
            scale: 1.0,
            ..AttentionConfig::new(1, 1, 2)
        };
        // Sequence 0: blocks [0, 5] -> its keys 2 and 3 are skipped. Sequence 1: [-1, 0] with
        // length 2 sees nothing. Sequence 2: padding.
        let table = [0, 5, -1, 0, 0, 0];
        let tables = BlockTables {
            table: &table,
            max_blocks_per_seq: 2,
        };
        let q = [1.0, 0.0].repeat(3);
        let mut out = [f32::NAN; 6];
        paged_attention_decode(&mut out, &q, &kv, &tables, &[4, 2, 0], &cfg);
        assert_close(&out, &[1.0, 6.0, 0.0, 0.0, 0.0, 0.0]);
        // Length 5 runs past the table row (2 blocks of 2): key 4 is skipped too.
        paged_attention_decode(&mut out[..2], &q[..2], &kv, &tables, &[5], &cfg);
        assert_close(&out[..2], &[1.0, 6.0]);
    }

    /// Flash-decoding's split and merge equal one pass over every key, for contexts far past
    /// one split's worth, any split count (more splits than tiles included), GQA, a sliding
    /// window, a soft-cap, skipped blocks and padding.
    #[test]
    fn split_decode_matches_one_pass() {
        let lens = [1i32, 40, 300, 700, 2_500, 0];
        let shape = KvCacheShape {
            num_blocks: 2 * 160,
            block_size: 16,
            num_kv_heads: 2,
            head_dim: 8,
        };
        let max_blocks_per_seq = 160; // 2,560 keys
                                      // Sequences share a scrambled pool (any block may repeat); one entry out of range.
        let mut table: Vec<i32> = (0..lens.len() * max_blocks_per_seq)
            .map(|i| ((i * 37 + 11) % shape.num_blocks) as i32)
            .collect();
        table[3 * max_blocks_per_seq + 5] = 10_000;
        let tables = BlockTables {
            table: &table,
            max_blocks_per_seq,
        };
        let (k, v) = (values(shape.len(), 1), values(shape.len(), 2));
        let kv = PagedKv {
            k_cache: &k,
            v_cache: &v,
            shape,
        };
        for (window, cap) in [(None, None), (Some(600), None), (None, Some(1.5))] {
            let mut cfg = AttentionConfig::new(4, 2, 8);
            cfg.sliding_window = window;
            cfg.softcap = cap;
            let row = cfg.num_heads * cfg.head_dim;
            let q = values(lens.len() * row, 3);
            let mut want = vec![0.0; q.len()];
            paged_attention_decode(&mut want, &q, &kv, &tables, &lens, &cfg);
            for splits in [1, 2, 3, 9, 64, 300] {
                let mut got = vec![f32::NAN; q.len()];
                paged_attention_decode_split(&mut got, &q, &kv, &tables, &lens, &cfg, splits);
                assert_close(&got, &want);
            }
        }
    }

    /// Two sequences of different lengths scattered over shuffled blocks: decode and a prefill
    /// chunk must match naive attention over the contiguous K/V, for GQA with and without a
    /// sliding window and a soft-cap.
    #[test]
    fn paged_matches_naive_attention() {
        for (window, cap) in [
            (None, None),
            (Some(5), None),
            (None, Some(0.5)),
            (Some(3), Some(2.0)),
        ] {
            let mut cfg = AttentionConfig::new(4, 2, 8);
            cfg.sliding_window = window;
            cfg.softcap = cap;
            let shape = KvCacheShape {
                num_blocks: 8,
                block_size: 4,
                num_kv_heads: 2,
                head_dim: 8,
            };
            let token = shape.num_kv_heads * shape.head_dim;
            let row = cfg.num_heads * cfg.head_dim;
            let lens = [11usize, 6];
            let table = [5, 0, 7, 0, 3, 6, 1, 0]; // max 4 blocks per sequence
            let tables = BlockTables {
                table: &table,
                max_blocks_per_seq: 4,
            };
            let mut k_cache = vec![f32::NAN; shape.len()]; // unwritten slots must never be read
            let mut v_cache = vec![f32::NAN; shape.len()];
            let mut seq_kv = Vec::new();
            for (s, &len) in lens.iter().enumerate() {
                let (k, v) = (
                    values(len * token, 10 + s as u32),
                    values(len * token, 20 + s as u32),
                );
                let slots: Vec<i32> = (0..len).map(|j| tables.slot(s, j, 4) as i32).collect();
                reshape_and_cache(&k, &v, &mut k_cache, &mut v_cache, &slots, &shape);
                seq_kv.push((k, v));
            }
            let kv = PagedKv {
                k_cache: &k_cache,
                v_cache: &v_cache,
                shape,
            };

            let q = values(2 * row, 99);
            let mut out = vec![0.0; 2 * row];
            paged_attention_decode(&mut out, &q, &kv, &tables, &[11, 6], &cfg);
            for s in 0..2 {
                let (k, v) = &seq_kv[s];
                let want = naive_attention(&q[s * row..][..row], k, v, lens[s] - 1, &cfg);
                assert_close(&out[s * row..][..row], &want);
            }

            // Prefill: sequence 0's last 3 tokens (positions 8..11), sequence 1's first 6.
            let cu = [0, 3, 9];
            let start = [8, 0];
            let q = values(9 * row, 7);
            let mut out = vec![0.0; 9 * row];
            paged_attention_prefill(&mut out, &q, &kv, &tables, &cu, &start, &cfg);
            for t in 0..9 {
                let (s, pos) = if t < 3 { (0, 8 + t) } else { (1, t - 3) };
                let (k, v) = &seq_kv[s];
                let want = naive_attention(&q[t * row..][..row], k, v, pos, &cfg);
                assert_close(&out[t * row..][..row], &want);
            }
        }
    }
}
