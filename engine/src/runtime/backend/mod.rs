//! The seam between the model and the hardware it runs on.
//!
//! The transformer (`crate::runtime::model::transformer`) is written once against [`Backend`]: a small
//! set of operations on one step's activations — embedding gather, linear, RMSNorm (fused
//! with the residual add), RoPE, KV write, paged attention, gated activation, logits. Each
//! backend owns its tensor type, its weight layout, its KV layout and its step preparation
//! (slot mapping, block tables, sequence offsets):
//!
//! - [`cpu`]: candle tensors in f32, decode attention read in place from the paged store, the
//!   engine's rayon pool;
//! - `cuda` (feature `cuda`): bf16 weights and KV on the GPU, GEMMs through cuBLAS, the rest
//!   through the NVRTC kernels of `infer-kernels`, CUDA graphs for decode steps.
//!
//! Activations are row-major `[rows, width]` matrices, one row per token of the step
//! (attention heads side by side in a row), so a backend never needs more than 2-D shapes.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod gemv_choice;
pub mod graph_set;
pub mod step_inputs;

use anyhow::{bail, Result};
use candle_core::Tensor;
use infer_kernels::sampling::{SampledRows, SamplingBatch};

use crate::runtime::batch::ForwardBatch;
use crate::runtime::model::config::Activation;

/// Where a model runs: `cpu`, `cuda` or `cuda:N`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Device {
    #[default]
    Cpu,
    Cuda(usize),
}

impl Device {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Ok(Device::Cuda(n)),
                _ => bail!("unknown device `{s}`: expected cpu, cuda or cuda:N"),
            },
        }
    }

    pub fn is_cpu(&self) -> bool {
        matches!(self, Device::Cpu)
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// What a loaded parameter is used for: decides the layout a backend prepares it in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// `[out, in]` as stored in HF checkpoints; multiplied as `x @ W^T`.
    Linear,
    /// A bias or any vector added to rows.
    Bias,
    /// `[vocab, hidden]`, gathered by token id.
    Embedding,
    /// An RMSNorm weight; `plus_one`: Gemma's convention, the scale is `1 + w`.
    Norm { plus_one: bool },
}

/// Attention geometry of one model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Heads {
    pub q: usize,
    pub kv: usize,
    pub dim: usize,
    /// Multiplies q·k before the softmax.
    pub scale: f32,
    /// Gemma 2's `attn_logit_softcapping`: scores become `cap * tanh(score / cap)`.
    pub softcap: Option<f32>,
}

/// One kind of attention layer: global, or sliding-window with its own RoPE table.
pub struct AttnKind<'a, R> {
    /// A query at `p` sees keys at `j` with `p - j < window` (its own token included).
    pub window: Option<usize>,
    pub rope: &'a R,
}

/// The paged KV store's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    pub num_layers: usize,
    pub num_blocks: usize,
    pub block_size: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

/// The device can no longer compute: a CUDA error that leaves the context unusable (an
/// illegal address, a failed launch, an uncorrectable ECC error…), after which every call
/// of this process fails the same way. A step that fails with it cannot be retried: the
/// server marks itself unhealthy and exits rather than fail requests forever.
#[derive(Debug)]
pub struct DeviceLost(pub String);

impl std::fmt::Display for DeviceLost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the GPU is in an unrecoverable state ({})", self.0)
    }
}

impl std::error::Error for DeviceLost {}

impl DeviceLost {
    /// Whether `e` was caused, anywhere in its chain, by a lost device.
    pub fn caused(e: &anyhow::Error) -> bool {
        e.chain().any(|c| c.is::<DeviceLost>())
    }
}

/// Whether a CUDA driver result leaves the context unusable ("the process must be
/// terminated and relaunched", as the CUDA documentation says of these codes).
pub fn cuda_error_is_sticky(code: u32) -> bool {
    matches!(
        code,
        214 // ECC_UNCORRECTABLE
            | 700 // ILLEGAL_ADDRESS
            | 702 // LAUNCH_TIMEOUT
            | 710 // ASSERT
            | 714 // HARDWARE_STACK_ERROR
            | 715 // ILLEGAL_INSTRUCTION
            | 716 // MISALIGNED_ADDRESS
            | 717 // INVALID_ADDRESS_SPACE
            | 718 // INVALID_PC
            | 719 // LAUNCH_FAILED
    )
}

/// f32 logits of the sampled rows, `[rows, vocab]`, on the host.
#[derive(Debug, Clone, PartialEq)]
pub struct Logits {
    data: Vec<f32>,
    vocab: usize,
}

impl Logits {
    pub fn new(data: Vec<f32>, vocab: usize) -> Self {
        assert!(
            vocab > 0 && data.len().is_multiple_of(vocab),
            "logits are not [rows, vocab]"
        );
        Self { data, vocab }
    }

    pub fn empty(vocab: usize) -> Self {
        Self::new(Vec::new(), vocab)
    }

    pub fn rows(&self) -> usize {
        self.data.len() / self.vocab
    }

    pub fn vocab(&self) -> usize {
        self.vocab
    }

    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.vocab..(i + 1) * self.vocab]
    }

    pub fn iter(&self) -> impl Iterator<Item = &[f32]> {
        self.data.chunks_exact(self.vocab)
    }

    /// The rows, flat.
    pub fn into_vec(self) -> Vec<f32> {
        self.data
    }
}

/// RoPE angles `[max_positions, inv_freq.len()]`, computed in f32 like HF: every backend's
/// cos/sin tables come from these.
pub(crate) fn rope_angles(inv_freq: &[f32], max_positions: usize) -> Vec<f32> {
    (0..max_positions)
        .flat_map(|p| inv_freq.iter().map(move |f| p as f32 * f))
        .collect()
}

/// The cos and sin tables of [`rope_angles`], each multiplied by `scale` (YaRN's attention
/// factor; 1 otherwise) as HF multiplies them.
pub(crate) fn rope_tables(
    inv_freq: &[f32],
    max_positions: usize,
    scale: f32,
) -> (Vec<f32>, Vec<f32>) {
    let angles = rope_angles(inv_freq, max_positions);
    (
        angles.iter().map(|a| a.cos() * scale).collect(),
        angles.iter().map(|a| a.sin() * scale).collect(),
    )
}

/// The operations the transformer is written against. `Act` is `[rows, width]`; the model
/// decides every width, the backend how and where the numbers live.
pub trait Backend: Sized {
    /// One step's activations.
    type Act;
    /// A parameter in the layout this backend computes with.
    type Weight;
    /// RoPE cos/sin tables.
    type Rope;
    /// The paged KV store of all layers.
    type Kv;
    /// One step's inputs, prepared once and read by every layer.
    type Step;
    /// A point in a step's activation memory (see [`Backend::scratch_mark`]).
    type ScratchMark: Copy;

    /// Whether an [`Role::Embedding`] weight, as this backend stores it, also multiplies as a
    /// [`Role::Linear`] one: then a tied output head is the embedding table itself, stored
    /// once (on a GPU with a 128k vocabulary, half a gigabyte not spent twice).
    const EMBEDDING_IS_LINEAR: bool = false;

    /// Takes a parameter loaded on the host (f32, or the checkpoint's bf16).
    fn weight(&self, t: Tensor, role: Role) -> Result<Self::Weight>;
    /// Element count of a weight (its width, for vectors).
    fn weight_len(w: &Self::Weight) -> usize;
    /// Tables for positions `[0, max_positions)` from the inverse frequencies (`head_dim / 2`),
    /// cos and sin multiplied by `scale` ([`rope_tables`]).
    fn rope(&self, inv_freq: &[f32], max_positions: usize, scale: f32) -> Result<Self::Rope>;
    fn new_kv(&self, layout: KvLayout) -> Result<Self::Kv>;
    fn kv_layout(kv: &Self::Kv) -> KvLayout;

    /// Device-side inputs of `batch`, validated by the caller (token ids in range, block
    /// tables covering every position, block ids inside the pool). `kinds` are the model's
    /// attention kinds, indexed by the `kind` argument of [`Backend::rope_and_write_kv`] and
    /// [`Backend::attention`].
    fn prepare(
        &self,
        batch: &ForwardBatch,
        kv: &Self::Kv,
        kinds: &[AttnKind<'_, Self::Rope>],
    ) -> Result<Self::Step>;

    /// Runs `forward` — the step's work from the embedding to the head's output of the sampled
    /// rows — for `step`. The CUDA backend captures it into a graph per decode bucket and
    /// replays that; the others just run it.
    fn execute(
        &self,
        step: &Self::Step,
        forward: &mut dyn FnMut() -> Result<Option<Self::Act>>,
    ) -> Result<Option<Self::Act>> {
        let _ = step;
        forward()
    }

    /// Rows of `table` for the step's tokens, times `scale` when given.
    fn embed(
        &self,
        table: &Self::Weight,
        step: &Self::Step,
        scale: Option<f32>,
    ) -> Result<Self::Act>;
    /// `x @ W^T (+ bias)`.
    fn linear(
        &self,
        x: &Self::Act,
        w: &Self::Weight,
        bias: Option<&Self::Weight>,
    ) -> Result<Self::Act>;
    /// RMSNorm of every `len(w)`-wide group of each row (a whole row, or each head).
    fn rms_norm(&self, x: &Self::Act, w: &Self::Weight, eps: f32) -> Result<Self::Act>;
    /// `residual += x`, then `out` = the RMSNorm of the new residual (`out` has the
    /// residual's shape and lives across layers, so a layer's scratch can be released).
    fn add_rms_norm(
        &self,
        residual: &mut Self::Act,
        x: &Self::Act,
        w: &Self::Weight,
        eps: f32,
        out: &mut Self::Act,
    ) -> Result<()>;
    /// Where the next activation would be allocated. Activations allocated after it are
    /// scratch that [`Backend::release_scratch`] gives back for reuse: the transformer
    /// releases each layer's at the layer's end, so a step holds one layer's activations
    /// at a time, not every layer's. Backends that allocate per op need neither.
    fn scratch_mark(&self) -> Self::ScratchMark;
    /// Gives back everything allocated since `mark`; those activations must not be used
    /// again (work already queued on them still runs first).
    fn release_scratch(&self, mark: Self::ScratchMark);
    /// `residual += x`.
    fn add(&self, residual: &mut Self::Act, x: &Self::Act) -> Result<()>;
    /// Splits the columns of `x` into pieces of `widths` (a fused QKV product).
    fn split(&self, x: &Self::Act, widths: &[usize]) -> Result<Vec<Self::Act>>;
    /// Rotates `q` (`[tokens, heads.q * dim]`) in place and `k` (`[tokens, heads.kv * dim]`)
    /// at the step's positions with the RoPE of attention kind `kind`, and writes the rotated
    /// K and `v` of `layer` into their slots. `k` is consumed: attention reads the cache.
    #[allow(clippy::too_many_arguments)]
    fn rope_and_write_kv(
        &self,
        q: &mut Self::Act,
        k: Self::Act,
        v: &Self::Act,
        kv: &mut Self::Kv,
        layer: usize,
        heads: &Heads,
        step: &Self::Step,
        kind: usize,
    ) -> Result<()>;
    /// A fused QKV product (`[tokens, (heads.q + 2 * heads.kv) * dim]`) as attention takes
    /// it, for layers without Q/K norms: Q rotated (returned) and K and V written into
    /// `layer`'s slots — [`Backend::split`] then [`Backend::rope_and_write_kv`], which a
    /// backend may do in one pass.
    fn qkv_rope_and_write_kv(
        &self,
        qkv: &Self::Act,
        kv: &mut Self::Kv,
        layer: usize,
        heads: &Heads,
        step: &Self::Step,
        kind: usize,
    ) -> Result<Self::Act> {
        let (nq, nkv) = (heads.q * heads.dim, heads.kv * heads.dim);
        let [mut q, k, v]: [Self::Act; 3] = self
            .split(qkv, &[nq, nkv, nkv])?
            .try_into()
            .map_err(|_| anyhow::anyhow!("split returned the wrong number of parts"))?;
        self.rope_and_write_kv(&mut q, k, &v, kv, layer, heads, step, kind)?;
        Ok(q)
    }
    /// Causal attention of the step's queries over their sequences' context in `kv`
    /// (the step's own K/V already written), with the window of attention kind `kind`.
    fn attention(
        &self,
        q: &Self::Act,
        kv: &Self::Kv,
        layer: usize,
        heads: &Heads,
        step: &Self::Step,
        kind: usize,
    ) -> Result<Self::Act>;
    /// `act(gate) * up` for rows `[gate ++ up]`.
    fn gated(&self, gate_up: &Self::Act, act: Activation) -> Result<Self::Act>;
    /// The rows whose next token is sampled, in batch order.
    fn sampled_rows(&self, x: &Self::Act, step: &Self::Step) -> Result<Option<Self::Act>>;
    /// f32 logits on the host, soft-capped when `softcap` is set.
    fn logits(&self, x: &Self::Act, softcap: Option<f32>) -> Result<Logits>;
    /// Samples the rows of `x` (one per row of `batch`) where the logits are, so only the
    /// choices come back; `None` when this backend samples on the host (from
    /// [`Backend::logits`]).
    fn sample(
        &self,
        x: &Self::Act,
        softcap: Option<f32>,
        batch: &SamplingBatch,
    ) -> Result<Option<SampledRows>> {
        let _ = (x, softcap, batch);
        Ok(None)
    }
    /// Copies the KV of block `src` into block `dst` in every layer.
    fn copy_block(&self, kv: &mut Self::Kv, src: usize, dst: usize) -> Result<()>;
    /// Fills every slot with deterministic values of real K/V magnitude (profiling reads
    /// real memory, not zero pages).
    fn fill_pattern(&self, kv: &mut Self::Kv) -> Result<()>;
    /// Bytes held by the KV store.
    fn kv_bytes(kv: &Self::Kv) -> usize;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse() {
        assert_eq!(Device::parse("cpu").unwrap(), Device::Cpu);
        assert_eq!(Device::parse("cuda").unwrap(), Device::Cuda(0));
        assert_eq!(Device::parse("cuda:3").unwrap(), Device::Cuda(3));
        assert!(Device::parse("cuda:x").is_err());
        assert!(Device::parse("gpu").is_err());
        assert_eq!(Device::Cuda(1).to_string(), "cuda:1");
    }

    #[test]
    fn only_context_killing_cuda_errors_are_sticky() {
        // Illegal address, launch failure, uncorrectable ECC: the context is gone.
        for code in [700, 719, 214, 716] {
            assert!(cuda_error_is_sticky(code), "{code}");
        }
        // Out of memory, invalid value, not ready, success: a step can fail and the next
        // one run.
        for code in [2, 1, 600, 0, 201] {
            assert!(!cuda_error_is_sticky(code), "{code}");
        }
        let e = anyhow::Error::new(DeviceLost("CUDA_ERROR_ILLEGAL_ADDRESS".into()));
        assert!(e.to_string().contains("unrecoverable"), "{e}");
    }

    #[test]
    fn logits_rows() {
        let l = Logits::new(vec![1., 2., 3., 4., 5., 6.], 3);
        assert_eq!(l.rows(), 2);
        assert_eq!(l.row(1), &[4., 5., 6.]);
        assert_eq!(l.iter().count(), 2);
        assert_eq!(Logits::empty(5).rows(), 0);
    }
}
