//! Chunked scan: the kernels against the sequential f64 recurrence, and against the state
//! update kernel run token by token, on the GPU (`#[ignore]`d); the chunk table in CI.

mod common;

use common::{Problem, TestState, random_states};
use half::bf16;
use host::Rows;
use host::batch::{Prefill, Slots};
use host::ssd::{SsdPlan, chunk_table, ssd_scan};
use host::ssm::{SsmCache, SsmInputs, SsmShape, ssm_update};
use kernels_gpu::ssd::SsdChunk;
use nemotron_rs::{POISON_BF16, Rng, assert_band, assert_same, gpu, to_f64};

/// y (bf16) against the f64 recurrence: half a bf16 ulp plus the f32 error of the chunked
/// form (exponentials of cumulative sums, sums over up to 128 tokens).
const RTOL: f64 = 1.0 / 256.0 + 1e-3;
const ATOL: f64 = 1e-3;

fn nemotron() -> SsmShape {
    SsmShape::new(64, 64, 8, 128)
}

#[test]
fn chunks_never_span_sequences() {
    let (chunks, first) = chunk_table(&[1, 128, 129, 300]);
    let c = |seq, start, len| SsdChunk { seq, start, len, _pad: 0 };
    let want =
        vec![c(0, 0, 1), c(1, 1, 128), c(2, 129, 128), c(2, 257, 1), c(3, 258, 128), c(3, 386, 128), c(3, 514, 44)];
    assert_eq!(chunks, want);
    assert_eq!(first, vec![0, 1, 2, 4, 7]);
}

/// The f64 recurrence over each sequence of `lens` (rows one after another) from its start
/// state (zeros where `None`): the outputs, their magnitudes M (the same recurrence over |x|,
/// |B|, |C| and |start| without D: the sum of the magnitudes of every term behind each output)
/// and each sequence's final state with its magnitudes.
type Finals = Vec<(Vec<f64>, Vec<f64>)>;
fn recurrence(prob: &Problem, lens: &[usize], starts: &[Option<Vec<f64>>]) -> (Vec<f64>, Vec<f64>, Finals) {
    let abs = Problem {
        shape: prob.shape,
        xbc: prob.xbc.iter().map(|v| bf16::from_bits(v.to_bits() & 0x7fff)).collect(),
        dt: prob.dt.clone(),
        z: prob.z.clone(),
        dt_bias: prob.dt_bias.clone(),
        a: prob.a.clone(),
        d: prob.d.clone(),
    };
    let (exact, magnitude) = (prob.reference(true), abs.reference(false));
    let sl = prob.shape.slot_len();
    let (mut y, mut mag, mut finals) = (Vec::new(), Vec::new(), Vec::new());
    let mut start = 0;
    for (s, &len) in lens.iter().enumerate() {
        let s0 = starts[s].clone().unwrap_or_else(|| vec![0.0; sl]);
        let run = |p: &Problem, r: &host::cpu::ssm::SsmRef, out: &mut Vec<f64>, mut st: Vec<f64>| {
            let rows = |f: fn(&Problem, usize) -> &[bf16]| (start..start + len).map(|t| f(p, t)).collect::<Vec<_>>();
            let ys = r.scan(&mut st, &rows(Problem::x), &rows(Problem::dt), &rows(Problem::b), &rows(Problem::c));
            out.extend(ys.into_iter().flatten());
            st
        };
        let fin = run(prob, &exact, &mut y, s0.clone());
        let fin_mag = run(&abs, &magnitude, &mut mag, s0.iter().map(|v| v.abs()).collect());
        finals.push((fin, fin_mag));
        start += len;
    }
    (y, mag, finals)
}

/// Checks y against the recurrence within `scale (ATOL + RTOL |want|) + 2^-7 M`: the first
/// part the f32 sums and the bf16 output (`scale` such roundings), the second the tensor-core
/// operands: each term behind an output went through at most two bf16 roundings (unit
/// roundoff 2^-8 each: bf16 keeps 8 significant bits) of one of its factors (x . w into the
/// chunk's own state, then that state into S_start; or the weighted score), so its error is
/// at most 2^-7 of its magnitude, and M sums those magnitudes. Prints the worst error in units
/// of the band; returns the count.
fn assert_y(label: &str, got: &[f64], want: &[f64], mag: &[f64], scale: f64) -> usize {
    assert_band(label, got, want, mag, (scale * ATOL, scale * RTOL, 1.0 / 128.0))
}

/// Slots for `nseq` sequences in a cache of nseq + 2, in reverse order (slot 0 and the slot of
/// a padded sequence stay unused); sequence `pad` padded.
fn slots_for(nseq: usize, pad: Option<usize>) -> Vec<i32> {
    (0..nseq).map(|s| if Some(s) == pad { -1 } else { (nseq + 1 - s) as i32 }).collect()
}

/// Runs the scan on the GPU and the recurrence on the CPU; compares y and every slot.
fn check_scan<T: TestState>(
    gpu: &host::Gpu,
    rng: &mut Rng,
    shape: SsmShape,
    lens: &[usize],
    pad: Option<usize>,
) -> usize
where
    kernels_gpu::ssd::SsdPassParams<T::Raw>: kernels_gpu::KernelParams,
{
    let nseq = lens.len();
    let tokens: usize = lens.iter().sum();
    let num_slots = nseq + 2;
    let slots = slots_for(nseq, pad);
    let has_initial: Vec<bool> = (0..nseq).map(|s| s % 2 == 1 && slots[s] >= 0).collect();
    let prob = Problem::new(rng, shape, tokens);
    let dev = prob.upload(gpu);
    let init: Vec<T> = random_states(rng, &shape, num_slots).into_iter().map(T::from_f64).collect();
    let mut state = gpu.upload(&init).unwrap();
    let seqs = Prefill::new(gpu, lens, &slots, &has_initial, num_slots).unwrap();
    let mut plan = SsdPlan::new(gpu, &seqs, shape).unwrap();
    let mut y = gpu.upload(&vec![POISON_BF16; tokens * shape.width()]).unwrap();
    ssd_scan(gpu, shape, (dev.inputs_at(0, tokens), dev.heads(true)), (&mut state, &seqs), &mut plan, &mut y).unwrap();

    let sl = shape.slot_len();
    let mut want_state: Vec<f64> = init.iter().map(|v| v.to_f64()).collect();
    let mut written = vec![false; num_slots];
    let starts: Vec<Option<Vec<f64>>> =
        (0..nseq).map(|s| has_initial[s].then(|| want_state[slots[s] as usize * sl..][..sl].to_vec())).collect();
    let (want_y, mag, finals) = recurrence(&prob, lens, &starts);
    let mut state_mag = vec![0.0; want_state.len()];
    for (s, (fin, fin_mag)) in finals.into_iter().enumerate() {
        if slots[s] >= 0 {
            want_state[slots[s] as usize * sl..][..sl].copy_from_slice(&fin);
            state_mag[slots[s] as usize * sl..][..sl].copy_from_slice(&fin_mag);
            written[slots[s] as usize] = true;
        }
    }
    let label = format!(
        "{} state, {:?}, lens {lens:?}",
        T::NAME,
        (shape.heads, shape.head_dim, shape.groups, shape.state_size)
    );
    let mut n = assert_y(&format!("{label} y"), &to_f64(&gpu.download(&y).unwrap()), &want_y, &mag, 1.0);
    let got: Vec<T> = gpu.download(&state).unwrap();
    for s in 0..num_slots {
        if written[s] {
            let g: Vec<f64> = got[s * sl..][..sl].iter().map(|v| v.to_f64()).collect();
            // The state's own rounding, the f32 sums, and one bf16 rounding (x . w) of a
            // factor of each term: 2^-8 of the magnitudes.
            n += assert_band(
                &format!("{label} final state slot {s}"),
                &g,
                &want_state[s * sl..][..sl],
                &state_mag[s * sl..][..sl],
                (1e-5, T::RTOL + 1e-4, 1.0 / 256.0),
            );
        } else {
            let bits = |v: &[T]| v.iter().map(|x| x.to_f64().to_bits()).collect::<Vec<_>>();
            n += assert_same(
                &format!("{label} untouched slot {s}"),
                &bits(&got[s * sl..][..sl]),
                &bits(&init[s * sl..][..sl]),
            );
        }
    }
    n
}

const LENS: &[usize] = &[1, 3, 127, 128, 129, 300, 1000, 5];

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_ssd_f32_state_matches_recurrence() {
    let gpu = gpu();
    let mut rng = Rng::new(41);
    let mut n = check_scan::<f32>(&gpu, &mut rng, nemotron(), LENS, Some(7));
    n += check_scan::<f32>(&gpu, &mut rng, nemotron(), &[1000], None);
    n += check_scan::<f32>(&gpu, &mut rng, SsmShape::new(4, 16, 2, 32), &[1, 130, 5], None);
    n += check_scan::<f32>(&gpu, &mut rng, SsmShape::new(3, 7, 3, 12), &[2, 257], Some(0));
    println!("ssd_scan f32 state: {n} values compared");
}

/// Small cases of both staging paths (16-byte and element-wise) and the production widths,
/// quick enough for compute-sanitizer's race and sync checks.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_ssd_small_for_the_sanitizers() {
    let gpu = gpu();
    let mut rng = Rng::new(45);
    let mut n = check_scan::<f32>(&gpu, &mut rng, nemotron(), &[129, 3], Some(1));
    n += check_scan::<f32>(&gpu, &mut rng, SsmShape::new(3, 7, 3, 12), &[2, 140], None);
    println!("ssd_scan small: {n} values compared");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_ssd_bf16_state_matches_recurrence() {
    let gpu = gpu();
    let mut rng = Rng::new(42);
    let n = check_scan::<bf16>(&gpu, &mut rng, nemotron(), &[129, 1, 300], None);
    println!("ssd_scan bf16 state: {n} values compared");
}

/// One plan for every layer of a step (the model's Mamba layers share theirs): a scan on a plan
/// another scan used (other inputs and states, its workspaces left written) gives bit for bit
/// what it gives on a fresh plan, and the plan says which batches and shapes it fits.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_ssd_plan_serves_every_layer_of_a_step() {
    let gpu = gpu();
    let mut rng = Rng::new(47);
    let shape = nemotron();
    let lens = &[129, 3, 300];
    let tokens: usize = lens.iter().sum();
    let (slots, has_initial) = (vec![0, 1, 2], vec![false, true, true]);
    let seqs = Prefill::new(&gpu, lens, &slots, &has_initial, 3).unwrap();
    let layers: Vec<Problem> = (0..2).map(|_| Problem::new(&mut rng, shape, tokens)).collect();
    let init: Vec<f32> = random_states(&mut rng, &shape, 3).into_iter().map(|v| v as f32).collect();
    // Layer 1's scan on a fresh plan, or on the plan layer 0's scan used.
    let scan = |plan: &mut SsdPlan, p: &Problem| {
        let dev = p.upload(&gpu);
        let mut state = gpu.upload(&init).unwrap();
        let mut y = gpu.upload(&vec![POISON_BF16; tokens * shape.width()]).unwrap();
        ssd_scan(&gpu, shape, (dev.inputs_at(0, tokens), dev.heads(true)), (&mut state, &seqs), plan, &mut y).unwrap();
        let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
        (gpu.download(&y).unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>(), bits(gpu.download(&state).unwrap()))
    };
    let mut shared = SsdPlan::new(&gpu, &seqs, shape).unwrap();
    scan(&mut shared, &layers[0]);
    let (reused, fresh) =
        (scan(&mut shared, &layers[1]), scan(&mut SsdPlan::new(&gpu, &seqs, shape).unwrap(), &layers[1]));
    let n = assert_same("y on a used plan", &reused.0, &fresh.0)
        + assert_same("states on a used plan", &reused.1, &fresh.1);
    assert!(shared.fits(&seqs, shape));
    assert!(!shared.fits(&seqs, SsmShape::new(4, 16, 2, 32)));
    let other = Prefill::new(&gpu, &[129, 3, 301], &slots, &has_initial, 3).unwrap();
    assert!(!shared.fits(&other, shape));
    println!("ssd_scan on a used plan: {n} values as on a fresh one");
}

/// The scan against the decode kernel stepped token by token over the same sequences (every
/// step a batch of the sequences still running): outputs and final states.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_ssd_equals_update_kernel_token_by_token() {
    let gpu = gpu();
    let mut rng = Rng::new(43);
    let shape = nemotron();
    let lens = &LENS[..7];
    let (nseq, tokens) = (lens.len(), lens.iter().sum::<usize>());
    let num_slots = nseq + 2;
    let slots = slots_for(nseq, None);
    let has_initial: Vec<bool> = (0..nseq).map(|s| s % 2 == 1).collect();
    let prob = Problem::new(&mut rng, shape, tokens);
    let dev = prob.upload(&gpu);
    let init: Vec<f32> = random_states(&mut rng, &shape, num_slots).into_iter().map(|v| v as f32).collect();
    let sl = shape.slot_len();

    let mut scan_state = gpu.upload(&init).unwrap();
    let seqs = Prefill::new(&gpu, lens, &slots, &has_initial, num_slots).unwrap();
    let mut plan = SsdPlan::new(&gpu, &seqs, shape).unwrap();
    let mut scan_y = gpu.zeros::<bf16>(tokens * shape.width()).unwrap();
    ssd_scan(
        &gpu,
        shape,
        (dev.inputs_at(0, tokens), dev.heads(true)),
        (&mut scan_state, &seqs),
        &mut plan,
        &mut scan_y,
    )
    .unwrap();

    // The update path starts fresh sequences from a zeroed slot.
    let mut upd_init = init.clone();
    for s in (0..nseq).filter(|&s| !has_initial[s]) {
        upd_init[slots[s] as usize * sl..][..sl].fill(0.0);
    }
    let mut upd_state = gpu.upload(&upd_init).unwrap();
    let starts: Vec<usize> = lens.iter().scan(0, |a, &l| Some(std::mem::replace(a, *a + l))).collect();
    let mut upd_y = vec![bf16::ZERO; tokens * shape.width()];
    for t in 0..*lens.iter().max().unwrap() {
        let live: Vec<usize> = (0..nseq).filter(|&s| lens[s] > t).collect();
        let rows: Vec<usize> = live.iter().map(|&s| starts[s] + t).collect();
        let gather = |f: fn(&Problem, usize) -> &[bf16]| {
            gpu.upload(&rows.iter().flat_map(|&r| f(&prob, r).to_vec()).collect::<Vec<_>>()).unwrap()
        };
        let (x, dt, b, c) = (gather(Problem::x), gather(Problem::dt), gather(Problem::b), gather(Problem::c));
        let gn = shape.groups * shape.state_size;
        let n = live.len();
        let inputs = SsmInputs {
            x: Rows::new(&x, n, shape.width()),
            dt: Rows::new(&dt, n, shape.heads),
            b: Rows::new(&b, n, gn),
            c: Rows::new(&c, n, gn),
        };
        let step_slots = Slots::new(&gpu, &live.iter().map(|&s| slots[s]).collect::<Vec<_>>(), num_slots).unwrap();
        let mut y = gpu.zeros::<bf16>(live.len() * shape.width()).unwrap();
        let cache = SsmCache { state: &mut upd_state, slots: &step_slots, dst: None };
        ssm_update(&gpu, shape, inputs, None, dev.heads(true), cache, &mut y).unwrap();
        let y = gpu.download(&y).unwrap();
        for (i, &r) in rows.iter().enumerate() {
            upd_y[r * shape.width()..][..shape.width()].copy_from_slice(&y[i * shape.width()..][..shape.width()]);
        }
    }
    // Two bf16 roundings of nearby values, plus the chunked form's error (M from the
    // recurrence; the update kernel's own error is f32's).
    let starts: Vec<Option<Vec<f64>>> = (0..nseq)
        .map(|s| has_initial[s].then(|| init[slots[s] as usize * sl..][..sl].iter().map(|&v| f64::from(v)).collect()))
        .collect();
    let (_, mag, finals) = recurrence(&prob, lens, &starts);
    let mut state_mag = vec![0.0; init.len()];
    for (s, (_, fin_mag)) in finals.into_iter().enumerate() {
        state_mag[slots[s] as usize * sl..][..sl].copy_from_slice(&fin_mag);
    }
    let n = assert_y("scan vs update y", &to_f64(&gpu.download(&scan_y).unwrap()), &to_f64(&upd_y), &mag, 2.0);
    let f = |v: Vec<f32>| v.into_iter().map(f64::from).collect::<Vec<_>>();
    let m = assert_band(
        "scan vs update final states",
        &f(gpu.download(&scan_state).unwrap()),
        &f(gpu.download(&upd_state).unwrap()),
        &state_mag,
        (1e-5, 1e-4, 1.0 / 256.0),
    );
    println!("scan vs update kernel: {} values compared", n + m);
}

/// What [`head_recurrence`] computes.
#[derive(Clone, Copy, PartialEq)]
enum Run {
    /// The recurrence.
    Exact,
    /// The chunk boundaries off by one: a token at a multiple of SSD_CHUNK carries the state
    /// over without its decay, the kind of slip the chunked form could make.
    Defect,
    /// Over |x|, |B|, |C|, |s0| without D: the magnitude M of the terms behind each output.
    Magnitude,
}

/// Head h's outputs over one sequence from state `s0`, the recurrence in f64 written out here:
/// `S = exp(delta A) S + delta x B^T`, `y = S C + D x`.
fn head_recurrence(prob: &Problem, h: usize, s0: &[f64], tokens: usize, run: Run) -> Vec<f64> {
    let shape = prob.shape;
    let (hd, n) = (shape.head_dim, shape.state_size);
    let g = h / (shape.heads / shape.groups);
    let m = run == Run::Magnitude;
    let f = |v: bf16| if m { f64::from(v.to_f32()).abs() } else { f64::from(v.to_f32()) };
    let mut s: Vec<f64> = s0.iter().map(|v| if m { v.abs() } else { *v }).collect();
    let d = if m { 0.0 } else { f64::from(prob.d[h]) };
    let mut y = Vec::with_capacity(tokens * hd);
    for t in 0..tokens {
        let z = f64::from(prob.dt(t)[h].to_f32()) + f64::from(prob.dt_bias[h]);
        let delta = if z > 20.0 { z } else { z.exp().ln_1p() };
        let boundary = run == Run::Defect && t > 0 && t % 128 == 0;
        let decay = if boundary { 1.0 } else { (delta * f64::from(prob.a[h])).exp() };
        let (x, b, c) = (&prob.x(t)[h * hd..][..hd], &prob.b(t)[g * n..][..n], &prob.c(t)[g * n..][..n]);
        for p in 0..hd {
            let row = &mut s[p * n..][..n];
            let mut acc = d * f(x[p]);
            for i in 0..n {
                row[i] = row[i] * decay + delta * f(x[p]) * f(b[i]);
                acc += row[i] * f(c[i]);
            }
            y.push(acc);
        }
    }
    y
}

/// Production geometry (64 heads of 64 x 128, 8 groups) at 16384 tokens, one sequence from an
/// initial state: y of four heads (groups 0, 1, 4, 7) against the f64 recurrence. Prints the
/// noise (worst error in units of assert_y's band) and the separation of a planted defect (the reference with its chunk boundaries off by one, in the same units);
/// asserts noise <= 1 < separation / 2.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_ssd_16k_tokens_sampled_heads_against_recurrence() {
    let gpu = gpu();
    let mut rng = Rng::new(44);
    let shape = nemotron();
    let tokens = 16384;
    let prob = Problem::new(&mut rng, shape, tokens);
    let dev = prob.upload(&gpu);
    let init: Vec<f32> = random_states(&mut rng, &shape, 1).into_iter().map(|v| v as f32).collect();
    let mut state = gpu.upload(&init).unwrap();
    let seqs = Prefill::new(&gpu, &[tokens], &[0], &[true], 1).unwrap();
    let mut plan = SsdPlan::new(&gpu, &seqs, shape).unwrap();
    let mut y = gpu.upload(&vec![POISON_BF16; tokens * shape.width()]).unwrap();
    ssd_scan(&gpu, shape, (dev.inputs_at(0, tokens), dev.heads(true)), (&mut state, &seqs), &mut plan, &mut y).unwrap();
    let got = to_f64(&gpu.download(&y).unwrap());
    let hn = shape.head_dim * shape.state_size;
    // The band of assert_y.
    let band = |g: f64, w: f64, m: f64| (g - w).abs() / (ATOL + RTOL * w.abs() + m / 128.0);
    let (mut noise, mut separation, mut compared) = (0.0f64, f64::INFINITY, 0usize);
    for h in [0, 9, 37, 63] {
        let s0: Vec<f64> = init[h * hn..][..hn].iter().map(|&v| f64::from(v)).collect();
        let want = head_recurrence(&prob, h, &s0, tokens, Run::Exact);
        let bad = head_recurrence(&prob, h, &s0, tokens, Run::Defect);
        let mag = head_recurrence(&prob, h, &s0, tokens, Run::Magnitude);
        let hd = shape.head_dim;
        let (mut head_noise, mut head_sep) = (0.0f64, 0.0f64);
        for t in 0..tokens {
            for p in 0..hd {
                let (g, w, m) = (got[t * shape.width() + h * hd + p], want[t * hd + p], mag[t * hd + p]);
                assert!(g.is_finite(), "head {h} token {t} channel {p}: {g}");
                head_noise = head_noise.max(band(g, w, m));
                head_sep = head_sep.max(band(bad[t * hd + p], w, m));
                compared += 1;
            }
        }
        println!("ssd 16384 tokens head {h}: noise {head_noise:.3} of the band, planted defect {head_sep:.1}");
        noise = noise.max(head_noise);
        separation = separation.min(head_sep);
    }
    println!("ssd 16384 tokens: {compared} values compared, noise {noise:.3}, defect separation {separation:.1}");
    assert_eq!(compared, 4 * tokens * shape.head_dim);
    assert!(noise <= 1.0, "noise {noise} beyond the band");
    assert!(separation > 2.0, "a boundary defect would hide in the band ({separation})");
}
