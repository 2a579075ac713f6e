//! RMSNorm over the last dimension: `out = x / sqrt(mean(x^2) + eps) * weight'`.
//!
//! Also serves Qwen3's per-head q/k norm: treat `[tokens * heads, head_dim]` as the rows.

/// How the stored weight scales the normalised value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RmsWeight {
    /// Llama/Qwen: `weight`.
    Scale,
    /// Gemma stores the weight centred on zero: `1 + weight`.
    OnePlus,
}

/// `x`, `out`: `[rows, hidden]`; `weight`: `[hidden]`.
pub fn rms_norm(out: &mut [f32], x: &[f32], weight: &[f32], eps: f32, style: RmsWeight) {
    let hidden = weight.len();
    assert_eq!(x.len(), out.len());
    assert_eq!(x.len() % hidden, 0);
    for (out_row, x_row) in out.chunks_mut(hidden).zip(x.chunks(hidden)) {
        let mean_sq = x_row.iter().map(|v| v * v).sum::<f32>() / hidden as f32;
        let inv_rms = 1.0 / (mean_sq + eps).sqrt();
        for i in 0..hidden {
            let w = match style {
                RmsWeight::Scale => weight[i],
                RmsWeight::OnePlus => 1.0 + weight[i],
            };
            out_row[i] = x_row[i] * inv_rms * w;
        }
    }
}

/// The pre-norm block's residual step: `residual += x`, then `out = rms_norm(residual)`.
/// `residual`, `x`, `out`: `[rows, hidden]`. (The kernel stores the sum in bf16 and normalises
/// the stored value.)
pub fn fused_add_rms_norm(
    out: &mut [f32],
    residual: &mut [f32],
    x: &[f32],
    weight: &[f32],
    eps: f32,
    style: RmsWeight,
) {
    super::add(residual, x);
    rms_norm(out, residual, weight, eps, style);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hand_computed_rows() {
        // Row [3, 4]: mean square 12.5, rms = sqrt(12.5). Row [1, 1]: rms 1.
        let x = [3.0, 4.0, 1.0, 1.0];
        let w = [1.0, 2.0];
        let mut out = [0.0; 4];
        rms_norm(&mut out, &x, &w, 0.0, RmsWeight::Scale);
        let r = 12.5f32.sqrt();
        assert!((out[0] - 3.0 / r).abs() < 1e-6);
        assert!((out[1] - 8.0 / r).abs() < 1e-6);
        assert_eq!(&out[2..], &[1.0, 2.0]);
        rms_norm(&mut out, &x, &w, 0.0, RmsWeight::OnePlus);
        assert!((out[0] - 6.0 / r).abs() < 1e-6);
        assert_eq!(&out[2..], &[2.0, 3.0]);
    }

    #[test]
    fn fused_add_then_norm() {
        let mut residual = [1.0, 4.0, 0.0, 2.0];
        let mut out = [0.0; 4];
        fused_add_rms_norm(
            &mut out,
            &mut residual,
            &[2.0, 0.0, 1.0, -1.0],
            &[1.0, 2.0],
            0.0,
            RmsWeight::Scale,
        );
        assert_eq!(residual, [3.0, 4.0, 1.0, 1.0]);
        let r = 12.5f32.sqrt();
        assert!((out[0] - 3.0 / r).abs() < 1e-6);
        assert!((out[1] - 8.0 / r).abs() < 1e-6);
        assert_eq!(&out[2..], &[1.0, 2.0]);
    }

    #[test]
    fn eps_guards_zero_rows() {
        let mut out = [1.0; 2];
        rms_norm(&mut out, &[0.0, 0.0], &[1.0, 1.0], 1e-6, RmsWeight::Scale);
        assert_eq!(out, [0.0, 0.0]);
    }
}
