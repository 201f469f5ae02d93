//! NVFP4 weights on the device (kernels-gpu/src/nvfp4.rs): their layout, made from a
//! checkpoint's codes and block scales ([`pack_rows`]), and their dequantization to bf16
//! ([`to_bf16`]), what the bf16 GEMMs take at many rows. At few rows the gemv and expert
//! kernels read the layout itself ([`crate::gemv::Weights::Nvfp4`]).

use cudarc::driver::DevicePtrMut;
use half::bf16;
use kernels_gpu::entry;
pub use kernels_gpu::nvfp4::row_bytes;
use kernels_gpu::nvfp4::{BLOCK, ToBf16Params};

use crate::args::Len;
use crate::check::{Check, MAX_ELEMS};
use crate::error::Result;
use crate::gemv::Weights;
use crate::gpu::{Gpu, Grid};
use crate::quant::elementwise_grid;

/// The device layout of `n` rows of `k` NVFP4 weights from a checkpoint's `codes` (`[n, k /
/// 2]`, two e2m1 codes a byte, element `2i` in the low four bits) and block `scales` (`[n, k /
/// 16]` e4m3): each row's codes, then its scales, then zeros ([`row_bytes`] a row).
pub fn pack_rows(codes: &[u8], scales: &[u8], n: usize, k: usize) -> Result<Vec<u8>> {
    let c = Check("nvfp4::pack_rows");
    c.that("k", k.is_multiple_of(BLOCK) && k > 0, "a positive multiple of 16", k)?;
    c.that("codes", codes.len() == n * k / 2, format!("exactly {} bytes", n * k / 2), codes.len())?;
    c.that("scales", scales.len() == n * k / BLOCK, format!("exactly {} bytes", n * k / BLOCK), scales.len())?;
    let mut out = Vec::with_capacity(n * row_bytes(k));
    for (row, s) in codes.chunks_exact(k / 2).zip(scales.chunks_exact(k / BLOCK)) {
        out.extend_from_slice(row);
        out.extend_from_slice(s);
        out.resize(out.len().next_multiple_of(16), 0);
    }
    Ok(out)
}

/// `out = bf16(W)` for `matrices` NVFP4 matrices of `[n, k]` (`w`: [`Weights::Nvfp4`]), each
/// weight `e2m1 * block scale * global[m]` rounded once to bf16 (nearest even, from the exact
/// product: what `crate::cpu::nvfp4::bf16_nearest` gives the exact value). One launch.
pub fn to_bf16(
    gpu: &Gpu,
    w: Weights<'_>,
    matrices: usize,
    (n, k): (usize, usize),
    out: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    let kern = entry::NVFP4_TO_BF16;
    let a = gpu.args(kern);
    let c = a.check();
    if !matches!(w, Weights::Nvfp4 { .. }) {
        return Err(crate::Error::Shape {
            kernel: kern.name(),
            arg: "w",
            expected: "NVFP4 weights".into(),
            got: "bf16 or FP8 weights".into(),
        });
    }
    c.count("n", MAX_ELEMS, n)?;
    c.that("k", k > 0, "positive", k)?;
    let total = matrices * n * k;
    c.count("matrices * n * k", MAX_ELEMS, total)?;
    // The codes and block scales of every matrix and a per-tensor scale each, k a multiple
    // of 16: the checks of every NVFP4 launch.
    let (rows, global, _) = w.args(&a, matrices, (n, k))?;
    let p = ToBf16Params {
        w: rows,
        global,
        out: a.output("out", out, Len::AtLeast(total))?,
        n: n as u32,
        k: k as u32,
        rows: (matrices * n) as u32,
    };
    // SAFETY: w holds matrices * n rows, global a scale per matrix, out the total; k is a
    // multiple of 16 and the total below 2^31.
    unsafe { gpu.launch(Grid::new(kern, (elementwise_grid(total), 1, 1)), p) }
}

#[cfg(test)]
mod tests {
    use super::{pack_rows, row_bytes};

    /// Each row's codes, then its scales, then zeros to 16 bytes (none where the row fills
    /// them); lengths and k refused by name.
    #[test]
    fn rows_are_codes_then_scales() {
        for (n, k, pad) in [(3, 32, 14), (2, 128, 8), (2, 256, 0)] {
            let codes: Vec<u8> = (0..n * k / 2).map(|i| i as u8).collect();
            let scales: Vec<u8> = (0..n * k / 16).map(|i| 200 - i as u8).collect();
            let rows = pack_rows(&codes, &scales, n, k).unwrap();
            assert_eq!(row_bytes(k), k / 2 + k / 16 + pad, "k {k}");
            assert_eq!(rows.len(), n * row_bytes(k));
            for r in 0..n {
                let row = &rows[r * row_bytes(k)..][..row_bytes(k)];
                assert_eq!(&row[..k / 2], &codes[r * k / 2..][..k / 2], "row {r} codes");
                assert_eq!(&row[k / 2..][..k / 16], &scales[r * k / 16..][..k / 16], "row {r} scales");
                assert!(row[k / 2 + k / 16..].iter().all(|&b| b == 0), "row {r} padding");
            }
        }
        let (n, k) = (3, 32);
        let codes: Vec<u8> = (0..n * k / 2).map(|i| i as u8).collect();
        let scales: Vec<u8> = (0..n * k / 16).map(|i| 200 + i as u8).collect();
        for (c, s, k, says) in [(&codes[1..], &scales[..], k, "`codes`"), (&codes[..], &scales[1..], k, "`scales`")] {
            let err = pack_rows(c, s, n, k).unwrap_err().to_string();
            assert!(err.contains(says), "{err}");
        }
        let err = pack_rows(&codes, &scales, n + 1, k).unwrap_err().to_string();
        assert!(err.contains("`codes`"), "{err}");
        let err = pack_rows(&codes[..36], &scales[..3], 3, 24).unwrap_err().to_string();
        assert!(err.contains("`k`"), "{err}");
    }
}
