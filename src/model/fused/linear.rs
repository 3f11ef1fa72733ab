//! The fused linear: `y = x W (+ b)` over the last dim of `x`, one candle
//! op in place of four (a reshape to rows, the matmul, the reshape back and
//! the bias add; five with `nn.Linear`'s `Wᵀ`).
//!
//! # Why
//!
//! Each node of candle's graph costs a zeroed tensor of its input's size
//! and an add in backward (see [`super::sdpa`]'s docs); the reshapes and
//! the bias add of a linear cost one `x` and two `y` of those a linear,
//! which for the MLP's `[rows, 4h]` outputs was the largest share of a
//! block's. Here backward computes `dx`, `dW` and `db` directly.
//!
//! # Numbers
//!
//! The products are gemm's, split over the current rayon pool
//! ([`super::matmul::matmul_split`]), with the operands in the same
//! orientation as the composition's (`x` rows times `W`, `Wᵀ` a strided
//! view), and the bias is added after the product in `T`, as
//! [`super::bias_add`] adds it; its gradient is that op's column sum (f64,
//! fixed blocks). `dx = g Wᵀ`, `dW = xᵀ g` (`nn.Linear`: `gᵀ x`).

use std::cell::Cell;
use std::sync::Mutex;

use super::matmul::{matmul_split, Mat};
use super::pointwise::GeluTanh;
use super::*;

/// How the weight is laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightLayout {
    /// `[in, out]`: HF's `Conv1D` (GPT-2).
    InOut,
    /// `[out, in]`: `nn.Linear`.
    OutIn,
}

/// The op, given the weight's layout.
struct Linear {
    layout: WeightLayout,
}

/// Rows of `x`, inputs, outputs.
#[derive(Debug, Clone, Copy)]
struct Sizes {
    rows: usize,
    n_in: usize,
    n_out: usize,
}

impl Linear {
    /// The sizes of `x [.., in]` times `w`, checked.
    fn sizes(&self, x: &Shape, w: &Shape) -> candle_core::Result<Sizes> {
        let n_in = row_len(x)?;
        let &[a, b] = w.dims() else {
            return Err(candle_core::Error::Msg(format!(
                "linear: weight {w:?} is not 2-D"
            )));
        };
        let (w_in, n_out) = match self.layout {
            WeightLayout::InOut => (a, b),
            WeightLayout::OutIn => (b, a),
        };
        if w_in != n_in {
            return Err(candle_core::Error::Msg(format!(
                "linear: x {x:?} against weight {w:?} ({:?})",
                self.layout
            )));
        }
        Ok(Sizes {
            rows: x.elem_count() / n_in,
            n_in,
            n_out,
        })
    }

    /// `W` as the `[in, out]` operand.
    fn w<'a, T>(&self, w: &'a [T], s: Sizes) -> Mat<'a, T> {
        match self.layout {
            WeightLayout::InOut => Mat::rows(w, s.n_in, s.n_out),
            WeightLayout::OutIn => Mat::rows(w, s.n_out, s.n_in).t(),
        }
    }

    fn fwd<T: Real>(
        &self,
        x: &[T],
        w: &[T],
        b: Option<&[T]>,
        s: Sizes,
    ) -> candle_core::Result<Vec<T>> {
        let mut y = matmul_split(Mat::rows(x, s.rows, s.n_in), self.w(w, s), T::of(1.0))?;
        if let Some(b) = b {
            let n = s.n_out;
            par_rows(
                &mut y,
                n,
                #[inline(always)]
                |_, rows| {
                    for row in rows.chunks_exact_mut(n) {
                        for (y, &b) in row.iter_mut().zip(b) {
                            *y = T::of(y.f() + b.f());
                        }
                    }
                },
            );
        }
        Ok(y)
    }

    /// `dx`, `dW` and (with a bias) `db` from the output's gradient `g`.
    #[allow(clippy::type_complexity, reason = "three gradients")]
    fn bwd<T: Real>(
        &self,
        x: &[T],
        w: &[T],
        g: &[T],
        bias: bool,
        s: Sizes,
    ) -> candle_core::Result<(Vec<T>, Vec<T>, Option<Vec<T>>)> {
        let one = T::of(1.0);
        let gm = Mat::rows(g, s.rows, s.n_out);
        let xm = Mat::rows(x, s.rows, s.n_in);
        let dx = matmul_split(gm, self.w(w, s).t(), one)?;
        let dw = match self.layout {
            WeightLayout::InOut => matmul_split(xm.t(), gm, one)?,
            WeightLayout::OutIn => matmul_split(gm.t(), xm, one)?,
        };
        let db = bias.then(|| super::pointwise::bias_grad(g, s.n_out));
        Ok((dx, dw, db))
    }

    fn out_shape(x: &Shape, s: Sizes) -> Shape {
        let mut dims = x.dims().to_vec();
        if let Some(last) = dims.last_mut() {
            *last = s.n_out;
        }
        Shape::from(dims)
    }
}

impl Linear {
    /// The forward on CPU storages, with or without a bias.
    fn cpu(
        &self,
        (sx, lx): (&CpuStorage, &Layout),
        (sw, lw): (&CpuStorage, &Layout),
        bias: Option<(&CpuStorage, &Layout)>,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let s = self.sizes(lx.shape(), lw.shape())?;
        if let Some((_, lb)) = bias {
            if lb.shape().elem_count() != s.n_out {
                return Err(candle_core::Error::Msg(format!(
                    "linear: bias {:?} for {} outputs",
                    lb.shape(),
                    s.n_out
                )));
            }
        }
        fn run<T: Real>(
            op: &Linear,
            (sx, lx): (&CpuStorage, &Layout),
            (sw, lw): (&CpuStorage, &Layout),
            bias: Option<(&CpuStorage, &Layout)>,
            s: Sizes,
        ) -> candle_core::Result<CpuStorage> {
            let b = bias.map(|(sb, lb)| elems::<T>(sb, lb)).transpose()?;
            Ok(T::storage(op.fwd(
                elems::<T>(sx, lx)?,
                elems::<T>(sw, lw)?,
                b,
                s,
            )?))
        }
        let out = match sx {
            CpuStorage::F32(_) => run::<f32>(self, (sx, lx), (sw, lw), bias, s)?,
            CpuStorage::F64(_) => run::<f64>(self, (sx, lx), (sw, lw), bias, s)?,
            _ => return Err(candle_core::Error::Msg("linear: dtype".into())),
        };
        Ok((out, Linear::out_shape(lx.shape(), s)))
    }

    /// The gradients of `x`, `w` and (given) the bias.
    fn grads(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: Option<&Tensor>,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let s = self.sizes(x.shape(), w.shape())?;
        type Three = (Option<Tensor>, Option<Tensor>, Option<Tensor>);
        fn run<T: Real>(
            op: &Linear,
            (x, w, b, g): (&Tensor, &Tensor, Option<&Tensor>, &Tensor),
            s: Sizes,
        ) -> candle_core::Result<Three> {
            let (dx, dw, db) =
                with_elems3::<T, _>(x, w, g, |xs, ws, gs| op.bwd(xs, ws, gs, b.is_some(), s))?;
            let db = match (db, b) {
                (Some(db), Some(b)) => Some(T::tensor(db, b.shape())?),
                _ => None,
            };
            Ok((
                Some(T::tensor(dx, x.shape())?),
                Some(T::tensor(dw, w.shape())?),
                db,
            ))
        }
        match x.dtype() {
            DType::F32 => run::<f32>(self, (x, w, b, g), s),
            _ => run::<f64>(self, (x, w, b, g), s),
        }
    }
}

impl CustomOp2 for Linear {
    fn name(&self) -> &'static str {
        "tz-linear"
    }

    fn cpu_fwd(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sw: &CpuStorage,
        lw: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        self.cpu((sx, lx), (sw, lw), None)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, _) = self.grads(x, w, None, g)?;
        Ok((dx, dw))
    }
}

impl CustomOp3 for Linear {
    fn name(&self) -> &'static str {
        "tz-linear-bias"
    }

    fn cpu_fwd(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sw: &CpuStorage,
        lw: &Layout,
        sb: &CpuStorage,
        lb: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        self.cpu((sx, lx), (sw, lw), Some((sb, lb)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        self.grads(x, w, Some(b), g)
    }
}

/// `y = x W (+ b)` over the last dim of `x`, `W` laid out as `layout`:
/// fused when it can be, else the composition (rows, matmul, reshape,
/// [`bias_add`]).
pub fn linear(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    layout: WeightLayout,
) -> candle_core::Result<Tensor> {
    let mut all = vec![x, w];
    all.extend(b);
    if fusable(&all) && x.elem_count() > 0 && w.rank() == 2 {
        let op = Linear { layout };
        let (x, w) = (x.contiguous()?, w.contiguous()?);
        return match b {
            Some(b) => x.apply_op3(&w, &b.contiguous()?, op),
            None => x.apply_op2(&w, op),
        };
    }
    let w = match layout {
        WeightLayout::InOut => w.clone(),
        WeightLayout::OutIn => w.t()?,
    };
    let y = ops::matmul_last(x, &w)?;
    match b {
        Some(b) => bias_add(&y, b),
        None => Ok(y),
    }
}

/// `gelu_tanh(x W + b)`: the MLP's first linear and its activation in one
/// op (GPT-2's `c_fc` and `gelu_new`).
///
/// # Why
///
/// As separate ops the `[rows, 4h]` pre-activation is a graph node, and
/// candle's backward zeroes a tensor of its size and adds into it (the
/// largest edge of a block's backward, beside the GELU output's; see
/// `sdpa`'s docs). Here the op keeps the pre-activation itself for its
/// backward, `dpre = g · gelu'(pre)` is computed and handed straight to the
/// linear's backward.
///
/// # Numbers
///
/// The same as the composition, bit for bit: the linear's forward, GELU's
/// element loop on its output, GELU's gradient loop, and the linear's
/// backward on that gradient (`tests`).
///
/// # Memory
///
/// The pre-activation lives in the op, which the graph holds until it is
/// dropped, so it is not a tensor `RecordedUnit::held_bytes` can see: the
/// forward adds its bytes to this thread's count ([`count_hidden`]), which
/// `Model::record_unit` reads. Without a graph (no input tracks its op) the
/// op is not used, and nothing is held.
struct LinearGelu {
    lin: Linear,
    /// The pre-activation `x W + b`, from the forward.
    pre: Mutex<Option<Tensor>>,
}

thread_local! {
    /// Bytes the fused ops on this thread have kept inside themselves for
    /// their backward since [`count_hidden`] started counting.
    static HIDDEN_BYTES: Cell<u64> = const { Cell::new(0) };
}

/// Runs `f` and returns, beside its result, the bytes the fused ops it ran
/// on this thread keep inside themselves for their backward (state a graph
/// walk does not see; see `LinearGelu`).
pub fn count_hidden<R>(f: impl FnOnce() -> R) -> (R, u64) {
    let before = HIDDEN_BYTES.with(Cell::get);
    let r = f();
    let after = HIDDEN_BYTES.with(Cell::get);
    (r, after.wrapping_sub(before))
}

impl CustomOp3 for LinearGelu {
    fn name(&self) -> &'static str {
        "tz-linear-bias-gelu"
    }

    fn cpu_fwd(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sw: &CpuStorage,
        lw: &Layout,
        sb: &CpuStorage,
        lb: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        // The linear's forward, then GELU's own forward on its output.
        let (pre, shape) = self.lin.cpu((sx, lx), (sw, lw), Some((sb, lb)))?;
        let (y, _) = GeluTanh.cpu_fwd(&pre, &Layout::contiguous(&shape))?;
        let pre = match pre {
            CpuStorage::F32(v) => f32::tensor(v, &shape)?,
            CpuStorage::F64(v) => f64::tensor(v, &shape)?,
            _ => return Err(candle_core::Error::Msg("linear + gelu: dtype".into())),
        };
        let bytes = (pre.elem_count() * pre.dtype().size_in_bytes()) as u64;
        HIDDEN_BYTES.with(|h| h.set(h.get().wrapping_add(bytes)));
        *self.pre.lock().unwrap_or_else(|p| p.into_inner()) = Some(pre);
        Ok((y, shape))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let pre = self.pre.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let no_grad = || candle_core::Error::Msg("linear + gelu: backward before forward".into());
        let pre = pre.ok_or_else(no_grad)?;
        // GELU's own backward (it reads only its input), then the linear's.
        let dpre = GeluTanh.bwd(&pre, &pre, g)?.ok_or_else(no_grad)?;
        self.lin.grads(x, w, Some(b), &dpre)
    }
}

/// `gelu_tanh(x W + b)` over the last dim of `x`, `W` laid out as
/// `layout`: one op (`LinearGelu`) when it can be and a graph is being
/// recorded, else [`linear`] then [`super::gelu_tanh`] (the same values).
pub fn linear_gelu_tanh(
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    layout: WeightLayout,
) -> candle_core::Result<Tensor> {
    let tracked = x.track_op() || w.track_op() || b.track_op();
    if tracked && fusable(&[x, w, b]) && x.elem_count() > 0 && w.rank() == 2 {
        let op = LinearGelu {
            lin: Linear { layout },
            pre: Mutex::new(None),
        };
        return x
            .contiguous()?
            .apply_op3(&w.contiguous()?, &b.contiguous()?, op);
    }
    super::gelu_tanh(&linear(x, w, Some(b), layout)?)
}
