//! Global gradient norm in f64, inf/NaN detection, and the step decision
//! (skip, or the combined unscale-and-clip multiplier).
//!
//! Design:
//! * Σg² is accumulated in f64. The square of any finite f32 is exact in f64
//!   (48 significant bits) and at most ~1.2e77, so the sum over any realistic
//!   number of elements stays finite; it is inf or NaN exactly when some
//!   gradient is. One pass therefore gives both the clip norm and the fp16
//!   overflow check (DeepSpeed does these as separate reductions).
//! * Deterministic, in one order that a GPU computes as fast
//!   (`tierzero_gpu::norm`, whose kernel and scalar reference give these
//!   bits): the slice is cut into parts of [`NORM_PART_NUMEL`] elements;
//!   in a part, lane `j` of 8 adds the squares of elements `j, j + 8, …`
//!   in order; the lanes are added pairwise, `((0 + 1) + (2 + 3)) + ((4 +
//!   5) + (6 + 7))`; the parts' sums are added in order from 0. Threads
//!   only decide who computes which part, so the result is the same bits
//!   at any thread count, and the device optimizer's norm (training in
//!   GPU memory) is the same bits as this one (a finite one: a NaN's
//!   payload may differ, and the step is skipped either way). (The parts were 1/256 of
//!   the slice each, which gave a GPU 2048 threads for a whole model's
//!   sub-group; fixed parts give it one per 1024 elements, at the same
//!   speed here.)
//! * The code is safe scalar Rust written lane-parallel so LLVM vectorises it
//!   without reassociation; the pass reads 4 B/element (2 over bf16
//!   gradients, [`super::GradIn::Bf16`]) and is bandwidth bound, so
//!   hand-written SIMD would not pay.

use tierzero_gpu::norm::{combine_lanes, fold_parts, NORM_LANES};

use super::{GradScale, OptimError};

/// Elements of one part of a norm reduction (a multiple of the lanes and
/// of [`super::SPLIT_ALIGN_NUMEL`]). 8192: 1024 loads per GPU thread, and
/// a partial of 8 bytes per 32 KiB read here.
pub const NORM_PART_NUMEL: usize = 8192;
const _: () = assert!(
    NORM_PART_NUMEL.is_multiple_of(NORM_LANES)
        && NORM_PART_NUMEL.is_multiple_of(super::SPLIT_ALIGN_NUMEL)
);

/// An element a norm squares: an f32, or a bf16 widened to one (its
/// square is the same bits as its fp32 sum's, `-0.0` and `+0.0` alike).
pub(crate) trait NormElem: Copy + Send + Sync {
    fn to_f64(self) -> f64;
}

impl NormElem for f32 {
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self as f64
    }
}

impl NormElem for half::bf16 {
    #[inline(always)]
    fn to_f64(self) -> f64 {
        super::scalar::bf16_bits_to_f32(self.to_bits()) as f64
    }
}

/// Σ x² of one part (the loop built with FMA where the CPU has it, see
/// `crate::wide`: the same bits either way).
fn part_sq_sum<T: NormElem>(x: &[T]) -> f64 {
    crate::wide::run(
        #[inline(always)]
        || part_sq_sum_lanes(x),
    )
}

#[inline(always)]
fn part_sq_sum_lanes<T: NormElem>(x: &[T]) -> f64 {
    let mut acc = [0.0f64; NORM_LANES];
    // Fixed-size windows: indexing `chunks_exact`'s slices kept their
    // bounds checks, and the loop compiled to scalar FMAs.
    let (chunks, rest) = x.as_chunks::<NORM_LANES>();
    for c in chunks {
        for j in 0..NORM_LANES {
            let g = c[j].to_f64();
            acc[j] = g.mul_add(g, acc[j]);
        }
    }
    for (j, &r) in rest.iter().enumerate() {
        let g = r.to_f64();
        acc[j] = g.mul_add(g, acc[j]);
    }
    combine_lanes(acc)
}

/// Σ x² in f64, bitwise independent of `threads`.
pub(crate) fn sq_norm_f64<T: NormElem>(x: &[T], threads: usize) -> f64 {
    let n = x.len();
    let parts = n.div_ceil(NORM_PART_NUMEL);
    let threads = threads.clamp(1, parts.max(1));
    if threads == 1 {
        return x
            .chunks(NORM_PART_NUMEL)
            .fold(0.0, |s, part| s + part_sq_sum(part));
    }
    let mut partial = vec![0.0f64; parts];
    let parts_per_thread = parts.div_ceil(threads);
    std::thread::scope(|s| {
        for (slots, xs) in partial
            .chunks_mut(parts_per_thread)
            .zip(x.chunks(parts_per_thread * NORM_PART_NUMEL))
        {
            s.spawn(move || {
                for (p, part) in slots.iter_mut().zip(xs.chunks(NORM_PART_NUMEL)) {
                    *p = part_sq_sum(part);
                }
            });
        }
    });
    fold_parts(&partial)
}

/// What the caller does with this step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum GradStep {
    /// A gradient is inf or NaN (an overflow): skip the step everywhere and
    /// lower the loss scale.
    Skip,
    /// Apply the step with this gradient multiplier (unscale · clip).
    Apply(GradScale),
}

/// Global Σg² of the loss-scaled gradients (sum of
/// [`super::CpuAdam::grad_sq_norm`] over all tiles and ranks).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GradNorm {
    pub sq_sum: f64,
}

impl GradNorm {
    pub fn from_sq_sum(sq_sum: f64) -> Self {
        Self { sq_sum }
    }

    /// Adds another tile's (or rank's) Σg².
    pub fn accumulate(&mut self, sq_sum: f64) {
        self.sq_sum += sq_sum;
    }

    /// False iff some gradient was inf or NaN.
    pub fn is_finite(&self) -> bool {
        self.sq_sum.is_finite()
    }

    /// L2 norm of the unscaled gradient.
    pub fn norm(&self, loss_scale: f64) -> f64 {
        self.sq_sum.sqrt() / loss_scale
    }

    /// Skip on overflow; otherwise the multiplier `clip / loss_scale`, with
    /// torch's `clip_grad_norm_` coefficient `max_norm / (norm + 1e-6)`
    /// applied only when it is below 1.
    pub fn scale_for_step(
        &self,
        loss_scale: f64,
        max_norm: Option<f64>,
    ) -> Result<GradStep, OptimError> {
        if !(loss_scale.is_finite() && loss_scale > 0.0) {
            return Err(OptimError::InvalidHyper {
                name: "loss_scale",
                value: loss_scale,
                reason: "must be finite and > 0",
            });
        }
        if let Some(mn) = max_norm {
            if !(mn.is_finite() && mn > 0.0) {
                return Err(OptimError::InvalidHyper {
                    name: "max_norm",
                    value: mn,
                    reason: "must be finite and > 0",
                });
            }
        }
        if !self.is_finite() {
            return Ok(GradStep::Skip);
        }
        let clip = match max_norm {
            Some(mn) => (mn / (self.norm(loss_scale) + 1e-6)).min(1.0),
            None => 1.0,
        };
        Ok(GradStep::Apply(GradScale((clip / loss_scale) as f32)))
    }
}
