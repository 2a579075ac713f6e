//! The model: configuration, weights, the transformer (written once against
//! [`crate::runtime::backend::Backend`]), and directory loading.

pub mod config;
mod dispatch;
pub mod loader;
mod rope;
pub mod transformer;
pub mod weights;

pub use config::{Arch, ModelConfig};
pub use dispatch::{KvCache, Model};
pub use loader::{load_model, load_model_dir, LoadedModel, SamplingDefaults};
