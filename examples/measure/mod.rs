//! Shared set-up of the measurement examples (`engine_train`, `overlap`):
//! a seeded GPT-2 of a given size, a synthetic byte corpus, and a
//! `ds_config` for one tier.

// Each example uses a subset of these helpers.
#![allow(dead_code)]
use std::error::Error;
use std::path::{Path, PathBuf};

use serde_json::json;
use tierzero::config::{load_str, Config, PathChecks, RunContext};
use tierzero::data::TokenData;
use tierzero::model::ModelDir;

/// Where params and optimizer state live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    /// Stage 0, everything in memory.
    Stage0,
    /// Stage 3, offloaded to pinned host memory.
    Cpu,
    /// Stage 3, offloaded to NVMe.
    Nvme,
}

impl Tier {
    /// `stage0 | cpu | nvme`.
    pub fn parse(s: &str) -> Result<Self, Box<dyn Error>> {
        match s {
            "stage0" => Ok(Tier::Stage0),
            "cpu" => Ok(Tier::Cpu),
            "nvme" => Ok(Tier::Nvme),
            other => Err(format!("tier `{other}`: expected stage0, cpu or nvme").into()),
        }
    }
}

/// One measured configuration.
#[derive(Debug, Clone)]
pub struct Setup {
    /// Transformer blocks.
    pub layers: usize,
    /// Width.
    pub hidden: usize,
    /// Tier.
    pub tier: Tier,
    /// `tierzero.overlap_optimizer` and optimizer pipelining.
    pub overlap: bool,
    /// Gradient clipping norm (0 = off).
    pub clip: f64,
    /// Root directory: model dirs and `swap/` go under it.
    pub root: PathBuf,
    /// Where what several setups share goes (`PRETRAIN`'s weights).
    pub shared: PathBuf,
    /// `train_micro_batch_size_per_gpu` (rows of `SEQ_LEN` tokens).
    pub micro_batch: usize,
    /// `tierzero.compute_threads` (`None` = "auto").
    pub compute_threads: Option<u32>,
}

impl Setup {
    /// The validated config, the model dir and the corpus.
    pub fn build(&self) -> Result<(Config, ModelDir, TokenData), Box<dyn Error>> {
        let (layers, hidden) = (self.layers, self.hidden);
        let model_dir = self.root.join(format!("model-{layers}x{hidden}"));
        let swap = self.root.join("swap");
        std::fs::create_dir_all(&model_dir)?;
        std::fs::create_dir_all(&swap)?;
        // Positions for `SEQ_LEN` tokens (at least 128).
        let positions = env_or("SEQ_LEN", 64usize).max(128);
        let cfg = json!({"model_type": "gpt2", "vocab_size": 256, "n_positions": positions,
            "n_embd": hidden, "n_layer": layers, "n_head": 4, "tie_word_embeddings": true});
        std::fs::write(model_dir.join("config.json"), cfg.to_string())?;
        // `PRETRAIN=N`: start from weights trained N steps (the model dir
        // then holds config.json alone and seeds the pre-training).
        let pretrain: u64 = env_or("PRETRAIN", 0);
        let model_dir = if pretrain > 0 {
            pretrained(&self.shared, &model_dir, layers, hidden, pretrain)?
        } else {
            model_dir
        };
        let off = match self.tier {
            Tier::Nvme => json!({"device": "nvme", "nvme_path": path_str(&swap)?,
                                 "buffer_count": 16, "buffer_size": 4 * hidden * hidden,
                                 "max_in_cpu": 0, "pipeline_read": self.overlap,
                                 "pipeline_write": self.overlap}),
            Tier::Cpu => json!({"device": "cpu"}),
            Tier::Stage0 => json!({"device": "none"}),
        };
        let stage = if self.tier == Tier::Stage0 { 0 } else { 3 };
        let mut zero = json!({"stage": stage, "sub_group_size": 4 * hidden * hidden,
            "stage3_param_persistence_threshold": 10 * hidden,
            "stage3_prefetch_bucket_size": env_or("BUCKET_H2", 24) * hidden * hidden,
            "stage3_max_live_parameters": env_or("LIVE_H2", 48) * hidden * hidden,
            "stage3_max_reuse_distance": env_or("REUSE_H2", 0) * hidden * hidden});
        if stage == 3 {
            zero["offload_param"] = off.clone();
            zero["offload_optimizer"] = off;
        }
        let mut ds = json!({
            "train_micro_batch_size_per_gpu": self.micro_batch, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": env_or("LR", 1e-3)}},
            "zero_optimization": zero,
            "tierzero": {"overlap_optimizer": self.overlap, "checksums": false}
        });
        // The device arms stream: every param crosses at each use
        // (`tierzero.device_cache_bytes` 0), unless `DEVICE_CACHE` says
        // "auto" or a byte count.
        ds["tierzero"]["device_cache_bytes"] = match std::env::var("DEVICE_CACHE") {
            Ok(v) if v == "auto" => json!("auto"),
            Ok(v) => json!(v
                .parse::<u64>()
                .map_err(|e| format!("DEVICE_CACHE={v}: {e}"))?),
            Err(_) => json!(0),
        };
        // `PRECISION=bf16`: bf16.enabled (bf16 params and GEMM operands).
        if std::env::var("PRECISION").as_deref() == Ok("bf16") {
            ds["bf16"] = json!({"enabled": true});
        }
        if let Some(qd) = std::env::var("AIO_QD")
            .ok()
            .and_then(|v| v.parse::<u32>().ok())
        {
            ds["aio"] = json!({"queue_depth": qd});
        }
        // `WARMUP=N`: a linear warm-up from 0 to `LR` over N steps.
        let warmup: u64 = env_or("WARMUP", 0);
        if warmup > 0 {
            ds["scheduler"] = json!({"type": "WarmupLR", "params": {"warmup_min_lr": 0.0,
                "warmup_max_lr": env_or("LR", 1e-3), "warmup_num_steps": warmup,
                "warmup_type": "linear"}});
        }
        if self.clip > 0.0 {
            ds["gradient_clipping"] = json!(self.clip);
        }
        if let Some(n) = std::env::var("OPT_BUFFERS")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
        {
            if self.tier == Tier::Nvme {
                ds["zero_optimization"]["offload_optimizer"]["buffer_count"] = json!(n);
            }
        }
        if let Some(n) = std::env::var("PARAM_BUFFERS")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
        {
            if self.tier == Tier::Nvme {
                ds["zero_optimization"]["offload_param"]["buffer_count"] = json!(n);
            }
        }
        if let Ok(v) = std::env::var("OPT_RESIDENT") {
            ds["tierzero"]["optimizer_resident_bytes"] = match v.parse::<u64>() {
                Ok(n) => json!(n),
                Err(_) => json!(v),
            };
        }
        if let Ok(v) = std::env::var("SPEC_POOL") {
            ds["tierzero"]["speculation_pool_bytes"] = match v.parse::<u64>() {
                Ok(n) => json!(n),
                Err(_) => json!(v),
            };
        }
        if let Some(n) = self.compute_threads {
            ds["tierzero"]["compute_threads"] = json!(n);
        }
        // `ACT_BUDGET`: `tierzero.activation_budget_bytes` (bytes or
        // "auto"); default 0, every block recomputed, so that the real step
        // does the I/O the I/O-alone run does (a kept block is not fetched
        // again in backward, and without compute nothing is kept).
        ds["tierzero"]["activation_budget_bytes"] = match std::env::var("ACT_BUDGET") {
            Ok(v) => match v.parse::<u64>() {
                Ok(n) => json!(n),
                Err(_) => json!(v),
            },
            Err(_) => json!(0),
        };
        match std::env::var("PIN").as_deref() {
            Ok("off") => ds["tierzero"]["pin_threads"] = json!(false),
            Ok("on") => ds["tierzero"]["pin_threads"] = json!(true),
            _ => {}
        }
        match std::env::var("SPECULATIVE").as_deref() {
            Ok("off") => ds["tierzero"]["speculative_step"] = json!(false),
            Ok("on") => ds["tierzero"]["speculative_step"] = json!(true),
            _ => {}
        }
        let run = RunContext {
            path_checks: PathChecks::CreateMissing,
            ..RunContext::default()
        };
        let loaded = load_str(&ds.to_string(), &run)?;
        let md = ModelDir::open(&model_dir, 1)?;
        Ok((loaded.config, md, corpus()))
    }
}

/// The synthetic byte corpus: a sentence's bytes in a stride-7 cycle of
/// 45, which a small model learns to a loss near 0.
fn corpus() -> TokenData {
    let text: Vec<u8> = (0..200_000u32)
        .map(|i| b"the quick brown fox jumps over the lazy dog. "[(i as usize * 7) % 45])
        .collect();
    TokenData::from_bytes(&text, Path::new("<synthetic>"))
}

/// A model dir with weights pre-trained from `seeded` (config.json only)
/// for `steps` steps: stage 0, AdamW at `PRETRAIN_LR` (default 1e-3),
/// clipping 1.0, `MICRO` rows of `SEQ_LEN` tokens, exported as fp32. Kept
/// under `root` and reused by later runs. Fine-tuning from it at a small
/// `LR` (e.g. 2e-5) gives gradient norms mostly below 1, as fine-tuning a
/// pretrained model does (with random weights they stay at 2-27).
fn pretrained(
    root: &Path,
    seeded: &Path,
    layers: usize,
    hidden: usize,
    steps: u64,
) -> Result<PathBuf, Box<dyn Error>> {
    let lr: f64 = env_or("PRETRAIN_LR", 1e-3);
    let micro: usize = env_or("MICRO", 4);
    let seq_len: usize = env_or("SEQ_LEN", 64);
    let dir = root.join(format!(
        "pretrained-{layers}x{hidden}-{steps}-lr{lr}-m{micro}-s{seq_len}"
    ));
    let weights = dir.join("model.safetensors");
    if weights.exists() {
        return Ok(dir);
    }
    let ds = json!({
        "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": lr}},
        "zero_optimization": {"stage": 0},
        "tierzero": {"checksums": false}
    });
    let config = load_str(&ds.to_string(), &RunContext::default())?.config;
    let md = ModelDir::open(seeded, 1)?;
    let opts = tierzero::engine::TrainerOptions::cpu(1, seq_len);
    let mut t = tierzero::engine::Trainer::new(&config, &md, corpus(), opts)?;
    eprintln!(
        "pre-training {layers}x{hidden} for {steps} steps at lr {lr} into {}",
        dir.display()
    );
    for _ in 0..steps {
        t.step()?;
    }
    let ckpt_root = root.join("pretrain-ckpt");
    let step_dir = t.save_checkpoint(&ckpt_root)?;
    t.finish()?;
    let ckpt = tierzero::checkpoint::Checkpoint::open(&step_dir)?;
    tierzero::checkpoint::export_safetensors(&ckpt, &weights, candle_core::DType::F32)?;
    std::fs::remove_dir_all(&ckpt_root)?;
    Ok(dir)
}

fn path_str(p: &Path) -> Result<&str, Box<dyn Error>> {
    p.to_str()
        .ok_or_else(|| format!("{} is not UTF-8", p.display()).into())
}

/// `name` from the environment, parsed, or `default`.
pub fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Median of a non-empty list (the lower middle for even lengths).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get((v.len().max(1) - 1) / 2).copied().unwrap_or(f64::NAN)
}

/// The median of `f` over steps' metrics.
pub fn med(
    ms: &[tierzero::engine::StepMetrics],
    f: impl Fn(&tierzero::engine::StepMetrics) -> f64,
) -> f64 {
    median(ms.iter().map(f).collect())
}
