//! The keys of a model's `config.json`: each family's, read; the ones
//! that change no arithmetic tierzero runs ([`HARMLESS_KEYS`]); the check
//! that every key is one of them; and the values of read keys that are
//! refused ([`check_refused_values`]).

use super::*;

pub(super) const GPT2_KEYS: &[&str] = &[
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
    "n_special",
    "pruned_heads",
];

/// Keys every Llama-family config may have, all read.
pub(super) const LLAMA_FAMILY_KEYS: &[&str] = &[
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
    "rope_parameters",
    "partial_rotary_factor",
    "original_max_position_embeddings",
    "tie_word_embeddings",
    "hidden_act",
    "initializer_range",
    "rope_interleaved",
    "pruned_heads",
];

/// The family's own keys beyond [`LLAMA_FAMILY_KEYS`], all read.
pub(super) fn family_keys(family: Family) -> &'static [&'static str] {
    match family {
        Family::Gpt2 => &[],
        Family::Llama => &["attention_bias", "mlp_bias"],
        Family::Mistral => &["sliding_window"],
        Family::Qwen2 => &[
            "use_sliding_window",
            "sliding_window",
            "max_window_layers",
            "layer_types",
            "use_mrope",
        ],
        Family::Qwen3 => &[
            "attention_bias",
            "use_sliding_window",
            "sliding_window",
            "max_window_layers",
            "layer_types",
        ],
    }
}

/// The one list of `config.json` keys that change no arithmetic tierzero
/// runs, accepted in every family without a word: special token ids (the
/// data loader owns tokens; they travel into exports as [`TokenIds`]),
/// dtypes (the run's config decides precision), dropout probabilities (we
/// train without dropout), generation caching, tensor-parallel hints of
/// pretraining (`pretraining_tp`: the same product, split), attention
/// upcasting (`reorder_and_upcast_attn`: precision only), the GPT-2
/// sequence-classification head (`summary_*`: not a causal LM's), labels,
/// generation settings and output switches (`transformers`'
/// `PretrainedConfig` attributes, saved by older versions in every
/// config), and bookkeeping of the tools that wrote the file.
/// `initializer_range` is read, not listed: it sets the seeded init. The
/// README's model section lists the same keys; keep them in step.
pub const HARMLESS_KEYS: &[&str] = &[
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
    "num_labels",
    "_num_labels",
    "problem_type",
    "finetuning_task",
    "tokenizer_class",
    "prefix",
    "sep_token_id",
    "decoder_start_token_id",
    // Generation settings (`generate`'s defaults, not the forward's).
    "max_length",
    "min_length",
    "do_sample",
    "early_stopping",
    "num_beams",
    "num_beam_groups",
    "diversity_penalty",
    "temperature",
    "top_k",
    "top_p",
    "typical_p",
    "repetition_penalty",
    "length_penalty",
    "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size",
    "bad_words_ids",
    "num_return_sequences",
    "output_scores",
    "return_dict_in_generate",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "remove_invalid_values",
    "exponential_decay_length_penalty",
    "suppress_tokens",
    "begin_suppress_tokens",
    "predict_special_tokens",
    // What the forward returns, and how it is traced or stored.
    "return_dict",
    "output_hidden_states",
    "output_attentions",
    "output_past",
    "torchscript",
    "use_bfloat16",
    "tf_legacy_loss",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "is_decoder",
    "cross_attention_hidden_size",
    "tie_encoder_decoder",
    "gradient_checkpointing",
    // Tools' marks.
    "_commit_hash",
    "_attn_implementation_autoset",
    "is_llama_config",
    "unsloth_version",
    "unsloth_fixed",
];

/// Keys read in some families only to refuse a value this engine does
/// not compute (transformers' own classes read them, or read them in
/// another model type): `null` or the harmless value passes.
pub(super) fn check_refused_values(
    obj: &serde_json::Map<String, Value>,
    family: Family,
) -> Result<(), ModelError> {
    let refused = |key: &str, why: &str| {
        unsupported(format!(
            "{} {key} = {} ({why})",
            family.name(),
            obj.get(key).map_or_else(String::new, Value::to_string)
        ))
    };
    let is =
        |key: &str, ok: &dyn Fn(&Value) -> bool| obj.get(key).is_none_or(|v| v.is_null() || ok(v));
    // Heads removed from some layers: another attention shape per layer.
    if !is("pruned_heads", &|v| {
        v.as_object().is_some_and(|m| m.is_empty())
    }) {
        return Err(refused("pruned_heads", "heads removed from some layers"));
    }
    match family {
        // OpenAI GPT's extra special-token rows in the embedding.
        Family::Gpt2 if !is("n_special", &|v| v.as_u64() == Some(0)) => {
            Err(refused("n_special", "extra special-token embedding rows"))
        }
        // Multimodal RoPE (Qwen2-VL's sections), not Qwen2's.
        Family::Qwen2 if !is("use_mrope", &|v| v == &Value::Bool(false)) => {
            Err(refused("use_mrope", "multimodal RoPE, Qwen2-VL's"))
        }
        // Rotation of interleaved pairs, not transformers' halves.
        Family::Llama | Family::Mistral | Family::Qwen2 | Family::Qwen3
            if !is("rope_interleaved", &|v| v == &Value::Bool(false)) =>
        {
            Err(refused(
                "rope_interleaved",
                "rotary on interleaved pairs; transformers rotates halves",
            ))
        }
        _ => Ok(()),
    }
}

/// Checks `obj`'s keys against `known` and [`HARMLESS_KEYS`]; `prefix`
/// names a nested object in messages (`"rope_parameters."`). Refused: the
/// first unknown key (in key order) is an error. Allowed: each is warned
/// about and returned.
pub(super) fn check_keys(
    obj: &serde_json::Map<String, Value>,
    known: &[&[&str]],
    harmless: &[&str],
    prefix: &str,
    model_type: &str,
    policy: UnknownKeys,
    unknown: &mut Vec<String>,
) -> Result<(), ModelError> {
    for key in obj.keys() {
        let k = key.as_str();
        if known.iter().any(|list| list.contains(&k)) || harmless.contains(&k) {
            continue;
        }
        let name = format!("{prefix}{key}");
        match policy {
            UnknownKeys::Refuse => {
                return Err(ModelError::UnknownConfigKey {
                    key: name,
                    model_type: model_type.to_owned(),
                })
            }
            UnknownKeys::Allow => {
                tracing::warn!(key = %name, "config.json: unknown key ignored (UnknownKeys::Allow: train and eval --allow-unknown-model-keys, estimate always); the model may differ from the one the file describes");
                unknown.push(name);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    fn parses(text: &str) -> ModelConfig {
        let (c, unknown) = ModelConfig::from_hf_json(text).unwrap();
        assert!(unknown.is_empty(), "{unknown:?}");
        c
    }

    fn refused(text: &str, words: &[&str]) {
        let e = ModelConfig::from_hf_json(text).unwrap_err();
        assert!(matches!(e, ModelError::Unsupported { .. }), "{e}");
        let msg = e.to_string();
        for w in words {
            assert!(msg.contains(w), "{msg} lacks {w}");
        }
    }

    /// The hub's Qwen2.5-0.5B `config.json`, as published.
    const QWEN25: &str = r#"{"architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu",
        "hidden_size": 896, "initializer_range": 0.02, "intermediate_size": 4864,
        "max_position_embeddings": 32768, "max_window_layers": 24, "model_type": "qwen2",
        "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
        "tie_word_embeddings": true, "torch_dtype": "bfloat16",
        "transformers_version": "4.40.1", "use_cache": true, "use_sliding_window": false,
        "vocab_size": 151936, "use_mrope": false}"#;

    /// The hub's gpt2-medium `config.json`, as published.
    const GPT2_MEDIUM: &str = r#"{"activation_function": "gelu_new",
        "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.1, "bos_token_id": 50256,
        "embd_pdrop": 0.1, "eos_token_id": 50256, "initializer_range": 0.02,
        "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_ctx": 1024, "n_embd": 1024,
        "n_head": 16, "n_layer": 24, "n_positions": 1024, "n_special": 0,
        "predict_special_tokens": true, "resid_pdrop": 0.1, "summary_activation": null,
        "summary_first_dropout": 0.1, "summary_proj_to_labels": true,
        "summary_type": "cls_index", "summary_use_proj": true,
        "task_specific_params": {"text-generation": {"do_sample": true, "max_length": 50}},
        "vocab_size": 50257}"#;

    /// The hub's SmolLM2-135M `config.json`, as published.
    const SMOLLM2: &str = r#"{"architectures": ["LlamaForCausalLM"], "attention_bias": false,
        "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 0, "hidden_act": "silu",
        "hidden_size": 576, "initializer_range": 0.041666666666666664,
        "intermediate_size": 1536, "is_llama_config": true, "max_position_embeddings": 8192,
        "mlp_bias": false, "model_type": "llama", "num_attention_heads": 9,
        "num_hidden_layers": 30, "num_key_value_heads": 3, "pretraining_tp": 1,
        "rms_norm_eps": 1e-05, "rope_interleaved": false, "rope_scaling": null,
        "rope_theta": 100000, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
        "transformers_version": "4.42.3", "use_cache": true, "vocab_size": 49152}"#;

    /// An older save (distilgpt2's era): `PretrainedConfig`'s generation
    /// and output attributes, written into every config then.
    const OLD_GPT2: &str = r#"{"_num_labels": 1, "activation_function": "gelu_new",
        "model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2, "n_positions": 128,
        "vocab_size": 300, "output_past": true, "do_sample": false, "max_length": 20,
        "num_beams": 1, "torchscript": false, "use_bfloat16": false, "pruned_heads": {},
        "output_attentions": false, "output_hidden_states": false, "is_decoder": false,
        "gradient_checkpointing": false, "id2label": {"0": "LABEL_0"},
        "label2id": {"LABEL_0": 0}, "unsloth_version": "2024.9"}"#;

    fn with(text: &str, key: &str, v: Value) -> String {
        let mut o: Value = serde_json::from_str(text).unwrap();
        o[key] = v;
        o.to_string()
    }

    #[test]
    fn published_configs_of_the_families_read_without_unknown_keys() {
        let q = parses(QWEN25);
        assert_eq!((q.n_layer, q.n_kv_head, q.sliding_window), (24, 2, None));
        let g = parses(GPT2_MEDIUM);
        assert_eq!((g.n_layer, g.hidden_size), (24, 1024));
        let s = parses(SMOLLM2);
        assert_eq!((s.n_head, s.n_kv_head), (9, 3));
        parses(OLD_GPT2);
    }

    #[test]
    fn read_keys_with_another_models_values_are_refused() {
        refused(
            &with(QWEN25, "use_mrope", Value::Bool(true)),
            &["use_mrope", "Qwen2-VL"],
        );
        parses(&with(QWEN25, "use_mrope", Value::Null));
        refused(
            &with(GPT2_MEDIUM, "n_special", serde_json::json!(2)),
            &["n_special = 2"],
        );
        refused(
            &with(SMOLLM2, "rope_interleaved", Value::Bool(true)),
            &["rope_interleaved", "halves"],
        );
        refused(
            &with(OLD_GPT2, "pruned_heads", serde_json::json!({"0": [1]})),
            &["pruned_heads"],
        );
        refused(
            &with(SMOLLM2, "pruned_heads", serde_json::json!({"3": [0, 2]})),
            &["pruned_heads"],
        );
        // Keys of another family stay unknown: use_mrope in a Llama.
        let e =
            ModelConfig::from_hf_json(&with(SMOLLM2, "use_mrope", Value::Bool(false))).unwrap_err();
        assert!(matches!(e, ModelError::UnknownConfigKey { .. }), "{e}");
    }
}
