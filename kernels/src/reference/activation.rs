//! Gated MLP activations: `out = act(gate) * up`.
//!
//! The input is the output of the merged gate/up projection, `[rows, 2 * inter]`, each row
//! being `gate (inter) ++ up (inter)`; the output is `[rows, inter]`.

pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// GELU with the tanh approximation (Gemma's `gelu_pytorch_tanh`).
pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)).tanh())
}

/// The error function, in f64 (std has no stable `erf`): its Maclaurin series below 3, where
/// f64 keeps it accurate to ~1e-12, and Numerical Recipes' `erfc` fit (relative error 1.2e-7
/// of an `erfc` below 2.3e-5) above.
pub fn erf(x: f32) -> f32 {
    let z = (x as f64).abs();
    let erf = if z < 3.0 {
        // erf z = 2/sqrt(pi) * sum_n (-1)^n z^(2n+1) / (n! (2n+1))
        let (mut term, mut sum, mut n) = (z, z, 0.0);
        while term.abs() > 1e-17 * sum.abs() {
            n += 1.0;
            term *= -z * z / n;
            sum += term / (2.0 * n + 1.0);
        }
        sum * std::f64::consts::FRAC_2_SQRT_PI
    } else {
        let t = 1.0 / (1.0 + 0.5 * z);
        let poly = -z * z - 1.265_512_23
            + t * (1.000_023_68
                + t * (0.374_091_96
                    + t * (0.096_784_18
                        + t * (-0.186_288_06
                            + t * (0.278_868_07
                                + t * (-1.135_203_98
                                    + t * (1.488_515_87
                                        + t * (-0.822_152_23 + t * 0.170_872_77))))))));
        1.0 - t * poly.exp()
    };
    (if x < 0.0 { -erf } else { erf }) as f32
}

/// Exact GELU, `x * Phi(x) = 0.5 x (1 + erf(x / sqrt 2))` (PyTorch's default `gelu`).
pub fn gelu_erf(x: f32) -> f32 {
    0.5 * x * (1.0 + erf(x * std::f32::consts::FRAC_1_SQRT_2))
}

/// Llama/Qwen MLP: `silu(gate) * up`.
pub fn silu_and_mul(out: &mut [f32], gate_up: &[f32], inter: usize) {
    gated(out, gate_up, inter, silu)
}

/// Gemma MLP: `gelu_tanh(gate) * up`.
pub fn gelu_tanh_and_mul(out: &mut [f32], gate_up: &[f32], inter: usize) {
    gated(out, gate_up, inter, gelu_tanh)
}

/// MLP with exact GELU: `gelu_erf(gate) * up`.
pub fn gelu_erf_and_mul(out: &mut [f32], gate_up: &[f32], inter: usize) {
    gated(out, gate_up, inter, gelu_erf)
}

fn gated(out: &mut [f32], gate_up: &[f32], inter: usize, act: fn(f32) -> f32) {
    assert_eq!(gate_up.len(), 2 * out.len());
    for (out_row, in_row) in out.chunks_mut(inter).zip(gate_up.chunks(2 * inter)) {
        let (gate, up) = in_row.split_at(inter);
        for i in 0..inter {
            out_row[i] = act(gate[i]) * up[i];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn activation_values() {
        assert_eq!(silu(0.0), 0.0);
        // silu(1) = 1 / (1 + e^-1)
        assert!((silu(1.0) - 0.731_058_6).abs() < 1e-6);
        assert!((silu(-20.0)).abs() < 1e-7);
        assert_eq!(gelu_tanh(0.0), 0.0);
        // torch.nn.functional.gelu(torch.tensor(1.0), approximate="tanh") = 0.8411920
        assert!((gelu_tanh(1.0) - 0.841_192).abs() < 1e-6);
        assert!((gelu_tanh(-1.0) + 0.158_808).abs() < 1e-6);
        // scipy.special.erf / torch.nn.functional.gelu(x) (exact).
        assert_eq!(erf(0.0), 0.0);
        assert!((erf(0.5) - 0.520_499_9).abs() < 2e-7);
        assert!((erf(-2.0) + 0.995_322_3).abs() < 2e-7);
        assert!((erf(2.9) - 0.999_958_9).abs() < 2e-7);
        assert!((erf(3.1) - 0.999_988_4).abs() < 2e-7);
        assert_eq!(erf(10.0), 1.0);
        assert_eq!(gelu_erf(0.0), 0.0);
        assert!((gelu_erf(1.0) - 0.841_344_7).abs() < 1e-6);
        assert!((gelu_erf(-1.0) + 0.158_655_3).abs() < 1e-6);
        assert!((gelu_erf(2.0) - 1.954_499_7).abs() < 1e-6);
    }

    #[test]
    fn gate_then_up_per_row() {
        // Two rows, inter = 2: [g0 g1 u0 u1].
        let gate_up = [1.0, 0.0, 2.0, 5.0, -1.0, 3.0, 4.0, 0.5];
        let mut out = [0.0; 4];
        silu_and_mul(&mut out, &gate_up, 2);
        assert_eq!(out[0], silu(1.0) * 2.0);
        assert_eq!(out[1], 0.0);
        assert_eq!(out[2], silu(-1.0) * 4.0);
        assert_eq!(out[3], silu(3.0) * 0.5);
        gelu_tanh_and_mul(&mut out, &gate_up, 2);
        assert_eq!(out[0], gelu_tanh(1.0) * 2.0);
        assert_eq!(out[3], gelu_tanh(3.0) * 0.5);
        gelu_erf_and_mul(&mut out, &gate_up, 2);
        assert_eq!(out[0], gelu_erf(1.0) * 2.0);
        assert_eq!(out[2], gelu_erf(-1.0) * 4.0);
    }
}
