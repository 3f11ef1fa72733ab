//! LayerNorm and RMSNorm over the last dim, weight (and bias) included.

use super::*;

/// LayerNorm over the last dim (`eps`), weight and bias.
struct LayerNorm {
    eps: f64,
}

/// A row's mean and `1 / sqrt(var + eps)` (biased variance), in f64, the
/// sums in [`LANES`] partial sums ([`sum_lanes`]): a fixed order, and loops
/// that vectorize.
#[inline(always)]
fn moments<T: Real>(row: &[T], eps: f64) -> (f64, f64) {
    let n = row.len() as f64;
    let mean = sum_lanes([row], |[x]| x) / n;
    let var = sum_lanes([row], |[x]| {
        let d = x - mean;
        d * d
    }) / n;
    (mean, 1.0 / (var + eps).sqrt())
}

/// A norm's backward over the rows (`n` wide) of `x` and `g`: `row(x_row,
/// g_row, dx_row, acc)` writes one row of `dx` and adds the row's terms to
/// `sums` column sums ([`par_rows_summing`]).
#[inline(always)]
fn bwd_by_row<T: Real>(
    x: &[T],
    g: &[T],
    n: usize,
    sums: usize,
    row: impl Fn(&[T], &[T], &mut [T], &mut [Vec<f64>]) + Sync + Send,
) -> (Vec<T>, Vec<Vec<T>>) {
    let mut dx = vec![T::of(0.0); x.len()];
    let sums = par_rows_summing(
        &mut dx,
        n,
        sums,
        #[inline(always)]
        |r0, d, acc| {
            for (k, d) in d.chunks_exact_mut(n).enumerate() {
                let r = r0 + k;
                row(&x[r * n..(r + 1) * n], &g[r * n..(r + 1) * n], d, acc);
            }
        },
    );
    (dx, sums)
}

impl LayerNorm {
    fn fwd<T: Real>(&self, x: &[T], w: &[T], b: &[T]) -> Vec<T> {
        let n = w.len();
        let mut out = vec![T::of(0.0); x.len()];
        par_rows(
            &mut out,
            n,
            #[inline(always)]
            |r0, o| {
                for (o, row) in o.chunks_exact_mut(n).zip(x[r0 * n..].chunks_exact(n)) {
                    let (mean, rstd) = moments(row, self.eps);
                    for (((o, &x), &w), &b) in o.iter_mut().zip(row).zip(w).zip(b) {
                        *o = T::of((x.f() - mean) * rstd * w.f() + b.f());
                    }
                }
            },
        );
        out
    }

    /// `(dx, dw, db)`, in one pass over the rows (each row's moments
    /// once).
    fn bwd_rows<T: Real>(&self, x: &[T], w: &[T], g: &[T]) -> (Vec<T>, Vec<T>, Vec<T>) {
        let n = w.len();
        let (dx, mut sums) = bwd_by_row(
            x,
            g,
            n,
            2,
            #[inline(always)]
            |xr, gr, d, acc| {
                let (xr, gr, w) = (&xr[..n], &gr[..n], &w[..n]);
                let (mean, rstd) = moments(xr, self.eps);
                // The row sums in lanes, the column sums in their own loop:
                // one loop doing both did not vectorize.
                let s1 = sum_lanes([gr, w], |[g, w]| g * w);
                let s2 = sum_lanes([gr, w, xr], |[g, w, x]| g * w * (x - mean) * rstd);
                let [a0, a1] = acc else {
                    unreachable!("two column sums")
                };
                for (((a0, a1), &x), &g) in a0.iter_mut().zip(a1.iter_mut()).zip(xr).zip(gr) {
                    *a0 += g.f() * (x.f() - mean) * rstd;
                    *a1 += g.f();
                }
                let (m1, m2) = (s1 / n as f64, s2 / n as f64);
                for j in 0..n {
                    let xhat = (xr[j].f() - mean) * rstd;
                    d[j] = T::of(rstd * (gr[j].f() * w[j].f() - m1 - xhat * m2));
                }
            },
        );
        let db = sums.pop().unwrap_or_default();
        let dw = sums.pop().unwrap_or_default();
        (dx, dw, db)
    }
}

impl CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        "tz-layer-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let n = row_len(l1.shape())?;
        if l2.shape().elem_count() != n || l3.shape().elem_count() != n {
            return Err(candle_core::Error::Msg("layer norm: weight length".into()));
        }
        let out = match s1 {
            CpuStorage::F32(_) => {
                f32::storage(self.fwd(elems(s1, l1)?, elems(s2, l2)?, elems(s3, l3)?))
            }
            CpuStorage::F64(_) => {
                f64::storage(self.fwd(elems(s1, l1)?, elems(s2, l2)?, elems(s3, l3)?))
            }
            _ => return Err(candle_core::Error::Msg("layer norm: dtype".into())),
        };
        Ok((out, l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        fn run<T: Real>(
            op: &LayerNorm,
            x: &Tensor,
            w: &Tensor,
            b: &Tensor,
            g: &Tensor,
        ) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
            with_elems3::<T, _>(x, w, g, |xs, ws, gs| {
                let (dx, dw, db) = op.bwd_rows(xs, ws, gs);
                Ok((
                    T::tensor(dx, x.shape())?,
                    T::tensor(dw, w.shape())?,
                    T::tensor(db, b.shape())?,
                ))
            })
        }
        let (dx, dw, db) = match x.dtype() {
            DType::F32 => run::<f32>(self, x, w, b, g)?,
            _ => run::<f64>(self, x, w, b, g)?,
        };
        Ok((Some(dx), Some(dw), Some(db)))
    }
}

/// LayerNorm over the last dim (fused when it can be; else
/// [`ops::layer_norm`]).
pub fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    let n = x.dims().last().copied().unwrap_or(0);
    if fusable(&[x, w, b]) && n > 0 && w.elem_count() == n && b.elem_count() == n {
        x.contiguous()?
            .apply_op3(&w.contiguous()?, &b.contiguous()?, LayerNorm { eps })
    } else {
        ops::layer_norm(x, w, b, eps)
    }
}

/// RMSNorm over the last dim (`eps`), weight.
struct RmsNorm {
    eps: f64,
}

impl RmsNorm {
    #[inline(always)]
    fn rstd<T: Real>(&self, row: &[T]) -> f64 {
        let ms = sum_lanes([row], |[x]| x * x) / row.len() as f64;
        1.0 / (ms + self.eps).sqrt()
    }

    fn fwd_rows<T: Real>(&self, x: &[T], w: &[T]) -> Vec<T> {
        let n = w.len();
        let mut out = vec![T::of(0.0); x.len()];
        par_rows(
            &mut out,
            n,
            #[inline(always)]
            |r0, o| {
                for (o, row) in o.chunks_exact_mut(n).zip(x[r0 * n..].chunks_exact(n)) {
                    let rstd = self.rstd(row);
                    for ((o, &x), &w) in o.iter_mut().zip(row).zip(w) {
                        *o = T::of(x.f() * rstd * w.f());
                    }
                }
            },
        );
        out
    }

    /// `(dx, dw)`, in one pass over the rows.
    fn bwd_rows<T: Real>(&self, x: &[T], w: &[T], g: &[T]) -> (Vec<T>, Vec<T>) {
        let n = w.len();
        let (dx, mut sums) = bwd_by_row(
            x,
            g,
            n,
            1,
            #[inline(always)]
            |xr, gr, d, acc| {
                let (xr, gr, w) = (&xr[..n], &gr[..n], &w[..n]);
                let rstd = self.rstd(xr);
                let s = sum_lanes([gr, w, xr], |[g, w, x]| g * w * x * rstd);
                let m = s / n as f64;
                for j in 0..n {
                    let xhat = xr[j].f() * rstd;
                    d[j] = T::of(rstd * (gr[j].f() * w[j].f() - xhat * m));
                    acc[0][j] += gr[j].f() * xr[j].f() * rstd;
                }
            },
        );
        (dx, sums.pop().unwrap_or_default())
    }
}

impl Forward2 for RmsNorm {
    fn run<T: Real>(&self, x: &[T], w: &[T]) -> Vec<T> {
        self.fwd_rows(x, w)
    }
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "tz-rms-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        per_row(l1, l2, "rms norm")?;
        cpu_fwd2(self, "rms norm", (s1, l1), (s2, l2))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        fn run<T: Real>(
            op: &RmsNorm,
            x: &Tensor,
            w: &Tensor,
            g: &Tensor,
        ) -> candle_core::Result<(Tensor, Tensor)> {
            with_elems3::<T, _>(x, w, g, |xs, ws, gs| {
                let (dx, dw) = op.bwd_rows(xs, ws, gs);
                Ok((T::tensor(dx, x.shape())?, T::tensor(dw, w.shape())?))
            })
        }
        let (dx, dw) = match x.dtype() {
            DType::F32 => run::<f32>(self, x, w, g)?,
            _ => run::<f64>(self, x, w, g)?,
        };
        Ok((Some(dx), Some(dw)))
    }
}

/// RMSNorm over the last dim (fused when it can be; else
/// [`ops::rms_norm`]).
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    let n = x.dims().last().copied().unwrap_or(0);
    if fusable(&[x, w]) && n > 0 && w.elem_count() == n {
        x.contiguous()?.apply_op2(&w.contiguous()?, RmsNorm { eps })
    } else {
        ops::rms_norm(x, w, eps)
    }
}
