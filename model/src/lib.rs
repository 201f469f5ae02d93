//! NemotronH: config, checkpoint loading, the hybrid stack, the state cache and the engine.
//!
//! Not yet implemented: this crate is the place the model issues fill. It depends on `host`
//! only, and never on the driver directly.
