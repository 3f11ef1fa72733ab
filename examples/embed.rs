//! Embedding tierzero in another Rust program (the README's "Library use"
//! shows the part between the `README` markers, verbatim; a test checks
//! that it stays so).
//!
//! Loads a `ds_config.json` (ZeRO-3, params and optimizer state on NVMe),
//! trains a seeded GPT-2 on the shipped corpus, then runs held-out text
//! through the trained model one unit at a time: fetch the unit's
//! parameters (from their home on NVMe), run it, release them.
//! The whole model is never gathered.
//!
//! ```text
//! cargo run --release --example embed [-- WORK_DIR]   (default ./tierzero-embed)
//! ```

use std::error::Error;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use serde_json::json;
use tierzero::config::{load_str, PathChecks, RunContext};
use tierzero::data::TokenData;
use tierzero::engine::{Trainer, TrainerOptions};
use tierzero::model::{ModelDir, UnitInput, UnitKind, UnitOutput};
use tierzero::run::DEFAULT_CORPUS;

fn main() -> Result<(), Box<dyn Error>> {
    let work = PathBuf::from(
        std::env::args()
            .nth(1)
            .unwrap_or_else(|| "tierzero-embed".into()),
    );
    // README:BEGIN
    // A HF model directory; config.json alone means a seeded init.
    let model_dir = work.join("model");
    std::fs::create_dir_all(&model_dir)?;
    let model_config = json!({"model_type": "gpt2", "vocab_size": 256, "n_positions": 64,
        "n_embd": 64, "n_layer": 2, "n_head": 4});
    std::fs::write(model_dir.join("config.json"), model_config.to_string())?;
    let model = ModelDir::open(&model_dir, 1)?;

    // The ds_config.json you use with DeepSpeed: ZeRO-3, params and
    // optimizer state offloaded to NVMe.
    let swap = work.join("swap");
    let ds_config = json!({
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-3}},
        "zero_optimization": {"stage": 3,
            // Every param's home on NVMe, small ones too (by default up to
            // 1e9 elements stay in pinned host memory, and params under
            // 1e5 elements stay resident).
            "offload_param": {"device": "nvme", "nvme_path": swap, "max_in_cpu": 0},
            "offload_optimizer": {"device": "nvme", "nvme_path": swap},
            "stage3_param_persistence_threshold": 0}
    });
    let run = RunContext {
        path_checks: PathChecks::CreateMissing, // mkdir -p the nvme_path
        ..RunContext::default()
    };
    let config = load_str(&ds_config.to_string(), &run)?.config;

    // Train on 90% of the corpus, byte-level, 64 tokens per sample.
    let (train_text, held_out) = DEFAULT_CORPUS.split_at(DEFAULT_CORPUS.len() / 10 * 9);
    let data = TokenData::from_bytes(train_text, Path::new("corpus"));
    let mut trainer = Trainer::new(&config, &model, data, TrainerOptions::cpu(1, 64))?;
    // Any thread (a UI, a timer, your own signal handling) may ask for a
    // stop; the step in progress finishes and reports it.
    let stop = trainer.stop_handle();
    for _ in 0..30 {
        let report = trainer.step()?;
        let m = &report.metrics;
        println!("step {} loss {:.4}", m.step, m.loss);
        if m.step == 25 {
            stop.request(); // stop early, at the next step boundary
        }
        if report.stop.is_some() {
            break; // then trainer.save_on_stop(dir) keeps this step
        }
    }

    // Held-out loss, streaming the trained weights one unit at a time.
    let tokens: Vec<u32> = held_out[..65].iter().map(|&b| u32::from(b)).collect();
    let ids = Tensor::from_vec(tokens[..64].to_vec(), (1, 64), &Device::Cpu)?;
    let targets = Tensor::from_vec(tokens[1..].to_vec(), (1, 64), &Device::Cpu)?;
    let net = trainer.model().clone();
    let mut hidden = None;
    for unit in net.units() {
        let params = trainer.fetch_unit(unit.id)?; // from NVMe, or a pinned buffer still holding it
        let input = match (&hidden, unit.kind) {
            (None, _) => UnitInput::Tokens(&ids),
            (Some(h), UnitKind::Head) => UnitInput::HiddenWithTargets {
                hidden: h,
                targets: &targets,
            },
            (Some(h), _) => UnitInput::Hidden(h),
        };
        match net.forward_unit(unit.id, &params, input)? {
            UnitOutput::Hidden(h) => hidden = Some(h),
            UnitOutput::Loss(l) => println!("held-out loss {:.4}", l.to_scalar::<f32>()?),
        }
        trainer.release_unit(unit.id)?; // its home stays on NVMe
    }
    let summary = trainer.finish()?;
    println!("weight_sha256 {}", summary.weight_sha256);
    // README:END
    Ok(())
}
