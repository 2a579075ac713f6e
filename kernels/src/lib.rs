//! infer-kernels: the GPU kernels of the engine's model runner, and a CPU reference for each.
//!
//! Every kernel exists twice:
//! - [`reference`]: plain f32 loops in Rust, written for clarity: the oracle the CUDA
//!   kernels are tested against. (The engine's CPU backend is not built on them: it runs
//!   candle plus its own in-place paged decode attention, tuned for speed, tested against
//!   [`reference::paged_attention_decode`] and, end to end, against candle-transformers'
//!   models.)
//! - `cuda` (feature `cuda`): CUDA C sources compiled at run time with NVRTC for the GPU's
//!   compute capability, typed launch wrappers over raw device-address spans, and cuBLAS for
//!   the linear layers (`reference::matmul_xwt` is its CPU counterpart).
//!
//! And one CPU kernel that is not a reference: [`cpu_matmul`], the engine's CPU backend's
//! linear layers, where nearly all of a CPU forward pass goes. It lives here so that test
//! builds optimise it (the workspace's `Cargo.toml` optimises this crate in the dev
//! profile): unoptimised, it made the engine's tests four times slower.
//!
//! Both sides share the tensor layouts described in [`layout`]; storage on the GPU is bf16
//! (raw `u16` bits, see [`bf16`]) with f32 arithmetic inside every kernel.
//!
//! All CUDA kernels are written to be captured in CUDA graphs: grid sizes depend only on the
//! batch shape (number of sequences / tokens), never on context lengths, and all per-step data
//! (sequence lengths, positions, block tables, slot mappings) is read from device memory. A
//! captured decode graph can therefore be replayed for any context length by rewriting those
//! buffers in place. The kernels bound every index they read from device memory (bad ids,
//! slots, block ids and positions are skipped or give zeros), so no device data can make them
//! touch memory outside their buffers; the CPU references follow the same rules.

pub mod bf16;
pub mod compat;
pub mod cpu_matmul;
pub mod decode_split;
pub mod fp8;
pub mod layout;
pub mod reference;
pub mod sampling;

#[cfg(feature = "cuda")]
pub mod cuda;
