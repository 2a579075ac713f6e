//! CPU reference kernels: f32, plain loops, written to be obviously right rather than fast.
//!
//! They are the CPU backend's kernels and the oracle for the CUDA kernels (which take bf16
//! inputs: round inputs with [`crate::bf16::round`] before calling these to compare).

mod activation;
mod attention;
mod kv_cache;
mod norm;
mod rope;

pub use activation::{gelu_tanh, gelu_tanh_and_mul, silu, silu_and_mul};
pub use attention::{paged_attention_decode, paged_attention_prefill, PagedKv};
pub use kv_cache::reshape_and_cache;
pub use norm::{rms_norm, RmsWeight};
pub use rope::{default_inv_freq, rope_neox, RopeTable};
