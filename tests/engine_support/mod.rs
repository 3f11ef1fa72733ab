//! Shared helpers for the `engine_*` integration tests: a tiny GPT-2 model
//! directory (config only: seeded init), a byte corpus, ds_config builders
//! and a runner that trains and collects every step's loss and the final
//! weight hash.
#![allow(dead_code, reason = "each test binary uses a subset")]
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test helpers")]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use serde_json::{json, Value};
use tierzero::config::{load_str, PathChecks, RunContext};
use tierzero::data::TokenData;
use tierzero::engine::{StepMetrics, Trainer, TrainerOptions};
use tierzero::model::ModelDir;

static NEXT: AtomicUsize = AtomicUsize::new(0);

/// A fresh directory under the cargo target tmp dir.
pub fn scratch(tag: &str) -> PathBuf {
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let d = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("engine-{tag}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A scratch directory ([`scratch`]) removed when dropped: a property
/// test's case's swap files and checkpoints (hundreds of cases a run).
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(tag: &str) -> Self {
        Scratch(scratch(tag))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The process's one copy of a tiny model made by `make` under `key`
/// (each property test case takes it again).
pub fn model_once(key: &'static str, make: impl FnOnce() -> PathBuf) -> PathBuf {
    static DIRS: std::sync::OnceLock<
        std::sync::Mutex<std::collections::HashMap<&'static str, PathBuf>>,
    > = std::sync::OnceLock::new();
    DIRS.get_or_init(Default::default)
        .lock()
        .unwrap()
        .entry(key)
        .or_insert_with(make)
        .clone()
}

/// The property tests' config: `cases` cases (or `PROPTEST_CASES`, to
/// draw more by hand), no regression files in the tree (a failure prints
/// its smallest case), and shrinking bounded to 2 minutes.
pub fn props_config(cases: u32) -> proptest::test_runner::Config {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(cases);
    proptest::test_runner::Config {
        failure_persistence: None,
        max_shrink_time: 120_000,
        ..proptest::test_runner::Config::with_cases(cases)
    }
}

/// What a simulated device still holds, or a staging buffer changed
/// under its copy (`None`: everything came back: device bytes, copies
/// both ways, staging buffers, page pins).
pub fn sim_leftovers(p: &tierzero::engine::device::sim::SimProbe) -> Option<String> {
    let checks = [
        (p.used_bytes(), 0, "device bytes left"),
        (p.in_flight(), 0, "copies left"),
        (p.downloads_in_flight(), 0, "downloads left"),
        (
            p.free_staging() as u64,
            p.staging_slots() as u64,
            "staging buffers lent",
        ),
        (p.violations(), 0, "a staging buffer changed mid-copy"),
        (p.pins_held(), 0, "page pins held by copies"),
    ];
    checks
        .into_iter()
        .find(|(got, want, _)| got != want)
        .map(|(got, want, what)| format!("{what}: {got} (want {want})"))
}

/// The tiny models the property tests draw from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TinyArch {
    /// GPT-2 with its head tied to the token table (8 192 elements, the
    /// largest param), 2 layers, width 32.
    Gpt2,
    /// Llama (untied, GQA), 2 layers, width 32.
    Llama,
}

impl TinyArch {
    /// The process's one copy of the model ([`model_once`]).
    pub fn model(self) -> PathBuf {
        match self {
            TinyArch::Gpt2 => model_once("props-gpt2", || tiny_gpt2_dir("props", 2, 32)),
            TinyArch::Llama => model_once("props-llama", || tiny_llama_dir("props")),
        }
    }
}

/// The blocks of the model in `dir` (its units but the embedding and
/// the head).
#[allow(dead_code, reason = "not every test binary counts them")]
pub fn blocks_in(dir: &Path) -> u64 {
    tierzero::model::ModelDir::open(dir, 1)
        .unwrap()
        .model()
        .units()
        .iter()
        .filter(|u| matches!(u.kind, tierzero::model::UnitKind::Block { .. }))
        .count() as u64
}

/// A GPT-2 with byte vocabulary, 2 layers, width 32.
pub fn tiny_gpt2_dir(tag: &str, n_layer: usize, n_embd: usize) -> PathBuf {
    let d = scratch(&format!("model-{tag}"));
    let cfg = json!({
        "model_type": "gpt2", "vocab_size": 256, "n_positions": 32, "n_embd": n_embd,
        "n_layer": n_layer, "n_head": 2, "n_inner": n_embd * 2, "tie_word_embeddings": true
    });
    std::fs::write(d.join("config.json"), cfg.to_string()).unwrap();
    d
}

/// A Llama (RMSNorm, rotary, SwiGLU, GQA) with byte vocabulary.
pub fn tiny_llama_dir(tag: &str) -> PathBuf {
    let d = scratch(&format!("llama-{tag}"));
    let cfg = json!({
        "model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 32, "rope_theta": 10000.0, "tie_word_embeddings": false
    });
    std::fs::write(d.join("config.json"), cfg.to_string()).unwrap();
    d
}

/// A deterministic, text-like byte corpus.
pub fn corpus() -> TokenData {
    let words = [
        "the ",
        "engine ",
        "streams ",
        "layers ",
        "from ",
        "nvme ",
        "and ",
        "steps ",
        "adam ",
        "on ",
        "the ",
        "cpu ",
        "while ",
        "backward ",
        "runs. ",
    ];
    let mut s = String::new();
    let mut x: u64 = 12345;
    while s.len() < 6000 {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        s.push_str(words[(x >> 33) as usize % words.len()]);
    }
    TokenData::from_bytes(s.as_bytes(), Path::new("<corpus>"))
}

/// Variant knobs of a run.
#[derive(Debug, Clone)]
pub struct Knobs {
    pub stage: u8,
    /// "none", "cpu" or "nvme".
    pub param: &'static str,
    pub optim: &'static str,
    pub gas: u64,
    /// "fp32", "bf16", "fp16".
    pub precision: &'static str,
    pub clip: f64,
    pub overlap: bool,
    pub pipeline: bool,
    pub sub_group: u64,
    pub persistence: u64,
    pub device_cache_bytes: u64,
    pub initial_scale_power: u32,
    pub pinned_budget: Option<u64>,
    pub param_buffer_numel: u64,
    pub param_buffer_count: u64,
    pub max_in_cpu: u64,
    /// `tierzero.optimizer_resident_bytes` (`None`: absent, auto).
    pub optimizer_resident_bytes: Option<u64>,
    /// `stage3_prefetch_bucket_size` and `stage3_max_live_parameters`.
    /// The defaults (10 000 and 20 000) are small beside the tiny test
    /// models (a block of width 32 is about 12 500 elements), so params
    /// are released and read again within a step, and the read path is
    /// exercised in every step, not only the first.
    pub prefetch_bucket: u64,
    pub max_live: u64,
    /// `tierzero.pin_threads` (`None`: absent, auto).
    pub pin_threads: Option<bool>,
    /// `tierzero.compute_threads` (`None`: absent, auto).
    pub compute_threads: Option<u32>,
    /// `tierzero.speculative_step` (`None`: absent, auto).
    pub speculative: Option<bool>,
    /// `tierzero.speculation_pool_bytes` (`None`: absent, auto).
    pub speculation_pool_bytes: Option<u64>,
    /// `tierzero.activation_budget_bytes` (`None`: absent, auto).
    pub activation_budget: Option<u64>,
}

impl Default for Knobs {
    fn default() -> Self {
        Knobs {
            stage: 0,
            param: "none",
            optim: "none",
            gas: 1,
            precision: "fp32",
            clip: 0.0,
            overlap: true,
            pipeline: true,
            sub_group: 3000,
            persistence: 0,
            device_cache_bytes: 0,
            initial_scale_power: 16,
            pinned_budget: None,
            param_buffer_numel: 20000,
            param_buffer_count: 4,
            max_in_cpu: 0,
            optimizer_resident_bytes: None,
            prefetch_bucket: 10_000,
            max_live: 20_000,
            pin_threads: None,
            compute_threads: None,
            speculative: None,
            speculation_pool_bytes: None,
            activation_budget: None,
        }
    }
}

impl Knobs {
    /// Stage 3 with params and optimizer state on NVMe.
    pub fn nvme() -> Self {
        Knobs {
            stage: 3,
            param: "nvme",
            optim: "nvme",
            ..Knobs::default()
        }
    }
    /// Stage 3 with params and optimizer state in host memory.
    pub fn cpu() -> Self {
        Knobs {
            stage: 3,
            param: "cpu",
            optim: "cpu",
            ..Knobs::default()
        }
    }
    /// The config's precision, read from the config `ds_config` writes.
    pub fn precision(&self) -> tierzero::config::Precision {
        let cfg = ds_config(self, Path::new("/nonexistent-swap"), 1);
        let run = RunContext {
            path_checks: PathChecks::Skip,
            ..RunContext::default()
        };
        load_str(&cfg.to_string(), &run).unwrap().config.precision
    }
    /// The device units' GEMM operands for `precision` (what
    /// `tierzero train --device` picks for the config's precision).
    pub fn gemm_dtype(&self) -> tierzero_gpu::unit::GemmDtype {
        self.precision().gemm_dtype()
    }
    /// The params' storage dtype for `precision`.
    pub fn storage_dtype(&self) -> candle_core::DType {
        self.precision().storage_dtype()
    }
}

pub fn ds_config(k: &Knobs, swap: &Path, total_steps: u64) -> Value {
    let off = |dev: &str| -> Value {
        if dev == "nvme" {
            json!({"device": "nvme", "nvme_path": swap.to_str().unwrap()})
        } else {
            json!({"device": dev})
        }
    };
    let mut op = off(k.param);
    if k.param == "nvme" {
        op["buffer_count"] = json!(k.param_buffer_count);
        op["buffer_size"] = json!(k.param_buffer_numel);
        op["max_in_cpu"] = json!(k.max_in_cpu);
        op["pin_memory"] = json!(true);
    }
    let mut oo = off(k.optim);
    if k.optim == "nvme" {
        oo["pipeline_read"] = json!(k.pipeline);
        oo["pipeline_write"] = json!(k.pipeline);
    }
    let mut zero = json!({
        "stage": k.stage,
        "sub_group_size": k.sub_group,
        "stage3_param_persistence_threshold": k.persistence,
        "stage3_prefetch_bucket_size": k.prefetch_bucket,
        "stage3_max_live_parameters": k.max_live,
        "stage3_max_reuse_distance": 1000,
    });
    if k.stage == 3 {
        zero["offload_param"] = op;
    }
    zero["offload_optimizer"] = oo;
    let mut tz = json!({
        "overlap_optimizer": k.overlap,
        "device_cache_bytes": k.device_cache_bytes,
        "checksums": true,
        "io_backend": "auto"
    });
    if let Some(b) = k.pinned_budget {
        tz["pinned_budget_bytes"] = json!(b);
    }
    if let Some(b) = k.optimizer_resident_bytes {
        tz["optimizer_resident_bytes"] = json!(b);
    }
    if let Some(n) = k.compute_threads {
        tz["compute_threads"] = json!(n);
    }
    if let Some(p) = k.pin_threads {
        tz["pin_threads"] = json!(p);
    }
    if let Some(s) = k.speculative {
        tz["speculative_step"] = json!(s);
    }
    if let Some(b) = k.speculation_pool_bytes {
        tz["speculation_pool_bytes"] = json!(b);
    }
    if let Some(b) = k.activation_budget {
        tz["activation_budget_bytes"] = json!(b);
    }
    json!({
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": k.gas,
        "gradient_clipping": k.clip,
        "bf16": {"enabled": k.precision == "bf16"},
        "fp16": {"enabled": k.precision == "fp16", "loss_scale": 0,
                 "initial_scale_power": k.initial_scale_power, "loss_scale_window": 4,
                 "hysteresis": 2, "min_loss_scale": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95],
                      "eps": 1e-8, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0,
                      "warmup_max_lr": 3e-3, "warmup_num_steps": 4,
                      "total_num_steps": total_steps, "warmup_type": "linear"}},
        "zero_optimization": zero,
        "tierzero": tz
    })
}

/// Result of a run.
#[derive(Debug, Clone)]
pub struct Run {
    pub steps: Vec<StepMetrics>,
    pub sha256: String,
    pub rerecords: u64,
    /// The summary's whole-run totals (per-step bytes depend on timing:
    /// the optimizer tail overlaps the next step).
    pub bytes_read: std::collections::BTreeMap<String, u64>,
    pub bytes_written: std::collections::BTreeMap<String, u64>,
    /// The activation policy's last decision.
    pub activations: Option<tierzero::engine::ActivationDecision>,
}

impl Run {
    pub fn loss_bits(&self) -> Vec<u32> {
        self.steps.iter().map(|s| s.loss.to_bits()).collect()
    }
    pub fn nvme_read_bytes(&self) -> u64 {
        self.bytes_read["nvme"]
    }
    pub fn nvme_written_bytes(&self) -> u64 {
        self.bytes_written["nvme"]
    }
    pub fn cpu_read_bytes(&self) -> u64 {
        self.steps.iter().map(|s| s.bytes_read["cpu"]).sum()
    }
}

pub fn build(model_dir: &Path, k: &Knobs, seed: u64, seq: usize, total: u64) -> Trainer {
    build_with(model_dir, k, TrainerOptions::cpu(seed, seq), total)
}

/// [`build`] with explicit trainer options.
pub fn build_with(model_dir: &Path, k: &Knobs, opts: TrainerOptions, total: u64) -> Trainer {
    try_build_in(model_dir, k, opts, total, &scratch("swap")).unwrap()
}

/// [`build_with`] with the swap files under `dir`, or why it was refused
/// (the config's error or the engine's, as text).
pub fn try_build_in(
    model_dir: &Path,
    k: &Knobs,
    opts: TrainerOptions,
    total: u64,
    dir: &Path,
) -> Result<Trainer, String> {
    let l = loaded_in(k, total, dir)?;
    let md = ModelDir::open(model_dir, opts.seed).unwrap();
    Trainer::new(&l.config, &md, corpus(), opts).map_err(|e| e.to_string())
}

/// The config of `k` with its swap files under `dir`, read as the CLI
/// reads it (missing directories created).
pub fn loaded_in(k: &Knobs, total: u64, dir: &Path) -> Result<tierzero::config::Loaded, String> {
    let cfg = ds_config(k, dir, total);
    let run = RunContext {
        path_checks: PathChecks::CreateMissing,
        ..RunContext::default()
    };
    load_str(&cfg.to_string(), &run).map_err(|e| e.to_string())
}

/// A trainer resumed from the checkpoint at `ckpt` (a save dir or a step
/// dir), with the same knobs as [`build`] and fresh swap files.
pub fn resume(ckpt: &Path, k: &Knobs, seed: u64, seq: usize, total: u64) -> Trainer {
    let swap = scratch("swap");
    let cfg = ds_config(k, &swap, total);
    let run = RunContext {
        path_checks: PathChecks::CreateMissing,
        ..RunContext::default()
    };
    let loaded = load_str(&cfg.to_string(), &run).unwrap();
    let c = tierzero::checkpoint::Checkpoint::open(ckpt).unwrap();
    Trainer::resume(&loaded.config, &c, corpus(), TrainerOptions::cpu(seed, seq)).unwrap()
}

/// Trains `steps` steps; `seq_at(step)` gives each step's sequence length.
pub fn train(
    model_dir: &Path,
    k: &Knobs,
    seed: u64,
    steps: u64,
    seq_at: impl Fn(u64) -> usize,
) -> Run {
    train_with(
        model_dir,
        k,
        TrainerOptions::cpu(seed, seq_at(0)),
        steps,
        seq_at,
    )
}

/// [`train`] with explicit trainer options (`opts.seq_len` is replaced by
/// `seq_at(0)`).
pub fn train_with(
    model_dir: &Path,
    k: &Knobs,
    mut opts: TrainerOptions,
    steps: u64,
    seq_at: impl Fn(u64) -> usize,
) -> Run {
    opts.seq_len = seq_at(0);
    let mut t = build_with(model_dir, k, opts, steps);
    let mut out = Vec::new();
    for s in 0..steps {
        t.set_seq_len(seq_at(s)).unwrap();
        out.push(t.step().unwrap().metrics);
    }
    let rerecords = t.prefetcher().rerecords();
    let activations = t.activation_decision().cloned();
    let summary = t.finish().unwrap();
    Run {
        steps: out,
        sha256: summary.weight_sha256,
        rerecords,
        bytes_read: summary.bytes_read,
        bytes_written: summary.bytes_written,
        activations,
    }
}

/// Asserts two runs are bit-identical, with a readable report if not.
pub fn assert_identical(a: &Run, b: &Run, what: &str) {
    let la = a.loss_bits();
    let lb = b.loss_bits();
    for (i, (x, y)) in la.iter().zip(&lb).enumerate() {
        assert_eq!(
            x,
            y,
            "{what}: step {} loss differs: {} vs {}",
            i + 1,
            f32::from_bits(*x),
            f32::from_bits(*y)
        );
    }
    assert_eq!(la.len(), lb.len(), "{what}: step counts");
    assert_eq!(a.sha256, b.sha256, "{what}: final weight sha256");
}

/// `tierzero` with `args` (as root under OpenMPI if need be): its stdout,
/// after asserting it succeeded.
pub fn tierzero(args: &[&str]) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tierzero"))
        .args(args)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .output()
        .expect("run tierzero");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "tierzero {args:?}: {}\nstdout:\n{stdout}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}
