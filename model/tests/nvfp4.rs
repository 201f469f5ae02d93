//! NVFP4 checkpoints as ModelOpt exports them: the transformers fixture's projections quantized
//! here with ModelOpt's rounding (a per-tensor `weight_scale_2 = amax / (6 * 448)`, a block
//! scale per 16 inputs `block amax / 6 / weight_scale_2` rounded to e4m3, each weight divided
//! by both and rounded to the nearest e2m1 value, ties to the even code; two codes a byte, the
//! even element low), every projection whose input is a multiple of 16 (the shared expert's
//! down projection, 24 inputs, stays bf16, as a mixed checkpoint keeps some layers). The
//! dequantization against this file's own decoding, bit for bit; the CPU backend and the f64
//! reference on it against the bf16 model within a band measured here; every malformed piece
//! an error naming its tensor; the CUDA backend against the CPU backend (`#[ignore]`d).

mod common;

use std::path::Path;

use host::cpu::nvfp4::{E2M1, quantize};
use host::cpu::quant::e4m3_decode;
use model::cache::Part;
use model::config::Config;
use model::cpu::Cpu;
use model::layout::Layout;
use model::model::Model;
use model::reference::Reference;
use model::weights::Checkpoint;
use nemotron_rs::assert_close;
use safetensors::Dtype;
use safetensors::tensor::TensorView;

/// A tensor to write: name, dtype, shape, bytes.
type Entry = (String, Dtype, Vec<usize>, Vec<u8>);

/// The `input_scale` the fixture's NVFP4 projections get: activations up to 448 * 6 times it
/// (26.9) keep their block scales below e4m3's largest.
const INPUT_SCALE: f32 = 0.01;

/// The fixture with every projection of a multiple of 16 inputs as NVFP4 (with an
/// `input_scale`, as W4A4 checkpoints hold one), `edit` applied to the tensors before they are
/// written; how many projections were quantized.
fn write_nvfp4(out: &Path, edit: impl FnOnce(&mut Vec<Entry>)) -> usize {
    let _ = std::fs::remove_dir_all(out);
    std::fs::create_dir_all(out).unwrap();
    std::fs::copy(common::dir().join("config.json"), out.join("config.json")).unwrap();
    let ck = Checkpoint::open(&common::dir()).unwrap();
    let mut data: Vec<Entry> = Vec::new();
    let mut quantized = 0;
    for name in ck.names() {
        let t = ck.tensor(name).unwrap();
        let prefix = name.strip_suffix(".weight").filter(|p| p.ends_with("proj") && t.shape[1].is_multiple_of(16));
        let Some(prefix) = prefix else {
            data.push((name.into(), Dtype::BF16, t.shape.to_vec(), t.bytes.to_vec()));
            continue;
        };
        let (o, i) = (t.shape[0], t.shape[1]);
        let q = quantize(&t.to_f32().unwrap(), o, i);
        data.push((name.into(), Dtype::U8, vec![o, i / 2], q.packed));
        data.push((format!("{prefix}.weight_scale"), Dtype::F8_E4M3, vec![o, i / 16], q.block));
        data.push((format!("{prefix}.weight_scale_2"), Dtype::F32, vec![], q.global.to_le_bytes().to_vec()));
        data.push((format!("{prefix}.input_scale"), Dtype::F32, vec![], INPUT_SCALE.to_le_bytes().to_vec()));
        quantized += 1;
    }
    edit(&mut data);
    let views = data.iter().map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()));
    std::fs::write(out.join("model.safetensors"), safetensors::serialize(views, None).unwrap()).unwrap();
    quantized
}

fn temp(tag: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("nemotron-nvfp4-{tag}-{}", std::process::id()))
}

/// The dequantized weights are the codes' values times their block's scale times the global
/// scale, bit for bit, for every quantized projection; and the quantization is what it should
/// be: every weight within half a grid step (at its block's scale) of the bf16 value.
#[test]
fn nvfp4_dequantization_is_codes_times_scales() {
    let dir = temp("dequant");
    let quantized = write_nvfp4(&dir, |_| {});
    assert_eq!(quantized, 2 * 8 * 2 + 2 + 2 * 2 + 4 + 2, "every projection but the shared experts' down (24 inputs)");
    let (config, ck, bf16) = (Config::from_dir(&dir).unwrap(), Checkpoint::open(&dir).unwrap(), common::open().1);
    let layout = Layout::new(&config, &ck).unwrap();
    let (mut layers, mut values) = (0, 0);
    let mut check = |l: &model::layout::Linear| {
        let Some(s) = l.nvfp4 else { return };
        let [o, i] = l.shape();
        let got = model::nvfp4::dequantize(l).unwrap();
        let want_bf16 = bf16.tensor(l.weight.name).unwrap().to_f32().unwrap();
        assert_eq!((got.len(), want_bf16.len()), (o * i, o * i), "{}", l.weight.name);
        for (j, (&g, &orig)) in got.iter().zip(&want_bf16).enumerate() {
            let (r, c) = (j / i, j % i);
            let byte = l.weight.bytes[r * i / 2 + c / 2];
            let code = if c % 2 == 0 { byte & 15 } else { byte >> 4 };
            let scale = f64::from(e4m3_decode(s.block.bytes[r * i / 16 + c / 16])) * f64::from(s.global);
            let v = f64::from(E2M1[usize::from(code & 7)]) * if code & 8 != 0 { -1.0 } else { 1.0 };
            assert_eq!(g.to_bits(), (v * scale).to_bits(), "{} [{r}, {c}]", l.weight.name);
            // Within half of the widest grid step (2, between 4 and 6) at this scale; saturated
            // at 6 (the block's largest rounds there exactly or from below).
            assert!((g - f64::from(orig)).abs() <= scale + 1e-12, "{} [{r}, {c}]: {g} for {orig}", l.weight.name);
            values += 1;
        }
        layers += 1;
    };
    for layer in &layout.layers {
        match &layer.mixer {
            model::layout::Mixer::Mamba(m) => [&m.in_proj, &m.out_proj].into_iter().for_each(&mut check),
            model::layout::Mixer::Attention(a) => [&a.q, &a.k, &a.v, &a.o].into_iter().for_each(&mut check),
            model::layout::Mixer::Moe(m) => {
                m.experts.iter().chain(&m.shared).flat_map(|e| [&e.up, &e.down]).for_each(&mut check)
            }
            model::layout::Mixer::Mlp(m) => [&m.up, &m.down].into_iter().for_each(&mut check),
        }
    }
    assert_eq!(layers, quantized);
    println!("NVFP4 dequantization: {layers} projections, {values} weights, each codes x scales exactly");
}

/// The NVFP4 fixture on the CPU backend and the f64 reference (weight-only: the weights
/// dequantized, the activations as they are, the `input_scale` not applied) against the
/// bf16 model: the backend near the reference; NVFP4 against bf16 within the gap measured here
/// (printed), and far enough that the codes were read as quantized weights.
#[test]
fn nvfp4_checkpoint_runs_weight_only() {
    let dir = temp("logits");
    write_nvfp4(&dir, |_| {});
    let prompt: Vec<u32> = (0..40).map(|i| (i * 7 % 64) as u32).collect();
    let (cpu, exact) = common::prompt_logits(&dir, &prompt);
    let (bf16_cpu, bf16_exact) = common::prompt_logits(&common::dir(), &prompt);
    let (backend_gap, quant_gap) = (common::max_gap(&cpu, &exact), common::max_gap(&exact, &bf16_exact));
    println!(
        "max logit gap: NVFP4 CPU backend vs NVFP4 f64 reference {backend_gap:.3}, NVFP4 vs bf16 weights (f64) \
         {quant_gap:.3}, bf16 CPU vs f64 {:.3}",
        common::max_gap(&bf16_cpu, &bf16_exact)
    );
    // The backend multiplies the exact weights, its activations bf16: measured 0.030 at most
    // here (0.050 when it rounded the weights to bf16), against the bf16 model's 0.021.
    assert_close("NVFP4 CPU backend vs NVFP4 f64 reference", &cpu, &exact, 0.05, 0.02);
    // Measured 1.80; the two codes of each byte read the other way round give 3.41.
    assert!(quant_gap > 0.05, "NVFP4 weights changed nothing: {quant_gap}");
    assert!(quant_gap < 2.2, "NVFP4 moved the logits by {quant_gap} from the bf16 model's (measured 1.80)");
}

/// What the weight-only path leaves out where a checkpoint expects W4A4 (docs/MATH.md,
/// "W4A4"): the f64 reference with every NVFP4 layer's input quantized with its input scale,
/// against the weight-only reference and the bf16 model, on four prompts. No block scale
/// saturates (the fixture's input scale covers its activations); the gaps are printed and held
/// to the band measured here. The fixture's layers are scaled so that they matter, which makes
/// its logits sensitive: NVFP4 weights alone move them by 0.7 to 3.2.
#[test]
fn w4a4_moves_the_logits_by_a_measured_band() {
    let dir = temp("w4a4");
    write_nvfp4(&dir, |_| {});
    let config = Config::from_dir(&dir).unwrap();
    let ck = Checkpoint::open(&dir).unwrap();
    let layout = Layout::new(&config, &ck).unwrap();
    let w4a4 = Reference::w4a4(&config, &layout).unwrap();
    let weight_only = Reference::new(&config, &layout).unwrap();
    let mut worst: f64 = 0.0;
    for m in [7, 3, 11, 29] {
        let prompt: Vec<u32> = (0..40).map(|i| (i * m % 64) as u32).collect();
        let last = |r: &Reference| {
            let mut st = r.new_state();
            prompt.iter().map(|&t| r.step(&mut st, t).unwrap()).last().unwrap()
        };
        let (a4, w4) = (last(&w4a4), last(&weight_only));
        let (_, bf16) = common::prompt_logits(&common::dir(), &prompt);
        let gap = common::max_gap(&a4, &w4);
        let top = |l: &[f64]| (0..l.len()).max_by(|&i, &j| l[i].total_cmp(&l[j])).unwrap();
        println!(
            "prompt x{m}: max logit gap W4A4 vs weight-only {gap:.3}; against the bf16 model weight-only {:.3}, \
             W4A4 {:.3}; top token W4A4 {} weight-only {} bf16 {}",
            common::max_gap(&w4, &bf16),
            common::max_gap(&a4, &bf16),
            top(&a4),
            top(&w4),
            top(&bf16)
        );
        assert!(gap > 0.01, "quantizing the activations changed nothing: {gap}");
        worst = worst.max(gap);
    }
    assert_eq!(w4a4.saturated_blocks(), 0, "the fixture's input scale is too small for its activations");
    assert!(worst < 3.2, "W4A4 moved the logits by {worst} from weight-only (measured 2.66 at most)");
    // An NVFP4 layer without an input scale has no W4A4 form: refused by name.
    let dir = temp("w4a4-unscaled");
    write_nvfp4(&dir, |d| d.retain(|e| !e.0.ends_with("layers.0.mixer.in_proj.input_scale")));
    let ck = Checkpoint::open(&dir).unwrap();
    let err = Reference::w4a4(&config, &Layout::new(&config, &ck).unwrap()).err().unwrap().to_string();
    assert!(err.contains("layers.0.mixer.in_proj.weight") && err.contains("input_scale"), "{err}");
}

/// `synthetic::in_memory_as` with `Precision::Nvfp4` (the nano bench's `--nvfp4`) on the
/// built-in model's shapes with a Mamba layer before attention (pattern `M*E-ME`): NVIDIA's
/// Nano recipe, so the routed and shared experts' projections and the other Mamba layer's
/// in_proj and out_proj are NVFP4 (codes, e4m3 block scales, a per-tensor scale and an input
/// scale beside each; every weight within its block's widest half step of the bf16 one with
/// the same seed), the rest (that Mamba layer, attention, the dense MLP, routers, embeddings,
/// LM head) the same bf16 tensor; on the CPU backend its logits move from the bf16 model's by
/// the quantization, within a band measured here.
#[test]
fn synthetic_nvfp4_checkpoint_follows_the_recipe() {
    use model::synthetic::{Draws, Precision, in_memory, in_memory_as};
    use model::weights::Dtype;
    let (_, json) = model::built_in::FILES.iter().find(|(name, _)| *name == "config.json").unwrap();
    let json = std::str::from_utf8(json).unwrap().replace("\"ME*-ME\"", "\"M*E-ME\"");
    let config = Config::from_json(&json).unwrap();
    let (bf16_ck, ck) = (
        in_memory(&config, 5).unwrap(),
        in_memory_as(&config, 5, Draws { precision: Precision::Nvfp4, ..Draws::default() }).unwrap(),
    );
    let (mut projections, mut values) = (vec![], 0);
    for name in bf16_ck.names() {
        let (b, q) = (bf16_ck.tensor(name).unwrap(), ck.tensor(name).unwrap());
        let recipe = name.contains("experts.") || name.starts_with("backbone.layers.4.mixer.");
        let Some(prefix) = name.strip_suffix(".weight").filter(|p| p.ends_with("proj") && recipe) else {
            assert_eq!((q.dtype, q.shape, q.bytes), (b.dtype, b.shape, b.bytes), "{name} stays bf16");
            continue;
        };
        let [out, inp] = [b.shape[0], b.shape[1]];
        assert_eq!((q.dtype, q.shape), (Dtype::U8, &[out, inp / 2][..]), "{name}");
        let block = ck.tensor(&format!("{prefix}.weight_scale")).unwrap();
        assert_eq!((block.dtype, block.shape), (Dtype::F8E4M3, &[out, inp / 16][..]), "{name}");
        let scalar =
            |n: &str| f32::from_le_bytes(ck.tensor(&format!("{prefix}.{n}")).unwrap().bytes.try_into().unwrap());
        let (global, input) = (scalar("weight_scale_2"), scalar("input_scale"));
        assert!(global > 0.0 && input > 0.0, "{name}");
        let w = host::cpu::nvfp4::dequantize(q.bytes, block.bytes, global, inp);
        for (i, (&got, orig)) in w.iter().zip(b.to_f32().unwrap()).enumerate() {
            let scale = f64::from(e4m3_decode(block.bytes[i / 16])) * f64::from(global);
            assert!((got - f64::from(orig)).abs() <= scale + 1e-12, "{name}[{i}]: {got} for {orig}");
        }
        projections.push(name.to_string());
        values += w.len();
    }
    // Per MoE layer 8 experts and the shared one, up and down; one Mamba layer's two.
    assert_eq!(projections.len(), 2 * 9 * 2 + 2, "{projections:?}");
    println!("synthetic NVFP4: {} projections, {values} weights within their step", projections.len());
    let gap = common::max_gap(&common::synthetic_logits(&config, &bf16_ck), &common::synthetic_logits(&config, &ck));
    println!("synthetic NVFP4 vs bf16, CPU backend: largest logit gap {gap:.3}");
    assert!(gap > 1e-3, "the NVFP4 checkpoint changed nothing: {gap}");
    assert!(gap < 0.6, "NVFP4 moved the logits by {gap} (measured 0.356)");
}

/// Every malformed NVFP4 piece is refused when the layout is made, naming the tensor.
#[test]
fn malformed_nvfp4_checkpoints_name_the_tensor() {
    let p = "backbone.layers.0.mixer.in_proj";
    fn find(d: &[Entry], name: &str) -> usize {
        d.iter().position(|e| e.0 == name).unwrap()
    }
    type Edit = Box<dyn Fn(&mut Vec<Entry>)>;
    let cases: Vec<(Edit, String)> = vec![
        (
            Box::new(move |d| {
                let i = find(d, &format!("{p}.weight_scale"));
                let n = d[i].3.len();
                d[i] = (d[i].0.clone(), Dtype::F32, vec![n / 4, 1], d[i].3.clone());
            }),
            format!("`{p}.weight_scale` is F32, expected F8_E4M3"),
        ),
        (
            Box::new(move |d| {
                let i = find(d, &format!("{p}.weight_scale"));
                let s = d[i].2.clone();
                d[i].2 = vec![s[0] / 2, s[1] * 2];
            }),
            format!("`{p}.weight_scale` has shape"),
        ),
        (
            Box::new(move |d| {
                let i = find(d, &format!("{p}.weight_scale"));
                d[i].3[5] |= 0x80;
            }),
            format!("`{p}.weight_scale` holds a negative block scale (element 5"),
        ),
        (
            Box::new(move |d| {
                let i = find(d, &format!("{p}.weight_scale"));
                d.remove(i);
            }),
            format!("`{p}.weight` is NVFP4 (U8) but `{p}.weight_scale` is missing"),
        ),
        (
            Box::new(move |d| {
                let i = find(d, &format!("{p}.weight_scale_2"));
                d.remove(i);
            }),
            format!("`{p}.weight` is NVFP4 (U8) but `{p}.weight_scale_2` is missing"),
        ),
        (
            Box::new(move |d| {
                let i = find(d, &format!("{p}.weight_scale_2"));
                d[i].3 = 0f32.to_le_bytes().to_vec();
            }),
            format!("`{p}.weight_scale_2` is 0, expected a finite scale > 0"),
        ),
        (
            Box::new(move |d| {
                let i = find(d, &format!("{p}.weight"));
                let s = d[i].2.clone();
                d[i].2 = vec![s[0] / 2, s[1] * 2];
            }),
            format!("`{p}.weight` has shape"),
        ),
        (
            Box::new(|d| {
                // The shared expert's down projection (24 inputs) as bytes: not a whole block.
                let n = "backbone.layers.1.mixer.shared_experts.down_proj.weight";
                let i = find(d, n);
                let s = d[i].2.clone();
                d[i] = (n.into(), Dtype::U8, vec![s[0], s[1] / 2], vec![0; s[0] * s[1] / 2]);
            }),
            "`backbone.layers.1.mixer.shared_experts.down_proj.weight` is NVFP4 (U8) for an input of 24, not a multiple"
                .into(),
        ),
    ];
    let dir = temp("bad");
    let count = cases.len();
    for (edit, want) in cases {
        write_nvfp4(&dir, |d| edit(d));
        let config = Config::from_dir(&dir).unwrap();
        let ck = Checkpoint::open(&dir).unwrap();
        let err = Layout::new(&config, &ck).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains(&want), "want {want:?} in:\n{err}");
    }
    assert_eq!(count, 8);
}

/// hf_quant_config.json beside config.json is read with it: NVFP4 with an FP8 KV cache is
/// taken (and the bf16 cache said), an algorithm or block size this crate does not run is an
/// error naming the file; the NVFP4 fixture without it declares nothing.
#[test]
fn hf_quant_config_is_read_beside_config_json() {
    let dir = temp("hfq");
    write_nvfp4(&dir, |_| {});
    assert_eq!(Config::from_dir(&dir).unwrap().quantization, None);
    let write = |q: &str| std::fs::write(dir.join("hf_quant_config.json"), q).unwrap();
    write(
        r#"{"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8",
        "group_size": 16, "exclude_modules": ["lm_head"]}}"#,
    );
    let config = Config::from_dir(&dir).unwrap();
    assert_eq!(config.quantization.as_ref().map(|q| q.quant_algo.as_str()), Some("NVFP4"));
    let note = config.kv_cache_note().unwrap_or_default();
    assert!(note.contains("FP8 KV cache") && note.contains("bf16"), "{note}");
    let layout_ok = Layout::new(&config, &Checkpoint::open(&dir).unwrap()).is_ok();
    assert!(layout_ok, "the NVFP4 fixture loads with its declaration");
    write(r#"{"quantization": {"quant_algo": "NVFP4", "group_size": 32}}"#);
    let e = Config::from_dir(&dir).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("hf_quant_config.json") && e.contains("`group_size`"), "{e}");
}

/// The layout holds the weights' formats to the declaration (`Quantization::declared`): an
/// NVFP4 weight in an excluded module, under an FP8 declaration, or (MIXED_PRECISION) without an
/// entry in quantized_layers, and an entry's module left bf16, each refused naming the tensor.
#[test]
fn the_weights_agree_with_the_declaration() {
    let dir = temp("declared");
    write_nvfp4(&dir, |_| {});
    let p = "backbone.layers.0.mixer.in_proj";
    let cases = [
        (
            r#"{"quantization": {"quant_algo": "NVFP4", "exclude_modules": ["lm_head", "backbone.layers.0.mixer*"]}}"#,
            format!("`{p}.weight` is NVFP4, but `backbone.layers.0.mixer*` in hf_quant_config.json's exclude_modules"),
        ),
        (
            r#"{"quantization": {"quant_algo": "FP8"}}"#,
            format!("`{p}.weight` is NVFP4, but hf_quant_config.json declares it FP8"),
        ),
        (
            r#"{"quantization": {"quant_algo": "MIXED_PRECISION", "quantized_layers": {}}}"#,
            format!("`{p}.weight` is NVFP4, but hf_quant_config.json's quantized_layers has no entry for `{p}`"),
        ),
        (
            r#"{"quantization": {"quant_algo": "MIXED_PRECISION", "quantized_layers": {"lm_head": {"quant_algo": "NVFP4"}}}}"#,
            "`lm_head.weight` is Bf16, but hf_quant_config.json's quantized_layers declares `lm_head` NVFP4".into(),
        ),
    ];
    let ck = Checkpoint::open(&dir).unwrap();
    for (declaration, want) in &cases {
        std::fs::write(dir.join("hf_quant_config.json"), declaration).unwrap();
        let config = Config::from_dir(&dir).unwrap();
        let err = Layout::new(&config, &ck).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains(want.as_str()), "want {want:?} in:\n{err}");
    }
    assert_eq!(cases.len(), 4);
}

/// The NVFP4 fixture on the CUDA backend against the CPU backend (both weight-only from the
/// codes: the CPU's products exact in f64), decode steps recorded as CUDA graphs and replayed,
/// and launched one by one:
/// - a 24-token prompt fed a token a step, then 8 greedy steps: every step the CUDA backend's
///   one-row path (the gemv and per-choice expert kernels reading the codes), each step's
///   logits within the bf16 band;
/// - a 12-token prompt in the first slot again (the dense projections and the experts on the
///   tensor-core mat-vec, from the codes), a 40-token prompt in a second slot (the dense
///   projections past the gemv's rows: their weights dequantized to bf16, rounded once, for
///   cuBLASLt; the experts still on the tensor-core mat-vec) and an 80-token one in a third
///   (the experts past the expert kernel's rows: dequantized for the bf16 grouped GEMM, the
///   fixture's sizes not being multiples of 64 as the NVFP4 grouped GEMM's are), their logits within
///   the band of bf16-rounded weights; then 16 decode
///   steps after the 80 fed the CPU's greedy tokens, whose states carry the prefill's bf16
///   weights: the largest gap printed, the greedy tokens mostly the same.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_nvfp4_matches_cpu_nvfp4() {
    let dir = temp("cuda");
    write_nvfp4(&dir, |_| {});
    let config = Config::from_dir(&dir).unwrap();
    let ck = Checkpoint::open(&dir).unwrap();
    let layout = Layout::new(&config, &ck).unwrap();
    let logits = |v: Vec<Vec<f32>>| v[0].iter().map(|&x| f64::from(x)).collect::<Vec<f64>>();
    let (mut compared, mut expected) = (0, 0);
    for graphs in [false, true] {
        let mut cpu = Model::load(Cpu::default(), &config, &layout, 3, 128).unwrap();
        let cuda = model::cuda::Cuda::new(0).unwrap().with_graphs(graphs);
        let mut gpu = Model::load(cuda, &config, &layout, 3, 128).unwrap();
        let mut tok = [0u32];
        for n in 0..32 {
            tok[0] = if n < 24 { (n * 5 % 64) as u32 } else { tok[0] };
            let part = Part { slot: 0, computed: n, tokens: &tok };
            let p = [part];
            let (a, b) = (logits(cpu.step(&p).unwrap()), logits(gpu.step(&p).unwrap()));
            compared +=
                assert_close(&format!("NVFP4 CUDA (graphs {graphs}) vs CPU, one row, step {n}"), &b, &a, 0.05, 0.02);
            tok[0] = common::argmax(&a);
        }
        let mut next = [0u32];
        cpu.release(0);
        gpu.release(0);
        for (slot, len) in [(0, 12), (2, 40), (1, 80)] {
            let prompt: Vec<u32> = (0..len).map(|i| (i * 7 % 64) as u32).collect();
            let part = Part { slot, computed: 0, tokens: &prompt };
            let p = [part];
            let (a, b) = (logits(cpu.step(&p).unwrap()), logits(gpu.step(&p).unwrap()));
            // The GEMMs' weights rounded to bf16 (2^-9 relative): the CPU backend with them so
            // rounded was 0.050 from the exact reference at the 40 tokens; measured here 0.077.
            let label = format!("NVFP4 CUDA (graphs {graphs}) vs CPU, {len}-token prompt");
            compared += assert_close(&label, &b, &a, 0.12, 0.04);
            next[0] = common::argmax(&a);
        }
        expected += 35 * config.vocab_size;
        let (mut worst, mut same) = (0.0f64, 0);
        for n in 0..16 {
            let part = Part { slot: 1, computed: 80 + n, tokens: &next };
            let p = [part];
            let (a, b) = (logits(cpu.step(&p).unwrap()), logits(gpu.step(&p).unwrap()));
            worst = worst.max(common::max_gap(&a, &b));
            same += usize::from(common::argmax(&a) == common::argmax(&b));
            next[0] = common::argmax(&a);
        }
        println!(
            "NVFP4 CUDA (graphs {graphs}) vs CPU after the 80-token prompt: largest logit gap over 16 steps {worst:.3}, {same}/16 greedy tokens equal"
        );
        assert!(same >= 12, "{same}/16");
    }
    println!("NVFP4 CUDA vs CPU backend: {compared} logits compared");
    assert_eq!(compared, expected);
}
