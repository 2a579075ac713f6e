//! The CUDA side: kernel sources, NVRTC compilation, loading and typed launches, cuBLAS GEMM.
//!
//! - [`sources`]: the `.cu` files and their entry points.
//! - [`nvrtc`]: finding libnvrtc (a CUDA toolkit or the `nvidia-cuda-nvrtc-cu12` wheel) and
//!   compiling the sources to PTX for a compute capability. Needs no GPU.
//! - [`kernels`]: loading the PTX into a CUDA context and launching, with every grid/block
//!   shape decided in one place.
//! - [`gemm`]: `x @ w^T` through cuBLAS with a preallocated workspace.
//! - [`span`]: the raw device-address spans every launch takes.
//!
//! `cudarc` itself is re-exported so that users need no dependency of their own on it.

pub mod gemm;
pub mod kernels;
pub mod launch;
pub mod nvrtc;
pub mod sources;
pub mod span;

pub use cudarc;
pub use gemm::Gemm;
pub use kernels::{
    DecodeKernel, DeviceBlockTables, DeviceKv, DeviceSampledRows, DeviceSamplingBatch, KernelError,
    Kernels, PrefillKernel,
};
pub use nvrtc::{compile, nvrtc_version, ComputeCapability};
pub use span::Span;
