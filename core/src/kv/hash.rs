//! The chained block hash of prefix caching: a full block is identified by its parent's hash
//! and its own tokens, so equal hashes mean equal prefixes up to 64-bit collisions; the
//! paged manager also compares [`block_check`], an independent hash of the same input.
//!
//! A fixed, portable function (no per-process random seed): the same tokens hash the same
//! in every run, which determinism and cross-replica routing need.

/// Parent hash of a sequence's first block.
pub const ROOT_HASH: u64 = 0x9e37_79b9_7f4a_7c15;

/// Hash of a full block of `tokens` whose preceding block hashed to `parent`.
pub fn hash_block(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = parent ^ (tokens.len() as u64).wrapping_mul(0xff51_afd7_ed55_8ccd);
    for &t in tokens {
        h = (h.rotate_left(23) ^ t as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
    splitmix(h)
}

/// A second, 32-bit hash of a block's parent hash and tokens, independent of [`hash_block`]
/// (other constants, other mixing): a false prefix match needs both to collide.
pub fn block_check(parent: u64, tokens: &[u32]) -> u32 {
    let mut h = 0x2545_f491_4f6c_dd1d ^ tokens.len() as u64 ^ parent.rotate_left(31);
    for &t in tokens {
        h = (h ^ t as u64)
            .wrapping_mul(0x0000_0100_0000_01b3)
            .rotate_left(29);
        h = h.wrapping_add(0x6a09_e667_f3bc_c909);
    }
    (splitmix(h ^ (h >> 32)) >> 32) as u32
}

fn splitmix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chained_and_order_sensitive() {
        let a = hash_block(ROOT_HASH, &[1, 2, 3, 4]);
        assert_eq!(a, hash_block(ROOT_HASH, &[1, 2, 3, 4]));
        assert_ne!(a, hash_block(ROOT_HASH, &[4, 3, 2, 1]));
        assert_ne!(
            hash_block(a, &[5, 6, 7, 8]),
            hash_block(ROOT_HASH, &[5, 6, 7, 8])
        );
    }

    #[test]
    fn the_block_check_sees_parent_and_order_and_is_unlike_the_block_hash() {
        let t = [1, 2, 3, 4];
        let c = block_check(ROOT_HASH, &t);
        assert_eq!(c, block_check(ROOT_HASH, &[1, 2, 3, 4]));
        assert_ne!(c, block_check(ROOT_HASH, &[4, 3, 2, 1]));
        assert_ne!(c, block_check(ROOT_HASH, &[1, 2, 3]));
        assert_ne!(c, block_check(ROOT_HASH ^ 1, &t));
        assert_ne!(c as u64, hash_block(ROOT_HASH, &t) >> 32);
        // Over 20,000 blocks differing in one token, 32-bit checks collide with
        // probability ~5%: allow one, not a pattern.
        let mut seen = std::collections::HashSet::new();
        let collisions = (0..20_000u32)
            .filter(|&i| !seen.insert(block_check(ROOT_HASH, &[7, i, 9, 11])))
            .count();
        assert!(collisions <= 1, "{collisions}");
    }
}
