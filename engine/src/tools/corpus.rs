//! English text for training generated tokenizers: the project corpus, embedded once in
//! `infer_core::workload::corpus`.

use infer_core::workload::corpus::CORPUS_FILES;

/// The corpus texts, in a fixed order.
pub fn texts() -> Vec<&'static str> {
    CORPUS_FILES.to_vec()
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
