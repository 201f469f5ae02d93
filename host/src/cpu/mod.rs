//! CPU references of the kernel families: naive implementations written from `docs/MATH.md`,
//! never derived from the GPU code. Accumulation in f64; where docs/MATH.md defines an
//! operation in f32 (the FP8 scales and divisions) the reference does exactly that operation,
//! so codes compare bit-exact.

pub mod attn;
pub mod conv1d;
pub mod gemm;
pub mod moe;
pub mod norm;
pub mod nvfp4;
pub mod quant;
pub mod router;
pub mod sample;
pub mod ssd;
pub mod ssm;
pub mod w4a4;
