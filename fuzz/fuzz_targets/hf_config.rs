//! The HF config.json parser on arbitrary text, then the model built from an
//! accepted config (parameter specs: shapes and element counts). Absurd
//! sizes must be refused before anything is allocated.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tierzero::model::{Model, ModelConfig};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok((config, _unknown)) = ModelConfig::from_hf_json(text) {
        if let Ok(model) = Model::new(config) {
            let _ = model.numel();
        }
    }
});
