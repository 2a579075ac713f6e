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

/// cuBLAS workspace preallocated for the handle (what cuBLAS recommends for Hopper).
pub const WORKSPACE_BYTES: usize = 32 << 20;

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
        assert_eq!(out.len(), m * n, "out is not [m, n]");
        assert_eq!(x.len(), m * k, "x is not [m, k]");
        assert_eq!(w.len(), n * k, "w is not [n, k]");
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
