//! CPU Adam / AdamW over one optimizer sub-group tile, at the memory-bandwidth
//! limit, fused with the low-precision parameter write-back.
//!
//! # What this module does
//!
//! In ZeRO-Offload / ZeRO-Infinity the optimizer step runs on the CPU over
//! fp32 master weights and moments that the optimizer swapper streams in from
//! NVMe one sub-group tile at a time. [`CpuAdam::step`] updates one such tile
//! (`master`, `grad`, `m`, `v` slices of equal length) in place and, in the
//! same pass, optionally writes the bf16 / fp16 copy of the updated parameter
//! that is sent back to the GPU.
//!
//! # Semantics
//!
//! [`AdamMode::AdamW`] matches `torch.optim.AdamW` (decoupled decay
//! `p -= lr·wd·p`, applied with the old parameter before the Adam update);
//! [`AdamMode::L2`] matches `torch.optim.Adam(weight_decay=..)` and
//! DeepSpeed's `adam_w_mode=False` (`g += wd·p` before the moments). With
//! bias correction (step `t` is 1-based):
//!
//! ```text
//! g  = grad · grad_scale                (loss-scale unscale · clip coefficient)
//! m  = β1·m + (1-β1)·g
//! v  = β2·v + (1-β2)·g²
//! p -= lr/(1-β1^t) · m / (sqrt(v)/sqrt(1-β2^t) + eps)
//! ```
//!
//! `eps` is added after the bias-corrected square root, as torch and
//! DeepSpeed do. The per-step scalars (`lr/(1-β1^t)`, `1/sqrt(1-β2^t)`, ...)
//! are computed once per call in f64 and rounded to f32.
//!
//! # Design decisions
//!
//! * **One pass, fewest bytes.** fp32 AdamW is bandwidth bound (28 B/param:
//!   read p, g, m, v; write p, m, v), so the kernel is a single streaming pass.
//!   The bf16/fp16 parameter copy is produced from the updated value that is
//!   still in a register (+2 B/param) instead of DeepSpeed's separate
//!   conversion pass (+6 B/param plus a second trip over the masters). bf16
//!   moments ([`Moments::Bf16`]) cut the traffic to 20 B/param.
//! * **Bit-identical across ISAs, tails and thread counts.** The scalar path
//!   evaluates exactly the same sequence of IEEE operations as the SIMD lanes
//!   (`mul_add` is a true fused multiply-add, `sqrt` and `/` are correctly
//!   rounded, the bf16 and fp16 conversions are round-to-nearest-even with the
//!   same NaN and subnormal rules). Every element's result therefore depends only on its own
//!   inputs, so the way a tile is split across threads or between vector body
//!   and scalar tail cannot change a single bit. Tests check this.
//! * **Run-time ISA choice.** AVX-512F with AVX512-BF16 (bf16 moments stored
//!   with `vcvtne2ps2bf16`), AVX-512F, or AVX2+FMA+F16C, is detected once
//!   ([`Isa::detect`]) and checked again (cached) at dispatch; otherwise a
//!   portable scalar kernel runs. NEON is not written: on aarch64 the scalar
//!   kernel compiles to `fmadd` and is correct, just not vectorised.
//! * **Loss scaling and clipping.** Both fold into one multiplier
//!   ([`GradScale`]) applied to the gradient as it is loaded, so neither costs
//!   a pass. The inf/NaN check cannot live inside the step pass: by the time
//!   an inf is seen, earlier elements of the state have been overwritten, and
//!   the whole step must be skipped. It is fused instead into the pass that
//!   is needed anyway for clipping: [`CpuAdam::grad_sq_norm`] accumulates
//!   Σg² in f64, where a square of any finite f32 is exact and cannot
//!   overflow, so the sum is finite if and only if every gradient is.
//!   [`GradNorm::scale_for_step`] turns it into [`GradStep::Skip`] or a
//!   [`GradScale`].
//! * **Threads.** A tile is handed out in fixed chunks of
//!   [`WORK_CHUNK_NUMEL`] elements that threads claim from a shared queue
//!   (see `par.rs`): a descheduled thread cannot stall the step, and the
//!   result is bit-identical at any thread count. The hot loop allocates
//!   nothing. Scoped threads are spawned per call (tens of microseconds,
//!   negligible next to a tile of millions of parameters); a persistent
//!   pool can replace them without changing the kernels.
//! * **bf16 moments accuracy.** m and v are computed in f32 and rounded to
//!   nearest-even bf16 (8 significant bits) on store, like DeepSpeed's
//!   (bf16, bf16) path. The parameter update of the current step uses the
//!   unrounded f32 moments. Caveat: with β2 = 0.999 one step moves v by
//!   0.1 % of (g² − v), and half a bf16 ulp is 0.2-0.4 % of v, so the stored
//!   v never decays (a decrease is at most 0.1 % of v) and grows only when g²
//!   exceeds about 3-5x v. v then tracks the largest recent g², which makes
//!   the effective step size conservative late in training. m (β1 = 0.9)
//!   is not affected. The training tests in `tests.rs` measure the gap: close
//!   over 300 steps, a visibly higher loss after 3000. Remedies, not built:
//!   stochastic rounding of v, or fp32 v with bf16 m (24 B/param).
//! * **bf16 moment storage: subnormals stored as zero.** A stored moment is
//!   `f32_to_bf16_moment_bits(x)`: round-to-nearest-even, NaN kept with the
//!   quiet bit set, and an f32 subnormal (|x| < 2^-126 ≈ 1.18e-38) stored as
//!   a zero of the same sign. That is the exact semantics of AVX512-BF16's
//!   `vcvtne2ps2bf16` (input denormals are zero; no normal f32 rounds to a
//!   bf16 subnormal), which converts two vectors in one instruction, where
//!   the integer rounding sequence costs ~8 ops per vector and made the
//!   20 B/param kernel compute-bound. The scalar, AVX2 and AVX-512F paths
//!   apply the same flush, so results stay bit-identical across ISAs. The
//!   accuracy cost is nil in practice: with eps = 1e-8, m ≈ 1e-38 moves no
//!   parameter (m/(sqrt(v)+eps) ≤ 1.2e-30), and v ≈ 1e-38 is far below
//!   eps² = 1e-16, so zero and a subnormal give the same update. The bf16
//!   *parameter* copy ([`LowPrecisionOut`]) is not affected: it keeps
//!   subnormals (`f32_to_bf16_bits`), as a weight must round-trip exactly.

mod kernels;
mod norm;
mod par;
mod scalar;
pub mod schedule;

#[cfg(test)]
mod tests;

pub use kernels::{convert_f32_to_bf16, rmw_probe, Isa, ProbeOrder};
pub use norm::{GradNorm, GradStep, NORM_PART_NUMEL};
pub use par::WORK_CHUNK_NUMEL;
pub use scalar::{f32_to_bf16_bits, f32_to_bf16_moment_bits, f32_to_f16_bits};

use half::{bf16, f16};
use std::num::NonZeroUsize;

/// Split points (thread chunks, norm parts) are multiples of this many
/// elements (a multiple of every SIMD width and of a 64-byte line of f32).
pub const SPLIT_ALIGN_NUMEL: usize = 64;

/// Errors of the CPU optimizer.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum OptimError {
    /// A hyper-parameter is out of its valid range.
    #[error("invalid Adam hyper-parameter {name} = {value}: {reason}")]
    InvalidHyper {
        name: &'static str,
        value: f64,
        reason: &'static str,
    },
    /// Slices of one tile disagree in length.
    #[error("tile slice `{name}` has {numel} elements, master has {master_numel}")]
    LengthMismatch {
        name: &'static str,
        numel: usize,
        master_numel: usize,
    },
    /// The step counter is 1-based.
    #[error("Adam step must be >= 1 (1-based, as in torch), got 0")]
    StepZero,
    /// The gradient scale multiplier is not a finite number.
    #[error("gradient scale {value} is not finite")]
    BadGradScale { value: f32 },
    /// The requested instruction set is not available on this CPU.
    #[error("instruction set {isa:?} is not supported by this CPU")]
    IsaUnsupported { isa: Isa },
    /// The dynamic fp16 loss scale cannot go lower: the gradients
    /// overflowed again at `fp16.min_loss_scale`, the hysteresis spent.
    /// DeepSpeed raises here ("Current loss scale already at minimum -
    /// cannot decrease scale anymore. Exiting run.": its
    /// `raise_error_at_min_scale` defaults to true); going on would skip
    /// every step.
    #[error(
        "fp16: the gradients overflowed at the minimum loss scale {min_scale} \
         (fp16.min_loss_scale) with the hysteresis spent: every later step would be skipped, \
         so the run stops, as DeepSpeed's does; resume from the last checkpoint with bf16, \
         a lower lr, or a lower fp16.min_loss_scale"
    )]
    LossScaleAtMinimum {
        /// `fp16.min_loss_scale`.
        min_scale: f64,
    },
}

/// Weight-decay flavour.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdamMode {
    /// Decoupled weight decay (`torch.optim.AdamW`, DeepSpeed `adam_w_mode=True`).
    AdamW,
    /// L2 penalty added to the gradient (`torch.optim.Adam`, `adam_w_mode=False`).
    L2,
}

/// Adam hyper-parameters, with torch's names and defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamHyper {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    pub mode: AdamMode,
    pub bias_correction: bool,
}

impl Default for AdamHyper {
    /// `torch.optim.AdamW` defaults.
    fn default() -> Self {
        Self {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 1e-2,
            mode: AdamMode::AdamW,
            bias_correction: true,
        }
    }
}

impl AdamHyper {
    /// Checks the ranges torch checks.
    pub fn validate(&self) -> Result<(), OptimError> {
        let bad = |name, value, reason| {
            Err(OptimError::InvalidHyper {
                name,
                value,
                reason,
            })
        };
        if !(self.lr.is_finite() && self.lr >= 0.0) {
            return bad("lr", self.lr, "must be finite and >= 0");
        }
        if !(0.0..1.0).contains(&self.beta1) {
            return bad("beta1", self.beta1, "must be in [0, 1)");
        }
        if !(0.0..1.0).contains(&self.beta2) {
            return bad("beta2", self.beta2, "must be in [0, 1)");
        }
        if !(self.eps.is_finite() && self.eps >= 0.0) {
            return bad("eps", self.eps, "must be finite and >= 0");
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return bad("weight_decay", self.weight_decay, "must be finite and >= 0");
        }
        Ok(())
    }
}

/// Multiplier applied to every gradient element as it is loaded:
/// `clip_coefficient / loss_scale`. See [`GradNorm::scale_for_step`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GradScale(pub f32);

impl GradScale {
    /// No unscaling and no clipping.
    pub const ONE: GradScale = GradScale(1.0);
}

/// Adam moments of one tile.
#[derive(Debug)]
pub enum Moments<'a> {
    /// fp32 first and second moments.
    F32 { m: &'a mut [f32], v: &'a mut [f32] },
    /// bf16 moments (computed in f32, stored round-to-nearest-even with f32
    /// subnormals stored as signed zero: [`f32_to_bf16_moment_bits`]).
    Bf16 {
        m: &'a mut [bf16],
        v: &'a mut [bf16],
    },
}

/// A tile's gradient as the kernel reads it.
///
/// A bf16 gradient is read as `+0.0 + g` widened to f32: the value an fp32
/// gradient sum of it holds (a sum starts at `+0.0`, so a `-0.0` gradient
/// sums to `+0.0`). A step and a norm from the bf16 gradient are therefore
/// the same bits as from its fp32 sum, with 2 B/param read instead of 4,
/// and without the sum's 4 B/param write; the engine steps a sub-group
/// whose every element gets exactly one gradient (one rank, one
/// micro-batch, no tied param) from its bf16 gradients.
#[derive(Debug, Clone, Copy)]
pub enum GradIn<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
}

/// A bf16 gradient element as the fp32 sum of it holds: `+0.0 + g`
/// widened (exact; a `-0.0` becomes `+0.0`). Every reader of a
/// [`GradIn::Bf16`] (the kernels' lanes, the scalar tail, the engine's
/// widening of a held gradient) computes exactly this.
#[inline(always)]
pub fn bf16_as_sum(g: bf16) -> f32 {
    0.0 + scalar::bf16_bits_to_f32(g.to_bits())
}

impl<'a> GradIn<'a> {
    /// Elements.
    pub fn len(&self) -> usize {
        match self {
            GradIn::F32(g) => g.len(),
            GradIn::Bf16(g) => g.len(),
        }
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Splits at `mid` (which must be `<= len`).
    fn split_at(self, mid: usize) -> (GradIn<'a>, GradIn<'a>) {
        match self {
            GradIn::F32(g) => {
                let (a, b) = g.split_at(mid);
                (GradIn::F32(a), GradIn::F32(b))
            }
            GradIn::Bf16(g) => {
                let (a, b) = g.split_at(mid);
                (GradIn::Bf16(a), GradIn::Bf16(b))
            }
        }
    }
}

impl<'a> From<&'a [f32]> for GradIn<'a> {
    fn from(g: &'a [f32]) -> Self {
        GradIn::F32(g)
    }
}

impl<'a> From<&'a Vec<f32>> for GradIn<'a> {
    fn from(g: &'a Vec<f32>) -> Self {
        GradIn::F32(g)
    }
}

impl<'a, const N: usize> From<&'a [f32; N]> for GradIn<'a> {
    fn from(g: &'a [f32; N]) -> Self {
        GradIn::F32(g)
    }
}

impl<'a> From<&'a [bf16]> for GradIn<'a> {
    fn from(g: &'a [bf16]) -> Self {
        GradIn::Bf16(g)
    }
}

impl<'a> From<&'a Vec<bf16>> for GradIn<'a> {
    fn from(g: &'a Vec<bf16>) -> Self {
        GradIn::Bf16(g)
    }
}

/// How Adam moments are stored: what [`Moments`] a state hands the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MomentDtype {
    /// fp32 `m` and `v` (torch's AdamW).
    #[default]
    F32,
    /// bf16 `m` and `v` ([`Moments::Bf16`]'s rounding): half the bytes.
    Bf16,
}

impl MomentDtype {
    /// Bytes of one moment element.
    pub fn bytes_per_elem(self) -> u64 {
        match self {
            MomentDtype::F32 => 4,
            MomentDtype::Bf16 => 2,
        }
    }

    /// The name torch gives the dtype.
    pub fn name(self) -> &'static str {
        match self {
            MomentDtype::F32 => "float32",
            MomentDtype::Bf16 => "bfloat16",
        }
    }
}

/// Destination of the low-precision copy of the updated parameters.
#[derive(Debug)]
pub enum LowPrecisionOut<'a> {
    Bf16(&'a mut [bf16]),
    F16(&'a mut [f16]),
}

/// Per-step f32 constants shared by all kernels (computed in f64 once).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct StepScalars {
    pub grad_scale: f32,
    pub beta1: f32,
    pub one_minus_beta1: f32,
    pub beta2: f32,
    pub one_minus_beta2: f32,
    pub eps: f32,
    /// `-lr / (1 - β1^t)`.
    pub neg_step_size: f32,
    /// `1 / sqrt(1 - β2^t)`.
    pub inv_sqrt_bc2: f32,
    /// `-lr · wd` (AdamW only; 0 in L2 mode).
    pub neg_lr_wd: f32,
    /// `wd` (L2 only; 0 in AdamW mode).
    pub l2_wd: f32,
    pub mode: AdamMode,
}

impl StepScalars {
    pub(crate) fn new(h: &AdamHyper, step: u64, scale: GradScale) -> Result<Self, OptimError> {
        h.validate()?;
        if step == 0 {
            return Err(OptimError::StepZero);
        }
        if !scale.0.is_finite() {
            return Err(OptimError::BadGradScale { value: scale.0 });
        }
        let t = step as f64;
        let (bc1, bc2) = if h.bias_correction {
            (1.0 - h.beta1.powf(t), 1.0 - h.beta2.powf(t))
        } else {
            (1.0, 1.0)
        };
        let (neg_lr_wd, l2_wd) = match h.mode {
            // `0 - x`, not `-x`: with no decay +0, and `p + 0·p` keeps a
            // -0.0 param as torch (which skips the decay) does; -0 made it +0.
            AdamMode::AdamW => (0.0 - h.lr * h.weight_decay, 0.0),
            AdamMode::L2 => (0.0, h.weight_decay),
        };
        Ok(Self {
            grad_scale: scale.0,
            beta1: h.beta1 as f32,
            one_minus_beta1: (1.0 - h.beta1) as f32,
            beta2: h.beta2 as f32,
            one_minus_beta2: (1.0 - h.beta2) as f32,
            eps: h.eps as f32,
            neg_step_size: (-h.lr / bc1) as f32,
            inv_sqrt_bc2: (1.0 / bc2.sqrt()) as f32,
            neg_lr_wd: neg_lr_wd as f32,
            l2_wd: l2_wd as f32,
            mode: h.mode,
        })
    }
}

/// The constants of step `step` for the CUDA AdamW kernel
/// (`tierzero_gpu::ops::adamw`), derived as the CPU kernel derives its own
/// (`StepScalars`), so both step with the same f32 values. `None` in L2
/// mode, which the CUDA kernel does not have.
pub fn gpu_step_scalars(
    hyper: &AdamHyper,
    step: u64,
    scale: GradScale,
) -> Result<Option<tierzero_gpu::reference::AdamScalars>, OptimError> {
    let s = StepScalars::new(hyper, step, scale)?;
    Ok(
        (s.mode == AdamMode::AdamW).then_some(tierzero_gpu::reference::AdamScalars {
            grad_scale: s.grad_scale,
            beta1: s.beta1,
            one_minus_beta1: s.one_minus_beta1,
            beta2: s.beta2,
            one_minus_beta2: s.one_minus_beta2,
            eps: s.eps,
            neg_step_size: s.neg_step_size,
            inv_sqrt_bc2: s.inv_sqrt_bc2,
            neg_lr_wd: s.neg_lr_wd,
        }),
    )
}

/// One tile (or a thread's chunk of it): all slices have equal length.
/// Its fields are private to `optim`, so a tile is built only by
/// [`Tile::new`] (which checks the lengths) and `split_at`: the SIMD
/// kernels size every pointer by `master`'s length.
#[derive(Debug)]
pub(crate) struct Tile<'a> {
    master: &'a mut [f32],
    grad: GradIn<'a>,
    moments: Moments<'a>,
    out: Option<LowPrecisionOut<'a>>,
}

impl<'a> Tile<'a> {
    fn new(
        master: &'a mut [f32],
        grad: GradIn<'a>,
        moments: Moments<'a>,
        out: Option<LowPrecisionOut<'a>>,
    ) -> Result<Self, OptimError> {
        let n = master.len();
        let check = |name, numel: usize| {
            if numel == n {
                Ok(())
            } else {
                Err(OptimError::LengthMismatch {
                    name,
                    numel,
                    master_numel: n,
                })
            }
        };
        check("grad", grad.len())?;
        match &moments {
            Moments::F32 { m, v } => {
                check("m", m.len())?;
                check("v", v.len())?;
            }
            Moments::Bf16 { m, v } => {
                check("m", m.len())?;
                check("v", v.len())?;
            }
        }
        match &out {
            None => {}
            Some(LowPrecisionOut::Bf16(o)) => check("low_precision_out", o.len())?,
            Some(LowPrecisionOut::F16(o)) => check("low_precision_out", o.len())?,
        }
        Ok(Self {
            master,
            grad,
            moments,
            out,
        })
    }

    pub(crate) fn len(&self) -> usize {
        self.master.len()
    }

    /// Splits every slice at `mid` (which must be `<= len`).
    fn split_at(self, mid: usize) -> (Tile<'a>, Tile<'a>) {
        let (p0, p1) = self.master.split_at_mut(mid);
        let (g0, g1) = self.grad.split_at(mid);
        let (mo0, mo1) = match self.moments {
            Moments::F32 { m, v } => {
                let (m0, m1) = m.split_at_mut(mid);
                let (v0, v1) = v.split_at_mut(mid);
                (Moments::F32 { m: m0, v: v0 }, Moments::F32 { m: m1, v: v1 })
            }
            Moments::Bf16 { m, v } => {
                let (m0, m1) = m.split_at_mut(mid);
                let (v0, v1) = v.split_at_mut(mid);
                (
                    Moments::Bf16 { m: m0, v: v0 },
                    Moments::Bf16 { m: m1, v: v1 },
                )
            }
        };
        let (o0, o1) = match self.out {
            None => (None, None),
            Some(LowPrecisionOut::Bf16(o)) => {
                let (a, b) = o.split_at_mut(mid);
                (
                    Some(LowPrecisionOut::Bf16(a)),
                    Some(LowPrecisionOut::Bf16(b)),
                )
            }
            Some(LowPrecisionOut::F16(o)) => {
                let (a, b) = o.split_at_mut(mid);
                (Some(LowPrecisionOut::F16(a)), Some(LowPrecisionOut::F16(b)))
            }
        };
        (
            Tile {
                master: p0,
                grad: g0,
                moments: mo0,
                out: o0,
            },
            Tile {
                master: p1,
                grad: g1,
                moments: mo1,
                out: o1,
            },
        )
    }
}

impl<'a> par::Split for Tile<'a> {
    fn numel(&self) -> usize {
        self.len()
    }
    fn split_at(self, mid: usize) -> (Self, Self) {
        Tile::split_at(self, mid)
    }
}

/// One tile of [`CpuAdam::step_many`]: what [`CpuAdam::step`] takes, with
/// its own hyper-parameters.
#[derive(Debug)]
pub struct StepItem<'a> {
    pub hyper: AdamHyper,
    /// Adam's step count, 1-based.
    pub step: u64,
    pub master: &'a mut [f32],
    pub grad: GradIn<'a>,
    pub moments: Moments<'a>,
    pub low_precision_out: Option<LowPrecisionOut<'a>>,
    pub grad_scale: GradScale,
}

/// The CPU Adam optimizer: hyper-parameters, thread count and instruction set.
/// It holds no state; moments live in the caller's (swapped) buffers.
#[derive(Debug, Clone)]
pub struct CpuAdam {
    hyper: AdamHyper,
    threads: NonZeroUsize,
    isa: Isa,
}

impl CpuAdam {
    /// Optimizer using the best instruction set of this CPU.
    pub fn new(hyper: AdamHyper, threads: NonZeroUsize) -> Result<Self, OptimError> {
        Self::with_isa(hyper, threads, Isa::detect())
    }

    /// Optimizer forced onto `isa` (tests, benchmarks of the fallbacks).
    pub fn with_isa(hyper: AdamHyper, threads: NonZeroUsize, isa: Isa) -> Result<Self, OptimError> {
        hyper.validate()?;
        if !isa.is_supported() {
            return Err(OptimError::IsaUnsupported { isa });
        }
        Ok(Self {
            hyper,
            threads,
            isa,
        })
    }

    pub fn hyper(&self) -> &AdamHyper {
        &self.hyper
    }

    /// Replaces the hyper-parameters (e.g. a learning-rate schedule).
    pub fn set_hyper(&mut self, hyper: AdamHyper) -> Result<(), OptimError> {
        hyper.validate()?;
        self.hyper = hyper;
        Ok(())
    }

    pub fn threads(&self) -> NonZeroUsize {
        self.threads
    }

    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// One Adam step (1-based `step`) over a tile, in place, optionally
    /// writing the low-precision copy of the updated `master` into
    /// `low_precision_out` in the same pass.
    ///
    /// `grad_scale` multiplies every gradient (loss-scale unscale and clip
    /// coefficient); get it from [`GradNorm::scale_for_step`], which also says
    /// when the step must be skipped because a gradient is inf or NaN.
    pub fn step<'g>(
        &self,
        step: u64,
        master: &mut [f32],
        grad: impl Into<GradIn<'g>>,
        moments: Moments<'_>,
        low_precision_out: Option<LowPrecisionOut<'_>>,
        grad_scale: GradScale,
    ) -> Result<(), OptimError> {
        let scalars = StepScalars::new(&self.hyper, step, grad_scale)?;
        let tile = Tile::new(master, grad.into(), moments, low_precision_out)?;
        let isa = self.isa;
        par::for_each_chunk(tile, self.threads.get(), |chunk| {
            kernels::run_tile(isa, &scalars, chunk)
        });
        Ok(())
    }

    /// Steps several tiles, each with its own hyper-parameters and step
    /// count (torch's param groups, per-param step counts), in one call:
    /// the same kernel and bits as [`CpuAdam::step`] on each, with this
    /// optimizer's threads spawned once for all of them. Every item is
    /// validated before any is stepped. `self`'s own hyper-parameters are
    /// not used.
    pub fn step_many(&self, items: Vec<StepItem<'_>>) -> Result<(), OptimError> {
        let mut tiles = Vec::with_capacity(items.len());
        let mut scalars = Vec::with_capacity(items.len());
        for item in items {
            scalars.push(StepScalars::new(&item.hyper, item.step, item.grad_scale)?);
            tiles.push(Tile::new(
                item.master,
                item.grad,
                item.moments,
                item.low_precision_out,
            )?);
        }
        let isa = self.isa;
        par::for_each_chunk_many(tiles, self.threads.get(), |i, chunk| {
            kernels::run_tile(isa, &scalars[i], chunk)
        });
        Ok(())
    }

    /// Σ g² over `grad`, accumulated in f64, deterministic (independent of
    /// the thread count; a bf16 gradient gives the bits of its fp32
    /// sum's). Sum the results of all tiles of all ranks, then use
    /// [`GradNorm`]. The result is finite iff every element of `grad` is.
    pub fn grad_sq_norm<'g>(&self, grad: impl Into<GradIn<'g>>) -> f64 {
        match grad.into() {
            GradIn::F32(g) => norm::sq_norm_f64(g, self.threads.get()),
            GradIn::Bf16(g) => norm::sq_norm_f64(g, self.threads.get()),
        }
    }
}
