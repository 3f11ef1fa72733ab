//! Global gradient norm in f64, inf/NaN detection, and the step decision
//! (skip, or the combined unscale-and-clip multiplier).
//!
//! Design:
//! * Σg² is accumulated in f64. The square of any finite f32 is exact in f64
//!   (48 significant bits) and at most ~1.2e77, so the sum over any realistic
//!   number of elements stays finite; it is inf or NaN exactly when some
//!   gradient is. One pass therefore gives both the clip norm and the fp16
//!   overflow check (DeepSpeed does these as separate reductions).
//! * Deterministic: the slice is cut into [`NORM_PARTS`] parts whose bounds
//!   depend only on its length; each part is summed with 8 fixed lanes and
//!   the part sums are added in order. Threads only decide who computes which
//!   part, so the result is the same bits at any thread count. The partials
//!   live in a stack array: no allocation.
//! * The code is safe scalar Rust written lane-parallel so LLVM vectorises it
//!   without reassociation; the pass reads 4 B/element and is bandwidth
//!   bound, so hand-written SIMD would not pay.

use super::{GradScale, OptimError, SPLIT_ALIGN_NUMEL};

/// Number of fixed parts of a norm reduction.
pub const NORM_PARTS: usize = 256;

const LANES: usize = 8;

/// Σ x² of one part (the loop built with FMA where the CPU has it, see
/// `crate::wide`: the same bits either way).
fn part_sq_sum(x: &[f32]) -> f64 {
    crate::wide::run(
        #[inline(always)]
        || part_sq_sum_lanes(x),
    )
}

#[inline(always)]
fn part_sq_sum_lanes(x: &[f32]) -> f64 {
    let mut acc = [0.0f64; LANES];
    // Fixed-size windows: indexing `chunks_exact`'s slices kept their
    // bounds checks, and the loop compiled to scalar FMAs.
    let (chunks, rest) = x.as_chunks::<LANES>();
    for c in chunks {
        for j in 0..LANES {
            let g = c[j] as f64;
            acc[j] = g.mul_add(g, acc[j]);
        }
    }
    for (j, &r) in rest.iter().enumerate() {
        let g = r as f64;
        acc[j] = g.mul_add(g, acc[j]);
    }
    ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))
}

/// Σ x² in f64, bitwise independent of `threads`.
pub(crate) fn sq_norm_f64(x: &[f32], threads: usize) -> f64 {
    let n = x.len();
    if n == 0 {
        return 0.0;
    }
    let part_len = n.div_ceil(NORM_PARTS).div_ceil(SPLIT_ALIGN_NUMEL).max(1) * SPLIT_ALIGN_NUMEL;
    let parts = n.div_ceil(part_len);
    let mut partial = [0.0f64; NORM_PARTS];
    let threads = threads.clamp(1, parts);
    let parts_per_thread = parts.div_ceil(threads);
    if threads == 1 {
        for (k, p) in partial.iter_mut().enumerate().take(parts) {
            let start = k * part_len;
            *p = part_sq_sum(&x[start..(start + part_len).min(n)]);
        }
    } else {
        std::thread::scope(|s| {
            for (t, slots) in partial[..parts].chunks_mut(parts_per_thread).enumerate() {
                s.spawn(move || {
                    for (j, p) in slots.iter_mut().enumerate() {
                        let start = (t * parts_per_thread + j) * part_len;
                        *p = part_sq_sum(&x[start..(start + part_len).min(n)]);
                    }
                });
            }
        });
    }
    partial[..parts].iter().sum()
}

/// What the caller does with this step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum GradStep {
    /// A gradient is inf or NaN (fp16 overflow): skip the step everywhere and
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
