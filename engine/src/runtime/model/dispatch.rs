//! The transformer on whichever backend its device picked, and that backend's KV store:
//! what every driver (serve, generate, profile, the tests) steps.

use anyhow::{bail, Result};
use candle_core::DType;

use super::config::ModelConfig;
use super::transformer::Transformer;
use super::weights::WeightStore;
use crate::runtime::backend::cpu::{CpuBackend, CpuKv};
#[cfg(feature = "cuda")]
use crate::runtime::backend::cuda::{CudaBackend, CudaKv};
use crate::runtime::backend::gemv_choice::GemvMode;
use crate::runtime::backend::{Backend, Device, Logits};
use crate::runtime::batch::ForwardBatch;
use infer_core::workload::KvCacheDtype;
use infer_kernels::sampling::{SampledRows, SamplingBatch};

// One model per process, moved once: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
pub enum Model {
    Cpu(Transformer<CpuBackend>),
    #[cfg(feature = "cuda")]
    Cuda(Transformer<CudaBackend>),
}

/// The paged KV store of a [`Model`], made by [`Model::new_kv_cache`].
pub enum KvCache {
    Cpu(CpuKv),
    #[cfg(feature = "cuda")]
    Cuda(CudaKv),
}

/// `$body` with `$m` the model's transformer and `$k` its KV store, on whichever backend.
macro_rules! with_kv {
    ($model:expr, $kv:expr, |$m:ident, $k:ident| $body:expr) => {
        #[allow(unreachable_patterns)]
        match ($model, $kv) {
            (Model::Cpu($m), KvCache::Cpu($k)) => $body,
            #[cfg(feature = "cuda")]
            (Model::Cuda($m), KvCache::Cuda($k)) => $body,
            _ => bail!("the KV cache was made for another device"),
        }
    };
}

impl Model {
    /// Builds the model for `device` from weights loaded on the host.
    pub fn load(cfg: &ModelConfig, w: &WeightStore, device: Device) -> Result<Self> {
        match device {
            Device::Cpu => Ok(Model::Cpu(Transformer::load(
                cfg,
                w,
                CpuBackend::new(w.dtype())?,
            )?)),
            #[cfg(feature = "cuda")]
            Device::Cuda(ordinal) => {
                let m = Transformer::load(cfg, w, CudaBackend::new(ordinal)?)?;
                m.backend().choose_gemv();
                Ok(Model::Cuda(m))
            }
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => {
                bail!("--device {device}: this build has no CUDA backend (build with --features cuda)")
            }
        }
    }

    pub fn config(&self) -> &ModelConfig {
        match self {
            Model::Cpu(m) => m.config(),
            #[cfg(feature = "cuda")]
            Model::Cuda(m) => m.config(),
        }
    }

    /// The dtype linear and embedding weights are held in.
    pub fn weight_dtype(&self) -> DType {
        match self {
            Model::Cpu(m) => m.backend().weight_dtype(),
            #[cfg(feature = "cuda")]
            Model::Cuda(_) => DType::BF16,
        }
    }

    /// What the KV caches made from now on store (vLLM's `--kv-cache-dtype`): before the
    /// first cache is made.
    pub fn set_kv_cache_dtype(&mut self, dtype: KvCacheDtype) {
        match self {
            Model::Cpu(m) => m.backend_mut().set_kv_cache_dtype(dtype),
            #[cfg(feature = "cuda")]
            Model::Cuda(m) => m.backend_mut().set_kv_cache_dtype(dtype),
        }
    }

    /// The dtype the KV cache is held in.
    pub fn kv_dtype(&self) -> DType {
        match self {
            Model::Cpu(m) => m.backend().kv_dtype(),
            #[cfg(feature = "cuda")]
            Model::Cuda(m) => m.backend().kv_dtype(),
        }
    }

    pub fn device(&self) -> Device {
        match self {
            Model::Cpu(_) => Device::Cpu,
            #[cfg(feature = "cuda")]
            Model::Cuda(m) => Device::Cuda(m.backend().ordinal()),
        }
    }

    /// Bytes of one KV block of `block_size` tokens (K and V, every layer).
    pub fn kv_bytes_per_block(&self, block_size: usize) -> usize {
        let c = self.config();
        2 * c.num_layers
            * block_size
            * c.num_kv_heads
            * c.head_dim
            * self.kv_dtype().size_in_bytes()
    }

    /// (free, total) bytes of the device's memory; `None` on the CPU.
    pub fn device_memory(&self) -> Result<Option<(usize, usize)>> {
        match self {
            Model::Cpu(_) => Ok(None),
            #[cfg(feature = "cuda")]
            Model::Cuda(m) => Ok(Some(m.backend().memory()?)),
        }
    }

    /// Bytes held for step activations (the CUDA arena, grown to the largest step so far);
    /// `None` where activations are allocated per step (the CPU).
    pub fn activation_bytes(&self) -> Option<usize> {
        match self {
            Model::Cpu(_) => None,
            #[cfg(feature = "cuda")]
            Model::Cuda(m) => Some(m.backend().activation_bytes()),
        }
    }

    /// The row counts a step's GEMMs run at, for steps of 1..=`max_rows` rows: the CUDA
    /// backend's buckets ([`infer_kernels::cuda::Gemm::padded_rows`]), in increasing order;
    /// empty on the CPU, which has no per-shape start-up cost to pay ahead.
    pub fn gemm_row_buckets(&self, max_rows: usize) -> Vec<usize> {
        match self {
            Model::Cpu(_) => {
                let _ = max_rows;
                Vec::new()
            }
            #[cfg(feature = "cuda")]
            Model::Cuda(_) => {
                let mut buckets: Vec<usize> = (1..=max_rows)
                    .map(infer_kernels::cuda::Gemm::padded_rows)
                    .collect();
                buckets.dedup();
                buckets
            }
        }
    }

    /// Where the CUDA backend runs decode batches' GEMMs from now on: the skinny kernel where
    /// it was timed faster at load (the default), everywhere it applies, or nowhere (cuBLAS).
    /// Graphs captured before keep the GEMMs they were captured with.
    pub fn set_gemv_mode(&self, mode: GemvMode) -> Result<()> {
        match self {
            Model::Cpu(_) => {
                let _ = mode;
                bail!("the skinny GEMM kernel needs a CUDA device")
            }
            #[cfg(feature = "cuda")]
            Model::Cuda(m) => {
                m.backend().set_gemv_mode(mode);
                Ok(())
            }
        }
    }

    /// Launches kernels with programmatic dependent launch from now on, or not: only where
    /// the GPU, the compiled code and the driver allow it (sm_90+, CUDA 12.3+; the default
    /// there unless `INFER_PDL=0`). Graphs captured before keep how they were launched.
    pub fn set_programmatic_launch(&self, on: bool) -> Result<()> {
        match self {
            Model::Cpu(_) => {
                let _ = on;
                bail!("programmatic dependent launch needs a CUDA device")
            }
            #[cfg(feature = "cuda")]
            Model::Cuda(m) => {
                m.backend().set_programmatic_launch(on);
                Ok(())
            }
        }
    }

    /// How the CUDA backend launches its work, for the start-up log: the GEMMs chosen for
    /// decode batches at load, and whether kernels use programmatic dependent launch; `None`
    /// on the CPU.
    pub fn launch_description(&self) -> Option<String> {
        match self {
            Model::Cpu(_) => None,
            #[cfg(feature = "cuda")]
            Model::Cuda(m) => Some(format!(
                "{}\nprogrammatic dependent launch: {}",
                m.backend().gemv_choice().describe(),
                if m.backend().programmatic_launch() {
                    "on"
                } else {
                    "off (needs sm_90+ and a CUDA 12.3+ driver; INFER_PDL=0 turns it off)"
                }
            )),
        }
    }

    /// Replays decode steps of up to `max_batch` sequences of at most `max_context` tokens
    /// from CUDA graphs. Only the CUDA backend has graphs.
    pub fn enable_cuda_graphs(&self, max_batch: usize, max_context: usize) -> Result<()> {
        match self {
            Model::Cpu(_) => {
                let _ = (max_batch, max_context);
                bail!("CUDA graphs need a CUDA device")
            }
            #[cfg(feature = "cuda")]
            Model::Cuda(m) => {
                m.backend().set_cuda_graphs(max_batch, max_context);
                Ok(())
            }
        }
    }

    /// The decode batch sizes that run from a CUDA graph of their own (none on the CPU or
    /// with graphs off).
    pub fn cuda_graph_buckets(&self) -> Vec<usize> {
        match self {
            Model::Cpu(_) => Vec::new(),
            #[cfg(feature = "cuda")]
            Model::Cuda(m) => match m.backend().cuda_graph_max_batch() {
                Some(max) => crate::runtime::backend::step_inputs::GRAPH_BUCKETS
                    .into_iter()
                    .filter(|&b| b <= max)
                    .collect(),
                None => Vec::new(),
            },
        }
    }

    /// A KV store of `num_blocks` blocks of `block_size` slots, shaped for this model.
    pub fn new_kv_cache(&self, num_blocks: usize, block_size: usize) -> Result<KvCache> {
        Ok(match self {
            Model::Cpu(m) => KvCache::Cpu(m.new_kv_cache(num_blocks, block_size)?),
            #[cfg(feature = "cuda")]
            Model::Cuda(m) => KvCache::Cuda(m.new_kv_cache(num_blocks, block_size)?),
        })
    }

    /// Runs one step: writes the batch's new K/V into `kv` and returns the f32 logits of
    /// the sequences with `sample == true`, in batch order.
    /// A step that leaves the device unusable fails with
    /// [`crate::runtime::backend::DeviceLost`] in its chain.
    pub fn forward(&self, batch: &ForwardBatch, kv: &mut KvCache) -> Result<Logits> {
        match self {
            Model::Cpu(_) => self.forward_unclassified(batch, kv),
            #[cfg(feature = "cuda")]
            Model::Cuda(_) => self
                .forward_unclassified(batch, kv)
                .map_err(crate::runtime::backend::cuda::classify_step_error),
        }
    }

    fn forward_unclassified(&self, batch: &ForwardBatch, kv: &mut KvCache) -> Result<Logits> {
        with_kv!(self, kv, |m, k| m.forward(batch, k))
    }

    /// Runs one step as [`Self::forward`] does and samples its rows where the logits are
    /// (see [`Self::enable_device_sampling`]): only the choices come back. `rows` packs the
    /// rows once the step is queued (see `Transformer::forward_sampled`).
    pub fn forward_sampled(
        &self,
        batch: &ForwardBatch,
        kv: &mut KvCache,
        rows: &mut dyn FnMut() -> Result<SamplingBatch>,
    ) -> Result<SampledRows> {
        let out = self.forward_sampled_unclassified(batch, kv, rows);
        match self {
            Model::Cpu(_) => out,
            #[cfg(feature = "cuda")]
            Model::Cuda(_) => out.map_err(crate::runtime::backend::cuda::classify_step_error),
        }
    }

    fn forward_sampled_unclassified(
        &self,
        batch: &ForwardBatch,
        kv: &mut KvCache,
        rows: &mut dyn FnMut() -> Result<SamplingBatch>,
    ) -> Result<SampledRows> {
        with_kv!(self, kv, |m, k| m.forward_sampled(batch, k, rows))
    }

    /// Samples on the GPU from now on: the engine sends each step's sampling parameters
    /// and gets token ids (and the logprobs asked for) back, not the logits. Only the CUDA
    /// backend samples on its device (a grammar's mask goes with its row); requests with
    /// prompt logprobs still take their step's logits to the host.
    pub fn enable_device_sampling(&self) -> Result<()> {
        match self {
            Model::Cpu(_) => bail!("device sampling needs a CUDA device"),
            #[cfg(feature = "cuda")]
            Model::Cuda(m) => {
                m.backend().set_device_sampling(true);
                Ok(())
            }
        }
    }

    /// Whether [`Self::enable_device_sampling`] was called.
    pub fn samples_on_device(&self) -> bool {
        match self {
            Model::Cpu(_) => false,
            #[cfg(feature = "cuda")]
            Model::Cuda(m) => m.backend().device_sampling(),
        }
    }

    /// Copies the KV of block `src` into block `dst` in every layer (copy-on-write of a
    /// shared prefix block).
    pub fn copy_block(&self, kv: &mut KvCache, src: u32, dst: u32) -> Result<()> {
        with_kv!(self, kv, |m, k| m.copy_block(k, src as usize, dst as usize))
    }

    /// Fills every slot with deterministic values of the magnitude real K and V have, so
    /// that a profile's reads touch real memory (a fresh store is zero pages).
    pub fn fill_pattern(&self, kv: &mut KvCache) -> Result<()> {
        with_kv!(self, kv, |m, k| m.backend().fill_pattern(k))
    }
}

impl KvCache {
    /// Bytes held by the store (K and V, all layers).
    pub fn size_bytes(&self) -> usize {
        match self {
            KvCache::Cpu(k) => CpuBackend::kv_bytes(k),
            #[cfg(feature = "cuda")]
            KvCache::Cuda(k) => CudaBackend::kv_bytes(k),
        }
    }

    pub fn num_blocks(&self) -> usize {
        self.layout().num_blocks
    }

    pub fn block_size(&self) -> usize {
        self.layout().block_size
    }

    fn layout(&self) -> crate::runtime::backend::KvLayout {
        match self {
            KvCache::Cpu(k) => CpuBackend::kv_layout(k),
            #[cfg(feature = "cuda")]
            KvCache::Cuda(k) => CudaBackend::kv_layout(k),
        }
    }
}
