//! The whole causal attention of a block's heads as one op:
//! `softmax(scale · q kᵀ + mask) v`, with GQA (query head `h` reads
//! key/value head `h / (nh / nkv)`, no repeated copy).
//!
//! # Why
//!
//! candle's backward adds every gradient into a zero tensor of its input's
//! size, node by node, on one thread (`GradStore::or_insert`, then `add`):
//! in a single-thread profile of a stage-0 GPT-2 step that zeroing and
//! adding were a fifth of all samples, more than anything but the matmuls.
//! The composition this op replaces was up to sixteen nodes a block:
//!
//! * GPT-2: three `narrow`s of the packed `qkv` projection (each `narrow`'s
//!   backward is a zero tensor of the whole `qkv` with the slice copied in,
//!   then added), a reshape, transpose and copy per head split, `kᵀ`, the
//!   scores' matmul, the softmax, the values' matmul, and a transpose,
//!   copy and reshape to merge the heads;
//! * Llama: the same without the `narrow`s, plus `repeat_kv` for keys and
//!   values.
//!
//! Here the inputs are read where they are ([`HeadsAt`]): GPT-2's packed
//! `qkv [b, t, 3h]` itself, Llama's `q` and `k` in the `[b, n, t, d]` the
//! rotary embedding left them in, `v` straight from its projection, and
//! the output is written merged, `[b, t, nh · d]`. Nothing but the inputs
//! is kept for backward: each head's probabilities are recomputed from `q`
//! and `k` (one `q kᵀ` more a head, as FlashAttention does), so a kept
//! block no longer holds `b · nh · t²` scores and probabilities.
//!
//! # Order and threads
//!
//! A task is one key/value head of one batch element (`b · nkv` tasks on
//! rayon): it computes its query heads' products with [`super::matmul`]
//! on its own thread, into dense buffers of its own, and the results are
//! copied into place after, in task order. A key/value head's gradient
//! sums its query heads in head order. So no result depends on the thread
//! count. The softmax rows are [`super::attention`]'s (`row_in_place`,
//! f64 statistics, masked probabilities exact zeros); the fused and the
//! composed paths differ only in the matmuls' summation order.

use super::attention::CausalSoftmax;
use super::matmul::{matmul, Mat};
use super::*;

/// Where an input's heads are in its (contiguous) tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HeadsAt {
    /// `[b, n, t, d]`: head `h` of batch element `bi` is the dense `[t, d]`
    /// block at `((bi · n + h) · t) · d`.
    Split,
    /// `[b, t, width]` rows, head `h`'s `d` columns from `col0 + h · d`: a
    /// projection's own output (`col0` picks q, k or v in a packed one).
    Rows { width: usize, col0: usize },
}

/// One input: its `n` heads and where they are.
#[derive(Debug, Clone, Copy)]
struct Input {
    n: usize,
    at: HeadsAt,
}

/// The sizes of one call.
#[derive(Debug, Clone, Copy)]
struct Dims {
    b: usize,
    nh: usize,
    nkv: usize,
    t: usize,
    d: usize,
}

impl Input {
    /// Whether every head's view lies in one batch element's chunk.
    fn fits(&self, m: Dims) -> bool {
        match self.at {
            HeadsAt::Split => true,
            HeadsAt::Rows { width, col0 } => col0 + self.n * m.d <= width,
        }
    }

    /// Elements of one batch element's chunk of the tensor.
    fn batch_elems(&self, m: Dims) -> usize {
        match self.at {
            HeadsAt::Split => self.n * m.t * m.d,
            HeadsAt::Rows { width, .. } => m.t * width,
        }
    }

    /// Head `h` of batch element `bi`: its `[t, d]` view.
    fn head<'a, T>(&self, data: &'a [T], m: Dims, bi: usize, h: usize) -> Mat<'a, T> {
        let (offset, row_stride) = self.place(m, bi, h);
        Mat::strided(&data[offset.min(data.len())..], m.t, m.d, row_stride)
    }

    /// The offset of head `h` of batch element `bi`, and its row stride.
    fn place(&self, m: Dims, bi: usize, h: usize) -> (usize, usize) {
        let base = bi * self.batch_elems(m);
        match self.at {
            HeadsAt::Split => (base + h * m.t * m.d, m.d),
            HeadsAt::Rows { width, col0 } => (base + col0 + h * m.d, width),
        }
    }

    /// Copies a dense `[t, d]` block into head `h` of batch element `bi`
    /// of `dst` (laid out as this input).
    fn scatter<T: Copy>(&self, dst: &mut [T], m: Dims, bi: usize, h: usize, block: &[T]) {
        let (offset, row_stride) = self.place(m, bi, h);
        for (i, row) in block.chunks_exact(m.d).enumerate() {
            let at = offset + i * row_stride;
            dst[at..at + m.d].copy_from_slice(row);
        }
    }
}

/// The attention, given where its inputs are.
#[derive(Debug, Clone, Copy)]
struct Sdpa {
    soft: CausalSoftmax,
    q: Input,
    k: Input,
    v: Input,
}

/// One task's gradients: its query heads' `dq` (dense `[rep, t, d]`), and
/// its key/value head's `dk` and `dv` (dense `[t, d]`).
type TaskGrads<T> = (Vec<T>, Vec<T>, Vec<T>);

impl Sdpa {
    fn rep(&self) -> usize {
        self.q.n / self.k.n
    }

    /// The sizes, checked against the tensors' lengths (`q_len` etc.).
    fn dims(&self, b: usize, t: usize, d: usize, lens: [usize; 3]) -> candle_core::Result<Dims> {
        let m = Dims {
            b,
            nh: self.q.n,
            nkv: self.k.n,
            t,
            d,
        };
        let ok = self.k.n > 0
            && self.v.n == self.k.n
            && self.q.n.is_multiple_of(self.k.n)
            && [self.q, self.k, self.v]
                .iter()
                .zip(lens)
                .all(|(i, len)| b * i.batch_elems(m) == len && i.fits(m));
        if !ok {
            return Err(candle_core::Error::Msg(format!(
                "attention: {} query heads, {} key and {} value heads of [{t}, {d}] over a \
                 batch of {b} do not fit the inputs ({lens:?} elements)",
                self.q.n, self.k.n, self.v.n
            )));
        }
        Ok(m)
    }

    /// One query head's probabilities into `p` (`t × t`).
    fn probs<T: Real>(&self, q: Mat<'_, T>, k: Mat<'_, T>, p: &mut [T]) -> candle_core::Result<()> {
        let t = q.rows_len();
        matmul(p, q, k.t(), T::of(1.0), false)?;
        crate::wide::run(
            #[inline(always)]
            || {
                for (i, row) in p.chunks_exact_mut(t).enumerate() {
                    self.soft.row_in_place(i, row);
                }
            },
        );
        Ok(())
    }

    /// `y [b, t, nh · d]` from the inputs (`q`, `k`, `v` may be one
    /// slice, packed).
    fn fwd<T: Real>(&self, q: &[T], k: &[T], v: &[T], m: Dims) -> candle_core::Result<Vec<T>> {
        let (t, d, rep) = (m.t, m.d, self.rep());
        let outs: Vec<Vec<T>> = (0..m.b * m.nkv)
            .into_par_iter()
            .map_init(
                || vec![T::of(0.0); t * t],
                |p, task| -> candle_core::Result<Vec<T>> {
                    let (bi, kv) = (task / m.nkv, task % m.nkv);
                    let (kh, vh) = (self.k.head(k, m, bi, kv), self.v.head(v, m, bi, kv));
                    let mut y = vec![T::of(0.0); rep * t * d];
                    for (r, yh) in y.chunks_exact_mut(t * d).enumerate() {
                        self.probs(self.q.head(q, m, bi, kv * rep + r), kh, p)?;
                        matmul(yh, Mat::rows(p, t, t), vh, T::of(1.0), false)?;
                    }
                    Ok(y)
                },
            )
            .collect::<candle_core::Result<_>>()?;
        let out = Input {
            n: m.nh,
            at: HeadsAt::Rows {
                width: m.nh * d,
                col0: 0,
            },
        };
        let mut y = vec![T::of(0.0); m.b * t * m.nh * d];
        for (task, heads) in outs.iter().enumerate() {
            let (bi, kv) = (task / m.nkv, task % m.nkv);
            for (r, block) in heads.chunks_exact(t * d).enumerate() {
                out.scatter(&mut y, m, bi, kv * rep + r, block);
            }
        }
        Ok(y)
    }

    /// The gradients of the inputs from the output's `g [b, t, nh · d]`:
    /// per task, for each query head in order, the probabilities again,
    /// then `dV += Pᵀ g`, `dS = softmax'(g vᵀ)`, `dQ = dS k`, `dK += dSᵀ q`.
    fn bwd<T: Real>(
        &self,
        (q, k, v): (&[T], &[T], &[T]),
        g: &[T],
        m: Dims,
    ) -> candle_core::Result<Vec<TaskGrads<T>>> {
        let (t, d, rep) = (m.t, m.d, self.rep());
        let out = Input {
            n: m.nh,
            at: HeadsAt::Rows {
                width: m.nh * d,
                col0: 0,
            },
        };
        (0..m.b * m.nkv)
            .into_par_iter()
            .map_init(
                || (vec![T::of(0.0); t * t], vec![T::of(0.0); t * t]),
                |(p, ds), task| -> candle_core::Result<TaskGrads<T>> {
                    let (bi, kv) = (task / m.nkv, task % m.nkv);
                    let (kh, vh) = (self.k.head(k, m, bi, kv), self.v.head(v, m, bi, kv));
                    let mut dq = vec![T::of(0.0); rep * t * d];
                    let (mut dk, mut dv) = (vec![T::of(0.0); t * d], vec![T::of(0.0); t * d]);
                    let one = T::of(1.0);
                    for (r, dqh) in dq.chunks_exact_mut(t * d).enumerate() {
                        let h = kv * rep + r;
                        let (qh, gh) = (self.q.head(q, m, bi, h), out.head(g, m, bi, h));
                        self.probs(qh, kh, p)?;
                        matmul(&mut dv, Mat::rows(p, t, t).t(), gh, one, r > 0)?;
                        matmul(ds, gh, vh.t(), one, false)?;
                        crate::wide::run(
                            #[inline(always)]
                            || {
                                for (i, (y, dsr)) in
                                    p.chunks_exact(t).zip(ds.chunks_exact_mut(t)).enumerate()
                                {
                                    self.soft.bwd_row_in_place(i, y, dsr);
                                }
                            },
                        );
                        matmul(dqh, Mat::rows(ds, t, t), kh, one, false)?;
                        matmul(&mut dk, Mat::rows(ds, t, t).t(), qh, one, r > 0)?;
                    }
                    Ok((dq, dk, dv))
                },
            )
            .collect()
    }

    /// Copies the tasks' gradients into `dq`, `dk`, `dv` laid out as the
    /// inputs (one buffer for a packed input: pass the same index).
    fn scatter_grads<T: Copy>(
        &self,
        bufs: &mut [Vec<T>],
        which: [usize; 3],
        grads: &[TaskGrads<T>],
        m: Dims,
    ) {
        let (t, d, rep) = (m.t, m.d, self.rep());
        for (task, (dq, dk, dv)) in grads.iter().enumerate() {
            let (bi, kv) = (task / m.nkv, task % m.nkv);
            for (r, block) in dq.chunks_exact(t * d).enumerate() {
                self.q
                    .scatter(&mut bufs[which[0]], m, bi, kv * rep + r, block);
            }
            self.k.scatter(&mut bufs[which[1]], m, bi, kv, dk);
            self.v.scatter(&mut bufs[which[2]], m, bi, kv, dv);
        }
    }
}

/// GPT-2's form: the packed `qkv [b, t, 3 · nh · d]` (q, k, v side by
/// side, as `c_attn` writes them) to the merged output `[b, t, nh · d]`.
struct PackedSdpa {
    sdpa: Sdpa,
    d: usize,
}

impl CustomOp1 for PackedSdpa {
    fn name(&self) -> &'static str {
        "tz-attention-packed"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let &[b, t, w] = l.shape().dims() else {
            return Err(candle_core::Error::Msg(
                "attention: qkv is not [b, t, 3h]".into(),
            ));
        };
        let n = b * t * w;
        let m = self.sdpa.dims(b, t, self.d, [n, n, n])?;
        let out = match s {
            CpuStorage::F32(_) => {
                let x = elems::<f32>(s, l)?;
                f32::storage(self.sdpa.fwd(x, x, x, m)?)
            }
            CpuStorage::F64(_) => {
                let x = elems::<f64>(s, l)?;
                f64::storage(self.sdpa.fwd(x, x, x, m)?)
            }
            _ => return Err(candle_core::Error::Msg("attention: dtype".into())),
        };
        Ok((out, Shape::from((b, t, w / 3))))
    }

    fn bwd(&self, qkv: &Tensor, _y: &Tensor, g: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let (b, t, _) = qkv.dims3()?;
        let n = qkv.elem_count();
        let m = self.sdpa.dims(b, t, self.d, [n, n, n])?;
        fn run<T: Real>(
            op: &PackedSdpa,
            qkv: &Tensor,
            g: &Tensor,
            m: Dims,
        ) -> candle_core::Result<Tensor> {
            let grads = with_elems::<T, _>(qkv, |x| {
                with_elems::<T, _>(g, |gs| op.sdpa.bwd((x, x, x), gs, m))
            })?;
            let mut bufs = vec![vec![T::of(0.0); qkv.elem_count()]];
            op.sdpa.scatter_grads(&mut bufs, [0, 0, 0], &grads, m);
            T::tensor(bufs.swap_remove(0), qkv.shape())
        }
        Ok(Some(match qkv.dtype() {
            DType::F32 => run::<f32>(self, qkv, g, m)?,
            _ => run::<f64>(self, qkv, g, m)?,
        }))
    }
}

/// Separate `q`, `k`, `v`, each [`HeadsAt::Split`] or [`HeadsAt::Rows`].
struct SplitSdpa {
    sdpa: Sdpa,
    b: usize,
    t: usize,
    d: usize,
}

impl CustomOp3 for SplitSdpa {
    fn name(&self) -> &'static str {
        "tz-attention"
    }

    fn cpu_fwd(
        &self,
        sq: &CpuStorage,
        lq: &Layout,
        sk: &CpuStorage,
        lk: &Layout,
        sv: &CpuStorage,
        lv: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let lens = [lq, lk, lv].map(|l| l.shape().elem_count());
        let m = self.sdpa.dims(self.b, self.t, self.d, lens)?;
        let out = match sq {
            CpuStorage::F32(_) => {
                f32::storage(
                    self.sdpa
                        .fwd(elems(sq, lq)?, elems(sk, lk)?, elems(sv, lv)?, m)?,
                )
            }
            CpuStorage::F64(_) => {
                f64::storage(
                    self.sdpa
                        .fwd(elems(sq, lq)?, elems(sk, lk)?, elems(sv, lv)?, m)?,
                )
            }
            _ => return Err(candle_core::Error::Msg("attention: dtype".into())),
        };
        Ok((out, Shape::from((m.b, m.t, m.nh * m.d))))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let lens = [q, k, v].map(Tensor::elem_count);
        let m = self.sdpa.dims(self.b, self.t, self.d, lens)?;
        type Three = (Option<Tensor>, Option<Tensor>, Option<Tensor>);
        fn run<T: Real>(
            op: &SplitSdpa,
            qkv: [&Tensor; 3],
            g: &Tensor,
            m: Dims,
        ) -> candle_core::Result<Three> {
            let [q, k, v] = qkv;
            let grads = with_elems3::<T, _>(q, k, v, |qs, ks, vs| {
                with_elems::<T, _>(g, |gs| op.sdpa.bwd((qs, ks, vs), gs, m))
            })?;
            let mut bufs: Vec<Vec<T>> = qkv
                .iter()
                .map(|x| vec![T::of(0.0); x.elem_count()])
                .collect();
            op.sdpa.scatter_grads(&mut bufs, [0, 1, 2], &grads, m);
            let mut it = bufs
                .into_iter()
                .zip(qkv)
                .map(|(b, x)| T::tensor(b, x.shape()));
            let mut next = || it.next().transpose();
            Ok((next()?, next()?, next()?))
        }
        match q.dtype() {
            DType::F32 => run::<f32>(self, [q, k, v], g, m),
            _ => run::<f64>(self, [q, k, v], g, m),
        }
    }
}

/// GPT-2's attention: `qkv [b, t, 3 · nh · d]` as `c_attn` writes it, to
/// the merged `[b, t, nh · d]` (fused when it can be; else the narrows,
/// head splits and [`attention`]'s composition, merged).
pub fn attention_packed(
    qkv: &Tensor,
    nh: usize,
    scale: f64,
    window: Option<usize>,
) -> candle_core::Result<Tensor> {
    let (h, d) = packed_heads(qkv, nh)?;
    if fusable(&[qkv]) && qkv.elem_count() > 0 {
        let w = 3 * h;
        let at = |col0| Input {
            n: nh,
            at: HeadsAt::Rows { width: w, col0 },
        };
        let op = PackedSdpa {
            sdpa: Sdpa {
                soft: CausalSoftmax { scale, window },
                q: at(0),
                k: at(h),
                v: at(2 * h),
            },
            d,
        };
        return qkv.contiguous()?.apply_op1(op);
    }
    let (q, k, v) = split_packed(qkv, nh)?;
    attention(&q, &k, &v, scale, window)
}

/// The width `h` of each of q, k and v in a packed `qkv [b, t, 3h]` of
/// `nh` heads, and the head dim.
fn packed_heads(qkv: &Tensor, nh: usize) -> candle_core::Result<(usize, usize)> {
    let (_, _, w) = qkv.dims3()?;
    if nh == 0 || !w.is_multiple_of(3 * nh) {
        return Err(candle_core::Error::Msg(format!(
            "attention: a packed width of {w} is not 3 x {nh} heads"
        )));
    }
    Ok((w / 3, w / (3 * nh)))
}

/// A packed `qkv [b, t, 3 · nh · d]` as the composition's operands: `q`
/// and `k` split into heads `[b, nh, t, d]`, `v` as rows `[b, t, nh · d]`
/// (the form [`attention`] and `Policy::attention` take).
pub fn split_packed(qkv: &Tensor, nh: usize) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
    let (b, t, _) = qkv.dims3()?;
    let (h, d) = packed_heads(qkv, nh)?;
    let heads = |i: usize| -> candle_core::Result<Tensor> {
        qkv.narrow(2, i * h, h)?
            .reshape((b, t, nh, d))?
            .transpose(1, 2)?
            .contiguous()
    };
    Ok((heads(0)?, heads(1)?, qkv.narrow(2, 2 * h, h)?.contiguous()?))
}

/// Causal attention of `q [b, nh, t, d]` over `k [b, nkv, t, d]` and `v`,
/// `v` either `[b, nkv, t, d]` or `[b, t, nkv · d]` (a projection's
/// output), to the merged `[b, t, nh · d]`; query head `h` reads key/value
/// head `h / (nh / nkv)`. Fused when it can be; else [`repeat_kv`], the
/// matmuls and [`causal_softmax`], merged.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    window: Option<usize>,
) -> candle_core::Result<Tensor> {
    let (b, nh, t, d) = q.dims4()?;
    let nkv = k.dim(1)?;
    if nkv == 0 || nh % nkv != 0 || k.dims4()? != (b, nkv, t, d) {
        return Err(candle_core::Error::Msg(format!(
            "attention: q {:?} over k {:?}",
            q.dims(),
            k.dims()
        )));
    }
    let v_rows = v.rank() == 3;
    let v_ok = if v_rows {
        v.dims3()? == (b, t, nkv * d)
    } else {
        v.dims() == k.dims()
    };
    if !v_ok {
        return Err(candle_core::Error::Msg(format!(
            "attention: v {:?} for k {:?}",
            v.dims(),
            k.dims()
        )));
    }
    if fusable(&[q, k, v]) && q.elem_count() > 0 {
        let split = |n| Input {
            n,
            at: HeadsAt::Split,
        };
        let vin = if v_rows {
            Input {
                n: nkv,
                at: HeadsAt::Rows {
                    width: nkv * d,
                    col0: 0,
                },
            }
        } else {
            split(nkv)
        };
        let op = SplitSdpa {
            sdpa: Sdpa {
                soft: CausalSoftmax { scale, window },
                q: split(nh),
                k: split(nkv),
                v: vin,
            },
            b,
            t,
            d,
        };
        return q
            .contiguous()?
            .apply_op3(&k.contiguous()?, &v.contiguous()?, op);
    }
    let v = if v_rows {
        v.reshape((b, t, nkv, d))?.transpose(1, 2)?.contiguous()?
    } else {
        v.clone()
    };
    let n_rep = nh / nkv;
    let (k, v) = (repeat_kv(k, n_rep)?, repeat_kv(&v, n_rep)?);
    let y = causal_softmax(&q.matmul(&k.t()?)?, scale, window)?.matmul(&v)?;
    y.transpose(1, 2)?.contiguous()?.reshape((b, t, nh * d))
}
