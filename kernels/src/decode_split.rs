//! Flash-decoding's work split: how many splits a decode step runs in, and which keys each
//! split of a sequence attends.
//!
//! A decode step with few (head, sequence) pairs cannot fill the GPU with one thread block
//! per pair, so each pair's keys are cut into `splits` ranges, each attended by its own block,
//! and the last of a pair's blocks to finish merges the ranges' softmax states (counting
//! arrivals in one counter per (sequence, head) — per (sequence, KV head) in the grouped
//! kernel: [`SPLIT_COUNTERS`]; the counts are right because every launch that uses them runs
//! in order on one stream). Two rules keep it right:
//!
//! - **Every key is covered.** A split's range is cut from the sequence's own visible keys
//!   (`first..=pos`) at each step, never from a length fixed on the host: a captured CUDA graph
//!   freezes the split count, not the contexts it is replayed at.
//! - **The count depends only on shapes** (device, heads, sequences, table width), so a graph
//!   bucket keeps one grid.
//!
//! The CUDA kernel (`paged_attention.cu`, `split_keys`) computes [`split_keys`] on the device;
//! [`crate::reference::paged_attention_decode_split`] runs the same ranges and merge on the
//! CPU, so the arithmetic is tested here without a GPU.

use std::ops::RangeInclusive;

/// Keys per warp tile: a split's range is a whole number of tiles.
pub const TILE_KEYS: usize = 32;

/// Fewest keys worth a split of their own on the widest sequence: one tile for each warp
/// of an attention block (`sources::ATTENTION_WARPS` = 8).
pub const MIN_SPLIT_KEYS: usize = 8 * TILE_KEYS;

/// CUDA's limit on a grid's z dimension, where the splits go.
pub const MAX_SPLITS: usize = 65_535;

/// How many splits a decode step of `num_seqs` sequences with `num_heads` query heads runs in
/// on a device of `sm_count` multiprocessors, when the block table holds up to `max_keys` keys
/// per sequence: enough blocks for two per multiprocessor when the pairs alone are too few,
/// never so many that the widest sequence's splits hold fewer than [`MIN_SPLIT_KEYS`] keys.
/// 1: no split.
pub fn split_count(sm_count: usize, num_heads: usize, num_seqs: usize, max_keys: usize) -> usize {
    let pairs = num_heads.saturating_mul(num_seqs).max(1);
    let wanted = (2 * sm_count).div_ceil(pairs);
    let most = max_keys.div_ceil(MIN_SPLIT_KEYS).clamp(1, MAX_SPLITS);
    wanted.clamp(1, most)
}

/// Counters the fused split merge keeps: one per (head, sequence) pair of a split step. A
/// step splits only when its pairs are fewer than two blocks per multiprocessor
/// ([`split_count`]), so this holds every pair on any GPU of up to 32,768 multiprocessors,
/// and a split forced on a wider step (tests, benchmarks) up to 65,536 pairs (256 KiB).
pub const SPLIT_COUNTERS: usize = 1 << 16;

/// The keys split `split` of `splits` attends for a query at `pos` whose first visible key is
/// `first` (`first <= pos`; 0 without a sliding window): the visible keys cut into `splits`
/// consecutive ranges of the same whole number of tiles, the last ones shorter or empty.
/// `None`: this split has no key (its state is empty and the merge skips it).
pub fn split_keys(
    first: usize,
    pos: usize,
    split: usize,
    splits: usize,
) -> Option<RangeInclusive<usize>> {
    assert!(first <= pos && split < splits, "split {split} of {splits}");
    let keys = pos - first + 1;
    let per = keys.div_ceil(splits).div_ceil(TILE_KEYS) * TILE_KEYS;
    let lo = first + split * per;
    (lo <= pos).then(|| lo..=(lo + per - 1).min(pos))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Splits cover `first..=pos` exactly once, in order: each starts where the previous
    /// ended, and the non-empty ones are a prefix.
    fn assert_covers(first: usize, pos: usize, splits: usize) {
        let mut next = first;
        let mut ended = false;
        for z in 0..splits {
            match split_keys(first, pos, z, splits) {
                Some(r) => {
                    assert!(!ended, "split {z} of {splits} non-empty after an empty one");
                    assert_eq!(*r.start(), next, "split {z} of {splits} ({first}..={pos})");
                    assert!(r.end() >= r.start() && *r.end() <= pos);
                    next = r.end() + 1;
                }
                None => ended = true,
            }
        }
        assert_eq!(
            next,
            pos + 1,
            "keys {next}..={pos} not attended ({splits} splits)"
        );
    }

    /// The shapes users run: SM counts of an RTX 5080 (84) and an H100 (132), 8-64 query
    /// heads, batches 1-256, table widths up to 128k keys. The count is within bounds and the
    /// splits cover every context up to the table's width.
    #[test]
    fn splits_cover_every_key_at_the_shapes_users_run() {
        let widths = [
            1, 31, 256, 257, 600, 1_500, 2_049, 3_000, 8_000, 32_768, 131_072,
        ];
        for sm in [84, 132] {
            for heads in [8, 14, 16, 24, 28, 32, 40, 48, 64] {
                for batch in 1..=256 {
                    for &width in &widths {
                        let n = split_count(sm, heads, batch, width);
                        assert!((1..=MAX_SPLITS).contains(&n));
                        assert!(
                            n == 1 || heads * batch * (n - 1) < 2 * sm,
                            "more than needed"
                        );
                        assert!(n == 1 || heads * batch <= SPLIT_COUNTERS);
                        assert!(n == 1 || width.div_ceil(n) * 2 > MIN_SPLIT_KEYS);
                        // Contexts at and around the places the old split dropped keys.
                        for ctx in [1, 2, 33, 255, 256, 257, 513, 769, 1_281, 2_305, width] {
                            if ctx <= width {
                                assert_covers(0, ctx - 1, n);
                                // A 4,096-token sliding window (Gemma's local layers).
                                assert_covers((ctx).saturating_sub(4_096), ctx - 1, n);
                            }
                        }
                    }
                }
            }
        }
    }

    /// Every context from 1 to 128k keys under every split count a step can have.
    #[test]
    fn splits_cover_every_context_up_to_128k() {
        let most = split_count(132, 1, 1, 131_072);
        assert_eq!(most, 264);
        for splits in [1, 2, 3, 7, 33, most] {
            for ctx in 1..=131_072 {
                assert_covers(0, ctx - 1, splits);
            }
        }
    }

    proptest! {
        #[test]
        fn splits_cover_any_shape(
            sm in 1usize..200,
            heads in 1usize..=128,
            batch in 1usize..=512,
            width in 1usize..=1 << 20,
            ctx_frac in 0.0f64..=1.0,
            window in prop::option::of(1usize..=1 << 16),
        ) {
            let n = split_count(sm, heads, batch, width);
            prop_assert!((1..=MAX_SPLITS).contains(&n));
            // The merge has a counter for every pair a split step has.
            prop_assert!(n == 1 || heads * batch <= SPLIT_COUNTERS);
            let pos = ((width - 1) as f64 * ctx_frac) as usize;
            let first = window.map_or(0, |w| (pos + 1).saturating_sub(w));
            assert_covers(first, pos, n);
        }
    }

    #[test]
    fn count_fills_the_device_only_when_pairs_are_few() {
        // H100, 32 heads: batch 1 wants 9 splits (264 blocks / 32), capped by the keys.
        assert_eq!(split_count(132, 32, 1, 4_096), 9);
        assert_eq!(split_count(132, 32, 1, 1_000), 4);
        assert_eq!(split_count(132, 32, 8, 4_096), 2);
        assert_eq!(split_count(132, 32, 9, 4_096), 1);
        assert_eq!(split_count(84, 32, 1, 100), 1);
        // Never more than the grid allows, whatever the shapes.
        assert_eq!(split_count(usize::MAX / 4, 1, 1, usize::MAX), MAX_SPLITS);
    }

    #[test]
    fn ranges_are_whole_tiles_from_the_first_visible_key() {
        assert_eq!(split_keys(0, 99, 0, 3), Some(0..=63));
        assert_eq!(split_keys(0, 99, 1, 3), Some(64..=99));
        assert_eq!(split_keys(0, 99, 2, 3), None);
        assert_eq!(split_keys(10, 10, 0, 4), Some(10..=10));
        assert_eq!(split_keys(10, 10, 1, 4), None);
        // 2,305 keys over 9 splits: 257 each, rounded to 288; the last split takes the rest.
        assert_eq!(split_keys(0, 2_304, 8, 9), Some(2_304..=2_304));
    }
}
