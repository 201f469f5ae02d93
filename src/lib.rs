//! Test and bench support shared by the integration suites (`tests/`) and the benches
//! (`benches/`): seeded random data, FP8 weights and their W8A8 reference, NVFP4 weights, and
//! comparisons that report what they compared.

use half::bf16;
use host::cpu::quant::{E4M3_MAX, MIN_SCALE, e4m3_decode, e4m3_encode};

/// A small seeded generator (SplitMix64): the same seed gives the same data on every machine.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [lo, hi).
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64)
    }

    /// `n` bf16 values uniform in [lo, hi).
    pub fn bf16s(&mut self, n: usize, lo: f64, hi: f64) -> Vec<bf16> {
        (0..n).map(|_| bf16::from_f64(self.uniform(lo, hi))).collect()
    }

    /// `rows` rows of `width` bf16, row r uniform in +-(1 - (r % 5) / 10): rows whose max |x|
    /// differ, so their per-row FP8 scales do (uniform rows in +-1 all have max |x| near 1).
    pub fn bf16_rows(&mut self, rows: usize, width: usize) -> Vec<bf16> {
        (0..rows)
            .flat_map(|r| {
                let m = 1.0 - (r % 5) as f64 / 10.0;
                self.bf16s(width, -m, m)
            })
            .collect()
    }

    /// Routing choices of `rows` tokens: `k` distinct experts of `e` each, uniformly.
    pub fn choices(&mut self, rows: usize, k: usize, e: usize) -> Vec<i32> {
        let mut idx = Vec::with_capacity(rows * k);
        for _ in 0..rows {
            let mut row: Vec<i32> = Vec::with_capacity(k);
            while row.len() < k {
                let x = (self.next_u64() % e as u64) as i32;
                if !row.contains(&x) {
                    row.push(x);
                }
            }
            idx.extend(row);
        }
        idx
    }
}

/// Checks `|got - want| <= atol + rtol * |want|` element-wise and returns the number of
/// elements compared. Panics with the worst element (index, both values, error), the count
/// and the NaN/Inf counts when any element fails, when a NaN or Inf appears in either side,
/// when the lengths differ, or when nothing was compared.
pub fn assert_close(label: &str, got: &[f64], want: &[f64], atol: f64, rtol: f64) -> usize {
    assert_eq!(got.len(), want.len(), "{label}: length mismatch");
    assert!(!got.is_empty(), "{label}: nothing compared");
    let non_finite = |v: &[f64]| v.iter().filter(|x| !x.is_finite()).count();
    let (bad_got, bad_want) = (non_finite(got), non_finite(want));
    let mut worst = (0usize, f64::NEG_INFINITY);
    let mut failures = 0usize;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let excess = (g - w).abs() - (atol + rtol * w.abs());
        if excess > 0.0 || excess.is_nan() {
            failures += 1;
        }
        if excess > worst.1 || (excess.is_nan() && !worst.1.is_nan()) {
            worst = (i, excess);
        }
    }
    let i = worst.0;
    let report = format!(
        "{label}: {} compared, {failures} outside atol {atol:e} + rtol {rtol:e}, non-finite got {bad_got} want {bad_want}; \
         worst at {i}: got {} want {} (|diff| {:e})",
        got.len(),
        got[i],
        want[i],
        (got[i] - want[i]).abs()
    );
    assert!(failures == 0 && bad_got == 0 && bad_want == 0, "{report}");
    println!("{report}");
    got.len()
}

/// Checks `|got - want| <= atol + rtol |want| + per_mag M` element-wise, M a magnitude per
/// element that a kernel's roundings scale with (`mag`); prints the worst error in units of the
/// band and returns the count.
pub fn assert_band(
    label: &str,
    got: &[f64],
    want: &[f64],
    mag: &[f64],
    (atol, rtol, per_mag): (f64, f64, f64),
) -> usize {
    assert_eq!((got.len(), want.len()), (mag.len(), mag.len()), "{label}: lengths");
    assert!(!got.is_empty(), "{label}: nothing compared");
    let mut worst = (0usize, 0.0f64);
    for i in 0..got.len() {
        let band = atol + rtol * want[i].abs() + per_mag * mag[i];
        let r = (got[i] - want[i]).abs() / band;
        assert!(r.is_finite(), "{label}: element {i} got {} want {}", got[i], want[i]);
        if r > worst.1 {
            worst = (i, r);
        }
    }
    let i = worst.0;
    let report = format!(
        "{label}: {} compared, worst {:.3} of the band at {i}: got {} want {} (M {:.3})",
        got.len(),
        worst.1,
        got[i],
        want[i],
        mag[i]
    );
    assert!(worst.1 <= 1.0, "{report}");
    println!("{report}");
    got.len()
}

/// Checks two code buffers are identical; returns the count compared. Panics with the first
/// mismatch and the number of mismatches.
pub fn assert_same<T: PartialEq + std::fmt::Debug>(label: &str, got: &[T], want: &[T]) -> usize {
    assert_eq!(got.len(), want.len(), "{label}: length mismatch");
    assert!(!got.is_empty(), "{label}: nothing compared");
    let mismatches: Vec<usize> = (0..got.len()).filter(|&i| got[i] != want[i]).collect();
    if let Some(&i) = mismatches.first() {
        panic!(
            "{label}: {} of {} differ; first at {i}: got {:?} want {:?}",
            mismatches.len(),
            got.len(),
            got[i],
            want[i]
        );
    }
    println!("{label}: {} compared, all identical", got.len());
    got.len()
}

/// bf16 values as f64 (for [`assert_close`]).
pub fn to_f64(v: &[bf16]) -> Vec<f64> {
    v.iter().map(|x| x.to_f64()).collect()
}

/// The GPU for `#[ignore = "needs a CUDA GPU"]` tests; panics with the reason when there is none.
pub fn gpu() -> host::Gpu {
    match host::Gpu::new(0) {
        Ok(g) => {
            println!("GPU: {} ({})", g.name().unwrap_or_default(), g.arch().name());
            g
        }
        Err(e) => panic!("this test needs a CUDA GPU: {e}"),
    }
}

/// FP8 weights `[count, n, k]` (matrix i uniform in +-(1 + (i % 4) / 4) sqrt(3 / k), e4m3
/// with one scale per matrix): codes, scales, and the decoded code values. The matrices'
/// ranges differ so their scales do (a kernel reading another matrix's scale fails a test;
/// with one range, every scale is the same max |w| / 448 to about seven digits).
pub fn fp8_weights(rng: &mut Rng, count: usize, n: usize, k: usize) -> (Vec<u8>, Vec<f32>, Vec<f64>) {
    let (mut codes, mut scales, mut values) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..count {
        let a = (1.0 + (i % 4) as f64 / 4.0) * (3.0 / k as f64).sqrt();
        let w: Vec<f32> = (0..n * k).map(|_| rng.uniform(-a, a) as f32).collect();
        let s = w.iter().fold(0.0f32, |m, v| m.max(v.abs())) / E4M3_MAX;
        let c: Vec<u8> = w.iter().map(|&v| e4m3_encode(v / s)).collect();
        values.extend(c.iter().map(|&c| f64::from(e4m3_decode(c))));
        codes.extend(c);
        scales.push(s);
    }
    (codes, scales, values)
}

/// W8A8 as docs/MATH.md defines it: `x` quantized with `in_scale` (or its per-token scale), the
/// code values of the rows of `w` multiplied in f64 and scaled by both scales.
pub fn w8a8(x: &[f64], w: &[f64], w_scale: f32, in_scale: Option<f32>) -> Vec<f64> {
    let s = in_scale.unwrap_or_else(|| {
        let amax = x.iter().fold(0.0f64, |m, v| m.max(v.abs())) as f32;
        (amax / E4M3_MAX).max(MIN_SCALE)
    });
    let xq: Vec<f64> = x.iter().map(|&v| f64::from(e4m3_decode(e4m3_encode(v as f32 / s)))).collect();
    w.chunks(x.len()).map(|row| row.iter().zip(&xq).map(|(a, b)| a * b).sum::<f64>() * f64::from(w_scale * s)).collect()
}

/// NVFP4 weights `[count, n, k]` (matrix i uniform in +-(1 + (i % 4) / 4) sqrt(3 / k), so the
/// per-tensor scales differ, each quantized by `host::cpu::nvfp4::quantize`): the device's rows
/// (`host::nvfp4::pack_rows` of each), the per-tensor scales, and the weights' exact values.
pub fn nvfp4_weights(rng: &mut Rng, count: usize, n: usize, k: usize) -> (Vec<u8>, Vec<f32>, Vec<f64>) {
    let (mut rows, mut globals, mut values) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..count {
        let a = (1.0 + (i % 4) as f64 / 4.0) * (3.0 / k as f64).sqrt();
        let w: Vec<f32> = (0..n * k).map(|_| rng.uniform(-a, a) as f32).collect();
        let q = host::cpu::nvfp4::quantize(&w, n, k);
        rows.extend(host::nvfp4::pack_rows(&q.packed, &q.block, n, k).expect("packing NVFP4 rows"));
        values.extend(host::cpu::nvfp4::dequantize(&q.packed, &q.block, q.global, k));
        globals.push(q.global);
    }
    (rows, globals, values)
}

/// A bf16 NaN, to poison output buffers before a kernel writes them.
pub const POISON_BF16: bf16 = bf16::NAN;
/// An FP8 code no kernel writes for finite inputs (0x7f is e4m3 NaN), to poison code buffers.
pub const POISON_FP8: u8 = 0x7f;

/// What every bench prints beside its time: the device and its measured copy bandwidth.
pub struct BenchGpu {
    /// Shared, so a backend can run on the same context and stream.
    pub gpu: std::sync::Arc<host::Gpu>,
    /// Device-to-device copy, bytes read + written per second, measured in this run.
    pub copy_bytes_per_s: f64,
}

/// Bytes rotated through in cold-L2 runs: over twice the H200's 50 MB (60 MB reported) L2.
pub const COLD_BYTES: usize = 256 << 20;

impl BenchGpu {
    /// Opens the GPU and measures the copy ceiling (median of 20 copies of 1 GiB); `None`, with
    /// a message, where there is no GPU.
    pub fn open() -> Option<BenchGpu> {
        let gpu = match host::Gpu::new(0) {
            Ok(g) => g,
            Err(e) => {
                eprintln!("no GPU benches: {e}");
                return None;
            }
        };
        let n = 1 << 30;
        let src = gpu.zeros::<u8>(n).expect("allocating the copy source");
        let mut dst = gpu.zeros::<u8>(n).expect("allocating the copy destination");
        let mut times: Vec<f32> =
            (0..21).map(|_| gpu.time_ms(|| gpu.copy(&src, &mut dst)).expect("timing a copy")).collect();
        times.sort_by(f32::total_cmp);
        let copy_bytes_per_s = 2.0 * n as f64 / (times[10] as f64 * 1e-3);
        println!(
            "GPU {} ({}); device-to-device copy of 1 GiB: {:.0} GB/s (read + written, median of 21)",
            gpu.name().unwrap_or_default(),
            gpu.arch().name(),
            copy_bytes_per_s / 1e9
        );
        Some(BenchGpu { gpu: std::sync::Arc::new(gpu), copy_bytes_per_s })
    }

    /// `f` timed with events around each of 12 calls, the first dropped (for work that a
    /// graph of many launches cannot hold, e.g. temporaries larger than the capture arena, or
    /// a host synchronization): (median, p10, p90) of the other 11, in microseconds.
    pub fn calls_us(&self, mut f: impl FnMut() -> host::Result<()>) -> (f64, f64, f64) {
        let mut t: Vec<f32> = (0..12).map(|_| self.gpu.time_ms(&mut f).expect("timing a call")).skip(1).collect();
        t.sort_by(f32::total_cmp);
        let us = |v: f32| f64::from(v) * 1e3;
        (us(t[5]), us(t[1]), us(t[9]))
    }

    /// Whether the shape `name` is selected by the bench's filter argument (criterion's
    /// positional filter, e.g. `cargo bench --bench norm -- gated/bf16/64x`); all without one.
    pub fn selected(name: &str) -> bool {
        std::env::args().skip(1).find(|a| !a.starts_with('-')).is_none_or(|f| name.contains(&f))
    }

    /// Buffer sets to rotate through so one pass touches at least [`COLD_BYTES`].
    pub fn cold_sets(bytes_per_call: usize) -> usize {
        COLD_BYTES.div_ceil(bytes_per_call.max(1)).clamp(1, 256)
    }

    /// Captures `launch(set)` into two graphs: warm (set 0, again and again) and cold
    /// (rotating over `sets` buffer sets, at least [`COLD_BYTES`] together).
    pub fn capture(&self, sets: usize, mut launch: impl FnMut(usize) -> host::Result<()>) -> Timed<'_> {
        let n_warm = 64;
        let n_cold = sets * 64usize.div_ceil(sets);
        let warm = self.gpu.capture(|| (0..n_warm).try_for_each(|_| launch(0))).expect("capturing the warm graph");
        let cold =
            self.gpu.capture(|| (0..n_cold).try_for_each(|i| launch(i % sets))).expect("capturing the cold graph");
        Timed { bench: self, warm: (warm, n_warm), cold: (cold, n_cold) }
    }
}

/// A launch captured as warm and cold CUDA graphs (see [`BenchGpu::capture`]). Times are per
/// launch: a graph replay of n launches, timed with CUDA events, divided by n.
pub struct Timed<'a> {
    bench: &'a BenchGpu,
    warm: (host::Graph, usize),
    cold: (host::Graph, usize),
}

impl Timed<'_> {
    /// Median, 10th and 90th percentile of 31 timed replays (after 3 untimed), microseconds per launch.
    fn per_launch_us(&self, (graph, n): &(host::Graph, usize)) -> (f64, f64, f64) {
        let gpu = &self.bench.gpu;
        for _ in 0..3 {
            graph.replay().expect("replaying a graph");
        }
        let mut t: Vec<f64> =
            (0..31).map(|_| gpu.time_ms(|| graph.replay()).expect("timing a graph") as f64 * 1e3 / *n as f64).collect();
        t.sort_by(f64::total_cmp);
        (t[15], t[3], t[27])
    }

    /// Prints cold and warm per-launch times with GB/s and % of the copy bandwidth for `bytes`
    /// moved per launch.
    pub fn report(&self, name: &str, bytes: usize) {
        let (cold, warm) = self.lines(|med| {
            let rate = bytes as f64 / (med * 1e-6);
            format!("{:6.0} GB/s {:5.1}%", rate / 1e9, 100.0 * rate / self.bench.copy_bytes_per_s)
        });
        println!("{name:<36} {bytes:>10} B  cold {cold}  warm {warm}");
    }

    /// Prints cold and warm per-launch times with the TFLOP/s of `flops` per launch.
    pub fn report_flops(&self, name: &str, flops: f64) {
        let (cold, warm) = self.lines(|med| format!("{:6.1} TFLOP/s", flops / (med * 1e-6) / 1e12));
        println!("{name:<36} {:>8.1} GFLOP  cold {cold}  warm {warm}", flops / 1e9);
    }

    /// The cold and warm lines of a report: median and spread of the per-launch time, then
    /// `rate(median)`.
    fn lines(&self, rate: impl Fn(f64) -> String) -> (String, String) {
        let line =
            |(med, p10, p90): (f64, f64, f64)| format!("{med:8.2} us [p10 {p10:.2}, p90 {p90:.2}] {}", rate(med));
        (line(self.per_launch_us(&self.cold)), line(self.per_launch_us(&self.warm)))
    }

    /// GPU time of `iters` launches (cold graph replays) for criterion's `iter_custom`.
    pub fn criterion(&self, iters: u64) -> std::time::Duration {
        let (graph, n) = &self.cold;
        let reps = (iters as usize).div_ceil(*n);
        let ms = self.bench.gpu.time_ms(|| (0..reps).try_for_each(|_| graph.replay())).expect("timing graph replays");
        std::time::Duration::from_secs_f64(ms as f64 * 1e-3 * iters as f64 / (reps * n) as f64)
    }
}

/// The README's Rust examples, compiled as doctests so they stay true.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
