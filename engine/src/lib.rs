//! infer-engine: the real engine. This crate holds the model runner — loading Hugging Face
//! model directories, one transformer code path executing flattened step batches over a
//! paged KV store (written once against the `backend` seam: on the CPU candle plus the
//! backend's own f32/bf16 projection kernel, on CUDA with `--features cuda` cuBLAS and
//! NVRTC kernels), sampling and
//! streaming detokenisation — plus generated models for tests and `builtin:tiny`.
//! The HTTP server, load generator and profiler drive `infer-core` on top of it.

pub mod backend;
pub mod batch;
pub mod bench;
pub mod builtin;
mod corpus;
pub mod detokenize;
pub mod engine_core;
pub mod generate;
pub mod host;
pub mod make_model;
pub mod memory_plan;
pub mod model;
pub mod profile;
pub mod sampling;
pub mod serve;
pub mod tokenizer;
pub mod verify;

pub use backend::{Device, Logits};
pub use batch::{ForwardBatch, SeqChunk};
pub use model::{load_model, load_model_dir, Arch, KvCache, LoadedModel, Model, ModelConfig};
