//! The rotary embedding fused with the split into heads: `x [b, t, n · d]`
//! (a projection's rows, or `[b, t, n, d]` after a per-head norm) to
//! `rope(x) [b, n, t, d]`, one candle op in place of eight (a reshape, a
//! transpose and a copy to split the heads; two `narrow`s, a `neg`, a `cat`,
//! two broadcast products and an add for `x cos + rotate_half(x) sin`).
//!
//! Each value is computed as the composition computes it: the two
//! products rounded to `T`, then their sum rounded to `T` (products and
//! sums of two `T` values are exact in f64, so rounding those once is
//! `T`'s own arithmetic), so the fused and the composed paths give the same
//! bits. The backward is the transpose: `dx_j = g_j cos_j + g_{j+½}
//! sin_{j+½}` in the first half, `g_j cos_j − g_{j−½} sin_{j−½}` in the
//! second, written back in the input's layout. Tasks are `[t, d]` heads
//! forward and batch elements backward, each writing its own rows.

use super::*;

/// The op: `n` heads of `d`; the tables are `[t, d]`.
struct RopeHeads {
    n: usize,
}

/// Sizes of one call.
#[derive(Debug, Clone, Copy)]
struct Dims {
    t: usize,
    n: usize,
    d: usize,
}

impl RopeHeads {
    /// Checks `x` (`[b, t, n · d]` or `[b, t, n, d]`) against the tables.
    fn dims(&self, x: &Shape, cos: &Shape, sin: &Shape) -> candle_core::Result<(usize, Dims)> {
        let bad = || {
            candle_core::Error::Msg(format!(
                "rotary embedding: x {x:?} as {} heads, tables {cos:?} and {sin:?}",
                self.n
            ))
        };
        let (b, t, w) = match *x.dims() {
            [b, t, w] => (b, t, w),
            [b, t, n, d] if n == self.n => (b, t, n * d),
            _ => return Err(bad()),
        };
        if self.n == 0 || !w.is_multiple_of(self.n) {
            return Err(bad());
        }
        let d = w / self.n;
        if !d.is_multiple_of(2) || cos.dims() != [t, d] || sin.dims() != [t, d] {
            return Err(bad());
        }
        Ok((b, Dims { t, n: self.n, d }))
    }

    fn fwd<T: Real>(&self, x: &[T], cos: &[T], sin: &[T], m: Dims) -> Vec<T> {
        let (t, n, d, half) = (m.t, m.n, m.d, m.d / 2);
        let mut out = vec![T::of(0.0); x.len()];
        out.par_chunks_mut(t * d).enumerate().for_each(|(bh, o)| {
            let (bi, h) = (bh / n, bh % n);
            for (i, o) in o.chunks_exact_mut(d).enumerate() {
                let at = (bi * t + i) * n * d + h * d;
                let xr = &x[at..at + d];
                let (c, s) = (&cos[i * d..(i + 1) * d], &sin[i * d..(i + 1) * d]);
                for j in 0..d {
                    let rot = if j < half {
                        -xr[j + half].f()
                    } else {
                        xr[j - half].f()
                    };
                    let a = T::of(xr[j].f() * c[j].f()).f();
                    let b = T::of(rot * s[j].f()).f();
                    o[j] = T::of(a + b);
                }
            }
        });
        out
    }

    fn bwd<T: Real>(&self, g: &[T], cos: &[T], sin: &[T], m: Dims) -> Vec<T> {
        let (t, n, d, half) = (m.t, m.n, m.d, m.d / 2);
        let mut dx = vec![T::of(0.0); g.len()];
        dx.par_chunks_mut(t * n * d)
            .enumerate()
            .for_each(|(bi, dxb)| {
                for (i, row) in dxb.chunks_exact_mut(n * d).enumerate() {
                    let (c, s) = (&cos[i * d..(i + 1) * d], &sin[i * d..(i + 1) * d]);
                    for (h, dxr) in row.chunks_exact_mut(d).enumerate() {
                        let at = ((bi * n + h) * t + i) * d;
                        let gr = &g[at..at + d];
                        for j in 0..d {
                            let a = T::of(gr[j].f() * c[j].f()).f();
                            let b = if j < half {
                                T::of(gr[j + half].f() * s[j + half].f()).f()
                            } else {
                                -T::of(gr[j - half].f() * s[j - half].f()).f()
                            };
                            dxr[j] = T::of(a + b);
                        }
                    }
                }
            });
        dx
    }
}

impl CustomOp3 for RopeHeads {
    fn name(&self) -> &'static str {
        "tz-rope-heads"
    }

    fn cpu_fwd(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sc: &CpuStorage,
        lc: &Layout,
        ss: &CpuStorage,
        ls: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (b, m) = self.dims(lx.shape(), lc.shape(), ls.shape())?;
        let out = match sx {
            CpuStorage::F32(_) => {
                f32::storage(self.fwd(elems(sx, lx)?, elems(sc, lc)?, elems(ss, ls)?, m))
            }
            CpuStorage::F64(_) => {
                f64::storage(self.fwd(elems(sx, lx)?, elems(sc, lc)?, elems(ss, ls)?, m))
            }
            _ => return Err(candle_core::Error::Msg("rotary embedding: dtype".into())),
        };
        Ok((out, Shape::from((b, m.n, m.t, m.d))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (_, m) = self.dims(x.shape(), cos.shape(), sin.shape())?;
        let dx = match x.dtype() {
            DType::F32 => with_elems3::<f32, _>(g, cos, sin, |g, c, s| {
                f32::tensor(self.bwd(g, c, s, m), x.shape())
            })?,
            _ => with_elems3::<f64, _>(g, cos, sin, |g, c, s| {
                f64::tensor(self.bwd(g, c, s, m), x.shape())
            })?,
        };
        // The tables are constants: no gradient.
        Ok((Some(dx), None, None))
    }
}

/// `x [b, t, n · d]` (or `[b, t, n, d]`) split into `n` heads and rotated:
/// `[b, n, t, d]` of `x cos + rotate_half(x) sin`, `cos, sin [t, d]`.
/// Fused when it can be; else the head split and [`ops::apply_rope`].
pub fn rope_heads(x: &Tensor, n: usize, cos: &Tensor, sin: &Tensor) -> candle_core::Result<Tensor> {
    if fusable(&[x, cos, sin]) && x.elem_count() > 0 {
        return x
            .contiguous()?
            .apply_op3(&cos.contiguous()?, &sin.contiguous()?, RopeHeads { n });
    }
    let (b, t) = (x.dim(0)?, x.dim(1)?);
    let d = x.elem_count() / (b * t * n.max(1)).max(1);
    let heads = x.reshape((b, t, n, d))?.transpose(1, 2)?.contiguous()?;
    ops::apply_rope(&heads, cos, sin)
}
