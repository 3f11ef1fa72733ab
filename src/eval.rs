//! Evaluation: the mean next-token cross-entropy of a model over a token
//! stream, and its perplexity (`tierzero eval`).
//!
//! # What is measured
//!
//! The tokens are cut into **non-overlapping windows of `seq_len` (L)
//! tokens**, from the start. In each window, positions 1..L−1 are predicted
//! from the ones before: the model reads the window's first L−1 tokens and
//! its logits at position `i` are scored against token `i + 1`. This is the
//! convention of HF `transformers`' `labels=input_ids` loss (which shifts
//! logits and labels by one inside the window), so each full window yields
//! L−1 predictions and the first token of every window is never predicted.
//! Feeding only the first L−1 tokens gives the same logits as feeding all L
//! (the model is causal) and saves one position.
//!
//! A **trailing partial window** of `r` tokens (`r = len mod L`) counts when
//! `r >= 2` (it yields `r − 1` predictions); a single trailing token has
//! nothing to be predicted from and is dropped.
//!
//! # Weighting
//!
//! The loss is the **mean over all predicted tokens** (the sum of their
//! negative log-likelihoods divided by their count), and
//! [`EvalResult::tokens`] is that count: `full × (L − 1) + max(r − 1, 0)`.
//! HF's usual perplexity loop averages the per-window means instead. The two
//! agree exactly when every window has the same length (no partial window,
//! i.e. `len mod L` is 0 or 1); with a partial window ours weights each
//! token equally rather than each window. We chose the token mean because it
//! does not depend on where the data happens to end, and it is what
//! `exp(loss)` as perplexity means.
//!
//! # Numerics and memory
//!
//! Parameters are fetched through the caller's closure and converted to
//! [`EvalOptions::dtype`] (fp32 unless asked) on the compute device (so a
//! checkpoint's master weights, a safetensors file in 16-bit or a seeded
//! init all evaluate the same way). Windows run `batch_windows` at a time
//! (a *batch*) through the units ([`Model::forward_unit`]) and the head's
//! [`Model::logits`], in that dtype under the precision policy
//! ([`crate::model::precision`]: with bf16 or fp16 the matmuls take 16-bit
//! operands and the norms and softmax run in fp32, as training computes);
//! the log-softmax of each predicted position is then taken in f64 from the
//! logits (upcast to fp32 exactly) and summed in f64, in window order, so
//! the result does not depend on `batch_windows`.
//!
//! The weights are **streamed unit by unit**, as in training, never held
//! whole: a model that trains with its parameters on NVMe evaluates in
//! about the memory of its largest unit. The batches go in *passes*: a pass
//! takes as many consecutive batches as keep their hidden states within
//! [`EvalOptions::pass_bytes`] (at least one), fetches each unit's params
//! once, runs every batch of the pass through that unit, and drops them
//! before the next unit. Memory is the largest unit in fp32, the pass's
//! hidden states, one batch's logits (`batch_windows × (L − 1) ×
//! vocab_size × 4` bytes, which `--batch` bounds; under bf16 or fp16 the
//! head's 16-bit output beside them, 2 bytes a logit more) and one window's
//! fp32 copy of them for the f64 sums. Each batch runs the same operations
//! as it would alone, and the sums are one chain in window order across
//! batches and passes, so the result does not depend on `pass_bytes` or
//! `batch_windows` either (tests check the bits). A param a later unit uses too (tied embeddings) is fetched again
//! there; each pass fetches the weights once more.
//!
//! # Where the weights come from
//!
//! [`evaluate`] takes a `fetch` closure from [`ParamId`] to a tensor, so any
//! weight source plugs in with one line: a HF directory
//! (`|id| dir.load_param(id, DType::F32, &device)`), or a checkpoint's fp32
//! master weights.

use crate::data::TokenSource;
use candle_core::{DType, Device, Tensor};

use crate::model::{Model, ModelError, ParamId, UnitInput, UnitKind};

/// Errors of evaluation. Every variant but `Model`/`Candle`/`Fetch` is the
/// caller's input.
#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    /// `seq_len` below 2: a window must hold one token to predict from and
    /// one to predict.
    #[error("seq_len {seq_len} is too small: a window needs at least 2 tokens (one to read, one to predict)")]
    SeqLenTooSmall {
        /// The value given.
        seq_len: usize,
    },
    /// `seq_len` above the model's positions.
    #[error("seq_len {seq_len} exceeds the model's maximum positions {max_seq_len}; use a seq_len of at most {max_seq_len}")]
    SeqLenTooLarge {
        /// The value given.
        seq_len: usize,
        /// The model's `max_seq_len` (`n_positions` / `max_position_embeddings`).
        max_seq_len: usize,
    },
    /// Fewer than 2 tokens: nothing to predict.
    #[error("{tokens} token(s): a window of seq_len {seq_len} needs at least 2 (one to read, one to predict); give more data")]
    TooFewTokens {
        /// Tokens available.
        tokens: usize,
        /// Window length.
        seq_len: usize,
    },
    /// A token id outside the model's vocabulary.
    #[error("token id {token} at position {position} is outside the model's vocabulary (vocab_size {vocab_size}); the data and the model do not match")]
    TokenOutOfVocab {
        /// The id.
        token: u32,
        /// Its index in the token stream.
        position: usize,
        /// The model's vocabulary size.
        vocab_size: usize,
    },
    /// `batch_windows` of zero.
    #[error("batch of 0 windows: give at least 1")]
    ZeroBatch,
    /// One batch's logits alone exceed the host memory available.
    #[error(
        "a batch of {windows} windows of {positions} positions x vocab_size {vocab_size} has \
         {} of logits, and {} of host memory is available; lower --batch (or --seq-len)",
        crate::units::format_bytes(*logits_bytes),
        crate::units::format_bytes(*available_bytes)
    )]
    LogitsTooLarge {
        /// Windows in the largest batch.
        windows: usize,
        /// Positions in each (the head computes every one).
        positions: usize,
        /// The model's vocabulary size.
        vocab_size: usize,
        /// Their logits' bytes (fp32, and the 16-bit output under
        /// bf16/fp16).
        logits_bytes: u64,
        /// `MemAvailable` now.
        available_bytes: u64,
    },
    /// The weight source failed for one parameter.
    #[error("loading parameter `{name}`: {source}")]
    Fetch {
        /// Parameter name.
        name: String,
        /// The source's error.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The loss is not finite (the weights are broken).
    #[error("the loss is {loss} (not finite): the weights produce non-finite logits")]
    NotFinite {
        /// The value.
        loss: f64,
    },
    /// From the model.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// From candle.
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
}

/// How to evaluate.
#[derive(Debug, Clone)]
pub struct EvalOptions {
    /// Window length L in tokens (each window yields L − 1 predictions).
    pub seq_len: usize,
    /// Windows per forward pass (bounds activation memory; does not change
    /// the result).
    pub batch_windows: usize,
    /// Compute device.
    pub device: Device,
    /// Bytes of hidden states (fp32) one pass may hold: how many batches
    /// share one read of the weights (see the module docs). Does not change
    /// the result. [`DEFAULT_PASS_BYTES`] is a good start.
    pub pass_bytes: u64,
    /// The dtype the weights are converted to and the units run in:
    /// `F32` (the default of `tierzero eval`), or `BF16` / `F16` to
    /// evaluate as training computes under `bf16` / `fp16`, by the
    /// precision policy of [`crate::model::precision`] (16-bit matmuls,
    /// fp32 norms, softmax and loss).
    pub dtype: DType,
}

/// 1 GiB of hidden states per pass over the weights.
pub const DEFAULT_PASS_BYTES: u64 = 1 << 30;

/// How a token stream splits into windows (pure arithmetic; see the module
/// docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Windows {
    /// Full windows of `seq_len` tokens.
    pub full: usize,
    /// Tokens in the trailing partial window that counts (0, or 2..L−1).
    pub partial_len: usize,
    /// Tokens at the end that are not used (0 or 1).
    pub dropped: usize,
    /// Predicted tokens: `full × (L − 1) + max(partial_len − 1, 0)`.
    pub predicted: usize,
}

impl Windows {
    /// Splits `n_tokens` into windows of `seq_len` (`seq_len >= 2`).
    pub fn new(n_tokens: usize, seq_len: usize) -> Result<Self, EvalError> {
        if seq_len < 2 {
            return Err(EvalError::SeqLenTooSmall { seq_len });
        }
        let full = n_tokens / seq_len;
        let rest = n_tokens % seq_len;
        let (partial_len, dropped) = if rest >= 2 { (rest, 0) } else { (0, rest) };
        let predicted = full * (seq_len - 1) + partial_len.saturating_sub(1);
        Ok(Windows {
            full,
            partial_len,
            dropped,
            predicted,
        })
    }

    /// Windows that count (full plus the partial one, if any).
    pub fn count(&self) -> usize {
        self.full + usize::from(self.partial_len > 0)
    }
}

/// The result of [`evaluate`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EvalResult {
    /// Mean negative log-likelihood (nats) over all predicted tokens.
    pub loss: f64,
    /// `exp(loss)`.
    pub perplexity: f64,
    /// Predicted tokens (the count the mean is over).
    pub tokens: usize,
    /// Windows evaluated (full plus a partial one, if any).
    pub windows: usize,
}

/// The mean next-token cross-entropy of `model` over `tokens` (see the
/// module docs for windows and weighting). `fetch` gives each parameter's
/// weights (any float dtype, any device; converted to `opts.dtype` on
/// `opts.device`); it is called for each unit's params when a pass reaches
/// that unit (once per unit that uses the param, per pass), and the
/// weights are dropped after the unit, so it should load lazily.
pub fn evaluate<E>(
    model: &Model,
    mut fetch: impl FnMut(ParamId) -> Result<Tensor, E>,
    tokens: &(impl TokenSource + ?Sized),
    opts: &EvalOptions,
) -> Result<EvalResult, EvalError>
where
    E: std::error::Error + Send + Sync + 'static,
{
    let cfg = model.config();
    let seq_len = opts.seq_len;
    let windows = Windows::new(tokens.token_count(), seq_len)?;
    if seq_len > cfg.max_seq_len {
        return Err(EvalError::SeqLenTooLarge {
            seq_len,
            max_seq_len: cfg.max_seq_len,
        });
    }
    // A text shorter than one window is one partial window (HF's recipe
    // scores it too); only fewer than 2 tokens predict nothing.
    if windows.count() == 0 {
        return Err(EvalError::TooFewTokens {
            tokens: tokens.token_count(),
            seq_len,
        });
    }
    if opts.batch_windows == 0 {
        return Err(EvalError::ZeroBatch);
    }
    // The largest batch's logits, before they abort the allocation: the
    // head computes every position of its windows (the full ones', or the
    // partial window's alone), in fp32, and under bf16/fp16 its 16-bit
    // output beside them. (A text shorter than one window was not
    // counted: its allocation aborted the process.)
    let (widest, positions) = match windows.full {
        0 => (1, windows.partial_len),
        full => (opts.batch_windows.min(full), seq_len),
    };
    let rows = (widest * positions) as u64;
    let logits_bytes = crate::engine::sizing::logits_bytes(rows, cfg.vocab_size as u64)
        .saturating_add(match opts.dtype {
            DType::F32 => 0,
            _ => rows.saturating_mul(cfg.vocab_size as u64).saturating_mul(2),
        });
    let on_host = matches!(opts.device, candle_core::Device::Cpu);
    if let Some(available_bytes) = crate::engine::sizing::mem_available_bytes().filter(|_| on_host)
    {
        if logits_bytes > available_bytes {
            return Err(EvalError::LogitsTooLarge {
                windows: widest,
                positions,
                vocab_size: cfg.vocab_size,
                logits_bytes,
                available_bytes,
            });
        }
    }
    let bound = u32::try_from(cfg.vocab_size).unwrap_or(u32::MAX);
    if let Some((position, token)) = tokens.first_at_or_above(bound) {
        return Err(EvalError::TokenOutOfVocab {
            token,
            position,
            vocab_size: cfg.vocab_size,
        });
    }

    // Batches of windows, each a run of equal-length windows: the full ones
    // `batch_windows` at a time, then the partial one alone.
    let mut batches: Vec<(usize, usize, usize)> = Vec::new(); // (first token, windows, length)
    let mut w = 0;
    while w < windows.full {
        let n = opts.batch_windows.min(windows.full - w);
        batches.push((w * seq_len, n, seq_len));
        w += n;
    }
    if windows.partial_len > 0 {
        batches.push((windows.full * seq_len, 1, windows.partial_len));
    }

    let hidden_bytes =
        |&(_, n, len): &(usize, usize, usize)| (n * (len - 1) * cfg.hidden_size * 4) as u64;
    let mut nll_sum = 0f64;
    let mut rest = &batches[..];
    while !rest.is_empty() {
        // A pass: at least one batch, then as many as fit `pass_bytes`.
        let mut take = 1;
        let mut bytes = hidden_bytes(&rest[0]);
        while take < rest.len() && bytes + hidden_bytes(&rest[take]) <= opts.pass_bytes {
            bytes += hidden_bytes(&rest[take]);
            take += 1;
        }
        let (pass, later) = rest.split_at(take);
        rest = later;
        eval_pass(model, &mut fetch, tokens, pass, opts, &mut nll_sum)?;
    }
    let loss = nll_sum / windows.predicted as f64;
    if !loss.is_finite() {
        return Err(EvalError::NotFinite { loss });
    }
    Ok(EvalResult {
        loss,
        perplexity: loss.exp(),
        tokens: windows.predicted,
        windows: windows.count(),
    })
}

/// One pass (see the module docs): each unit's params fetched once, every
/// batch of `pass` run through it, then dropped. Adds each predicted
/// position's NLL to `nll_sum`, in window order: one chain of additions
/// over the whole evaluation, so neither the batches nor the passes group
/// the sum.
fn eval_pass<E>(
    model: &Model,
    fetch: &mut impl FnMut(ParamId) -> Result<Tensor, E>,
    tokens: &(impl TokenSource + ?Sized),
    pass: &[(usize, usize, usize)],
    opts: &EvalOptions,
    nll_sum: &mut f64,
) -> Result<(), EvalError>
where
    E: std::error::Error + Send + Sync + 'static,
{
    let vocab = model.config().vocab_size;
    let device = &opts.device;
    let mut inputs = Vec::with_capacity(pass.len());
    let mut targets = Vec::with_capacity(pass.len());
    for &(start, n, len) in pass {
        let t = len - 1;
        let mut ids = Vec::with_capacity(n * t);
        let mut tg = Vec::with_capacity(n * t);
        let mut win = Vec::with_capacity(len);
        for k in 0..n {
            win.clear();
            tokens.extend_window(start + k * len, len, &mut win);
            ids.extend_from_slice(&win[..t]);
            tg.extend_from_slice(&win[1..]);
        }
        inputs.push(Tensor::from_vec(ids, (n, t), device)?);
        targets.push(tg);
    }
    let mut hidden: Vec<Tensor> = Vec::new();
    for unit in model.units() {
        let mut p = Vec::with_capacity(unit.params.len());
        for &id in &unit.params {
            let t = fetch(id).map_err(|e| EvalError::Fetch {
                name: model
                    .param(id)
                    .map_or_else(|| format!("{id:?}"), |s| s.name.clone()),
                source: Box::new(e),
            })?;
            p.push(t.to_dtype(opts.dtype)?.to_device(device)?);
        }
        match unit.kind {
            UnitKind::Embedding => {
                hidden = inputs
                    .iter()
                    .map(|ids| {
                        Ok(model
                            .forward_unit(unit.id, &p, UnitInput::Tokens(ids))?
                            .into_tensor())
                    })
                    .collect::<Result<_, EvalError>>()?;
            }
            UnitKind::Block { .. } if hidden.len() == pass.len() => {
                for h in &mut hidden {
                    *h = model
                        .forward_unit(unit.id, &p, UnitInput::Hidden(h))?
                        .into_tensor();
                }
            }
            UnitKind::Head if hidden.len() == pass.len() => {
                for (h, tg) in hidden.drain(..).zip(&targets) {
                    // In the storage dtype under 16-bit (the LM head's
                    // output), upcast exactly, as transformers' loss does.
                    let logits = model.logits(&p, &h)?.to_dtype(DType::F32)?;
                    add_nll_f64(&logits, tg, vocab, nll_sum)?;
                }
                return Ok(());
            }
            _ => break,
        }
    }
    Err(EvalError::Model(ModelError::Unsupported {
        what: "a model without an embedding and a head unit".into(),
    }))
}

/// Adds `-log softmax(logits)[target]` of each row to `sum`, computed in f64
/// from the fp32 logits `(windows, positions, vocab)`, rows in order. The
/// logits are copied out one window at a time, so the copy adds one
/// window's logits to the batch's, not a second batch of them.
fn add_nll_f64(
    logits: &Tensor,
    targets: &[u32],
    vocab: usize,
    sum: &mut f64,
) -> Result<(), EvalError> {
    let (windows, positions, _) = logits.dims3()?;
    for w in 0..windows {
        let flat = logits.get(w)?.flatten_all()?.to_vec1::<f32>()?;
        let tg = &targets[w * positions..(w + 1) * positions];
        add_rows_nll_f64(&flat, tg, vocab, sum);
    }
    Ok(())
}

fn add_rows_nll_f64(flat: &[f32], targets: &[u32], vocab: usize, sum: &mut f64) {
    for (row, &target) in flat.chunks_exact(vocab).zip(targets) {
        let max = row
            .iter()
            .fold(f64::NEG_INFINITY, |m, &x| m.max(f64::from(x)));
        let lse = row
            .iter()
            .map(|&x| (f64::from(x) - max).exp())
            .sum::<f64>()
            .ln()
            + max;
        *sum += lse - f64::from(row[target as usize]);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    #[test]
    fn window_counts_at_awkward_lengths() {
        // (tokens, L) -> (full, partial_len, dropped, predicted)
        let cases = [
            (8, 4, (2, 0, 0, 6)),
            (9, 4, (2, 0, 1, 6)),  // one trailing token: dropped
            (10, 4, (2, 2, 0, 7)), // two trailing tokens: one prediction
            (11, 4, (2, 3, 0, 8)),
            (3, 4, (0, 3, 0, 2)),
            (1, 2, (0, 0, 1, 0)),
            (2, 2, (1, 0, 0, 1)),
            (5, 2, (2, 0, 1, 2)),
            (0, 3, (0, 0, 0, 0)),
            (1000, 7, (142, 6, 0, 142 * 6 + 5)),
        ];
        for (n, l, (full, partial_len, dropped, predicted)) in cases {
            let w = Windows::new(n, l).unwrap();
            assert_eq!(
                w,
                Windows {
                    full,
                    partial_len,
                    dropped,
                    predicted
                },
                "{n} tokens, L={l}"
            );
            // Every token is either in a window or dropped.
            assert_eq!(w.full * l + w.partial_len + w.dropped, n);
            // Each counted window predicts all but its first token.
            assert_eq!(w.predicted, n - w.count() - w.dropped);
        }
        assert!(matches!(
            Windows::new(10, 1),
            Err(EvalError::SeqLenTooSmall { seq_len: 1 })
        ));
        assert!(matches!(
            Windows::new(10, 0),
            Err(EvalError::SeqLenTooSmall { seq_len: 0 })
        ));
    }
}
