//! The text layer: config text to a `serde_json::Value`, read as DeepSpeed
//! reads it.
//!
//! DeepSpeed loads `ds_config.json` with Python's `hjson`
//! (`hjson.load(f, object_pairs_hook=dict_raise_error_on_duplicate_keys)`
//! in `deepspeed/runtime/config.py`), so every JSON file is accepted and so
//! are `//`, `#` and `/* */` comments, trailing commas, unquoted keys and
//! the other hjson forms; a key given twice in one object is an error. We
//! parse with the `deser-hjson` crate into our own [`Node`], which builds the
//! same `Value` `serde_json::from_str` built before: integers stay integers
//! (`u64`, or `i64` when negative), anything with `.`, `e` or `E` is an
//! `f64` (the walker accepts `5e8` where it wants an integer), and objects
//! are `serde_json::Map`s (sorted by key: serde_json's `preserve_order` is
//! off).
//!
//! **Duplicate keys** are found while building the tree. The crate gives a
//! position only to an error raised while a map *value* is read (it adds its
//! line and column, taken just before the value, to a visitor's error), so
//! the two lines are found by parsing again, twice, with a probe: the keys
//! of the document are numbered in order, and at the key numbered like the
//! first (then the second) occurrence the probe reads the value with a seed
//! that fails at once; the error's line is that key's line (the value's,
//! when the value starts on a later line than its key). The probe runs only
//! after a duplicate, and stops where the duplicate was found, so it never
//! meets anything the first pass did not.
//!
//! The crate's deserializer takes no state, so the numbering lives in a
//! thread-local [`Ctx`] that [`parse`] sets up and takes down around each
//! pass.

use std::cell::RefCell;
use std::collections::HashMap;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};

use super::error::{truncate, ConfigError};
use super::reader::join;

/// What the probe's failing seed says; never shown to a user.
const PROBE: &str = "tierzero: duplicate-key probe";

/// A key given twice in one object, as the first pass found it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Duplicate {
    /// JSON path of the key (`zero_optimization.stage`).
    path: String,
    /// Document-order numbers of the first and the second occurrence.
    first: usize,
    second: usize,
}

/// The state of one pass: the path being read, the keys numbered so far, the
/// key number the probe stops at and the duplicate found.
#[derive(Debug, Default)]
struct Ctx {
    path: Vec<String>,
    keys: usize,
    stop_at: Option<usize>,
    duplicate: Option<Duplicate>,
}

thread_local! {
    static CTX: RefCell<Option<Ctx>> = const { RefCell::new(None) };
}

fn with_ctx<R>(f: impl FnOnce(&mut Ctx) -> R) -> R {
    CTX.with(|c| f(c.borrow_mut().get_or_insert_with(Ctx::default)))
}

/// Runs one pass of `deser_hjson` with a fresh [`Ctx`] and returns it.
fn pass(text: &str, stop_at: Option<usize>) -> (Result<Node, deser_hjson::Error>, Ctx) {
    CTX.with(|c| {
        *c.borrow_mut() = Some(Ctx {
            stop_at,
            ..Ctx::default()
        })
    });
    let result = deser_hjson::from_str::<Node>(text);
    let ctx = CTX.with(|c| c.borrow_mut().take()).unwrap_or_default();
    (result, ctx)
}

/// Parses config text (JSON or hjson) to a `Value`. Syntax errors are
/// [`ConfigError::Json`] with line and column; a key given twice in one
/// object is [`ConfigError::DuplicateKey`] with both places.
pub(crate) fn parse(text: &str) -> Result<Value, ConfigError> {
    // A byte-order mark (Windows editors write one) is not part of the
    // document: Python's `utf-8-sig` drops it; read as a character, it made
    // the whole file one quoteless string.
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    // hjson lets the root object go without its braces (`stage: 3` on the
    // first line), and Python's `hjson`, DeepSpeed's reader, takes such a
    // file; `deser_hjson` does not, so the braces are added on lines of
    // their own and every line an error names is moved back by one.
    if !starts_with_brace_or_bracket(text) {
        let wrapped = format!("{{\n{text}\n}}");
        // The closing brace's line is past the file's end: its last line.
        let last_line = text.lines().count().max(1);
        return parse_text(&wrapped).map_err(|e| match e {
            // At the added closing brace: said as the file's end, and why
            // an object was read ("at `}`" named a brace not in the file).
            ConfigError::Json { line, message, .. } if line > last_line + 1 => ConfigError::Json {
                line: last_line,
                column: text.lines().last().map_or(1, |l| l.chars().count() + 1),
                message: format!(
                    "{} (the file does not start with '{{', so it is read as hjson's object \
                     without braces, `key: value` lines; a config is an object)",
                    message
                        .replace("at `}`", "at the end of the file")
                        .replace("at '}'", "at the end of the file")
                ),
            },
            ConfigError::Json {
                line,
                column,
                message,
            } => ConfigError::Json {
                line: line.saturating_sub(1).clamp(1, last_line),
                column,
                message,
            },
            ConfigError::DuplicateKey {
                key,
                first_line,
                first_column,
                second_line,
                second_column,
            } => ConfigError::DuplicateKey {
                key,
                first_line: first_line.saturating_sub(1),
                first_column,
                second_line: second_line.saturating_sub(1),
                second_column,
            },
            other => other,
        });
    }
    parse_text(text)
}

/// Whether the document's first character that is not blank or in a
/// comment (`//`, `#`, `/* */`) opens an object or an array; an empty
/// document counts as one (its error is the parser's).
fn starts_with_brace_or_bracket(text: &str) -> bool {
    let mut rest = text;
    loop {
        rest = rest.trim_start();
        if let Some(r) = rest.strip_prefix("//").or_else(|| rest.strip_prefix('#')) {
            rest = r.split_once('\n').map_or("", |(_, after)| after);
        } else if let Some(r) = rest.strip_prefix("/*") {
            rest = r.split_once("*/").map_or("", |(_, after)| after);
        } else {
            return rest.is_empty() || rest.starts_with('{') || rest.starts_with('[');
        }
    }
}

/// [`parse`] of a document that opens with its root's brace or bracket.
fn parse_text(text: &str) -> Result<Value, ConfigError> {
    let (result, ctx) = pass(text, None);
    if let Some(dup) = ctx.duplicate {
        let at = |n| match pass(text, Some(n)).0 {
            Err(deser_hjson::Error::Serde { line, col, message }) if message == PROBE => {
                (line, col)
            }
            // Cannot happen: the probe stops before anything that fails.
            _ => (0, 0),
        };
        let ((first_line, first_column), (second_line, second_column)) =
            (at(dup.first), at(dup.second));
        return Err(ConfigError::DuplicateKey {
            key: dup.path,
            first_line,
            first_column,
            second_line,
            second_column,
        });
    }
    result.map(|n| n.0).map_err(|e| syntax_error(text, e))
}

/// One line for a syntax error of `deser_hjson`, with its position.
fn syntax_error(text: &str, e: deser_hjson::Error) -> ConfigError {
    use deser_hjson::{Error as E, ErrorCode as C};
    let (line, column, message) = match e {
        E::Syntax {
            line, col, code, ..
        } => {
            let (what, consumed) = match code {
                C::Eof => (
                    "unexpected end of the text (an unclosed `{`, `[` or string?)",
                    false,
                ),
                C::ExpectedMapColon => ("expected `:` after the key", true),
                C::ExpectedMapEnd => ("expected `,` or `}`", true),
                C::ExpectedArrayEnd => ("expected `,` or `]`", true),
                C::ExpectedU64 | C::ExpectedI64 => ("integer too large for 64 bits", false),
                C::ExpectedF64 => ("malformed number", false),
                C::InvalidEscapeSequence => ("invalid escape sequence in a string", false),
                C::TrailingCharacters => ("text after the end of the config", false),
                _ => ("unexpected character", false),
            };
            // Where the crate read the offending byte before failing, its
            // position is one past it.
            let col = if consumed {
                col.saturating_sub(1).max(1)
            } else {
                col
            };
            let near: String = text
                .lines()
                .nth(line.saturating_sub(1))
                .unwrap_or("")
                .chars()
                .skip(col - 1)
                .take(16)
                .collect();
            let near = near.trim_end();
            let message = if near.is_empty() {
                what.to_owned()
            } else {
                format!("{what}, at `{near}`")
            };
            (line, col, message)
        }
        E::Serde { line, col, message } => (line, col, message),
        // Errors the crate gives no position: the top-level value's own.
        other => (1, 1, other.to_string()),
    };
    ConfigError::Json {
        line,
        column,
        message: truncate(&message),
    }
}

/// A parsed value (the newtype lets it implement `Deserialize`).
struct Node(Value);

impl<'de> de::Deserialize<'de> for Node {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(NodeVisitor).map(Node)
    }
}

/// Fails at once, to make the crate report where it is.
struct Probe;

impl<'de> DeserializeSeed<'de> for Probe {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, _: D) -> Result<(), D::Error> {
        Err(de::Error::custom(PROBE))
    }
}

struct NodeVisitor;

/// Arrays and objects nested deeper than this are refused (as serde_json
/// refuses past 128): the parser recurses once a level, and 2000 levels
/// overflowed the stack (an abort, no message).
const MAX_DEPTH: usize = 128;

/// Refuses to open another array or object past [`MAX_DEPTH`].
fn check_depth<E: de::Error>() -> Result<(), E> {
    if with_ctx(|c| c.path.len()) >= MAX_DEPTH {
        return Err(E::custom(format!(
            "arrays and objects nested deeper than {MAX_DEPTH} levels"
        )));
    }
    Ok(())
}

impl<'de> Visitor<'de> for NodeVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        Number::from_f64(v)
            .map(Value::Number)
            .ok_or_else(|| E::custom("number out of range"))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        check_depth()?;
        let mut out = Vec::new();
        loop {
            with_ctx(|c| c.path.push(format!("[{}]", out.len())));
            let next = seq.next_element::<Node>();
            with_ctx(|c| c.path.pop());
            match next? {
                Some(n) => out.push(n.0),
                None => return Ok(Value::Array(out)),
            }
        }
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        check_depth()?;
        let mut out = Map::new();
        // Key -> its document-order number, for this object.
        let mut numbers: HashMap<String, usize> = HashMap::new();
        while let Some(key) = map.next_key::<String>()? {
            let (n, stop) = with_ctx(|c| {
                c.keys += 1;
                (c.keys, c.stop_at == Some(c.keys))
            });
            if stop {
                map.next_value_seed(Probe)?;
            }
            if let Some(&first) = numbers.get(&key) {
                with_ctx(|c| {
                    let parent = path_string(&c.path);
                    c.duplicate = Some(Duplicate {
                        path: join(&parent, &key),
                        first,
                        second: n,
                    });
                });
                return Err(de::Error::custom("duplicate key"));
            }
            numbers.insert(key.clone(), n);
            with_ctx(|c| c.path.push(key.clone()));
            let value = map.next_value::<Node>();
            with_ctx(|c| c.path.pop());
            out.insert(key, value?.0);
        }
        Ok(Value::Object(out))
    }
}

/// `["a", "[0]", "b"]` -> `a[0].b`.
fn path_string(parts: &[String]) -> String {
    let mut s = String::new();
    for p in parts {
        if !p.starts_with('[') && !s.is_empty() {
            s.push('.');
        }
        s.push_str(p);
    }
    s
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// Nesting past 128 levels is a syntax error with its line, not a
    /// stack overflow (2000 levels aborted the process); 128 parse.
    #[test]
    fn deep_nesting_is_refused_not_a_stack_overflow() {
        let deep = |n: usize| format!("{{\"x\":\n{}{}}}", "[".repeat(n), "]".repeat(n));
        assert!(parse(&deep(MAX_DEPTH - 1)).is_ok());
        // On a thread with a small stack: the refusal comes before the
        // recursion could overflow it.
        let text = deep(100_000);
        let r = std::thread::Builder::new()
            .stack_size(1 << 20)
            .spawn(move || parse(&text).map(|_| ()).map_err(|e| e.to_string()))
            .unwrap()
            .join()
            .unwrap();
        match r {
            Err(e) => assert!(
                e.contains("nested deeper than 128") && e.contains("line 2"),
                "{e}"
            ),
            Ok(()) => panic!("100000 levels parsed"),
        }
    }

    fn dup(text: &str) -> (String, usize, usize) {
        match parse(text) {
            Err(ConfigError::DuplicateKey {
                key,
                first_line,
                second_line,
                ..
            }) => (key, first_line, second_line),
            other => panic!("expected a duplicate, got {other:?}"),
        }
    }

    #[test]
    fn a_byte_order_mark_is_not_part_of_the_document() {
        let v = parse("\u{feff}{\"train_micro_batch_size_per_gpu\": 2}").unwrap();
        assert_eq!(v, serde_json::json!({"train_micro_batch_size_per_gpu": 2}));
        // Only at the start.
        assert!(parse("{\"a\": 1}\u{feff}").is_err());
    }

    #[test]
    fn numbers_keep_the_forms_serde_json_gave() {
        let text = r#"{"a": 1e9, "b": 5e8, "c": 18446744073709551615, "d": -3,
            "e": 0.5, "f": 7, "g": -2.0, "h": 1.0}"#;
        let v = parse(text).unwrap();
        assert_eq!(v, serde_json::from_str::<Value>(text).unwrap());
        assert!(v["a"].is_f64() && v["b"].is_f64() && v["g"].is_f64() && v["h"].is_f64());
        assert_eq!(v["c"].as_u64(), Some(u64::MAX));
        assert!(v["d"].is_i64() && v["d"].as_i64() == Some(-3));
        assert!(v["f"].is_u64());
    }

    #[test]
    fn plain_json_parses_to_what_serde_json_gives() {
        let text = include_str!("default.json");
        assert_eq!(
            parse(text).unwrap(),
            serde_json::from_str::<Value>(text).unwrap()
        );
        let text = r#"{"z": [1, {"y": null, "x": "s\u00e9\n"}], "a": {}, "b": [], "c": true}"#;
        assert_eq!(
            parse(text).unwrap(),
            serde_json::from_str::<Value>(text).unwrap()
        );
    }

    /// A root object without its braces, as hjson allows and Python's
    /// `hjson` (DeepSpeed's reader) takes; errors keep the file's lines.
    #[test]
    fn a_root_object_without_braces_parses_as_in_python_hjson() {
        let text = "# DeepSpeed config\ntrain_micro_batch_size_per_gpu: 2\nzero_optimization: {\n  stage: 3\n}\n";
        assert_eq!(
            parse(text).unwrap(),
            serde_json::json!({"train_micro_batch_size_per_gpu": 2,
                "zero_optimization": {"stage": 3}})
        );
        let (key, first, second) = dup("a: 1\nb: 2\na: 3\n");
        assert_eq!((key.as_str(), first, second), ("a", 1, 3));
        match parse("a: 1\nb: {\n") {
            Err(ConfigError::Json { line, .. }) => assert_eq!(line, 2),
            other => panic!("{other:?}"),
        }
        // A bare value is not an object: the error is at the file's end,
        // not at the brace added around it, and says why it was read so.
        for bare in ["3", "a", "a:"] {
            match parse(bare) {
                Err(ConfigError::Json { line, message, .. }) => {
                    assert_eq!(line, 1);
                    assert!(
                        message.contains("at the end of the file")
                            && message.contains("a config is an object")
                            && !message.contains('}'),
                        "{bare}: {message}"
                    );
                }
                other => panic!("{bare}: {other:?}"),
            }
        }
        // A braced document, after comments, is read as it is.
        assert!(starts_with_brace_or_bracket("// x\n/* y */ # z\n {}"));
        assert!(!starts_with_brace_or_bracket("// x\nstage: 3"));
        assert!(starts_with_brace_or_bracket(""));
    }

    #[test]
    fn comments_and_trailing_commas() {
        let text = "{\n  // line\n  \"a\": 1, # hash\n  /* block\n */ \"b\": [1, 2,],\n}\n";
        assert_eq!(
            parse(text).unwrap(),
            serde_json::json!({"a": 1, "b": [1, 2]})
        );
    }

    #[test]
    fn duplicates_name_the_path_and_both_lines() {
        assert_eq!(
            dup("{\n  \"a\": 1,\n  \"b\": 2,\n  \"a\": 3\n}"),
            ("a".to_owned(), 2, 4)
        );
        assert_eq!(
            dup("{\"x\": {\n \"s\": 1,\n\n \"s\": {\"q\": 1}}}"),
            ("x.s".to_owned(), 2, 4)
        );
        // Inside an array, after an earlier object that has the same key.
        assert_eq!(
            dup("{\"l\": [{\"k\": 1},\n {\"k\": 1,\n \"k\": 2}]}"),
            ("l[1].k".to_owned(), 2, 3)
        );
        // The same key in two different objects is no duplicate.
        assert!(parse("{\"a\": {\"k\": 1}, \"b\": {\"k\": 1}}").is_ok());
    }

    #[test]
    fn syntax_errors_have_line_and_column() {
        match parse("{\n  \"a\": 1,\n  \"b\" 2\n}") {
            Err(ConfigError::Json { line: 3, .. }) => {}
            other => panic!("{other:?}"),
        }
        assert!(matches!(parse(""), Err(ConfigError::Json { .. })));
        assert!(matches!(
            parse("{\"a\": 1e999}"),
            Err(ConfigError::Json { line: 1, .. })
        ));
    }
}
