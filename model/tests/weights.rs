//! Safetensors loading, on small checkpoints this test writes itself (the format by hand:
//! an 8-byte header length, a JSON header, the data), including malformed ones.

use std::path::{Path, PathBuf};

use half::{bf16, f16};
use model::weights::{Checkpoint, Dtype};

/// A fresh empty directory under the system temp dir.
fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("nemotron-weights-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Writes a safetensors file of `(name, dtype, shape, bytes)`.
fn write(path: &Path, tensors: &[(&str, &str, Vec<usize>, Vec<u8>)]) {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, dtype, shape, bytes) in tensors {
        let start = data.len();
        data.extend_from_slice(bytes);
        header.insert(
            name.to_string(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    let mut h = serde_json::Value::Object(header).to_string().into_bytes();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h);
    out.extend(data);
    std::fs::write(path, out).unwrap();
}

fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|&x| bf16::from_f32(x).to_le_bytes()).collect()
}

fn sample() -> Vec<(&'static str, &'static str, Vec<usize>, Vec<u8>)> {
    vec![
        ("backbone.embeddings.weight", "BF16", vec![2, 3], bf16_bytes(&[1.0, -2.0, 0.5, 4.0, 8.0, -0.25])),
        (
            "backbone.layers.0.mixer.A_log",
            "F32",
            vec![3],
            [0.5f32, 1.0, -1.0].iter().flat_map(|v| v.to_le_bytes()).collect(),
        ),
        (
            "backbone.layers.0.mixer.D",
            "F16",
            vec![2],
            [1.5f32, -3.0].iter().flat_map(|&v| f16::from_f32(v).to_le_bytes()).collect(),
        ),
        ("backbone.layers.1.mixer.experts.0.up_proj.weight", "F8_E4M3", vec![2, 2], vec![0x38, 0xb8, 0x40, 0x00]),
        ("backbone.layers.1.mixer.experts.0.up_proj.weight_scale", "F32", vec![], 0.25f32.to_le_bytes().to_vec()),
    ]
}

fn msg(r: model::Result<impl Sized>) -> String {
    match r {
        Err(e) => e.to_string(),
        Ok(_) => panic!("expected an error"),
    }
}

#[test]
fn single_file_values_and_dtypes() {
    let dir = tmpdir("single");
    write(&dir.join("model.safetensors"), &sample());
    let ck = Checkpoint::open(&dir).unwrap();
    assert_eq!(ck.names().count(), 5);
    let e = ck.expect("backbone.embeddings.weight", &[2, 3]).unwrap();
    assert_eq!((e.dtype, e.len()), (Dtype::Bf16, 6));
    assert_eq!(e.to_f32().unwrap(), vec![1.0, -2.0, 0.5, 4.0, 8.0, -0.25]);
    assert_eq!(ck.tensor("backbone.layers.0.mixer.A_log").unwrap().to_f32().unwrap(), vec![0.5, 1.0, -1.0]);
    assert_eq!(
        ck.tensor("backbone.layers.0.mixer.D").unwrap().to_bf16().unwrap(),
        vec![bf16::from_f32(1.5), bf16::from_f32(-3.0)]
    );
    let w = ck.tensor("backbone.layers.1.mixer.experts.0.up_proj.weight").unwrap();
    assert_eq!((w.dtype, w.bytes), (Dtype::F8E4M3, &[0x38u8, 0xb8, 0x40, 0x00][..]));
    assert!(msg(w.to_f32()).contains("is FP8"));
    assert_eq!(ck.tensor("backbone.layers.1.mixer.experts.0.up_proj.weight_scale").unwrap().scalar().unwrap(), 0.25);
    assert_eq!(ck.total_bytes(), 12 + 12 + 4 + 4 + 4);
}

#[test]
fn sharded_through_the_index() {
    let dir = tmpdir("sharded");
    let s = sample();
    write(&dir.join("model-00001-of-00002.safetensors"), &s[..2]);
    write(&dir.join("model-00002-of-00002.safetensors"), &s[2..]);
    let map: serde_json::Map<String, serde_json::Value> = s
        .iter()
        .enumerate()
        .map(|(i, t)| (t.0.to_string(), format!("model-0000{}-of-00002.safetensors", if i < 2 { 1 } else { 2 }).into()))
        .collect();
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::json!({"metadata": {}, "weight_map": map}).to_string(),
    )
    .unwrap();
    let ck = Checkpoint::open(&dir).unwrap();
    assert_eq!(ck.names().count(), 5);
    assert_eq!(ck.tensor("backbone.layers.0.mixer.D").unwrap().to_f32().unwrap(), vec![1.5, -3.0]);
    assert!(ck.tensor("backbone.layers.0.mixer.D").unwrap().path.ends_with("model-00002-of-00002.safetensors"));
}

#[test]
fn errors_name_the_file_and_tensor() {
    let dir = tmpdir("errors");
    write(&dir.join("model.safetensors"), &sample());
    let ck = Checkpoint::open(&dir).unwrap();
    let m = msg(ck.tensor("lm_head.weight"));
    assert!(m.contains("tensor `lm_head.weight` is missing") && m.contains(dir.to_str().unwrap()), "{m}");
    let m = msg(ck.expect("backbone.embeddings.weight", &[3, 2]));
    assert!(m.contains("`backbone.embeddings.weight` has shape [2, 3], expected [3, 2]"), "{m}");
    assert!(msg(ck.tensor("backbone.layers.0.mixer.A_log").unwrap().scalar()).contains("expected a single value"));

    let empty = tmpdir("empty");
    assert!(msg(Checkpoint::open(&empty)).contains("holds neither model.safetensors"));
}

#[test]
fn corrupt_files_are_errors() {
    let dir = tmpdir("corrupt");
    let path = dir.join("model.safetensors");
    write(&path, &sample());
    let whole = std::fs::read(&path).unwrap();
    // Truncated data, truncated header, a header length past the end, garbage JSON.
    let mut bad_json = whole.clone();
    bad_json[9] = b'!';
    for (what, bytes) in [
        ("truncated", whole[..whole.len() - 3].to_vec()),
        ("short", whole[..5].to_vec()),
        ("length", [u64::MAX.to_le_bytes().to_vec(), whole[8..].to_vec()].concat()),
        ("json", bad_json),
    ] {
        std::fs::write(&path, &bytes).unwrap();
        let m = msg(Checkpoint::open(&dir));
        assert!(m.contains("is not a valid safetensors file"), "{what}: {m}");
    }
    write(&path, &[("x", "I64", vec![1], vec![0; 8])]);
    assert!(msg(Checkpoint::open(&dir)).contains("tensor `x` has dtype I64"));
}

#[test]
fn inconsistent_index_is_an_error() {
    let dir = tmpdir("index");
    write(&dir.join("a.safetensors"), &sample()[..1]);
    let index = |map: serde_json::Value| {
        std::fs::write(dir.join("model.safetensors.index.json"), serde_json::json!({"weight_map": map}).to_string())
            .unwrap()
    };
    index(serde_json::json!({"backbone.embeddings.weight": "missing.safetensors"}));
    assert!(msg(Checkpoint::open(&dir)).contains("missing.safetensors: cannot be opened"));
    index(serde_json::json!({"backbone.embeddings.weight": "a.safetensors", "lm_head.weight": "a.safetensors"}));
    assert!(msg(Checkpoint::open(&dir)).contains("`lm_head.weight` is listed in the index but not in the shard"));
    index(serde_json::json!({"backbone.embeddings.weight": "../a.safetensors"}));
    assert!(msg(Checkpoint::open(&dir)).contains("outside the checkpoint"));
    write(&dir.join("b.safetensors"), &sample()[..1]);
    index(serde_json::json!({"backbone.embeddings.weight": "a.safetensors", "x": "b.safetensors"}));
    assert!(msg(Checkpoint::open(&dir)).contains("appears in more than one file"));
    std::fs::write(dir.join("model.safetensors.index.json"), "{").unwrap();
    assert!(msg(Checkpoint::open(&dir)).contains("is not a valid index"));
}

/// The in-memory synthetic checkpoint of the full Nemotron-3 Nano config: every tensor the
/// layout needs, at full shape, with one buffer per kind of tensor (experts and layers of a
/// kind share values), so it is built without 63 GB of host memory.
#[test]
fn nano_sized_synthetic_checkpoint_in_memory() {
    let json = include_str!("../assets/nano-30b-a3b.json");
    let config = model::Config::from_json(json).unwrap();
    let ck = model::synthetic::in_memory(&config, 3).unwrap();
    let layout = model::layout::Layout::trusting_values(&config, &ck).unwrap();
    assert_eq!(layout.layers.len(), 52);
    assert_eq!(config.layer_counts(), (23, 23, 6, 0));
    assert!(ck.total_bytes() > 60_000_000_000, "{} bytes", ck.total_bytes());
    let e0 = ck.tensor("backbone.layers.1.mixer.experts.0.up_proj.weight").unwrap();
    let e9 = ck.tensor("backbone.layers.3.mixer.experts.9.up_proj.weight").unwrap();
    assert_eq!((e0.shape, e0.dtype), (&[1856usize, 2688][..], Dtype::Bf16));
    assert_eq!(e0.bytes, e9.bytes, "one kind, one buffer");
    assert_ne!(
        e0.bytes,
        &ck.tensor("backbone.layers.1.mixer.shared_experts.up_proj.weight").unwrap().bytes[..e0.bytes.len()]
    );
}
