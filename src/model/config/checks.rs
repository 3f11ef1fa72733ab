//! [`ModelConfig::validate`]: sizes positive and divisible, every
//! parameter's element count within bounds, and the family's own rules.

use super::*;

impl ModelConfig {
    /// The key of the family's HF `config.json` that sets the field `key`
    /// of this struct, for errors that name what the user wrote (`n_embd`,
    /// not `hidden_size`, for GPT-2; a derived one says how it is
    /// derived).
    fn hf_key(&self, key: &'static str) -> &'static str {
        match (self.arch, key) {
            (Arch::Gpt2, "hidden_size") => "n_embd",
            (Arch::Gpt2, "intermediate_size") => "n_inner",
            (Arch::Gpt2, "max_seq_len") => "n_positions",
            (Arch::Gpt2, "norm_eps") => "layer_norm_epsilon",
            (Arch::Gpt2, "head_dim") => "n_embd / n_head",
            (Arch::Gpt2, "n_kv_head") => "n_head",
            (Arch::Llama, "n_layer") => "num_hidden_layers",
            (Arch::Llama, "n_head") => "num_attention_heads",
            (Arch::Llama, "n_kv_head") => "num_key_value_heads",
            (Arch::Llama, "max_seq_len") => "max_position_embeddings",
            (Arch::Llama, "norm_eps") => "rms_norm_eps",
            _ => key,
        }
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
                return Err(invalid(self.hf_key(key), "must be positive"));
            }
        }
        if !self.n_head.is_multiple_of(self.n_kv_head) {
            return Err(invalid(
                self.hf_key("n_kv_head"),
                format!(
                    "{} {} must be a multiple of {} {}",
                    self.hf_key("n_head"),
                    self.n_head,
                    self.hf_key("n_kv_head"),
                    self.n_kv_head
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
                self.hf_key("norm_eps"),
                format!("must be > 0, got {}", self.norm_eps),
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err(invalid(
                "rope_theta",
                format!("must be > 0, got {}", self.rope_theta),
            ));
        }
        self.validate_family()?;
        if self.sliding_window == Some(0) {
            return Err(invalid(
                "sliding_window",
                "must be positive (or null for none)",
            ));
        }
        self.validate_rope()?;
        if !(self.initializer_range.is_finite() && self.initializer_range >= 0.0) {
            return Err(invalid(
                "initializer_range",
                format!("must be >= 0, got {}", self.initializer_range),
            ));
        }
        // The seeded init's normal draws (several deviations out) must be
        // float32 numbers: 1e300 trained NaN at every step, each skipped,
        // and the run exited 0 (a NaN loss now ends a run without fp16's
        // dynamic scale whatever the value: refused here, it is named
        // before anything runs).
        let largest = f64::from(f32::MAX) / 16.0;
        if self.initializer_range > largest {
            return Err(invalid(
                "initializer_range",
                format!(
                    "{:e} is too large: normal draws of that deviation are not float32 numbers \
                     (at most {largest:e}; HF models use about 0.02)",
                    // (Read as a float32, as HF's config holds it: its
                    // shortest form is the value as written.)
                    self.initializer_range as f32
                ),
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
                    self.hf_key(key),
                    format!("{v} is larger than tierzero supports ({max}); is the file corrupt?"),
                ));
            }
        }
        // Every tensor's element count must fit in usize, and stay within
        // MAX_TENSOR_NUMEL: the embeddings, the attention projections
        // (Llama's q/o and k/v, GPT-2's fused qkv [hidden, 3 * hidden])
        // and the MLP's.
        let mul = |a: usize, b: usize, c: usize| a.checked_mul(b).and_then(|x| x.checked_mul(c));
        let tensors = [
            (
                "vocab_size * hidden_size",
                mul(self.vocab_size, self.hidden_size, 1),
            ),
            (
                "max_seq_len * hidden_size",
                mul(self.max_seq_len, self.hidden_size, 1),
            ),
            (
                "n_head * head_dim * hidden_size",
                mul(self.n_head, self.head_dim, self.hidden_size),
            ),
            (
                "n_kv_head * head_dim * hidden_size",
                mul(self.n_kv_head, self.head_dim, self.hidden_size),
            ),
            (
                "3 * hidden_size * hidden_size",
                mul(3, self.hidden_size, self.hidden_size),
            ),
            (
                "intermediate_size * hidden_size",
                mul(self.intermediate_size, self.hidden_size, 1),
            ),
        ];
        for (what, numel) in tensors {
            let numel = numel.ok_or_else(|| ModelError::SizeOverflow {
                what: what.to_string(),
            })?;
            if numel > MAX_TENSOR_NUMEL {
                return Err(invalid(
                    "<sizes>",
                    format!(
                        "{what} = {numel} elements is larger than tierzero supports \
                         ({MAX_TENSOR_NUMEL} per tensor)"
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The flags must be ones the family's HF class can express (so the
    /// export builds the same model).
    pub(super) fn validate_family(&self) -> Result<(), ModelError> {
        let f = self.family;
        let ok = match f {
            Family::Gpt2 => {
                self.arch == Arch::Gpt2
                    && !(self.qkv_bias || self.o_bias || self.mlp_bias || self.qk_norm)
                    && self.sliding_window.is_none()
            }
            _ if self.arch != Arch::Llama => false,
            Family::Llama => {
                self.qkv_bias == self.o_bias && !self.qk_norm && self.sliding_window.is_none()
            }
            Family::Mistral => !(self.qkv_bias || self.o_bias || self.mlp_bias || self.qk_norm),
            Family::Qwen2 => {
                self.qkv_bias
                    && !(self.o_bias || self.mlp_bias || self.qk_norm)
                    && self.sliding_window.is_none()
            }
            Family::Qwen3 => {
                self.qkv_bias == self.o_bias
                    && self.qk_norm
                    && !self.mlp_bias
                    && self.sliding_window.is_none()
            }
        };
        if ok {
            Ok(())
        } else {
            Err(invalid(
                "model_type",
                format!(
                    "{:?} with qkv_bias {}, o_bias {}, mlp_bias {}, qk_norm {}, sliding_window \
                     {:?} is not a {} model",
                    self.arch,
                    self.qkv_bias,
                    self.o_bias,
                    self.mlp_bias,
                    self.qk_norm,
                    self.sliding_window,
                    f.name()
                ),
            ))
        }
    }
}
