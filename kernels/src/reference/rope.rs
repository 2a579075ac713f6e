//! Rotary position embedding, NeoX style ("rotate half"): dimension `i` of the first half is
//! rotated together with dimension `i + head_dim/2`, as Llama, Qwen and Gemma do in HF.

/// Precomputed `cos`/`sin` of `pos * inv_freq[i]`, each `[max_positions, head_dim / 2]`, f32.
///
/// Frequencies come in from the caller so that model-specific scaling (Llama 3's
/// piecewise scaling, linear scaling, Gemma's local/global bases) stays out of the kernels.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeTable {
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
    pub half_dim: usize,
    pub max_positions: usize,
}

/// The unscaled frequencies `theta^(-2i / head_dim)`.
pub fn default_inv_freq(head_dim: usize, theta: f64) -> Vec<f32> {
    (0..head_dim / 2)
        .map(|i| theta.powf(-2.0 * i as f64 / head_dim as f64) as f32)
        .collect()
}

impl RopeTable {
    pub fn new(inv_freq: &[f32], max_positions: usize) -> Self {
        let half_dim = inv_freq.len();
        let mut cos = Vec::with_capacity(max_positions * half_dim);
        let mut sin = Vec::with_capacity(max_positions * half_dim);
        for pos in 0..max_positions {
            for &f in inv_freq {
                // Angles in f64: at position 100k an f32 product loses the low digits.
                let angle = pos as f64 * f as f64;
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        Self {
            cos,
            sin,
            half_dim,
            max_positions,
        }
    }
}

/// Rotate `x` (`[num_tokens, num_heads, head_dim]`) in place; token `t` is at `positions[t]`.
/// A position outside the table (`[0, max_positions)`) leaves its token unchanged, as the kernel.
pub fn rope_neox(x: &mut [f32], positions: &[i32], num_heads: usize, table: &RopeTable) {
    let half = table.half_dim;
    let head_dim = 2 * half;
    assert_eq!(x.len(), positions.len() * num_heads * head_dim);
    for (t, &pos) in positions.iter().enumerate() {
        let Some(pos) = usize::try_from(pos)
            .ok()
            .filter(|&p| p < table.max_positions)
        else {
            continue;
        };
        let angles = pos * half;
        let (cos, sin) = (
            &table.cos[angles..angles + half],
            &table.sin[angles..angles + half],
        );
        for h in 0..num_heads {
            let head = &mut x[(t * num_heads + h) * head_dim..][..head_dim];
            for i in 0..half {
                let (x1, x2) = (head[i], head[i + half]);
                head[i] = x1 * cos[i] - x2 * sin[i];
                head[i + half] = x2 * cos[i] + x1 * sin[i];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn position_zero_is_identity_and_quarter_turn_rotates() {
        // head_dim 2, one frequency of 1 rad per position.
        let table = RopeTable::new(&[std::f32::consts::FRAC_PI_2], 3);
        let mut x = [1.0, 2.0, 1.0, 2.0];
        rope_neox(&mut x, &[0, 1], 1, &table);
        assert_eq!(&x[..2], &[1.0, 2.0]);
        // Rotating (1, 2) by 90 degrees gives (-2, 1).
        assert!((x[2] + 2.0).abs() < 1e-6 && (x[3] - 1.0).abs() < 1e-6);
        // Positions outside the table leave the token as it was.
        let mut x = [1.0, 2.0, 1.0, 2.0];
        rope_neox(&mut x, &[-1, 3], 1, &table);
        assert_eq!(x, [1.0, 2.0, 1.0, 2.0]);
    }

    #[test]
    fn pairs_are_half_a_head_apart_and_norm_is_kept() {
        let table = RopeTable::new(&default_inv_freq(4, 10000.0), 8);
        assert_eq!(table.cos.len(), 8 * 2);
        let mut x = [1.0, 0.0, 0.0, 0.0];
        rope_neox(&mut x, &[5], 1, &table);
        // Dimension 0 pairs with dimension 2 (not 1): only those two move.
        assert!((x[0] - 5f32.cos()).abs() < 1e-6);
        assert!((x[2] - 5f32.sin()).abs() < 1e-6);
        assert_eq!((x[1], x[3]), (0.0, 0.0));
        assert!((x.iter().map(|v| v * v).sum::<f32>() - 1.0).abs() < 1e-6);
    }

    #[test]
    fn inverse_frequencies() {
        let f = default_inv_freq(4, 10000.0);
        assert_eq!(f[0], 1.0);
        assert!((f[1] - 0.01).abs() < 1e-9);
    }
}
