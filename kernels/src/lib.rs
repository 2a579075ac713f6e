//! infer-kernels: CUDA kernels (paged attention, KV write, fused norms) compiled through NVRTC,
//! each with a CPU reference implementation. Filled by the CUDA issue.
