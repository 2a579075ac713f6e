//! The chained block hash of prefix caching: a full block is identified by its parent's hash
//! and its own tokens, so equal hashes mean equal prefixes up to 64-bit collisions; the
//! paged manager also compares [`token_check`], an independent hash of the block's tokens.
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

/// A second hash of a block's tokens, independent of [`hash_block`] (other constants, other
/// mixing, no chaining): a false prefix match needs both to collide.
pub fn token_check(tokens: &[u32]) -> u64 {
    let mut h = 0x2545_f491_4f6c_dd1d ^ tokens.len() as u64;
    for &t in tokens {
        h = (h ^ t as u64)
            .wrapping_mul(0x0000_0100_0000_01b3)
            .rotate_left(29);
        h = h.wrapping_add(0x6a09_e667_f3bc_c909);
    }
    splitmix(h ^ (h >> 32))
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
    fn the_token_check_is_order_sensitive_and_unlike_the_block_hash() {
        let t = [1, 2, 3, 4];
        assert_eq!(token_check(&t), token_check(&[1, 2, 3, 4]));
        assert_ne!(token_check(&t), token_check(&[4, 3, 2, 1]));
        assert_ne!(token_check(&t), token_check(&[1, 2, 3]));
        assert_ne!(token_check(&t), hash_block(ROOT_HASH, &t));
        // Over many blocks differing in one token, no two checks agree.
        let mut seen = std::collections::HashSet::new();
        for i in 0..100_000u32 {
            assert!(seen.insert(token_check(&[7, i, 9, 11])), "{i}");
        }
    }
}
