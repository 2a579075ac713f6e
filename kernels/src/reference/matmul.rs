//! Linear layers: `out = x @ w^T` with the weight stored as `[out_features, in_features]`
//! (the PyTorch / safetensors layout). On the GPU this is cuBLAS (`cuda::Gemm`).

/// `out[m, n] = x[m, k] @ w[n, k]^T`, all row-major, f32 accumulation.
pub fn matmul_xwt(out: &mut [f32], x: &[f32], w: &[f32], m: usize, n: usize, k: usize) {
    assert_eq!(out.len(), m * n);
    assert_eq!(x.len(), m * k);
    assert_eq!(w.len(), n * k);
    for i in 0..m {
        let x_row = &x[i * k..][..k];
        for j in 0..n {
            let w_row = &w[j * k..][..k];
            out[i * n + j] = x_row.iter().zip(w_row).map(|(a, b)| a * b).sum();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hand_computed_product() {
        // x: [2, 3], w: [2 out, 3 in].
        let x = [1.0, 2.0, 3.0, -1.0, 0.0, 1.0];
        let w = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0];
        let mut out = [0.0; 4];
        matmul_xwt(&mut out, &x, &w, 2, 2, 3);
        assert_eq!(out, [1.0, 6.0, -1.0, 0.0]);
    }
}
