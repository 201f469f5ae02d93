//! NemotronH from a Hugging Face checkpoint: its config ([`Config`]) and safetensors
//! ([`Checkpoint`]) found and checked ([`layout::Layout`]), the hybrid stack over a backend
//! (the CPU reference or CUDA: [`model::Model`]), the engine that batches requests
//! ([`engine::Engine`]), text in and text out on top of it ([`text::Llm`]), the chat template
//! and output parsing ([`chat`]), the prefix cache ([`prefix`]), the OpenAI-compatible server ([`serve`]), an f64 oracle
//! ([`reference::Reference`]) and random checkpoints for tests and benches ([`synthetic`]).

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
pub mod prefix;
pub mod profile;
pub mod quantization;
pub mod reference;
pub mod sampling;
pub mod serve;
pub mod structured;
pub mod synthetic;
pub mod text;
pub mod weights;

pub use config::{Config, LayerKind};
pub use error::{Error, Result};
pub use weights::Checkpoint;
