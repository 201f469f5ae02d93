//! Causal conv1d: the reference against hand-checked values and against itself (forward ==
//! repeated update) in CI; the kernels against the reference on the GPU (`#[ignore]`d).

use half::bf16;
use host::Rows;
use host::batch::{Prefill, Slots};
use host::conv1d::{Conv, ConvPath, ConvShape, TILED_TOKENS, conv_fwd, conv_fwd_on, conv_update};
use host::cpu::conv1d::ConvRef;
use nemotron_rs::{POISON_BF16, Rng, assert_close, assert_same, gpu};

const RTOL: f64 = 1.0 / 256.0 + 1e-5;
const ATOL: f64 = 1e-6;

fn silu(v: f64) -> f64 {
    v / (1.0 + (-v).exp())
}

fn bf(v: &[f64]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f64(x)).collect()
}

#[test]
fn reference_update_hand_checked() {
    // One channel, k = 3, w = [1, 2, 3], bias 0.5, state [1, 2], x = 3:
    // y = silu(0.5 + 1 + 4 + 9), state becomes [2, 3].
    let (w, bias) = (bf(&[1.0, 2.0, 3.0]), bf(&[0.5]));
    let conv = ConvRef { dim: 1, k: 3, w: &w, bias: Some(&bias) };
    let mut state = bf(&[9.0, 9.0, 1.0, 2.0]); // slot 0 = [9, 9], slot 1 = [1, 2]
    let y = conv.update(&bf(&[3.0, 7.0]), 1, &mut state, &[1, -1]);
    assert_close("y", y[0].as_ref().unwrap(), &[silu(14.5)], 0.0, 1e-15);
    assert!(y[1].is_none(), "pad row has no output");
    assert_eq!(state, bf(&[9.0, 9.0, 2.0, 3.0]), "slot 1 rolled, slot 0 untouched");
}

#[test]
fn reference_forward_hand_checked() {
    // Without an initial state the prefix is zeros: y0 = silu(w2 x0), y1 = silu(w1 x0 + w2 x1).
    let w = bf(&[1.0, 2.0, 3.0]);
    let conv = ConvRef { dim: 1, k: 3, w: &w, bias: None };
    let mut state = bf(&[5.0, 6.0]);
    let y = conv.forward(&bf(&[1.0, 2.0]), 1, &mut state, &[2], &[0], &[false]);
    let y: Vec<f64> = y.into_iter().map(|r| r.unwrap()[0]).collect();
    assert_close("y", &y, &[silu(3.0), silu(2.0 + 6.0)], 0.0, 1e-15);
    assert_eq!(state, bf(&[1.0, 2.0]));
    // A sequence shorter than k - 1 keeps the newest old value: [5, 6] ++ [4] -> [6, 4].
    let mut state = bf(&[5.0, 6.0]);
    conv.forward(&bf(&[4.0]), 1, &mut state, &[1], &[0], &[true]);
    assert_eq!(state, bf(&[6.0, 4.0]));
}

#[test]
fn reference_forward_equals_repeated_update() {
    let mut rng = Rng::new(21);
    let (dim, k) = (5, 4);
    let (w, bias) = (rng.bf16s(dim * k, -1.0, 1.0), rng.bf16s(dim, -1.0, 1.0));
    let conv = ConvRef { dim, k, w: &w, bias: Some(&bias) };
    let x = rng.bf16s(7 * dim, -2.0, 2.0);
    let init = rng.bf16s(dim * (k - 1), -2.0, 2.0);
    let (mut s1, mut s2) = (init.clone(), init);
    let fwd: Vec<f64> =
        conv.forward(&x, dim, &mut s1, &[7], &[0], &[true]).into_iter().flat_map(Option::unwrap).collect();
    let upd: Vec<f64> =
        (0..7).flat_map(|t| conv.update(&x[t * dim..(t + 1) * dim], dim, &mut s2, &[0]).remove(0).unwrap()).collect();
    assert_close("forward vs update", &fwd, &upd, 0.0, 0.0);
    assert_eq!(s1, s2);
}

/// Rows of pad rows or sequences keep their poison; the others compare with the reference.
fn compare_rows(label: &str, got: &[bf16], want: &[Option<Vec<f64>>], dim: usize) -> usize {
    let (mut g, mut w) = (Vec::new(), Vec::new());
    for (r, row) in want.iter().enumerate() {
        let out = &got[r * dim..(r + 1) * dim];
        match row {
            Some(row) => {
                g.extend(out.iter().map(|v| v.to_f64()));
                w.extend_from_slice(row);
            }
            None => {
                assert!(out.iter().all(|v| v.to_bits() == POISON_BF16.to_bits()), "{label}: pad row {r} was written")
            }
        }
    }
    assert_close(label, &g, &w, ATOL, RTOL)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_conv_update_matches_reference() {
    let gpu = gpu();
    let mut rng = Rng::new(22);
    let mut compared = 0;
    // (batch, dim, k, x_stride): NemotronH (conv_dim 6144 inside in_proj rows of 10304) and edges.
    for &(batch, dim, k, x_stride) in
        &[(64, 6144, 4, 10304), (1, 6144, 4, 10304), (3, 37, 2, 40), (5, 300, 3, 300), (2, 1, 4, 1)]
    {
        let num_slots = batch + 3;
        // Slots in reverse order (some unused), the second row padded when there are several.
        let mut slots: Vec<i32> = (0..batch).map(|r| (num_slots - 1 - r) as i32).collect();
        if batch > 1 {
            slots[1] = -1;
        }
        let (w, bias) = (rng.bf16s(dim * k, -1.0, 1.0), rng.bf16s(dim, -1.0, 1.0));
        let x = rng.bf16s(batch * x_stride, -3.0, 3.0);
        let mut state = rng.bf16s(num_slots * dim * (k - 1), -3.0, 3.0);
        let shape = ConvShape { dim, k };
        let (dx, dw, db) = (gpu.upload(&x).unwrap(), gpu.upload(&w).unwrap(), gpu.upload(&bias).unwrap());
        let mut dstate = gpu.upload(&state).unwrap();
        let mut dy = gpu.upload(&vec![POISON_BF16; batch * dim]).unwrap();
        let dslots = Slots::new(&gpu, &slots, num_slots).unwrap();
        let (xr, conv) =
            (Rows::strided(&dx, batch, dim, x_stride), Conv { w: &dw, bias: Some(&db), state: &mut dstate });
        conv_update(&gpu, shape, xr, conv, &dslots, &mut dy).unwrap();
        let want = ConvRef { dim, k, w: &w, bias: Some(&bias) }.update(&x, x_stride, &mut state, &slots);
        let label = format!("update b{batch} dim{dim} k{k}");
        compared += compare_rows(&label, &gpu.download(&dy).unwrap(), &want, dim);
        // Every slot, used or not, bit-exact: rolled where a row used it, untouched elsewhere.
        compared += assert_same(&format!("{label} states"), &gpu.download(&dstate).unwrap(), &state);
    }
    println!("conv_update: {compared} values compared");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_conv_fwd_matches_reference() {
    let gpu = gpu();
    let mut rng = Rng::new(23);
    let mut compared = 0;
    let big: &[usize] = &[1, 2, 3, 5, 127, 128, 129, 300, 1000];
    for &(dim, k, x_stride, lens) in &[(6144, 4, 10304, big), (37, 3, 37, &[1, 1, 2, 4][..]), (8, 2, 9, &[3][..])] {
        let nseq = lens.len();
        let num_slots = nseq + 2;
        let mut slots: Vec<i32> = (0..nseq).map(|s| (num_slots - 1 - s) as i32).collect();
        let mut has_initial: Vec<bool> = (0..nseq).map(|s| s % 2 == 0).collect();
        if nseq > 2 {
            slots[2] = -1;
            has_initial[2] = false;
        }
        let tokens: usize = lens.iter().sum();
        let (w, bias) = (rng.bf16s(dim * k, -1.0, 1.0), rng.bf16s(dim, -1.0, 1.0));
        let x = rng.bf16s(tokens * x_stride, -3.0, 3.0);
        let mut state = rng.bf16s(num_slots * dim * (k - 1), -3.0, 3.0);
        let shape = ConvShape { dim, k };
        let (dx, dw, db) = (gpu.upload(&x).unwrap(), gpu.upload(&w).unwrap(), gpu.upload(&bias).unwrap());
        let mut dstate = gpu.upload(&state).unwrap();
        let mut dy = gpu.upload(&vec![POISON_BF16; tokens * dim]).unwrap();
        let seqs = Prefill::new(&gpu, lens, &slots, &has_initial, num_slots).unwrap();
        let xr = Rows::strided(&dx, tokens, dim, x_stride);
        conv_fwd(&gpu, shape, xr, Conv { w: &dw, bias: Some(&db), state: &mut dstate }, &seqs, &mut dy).unwrap();
        let conv = ConvRef { dim, k, w: &w, bias: Some(&bias) };
        let want = conv.forward(&x, x_stride, &mut state, lens, &slots, &has_initial);
        let label = format!("forward dim{dim} k{k} lens {lens:?}");
        compared += compare_rows(&label, &gpu.download(&dy).unwrap(), &want, dim);
        compared += assert_same(&format!("{label} states"), &gpu.download(&dstate).unwrap(), &state);
    }
    println!("conv_fwd: {compared} values compared");
}

/// The tiled forward (4 channels by a run of tokens a thread), forced, against the reference
/// and bit for bit against the per-token kernel: NemotronH geometry at prefill sizes (one
/// sequence of 4097 tokens, crossing tiles of 16 at odd places), varlen batches of many short
/// sequences (length 1, 2, 3, tile-crossing lengths) with initial states and pad sequences,
/// k 2 and 3, a dim that is a multiple of 4 but not 8, one token; states bit-exact too.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_conv_fwd_tiled_matches_reference_and_per_token() {
    let gpu = gpu();
    let mut rng = Rng::new(24);
    let mut compared = 0;
    let many: Vec<usize> = (0..40).map(|i| [1, 2, 3, 1, 15, 17, 1, 33, 4, 100][i % 10]).collect();
    let cases: &[(usize, usize, usize, &[usize])] = &[
        (6144, 4, 10304, &[4097]),
        (6144, 4, 10304, &many),
        (6144, 4, 10304, &[1]),
        (6144, 4, 10304, &[300, 1, 1, 2, 1000]),
        (12, 3, 20, &many),
        (1028, 2, 1032, &[1, 260, 3]),
        (4, 4, 4, &[2, 1, 5]),
    ];
    for &(dim, k, x_stride, lens) in cases {
        let nseq = lens.len();
        let num_slots = nseq + 2;
        let mut slots: Vec<i32> = (0..nseq).map(|s| (num_slots - 1 - s) as i32).collect();
        let mut has_initial: Vec<bool> = (0..nseq).map(|s| s % 3 != 1).collect();
        for s in (2..nseq).step_by(5) {
            slots[s] = -1;
            has_initial[s] = false;
        }
        let tokens: usize = lens.iter().sum();
        let (w, bias) = (rng.bf16s(dim * k, -1.0, 1.0), rng.bf16s(dim, -1.0, 1.0));
        let x = rng.bf16s(tokens * x_stride, -3.0, 3.0);
        let state0 = rng.bf16s(num_slots * dim * (k - 1), -3.0, 3.0);
        let shape = ConvShape { dim, k };
        let (dx, dw, db) = (gpu.upload(&x).unwrap(), gpu.upload(&w).unwrap(), gpu.upload(&bias).unwrap());
        let seqs = Prefill::new(&gpu, lens, &slots, &has_initial, num_slots).unwrap();
        let mut runs = Vec::new();
        for path in [ConvPath::Tiled, ConvPath::PerToken] {
            for with_bias in [true, false] {
                let mut dstate = gpu.upload(&state0).unwrap();
                let mut dy = gpu.upload(&vec![POISON_BF16; tokens * dim]).unwrap();
                let b = with_bias.then_some(&db);
                let (xr, conv) =
                    (Rows::strided(&dx, tokens, dim, x_stride), Conv { w: &dw, bias: b, state: &mut dstate });
                conv_fwd_on(&gpu, Some(path), shape, xr, conv, &seqs, &mut dy).unwrap();
                runs.push((path, with_bias, gpu.download(&dy).unwrap(), gpu.download(&dstate).unwrap()));
            }
        }
        let nlens = if nseq > 6 { format!("{nseq} sequences") } else { format!("{lens:?}") };
        for (path, with_bias, y, st) in &runs[..2] {
            let mut state = state0.clone();
            let conv = ConvRef { dim, k, w: &w, bias: with_bias.then_some(&bias[..]) };
            let want = conv.forward(&x, x_stride, &mut state, lens, &slots, &has_initial);
            let label = format!("{path:?} dim{dim} k{k} bias {with_bias} lens {nlens}");
            compared += compare_rows(&label, y, &want, dim);
            compared += assert_same(&format!("{label} states"), st, &state);
        }
        for i in 0..2 {
            let (t, p) = (&runs[i], &runs[i + 2]);
            let label = format!("tiled == per-token dim{dim} k{k} bias {} lens {nlens}", t.1);
            // As bits: pad sequences' rows keep their NaN poison in both.
            let bits = |v: &[bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<u16>>();
            compared += assert_same(&label, &bits(&t.2), &bits(&p.2));
        }
    }
    println!("conv_fwd tiled: {compared} values compared");
}

/// The launcher's own pick (tiled at many tokens where the shape allows, per token otherwise)
/// gives the reference's values; the tiled kernel refuses shapes it does not take.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_conv_fwd_picks_a_path_and_tiled_refuses_other_shapes() {
    let gpu = gpu();
    let mut rng = Rng::new(25);
    let mut compared = 0;
    for &(dim, k, x_stride, tokens) in
        &[(6144, 4, 10304, TILED_TOKENS), (6144, 4, 10304, TILED_TOKENS - 1), (37, 3, 37, 300), (64, 5, 64, 300)]
    {
        let lens = [tokens / 3, tokens - tokens / 3];
        let (slots, has_initial) = ([1, 0], [true, false]);
        let (w, bias) = (rng.bf16s(dim * k, -1.0, 1.0), rng.bf16s(dim, -1.0, 1.0));
        let x = rng.bf16s(tokens * x_stride, -3.0, 3.0);
        let mut state = rng.bf16s(2 * dim * (k - 1), -3.0, 3.0);
        let shape = ConvShape { dim, k };
        let (dx, dw, db) = (gpu.upload(&x).unwrap(), gpu.upload(&w).unwrap(), gpu.upload(&bias).unwrap());
        let mut dstate = gpu.upload(&state).unwrap();
        let mut dy = gpu.upload(&vec![POISON_BF16; tokens * dim]).unwrap();
        let seqs = Prefill::new(&gpu, &lens, &slots, &has_initial, 2).unwrap();
        let xr = Rows::strided(&dx, tokens, dim, x_stride);
        if dim % 4 != 0 || k > 4 {
            let conv = Conv { w: &dw, bias: Some(&db), state: &mut dstate };
            let e = conv_fwd_on(&gpu, Some(ConvPath::Tiled), shape, xr, conv, &seqs, &mut dy);
            println!("tiled refuses dim {dim} k {k}: {}", e.as_ref().unwrap_err());
            assert!(e.is_err());
        }
        conv_fwd(&gpu, shape, xr, Conv { w: &dw, bias: Some(&db), state: &mut dstate }, &seqs, &mut dy).unwrap();
        let want =
            ConvRef { dim, k, w: &w, bias: Some(&bias) }.forward(&x, x_stride, &mut state, &lens, &slots, &has_initial);
        let label = format!("picked dim{dim} k{k} {tokens} tokens");
        compared += compare_rows(&label, &gpu.download(&dy).unwrap(), &want, dim);
        compared += assert_same(&format!("{label} states"), &gpu.download(&dstate).unwrap(), &state);
    }
    println!("conv_fwd picked: {compared} values compared");
}
