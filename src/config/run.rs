//! The run context: what the caller knows that the config file does not,
//! and the rules that turn `"auto"` into numbers.
//!
//! ## How `"auto"` is resolved (HF Trainer's rules)
//!
//! HF Trainer fills `"auto"` from its `TrainingArguments`
//! (`transformers.integrations.deepspeed.HfTrainerDeepSpeedConfig`). We do
//! the same with a [`RunContext`], whose fields are all optional: set only
//! what the user actually gave (on the command line, or what the engine
//! knows such as the model's hidden size). A field left `None` falls back to
//! HF `TrainingArguments`' default, as HF would.
//!
//! | key | `"auto"` becomes | fallback |
//! |---|---|---|
//! | `train_micro_batch_size_per_gpu` | `micro_batch_size` | 8 |
//! | `gradient_accumulation_steps` | `gradient_accumulation_steps` | 1 |
//! | `train_batch_size` | ranks × micro × accumulation (after those resolve) | — |
//! | `gradient_clipping` | `max_grad_norm` | 1.0 |
//! | `optimizer.params.lr` | `learning_rate` | 5e-5 |
//! | `optimizer.params.betas` | `adam_betas` | [0.9, 0.999] |
//! | `optimizer.params.eps` | `adam_eps` | 1e-8 |
//! | `optimizer.params.weight_decay` | `weight_decay` | 0.0 |
//! | `scheduler.params.warmup_min_lr` | 0 | — |
//! | `scheduler.params.warmup_max_lr` | the optimizer's resolved lr | — |
//! | `scheduler.params.warmup_num_steps` | `warmup_steps` | 0 |
//! | `scheduler.params.total_num_steps` | `total_steps` (`--steps`) | error |
//! | `fp16.enabled` / `bf16.enabled` | `mixed_precision` is fp16 / bf16 | false |
//! | `zero_optimization.reduce_bucket_size` | hidden² | DeepSpeed default 5e8 |
//! | `zero_optimization.stage3_prefetch_bucket_size` | ⌊0.9 × hidden²⌋ | 5e7 |
//! | `zero_optimization.stage3_param_persistence_threshold` | 10 × hidden | 1e5 |
//! | `zero_optimization.stage3_gather_16bit_weights_on_model_save` | `save_16bit_model` | false |
//!
//! Where we differ from HF, on purpose:
//! - **A concrete config value that contradicts a run value is an error**
//!   ([`super::ConfigError::RunMismatch`]), as HF reports for its
//!   must-match keys, but for every numeric key in the table but the
//!   scheduler's step counts: silently preferring one of two explicit,
//!   different answers is how batch-size mismatches go unnoticed.
//!   `warmup_num_steps` and `total_num_steps` keep a fill-only rule (a
//!   concrete value is kept over the run's, with a note, as accelerate
//!   does; HF Trainer refuses the mismatch), so a config that fixes its
//!   schedule can run a different `--steps`.
//! - **An absent numeric key takes the run value** when one is given (HF
//!   leaves absent keys to DeepSpeed's defaults and silently drops the CLI
//!   value).
//! - The boolean keys (`fp16.enabled`, `bf16.enabled`,
//!   `stage3_gather_16bit_weights_on_model_save`) take the run value only
//!   when written as `"auto"`; written or absent, the config decides.
//! - Hidden-size rules fall back to DeepSpeed's defaults instead of failing,
//!   since the config can be loaded before the model (e.g. `estimate`).
//!
//! Every resolution is recorded in [`super::Loaded::resolved`] with its
//! source, so the CLI can print where each number came from.

use std::fmt;

/// Mixed-precision choice given by the run (HF's `--fp16` / `--bf16`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MixedPrecision {
    /// fp32 everywhere.
    No,
    /// fp16 with loss scaling.
    Fp16,
    /// bf16.
    Bf16,
}

/// What filesystem checks to make on `nvme_path`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PathChecks {
    /// Must exist, be a directory and be writable (a probe file is created
    /// and removed).
    #[default]
    Check,
    /// Like `Check`, but create a missing directory first (`mkdir -p`).
    /// The embedded default config uses this for `./tierzero-swap/`.
    CreateMissing,
    /// No filesystem access at all (e.g. `estimate`, or tests).
    Skip,
}

/// Everything the caller knows about the run. See the module docs for how
/// each field fills `"auto"`.
#[derive(Debug, Clone, PartialEq)]
pub struct RunContext {
    /// Data-parallel ranks (world size). Default 1.
    pub ranks: u64,
    /// Samples per rank per micro-step, if given on the command line.
    pub micro_batch_size: Option<u64>,
    /// Gradient accumulation steps, if given.
    pub gradient_accumulation_steps: Option<u64>,
    /// Learning rate, if given.
    pub learning_rate: Option<f64>,
    /// Adam betas, if given.
    pub adam_betas: Option<[f64; 2]>,
    /// Adam epsilon, if given.
    pub adam_eps: Option<f64>,
    /// Weight decay, if given.
    pub weight_decay: Option<f64>,
    /// Gradient clipping norm, if given.
    pub max_grad_norm: Option<f64>,
    /// Warmup steps, if given.
    pub warmup_steps: Option<u64>,
    /// Total optimizer steps (`--steps`), if given.
    pub total_steps: Option<u64>,
    /// Mixed precision, if given.
    pub mixed_precision: Option<MixedPrecision>,
    /// The model's hidden size, once known.
    pub hidden_size: Option<u64>,
    /// Whether to save consolidated 16-bit weights, if given.
    pub save_16bit_model: Option<bool>,
    /// Total parameter count of the model, once known. Lets the load-time
    /// pinned-budget check include the NVMe optimizer swap buffers, whose
    /// size is `min(sub_group_size, params per rank)` elements.
    pub model_numel: Option<u64>,
    /// Elements of the model's largest parameter, once known: a parameter
    /// larger than `sub_group_size` is an optimizer sub-group of its own,
    /// so the pinned-budget check sizes the optimizer buffers for it, as
    /// the engine will.
    pub largest_param_numel: Option<u64>,
    /// Filesystem checks on `nvme_path`.
    pub path_checks: PathChecks,
}

impl Default for RunContext {
    fn default() -> Self {
        RunContext {
            ranks: 1,
            micro_batch_size: None,
            gradient_accumulation_steps: None,
            learning_rate: None,
            adam_betas: None,
            adam_eps: None,
            weight_decay: None,
            max_grad_norm: None,
            warmup_steps: None,
            total_steps: None,
            mixed_precision: None,
            hidden_size: None,
            save_16bit_model: None,
            model_numel: None,
            largest_param_numel: None,
            path_checks: PathChecks::Check,
        }
    }
}

/// HF `TrainingArguments` defaults used when `"auto"` has no run value.
pub mod hf_defaults {
    /// `per_device_train_batch_size`.
    pub const MICRO_BATCH_SIZE: u64 = 8;
    /// `gradient_accumulation_steps`.
    pub const GRADIENT_ACCUMULATION_STEPS: u64 = 1;
    /// `learning_rate`.
    pub const LEARNING_RATE: f64 = 5e-5;
    /// `adam_beta1`, `adam_beta2`.
    pub const ADAM_BETAS: [f64; 2] = [0.9, 0.999];
    /// `adam_epsilon`.
    pub const ADAM_EPS: f64 = 1e-8;
    /// `weight_decay`.
    pub const WEIGHT_DECAY: f64 = 0.0;
    /// `max_grad_norm`.
    pub const MAX_GRAD_NORM: f64 = 1.0;
    /// `warmup_steps`.
    pub const WARMUP_STEPS: u64 = 0;
}

/// Where a resolved value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// The run context (command line or engine), naming the field.
    Run(&'static str),
    /// HF `TrainingArguments`' default for an `"auto"` with no run value.
    HfDefault,
    /// DeepSpeed's default (a hidden-size rule without a hidden size).
    DeepSpeedDefault,
    /// An absent key's default that changed between DeepSpeed versions:
    /// a config written for an older one meant another value.
    DeepSpeedDefaultSince {
        /// The first version with this default.
        version: &'static str,
        /// The default before it.
        before: &'static str,
    },
    /// Derived from other resolved keys (e.g. `train_batch_size`).
    Derived(String),
    /// DeepSpeed's batch-size inference from the two keys that were given.
    Inferred,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Run(what) => write!(f, "run: {what}"),
            Source::HfDefault => write!(f, "HF Trainer default"),
            Source::DeepSpeedDefault => write!(f, "DeepSpeed default (model hidden size unknown)"),
            Source::DeepSpeedDefaultSince { version, before } => write!(
                f,
                "absent: DeepSpeed's default since {version}; {before} before, write it to choose"
            ),
            Source::Derived(how) => write!(f, "derived: {how}"),
            Source::Inferred => write!(f, "inferred from the other batch sizes, as DeepSpeed does"),
        }
    }
}

/// One value filled in for `"auto"` (or inferred).
#[derive(Debug, Clone, PartialEq)]
pub struct Resolved {
    /// JSON path of the key.
    pub key: String,
    /// The value, rendered.
    pub value: String,
    /// Where it came from.
    pub source: Source,
}

impl fmt::Display for Resolved {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "`{}` = {} ({})", self.key, self.value, self.source)
    }
}
