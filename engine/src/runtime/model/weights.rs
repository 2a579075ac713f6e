//! Tensors of a model directory: one `model.safetensors`, or shards listed by
//! `model.safetensors.index.json`. Every error names the file (and tensor) it is about.

use anyhow::{bail, ensure, Context, Result};
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

pub struct WeightStore {
    files: Vec<(PathBuf, MmapedSafetensors)>,
    /// tensor name -> index into `files`.
    location: HashMap<String, usize>,
    dtype: DType,
    /// Names [`Self::get`] has loaded: what is left once a model is built are weights it
    /// did not use ([`Self::unread`]).
    read: Mutex<HashSet<String>>,
}

impl WeightStore {
    /// Opens the weights of `dir`, converting tensors to `dtype` on the host as they load
    /// (a backend then takes them where it computes).
    pub fn open(dir: &Path, dtype: DType) -> Result<Self> {
        let index = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let paths: Vec<PathBuf> = if index.exists() {
            shard_paths(&index)?
        } else if single.exists() {
            vec![single]
        } else {
            bail!(
                "missing weights: neither {} nor {} exists",
                single.display(),
                index.display()
            );
        };
        let mut files = Vec::with_capacity(paths.len());
        let mut location = HashMap::new();
        for (i, path) in paths.into_iter().enumerate() {
            ensure!(path.exists(), "missing weight file {}", path.display());
            // SAFETY: the file is mapped read-only; as with every mmap-based loader, it must
            // not be truncated while the model is loaded.
            let st = unsafe { MmapedSafetensors::new(&path) }
                .map_err(|e| anyhow::anyhow!("corrupt safetensors file {}: {e}", path.display()))?;
            for (name, _) in st.tensors() {
                location.insert(name, i);
            }
            files.push((path, st));
        }
        Ok(Self {
            files,
            location,
            dtype,
            read: Mutex::default(),
        })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.locate(name).is_some()
    }

    /// The stored name of the text model's tensor `name`: as named, or under a multimodal
    /// checkpoint's language-model prefix (`language_model.model.layers.0...` as
    /// gemma-3-4b-it ships it, `model.language_model.layers.0...` as transformers 5 saves
    /// it), and its file.
    fn locate(&self, name: &str) -> Option<(String, usize)> {
        let mut candidates = vec![name.to_string(), format!("language_model.{name}")];
        if let Some(rest) = name.strip_prefix("model.") {
            candidates.push(format!("model.language_model.{rest}"));
        }
        candidates
            .into_iter()
            .find_map(|n| self.location.get(&n).map(|&i| (n, i)))
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Loads `name`, checking that its shape is `shape`.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let Some((stored, i)) = self.locate(name) else {
            let files: Vec<_> = self
                .files
                .iter()
                .map(|(p, _)| p.display().to_string())
                .collect();
            bail!("tensor `{name}` not found in {}", files.join(", "));
        };
        let (path, st) = &self.files[i];
        let name = stored.as_str();
        let view = st
            .get(name)
            .with_context(|| format!("reading `{name}` from {}", path.display()))?;
        ensure!(
            view.shape() == shape,
            "shape mismatch for tensor `{name}` in {}: expected {shape:?}, found {:?}",
            path.display(),
            view.shape()
        );
        self.read.lock().unwrap().insert(name.to_string());
        let t = st
            .load(name, &Device::Cpu)
            .map_err(|e| anyhow::anyhow!("corrupt tensor `{name}` in {}: {e}", path.display()))?;
        Ok(t.to_dtype(self.dtype)?)
    }
}

impl WeightStore {
    /// The tensors no [`Self::get`] has loaded, sorted.
    pub fn unread(&self) -> Vec<&str> {
        let read = self.read.lock().unwrap();
        let mut left: Vec<&str> = self
            .location
            .keys()
            .filter(|n| !read.contains(*n))
            .map(String::as_str)
            .collect();
        left.sort_unstable();
        left
    }
}

/// The distinct shard files named by an index's `weight_map`, in first-seen order.
fn shard_paths(index: &Path) -> Result<Vec<PathBuf>> {
    let text = std::fs::read_to_string(index)
        .with_context(|| format!("cannot read {}", index.display()))?;
    let json: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", index.display()))?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .with_context(|| format!("{} has no `weight_map` object", index.display()))?;
    let dir = index.parent().unwrap_or(Path::new("."));
    let mut seen = Vec::<String>::new();
    for file in map.values() {
        let file = file
            .as_str()
            .with_context(|| format!("non-string file name in {}", index.display()))?;
        if !seen.iter().any(|f| f == file) {
            seen.push(file.to_string());
        }
    }
    Ok(seen.into_iter().map(|f| dir.join(f)).collect())
}
