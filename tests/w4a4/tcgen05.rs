//! The `tcgen05` W4A4 kernel (kernels-gpu/src/w4a4/tmem.rs) on the CPU: its copies of a
//! stage into shared memory, its scale copies into tensor memory, its products and its reads
//! of the accumulators, each through the kernel's own layout functions
//! (kernels-gpu/src/tcgen05.rs), run through the instructions emulated from the PTX ISA's
//! description of them (the matrix and instruction descriptors decoded field by field), give
//! the exact product. No GPU of the sm_100a family is at hand to run the kernel itself.

use super::*;
use kernels_gpu::swizzle_128;
use kernels_gpu::tcgen05::*;

/// Columns of a block's tensor memory (128 lanes each).
const TMEM_MAX: usize = 512;

/// What a TMEM column holds, as the emulation saw it written.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Held {
    Nothing,
    Scales,
    Sums,
}

/// One block's shared and tensor memory.
struct Block {
    smem: Vec<u8>,
    /// Lane-major: `words[lane][column]`, the scale columns.
    words: Vec<[u32; TMEM_MAX]>,
    /// The accumulators' columns, in f64 (the products of codes and scales and their sums are
    /// exact with the test's scales).
    sums: Vec<[f64; TMEM_MAX]>,
    held: [Held; TMEM_MAX],
}

/// A shared-memory matrix descriptor by the PTX ISA's table (the sm_100 form): start address,
/// stride byte offset and swizzle mode (0 none, 2 the 128-byte swizzle); the fixed bits 46-48
/// 0b001, base offset 0 and relative leading offsets checked.
fn matrix_desc(d: u64) -> (usize, usize, u64) {
    assert_eq!((d >> 46) & 7, 1, "bits 46-48 of {d:#x}: the fixed 0b001");
    assert_eq!((d >> 49) & 15, 0, "{d:#x}: base offset 0, leading offsets relative");
    assert_eq!(d & (3 << 14) | (d >> 53) & 0xff, 0, "{d:#x}: reserved bits");
    let start = ((d & 0x3fff) << 4) as usize;
    let stride = (((d >> 32) & 0x3fff) << 4) as usize;
    (start, stride, d >> 61)
}

/// A K-major operand in the 128-byte swizzle by its descriptor: rows 128 bytes apart in
/// groups of 8, the stride offset from group to group; the hardware swaps address bits 4-6 by
/// bits 7-9 of the address it forms.
struct Operand {
    start: usize,
    stride: usize,
}

impl Operand {
    fn new(d: u64) -> Operand {
        let (start, stride, swizzle) = matrix_desc(d);
        assert_eq!(swizzle, 2, "{d:#x}: the 128-byte swizzle");
        Operand { start, stride }
    }

    /// Address of byte `j` (0..32) of row `r`.
    fn byte(&self, r: usize, j: usize) -> usize {
        let at = self.start + self.stride * (r / 8) + 128 * (r % 8) + j;
        at ^ (((at >> 7) & 7) << 4)
    }
}

impl Block {
    fn new() -> Block {
        Block {
            smem: vec![0; tc_smem_bytes() as usize],
            words: vec![[0; TMEM_MAX]; 128],
            sums: vec![[0.0; TMEM_MAX]; 128],
            held: [Held::Nothing; TMEM_MAX],
        }
    }

    /// The column of TMEM address `t` (lane 0), within the allocation.
    fn column(t: u32) -> usize {
        assert_eq!(t >> 16, 0, "{t:#x}: lane 0");
        let col = (t & 0xffff) as usize;
        assert!(col < TMEM_COLS as usize, "column {col} past the {TMEM_COLS} allocated");
        col
    }

    /// `tcgen05.cp.cta_group::1.32x128b.warpx4 [t], d`: 32 rows of 16 bytes (no swizzle: 8 rows
    /// 16 bytes apart, the stride offset to the next 8), row i's four words to columns
    /// `t .. t + 4` of lanes `i + 32 q`, every q.
    fn copy_scales(&mut self, t: u32, d: u64) {
        let (start, stride, swizzle) = matrix_desc(d);
        assert_eq!(swizzle, 0, "{d:#x}: no swizzle");
        let col = Block::column(t);
        for i in 0..32 {
            let row = start + stride * (i / 8) + 16 * (i % 8);
            for w in 0..4 {
                self.held[col + w] = Held::Scales;
                for q in 0..4 {
                    self.words[i + 32 * q][col + w] = word(&self.smem, row + 4 * w);
                }
            }
        }
    }

    /// `tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.block16 [d], a, b, idesc, [sa],
    /// [sb], accumulate`, the instruction descriptor decoded by the PTX ISA's table: element
    /// (m, k) of A nibble `k % 2` of byte `k / 2` of row m, its block scale byte `k / 16` of
    /// lane m's column `sa + m / 32`, B's (n, k) likewise; D (m, n) lane m, column `d + n`.
    fn mma(&mut self, d: u32, (a, b): (u64, u64), idesc: u32, (sa, sb): (u32, u32), accumulate: bool) {
        let field = |at: u32, bits: u32| (idesc >> at) & ((1 << bits) - 1);
        assert_eq!(
            field(0, 7) | field(13, 4) | field(24, 3) | field(29, 3),
            0,
            "{idesc:#x}: dense, no negation, K-major, scale ids 0, K 64"
        );
        assert_eq!((field(7, 3), field(10, 3), field(23, 1)), (1, 1, 0), "{idesc:#x}: e2m1 codes, ue4m3 scales");
        let (rows, cols) = (128 * field(27, 2) as usize, 8 * field(17, 6) as usize);
        assert_eq!(rows, 128, "cta_group::1 products of 128 rows");
        let (d, sa, sb) = (Block::column(d), Block::column(sa), Block::column(sb));
        // Row r's 64 elements of an operand, each code times its block scale.
        let values = |op: u64, s: usize, r: usize| -> [f64; 64] {
            assert_eq!(self.held[s + r / 32], Held::Scales, "scale column {} unwritten", s + r / 32);
            let op = Operand::new(op);
            core::array::from_fn(|k| {
                code(u32::from(self.smem[op.byte(r, k / 2)]), k % 2) * scale(self.words[r][s + r / 32], k / 16)
            })
        };
        let b_rows: Vec<[f64; 64]> = (0..cols).map(|n| values(b, sb, n)).collect();
        for m in 0..rows {
            let x = values(a, sa, m);
            for (n, y) in b_rows.iter().enumerate() {
                assert!(self.held[d + n] != Held::Scales, "the sums' column {} holds scales", d + n);
                let sum: f64 = x.iter().zip(y).map(|(x, y)| x * y).sum();
                let acc = if accumulate { self.sums[m][d + n] } else { 0.0 };
                self.sums[m][d + n] = acc + sum;
            }
        }
        for n in 0..cols {
            self.held[d + n] = Held::Sums;
        }
    }

    /// `tcgen05.ld.sync.aligned.32x32b.x16 [t]` by warp `w`: lane l's register j, lane
    /// `lane(t) + l`, column `column(t) + j`; a warp reaches lanes `32 (w % 4) ..` only.
    fn load16(&self, w: u32, t: u32, l: usize) -> [f64; 16] {
        assert_eq!(t >> 16, 32 * (w % 4), "warp {w} reads its quarter of the lanes");
        let col = Block::column(t & 0xffff);
        assert!(self.held[col..col + 16].iter().all(|&h| h == Held::Sums), "columns {col}.. hold no sums");
        core::array::from_fn(|j| self.sums[(t >> 16) as usize + l][col + j])
    }
}

/// One block of the kernel, tile (`m0`, `n0`), emulated: per stage, every thread's copies
/// (the kernel's `tile_copy`, `swizzle_128`, `stage_offsets`, `scale_offset` and guards), then
/// thread 0's scale copies and products; then every warp's reads into y.
fn block(a: &[u8], w: &[u8], (m, n, k): (usize, usize, usize), (m0, n0): (usize, usize), y: &mut [f64]) {
    let bytes = row_bytes(k);
    let mut b = Block::new();
    let tmem = 0u32;
    let steps = k.div_ceil(STAGE_K as usize);
    for step in 0..steps {
        let slot = (step % TC_STAGES as usize) as u32;
        let st = slot as usize * STAGE_BYTES as usize;
        let (kb, mmas) = (step * STAGE_K as usize / 2, ((k - step * STAGE_K as usize) / 64).min(4));
        for (rows, r0, operand, src) in [(m, m0, 0, a), (n, n0, 1, w)] {
            let tile = st + stage_offsets(0)[operand] as usize;
            for t in 0..TC_BLOCK {
                for i in 0..8 {
                    let (r, c) = tile_copy(t, i);
                    let (r, c) = (r as usize, c as usize);
                    let ok = r0 + r < rows && kb + 16 * c < k / 2;
                    let to = tile + swizzle_128(r as u32, c as u32) as usize;
                    let from = (r0 + r) * bytes + kb + 16 * c;
                    b.smem[to..to + 16].copy_from_slice(if ok { &src[from..from + 16] } else { &[0; 16] });
                }
                let t = t as usize;
                for j in 0..4 {
                    let to = st + (stage_offsets(j)[2 + operand] + scale_offset(t as u32)) as usize;
                    let from = (r0 + t) * bytes + k / 2 + step * STAGE_K as usize / 16 + 4 * j as usize;
                    let ok = r0 + t < rows && (j as usize) < mmas;
                    b.smem[to..to + 4].copy_from_slice(if ok { &src[from..from + 4] } else { &[0; 4] });
                }
            }
        }
        for j in 0..mmas as u32 {
            let [_, _, sa, sb] = stage_offsets(j);
            b.copy_scales(tmem + sfa_col(slot, j), scale_desc(st as u32 + sa));
            b.copy_scales(tmem + sfb_col(slot, j), scale_desc(st as u32 + sb));
        }
        for j in 0..mmas as u32 {
            let [oa, ob, ..] = stage_offsets(0);
            let descs = (smem_desc(st as u32 + oa + 32 * j), smem_desc(st as u32 + ob + 32 * j));
            b.mma(tmem + ACC_COL, descs, IDESC, (tmem + sfa_col(slot, j), tmem + sfb_col(slot, j)), step > 0 || j > 0);
        }
    }
    for warp in 0..TC_BLOCK / 32 {
        for lane in 0..32 {
            let row = m0 + 32 * warp as usize + lane;
            for c in 0..TC_N / 16 {
                let v = b.load16(warp, tmem + ((32 * warp) << 16) + ACC_COL + 16 * c, lane);
                for (j, v) in v.into_iter().enumerate() {
                    let col = n0 + 16 * c as usize + j;
                    if row < m && col < n {
                        y[row * n + col] = v;
                    }
                }
            }
        }
    }
}

/// The whole grid at edge sizes (a partial tile each way, a partial last stage of one MMA)
/// equals the exact product; also red with `scale_offset`'s lanes swapped, with the
/// descriptors' stride offset halved and with the B scales' columns on A's (tried on each).
#[test]
fn emulated_tcgen05_block_of_the_kernel_layouts_is_the_product() {
    let mut rng = Rng::new(45);
    let (m, n, k) = (TC_M as usize + 40, TC_N as usize + 24, STAGE_K as usize + MMA_K as usize);
    let (a, w) = (random_rows(&mut rng, m, k), random_rows(&mut rng, n, k));
    let mut got = vec![f64::NAN; m * n];
    for m0 in (0..m).step_by(TC_M as usize) {
        for n0 in (0..n).step_by(TC_N as usize) {
            block(&a, &w, (m, n, k), (m0, n0), &mut got);
        }
    }
    let (want, _) = product(&a, &w, (m, n, k));
    assert!(want.iter().filter(|&&v| v != 0.0).count() > m * n / 2, "the product is not mostly zero");
    assert_eq!(assert_same("emulated tcgen05 blocks", &got, &want), m * n);
}

/// The layout's fixed values: the instruction descriptors the PTX ISA's table gives for
/// M 128 with N 128 and 256 (e2m1, ue4m3, K-major, dense), and what fits a block.
#[test]
fn tcgen05_descriptors_and_sizes() {
    assert_eq!((IDESC, idesc(128, 256)), (0x0820_0480, 0x0840_0480));
    assert_eq!(smem_desc(0x400 + 64), 0x4000_4040_0001_0044);
    assert_eq!(STAGE_BYTES % 1024, 0, "each stage's tiles start 1024-byte aligned");
    assert!(tc_smem_bytes() <= 232_448, "{} bytes of shared memory", tc_smem_bytes());
}
