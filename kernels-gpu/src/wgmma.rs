//! Warpgroup matrix products (`wgmma.mma_async`, sm_90a only): operands in shared memory
//! described by 64-bit descriptors, f32 accumulators in the registers of a warpgroup (four
//! warps, 128 threads), through inline PTX. Only the sm_90a PTX has them (`Kernel::in_arch`);
//! the host picks that PTX on devices of compute capability 9.0.
//!
//! # Shared-memory tiles
//! A [`SwizzledTile`] holds rows of 128 bytes (64 bf16 or 128 e4m3 of k: each operand
//! "K-major", A `[m][k]` and B `[n][k]`) in the 128-byte swizzle `wgmma` reads: the 16-byte
//! chunk c of row r sits at chunk `c ^ (r % 8)` of its row, rows 128 bytes apart, the tile
//! 1024-byte aligned (the swizzle repeats every 8 rows, 1024 bytes). Its descriptor
//! ([`SwizzledTile::desc`]): start address / 16 (bits 0-13), leading-dimension offset 1
//! (unused with this swizzle), stride offset 1024 / 16 (bits 32-45: 8 rows of 128 bytes to
//! the next 8), swizzle mode 1 (128 bytes, bits 62-63). The k16 (bf16) or k32 (e4m3) step kk
//! of a row starts 32 kk bytes in: its descriptor's start address 2 kk higher (the hardware
//! applies the swizzle to the address it forms).
//!
//! # One stage of products
//! [`mma_stage`] runs a warpgroup's 64 x 256 block over one 128-byte bf16 stage of k: for each
//! of the 4 k steps, two `m64n128` products (B rows 0..128 and 128..256), accumulating into
//! two sets of 64 f32 a thread. The fence, the products, their commit and the wait for them
//! are one asm block, so no instruction the compiler places can touch the accumulators while
//! the products are in flight. e4m3 products sum inside the tensor cores with fewer bits than
//! f32 (Hopper), so the FP8 stage ([`mma_stage_fp8`], 64 x 192) runs each half's 4 steps into
//! fresh registers and adds them to the accumulators in f32: a promotion every 128 of k.
//! Accumulator i of a thread, in warp `wi` of the warpgroup, is element (row `16 wi + lane / 4
//! + 8 ((i / 2) % 2)`, column `8 (i / 4) + 2 (lane % 4) + i % 2`) of its 64 x 128 half
//! ([`acc_row`], [`acc_col`]); of a 64 x 96 half the same for i below 48.

/// Bytes of k in a stage row (one 128-byte swizzled row).
pub const STAGE_ROW_BYTES: u32 = 128;

/// Row (within its warpgroup's 64-row block) of accumulator `i` of `lane` in warp `wi`.
pub const fn acc_row(wi: u32, lane: u32, i: u32) -> u32 {
    16 * wi + lane / 4 + 8 * ((i / 2) % 2)
}

/// Column (within its 128-column half) of accumulator `i` of `lane`.
pub const fn acc_col(lane: u32, i: u32) -> u32 {
    8 * (i / 4) + 2 * (lane % 4) + i % 2
}

#[cfg(all(target_arch = "nvptx64", target_feature = "sm_90a"))]
pub(crate) use device::*;

#[cfg(all(target_arch = "nvptx64", target_feature = "sm_90a"))]
mod device {
    use super::*;
    use core::arch::asm;

    /// A tile of 128-byte rows in the 128-byte swizzle ([`crate::swizzle_128`]), at a
    /// 1024-byte aligned shared address.
    #[derive(Clone, Copy)]
    pub struct SwizzledTile {
        pub addr: u32,
    }

    impl SwizzledTile {
        /// Shared address of 16-byte chunk `c` (0..8) of row `r`.
        #[inline(always)]
        pub fn chunk(self, r: u32, c: u32) -> u32 {
            self.addr + crate::swizzle_128(r, c)
        }

        /// The descriptor of the tile from row `r0` (a multiple of 8), at byte `kb` (a multiple
        /// of 32) of its rows.
        #[inline(always)]
        pub fn desc(self, r0: u32, kb: u32) -> u64 {
            crate::swizzle_128_desc(self.addr + r0 * STAGE_ROW_BYTES + kb)
        }
    }

    /// Sets the registers a thread of this warpgroup has to `N` (`setmaxnreg`, a multiple of 8
    /// in 24..=256): lowered (`RAISE` false) for a warpgroup that needs few, returning them to
    /// the block's pool, or raised, waiting until the pool has them. The block starts with the
    /// count ptxas gave the entry (its `.maxntid`'s bound), which the warpgroups' counts must
    /// not exceed together.
    ///
    /// # Safety
    /// The whole warpgroup calls it in uniform flow; raised counts stay within what lowered ones
    /// freed (or the raise waits forever).
    #[inline(always)]
    pub unsafe fn set_max_regs<const RAISE: bool, const N: u32>() {
        // SAFETY: guaranteed by the caller.
        unsafe {
            if RAISE {
                asm!("setmaxnreg.inc.sync.aligned.u32 {n};", n = const N, options(nostack))
            } else {
                asm!("setmaxnreg.dec.sync.aligned.u32 {n};", n = const N, options(nostack))
            }
        }
    }

    /// The first 64 accumulator registers of an asm block (its positional operands 0..64),
    /// as a `wgmma` operand list.
    macro_rules! d0 {
        () => {
            "{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}, {16}, {17}, {18}, {19}, {20}, {21}, {22}, {23}, {24}, {25}, {26}, {27}, {28}, {29}, {30}, {31}, {32}, {33}, {34}, {35}, {36}, {37}, {38}, {39}, {40}, {41}, {42}, {43}, {44}, {45}, {46}, {47}, {48}, {49}, {50}, {51}, {52}, {53}, {54}, {55}, {56}, {57}, {58}, {59}, {60}, {61}, {62}, {63}"
        };
    }

    /// Accumulator registers 64..128 (positional operands 64..128).
    macro_rules! d1 {
        () => {
            "{64}, {65}, {66}, {67}, {68}, {69}, {70}, {71}, {72}, {73}, {74}, {75}, {76}, {77}, {78}, {79}, {80}, {81}, {82}, {83}, {84}, {85}, {86}, {87}, {88}, {89}, {90}, {91}, {92}, {93}, {94}, {95}, {96}, {97}, {98}, {99}, {100}, {101}, {102}, {103}, {104}, {105}, {106}, {107}, {108}, {109}, {110}, {111}, {112}, {113}, {114}, {115}, {116}, {117}, {118}, {119}, {120}, {121}, {122}, {123}, {124}, {125}, {126}, {127}"
        };
    }

    /// One asm block of `wgmma` products: the fence, each step `[d a b p]` as `$ins {d}, a,
    /// b, p, $tail;` (`d` the accumulators' list, [`d0!`] or [`d1!`]; `a`, `b` operands; `p`
    /// scale-d: `p0` false, a product that overwrites, `p1` true, one that accumulates), then
    /// their commit and the wait for them, so no instruction the compiler places can touch the
    /// accumulators while the products are in flight. `$acc[i]` for each listed i are the
    /// positional operands 0.., then the steps' operands: `$arr[j]` for each array and listed j,
    /// in registers of class `$class`.
    macro_rules! products {
        ($ins:literal, $tail:literal; [$([$d:ident $a:literal $b:literal $p:literal])*];
         [$($class:ident $arr:expr => [$($j:literal)*]),*]; $acc:ident [$($i:literal)*]) => {
            asm!(
                "{{",
                ".reg .pred p0, p1;",
                "setp.ne.b32 p0, {zero}, 0;",
                "setp.ne.b32 p1, {one}, 0;",
                "wgmma.fence.sync.aligned;",
                $(concat!($ins, " {{", $d!(), "}}, ", $a, ", ", $b, ", ", $p, ", ", $tail, ";"),)*
                "wgmma.commit_group.sync.aligned;",
                "wgmma.wait_group.sync.aligned 0;",
                "}}",
                $(inout(reg32) $acc[$i],)*
                $($(in($class) $arr[$j],)*)*
                zero = in(reg32) 0u32,
                one = in(reg32) 1u32,
                options(nostack),
            )
        };
    }

    /// [`products!`] with its accumulators `$acc[0..64]`.
    macro_rules! products64 {
        ($($args:tt)*) => {
            products!($($args)* [0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31 32 33 34 35 36 37 38 39 40 41 42 43 44 45 46 47 48 49 50 51 52 53 54 55 56 57 58 59 60 61 62 63])
        };
    }

    /// `acc += A B` over one bf16 stage (the module docs): `a[kk]` the A descriptors of the 4
    /// k16 steps (the warpgroup's 64 rows), `b[h][kk]` those of B's rows `128 h .. + 128`.
    /// Returns with the products done.
    ///
    /// # Safety
    /// The whole warpgroup calls it in uniform flow; the descriptors describe tiles of the
    /// block's shared memory that every thread's writes (fenced with [`fence_async_shared`])
    /// reached before a barrier all of the warpgroup passed.
    #[inline(always)]
    pub unsafe fn mma_stage(acc: &mut [[f32; 64]; 2], a: [u64; 4], b: [[u64; 4]; 2]) {
        // SAFETY: [[f32; 64]; 2] and [f32; 128] have the same layout; the rest guaranteed by the
        // caller, register operands only, the products waited for inside the block.
        unsafe {
            let flat = &mut *(acc as *mut [[f32; 64]; 2] as *mut [f32; 128]);
            products!("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16", "1, 1, 0, 0";
                [[d0 "{128}" "{132}" "p1"]
                [d1 "{128}" "{136}" "p1"]
                [d0 "{129}" "{133}" "p1"]
                [d1 "{129}" "{137}" "p1"]
                [d0 "{130}" "{134}" "p1"]
                [d1 "{130}" "{138}" "p1"]
                [d0 "{131}" "{135}" "p1"]
                [d1 "{131}" "{139}" "p1"]];
                [reg64 a => [0 1 2 3], reg64 b[0] => [0 1 2 3], reg64 b[1] => [0 1 2 3]];
                flat [0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31 32 33 34 35 36 37 38 39 40 41 42 43 44 45 46 47 48 49 50 51 52 53 54 55 56 57 58 59 60 61 62 63 64 65 66 67 68 69 70 71 72 73 74 75 76 77 78 79 80 81 82 83 84 85 86 87 88 89 90 91 92 93 94 95 96 97 98 99 100 101 102 103 104 105 106 107 108 109 110 111 112 113 114 115 116 117 118 119 120 121 122 123 124 125 126 127])
        }
    }

    /// One half of [`mma_stage`]: `acc += A B` for a warpgroup's 64 x 128 block, `b[kk]` the
    /// descriptors of B's 128 rows. For a tile of at most 64 rows, where each warpgroup takes
    /// half of the columns instead of half of the rows. Returns with the products done.
    ///
    /// # Safety
    /// As [`mma_stage`].
    #[inline(always)]
    pub unsafe fn mma_half(acc: &mut [f32; 64], a: [u64; 4], b: [u64; 4]) {
        // SAFETY: guaranteed by the caller; register operands only, the products waited for
        // inside the block.
        unsafe {
            products64!("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16", "1, 1, 0, 0";
                [[d0 "{64}" "{68}" "p1"]
                [d0 "{65}" "{69}" "p1"]
                [d0 "{66}" "{70}" "p1"]
                [d0 "{67}" "{71}" "p1"]];
                [reg64 a => [0 1 2 3], reg64 b => [0 1 2 3]];
                acc)
        }
    }

    /// `{p}{first}, {p}{rest}..`: a list of PTX registers named `p` and a number.
    macro_rules! temps {
        ($p:literal; $first:literal $($i:literal)*) => { concat!($p, $first $(, ", ", $p, $i)*) };
    }

    /// [`temps!`] of 48 registers, `p0` to `p47`.
    macro_rules! t48 {
        ($p:literal) => {
            temps!($p; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31 32 33 34 35 36 37 38 39 40 41 42 43 44 45 46 47)
        };
    }

    /// `add.f32 {i}, {i}, {p}{j};` for each pair `i j`: positional operand i plus temporary j.
    macro_rules! adds {
        ($p:literal; $($i:literal $j:literal)*) => { concat!($("add.f32 {", $i, "}, {", $i, "}, ", $p, $j, ";",)*) };
    }

    /// The 4 k32 steps of a warpgroup's 64 x 96 e4m3 products into the asm block's fresh
    /// registers `$t` ([`t48!`]), A's descriptors `{a0}`.. and B's `$b`: the first step
    /// overwrites them (`p0`), the rest accumulate (`p1`); then their commit.
    macro_rules! fp8_steps {
        ($t:literal; $b0:literal $b1:literal $b2:literal $b3:literal) => {
            concat!(
                "wgmma.mma_async.sync.aligned.m64n96k32.f32.e4m3.e4m3 {{",
                t48!($t),
                "}}, {a0}, ",
                $b0,
                ", p0, 1, 1;",
                "wgmma.mma_async.sync.aligned.m64n96k32.f32.e4m3.e4m3 {{",
                t48!($t),
                "}}, {a1}, ",
                $b1,
                ", p1, 1, 1;",
                "wgmma.mma_async.sync.aligned.m64n96k32.f32.e4m3.e4m3 {{",
                t48!($t),
                "}}, {a2}, ",
                $b2,
                ", p1, 1, 1;",
                "wgmma.mma_async.sync.aligned.m64n96k32.f32.e4m3.e4m3 {{",
                t48!($t),
                "}}, {a3}, ",
                $b3,
                ", p1, 1, 1;",
                "wgmma.commit_group.sync.aligned;",
            )
        };
    }

    /// One e4m3 stage of a warpgroup's 64 x 192 block (k32 steps, 128 of k): for each of B's
    /// halves (rows `96 h .. + 96`) the 4 steps' products into 48 fresh registers a thread, a
    /// commit group each, then each half added to `acc[h][0..48]` in f32 once its group is
    /// done: the first half's additions run while the second half's products do (the
    /// promotion every 128 of k, with the products and the additions overlapped). One asm
    /// block: the fresh registers are its own, so nothing the compiler places can touch them in
    /// flight. Accumulator i of a half lies as [`acc_row`] and [`acc_col`] say (columns of 96).
    /// Returns with the products done.
    ///
    /// # Safety
    /// As [`mma_stage`].
    #[inline(always)]
    pub unsafe fn mma_stage_fp8(acc: &mut [[f32; 64]; 2], a: [u64; 4], b: [[u64; 4]; 2]) {
        let [h0, h1] = acc;
        // The asm block over both halves' first 48 accumulators: positional operands 0..48
        // and 48..96.
        macro_rules! stage {
            ($($i:literal)*) => {
                asm!(
                    "{{",
                    ".reg .pred p0, p1;",
                    ".reg .f32 t<48>, u<48>;",
                    "setp.ne.b32 p0, {zero}, 0;",
                    "setp.ne.b32 p1, {one}, 0;",
                    "wgmma.fence.sync.aligned;",
                    fp8_steps!("t"; "{b00}" "{b01}" "{b02}" "{b03}"),
                    fp8_steps!("u"; "{b10}" "{b11}" "{b12}" "{b13}"),
                    "wgmma.wait_group.sync.aligned 1;",
                    adds!("t"; 0 0 1 1 2 2 3 3 4 4 5 5 6 6 7 7 8 8 9 9 10 10 11 11 12 12 13 13 14 14 15 15 16 16 17 17 18 18 19 19 20 20 21 21 22 22 23 23 24 24 25 25 26 26 27 27 28 28 29 29 30 30 31 31 32 32 33 33 34 34 35 35 36 36 37 37 38 38 39 39 40 40 41 41 42 42 43 43 44 44 45 45 46 46 47 47),
                    "wgmma.wait_group.sync.aligned 0;",
                    adds!("u"; 48 0 49 1 50 2 51 3 52 4 53 5 54 6 55 7 56 8 57 9 58 10 59 11 60 12 61 13 62 14 63 15 64 16 65 17 66 18 67 19 68 20 69 21 70 22 71 23 72 24 73 25 74 26 75 27 76 28 77 29 78 30 79 31 80 32 81 33 82 34 83 35 84 36 85 37 86 38 87 39 88 40 89 41 90 42 91 43 92 44 93 45 94 46 95 47),
                    "}}",
                    $(inout(reg32) h0[$i],)*
                    $(inout(reg32) h1[$i],)*
                    a0 = in(reg64) a[0], a1 = in(reg64) a[1], a2 = in(reg64) a[2], a3 = in(reg64) a[3],
                    b00 = in(reg64) b[0][0], b01 = in(reg64) b[0][1], b02 = in(reg64) b[0][2], b03 = in(reg64) b[0][3],
                    b10 = in(reg64) b[1][0], b11 = in(reg64) b[1][1], b12 = in(reg64) b[1][2], b13 = in(reg64) b[1][3],
                    zero = in(reg32) 0u32,
                    one = in(reg32) 1u32,
                    options(nostack),
                )
            };
        }
        // SAFETY: guaranteed by the caller; register operands only, the products waited for
        // inside the block.
        unsafe {
            stage!(0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31 32 33 34 35 36 37 38 39 40 41 42 43 44 45 46 47)
        }
    }

    /// One half of [`mma_stage_fp8`]: a warpgroup's 64 x 96 block over one e4m3 stage, the 4
    /// steps' products (`b[kk]` B's 96 rows) into 48 fresh registers a thread, added to
    /// `acc[0..48]` in f32 once done (the promotion every 128 of k). For a tile of at most 64
    /// rows, where each warpgroup takes half of the columns instead of half of the rows. Returns
    /// with the products done.
    ///
    /// # Safety
    /// As [`mma_stage`].
    #[inline(always)]
    pub unsafe fn mma_half_fp8(acc: &mut [f32; 64], a: [u64; 4], b: [u64; 4]) {
        macro_rules! stage {
            ($($i:literal)*) => {
                asm!(
                    "{{",
                    ".reg .pred p0, p1;",
                    ".reg .f32 t<48>;",
                    "setp.ne.b32 p0, {zero}, 0;",
                    "setp.ne.b32 p1, {one}, 0;",
                    "wgmma.fence.sync.aligned;",
                    fp8_steps!("t"; "{b0}" "{b1}" "{b2}" "{b3}"),
                    "wgmma.wait_group.sync.aligned 0;",
                    adds!("t"; 0 0 1 1 2 2 3 3 4 4 5 5 6 6 7 7 8 8 9 9 10 10 11 11 12 12 13 13 14 14 15 15 16 16 17 17 18 18 19 19 20 20 21 21 22 22 23 23 24 24 25 25 26 26 27 27 28 28 29 29 30 30 31 31 32 32 33 33 34 34 35 35 36 36 37 37 38 38 39 39 40 40 41 41 42 42 43 43 44 44 45 45 46 46 47 47),
                    "}}",
                    $(inout(reg32) acc[$i],)*
                    a0 = in(reg64) a[0], a1 = in(reg64) a[1], a2 = in(reg64) a[2], a3 = in(reg64) a[3],
                    b0 = in(reg64) b[0], b1 = in(reg64) b[1], b2 = in(reg64) b[2], b3 = in(reg64) b[3],
                    zero = in(reg32) 0u32,
                    one = in(reg32) 1u32,
                    options(nostack),
                )
            };
        }
        // SAFETY: guaranteed by the caller; register operands only, the products waited for
        // inside the block.
        unsafe {
            stage!(0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31 32 33 34 35 36 37 38 39 40 41 42 43 44 45 46 47)
        }
    }

    /// `s = A B`: a warpgroup's 64 rows of A against B's 128 rows, over 8 bf16 k steps of 16
    /// (a head of 128 channels), `a[kk]` and `b[kk]` the K-major descriptors of step kk;
    /// `s` as the module docs' accumulators of one 64 x 128 half. Returns with the products
    /// done.
    ///
    /// # Safety
    /// As [`mma_stage`].
    #[inline(always)]
    pub unsafe fn products_k128(s: &mut [f32; 64], a: [u64; 8], b: [u64; 8]) {
        // SAFETY: guaranteed by the caller; register operands only, the products waited for
        // inside the block.
        unsafe {
            products64!("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16", "1, 1, 0, 0";
                [[d0 "{64}" "{72}" "p0"]
                [d0 "{65}" "{73}" "p1"]
                [d0 "{66}" "{74}" "p1"]
                [d0 "{67}" "{75}" "p1"]
                [d0 "{68}" "{76}" "p1"]
                [d0 "{69}" "{77}" "p1"]
                [d0 "{70}" "{78}" "p1"]
                [d0 "{71}" "{79}" "p1"]];
                [reg64 a => [0 1 2 3 4 5 6 7], reg64 b => [0 1 2 3 4 5 6 7]];
                s)
        }
    }

    /// `o += P B` over 8 bf16 k steps of 16 (128 of k), P from registers: `p[4 kk .. 4 kk + 4]`
    /// step kk's fragment of the warpgroup's 64 rows (as `mma.sync`'s m16n8k16 A fragment of warp wi's
    /// rows `16 wi ..`, which is the accumulators' layout of columns `16 kk .. + 16` rounded to
    /// bf16), `b[kk]` the MN-major descriptor of B's rows `16 kk .. + 16` (k) by 128 columns
    /// (n), read transposed. Returns with the products done.
    ///
    /// # Safety
    /// As [`mma_stage`].
    #[inline(always)]
    pub unsafe fn products_regs_k128(o: &mut [f32; 64], p: &[u32; 32], b: [u64; 8]) {
        // SAFETY: guaranteed by the caller; register operands only, the products waited for
        // inside the block.
        unsafe {
            products64!("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16", "1, 1, 1";
                [[d0 "{{{64}, {65}, {66}, {67}}}" "{96}" "p1"]
                [d0 "{{{68}, {69}, {70}, {71}}}" "{97}" "p1"]
                [d0 "{{{72}, {73}, {74}, {75}}}" "{98}" "p1"]
                [d0 "{{{76}, {77}, {78}, {79}}}" "{99}" "p1"]
                [d0 "{{{80}, {81}, {82}, {83}}}" "{100}" "p1"]
                [d0 "{{{84}, {85}, {86}, {87}}}" "{101}" "p1"]
                [d0 "{{{88}, {89}, {90}, {91}}}" "{102}" "p1"]
                [d0 "{{{92}, {93}, {94}, {95}}}" "{103}" "p1"]];
                [reg32 p => [0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31],
                 reg64 b => [0 1 2 3 4 5 6 7]];
                o)
        }
    }
}
