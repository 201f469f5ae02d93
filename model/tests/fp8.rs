//! FP8 (W8A8) checkpoints: the fixture's projections quantized to e4m3 with per-tensor weight
//! scales, some with a static input_scale (the rest quantize activations per token). The CPU
//! backend against the f64 reference on the same FP8 checkpoint, and both against the bf16
//! model within the quantization error.

mod common;

use std::path::Path;

use host::cpu::quant::{E4M3_MAX, e4m3_encode};
use model::cache::Part;
use model::config::Config;
use model::cpu::Cpu;
use model::layout::Layout;
use model::model::Model;
use model::weights::Checkpoint;
use nemotron_rs::assert_close;
use safetensors::tensor::TensorView;

/// Which projections of the FP8 fixture quantize their inputs with a static `input_scale` (the
/// others per token).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Statics {
    /// q/k/v and in_proj (0.01).
    Attention,
    /// Those and the up projections of the last MoE layer's experts (0.02).
    LastExperts,
    /// Every projection (0.01), as ModelOpt's FP8 checkpoints: the CUDA backend then runs a
    /// one-row step's shared expert as pieces among the routed experts.
    All,
}

/// Writes the fixture with every `*proj.weight` as FP8, input scales as `statics` says.
fn write_fp8(out: &Path, statics: Statics) -> usize {
    let _ = std::fs::remove_dir_all(out);
    std::fs::create_dir_all(out).unwrap();
    std::fs::copy(common::dir().join("config.json"), out.join("config.json")).unwrap();
    let ck = Checkpoint::open(&common::dir()).unwrap();
    let mut data: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut quantized = 0;
    for name in ck.names() {
        let t = ck.tensor(name).unwrap();
        let Some(prefix) = name.strip_suffix(".weight").filter(|p| p.ends_with("proj")) else {
            data.push((name.into(), safetensors::Dtype::BF16, t.shape.to_vec(), t.bytes.to_vec()));
            continue;
        };
        let v = t.to_f32().unwrap();
        let scale = v.iter().map(|x| x.abs()).fold(0.0, f32::max) / E4M3_MAX;
        data.push((
            name.into(),
            safetensors::Dtype::F8_E4M3,
            t.shape.to_vec(),
            v.iter().map(|&x| e4m3_encode(x / scale)).collect(),
        ));
        data.push((format!("{prefix}.weight_scale"), safetensors::Dtype::F32, vec![], scale.to_le_bytes().to_vec()));
        let expert_up = statics == Statics::LastExperts
            && prefix.contains("layers.5.mixer.experts.")
            && prefix.ends_with("up_proj");
        let attention = ["q_proj", "k_proj", "v_proj", "in_proj"].iter().any(|p| prefix.ends_with(p));
        if expert_up || attention || statics == Statics::All {
            let s: f32 = if expert_up { 0.02 } else { 0.01 };
            data.push((format!("{prefix}.input_scale"), safetensors::Dtype::F32, vec![], s.to_le_bytes().to_vec()));
        }
        quantized += 1;
    }
    let views = data.iter().map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()));
    std::fs::write(out.join("model.safetensors"), safetensors::serialize(views, None).unwrap()).unwrap();
    quantized
}

#[test]
fn fp8_checkpoint_runs_as_w8a8() {
    let dir = std::env::temp_dir().join(format!("nemotron-fp8-{}", std::process::id()));
    let quantized = write_fp8(&dir, Statics::Attention);
    assert_eq!(quantized, 2 * 8 * 2 + 2 * 2 + 2 * 2 + 4 + 2, "every projection quantized");
    let prompt: Vec<u32> = (0..40).map(|i| (i * 7 % 64) as u32).collect();
    let (fp8_cpu, fp8_exact) = common::prompt_logits(&dir, &prompt);
    let (bf16_cpu, bf16_exact) = common::prompt_logits(&common::dir(), &prompt);
    let (backend_gap, quant_gap) = (common::max_gap(&fp8_cpu, &fp8_exact), common::max_gap(&fp8_exact, &bf16_exact));
    println!(
        "max logit gap: FP8 CPU backend vs FP8 f64 reference {backend_gap:.3}, FP8 vs bf16 weights (f64) {quant_gap:.3}, bf16 CPU vs f64 {:.3}",
        common::max_gap(&bf16_cpu, &bf16_exact)
    );
    // The backend and the reference apply the same W8A8 definition; they differ by bf16
    // activations, which can move an activation across an e4m3 rounding boundary: a wider band
    // than the bf16 model's, still far below the quantization's own effect.
    assert_close("FP8 CPU backend vs FP8 f64 reference", &fp8_cpu, &fp8_exact, 0.15, 0.05);
    // Had the FP8 tensors been read as anything but quantized weights, nothing would differ.
    assert!(quant_gap > 0.05, "FP8 weights changed nothing: {quant_gap}");
    assert_close("FP8 vs bf16 weights (f64)", &fp8_exact, &bf16_exact, 0.6, 0.2);
}

/// The FP8 fixture on the CUDA backend (e4m3 codes on the device, the expert kernel's W8A8 path for
/// dense layers and experts at up to 64 rows, the FP8 GEMM and grouped GEMM on tensor cores at
/// more; static and per-token input scales, and static ones everywhere, where one-row steps run the
/// shared expert as pieces among the routed experts) against the CPU backend on the same
/// checkpoint: a 40-token prompt and a 100-token one (its prefill past 64 rows), each then 16
/// decode steps fed the CPU's greedy tokens. On this tiny model (hidden 32) one activation crossing
/// an e4m3 rounding boundary moves the logits by about as much as FP8 itself does: measured here,
/// the CPU backend against the f64 reference (the same W8A8 definition) over the 40-token prompt's
/// 17 steps differs by up to 0.92 and agrees on 14/17 greedy tokens. So the logits are checked at
/// the prompt within the CPU backend's band and decode steps by their greedy tokens, with that same
/// margin (a first decode step's logits were measured 0.25 apart on an H100, the pieces not
/// involved); the kernels themselves are checked value by value in tests/moe.rs, tests/grouped.rs
/// and tests/gemv.rs, the layout of the shared expert's pieces in the CUDA backend's unit tests.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_fp8_matches_cpu_fp8() {
    for statics in [Statics::LastExperts, Statics::All] {
        let dir = std::env::temp_dir().join(format!("nemotron-fp8-cuda-{statics:?}-{}", std::process::id()));
        write_fp8(&dir, statics);
        cuda_matches_cpu(&dir, statics);
    }
}

/// [`cuda_fp8_matches_cpu_fp8`] on the fixture at `dir`.
fn cuda_matches_cpu(dir: &Path, statics: Statics) {
    let config = Config::from_dir(dir).unwrap();
    let ck = Checkpoint::open(dir).unwrap();
    let layout = Layout::new(&config, &ck).unwrap();
    for len in [40, 100] {
        let mut cpu = Model::load(Cpu::default(), &config, &layout, 1, 128).unwrap();
        let mut gpu = Model::load(model::cuda::Cuda::new(0).unwrap(), &config, &layout, 1, 128).unwrap();
        let prompt: Vec<u32> = (0..len).map(|i| (i * 7 % 64) as u32).collect();
        let mut part = Part { slot: 0, computed: 0, tokens: &prompt };
        let (mut worst, mut same) = (0.0f64, 0);
        let mut next = [0u32];
        for n in 0..17 {
            let a: Vec<f64> = cpu.step(&[part.clone()]).unwrap().remove(0).into_iter().map(f64::from).collect();
            let b: Vec<f64> = gpu.step(&[part]).unwrap().remove(0).into_iter().map(f64::from).collect();
            assert_eq!(cpu.counters(), gpu.counters());
            if n == 0 {
                assert_close(&format!("FP8 CUDA vs CPU ({statics:?}) at the {len}-token prompt"), &b, &a, 0.15, 0.05);
            }
            worst = worst.max(common::max_gap(&a, &b));
            let (ta, tb) = (common::argmax(&a), common::argmax(&b));
            same += usize::from(ta == tb);
            next[0] = ta;
            part = Part { slot: 0, computed: prompt.len() + n, tokens: &next };
        }
        println!(
            "FP8 CUDA vs CPU backend, static input scales {statics:?}, {len}-token prompt: largest logit gap over 17 steps {worst:.3}, {same}/17 greedy tokens equal"
        );
        assert!(same >= 12, "{statics:?}, {len}-token prompt: {same}/17");
    }
}

/// `synthetic::in_memory_as` with `Precision::Fp8` (the nano bench's `--fp8`): every projection
/// of the bf16 synthetic checkpoint with the same seed, quantized: e4m3 codes within half an
/// e4m3 step of the bf16 values at their tensor's scale (max |w| / 448), a `weight_scale` and
/// the static `input_scale` beside each, everything else the same bf16 tensor; and the
/// built-in model's config run on both (CPU backend) gives logits apart by the quantization
/// and within the fixture's FP8-against-bf16 band.
#[test]
fn synthetic_fp8_checkpoint_is_the_bf16_one_quantized() {
    use model::synthetic::{Draws, FP8_INPUT_SCALE, Precision, in_memory, in_memory_as};
    use model::weights::Dtype;
    let (_, json) = model::built_in::FILES.iter().find(|(name, _)| *name == "config.json").unwrap();
    let config = Config::from_json(std::str::from_utf8(json).unwrap()).unwrap();
    let (bf16_ck, fp8_ck) = (
        in_memory(&config, 5).unwrap(),
        in_memory_as(&config, 5, Draws { precision: Precision::Fp8, ..Draws::default() }).unwrap(),
    );
    let (mut projections, mut values) = (0, 0);
    for name in bf16_ck.names() {
        let (b, f) = (bf16_ck.tensor(name).unwrap(), fp8_ck.tensor(name).unwrap());
        assert_eq!(b.shape, f.shape, "{name}");
        let Some(prefix) = name.strip_suffix(".weight").filter(|p| p.ends_with("proj") && b.shape.len() == 2) else {
            assert_eq!((f.dtype, f.bytes), (b.dtype, b.bytes), "{name} stays bf16");
            continue;
        };
        assert_eq!(f.dtype, Dtype::F8E4M3, "{name}");
        let scalar = |n: String| f32::from_le_bytes(fp8_ck.tensor(&n).unwrap().bytes.try_into().unwrap());
        let (w_scale, in_scale) = (scalar(format!("{prefix}.weight_scale")), scalar(format!("{prefix}.input_scale")));
        assert_eq!(in_scale, FP8_INPUT_SCALE, "{name}");
        let v = b.to_f32().unwrap();
        assert_eq!(w_scale, v.iter().fold(0.0f32, |m, x| m.max(x.abs())) / E4M3_MAX, "{name}");
        for (&code, &x) in f.bytes.iter().zip(&v) {
            // e4m3 keeps 3 mantissa bits (half a step: 1/16 of the value), subnormals steps
            // of 2^-9 of the scale.
            let got = host::cpu::quant::e4m3_decode(code) * w_scale;
            assert!((got - x).abs() <= x.abs() / 16.0 + w_scale / 1024.0, "{name}: {x} coded as {got}");
        }
        projections += 1;
        values += v.len();
    }
    assert!(projections > 8, "{projections} projections");
    println!("synthetic FP8: {projections} projections, {values} codes within half a step");
    let (b, f) = (common::synthetic_logits(&config, &bf16_ck), common::synthetic_logits(&config, &fp8_ck));
    let gap = common::max_gap(&b, &f);
    assert!(gap > 1e-3, "the FP8 checkpoint changed nothing: {gap}");
    assert_close("synthetic FP8 vs bf16, CPU backend", &f, &b, 0.6, 0.2);
}
