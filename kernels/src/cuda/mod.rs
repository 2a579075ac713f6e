//! The CUDA side: kernel sources, NVRTC compilation, loading and typed launches.
//!
//! - [`sources`]: the `.cu` files and their entry points.
//! - [`nvrtc`]: finding libnvrtc (a CUDA toolkit or the `nvidia-cuda-nvrtc-cu12` wheel) and
//!   compiling the sources to PTX for a compute capability. Needs no GPU.
//! - [`kernels`]: loading the PTX into a CUDA context and launching, with every grid/block
//!   shape decided in one place.

pub mod kernels;
pub mod nvrtc;
pub mod sources;

pub use kernels::Kernels;
pub use nvrtc::{compile, nvrtc_version, ComputeCapability};
