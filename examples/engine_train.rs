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
use tierzero::engine::{Trainer, TrainerOptions};

mod measure;
use measure::{env_or, Setup, Tier};

fn main() -> Result<(), Box<dyn Error>> {
    let a: Vec<String> = std::env::args().collect();
    if a.len() < 5 {
        return Err("usage: engine_train LAYERS HIDDEN STEPS TIER [on|off] [SWAP_DIR]".into());
    }
    let tier_name = a[4].clone();
    let setup = Setup {
        layers: a[1].parse()?,
        hidden: a[2].parse()?,
        tier: Tier::parse(&tier_name)?,
        overlap: a.get(5).is_none_or(|s| s == "on"),
        // CLIP env: gradient clipping norm (0 = off), default 1.0 like the
        // embedded default config.
        clip: env_or("CLIP", 1.0),
        root: PathBuf::from(a.get(6).cloned().unwrap_or_else(|| "engine-measure".into())),
        shared: PathBuf::from(a.get(6).cloned().unwrap_or_else(|| "engine-measure".into())),
        micro_batch: env_or("MICRO", 4),
        compute_threads: None,
    };
    let steps: u64 = a[3].parse()?;
    let (config, md, data) = setup.build()?;
    let mut opts = TrainerOptions::cpu(1, env_or("SEQ_LEN", 64));
    opts.metrics_path = Some(setup.root.join(format!(
        "metrics-{tier_name}-{}x{}.jsonl",
        setup.layers, setup.hidden
    )));
    let mut t = Trainer::new(&config, &md, data, opts)?;
    let numel = t.model().numel();
    let mut last = None;
    for _ in 0..steps {
        last = Some(t.step()?.metrics);
    }
    let summary = t.finish()?;
    println!(
        "{}",
        json!({"params": numel, "tier": tier_name, "overlap": setup.overlap,
               "last_step": last, "summary": summary})
    );
    Ok(())
}
