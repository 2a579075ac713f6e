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

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};

use super::{Activation, AttnKind, Backend, Heads, KvLayout, Logits, Role};
use crate::runtime::batch::ForwardBatch;
use attention::AttnPlan;
use infer_kernels::sampling::{SampledRows, SamplingBatch};
pub use kv::CpuKv;

use infer_core::workload::KvCacheDtype;
use infer_kernels::cpu_matmul::Weights;

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

/// cos/sin tables, row-major `[max_positions, head_dim / 2]`.
pub struct CpuRope {
    half: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

/// One attention kind's share of a step: its plan and the rotations at the step's positions
/// (`[tokens, head_dim / 2]`).
struct KindStep {
    plan: AttnPlan,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

pub struct CpuStep {
    tokens: Tensor,
    /// The KV slot of each of the step's tokens.
    slots: Vec<u32>,
    /// Rows whose next token is sampled; `None` when none is.
    sample_rows: Option<Tensor>,
    kinds: Vec<KindStep>,
}

/// The CPU backend. Activations and vectors (norms, biases) are f32; linear and embedding
/// weights are held in `weights` (f32, or bf16 to halve what a decode step reads); the KV
/// store in `kv` (f32, or fp8 E4M3: a quarter of the bytes, rounded on its way in).
pub struct CpuBackend {
    weights: DType,
    kv: DType,
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
        Ok(Self { weights, kv: ACT })
    }

    /// What linear and embedding weights are held in.
    pub fn weight_dtype(&self) -> DType {
        self.weights
    }

    /// What the KV store holds.
    pub fn kv_dtype(&self) -> DType {
        self.kv
    }

    /// The KV store's dtype, for stores made from now on.
    pub fn set_kv_cache_dtype(&mut self, dtype: KvCacheDtype) {
        self.kv = match dtype {
            KvCacheDtype::Auto => ACT,
            KvCacheDtype::Fp8 => DType::F8E4M3,
        };
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

    fn rope(&self, inv_freq: &[f32], max_positions: usize, scale: f32) -> Result<CpuRope> {
        let (cos, sin) = super::rope_tables(inv_freq, max_positions, scale);
        Ok(CpuRope {
            half: inv_freq.len(),
            cos,
            sin,
        })
    }

    fn new_kv(&self, l: KvLayout) -> Result<CpuKv> {
        CpuKv::new(
            l.num_layers,
            l.num_kv_heads,
            l.head_dim,
            l.num_blocks,
            l.block_size,
            self.kv,
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
            let first = tokens.len() - s.tokens.len();
            sample_rows.extend(s.logit_rows().map(|j| (first + j) as u32));
        }
        let kinds = kinds
            .iter()
            .map(|k| {
                let r = k.rope;
                let at = |table: &[f32]| -> Vec<f32> {
                    positions
                        .iter()
                        .flat_map(|&p| &table[p as usize * r.half..][..r.half])
                        .copied()
                        .collect()
                };
                Ok(KindStep {
                    plan: AttnPlan::new(batch, kv, k.window, &DEV)?,
                    cos: at(&r.cos),
                    sin: at(&r.sin),
                })
            })
            .collect::<Result<_>>()?;
        Ok(CpuStep {
            tokens: Tensor::new(tokens.as_slice(), &DEV)?,
            slots,
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
        let w = w.tensor()?;
        let (rows, width) = residual.dims2()?;
        ensure!(
            x.dims2()? == (rows, width) && w.elem_count() == width,
            "add_rms_norm of [{rows}, {width}] rows with {:?} and a norm of {}",
            x.dims(),
            w.elem_count()
        );
        let (sum, normed) = with_f32(residual, |r| {
            with_f32(x, |x| with_f32(w, |w| add_rms_norm(r, x, w, eps)))
        })???;
        *residual = Tensor::from_vec(sum, (rows, width), &DEV)?;
        *out = Tensor::from_vec(normed, (rows, width), &DEV)?;
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

    fn rope_and_write_kv(
        &self,
        q: &mut Tensor,
        k: Tensor,
        v: &Tensor,
        kv: &mut CpuKv,
        layer: usize,
        heads: &Heads,
        step: &CpuStep,
        kind: usize,
    ) -> Result<()> {
        use rayon::prelude::*;
        let ks = &step.kinds[kind];
        let (d, half) = (heads.dim, heads.dim / 2);
        let angles = |t: usize| (&ks.cos[t * half..][..half], &ks.sin[t * half..][..half]);
        let (tokens, q_width) = q.dims2()?;
        let rotated_q = with_f32(q, |src| {
            let mut out = vec![0f32; src.len()];
            out.par_chunks_mut(q_width)
                .zip(src.par_chunks(q_width))
                .enumerate()
                .for_each(|(t, (o, x))| {
                    let (cos, sin) = angles(t);
                    for (o, x) in o.chunks_exact_mut(d).zip(x.chunks_exact(d)) {
                        rotate_half(x, cos, sin, o);
                    }
                });
            out
        })?;
        *q = Tensor::from_vec(rotated_q, (tokens, q_width), &DEV)?;
        // K is rotated on its way into its slots; V is copied.
        let kv_width = heads.kv * d;
        with_f32(&k, |k| {
            with_f32(v, |v| {
                kv.write_with(
                    layer,
                    &step.slots,
                    |t, h, dst| {
                        let (cos, sin) = angles(t);
                        rotate_half(&k[t * kv_width + h * d..][..d], cos, sin, dst);
                    },
                    |t, h, dst| dst.copy_from_slice(&v[t * kv_width + h * d..][..d]),
                )
            })
        })??
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

    /// The kernels' reference sampler over the host logits: what the GPU computes. The
    /// engine samples CPU steps per request with its [`crate::runtime::sampling::Sampler`];
    /// this lets the batched path be run, and tested, without a GPU.
    fn sample(
        &self,
        x: &Tensor,
        softcap: Option<f32>,
        batch: &SamplingBatch,
    ) -> Result<Option<SampledRows>> {
        let logits = self.logits(x, softcap)?;
        let vocab = logits.vocab();
        let mut data = logits.into_vec();
        Ok(Some(infer_kernels::reference::sample_rows(
            &mut data, vocab, batch,
        )))
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

/// One head's `x` rotated by the angles of `cos`/`sin` (`head_dim / 2` each) into `out`:
/// the non-interleaved ("rotate half") RoPE of HF's Llama, with candle's arithmetic.
fn rotate_half(x: &[f32], cos: &[f32], sin: &[f32], out: &mut [f32]) {
    let half = cos.len();
    let (x1, x2) = x.split_at(half);
    let (o1, o2) = out.split_at_mut(half);
    for i in 0..half {
        o1[i] = x1[i] * cos[i] - x2[i] * sin[i];
        o2[i] = x1[i] * sin[i] + x2[i] * cos[i];
    }
}

/// `residual + x` and its RMSNorm times `w`, row by row in one parallel pass (in place of
/// an add and a norm, each a pass over the rows of a tensor of its own); the norm's
/// arithmetic is candle's (`x / sqrt(mean(x²) + eps) * w`).
fn add_rms_norm(residual: &[f32], x: &[f32], w: &[f32], eps: f32) -> (Vec<f32>, Vec<f32>) {
    use rayon::prelude::*;
    let width = w.len();
    let mut sum = vec![0f32; residual.len()];
    let mut normed = vec![0f32; residual.len()];
    sum.par_chunks_mut(width)
        .zip(normed.par_chunks_mut(width))
        .zip(residual.par_chunks(width).zip(x.par_chunks(width)))
        .for_each(|((s, n), (r, x))| {
            for ((s, &r), &x) in s.iter_mut().zip(r).zip(x) {
                *s = r + x;
            }
            let sum2: f32 = s.iter().map(|&v| v * v).sum();
            let m = (sum2 / width as f32 + eps).sqrt();
            for ((n, &s), &w) in n.iter_mut().zip(s.iter()).zip(w) {
                *n = s / m * w;
            }
        });
    (sum, normed)
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

    /// Bit for bit what the unfused add and candle's norm compute.
    #[test]
    fn fused_add_rms_norm_equals_an_add_then_candles_norm() -> Result<()> {
        let backend = CpuBackend::new(DType::F32)?;
        let mut residual = Tensor::randn(0f32, 1.0, (5, 96), &DEV)?;
        let x = Tensor::randn(0f32, 1.0, (5, 96), &DEV)?;
        let w = Tensor::randn(0f32, 1.0, 96, &DEV)?;
        let sum = (&residual + &x)?;
        let expect = candle_nn::ops::rms_norm(&sum, &w, 1e-5)?;
        let mut out = Tensor::zeros((5, 96), DType::F32, &DEV)?;
        let norm = backend.weight(w, Role::Norm { plus_one: false })?;
        backend.add_rms_norm(&mut residual, &x, &norm, 1e-5, &mut out)?;
        let bits = |t: &Tensor| -> Result<Vec<u32>> {
            Ok(t.flatten_all()?
                .to_vec1::<f32>()?
                .iter()
                .map(|v| v.to_bits())
                .collect())
        };
        assert_eq!(bits(&residual)?, bits(&sum)?);
        assert_eq!(bits(&out)?, bits(&expect)?);
        Ok(())
    }

    /// Two sequences (a 3-token prefill chunk from position 2, a decode at 7) through the
    /// fused RoPE and KV write: q equals candle's rope, and each slot of the cache holds
    /// candle's rotated K and the plain V, bit for bit; other slots stay zero.
    #[test]
    fn rope_and_kv_write_equal_candles_rope_then_a_write() -> Result<()> {
        let backend = CpuBackend::new(DType::F32)?;
        let heads = Heads {
            q: 4,
            kv: 2,
            dim: 8,
            scale: 1.0,
            softcap: None,
        };
        let inv_freq = [1.0f32, 0.3, 0.05, 0.001];
        let rope = backend.rope(&inv_freq, 16, 1.0)?;
        let mut kv = backend.new_kv(KvLayout {
            num_layers: 2,
            num_blocks: 4,
            block_size: 4,
            num_kv_heads: 2,
            head_dim: 8,
        })?;
        let batch = ForwardBatch {
            seqs: vec![
                crate::runtime::batch::SeqChunk {
                    tokens: vec![1, 2, 3],
                    start_pos: 2,
                    block_table: vec![3, 0],
                    sample: true,
                    all_logits: false,
                },
                crate::runtime::batch::SeqChunk {
                    tokens: vec![4],
                    start_pos: 7,
                    block_table: vec![1, 2],
                    sample: true,
                    all_logits: false,
                },
            ],
        };
        let step = backend.prepare(
            &batch,
            &kv,
            &[AttnKind {
                window: None,
                rope: &rope,
            }],
        )?;
        let mut q = Tensor::randn(0f32, 1.0, (4, 32), &DEV)?;
        let k = Tensor::randn(0f32, 1.0, (4, 16), &DEV)?;
        let v = Tensor::randn(0f32, 1.0, (4, 16), &DEV)?;
        // candle's rope at each token's position.
        let positions = Tensor::new(&[2u32, 3, 4, 7], &DEV)?;
        let angles = Tensor::from_vec(super::super::rope_angles(&inv_freq, 16), (16, 4), &DEV)?
            .index_select(&positions, 0)?;
        let (cos, sin) = (angles.cos()?, angles.sin()?);
        let candle_rope = |x: &Tensor, n: usize| -> Result<Tensor> {
            let x4 = x.reshape((1, 4, n, 8))?;
            Ok(candle_nn::rotary_emb::rope_thd(&x4, &cos, &sin)?.reshape((4, n * 8))?)
        };
        let (want_q, want_k) = (candle_rope(&q, 4)?, candle_rope(&k, 2)?);
        backend.rope_and_write_kv(&mut q, k, &v, &mut kv, 1, &heads, &step, 0)?;
        assert_eq!(q.to_vec2::<f32>()?, want_q.to_vec2::<f32>()?);
        // Slots: blocks [3, 0] hold positions 2..5 of the first sequence; block 2 slot 3 the
        // second's position 7.
        let slots = [14u32, 15, 0, 11];
        let (got_k, got_v) = kv.gather(1, &Tensor::new(&slots, &DEV)?)?;
        let per_token = |t: &Tensor| -> Result<Vec<Vec<f32>>> {
            Ok(t.transpose(0, 1)?.flatten_from(1)?.to_vec2::<f32>()?)
        };
        assert_eq!(per_token(&got_k)?, want_k.to_vec2::<f32>()?);
        assert_eq!(per_token(&got_v)?, v.to_vec2::<f32>()?);
        let (k_layer0, _) = kv.gather(0, &Tensor::new(&slots, &DEV)?)?;
        assert!(k_layer0
            .flatten_all()?
            .to_vec1::<f32>()?
            .iter()
            .all(|&x| x == 0.0));
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
