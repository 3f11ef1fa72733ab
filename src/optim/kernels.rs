//! SIMD kernels (AVX-512F [+ AVX512-BF16], AVX2+FMA+F16C) and run-time
//! dispatch.
//!
//! One of the three modules of the crate allowed `unsafe` (with its child
//! `passes.rs`: the conversion pass and the bandwidth probe; the others
//! are `model/fused/matmul.rs` and `wide.rs`). The design:
//!
//! * One generic kernel body, [`adam_body`], is written against the small
//!   [`Simd`] trait (splat, load, store, fma, sqrt, div, bf16/fp16 load and
//!   store). It is `#[inline(always)]` and is instantiated inside thin
//!   `#[target_feature]` entry functions (`adam_avx512bf16`, `adam_avx512`,
//!   `adam_avx2`), so
//!   LLVM compiles each instantiation with the wider instruction set and
//!   inlines the intrinsics. Moment precision, output precision, weight
//!   decay mode and gradient precision (fp32, or bf16 read as its fp32
//!   sum: [`GradIn`]) are const generics, so each of the 24 combinations is
//!   its own branch-free loop.
//! * The vector body covers the largest multiple of the vector width; the rest
//!   is handed, as a safe sub-tile, to the scalar kernel, which is bitwise
//!   identical to a vector lane (see `scalar.rs`).
//! * Safety rests on two invariants: (1) an entry function runs only after
//!   `is_x86_feature_detected!` confirmed its features (checked at every
//!   dispatch; the macro caches the answer in an atomic), and (2) the raw
//!   pointers come from slices of a [`Tile`] whose lengths were validated to
//!   be equal, and the body only touches indices `< n` of each.
//! * p, m and v use plain stores: they are read-modify-write, so their lines
//!   are in cache anyway. The bf16/fp16 parameter copy is write-only and next
//!   read by DMA, so it uses streaming (non-temporal) stores: that skips the
//!   read-for-ownership of its lines (2 B/param less traffic) and keeps it out
//!   of the caches. A few scalar elements are peeled so that those stores are
//!   aligned; an `sfence` ends each call that streamed.
//! * bf16 rounding of the *parameter copy* and of the conversion pass is done
//!   with integer ops (`bits + 0x7fff + lsb`, NaN blended back with the
//!   quiet bit set), because it must keep subnormals, which AVX512-BF16's
//!   instructions flush. *Moments* are stored with the flushing semantics
//!   (`scalar::f32_to_bf16_moment_bits`, see the module docs of `optim`):
//!   on [`Isa::Avx512Bf16`] with one `vcvtne2ps2bf16` for m and v together
//!   (it replaces ~20 integer ops per 16 elements; the bf16-moment kernel
//!   was compute-bound), elsewhere with the integer sequence plus a
//!   subnormal-to-signed-zero mask, bit for bit the same. fp16 uses
//!   `vcvtps2ph` with round-to-nearest-even.
#![allow(unsafe_code)]

use super::{scalar, StepScalars, Tile};

mod passes;
pub use passes::{convert_f32_to_bf16, rmw_probe, ProbeOrder};

/// Instruction set of the kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// AVX-512F plus AVX512-BF16 (bf16 moments stored with
    /// `vcvtne2ps2bf16`), 16 f32 lanes. Same bits as [`Isa::Avx512`].
    Avx512Bf16,
    /// AVX-512F, 16 f32 lanes.
    Avx512,
    /// AVX2 with FMA and F16C, 8 f32 lanes.
    Avx2Fma,
    /// Portable scalar code.
    Scalar,
}

impl Isa {
    /// Best instruction set of this CPU.
    pub fn detect() -> Isa {
        [Isa::Avx512Bf16, Isa::Avx512, Isa::Avx2Fma]
            .into_iter()
            .find(|i| i.is_supported())
            .unwrap_or(Isa::Scalar)
    }

    /// All instruction sets this CPU runs, best first.
    pub fn available() -> Vec<Isa> {
        [Isa::Avx512Bf16, Isa::Avx512, Isa::Avx2Fma, Isa::Scalar]
            .into_iter()
            .filter(|i| i.is_supported())
            .collect()
    }

    /// Whether this CPU supports `self` (cached by std after the first call).
    pub fn is_supported(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Bf16 => {
                std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bf16")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => std::arch::is_x86_feature_detected!("avx512f"),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2Fma => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                    && std::arch::is_x86_feature_detected!("f16c")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// Short lower-case name (`avx512bf16`, `avx512`, `avx2`, `scalar`).
    pub fn name(self) -> &'static str {
        match self {
            Isa::Avx512Bf16 => "avx512bf16",
            Isa::Avx512 => "avx512",
            Isa::Avx2Fma => "avx2",
            Isa::Scalar => "scalar",
        }
    }
}

/// Runs Adam over one tile (or chunk) on `isa`, falling back to scalar code
/// if `isa` is not supported here.
pub(crate) fn run_tile(isa: Isa, s: &StepScalars, tile: Tile<'_>) {
    #[cfg(target_arch = "x86_64")]
    {
        if isa != Isa::Scalar && isa.is_supported() {
            x86::run_tile(isa, s, tile);
            return;
        }
    }
    let _ = isa;
    scalar::run(s, tile);
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::{AdamMode, GradIn, StepScalars};
    use super::super::{LowPrecisionOut, Moments};
    use super::{scalar, Isa, Tile};
    use std::arch::x86_64::*;

    /// Vector operations used by the generic kernel bodies.
    ///
    /// # Safety
    /// Every method may only be called when the CPU supports the
    /// implementor's instruction set; pointer arguments must be valid for
    /// `LANES` elements.
    pub(super) trait Simd: Copy {
        const LANES: usize;
        type F: Copy;
        unsafe fn splat(x: f32) -> Self::F;
        unsafe fn load(p: *const f32) -> Self::F;
        unsafe fn store(p: *mut f32, v: Self::F);
        unsafe fn load_bf16(p: *const u16) -> Self::F;
        /// `LANES` packed u16 values.
        type H: Copy;
        /// Bytes of one `H`; `stream_h` needs this alignment.
        const H_BYTES: usize;
        /// f32 -> bf16, round-to-nearest-even, NaN kept (quiet).
        unsafe fn cvt_bf16(v: Self::F) -> Self::H;
        /// f32 -> bf16 for stored moments: as `cvt_bf16`, but f32
        /// subnormals become signed zero (`scalar::f32_to_bf16_moment_bits`).
        unsafe fn cvt_bf16_moment(v: Self::F) -> Self::H;
        /// f32 -> fp16, round-to-nearest-even (`vcvtps2ph`).
        unsafe fn cvt_f16(v: Self::F) -> Self::H;
        unsafe fn store_h(p: *mut u16, h: Self::H);
        /// Stores `m` and `v` as bf16 moments (`cvt_bf16_moment`) at `pm`
        /// and `pv`, each valid for `LANES` u16 (unaligned).
        #[inline(always)]
        unsafe fn store_moments_bf16(pm: *mut u16, pv: *mut u16, m: Self::F, v: Self::F) {
            // SAFETY: forwarded from the trait and method contract.
            unsafe {
                Self::store_h(pm, Self::cvt_bf16_moment(m));
                Self::store_h(pv, Self::cvt_bf16_moment(v));
            }
        }
        /// Non-temporal store; `p` aligned to `H_BYTES`.
        unsafe fn stream_h(p: *mut u16, h: Self::H);
        unsafe fn add(a: Self::F, b: Self::F) -> Self::F;
        unsafe fn mul(a: Self::F, b: Self::F) -> Self::F;
        /// `a * b + c` with one rounding.
        unsafe fn fma(a: Self::F, b: Self::F, c: Self::F) -> Self::F;
        unsafe fn sqrt(a: Self::F) -> Self::F;
        unsafe fn div(a: Self::F, b: Self::F) -> Self::F;
    }

    #[derive(Clone, Copy)]
    pub(super) struct Avx512;

    #[derive(Clone, Copy)]
    pub(super) struct Avx2;

    /// AVX-512F plus AVX512-BF16: [`Avx512`] except for the moment stores.
    #[derive(Clone, Copy)]
    pub(super) struct Avx512Bf16;

    const ROUND_NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

    impl Simd for Avx512 {
        const LANES: usize = 16;
        type F = __m512;
        #[inline(always)]
        unsafe fn splat(x: f32) -> __m512 {
            // SAFETY: trait contract: avx512f is available.
            unsafe { _mm512_set1_ps(x) }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m512 {
            // SAFETY: trait contract: avx512f available, p valid for 16 f32.
            unsafe { _mm512_loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m512) {
            // SAFETY: trait contract: avx512f available, p valid for 16 f32.
            unsafe { _mm512_storeu_ps(p, v) }
        }
        #[inline(always)]
        unsafe fn load_bf16(p: *const u16) -> __m512 {
            // SAFETY: trait contract: avx512f available, p valid for 16 u16
            // (32 bytes, unaligned load).
            unsafe {
                let h = _mm256_loadu_si256(p as *const __m256i);
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
            }
        }
        type H = __m256i;
        const H_BYTES: usize = 32;
        #[inline(always)]
        unsafe fn cvt_bf16(v: __m512) -> __m256i {
            // SAFETY: trait contract: avx512f available.
            unsafe {
                let b = _mm512_castps_si512(v);
                let hi = _mm512_srli_epi32::<16>(b);
                let lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
                let bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF));
                let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(b, bias));
                let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
                let quiet = _mm512_or_si512(hi, _mm512_set1_epi32(0x40));
                let r = _mm512_mask_blend_epi32(nan, rounded, quiet);
                _mm512_cvtepi32_epi16(r)
            }
        }
        #[inline(always)]
        unsafe fn cvt_bf16_moment(v: __m512) -> __m256i {
            // SAFETY: trait contract: avx512f available.
            unsafe {
                // Lanes with a zero exponent field (zeros, subnormals) keep
                // only their sign bit; `cvt_bf16` then yields signed zero.
                let b = _mm512_castps_si512(v);
                let sub = _mm512_testn_epi32_mask(b, _mm512_set1_epi32(0x7F80_0000));
                let sign = _mm512_set1_epi32(i32::MIN);
                let flushed = _mm512_mask_and_epi32(b, sub, b, sign);
                Self::cvt_bf16(_mm512_castsi512_ps(flushed))
            }
        }
        #[inline(always)]
        unsafe fn cvt_f16(v: __m512) -> __m256i {
            // SAFETY: trait contract: avx512f available.
            unsafe { _mm512_cvtps_ph::<ROUND_NEAREST>(v) }
        }
        #[inline(always)]
        unsafe fn store_h(p: *mut u16, h: __m256i) {
            // SAFETY: trait contract: p valid for 16 u16 (unaligned store).
            unsafe { _mm256_storeu_si256(p as *mut __m256i, h) }
        }
        #[inline(always)]
        unsafe fn stream_h(p: *mut u16, h: __m256i) {
            // SAFETY: trait contract: p valid for 16 u16, 32-byte aligned.
            unsafe { _mm256_stream_si256(p as *mut __m256i, h) }
        }
        #[inline(always)]
        unsafe fn add(a: __m512, b: __m512) -> __m512 {
            // SAFETY: trait contract: avx512f is available.
            unsafe { _mm512_add_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn mul(a: __m512, b: __m512) -> __m512 {
            // SAFETY: trait contract: avx512f is available.
            unsafe { _mm512_mul_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
            // SAFETY: trait contract: avx512f is available.
            unsafe { _mm512_fmadd_ps(a, b, c) }
        }
        #[inline(always)]
        unsafe fn sqrt(a: __m512) -> __m512 {
            // SAFETY: trait contract: avx512f is available.
            unsafe { _mm512_sqrt_ps(a) }
        }
        #[inline(always)]
        unsafe fn div(a: __m512, b: __m512) -> __m512 {
            // SAFETY: trait contract: avx512f is available.
            unsafe { _mm512_div_ps(a, b) }
        }
    }

    impl Simd for Avx2 {
        const LANES: usize = 8;
        type F = __m256;
        #[inline(always)]
        unsafe fn splat(x: f32) -> __m256 {
            // SAFETY: trait contract: avx2 is available.
            unsafe { _mm256_set1_ps(x) }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m256 {
            // SAFETY: trait contract: avx2 available, p valid for 8 f32.
            unsafe { _mm256_loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m256) {
            // SAFETY: trait contract: avx2 available, p valid for 8 f32.
            unsafe { _mm256_storeu_ps(p, v) }
        }
        #[inline(always)]
        unsafe fn load_bf16(p: *const u16) -> __m256 {
            // SAFETY: trait contract: avx2 available, p valid for 8 u16
            // (16 bytes, unaligned load).
            unsafe {
                let h = _mm_loadu_si128(p as *const __m128i);
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
            }
        }
        type H = __m128i;
        const H_BYTES: usize = 16;
        #[inline(always)]
        unsafe fn cvt_bf16(v: __m256) -> __m128i {
            // SAFETY: trait contract: avx2 available.
            unsafe {
                let b = _mm256_castps_si256(v);
                let hi = _mm256_srli_epi32::<16>(b);
                let lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
                let bias = _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF));
                let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(b, bias));
                let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
                let quiet = _mm256_or_si256(hi, _mm256_set1_epi32(0x40));
                let r = _mm256_blendv_epi8(rounded, quiet, nan);
                // Every lane is <= 0xffff, so unsigned saturation is exact.
                _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256::<1>(r))
            }
        }
        #[inline(always)]
        unsafe fn cvt_bf16_moment(v: __m256) -> __m128i {
            // SAFETY: trait contract: avx2 available.
            unsafe {
                // Lanes with a zero exponent field (zeros, subnormals) keep
                // only their sign bit; `cvt_bf16` then yields signed zero.
                let b = _mm256_castps_si256(v);
                let exp = _mm256_and_si256(b, _mm256_set1_epi32(0x7F80_0000));
                let sub = _mm256_cmpeq_epi32(exp, _mm256_setzero_si256());
                let clear = _mm256_and_si256(sub, _mm256_set1_epi32(i32::MAX));
                let flushed = _mm256_andnot_si256(clear, b);
                Self::cvt_bf16(_mm256_castsi256_ps(flushed))
            }
        }
        #[inline(always)]
        unsafe fn cvt_f16(v: __m256) -> __m128i {
            // SAFETY: trait contract: avx2 + f16c available.
            unsafe { _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v) }
        }
        #[inline(always)]
        unsafe fn store_h(p: *mut u16, h: __m128i) {
            // SAFETY: trait contract: p valid for 8 u16 (unaligned store).
            unsafe { _mm_storeu_si128(p as *mut __m128i, h) }
        }
        #[inline(always)]
        unsafe fn stream_h(p: *mut u16, h: __m128i) {
            // SAFETY: trait contract: p valid for 8 u16, 16-byte aligned.
            unsafe { _mm_stream_si128(p as *mut __m128i, h) }
        }
        #[inline(always)]
        unsafe fn add(a: __m256, b: __m256) -> __m256 {
            // SAFETY: trait contract: avx2 is available.
            unsafe { _mm256_add_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn mul(a: __m256, b: __m256) -> __m256 {
            // SAFETY: trait contract: avx2 is available.
            unsafe { _mm256_mul_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn fma(a: __m256, b: __m256, c: __m256) -> __m256 {
            // SAFETY: trait contract: fma is available.
            unsafe { _mm256_fmadd_ps(a, b, c) }
        }
        #[inline(always)]
        unsafe fn sqrt(a: __m256) -> __m256 {
            // SAFETY: trait contract: avx2 is available.
            unsafe { _mm256_sqrt_ps(a) }
        }
        #[inline(always)]
        unsafe fn div(a: __m256, b: __m256) -> __m256 {
            // SAFETY: trait contract: avx2 is available.
            unsafe { _mm256_div_ps(a, b) }
        }
    }

    /// Everything but the moment conversion is [`Avx512`]'s.
    impl Simd for Avx512Bf16 {
        const LANES: usize = Avx512::LANES;
        type F = __m512;
        #[inline(always)]
        unsafe fn splat(x: f32) -> __m512 {
            // SAFETY: trait contract (avx512f is part of this ISA).
            unsafe { Avx512::splat(x) }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m512 {
            // SAFETY: trait contract (avx512f is part of this ISA).
            unsafe { Avx512::load(p) }
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m512) {
            // SAFETY: trait contract (avx512f is part of this ISA).
            unsafe { Avx512::store(p, v) }
        }
        #[inline(always)]
        unsafe fn load_bf16(p: *const u16) -> __m512 {
            // SAFETY: trait contract (avx512f is part of this ISA).
            unsafe { Avx512::load_bf16(p) }
        }
        type H = __m256i;
        const H_BYTES: usize = Avx512::H_BYTES;
        #[inline(always)]
        unsafe fn cvt_bf16(v: __m512) -> __m256i {
            // SAFETY: trait contract (avx512f is part of this ISA).
            unsafe { Avx512::cvt_bf16(v) }
        }
        #[inline(always)]
        unsafe fn cvt_bf16_moment(v: __m512) -> __m256i {
            // SAFETY: trait contract: avx512bf16 (and avx512f) available.
            // `vcvtneps2bf16`: RNE, NaN quieted, input denormals as zero.
            unsafe { std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(v)) }
        }
        #[inline(always)]
        unsafe fn store_moments_bf16(pm: *mut u16, pv: *mut u16, m: __m512, v: __m512) {
            // SAFETY: trait contract: avx512bf16 (and avx512f) available, pm
            // and pv valid for 16 u16 each; `__m512bh` and `__m512i` are
            // both 64-byte plain vectors, so the transmute is a bit cast.
            unsafe {
                // Elements 0..16 come from the second operand (m), 16..32
                // from the first (v).
                let mv = std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(v, m));
                _mm256_storeu_si256(pm as *mut __m256i, _mm512_castsi512_si256(mv));
                _mm256_storeu_si256(pv as *mut __m256i, _mm512_extracti64x4_epi64::<1>(mv));
            }
        }
        #[inline(always)]
        unsafe fn cvt_f16(v: __m512) -> __m256i {
            // SAFETY: trait contract (avx512f is part of this ISA).
            unsafe { Avx512::cvt_f16(v) }
        }
        #[inline(always)]
        unsafe fn store_h(p: *mut u16, h: __m256i) {
            // SAFETY: trait contract (avx512f is part of this ISA).
            unsafe { Avx512::store_h(p, h) }
        }
        #[inline(always)]
        unsafe fn stream_h(p: *mut u16, h: __m256i) {
            // SAFETY: trait contract (avx512f is part of this ISA).
            unsafe { Avx512::stream_h(p, h) }
        }
        #[inline(always)]
        unsafe fn add(a: __m512, b: __m512) -> __m512 {
            // SAFETY: trait contract (avx512f is part of this ISA).
            unsafe { Avx512::add(a, b) }
        }
        #[inline(always)]
        unsafe fn mul(a: __m512, b: __m512) -> __m512 {
            // SAFETY: trait contract (avx512f is part of this ISA).
            unsafe { Avx512::mul(a, b) }
        }
        #[inline(always)]
        unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
            // SAFETY: trait contract (avx512f is part of this ISA).
            unsafe { Avx512::fma(a, b, c) }
        }
        #[inline(always)]
        unsafe fn sqrt(a: __m512) -> __m512 {
            // SAFETY: trait contract (avx512f is part of this ISA).
            unsafe { Avx512::sqrt(a) }
        }
        #[inline(always)]
        unsafe fn div(a: __m512, b: __m512) -> __m512 {
            // SAFETY: trait contract (avx512f is part of this ISA).
            unsafe { Avx512::div(a, b) }
        }
    }

    /// Raw view of a tile's vector part. All pointers are valid for `n`
    /// elements; the ones unused by the instantiation are null.
    pub(super) struct RawTile {
        n: usize,
        p: *mut f32,
        /// The gradient: f32 (`g`) or bf16 (`g16`), the other null.
        g: *const f32,
        g16: *const u16,
        m32: *mut f32,
        v32: *mut f32,
        m16: *mut u16,
        v16: *mut u16,
        out: *mut u16,
    }

    const OUT_NONE: u8 = 0;
    const OUT_BF16: u8 = 1;
    const OUT_F16: u8 = 2;

    /// The Adam kernel body. Mirrors `scalar::update` operation by operation
    /// (a bf16 gradient, `G16`, loaded as `scalar::grad_at` reads it).
    ///
    /// # Safety
    /// `S`'s instruction set is available; `t.n` is a multiple of `S::LANES`
    /// and every pointer used by this instantiation is valid for `t.n`
    /// elements (reads and, except `g` and `g16`, writes); `t.out`, when
    /// used, is aligned to `S::H_BYTES`.
    #[inline(always)]
    unsafe fn adam_body<
        S: Simd,
        const L2: bool,
        const MB16: bool,
        const OUT: u8,
        const G16: bool,
    >(
        s: &StepScalars,
        t: &RawTile,
    ) {
        // SAFETY: the caller guarantees the instruction set and the pointer
        // ranges; `i + S::LANES <= t.n` holds for every access below.
        unsafe {
            let grad_scale = S::splat(s.grad_scale);
            let beta1 = S::splat(s.beta1);
            let omb1 = S::splat(s.one_minus_beta1);
            let beta2 = S::splat(s.beta2);
            let omb2 = S::splat(s.one_minus_beta2);
            let eps = S::splat(s.eps);
            let neg_step = S::splat(s.neg_step_size);
            let inv_sqrt_bc2 = S::splat(s.inv_sqrt_bc2);
            let neg_lr_wd = S::splat(s.neg_lr_wd);
            let l2_wd = S::splat(s.l2_wd);
            let zero = S::splat(0.0);
            let mut i = 0;
            while i < t.n {
                let p = S::load(t.p.add(i));
                let g = if G16 {
                    // `+0.0 + g`: a `-0.0` reads as its fp32 sum's `+0.0`.
                    S::add(S::load_bf16(t.g16.add(i)), zero)
                } else {
                    S::load(t.g.add(i))
                };
                let g = S::mul(g, grad_scale);
                let g = if L2 { S::fma(p, l2_wd, g) } else { g };
                let (m, v) = if MB16 {
                    (S::load_bf16(t.m16.add(i)), S::load_bf16(t.v16.add(i)))
                } else {
                    (S::load(t.m32.add(i)), S::load(t.v32.add(i)))
                };
                let m2 = S::fma(beta1, m, S::mul(omb1, g));
                let v2 = S::fma(beta2, v, S::mul(S::mul(omb2, g), g));
                let den = S::fma(S::sqrt(v2), inv_sqrt_bc2, eps);
                let upd = S::div(m2, den);
                let p1 = if L2 { p } else { S::fma(neg_lr_wd, p, p) };
                let p2 = S::fma(neg_step, upd, p1);
                S::store(t.p.add(i), p2);
                if MB16 {
                    S::store_moments_bf16(t.m16.add(i), t.v16.add(i), m2, v2);
                } else {
                    S::store(t.m32.add(i), m2);
                    S::store(t.v32.add(i), v2);
                }
                // The copy is write-only here and next read by a DMA engine
                // (H2D copy or NVMe write): stream it past the caches, which
                // also saves the read-for-ownership of its lines.
                if OUT == OUT_BF16 {
                    S::stream_h(t.out.add(i), S::cvt_bf16(p2));
                } else if OUT == OUT_F16 {
                    S::stream_h(t.out.add(i), S::cvt_f16(p2));
                }
                i += S::LANES;
            }
            if OUT != OUT_NONE {
                // Order the weakly-ordered streaming stores before whatever
                // the caller does next (e.g. hand the buffer to another thread).
                _mm_sfence();
            }
        }
    }

    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn adam_avx512bf16<const L2: bool, const MB16: bool, const OUT: u8, const G16: bool>(
        s: &StepScalars,
        t: &RawTile,
    ) {
        // SAFETY: avx512f and avx512bf16 are enabled for this function; the
        // caller guarantees the pointer ranges.
        unsafe { adam_body::<Avx512Bf16, L2, MB16, OUT, G16>(s, t) }
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn adam_avx512<const L2: bool, const MB16: bool, const OUT: u8, const G16: bool>(
        s: &StepScalars,
        t: &RawTile,
    ) {
        // SAFETY: avx512f is enabled for this function; the caller
        // guarantees the pointer ranges.
        unsafe { adam_body::<Avx512, L2, MB16, OUT, G16>(s, t) }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn adam_avx2<const L2: bool, const MB16: bool, const OUT: u8, const G16: bool>(
        s: &StepScalars,
        t: &RawTile,
    ) {
        // SAFETY: avx2, fma and f16c are enabled for this function; the
        // caller guarantees the pointer ranges.
        unsafe { adam_body::<Avx2, L2, MB16, OUT, G16>(s, t) }
    }

    /// Dispatches to the monomorphised entry for `isa` and the tile's kinds.
    ///
    /// # Safety
    /// `isa` (not `Scalar`) is supported by this CPU; `t` obeys the
    /// [`RawTile`] contract with `t.n` a multiple of `isa`'s lane count.
    unsafe fn dispatch<const MB16: bool, const OUT: u8, const G16: bool>(
        isa: Isa,
        l2: bool,
        s: &StepScalars,
        t: &RawTile,
    ) {
        // SAFETY: forwarded from this function's contract.
        unsafe {
            match (isa, l2) {
                // Only the moment stores differ: fp32-moment variants run
                // the AVX-512F code rather than a second identical copy.
                (Isa::Avx512Bf16, false) if MB16 => adam_avx512bf16::<false, MB16, OUT, G16>(s, t),
                (Isa::Avx512Bf16, true) if MB16 => adam_avx512bf16::<true, MB16, OUT, G16>(s, t),
                (Isa::Avx512 | Isa::Avx512Bf16, false) => {
                    adam_avx512::<false, MB16, OUT, G16>(s, t)
                }
                (Isa::Avx512 | Isa::Avx512Bf16, true) => adam_avx512::<true, MB16, OUT, G16>(s, t),
                (Isa::Avx2Fma, false) => adam_avx2::<false, MB16, OUT, G16>(s, t),
                (Isa::Avx2Fma, true) => adam_avx2::<true, MB16, OUT, G16>(s, t),
                (Isa::Scalar, _) => {}
            }
        }
    }

    /// Number of 2-byte elements from `addr` to the next `align`-byte
    /// boundary (`addr` is 2-byte aligned, as every `bf16`/`f16` is).
    fn peel_numel(addr: usize, align: usize) -> usize {
        ((align - addr % align) % align) / 2
    }

    pub(super) fn lanes(isa: Isa) -> usize {
        match isa {
            Isa::Avx512 => Avx512::LANES,
            Isa::Avx512Bf16 => Avx512Bf16::LANES,
            Isa::Avx2Fma => Avx2::LANES,
            Isa::Scalar => 1,
        }
    }

    /// Vector part of the tile on `isa` (supported, not scalar: checked by
    /// the caller), scalar tail.
    pub(super) fn run_tile(isa: Isa, s: &StepScalars, tile: Tile<'_>) {
        if !isa.is_supported() || isa == Isa::Scalar {
            scalar::run(s, tile);
            return;
        }
        // Peel scalar elements until the low-precision copy is aligned for
        // streaming stores (bitwise the same results, see scalar.rs).
        let align_bytes = match isa {
            Isa::Avx512 => Avx512::H_BYTES,
            Isa::Avx512Bf16 => Avx512Bf16::H_BYTES,
            _ => Avx2::H_BYTES,
        };
        let peel = match &tile.out {
            None => 0,
            Some(LowPrecisionOut::Bf16(o)) => peel_numel(o.as_ptr() as usize, align_bytes),
            Some(LowPrecisionOut::F16(o)) => peel_numel(o.as_ptr() as usize, align_bytes),
        };
        let peel = peel.min(tile.len());
        let (head, tile) = tile.split_at(peel);
        scalar::run(s, head);
        let n = tile.len();
        let body_n = n - n % lanes(isa);
        let (mut body, tail) = tile.split_at(body_n);
        let l2 = s.mode == AdamMode::L2;
        let null16 = std::ptr::null_mut::<u16>();
        let null32 = std::ptr::null_mut::<f32>();
        let (m32, v32, m16, v16) = match &mut body.moments {
            Moments::F32 { m, v } => (m.as_mut_ptr(), v.as_mut_ptr(), null16, null16),
            Moments::Bf16 { m, v } => (
                null32,
                null32,
                m.as_mut_ptr() as *mut u16,
                v.as_mut_ptr() as *mut u16,
            ),
        };
        let (out, out_kind) = match &mut body.out {
            None => (null16, OUT_NONE),
            Some(LowPrecisionOut::Bf16(o)) => (o.as_mut_ptr() as *mut u16, OUT_BF16),
            Some(LowPrecisionOut::F16(o)) => (o.as_mut_ptr() as *mut u16, OUT_F16),
        };
        let (g, g16) = match body.grad {
            GradIn::F32(g) => (g.as_ptr(), std::ptr::null::<u16>()),
            GradIn::Bf16(g) => (std::ptr::null::<f32>(), g.as_ptr() as *const u16),
        };
        let raw = RawTile {
            n: body_n,
            p: body.master.as_mut_ptr(),
            g,
            g16,
            m32,
            v32,
            m16,
            v16,
            out,
        };
        let mb16 = !m16.is_null();
        let grad16 = !raw.g16.is_null();
        // SAFETY: `isa` was checked supported above; all slices of `body`
        // have length `body_n` (validated by `Tile::new`, preserved by
        // `split_at`), a multiple of the lane count; exactly one of `g` and
        // `g16` is non-null, and `grad16` (the `G16` instantiation) reads
        // that one only (bf16 loads are unaligned); the peel above aligned
        // `out` to the streaming-store width; `bf16`/`f16` are
        // `repr(transparent)` over `u16`; `body` is borrowed mutably for the
        // whole call, so nothing aliases the writes.
        unsafe {
            match (mb16, out_kind, grad16) {
                (false, OUT_NONE, false) => dispatch::<false, OUT_NONE, false>(isa, l2, s, &raw),
                (false, OUT_BF16, false) => dispatch::<false, OUT_BF16, false>(isa, l2, s, &raw),
                (false, _, false) => dispatch::<false, OUT_F16, false>(isa, l2, s, &raw),
                (true, OUT_NONE, false) => dispatch::<true, OUT_NONE, false>(isa, l2, s, &raw),
                (true, OUT_BF16, false) => dispatch::<true, OUT_BF16, false>(isa, l2, s, &raw),
                (true, _, false) => dispatch::<true, OUT_F16, false>(isa, l2, s, &raw),
                (false, OUT_NONE, true) => dispatch::<false, OUT_NONE, true>(isa, l2, s, &raw),
                (false, OUT_BF16, true) => dispatch::<false, OUT_BF16, true>(isa, l2, s, &raw),
                (false, _, true) => dispatch::<false, OUT_F16, true>(isa, l2, s, &raw),
                (true, OUT_NONE, true) => dispatch::<true, OUT_NONE, true>(isa, l2, s, &raw),
                (true, OUT_BF16, true) => dispatch::<true, OUT_BF16, true>(isa, l2, s, &raw),
                (true, _, true) => dispatch::<true, OUT_F16, true>(isa, l2, s, &raw),
            }
        }
        scalar::run(s, tail);
    }
}
