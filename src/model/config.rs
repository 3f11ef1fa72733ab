//! Model configuration: the HF `config.json` at the edge, a validated
//! [`ModelConfig`] inside.
//!
//! Design:
//! - The serde structs ([`HfGpt2Config`], [`HfLlamaConfig`]) mirror the key
//!   names and defaults of the HF `transformers` classes `GPT2Config` and
//!   `LlamaConfig`, so a `config.json` written by `save_pretrained` reads
//!   unchanged, and a config that omits a key means what it means there.
//! - Unknown keys are warned about (through `tracing`), never rejected. Keys
//!   that HF writes but that do not change the math we run (token ids,
//!   `torch_dtype`, dropout probabilities: we train without dropout) are
//!   accepted silently.
//! - Keys whose values would change the math to something we do not implement
//!   (`rope_scaling`, attention biases in Llama, cross-attention, ...) are an
//!   error ([`ModelError::Unsupported`]): silently training a different model
//!   than the checkpoint describes is worse than refusing.
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
    /// Llama: RMSNorm, rotary embeddings, SwiGLU MLP, no biases.
    Llama,
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
    /// Rotary base (Llama only; unused for GPT-2).
    pub rope_theta: f64,
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

fn d_llama_vocab() -> usize {
    32000
}
fn d_llama_hidden() -> usize {
    4096
}
fn d_llama_inter() -> usize {
    11008
}
fn d_32() -> usize {
    32
}
fn d_llama_maxpos() -> usize {
    2048
}
fn d_rms_eps() -> f64 {
    1e-6
}
fn d_rope_theta() -> f64 {
    10000.0
}
fn d_silu() -> String {
    "silu".to_string()
}

/// HF `LlamaConfig` keys that we read (defaults as in `transformers`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HfLlamaConfig {
    /// Always `"llama"`.
    pub model_type: String,
    #[serde(default = "d_llama_vocab")]
    pub vocab_size: usize,
    #[serde(default = "d_llama_hidden")]
    pub hidden_size: usize,
    #[serde(default = "d_llama_inter")]
    pub intermediate_size: usize,
    #[serde(default = "d_32")]
    pub num_hidden_layers: usize,
    #[serde(default = "d_32")]
    pub num_attention_heads: usize,
    /// `None` means `num_attention_heads` (no GQA).
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// `None` means `hidden_size / num_attention_heads`.
    #[serde(default)]
    pub head_dim: Option<usize>,
    #[serde(default = "d_llama_maxpos")]
    pub max_position_embeddings: usize,
    #[serde(default = "d_rms_eps")]
    pub rms_norm_eps: f64,
    #[serde(default = "d_rope_theta")]
    pub rope_theta: f64,
    /// Must be null: scaled rotary variants are not implemented.
    #[serde(default)]
    pub rope_scaling: Option<Value>,
    #[serde(default = "d_false")]
    pub tie_word_embeddings: bool,
    #[serde(default = "d_silu")]
    pub hidden_act: String,
    #[serde(default = "d_false")]
    pub attention_bias: bool,
    #[serde(default = "d_false")]
    pub mlp_bias: bool,
    #[serde(default = "d_init_range")]
    pub initializer_range: f64,
}

const GPT2_KEYS: &[&str] = &[
    "model_type",
    "vocab_size",
    "n_positions",
    "n_embd",
    "n_layer",
    "n_head",
    "n_inner",
    "activation_function",
    "layer_norm_epsilon",
    "initializer_range",
    "tie_word_embeddings",
    "scale_attn_weights",
    "scale_attn_by_inverse_layer_idx",
    "add_cross_attention",
];

const LLAMA_KEYS: &[&str] = &[
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "tie_word_embeddings",
    "hidden_act",
    "attention_bias",
    "mlp_bias",
    "initializer_range",
];

/// Keys HF writes that do not change the math we run (we train without
/// dropout, and token ids / dtypes are the data loader's and store's business).
const HARMLESS_KEYS: &[&str] = &[
    "architectures",
    "torch_dtype",
    "dtype",
    "transformers_version",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "use_cache",
    "n_ctx",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "attention_dropout",
    "summary_type",
    "summary_use_proj",
    "summary_activation",
    "summary_proj_to_labels",
    "summary_first_dropout",
    "reorder_and_upcast_attn",
    "pretraining_tp",
    "task_specific_params",
    "_name_or_path",
    "id2label",
    "label2id",
];

/// The special token ids of an HF `config.json` (`bos_token_id`,
/// `eos_token_id`, `pad_token_id`). They change nothing we compute (the
/// data loader owns tokens), so they are not part of [`ModelConfig`] and
/// two models differing only in them train alike; but generation reads
/// them, so they travel with the model into checkpoints and the exported
/// `config.json`. Each is kept as written when it is a non-negative integer
/// or a list of them (Llama 3 lists several `eos_token_id`s); `null` is
/// dropped, anything else dropped with a warning.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TokenIds(serde_json::Map<String, Value>);

/// The keys of [`TokenIds`].
pub const TOKEN_ID_KEYS: [&str; 3] = ["bos_token_id", "eos_token_id", "pad_token_id"];

impl TokenIds {
    /// The ids in an HF config object (nothing from anything else).
    pub fn from_hf_value(value: &Value) -> Self {
        let is_id = |v: &Value| v.as_u64().is_some();
        let mut out = serde_json::Map::new();
        let Some(obj) = value.as_object() else {
            return TokenIds(out);
        };
        for key in TOKEN_ID_KEYS {
            match obj.get(key) {
                None | Some(Value::Null) => {}
                Some(v) if is_id(v) => {
                    out.insert(key.to_owned(), v.clone());
                }
                Some(Value::Array(a)) if !a.is_empty() && a.iter().all(is_id) => {
                    out.insert(key.to_owned(), Value::Array(a.clone()));
                }
                Some(v) => {
                    tracing::warn!(key, value = %v, "config.json: not a token id or a list of them; dropped");
                }
            }
        }
        TokenIds(out)
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// `eos_token_id`: the id, or the first of a list (Llama 3 writes
    /// several).
    pub fn eos(&self) -> Option<u64> {
        match self.0.get("eos_token_id")? {
            Value::Array(a) => a.first().and_then(Value::as_u64),
            v => v.as_u64(),
        }
    }

    /// Adds the ids to an HF config object.
    pub fn add_to(&self, value: &mut Value) {
        if let Some(obj) = value.as_object_mut() {
            for (k, v) in &self.0 {
                obj.insert(k.clone(), v.clone());
            }
        }
    }
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

fn warn_unknown(obj: &serde_json::Map<String, Value>, known: &[&str]) -> Vec<String> {
    let mut unknown = Vec::new();
    for key in obj.keys() {
        if !known.contains(&key.as_str()) && !HARMLESS_KEYS.contains(&key.as_str()) {
            tracing::warn!(key = %key, "config.json: unknown key ignored");
            unknown.push(key.clone());
        }
    }
    unknown
}

impl ModelConfig {
    /// Parses an HF `config.json` text. Returns the config and the unknown
    /// keys that were ignored (also logged as warnings).
    pub fn from_hf_json(text: &str) -> Result<(Self, Vec<String>), ModelError> {
        let value: Value = serde_json::from_str(text).map_err(|e| ModelError::ConfigJson {
            reason: e.to_string(),
        })?;
        Self::from_hf_value(&value)
    }

    /// Like [`ModelConfig::from_hf_json`], from a parsed JSON value.
    pub fn from_hf_value(value: &Value) -> Result<(Self, Vec<String>), ModelError> {
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
        match model_type {
            "gpt2" => {
                let unknown = warn_unknown(obj, GPT2_KEYS);
                let hf: HfGpt2Config = serde_json::from_value(value.clone()).map_err(de_err)?;
                Ok((Self::from_gpt2(&hf)?, unknown))
            }
            "llama" => {
                let unknown = warn_unknown(obj, LLAMA_KEYS);
                let hf: HfLlamaConfig = serde_json::from_value(value.clone()).map_err(de_err)?;
                Ok((Self::from_llama(&hf)?, unknown))
            }
            other => Err(unsupported(format!(
                "model_type {other:?} (supported: \"gpt2\", \"llama\")"
            ))),
        }
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
            rope_theta: d_rope_theta(),
            tie_word_embeddings: hf.tie_word_embeddings,
            activation,
            initializer_range: hf.initializer_range,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Validates an HF Llama config.
    pub fn from_llama(hf: &HfLlamaConfig) -> Result<Self, ModelError> {
        if hf.hidden_act != "silu" {
            return Err(unsupported(format!("Llama hidden_act {:?}", hf.hidden_act)));
        }
        if hf.rope_scaling.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(unsupported("Llama rope_scaling (only plain RoPE)"));
        }
        if hf.attention_bias || hf.mlp_bias {
            return Err(unsupported("Llama attention_bias / mlp_bias = true"));
        }
        if hf.num_attention_heads == 0 {
            return Err(invalid("num_attention_heads", "must be positive"));
        }
        let n_kv_head = hf.num_key_value_heads.unwrap_or(hf.num_attention_heads);
        let head_dim = match hf.head_dim {
            Some(d) => d,
            None => {
                if !hf.hidden_size.is_multiple_of(hf.num_attention_heads) {
                    return Err(invalid(
                        "num_attention_heads",
                        format!(
                            "hidden_size {} is not a multiple of num_attention_heads {} (and no head_dim given)",
                            hf.hidden_size, hf.num_attention_heads
                        ),
                    ));
                }
                hf.hidden_size / hf.num_attention_heads
            }
        };
        let cfg = ModelConfig {
            arch: Arch::Llama,
            vocab_size: hf.vocab_size,
            hidden_size: hf.hidden_size,
            n_layer: hf.num_hidden_layers,
            n_head: hf.num_attention_heads,
            n_kv_head,
            head_dim,
            intermediate_size: hf.intermediate_size,
            max_seq_len: hf.max_position_embeddings,
            norm_eps: hf.rms_norm_eps,
            rope_theta: hf.rope_theta,
            tie_word_embeddings: hf.tie_word_embeddings,
            activation: Activation::Silu,
            initializer_range: hf.initializer_range,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks sizes: positive, divisible, and that every parameter's element
    /// count fits in `usize`.
    pub fn validate(&self) -> Result<(), ModelError> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("n_layer", self.n_layer),
            ("n_head", self.n_head),
            ("n_kv_head", self.n_kv_head),
            ("head_dim", self.head_dim),
            ("intermediate_size", self.intermediate_size),
            ("max_seq_len", self.max_seq_len),
        ];
        for (key, v) in positive {
            if v == 0 {
                return Err(invalid(key, "must be positive"));
            }
        }
        if !self.n_head.is_multiple_of(self.n_kv_head) {
            return Err(invalid(
                "num_key_value_heads",
                format!(
                    "n_head {} must be a multiple of n_kv_head {}",
                    self.n_head, self.n_kv_head
                ),
            ));
        }
        if self.arch == Arch::Llama && !self.head_dim.is_multiple_of(2) {
            return Err(invalid(
                "head_dim",
                format!(
                    "rotary embeddings need an even head_dim, got {}",
                    self.head_dim
                ),
            ));
        }
        if self.arch == Arch::Gpt2 && self.n_head * self.head_dim != self.hidden_size {
            return Err(invalid("n_head", "n_head * head_dim must equal n_embd"));
        }
        if !(self.norm_eps.is_finite() && self.norm_eps > 0.0) {
            return Err(invalid(
                "norm_eps",
                format!("must be > 0, got {}", self.norm_eps),
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err(invalid(
                "rope_theta",
                format!("must be > 0, got {}", self.rope_theta),
            ));
        }
        if !(self.initializer_range.is_finite() && self.initializer_range >= 0.0) {
            return Err(invalid(
                "initializer_range",
                format!("must be >= 0, got {}", self.initializer_range),
            ));
        }
        // Absurd sizes are refused before anything is allocated (a model
        // description with n_layer = 2^31 would otherwise allocate its
        // parameter list, and vocab_size = 2^40 its embedding).
        let bounded = [
            ("vocab_size", self.vocab_size, MAX_VOCAB_SIZE),
            ("hidden_size", self.hidden_size, MAX_WIDTH),
            ("intermediate_size", self.intermediate_size, MAX_WIDTH),
            ("n_layer", self.n_layer, MAX_LAYERS),
            ("n_head", self.n_head, MAX_HEADS),
            ("n_kv_head", self.n_kv_head, MAX_HEADS),
            ("head_dim", self.head_dim, MAX_WIDTH),
            ("max_seq_len", self.max_seq_len, MAX_SEQ_LEN),
        ];
        for (key, v, max) in bounded {
            if v > max {
                return Err(invalid(
                    key,
                    format!("{v} is larger than tierzero supports ({max}); is the file corrupt?"),
                ));
            }
        }
        // Every product of dimensions the model forms must fit in usize.
        let dims = [
            (
                "vocab_size * hidden_size",
                self.vocab_size,
                self.hidden_size,
            ),
            (
                "max_seq_len * hidden_size",
                self.max_seq_len,
                self.hidden_size,
            ),
            ("n_head * head_dim", self.n_head, self.head_dim),
            ("n_kv_head * head_dim", self.n_kv_head, self.head_dim),
            (
                "intermediate_size * hidden_size",
                self.intermediate_size,
                self.hidden_size,
            ),
        ];
        for (what, a, b) in dims {
            a.checked_mul(b).ok_or_else(|| ModelError::SizeOverflow {
                what: what.to_string(),
            })?;
        }
        // GPT-2's fused qkv projection is [hidden, 3 * hidden].
        self.hidden_size
            .checked_mul(3)
            .and_then(|x| x.checked_mul(self.hidden_size))
            .ok_or_else(|| ModelError::SizeOverflow {
                what: "3 * hidden_size * hidden_size".to_string(),
            })?;
        // And no single tensor beyond MAX_TENSOR_NUMEL elements.
        for (what, a, b) in dims {
            if a.saturating_mul(b) > MAX_TENSOR_NUMEL {
                return Err(invalid(
                    "<sizes>",
                    format!(
                        "{what} = {a} x {b} elements is larger than tierzero supports \
                         ({MAX_TENSOR_NUMEL} per tensor)"
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The HF `config.json` object for this config (what an exporter writes).
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
            Arch::Llama => serde_json::json!({
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
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
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

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
    fn token_ids_travel_as_written_and_bad_ones_are_dropped() {
        let v: Value = serde_json::json!({"model_type": "llama", "bos_token_id": 128000,
            "eos_token_id": [128001, 128008], "pad_token_id": null});
        let ids = TokenIds::from_hf_value(&v);
        let mut out = serde_json::json!({"model_type": "llama"});
        ids.add_to(&mut out);
        assert_eq!(
            out,
            serde_json::json!({"model_type": "llama", "bos_token_id": 128000,
                "eos_token_id": [128001, 128008]})
        );
        let bad = serde_json::json!({"bos_token_id": -1, "eos_token_id": "x",
            "pad_token_id": []});
        assert!(TokenIds::from_hf_value(&bad).is_empty());
        assert!(TokenIds::from_hf_value(&serde_json::json!([1])).is_empty());
    }

    #[test]
    fn unknown_keys_warned_not_rejected() {
        let (_, unknown) =
            ModelConfig::from_hf_json(r#"{"model_type":"gpt2","bos_token_id":1,"frobnicate":3}"#)
                .unwrap();
        assert_eq!(unknown, vec!["frobnicate".to_string()]);
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
            r#"{"model_type":"llama","rope_scaling":{"type":"linear","factor":2.0}}"#,
            r#"{"model_type":"llama","num_attention_heads":32,"num_key_value_heads":5}"#,
            r#"{"model_type":"gpt2","vocab_size":18446744073709551615,"n_embd":1024,"n_head":1}"#,
            r#"[1,2]"#,
            r#"not json"#,
        ] {
            assert!(ModelConfig::from_hf_json(text).is_err(), "{text}");
        }
    }
}
