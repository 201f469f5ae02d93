//! Config parsing: any text gives a config or an error, never a panic, and a config it
//! accepts has sizes the model can multiply (its derived widths do not overflow).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(c) = model::Config::from_json(&String::from_utf8_lossy(data)) else { return };
    if let Some(m) = &c.mamba {
        let _ = (m.inner(), m.conv_dim(), m.in_proj_width());
    }
    assert!(c.layers.len() <= model::config::MAX_LAYERS);
});
