//! `builtin:tiny`: a small Llama built on first use into a cache directory, so the engine
//! runs with no model files. The directory name carries the corpus fingerprint, so a
//! changed corpus builds a new model instead of reusing a stale tokenizer.

use crate::runtime::model::Arch;
use crate::tools::make_model::{make_model, ModelSpec};
use anyhow::{bail, Context, Result};
use std::path::PathBuf;

pub const TINY: &str = "builtin:tiny";

/// The spec of `builtin:tiny` (about 4.5M parameters).
pub fn tiny_spec() -> ModelSpec {
    ModelSpec {
        layers: 4,
        hidden: 256,
        heads: 4,
        kv_heads: 2,
        intermediate: 768,
        vocab: 4096,
        max_pos: 4096,
        seed: 0,
        ..ModelSpec::new(Arch::Llama)
    }
}

/// Where generated models are cached: `$INFER_CACHE`, else `~/.cache/infer`.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("INFER_CACHE") {
        return PathBuf::from(dir);
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    home.join(".cache").join("infer")
}

/// A model spec → its directory: paths are returned as is, `builtin:*` names are built
/// into the cache if needed.
pub fn resolve(spec: &str) -> Result<PathBuf> {
    let Some(name) = spec.strip_prefix("builtin:") else {
        return Ok(PathBuf::from(spec));
    };
    if name != "tiny" {
        bail!("unknown builtin model `{spec}` (available: {TINY})");
    }
    let dir = cache_dir().join(format!(
        "builtin-tiny-v1-{}",
        crate::tools::corpus::fingerprint()
    ));
    if dir.join("model.safetensors").exists() {
        return Ok(dir);
    }
    // Build beside the target and rename, so a concurrent or interrupted build never
    // leaves a half-written model where a reader would take it.
    // Unique per process and per call: tests build it from several threads at once.
    static BUILDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = BUILDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.with_extension(format!("tmp{}-{n}", std::process::id()));
    make_model(&tiny_spec(), &tmp)
        .with_context(|| format!("building {TINY} in {}", tmp.display()))?;
    match std::fs::rename(&tmp, &dir) {
        Ok(()) => Ok(dir),
        Err(_) if dir.join("model.safetensors").exists() => {
            let _ = std::fs::remove_dir_all(&tmp);
            Ok(dir)
        }
        Err(e) => Err(e).with_context(|| format!("moving {} to {}", tmp.display(), dir.display())),
    }
}
