//! The fused Mamba2 decode kernel (conv update, state update, gated norm in one launch): on the
//! GPU (`#[ignore]`d) against the three kernels it replaces, launched apart on the same data,
//! and against the f64 references of the three (rounded to bf16 where the kernels store), at
//! NemotronH geometry (64 heads x 64, state 128, 8 groups, 4 taps) and odd shapes.

use half::bf16;
use host::Rows;
use host::batch::Slots;
use host::conv1d::{Conv, ConvShape, conv_update};
use host::cpu::conv1d::ConvRef;
use host::cpu::norm::gated_norm as cpu_gated_norm;
use host::cpu::ssm::{SsmRef, Token, group_of};
use host::mamba::{MambaLayer, mamba_decode, mamba_decode_fits};
use host::norm::{NormShape, gated_norm};
use host::ssm::{SsmCache, SsmHeads, SsmInputs, SsmShape, ssm_update};
use kernels_gpu::conv1d::PAD_SLOT;
use nemotron_rs::{POISON_BF16, Rng, assert_close, assert_same, gpu, to_f64};

const EPS: f32 = 1e-5;

/// The bits of bf16 values (compared bit for bit: a poison NaN equals itself).
fn bits(v: &[bf16]) -> Vec<u16> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The bits of f32 values, likewise.
fn fbits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// One case: the SSM shape, conv taps, decode rows, cache slots, a conv bias or not.
struct Case {
    shape: SsmShape,
    k: usize,
    batch: usize,
    slots: usize,
    bias: bool,
}

#[test]
fn the_fused_kernel_takes_nemotron_shapes_and_refuses_others() {
    assert!(mamba_decode_fits(&SsmShape::new(64, 64, 8, 128)));
    assert!(mamba_decode_fits(&SsmShape::new(128, 64, 16, 128)));
    assert!(!mamba_decode_fits(&SsmShape::new(64, 64, 4, 128)), "16 heads a group");
    assert!(!mamba_decode_fits(&SsmShape::new(64, 72, 8, 128)), "head_dim 72");
    assert!(!mamba_decode_fits(&SsmShape::new(64, 64, 8, 256)), "state 256");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_mamba_decode_matches_apart_and_reference() {
    let gpu = gpu();
    let mut rng = Rng::new(101);
    let (mut compared, mut expected) = (0, 0);
    let cases = [
        Case { shape: SsmShape::new(64, 64, 8, 128), k: 4, batch: 1, slots: 3, bias: true },
        Case { shape: SsmShape::new(64, 64, 8, 128), k: 4, batch: 3, slots: 5, bias: true },
        // 3 heads a group, head_dim and state not multiples of the kernel's strides, 2 taps,
        // no bias; one head a group.
        Case { shape: SsmShape::new(6, 40, 2, 20), k: 2, batch: 2, slots: 4, bias: false },
        Case { shape: SsmShape::new(4, 8, 4, 4), k: 3, batch: 1, slots: 1, bias: true },
    ];
    for case in &cases {
        let got = check(&gpu, &mut rng, case);
        let s = case.shape;
        let conv_dim = s.width() + 2 * s.groups * s.state_size;
        // Both caches and y against the apart launches; y against the reference.
        expected += case.slots * conv_dim * (case.k - 1) + case.slots * s.slot_len() + 2 * case.batch * s.width();
        compared += got;
    }
    println!("fused Mamba decode: {compared} values compared");
    assert_eq!(compared, expected);
}

/// Runs `case` fused and apart on the same inputs; returns the values compared.
fn check(gpu: &host::Gpu, rng: &mut Rng, case: &Case) -> usize {
    let (s, k, batch) = (case.shape, case.k, case.batch);
    let (inner, gn) = (s.width(), s.groups * s.state_size);
    let conv_dim = inner + 2 * gn;
    // in_proj's rows: z, xBC, dt, then 3 columns of padding.
    let stride = inner + conv_dim + s.heads + 3;
    let zx = rng.bf16s(batch * stride, -2.0, 2.0);
    let mut zx = zx;
    for r in 0..batch {
        for h in 0..s.heads {
            zx[r * stride + inner + conv_dim + h] = bf16::from_f64(rng.uniform(-4.0, 0.5));
        }
    }
    let conv_w = rng.bf16s(conv_dim * k, -0.5, 0.5);
    let conv_b = case.bias.then(|| rng.bf16s(conv_dim, -0.5, 0.5));
    let conv_state = rng.bf16s(case.slots * conv_dim * (k - 1), -2.0, 2.0);
    let ssm_state: Vec<f32> = (0..case.slots * s.slot_len()).map(|_| rng.uniform(-1.0, 1.0) as f32).collect();
    let dt_bias: Vec<f32> = (0..s.heads).map(|_| rng.uniform(-1.0, 1.0) as f32).collect();
    let a: Vec<f32> = (0..s.heads).map(|_| -(rng.uniform(-1.5, 1.0).exp()) as f32).collect();
    let d: Vec<f32> = (0..s.heads).map(|_| rng.uniform(-1.0, 1.0) as f32).collect();
    let norm_w = rng.bf16s(inner, -2.0, 2.0);
    // Rows at the slots from the top down.
    let slots: Vec<i32> = (0..batch).map(|r| (case.slots - 1 - r) as i32).collect();
    let dslots = Slots::new(gpu, &slots, case.slots).unwrap();
    let (dzx, dw) = (gpu.upload(&zx).unwrap(), gpu.upload(&conv_w).unwrap());
    let db = conv_b.as_ref().map(|b| gpu.upload(b).unwrap());
    let (dbias, da, dd, dnorm) =
        (gpu.upload(&dt_bias).unwrap(), gpu.upload(&a).unwrap(), gpu.upload(&d).unwrap(), gpu.upload(&norm_w).unwrap());
    let heads = SsmHeads { dt_bias: &dbias, a: &da, d: Some(&dd) };

    // Apart: conv update, state update (no gate), gated norm.
    let (mut conv_a, mut ssm_a) = (gpu.upload(&conv_state).unwrap(), gpu.upload(&ssm_state).unwrap());
    let mut xbc = gpu.upload(&vec![POISON_BF16; batch * conv_dim]).unwrap();
    // in_proj's rows, and the conv's output rows: x, B, C.
    let zxr = Rows::strided(&dzx, batch, inner + conv_dim + s.heads, stride);
    let cs = ConvShape { dim: conv_dim, k };
    let conv = Conv { w: &dw, bias: db.as_ref(), state: &mut conv_a };
    conv_update(gpu, cs, zxr.cols(inner, conv_dim), conv, &dslots, &mut xbc).unwrap();
    let xbcr = Rows::new(&xbc, batch, conv_dim);
    let inputs = SsmInputs {
        x: xbcr.cols(0, inner),
        dt: zxr.cols(inner + conv_dim, s.heads),
        b: xbcr.cols(inner, gn),
        c: xbcr.cols(inner + gn, gn),
    };
    let mut y = gpu.upload(&vec![POISON_BF16; batch * inner]).unwrap();
    ssm_update(gpu, s, inputs, None, heads, SsmCache { state: &mut ssm_a, slots: &dslots, dst: None }, &mut y).unwrap();
    let mut yn_a = gpu.upload(&vec![POISON_BF16; batch * inner]).unwrap();
    let ns = NormShape::new(batch, inner, s.groups, EPS);
    gated_norm(gpu, ns, Rows::new(&y, batch, inner), zxr.cols(0, inner), &dnorm, &mut yn_a).unwrap();

    // Fused.
    let (mut conv_f, mut ssm_f) = (gpu.upload(&conv_state).unwrap(), gpu.upload(&ssm_state).unwrap());
    let mut yn_f = gpu.upload(&vec![POISON_BF16; batch * inner]).unwrap();
    let conv = Conv { w: &dw, bias: db.as_ref(), state: &mut conv_f };
    let layer = MambaLayer { conv, k, heads, state: &mut ssm_f, norm: &dnorm, eps: EPS };
    mamba_decode(gpu, s, zxr, layer, &dslots, &mut yn_f).unwrap();

    let label = format!(
        "{} heads x {}, {} groups, state {}, k {k}, batch {batch}",
        s.heads, s.head_dim, s.groups, s.state_size
    );
    let mut compared = assert_same(
        &format!("{label}: conv state"),
        &bits(&gpu.download(&conv_f).unwrap()),
        &bits(&gpu.download(&conv_a).unwrap()),
    );
    compared += assert_same(
        &format!("{label}: state"),
        &fbits(&gpu.download(&ssm_f).unwrap()),
        &fbits(&gpu.download(&ssm_a).unwrap()),
    );
    let got = to_f64(&gpu.download(&yn_f).unwrap());
    // The norm's group sums in another order: a bf16 ulp either way.
    compared +=
        assert_close(&format!("{label}: y vs apart"), &got, &to_f64(&gpu.download(&yn_a).unwrap()), 1e-3, 1.0 / 128.0);

    // The f64 references, rounded to bf16 where the kernels store.
    let round = |v: &[f64]| v.iter().map(|&x| bf16::from_f64(x)).collect::<Vec<_>>();
    let conv_ref = ConvRef { dim: conv_dim, k, w: &conv_w, bias: conv_b.as_deref() };
    let mut cstate = conv_state.clone();
    let conv_out = conv_ref.update(&zx[inner..], stride, &mut cstate, &slots);
    let ssm_ref = SsmRef {
        heads: s.heads,
        head_dim: s.head_dim,
        groups: s.groups,
        state_size: s.state_size,
        dt_bias: &dt_bias,
        a: &a,
        d: Some(&d),
        dt_min: 0.0,
        dt_max: f64::INFINITY,
    };
    let mut want = Vec::new();
    for (r, out) in conv_out.iter().enumerate() {
        let xr = round(out.as_ref().expect("no pad rows"));
        let slot = slots[r] as usize;
        let mut st: Vec<f64> = ssm_state[slot * s.slot_len()..][..s.slot_len()].iter().map(|&v| f64::from(v)).collect();
        let dt = &zx[r * stride + inner + conv_dim..][..s.heads];
        let group = |h| group_of(h, s.heads, s.groups);
        let yr = ssm_ref.step_with_groups(&mut st, Token::of_xbc(&xr, dt, (inner, gn)), group);
        let z = &zx[r * stride..][..inner];
        want.extend(cpu_gated_norm(&round(&yr), Some(z), &norm_w, inner, s.groups, f64::from(EPS)));
    }
    // Rounding points of three kernels chained: a few bf16 ulps.
    compared += assert_close(&format!("{label}: y vs f64"), &got, &want, 2e-2, 1.0 / 32.0);
    compared
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_mamba_decode_pad_rows_touch_nothing() {
    let gpu = gpu();
    let mut rng = Rng::new(103);
    let s = SsmShape::new(64, 64, 8, 128);
    let (inner, k, nslots) = (s.width(), 4, 2);
    let conv_dim = inner + 2 * s.groups * s.state_size;
    let stride = inner + conv_dim + s.heads;
    let dzx = gpu.upload(&rng.bf16s(2 * stride, -2.0, 2.0)).unwrap();
    let w = gpu.upload(&rng.bf16s(conv_dim * k, -0.5, 0.5)).unwrap();
    let conv0 = rng.bf16s(nslots * conv_dim * (k - 1), -2.0, 2.0);
    let ssm0: Vec<f32> = (0..nslots * s.slot_len()).map(|_| rng.uniform(-1.0, 1.0) as f32).collect();
    // dt_bias and A both -1 (A must be negative).
    let hb = gpu.upload(&vec![-1.0f32; s.heads]).unwrap();
    let norm = gpu.upload(&rng.bf16s(inner, -2.0, 2.0)).unwrap();
    let heads = SsmHeads { dt_bias: &hb, a: &hb, d: None };
    // The rows of `zx` from `row0`, at `slots`: both caches and y afterwards, as bits.
    let run = |row0: usize, slots: &[i32]| {
        let dslots = Slots::new(&gpu, slots, nslots).unwrap();
        let (mut cst, mut st) = (gpu.upload(&conv0).unwrap(), gpu.upload(&ssm0).unwrap());
        let mut y = gpu.upload(&vec![POISON_BF16; slots.len() * inner]).unwrap();
        let zx = Rows { offset: row0 * stride, ..Rows::new(&dzx, slots.len(), stride) };
        let conv = Conv { w: &w, bias: None, state: &mut cst };
        let layer = MambaLayer { conv, k, heads, state: &mut st, norm: &norm, eps: EPS };
        mamba_decode(&gpu, s, zx, layer, &dslots, &mut y).unwrap();
        (bits(&gpu.download(&cst).unwrap()), fbits(&gpu.download(&st).unwrap()), bits(&gpu.download(&y).unwrap()))
    };
    let poison = vec![POISON_BF16.to_bits(); inner];
    // A pad row beside a real one: the real one as alone, the pad row's y untouched.
    let (c2, s2, y2) = run(0, &[PAD_SLOT, 1]);
    let (c1, s1, y1) = run(1, &[1]);
    let mut compared = assert_same("pad + row: conv state", &c2, &c1);
    compared += assert_same("pad + row: state", &s2, &s1);
    compared += assert_same("pad + row: the row's y", &y2[inner..], &y1);
    compared += assert_same("pad + row: the pad row's y", &y2[..inner], &poison);
    // Only a pad row: nothing written.
    let (c0, s0, y0) = run(0, &[PAD_SLOT]);
    compared += assert_same("pad only: conv state", &c0, &bits(&conv0));
    compared += assert_same("pad only: state", &s0, &fbits(&ssm0));
    compared += assert_same("pad only: y", &y0, &poison);
    let caches = nslots * (conv_dim * (k - 1) + s.slot_len());
    assert_eq!(compared, 2 * caches + 3 * inner);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_mamba_decode_misuse_is_refused() {
    let gpu = gpu();
    let dslots = Slots::new(&gpu, &[0], 1).unwrap();
    // (shape, zx stride short by one?, the argument named in the error)
    for (shape, short, arg) in [
        (SsmShape::new(32, 64, 2, 128), false, "`heads`"),
        (SsmShape::new(8, 72, 1, 16), false, "`head_dim`"),
        (SsmShape::new(8, 8, 1, 132), false, "`state_size`"),
        (SsmShape::new(8, 8, 1, 16), true, "`zx`"),
    ] {
        let (inner, k) = (shape.width(), 4);
        let conv_dim = inner + 2 * shape.groups * shape.state_size;
        let stride = inner + conv_dim + shape.heads - usize::from(short);
        let zx = gpu.zeros::<bf16>(stride + shape.heads).unwrap();
        let (w, mut cst) = (gpu.zeros::<bf16>(conv_dim * k).unwrap(), gpu.zeros::<bf16>(conv_dim * (k - 1)).unwrap());
        let (hb, mut st) = (gpu.zeros::<f32>(shape.heads).unwrap(), gpu.zeros::<f32>(shape.slot_len()).unwrap());
        let (norm, mut y) = (gpu.zeros::<bf16>(inner).unwrap(), gpu.zeros::<bf16>(inner).unwrap());
        let heads = SsmHeads { dt_bias: &hb, a: &hb, d: None };
        let conv = Conv { w: &w, bias: None, state: &mut cst };
        let layer = MambaLayer { conv, k, heads, state: &mut st, norm: &norm, eps: EPS };
        let zx = Rows::strided(&zx, 1, inner + conv_dim + shape.heads, stride);
        let err = mamba_decode(&gpu, shape, zx, layer, &dslots, &mut y).unwrap_err();
        assert!(err.to_string().contains(arg), "{arg}: {err}");
    }
}
