//! Element-wise kernels: residual add, bias add, and the f32 logits with optional soft-cap.

/// `cap * tanh(x / cap)` when `cap` is set (Gemma's attention and final-logit soft-capping),
/// else `x`. A cap `<= 0` means none, as in the kernels.
pub fn softcap(x: f32, cap: Option<f32>) -> f32 {
    match cap {
        Some(c) if c > 0.0 => c * (x / c).tanh(),
        _ => x,
    }
}

/// Residual add: `x += y`.
pub fn add(x: &mut [f32], y: &[f32]) {
    assert_eq!(x.len(), y.len());
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// `x[r, c] += bias[c]` for `x`: `[rows, bias.len()]`.
pub fn bias_add(x: &mut [f32], bias: &[f32]) {
    assert_eq!(x.len() % bias.len(), 0);
    for row in x.chunks_mut(bias.len()) {
        add(row, bias);
    }
}

/// The sampler's input: `out = softcap(x)` (Gemma 2's `final_logit_softcapping`), or a copy.
pub fn logits(out: &mut [f32], x: &[f32], cap: Option<f32>) {
    assert_eq!(out.len(), x.len());
    for (o, &v) in out.iter_mut().zip(x) {
        *o = softcap(v, cap);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adds() {
        let mut x = [1.0, 2.0, 3.0, 4.0];
        add(&mut x, &[0.5, -2.0, 0.0, 1.0]);
        assert_eq!(x, [1.5, 0.0, 3.0, 5.0]);
        bias_add(&mut x, &[1.0, 10.0]);
        assert_eq!(x, [2.5, 10.0, 4.0, 15.0]);
    }

    #[test]
    fn soft_capped_logits() {
        let x = [0.0, 1.0, -300.0, 30.0];
        let mut out = [0.0; 4];
        logits(&mut out, &x, None);
        assert_eq!(out, x);
        logits(&mut out, &x, Some(30.0));
        assert_eq!(out[0], 0.0);
        assert!((out[1] - 30.0 * (1.0f32 / 30.0).tanh()).abs() < 1e-6);
        assert!((out[2] + 30.0).abs() < 1e-4, "saturates at -cap");
        assert!((out[3] - 30.0 * 1f32.tanh()).abs() < 1e-5);
        assert_eq!(softcap(5.0, Some(0.0)), 5.0);
    }
}
