//! Text documents to token ids, in a stream.
//!
//! A [`Docs`] reader yields one document at a time from a text or JSONL
//! file (see [`super::format`] for where a document ends), with the line it
//! starts on for errors. [`encode`] encodes documents in chunks of about
//! [`CHUNK_BYTES`] of text with `Tokenizer::encode_batch` (the chunk's
//! documents in parallel, results in document order), appends the EOS id
//! after each document unless the tokenizer's post-processor already ended
//! it with that id, checks every id against the model's vocabulary, and
//! hands the ids to a sink in order. Memory is bounded by one chunk or one
//! document, whichever is larger, not by the corpus: a document is encoded
//! in one tokenizer call, so one very large document (a whole file read as
//! `text`, or a paragraphs file with no blank line) costs the tokenizer's
//! memory for all of it (several times its bytes).
//!
//! The tokenizer is the user's `tokenizer.json` with its truncation and
//! padding turned off ([`open_tokenizer`]): a corpus is not a batch of
//! model inputs, and a `max_length` of 128 would otherwise keep 128 tokens
//! of every document. Special tokens are added per document as
//! `tokenizer(doc)` adds them (BERT: `[CLS] … [SEP]`; Llama: a BOS).

use std::io::BufRead;
use std::path::{Path, PathBuf};

use crate::engine::{EngineError, Result};

/// Why bytes that are not UTF-8 (the first invalid at byte `at`; `head`,
/// the file's first bytes where known) cannot be encoded, and the fix: a
/// compressed file or a dataset container is named as one (its fix is not
/// `--data-format bytes`, which trains on its encoding).
fn not_text(head: &[u8], at: usize, path: &Path, cut: &Cut) -> String {
    let piped = !std::fs::metadata(path).is_ok_and(|m| m.is_file());
    match super::format::not_data_reason(head, path, piped) {
        Some(why) => format!("not UTF-8 text: {why}"),
        // Byte-level is a way only for plain text, and only without the
        // tokenizer (`--data-format bytes` beside it is refused); JSONL's
        // bytes would train on its braces and keys.
        None if matches!(cut, Cut::Jsonl(_)) => format!(
            "not UTF-8 text (invalid byte at offset {at}); JSON is UTF-8: convert the file \
             (iconv -t UTF-8) or fix that line"
        ),
        None => format!(
            "not UTF-8 text (invalid byte at offset {at}); a tokenizer needs UTF-8 text: \
             convert the file (iconv -t UTF-8), or train on its bytes without --tokenizer \
             (--data-format bytes)"
        ),
    }
}

/// The UTF-8 byte-order mark some editors put first in a text file: not
/// text (JSON refuses it; a tokenizer would encode it), dropped by
/// [`Docs`].
pub const UTF8_BOM: &[u8] = b"\xEF\xBB\xBF";

/// Text encoded per `encode_batch` call.
pub const CHUNK_BYTES: usize = 4 << 20;

/// Documents per `encode_batch` call at most.
const CHUNK_DOCS: usize = 8192;

/// How a [`Docs`] reader cuts its file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cut {
    /// The whole file is one document.
    Whole,
    /// Documents end at a blank line.
    Paragraphs,
    /// Each non-empty line is a document.
    Lines,
    /// One JSON object per line; the named field is the text.
    Jsonl(String),
}

/// One document and the 1-based line it starts on.
#[derive(Debug)]
pub struct Doc {
    /// Its text.
    pub text: String,
    /// The line it starts on.
    pub line: u64,
}

/// Documents of a text file, one at a time.
#[derive(Debug)]
pub struct Docs<R> {
    reader: R,
    cut: Cut,
    path: PathBuf,
    /// Lines read so far.
    line: u64,
    /// Bytes read so far.
    bytes: u64,
    done: bool,
    buf: Vec<u8>,
    /// JSON objects read so far (JSONL): a first line that is not one may
    /// be a whole JSON document, which the error then says.
    objects: u64,
}

impl<R> Docs<R> {
    /// The reader the documents come from.
    pub fn reader(&self) -> &R {
        &self.reader
    }
}

impl<R: BufRead> Docs<R> {
    /// Documents of `reader` (the file `path`, named in errors).
    pub fn new(reader: R, cut: Cut, path: &Path) -> Docs<R> {
        Docs {
            reader,
            cut,
            path: path.to_owned(),
            line: 0,
            bytes: 0,
            done: false,
            buf: Vec::new(),
            objects: 0,
        }
    }

    /// Bytes of the file read so far.
    pub fn bytes_read(&self) -> u64 {
        self.bytes
    }

    fn err(&self, line: u64, reason: String) -> EngineError {
        EngineError::Data {
            path: self.path.clone(),
            reason: format!("line {line}: {reason}"),
        }
    }

    /// The next raw line (without its line break), or `None` at the end.
    fn next_line(&mut self) -> Result<Option<String>> {
        self.buf.clear();
        let n = self
            .reader
            .read_until(b'\n', &mut self.buf)
            .map_err(|source| EngineError::Io {
                path: self.path.clone(),
                source,
            })?;
        if n == 0 {
            return Ok(None);
        }
        let mut at = self.bytes;
        self.bytes += n as u64;
        self.line += 1;
        while matches!(self.buf.last(), Some(b'\n' | b'\r')) {
            self.buf.pop();
        }
        if self.line == 1 && self.buf.starts_with(UTF8_BOM) {
            self.buf.drain(..UTF8_BOM.len());
            at += UTF8_BOM.len() as u64;
        }
        match std::str::from_utf8(&self.buf) {
            Ok(s) => Ok(Some(s.to_owned())),
            Err(e) => {
                // The file's first bytes (a compressed file, a container)
                // are this line's when it is the first.
                let head: &[u8] = if self.line == 1 { &self.buf } else { &[] };
                let at = at as usize + e.valid_up_to();
                Err(self.err(self.line, not_text(head, at, &self.path, &self.cut)))
            }
        }
    }

    /// The next document, or `None` at the end. Empty documents are
    /// skipped.
    pub fn next_doc(&mut self) -> Result<Option<Doc>> {
        if self.done {
            return Ok(None);
        }
        match self.cut.clone() {
            Cut::Whole => {
                self.done = true;
                let mut all = Vec::new();
                self.bytes +=
                    self.reader
                        .read_to_end(&mut all)
                        .map_err(|source| EngineError::Io {
                            path: self.path.clone(),
                            source,
                        })? as u64;
                let bom = if all.starts_with(UTF8_BOM) {
                    all.drain(..UTF8_BOM.len());
                    UTF8_BOM.len()
                } else {
                    0
                };
                let text = String::from_utf8(all).map_err(|e| {
                    let at = bom + e.utf8_error().valid_up_to();
                    self.err(1, not_text(e.as_bytes(), at, &self.path, &self.cut))
                })?;
                Ok((!text.is_empty()).then_some(Doc { text, line: 1 }))
            }
            Cut::Lines => loop {
                match self.next_line()? {
                    None => return Ok(None),
                    Some(l) if l.trim().is_empty() => {}
                    Some(l) => {
                        return Ok(Some(Doc {
                            text: l,
                            line: self.line,
                        }))
                    }
                }
            },
            Cut::Paragraphs => {
                let mut text = String::new();
                let mut first = 0;
                loop {
                    match self.next_line()? {
                        None => break,
                        Some(l) if l.trim().is_empty() => {
                            if !text.is_empty() {
                                break;
                            }
                        }
                        Some(l) => {
                            if text.is_empty() {
                                first = self.line;
                            } else {
                                text.push('\n');
                            }
                            text.push_str(&l);
                        }
                    }
                }
                Ok((!text.is_empty()).then_some(Doc { text, line: first }))
            }
            Cut::Jsonl(field) => loop {
                let Some(l) = self.next_line()? else {
                    return Ok(None);
                };
                if l.trim().is_empty() {
                    continue;
                }
                let first = self.objects == 0;
                let v: serde_json::Value = serde_json::from_str(&l).map_err(|e| {
                    if e.is_eof() {
                        if let Some(why) = whole_document(first, &l, None, &self.path) {
                            return self.err(self.line, why);
                        }
                    }
                    // serde's own position counts this line as line 1.
                    let text = e.to_string();
                    let what = text
                        .rfind(" at line ")
                        .map_or(text.as_str(), |i| &text[..i]);
                    self.err(
                        self.line,
                        format!(
                            "not valid JSON ({what} at column {}); JSONL is one JSON object per \
                             line (NaN, Infinity and lone \\ud800-style surrogates, which \
                             Python's json writes, are not JSON)",
                            e.column()
                        ),
                    )
                })?;
                let kind = |v: &serde_json::Value| match v {
                    serde_json::Value::Null => "null",
                    serde_json::Value::Bool(_) => "a boolean",
                    serde_json::Value::Number(_) => "a number",
                    serde_json::Value::Array(_) => "an array",
                    serde_json::Value::Object(_) => "an object",
                    serde_json::Value::String(_) => "a string",
                };
                if !v.is_object() {
                    if let Some(why) = whole_document(first, &l, Some(&v), &self.path) {
                        return Err(self.err(self.line, why));
                    }
                    return Err(self.err(
                        self.line,
                        format!(
                            "is {}, not a JSON object; JSONL is one object per line, such as \
                             {{\"{field}\": \"...\"}}",
                            kind(&v)
                        ),
                    ));
                }
                self.objects += 1;
                match v.get(&field) {
                    Some(serde_json::Value::String(s)) => {
                        if s.is_empty() {
                            continue;
                        }
                        return Ok(Some(Doc {
                            text: s.clone(),
                            line: self.line,
                        }));
                    }
                    Some(other) => {
                        return Err(self.err(
                            self.line,
                            format!("\"{field}\" is {}, not a string", kind(other)),
                        ))
                    }
                    None => {
                        if let Some(why) = whole_document(first, &l, Some(&v), &self.path) {
                            return Err(self.err(self.line, why));
                        }
                        return Err(self.err(
                            self.line,
                            format!("no \"{field}\" field; name the text field with --text-field"),
                        ));
                    }
                }
            },
        }
    }
}

/// Why the first line of a JSONL file (`first`: no object read before it)
/// is one JSON document spread over lines rather than JSON Lines, with
/// the conversion: an array (HF datasets reads a `.json` array), a
/// pretty-printed object (`line` opens one that does not end on it), or
/// an object holding the records in an array (`{"data": [...]}`, which HF
/// reads with `field="data"`). `None` where it is not.
fn whole_document(
    first: bool,
    line: &str,
    value: Option<&serde_json::Value>,
    path: &Path,
) -> Option<String> {
    let jq = |filter: &str| {
        format!(
            "the file is one JSON document, not JSON Lines (one object per line); convert it: \
             jq -c '{filter}' {} > FILE.jsonl",
            path.display()
        )
    };
    if !first {
        return None;
    }
    match value {
        None if line.trim_start().starts_with('[') => Some(jq(".[]")),
        // A pretty-printed object: one record (`.`) or records under a key
        // (`.data[]`); which, the next lines say.
        None if line.trim_start().starts_with('{') => Some(format!(
            "the file is one JSON document, not JSON Lines (one object per line); convert it \
             with jq -c: jq -c '.KEY[]' {} > FILE.jsonl for records in an array under KEY, \
             jq -c . for one object",
            path.display()
        )),
        Some(serde_json::Value::Array(a)) if a.iter().any(serde_json::Value::is_object) => {
            Some(jq(".[]"))
        }
        Some(serde_json::Value::Object(o)) => o
            .iter()
            .find(|(_, x)| {
                x.as_array()
                    .is_some_and(|a| a.iter().any(serde_json::Value::is_object))
            })
            .map(|(k, _)| jq(&format!(".{}[]", serde_json::Value::from(k.as_str())))),
        _ => None,
    }
}

/// The largest `tokenizer.json` read (the largest on the hub are tens of
/// MB).
const MAX_TOKENIZER_BYTES: u64 = 1 << 30;

/// The user's tokenizer with truncation and padding off (see the module
/// docs).
pub fn open_tokenizer(path: &Path) -> Result<tokenizers::Tokenizer> {
    open_tokenizer_with_bytes(path).map(|(t, _)| t)
}

/// [`open_tokenizer`], with the file's bytes (the token cache's key hashes
/// them: read once, not again).
pub fn open_tokenizer_with_bytes(path: &Path) -> Result<(tokenizers::Tokenizer, Vec<u8>)> {
    let bad = |reason: String| EngineError::Tokenizer {
        path: path.to_owned(),
        reason,
    };
    // A regular file of a tokenizer's size: a link to `/dev/zero` was read
    // until memory ran out.
    let bytes = crate::durable::read_regular(path, MAX_TOKENIZER_BYTES).map_err(|e| {
        bad(format!(
            "cannot read it: {e}; give the model directory's tokenizer.json"
        ))
    })?;
    let mut t = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| {
        // Another JSON file of a model directory (its tokenizer_config.json,
        // config.json) is named as one: the tokenizers crate's serde error
        // was "expected `,` or `}` at line 2 column 24" for valid JSON.
        let json = serde_json::from_slice::<serde_json::Value>(&bytes).ok();
        // A SentencePiece model (Llama 2's, T5's `tokenizer.model`): a
        // protobuf, not JSON ("expected value at line 2 column 1").
        let sentencepiece = path.extension().is_some_and(|x| x == "model")
            || (json.is_none() && std::str::from_utf8(&bytes).is_err());
        match json {
            Some(v) if !v.get("model").is_some_and(serde_json::Value::is_object) => bad(format!(
                "is JSON but not a HF tokenizer.json (it has no \"model\" object{}); give \
                 the model directory's tokenizer.json",
                match v.get("model_type").is_some() || v.get("tokenizer_class").is_some() {
                    true => ": a config.json or tokenizer_config.json",
                    false => "",
                }
            )),
            None if sentencepiece => bad(
                "is not JSON: a SentencePiece model (tokenizer.model) or another binary \
                 file? tierzero reads a HF tokenizer.json; make one with transformers: \
                 AutoTokenizer.from_pretrained(MODEL_DIR).save_pretrained(OUT_DIR) writes \
                 OUT_DIR/tokenizer.json"
                    .into(),
            ),
            _ => bad(format!("not a usable HF tokenizer.json: {e}")),
        }
    })?;
    t.with_truncation(None)
        .map_err(|e| bad(format!("turning truncation off: {e}")))?;
    t.with_padding(None);
    Ok((t, bytes))
}

/// What [`encode`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Encoded {
    /// Documents encoded.
    pub documents: u64,
    /// Token ids handed to the sink (EOS included).
    pub tokens: u64,
    /// The largest of them (0 when there are none).
    pub max_id: u32,
}

/// Host memory a HF tokenizer holds per byte of one document while it
/// encodes it (offsets, words, merges): a 10.7 MB document peaked at
/// 2.11 GB RSS with a byte-level BPE (GPT-2's), `/usr/bin/time -v
/// tierzero eval --data-format text` on 2026-12-07 (a tiny model).
const ENCODE_BYTES_PER_TEXT_BYTE: u64 = 200;

/// Documents below this are not looked at ([`warn_if_too_large_to_encode`]).
const LARGE_DOC_BYTES: usize = 16 << 20;

/// A document whose encoding would take more memory than is available
/// (one file as one document, `--data-format text`, or one huge line) is
/// said before the encode, which the OOM killer ends without a word.
fn warn_if_too_large_to_encode(texts: &[String], lines: &[u64], path: &Path) {
    let Some((text, line)) = texts
        .iter()
        .zip(lines)
        .filter(|(t, _)| t.len() >= LARGE_DOC_BYTES)
        .max_by_key(|(t, _)| t.len())
    else {
        return;
    };
    let Some(available) = crate::engine::sizing::mem_available_bytes() else {
        return;
    };
    if let Some(need) = encode_needs_more_than(text.len(), available) {
        tracing::warn!(
            data = %path.display(),
            "the document at line {line} is {} of text, and a tokenizer holds about {} bytes \
             per byte while it encodes one document (about {} here) where {} is available: \
             the encode may be killed for memory; split it into documents (--data-format \
             lines or paragraphs, or JSONL)",
            crate::units::format_bytes(text.len() as u64),
            ENCODE_BYTES_PER_TEXT_BYTE,
            crate::units::format_bytes(need),
            crate::units::format_bytes(available)
        );
    }
}

/// A paragraphs document (the default for text with a tokenizer) this
/// large and of this many lines is most likely a corpus of one document a
/// line with no blank line between them: encoded as one document, with no
/// EOS between its lines, at the tokenizer's ~200 bytes a byte (an 8.3 MB
/// file of short lines peaked at 1.4 GiB RSS, as `lines` at 68 MiB: a
/// review's `/usr/bin/time -v tierzero train --data F --tokenizer T
/// --no-data-cache [--data-format lines]`, 2026-12-07, a tiny model).
const ONE_PARAGRAPH_BYTES: usize = CHUNK_BYTES;
const ONE_PARAGRAPH_LINES: usize = 1000;

/// Says once (returns true when it did) that a paragraphs document is
/// large and has many lines, with `--data-format lines` as the fix.
fn warn_if_lines_without_blank_ones<R>(texts: &[String], lines: &[u64], docs: &Docs<R>) -> bool {
    if docs.cut != Cut::Paragraphs {
        return false;
    }
    // Lines counted once, and only in documents this large.
    let Some((text, line, line_count)) = texts
        .iter()
        .zip(lines)
        .filter(|(t, _)| t.len() >= ONE_PARAGRAPH_BYTES)
        .map(|(t, l)| (t, l, t.lines().count()))
        .find(|(_, _, n)| *n >= ONE_PARAGRAPH_LINES)
    else {
        return false;
    };
    tracing::warn!(
        data = %docs.path.display(),
        "the document at line {line} is {} of text over {} lines with no blank line between \
         them: paragraphs (the default with --tokenizer) end documents at blank lines only, so \
         it is encoded as one document, with no EOS between its lines, and the tokenizer holds \
         about {} bytes per byte of it; if each line is a document, give --data-format lines",
        crate::units::format_bytes(text.len() as u64),
        line_count,
        ENCODE_BYTES_PER_TEXT_BYTE,
    );
    true
}

/// The memory encoding one document of `text_bytes` takes, when that is
/// more than `available_bytes` (and the document is a large one).
fn encode_needs_more_than(text_bytes: usize, available_bytes: u64) -> Option<u64> {
    let need = (text_bytes as u64).saturating_mul(ENCODE_BYTES_PER_TEXT_BYTE);
    (text_bytes >= LARGE_DOC_BYTES && need > available_bytes).then_some(need)
}

/// Encodes every document of `docs` (see the module docs), handing the ids
/// to `sink` in order; `progress` gets the bytes read so far after each
/// chunk. Fails on the first id at or above `vocab_size`, naming it, the
/// document's line and its offset in the token stream.
pub fn encode<R: BufRead>(
    docs: &mut Docs<R>,
    tokenizer: &tokenizers::Tokenizer,
    eos: Option<u32>,
    vocab_size: usize,
    sink: &mut dyn FnMut(&[u32]) -> Result<()>,
    progress: &dyn Fn(u64),
) -> Result<Encoded> {
    let mut done = Encoded::default();
    let mut out: Vec<u32> = Vec::new();
    let mut said_one_paragraph = false;
    loop {
        let mut texts = Vec::new();
        let mut lines = Vec::new();
        let mut bytes = 0usize;
        while bytes < CHUNK_BYTES && texts.len() < CHUNK_DOCS {
            match docs.next_doc()? {
                Some(d) => {
                    bytes += d.text.len();
                    lines.push(d.line);
                    texts.push(d.text);
                }
                None => break,
            }
        }
        if texts.is_empty() {
            return Ok(done);
        }
        warn_if_too_large_to_encode(&texts, &lines, &docs.path);
        if !said_one_paragraph {
            said_one_paragraph = warn_if_lines_without_blank_ones(&texts, &lines, docs);
        }
        let inputs: Vec<&str> = texts.iter().map(String::as_str).collect();
        let encodings = tokenizer.encode_batch(inputs, true).map_err(|e| {
            // The batch's error does not say which document: the first
            // that fails alone does.
            let line = texts
                .iter()
                .zip(&lines)
                .find(|(t, _)| tokenizer.encode(t.as_str(), true).is_err())
                .map_or(lines[0], |(_, l)| *l);
            EngineError::Data {
                path: docs.path.clone(),
                reason: format!("encoding the document at line {line}: {e}"),
            }
        })?;
        out.clear();
        for (enc, line) in encodings.iter().zip(&lines) {
            let ids = enc.get_ids();
            let start = done.tokens + out.len() as u64;
            if let Some((k, &id)) = ids
                .iter()
                .enumerate()
                .find(|(_, &id)| id as usize >= vocab_size)
            {
                return Err(EngineError::Data {
                    path: docs.path.clone(),
                    reason: format!(
                        "the tokenizer gives token id {id} (document at line {line}, token \
                         {} of the corpus) but the model's vocab_size is {vocab_size}; use the \
                         tokenizer the model was trained with",
                        start + k as u64
                    ),
                });
            }
            out.extend_from_slice(ids);
            if let Some(e) = eos {
                if ids.last() != Some(&e) {
                    out.push(e);
                }
            }
        }
        sink(&out)?;
        done.max_id = out.iter().copied().fold(done.max_id, u32::max);
        done.tokens += out.len() as u64;
        done.documents += encodings.len() as u64;
        progress(docs.bytes_read());
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    /// A large paragraphs document of many lines is said (a corpus of a
    /// document a line, read as one); a large one of few lines, a large
    /// `lines` chunk or a small paragraph is not.
    #[test]
    fn a_paragraph_of_a_whole_line_corpus_is_said() {
        let many = "a short sentence of a corpus.\n".repeat(ONE_PARAGRAPH_BYTES / 30 + 1);
        let few = format!("{}\n", "x".repeat(ONE_PARAGRAPH_BYTES)).repeat(3);
        let says = |text: &str, cut: Cut| {
            let d = Docs::new(&b""[..], cut, Path::new("t"));
            warn_if_lines_without_blank_ones(&[text.to_owned()], &[1], &d)
        };
        assert!(says(&many, Cut::Paragraphs));
        assert!(!says(&many, Cut::Lines));
        assert!(!says(&many, Cut::Whole));
        assert!(!says(&few, Cut::Paragraphs));
        assert!(!says(&many[..ONE_PARAGRAPH_BYTES / 2], Cut::Paragraphs));
    }

    fn docs(text: &str, cut: Cut) -> Result<Vec<(String, u64)>> {
        let mut d = Docs::new(text.as_bytes(), cut, Path::new("t"));
        let mut v = Vec::new();
        while let Some(doc) = d.next_doc()? {
            v.push((doc.text, doc.line));
        }
        assert_eq!(d.bytes_read(), text.len() as u64);
        Ok(v)
    }

    #[test]
    fn a_utf8_byte_order_mark_is_not_text() {
        let bom = "\u{feff}";
        assert_eq!(
            docs(
                &format!("{bom}{{\"text\":\"a\"}}\n"),
                Cut::Jsonl("text".into())
            )
            .unwrap(),
            vec![("a".into(), 1)]
        );
        assert_eq!(
            docs(&format!("{bom}one\ntwo"), Cut::Lines).unwrap(),
            vec![("one".into(), 1), ("two".into(), 2)]
        );
        assert_eq!(
            docs(&format!("{bom}x\n\ny"), Cut::Paragraphs).unwrap(),
            vec![("x".into(), 1), ("y".into(), 3)]
        );
        assert_eq!(
            docs(&format!("{bom}all"), Cut::Whole).unwrap(),
            vec![("all".into(), 1)]
        );
        // Only first in the file: elsewhere it is the text's.
        assert_eq!(
            docs(&format!("a\n{bom}b"), Cut::Lines).unwrap(),
            vec![("a".into(), 1), (format!("{bom}b"), 2)]
        );
    }

    #[test]
    fn an_encoding_error_names_the_document_that_failed() {
        // A WordLevel tokenizer whose unknown token is not in its vocab
        // fails on a word it does not know.
        let tok: tokenizers::Tokenizer = r#"{"version": "1.0", "truncation": null,
            "padding": null, "added_tokens": [], "normalizer": null,
            "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": {"the": 0, "engine": 1, "nvme": 2},
                      "unk_token": "[UNK]"}}"#
            .parse()
            .unwrap();
        let text = "the engine\nthe nvme\nthe zebra\nnvme\n";
        let mut d = Docs::new(text.as_bytes(), Cut::Lines, Path::new("t"));
        let e = encode(&mut d, &tok, None, 10, &mut |_| Ok(()), &|_| {})
            .unwrap_err()
            .to_string();
        assert!(e.contains("at line 3"), "{e}");
    }

    #[test]
    fn documents_end_where_the_format_says() {
        let text = "a b\nc\n\n\n  \nd\r\ne\n\nf";
        assert_eq!(
            docs(text, Cut::Paragraphs).unwrap(),
            vec![("a b\nc".into(), 1), ("d\ne".into(), 6), ("f".into(), 9)]
        );
        assert_eq!(
            docs(text, Cut::Lines).unwrap(),
            vec![
                ("a b".into(), 1),
                ("c".into(), 2),
                ("d".into(), 6),
                ("e".into(), 7),
                ("f".into(), 9)
            ]
        );
        assert_eq!(docs(text, Cut::Whole).unwrap(), vec![(text.into(), 1)]);
        assert!(docs("", Cut::Whole).unwrap().is_empty());
    }

    #[test]
    fn jsonl_takes_the_field_and_names_bad_lines() {
        let j = "{\"text\": \"one\"}\n\n{\"text\": \"\", \"x\": 1}\n{\"text\": \"two\\nlines\"}\n";
        assert_eq!(
            docs(j, Cut::Jsonl("text".into())).unwrap(),
            vec![("one".into(), 1), ("two\nlines".into(), 4)]
        );
        let e = docs("{\"text\": \"a\"}\nnot json\n", Cut::Jsonl("text".into()))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("line 2") && e.contains("not valid JSON") && !e.contains("line 1"),
            "{e}"
        );
        let e = docs("{\"body\": \"a\"}\n", Cut::Jsonl("text".into()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("line 1") && e.contains("--text-field"), "{e}");
        let e = docs("{\"text\": 3}\n", Cut::Jsonl("text".into()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("a number"), "{e}");
    }

    #[test]
    fn a_document_too_large_to_encode_in_memory_is_found() {
        let gib = 1u64 << 30;
        // A 1 GiB file as one document wants ~200 GiB.
        assert_eq!(encode_needs_more_than(1 << 30, 24 * gib), Some(200 * gib));
        assert_eq!(encode_needs_more_than(1 << 30, 300 * gib), None);
        // Small documents are never looked at.
        assert_eq!(encode_needs_more_than(1 << 20, 1), None);
        assert!(encode_needs_more_than(LARGE_DOC_BYTES, 1).is_some());
    }

    #[test]
    fn invalid_utf8_names_the_offset() {
        let mut d = Docs::new(&b"ok\nb\xffd\n"[..], Cut::Lines, Path::new("t"));
        assert_eq!(d.next_doc().unwrap().unwrap().text, "ok");
        let e = d.next_doc().unwrap_err().to_string();
        assert!(e.contains("offset 4") && e.contains("line 2"), "{e}");
    }
}
