//! Linear layers through cuBLAS: `out = x @ w^T`, bf16 in and out, f32 accumulation.
//!
//! The handle gets a preallocated workspace, so no GEMM allocates: the calls can be captured
//! into a CUDA graph (cuBLAS otherwise allocates its workspace on first use, which capture
//! forbids).

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublas::result as blas;
use cudarc::cublas::sys::{
    self as cublas, cublasComputeType_t, cublasHandle_t, cublasOperation_t, cudaDataType,
};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

use super::kernels::KernelError;
use super::span::Span;
use crate::compat::{self, Version};

/// cuBLAS workspace preallocated for the handle (what cuBLAS recommends for Hopper).
pub const WORKSPACE_BYTES: usize = 32 << 20;

/// Panics unless `out`, `x` and `w` are `[m, n]`, `[m, k]` and `[n, k]`: the shapes of
/// `out = x @ w^T`, whichever kernel computes it (cuBLAS or the skinny GEMM).
pub(crate) fn check_xwt_shapes(
    out: Span<u16>,
    x: Span<u16>,
    w: Span<u16>,
    m: usize,
    n: usize,
    k: usize,
) {
    assert_eq!(out.len(), m * n, "out is not [m, n]");
    assert_eq!(x.len(), m * k, "x is not [m, k]");
    assert_eq!(w.len(), n * k, "w is not [n, k]");
}

/// The loaded cuBLAS's version.
pub fn cublas_version() -> Version {
    let get = |property| {
        let mut v = 0;
        // SAFETY: an out-parameter; needs no handle.
        unsafe { cublas::cublasGetProperty(property, &mut v) };
        v
    };
    Version(
        get(cublas::libraryPropertyType::MAJOR_VERSION),
        get(cublas::libraryPropertyType::MINOR_VERSION),
    )
}

/// A cuBLAS handle bound to one stream, with its own workspace.
pub struct Gemm {
    handle: cublasHandle_t,
    workspace: CudaSlice<u8>,
    stream: Arc<CudaStream>,
}

// SAFETY: as cudarc's `CudaBlas`: the handle is only used through `&self` calls that enqueue on
// the handle's one stream; cuBLAS handles may be used from any thread.
unsafe impl Send for Gemm {}
unsafe impl Sync for Gemm {}

impl Gemm {
    /// Create a handle on `stream`'s context, bind it to `stream`, and give it a
    /// [`WORKSPACE_BYTES`] workspace. Math mode is cuBLAS's default.
    pub fn new(stream: Arc<CudaStream>) -> Result<Self, KernelError> {
        // SAFETY: only tries to dlopen libcublas.
        if !unsafe { cublas::is_culib_present() } {
            return Err(KernelError::CublasMissing);
        }
        stream.context().bind_to_thread()?;
        let (major, minor) = stream.context().compute_capability()?;
        compat::check_cublas(
            compat::arch_code(major as u32, minor as u32),
            cublas_version(),
        )
        .map_err(KernelError::Unsupported)?;
        // SAFETY: allocation on the stream; cuBLAS never reads the workspace before writing it.
        let workspace = unsafe { stream.alloc::<u8>(WORKSPACE_BYTES) }?;
        let handle = blas::create_handle()?;
        // From here on `gemm` owns the handle and destroys it on any error below.
        let gemm = Self {
            handle,
            workspace,
            stream,
        };
        let workspace_ptr = {
            let (ptr, _guard) = gemm.workspace.device_ptr(&gemm.stream);
            ptr
        };
        // SAFETY: a live handle, the stream of this context, and a workspace that lives (in
        // `gemm`) as long as the handle.
        unsafe {
            blas::set_stream(gemm.handle, gemm.stream.cu_stream() as _)?;
            cublas::cublasSetWorkspace_v2(
                gemm.handle,
                workspace_ptr as *mut c_void,
                WORKSPACE_BYTES,
            )
            .result()?;
        }
        Ok(gemm)
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The row count a step's GEMMs run at for `m` rows: `m` itself up to 32 (small decode
    /// batches, where cuBLAS has GEMV-like kernels worth keeping), else `m` rounded up to a
    /// multiple of 16 up to 512, of 64 up to 4,096, of 256 beyond.
    ///
    /// cuBLAS picks an algorithm per shape with a heuristic it caches by shape, and on an H100
    /// the first call of a shape costs milliseconds (measured: a never-seen ~330-token prefill
    /// of a 1B model 14 ms, the same lengths again 5 ms). Served prompts almost always have a
    /// new length, so without buckets that cost lands on nearly every TTFT. Bucketed, the
    /// shapes are few enough to be warmed up at start; the extra rows cost little (fewer than
    /// 16 up to 512 rows, where a step is mostly bound by reading the weights; at most 12.5%
    /// beyond).
    pub fn padded_rows(m: usize) -> usize {
        let step = match m {
            0..=32 => 1,
            33..=512 => 16,
            513..=4096 => 64,
            _ => 256,
        };
        m.div_ceil(step) * step
    }

    /// `out[m, n] = x[m, k] @ w[n, k]^T` (row-major, `out` written), bf16 in and out, f32
    /// accumulation (`cublasGemmEx`, `CUBLAS_COMPUTE_32F`, `CUDA_R_16BF`). See
    /// [`crate::reference::matmul_xwt`].
    pub fn matmul_bf16(
        &self,
        out: Span<u16>,
        x: Span<u16>,
        w: Span<u16>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<(), KernelError> {
        assert!(m > 0 && n > 0 && k > 0, "empty matmul {m}x{n}x{k}");
        check_xwt_shapes(out, x, w, m, n, k);
        let (m, n, k) = (c_int(m), c_int(n), c_int(k));
        let (alpha, beta) = (1.0f32, 0.0f32);
        // Row-major out[m, n] is column-major out^T[n, m] = w[n, k] · x^T: A = w read transposed
        // (stored column-major as [k, n], lda = k), B = x as stored (column-major [k, m],
        // ldb = k), C column-major [n, m] with ldc = n.
        // SAFETY: the spans hold exactly the elements the shapes address (checked above);
        // alpha/beta are host f32s, as the default pointer mode and COMPUTE_32F expect.
        unsafe {
            blas::gemm_ex(
                self.handle,
                cublasOperation_t::CUBLAS_OP_T,
                cublasOperation_t::CUBLAS_OP_N,
                n,
                m,
                k,
                &alpha as *const f32 as *const c_void,
                w.ptr() as *const c_void,
                cudaDataType::CUDA_R_16BF,
                k,
                x.ptr() as *const c_void,
                cudaDataType::CUDA_R_16BF,
                k,
                &beta as *const f32 as *const c_void,
                out.ptr() as *mut c_void,
                cudaDataType::CUDA_R_16BF,
                n,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )?;
        }
        Ok(())
    }
}

impl Drop for Gemm {
    fn drop(&mut self) {
        // SAFETY: the handle was created in `new` and is destroyed once, here. Errors cannot be
        // reported from drop; a failure to destroy only leaks the handle.
        let _ = unsafe { blas::destroy_handle(self.handle) };
    }
}

fn c_int(x: usize) -> i32 {
    i32::try_from(x).expect("matmul dimension exceeds i32")
}

#[cfg(test)]
mod tests {
    use super::Gemm;

    #[test]
    fn row_buckets_cover_and_stay_close() {
        let mut buckets = std::collections::BTreeSet::new();
        for m in 1..=8192 {
            let b = Gemm::padded_rows(m);
            assert!(b >= m, "{m} -> {b}");
            // Exact up to 32, fewer than 16 extra rows up to 512, and past that at most 12.5%
            // extra (63 of 513 is the worst).
            assert!(m > 32 || b == m, "{m} -> {b}");
            assert!(m > 512 || b - m < 16, "{m} -> {b}");
            assert!(m <= 512 || (b - m) * 8 <= m, "{m} -> {b}");
            buckets.insert(b);
        }
        // Few enough to warm up at start: 32 exact, 30 of 16, 56 of 64, 16 of 256.
        assert_eq!(buckets.len(), 32 + 30 + 56 + 16);
    }
}
