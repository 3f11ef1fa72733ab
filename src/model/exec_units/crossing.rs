//! How a unit's tensors cross between the host and the executor
//! ([`Crossing`]): its inputs fed, its output kept for the next unit, a
//! block's forward kept for its backward ([`KeptForward`]) and the rotary
//! tables kept between calls. [`Direct`] is the plain one (uploads on the
//! executor, nothing kept); the device tier's is
//! `crate::engine::device::inputs`'s.

use candle_core::{DType, Device, Tensor};
use tierzero_gpu::unit::{self, Exec, RopeTables};

use super::upload;
use crate::model::{ops, ModelConfig, ModelError, UnitId};

/// A block's forward kept on the executor from its forward to its
/// backward: its input and the intermediates the backward reads, so the
/// backward does not compute the forward again. The same bits as the
/// recompute (`tierzero_gpu::unit::gpt2_block_backward_kept`).
#[derive(Debug)]
pub enum KeptForward<B> {
    /// A GPT-2 block's.
    Gpt2(unit::Gpt2Kept<B>),
    /// A Llama-family block's.
    Llama(unit::LlamaKept<B>),
}

/// How a unit's tensors cross between the host and the executor.
pub(crate) trait Crossing<B> {
    /// A unit's host input on the executor: its hidden input, its upstream
    /// gradient, its rotary tables. [`super::ReferenceUnits`] and [`super::CudaUnits`]
    /// upload them on the executor (`upload`); the device tier sends them
    /// through its link, asynchronously and counted, or hands back the
    /// executor's own copy ([`Crossing::keep`]).
    fn feed(&self, what: &str, t: &Tensor) -> Result<B, ModelError>;
    /// A unit's output (hidden state, or its input gradient) was just
    /// downloaded as `host` from `dev`: a crossing may keep `dev` to feed
    /// back when `host` comes in as the next unit's input. Dropped by
    /// default.
    fn keep(&self, _host: &Tensor, _dev: B) {}
    /// Whether a block's forward may be kept for its backward
    /// ([`Crossing::keep_forward`]): the crossing holds a budget for them.
    fn keeps_forwards(&self) -> bool {
        false
    }
    /// Keeps `fwd`, `bytes` on the executor, the forward of `unit` on the
    /// host input `input`, if it fits the budget; drops it otherwise.
    fn keep_forward(&self, _unit: UnitId, _input: &Tensor, _fwd: KeptForward<B>, _bytes: u64) {}
    /// The forward kept for `unit` on this same host input (None: its
    /// backward recomputes it).
    fn take_forward(&self, _unit: UnitId, _input: &Tensor) -> Option<KeptForward<B>> {
        None
    }
    /// The rotary tables of `seq` positions the crossing kept on the
    /// executor from an earlier call (None: they are fed).
    fn take_rope(&self, _seq: usize) -> Option<RopeTables<B>> {
        None
    }
    /// Hands back the rotary tables of `seq` positions after a call: a
    /// crossing may keep them for the next (they depend on the model and
    /// `seq` alone). Dropped by default.
    fn put_rope(&self, _seq: usize, _tables: RopeTables<B>) {}
}

/// [`Crossing`] by plain uploads on the executor.
pub(super) struct Direct<'e, E>(pub(super) &'e E);

impl<E: Exec> Crossing<E::Buf> for Direct<'_, E> {
    fn feed(&self, what: &str, t: &Tensor) -> Result<E::Buf, ModelError> {
        upload(self.0, what, t)
    }
}

/// A unit's [`Crossing`].
pub(crate) type Feed<'a, B> = &'a dyn Crossing<B>;

/// The rotary tables of `seq` positions as the kernel takes them (one
/// half of the CPU units' `[seq, head_dim]` tables).
pub(super) fn rope_tables<B>(
    feed: Feed<'_, B>,
    c: &ModelConfig,
    seq: usize,
) -> Result<RopeTables<B>, ModelError> {
    let (cos, sin) = ops::rope_tables_for(c, seq, DType::F32, &Device::Cpu)?;
    let half = |t: &Tensor| -> Result<B, ModelError> {
        feed.feed(
            "rotary table",
            &t.narrow(1, 0, c.head_dim / 2)?.contiguous()?,
        )
    };
    Ok(RopeTables {
        cos: half(&cos)?,
        sin: half(&sin)?,
    })
}

/// Runs `f` with the rotary tables of `seq` positions on the executor:
/// the crossing's kept ones ([`Crossing::take_rope`]), or fed now, then
/// handed back to it.
pub(super) fn with_rope<B, R>(
    feed: Feed<'_, B>,
    c: &ModelConfig,
    seq: usize,
    f: impl FnOnce(&RopeTables<B>) -> Result<R, ModelError>,
) -> Result<R, ModelError> {
    let rope = match feed.take_rope(seq) {
        Some(r) => r,
        None => rope_tables(feed, c, seq)?,
    };
    let out = f(&rope);
    feed.put_rope(seq, rope);
    out
}
