//! A small typed walker over a parsed `serde_json::Value`.
//!
//! Why not `#[derive(Deserialize)]` straight from the text: serde's derived
//! errors carry neither the key path (`zero_optimization.offload_param.
//! buffer_size`) nor a way to collect the keys it ignored, DeepSpeed's number
//! forms (`5e8` for an integer) need custom visitors anyway, and deprecated
//! aliases need conflict detection and a warning that names the old key. Two
//! extra crates (`serde_path_to_error`, `serde_ignored`) would cover part of
//! it; the walker covers all of it in a few hundred lines with no new
//! dependency.
//!
//! An [`Obj`] wraps one JSON object with its path and the list of keys the
//! schema knows. Every `take*` call marks a key as consumed; [`Obj::finish`]
//! turns the unconsumed ones into [`ConfigWarning`]s: `IgnoredKey` for keys
//! DeepSpeed defines but tierzero does not use, `UnknownKey` (with a
//! did-you-mean suggestion) for everything else. Unknown keys never fail a
//! load.

use std::fmt;

use serde_json::{Map, Value};

use super::error::{render, ConfigError};

/// A non-fatal finding while reading a config. The loader logs each one with
/// `tracing::warn!` and returns them so the CLI can print them.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConfigWarning {
    /// A key neither DeepSpeed (as far as tierzero knows) nor tierzero
    /// defines. Often a typo.
    UnknownKey {
        /// JSON path, e.g. `zero_optimization.stage3_foo`.
        key: String,
        /// A close known key, if any.
        suggestion: Option<String>,
    },
    /// A key DeepSpeed defines but tierzero does not use; it is ignored.
    IgnoredKey {
        /// JSON path.
        key: String,
    },
    /// A deprecated DeepSpeed name that was accepted.
    Deprecated {
        /// JSON path of the deprecated key.
        key: String,
        /// What to write instead.
        replacement: String,
    },
    /// Any other advice about a key (a value that is accepted but has no
    /// effect, or a suspicious combination DeepSpeed also only warns about).
    Note {
        /// JSON path.
        key: String,
        /// One-line explanation.
        message: String,
    },
}

impl ConfigWarning {
    /// JSON path of the key the warning is about.
    pub fn key(&self) -> &str {
        match self {
            ConfigWarning::UnknownKey { key, .. }
            | ConfigWarning::IgnoredKey { key }
            | ConfigWarning::Deprecated { key, .. }
            | ConfigWarning::Note { key, .. } => key,
        }
    }
}

impl fmt::Display for ConfigWarning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigWarning::UnknownKey {
                key,
                suggestion: Some(s),
            } => {
                write!(f, "unknown config key `{key}` ignored; did you mean `{s}`?")
            }
            ConfigWarning::UnknownKey {
                key,
                suggestion: None,
            } => {
                write!(f, "unknown config key `{key}` ignored")
            }
            ConfigWarning::IgnoredKey { key } => {
                write!(
                    f,
                    "config key `{key}` is a DeepSpeed setting tierzero does not use; ignored"
                )
            }
            ConfigWarning::Deprecated { key, replacement } => {
                write!(f, "config key `{key}` is deprecated in DeepSpeed; accepted, but write {replacement}")
            }
            ConfigWarning::Note { key, message } => write!(f, "config key `{key}`: {message}"),
        }
    }
}

/// Collects warnings while walking.
#[derive(Debug, Default)]
pub(crate) struct Sink {
    pub warnings: Vec<ConfigWarning>,
}

impl Sink {
    pub fn note(&mut self, key: &str, message: impl Into<String>) {
        self.warnings.push(ConfigWarning::Note {
            key: key.to_owned(),
            message: message.into(),
        });
    }
}

/// Joins a parent path and a key.
pub(crate) fn join(parent: &str, key: &str) -> String {
    if parent.is_empty() {
        key.to_owned()
    } else {
        format!("{parent}.{key}")
    }
}

/// One JSON object being read, with its schema.
#[derive(Debug)]
pub(crate) struct Obj<'a> {
    path: String,
    map: &'a Map<String, Value>,
    known: &'static [&'static str],
    ignored: &'static [&'static str],
    seen: Vec<&'a str>,
}

impl<'a> Obj<'a> {
    /// Wraps `value` (which must be an object) found at `path`.
    pub fn new(
        path: &str,
        value: &'a Value,
        known: &'static [&'static str],
        ignored: &'static [&'static str],
    ) -> Result<Self, ConfigError> {
        match value {
            Value::Object(map) => Ok(Obj {
                path: path.to_owned(),
                map,
                known,
                ignored,
                seen: Vec::new(),
            }),
            other => Err(ConfigError::WrongType {
                key: if path.is_empty() {
                    "<top level>".to_owned()
                } else {
                    path.to_owned()
                },
                value: render(other),
                expected: "a JSON object {...}".to_owned(),
            }),
        }
    }

    /// Path of a child key.
    pub fn key_path(&self, key: &str) -> String {
        join(&self.path, key)
    }

    /// Whether the key is present (does not consume it).
    pub fn has(&self, key: &str) -> bool {
        self.map.contains_key(key)
    }

    /// Takes a key's value (JSON `null` counts as absent).
    pub fn take(&mut self, key: &str) -> Option<Field<'a>> {
        let (k, v) = self.map.get_key_value(key)?;
        self.seen.push(k.as_str());
        if v.is_null() {
            return None;
        }
        Some(Field {
            key: join(&self.path, key),
            value: v,
        })
    }

    /// Takes `key`, also accepting the other names in `aliases`. At most one
    /// of them may be present. With `deprecated`, using an alias produces a
    /// [`ConfigWarning::Deprecated`].
    pub fn take_alias(
        &mut self,
        key: &str,
        aliases: &[&str],
        deprecated: bool,
        sink: &mut Sink,
    ) -> Result<Option<Field<'a>>, ConfigError> {
        let present: Vec<&str> = std::iter::once(key)
            .chain(aliases.iter().copied())
            .filter(|n| self.has(n))
            .collect();
        match present.as_slice() {
            [] => Ok(None),
            [name] => {
                if *name != key && deprecated {
                    sink.warnings.push(ConfigWarning::Deprecated {
                        key: self.key_path(name),
                        replacement: format!("`{}`", self.key_path(key)),
                    });
                }
                Ok(self.take(name))
            }
            [first, second, ..] => Err(ConfigError::ConflictingAlias {
                old: self.key_path(second),
                new: self.key_path(first),
            }),
        }
    }

    /// Reports every key not taken.
    pub fn finish(self, sink: &mut Sink) {
        for key in self.map.keys() {
            if self.seen.contains(&key.as_str()) {
                continue;
            }
            let path = join(&self.path, key);
            if self.ignored.contains(&key.as_str()) {
                sink.warnings.push(ConfigWarning::IgnoredKey { key: path });
            } else {
                let suggestion = special_suggestion(&self.path, key)
                    .or_else(|| suggest(key, self.known).map(|s| join(&self.path, s)))
                    .filter(|s| *s != path);
                sink.warnings.push(ConfigWarning::UnknownKey {
                    key: path,
                    suggestion,
                });
            }
        }
    }
}

/// Misplacements seen in real configs that a spelling distance cannot find.
fn special_suggestion(parent: &str, key: &str) -> Option<String> {
    match (parent, key) {
        // The HF DeepSpeed guide's ZeRO-Infinity example nests `aio` here.
        ("zero_optimization", "aio") => Some("aio (a top-level key)".to_owned()),
        ("", "offload_param" | "offload_optimizer" | "sub_group_size" | "stage") => {
            Some(format!("zero_optimization.{key}"))
        }
        _ => None,
    }
}

/// The known key closest to `key`: equal up to the order of its
/// `_`-separated words, or within a small edit distance.
fn suggest(key: &str, known: &[&'static str]) -> Option<&'static str> {
    let lower = key.to_ascii_lowercase();
    let mut words: Vec<&str> = lower.split('_').collect();
    words.sort_unstable();
    for k in known {
        let mut kw: Vec<&str> = k.split('_').collect();
        kw.sort_unstable();
        if kw == words {
            return Some(k);
        }
    }
    let limit = if key.len() <= 3 {
        1
    } else {
        (key.len() / 5).clamp(2, 4)
    };
    known
        .iter()
        .map(|k| (levenshtein(&lower, k), *k))
        .filter(|(d, _)| *d <= limit)
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k)
}

fn levenshtein(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    let mut cur = vec![0; b.len() + 1];
    for (i, ca) in a.chars().enumerate() {
        cur[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cost = usize::from(ca != *cb);
            cur[j + 1] = (prev[j] + cost).min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        std::mem::swap(&mut prev, &mut cur);
    }
    prev[b.len()]
}

/// One present key, owning its path.
#[derive(Debug, Clone)]
pub(crate) struct Field<'a> {
    pub key: String,
    pub value: &'a Value,
}

/// Whether a value is the string `"auto"`.
pub(crate) fn is_auto(v: &Value) -> bool {
    v.as_str() == Some("auto")
}

impl<'a> Field<'a> {
    fn wrong(&self, expected: &str) -> ConfigError {
        ConfigError::WrongType {
            key: self.key.clone(),
            value: render(self.value),
            expected: expected.to_owned(),
        }
    }

    /// A non-negative integer; integral floats such as `5e8` or `1.0` are
    /// accepted, as DeepSpeed's pydantic models accept them.
    pub fn u64(&self) -> Result<u64, ConfigError> {
        let wrong = |expected: &str| ConfigError::WrongType {
            key: self.key.clone(),
            value: render(self.value),
            expected: expected.to_owned(),
        };
        let out_of_range = |allowed: &str, fix: &str| ConfigError::OutOfRange {
            key: self.key.clone(),
            value: render(self.value),
            allowed: allowed.to_owned(),
            fix: fix.to_owned(),
        };
        let negative =
            || out_of_range("a non-negative integer", "use 0 or a positive whole number");
        let Value::Number(n) = self.value else {
            if is_auto(self.value) {
                return Err(wrong("an integer (\"auto\" is not accepted for this key)"));
            }
            return Err(wrong("an integer"));
        };
        if let Some(u) = n.as_u64() {
            return Ok(u);
        }
        if n.as_i64().is_some() {
            return Err(negative());
        }
        match n.as_f64() {
            Some(f) if f.is_finite() && f.fract() == 0.0 => {
                if f < 0.0 {
                    Err(negative())
                } else if f >= 2f64.powi(64) {
                    Err(out_of_range("below 2^64", "use a smaller number"))
                } else {
                    // Exact: integral and below 2^64.
                    Ok(f as u64)
                }
            }
            _ => Err(wrong("an integer")),
        }
    }

    /// Like [`Field::u64`] but also `"auto"` (returns `None`).
    pub fn auto_u64(&self) -> Result<Option<u64>, ConfigError> {
        if is_auto(self.value) {
            return Ok(None);
        }
        self.u64().map(Some).map_err(|e| self.add_auto_hint(e))
    }

    /// Any JSON number as `f64`.
    pub fn f64(&self) -> Result<f64, ConfigError> {
        match self.value.as_f64() {
            Some(v) if v.is_finite() => Ok(v),
            _ => Err(self.wrong("a number")),
        }
    }

    /// Like [`Field::f64`] but also `"auto"` (returns `None`).
    pub fn auto_f64(&self) -> Result<Option<f64>, ConfigError> {
        if is_auto(self.value) {
            return Ok(None);
        }
        self.f64().map(Some).map_err(|e| self.add_auto_hint(e))
    }

    /// `true` or `false`.
    pub fn bool(&self) -> Result<bool, ConfigError> {
        self.value
            .as_bool()
            .ok_or_else(|| self.wrong("true or false"))
    }

    /// Like [`Field::bool`] but also `"auto"` (returns `None`).
    pub fn auto_bool(&self) -> Result<Option<bool>, ConfigError> {
        if is_auto(self.value) {
            return Ok(None);
        }
        self.bool().map(Some).map_err(|e| self.add_auto_hint(e))
    }

    /// A string.
    pub fn str(&self) -> Result<&'a str, ConfigError> {
        self.value.as_str().ok_or_else(|| self.wrong("a string"))
    }

    /// Two numbers `[b1, b2]`, or `"auto"` (returns `None`).
    pub fn auto_pair(&self) -> Result<Option<[f64; 2]>, ConfigError> {
        if is_auto(self.value) {
            return Ok(None);
        }
        let expected = "an array of two numbers like [0.9, 0.999] or \"auto\"";
        let arr = self.value.as_array().ok_or_else(|| self.wrong(expected))?;
        match arr.as_slice() {
            [a, b] => match (a.as_f64(), b.as_f64()) {
                (Some(a), Some(b)) if a.is_finite() && b.is_finite() => Ok(Some([a, b])),
                _ => Err(self.wrong(expected)),
            },
            _ => Err(self.wrong(expected)),
        }
    }

    fn add_auto_hint(&self, e: ConfigError) -> ConfigError {
        match e {
            ConfigError::WrongType {
                key,
                value,
                expected,
            } => ConfigError::WrongType {
                key,
                value,
                expected: format!("{expected} or \"auto\""),
            },
            other => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suggestions() {
        let known = &[
            "stage3_param_persistence_threshold",
            "overlap_comm",
            "stage",
        ];
        assert_eq!(
            suggest("stage3_param_persitance_threshold", known),
            Some("stage3_param_persistence_threshold")
        );
        assert_eq!(suggest("comm_overlap", known), Some("overlap_comm"));
        assert_eq!(suggest("stgae", known), Some("stage"));
        assert_eq!(suggest("something_else_entirely", known), None);
    }

    #[test]
    fn integers_accept_integral_floats_only() {
        let get = |v: Value| {
            Field {
                key: "k".into(),
                value: Box::leak(Box::new(v)),
            }
            .u64()
        };
        assert_eq!(get(serde_json::json!(5e8)).ok(), Some(500_000_000));
        assert_eq!(get(serde_json::json!(1e14)).ok(), Some(100_000_000_000_000));
        assert_eq!(get(serde_json::json!(3)).ok(), Some(3));
        assert!(matches!(
            get(serde_json::json!(1.5)),
            Err(ConfigError::WrongType { .. })
        ));
        assert!(matches!(
            get(serde_json::json!(-2)),
            Err(ConfigError::OutOfRange { .. })
        ));
        assert!(matches!(
            get(serde_json::json!(-2.0)),
            Err(ConfigError::OutOfRange { .. })
        ));
        assert!(matches!(
            get(serde_json::json!(1e30)),
            Err(ConfigError::OutOfRange { .. })
        ));
        assert!(matches!(
            get(serde_json::json!("8")),
            Err(ConfigError::WrongType { .. })
        ));
    }
}
