//! What a `--data` file is: byte-level text, text documents, HF-datasets
//! JSONL, or a flat file of token ids; and how that is decided.
//!
//! Detection ([`DataFormat::detect`]), when `--data-format` is `auto`:
//!
//! | file | with `--tokenizer` | without |
//! |---|---|---|
//! | `*.jsonl`, `*.json` | JSONL documents (field `text`, or `--text-field`) | error: needs a tokenizer |
//! | `*.u16`, `*.u32` | error: already token ids | token ids of that width |
//! | `*.bin`, `*.tokens` | error: already token ids | token ids; the width from the sidecar `FILE.json` (`{"dtype": "uint16"}`), else an error asking for `--data-format u16` or `u32` |
//! | anything else | text documents split at blank lines | byte-level (one token per byte) |
//!
//! An explicit `--data-format` wins: `bytes`, `text` (the whole file is one
//! document), `paragraphs` (documents end at a blank line), `lines` (each
//! line is a document), `jsonl`, `u16`, `u32`.

use std::path::Path;

use crate::engine::{EngineError, Result};

/// Bytes of one stored token id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TokenWidth {
    /// `uint16` little-endian (nanoGPT's `train.bin`; vocabularies up to
    /// 65,536).
    U16,
    /// `uint32` little-endian.
    U32,
}

impl TokenWidth {
    /// Bytes per id.
    pub fn bytes(self) -> usize {
        match self {
            TokenWidth::U16 => 2,
            TokenWidth::U32 => 4,
        }
    }

    /// The narrowest width holding every id below `vocab_size`.
    pub fn for_vocab(vocab_size: usize) -> TokenWidth {
        if vocab_size <= 1 << 16 {
            TokenWidth::U16
        } else {
            TokenWidth::U32
        }
    }

    /// numpy's name (`uint16`, `uint32`), as sidecars write it.
    pub fn dtype_name(self) -> &'static str {
        match self {
            TokenWidth::U16 => "uint16",
            TokenWidth::U32 => "uint32",
        }
    }

    fn from_dtype_name(name: &str) -> Option<TokenWidth> {
        match name {
            "uint16" | "u16" => Some(TokenWidth::U16),
            "uint32" | "u32" => Some(TokenWidth::U32),
            _ => None,
        }
    }
}

/// Where one document of a text file ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DocSplit {
    /// The whole file is one document.
    Whole,
    /// A document ends at a blank line (a line of white space only).
    Paragraphs,
    /// Each non-empty line is a document.
    Lines,
}

/// The format of a `--data` file.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum DataFormat {
    /// One token per byte (ids 0..=255), no tokenizer.
    Bytes,
    /// UTF-8 text cut into documents, each encoded with the tokenizer.
    Text(DocSplit),
    /// One JSON object per line; `field` holds the document's text.
    Jsonl {
        /// The field with the text (`"text"` by default).
        field: String,
    },
    /// A flat file of little-endian token ids.
    Tokens(TokenWidth),
}

impl DataFormat {
    /// Whether the format needs a tokenizer.
    pub fn needs_tokenizer(&self) -> bool {
        matches!(self, DataFormat::Text(_) | DataFormat::Jsonl { .. })
    }

    /// A stable name (cache keys, messages).
    pub fn name(&self) -> String {
        match self {
            DataFormat::Bytes => "bytes".into(),
            DataFormat::Text(DocSplit::Whole) => "text".into(),
            DataFormat::Text(DocSplit::Paragraphs) => "paragraphs".into(),
            DataFormat::Text(DocSplit::Lines) => "lines".into(),
            DataFormat::Jsonl { field } => format!("jsonl:{field}"),
            DataFormat::Tokens(w) => w.dtype_name().into(),
        }
    }

    /// The format of `path` (see the module docs): `requested` is the
    /// `--data-format` value (`None` or `"auto"`: detect), `text_field`
    /// the JSONL field.
    pub fn detect(
        path: &Path,
        requested: Option<&str>,
        has_tokenizer: bool,
        text_field: &str,
    ) -> Result<DataFormat> {
        let bad = |reason: String| EngineError::Data {
            path: path.to_owned(),
            reason,
        };
        let jsonl = || DataFormat::Jsonl {
            field: text_field.to_owned(),
        };
        let format = match requested.unwrap_or("auto") {
            "auto" => {
                let ext = extension_of(path);
                match ext.as_str() {
                    e if JSONL_EXTENSIONS.contains(&e) => jsonl(),
                    "u16" => DataFormat::Tokens(TokenWidth::U16),
                    "u32" => DataFormat::Tokens(TokenWidth::U32),
                    "bin" | "tokens" => {
                        DataFormat::Tokens(sidecar_width(path)?.ok_or_else(|| {
                            bad(
                                "a .bin or .tokens file is read as token ids and needs their \
                             width: give --data-format u16 or u32 (nanoGPT's train.bin is u16) \
                             or a sidecar FILE.json with {\"dtype\": \"uint16\"}; for one token \
                             per byte, --data-format bytes"
                                    .into(),
                            )
                        })?)
                    }
                    _ if has_tokenizer => DataFormat::Text(DocSplit::Paragraphs),
                    _ => DataFormat::Bytes,
                }
            }
            "bytes" => DataFormat::Bytes,
            "text" => DataFormat::Text(DocSplit::Whole),
            "paragraphs" => DataFormat::Text(DocSplit::Paragraphs),
            "lines" => DataFormat::Text(DocSplit::Lines),
            "jsonl" => jsonl(),
            "u16" | "uint16" => DataFormat::Tokens(TokenWidth::U16),
            "u32" | "uint32" => DataFormat::Tokens(TokenWidth::U32),
            other => {
                return Err(bad(format!(
                    "--data-format {other}: unknown; use auto, bytes, text, paragraphs, lines, \
                     jsonl, u16 or u32"
                )))
            }
        };
        match (&format, has_tokenizer) {
            // JSONL read byte-level would train on its syntax: no bytes
            // advice there.
            (DataFormat::Jsonl { .. }, false) => Err(bad(
                "jsonl data is text to encode: give --tokenizer tokenizer.json".into(),
            )),
            (f, false) if f.needs_tokenizer() => Err(bad(format!(
                "{} data is text to encode: give --tokenizer tokenizer.json (or \
                 --data-format bytes to read it byte-level)",
                f.name()
            ))),
            (DataFormat::Tokens(_), true) => Err(bad(
                "a token file holds token ids already: drop --tokenizer".into(),
            )),
            (DataFormat::Bytes, true) => Err(bad(
                "--data-format bytes reads one token per byte: drop --tokenizer, or pick a \
                 text format (text, paragraphs, lines, jsonl)"
                    .into(),
            )),
            _ => Ok(format),
        }
    }
}

/// The token width a sidecar `FILE.json` gives (`{"dtype": "uint16"}`), if
/// there is one.
fn sidecar_width(path: &Path) -> Result<Option<TokenWidth>> {
    let mut name = path.as_os_str().to_owned();
    name.push(".json");
    let sidecar = std::path::PathBuf::from(name);
    let text = match std::fs::read_to_string(&sidecar) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(EngineError::Io {
                path: sidecar,
                source,
            })
        }
    };
    let bad = |reason: &str| EngineError::Data {
        path: sidecar.clone(),
        reason: reason.to_owned(),
    };
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|_| bad("a token file's sidecar must be JSON"))?;
    let dtype = v
        .get("dtype")
        .and_then(|d| d.as_str())
        .ok_or_else(|| bad("a token file's sidecar needs \"dtype\": \"uint16\" or \"uint32\""))?;
    TokenWidth::from_dtype_name(dtype)
        .map(Some)
        .ok_or_else(|| bad("\"dtype\" must be \"uint16\" or \"uint32\""))
}

/// A binary dataset container `head` (a file's first bytes) starts with,
/// and how to make training data of it: read as bytes (or refused as
/// text) it trained on its encoding without a word.
pub fn container_of(head: &[u8]) -> Option<(&'static str, &'static str)> {
    const MAGIC: [(&[u8], &str, &str); 4] = [
        (
            b"PAR1",
            "Parquet",
            "write its text column as JSONL (datasets: load_dataset(\"parquet\", ...).to_json(\"x.jsonl\"))",
        ),
        (
            b"ARROW1",
            "Arrow",
            "write its text column as JSONL (datasets: Dataset.from_file(...).to_json(\"x.jsonl\"))",
        ),
        (
            b"\x93NUMPY",
            "NumPy .npy",
            "write its ids as a flat file (np.load(f).astype(np.uint16).tofile(\"train.bin\"), or np.uint32 for a vocabulary above 65,536) and give --data-format u16 (or u32)",
        ),
        (
            b"\x89HDF\r\n\x1a\n",
            "HDF5",
            "write its text as JSONL, or its ids as a flat .bin file with --data-format u16 or u32",
        ),
    ];
    MAGIC
        .iter()
        .find(|(m, _, _)| head.starts_with(m))
        .map(|(_, what, fix)| (*what, *fix))
}

/// The extensions `auto` reads as JSONL, and as token ids (`.bin` and
/// `.tokens` with a sidecar naming their width).
const JSONL_EXTENSIONS: [&str; 2] = ["jsonl", "json"];
const TOKEN_EXTENSIONS: [&str; 4] = ["u16", "u32", "bin", "tokens"];

/// `path`'s extension, lower-cased (`""` without one).
fn extension_of(path: &Path) -> String {
    path.extension()
        .and_then(|e| e.to_str())
        .unwrap_or("")
        .to_ascii_lowercase()
}

/// Why bytes that start with `head` are not text or training data, with
/// the fix (a compressed file, a dataset container), if they are one of
/// those; for the errors of a read that would train on them. `piped`:
/// they came through a pipe, not from the file `path`.
pub fn not_data_reason(head: &[u8], path: &Path, piped: bool) -> Option<String> {
    if let Some((what, tool)) = compression_of(head) {
        return Some(match piped {
            true => format!(
                "its bytes are {what}-compressed; decompress them in the pipe ({tool}), e.g. \
                 --data <({tool} corpus)"
            ),
            false => {
                // The format is the name's under the compression's suffix
                // (`c.jsonl.gz`): a pipe has no name, so `auto` would read
                // JSONL as text and ids as bytes; token files are mapped,
                // so they must be a file.
                let inner = extension_of(Path::new(path.file_stem().unwrap_or_default()));
                let shown = path.display();
                match inner.as_str() {
                    e if TOKEN_EXTENSIONS.contains(&e) => format!(
                        "is {what}-compressed; token ids are read from a file (a memory map), \
                         not a pipe: decompress it first ({tool} {shown} > FILE, with FILE \
                         named .{inner} as this one is) and give --data FILE"
                    ),
                    e if JSONL_EXTENSIONS.contains(&e) => format!(
                        "is {what}-compressed; decompress it first, or read it through a pipe \
                         naming the format, which a pipe's name does not say: --data <({tool} \
                         {shown}) --data-format jsonl"
                    ),
                    _ => format!(
                        "is {what}-compressed; decompress it first, or read it through a pipe: \
                         --data <({tool} {shown})"
                    ),
                }
            }
        });
    }
    if let Some((what, iconv_from)) = wide_text_of(head) {
        return Some(match piped {
            true => format!(
                "its bytes are {what} text, not UTF-8 (read so, a NUL or a refused byte stands \
                 beside every character); convert them in the pipe: --data <(iconv -f \
                 {iconv_from} -t UTF-8 FILE)"
            ),
            false => format!(
                "is {what} text, not UTF-8 (read so, a NUL or a refused byte stands beside \
                 every character); convert it first: iconv -f {iconv_from} -t UTF-8 {} > FILE, \
                 and give --data FILE",
                path.display()
            ),
        });
    }
    container_of(head).map(|(what, fix)| format!("it is a {what} file; {fix}"))
}

/// The bytes of a file's head [`wide_text_of`] looks at.
pub const WIDE_TEXT_PROBE_BYTES: usize = 1024;

/// The UTF-16 or UTF-32 encoding of the text `head` (a file's first bytes)
/// starts, and the name `iconv -f` takes for it: a byte-order mark (what
/// Windows' "Unicode" text is written with), or, without one, UTF-16 of
/// mostly ASCII text (a NUL at nine in ten of the high bytes, and at
/// hardly any low one). Read as UTF-8, text with a mark is refused at its
/// first byte and text without one is valid: it trained on a NUL after
/// every character.
pub fn wide_text_of(head: &[u8]) -> Option<(&'static str, &'static str)> {
    const MARKS: [(&[u8], &str, &str); 4] = [
        (
            b"\xFF\xFE\x00\x00",
            "UTF-32 (little-endian, with a byte-order mark)",
            "UTF-32",
        ),
        (
            b"\x00\x00\xFE\xFF",
            "UTF-32 (big-endian, with a byte-order mark)",
            "UTF-32",
        ),
        (
            b"\xFF\xFE",
            "UTF-16 (little-endian, with a byte-order mark)",
            "UTF-16",
        ),
        (
            b"\xFE\xFF",
            "UTF-16 (big-endian, with a byte-order mark)",
            "UTF-16",
        ),
    ];
    if let Some((_, what, from)) = MARKS.iter().find(|(m, _, _)| head.starts_with(m)) {
        return Some((what, from));
    }
    let head = &head[..head.len().min(WIDE_TEXT_PROBE_BYTES)];
    let pairs = head.len() / 2;
    if pairs < 8 {
        return None;
    }
    let nuls_at = |first: usize| {
        head[first..]
            .iter()
            .step_by(2)
            .take(pairs)
            .filter(|&&b| b == 0)
            .count()
    };
    // Little-endian ASCII: the character, then its NUL high byte.
    let (even_nuls, odd_nuls) = (nuls_at(0), nuls_at(1));
    let wide = |high: usize, low: usize| high * 10 >= pairs * 9 && low * 100 <= pairs;
    if wide(odd_nuls, even_nuls) {
        Some(("UTF-16 (little-endian)", "UTF-16LE"))
    } else if wide(even_nuls, odd_nuls) {
        Some(("UTF-16 (big-endian)", "UTF-16BE"))
    } else {
        None
    }
}

/// The compression format whose magic bytes `head` starts with, and the
/// tool that decompresses it to stdout.
pub fn compression_of(head: &[u8]) -> Option<(&'static str, &'static str)> {
    const MAGIC: [(&[u8], &str, &str); 4] = [
        (&[0x1f, 0x8b], "gzip", "zcat"),
        (&[0x28, 0xb5, 0x2f, 0xfd], "zstd", "zstdcat"),
        (&[0xfd, b'7', b'z', b'X', b'Z', 0x00], "xz", "xzcat"),
        (&[b'P', b'K', 0x03, 0x04], "zip", "unzip -p"),
    ];
    // bzip2: "BZh", the block size digit, then the block magic's start
    // (a text may well begin with "BZh").
    let bzip2 = head.len() >= 6
        && head.starts_with(b"BZh")
        && (b'1'..=b'9').contains(&head[3])
        && head[4..6] == [0x31, 0x41];
    if bzip2 {
        return Some(("bzip2", "bzcat"));
    }
    MAGIC
        .iter()
        .find(|(m, _, _)| head.starts_with(m))
        .map(|(_, what, tool)| (*what, *tool))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    #[test]
    fn detection_by_extension_flag_and_sidecar() {
        let d = tempfile::tempdir().unwrap();
        let p = |n: &str| d.path().join(n);
        let det =
            |n: &str, req: Option<&str>, tok: bool| DataFormat::detect(&p(n), req, tok, "text");
        assert_eq!(det("a.txt", None, false).unwrap(), DataFormat::Bytes);
        assert_eq!(
            det("a.txt", None, true).unwrap(),
            DataFormat::Text(DocSplit::Paragraphs)
        );
        assert_eq!(
            det("a.txt", Some("lines"), true).unwrap(),
            DataFormat::Text(DocSplit::Lines)
        );
        assert!(matches!(
            det("a.jsonl", None, true).unwrap(),
            DataFormat::Jsonl { .. }
        ));
        assert!(det("a.jsonl", None, false).is_err());
        assert_eq!(
            det("a.u32", None, false).unwrap(),
            DataFormat::Tokens(TokenWidth::U32)
        );
        assert!(det("a.u16", None, true).is_err());
        let e = det("train.bin", None, false).unwrap_err().to_string();
        assert!(e.contains("--data-format u16"), "{e}");
        std::fs::write(p("train.bin.json"), r#"{"dtype": "uint16", "tokens": 3}"#).unwrap();
        assert_eq!(
            det("train.bin", None, false).unwrap(),
            DataFormat::Tokens(TokenWidth::U16)
        );
        std::fs::write(p("bad.bin.json"), r#"{"dtype": "int8"}"#).unwrap();
        assert!(det("bad.bin", None, false).is_err());
        assert!(det("a.txt", Some("csv"), false).is_err());
        assert!(det("a.txt", Some("bytes"), true).is_err());
    }

    /// UTF-16 and UTF-32 text is named by its mark, and UTF-16 of mostly
    /// ASCII text without one by its NULs; UTF-8 text (NULs in it
    /// included), uint16 ids and short heads are not.
    #[test]
    fn wide_text_is_told_from_utf8() {
        let utf16 = |text: &str, le: bool| -> Vec<u8> {
            text.encode_utf16()
                .flat_map(|u| if le { u.to_le_bytes() } else { u.to_be_bytes() })
                .collect()
        };
        let text = "The cat sat on the mat.\n\nAnother paragraph, déjà vu.\n";
        let name = |h: &[u8]| wide_text_of(h).map(|(_, from)| from);
        assert_eq!(name(&utf16(text, true)), Some("UTF-16LE"));
        assert_eq!(name(&utf16(text, false)), Some("UTF-16BE"));
        let marked = [&b"\xFF\xFE"[..], &utf16(text, true)].concat();
        assert_eq!(name(&marked), Some("UTF-16"));
        assert_eq!(name(b"\xFF\xFE\x00\x00T\x00\x00\x00"), Some("UTF-32"));
        assert_eq!(name(text.as_bytes()), None);
        assert_eq!(name(b"a\x00b\x00"), None);
        assert_eq!(
            name(b"col\x00umn\x00with a few NULs\x00 in UTF-8 text"),
            None
        );
        let one_nul_in_many = [&utf16(&text.repeat(3), true)[..], &b"\x00\x00"[..]].concat();
        assert_eq!(name(&one_nul_in_many), Some("UTF-16LE"));
        let why = not_data_reason(&utf16(text, true), Path::new("c.txt"), false).unwrap();
        assert!(why.contains("iconv -f UTF-16LE -t UTF-8 c.txt"), "{why}");
    }

    #[test]
    fn widths() {
        assert_eq!(TokenWidth::for_vocab(65_536), TokenWidth::U16);
        assert_eq!(TokenWidth::for_vocab(65_537), TokenWidth::U32);
        assert_eq!(TokenWidth::U32.bytes(), 4);
    }
}
