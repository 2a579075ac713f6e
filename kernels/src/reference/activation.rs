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

/// Llama/Qwen MLP: `silu(gate) * up`.
pub fn silu_and_mul(out: &mut [f32], gate_up: &[f32], inter: usize) {
    gated(out, gate_up, inter, silu)
}

/// Gemma MLP: `gelu_tanh(gate) * up`.
pub fn gelu_tanh_and_mul(out: &mut [f32], gate_up: &[f32], inter: usize) {
    gated(out, gate_up, inter, gelu_tanh)
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
    }
}
