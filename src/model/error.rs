//! The one error type of the model area, [`ModelError`].
use super::UnitId;

/// Errors of the model area.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A durable write of a model file (see [`crate::durable`]).
    #[error(transparent)]
    Durable(#[from] crate::durable::DurableError),
    /// I/O on a model file.
    #[error("I/O error on {path}: {source}")]
    Io {
        /// File concerned.
        path: std::path::PathBuf,
        /// Underlying error.
        source: std::io::Error,
    },
    /// `config.json` is not valid JSON or has a wrongly typed key.
    #[error("config.json: {reason}")]
    ConfigJson {
        /// Parser message.
        reason: String,
    },
    /// A config value is out of range.
    #[error("config key `{key}`: {reason}")]
    InvalidConfig {
        /// HF key name.
        key: String,
        /// What is wrong.
        reason: String,
    },
    /// A `config.json` key that tierzero neither reads nor knows to be
    /// harmless ([`super::config::HARMLESS_KEYS`]).
    #[error(
        "config.json: unknown key `{key}` for model_type {model_type:?}: it may change the \
         model's math, so tierzero refuses rather than run a different model; remove the key, \
         or pass --allow-unknown-model-keys (library: UnknownKeys::Allow) to proceed at your \
         own risk"
    )]
    UnknownConfigKey {
        /// The key (`rope_parameters.<k>` inside the rotary dict).
        key: String,
        /// The config's `model_type`.
        model_type: String,
    },
    /// The config or checkpoint asks for something not implemented.
    #[error("unsupported: {what}")]
    Unsupported {
        /// What.
        what: String,
    },
    /// A product of dimensions does not fit in `usize`.
    #[error("size overflow computing {what}")]
    SizeOverflow {
        /// Which product.
        what: String,
    },
    /// A safetensors file is malformed.
    #[error("safetensors file {path}: {reason}")]
    BadSafetensors {
        /// File.
        path: std::path::PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A model directory holds weights in a format tierzero does not read
    /// and no safetensors.
    #[error(
        "model directory {dir}: it holds weights tierzero does not read ({files}) and no \
         safetensors; convert them (in Python, `AutoModelForCausalLM.from_pretrained(dir)\
         .save_pretrained(dir)` writes model.safetensors), or remove them to train from a \
         seeded init"
    )]
    ForeignWeights {
        /// The directory.
        dir: std::path::PathBuf,
        /// The files' names, comma-separated.
        files: String,
    },
    /// An expected tensor is not in the checkpoint.
    #[error("tensor `{name}` is missing from the checkpoint{hint}")]
    MissingTensor {
        /// Canonical (HF) name.
        name: String,
        /// What else the checkpoint held, when that suggests another
        /// model's (empty if nothing).
        hint: String,
    },
    /// The same tensor appears twice in the checkpoint.
    #[error(
        "tensor `{name}` appears more than once in the checkpoint ({files}); keep one copy \
         of the weights in the directory"
    )]
    DuplicateTensor {
        /// Canonical name.
        name: String,
        /// Where each copy is.
        files: String,
    },
    /// A value the output dtype cannot hold (a finite fp32 beyond fp16's
    /// range would be written as infinity), or a value that is not finite
    /// at all.
    #[error(
        "tensor `{name}`: element {index} is {value}, {}",
        if value.is_finite() {
            format!(
                "beyond {dtype}'s range (its largest finite value is {}); write the weights \
                 in a wider dtype ({}: `export --dtype`, or the run's precision)",
                if *dtype == "fp16" { "65504" } else { "3.39e38" },
                if *dtype == "fp16" { "bf16 or fp32" } else { "fp32" }
            )
        } else {
            "not a finite number: the weights have diverged; use an earlier checkpoint".to_owned()
        }
    )]
    NotRepresentable {
        /// Name (HF name for parameters).
        name: String,
        /// The element's index in the flattened tensor.
        index: usize,
        /// Its fp32 value.
        value: f32,
        /// The dtype asked for.
        dtype: &'static str,
    },
    /// A tensor's shape differs from what the config implies.
    #[error("tensor `{name}`: expected shape {expected:?}, found {found:?}")]
    ShapeMismatch {
        /// Name (HF name for parameters).
        name: String,
        /// Expected shape.
        expected: Vec<usize>,
        /// Found shape.
        found: Vec<usize>,
    },
    /// A tensor's dtype is not usable.
    #[error("tensor `{name}`: unsupported dtype {dtype}")]
    UnsupportedDtype {
        /// Name.
        name: String,
        /// Dtype as written.
        dtype: String,
    },
    /// A unit received the wrong number of parameters.
    #[error("unit {unit:?}: expected {expected} params, got {found}")]
    ParamCount {
        /// Unit.
        unit: UnitId,
        /// Declared count.
        expected: usize,
        /// Passed count.
        found: usize,
    },
    /// A unit's input is malformed.
    #[error("unit {unit:?}: bad input: {reason}")]
    BadInput {
        /// Unit.
        unit: UnitId,
        /// What is wrong.
        reason: String,
    },
    /// A unit id outside the model.
    #[error("unit {unit:?} does not exist (model has {n_units} units)")]
    NoSuchUnit {
        /// Unit asked for.
        unit: UnitId,
        /// Units in the model.
        n_units: usize,
    },
    /// Backward produced no gradient for a parameter (a dropped gradient).
    #[error("no gradient for parameter `{name}`: an op without backward in its path?")]
    MissingGradient {
        /// Parameter name.
        name: String,
    },
    /// An error from candle.
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    /// The CUDA units (crate `tierzero-gpu`) failed.
    #[error("GPU compute: {what}")]
    Gpu {
        /// tierzero-gpu's error.
        what: String,
    },
}
