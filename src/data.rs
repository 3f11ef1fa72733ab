//! A deterministic data loader over a token file.
//!
//! Byte-level by default: every byte of the file is one token (ids 0..=255,
//! so the model's vocabulary must have at least 256 entries). With a HF
//! `tokenizer.json` ([`TokenData::from_tokenizer_file`]), the whole file is
//! encoded at once by the `tokenizers` crate (HF's own implementation, so
//! the ids are those `transformers` gives), with the tokenizer's special
//! tokens added as `tokenizer(text)` adds them by default (GPT-2: none;
//! Llama: one BOS at the start). Every id must be below the model's
//! `vocab_size`, checked at load with both numbers in the error. Sample `s`
//! (a global index over steps, micro-batches, ranks and rows) is the
//! window of `seq_len + 1` tokens starting at `(s · seq_len) mod (len −
//! seq_len − 1)`: inputs are its first `seq_len` tokens, targets the last
//! `seq_len`. Ranks read disjoint samples of the same global batch, so the
//! data of a step does not depend on how it is split over ranks and
//! micro-batches. The loader holds the tokens in memory (`u32`; a token
//! file is small next to the model it trains).

use std::path::Path;

use candle_core::{Device, Tensor};

use crate::engine::{EngineError, Result};

/// Tokens of a training corpus.
#[derive(Debug, Clone)]
pub struct TokenData {
    tokens: Vec<u32>,
    source: std::path::PathBuf,
}

impl TokenData {
    /// Reads `path` as bytes, one token per byte.
    pub fn from_byte_file(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|source| EngineError::Io {
            path: path.to_owned(),
            source,
        })?;
        Ok(Self::from_bytes(&bytes, path))
    }

    /// Reads `data_path` as UTF-8 text and encodes it with the HF tokenizer
    /// in `tokenizer_path` (`tokenizer.json`). Fails with both numbers when
    /// an id is not below `vocab_size` (the model's).
    pub fn from_tokenizer_file(
        data_path: &Path,
        tokenizer_path: &Path,
        vocab_size: usize,
    ) -> Result<Self> {
        let tokenizer =
            tokenizers::Tokenizer::from_file(tokenizer_path).map_err(|e| EngineError::Data {
                path: tokenizer_path.to_owned(),
                reason: format!("not a usable HF tokenizer.json: {e}"),
            })?;
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
        let data = TokenData {
            tokens: encoding.get_ids().to_vec(),
            source: data_path.to_owned(),
        };
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
        TokenData {
            tokens: bytes.iter().map(|&b| u32::from(b)).collect(),
            source: source.to_owned(),
        }
    }

    /// The tokens, in file order.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// True when there is no token.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Largest token id plus one.
    pub fn vocab_needed(&self) -> usize {
        self.tokens
            .iter()
            .copied()
            .max()
            .map_or(0, |m| m as usize + 1)
    }

    /// Inputs and targets `[rows, seq_len]` (`u32`) of the samples
    /// `first_sample .. first_sample + rows`.
    pub fn batch(
        &self,
        first_sample: u64,
        rows: usize,
        seq_len: usize,
        device: &Device,
    ) -> Result<(Tensor, Tensor)> {
        let n = self.tokens.len();
        if seq_len == 0 || n < seq_len + 2 {
            return Err(EngineError::Data {
                path: self.source.clone(),
                reason: format!(
                    "{n} tokens cannot give windows of seq_len {seq_len} + 1 (need at least {})",
                    seq_len + 2
                ),
            });
        }
        let span = (n - seq_len - 1) as u64;
        let mut ids = Vec::with_capacity(rows * seq_len);
        let mut tgt = Vec::with_capacity(rows * seq_len);
        for r in 0..rows as u64 {
            let s = first_sample + r;
            let start = ((s.wrapping_mul(seq_len as u64)) % span) as usize;
            let w = &self.tokens[start..start + seq_len + 1];
            ids.extend_from_slice(&w[..seq_len]);
            tgt.extend_from_slice(&w[1..]);
        }
        let ids = Tensor::from_vec(ids, (rows, seq_len), device)?;
        let tgt = Tensor::from_vec(tgt, (rows, seq_len), device)?;
        Ok((ids, tgt))
    }
}
