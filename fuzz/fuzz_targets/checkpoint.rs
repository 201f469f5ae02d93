//! The checkpoint opener and the layout: any bytes as `model.safetensors` beside the
//! fixture's config give a checkpoint and a layout, or an error, never a panic; a layout found
//! loads on the CPU backend.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use model::cpu::Cpu;
use model::layout::Layout;
use model::model::Model;
use model::weights::Checkpoint;

/// A directory of this process with the fixture's config.json.
fn dir() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = std::env::temp_dir().join(format!("nemotron-fuzz-checkpoint-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/tiny_nemotron_h/config.json");
        std::fs::copy(fixture, d.join("config.json")).unwrap();
        d
    })
}

fuzz_target!(|data: &[u8]| {
    let d = dir();
    std::fs::write(d.join("model.safetensors"), data).unwrap();
    let config = model::Config::from_dir(d).unwrap();
    let Ok(ck) = Checkpoint::open(d) else { return };
    let Ok(layout) = Layout::new(&config, &ck) else { return };
    let _ = Model::load(Cpu::default(), &config, &layout, 1, 8);
});
