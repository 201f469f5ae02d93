//! Tensor maps (sm_90+): how the tensor memory accelerator finds a box of a tensor in global
//! memory. The FP8 `wgmma` kernels copy their stages with it, their maps in their parameter
//! ([`kernels_gpu::grouped::Tma`]).

use cudarc::driver::sys;

use crate::error::{During, Result};

/// The tensor map of a tensor of bytes at `addr`: `dims` its extents, innermost first,
/// `strides[i]` the bytes from one index of dimension `i + 1` to the next, copied in boxes of
/// `boxes` (its extent in each dimension), rows of a box in the 128-byte swizzle (innermost
/// extent 128 bytes at most; the box lands 1024-byte aligned in the `wgmma` tiles' layout),
/// L2 promotion of 256 bytes, zeros where a box reaches past the tensor. The driver refuses
/// what it cannot encode (an address not 16-byte aligned, a stride not a multiple of 16, an
/// extent of 0 or past 2^32, a box past 256): an error naming the encoding.
///
/// # Panics
/// Where the slices' lengths disagree (`dims` and `boxes` 1 to 5 long, `strides` one less).
pub(crate) fn byte_tensor_map(addr: u64, dims: &[u64], strides: &[u64], boxes: &[u32]) -> Result<[u64; 16]> {
    let rank = dims.len();
    assert!((1..=5).contains(&rank) && boxes.len() == rank && strides.len() + 1 == rank, "tensor map of rank {rank}");
    let mut map = sys::CUtensorMap { opaque: [0; 16] };
    let unit = [1u32; 5];
    // SAFETY: `map` is a writable, 64-byte aligned tensor map; the arrays hold `rank` (the
    // strides `rank - 1`) elements; the driver only encodes the address, it reads no memory.
    let encoded = unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8,
            rank as u32,
            addr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            unit.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    encoded.result().during("encoding a tensor map (cuTensorMapEncodeTiled)")?;
    Ok(map.opaque)
}
