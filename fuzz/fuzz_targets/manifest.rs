//! The checkpoint manifest reader on arbitrary text. Twice: as given (the
//! manifest's own crc32c must refuse almost everything, without panicking),
//! and re-sealed with a correct crc, so the fuzzer reaches the structure
//! checks behind it: field types, path rules (`..`, absolute paths), region
//! bounds and overlaps, shard coverage, the model built from the manifest's
//! config. Nothing may panic or allocate without bound.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use tierzero::checkpoint::{check_relative, seal_manifest_value, Manifest};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let path = Path::new("fuzz/step-00000001/manifest.json");
    let _ = Manifest::parse(text, path);
    if let Ok(value) = serde_json::from_str::<serde_json::Value>(text) {
        if let Ok(sealed) = seal_manifest_value(value) {
            if let Ok(sealed) = std::str::from_utf8(&sealed) {
                if let Ok(m) = Manifest::parse(sealed, path) {
                    if let Ok(model) = m.build_model(path) {
                        let _ = m.validate(&model, path);
                    }
                }
            }
        }
    }
    let _ = check_relative(text);
});
