//! The passes beside the Adam kernel, on the same SIMD building blocks
//! (`super::x86`): the separate fp32 -> bf16 conversion pass (DeepSpeed's
//! step after its optimizer, the two-pass baseline of `benches/adam.rs`)
//! and the read-modify-write bandwidth probe (`tierzero bench-adam`'s
//! ceiling). Each runs vector bodies over the largest multiple of the
//! vector width and the scalar code (`super::scalar`) over the rest, the
//! same bits as a vector lane.

use super::super::par::{self, Split};
use super::super::{scalar, OptimError};
use super::Isa;
use half::bf16;
use std::num::NonZeroUsize;

struct ConvertWork<'a> {
    src: &'a [f32],
    dst: &'a mut [bf16],
}

impl Split for ConvertWork<'_> {
    fn numel(&self) -> usize {
        self.src.len()
    }
    fn split_at(self, mid: usize) -> (Self, Self) {
        let (s0, s1) = self.src.split_at(mid);
        let (d0, d1) = self.dst.split_at_mut(mid);
        (
            ConvertWork { src: s0, dst: d0 },
            ConvertWork { src: s1, dst: d1 },
        )
    }
}

struct ProbeWork<'a> {
    p: &'a mut [f32],
    g: &'a [f32],
    m: &'a mut [f32],
    v: &'a mut [f32],
}

impl Split for ProbeWork<'_> {
    fn numel(&self) -> usize {
        self.p.len()
    }
    fn split_at(self, mid: usize) -> (Self, Self) {
        let (p0, p1) = self.p.split_at_mut(mid);
        let (g0, g1) = self.g.split_at(mid);
        let (m0, m1) = self.m.split_at_mut(mid);
        let (v0, v1) = self.v.split_at_mut(mid);
        (
            ProbeWork {
                p: p0,
                g: g0,
                m: m0,
                v: v0,
            },
            ProbeWork {
                p: p1,
                g: g1,
                m: m1,
                v: v1,
            },
        )
    }
}

/// Separate fp32 -> bf16 conversion pass (round-to-nearest-even): what
/// DeepSpeed does after its optimizer step. Used as the two-pass baseline.
pub fn convert_f32_to_bf16(
    isa: Isa,
    threads: NonZeroUsize,
    src: &[f32],
    dst: &mut [bf16],
) -> Result<(), OptimError> {
    if src.len() != dst.len() {
        return Err(OptimError::LengthMismatch {
            name: "dst",
            numel: dst.len(),
            master_numel: src.len(),
        });
    }
    if !isa.is_supported() {
        return Err(OptimError::IsaUnsupported { isa });
    }
    let work = ConvertWork { src, dst };
    par::for_each_chunk(work, threads.get(), |w| convert_chunk(isa, w.src, w.dst));
    Ok(())
}

fn convert_chunk(isa: Isa, src: &[f32], dst: &mut [bf16]) {
    #[cfg(target_arch = "x86_64")]
    {
        if isa != Isa::Scalar && isa.is_supported() {
            x86::convert_chunk(isa, src, dst);
            return;
        }
    }
    let _ = isa;
    scalar::convert_bf16(src, dst);
}

/// Order of the loads and stores inside one vector step of [`rmw_probe`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProbeOrder {
    /// Load g, p, m, v, then store p, m, v (the order of the Adam body).
    Grouped,
    /// Load g; then load and store p, then m, then v.
    Interleaved,
}

/// In-place read-modify-write bandwidth probe with Adam's exact stream
/// pattern: reads `g`, reads and writes `p`, `m`, `v` (28 B/element) with
/// one add per stream. No real optimizer can move these bytes faster. The
/// two [`ProbeOrder`]s can differ in speed; a fair roof takes the faster.
pub fn rmw_probe(
    isa: Isa,
    order: ProbeOrder,
    threads: NonZeroUsize,
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
) -> Result<(), OptimError> {
    let n = p.len();
    for (name, numel) in [("grad", g.len()), ("m", m.len()), ("v", v.len())] {
        if numel != n {
            return Err(OptimError::LengthMismatch {
                name,
                numel,
                master_numel: n,
            });
        }
    }
    if !isa.is_supported() {
        return Err(OptimError::IsaUnsupported { isa });
    }
    let work = ProbeWork { p, g, m, v };
    par::for_each_chunk(work, threads.get(), |w| {
        probe_chunk(isa, order, w.p, w.g, w.m, w.v)
    });
    Ok(())
}

fn probe_chunk(
    isa: Isa,
    order: ProbeOrder,
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    {
        if isa != Isa::Scalar && isa.is_supported() {
            x86::probe_chunk(isa, order == ProbeOrder::Interleaved, p, g, m, v);
            return;
        }
    }
    let _ = (isa, order);
    scalar::probe(p, g, m, v);
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::super::scalar;
    use super::super::x86::{lanes, Avx2, Avx512, Simd};
    use super::Isa;
    use half::bf16;

    /// # Safety
    /// `S`'s instruction set is available; `src` and `dst` valid for `n`
    /// elements, `n` a multiple of `S::LANES`.
    #[inline(always)]
    unsafe fn convert_body<S: Simd>(n: usize, src: *const f32, dst: *mut u16) {
        let mut i = 0;
        while i < n {
            // SAFETY: i + LANES <= n, see the function contract.
            unsafe { S::store_h(dst.add(i), S::cvt_bf16(S::load(src.add(i)))) };
            i += S::LANES;
        }
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn convert_avx512(n: usize, src: *const f32, dst: *mut u16) {
        // SAFETY: avx512f enabled here; ranges from the caller.
        unsafe { convert_body::<Avx512>(n, src, dst) }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn convert_avx2(n: usize, src: *const f32, dst: *mut u16) {
        // SAFETY: avx2 enabled here; ranges from the caller.
        unsafe { convert_body::<Avx2>(n, src, dst) }
    }

    pub(super) fn convert_chunk(isa: Isa, src: &[f32], dst: &mut [bf16]) {
        let n = src.len().min(dst.len());
        let body_n = n - n % lanes(isa);
        let dst_ptr = dst.as_mut_ptr() as *mut u16;
        // SAFETY: `isa` checked supported by the caller (and again here);
        // both slices hold at least `body_n` elements; bf16 is
        // repr(transparent) over u16.
        unsafe {
            match isa {
                // The conversion pass keeps subnormals: plain AVX-512F code.
                Isa::Avx512 | Isa::Avx512Bf16 if isa.is_supported() => {
                    convert_avx512(body_n, src.as_ptr(), dst_ptr)
                }
                Isa::Avx2Fma if isa.is_supported() => convert_avx2(body_n, src.as_ptr(), dst_ptr),
                _ => {
                    scalar::convert_bf16(src, dst);
                    return;
                }
            }
        }
        scalar::convert_bf16(&src[body_n..n], &mut dst[body_n..n]);
    }

    /// # Safety
    /// `S`'s instruction set is available; all pointers valid for `n`
    /// elements, `n` a multiple of `S::LANES`.
    #[inline(always)]
    unsafe fn probe_body<S: Simd, const INTERLEAVED: bool>(
        n: usize,
        p: *mut f32,
        g: *const f32,
        m: *mut f32,
        v: *mut f32,
    ) {
        let mut i = 0;
        while i < n {
            // SAFETY: i + LANES <= n, see the function contract.
            unsafe {
                let gv = S::load(g.add(i));
                if INTERLEAVED {
                    S::store(p.add(i), S::add(S::load(p.add(i)), gv));
                    S::store(m.add(i), S::add(S::load(m.add(i)), gv));
                    S::store(v.add(i), S::add(S::load(v.add(i)), gv));
                    i += S::LANES;
                    continue;
                }
                let pv = S::load(p.add(i));
                let mv = S::load(m.add(i));
                let vv = S::load(v.add(i));
                S::store(p.add(i), S::add(pv, gv));
                S::store(m.add(i), S::add(mv, gv));
                S::store(v.add(i), S::add(vv, gv));
            }
            i += S::LANES;
        }
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn probe_avx512<const I: bool>(
        n: usize,
        p: *mut f32,
        g: *const f32,
        m: *mut f32,
        v: *mut f32,
    ) {
        // SAFETY: avx512f enabled here; ranges from the caller.
        unsafe { probe_body::<Avx512, I>(n, p, g, m, v) }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn probe_avx2<const I: bool>(
        n: usize,
        p: *mut f32,
        g: *const f32,
        m: *mut f32,
        v: *mut f32,
    ) {
        // SAFETY: avx2 enabled here; ranges from the caller.
        unsafe { probe_body::<Avx2, I>(n, p, g, m, v) }
    }

    pub(super) fn probe_chunk(
        isa: Isa,
        interleaved: bool,
        p: &mut [f32],
        g: &[f32],
        m: &mut [f32],
        v: &mut [f32],
    ) {
        let n = p.len().min(g.len()).min(m.len()).min(v.len());
        let body_n = n - n % lanes(isa);
        let (pp, gp, mp, vp) = (p.as_mut_ptr(), g.as_ptr(), m.as_mut_ptr(), v.as_mut_ptr());
        // SAFETY: `isa` checked supported; all four slices hold at least
        // `body_n` elements.
        unsafe {
            match isa {
                Isa::Avx512 | Isa::Avx512Bf16 if isa.is_supported() && interleaved => {
                    probe_avx512::<true>(body_n, pp, gp, mp, vp)
                }
                Isa::Avx512 | Isa::Avx512Bf16 if isa.is_supported() => {
                    probe_avx512::<false>(body_n, pp, gp, mp, vp)
                }
                Isa::Avx2Fma if isa.is_supported() && interleaved => {
                    probe_avx2::<true>(body_n, pp, gp, mp, vp)
                }
                Isa::Avx2Fma if isa.is_supported() => probe_avx2::<false>(body_n, pp, gp, mp, vp),
                _ => {
                    scalar::probe(p, g, m, v);
                    return;
                }
            }
        }
        scalar::probe(
            &mut p[body_n..n],
            &g[body_n..n],
            &mut m[body_n..n],
            &mut v[body_n..n],
        );
    }
}
