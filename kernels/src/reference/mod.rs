//! CPU reference kernels: f32, plain loops, written to be obviously right rather than fast.
//!
//! They are the CPU backend's kernels and the oracle for the CUDA kernels (which take bf16
//! inputs: round inputs with [`crate::bf16::round`] before calling these to compare).

mod activation;
mod attention;
mod elementwise;
mod gather;
mod kv_cache;
mod matmul;
mod norm;
mod rope;
mod sampling;

pub use activation::{
    erf, gelu_erf, gelu_erf_and_mul, gelu_tanh, gelu_tanh_and_mul, silu, silu_and_mul,
};
pub use attention::{
    paged_attention_decode, paged_attention_decode_split, paged_attention_prefill, PagedKv,
};
pub use elementwise::{add, bias_add, logits, softcap};
pub use gather::{copy_columns, embedding, gather_rows};
pub use kv_cache::{qkv_rope_and_cache, reshape_and_cache};
pub use matmul::matmul_xwt;
pub use norm::{fused_add_rms_norm, rms_norm, RmsWeight};
pub use rope::{default_inv_freq, rope_neox, RopeTable};
pub use sampling::{adjust_logits, draw_target, keep_threshold, mass_target, sample_rows, weights};
