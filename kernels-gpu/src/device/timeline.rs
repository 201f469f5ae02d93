//! The `timeline` feature (a diagnostic build: `NEMO_TIMELINE` set when host/build.rs runs):
//! block 0 of every launch records (start, wait returned, grid x | y << 32, block size) in
//! `TIMELINE`, slots taken in arrival order by `TIMELINE_N` (read and reset by the host's
//! `Gpu::timeline`).

use core::arch::asm;

use super::{block_dim_x, block_x, block_y, block_z, grid_dim_x, grid_dim_y, st, thread_x};

#[inline(always)]
pub(super) fn globaltimer() -> u64 {
    let t: u64;
    // SAFETY: reads a special register.
    unsafe { asm!("mov.u64 {t}, %globaltimer;", t = out(reg64) t, options(nomem, nostack)) };
    t
}

const SLOTS: usize = 8192;
#[unsafe(no_mangle)]
static mut TIMELINE: [u64; 4 * SLOTS] = [0; 4 * SLOTS];
#[unsafe(no_mangle)]
static TIMELINE_N: core::sync::atomic::AtomicU32 = core::sync::atomic::AtomicU32::new(0);

#[inline(always)]
pub(super) fn record(t0: u64) {
    if thread_x() == 0 && block_x() == 0 && block_y() == 0 && block_z() == 0 {
        let t1 = globaltimer();
        let slot = TIMELINE_N.fetch_add(1, core::sync::atomic::Ordering::Relaxed) as usize;
        if slot < SLOTS {
            let grid = u64::from(grid_dim_x()) | (u64::from(grid_dim_y()) << 32);
            // SAFETY: slot < SLOTS; one writer per slot.
            unsafe {
                let p = (&raw mut TIMELINE) as *mut u64;
                st(p, 4 * slot, t0);
                st(p, 4 * slot + 1, t1);
                st(p, 4 * slot + 2, grid);
                st(p, 4 * slot + 3, u64::from(block_dim_x()));
            }
        }
    }
}
