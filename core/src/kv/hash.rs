//! The chained block hash of prefix caching: a full block is identified by its parent's hash
//! and its own tokens, so equal hashes mean equal prefixes (up to 64-bit collisions, which
//! the paged manager rules out by also comparing the stored tokens).
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
}
