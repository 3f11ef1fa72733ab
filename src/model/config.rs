//! Model configuration: the HF `config.json` at the edge, a validated
//! [`ModelConfig`] inside.
//!
//! Design:
//! - Families: GPT-2 (`"gpt2"`) and the Llama family (`"llama"`,
//!   `"mistral"`, `"qwen2"`, `"qwen3"`), which share Llama's math (RMSNorm,
//!   rotary embeddings, SwiGLU, GQA) and differ in flags: biases on q/k/v (and
//!   o), RMSNorm of q and k per head (Qwen3), a sliding attention window
//!   (Mistral). The serde struct [`HfGpt2Config`] and the per-family defaults
//!   of the Llama family mirror the key names and defaults of the HF
//!   `transformers` config classes, so a `config.json` written by
//!   `save_pretrained` reads unchanged, and a config that omits a key means
//!   what it means there.
//! - **Every key is accounted for.** A key is either read (it changes the
//!   math, and its value is honoured or refused), or on [`HARMLESS_KEYS`],
//!   the one list of keys that change no arithmetic we run (token ids,
//!   dtypes, dropout: we train without it, caching, bookkeeping). Any other
//!   key is an error naming it ([`ModelError::UnknownConfigKey`]), because a
//!   key we do not know may describe a different model (transformers 5's
//!   `rope_parameters` once did: ignoring it trained with the wrong rotary
//!   base). [`UnknownKeys::Allow`] (`--allow-unknown-model-keys`) turns the
//!   error into a warning, at the user's risk. The keys inside
//!   `rope_parameters` / `rope_scaling` are checked the same way.
//! - **Rotary settings, both styles.** transformers 4 writes `rope_theta`
//!   and `rope_scaling` at the top level; transformers 5 writes
//!   `rope_parameters: {rope_type, rope_theta, ...}`. Both are read, with
//!   transformers 5's precedence (`rope_scaling` over `rope_parameters`, a
//!   value inside the dict over the top-level one); two different values
//!   for the same setting are an error rather than a silent choice.
//!   Rotary types: `default`, `linear`, `dynamic`, `llama3`, `yarn`
//!   ([`RopeScaling`]; the formulas are in [`super::ops::rope_inv_freq`]);
//!   any other is an error naming it.
//! - Values that would change the math to something we do not implement
//!   (`partial_rotary_factor` below 1, cross-attention, a Qwen sliding
//!   window, an activation other than SiLU in the Llama family, ...) are an
//!   error ([`ModelError::Unsupported`]): silently training a different
//!   model than the checkpoint describes is worse than refusing.
//! - Validation checks every size for zero, divisibility and `usize` overflow
//!   of the parameter counts, so later code can multiply dimensions freely.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::ModelError;

/// Which decoder family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Arch {
    /// GPT-2: learned position embedding, LayerNorm, fused qkv Conv1D, GELU MLP.
    Gpt2,
    /// The Llama family: RMSNorm, rotary embeddings, SwiGLU MLP (Llama,
    /// Mistral, Qwen2, Qwen3; see [`Family`] and the flags of
    /// [`ModelConfig`]).
    Llama,
}

/// Which HF model family: the `model_type`, the tensor names' owner and the
/// exported `architectures`. The math is [`Arch`] plus the flags of
/// [`ModelConfig`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Family {
    /// `"gpt2"`, `GPT2LMHeadModel`.
    Gpt2,
    /// `"llama"`, `LlamaForCausalLM`.
    Llama,
    /// `"mistral"`, `MistralForCausalLM`: Llama math with a sliding window.
    Mistral,
    /// `"qwen2"` (Qwen2, Qwen2.5), `Qwen2ForCausalLM`: bias on q, k and v.
    Qwen2,
    /// `"qwen3"`, `Qwen3ForCausalLM`: RMSNorm of q and k per head.
    Qwen3,
}

impl Family {
    /// The HF `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Gpt2 => "gpt2",
            Family::Llama => "llama",
            Family::Mistral => "mistral",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
        }
    }

    /// The HF class of the causal LM (`architectures` of an export).
    pub fn architecture(self) -> &'static str {
        match self {
            Family::Gpt2 => "GPT2LMHeadModel",
            Family::Llama => "LlamaForCausalLM",
            Family::Mistral => "MistralForCausalLM",
            Family::Qwen2 => "Qwen2ForCausalLM",
            Family::Qwen3 => "Qwen3ForCausalLM",
        }
    }

    /// A display name.
    pub fn name(self) -> &'static str {
        match self {
            Family::Gpt2 => "GPT-2",
            Family::Llama => "Llama",
            Family::Mistral => "Mistral",
            Family::Qwen2 => "Qwen2",
            Family::Qwen3 => "Qwen3",
        }
    }
}

/// The rotary variant (`rope_type`), with its parameters as transformers
/// names them. The inverse frequencies each gives are computed by
/// [`super::ops::rope_inv_freq`].
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE: `inv_freq[i] = theta^(-2i/d)`.
    Default,
    /// Position interpolation: `inv_freq / factor`.
    Linear {
        /// `factor`.
        factor: f64,
    },
    /// Dynamic NTK: the base grows with the sequence beyond
    /// `max_position_embeddings` (so plain RoPE at training lengths, which
    /// never exceed it).
    Dynamic {
        /// `factor`.
        factor: f64,
    },
    /// Llama 3.1's piecewise rescaling of the frequencies.
    Llama3 {
        /// `factor` (8 in Llama 3.1).
        factor: f64,
        /// `low_freq_factor` (1).
        low_freq_factor: f64,
        /// `high_freq_factor` (4).
        high_freq_factor: f64,
        /// `original_max_position_embeddings` (8192).
        original_max_position_embeddings: usize,
    },
    /// YaRN: ramped interpolation plus an attention factor on cos and sin.
    Yarn {
        /// `factor`.
        factor: f64,
        /// `original_max_position_embeddings`.
        original_max_position_embeddings: usize,
        /// `attention_factor` (`None`: from `factor`, `mscale`, `mscale_all_dim`).
        attention_factor: Option<f64>,
        /// `beta_fast` (`None`: 32).
        beta_fast: Option<f64>,
        /// `beta_slow` (`None`: 1).
        beta_slow: Option<f64>,
        /// `mscale`.
        mscale: Option<f64>,
        /// `mscale_all_dim`.
        mscale_all_dim: Option<f64>,
        /// `truncate` (default true).
        truncate: bool,
    },
}

/// What to do with a `config.json` key that is neither read nor on
/// [`HARMLESS_KEYS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum UnknownKeys {
    /// An error naming the key (the default).
    #[default]
    Refuse,
    /// A warning; the key is ignored and listed (at the user's risk: the
    /// model may not be the one the file describes).
    Allow,
}

/// The MLP nonlinearity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Activation {
    /// GELU, tanh approximation (HF `gelu_new`, `gelu_pytorch_tanh`): GPT-2's.
    GeluTanh,
    /// GELU with the exact erf (HF `gelu`).
    GeluErf,
    /// SiLU gate of SwiGLU (Llama's `silu`).
    Silu,
}

/// A validated model configuration (internal form; all sizes checked).
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Decoder family.
    pub arch: Arch,
    /// Vocabulary size (rows of the token embedding).
    pub vocab_size: usize,
    /// Model width (`n_embd` / `hidden_size`).
    pub hidden_size: usize,
    /// Number of transformer blocks.
    pub n_layer: usize,
    /// Attention heads for queries.
    pub n_head: usize,
    /// Attention heads for keys and values (`== n_head` without GQA).
    pub n_kv_head: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// MLP inner width.
    pub intermediate_size: usize,
    /// Longest sequence accepted (`n_positions` / `max_position_embeddings`).
    pub max_seq_len: usize,
    /// Epsilon of LayerNorm / RMSNorm.
    pub norm_eps: f64,
    /// Rotary base (Llama family only; unused for GPT-2).
    pub rope_theta: f64,
    /// Rotary variant (Llama family only; `Default` for GPT-2).
    pub rope_scaling: RopeScaling,
    /// HF family (model_type, names of the export).
    pub family: Family,
    /// Llama family: bias on the q, k and v projections (Llama and Qwen3
    /// `attention_bias`; always for Qwen2). False for GPT-2 (whose biases
    /// are fixed by its layout).
    pub qkv_bias: bool,
    /// Llama family: bias on the attention output projection (Llama and Qwen3
    /// `attention_bias`; never for Qwen2).
    pub o_bias: bool,
    /// Llama family: biases on gate, up and down projections (Llama
    /// `mlp_bias`).
    pub mlp_bias: bool,
    /// RMSNorm of q and k over each head, before the rotary embedding
    /// (Qwen3's `q_norm` / `k_norm`).
    pub qk_norm: bool,
    /// Each query attends to at most this many keys, itself included
    /// (Mistral's `sliding_window`); `None`: all earlier keys.
    pub sliding_window: Option<usize>,
    /// LM head shares the token embedding matrix.
    pub tie_word_embeddings: bool,
    /// MLP nonlinearity.
    pub activation: Activation,
    /// Std of the normal init of weight matrices and embeddings.
    pub initializer_range: f64,
}

fn d_gpt2_vocab() -> usize {
    50257
}
fn d_gpt2_npos() -> usize {
    1024
}
fn d_gpt2_embd() -> usize {
    768
}
fn d_12() -> usize {
    12
}
fn d_gelu_new() -> String {
    "gelu_new".to_string()
}
fn d_ln_eps() -> f64 {
    1e-5
}
fn d_init_range() -> f64 {
    0.02
}
fn d_true() -> bool {
    true
}
fn d_false() -> bool {
    false
}

/// Upper bounds on the sizes a `config.json` may give, far above any real
/// model (the largest vocabularies are ~2^18, widths ~2^15, depths ~2^8),
/// low enough that nothing derived from them can overflow or ask for an
/// absurd allocation.
pub const MAX_VOCAB_SIZE: usize = 1 << 24;
/// Bound on `hidden_size`, `intermediate_size` and `head_dim`.
pub const MAX_WIDTH: usize = 1 << 20;
/// Bound on the number of layers.
pub const MAX_LAYERS: usize = 1 << 14;
/// Bound on attention heads.
pub const MAX_HEADS: usize = 1 << 14;
/// Bound on `max_position_embeddings` / `n_positions`.
pub const MAX_SEQ_LEN: usize = 1 << 24;
/// Bound on the elements of one parameter tensor (2^36: 256 GiB in fp32).
pub const MAX_TENSOR_NUMEL: usize = 1 << 36;

/// HF `GPT2Config` keys that we read (defaults as in `transformers`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HfGpt2Config {
    /// Always `"gpt2"`.
    pub model_type: String,
    #[serde(default = "d_gpt2_vocab")]
    pub vocab_size: usize,
    #[serde(default = "d_gpt2_npos")]
    pub n_positions: usize,
    #[serde(default = "d_gpt2_embd")]
    pub n_embd: usize,
    #[serde(default = "d_12")]
    pub n_layer: usize,
    #[serde(default = "d_12")]
    pub n_head: usize,
    /// `None` (JSON null) means `4 * n_embd`.
    #[serde(default)]
    pub n_inner: Option<usize>,
    #[serde(default = "d_gelu_new")]
    pub activation_function: String,
    #[serde(default = "d_ln_eps")]
    pub layer_norm_epsilon: f64,
    #[serde(default = "d_init_range")]
    pub initializer_range: f64,
    #[serde(default = "d_true")]
    pub tie_word_embeddings: bool,
    #[serde(default = "d_true")]
    pub scale_attn_weights: bool,
    #[serde(default = "d_false")]
    pub scale_attn_by_inverse_layer_idx: bool,
    #[serde(default = "d_false")]
    pub add_cross_attention: bool,
}

/// The first key of a GPT-2 `config.json` object whose value does not
/// read as its field (a `null`, a string for a number, a negative size),
/// as an error naming it: serde's message for the whole object names only
/// the type. `None` if no one key alone fails.
fn gpt2_key_error(obj: &serde_json::Map<String, Value>, model_type: &str) -> Option<ModelError> {
    obj.iter()
        .filter(|(k, _)| *k != "model_type")
        .find_map(|(k, v)| {
            let one = serde_json::json!({ "model_type": model_type, k.as_str(): v });
            serde_json::from_value::<HfGpt2Config>(one).err().map(|e| {
                invalid(
                    k,
                    format!(
                        "{v}: {}",
                        e.to_string().trim_end_matches(" at line 0 column 0")
                    ),
                )
            })
        })
}

fn invalid(key: &str, reason: impl Into<String>) -> ModelError {
    ModelError::InvalidConfig {
        key: key.to_string(),
        reason: reason.into(),
    }
}

fn unsupported(what: impl Into<String>) -> ModelError {
    ModelError::Unsupported { what: what.into() }
}

/// Qwen2/Qwen3's sliding window is per layer (`layer_types`, or
/// `use_sliding_window` from layer `max_window_layers` on). Only configs
/// whose every layer is full attention are accepted; the others are refused
/// (not implemented) rather than run without their window.
fn qwen_sliding_window(k: &Keys<'_>, n_layer: usize) -> Result<(), ModelError> {
    let use_sw = k.bool("use_sliding_window", false)?;
    // Absent, transformers' default window is 4096; null is none.
    let window = match (use_sw, k.0.contains_key("sliding_window")) {
        (false, _) => None,
        (true, false) => Some(4096),
        (true, true) => k.opt_usize("sliding_window")?,
    };
    let refuse = |why: String| {
        unsupported(format!(
            "{why}: per-layer sliding-window attention (Qwen2/Qwen3) is not implemented; \
             use_sliding_window false trains every layer with full attention"
        ))
    };
    match k.get("layer_types") {
        Some(Value::Array(types)) => {
            if types.len() != n_layer {
                return Err(invalid(
                    "layer_types",
                    format!("{} entries for num_hidden_layers {n_layer}", types.len()),
                ));
            }
            for (i, t) in types.iter().enumerate() {
                match t.as_str() {
                    Some("full_attention") => {}
                    Some("sliding_attention") => {
                        return Err(refuse(format!("layer_types[{i}] = \"sliding_attention\"")))
                    }
                    _ => {
                        return Err(invalid(
                            "layer_types",
                            format!("entry {i} is {t}; expected \"full_attention\" or \"sliding_attention\""),
                        ))
                    }
                }
            }
        }
        Some(v) => return Err(invalid("layer_types", format!("expected a list, got {v}"))),
        None => {
            // (null is let through: transformers reads it only with the
            // window on.)
            let from = k.opt_usize("max_window_layers")?.unwrap_or(28);
            if window.is_some() && from < n_layer {
                return Err(refuse(format!(
                    "use_sliding_window true with max_window_layers {from} < num_hidden_layers {n_layer}"
                )));
            }
        }
    }
    Ok(())
}

/// Typed reads of a Llama-family `config.json` object. `null` is
/// transformers' `None`: for the optional reads (`opt_*`: a key whose
/// `None` has a meaning, as `num_key_value_heads` or `head_dim`) it is
/// absent; for a number read with a default ([`Keys::usize`],
/// [`Keys::f64`]: `rms_norm_eps`, `vocab_size`, ...) it is an error, since
/// transformers keeps the `None` there (its model then fails on it) rather
/// than taking the default.
struct Keys<'a>(&'a serde_json::Map<String, Value>);

impl Keys<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }

    /// An error when `key` is present as `null` (see the type's docs).
    fn not_null(&self, key: &str, default: impl std::fmt::Display) -> Result<(), ModelError> {
        if self.0.get(key).is_some_and(Value::is_null) {
            return Err(invalid(
                key,
                format!(
                    "null: transformers keeps it as None, which its model cannot compute with; \
                     give a number or leave the key out (default {default})"
                ),
            ));
        }
        Ok(())
    }

    fn opt_usize(&self, key: &str) -> Result<Option<usize>, ModelError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| invalid(key, format!("expected a non-negative integer, got {v}"))),
        }
    }

    fn usize(&self, key: &str, default: usize) -> Result<usize, ModelError> {
        self.not_null(key, default)?;
        Ok(self.opt_usize(key)?.unwrap_or(default))
    }

    fn opt_f64(&self, key: &str) -> Result<Option<f64>, ModelError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| invalid(key, format!("expected a number, got {v}"))),
        }
    }

    fn f64(&self, key: &str, default: f64) -> Result<f64, ModelError> {
        self.not_null(key, default)?;
        Ok(self.opt_f64(key)?.unwrap_or(default))
    }

    /// A flag: `default` when absent; `null` is false, as transformers
    /// tests its `None` (`if truncate:`; yarn's `truncate` defaults to
    /// true, so a `null` there turns it off).
    fn bool(&self, key: &str, default: bool) -> Result<bool, ModelError> {
        if self.0.get(key).is_some_and(Value::is_null) {
            return Ok(false);
        }
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| invalid(key, format!("expected true or false, got {v}"))),
        }
    }

    fn str<'s>(&'s self, key: &str, default: &'s str) -> Result<&'s str, ModelError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_str()
                .ok_or_else(|| invalid(key, format!("expected a string, got {v}"))),
        }
    }
}

/// transformers' defaults of one Llama-family config class.
struct FamilyDefaults {
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    layers: usize,
    heads: usize,
    /// `None`: `num_attention_heads`.
    kv_heads: Option<usize>,
    /// `None`: `hidden_size / num_attention_heads`.
    head_dim: Option<usize>,
    max_positions: usize,
    /// Mistral's `sliding_window` when the key is absent.
    sliding_window: Option<usize>,
}

fn family_defaults(family: Family) -> FamilyDefaults {
    match family {
        Family::Gpt2 | Family::Llama => FamilyDefaults {
            vocab_size: 32000,
            hidden_size: 4096,
            intermediate_size: 11008,
            layers: 32,
            heads: 32,
            kv_heads: None,
            head_dim: None,
            max_positions: 2048,
            sliding_window: None,
        },
        Family::Mistral => FamilyDefaults {
            vocab_size: 32000,
            hidden_size: 4096,
            intermediate_size: 14336,
            layers: 32,
            heads: 32,
            kv_heads: Some(8),
            head_dim: None,
            max_positions: 4096 * 32,
            sliding_window: Some(4096),
        },
        Family::Qwen2 | Family::Qwen3 => FamilyDefaults {
            vocab_size: 151936,
            hidden_size: 4096,
            intermediate_size: 22016,
            layers: 32,
            heads: 32,
            kv_heads: Some(32),
            head_dim: (family == Family::Qwen3).then_some(128),
            max_positions: 32768,
            sliding_window: None,
        },
    }
}

mod checks;
mod keys;
mod rope;
mod token_ids;

pub use token_ids::{TokenIds, TOKEN_ID_KEYS};

pub use keys::HARMLESS_KEYS;
use keys::{check_keys, check_refused_values, family_keys, GPT2_KEYS, LLAMA_FAMILY_KEYS};
use rope::parse_rope;

impl ModelConfig {
    /// Parses an HF `config.json` text; an unknown key is an error
    /// ([`UnknownKeys::Refuse`]). Returns the config and the unknown keys
    /// that were ignored (none, with this policy).
    pub fn from_hf_json(text: &str) -> Result<(Self, Vec<String>), ModelError> {
        Self::from_hf_json_with(text, UnknownKeys::Refuse)
    }

    /// Like [`ModelConfig::from_hf_json`] with an explicit policy for
    /// unknown keys.
    pub fn from_hf_json_with(
        text: &str,
        policy: UnknownKeys,
    ) -> Result<(Self, Vec<String>), ModelError> {
        let value: Value = serde_json::from_str(text).map_err(|e| ModelError::ConfigJson {
            reason: e.to_string(),
        })?;
        Self::from_hf_value_with(&value, policy)
    }

    /// Like [`ModelConfig::from_hf_json`], from a parsed JSON value.
    pub fn from_hf_value(value: &Value) -> Result<(Self, Vec<String>), ModelError> {
        Self::from_hf_value_with(value, UnknownKeys::Refuse)
    }

    /// Like [`ModelConfig::from_hf_value`] with an explicit policy for
    /// unknown keys: with [`UnknownKeys::Allow`] they are warned about and
    /// returned.
    pub fn from_hf_value_with(
        value: &Value,
        policy: UnknownKeys,
    ) -> Result<(Self, Vec<String>), ModelError> {
        let obj = value
            .as_object()
            .ok_or_else(|| invalid("<root>", "config.json must be a JSON object"))?;
        let model_type = obj
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| invalid("model_type", "missing or not a string"))?;
        let de_err = |e: serde_json::Error| ModelError::ConfigJson {
            reason: e.to_string(),
        };
        let family = match model_type {
            "gpt2" => Family::Gpt2,
            "llama" => Family::Llama,
            "mistral" => Family::Mistral,
            "qwen2" => Family::Qwen2,
            "qwen3" => Family::Qwen3,
            other => {
                return Err(unsupported(format!(
                    "model_type {other:?} (supported: \"gpt2\", \"llama\", \"mistral\", \
                     \"qwen2\", \"qwen3\")"
                )))
            }
        };
        let mut unknown = Vec::new();
        check_refused_values(obj, family)?;
        if family == Family::Gpt2 {
            check_keys(
                obj,
                &[GPT2_KEYS],
                HARMLESS_KEYS,
                "",
                model_type,
                policy,
                &mut unknown,
            )?;
            let hf: HfGpt2Config = serde_json::from_value(value.clone())
                .map_err(|e| gpt2_key_error(obj, model_type).unwrap_or_else(|| de_err(e)))?;
            return Ok((Self::from_gpt2(&hf)?, unknown));
        }
        check_keys(
            obj,
            &[LLAMA_FAMILY_KEYS, family_keys(family)],
            HARMLESS_KEYS,
            "",
            model_type,
            policy,
            &mut unknown,
        )?;
        let cfg = Self::from_llama_family(obj, family, policy, &mut unknown)?;
        Ok((cfg, unknown))
    }

    /// Validates an HF GPT-2 config.
    pub fn from_gpt2(hf: &HfGpt2Config) -> Result<Self, ModelError> {
        let activation = match hf.activation_function.as_str() {
            "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => Activation::GeluTanh,
            "gelu" => Activation::GeluErf,
            other => return Err(unsupported(format!("GPT-2 activation_function {other:?}"))),
        };
        if !hf.scale_attn_weights {
            return Err(unsupported("GPT-2 scale_attn_weights = false"));
        }
        if hf.scale_attn_by_inverse_layer_idx {
            return Err(unsupported("GPT-2 scale_attn_by_inverse_layer_idx = true"));
        }
        if hf.add_cross_attention {
            return Err(unsupported("GPT-2 add_cross_attention = true"));
        }
        if hf.n_head == 0 || !hf.n_embd.is_multiple_of(hf.n_head) {
            return Err(invalid(
                "n_head",
                format!(
                    "n_embd {} must be a positive multiple of n_head {}",
                    hf.n_embd, hf.n_head
                ),
            ));
        }
        let intermediate_size = match hf.n_inner {
            Some(n) => n,
            None => hf
                .n_embd
                .checked_mul(4)
                .ok_or_else(|| invalid("n_embd", "4 * n_embd overflows"))?,
        };
        let cfg = ModelConfig {
            arch: Arch::Gpt2,
            vocab_size: hf.vocab_size,
            hidden_size: hf.n_embd,
            n_layer: hf.n_layer,
            n_head: hf.n_head,
            n_kv_head: hf.n_head,
            head_dim: hf.n_embd / hf.n_head,
            intermediate_size,
            max_seq_len: hf.n_positions,
            norm_eps: hf.layer_norm_epsilon,
            rope_theta: 10000.0,
            rope_scaling: RopeScaling::Default,
            family: Family::Gpt2,
            qkv_bias: false,
            o_bias: false,
            mlp_bias: false,
            qk_norm: false,
            sliding_window: None,
            tie_word_embeddings: hf.tie_word_embeddings,
            activation,
            initializer_range: hf.initializer_range,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Validates a Llama-family config object (keys already checked).
    fn from_llama_family(
        obj: &serde_json::Map<String, Value>,
        family: Family,
        policy: UnknownKeys,
        unknown: &mut Vec<String>,
    ) -> Result<Self, ModelError> {
        let k = Keys(obj);
        let d = family_defaults(family);
        let fam = family.name();
        let hidden_act = k.str("hidden_act", "silu")?;
        if hidden_act != "silu" {
            return Err(unsupported(format!(
                "{fam} hidden_act {hidden_act:?} (only \"silu\", SwiGLU)"
            )));
        }
        let hidden_size = k.usize("hidden_size", d.hidden_size)?;
        let n_head = k.usize("num_attention_heads", d.heads)?;
        if n_head == 0 {
            return Err(invalid("num_attention_heads", "must be positive"));
        }
        // Absent: the family's default (Mistral 8, Qwen 32); null: as many
        // as the query heads, as transformers' configs set `None`.
        let n_kv_head = match k.opt_usize("num_key_value_heads")? {
            Some(n) => n,
            None if obj.contains_key("num_key_value_heads") => n_head,
            None => d.kv_heads.unwrap_or(n_head),
        };
        if d.head_dim.is_some() && obj.get("head_dim").is_some_and(Value::is_null) {
            // transformers 5's Qwen3Config refuses it (an int, strict); 4
            // kept None and failed building the attention.
            return Err(invalid(
                "head_dim",
                format!(
                    "is null; {fam} needs a number (its default is 128 when the key is absent)"
                ),
            ));
        }
        let head_dim = match k.opt_usize("head_dim")?.or(d.head_dim) {
            Some(h) => h,
            None => {
                if !hidden_size.is_multiple_of(n_head) {
                    return Err(invalid(
                        "num_attention_heads",
                        format!(
                            "hidden_size {hidden_size} is not a multiple of num_attention_heads \
                             {n_head} (and no head_dim given)"
                        ),
                    ));
                }
                hidden_size / n_head
            }
        };
        let max_seq_len = k.usize("max_position_embeddings", d.max_positions)?;
        let (rope_theta, rope_scaling) =
            parse_rope(&k, max_seq_len, family.model_type(), policy, unknown)?;
        let attention_bias = k.bool("attention_bias", false)?;
        let (qkv_bias, o_bias) = match family {
            Family::Qwen2 => (true, false),
            Family::Llama | Family::Qwen3 => (attention_bias, attention_bias),
            Family::Mistral | Family::Gpt2 => (false, false),
        };
        let mlp_bias = k.bool("mlp_bias", false)?;
        let n_layer = k.usize("num_hidden_layers", d.layers)?;
        let sliding_window = match family {
            Family::Mistral => {
                if obj.contains_key("sliding_window") {
                    k.opt_usize("sliding_window")?
                } else {
                    d.sliding_window
                }
            }
            Family::Qwen2 | Family::Qwen3 => {
                qwen_sliding_window(&k, n_layer)?;
                None
            }
            Family::Llama | Family::Gpt2 => None,
        };
        let cfg = ModelConfig {
            arch: Arch::Llama,
            vocab_size: k.usize("vocab_size", d.vocab_size)?,
            hidden_size,
            n_layer,
            n_head,
            n_kv_head,
            head_dim,
            intermediate_size: k.usize("intermediate_size", d.intermediate_size)?,
            max_seq_len,
            norm_eps: k.f64("rms_norm_eps", 1e-6)?,
            rope_theta,
            rope_scaling,
            family,
            qkv_bias,
            o_bias,
            mlp_bias,
            qk_norm: family == Family::Qwen3,
            sliding_window,
            tie_word_embeddings: k.bool("tie_word_embeddings", false)?,
            activation: Activation::Silu,
            initializer_range: k.f64("initializer_range", 0.02)?,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// The HF `config.json` object for this config (what an exporter
    /// writes): the family's `model_type` and `architectures` and every key
    /// that changes the math, so `from_pretrained` builds the same model.
    /// Rotary settings go in transformers 4's style (`rope_theta`,
    /// `rope_scaling`), which transformers 5 reads as well.
    pub fn to_hf_value(&self) -> Value {
        match self.arch {
            Arch::Gpt2 => serde_json::json!({
                "model_type": "gpt2",
                "architectures": ["GPT2LMHeadModel"],
                "vocab_size": self.vocab_size,
                "n_positions": self.max_seq_len,
                "n_embd": self.hidden_size,
                "n_layer": self.n_layer,
                "n_head": self.n_head,
                "n_inner": self.intermediate_size,
                "activation_function": match self.activation {
                    Activation::GeluErf => "gelu",
                    _ => "gelu_new",
                },
                "layer_norm_epsilon": self.norm_eps,
                "initializer_range": self.initializer_range,
                "tie_word_embeddings": self.tie_word_embeddings,
            }),
            Arch::Llama => {
                let mut v = serde_json::json!({
                    "model_type": self.family.model_type(),
                    "architectures": [self.family.architecture()],
                    "vocab_size": self.vocab_size,
                    "hidden_size": self.hidden_size,
                    "intermediate_size": self.intermediate_size,
                    "num_hidden_layers": self.n_layer,
                    "num_attention_heads": self.n_head,
                    "num_key_value_heads": self.n_kv_head,
                    "head_dim": self.head_dim,
                    "max_position_embeddings": self.max_seq_len,
                    "rms_norm_eps": self.norm_eps,
                    "rope_theta": self.rope_theta,
                    "tie_word_embeddings": self.tie_word_embeddings,
                    "hidden_act": "silu",
                    "initializer_range": self.initializer_range,
                });
                let extra = match self.family {
                    Family::Mistral => serde_json::json!({"sliding_window": self.sliding_window}),
                    Family::Qwen2 => serde_json::json!({
                        "use_sliding_window": false,
                        "sliding_window": null,
                    }),
                    Family::Qwen3 => serde_json::json!({
                        "attention_bias": self.qkv_bias,
                        "use_sliding_window": false,
                        "sliding_window": null,
                    }),
                    Family::Llama | Family::Gpt2 => serde_json::json!({
                        "attention_bias": self.qkv_bias,
                        "mlp_bias": self.mlp_bias,
                    }),
                };
                if let (Some(o), Some(e)) = (v.as_object_mut(), extra.as_object()) {
                    for (k, x) in e {
                        o.insert(k.clone(), x.clone());
                    }
                    if let Some(r) = self.rope_scaling_value() {
                        o.insert("rope_scaling".to_owned(), r);
                    }
                }
                v
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    /// A GPT-2 value of the wrong type is refused naming its key and the
    /// value (serde's message for the object named only the type).
    #[test]
    fn a_gpt2_value_of_the_wrong_type_names_its_key() {
        for (text, key, value) in [
            (r#"{"model_type":"gpt2","n_layer":null}"#, "n_layer", "null"),
            (
                r#"{"model_type":"gpt2","n_embd":"768"}"#,
                "n_embd",
                "\"768\"",
            ),
            (r#"{"n_head":-2,"model_type":"gpt2"}"#, "n_head", "-2"),
            (
                r#"{"model_type":"gpt2","n_layer":2,"layer_norm_epsilon":true}"#,
                "layer_norm_epsilon",
                "true",
            ),
        ] {
            match ModelConfig::from_hf_json(text) {
                Err(ModelError::InvalidConfig { key: k, reason }) => {
                    assert_eq!(k, key, "{text}");
                    assert!(
                        reason.starts_with(&format!("{value}: invalid")),
                        "{text}: {reason}"
                    );
                    assert!(!reason.contains("line 0"), "{reason}");
                }
                other => panic!("{text}: {other:?}"),
            }
        }
    }

    #[test]
    fn gpt2_defaults_match_hf() {
        let (cfg, unknown) = ModelConfig::from_hf_json(r#"{"model_type":"gpt2"}"#).unwrap();
        assert!(unknown.is_empty());
        assert_eq!(cfg.vocab_size, 50257);
        assert_eq!(cfg.hidden_size, 768);
        assert_eq!(cfg.intermediate_size, 3072);
        assert_eq!(cfg.head_dim, 64);
        assert_eq!(cfg.activation, Activation::GeluTanh);
        assert!(cfg.tie_word_embeddings);
    }

    #[test]
    fn null_kv_heads_is_the_query_heads_and_absent_is_the_family_default() {
        // transformers: `if num_key_value_heads is None: = num_attention_heads`;
        // only an absent key gets the signature default (Mistral 8, Qwen 32).
        for (family, absent) in [("mistral", 8), ("qwen2", 32), ("qwen3", 32), ("llama", 32)] {
            let text = format!(
                r#"{{"model_type":"{family}","num_attention_heads":32,"hidden_size":4096,"num_key_value_heads":null}}"#
            );
            let (cfg, _) = ModelConfig::from_hf_json(&text).unwrap();
            assert_eq!(cfg.n_kv_head, 32, "{family} null");
            let text = format!(
                r#"{{"model_type":"{family}","num_attention_heads":32,"hidden_size":4096}}"#
            );
            let (cfg, _) = ModelConfig::from_hf_json(&text).unwrap();
            assert_eq!(cfg.n_kv_head, absent, "{family} absent");
        }
        let text = r#"{"model_type":"qwen2","num_attention_heads":14,"hidden_size":896,"num_key_value_heads":null}"#;
        assert_eq!(ModelConfig::from_hf_json(text).unwrap().0.n_kv_head, 14);
    }

    #[test]
    fn a_null_number_that_the_math_reads_is_refused_not_defaulted() {
        // transformers keeps None there (LlamaRMSNorm then fails on it);
        // it trained with the default.
        for key in [
            "rms_norm_eps",
            "vocab_size",
            "max_position_embeddings",
            "intermediate_size",
        ] {
            let text = format!(
                r#"{{"model_type":"llama","num_attention_heads":16,"hidden_size":1024,"{key}":null}}"#
            );
            let e = ModelConfig::from_hf_json(&text).unwrap_err().to_string();
            assert!(e.contains(key) && e.contains("null"), "{key}: {e}");
        }
    }

    #[test]
    fn a_null_head_dim_is_refused_where_the_family_has_a_number() {
        let text =
            r#"{"model_type":"qwen3","num_attention_heads":16,"hidden_size":1024,"head_dim":null}"#;
        let e = ModelConfig::from_hf_json(text).unwrap_err().to_string();
        assert!(e.contains("head_dim"), "{e}");
        // Llama's default is None: null is hidden / heads, as absent is.
        let text =
            r#"{"model_type":"llama","num_attention_heads":16,"hidden_size":1024,"head_dim":null}"#;
        assert_eq!(ModelConfig::from_hf_json(text).unwrap().0.head_dim, 64);
    }

    #[test]
    fn token_ids_travel_as_written_and_bad_ones_are_dropped() {
        let v: Value = serde_json::json!({"model_type": "llama", "bos_token_id": 128000,
            "eos_token_id": [128001, 128008], "pad_token_id": null});
        let ids = TokenIds::from_hf_value(&v);
        let mut out = serde_json::json!({"model_type": "llama"});
        ids.add_to(&mut out);
        assert_eq!(
            out,
            serde_json::json!({"model_type": "llama", "bos_token_id": 128000,
                "eos_token_id": [128001, 128008], "pad_token_id": null})
        );
        let bad = serde_json::json!({"bos_token_id": -1, "eos_token_id": "x",
            "pad_token_id": []});
        assert!(TokenIds::from_hf_value(&bad).is_empty());
        assert!(TokenIds::from_hf_value(&serde_json::json!([1])).is_empty());
    }

    #[test]
    fn unknown_key_is_an_error_naming_it_unless_allowed() {
        let text = r#"{"model_type":"gpt2","bos_token_id":1,"frobnicate":3}"#;
        let e = ModelConfig::from_hf_json(text).unwrap_err();
        assert!(
            matches!(&e, ModelError::UnknownConfigKey { key, .. } if key == "frobnicate"),
            "{e}"
        );
        let msg = e.to_string();
        assert!(msg.contains("`frobnicate`") && msg.contains("--allow-unknown-model-keys"));
        assert!(!msg.contains('\n'), "one line: {msg}");
        let (_, unknown) = ModelConfig::from_hf_json_with(text, UnknownKeys::Allow).unwrap();
        assert_eq!(unknown, vec!["frobnicate".to_string()]);
        // Inside the rotary dict too, named with its path.
        let text = r#"{"model_type":"llama","rope_parameters":{"rope_type":"default","rope_theta":5.0,"warp":2}}"#;
        let e = ModelConfig::from_hf_json(text).unwrap_err();
        assert!(
            matches!(&e, ModelError::UnknownConfigKey { key, .. } if key == "rope_parameters.warp"),
            "{e}"
        );
        let (c, unknown) = ModelConfig::from_hf_json_with(text, UnknownKeys::Allow).unwrap();
        assert_eq!(unknown, vec!["rope_parameters.warp".to_string()]);
        assert_eq!(c.rope_theta, 5.0);
        // A key of another family is unknown here.
        let e = ModelConfig::from_hf_json(r#"{"model_type":"mistral","attention_bias":true}"#)
            .unwrap_err();
        assert!(matches!(e, ModelError::UnknownConfigKey { .. }), "{e}");
        // The harmless ones pass in every family.
        for family in ["gpt2", "llama", "mistral", "qwen2", "qwen3"] {
            let mut v = serde_json::json!({"model_type": family});
            for k in HARMLESS_KEYS {
                v[*k] = Value::Null;
            }
            ModelConfig::from_hf_value(&v).unwrap();
        }
    }

    const SMALL: &str = r#""vocab_size":10,"hidden_size":16,"intermediate_size":12,
        "num_hidden_layers":1,"num_attention_heads":4,"num_key_value_heads":2,
        "max_position_embeddings":64"#;

    fn llama(extra: &str) -> Result<ModelConfig, ModelError> {
        ModelConfig::from_hf_json(&format!(r#"{{"model_type":"llama",{SMALL}{extra}}}"#))
            .map(|(c, _)| c)
    }

    #[test]
    fn rope_settings_read_in_both_styles() {
        // transformers 4: top level; transformers 5: rope_parameters.
        let v4 = llama(r#","rope_theta":500000.0"#).unwrap();
        let v5 =
            llama(r#","rope_parameters":{"rope_type":"default","rope_theta":500000.0}"#).unwrap();
        assert_eq!(v4.rope_theta, 500000.0);
        assert_eq!(v4, v5);
        assert_eq!(llama("").unwrap().rope_theta, 10000.0);
        let l3 = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 32,
        };
        let a = llama(
            r#","rope_theta":500000.0,"rope_scaling":{"rope_type":"llama3","factor":8.0,
            "low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":32}"#,
        )
        .unwrap();
        let b = llama(
            r#","rope_parameters":{"rope_type":"llama3","factor":8.0,"rope_theta":500000.0,
            "low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":32}"#,
        )
        .unwrap();
        assert_eq!(a.rope_scaling, l3);
        assert_eq!(a, b);
        // transformers 4's `type` alias; original_max_position_embeddings
        // defaults to max_position_embeddings.
        let c = llama(r#","rope_scaling":{"type":"linear","factor":2.0}"#).unwrap();
        assert_eq!(c.rope_scaling, RopeScaling::Linear { factor: 2.0 });
        let d = llama(
            r#","rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0}"#,
        )
        .unwrap();
        assert!(matches!(
            d.rope_scaling,
            RopeScaling::Llama3 {
                original_max_position_embeddings: 64,
                ..
            }
        ));
        let y = llama(r#","rope_parameters":{"rope_type":"yarn","factor":4.0,"beta_fast":16}"#)
            .unwrap();
        assert!(matches!(
            y.rope_scaling,
            RopeScaling::Yarn { factor, beta_fast: Some(b), truncate: true, .. } if factor == 4.0 && b == 16.0
        ));
        // The default original is not written: transformers 4.45-4.57
        // would take max_position_embeddings / original (1) as the factor.
        let hf = y.to_hf_value();
        let scaling = hf.get("rope_scaling").unwrap();
        assert!(
            scaling.get("original_max_position_embeddings").is_none(),
            "{hf}"
        );
        let y2 = llama(
            r#","rope_parameters":{"rope_type":"yarn","factor":4.0,"original_max_position_embeddings":16}"#,
        )
        .unwrap();
        let hf = y2.to_hf_value();
        assert_eq!(
            hf["rope_scaling"]["original_max_position_embeddings"], 16,
            "{hf}"
        );
        // `"truncate": null` is transformers' None: falsy, no truncation
        // (it read as absent, true).
        let y3 = llama(r#","rope_parameters":{"rope_type":"yarn","factor":4.0,"truncate":null}"#)
            .unwrap();
        assert!(matches!(
            y3.rope_scaling,
            RopeScaling::Yarn {
                truncate: false,
                ..
            }
        ));
        // Every variant round-trips through the exported config.
        for cfg in [a, c, d, y, y2, y3, v4] {
            let (back, unknown) = ModelConfig::from_hf_value(&cfg.to_hf_value()).unwrap();
            assert!(unknown.is_empty());
            assert_eq!(back, cfg);
        }
    }

    /// An initializer_range whose normal draws are not float32 numbers is
    /// refused naming it (1e300 trained NaN, every step skipped, exit 0);
    /// a large one that fits is taken.
    #[test]
    fn an_initializer_range_beyond_float32_is_refused() {
        let e = llama(r#","initializer_range":1e300"#)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("initializer_range") && e.contains("float32"),
            "{e}"
        );
        // The value as given, not its 300 digits.
        let e = llama(r#","initializer_range":3e37"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("3e37 is too large"), "{e}");
        assert_eq!(
            llama(r#","initializer_range":1e30"#)
                .unwrap()
                .initializer_range,
            1e30
        );
    }

    #[test]
    fn rope_conflicts_and_unknown_types_are_errors_naming_them() {
        for (extra, needle) in [
            (
                r#","rope_theta":1.0,"rope_parameters":{"rope_theta":2.0}"#,
                "rope_theta",
            ),
            (
                r#","rope_scaling":{"rope_type":"linear","factor":2.0},"rope_parameters":{"rope_type":"default"}"#,
                "rope_scaling",
            ),
            (r#","rope_parameters":{"rope_type":"longrope"}"#, "longrope"),
            (r#","rope_parameters":{"rope_type":"linear"}"#, "factor"),
            (
                r#","rope_parameters":{"rope_type":"linear","type":"dynamic","factor":2}"#,
                "rope_type",
            ),
            (r#","rope_parameters":"fast""#, "rope_parameters"),
            (r#","partial_rotary_factor":0.5"#, "partial_rotary_factor"),
            (
                r#","rope_parameters":{"rope_type":"llama3","factor":8.0,"low_freq_factor":4.0,"high_freq_factor":1.0}"#,
                "high_freq_factor",
            ),
            (
                r#","original_max_position_embeddings":16"#,
                "original_max_position_embeddings",
            ),
            // A value is named under the dict that gave it.
            (
                r#","rope_scaling":{"rope_type":"linear","factor":0}"#,
                "`rope_scaling.factor`",
            ),
            (
                r#","original_max_position_embeddings":0,"rope_scaling":{"rope_type":"yarn","factor":2}"#,
                "config key `original_max_position_embeddings`: must be positive",
            ),
            (
                r#","rope_parameters":{"rope_type":"linear","factor":0}"#,
                "`rope_parameters.factor`",
            ),
            (
                r#","rope_scaling":{"type":"llama3","factor":8,"low_freq_factor":4,"high_freq_factor":1}"#,
                "`rope_scaling.high_freq_factor`",
            ),
        ] {
            let e = llama(extra).unwrap_err().to_string();
            assert!(e.contains(needle), "{extra}: {e}");
            assert!(!e.contains('\n'), "{e}");
        }
        // The same value twice is fine.
        llama(r#","rope_theta":7.0,"rope_parameters":{"rope_type":"default","rope_theta":7.0}"#)
            .unwrap();
    }

    #[test]
    fn families_read_their_math_keys() {
        let fam = |t: &str, extra: &str| {
            ModelConfig::from_hf_json(&format!(r#"{{"model_type":"{t}",{SMALL}{extra}}}"#))
                .map(|(c, _)| c)
        };
        let l = fam(
            "llama",
            r#","attention_bias":true,"mlp_bias":true,"head_dim":8"#,
        )
        .unwrap();
        assert!(l.qkv_bias && l.o_bias && l.mlp_bias && !l.qk_norm);
        assert_eq!(l.head_dim, 8);
        let m = fam("mistral", r#","sliding_window":5"#).unwrap();
        assert_eq!((m.family, m.sliding_window), (Family::Mistral, Some(5)));
        assert_eq!(
            fam("mistral", r#","sliding_window":null"#)
                .unwrap()
                .sliding_window,
            None
        );
        // transformers' MistralConfig default.
        assert_eq!(fam("mistral", "").unwrap().sliding_window, Some(4096));
        let q2 = fam("qwen2", r#","layer_types":["full_attention"],"use_sliding_window":false,"sliding_window":null,"max_window_layers":28"#).unwrap();
        assert!(q2.qkv_bias && !q2.o_bias && !q2.qk_norm);
        let q3 = fam("qwen3", r#","head_dim":6"#).unwrap();
        assert!(q3.qk_norm && !q3.qkv_bias && q3.head_dim == 6);
        assert_eq!(fam("qwen3", "").unwrap().head_dim, 128);
        for cfg in [l, m, q2, q3] {
            let v = cfg.to_hf_value();
            assert_eq!(v["model_type"], cfg.family.model_type());
            let (back, unknown) = ModelConfig::from_hf_value(&v).unwrap();
            assert!(unknown.is_empty());
            assert_eq!(back, cfg);
        }
        // Qwen's per-layer sliding window is refused, not ignored.
        // The window absent is transformers' 4096, not none.
        for extra in [
            r#","layer_types":["sliding_attention"]"#,
            r#","use_sliding_window":true,"sliding_window":4,"max_window_layers":0"#,
            r#","use_sliding_window":true,"max_window_layers":0"#,
        ] {
            let e = fam("qwen2", extra).unwrap_err().to_string();
            assert!(e.contains("sliding"), "{e}");
        }
        // A null window is none: every layer full attention.
        fam(
            "qwen2",
            r#","use_sliding_window":true,"sliding_window":null,"max_window_layers":0"#,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert!(fam("llama", r#","hidden_act":"gelu""#).is_err());
        assert!(fam("mistral", r#","sliding_window":0"#).is_err());
    }

    #[test]
    fn llama_gqa_and_round_trip() {
        let text = r#"{"model_type":"llama","vocab_size":10,"hidden_size":8,"intermediate_size":12,
            "num_hidden_layers":1,"num_attention_heads":4,"num_key_value_heads":2,"max_position_embeddings":16}"#;
        let (cfg, _) = ModelConfig::from_hf_json(text).unwrap();
        assert_eq!((cfg.n_head, cfg.n_kv_head, cfg.head_dim), (4, 2, 2));
        let (back, unknown) = ModelConfig::from_hf_value(&cfg.to_hf_value()).unwrap();
        assert!(unknown.is_empty());
        assert_eq!(back, cfg);
    }

    #[test]
    fn bad_configs_are_errors() {
        for text in [
            r#"{"model_type":"gpt2","n_embd":10,"n_head":3}"#,
            r#"{"model_type":"gpt2","n_layer":0}"#,
            r#"{"model_type":"gpt2","n_embd":-1}"#,
            r#"{"model_type":"bert"}"#,
            r#"{"model_type":"llama","rope_scaling":{"type":"su","factor":2.0}}"#,
            r#"{"model_type":"mixtral"}"#,
            r#"{"model_type":"llama","num_attention_heads":32,"num_key_value_heads":5}"#,
            r#"{"model_type":"gpt2","vocab_size":18446744073709551615,"n_embd":1024,"n_head":1}"#,
            r#"[1,2]"#,
            r#"not json"#,
        ] {
            assert!(ModelConfig::from_hf_json(text).is_err(), "{text}");
        }
    }
}
