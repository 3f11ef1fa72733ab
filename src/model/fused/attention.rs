//! The attention's fused ops: the causal softmax (scale and mask folded
//! in) and GQA's `repeat_kv`. The whole attention of a block's heads, which
//! uses the softmax's rows, is [`super::sdpa`].

use super::*;

/// `softmax(scale · s + causal mask)` over the last dim of scores
/// `s [.., t, t]`, query `i` seeing keys `j ≤ i` (within `window`, see
/// [`ops::causal_mask_window`]); masked probabilities are exactly 0.
#[derive(Debug, Clone, Copy)]
pub(super) struct CausalSoftmax {
    pub(super) scale: f64,
    pub(super) window: Option<usize>,
}

/// The max and the min of `xs` (as f64), NaN ignored as `f64::max` does;
/// `(-inf, inf)` for no elements.
#[inline(always)]
fn max_min<T: Real>(xs: &[T]) -> (f64, f64) {
    let (mut hi, mut lo) = ([f64::NEG_INFINITY; LANES], [f64::INFINITY; LANES]);
    let mut lane = |k: usize, x: f64| {
        hi[k] = if x > hi[k] { x } else { hi[k] };
        lo[k] = if x < lo[k] { x } else { lo[k] };
    };
    let chunks = xs.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for (k, x) in c.iter().enumerate() {
            lane(k, x.f());
        }
    }
    for (k, x) in rest.iter().enumerate() {
        lane(k, x.f());
    }
    (
        hi.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        lo.iter().copied().fold(f64::INFINITY, f64::min),
    )
}

impl CausalSoftmax {
    /// The keys row `i` sees: `lo..=i`.
    fn lo(&self, i: usize) -> usize {
        match self.window {
            Some(w) if w > 0 => (i + 1).saturating_sub(w),
            _ => 0,
        }
    }

    /// Row `i` of the probabilities, in place: `row` holds the scores and
    /// gets `softmax(scale · row[lo..=i])` there and exact zeros elsewhere.
    /// The max and the sum are f64, in [`LANES`] interleaved partial
    /// results (element `j` in lane `j % LANES`) combined in lane order: a
    /// fixed order, whatever the threads, and no chain of dependent adds,
    /// so the loops vectorize.
    #[inline(always)]
    pub(super) fn row_in_place<T: Real>(&self, i: usize, row: &mut [T]) {
        let lo = self.lo(i);
        // Rounding is monotonic, so the max of the scaled scores is the
        // scaled max (the scaled min for a negative scale).
        let (hi, low) = max_min(&row[lo..=i]);
        let max = self.scale * if self.scale >= 0.0 { hi } else { low };
        // The exponentials first, a plain map that vectorizes, then their
        // sum over the stored values: `T::of(e)` is `e` exactly (`exp_in`
        // rounds to `T`), so this is the sum of the same terms.
        let seen = &mut row[lo..=i];
        for x in seen.iter_mut() {
            *x = T::of(T::exp_in(self.scale * x.f() - max));
        }
        let total = sum_lanes([&*seen], |[e]| e);
        // One division a row (the f64 reciprocal is within an ulp of each
        // quotient, far below `T`'s rounding).
        let inv = 1.0 / total;
        for x in &mut row[lo..=i] {
            *x = T::of(x.f() * inv);
        }
        row[..lo].fill(T::of(0.0));
        row[i + 1..].fill(T::of(0.0));
    }

    /// Row `i` of the scores' gradient, in place: `d` holds the
    /// probabilities' gradient `g` and gets `scale · y ⊙ (g − Σ g ⊙ y)`
    /// (the sum in f64, in [`LANES`] partial sums as
    /// [`Self::row_in_place`]'s), exact zeros where masked.
    #[inline(always)]
    pub(super) fn bwd_row_in_place<T: Real>(&self, i: usize, y: &[T], d: &mut [T]) {
        let lo = self.lo(i);
        let (ys, ds) = (&y[lo..=i], &mut d[lo..=i]);
        let dot = sum_lanes([&*ds, ys], |[d, y]| d * y);
        for (d, y) in ds.iter_mut().zip(ys) {
            *d = T::of(self.scale * y.f() * (d.f() - dot));
        }
        d[..lo].fill(T::of(0.0));
        d[i + 1..].fill(T::of(0.0));
    }

    /// The probabilities of scores `s` (rows of `t`, query `row % t`).
    fn fwd<T: Real>(&self, s: &[T], t: usize) -> Vec<T> {
        let mut out = s.to_vec();
        par_rows(
            &mut out,
            t,
            #[inline(always)]
            |r0, o| {
                for (k, row) in o.chunks_exact_mut(t).enumerate() {
                    self.row_in_place((r0 + k) % t, row);
                }
            },
        );
        out
    }

    /// `d s = scale · y ⊙ (g − Σ g ⊙ y)` per row.
    fn bwd_rows<T: Real>(&self, y: &[T], g: &[T], t: usize) -> Vec<T> {
        let mut ds = g.to_vec();
        par_rows(
            &mut ds,
            t,
            #[inline(always)]
            |r0, d| {
                for (k, d) in d.chunks_exact_mut(t).enumerate() {
                    let r = r0 + k;
                    self.bwd_row_in_place(r % t, &y[r * t..(r + 1) * t], d);
                }
            },
        );
        ds
    }
}

impl CustomOp1 for CausalSoftmax {
    fn name(&self) -> &'static str {
        "tz-causal-softmax"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let t = row_len(l.shape())?;
        let dims = l.shape().dims();
        if dims.len() < 2 || dims[dims.len() - 2] != t {
            return Err(candle_core::Error::Msg(
                "causal softmax: scores are not [.., t, t]".into(),
            ));
        }
        let out = match s {
            CpuStorage::F32(_) => f32::storage(self.fwd(elems::<f32>(s, l)?, t)),
            CpuStorage::F64(_) => f64::storage(self.fwd(elems::<f64>(s, l)?, t)),
            _ => return Err(candle_core::Error::Msg("causal softmax: dtype".into())),
        };
        Ok((out, l.shape().clone()))
    }

    fn bwd(&self, s: &Tensor, y: &Tensor, g: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let t = s.dims().last().copied().unwrap_or(1);
        let ds = match s.dtype() {
            DType::F32 => with_elems::<f32, _>(y, |ys| {
                with_elems::<f32, _>(g, |gs| f32::tensor(self.bwd_rows(ys, gs, t), s.shape()))
            })?,
            _ => with_elems::<f64, _>(y, |ys| {
                with_elems::<f64, _>(g, |gs| f64::tensor(self.bwd_rows(ys, gs, t), s.shape()))
            })?,
        };
        Ok(Some(ds))
    }
}

/// `softmax(scale · scores + causal mask)` over the last dim of
/// `scores [.., t, t]` (fused when it can be; else the primitive
/// composition: affine, the mask of [`ops::causal_mask_window`], and
/// [`ops::softmax_last`]).
pub fn causal_softmax(
    scores: &Tensor,
    scale: f64,
    window: Option<usize>,
) -> candle_core::Result<Tensor> {
    let dims = scores.dims();
    let square = dims.len() >= 2 && dims[dims.len() - 1] == dims[dims.len() - 2];
    if fusable(&[scores]) && square && dims[dims.len() - 1] > 0 {
        scores
            .contiguous()?
            .apply_op1(CausalSoftmax { scale, window })
    } else {
        let t = dims.last().copied().unwrap_or(0);
        let att = scores.affine(scale, 0.0)?;
        let mask = ops::causal_mask_window(t, window, att.dtype(), att.device())?;
        ops::softmax_last(&att.broadcast_add(&mask)?)
    }
}

/// `[b, kv, t, d] -> [b, kv · n_rep, t, d]`, each head repeated `n_rep`
/// times in place (GQA's `repeat_kv`).
struct RepeatKv {
    n_rep: usize,
}

impl RepeatKv {
    fn fwd<T: Real>(&self, x: &[T], block: usize) -> Vec<T> {
        let mut out = vec![T::of(0.0); x.len() * self.n_rep];
        out.par_chunks_mut(block * self.n_rep)
            .zip(x.par_chunks(block))
            .for_each(|(o, x)| {
                for o in o.chunks_exact_mut(block) {
                    o.copy_from_slice(x);
                }
            });
        out
    }

    /// Sums the `n_rep` copies of each head's gradient, in copy order.
    fn bwd_heads<T: Real>(&self, g: &[T], block: usize) -> Vec<T> {
        let mut dx = vec![T::of(0.0); g.len() / self.n_rep];
        dx.par_chunks_mut(block)
            .zip(g.par_chunks(block * self.n_rep))
            .for_each(|(d, g)| {
                for (j, d) in d.iter_mut().enumerate() {
                    let mut acc = 0f64;
                    for r in 0..self.n_rep {
                        acc += g[r * block + j].f();
                    }
                    *d = T::of(acc);
                }
            });
        dx
    }
}

impl CustomOp1 for RepeatKv {
    fn name(&self) -> &'static str {
        "tz-repeat-kv"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let &[b, kv, t, d] = l.shape().dims() else {
            return Err(candle_core::Error::Msg(
                "repeat_kv: not [b, kv, t, d]".into(),
            ));
        };
        let out = match s {
            CpuStorage::F32(_) => f32::storage(self.fwd(elems::<f32>(s, l)?, t * d)),
            CpuStorage::F64(_) => f64::storage(self.fwd(elems::<f64>(s, l)?, t * d)),
            _ => return Err(candle_core::Error::Msg("repeat_kv: dtype".into())),
        };
        Ok((out, Shape::from((b, kv * self.n_rep, t, d))))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, g: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let (_, _, t, d) = x.dims4()?;
        let dx = match x.dtype() {
            DType::F32 => {
                with_elems::<f32, _>(g, |gs| f32::tensor(self.bwd_heads(gs, t * d), x.shape()))?
            }
            _ => with_elems::<f64, _>(g, |gs| f64::tensor(self.bwd_heads(gs, t * d), x.shape()))?,
        };
        Ok(Some(dx))
    }
}

/// Repeats key/value heads `[b, kv, t, d] -> [b, kv · n_rep, t, d]` (fused
/// when it can be; else [`ops::repeat_kv`]).
pub fn repeat_kv(x: &Tensor, n_rep: usize) -> candle_core::Result<Tensor> {
    if n_rep == 1 {
        return Ok(x.clone());
    }
    if fusable(&[x]) && x.rank() == 4 && x.elem_count() > 0 {
        x.contiguous()?.apply_op1(RepeatKv { n_rep })
    } else {
        ops::repeat_kv(x, n_rep)
    }
}
