//! English text for training generated tokenizers: the project corpus when it has files,
//! else a short built-in text so generation still works.

include!(concat!(env!("OUT_DIR"), "/corpus.rs"));

const FALLBACK: &str = include_str!("fallback_corpus.txt");

/// The corpus texts, in a fixed order.
pub fn texts() -> Vec<&'static str> {
    if CORPUS_FILES.is_empty() {
        vec![FALLBACK]
    } else {
        CORPUS_FILES.iter().map(|(_, t)| *t).collect()
    }
}

/// A short stable hash of the corpus (FNV-1a), naming caches built from it.
pub fn fingerprint() -> String {
    let mut h: u64 = 0xcbf29ce484222325;
    for t in texts() {
        for b in t.bytes().chain(std::iter::once(0)) {
            h ^= b as u64;
            h = h.wrapping_mul(0x100000001b3);
        }
    }
    format!("{:08x}", h >> 32)
}
