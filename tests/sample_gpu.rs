//! Token sampling on the GPU (`#[ignore]`d: needs a GPU): the kernel against the CPU
//! (tests/sample.rs checks the CPU against the reference) at Nano's vocabulary and at edge
//! sizes up to `SAMPLE_MAX_VOCAB` (rows padded with NaN past the vocabulary), the special rows,
//! batch independence, the launcher's refusals and a chi-square smoke test.

mod common;

use common::sampling::*;
use half::bf16;
use std::collections::BTreeMap;

use host::sample::{RowSampling, SampleRows, read_out, sample, sample_out};
use host::{Gpu, Rows};
use kernels_gpu::sample::{SAMPLE_MAX_VOCAB, SAMPLE_OUT_WORDS, SampleOut, SampleRow};
use nemotron_rs::{Rng, gpu};

// ---------------------------------------------------------------------------------------------
// The GPU kernel.

/// Samples `cases` (one vocabulary) on the GPU, rows `stride` apart with NaN past the
/// vocabulary, once per offset of `launches` (each row at its counter plus the offset, the rows
/// rewritten in place between launches); returns each launch's outputs.
fn gpu_run(gpu: &Gpu, cases: &[Case], stride: usize, launches: &[u64]) -> Vec<Vec<SampleOut>> {
    let vocab = cases[0].logits.len();
    let mut logits = vec![bf16::NAN; cases.len() * stride];
    for (r, c) in cases.iter().enumerate() {
        assert_eq!(c.logits.len(), vocab, "{}: one vocabulary a launch", c.label);
        for (j, &v) in c.logits.iter().enumerate() {
            let b = bf16::from_f32(v);
            assert!(v.is_nan() || b.to_f32().to_bits() == v.to_bits(), "{}: logit {j} ({v}) is no bf16", c.label);
            logits[r * stride + j] = b;
        }
    }
    let logits = gpu.upload(&logits).unwrap();
    let rows_at = |offset: u64| -> Vec<RowSampling> {
        cases
            .iter()
            .map(|c| RowSampling {
                row: c.at(c.row.counter.wrapping_add(offset)),
                penalties: &c.penalties,
                mask: c.mask.as_deref(),
            })
            .collect()
    };
    let capacity = cases.iter().map(|c| c.penalties.len()).sum();
    let mut rows = SampleRows::new(gpu, &rows_at(launches[0]), vocab, capacity).unwrap();
    launches
        .iter()
        .map(|&offset| {
            rows.set(gpu, &rows_at(offset)).unwrap();
            // Poisoned: every field of every row must be written.
            let mut out = gpu.upload(&vec![0xDEAD_BEEFu32; cases.len() * SAMPLE_OUT_WORDS as usize]).unwrap();
            sample(gpu, Rows::strided(&logits, cases.len(), vocab, stride), &rows, &mut out).unwrap();
            read_out(&gpu.download(&out).unwrap())
        })
        .collect()
}

/// Compares the GPU's outputs `got` for `cases` at counter offset `offset` with `sample_row`'s:
/// token, status, kept count and the top tokens' ids exactly, the log-probabilities within
/// 1e-3. Returns the rows compared.
fn compare_with_cpu(cases: &[Case], offset: u64, got: &[SampleOut]) -> usize {
    assert_eq!(got.len(), cases.len());
    let bad: Vec<String> = cases
        .iter()
        .zip(got)
        .filter_map(|(c, g)| {
            let want = c.cpu(c.row.counter.wrapping_add(offset));
            let ids = |o: &SampleOut| o.top().iter().map(|e| e.0).collect::<Vec<_>>();
            let close = |a: f32, b: f32| (a - b).abs() <= 1e-3 || a == b;
            let same = (g.token, g.status, g.kept, ids(g)) == (want.token, want.status, want.kept, ids(&want))
                && close(g.logprob, want.logprob)
                && g.top().iter().zip(want.top()).all(|(a, b)| close(a.1, b.1));
            (!same).then(|| {
                format!("{} (counter {}): GPU {g:?}, CPU {want:?}", c.label, c.row.counter.wrapping_add(offset))
            })
        })
        .collect();
    assert!(bad.is_empty(), "{} of {} rows differ:\n{}", bad.len(), cases.len(), bad.join("\n"));
    cases.len()
}

/// Runs `cases` on the GPU at each of `launches` and compares every row with the CPU; returns
/// the rows compared.
fn gpu_check(gpu: &Gpu, cases: &[Case], stride: usize, launches: &[u64]) -> usize {
    let outs = gpu_run(gpu, cases, stride, launches);
    launches.iter().zip(&outs).map(|(&offset, got)| compare_with_cpu(cases, offset, got)).sum()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_matches_cpu_at_nano_vocab() {
    let gpu = gpu();
    let mut rng = Rng::new(51);
    let cases = mixed_cases(&mut rng, NANO_VOCAB, 64);
    let launches = [0, 1, 2, 1 << 33];
    let compared = gpu_check(&gpu, &cases, NANO_VOCAB, &launches);
    println!(
        "GPU vs CPU, vocab {NANO_VOCAB}: {compared} rows compared (token, status, kept, top ids; logprobs within 1e-3)"
    );
    assert_eq!(compared, 64 * launches.len());
}

/// Every setting once at a small vocabulary, one launch: the GPU test compute-sanitizer runs
/// (racecheck instruments every shared-memory access; the large suites take minutes there).
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_small_rows_for_the_sanitizers() {
    let gpu = gpu();
    let mut rng = Rng::new(61);
    let cases = mixed_cases(&mut rng, 4099, 25);
    let compared = gpu_check(&gpu, &cases, 4099, &[3]);
    println!("GPU vs CPU, vocab 4099: {compared} rows compared");
    assert_eq!(compared, 25);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_matches_cpu_at_edge_vocabs_and_padded_rows() {
    let gpu = gpu();
    let mut rng = Rng::new(52);
    let (mut compared, mut expected) = (0, 0);
    for vocab in [1, 7, 8, 9, 1000, SAMPLE_MAX_VOCAB as usize] {
        let n = if vocab <= 1000 { 115 } else { 64 };
        let cases = mixed_cases(&mut rng, vocab, n);
        // An odd stride: rows at unaligned offsets, NaN between them.
        for stride in [vocab, vocab + 13] {
            compared += gpu_check(&gpu, &cases, stride, &[0, 77]);
            expected += 2 * n;
        }
    }
    println!("GPU vs CPU, edge vocabularies and strides: {compared} rows compared");
    assert_eq!(compared, expected);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_special_rows_match_cpu() {
    let gpu = gpu();
    let mut by_vocab: BTreeMap<usize, Vec<Case>> = BTreeMap::new();
    let cases = special_cases().into_iter().map(|e| e.0).chain(boundary_cases().into_iter().map(|e| e.0));
    for c in cases {
        by_vocab.entry(c.logits.len()).or_default().push(c);
    }
    let (mut compared, mut expected) = (0, 0);
    for cases in by_vocab.values() {
        let launches: Vec<u64> = (0..8).map(|i| i * 1000 + 3).collect();
        compared += gpu_check(&gpu, cases, cases[0].logits.len() + 3, &launches);
        expected += cases.len() * launches.len();
    }
    println!("GPU vs CPU, special values and boundaries: {compared} rows compared");
    assert_eq!(compared, expected);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_rows_do_not_depend_on_the_batch() {
    let gpu = gpu();
    let mut rng = Rng::new(53);
    let mixed = mixed_cases(&mut rng, NANO_VOCAB, 64);
    // Probes: rows of different settings (penalized ones among them), each alone and at
    // positions 0, 21, 42, 63 of a batch, then the reverse.
    let probes: Vec<Case> =
        ["T 1", "top-p 0.3", "penalties, T 1, top 3 logprobs", "boosting penalties, top-k 20, top-p 0.8"]
            .iter()
            .map(|what| mixed.iter().find(|c| c.label.ends_with(&format!(", {what}"))).unwrap().clone())
            .collect();
    let alone: Vec<SampleOut> =
        probes.iter().map(|p| gpu_run(&gpu, std::slice::from_ref(p), NANO_VOCAB, &[0])[0][0]).collect();
    let mut compared = 0;
    for positions in [[0, 21, 42, 63], [63, 42, 21, 0]] {
        let mut batch = mixed.clone();
        for (p, &at) in probes.iter().zip(&positions) {
            batch[at] = p.clone();
        }
        let got = &gpu_run(&gpu, &batch, NANO_VOCAB, &[0])[0];
        compare_with_cpu(&batch, 0, got);
        for ((p, &at), want) in probes.iter().zip(&positions).zip(&alone) {
            assert_eq!(got[at], *want, "{} at row {at} of 64 vs alone", p.label);
            compared += 1;
        }
    }
    println!("batch independence: {compared} probe rows identical alone and in a batch of 64");
    assert_eq!(compared, 2 * probes.len());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_chi_square_smoke() {
    let gpu = gpu();
    let x = chi_logits();
    let n = 4096;
    let rows = |label: &str, row: SampleRow| -> Vec<Case> {
        (0..n).map(|c| Case::new(label, &x, SampleRow { counter: c, ..row })).collect()
    };
    let (t, k) = (0.7, 5);
    let mut cases = rows("T 1", SampleRow { temperature: 1.0, seed: 61, ..GREEDY });
    cases.extend(rows("T 0.7, top-k 5", SampleRow { temperature: t, top_k: k as u32, seed: 62, ..GREEDY }));
    let got = &gpu_run(&gpu, &cases, x.len(), &[0])[0];
    let compared = compare_with_cpu(&cases, 0, got);
    let all = vec![true; x.len()];
    assert_fits("GPU, T 1", &tally(got[..n as usize].iter().copied(), x.len()), &softmax(&x, 1.0, &all), &[]);
    let want = softmax(&x, f64::from(t), &top_k_mask(&x, k));
    assert_fits("GPU, T 0.7, top-k 5", &tally(got[n as usize..].iter().copied(), x.len()), &want, &[]);
    println!("GPU chi-square smoke: {compared} rows, identical to the CPU");
    assert_eq!(compared, 2 * n as usize);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_launcher_refuses_bad_arguments() {
    let gpu = gpu();
    let names = |r: Result<(), host::Error>, arg: &str| {
        let e = r.expect_err(&format!("{arg}: accepted")).to_string();
        assert!(e.contains(arg), "the error names {arg}: {e}");
        println!("refused: {e}");
    };
    let t1 = SampleRow { temperature: 1.0, seed: 71, ..GREEDY };
    let two = [
        RowSampling { row: t1, penalties: &[(1, 1)], mask: None },
        RowSampling { row: t1, penalties: &[(2, 1)], mask: None },
    ];
    let max = SAMPLE_MAX_VOCAB as usize;
    names(SampleRows::new(&gpu, &two, 0, 2).map(drop), "`vocab`");
    names(SampleRows::new(&gpu, &two, max + 1, 2).map(drop), "`vocab`");
    names(SampleRows::new(&gpu, &[], 8, 2).map(drop), "`rows`");
    names(
        SampleRows::new(&gpu, &[RowSampling { row: SampleRow { top_p: 0.0, ..t1 }, penalties: &[], mask: None }], 8, 0)
            .map(drop),
        "`top_p`",
    );
    names(SampleRows::new(&gpu, &two, 8, 1).map(drop), "`penalties`");
    SampleRows::new(&gpu, &two, max, 2).expect("the largest vocabulary");

    let vocab = 8;
    let mut rows = SampleRows::new(&gpu, &two, vocab, 2).unwrap();
    let logits = gpu.upload(&vec![bf16::from_f32(0.5); 2 * vocab]).unwrap();
    let mut out = sample_out(&gpu, 2).unwrap();
    let two_rows = Rows::new(&logits, 2, vocab);
    sample(&gpu, two_rows, &rows, &mut out).unwrap();
    let before = read_out(&gpu.download(&out).unwrap());
    // Refused rewrites leave the rows as they were.
    names(rows.set(&gpu, &two[..1]), "1 sampling rows given for 2");
    let three = [RowSampling { row: t1, penalties: &[(1, 1), (3, 2)], mask: None }, two[1]];
    names(rows.set(&gpu, &three), "`penalties`");
    names(
        rows.set(&gpu, &[two[0], RowSampling { row: t1, penalties: &[(vocab as u32, 1)], mask: None }]),
        "`penalties`",
    );
    names(
        rows.set(&gpu, &[two[0], RowSampling { row: SampleRow { min_p: 2.0, ..t1 }, penalties: &[], mask: None }]),
        "`min_p`",
    );
    sample(&gpu, two_rows, &rows, &mut out).unwrap();
    assert_eq!(read_out(&gpu.download(&out).unwrap()), before, "the rows after refused rewrites");
    // The launch itself.
    names(sample(&gpu, Rows { stride: vocab - 1, ..two_rows }, &rows, &mut out), "`logits`: expected a row stride");
    names(sample(&gpu, Rows { stride: vocab + 1, ..two_rows }, &rows, &mut out), "`logits`");
    names(sample(&gpu, Rows { rows: 1, ..two_rows }, &rows, &mut out), "`logits`: expected 2 rows");
    let mut short = sample_out(&gpu, 1).unwrap();
    names(sample(&gpu, two_rows, &rows, &mut short), "`out`");
    println!("launcher: refusals name their argument; the rows survive refused rewrites");
}
