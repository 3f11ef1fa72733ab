//! Safe loops compiled for the CPU's wider vectors: the fused ops' element
//! loops, and the gradient norm's sums of squares.
//!
//! # Why
//!
//! The crate is built for baseline x86-64, so its loops vectorize to SSE2:
//! four f32 lanes. The fused ops' element loops (GELU and its gradient,
//! the softmax rows, the norms, the bias add) were a fifth of a GPT-2
//! step's samples after gemm, which picks its own kernels at run time. One
//! choke point does the same for them: every task the fused ops hand to
//! the pool (`par_rows`, `par_elems`, ... in `model::fused`) runs through
//! [`run`], which calls it inside a `#[target_feature]` function for the
//! best instruction set the CPU has. LLVM inlines the task (a closure with
//! one call site) and the kernels it calls (`#[inline(always)]`) into that
//! function and compiles them with its features; whatever it does not
//! inline runs as built, so a missed inline costs speed, never results.
//!
//! The gradient norm ([`crate::optim`]'s `part_sq_sum`) runs through it
//! too: its `f64::mul_add`, built for baseline x86-64, is a call of the
//! software fma per element (1% of a GPT-2 step's samples); with FMA
//! enabled it is one instruction, with the same, correctly rounded result.
//!
//! # The same bits on every instruction set
//!
//! Rust never contracts `a * b + c` into a fused multiply-add, and the
//! loops are element-wise or sum in a fixed lane order in the source (the
//! softmax's [`super::attention`] lanes), so a wider vector computes each
//! element with the same operations in the same order: the results are bit
//! for bit those of the baseline build (`tests` checks the kernels both
//! ways at awkward sizes). `TIERZERO_FUSED_ISA` (`baseline`, `avx2`,
//! `avx512`) picks one for a side-by-side run; one this CPU lacks is
//! ignored.
//!
//! # Which
//!
//! GPT-2 stage 0 (`W/tz0` of `scripts/compare_torch.py --workdir W`, 30
//! steps, 2 threads), the three alternating in one run, tok/s:
//!
//! | round | baseline (SSE2) | AVX2 | AVX-512F |
//! |---|---|---|---|
//! | 1 | 6,631 | 6,817 | 6,394 |
//! | 2 | 6,332 | 6,655 | 6,609 |
//! | 3 | 6,786 | 6,786 | 6,250 |
//!
//! The same `weight_sha256` in all nine. AVX2 is the default; AVX-512 only
//! when asked for. The loops convert to f64 for their sums (the norms, the
//! softmax), so they gain less than the lane count suggests.
//!
//! # Safety
//!
//! The only `unsafe` is the call of a `#[target_feature]` function, made
//! after `is_x86_feature_detected!` confirmed its features (std caches the
//! answer). The code it runs is safe Rust.
#![allow(unsafe_code)]

use std::sync::OnceLock;

/// The instruction sets the fused ops' tasks run with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wide {
    /// AVX-512F (16 f32 lanes).
    Avx512,
    /// AVX2 with FMA (8 f32 lanes).
    Avx2,
    /// As the crate is built (SSE2 on x86-64).
    Baseline,
}

impl Wide {
    /// [`Wide::best`], or what `TIERZERO_FUSED_ISA` asks for.
    pub(crate) fn detected() -> Wide {
        static CHOSEN: OnceLock<Wide> = OnceLock::new();
        *CHOSEN.get_or_init(|| {
            let asked = match std::env::var("TIERZERO_FUSED_ISA").as_deref() {
                Ok("baseline") => Some(Wide::Baseline),
                Ok("avx2") => Some(Wide::Avx2),
                Ok("avx512") => Some(Wide::Avx512),
                _ => None,
            };
            asked.filter(|w| w.supported()).unwrap_or_else(Wide::best)
        })
    }

    /// AVX2 where the CPU has it, even beside AVX-512: on the development
    /// VM (AVX-512F) the 512-bit build of the same loops made the GPT-2 step
    /// slower than the baseline one (module docs).
    fn best() -> Wide {
        [Wide::Avx2, Wide::Avx512]
            .into_iter()
            .find(|w| w.supported())
            .unwrap_or(Wide::Baseline)
    }

    /// Whether this CPU runs `self`: the optimizer kernels' detection
    /// ([`crate::optim::Isa`]; its AVX2 set also asks for F16C, which every
    /// AVX2 CPU has).
    pub(crate) fn supported(self) -> bool {
        match self {
            Wide::Baseline => true,
            Wide::Avx512 => crate::optim::Isa::Avx512.is_supported(),
            Wide::Avx2 => crate::optim::Isa::Avx2Fma.is_supported(),
        }
    }
}

/// Tests' choice over [`Wide::detected`] (0: none; else 1 + the index in
/// [`ALL`]). Process-wide, so another test that runs meanwhile gets it
/// too; set only through [`with_test_choice`], which holds
/// [`TEST_CHOICE_LOCK`] so that two tests comparing instruction sets do
/// not set it under each other (one's "baseline" run would take the
/// other's choice, and the comparison would pass without comparing).
#[cfg(test)]
static TEST_CHOICE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
#[cfg(test)]
static TEST_CHOICE_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Runs `f` with the loops built for `ALL[isa_index]` (as built where this
/// CPU lacks it), the choice held for `f`'s whole run, every thread's, and
/// cleared after it, also when `f` panics.
#[cfg(test)]
pub(crate) fn with_test_choice<R>(isa_index: usize, f: impl FnOnce() -> R) -> R {
    use std::sync::atomic::Ordering::SeqCst;
    struct Clear;
    impl Drop for Clear {
        fn drop(&mut self) {
            TEST_CHOICE.store(0, SeqCst);
        }
    }
    let _held = TEST_CHOICE_LOCK
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    assert!(isa_index < ALL.len(), "no instruction set {isa_index}");
    TEST_CHOICE.store(isa_index + 1, SeqCst);
    let _clear = Clear;
    f()
}

/// Every instruction set, baseline first.
#[cfg(test)]
pub(crate) const ALL: [Wide; 3] = [Wide::Baseline, Wide::Avx2, Wide::Avx512];

/// Runs `f` with the instruction set [`Wide::detected`] chose.
#[inline(always)]
pub(crate) fn run<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(test)]
    {
        let k = TEST_CHOICE.load(std::sync::atomic::Ordering::SeqCst);
        if k > 0 {
            return run_on(ALL[k - 1], f);
        }
    }
    run_on(Wide::detected(), f)
}

/// Runs `f` with `isa`, or as built where this CPU lacks it.
#[inline(always)]
fn run_on<R>(isa: Wide, f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        match isa {
            Wide::Avx512 if isa.supported() => {
                // SAFETY: avx512f is present (checked just above); `f` is
                // safe code.
                return unsafe { x86::avx512(f) };
            }
            Wide::Avx2 if isa.supported() => {
                // SAFETY: avx2 and fma are present (checked just above).
                return unsafe { x86::avx2(f) };
            }
            _ => {}
        }
    }
    let _ = isa;
    f()
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    /// # Safety
    /// The CPU has AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn avx512<R>(f: impl FnOnce() -> R) -> R {
        f()
    }

    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn avx2<R>(f: impl FnOnce() -> R) -> R {
        f()
    }
}
