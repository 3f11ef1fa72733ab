//! The one error type of the config module.
//!
//! Design rules, all checked by tests:
//! - every message is **one line** (no `\n`), so the CLI can print it after
//!   `error: ` and exit 2;
//! - every message names the **key** as a JSON path
//!   (`zero_optimization.offload_param.nvme_path`), the **value** as written
//!   (compact JSON, truncated to [`MAX_VALUE_CHARS`]) and a **fix**;
//! - variants carry structured fields so callers and tests can match on them
//!   instead of parsing text.

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::units::Bytes;

/// Longest rendering of a user value inside an error message.
pub const MAX_VALUE_CHARS: usize = 80;

/// Renders a JSON value compactly on one line for an error message.
pub(crate) fn render(v: &Value) -> String {
    let s = serde_json::to_string(v).unwrap_or_else(|_| "<unprintable>".to_owned());
    truncate(&s)
}

/// Cuts a string to [`MAX_VALUE_CHARS`] characters and strips line breaks.
pub(crate) fn truncate(s: &str) -> String {
    let one_line: String = s
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if one_line.chars().count() <= MAX_VALUE_CHARS {
        one_line
    } else {
        let mut out: String = one_line.chars().take(MAX_VALUE_CHARS).collect();
        out.push('…');
        out
    }
}

/// A path as the config wrote it, for a message: a JSON string (quoted,
/// control characters escaped: a newline in `nvme_path` made a three-line
/// error), cut to [`MAX_VALUE_CHARS`].
pub(crate) fn shown(p: &Path) -> String {
    let s = serde_json::to_string(&p.to_string_lossy()).unwrap_or_else(|_| "<unprintable>".into());
    if s.chars().count() <= MAX_VALUE_CHARS {
        s
    } else {
        let mut out: String = s.chars().take(MAX_VALUE_CHARS).collect();
        out.push('…');
        out
    }
}

/// `mkdir -p` of `p` as a shell reads it (single-quoted where it holds
/// anything but plain path characters: a space made two directories), or
/// words without a command where it holds control characters.
fn mkdir_fix(p: &Path) -> String {
    let s = p.to_string_lossy();
    if s.chars().any(char::is_control) {
        return "create it".to_owned();
    }
    let plain = s
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "/._-+,:=@%~".contains(c));
    if plain && !s.is_empty() {
        format!("create it (mkdir -p {s})")
    } else {
        format!("create it (mkdir -p '{}')", s.replace('\'', r"'\''"))
    }
}

/// Everything that can be wrong with a `ds_config.json`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The config file could not be read.
    #[error("cannot read config file {}: {source}; fix: check the --config path and its permissions", path.display())]
    Read {
        /// File that was asked for.
        path: PathBuf,
        /// Underlying I/O error.
        source: std::io::Error,
    },

    /// The text is neither JSON nor hjson (DeepSpeed reads its config with
    /// Python's `hjson`: comments and trailing commas are fine).
    #[error("invalid JSON at line {line}, column {column}: {message}; fix: correct the syntax there (the config is read as DeepSpeed reads it, as hjson: `//`, `#` and `/* */` comments and trailing commas are accepted)")]
    Json {
        /// 1-based line.
        line: usize,
        /// 1-based column.
        column: usize,
        /// What is wrong there.
        message: String,
    },

    /// A key given twice in one object. DeepSpeed refuses it (its hjson
    /// loader raises on duplicates); a JSON reader would silently keep the
    /// last value.
    #[error("`{key}` is given twice, {}: DeepSpeed refuses duplicate keys, and a JSON reader would silently keep the second; fix: delete one of the two", if first_line == second_line { format!("on line {first_line}, its values near columns {first_column} and {second_column}") } else { format!("at line {first_line} and at line {second_line}") })]
    DuplicateKey {
        /// JSON path of the key.
        key: String,
        /// 1-based line of the first occurrence.
        first_line: usize,
        /// 1-based column of its value (the parser's, within a character or two).
        first_column: usize,
        /// 1-based line of the second occurrence.
        second_line: usize,
        /// 1-based column of its value (the parser's, within a character or two).
        second_column: usize,
    },

    /// A key holds a value of the wrong JSON type (or a non-integral number
    /// where an integer is needed).
    #[error("`{key}` = {value}: expected {expected}; fix: write {expected}")]
    WrongType {
        /// JSON path of the key.
        key: String,
        /// The value as written.
        value: String,
        /// What the key accepts, e.g. `an integer`.
        expected: String,
    },

    /// A number or string outside the range the key accepts.
    #[error("`{key}` = {value}: must be {allowed}; fix: {fix}")]
    OutOfRange {
        /// JSON path of the key.
        key: String,
        /// The value as written.
        value: String,
        /// The accepted range, e.g. `in [0, 1)`.
        allowed: String,
        /// What to do.
        fix: String,
    },

    /// `zero_optimization.stage` is not 0..=3.
    #[error("`zero_optimization.stage` = {value}: ZeRO stages are 0, 1, 2 and 3; fix: use 3 to partition and offload parameters, gradients and optimizer state")]
    InvalidStage {
        /// The value as written.
        value: String,
    },

    /// `optimizer.type` is not Adam or AdamW.
    #[error("`optimizer.type` = {value}: tierzero implements Adam and AdamW only; fix: set \"type\": \"AdamW\" (or \"Adam\")")]
    UnsupportedOptimizer {
        /// The value as written.
        value: String,
    },

    /// `scheduler.type` is not one of the supported schedules.
    #[error("`scheduler.type` = {value}: tierzero supports WarmupLR, WarmupDecayLR and WarmupCosineLR; fix: {fix}")]
    UnsupportedScheduler {
        /// The value as written.
        value: String,
        /// What to do (names the nearest supported type when there is one).
        fix: String,
    },

    /// An offload `device` that is not `none`, `cpu` or `nvme`.
    #[error("`{key}` = {value}: offload device must be \"none\", \"cpu\" or \"nvme\"; fix: use one of those")]
    UnknownOffloadDevice {
        /// JSON path of the `device` key.
        key: String,
        /// The value as written.
        value: String,
    },

    /// All three batch sizes were given (or resolved) and do not multiply up.
    #[error("batch sizes do not add up: `train_batch_size` = {train_batch_size} but `train_micro_batch_size_per_gpu` {micro_batch_size} × `gradient_accumulation_steps` {gradient_accumulation_steps} × ranks {ranks} = {product}; fix: {fix}")]
    BatchMismatch {
        /// `train_batch_size`.
        train_batch_size: u64,
        /// `train_micro_batch_size_per_gpu`.
        micro_batch_size: u64,
        /// `gradient_accumulation_steps`.
        gradient_accumulation_steps: u64,
        /// World size (number of data-parallel ranks).
        ranks: u64,
        /// `micro × gas × ranks`.
        product: u64,
        /// Suggested correction.
        fix: String,
    },

    /// Two batch sizes were given and the third cannot be inferred as a
    /// whole number (DeepSpeed would round down and then fail its check).
    #[error("cannot infer `{missing}`: `train_batch_size` = {train_batch_size} is not divisible by {divisor_desc} = {divisor}; fix: make `train_batch_size` a multiple of {divisor} (e.g. {suggestion}), or remove it and set `{missing}` (the batch is then the product)")]
    BatchIndivisible {
        /// The key being inferred.
        missing: &'static str,
        /// `train_batch_size`.
        train_batch_size: u64,
        /// Description of the divisor, e.g. `micro 4 × ranks 2`.
        divisor_desc: String,
        /// The divisor's value.
        divisor: u64,
        /// Nearest multiple at or above the given train batch size.
        suggestion: u64,
    },

    /// Neither `train_batch_size` nor `train_micro_batch_size_per_gpu`.
    #[error("no batch size: neither `train_batch_size` nor `train_micro_batch_size_per_gpu` is set; fix: set \"train_micro_batch_size_per_gpu\" (and optionally \"gradient_accumulation_steps\"), or set them to \"auto\"")]
    BatchMissing,

    /// An NVMe offload with no `nvme_path`.
    #[error("`{key}` is missing: `{device_key}` = \"nvme\" needs a swap directory; fix: add \"nvme_path\": \"/path/on/local/nvme\" next to \"device\"")]
    NvmePathMissing {
        /// JSON path of the missing `nvme_path`.
        key: String,
        /// JSON path of the `device` key.
        device_key: String,
    },

    /// `nvme_path` does not exist.
    #[error("`{key}` = {}: directory does not exist; fix: {} or point `{key}` at a directory on a local NVMe drive", shown(dir), mkdir_fix(dir))]
    NvmePathNotFound {
        /// JSON path of the key.
        key: String,
        /// The directory.
        dir: PathBuf,
    },

    /// `nvme_path` exists but is not a directory.
    #[error("`{key}` = {}: exists but is not a directory; fix: point `{key}` at a directory (swap files are created inside it)", shown(dir))]
    NvmePathNotDir {
        /// JSON path of the key.
        key: String,
        /// The path.
        dir: PathBuf,
    },

    /// `nvme_path` is a directory we cannot create files in (or could not
    /// be created).
    #[error("`{key}` = {}: not writable ({}); fix: choose a directory you can write to or fix its permissions", shown(dir), truncate(reason))]
    NvmePathNotWritable {
        /// JSON path of the key.
        key: String,
        /// The directory.
        dir: PathBuf,
        /// What failed, one line.
        reason: String,
    },

    /// `offload_optimizer` to NVMe with a stage other than 3.
    #[error("`zero_optimization.offload_optimizer.device` = \"nvme\" needs ZeRO stage 3 but `zero_optimization.stage` = {stage}; fix: set \"stage\": 3, or use \"device\": \"cpu\" with {}", if *stage == 0 { "stage 1 or 2 (stage 0 offloads nothing)".to_owned() } else { format!("stage {stage}") })]
    NvmeOptimizerNeedsStage3 {
        /// The configured stage.
        stage: u8,
    },

    /// The pinned budget cannot hold the configured swap buffers.
    #[error("`tierzero.pinned_budget_bytes` = {} is too small: {what} needs {breakdown} = {} of pinned buffers; fix: raise `tierzero.pinned_budget_bytes` to at least {required_bytes} or lower {lower_keys}", Bytes(*budget_bytes), Bytes(*required_bytes))]
    PinnedBudgetTooSmall {
        /// The budget.
        budget_bytes: u64,
        /// Bytes the buffers need.
        required_bytes: u64,
        /// Which buffers, e.g. `offload_param`.
        what: String,
        /// The arithmetic, e.g. `buffer_count 5 × buffer_size 100000000 elements × 2 bytes`.
        breakdown: String,
        /// Keys that lower the need.
        lower_keys: String,
    },

    /// fp16 and bf16 both enabled.
    #[error("`fp16.enabled` and `bf16.enabled` are both true: only one 16-bit format can be used; fix: set one of them to false")]
    PrecisionConflict,

    /// Two names of one setting were both given (a deprecated alias and
    /// its replacement, or two names DeepSpeed reads alike, as
    /// `stage3_prefetch_bucket_size` and `prefetch_bucket_size`).
    #[error("`{old}` and `{new}` are both set: DeepSpeed reads them as one setting; fix: keep only `{new}`")]
    ConflictingAlias {
        /// The other name's key path (the deprecated one, if either is).
        old: String,
        /// Current key path.
        new: String,
    },

    /// `optimizer.params.max_grad_norm`: DeepSpeed refuses it ("not
    /// supported as an optimizer parameter, please switch to using the
    /// deepspeed parameter 'gradient_clipping'"); ignoring it would train
    /// without the clipping it asks for.
    #[error("`optimizer.params.max_grad_norm` = {value}: not an optimizer parameter (DeepSpeed refuses it too), and ignoring it would train without the clipping it asks for; fix: remove it and set the top-level \"gradient_clipping\": {value}")]
    MaxGradNormInOptimizer {
        /// The value as written.
        value: String,
    },

    /// A key that the rest of the config makes mandatory is absent.
    #[error("`{key}` is missing: {why}; fix: {fix}")]
    MissingKey {
        /// JSON path of the key.
        key: String,
        /// Why it is needed.
        why: String,
        /// What to do.
        fix: String,
    },

    /// An `"auto"` value that the run context cannot fill.
    #[error("`{key}` = \"auto\" cannot be resolved: {needs}; fix: {fix}")]
    AutoUnresolved {
        /// JSON path of the key.
        key: String,
        /// What is missing.
        needs: String,
        /// What to do.
        fix: String,
    },

    /// A config value contradicts a value the caller passed explicitly
    /// (e.g. on the command line), as HF Trainer reports it.
    #[error("`{key}` = {config_value} in the config but {run_value} was given for the run ({run_source}); fix: make them equal, or set `{key}` to \"auto\" to use the run's value")]
    RunMismatch {
        /// JSON path of the key.
        key: String,
        /// The config's value.
        config_value: String,
        /// The run's value.
        run_value: String,
        /// Which run setting, e.g. `learning_rate`.
        run_source: String,
    },
}

impl ConfigError {
    /// The JSON path of the key the error is about, when there is exactly one.
    pub fn key(&self) -> Option<&str> {
        match self {
            ConfigError::WrongType { key, .. }
            | ConfigError::OutOfRange { key, .. }
            | ConfigError::UnknownOffloadDevice { key, .. }
            | ConfigError::NvmePathMissing { key, .. }
            | ConfigError::NvmePathNotFound { key, .. }
            | ConfigError::NvmePathNotDir { key, .. }
            | ConfigError::NvmePathNotWritable { key, .. }
            | ConfigError::AutoUnresolved { key, .. }
            | ConfigError::MissingKey { key, .. }
            | ConfigError::DuplicateKey { key, .. }
            | ConfigError::RunMismatch { key, .. } => Some(key),
            ConfigError::MaxGradNormInOptimizer { .. } => Some("optimizer.params.max_grad_norm"),
            ConfigError::InvalidStage { .. } => Some("zero_optimization.stage"),
            ConfigError::UnsupportedOptimizer { .. } => Some("optimizer.type"),
            ConfigError::UnsupportedScheduler { .. } => Some("scheduler.type"),
            ConfigError::NvmeOptimizerNeedsStage3 { .. } => {
                Some("zero_optimization.offload_optimizer.device")
            }
            ConfigError::PinnedBudgetTooSmall { .. } => Some("tierzero.pinned_budget_bytes"),
            ConfigError::ConflictingAlias { new, .. } => Some(new),
            ConfigError::Read { .. }
            | ConfigError::Json { .. }
            | ConfigError::BatchMismatch { .. }
            | ConfigError::BatchIndivisible { .. }
            | ConfigError::BatchMissing
            | ConfigError::PrecisionConflict => None,
        }
    }
}
