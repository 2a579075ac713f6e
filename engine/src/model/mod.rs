//! The model: configuration, weights, the transformer, and directory loading.

mod attention;
pub mod config;
pub(crate) mod decode_attention;
pub mod loader;
mod rope;
pub mod transformer;
pub mod weights;

pub use config::{Arch, ModelConfig};
pub use loader::{load_model, load_model_dir, LoadedModel};
pub use transformer::Model;
