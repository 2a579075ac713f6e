//! Rotary position embedding tables (non-interleaved / "rotate half", as in HF).

use super::config::RopeScaling;
use anyhow::Result;
use candle_core::{DType, Device, Tensor};

/// cos/sin tables `[max_positions, head_dim / 2]`, looked up by position each step.
pub struct Rope {
    cos: Tensor,
    sin: Tensor,
}

impl Rope {
    pub fn new(
        head_dim: usize,
        theta: f64,
        scaling: &RopeScaling,
        max_positions: usize,
        dtype: DType,
        dev: &Device,
    ) -> Result<Self> {
        let inv_freq = inv_frequencies(head_dim, theta, scaling);
        let half = inv_freq.len();
        // Angles in f32 like HF, then cast: the tables are what the model was trained with.
        let angles: Vec<f32> = (0..max_positions)
            .flat_map(|p| inv_freq.iter().map(move |f| p as f32 * f))
            .collect();
        let angles = Tensor::from_vec(angles, (max_positions, half), dev)?;
        Ok(Self {
            cos: angles.cos()?.to_dtype(dtype)?,
            sin: angles.sin()?.to_dtype(dtype)?,
        })
    }

    /// Tables for the given positions (`[n]` u32): `([n, d/2], [n, d/2])`.
    pub fn lookup(&self, positions: &Tensor) -> Result<(Tensor, Tensor)> {
        Ok((
            self.cos.index_select(positions, 0)?,
            self.sin.index_select(positions, 0)?,
        ))
    }

    /// Rotates `x` `[tokens, heads, head_dim]` with tables from [`Rope::lookup`].
    pub fn apply(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let x4 = x.unsqueeze(0)?.contiguous()?;
        Ok(candle_nn::rotary_emb::rope_thd(&x4, cos, sin)?.squeeze(0)?)
    }
}

fn inv_frequencies(head_dim: usize, theta: f64, scaling: &RopeScaling) -> Vec<f32> {
    let base = (0..head_dim)
        .step_by(2)
        .map(|i| 1.0 / theta.powf(i as f64 / head_dim as f64) as f32);
    match *scaling {
        RopeScaling::None => base.collect(),
        RopeScaling::Linear { factor } => base.map(|f| f / factor as f32).collect(),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => {
            let (factor, low, high) = (
                factor as f32,
                low_freq_factor as f32,
                high_freq_factor as f32,
            );
            let old_len = original_max_position_embeddings as f32;
            let low_freq_wavelen = old_len / low;
            let high_freq_wavelen = old_len / high;
            base.map(|freq| {
                let wavelen = 2.0 * std::f32::consts::PI / freq;
                if wavelen < high_freq_wavelen {
                    freq
                } else if wavelen > low_freq_wavelen {
                    freq / factor
                } else {
                    let smooth = (old_len / wavelen - low) / (high - low);
                    (1.0 - smooth) * freq / factor + smooth * freq
                }
            })
            .collect()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama3_scaling_keeps_high_and_divides_low_frequencies() {
        let s = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        };
        let plain = inv_frequencies(128, 500_000.0, &RopeScaling::None);
        let scaled = inv_frequencies(128, 500_000.0, &s);
        assert_eq!(scaled[0], plain[0]);
        assert!((scaled[63] - plain[63] / 8.0).abs() < 1e-12);
        assert!(scaled[40] < plain[40] && scaled[40] >= plain[40] / 8.0);
    }

    #[test]
    fn rotation_preserves_norm_and_position_zero_is_identity() -> Result<()> {
        let dev = Device::Cpu;
        let rope = Rope::new(8, 10_000.0, &RopeScaling::None, 16, DType::F32, &dev)?;
        let x = Tensor::arange(0f32, 16., &dev)?.reshape((2, 1, 8))?;
        let (cos, sin) = rope.lookup(&Tensor::new(&[0u32, 5], &dev)?)?;
        let y = Rope::apply(&x, &cos, &sin)?;
        let (x, y) = (x.to_vec3::<f32>()?, y.to_vec3::<f32>()?);
        assert_eq!(x[0], y[0]);
        let norm = |v: &[f32]| v.iter().map(|a| a * a).sum::<f32>();
        assert!((norm(&x[1][0]) - norm(&y[1][0])).abs() < 1e-3);
        assert_ne!(x[1], y[1]);
        Ok(())
    }
}
