//! The CPU backend: activations and KV in f32 (candle tensors) on the engine's rayon pool,
//! linear weights in f32 or bf16.
//!
//! Projections go through this backend's own kernel ([`matmul`]: bf16 weights multiply
//! bf16-rounded activations with native dot products, so a decode step reads half the
//! bytes); prefill chunks attend through padded batched matmuls grouped by shape, decodes
//! read the paged store in place ([`attention`], [`decode_attention`]).

pub(crate) mod attention;
pub(crate) mod decode_attention;
pub mod kv;
pub mod matmul;

use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Tensor};

use super::{Activation, AttnKind, Backend, Heads, KvLayout, Logits, Role};
use crate::batch::ForwardBatch;
use attention::AttnPlan;
pub use kv::CpuKv;
use matmul::Weights;

pub enum CpuWeight {
    Linear(Weights),
    Tensor(Tensor),
}

impl CpuWeight {
    fn tensor(&self) -> Result<&Tensor> {
        match self {
            CpuWeight::Tensor(t) => Ok(t),
            CpuWeight::Linear(_) => anyhow::bail!("a linear weight used as a vector"),
        }
    }
}

/// cos/sin tables `[max_positions, head_dim / 2]`.
pub struct CpuRope {
    cos: Tensor,
    sin: Tensor,
}

/// One attention kind's share of a step: its plan and the rotations at the step's positions.
struct KindStep {
    plan: AttnPlan,
    cos: Tensor,
    sin: Tensor,
}

pub struct CpuStep {
    tokens: Tensor,
    /// Scatter index of the step's new K/V rows (see [`CpuKv::write_index`]).
    write_index: Tensor,
    /// Rows whose next token is sampled; `None` when none is.
    sample_rows: Option<Tensor>,
    kinds: Vec<KindStep>,
}

/// The CPU backend. Activations, KV and vectors (norms, biases) are f32; linear and
/// embedding weights are held in `weights` (f32, or bf16 to halve what a decode step reads).
pub struct CpuBackend {
    weights: DType,
}

/// What activations, KV and vector weights are held in.
const ACT: DType = DType::F32;

impl CpuBackend {
    /// `weights`: F32 or BF16.
    pub fn new(weights: DType) -> Result<Self> {
        ensure!(
            matches!(weights, DType::F32 | DType::BF16),
            "the CPU backend holds weights in f32 or bf16, not {weights:?}"
        );
        Ok(Self { weights })
    }

    /// What linear and embedding weights are held in.
    pub fn weight_dtype(&self) -> DType {
        self.weights
    }

    /// What KV and activations are held in.
    pub fn kv_dtype(&self) -> DType {
        ACT
    }
}

const DEV: Device = Device::Cpu;

impl Backend for CpuBackend {
    type Act = Tensor;
    type Weight = CpuWeight;
    type Rope = CpuRope;
    type Kv = CpuKv;
    type Step = CpuStep;
    /// Tensors free themselves when dropped: nothing to mark.
    type ScratchMark = ();

    fn weight(&self, t: Tensor, role: Role) -> Result<CpuWeight> {
        let t = t.to_device(&DEV)?;
        Ok(match role {
            Role::Linear => {
                let (rows, cols) = t.dims2()?;
                let flat = t.flatten_all()?;
                CpuWeight::Linear(match self.weights {
                    DType::BF16 => {
                        Weights::bf16(rows, cols, &flat.to_dtype(DType::BF16)?.to_vec1()?)
                    }
                    _ => Weights::f32(rows, cols, &flat.to_dtype(DType::F32)?.to_vec1()?),
                })
            }
            Role::Embedding => CpuWeight::Tensor(t.to_dtype(self.weights)?),
            // HF computes (1 + w) in f32 before scaling.
            Role::Norm { plus_one: true } => CpuWeight::Tensor((t.to_dtype(ACT)? + 1.0)?),
            Role::Norm { plus_one: false } | Role::Bias => CpuWeight::Tensor(t.to_dtype(ACT)?),
        })
    }

    fn weight_len(w: &CpuWeight) -> usize {
        match w {
            CpuWeight::Linear(w) => w.rows() * w.cols(),
            CpuWeight::Tensor(t) => t.elem_count(),
        }
    }

    fn rope(&self, inv_freq: &[f32], max_positions: usize) -> Result<CpuRope> {
        let half = inv_freq.len();
        // Cast after the trig: the tables are what the model was trained with.
        let angles = super::rope_angles(inv_freq, max_positions);
        let angles = Tensor::from_vec(angles, (max_positions, half), &DEV)?;
        Ok(CpuRope {
            cos: angles.cos()?,
            sin: angles.sin()?,
        })
    }

    fn new_kv(&self, l: KvLayout) -> Result<CpuKv> {
        CpuKv::new(
            l.num_layers,
            l.num_kv_heads,
            l.head_dim,
            l.num_blocks,
            l.block_size,
            ACT,
            &DEV,
        )
    }

    fn kv_layout(kv: &CpuKv) -> KvLayout {
        KvLayout {
            num_layers: kv.num_layers(),
            num_blocks: kv.num_blocks(),
            block_size: kv.block_size(),
            num_kv_heads: kv.num_kv_heads(),
            head_dim: kv.head_dim(),
        }
    }

    fn prepare(
        &self,
        batch: &ForwardBatch,
        kv: &CpuKv,
        kinds: &[AttnKind<'_, CpuRope>],
    ) -> Result<CpuStep> {
        let total = batch.total_tokens();
        let mut tokens = Vec::with_capacity(total);
        let mut positions = Vec::with_capacity(total);
        let mut slots = Vec::with_capacity(total);
        let mut sample_rows = Vec::new();
        for s in &batch.seqs {
            for (j, &t) in s.tokens.iter().enumerate() {
                let pos = s.start_pos + j;
                tokens.push(t);
                positions.push(pos as u32);
                slots.push(kv.slot(&s.block_table, pos)?);
            }
            if s.sample {
                sample_rows.push((tokens.len() - 1) as u32);
            }
        }
        let positions = Tensor::new(positions.as_slice(), &DEV)?;
        let kinds = kinds
            .iter()
            .map(|k| {
                Ok(KindStep {
                    plan: AttnPlan::new(batch, kv, k.window, &DEV)?,
                    cos: k.rope.cos.index_select(&positions, 0)?,
                    sin: k.rope.sin.index_select(&positions, 0)?,
                })
            })
            .collect::<Result<_>>()?;
        Ok(CpuStep {
            tokens: Tensor::new(tokens.as_slice(), &DEV)?,
            write_index: kv.write_index(&slots, &DEV)?,
            sample_rows: if sample_rows.is_empty() {
                None
            } else {
                Some(Tensor::new(sample_rows.as_slice(), &DEV)?)
            },
            kinds,
        })
    }

    fn embed(&self, table: &CpuWeight, step: &CpuStep, scale: Option<f32>) -> Result<Tensor> {
        let x = table
            .tensor()?
            .index_select(&step.tokens, 0)?
            .to_dtype(ACT)?;
        Ok(match scale {
            Some(s) => (x * s as f64)?,
            None => x,
        })
    }

    fn linear(&self, x: &Tensor, w: &CpuWeight, bias: Option<&CpuWeight>) -> Result<Tensor> {
        let CpuWeight::Linear(w) = w else {
            anyhow::bail!("a vector weight used as a linear layer");
        };
        let y = project(x, w)?;
        Ok(match bias {
            Some(b) => y.broadcast_add(b.tensor()?)?,
            None => y,
        })
    }

    fn rms_norm(&self, x: &Tensor, w: &CpuWeight, eps: f32) -> Result<Tensor> {
        let w = w.tensor()?;
        let (rows, width) = x.dims2()?;
        let group = w.elem_count();
        if group == width {
            return Ok(candle_nn::ops::rms_norm(&x.contiguous()?, w, eps)?);
        }
        ensure!(
            width % group == 0,
            "norm of width {group} over rows of {width}"
        );
        let x = x.reshape((rows * width / group, group))?;
        Ok(candle_nn::ops::rms_norm(&x, w, eps)?.reshape((rows, width))?)
    }

    fn add_rms_norm(
        &self,
        residual: &mut Tensor,
        x: &Tensor,
        w: &CpuWeight,
        eps: f32,
        out: &mut Tensor,
    ) -> Result<()> {
        self.add(residual, x)?;
        *out = self.rms_norm(residual, w, eps)?;
        Ok(())
    }

    fn scratch_mark(&self) {}

    fn release_scratch(&self, _: ()) {}

    fn add(&self, residual: &mut Tensor, x: &Tensor) -> Result<()> {
        *residual = (&*residual + x)?;
        Ok(())
    }

    fn split(&self, x: &Tensor, widths: &[usize]) -> Result<Vec<Tensor>> {
        let mut start = 0;
        widths
            .iter()
            .map(|&w| {
                let part = x.narrow(1, start, w)?;
                start += w;
                Ok(part)
            })
            .collect()
    }

    fn rope_qk(
        &self,
        q: &mut Tensor,
        k: &mut Tensor,
        heads: &Heads,
        step: &CpuStep,
        kind: usize,
    ) -> Result<()> {
        let ks = &step.kinds[kind];
        let rotate = |x: &Tensor, n: usize| -> Result<Tensor> {
            let t = x.dim(0)?;
            let x4 = x.reshape((1, t, n, heads.dim))?;
            let y = candle_nn::rotary_emb::rope_thd(&x4, &ks.cos, &ks.sin)?;
            Ok(y.reshape((t, n * heads.dim))?)
        };
        *q = rotate(q, heads.q)?;
        *k = rotate(k, heads.kv)?;
        Ok(())
    }

    fn write_kv(
        &self,
        kv: &mut CpuKv,
        layer: usize,
        k: &Tensor,
        v: &Tensor,
        step: &CpuStep,
    ) -> Result<()> {
        let shape = (k.dim(0)?, kv.num_kv_heads(), kv.head_dim());
        kv.write(
            layer,
            &step.write_index,
            &k.reshape(shape)?,
            &v.reshape(shape)?,
        )
        .with_context(|| format!("layer {layer}"))
    }

    fn attention(
        &self,
        q: &Tensor,
        kv: &CpuKv,
        layer: usize,
        heads: &Heads,
        step: &CpuStep,
        kind: usize,
    ) -> Result<Tensor> {
        let q = q.reshape((q.dim(0)?, heads.q, heads.dim))?;
        step.kinds[kind].plan.attend(
            &q,
            kv,
            layer,
            heads.scale as f64,
            heads.softcap.map(f64::from),
        )
    }

    fn gated(&self, gate_up: &Tensor, act: Activation) -> Result<Tensor> {
        if act == Activation::Silu {
            return silu_mul(gate_up);
        }
        let inter = gate_up.dim(1)? / 2;
        let gate = gate_up.narrow(1, 0, inter)?;
        let up = gate_up.narrow(1, inter, inter)?;
        let gate = match act {
            Activation::Silu => candle_nn::ops::silu(&gate)?,
            Activation::GeluTanh => gate.gelu()?,
            Activation::GeluErf => gate.gelu_erf()?,
        };
        Ok((gate * up)?)
    }

    fn sampled_rows(&self, x: &Tensor, step: &CpuStep) -> Result<Option<Tensor>> {
        step.sample_rows
            .as_ref()
            .map(|rows| Ok(x.index_select(rows, 0)?))
            .transpose()
    }

    fn logits(&self, x: &Tensor, softcap: Option<f32>) -> Result<Logits> {
        let vocab = x.dim(1)?;
        let mut logits = x.to_dtype(DType::F32)?;
        if let Some(cap) = softcap {
            let cap = cap as f64;
            logits = ((logits / cap)?.tanh()? * cap)?;
        }
        Ok(Logits::new(logits.flatten_all()?.to_vec1()?, vocab))
    }

    fn copy_block(&self, kv: &mut CpuKv, src: usize, dst: usize) -> Result<()> {
        kv.copy_block(src as u32, dst as u32)
    }

    fn fill_pattern(&self, kv: &mut CpuKv) -> Result<()> {
        kv.fill_pattern()
    }

    fn kv_bytes(kv: &CpuKv) -> usize {
        kv.size_bytes()
    }
}

/// `silu(gate) * up` for `[rows, gate | up]`, in one parallel pass over the rows (in place
/// of two views, an activation and a product, each a tensor of its own).
fn silu_mul(gate_up: &Tensor) -> Result<Tensor> {
    use rayon::prelude::*;
    let (m, width) = gate_up.dims2()?;
    let inter = width / 2;
    let out = with_f32(gate_up, |src| {
        let mut out = vec![0f32; m * inter];
        out.par_chunks_mut(inter)
            .zip(src.par_chunks(width))
            .for_each(|(o, row)| {
                let (gate, up) = row.split_at(inter);
                for ((o, &g), &u) in o.iter_mut().zip(gate).zip(up) {
                    // candle's (and PyTorch's) silu: x / (1 + e^-x).
                    *o = g / (1.0 + (-g).exp()) * u;
                }
            });
        out
    })?;
    Ok(Tensor::from_vec(out, (m, inter), &DEV)?)
}

/// `f` of an f32 CPU tensor's elements in row-major order (a copy only if `t` is a strided
/// view): how this backend's own kernels read candle's activations.
pub(crate) fn with_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    let candle_core::Storage::Cpu(cpu) = &*storage else {
        anyhow::bail!("a CPU kernel given a tensor on another device");
    };
    Ok(f(
        &cpu.as_slice::<f32>()?[layout.start_offset()..][..t.elem_count()]
    ))
}

/// `x @ W^T` through [`matmul`], `x` being `[rows, in]` f32.
fn project(x: &Tensor, w: &Weights) -> Result<Tensor> {
    let (m, k) = x.dims2()?;
    ensure!(
        k == w.cols(),
        "a [{m}, {k}] input to a linear layer of {} inputs",
        w.cols()
    );
    let mut y = vec![0f32; m * w.rows()];
    with_f32(x, |data| w.matmul_t(data, m, &mut y))?;
    Ok(Tensor::from_vec(y, (m, w.rows()), &DEV)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linear_layers_compute_x_times_w_transposed_plus_bias_in_both_weight_dtypes() -> Result<()> {
        let x = Tensor::randn(0f32, 1.0, (5, 1024), &DEV)?;
        for dtype in [DType::F32, DType::BF16] {
            let backend = CpuBackend::new(dtype)?;
            for out in [256, 1100] {
                let w = Tensor::randn(0f32, 1.0, (out, 1024), &DEV)?;
                let b = Tensor::randn(0f32, 1.0, out, &DEV)?;
                let p = backend.weight(w.clone(), Role::Linear)?;
                let bias = backend.weight(b.clone(), Role::Bias)?;
                // bf16 weights multiply activations rounded to bf16 (see `matmul`).
                let held = |t: &Tensor| t.to_dtype(dtype)?.to_dtype(DType::F32);
                let expect = held(&x)?.matmul(&held(&w)?.t()?)?.broadcast_add(&b)?;
                let got = backend.linear(&x, &p, Some(&bias))?;
                assert_eq!(got.dims(), &[5, out]);
                let err = (got - &expect)?.abs()?.max_all()?.to_scalar::<f32>()?;
                assert!(err < 1e-3, "{dtype:?} out {out}: max error {err}");
            }
        }
        Ok(())
    }

    #[test]
    fn fused_silu_mul_equals_candles_three_ops() -> Result<()> {
        let backend = CpuBackend::new(DType::F32)?;
        let x = (Tensor::randn(0f32, 1.0, (7, 2 * 300), &DEV)? * 4.0)?;
        let got = backend.gated(&x, Activation::Silu)?;
        let expect = (candle_nn::ops::silu(&x.narrow(1, 0, 300)?)? * x.narrow(1, 300, 300)?)?;
        let err = (got - expect)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(err < 1e-6, "max error {err}");
        Ok(())
    }

    #[test]
    fn per_head_norm_equals_norm_of_each_head() -> Result<()> {
        let backend = CpuBackend::new(DType::F32)?;
        let x = Tensor::randn(0f32, 1.0, (3, 8), &DEV)?;
        let w = Tensor::randn(0f32, 1.0, 4, &DEV)?;
        let got = backend.rms_norm(
            &x,
            &backend.weight(w.clone(), Role::Norm { plus_one: false })?,
            1e-6,
        )?;
        let expect = candle_nn::ops::rms_norm(&x.reshape((6, 4))?, &w, 1e-6)?.reshape((3, 8))?;
        let err = (got - expect)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(err < 1e-6, "max error {err}");
        Ok(())
    }
}
