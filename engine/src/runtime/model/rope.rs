//! Rotary position embedding frequencies (non-interleaved / "rotate half", as in HF); each
//! backend builds its cos/sin tables from them.

use super::config::RopeScaling;

/// Inverse frequencies (`head_dim / 2` of them), rescaled as the config says.
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
}
