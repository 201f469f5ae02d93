//! A MoE layer's shared expert as pieces of the routed experts' shape, written after them in
//! the layer's expert buffers (`Shared::Pieces`, `Shared::MlpAndPieces` in the parent): the
//! bytes of each format's pieces ([`pieces_bytes`]) and their upload with their scales
//! ([`put_pieces`]).

use host::{CudaSlice, Gpu};

use super::super::linear::{Weights, bf16_bytes, check_linear};
use super::super::unsupported;
use crate::error::{Error, Result};
use crate::layout::{Fp8Scales, Linear, Mlp};
use crate::weights::Dtype;

/// The formats a shared expert's pieces are written in ([`pieces_bytes`]).
#[derive(Clone, Copy, PartialEq)]
enum PieceFormat {
    Bf16,
    Fp8,
    Nvfp4,
}

/// The shared expert `s` as pieces of the routed experts' shape (see `Shared::Pieces` in the
/// parent), as the device holds them: the pieces' up matrices (the shared up's rows in order, zero
/// rows past its width), their down matrices (piece j's row r is the shared down's row r, columns
/// `j * inter..`, zeros past its width: as the expert kernels read pieces, at matrix row `r *
/// pieces + j` of rows of `inter`), in bf16, as the checkpoint's e4m3 codes, or as NVFP4 rows
/// ([`host::nvfp4::pack_rows`]: each piece's row its codes and its blocks' scales, so `inter` must
/// be a multiple of 16); and how many pieces.
fn pieces_bytes(s: &Mlp, (inter, hidden): (usize, usize), format: PieceFormat) -> Result<(Vec<u8>, Vec<u8>, usize)> {
    let si = s.up.shape()[0];
    for (l, shape) in [(&s.up, [si, hidden]), (&s.down, [hidden, si])] {
        check_linear(l, shape, "the shared expert's")?;
        let ok = match format {
            PieceFormat::Bf16 => true,
            PieceFormat::Fp8 => l.weight.dtype == Dtype::F8E4M3,
            PieceFormat::Nvfp4 => l.nvfp4.is_some() && inter.is_multiple_of(16),
        };
        if !ok {
            return Err(Error::Unsupported(format!(
                "`{}` ({:?}) as pieces of {inter} columns beside the routed experts",
                l.weight.name, l.weight.dtype
            )));
        }
    }
    let (padded, pieces) = (si.next_multiple_of(inter), si.div_ceil(inter));
    // Each of `rows` rows of `width` units (`unit` bytes each) cut into the pieces' parts of
    // `width * inter / si` units, part j of row r at part `r * pieces + j`, zero past the row.
    let split = |d: &[u8], rows: usize, width: usize, unit: usize| {
        let each = width * inter / si;
        let mut out = vec![0u8; rows * pieces * each * unit];
        for (r, from) in d.chunks(width * unit).take(rows).enumerate() {
            for (j, part) in from.chunks(each * unit).enumerate() {
                out[(r * pieces + j) * each * unit..][..part.len()].copy_from_slice(part);
            }
        }
        out
    };
    match (format, s.down.nvfp4) {
        (PieceFormat::Nvfp4, Some(down)) => {
            let up = s.up.nvfp4.ok_or_else(|| unsupported("an NVFP4 shared down projection beside another up"))?;
            let mut u = host::nvfp4::pack_rows(s.up.weight.bytes, up.block.bytes, si, hidden)?;
            u.resize(padded * host::nvfp4::row_bytes(hidden), 0);
            let codes = split(s.down.weight.bytes, hidden, si / 2, 1);
            let scales = split(down.block.bytes, hidden, si / 16, 1);
            Ok((u, host::nvfp4::pack_rows(&codes, &scales, hidden * pieces, inter)?, pieces))
        }
        _ => {
            let unit = if format == PieceFormat::Fp8 { 1 } else { 2 };
            let bytes = |l: &Linear| -> Result<Vec<u8>> {
                Ok(match format {
                    PieceFormat::Fp8 => l.weight.bytes.to_vec(),
                    _ => bf16_bytes(l)?.into_owned(),
                })
            };
            let mut u = bytes(&s.up)?;
            u.resize(padded * hidden * unit, 0);
            Ok((u, split(&bytes(&s.down)?, hidden, si, unit), pieces))
        }
    }
}

/// Writes the shared expert `s` as pieces ([`pieces_bytes`]) after the `routed` experts of
/// `up [.., inter, hidden]` and `down [.., hidden, inter]`: bf16; FP8 codes with each piece's
/// weight and input scales its projection's; NVFP4 rows with each piece's per-tensor scale its
/// projection's.
pub(super) fn put_pieces(
    gpu: &Gpu,
    s: &Mlp,
    routed: usize,
    (inter, hidden): (usize, usize),
    (up, down): (&mut Weights, &mut Weights),
) -> Result<()> {
    let at = routed * inter * hidden;
    // The pieces' scales, each its projection's.
    let put = |w: &mut CudaSlice<f32>, v: f32, pieces: usize| {
        gpu.upload_into(&vec![v; pieces], &mut w.slice_mut(routed..routed + pieces))
    };
    match (up, down) {
        (Weights::Bf16(up), Weights::Bf16(down)) => {
            let (u, d, _) = pieces_bytes(s, (inter, hidden), PieceFormat::Bf16)?;
            gpu.upload_bytes_into(&u, &mut up.slice_mut(at..at + u.len() / 2))?;
            Ok(gpu.upload_bytes_into(&d, &mut down.slice_mut(at..at + d.len() / 2))?)
        }
        (
            Weights::Fp8 { codes: up, w_scale: up_w, in_scale: Some(up_in) },
            Weights::Fp8 { codes: down, w_scale: down_w, in_scale: Some(down_in) },
        ) => {
            let (u, d, pieces) = pieces_bytes(s, (inter, hidden), PieceFormat::Fp8)?;
            for (l, w, i) in [(&s.up, up_w, up_in), (&s.down, down_w, down_in)] {
                let Some(Fp8Scales { weight_scale, input_scale: Some(input_scale) }) = l.fp8 else {
                    return Err(Error::Unsupported(format!(
                        "`{}`: a shared expert's pieces beside FP8 experts need FP8 with a static input scale",
                        l.weight.name
                    )));
                };
                put(w, weight_scale, pieces)?;
                put(i, input_scale, pieces)?;
            }
            gpu.upload_bytes_into(&u, &mut up.slice_mut(at..at + u.len()))?;
            Ok(gpu.upload_bytes_into(&d, &mut down.slice_mut(at..at + d.len()))?)
        }
        (Weights::Nvfp4 { rows: up, global: up_g }, Weights::Nvfp4 { rows: down, global: down_g }) => {
            let (u, d, pieces) = pieces_bytes(s, (inter, hidden), PieceFormat::Nvfp4)?;
            for (l, g) in [(&s.up, up_g), (&s.down, down_g)] {
                let global = l.nvfp4.ok_or_else(|| unsupported("NVFP4 pieces of a shared expert in another format"))?;
                put(g, global.global, pieces)?;
            }
            let row_bytes = host::nvfp4::row_bytes;
            let (at_up, at_down) = (routed * inter * row_bytes(hidden), routed * hidden * row_bytes(inter));
            gpu.upload_bytes_into(&u, &mut up.slice_mut(at_up..at_up + u.len()))?;
            Ok(gpu.upload_bytes_into(&d, &mut down.slice_mut(at_down..at_down + d.len()))?)
        }
        _ => Err(unsupported("a shared expert's pieces beside experts of another format")),
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use host::cpu::nvfp4::dequantize;
    use host::cpu::quant::e4m3_decode;
    use host::nvfp4::row_bytes;
    use nemotron_rs::Rng;

    use super::*;
    use crate::layout::Nvfp4Scales;
    use crate::weights::Tensor;

    /// `down(relu(up x)^2)` in f64, `up [inter, x.len()]` and `down [x.len(), inter]` given
    /// element by element.
    fn mlp(x: &[f64], up: impl Fn(usize, usize) -> f64, down: impl Fn(usize, usize) -> f64, inter: usize) -> Vec<f64> {
        let h: Vec<f64> =
            (0..inter).map(|r| (0..x.len()).map(|c| up(r, c) * x[c]).sum::<f64>().max(0.0).powi(2)).collect();
        (0..x.len()).map(|r| (0..inter).map(|c| down(r, c) * h[c]).sum()).collect()
    }

    /// The shared expert's MLP `whole` against the sum of its pieces' MLPs, each piece's
    /// weights `piece(j)` (its up and down as element getters).
    fn assert_pieces_sum<U: Fn(usize, usize) -> f64, D: Fn(usize, usize) -> f64>(
        x: &[f64],
        whole: &[f64],
        (inter, pieces): (usize, usize),
        piece: impl Fn(usize) -> (U, D),
    ) {
        let mut sum = vec![0.0; x.len()];
        for j in 0..pieces {
            let (up, down) = piece(j);
            for (s, v) in sum.iter_mut().zip(mlp(x, up, down, inter)) {
                *s += v;
            }
        }
        for (a, b) in sum.iter().zip(whole) {
            assert!((a - b).abs() <= 1e-9 * b.abs().max(1.0), "pieces {sum:?} against the MLP {whole:?}");
        }
    }

    /// A linear layer of `bytes` as `dtype`, `shape` its tensor's.
    fn linear<'a>(dtype: Dtype, shape: &'a [usize], bytes: &'a [u8]) -> Linear<'a> {
        Linear {
            weight: Tensor { name: "w", path: Path::new(""), dtype, shape, bytes },
            bias: None,
            fp8: None,
            nvfp4: None,
        }
    }

    /// The pieces of an FP8 shared expert (24 wide beside experts of 16: two pieces, the
    /// second half zeros), read as the expert kernels read them (each piece's up rows; its down
    /// row r at matrix row `r * pieces + j`), sum to the shared expert's MLP; those of an NVFP4
    /// one (48 wide beside 32, hidden 32), each row of a piece its codes and block scales.
    #[test]
    fn shared_expert_pieces_sum_to_its_mlp() {
        let mut rng = Rng::new(7);
        // Finite e4m3 codes of either sign (0x7f and 0xff are NaN).
        let mut code = || (rng.next_u64() % 0x7f) as u8 | if rng.next_u64().is_multiple_of(2) { 0x80 } else { 0 };
        let mut codes = |n: usize| -> Vec<u8> { (0..n).map(|_| code()).collect() };
        let (hidden, inter, si) = (8, 16, 24);
        let x: Vec<f64> = (0..hidden).map(|i| (i as f64 - 3.5) / 4.0).collect();
        let (upc, downc) = (codes(si * hidden), codes(hidden * si));
        let scales = Some(Fp8Scales { weight_scale: 1.0, input_scale: Some(1.0) });
        let (up_shape, down_shape) = ([si, hidden], [hidden, si]);
        let s = Mlp {
            up: Linear { fp8: scales, ..linear(Dtype::F8E4M3, &up_shape, &upc) },
            down: Linear { fp8: scales, ..linear(Dtype::F8E4M3, &down_shape, &downc) },
        };
        let e4m3 = |b: &[u8], i: usize| f64::from(e4m3_decode(b[i]));
        let whole = mlp(&x, |r, c| e4m3(&upc, r * hidden + c), |r, c| e4m3(&downc, r * si + c), si);
        let (u, d, pieces) = pieces_bytes(&s, (inter, hidden), PieceFormat::Fp8).unwrap();
        assert_eq!((u.len(), d.len(), pieces), (2 * inter * hidden, hidden * 2 * inter, 2));
        assert_pieces_sum(&x, &whole, (inter, pieces), |j| {
            let (u, d) = (&u, &d);
            (move |r, c| e4m3(u, (j * inter + r) * hidden + c), move |r, c| e4m3(d, (r * pieces + j) * inter + c))
        });

        let (hidden, inter, si) = (32, 32, 48);
        let x: Vec<f64> = (0..hidden).map(|i| (i as f64 - 15.5) / 16.0).collect();
        let (upc, downc) = (codes(si * hidden / 2), codes(hidden * si / 2));
        // Positive e4m3 block scales, each block its own.
        let block_scales = |n: usize, at: usize| -> Vec<u8> { (0..n).map(|i| ((i + at) % 40 + 40) as u8).collect() };
        let (ups, downs) = (block_scales(si * hidden / 16, 0), block_scales(hidden * si / 16, 7));
        let (up_shape, down_shape) = ([si, hidden / 2], [hidden, si / 2]);
        let (ups_shape, downs_shape) = ([si, hidden / 16], [hidden, si / 16]);
        let nvfp4 = |block| Some(Nvfp4Scales { block, global: 1.0, input_scale: None });
        let s = Mlp {
            up: Linear {
                nvfp4: nvfp4(linear(Dtype::F8E4M3, &ups_shape, &ups).weight),
                ..linear(Dtype::U8, &up_shape, &upc)
            },
            down: Linear {
                nvfp4: nvfp4(linear(Dtype::F8E4M3, &downs_shape, &downs).weight),
                ..linear(Dtype::U8, &down_shape, &downc)
            },
        };
        let (wu, wd) = (dequantize(&upc, &ups, 1.0, hidden), dequantize(&downc, &downs, 1.0, si));
        let whole = mlp(&x, |r, c| wu[r * hidden + c], |r, c| wd[r * si + c], si);
        let (u, d, pieces) = pieces_bytes(&s, (inter, hidden), PieceFormat::Nvfp4).unwrap();
        assert_eq!((u.len(), d.len(), pieces), (2 * inter * row_bytes(hidden), hidden * 2 * row_bytes(inter), 2));
        // Rows of `k` packed as the device holds them, dequantized.
        let unpack = |rows: &[u8], k: usize| -> Vec<f64> {
            rows.chunks(row_bytes(k)).flat_map(|r| dequantize(&r[..k / 2], &r[k / 2..][..k / 16], 1.0, k)).collect()
        };
        let (pu, pd) = (unpack(&u, hidden), unpack(&d, inter));
        assert_pieces_sum(&x, &whole, (inter, pieces), |j| {
            let (pu, pd) = (&pu, &pd);
            (move |r, c| pu[(j * inter + r) * hidden + c], move |r, c| pd[(r * pieces + j) * inter + c])
        });
    }
}
