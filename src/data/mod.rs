//! Training data: token ids from what users bring, and the windows cut
//! from them.
//!
//! # What `--data` can be
//!
//! - **Bytes** (the default without a tokenizer): every byte is one token
//!   (ids 0..=255, so the model's vocabulary needs at least 256 entries),
//!   kept as the bytes they are: the heap is the file's size (until
//!   2026-12-07 the ids were widened to `u32` at load, four times the
//!   file, five while loading). Read, not mapped: a text corpus is a file
//!   users edit, and a mapped file truncated under a run kills it.
//! - **Text documents** with a HF `tokenizer.json`: plain text whose
//!   documents end at a blank line (or each line, or the whole file), or
//!   HF `datasets` JSONL with one object per line and the text in a field.
//!   Each document is encoded on its own, with the tokenizer's truncation
//!   and padding off and its special tokens added as `tokenizer(doc)` adds
//!   them, and followed by the EOS id (nanoGPT's prepare scripts' stream;
//!   `--eos-id none` appends none, as HF's `run_clm` and its perplexity
//!   recipe, `tokenizer(text)` whole, do). Encoding streams document by document
//!   ([`encode`]) and the result is cached next to the data ([`cache`]).
//! - **Token files**: flat little-endian `uint16` or `uint32` ids
//!   (nanoGPT's `train.bin`, and our cache), read through a memory map
//!   ([`tierzero_swap::MappedFile`]), so a corpus of any size costs no
//!   heap.
//!
//! [`format`](mod@format) says how a file's format is decided. Every id is checked
//! against the model's `vocab_size` at load, with the id, the file and
//! its offset in the error.
//!
//! # Windows
//!
//! Sample `s` (a global index over steps, micro-batches, ranks and rows) is
//! a window of `seq_len + 1` tokens ([`window_start`]): inputs are its first
//! `seq_len` tokens, targets the last `seq_len`. The corpus is read in
//! passes of `W = (len − 1) / seq_len` windows that do not overlap (but for
//! the one token that is a target of a window and an input of the next),
//! sample `s` is the `s mod W`-th window of pass `s / W` in the pass's
//! order ([`DataOrder`]: file order, or a seeded shuffle of each pass,
//! the default of `tierzero train`). The
//! `r = len − 1 − W · seq_len` tokens a pass cannot use (fewer than
//! `seq_len`) are at its end in pass 0 and at its start in pass 1 (the
//! pass's offset into the corpus rotates through `0, r, r − 1, …, 1`), so
//! every token but the first (no window predicts it) is a target by the
//! end of the second pass, and a corpus of
//! `seq_len + 1` tokens is one window. (Until 2026-12-05 the start was
//! `(s · seq_len) mod (len − seq_len − 1)`: the last token never a target,
//! and where that modulus shared a large factor with `seq_len` few
//! distinct windows, one alone for `len = 2 · seq_len + 1`.)
//!
//! Ranks read disjoint samples of the same global batch, so the data of a
//! step does not depend on how it is split over ranks and micro-batches,
//! whatever the format; the checkpoint's data position is the sample count
//! and the order (and its config fingerprint names both, [`WINDOW_ORDER`]
//! and [`DataOrder::describe`]).

pub mod cache;
pub mod encode;
pub mod format;
pub mod order;

pub use format::{compression_of, DataFormat, DocSplit, TokenWidth};
pub use order::DataOrder;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{Device, Tensor};
use tierzero_swap::MappedFile;

use crate::engine::{EngineError, Result};

/// Tokens of a training corpus: in memory or mapped from a token file.
/// A byte-level corpus keeps its bytes as they are (one byte per token,
/// not widened to `u32`): its heap is the file's size.
#[derive(Debug, Clone)]
pub struct TokenData {
    store: Store,
    source: PathBuf,
    /// Largest id plus one (0 when empty).
    vocab_needed: usize,
    /// [`TokenData::ids_crc32c`], computed once (the ids never change),
    /// shared by the clones.
    ids_crc32c: Arc<std::sync::OnceLock<u32>>,
}

#[derive(Debug, Clone)]
enum Store {
    Owned(Arc<Vec<u32>>),
    /// Byte-level: each byte is an id.
    Bytes(Arc<Vec<u8>>),
    Mapped {
        map: Arc<MappedFile>,
        width: TokenWidth,
    },
}

/// Token ids that windows are cut from: a slice, or a [`TokenData`] in
/// memory or mapped.
pub trait TokenSource {
    /// Number of ids.
    fn token_count(&self) -> usize;
    /// Appends ids `start .. start + n` to `out` (panics past the end, as
    /// slicing does).
    fn extend_window(&self, start: usize, n: usize, out: &mut Vec<u32>);
    /// The first id at or above `bound`, with its position.
    fn first_at_or_above(&self, bound: u32) -> Option<(usize, u32)>;
}

impl TokenSource for [u32] {
    fn token_count(&self) -> usize {
        self.len()
    }
    fn extend_window(&self, start: usize, n: usize, out: &mut Vec<u32>) {
        out.extend_from_slice(&self[start..start + n]);
    }
    fn first_at_or_above(&self, bound: u32) -> Option<(usize, u32)> {
        self.iter().copied().enumerate().find(|&(_, t)| t >= bound)
    }
}

impl TokenSource for Vec<u32> {
    fn token_count(&self) -> usize {
        self.len()
    }
    fn extend_window(&self, start: usize, n: usize, out: &mut Vec<u32>) {
        self.as_slice().extend_window(start, n, out);
    }
    fn first_at_or_above(&self, bound: u32) -> Option<(usize, u32)> {
        self.as_slice().first_at_or_above(bound)
    }
}

impl TokenSource for TokenData {
    fn token_count(&self) -> usize {
        self.len()
    }
    fn extend_window(&self, start: usize, n: usize, out: &mut Vec<u32>) {
        match &self.store {
            Store::Owned(v) => out.extend_from_slice(&v[start..start + n]),
            Store::Bytes(v) => out.extend(v[start..start + n].iter().map(|&b| u32::from(b))),
            Store::Mapped { map, width } => {
                let w = width.bytes();
                let bytes = &map.bytes()[start * w..(start + n) * w];
                out.extend(decode(bytes, *width));
            }
        }
    }
    fn first_at_or_above(&self, bound: u32) -> Option<(usize, u32)> {
        match &self.store {
            Store::Owned(v) => v.as_slice().first_at_or_above(bound),
            Store::Bytes(v) => v
                .iter()
                .map(|&b| u32::from(b))
                .enumerate()
                .find(|&(_, t)| t >= bound),
            Store::Mapped { map, width } => decode(map.bytes(), *width)
                .enumerate()
                .find(|&(_, t)| t >= bound),
        }
    }
}

/// The ids of little-endian `bytes` of `width`.
fn decode(bytes: &[u8], width: TokenWidth) -> impl Iterator<Item = u32> + '_ {
    let w = width.bytes();
    bytes.chunks_exact(w).map(move |c| match c {
        [a, b] => u32::from(u16::from_le_bytes([*a, *b])),
        [a, b, c, d] => u32::from_le_bytes([*a, *b, *c, *d]),
        _ => 0,
    })
}

/// How a corpus is read: the file, its format, the tokenizer for text, the
/// EOS id after each document, and whether to cache the encoding.
#[derive(Debug, Clone)]
pub struct DataSpec {
    /// The `--data` file.
    pub path: PathBuf,
    /// Its format ([`DataFormat::detect`]).
    pub format: DataFormat,
    /// The `tokenizer.json` (text formats).
    pub tokenizer: Option<PathBuf>,
    /// The id appended after each document (text formats).
    pub eos: Option<u32>,
    /// Keep the encoding ([`cache`]).
    pub cache: bool,
    /// Where: `None` next to the data, or where its directory is not
    /// writable in the user's cache directory ([`cache::user_dir`]).
    pub cache_dir: Option<PathBuf>,
}

/// Where the tokens of a loaded corpus came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// Read as they are (bytes, a token file).
    Read,
    /// Encoded now, and cached in this file.
    Encoded {
        /// The cache's token file, if one was written.
        cached: Option<PathBuf>,
        /// Why none was written, when not.
        no_cache: Option<String>,
        /// Cache entries of earlier contents of the data, removed beside
        /// the new one ([`cache::remove_superseded`]): token files and
        /// their bytes.
        superseded: Vec<(PathBuf, u64)>,
    },
    /// Found in the cache.
    CacheHit(PathBuf),
}

/// A corpus as loaded.
#[derive(Debug, Clone)]
pub struct Loaded {
    /// Its tokens.
    pub data: TokenData,
    /// Documents (text formats).
    pub documents: Option<u64>,
    /// Where the tokens came from.
    pub origin: Origin,
}

/// uint16 ids a token file must hold before high halves at every odd
/// place (0, or below `vocab_size / 65536` rounded up) are taken for
/// uint32 ids read as uint16 (a real corpus never has them).
const WIDER_EVIDENCE_IDS: u64 = 1024;

impl TokenData {
    /// Reads `path` as bytes, one token per byte.
    pub fn from_byte_file(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|source| EngineError::Io {
            path: path.to_owned(),
            source,
        })?;
        // A pipe of compressed bytes (`--data <(cat corpus.gz)`) trained
        // on them without a word: a regular file is looked at before it
        // is read (the CLI), a pipe only here.
        if let Some(reason) = format::not_data_reason(&bytes, path, true) {
            return Err(EngineError::Data {
                path: path.to_owned(),
                reason,
            });
        }
        Ok(Self::from_byte_vec(bytes, path))
    }

    /// Reads `data_path` as UTF-8 text and encodes it whole, as one
    /// sequence, with the HF tokenizer in `tokenizer_path`
    /// (`tokenizer.json`), its truncation and padding off, special tokens
    /// added as `tokenizer(text)` adds them, and no EOS appended (documents
    /// with EOS: [`TokenData::load`]). Fails with both numbers when an id
    /// is not below `vocab_size` (the model's).
    pub fn from_tokenizer_file(
        data_path: &Path,
        tokenizer_path: &Path,
        vocab_size: usize,
    ) -> Result<Self> {
        let tokenizer = encode::open_tokenizer(tokenizer_path)?;
        let bytes = std::fs::read(data_path).map_err(|source| EngineError::Io {
            path: data_path.to_owned(),
            source,
        })?;
        let text = String::from_utf8(bytes).map_err(|e| EngineError::Data {
            path: data_path.to_owned(),
            reason: format!(
                "not UTF-8 text (invalid byte at offset {}); a tokenizer needs text, \
                 or drop --tokenizer to read the file byte-level",
                e.utf8_error().valid_up_to()
            ),
        })?;
        let encoding = tokenizer
            .encode(text.as_str(), true)
            .map_err(|e| EngineError::Data {
                path: data_path.to_owned(),
                reason: format!("encoding with {}: {e}", tokenizer_path.display()),
            })?;
        let data = TokenData::from_ids(encoding.get_ids().to_vec(), data_path);
        let needed = data.vocab_needed();
        if needed > vocab_size {
            return Err(EngineError::Data {
                path: data_path.to_owned(),
                reason: format!(
                    "tokenizer {} gives token id {} but the model's vocab_size is {vocab_size}; \
                     use the tokenizer the model was trained with (ids must be below \
                     vocab_size)",
                    tokenizer_path.display(),
                    needed - 1
                ),
            });
        }
        Ok(data)
    }

    /// Byte-level tokens from memory (`source` names them in errors).
    pub fn from_bytes(bytes: &[u8], source: &Path) -> Self {
        Self::from_byte_vec(bytes.to_vec(), source)
    }

    /// [`TokenData::from_bytes`], keeping `bytes` (no copy).
    pub fn from_byte_vec(bytes: Vec<u8>, source: &Path) -> Self {
        let vocab_needed = bytes
            .iter()
            .copied()
            .max()
            .map_or(0, |m| usize::from(m) + 1);
        TokenData {
            store: Store::Bytes(Arc::new(bytes)),
            source: source.to_owned(),
            vocab_needed,
            ids_crc32c: Arc::default(),
        }
    }

    /// Token ids from memory (`source` names them in errors).
    pub fn from_ids(ids: Vec<u32>, source: &Path) -> Self {
        let vocab_needed = ids.iter().copied().max().map_or(0, |m| m as usize + 1);
        TokenData {
            store: Store::Owned(Arc::new(ids)),
            source: source.to_owned(),
            vocab_needed,
            ids_crc32c: Arc::default(),
        }
    }

    /// A flat file of little-endian ids of `width`, mapped. Every id must
    /// be below `vocab_size`: the first that is not is an error with the
    /// id and its offset. The check reads the file in chunks rather than
    /// through the map, so it leaves no mapped pages resident.
    pub fn from_token_file(path: &Path, width: TokenWidth, vocab_size: usize) -> Result<Self> {
        let bad = |reason: String| EngineError::Data {
            path: path.to_owned(),
            reason,
        };
        let io = |source| EngineError::Io {
            path: path.to_owned(),
            source,
        };
        let meta = std::fs::metadata(path).map_err(io)?;
        if !meta.is_file() {
            // It is mapped: a pipe has no length and cannot be.
            return Err(bad(
                "a token file must be a regular file (it is memory-mapped), not a pipe or a \
                 device; write the ids to a file first"
                    .into(),
            ));
        }
        let len = meta.len();
        let w = width.bytes() as u64;
        if len % w != 0 {
            // The other width is a fix only where it divides the length
            // (a uint16 file of an odd length is cut short or not ids).
            let hint = if w == 4 && len % 2 == 0 {
                "; is it uint16 ids (--data-format u16)?"
            } else {
                "; the file is cut short or is not token ids (was it written whole?)"
            };
            return Err(bad(format!(
                "{len} bytes are not a whole number of {} ids ({w} bytes each){hint}",
                width.dtype_name()
            )));
        }
        let mut f = std::fs::File::open(path).map_err(io)?;
        let mut buf = vec![0u8; 1 << 20];
        let (mut max, mut at) = (0u32, 0u64);
        // uint32 ids read as uint16 (little-endian): every odd id is an
        // id's high half, below `vocab_size / 65536` rounded up (0 for a
        // vocabulary of at most 65,536; 0 or 1 for Llama 3's 128,256),
        // and the even ones not all 0. A real uint16 corpus of
        // `WIDER_EVIDENCE_IDS` ids never has that.
        let high_half_bound = vocab_size.div_ceil(1 << 16).max(1);
        let (mut odd_all_high_halves, mut even_any) = (true, false);
        loop {
            let n = read_full(&mut f, &mut buf).map_err(io)?;
            if n == 0 {
                break;
            }
            for (k, t) in decode(&buf[..n], width).enumerate() {
                let i = at + k as u64;
                if t as usize >= vocab_size {
                    return Err(bad(format!(
                        "token id {t} at token {i} (byte offset {}) is not below the model's \
                         vocab_size {vocab_size}; the file was made for another vocabulary",
                        i * w
                    )));
                }
                max = max.max(t);
                if i % 2 == 1 {
                    odd_all_high_halves &= (t as usize) < high_half_bound;
                } else {
                    even_any |= t != 0;
                }
            }
            at += (n as u64) / w;
        }
        if width == TokenWidth::U16 && at >= WIDER_EVIDENCE_IDS && odd_all_high_halves && even_any {
            let odd = match high_half_bound {
                1 => "0".to_owned(),
                b => format!("below {b} (the high halves of ids below vocab_size {vocab_size})"),
            };
            return Err(bad(format!(
                "every second id of its {at} uint16 ids is {odd} and the others are not all 0: \
                 these are uint32 ids read as uint16; give --data-format u32 (or, for a .bin \
                 file, a sidecar {{\"dtype\": \"uint32\"}})"
            )));
        }
        Self::mapped(path, width, (len > 0).then_some(max))
    }

    /// A token file whose largest id is known (`None`: it is empty),
    /// mapped without reading it.
    fn mapped(path: &Path, width: TokenWidth, max_id: Option<u32>) -> Result<Self> {
        let map = MappedFile::open(path).map_err(|e| EngineError::Data {
            path: path.to_owned(),
            reason: e.to_string(),
        })?;
        Ok(TokenData {
            vocab_needed: max_id.map_or(0, |m| m as usize + 1),
            store: Store::Mapped {
                map: Arc::new(map),
                width,
            },
            source: path.to_owned(),
            ids_crc32c: Arc::default(),
        })
    }

    /// Loads a corpus as `spec` says (see the module docs), checking every
    /// id against `vocab_size`; `progress` gets the data bytes read so far
    /// while text is encoded (with the total).
    pub fn load(spec: &DataSpec, vocab_size: usize, progress: &dyn Fn(u64, u64)) -> Result<Loaded> {
        let read = |data: TokenData| Loaded {
            data,
            documents: None,
            origin: Origin::Read,
        };
        match &spec.format {
            DataFormat::Bytes => {
                let d = Self::from_byte_file(&spec.path)?;
                if d.vocab_needed() > vocab_size {
                    return Err(EngineError::Data {
                        path: spec.path.clone(),
                        reason: format!(
                            "byte-level tokens go up to {} but the model's vocab_size is \
                             {vocab_size}; use a model with vocab_size >= 256 or give \
                             --tokenizer",
                            d.vocab_needed() - 1
                        ),
                    });
                }
                Ok(read(d))
            }
            DataFormat::Tokens(w) => Ok(read(Self::from_token_file(&spec.path, *w, vocab_size)?)),
            DataFormat::Text(_) | DataFormat::Jsonl { .. } => load_text(spec, vocab_size, progress),
        }
    }

    /// The tokens, in file order (a copy when mapped).
    pub fn tokens(&self) -> std::borrow::Cow<'_, [u32]> {
        match &self.store {
            Store::Owned(v) => std::borrow::Cow::Borrowed(v.as_slice()),
            Store::Bytes(v) => v.iter().map(|&b| u32::from(b)).collect(),
            Store::Mapped { map, width } => decode(map.bytes(), *width).collect(),
        }
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        match &self.store {
            Store::Owned(v) => v.len(),
            Store::Bytes(v) => v.len(),
            Store::Mapped { map, width } => map.bytes().len() / width.bytes(),
        }
    }

    /// crc32c of the ids as little-endian u32s, whatever their storage
    /// (bytes, u16, u32): the same ids give the same value. A checkpoint
    /// records it, so a resume on data edited to the same token count is
    /// told (the count alone missed it). Reads every id once, the first
    /// time it is asked (a resume's check, the ranks' comparison, a save);
    /// later asks, by this value or its clones, reuse it.
    pub fn ids_crc32c(&self) -> u32 {
        *self.ids_crc32c.get_or_init(|| self.compute_ids_crc32c())
    }

    fn compute_ids_crc32c(&self) -> u32 {
        const CHUNK_IDS: usize = 1 << 16;
        let mut crc = 0u32;
        let mut buf: Vec<u8> = Vec::with_capacity(CHUNK_IDS * 4);
        let mut ids: Vec<u32> = Vec::with_capacity(CHUNK_IDS);
        let mut start = 0;
        while start < self.len() {
            let n = CHUNK_IDS.min(self.len() - start);
            ids.clear();
            self.extend_window(start, n, &mut ids);
            buf.clear();
            buf.extend(ids.iter().flat_map(|id| id.to_le_bytes()));
            crc = crc32c::crc32c_append(crc, &buf);
            start += n;
        }
        crc
    }

    /// True when there is no token.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Largest token id plus one.
    pub fn vocab_needed(&self) -> usize {
        self.vocab_needed
    }

    /// Whether the tokens are mapped from a file (not in memory).
    pub fn is_mapped(&self) -> bool {
        matches!(self.store, Store::Mapped { .. })
    }

    /// Whether the data gives windows of `seq_len + 1` tokens: an error
    /// naming the numbers if not.
    pub fn check_seq_len(&self, seq_len: usize) -> Result<()> {
        let n = self.len();
        if seq_len == 0 || n < min_tokens(seq_len) {
            return Err(EngineError::Data {
                path: self.source.clone(),
                reason: format!(
                    "{n} tokens cannot give windows of seq_len {seq_len} + 1 (need at least {})",
                    min_tokens(seq_len)
                ),
            });
        }
        Ok(())
    }

    /// Inputs and targets `[rows, seq_len]` (`u32`) of the samples
    /// `first_sample .. first_sample + rows`, read in `order`.
    pub fn batch(
        &self,
        first_sample: u64,
        rows: usize,
        seq_len: usize,
        order: DataOrder,
        device: &Device,
    ) -> Result<(Tensor, Tensor)> {
        self.check_seq_len(seq_len)?;
        let n = self.len();
        let mut ids = Vec::with_capacity(rows * seq_len);
        let mut tgt = Vec::with_capacity(rows * seq_len);
        let mut w = Vec::with_capacity(seq_len + 1);
        for r in 0..rows as u64 {
            let s = first_sample
                .checked_add(r)
                .ok_or_else(|| EngineError::Data {
                    path: self.source.clone(),
                    reason: format!("sample index {first_sample} + {r} overflows"),
                })?;
            let start = window_start(s, n, seq_len, order);
            w.clear();
            self.extend_window(start, seq_len + 1, &mut w);
            ids.extend_from_slice(&w[..seq_len]);
            tgt.extend_from_slice(&w[1..]);
        }
        let ids = Tensor::from_vec(ids, (rows, seq_len), device)?;
        let tgt = Tensor::from_vec(tgt, (rows, seq_len), device)?;
        Ok((ids, tgt))
    }
}

/// The name of the window order ([`window_start`]), recorded in a
/// checkpoint's config fingerprint: a run resumed from a checkpoint of
/// another order reads other windows from the same data position, and is
/// warned so.
pub const WINDOW_ORDER: &str = "passes of non-overlapping windows, offset rotating (2026-12-05)";

/// The fewest tokens that give one window of `seq_len + 1`.
pub fn min_tokens(seq_len: usize) -> usize {
    seq_len.saturating_add(1)
}

/// Where sample `s`'s window of `seq_len + 1` tokens starts in a corpus
/// of `n` tokens (`n >= seq_len + 1`, `seq_len >= 1`): the `s mod W`-th
/// window of pass `s / W` in `order`, `W = (n − 1) / seq_len`, the pass
/// shifted by its offset (see "Windows" in the module docs). The window
/// ends at or before `n`.
pub fn window_start(s: u64, n: usize, seq_len: usize, order: DataOrder) -> usize {
    debug_assert!(seq_len >= 1 && n > seq_len);
    let per_pass = ((n - 1) / seq_len) as u64;
    let spare = ((n - 1) as u64 - per_pass * seq_len as u64) + 1;
    let pass = s / per_pass;
    let k = order.window(pass, s % per_pass, per_pass);
    // 0, r, r - 1, ..., 1, 0, r, ... for passes 0, 1, 2, ...: pass 1 ends
    // at the corpus's end, pass 0 starts at its start.
    let offset = ((pass % spare) * (spare - 1)) % spare;
    (offset + k * seq_len as u64) as usize
}

/// Reads until `buf` is full or the file ends; returns the bytes read.
fn read_full(f: &mut std::fs::File, buf: &mut [u8]) -> std::io::Result<usize> {
    use std::io::Read as _;
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// A cached token file as its sidecar describes it: checked against
/// `vocab_size` by its recorded largest id (read when not recorded).
fn cached(
    tokens: &Path,
    width: TokenWidth,
    meta: &cache::CacheMeta,
    vocab_size: usize,
) -> Result<TokenData> {
    match meta.max_id {
        Some(m) if (m as usize) < vocab_size => TokenData::mapped(tokens, width, Some(m)),
        Some(m) => Err(EngineError::Data {
            path: tokens.to_owned(),
            reason: format!(
                "the cached encoding has token id {m}, not below the model's vocab_size \
                 {vocab_size}; use the tokenizer the model was trained with"
            ),
        }),
        None => TokenData::from_token_file(tokens, width, vocab_size),
    }
}

/// [`TokenData::load`] of a text format: from the cache, or encoded now
/// (into the cache when it can be written, else into memory).
fn load_text(spec: &DataSpec, vocab_size: usize, progress: &dyn Fn(u64, u64)) -> Result<Loaded> {
    let tok_path = spec.tokenizer.as_deref().ok_or_else(|| EngineError::Data {
        path: spec.path.clone(),
        reason: format!("{} data needs --tokenizer", spec.format.name()),
    })?;
    let cut = match &spec.format {
        DataFormat::Text(DocSplit::Whole) => encode::Cut::Whole,
        DataFormat::Text(DocSplit::Paragraphs) => encode::Cut::Paragraphs,
        DataFormat::Text(DocSplit::Lines) => encode::Cut::Lines,
        DataFormat::Jsonl { field } => encode::Cut::Jsonl(field.clone()),
        other => {
            return Err(EngineError::internal(format!(
                "load_text of {}",
                other.name()
            )))
        }
    };
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| EngineError::Io { path, source }
    };
    let (tokenizer, tokenizer_json) = encode::open_tokenizer_with_bytes(tok_path)?;
    let total = std::fs::metadata(&spec.path).map_err(io(&spec.path))?.len();
    let open_docs = || -> Result<encode::Docs<std::io::BufReader<cache::Tally<std::fs::File>>>> {
        let f = std::fs::File::open(&spec.path).map_err(io(&spec.path))?;
        Ok(encode::Docs::new(
            std::io::BufReader::with_capacity(1 << 20, cache::Tally::new(f)),
            cut.clone(),
            &spec.path,
        ))
    };
    let width = TokenWidth::for_vocab(vocab_size);
    let empty = |documents: u64| EngineError::Data {
        path: spec.path.clone(),
        reason: format!(
            "the corpus is empty ({documents} documents, no tokens); give a file with text in it"
        ),
    };
    let on_progress = |bytes: u64| progress(bytes, total);

    let mut no_cache = None;
    let mut target = None;
    // A pipe (`--data <(zcat corpus.txt.gz)`) can be read once: its
    // identity for the cache key would drain it, and the encode below then
    // found nothing ("the corpus is empty").
    let regular = std::fs::metadata(&spec.path).is_ok_and(|m| m.is_file());
    if spec.cache && !regular {
        no_cache = Some("it is not a regular file (a pipe?): the tokens stay in memory".into());
    } else if spec.cache
        && spec.cache_dir.is_none()
        && cache::is_read_through_dev_or_proc(&spec.path)
    {
        no_cache = Some(
            "it is read through /dev or /proc (a redirected stdin?), where no cache goes: the \
             tokens stay in memory (--data-cache-dir DIR keeps them)"
                .into(),
        );
    } else if spec.cache {
        let data = cache::DataIdentity::of(&spec.path)?;
        let key = cache::key(&cache::KeyInputs {
            tokenizer_json: &tokenizer_json,
            data,
            format: &spec.format,
            eos: spec.eos,
            width,
        });
        // Where the entry may be: the given directory, else next to the
        // data, then the user's cache directory.
        let dirs: Vec<PathBuf> = match &spec.cache_dir {
            Some(d) => vec![d.clone()],
            None => std::iter::once(cache::data_dir(&spec.path))
                .chain(cache::user_dir())
                .collect(),
        };
        for dir in &dirs {
            let (tokens, sidecar) = cache::paths_in(dir, &spec.path, &key, width);
            if let Some(meta) = cache::lookup(&tokens, &sidecar, &key, width) {
                let data = cached(&tokens, width, &meta, vocab_size)?;
                if data.is_empty() {
                    return Err(empty(meta.documents));
                }
                return Ok(Loaded {
                    data,
                    documents: Some(meta.documents),
                    origin: Origin::CacheHit(tokens),
                });
            }
        }
        // Written in the first that takes files (created if missing).
        // A directory whose entry paths are taken by something that is
        // not a file (a directory made there) cannot take the entry.
        let entry_in = |d: &PathBuf| {
            if crate::durable::create_dir_all(d).is_err() || !cache::writable(d) {
                return None;
            }
            let (tokens, sidecar) = cache::paths_in(d, &spec.path, &key, width);
            let free = crate::durable::check_replaceable(&tokens).is_ok()
                && crate::durable::check_replaceable(&sidecar).is_ok();
            free.then_some((tokens, sidecar))
        };
        match dirs.iter().find_map(entry_in) {
            Some((tokens, sidecar)) => target = Some((tokens, sidecar, key, data)),
            None => {
                let names: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
                no_cache = Some(format!(
                    "{} not writable (or the entry's name there is taken by a directory or a \
                     link): the tokens stay in memory",
                    if names.len() == 1 {
                        format!("{} is", names[0])
                    } else {
                        format!("neither {} is", names.join(" nor "))
                    }
                ));
            }
        }
    } else {
        no_cache = Some("the cache is off (--no-data-cache)".into());
    }

    let mut docs = open_docs()?;
    let Some((tokens, sidecar, key, ident)) = target else {
        let mut ids = Vec::new();
        let enc = encode::encode(
            &mut docs,
            &tokenizer,
            spec.eos,
            vocab_size,
            &mut |x| {
                ids.extend_from_slice(x);
                Ok(())
            },
            &on_progress,
        )?;
        if ids.is_empty() {
            return Err(empty(enc.documents));
        }
        return Ok(Loaded {
            data: TokenData::from_ids(ids, &spec.path),
            documents: Some(enc.documents),
            origin: Origin::Encoded {
                cached: None,
                no_cache,
                superseded: Vec::new(),
            },
        });
    };
    // A first encode killed before its rename left its temporary file, as
    // large as the cache: removed now that the next one begins (a live
    // writer's, another rank's encoding the same corpus, stays).
    crate::durable::remove_stale_tmp(&tokens, false);
    crate::durable::remove_stale_tmp(&sidecar, false);
    let mut enc = encode::Encoded::default();
    let mut tokens_crc32c = 0u32;
    crate::durable::write_atomic_streamed(&tokens, |file, tmp| -> Result<std::fs::File> {
        use std::io::Write as _;
        crate::failpoint::kill_point(crate::failpoint::Site::DataEncode);
        let mut w = std::io::BufWriter::with_capacity(1 << 20, file);
        let werr = |source| EngineError::Io {
            path: tmp.to_owned(),
            source,
        };
        let mut bytes = Vec::new();
        let mut crc = 0u32;
        enc = encode::encode(
            &mut docs,
            &tokenizer,
            spec.eos,
            vocab_size,
            &mut |ids| {
                bytes.clear();
                for &t in ids {
                    match width {
                        // Every id is below vocab_size, which fits the width.
                        TokenWidth::U16 => bytes.extend_from_slice(&(t as u16).to_le_bytes()),
                        TokenWidth::U32 => bytes.extend_from_slice(&t.to_le_bytes()),
                    }
                }
                crc = crc32c::crc32c_append(crc, &bytes);
                w.write_all(&bytes).map_err(werr)
            },
            &on_progress,
        )?;
        tokens_crc32c = crc;
        // All of it was read (the encode reads to the end): the entry is
        // of the content its key names, or it is not made.
        docs.reader().get_ref().check(&ident, &spec.path)?;
        w.into_inner().map_err(|e| werr(e.into_error()))
    })
    .map_err(|e| cache_full(e, &spec.path, &tokens))?;
    if enc.tokens == 0 {
        let _ = std::fs::remove_file(&tokens);
        return Err(empty(enc.documents));
    }
    // Resolved: a later run started in another directory finds this
    // entry's data as the same file when it prunes superseded entries (a
    // relative path resolved against its own directory did not, and every
    // edit left a corpus-sized entry behind); a name that is not UTF-8 is
    // kept whole beside it.
    let (source, source_hex) = cache::CacheMeta::source_fields(
        &std::fs::canonicalize(&spec.path).unwrap_or_else(|_| spec.path.clone()),
    );
    let meta = cache::CacheMeta {
        tierzero_token_cache: 1,
        key,
        dtype: width.dtype_name().into(),
        tokens: enc.tokens,
        documents: enc.documents,
        source,
        source_hex,
        data: ident,
        format: spec.format.name(),
        eos_id: spec.eos,
        max_id: Some(enc.max_id),
        tokens_crc32c: Some(tokens_crc32c),
    };
    let text = serde_json::to_vec_pretty(&meta)
        .map_err(|e| EngineError::internal(format!("token cache sidecar: {e}")))?;
    crate::durable::write_atomic(&sidecar, &text)
        .map_err(|e| cache_full(e.into(), &spec.path, &tokens))?;
    cache::readable_as_the_data(&spec.path, &[&tokens, &sidecar]);
    // Mapped first: a run pruning this entry as another content's (the
    // file edited meanwhile) then leaves the mapping whole.
    let data = cached(&tokens, width, &meta, vocab_size)?;
    let dir = cache::data_dir(&spec.path);
    // The data's own directory, however --data-cache-dir spelled it.
    let superseded = if tokens
        .parent()
        .is_some_and(|p| crate::durable::same_path(p, &dir))
    {
        cache::remove_superseded(&dir, &spec.path, &meta.data)
    } else {
        Vec::new()
    };
    Ok(Loaded {
        data,
        documents: Some(enc.documents),
        origin: Origin::Encoded {
            cached: Some(tokens),
            no_cache: None,
            superseded,
        },
    })
}

/// A token cache write that ran out of space (or quota) becomes an
/// error on the data naming the cache and the way past it; any other is
/// kept.
fn cache_full(e: EngineError, data: &Path, cache: &Path) -> EngineError {
    let source = match &e {
        EngineError::Io { source, .. } => source,
        EngineError::Durable(d) => &d.source,
        _ => return e,
    };
    let fix = match source.kind() {
        std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded => "free space there",
        // Another user's entry in a shared (sticky) directory.
        std::io::ErrorKind::PermissionDenied => "give --data-cache-dir DIR (a directory of yours)",
        _ => return e,
    };
    EngineError::Data {
        path: data.to_owned(),
        reason: format!(
            "writing its token cache {}: {source}; {fix}, or give --no-data-cache (the tokens \
             then stay in memory)",
            cache.display()
        ),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;
    use proptest::prelude::*;

    /// A byte-level corpus kept as bytes reads as the same ids as the
    /// bytes widened to u32: windows at every start, the first id at or
    /// above a bound, the length and the vocabulary it needs.
    #[test]
    fn bytes_kept_as_bytes_read_as_their_widened_ids() {
        let bytes: Vec<u8> = (0..1000u32)
            .map(|i| (i * 37 % 251 + i / 200) as u8)
            .collect();
        let kept = TokenData::from_bytes(&bytes, Path::new("b"));
        let wide = TokenData::from_ids(
            bytes.iter().map(|&b| u32::from(b)).collect(),
            Path::new("w"),
        );
        assert!(matches!(kept.store, Store::Bytes(_)));
        assert_eq!(
            (kept.len(), kept.vocab_needed()),
            (wide.len(), wide.vocab_needed())
        );
        assert_eq!(kept.vocab_needed(), 255);
        assert_eq!(kept.tokens(), wide.tokens());
        for (start, n) in [(0, 1), (0, 1000), (3, 17), (999, 1), (500, 0)] {
            let (mut a, mut b) = (vec![7], vec![7]);
            kept.extend_window(start, n, &mut a);
            wide.extend_window(start, n, &mut b);
            assert_eq!(a, b, "{start}+{n}");
        }
        for bound in [0, 1, 200, 250, 254, 255, 256] {
            assert_eq!(
                kept.first_at_or_above(bound),
                wide.first_at_or_above(bound),
                "{bound}"
            );
        }
        let empty = TokenData::from_bytes(&[], Path::new("e"));
        assert_eq!((empty.len(), empty.vocab_needed()), (0, 0));
    }

    /// uint32 ids of a vocabulary above 65,536 (Llama 3's) read as uint16
    /// are refused: their high halves are 0 or 1, not all 0. A uint16
    /// file of the same model whose ids happen to be small still loads.
    #[test]
    fn uint32_ids_of_a_large_vocabulary_read_as_uint16_are_refused() {
        let d = tempfile::tempdir().unwrap();
        let vocab = 128_256;
        let ids: Vec<u32> = (0..4096u32).map(|i| (i * 7919) % vocab as u32).collect();
        assert!(ids.iter().any(|&t| t >= 1 << 16));
        let wide: Vec<u8> = ids.iter().flat_map(|t| t.to_le_bytes()).collect();
        let path = d.path().join("wide.bin");
        std::fs::write(&path, wide).unwrap();
        let e = TokenData::from_token_file(&path, TokenWidth::U16, vocab)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("is below 2") && e.contains("--data-format u32"),
            "{e}"
        );
        let read = TokenData::from_token_file(&path, TokenWidth::U32, vocab).unwrap();
        assert_eq!(read.tokens().as_ref(), ids.as_slice());
        // Real uint16 ids (all below 65,536) of the same model.
        let narrow: Vec<u8> = (0..4096u32)
            .flat_map(|i| (((i * 7919) % (1 << 16)) as u16).to_le_bytes())
            .collect();
        let path = d.path().join("narrow.bin");
        std::fs::write(&path, narrow).unwrap();
        assert_eq!(
            TokenData::from_token_file(&path, TokenWidth::U16, vocab)
                .unwrap()
                .len(),
            4096
        );
    }

    #[test]
    fn a_full_disk_under_the_cache_names_the_way_past_it() {
        let io = |errno| EngineError::Io {
            path: "t.tmp".into(),
            source: std::io::Error::from_raw_os_error(errno),
        };
        let e = cache_full(io(libc::ENOSPC), Path::new("c.jsonl"), Path::new(".c.tz")).to_string();
        assert!(
            e.contains("c.jsonl") && e.contains(".c.tz") && e.contains("--no-data-cache"),
            "{e}"
        );
        let e = cache_full(io(libc::EIO), Path::new("c.jsonl"), Path::new(".c.tz"));
        assert!(matches!(e, EngineError::Io { .. }), "{e}");
    }

    const SEQ: DataOrder = DataOrder::Sequential;
    const SHUFFLED: DataOrder = DataOrder::Shuffled { seed: 3 };

    /// Which tokens the windows of samples `0..samples` make targets.
    fn targets(n: usize, seq_len: usize, samples: u64, order: DataOrder) -> Vec<bool> {
        let mut hit = vec![false; n];
        for s in 0..samples {
            let start = window_start(s, n, seq_len, order);
            assert!(
                start + seq_len < n,
                "s {s}: window {start}+{seq_len} past {n}"
            );
            for h in &mut hit[start + 1..=start + seq_len] {
                *h = true;
            }
        }
        hit
    }

    #[test]
    fn the_first_pass_is_the_corpus_in_order_without_overlap() {
        // 10 windows of 8 and 3 tokens over: starts 0, 8, ..., 72.
        let (n, seq_len) = (84, 8);
        let starts: Vec<usize> = (0..10).map(|s| window_start(s, n, seq_len, SEQ)).collect();
        assert_eq!(starts, (0..10).map(|k| k * seq_len).collect::<Vec<_>>());
        // Pass 1 is shifted to end at the corpus's end: it starts at 3.
        assert_eq!(window_start(10, n, seq_len, SEQ), 3);
        assert_eq!(window_start(19, n, seq_len, SEQ) + seq_len + 1, n);
    }

    #[test]
    fn a_shuffled_pass_reads_the_same_windows_in_another_order() {
        let (n, seq_len) = (84, 8);
        for pass in 0..3u64 {
            let starts = |order| -> Vec<usize> {
                (pass * 10..pass * 10 + 10)
                    .map(|s| window_start(s, n, seq_len, order))
                    .collect()
            };
            let (mut shuffled, file) = (starts(SHUFFLED), starts(SEQ));
            assert_ne!(shuffled, file, "pass {pass}");
            shuffled.sort_unstable();
            assert_eq!(shuffled, file, "pass {pass}");
        }
    }

    #[test]
    fn two_passes_make_every_token_but_the_first_a_target() {
        // The old rule's worst case: 2 * seq_len + 1 tokens gave one window
        // (0..=seq_len) for every sample; here two windows, the whole corpus.
        for (n, seq_len) in [(2049, 1024), (10241, 1024), (1025, 1024), (100, 7), (9, 8)] {
            let per_pass = ((n - 1) / seq_len) as u64;
            for order in [SEQ, SHUFFLED] {
                let hit = targets(n, seq_len, 2 * per_pass, order);
                assert!(hit[1..].iter().all(|&h| h), "n {n}, seq_len {seq_len}");
            }
        }
    }

    /// The ids' checksum depends on the ids, not on how they are stored,
    /// and sees one id changed (past the first chunk too).
    #[test]
    fn the_ids_checksum_is_the_ids_whatever_the_storage() {
        let bytes: Vec<u8> = (0..200_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let ids: Vec<u32> = bytes.iter().map(|&b| u32::from(b)).collect();
        let p = Path::new("x");
        let a = TokenData::from_byte_vec(bytes.clone(), p).ids_crc32c();
        assert_eq!(a, TokenData::from_ids(ids.clone(), p).ids_crc32c());
        let mut other = ids;
        other[150_000] ^= 1;
        assert_ne!(a, TokenData::from_ids(other, p).ids_crc32c());
        assert_eq!(TokenData::from_ids(Vec::new(), p).ids_crc32c(), 0);
    }

    #[test]
    fn a_corpus_of_one_window_is_enough() {
        let d = TokenData::from_ids((0..9).collect(), Path::new("t"));
        let (ids, tgt) = d.batch(0, 3, 8, SHUFFLED, &Device::Cpu).unwrap();
        let ids: Vec<Vec<u32>> = ids.to_vec2().unwrap();
        let tgt: Vec<Vec<u32>> = tgt.to_vec2().unwrap();
        for r in 0..3 {
            assert_eq!(ids[r], (0..8).collect::<Vec<u32>>());
            assert_eq!(tgt[r], (1..9).collect::<Vec<u32>>());
        }
        let short = TokenData::from_ids((0..8).collect(), Path::new("t"));
        assert!(short.batch(0, 1, 8, SEQ, &Device::Cpu).is_err());
    }

    proptest! {
        #[test]
        fn windows_stay_inside_and_passes_cover(
            seq_len in 1usize..40,
            extra in 0usize..200,
            s in 0u64..u64::MAX / 2,
            seed: u64,
        ) {
            let n = seq_len + 1 + extra;
            for order in [SEQ, DataOrder::Shuffled { seed }] {
                let start = window_start(s, n, seq_len, order);
                prop_assert!(start + seq_len < n);
                let per_pass = ((n - 1) / seq_len) as u64;
                let hit = targets(n, seq_len, 2 * per_pass, order);
                prop_assert!(hit[1..].iter().all(|&h| h));
            }
        }
    }
}
