//! The model runner and the engine core that drives the scheduler with it.

pub mod backend;
pub mod batch;
pub mod detokenize;
pub mod engine_core;
pub mod host;
pub mod memory_plan;
pub mod model;
pub mod sampling;
pub mod structured;
pub mod tokenizer;
