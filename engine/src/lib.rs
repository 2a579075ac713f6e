//! infer-engine: the real engine, by job.
//!
//! - [`runtime`]: the model runner — Hugging Face model directories loaded into one
//!   transformer code path that executes flattened step batches over a paged KV store,
//!   written once against the [`runtime::backend`] seam (on the CPU candle plus the backend's
//!   own f32/bf16 projection kernel and in-place decode attention; on CUDA, with `--features
//!   cuda`, cuBLAS and the NVRTC kernels of `infer-kernels`) — plus sampling, tokenisation,
//!   streaming detokenisation and the engine core that drives `infer-core`'s scheduler one
//!   step at a time.
//! - [`server`]: `engine serve` — the OpenAI-compatible HTTP server around the engine core
//!   (engine thread, routes, SSE, request parsing, Prometheus metrics, KV-cache events).
//! - [`loadgen`]: `engine bench` and `engine probe` — the load generator for any
//!   OpenAI-compatible server.
//! - [`tools`]: `engine profile`, `verify`, `make-model`, `generate` and the `builtin:tiny`
//!   model.

pub mod loadgen;
pub mod runtime;
pub mod server;
pub mod tools;

pub use runtime::backend::{Device, Logits};
pub use runtime::batch::{ForwardBatch, SeqChunk};
pub use runtime::model::{
    load_model, load_model_dir, Arch, KvCache, LoadedModel, Model, ModelConfig,
};
