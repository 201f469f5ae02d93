//! Inputs a hostile or careless user gives, each an error naming the problem (never an abort,
//! a wrapped size or a hang): load parameters whose cache sizes overflow or do not fit in
//! memory, zero slots, a request whose lengths overflow, a checkpoint file that is no regular
//! file, and the CLI's huge `--max-new-tokens`.

mod common;

use std::process::Command;

use common::open;
use model::cpu::Cpu;
use model::engine::{Engine, RequestParams};
use model::layout::Layout;
use model::model::Model;
use model::sampling::SamplingParams;

fn load(slots: usize, max_len: usize) -> model::Result<Model<Cpu>> {
    let (config, ck) = open();
    let layout = Layout::new(&config, &ck).unwrap();
    Model::load(Cpu::default(), &config, &layout, slots, max_len)
}

fn load_error(slots: usize, max_len: usize) -> String {
    load(slots, max_len).err().map(|e| e.to_string()).unwrap_or_else(|| panic!("({slots}, {max_len}) loaded"))
}

#[test]
fn cache_sizes_that_overflow_or_do_not_fit_are_errors() {
    let cases = [
        (0, 64, "at least one slot"),
        (2, 0, "at least one token"),
        (usize::MAX / 2, 64, "overflows"),
        (2, usize::MAX / 4, "overflows"),
        (1, 1 << 40, "do not fit in host memory"),
    ];
    for (slots, max_len, want) in cases {
        let e = load_error(slots, max_len);
        assert!(e.contains(want), "slots {slots}, max_len {max_len}: {e}");
        println!("slots {slots}, max_len {max_len}: {e}");
    }
    assert!(load(2, 64).is_ok(), "the fixture's own sizes load");
}

#[test]
fn request_lengths_that_overflow_are_refused() {
    let mut e = Engine::new(load(1, 64).unwrap());
    for n in [usize::MAX, usize::MAX - 1, 1 << 60] {
        let params = RequestParams {
            max_new_tokens: n,
            sampling: SamplingParams::greedy(),
            stop_tokens: vec![],
            min_new_tokens: 0,
        };
        let err = e.add(&[1, 2, 3], params).unwrap_err().to_string();
        assert!(err.contains("exceeds the maximum of 64 tokens"), "max_new_tokens {n}: {err}");
    }
    assert!(!e.has_work());
}

#[test]
fn a_checkpoint_file_that_is_not_a_regular_file_is_an_error() {
    let dir = std::env::temp_dir().join(format!("nemotron-fifo-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let fifo = dir.join("model.safetensors");
    let _ = std::fs::remove_file(&fifo);
    let made = Command::new("mkfifo").arg(&fifo).status().map(|s| s.success()).unwrap_or(false);
    // A directory in its place stands for the special files where mkfifo is missing.
    if !made {
        std::fs::create_dir_all(&fifo).unwrap();
    }
    let e = model::weights::Checkpoint::open(&dir).err().expect("opened a special file").to_string();
    assert!(e.contains("is not a regular file"), "{e}");
    println!("{}: {e}", if made { "FIFO" } else { "directory" });
}

#[test]
fn huge_max_new_tokens_in_the_cli_is_an_error_not_an_abort() {
    for n in ["1000000000000", "1152921504606846976", &usize::MAX.to_string()] {
        let out = Command::new(env!("CARGO_BIN_EXE_generate"))
            .args(["--prompt", "hi", "--backend", "cpu", "--max-new-tokens", n])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "--max-new-tokens {n}: {stderr}");
        assert!(stderr.contains("exceeds the maximum of 4096 tokens"), "--max-new-tokens {n}: {stderr}");
    }
}

/// A NaN or infinite weight is an error at layout time naming the tensor and the element,
/// for each float dtype and for FP8 codes; `trusting_values` skips the scan.
#[test]
fn non_finite_weights_are_found_by_name_at_load() {
    use model::weights::{Dtype, Tensor};
    let path = std::path::Path::new("x.safetensors");
    let cases: [(Dtype, Vec<u8>, Option<usize>); 8] = [
        (Dtype::Bf16, [1.0f32, 2.0].iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect(), None),
        (Dtype::Bf16, [0.0, f32::NAN].iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect(), Some(1)),
        (
            Dtype::Bf16,
            [f32::NEG_INFINITY].iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect(),
            Some(0),
        ),
        (Dtype::F16, [0.5f32, 1e9].iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect(), Some(1)),
        (Dtype::F32, [3.0f32, 4.0, f32::INFINITY].iter().flat_map(|v| v.to_le_bytes()).collect(), Some(2)),
        (Dtype::F32, [f32::MAX, -f32::MAX].iter().flat_map(|v| v.to_le_bytes()).collect(), None),
        (Dtype::F8E4M3, vec![0x7E, 0xFE, 0x00], None),
        (Dtype::F8E4M3, vec![0x10, 0xFF], Some(1)),
    ];
    for (dtype, bytes, want) in &cases {
        let shape = [bytes.len() / dtype.size()];
        let t = Tensor { name: "w", path, dtype: *dtype, shape: &shape, bytes };
        assert_eq!(t.first_non_finite().map(|e| e.0), *want, "{dtype:?} {bytes:?}");
    }
    // Past the scan's first blocks (8192 bytes each): the element's index, not the block's.
    for (dtype, width, at) in [(Dtype::Bf16, 2, 9000), (Dtype::F32, 4, 4095), (Dtype::F8E4M3, 1, 20000)] {
        let mut bytes = vec![0u8; 30000];
        let bits: &[u8] = match width {
            1 => &[0xFF],
            2 => &[0x80, 0x7F],
            _ => &[0, 0, 0xC0, 0x7F],
        };
        bytes[at * width..(at + 1) * width].copy_from_slice(bits);
        let shape = [bytes.len() / width];
        let t = Tensor { name: "w", path, dtype, shape: &shape, bytes: &bytes };
        assert_eq!(t.first_non_finite().map(|e| e.0), Some(at), "{dtype:?}");
    }
    let (config, ck) = common::open_with_nan_embedding(3);
    let e = Layout::new(&config, &ck).unwrap_err().to_string();
    assert!(e.contains("`backbone.embeddings.weight` holds a NaN or infinite value (element 96"), "{e}");
    assert!(Layout::trusting_values(&config, &ck).is_ok());
    // An infinite router bias (it made the GPU's grouped routing trap) is refused at load.
    let bias = "backbone.layers.1.mixer.gate.e_score_correction_bias";
    let (config, ck) = common::open_patched("inf-bias", bias, 2..3, half::bf16::INFINITY);
    let e = Layout::new(&config, &ck).unwrap_err().to_string();
    assert!(e.contains(&format!("`{bias}` holds a NaN or infinite value (element 2")), "{e}");
}
