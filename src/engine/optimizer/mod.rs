//! The optimizer pipeline: fp32 master weights and Adam moments per
//! sub-group on their tier, stepped on a thread of their own.
//!
//! - [`state`]: [`state::OptimizerState`], the state of every sub-group in
//!   host memory or on NVMe and the pipelined read / step / write.
//! - [`worker`]: [`worker::OptimizerWorker`], the optimizer thread that owns
//!   the state and runs Adam while backward goes on.

pub mod state;
pub mod worker;

use half::bf16;

use crate::engine::sizing::SumDtype;
use crate::optim::GradIn;

/// A sub-group's final gradient as the optimizer steps from it: fp32
/// sums, or the bf16 gradients themselves where each element got exactly
/// one ([`crate::engine::sizing::grad_sum_dtype`]), which the kernels and
/// the norm read as the fp32 sums they stand for ([`GradIn::Bf16`]).
#[derive(Debug)]
pub enum GradBuf {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
}

impl GradBuf {
    /// `numel` zeros (`+0.0`) of `dtype`: the gradient of a group that got
    /// none (rare), made on the calling thread, which may be outside every
    /// pool.
    pub fn zeros(numel: usize, dtype: SumDtype) -> GradBuf {
        match dtype {
            SumDtype::F32 => GradBuf::F32(vec![0f32; numel]),
            SumDtype::Bf16 => GradBuf::Bf16(vec![bf16::ZERO; numel]),
        }
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.as_in().len()
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// How it is held.
    pub fn dtype(&self) -> SumDtype {
        match self {
            GradBuf::F32(_) => SumDtype::F32,
            GradBuf::Bf16(_) => SumDtype::Bf16,
        }
    }

    /// What the kernels read.
    pub fn as_in(&self) -> GradIn<'_> {
        match self {
            GradBuf::F32(g) => GradIn::F32(g),
            GradBuf::Bf16(g) => GradIn::Bf16(g),
        }
    }

    /// Elements its buffer holds (its capacity).
    pub fn capacity(&self) -> usize {
        match self {
            GradBuf::F32(g) => g.capacity(),
            GradBuf::Bf16(g) => g.capacity(),
        }
    }

    /// Bytes its buffer holds (its capacity's).
    pub fn capacity_bytes(&self) -> usize {
        self.capacity() * self.dtype().bytes_per_elem() as usize
    }

    /// As fp32 sums: bf16 gradients widened as `+0.0 + g`
    /// ([`crate::optim::bf16_as_sum`], in parallel on the current pool),
    /// the bits their sums hold.
    pub fn into_f32(self) -> Vec<f32> {
        match self {
            GradBuf::F32(g) => g,
            GradBuf::Bf16(g) => crate::model::fused::bf16_sums_to_f32(&g),
        }
    }
}
