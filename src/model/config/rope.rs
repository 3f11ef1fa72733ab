//! Rotary settings: the `rope_scaling` / `rope_parameters` dict of either
//! transformers style parsed into [`RopeScaling`], every key checked
//! against its `rope_type`, validated, and written back for an export.

use super::*;

/// Keys of a rotary dict per `rope_type` (besides `rope_type` / `type`,
/// `rope_theta` and `partial_rotary_factor`, allowed in all).
pub(super) fn rope_keys(rope_type: &str) -> Option<&'static [&'static str]> {
    Some(match rope_type {
        "default" => &[],
        "linear" | "dynamic" => &["factor"],
        "llama3" => &[
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        ],
        "yarn" => &[
            "factor",
            "original_max_position_embeddings",
            "attention_factor",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "truncate",
        ],
        _ => return None,
    })
}

/// The rotary base and variant of a Llama-family config, as transformers 5
/// resolves them (`standardize_rope_params`), from either style.
pub(super) fn parse_rope(
    top: &Keys<'_>,
    max_positions: usize,
    model_type: &str,
    policy: UnknownKeys,
    unknown: &mut Vec<String>,
) -> Result<(f64, RopeScaling), ModelError> {
    let scaling = top.get("rope_scaling");
    let params = top.get("rope_parameters");
    // transformers 5: `rope_scaling or rope_parameters`.
    let (dict_key, dict) = match (scaling, params) {
        (Some(s), Some(p)) if s != p => {
            return Err(invalid(
                "rope_scaling",
                format!(
                    "both rope_scaling {s} and rope_parameters {p} are given and differ; keep one"
                ),
            ))
        }
        (Some(s), _) => ("rope_scaling", Some(s)),
        (None, Some(p)) => ("rope_parameters", Some(p)),
        (None, None) => ("rope_parameters", None),
    };
    let empty = serde_json::Map::new();
    let obj = match dict {
        None => &empty,
        Some(Value::Object(o)) => o,
        Some(v) => {
            return Err(invalid(
                dict_key,
                format!("expected an object such as {{\"rope_type\": \"default\", \"rope_theta\": 10000.0}}, got {v}"),
            ))
        }
    };
    let rope = Keys(obj);
    let name = |k: &str| format!("{dict_key}.{k}");
    let inner = |k: &str| -> Result<Option<f64>, ModelError> {
        rope.opt_f64(k).map_err(|_| {
            invalid(
                &name(k),
                format!(
                    "expected a number, got {}",
                    obj.get(k).unwrap_or(&Value::Null)
                ),
            )
        })
    };
    let rope_type = match (rope.get("rope_type"), rope.get("type")) {
        (Some(a), Some(b)) if a != b => {
            return Err(invalid(
                &name("rope_type"),
                format!("rope_type {a} and type {b} differ; keep one"),
            ))
        }
        (Some(v), _) | (None, Some(v)) => v
            .as_str()
            .ok_or_else(|| invalid(&name("rope_type"), format!("expected a string, got {v}")))?,
        (None, None) => "default",
    };
    let Some(type_keys) = rope_keys(rope_type) else {
        return Err(unsupported(format!(
            "{dict_key}.rope_type {rope_type:?}: tierzero implements default, linear, dynamic, \
             llama3 and yarn; convert the model or use one of those"
        )));
    };
    check_keys(
        obj,
        &[
            &["rope_type", "type", "rope_theta", "partial_rotary_factor"],
            type_keys,
        ],
        &[],
        &format!("{dict_key}."),
        model_type,
        policy,
        unknown,
    )?;
    // One value per setting: the dict's wins in transformers; two different
    // ones are refused.
    let agree = |key: &str, outer: Option<f64>, nested: Option<f64>| match (outer, nested) {
        (Some(a), Some(b)) if a != b => Err(invalid(
            key,
            format!("{key} {a} and {} {b} differ; keep one", name(key)),
        )),
        (a, b) => Ok(b.or(a)),
    };
    let theta = agree(
        "rope_theta",
        top.opt_f64("rope_theta")?,
        inner("rope_theta")?,
    )?
    .unwrap_or(10000.0);
    let partial = agree(
        "partial_rotary_factor",
        top.opt_f64("partial_rotary_factor")?,
        inner("partial_rotary_factor")?,
    )?;
    if let Some(f) = partial.filter(|&f| f != 1.0) {
        return Err(unsupported(format!(
            "partial_rotary_factor {f}: rotary embeddings on part of each head are not \
             implemented (only 1.0)"
        )));
    }
    let need = |k: &str| -> Result<f64, ModelError> {
        inner(k)?.ok_or_else(|| {
            invalid(
                &name(k),
                format!("rope_type {rope_type:?} needs {k}; add it to {dict_key}"),
            )
        })
    };
    let original_max = || -> Result<usize, ModelError> {
        let outer = top.opt_usize("original_max_position_embeddings")?;
        let nested = rope
            .opt_usize("original_max_position_embeddings")
            .map_err(|e| match e {
                ModelError::InvalidConfig { reason, .. } => {
                    invalid(&name("original_max_position_embeddings"), reason)
                }
                e => e,
            })?;
        match (outer, nested) {
            (Some(a), Some(b)) if a != b => Err(invalid(
                "original_max_position_embeddings",
                format!(
                    "original_max_position_embeddings {a} and {} {b} differ; keep one",
                    name("original_max_position_embeddings")
                ),
            )),
            // Checked here, where it is known which key gave it.
            (Some(0), _) => Err(invalid(
                "original_max_position_embeddings",
                "must be positive",
            )),
            (None, Some(0)) => Err(invalid(
                &name("original_max_position_embeddings"),
                "must be positive",
            )),
            (a, b) => Ok(a.or(b).unwrap_or(max_positions)),
        }
    };
    let scaling = match rope_type {
        "default" => RopeScaling::Default,
        "linear" => RopeScaling::Linear {
            factor: need("factor")?,
        },
        "dynamic" => RopeScaling::Dynamic {
            factor: need("factor")?,
        },
        "llama3" => RopeScaling::Llama3 {
            factor: need("factor")?,
            low_freq_factor: need("low_freq_factor")?,
            high_freq_factor: need("high_freq_factor")?,
            original_max_position_embeddings: original_max()?,
        },
        "yarn" => RopeScaling::Yarn {
            factor: need("factor")?,
            original_max_position_embeddings: original_max()?,
            attention_factor: inner("attention_factor")?,
            beta_fast: inner("beta_fast")?,
            beta_slow: inner("beta_slow")?,
            mscale: inner("mscale")?,
            mscale_all_dim: inner("mscale_all_dim")?,
            truncate: rope.bool("truncate", true).map_err(|e| match e {
                ModelError::InvalidConfig { reason, .. } => invalid(&name("truncate"), reason),
                e => e,
            })?,
        },
        other => return Err(unsupported(format!("rope_type {other:?}"))),
    };
    validate_scaling(&scaling, dict_key)?;
    // A top-level original_max_position_embeddings only means something to
    // the scaled types that read it.
    if top.get("original_max_position_embeddings").is_some()
        && !matches!(
            scaling,
            RopeScaling::Llama3 { .. } | RopeScaling::Yarn { .. }
        )
    {
        let e = ModelError::UnknownConfigKey {
            key: "original_max_position_embeddings".to_owned(),
            model_type: model_type.to_owned(),
        };
        match policy {
            UnknownKeys::Refuse => return Err(e),
            UnknownKeys::Allow => unknown.push("original_max_position_embeddings".to_owned()),
        }
    }
    Ok((theta, scaling))
}

impl ModelConfig {
    /// Checks the rotary variant's values, naming them under our
    /// `rope_scaling` (a config.json's are checked as they are read,
    /// under the dict that gave them: [`parse_rope`]).
    pub(super) fn validate_rope(&self) -> Result<(), ModelError> {
        validate_scaling(&self.rope_scaling, "rope_scaling")
    }
}

/// Checks a rotary variant's values, naming each as `{dict_key}.{key}`.
fn validate_scaling(scaling: &RopeScaling, dict_key: &str) -> Result<(), ModelError> {
    let name = |k: &str| format!("{dict_key}.{k}");
    let positive = |key: &str, v: f64| {
        if v.is_finite() && v > 0.0 {
            Ok(())
        } else {
            Err(invalid(key, format!("must be a number > 0, got {v}")))
        }
    };
    let finite = |key: &str, v: Option<f64>| match v {
        Some(x) if !x.is_finite() => Err(invalid(key, format!("must be finite, got {x}"))),
        _ => Ok(()),
    };
    let original_positions = |n: usize| {
        if n == 0 {
            Err(invalid(
                &name("original_max_position_embeddings"),
                "must be positive",
            ))
        } else {
            Ok(())
        }
    };
    match scaling {
        RopeScaling::Default => Ok(()),
        RopeScaling::Linear { factor } | RopeScaling::Dynamic { factor } => {
            positive(&name("factor"), *factor)
        }
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => {
            positive(&name("factor"), *factor)?;
            positive(&name("low_freq_factor"), *low_freq_factor)?;
            positive(&name("high_freq_factor"), *high_freq_factor)?;
            if high_freq_factor <= low_freq_factor {
                return Err(invalid(
                    &name("high_freq_factor"),
                    format!(
                        "must be greater than low_freq_factor {low_freq_factor}, got \
                         {high_freq_factor}"
                    ),
                ));
            }
            original_positions(*original_max_position_embeddings)
        }
        RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            attention_factor,
            beta_fast,
            beta_slow,
            mscale,
            mscale_all_dim,
            ..
        } => {
            positive(&name("factor"), *factor)?;
            finite(&name("attention_factor"), *attention_factor)?;
            finite(&name("beta_fast"), *beta_fast)?;
            finite(&name("beta_slow"), *beta_slow)?;
            finite(&name("mscale"), *mscale)?;
            finite(&name("mscale_all_dim"), *mscale_all_dim)?;
            original_positions(*original_max_position_embeddings)
        }
    }
}

impl ModelConfig {
    /// The transformers 4 `rope_scaling` object of the rotary variant
    /// (`None` for plain RoPE); transformers 5 reads it too.
    pub fn rope_scaling_value(&self) -> Option<Value> {
        use serde_json::json;
        match &self.rope_scaling {
            RopeScaling::Default => None,
            RopeScaling::Linear { factor } => {
                Some(json!({"rope_type": "linear", "factor": factor}))
            }
            RopeScaling::Dynamic { factor } => {
                Some(json!({"rope_type": "dynamic", "factor": factor}))
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => Some(json!({
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low_freq_factor,
                "high_freq_factor": high_freq_factor,
                "original_max_position_embeddings": original_max_position_embeddings,
            })),
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                attention_factor,
                beta_fast,
                beta_slow,
                mscale,
                mscale_all_dim,
                truncate,
            } => {
                let mut v = json!({
                    "rope_type": "yarn",
                    "factor": factor,
                    "truncate": truncate,
                });
                // Written only where it is not max_position_embeddings (its
                // default in both): transformers 4.45 to 4.57 replace the
                // factor by max_position_embeddings / original when the key
                // is there, so a written default turned yarn off (factor 1)
                // for them. Where the config itself gives another original,
                // those versions compute another factor than transformers 5,
                // whose reading (the factor as given) tierzero follows.
                if *original_max_position_embeddings != self.max_seq_len {
                    if let Some(o) = v.as_object_mut() {
                        o.insert(
                            "original_max_position_embeddings".to_owned(),
                            json!(original_max_position_embeddings),
                        );
                    }
                }
                for (k, x) in [
                    ("attention_factor", attention_factor),
                    ("beta_fast", beta_fast),
                    ("beta_slow", beta_slow),
                    ("mscale", mscale),
                    ("mscale_all_dim", mscale_all_dim),
                ] {
                    if let (Some(x), Some(o)) = (x, v.as_object_mut()) {
                        o.insert(k.to_owned(), json!(x));
                    }
                }
                Some(v)
            }
        }
    }
}
