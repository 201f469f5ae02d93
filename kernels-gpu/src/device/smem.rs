//! The block's shared memory: the dynamic shared memory the launch sizes, and `static_smem!` for
//! static shared arrays.

use core::arch::asm;

// The block's dynamic shared memory (sized by the launch). A module-level `.extern .shared`
// declaration is the only form ptxas accepts for it.
core::arch::global_asm!(".extern .shared .align 16 .b8 dyn_smem[];");

/// Start of the block's dynamic shared memory, as f32 words.
#[inline(always)]
pub fn dyn_smem_f32() -> *mut f32 {
    let p: u64;
    // SAFETY: takes the generic address of the module's `dyn_smem` symbol.
    unsafe { asm!("cvta.shared.u64 {p}, dyn_smem;", p = out(reg64) p, options(pure, nomem, nostack)) };
    p as *mut f32
}

/// A generic `*mut f32` to a static shared array of the block, `$bytes` bytes (4-byte aligned)
/// named `$name` (unique in the module): a `.shared` declaration inside an asm block, the form
/// of static shared memory the NVPTX backend takes. Expands to inline assembly: use it inside
/// an `unsafe` block (the assembly only declares the array and takes its address).
macro_rules! static_smem {
    ($name:literal, $bytes:expr) => {{
        let p: *mut f32;
        core::arch::asm!(
            concat!("{{ .shared .align 4 .b8 ", $name, "[{n}]; cvta.shared.u64 {p}, ", $name, "; }}"),
            p = out(reg64) p,
            n = const ($bytes),
            options(nostack),
        );
        p
    }};
}
pub(crate) use static_smem;
