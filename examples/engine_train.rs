//! Measurement driver for the engine (not a test): trains a seeded GPT-2
//! of a given size on a synthetic byte corpus and prints the last step's
//! metrics line and the summary as JSON.
//!
//! ```text
//! cargo run --example engine_train -- LAYERS HIDDEN STEPS TIER [OVERLAP] [SWAP_DIR]
//!   TIER    = stage0 | cpu | nvme
//!   OVERLAP = on | off   (tierzero.overlap_optimizer and optimizer pipelining)
//! ```

use std::error::Error;
use std::path::PathBuf;

use serde_json::json;
use tierzero::config::{load_str, PathChecks, RunContext};
use tierzero::engine::{TokenData, Trainer, TrainerOptions};
use tierzero::model::ModelDir;

fn main() -> Result<(), Box<dyn Error>> {
    let a: Vec<String> = std::env::args().collect();
    if a.len() < 5 {
        return Err("usage: engine_train LAYERS HIDDEN STEPS TIER [on|off] [SWAP_DIR]".into());
    }
    let layers: usize = a[1].parse()?;
    let hidden: usize = a[2].parse()?;
    let steps: u64 = a[3].parse()?;
    let tier = a[4].as_str();
    let overlap = a.get(5).is_none_or(|s| s == "on");
    // CLIP env: gradient clipping norm (0 = off), default 1.0 like the
    // embedded default config.
    let clip: f64 = std::env::var("CLIP")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1.0);
    let root = PathBuf::from(a.get(6).cloned().unwrap_or_else(|| "engine-measure".into()));
    let model_dir = root.join(format!("model-{layers}x{hidden}"));
    let swap = root.join("swap");
    std::fs::create_dir_all(&model_dir)?;
    std::fs::create_dir_all(&swap)?;
    let cfg = json!({"model_type": "gpt2", "vocab_size": 256, "n_positions": 128,
        "n_embd": hidden, "n_layer": layers, "n_head": 4, "tie_word_embeddings": true});
    std::fs::write(model_dir.join("config.json"), cfg.to_string())?;
    let off = |_: &str| -> serde_json::Value {
        match tier {
            "nvme" => json!({"device": "nvme", "nvme_path": swap.to_str().unwrap_or("."),
                             "buffer_count": 16, "buffer_size": 4 * hidden * hidden,
                             "max_in_cpu": 0, "pipeline_read": overlap, "pipeline_write": overlap}),
            "cpu" => json!({"device": "cpu"}),
            _ => json!({"device": "none"}),
        }
    };
    let stage = if tier == "stage0" { 0 } else { 3 };
    let mut zero = json!({"stage": stage, "sub_group_size": 4 * hidden * hidden,
        "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 24 * hidden * hidden,
        "stage3_max_live_parameters": 48 * hidden * hidden, "stage3_max_reuse_distance": 0});
    if stage == 3 {
        zero["offload_param"] = off("param");
        zero["offload_optimizer"] = off("optim");
    }
    let ds = json!({
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": zero,
        "tierzero": {"overlap_optimizer": overlap, "checksums": false}
    });
    let run = RunContext {
        path_checks: PathChecks::CreateMissing,
        ..RunContext::default()
    };
    let loaded = load_str(&ds.to_string(), &run)?;
    let md = ModelDir::open(&model_dir, 1)?;
    let text: Vec<u8> = (0..200_000u32)
        .map(|i| b"the quick brown fox jumps over the lazy dog. "[(i as usize * 7) % 45])
        .collect();
    let data = TokenData::from_bytes(&text, std::path::Path::new("<synthetic>"));
    let mut opts = TrainerOptions::cpu(1, 64);
    opts.metrics_path = Some(root.join(format!("metrics-{tier}-{layers}x{hidden}.jsonl")));
    let mut t = Trainer::new(&loaded.config, &md, data, opts)?;
    let numel = t.model().numel();
    let mut last = None;
    for _ in 0..steps {
        last = Some(t.step()?.metrics);
    }
    let summary = t.finish()?;
    println!(
        "{}",
        json!({"params": numel, "tier": tier, "overlap": overlap,
               "last_step": last, "summary": summary})
    );
    Ok(())
}
