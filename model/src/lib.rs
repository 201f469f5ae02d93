//! NemotronH: config, checkpoint loading, the hybrid stack, the state cache and the engine.
//!
//! In progress: so far the crate parses and checks a checkpoint's `config.json` ([`Config`])
//! and maps its safetensors files ([`Checkpoint`]), finds and checks every tensor the config
//! needs ([`layout::Layout`]), runs the whole model in f64 on the CPU one token at a time as
//! the oracle for the backends ([`reference::Reference`]), and writes random checkpoints for
//! tests ([`synthetic`]). It depends on `host` only, and never on the driver directly.

pub mod backend;
pub mod built_in;
pub mod cache;
pub mod chat;
pub mod config;
pub mod cpu;
pub mod cuda;
pub mod engine;
mod error;
pub mod fp8;
pub mod hub;
pub mod layout;
pub mod logs;
pub mod model;
pub mod nvfp4;
pub mod profile;
pub mod quantization;
pub mod reference;
pub mod sampling;
pub mod serve;
pub mod synthetic;
pub mod weights;

pub use config::{Config, LayerKind};
pub use error::{Error, Result};
pub use weights::Checkpoint;
