//! The CPU backend: candle tensors in f32 on the engine's rayon pool.
//!
//! Matmuls go through candle's gemm with the weight layout that suits step-sized inputs
//! ([`Proj`]); prefill chunks attend through padded batched matmuls grouped by shape, decodes
//! read the paged store in place ([`attention`], [`decode_attention`]).

pub(crate) mod attention;
pub(crate) mod decode_attention;
pub mod kv;

use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Tensor};

use super::{Activation, AttnKind, Backend, Heads, KvLayout, Logits, Role};
use crate::batch::ForwardBatch;
use attention::AttnPlan;
pub use kv::CpuKv;

/// A projection `x @ W^T`, `W` being `[out, in]` as stored in HF checkpoints.
///
/// How the product is laid out matters a lot to candle's CPU gemm on step-sized inputs
/// (x with 1–128 rows). Measured on this project's 2-core machines: for small weights a
/// contiguous `[in, out]` copy of `W^T` is fastest (256x768, batch 32: 79 us vs 317 us
/// through a transposed view); for large ones computing `(W @ x^T)^T` is (8192x1024,
/// batch 32: 5.5 ms vs 8.3 ms via a view, 13.9 ms via the copy).
pub enum Proj {
    /// `x @ wt`; `wt` is a contiguous copy of `W^T`.
    XWt(Tensor),
    /// `(w @ x^T)^T` with `w` as stored.
    WXt(Tensor),
}

/// Weights up to this many elements take the contiguous `W^T` layout.
const SMALL_WEIGHT_ELEMS: usize = 1 << 20;

impl Proj {
    fn new(w: Tensor) -> Result<Self> {
        Ok(if w.elem_count() <= SMALL_WEIGHT_ELEMS {
            Proj::XWt(w.t()?.contiguous()?)
        } else {
            Proj::WXt(w)
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Proj::XWt(wt) => x.matmul(wt)?,
            Proj::WXt(w) => w.matmul(&x.t()?)?.t()?.contiguous()?,
        })
    }

    fn elem_count(&self) -> usize {
        match self {
            Proj::XWt(w) | Proj::WXt(w) => w.elem_count(),
        }
    }
}

pub enum CpuWeight {
    Linear(Proj),
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

/// The CPU backend. `dtype` is what weights, activations and KV are held in (f32: candle's
/// CPU backend has no bf16 matmul).
pub struct CpuBackend {
    dtype: DType,
}

impl CpuBackend {
    pub fn new(dtype: DType) -> Self {
        Self { dtype }
    }

    pub fn dtype(&self) -> DType {
        self.dtype
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
        let t = match role {
            // HF computes (1 + w) in f32 before scaling; do the same, then cast.
            Role::Norm { plus_one: true } => (t.to_dtype(DType::F32)? + 1.0)?,
            _ => t,
        };
        let t = t.to_device(&DEV)?.to_dtype(self.dtype)?;
        Ok(match role {
            Role::Linear => CpuWeight::Linear(Proj::new(t)?),
            _ => CpuWeight::Tensor(t),
        })
    }

    fn weight_len(w: &CpuWeight) -> usize {
        match w {
            CpuWeight::Linear(p) => p.elem_count(),
            CpuWeight::Tensor(t) => t.elem_count(),
        }
    }

    fn rope(&self, inv_freq: &[f32], max_positions: usize) -> Result<CpuRope> {
        let half = inv_freq.len();
        // Cast after the trig: the tables are what the model was trained with.
        let angles = super::rope_angles(inv_freq, max_positions);
        let angles = Tensor::from_vec(angles, (max_positions, half), &DEV)?;
        Ok(CpuRope {
            cos: angles.cos()?.to_dtype(self.dtype)?,
            sin: angles.sin()?.to_dtype(self.dtype)?,
        })
    }

    fn new_kv(&self, l: KvLayout) -> Result<CpuKv> {
        CpuKv::new(
            l.num_layers,
            l.num_kv_heads,
            l.head_dim,
            l.num_blocks,
            l.block_size,
            self.dtype,
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
        let x = table.tensor()?.index_select(&step.tokens, 0)?;
        Ok(match scale {
            // HF multiplies by the scale cast to the model dtype.
            Some(s) => x.broadcast_mul(&Tensor::new(s, &DEV)?.to_dtype(self.dtype)?)?,
            None => x,
        })
    }

    fn linear(&self, x: &Tensor, w: &CpuWeight, bias: Option<&CpuWeight>) -> Result<Tensor> {
        let CpuWeight::Linear(p) = w else {
            anyhow::bail!("a vector weight used as a linear layer");
        };
        let y = p.forward(x)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_projection_layouts_compute_x_times_w_transposed() -> Result<()> {
        let x = Tensor::randn(0f32, 1.0, (5, 1024), &DEV)?;
        let backend = CpuBackend::new(DType::F32);
        for out in [256, 1100] {
            let w = Tensor::randn(0f32, 1.0, (out, 1024), &DEV)?;
            let b = Tensor::randn(0f32, 1.0, out, &DEV)?;
            let p = backend.weight(w.clone(), Role::Linear)?;
            assert_eq!(
                matches!(p, CpuWeight::Linear(Proj::WXt(_))),
                out * 1024 > SMALL_WEIGHT_ELEMS
            );
            let bias = backend.weight(b.clone(), Role::Bias)?;
            let expect = x.matmul(&w.t()?)?.broadcast_add(&b)?;
            let got = backend.linear(&x, &p, Some(&bias))?;
            assert_eq!(got.dims(), &[5, out]);
            let err = (got - &expect)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(err < 1e-3, "out {out}: max error {err}");
        }
        Ok(())
    }

    #[test]
    fn per_head_norm_equals_norm_of_each_head() -> Result<()> {
        let backend = CpuBackend::new(DType::F32);
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
