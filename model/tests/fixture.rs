//! The checkpoint transformers 5.17 wrote (tests/fixtures/gen_nemotron_fixture.py): its
//! config.json and safetensors load, and every tensor the config needs is there.

use std::path::PathBuf;

use model::config::{Config, LayerKind};
use model::layout::Layout;
use model::weights::Checkpoint;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny_nemotron_h")
}

#[test]
fn transformers_checkpoint_loads() {
    let config = Config::from_dir(&fixture()).unwrap();
    use LayerKind::*;
    assert_eq!(config.layers, vec![Mamba, Moe, Attention, Mlp, Mamba, Moe]);
    assert_eq!(config.mamba.as_ref().unwrap().dt_limit, (0.0, f32::INFINITY));
    let ck = Checkpoint::open(&fixture()).unwrap();
    let layout = Layout::new(&config, &ck).unwrap();
    assert_eq!(layout.layers.len(), 6);
    assert_eq!(ck.names().count(), 71);
}
