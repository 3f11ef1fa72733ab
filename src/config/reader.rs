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
//! Each object of the config is declared once, with [`section!`]: one table
//! row per key gives the field, its type, DeepSpeed's default, its reader
//! and its other names, and the macro writes the struct, its `Default`, its
//! list of known keys and the reader that walks the object.
//!
//! An [`Obj`] wraps one JSON object with its path and the list of keys the
//! schema knows. Every `take*` call marks a key as consumed; [`Obj::finish`]
//! turns the unconsumed ones into [`ConfigWarning`]s: `IgnoredKey` for keys
//! DeepSpeed defines but tierzero does not use, `UnknownKey` (with a
//! did-you-mean suggestion) for everything else. Unknown keys never fail a
//! load (they warn, as the project's config rule says), but where DeepSpeed
//! itself refuses them (its pydantic sections forbid extras: `fp16`,
//! `bf16`, `zero_optimization` and its offload blocks; the optimizer's and
//! scheduler's `params` are its constructors' keyword arguments) the
//! warning says so: a misspelled `devcie` keeps the optimizer state in host
//! memory, and DeepSpeed would not have run the file at all.

use std::fmt;

use serde_json::{Map, Value};

use super::ds::AutoOr;
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
        /// Why DeepSpeed refuses the key where it does (its section
        /// forbids unknown keys); `None` where it ignores it.
        deepspeed_refuses: Option<&'static str>,
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
                suggestion,
                deepspeed_refuses,
            } => {
                write!(f, "unknown config key `{key}` ignored")?;
                if let Some(s) = suggestion {
                    write!(f, "; did you mean `{s}`?")?;
                }
                if let Some(why) = deepspeed_refuses {
                    write!(f, " (DeepSpeed would refuse this config: {why})")?;
                }
                Ok(())
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
    deepspeed_refuses: Option<&'static str>,
    seen: Vec<&'a str>,
}

impl<'a> Obj<'a> {
    /// Wraps `value` (which must be an object) found at `path`;
    /// `deepspeed_refuses` says why DeepSpeed refuses its unknown keys
    /// (`None`: it ignores them).
    pub fn new(
        path: &str,
        value: &'a Value,
        known: &'static [&'static str],
        ignored: &'static [&'static str],
        deepspeed_refuses: Option<&'static str>,
    ) -> Result<Self, ConfigError> {
        match value {
            Value::Object(map) => Ok(Obj {
                path: path.to_owned(),
                map,
                known,
                ignored,
                deepspeed_refuses,
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

    /// Takes `key`, also accepting the other names in `aliases`, each with
    /// whether it is deprecated (using a deprecated one produces a
    /// [`ConfigWarning::Deprecated`]; the others are accepted silently, as
    /// DeepSpeed accepts its field names). At most one of the names may be
    /// present: two are [`ConfigError::ConflictingAlias`], the later one in
    /// `key, aliases...` order named as the old name.
    pub fn take_alias(
        &mut self,
        key: &str,
        aliases: &[(&str, bool)],
        sink: &mut Sink,
    ) -> Result<Option<Field<'a>>, ConfigError> {
        let present: Vec<(&str, bool)> = std::iter::once((key, false))
            .chain(aliases.iter().copied())
            .filter(|(n, _)| self.has(n))
            .collect();
        match present.as_slice() {
            [] => Ok(None),
            [(name, deprecated)] => {
                if *deprecated {
                    sink.warnings.push(ConfigWarning::Deprecated {
                        key: self.key_path(name),
                        replacement: format!("`{}`", self.key_path(key)),
                    });
                }
                Ok(self.take(name))
            }
            [(first, _), (second, _), ..] => Err(ConfigError::ConflictingAlias {
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
                    deepspeed_refuses: self.deepspeed_refuses,
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
    /// A [`ConfigError::WrongType`] for this key and value.
    pub fn wrong(&self, expected: &str) -> ConfigError {
        ConfigError::WrongType {
            key: self.key.clone(),
            value: render(self.value),
            expected: expected.to_owned(),
        }
    }

    /// A [`ConfigError::OutOfRange`] for this key and value.
    pub fn out_of_range(&self, allowed: &str, fix: &str) -> ConfigError {
        ConfigError::OutOfRange {
            key: self.key.clone(),
            value: render(self.value),
            allowed: allowed.to_owned(),
            fix: fix.to_owned(),
        }
    }

    /// A non-negative integer; integral floats such as `5e8` or `1.0` are
    /// accepted, as DeepSpeed's pydantic models accept them.
    pub fn u64(&self) -> Result<u64, ConfigError> {
        let negative = || {
            self.out_of_range(
                "a non-negative integer",
                "use a positive whole number (or 0 where the key allows it)",
            )
        };
        let Value::Number(n) = self.value else {
            if is_auto(self.value) {
                return Err(self.wrong("an integer (\"auto\" is not accepted for this key)"));
            }
            return Err(self.wrong("an integer"));
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
                    Err(self.out_of_range("below 2^64", "use a smaller number"))
                } else {
                    // Exact: integral and below 2^64.
                    Ok(f as u64)
                }
            }
            _ => Err(self.wrong("an integer")),
        }
    }

    /// Any JSON number as `f64`.
    pub fn f64(&self) -> Result<f64, ConfigError> {
        match self.value.as_f64() {
            Some(v) if v.is_finite() => Ok(v),
            _ => Err(self.wrong("a number")),
        }
    }

    /// `true` or `false`.
    pub fn bool(&self) -> Result<bool, ConfigError> {
        self.value
            .as_bool()
            .ok_or_else(|| self.wrong("true or false"))
    }

    /// A string.
    pub fn str(&self) -> Result<&'a str, ConfigError> {
        self.value.as_str().ok_or_else(|| self.wrong("a string"))
    }
}

/// Adds `or "auto"` to what a key that accepts `"auto"` expected.
fn add_auto_hint(e: ConfigError) -> ConfigError {
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

// ---------------------------------------------------------------------------
// Readers: what a `section!` row names to read its key's value. Each takes
// the field and the warning sink (nested objects warn), and returns the
// field's value.

/// A non-negative integer ([`Field::u64`]).
pub(crate) fn int(f: &Field<'_>, _: &mut Sink) -> Result<u64, ConfigError> {
    f.u64()
}

/// A finite number ([`Field::f64`]).
pub(crate) fn num(f: &Field<'_>, _: &mut Sink) -> Result<f64, ConfigError> {
    f.f64()
}

/// `true` or `false`.
pub(crate) fn flag(f: &Field<'_>, _: &mut Sink) -> Result<bool, ConfigError> {
    f.bool()
}

/// Two numbers `[b1, b2]`.
pub(crate) fn pair(f: &Field<'_>, _: &mut Sink) -> Result<[f64; 2], ConfigError> {
    let expected = "an array of two numbers like [0.9, 0.999]";
    match f.value.as_array().map(Vec::as_slice) {
        Some([a, b]) => match (a.as_f64(), b.as_f64()) {
            (Some(a), Some(b)) if a.is_finite() && b.is_finite() => Ok([a, b]),
            _ => Err(f.wrong(expected)),
        },
        _ => Err(f.wrong(expected)),
    }
}

/// `read`, for a field that is `None` when the key is absent.
pub(crate) fn some<T>(
    read: impl Fn(&Field<'_>, &mut Sink) -> Result<T, ConfigError>,
) -> impl Fn(&Field<'_>, &mut Sink) -> Result<Option<T>, ConfigError> {
    move |f, sink| read(f, sink).map(Some)
}

/// `read`, or `"auto"` ([`AutoOr::Auto`]).
pub(crate) fn auto<T>(
    read: impl Fn(&Field<'_>, &mut Sink) -> Result<T, ConfigError>,
) -> impl Fn(&Field<'_>, &mut Sink) -> Result<AutoOr<T>, ConfigError> {
    move |f, sink| {
        if is_auto(f.value) {
            return Ok(AutoOr::Auto);
        }
        read(f, sink).map(AutoOr::Value).map_err(add_auto_hint)
    }
}

/// `read`, or `"auto"` as `None` (for our own keys, where absent means
/// `"auto"` too).
pub(crate) fn auto_none<T>(
    read: impl Fn(&Field<'_>, &mut Sink) -> Result<T, ConfigError>,
) -> impl Fn(&Field<'_>, &mut Sink) -> Result<Option<T>, ConfigError> {
    move |f, sink| match auto(&read)(f, sink)? {
        AutoOr::Auto => Ok(None),
        AutoOr::Value(v) => Ok(Some(v)),
    }
}

/// Declares one JSON object of the config from one table, so that each key
/// is written once. For
///
/// ```ignore
/// section! {
///     /// `aio` {...}.
///     pub struct DsAio {
///         /// `queue_depth` (default 8).
///         queue_depth: u64 = 8 => int;
///         /// `intra_op_parallelism` (old name `thread_count`).
///         intra_op_parallelism: u64 = 1 => int, deprecated "thread_count";
///         /// `use_gds` (default false).
///         use_gds: bool => flag;
///     }
///     ignored: ["some_deepspeed_key"];
///     also: ["handled_by_hand"];
///     deepspeed_refuses: "why DeepSpeed refuses an unknown key here";
/// }
/// ```
///
/// it writes:
/// - the struct, every field `pub`, with serde's derive (`#[serde(default)]`
///   and an `alias` per other name), so the config prints back in
///   DeepSpeed's names and reads back the same;
/// - `Default`, from the `= default` of each row (`Default::default()` where
///   a row has none);
/// - `KEYS`, the keys the object knows (fields, their other names, and the
///   `also` keys that a `then` hook reads by hand), for [`Obj::finish`]'s
///   unknown-key warnings and did-you-mean;
/// - `read` (and `read_known`, which reads only the fields in a given list
///   of known keys: `scheduler.params` depends on the type), which takes
///   each row's key or one of its other names ([`Obj::take_alias`]:
///   `deprecated` names warn, `alias` names do not, two names at once are
///   an error), reads its value with the row's reader (`int`, `auto(int)`,
///   `some(path)`, a nested section's `read`, ...), calls the row's `then`
///   hook if it has one (`fn(&mut Obj, &mut Self, &mut Sink) -> Result<(),
///   ConfigError>`, for keys read by hand), and reports every key left.
///
/// Rows are read in table order, which is the order of their warnings.
macro_rules! section {
    (
        $(#[$meta:meta])*
        pub struct $name:ident {
            $(
                $(#[$fmeta:meta])*
                $field:ident : $ty:ty $(= $default:expr)? => $read:expr
                    $(, deprecated $old:literal)* $(, alias $alias:literal)*
                    $(, then $then:path)? ;
            )*
        }
        $(ignored: [$($ignored:literal),* $(,)?];)?
        $(also: [$($also:literal),* $(,)?];)?
        $(deepspeed_refuses: $refuses:expr;)?
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, PartialEq, ::serde::Serialize, ::serde::Deserialize)]
        #[serde(default)]
        pub struct $name {
            $(
                $(#[$fmeta])*
                $(#[serde(alias = $old)])*
                $(#[serde(alias = $alias)])*
                pub $field: $ty,
            )*
        }

        impl ::std::default::Default for $name {
            fn default() -> Self {
                $name {
                    $($field: $crate::config::reader::section!(@default $($default)?),)*
                }
            }
        }

        // Not every section uses every item (`scheduler.params` is read with
        // `read_known` only).
        #[allow(dead_code)]
        impl $name {
            /// The keys this object knows.
            pub(crate) const KEYS: &'static [&'static str] = &[
                $(stringify!($field),)*
                $($($old,)* $($alias,)*)*
                $($($also,)*)?
            ];
            /// DeepSpeed keys of this object that tierzero does not use.
            const IGNORED: &'static [&'static str] = &[$($($ignored),*)?];
            /// Why DeepSpeed refuses an unknown key of this object
            /// (`None`: it ignores them).
            const DEEPSPEED_REFUSES: Option<&'static str> = $crate::config::reader::section!(@refuses $($refuses)?);

            /// Reads the object at `f`; every key of [`Self::KEYS`] is known.
            pub(crate) fn read(
                f: &$crate::config::reader::Field<'_>,
                sink: &mut $crate::config::reader::Sink,
            ) -> ::std::result::Result<Self, $crate::config::ConfigError> {
                Self::read_known(f, sink, Self::KEYS)
            }

            /// Reads the object at `f`, taking only the fields in `known`;
            /// the other keys are reported as unknown.
            pub(crate) fn read_known(
                f: &$crate::config::reader::Field<'_>,
                sink: &mut $crate::config::reader::Sink,
                known: &'static [&'static str],
            ) -> ::std::result::Result<Self, $crate::config::ConfigError> {
                let mut o = $crate::config::reader::Obj::new(&f.key, f.value, known, Self::IGNORED, Self::DEEPSPEED_REFUSES)?;
                let mut s = Self::default();
                $(
                    if known.contains(&stringify!($field)) {
                        let names: &[(&str, bool)] = &[$(($old, true),)* $(($alias, false),)*];
                        if let Some(f) = o.take_alias(stringify!($field), names, sink)? {
                            s.$field = ($read)(&f, sink)?;
                        }
                    }
                    $($then(&mut o, &mut s, sink)?;)?
                )*
                o.finish(sink);
                Ok(s)
            }
        }
    };
    (@default) => { ::std::default::Default::default() };
    (@refuses) => { None };
    (@refuses $why:expr) => { Some($why) };
    (@default $default:expr) => { $default };
}
pub(crate) use section;

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
