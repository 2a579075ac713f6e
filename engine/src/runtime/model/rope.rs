//! Rotary position embedding frequencies (non-interleaved / "rotate half", as in HF); each
//! backend builds its cos/sin tables from them.

use super::config::RopeScaling;

/// Inverse frequencies (`head_dim / 2` of them), rescaled as the config says (as
/// transformers' `modeling_rope_utils` computes them; cos and sin scaled by
/// [`RopeScaling::attention_scaling`] as well).
pub(crate) fn inv_frequencies(head_dim: usize, theta: f64, scaling: &RopeScaling) -> Vec<f32> {
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
        RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            truncate,
            ..
        } => {
            let dim = head_dim as f64;
            // The dimension at which a wavelength makes `rotations` turns over the
            // pretraining length.
            let dimension_of = |rotations: f64| {
                dim * (original_max_position_embeddings as f64
                    / (rotations * 2.0 * std::f64::consts::PI))
                    .ln()
                    / (2.0 * theta.ln())
            };
            let (mut low, mut high) = (dimension_of(beta_fast), dimension_of(beta_slow));
            if truncate {
                (low, high) = (low.floor(), high.ceil());
            }
            let (low, high) = (low.max(0.0), high.min(dim - 1.0));
            let high = if low == high { high + 0.001 } else { high };
            (0..head_dim / 2)
                .map(|i| {
                    let kept = 1.0 / theta.powf(2.0 * i as f64 / dim);
                    // 0 keeps the frequency (fast dimensions), 1 divides it by the factor.
                    let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                    (kept / factor * ramp + kept * (1.0 - ramp)) as f32
                })
                .collect()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Qwen2.5-7B's recommended YaRN (factor 4 over 32,768 positions, base 1e6, head 128):
    /// the frequencies and attention factor transformers 5.25's `_compute_yarn_parameters`
    /// gives for it.
    #[test]
    fn yarn_matches_transformers() {
        let s = RopeScaling::Yarn {
            factor: 4.0,
            original_max_position_embeddings: 32768,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: 0.1 * 4f64.ln() + 1.0,
            truncate: true,
        };
        let got = inv_frequencies(128, 1e6, &s);
        let transformers = [
            (0, 1.0),
            (10, 0.115_478_202_700_614_93),
            (20, 0.013_335_214_927_792_55),
            (30, 0.001_064_360_956_661_403_2),
            (40, 4.445_698_505_151_085_6e-5),
            (50, 5.133_812_464_919_174e-6),
            (63, 3.102_344_408_034_696e-7),
        ];
        for (i, want) in transformers {
            let rel = (got[i] as f64 - want).abs() / want;
            assert!(rel < 1e-5, "inv_freq[{i}] {} vs {want}", got[i]);
        }
        assert!((s.attention_scaling() - 1.138_629_4).abs() < 1e-6);
    }

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
}
