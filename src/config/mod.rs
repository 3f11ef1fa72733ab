//! DeepSpeed-compatible configuration (`ds_config.json`).
//!
//! A user must be able to point tierzero at the `ds_config.json` they
//! already use with DeepSpeed or HF Trainer. This module reads it in three
//! layers:
//!
//! 1. **Text** ([`parse_str`]): hjson, as DeepSpeed reads it (JSON plus
//!    comments and trailing commas), to a `serde_json::Value` (see
//!    `hjson.rs`); syntax errors become [`ConfigError::Json`] with line and
//!    column, a key given twice in one object [`ConfigError::DuplicateKey`]
//!    with both lines.
//! 2. **Edge** ([`ds`]): a walker fills serde structs that mirror
//!    DeepSpeed's keys and defaults ([`DsConfig`]). It accepts the forms real
//!    configs use: `"auto"`, integers written as floats (`5e8`, `1e14`),
//!    DeepSpeed's deprecated aliases, and our own `"tierzero": {...}` block.
//!    Wrong types fail with the key's JSON path; unknown keys only warn
//!    ([`ConfigWarning`]), with a did-you-mean where one is close.
//! 3. **Validated** ([`Parsed::resolve`]): `"auto"` is filled from a
//!    [`RunContext`] with HF Trainer's rules (see [`run`]), DeepSpeed's batch
//!    inference runs, and every cross-key rule is checked, producing
//!    [`Config`] with enums ([`Stage`], [`OffloadDevice`], [`Precision`]) and
//!    unit types ([`Numel`] for DeepSpeed's element counts, [`Bytes`]).
//!
//! Why three layers: the edge layer alone can serve `estimate` (no run, no
//! filesystem), and keeping DeepSpeed's names and defaults in one place lets
//! the effective config be printed back in DeepSpeed's own vocabulary
//! (`serde_json::to_string(&loaded.ds)`).
//!
//! Errors are one [`ConfigError`] enum; each message is one line naming the
//! key, the value and the fix. Warnings are logged with `tracing::warn!` by
//! the `load_*` functions and also returned, so the CLI can print them.
//!
//! ```
//! use tierzero::config::{load_str, PathChecks, RunContext, Stage};
//! let run = RunContext { ranks: 2, path_checks: PathChecks::Skip, ..RunContext::default() };
//! let loaded = load_str(
//!     r#"{"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
//!         "zero_optimization": {"stage": 3, "stage3_foo": 1}}"#,
//!     &run,
//! ).unwrap();
//! assert_eq!(loaded.config.batch.gradient_accumulation_steps, 4);
//! assert_eq!(loaded.config.zero.stage, Stage::Parameters);
//! assert_eq!(loaded.unknown_keys(), vec!["zero_optimization.stage3_foo"]);
//! ```

pub mod ds;
mod error;
mod hjson;
mod reader;
pub mod run;
pub mod units;
mod validate;

use std::path::Path;

pub use ds::{AutoOr, DirectIo, DsConfig, IoBackend, Memlock};
pub use error::ConfigError;
pub use reader::ConfigWarning;
pub use run::{MixedPrecision, PathChecks, Resolved, RunContext, Source};
pub use units::{Bytes, Numel};
pub use validate::{
    ActivationBudget, Aio, Batch, Config, LossScale, OffloadDevice, Optimizer, OptimizerKind,
    OptimizerOffload, ParamOffload, Precision, Scheduler, Stage, Tierzero, WarmupType, Zero,
    MAX_BUFFER_COUNT, MAX_SIZE_NUMEL, MAX_STOP_GRACE_S,
};

/// The embedded default config: a small-model run with ZeRO stage 3 and
/// NVMe offload of both parameters and optimizer state into
/// `./tierzero-swap/`, fp32, AdamW with a linear warmup then decay over
/// `--steps`. `offload_param.buffer_size` is 2e5 elements (64 buffers: one
/// per tensor of the default model, so one step's parameter write-backs
/// never wait for a free buffer), so the default model's largest tensor
/// must stay at or below 200K elements. Load it with [`load_default`],
/// which creates the swap directory.
pub fn default_embedded() -> &'static str {
    include_str!("default.json")
}

/// A config read to the edge layer: DeepSpeed's keys with defaults filled,
/// `"auto"` not yet resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct Parsed {
    /// The config as written (aliases folded, defaults filled).
    pub ds: DsConfig,
    /// Unknown/ignored/deprecated keys and notes found while reading.
    pub warnings: Vec<ConfigWarning>,
}

impl Parsed {
    /// The scheduler's `total_num_steps` when the config gives a number
    /// (`train` runs that many steps without `--steps`).
    pub fn scheduler_total_steps(&self) -> Option<u64> {
        self.ds
            .scheduler
            .as_ref()
            .and_then(|s| match s.params.total_num_steps {
                Some(ds::AutoOr::Value(n)) => Some(n),
                _ => None,
            })
    }
}

/// A fully validated config.
#[derive(Debug, Clone, PartialEq)]
pub struct Loaded {
    /// What the engine runs with.
    pub config: Config,
    /// The config as written (for printing back in DeepSpeed's names).
    pub ds: DsConfig,
    /// Every warning, in the order found.
    pub warnings: Vec<ConfigWarning>,
    /// Every value filled in for `"auto"` or inferred, with its source.
    pub resolved: Vec<Resolved>,
}

fn unknown(warnings: &[ConfigWarning]) -> Vec<&str> {
    warnings
        .iter()
        .filter_map(|w| match w {
            ConfigWarning::UnknownKey { key, .. } => Some(key.as_str()),
            _ => None,
        })
        .collect()
}

impl Parsed {
    /// JSON paths of the keys neither DeepSpeed nor tierzero defines.
    pub fn unknown_keys(&self) -> Vec<&str> {
        unknown(&self.warnings)
    }

    /// Resolves `"auto"` from `run` and validates into a [`Config`].
    pub fn resolve(self, run: &RunContext) -> Result<Loaded, ConfigError> {
        let mut sink = reader::Sink {
            warnings: self.warnings,
        };
        let (config, resolved) = validate::validate(&self.ds, run, &mut sink)?;
        Ok(Loaded {
            config,
            ds: self.ds,
            warnings: sink.warnings,
            resolved,
        })
    }
}

impl Loaded {
    /// JSON paths of the keys neither DeepSpeed nor tierzero defines.
    pub fn unknown_keys(&self) -> Vec<&str> {
        unknown(&self.warnings)
    }
}

/// Parses config text (JSON or hjson, as DeepSpeed reads it) to the edge
/// layer (no run context, no filesystem).
pub fn parse_str(text: &str) -> Result<Parsed, ConfigError> {
    let value = hjson::parse(text)?;
    let mut sink = reader::Sink::default();
    let ds = ds::read(&value, &mut sink)?;
    Ok(Parsed {
        ds,
        warnings: sink.warnings,
    })
}

fn log_warnings(loaded: &Loaded) {
    for w in &loaded.warnings {
        tracing::warn!(key = w.key(), "{w}");
    }
}

/// Parses, resolves and validates config text; logs every warning.
pub fn load_str(text: &str, run: &RunContext) -> Result<Loaded, ConfigError> {
    let loaded = parse_str(text)?.resolve(run)?;
    log_warnings(&loaded);
    Ok(loaded)
}

/// Reads a `ds_config.json` file and loads it like [`load_str`].
pub fn load_file(path: &Path, run: &RunContext) -> Result<Loaded, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_owned(),
        source,
    })?;
    load_str(&text, run)
}

/// Loads [`default_embedded`]. With `run.path_checks` left at
/// [`PathChecks::Check`], this switches to [`PathChecks::CreateMissing`] so
/// the default run creates `./tierzero-swap/`.
pub fn load_default(run: &RunContext) -> Result<Loaded, ConfigError> {
    let mut run = run.clone();
    if run.path_checks == PathChecks::Check {
        run.path_checks = PathChecks::CreateMissing;
    }
    load_str(default_embedded(), &run)
}
