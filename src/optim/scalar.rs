//! Portable scalar kernel and the scalar f32 -> bf16 / fp16 conversions.
//!
//! This is the fallback on CPUs without AVX2/AVX-512 and the tail handler of
//! the SIMD kernels, so it must produce the *same bits* as a SIMD lane: the
//! operation sequence in [`update`] mirrors `kernels::adam_body` exactly
//! (`mul_add` is a fused multiply-add with a single rounding on every
//! target), and the conversions below round exactly like the vector code.
//! Moments and the parameter copy use two different bf16 conversions (see
//! [`f32_to_bf16_moment_bits`]).

use super::{AdamMode, GradIn, LowPrecisionOut, Moments, StepScalars, Tile};
use half::{bf16, f16};

/// f32 -> bf16 bits, round-to-nearest-even; NaN stays NaN (quiet bit set,
/// sign and upper payload kept); ±inf and overflow to ±inf as IEEE says.
#[inline(always)]
pub fn f32_to_bf16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) | 0x0040) as u16;
    }
    let lsb = (bits >> 16) & 1;
    (bits.wrapping_add(0x7FFF + lsb) >> 16) as u16
}

/// f32 -> bf16 bits for *stored Adam moments*: [`f32_to_bf16_bits`], except
/// that an f32 subnormal (exponent field 0) becomes a zero of the same sign.
///
/// This is exactly what AVX512-BF16's `vcvtne2ps2bf16` computes (it treats
/// input denormals as zero; a normal f32 never rounds to a bf16 subnormal, so
/// its output flushing never applies), so every ISA can store moments with
/// the fastest conversion it has and still produce the same bits. The
/// parameter copy ([`f32_to_bf16_bits`]) keeps subnormals.
#[inline(always)]
pub fn f32_to_bf16_moment_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    if bits & 0x7F80_0000 == 0 {
        return ((bits >> 16) & 0x8000) as u16;
    }
    f32_to_bf16_bits(x)
}

/// f32 -> IEEE binary16 bits, round-to-nearest-even, NaN preserved (quiet),
/// subnormals rounded correctly. Same bits as x86 `vcvtps2ph` with
/// round-to-nearest (checked by tests).
#[inline(always)]
pub fn f32_to_f16_bits(x: f32) -> u16 {
    f16::from_f32(x).to_bits()
}

#[inline(always)]
pub(crate) fn bf16_bits_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// One element of Adam. Returns `(p, m, v)` after the step.
#[inline(always)]
pub(crate) fn update(s: &StepScalars, l2: bool, p: f32, g: f32, m: f32, v: f32) -> (f32, f32, f32) {
    let g = g * s.grad_scale;
    let g = if l2 { p.mul_add(s.l2_wd, g) } else { g };
    let m2 = s.beta1.mul_add(m, s.one_minus_beta1 * g);
    let v2 = s.beta2.mul_add(v, (s.one_minus_beta2 * g) * g);
    let den = v2.sqrt().mul_add(s.inv_sqrt_bc2, s.eps);
    let upd = m2 / den;
    let p1 = if l2 { p } else { s.neg_lr_wd.mul_add(p, p) };
    let p2 = s.neg_step_size.mul_add(upd, p1);
    (p2, m2, v2)
}

#[inline(always)]
fn write_out(out: &mut Option<LowPrecisionOut<'_>>, i: usize, p: f32) {
    match out {
        None => {}
        Some(LowPrecisionOut::Bf16(o)) => o[i] = bf16::from_bits(f32_to_bf16_bits(p)),
        Some(LowPrecisionOut::F16(o)) => o[i] = f16::from_bits(f32_to_f16_bits(p)),
    }
}

/// Gradient element `i` as the kernel reads it: a bf16 one as `+0.0 + g`
/// (see [`GradIn`]; the SIMD lanes add the same zero).
#[inline(always)]
fn grad_at(g: &GradIn<'_>, i: usize) -> f32 {
    match g {
        GradIn::F32(g) => g[i],
        GradIn::Bf16(g) => super::bf16_as_sum(g[i]),
    }
}

/// Scalar Adam over a whole tile.
pub(crate) fn run(s: &StepScalars, tile: Tile<'_>) {
    let l2 = s.mode == AdamMode::L2;
    let Tile {
        master,
        grad,
        moments,
        mut out,
    } = tile;
    match moments {
        Moments::F32 { m, v } => {
            for i in 0..master.len() {
                let (p2, m2, v2) = update(s, l2, master[i], grad_at(&grad, i), m[i], v[i]);
                master[i] = p2;
                m[i] = m2;
                v[i] = v2;
                write_out(&mut out, i, p2);
            }
        }
        Moments::Bf16 { m, v } => {
            for i in 0..master.len() {
                let (p2, m2, v2) = update(
                    s,
                    l2,
                    master[i],
                    grad_at(&grad, i),
                    bf16_bits_to_f32(m[i].to_bits()),
                    bf16_bits_to_f32(v[i].to_bits()),
                );
                master[i] = p2;
                m[i] = bf16::from_bits(f32_to_bf16_moment_bits(m2));
                v[i] = bf16::from_bits(f32_to_bf16_moment_bits(v2));
                write_out(&mut out, i, p2);
            }
        }
    }
}

/// Scalar f32 -> bf16 conversion pass (tail of the SIMD conversion pass).
pub(crate) fn convert_bf16(src: &[f32], dst: &mut [bf16]) {
    for (d, &x) in dst.iter_mut().zip(src) {
        *d = bf16::from_bits(f32_to_bf16_bits(x));
    }
}

/// Scalar body of the read-modify-write bandwidth probe.
pub(crate) fn probe(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
    for i in 0..p.len() {
        let gi = g[i];
        p[i] += gi;
        m[i] += gi;
        v[i] += gi;
    }
}
