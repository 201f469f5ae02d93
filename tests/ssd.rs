//! Chunked scan: the kernels against the sequential f64 recurrence, and against the state
//! update kernel run token by token, on the GPU (`#[ignore]`d); the chunk table in CI.

mod common;

use common::{Problem, TestState, random_states};
use half::bf16;
use host::batch::{Prefill, Slots};
use host::ssd::{SsdPlan, chunk_table, ssd_scan};
use host::ssm::{Rows, SsmInputs, SsmShape, ssm_update};
use kernels_gpu::ssd::SsdChunk;
use nemotron_rs::{POISON_BF16, Rng, assert_close, assert_same, gpu, to_f64};

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
    let mut plan = SsdPlan::new(gpu, &seqs, shape.heads, shape.head_dim, shape.state_size).unwrap();
    let mut y = gpu.upload(&vec![POISON_BF16; tokens * shape.width()]).unwrap();
    ssd_scan(gpu, shape, dev.inputs_at(0), dev.heads(true), &mut state, &seqs, &mut plan, &mut y).unwrap();

    let reference = prob.reference(true);
    let sl = shape.slot_len();
    let mut want_state: Vec<f64> = init.iter().map(|v| v.to_f64()).collect();
    let mut written = vec![false; num_slots];
    let mut want_y = Vec::new();
    let mut start = 0;
    for (s, &len) in lens.iter().enumerate() {
        let mut st = if has_initial[s] { want_state[slots[s] as usize * sl..][..sl].to_vec() } else { vec![0.0; sl] };
        let rows = |f: fn(&Problem, usize) -> &[bf16]| (start..start + len).map(|r| f(&prob, r)).collect::<Vec<_>>();
        let ys = reference.scan(&mut st, &rows(Problem::x), &rows(Problem::dt), &rows(Problem::b), &rows(Problem::c));
        want_y.extend(ys.into_iter().flatten());
        if slots[s] >= 0 {
            want_state[slots[s] as usize * sl..][..sl].copy_from_slice(&st);
            written[slots[s] as usize] = true;
        }
        start += len;
    }
    let label = format!(
        "{} state, {:?}, lens {lens:?}",
        T::NAME,
        (shape.heads, shape.head_dim, shape.groups, shape.state_size)
    );
    let mut n = assert_close(&format!("{label} y"), &to_f64(&gpu.download(&y).unwrap()), &want_y, ATOL, RTOL);
    let got: Vec<T> = gpu.download(&state).unwrap();
    for s in 0..num_slots {
        if written[s] {
            let g: Vec<f64> = got[s * sl..][..sl].iter().map(|v| v.to_f64()).collect();
            n += assert_close(
                &format!("{label} final state slot {s}"),
                &g,
                &want_state[s * sl..][..sl],
                1e-5,
                T::RTOL + 1e-4,
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

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_ssd_bf16_state_matches_recurrence() {
    let gpu = gpu();
    let mut rng = Rng::new(42);
    let n = check_scan::<bf16>(&gpu, &mut rng, nemotron(), &[129, 1, 300], None);
    println!("ssd_scan bf16 state: {n} values compared");
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
    let mut plan = SsdPlan::new(&gpu, &seqs, shape.heads, shape.head_dim, shape.state_size).unwrap();
    let mut scan_y = gpu.zeros::<bf16>(tokens * shape.width()).unwrap();
    ssd_scan(&gpu, shape, dev.inputs_at(0), dev.heads(true), &mut scan_state, &seqs, &mut plan, &mut scan_y).unwrap();

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
        let inputs = SsmInputs {
            x: Rows::contiguous(&x, shape.width()),
            dt: Rows::contiguous(&dt, shape.heads),
            b: Rows::contiguous(&b, gn),
            c: Rows::contiguous(&c, gn),
        };
        let step_slots = Slots::new(&gpu, &live.iter().map(|&s| slots[s]).collect::<Vec<_>>(), num_slots).unwrap();
        let mut y = gpu.zeros::<bf16>(live.len() * shape.width()).unwrap();
        ssm_update(&gpu, shape, inputs, None, dev.heads(true), &mut upd_state, &step_slots, None, &mut y).unwrap();
        let y = gpu.download(&y).unwrap();
        for (i, &r) in rows.iter().enumerate() {
            upd_y[r * shape.width()..][..shape.width()].copy_from_slice(&y[i * shape.width()..][..shape.width()]);
        }
    }
    // Two bf16 roundings of nearby values: one ulp apart at most, plus the chunked form's error.
    let n =
        assert_close("scan vs update y", &to_f64(&gpu.download(&scan_y).unwrap()), &to_f64(&upd_y), ATOL, 2.0 * RTOL);
    let f = |v: Vec<f32>| v.into_iter().map(f64::from).collect::<Vec<_>>();
    let m = assert_close(
        "scan vs update final states",
        &f(gpu.download(&scan_state).unwrap()),
        &f(gpu.download(&upd_state).unwrap()),
        1e-5,
        1e-4,
    );
    println!("scan vs update kernel: {} values compared", n + m);
}
