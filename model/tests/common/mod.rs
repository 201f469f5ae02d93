//! The transformers fixture (tests/fixtures/tiny_nemotron_h), shared by the model's suites.
#![allow(dead_code)] // each suite that includes this module uses a part of it

use std::path::PathBuf;

use model::config::Config;
use model::weights::Checkpoint;
use serde::Deserialize;

/// One prompt of reference.json: float32 logits of every position and 8 greedy tokens.
#[derive(Deserialize)]
pub struct Case {
    pub prompt: Vec<u32>,
    pub logits: Vec<Vec<f64>>,
    pub greedy: Vec<u32>,
}

#[derive(Deserialize)]
struct Fixture {
    cases: Vec<Case>,
}

/// The fixture's directory.
pub fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny_nemotron_h")
}

/// The fixture's prompts and transformers' outputs.
pub fn cases() -> Vec<Case> {
    let text = std::fs::read_to_string(dir().join("reference.json")).expect("the fixture is in the repository");
    serde_json::from_str::<Fixture>(&text).expect("reference.json parses").cases
}

/// The fixture's config and mapped checkpoint.
pub fn open() -> (Config, Checkpoint) {
    (Config::from_dir(&dir()).unwrap(), Checkpoint::open(&dir()).unwrap())
}

/// The index of the largest logit (the lowest on ties).
pub fn argmax<T: PartialOrd>(v: &[T]) -> u32 {
    (0..v.len()).fold(0, |best, i| if v[i] > v[best] { i } else { best }) as u32
}
