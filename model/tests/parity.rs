//! The f64 reference model against transformers 5.17 on the fixture checkpoint
//! (tests/fixtures/tiny_nemotron_h, float32 logits of every prompt position and 8 greedy
//! tokens; prompts shorter than one chunk, where transformers' slow path is exact).

mod common;

use common::argmax;
use model::layout::Layout;
use model::reference::Reference;
use nemotron_rs::assert_close;

/// transformers computes in float32 (from the same bf16 weights), the reference in f64: the
/// logits (O(1) to O(10) here) differ by float32 rounding through 6 layers, about 1e-5
/// relative, printed below. A wrong head-to-group map, routing or gate moves them by O(1).
const RTOL: f64 = 1e-4;
const ATOL: f64 = 1e-4;

#[test]
fn reference_matches_transformers() {
    let (config, ck) = common::open();
    let reference = Reference::new(&config, &Layout::new(&config, &ck).unwrap()).unwrap();
    let (mut compared, mut tokens) = (0, 0);
    for (i, case) in common::cases().iter().enumerate() {
        let mut state = reference.new_state();
        let mut got = Vec::new();
        for &t in &case.prompt {
            got.push(reference.step(&mut state, t).unwrap());
        }
        let want: Vec<f64> = case.logits.iter().flatten().copied().collect();
        let got = got.concat();
        let noise = got.iter().zip(&want).map(|(g, w)| (g - w).abs()).fold(0.0, f64::max);
        let scale = want.iter().map(|w| w.abs()).fold(0.0, f64::max);
        println!(
            "prompt {i}: max |f64 - transformers| = {noise:.2e}, max |logit| = {scale:.2}, band {ATOL:e} + {RTOL:e} * |logit|"
        );
        compared += assert_close(&format!("prompt {i} logits"), &got, &want, ATOL, RTOL);
        let mut next = argmax(&got[got.len() - config.vocab_size..]);
        let mut greedy = Vec::new();
        for _ in 0..case.greedy.len() {
            greedy.push(next);
            next = argmax(&reference.step(&mut state, next).unwrap());
        }
        assert_eq!(greedy, case.greedy, "prompt {i}: greedy tokens");
        tokens += greedy.len();
    }
    println!("f64 reference vs transformers: {compared} logits compared, {tokens}/{tokens} greedy tokens matched");
}
