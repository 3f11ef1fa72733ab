//! The special token ids a model's `config.json` carries beside its
//! architecture ([`TokenIds`]).

use serde_json::Value;

/// The special token ids of an HF `config.json` (`bos_token_id`,
/// `eos_token_id`, `pad_token_id`). They change nothing we compute (the
/// data loader owns tokens), so they are not part of [`super::ModelConfig`] and
/// two models differing only in them train alike; but generation reads
/// them, so they travel with the model into checkpoints and the exported
/// `config.json`. Each is kept as written when it is a non-negative integer
/// or a list of them (Llama 3 lists several `eos_token_id`s), or `null`
/// (none: transformers would otherwise fill in its family's default);
/// anything else is dropped with a warning.
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
                None => {}
                Some(v) if is_id(v) || v.is_null() => {
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

    /// These ids with `eos_token_id` set to `id` where they name none
    /// (the EOS a tokenizer gave the data, recorded with the model so that
    /// its export says where generation stops); an `eos_token_id` already
    /// there stays.
    pub fn with_eos_if_none(mut self, id: u64) -> Self {
        if self.eos().is_none() {
            self.0.insert("eos_token_id".to_owned(), Value::from(id));
        }
        self
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
