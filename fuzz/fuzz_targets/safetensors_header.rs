//! The safetensors loader on arbitrary bytes: the bytes become
//! `model.safetensors` next to a fixed tiny GPT-2 `config.json`, the
//! directory is opened (header, offsets, dtypes, shapes checked) and, if it
//! is accepted, every tensor is loaded. The directory lives on tmpfs when
//! there is one, and is reused across runs.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use candle_core::{DType, Device};
use libfuzzer_sys::fuzz_target;
use tierzero::model::ModelDir;

/// Vocabulary 4, 2 positions, width 2, one layer, one head, inner 2: the
/// smallest GPT-2 whose every tensor a short input can describe.
const CONFIG: &str = r#"{"model_type":"gpt2","vocab_size":4,"n_positions":2,"n_embd":2,
"n_layer":1,"n_head":1,"n_inner":2,"tie_word_embeddings":true}"#;

fn dir() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let base = if std::path::Path::new("/dev/shm").is_dir() {
            PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        let d = base.join(format!("tierzero-fuzz-st-{}", std::process::id()));
        std::fs::create_dir_all(&d).expect("fuzz dir");
        std::fs::write(d.join("config.json"), CONFIG).expect("config.json");
        d
    })
}

fuzz_target!(|data: &[u8]| {
    let d = dir();
    std::fs::write(d.join("model.safetensors"), data).expect("write model.safetensors");
    if let Ok(md) = ModelDir::open(d, 0) {
        let _ = md.load_all(DType::F32, &Device::Cpu);
    }
});
