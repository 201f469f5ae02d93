//! NemotronH: config, checkpoint loading, the hybrid stack, the state cache and the engine.
//!
//! In progress: so far the crate parses and checks a checkpoint's `config.json` ([`Config`])
//! and maps its safetensors files ([`Checkpoint`]). It depends on `host` only, and never on
//! the driver directly.

pub mod config;
mod error;
pub mod weights;

pub use config::{Config, LayerKind};
pub use error::{Error, Result};
pub use weights::Checkpoint;
