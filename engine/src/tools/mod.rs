//! The engine's tools: profiling and predict-vs-measure verification, generated test models
//! (and `builtin:tiny`, one of them), and offline generation.

pub mod builtin;
mod corpus;
pub mod generate;
pub mod make_model;
pub mod profile;
pub mod verify;
