//! Fused CPU ops with a hand-written backward: the blocks' norms, bias
//! adds, masked softmax and GELU, each one pass forward and one backward
//! over contiguous rows instead of candle's chain of primitive ops.
//!
//! The ops: bias add, LayerNorm, RMSNorm, the causal softmax (scale and
//! mask folded in), GELU (tanh), SwiGLU (`silu(a) · b`) and GQA's
//! `repeat_kv`; and the injection of a unit's upstream gradient.
//!
//! # Why
//!
//! [`super::ops`] builds every function from candle primitives, whose
//! backward is candle's. Profiled on the 2-core machine (stage 0, the
//! embedded GPT-2 shape, 8 × 128 tokens; `perf record`, see issue 27's
//! note), 13% of all samples were candle's `ReduceSum` slow path: the
//! backward of every broadcast over leading dims (each bias and norm
//! weight's gradient) sums with two integer divisions per element. The
//! primitive softmax, norm and GELU chains also allocate and walk a
//! full-size tensor per op, forward and backward.
//!
//! With these ops, candle's barrier pool off (`CANDLE_NUM_THREADS=1`, see
//! `crate::engine::host::threads::apply`) and gemm's AVX-512 kernels, the
//! same run went from 0.28x PyTorch eager's tokens/s to 0.80x
//! (`scripts/compare_torch.py`; the fused ops alone: 4,000 to 6,300-6,500
//! tokens/s), and the profile is the matmuls first.
//!
//! # The contract
//!
//! * Each op here computes what its [`super::ops`] counterpart computes,
//!   to rounding: the statistics of a row (norm means and variances, the
//!   softmax sum, the column sums of a gradient) are accumulated in f64 in
//!   a fixed order, so a result never depends on threads or timing.
//!   `tests` compares values and gradients with the primitive composition
//!   at awkward sizes in f32 and f64, and `tests/model_grad.rs`' finite
//!   differences (f64) run through these ops.
//! * f32 and f64 on the CPU only; any other dtype or device, and
//!   `TIERZERO_PRIMITIVE_OPS=1` in the environment, takes the primitive
//!   composition (the reference, and the A/B switch).
//! * Inputs are made contiguous first (a no-op for the blocks' tensors).
//! * The backward returns plain tensors: no second-order gradients.

use std::sync::OnceLock;

use candle_core::{
    CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Shape, Storage, Tensor,
};

use rayon::prelude::*;

use super::ops;

/// Whether the fused ops are used (not `TIERZERO_PRIMITIVE_OPS=1`).
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        std::env::var("TIERZERO_PRIMITIVE_OPS").map_or(true, |v| v.is_empty() || v == "0")
    })
}

/// All CPU tensors of one dtype, f32 or f64.
fn fusable(ts: &[&Tensor]) -> bool {
    let Some(first) = ts.first() else {
        return false;
    };
    enabled()
        && matches!(first.dtype(), DType::F32 | DType::F64)
        && ts
            .iter()
            .all(|t| t.device().is_cpu() && t.dtype() == first.dtype())
}

/// The element types the fused ops run on.
trait Real: Copy + Send + Sync + 'static {
    fn of(x: f64) -> Self;
    fn f(self) -> f64;
    fn slice(s: &CpuStorage) -> Option<&[Self]>;
    fn storage(v: Vec<Self>) -> CpuStorage;
    fn tensor(v: Vec<Self>, shape: &Shape) -> candle_core::Result<Tensor>;
    /// `exp(x)` in this type's precision (as candle's `exp` computes it).
    fn exp_in(x: f64) -> f64;
    /// `tanh(x)` in this type's precision.
    fn tanh_in(x: f64) -> f64;
    /// `tanh` for this type: f32 through one `exp` (`1 - 2 / (e^{2x} + 1)`,
    /// within 1e-7 of libm's `tanhf`, which costs twice as much through
    /// `expm1f`); f64 exactly.
    fn tanh_fast(x: Self) -> f64;
}

macro_rules! real {
    ($t:ty, $variant:ident, $tanh:expr) => {
        impl Real for $t {
            #[inline(always)]
            fn of(x: f64) -> Self {
                x as $t
            }
            #[inline(always)]
            fn f(self) -> f64 {
                f64::from(self)
            }
            fn slice(s: &CpuStorage) -> Option<&[Self]> {
                match s {
                    CpuStorage::$variant(v) => Some(v),
                    _ => None,
                }
            }
            fn storage(v: Vec<Self>) -> CpuStorage {
                CpuStorage::$variant(v)
            }
            fn tensor(v: Vec<Self>, shape: &Shape) -> candle_core::Result<Tensor> {
                Tensor::from_vec(v, shape.clone(), &candle_core::Device::Cpu)
            }
            #[inline(always)]
            fn exp_in(x: f64) -> f64 {
                f64::from((x as $t).exp())
            }
            #[inline(always)]
            fn tanh_in(x: f64) -> f64 {
                Self::tanh_fast(x as $t)
            }
            #[inline(always)]
            fn tanh_fast(x: Self) -> f64 {
                let f: fn($t) -> f64 = $tanh;
                f(x)
            }
        }
    };
}
real!(f32, F32, |x: f32| {
    let e = (2.0 * x).exp();
    f64::from(1.0 - 2.0 / (e + 1.0))
});
real!(f64, F64, f64::tanh);

/// The contiguous elements of a CPU storage under `layout`.
fn elems<'a, T: Real>(s: &'a CpuStorage, layout: &Layout) -> candle_core::Result<&'a [T]> {
    let all = T::slice(s).ok_or_else(|| candle_core::Error::Msg("fused op: dtype".into()))?;
    let (a, b) = layout
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("fused op: non-contiguous input".into()))?;
    all.get(a..b)
        .ok_or_else(|| candle_core::Error::Msg("fused op: layout out of storage".into()))
}

/// Runs `f` on a tensor's contiguous elements (copied contiguous first if
/// need be).
fn with_elems<T: Real, R>(
    t: &Tensor,
    f: impl FnOnce(&[T]) -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(s) => f(elems::<T>(s, layout)?),
        _ => Err(candle_core::Error::Msg("fused op: not a CPU tensor".into())),
    }
}

/// [`with_elems`] of three tensors at once.
fn with_elems3<T: Real, R>(
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    f: impl FnOnce(&[T], &[T], &[T]) -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    with_elems::<T, _>(a, |a| {
        with_elems::<T, _>(b, |b| with_elems::<T, _>(c, |c| f(a, b, c)))
    })
}

/// Checks that `param` (a bias or norm weight) has one element per
/// element of a row of `x`.
fn per_row(x: &Layout, param: &Layout, what: &str) -> candle_core::Result<()> {
    if param.shape().elem_count() != row_len(x.shape())? {
        return Err(candle_core::Error::Msg(format!(
            "{what}: {:?} does not match rows of {:?}",
            param.shape(),
            x.shape()
        )));
    }
    Ok(())
}

/// A forward over two contiguous inputs of one dtype, in `T`.
trait Forward2 {
    fn run<T: Real>(&self, a: &[T], b: &[T]) -> Vec<T>;
}

/// A [`Forward2`] on CPU storages: f32 or f64, the output shaped as `l1`.
fn cpu_fwd2(
    op: &impl Forward2,
    what: &str,
    (s1, l1): (&CpuStorage, &Layout),
    (s2, l2): (&CpuStorage, &Layout),
) -> candle_core::Result<(CpuStorage, Shape)> {
    let out = match s1 {
        CpuStorage::F32(_) => f32::storage(op.run(elems(s1, l1)?, elems(s2, l2)?)),
        CpuStorage::F64(_) => f64::storage(op.run(elems(s1, l1)?, elems(s2, l2)?)),
        _ => return Err(candle_core::Error::Msg(format!("{what}: dtype"))),
    };
    Ok((out, l1.shape().clone()))
}

/// The last dim of a shape (the row length), at least 1 element.
fn row_len(shape: &Shape) -> candle_core::Result<usize> {
    shape
        .dims()
        .last()
        .copied()
        .filter(|&n| n > 0)
        .ok_or_else(|| candle_core::Error::Msg("fused op: empty rows".into()))
}

/// Elements per parallel task: rayon wakes its workers for each task, so
/// a task of a few thousand elements cost more in scheduling than it
/// saved (a fifth of a step's samples were the kernel's scheduler).
const TASK_ELEMS: usize = 32 * 1024;

/// Rows of `n` per task and per partial column sum: from the row length
/// alone, so that no result depends on the number of threads (rayon's
/// pool, the one candle's gemm runs on).
fn rows_per_task(n: usize) -> usize {
    (TASK_ELEMS / n.max(1)).max(1)
}

/// Fills `out` (rows of `n`) task by task, in parallel when there is more
/// than one task: `f(first_row, the task's rows)`.
fn par_rows<T: Send>(out: &mut [T], n: usize, f: impl Fn(usize, &mut [T]) + Sync + Send) {
    let rows = rows_per_task(n);
    if out.len() <= rows * n {
        f(0, out);
        return;
    }
    out.par_chunks_mut(n * rows)
        .enumerate()
        .for_each(|(b, chunk)| f(b * rows, chunk));
}

/// Elementwise over `len` elements: `f(range)` per task, in parallel when
/// there is more than one.
fn par_elems<T: Send>(out: &mut [T], f: impl Fn(usize, &mut [T]) + Sync + Send) {
    if out.len() <= TASK_ELEMS {
        f(0, out);
        return;
    }
    out.par_chunks_mut(TASK_ELEMS)
        .enumerate()
        .for_each(|(b, chunk)| f(b * TASK_ELEMS, chunk));
}

/// Column sums over `rows` rows of `n`: `add(row, acc)` adds one row's
/// terms into `acc`. Each block of [`rows_per_task`] rows sums in f64 in
/// row order (in parallel when there are several), and the blocks' sums
/// add up in block order.
fn column_sums<T: Real>(
    rows: usize,
    n: usize,
    add: impl Fn(usize, &mut [f64]) + Sync + Send,
) -> Vec<T> {
    let per = rows_per_task(n);
    let block = |b: usize| {
        let mut acc = vec![0f64; n];
        for r in b * per..((b + 1) * per).min(rows) {
            add(r, &mut acc);
        }
        acc
    };
    let blocks = rows.div_ceil(per);
    let partials: Vec<Vec<f64>> = if blocks <= 1 {
        (0..blocks).map(block).collect()
    } else {
        (0..blocks).into_par_iter().map(block).collect()
    };
    let mut total = vec![0f64; n];
    for p in partials {
        for (t, v) in total.iter_mut().zip(p) {
            *t += v;
        }
    }
    total.into_iter().map(T::of).collect()
}

/// [`par_rows`] whose tasks also sum columns: `f(first_row, the task's
/// rows, acc)` fills the rows and adds their terms into `sums`
/// accumulators of `n` f64 columns, in row order. The tasks are
/// [`column_sums`]' blocks, and their sums add up in task order as its
/// blocks' do, so a gradient's column sums come out of the pass that
/// writes its rows, with the same bits.
fn par_rows_summing<T: Real>(
    out: &mut [T],
    n: usize,
    sums: usize,
    f: impl Fn(usize, &mut [T], &mut [Vec<f64>]) + Sync + Send,
) -> Vec<Vec<T>> {
    let rows = rows_per_task(n);
    let task = |(b, chunk): (usize, &mut [T])| {
        let mut acc = vec![vec![0f64; n]; sums];
        f(b * rows, chunk, &mut acc);
        acc
    };
    let partials: Vec<Vec<Vec<f64>>> = if out.len() <= rows * n {
        vec![task((0, out))]
    } else {
        out.par_chunks_mut(n * rows).enumerate().map(task).collect()
    };
    let mut total = vec![vec![0f64; n]; sums];
    for p in partials {
        for (t, v) in total.iter_mut().zip(p) {
            for (a, b) in t.iter_mut().zip(v) {
                *a += b;
            }
        }
    }
    total
        .into_iter()
        .map(|t| t.into_iter().map(T::of).collect())
        .collect()
}

// ---------------------------------------------------------------- bias

/// `x [.., n] + b [n]`.
struct BiasAdd;

impl Forward2 for BiasAdd {
    fn run<T: Real>(&self, x: &[T], b: &[T]) -> Vec<T> {
        let n = b.len();
        let mut out = vec![T::of(0.0); x.len()];
        par_rows(&mut out, n, |r0, o| {
            for (o, x) in o.chunks_exact_mut(n).zip(x[r0 * n..].chunks_exact(n)) {
                for ((o, &x), &b) in o.iter_mut().zip(x).zip(b) {
                    *o = T::of(x.f() + b.f());
                }
            }
        });
        out
    }
}

impl CustomOp2 for BiasAdd {
    fn name(&self) -> &'static str {
        "tz-bias-add"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        per_row(l1, l2, "bias add")?;
        cpu_fwd2(self, "bias add", (s1, l1), (s2, l2))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let n = b.elem_count();
        let db = match g.dtype() {
            DType::F32 => with_elems::<f32, _>(g, |g| f32::tensor(bias_grad(g, n), b.shape()))?,
            _ => with_elems::<f64, _>(g, |g| f64::tensor(bias_grad(g, n), b.shape()))?,
        };
        Ok((Some(g.clone()), Some(db)))
    }
}

/// The bias's gradient: the column sums of `g`.
fn bias_grad<T: Real>(g: &[T], n: usize) -> Vec<T> {
    column_sums(g.len() / n, n, |r, acc| {
        for (a, g) in acc.iter_mut().zip(&g[r * n..(r + 1) * n]) {
            *a += g.f();
        }
    })
}

/// `x [.., n] + b [n]` (fused when it can be, see the module docs).
pub fn bias_add(x: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    if fusable(&[x, b]) && b.rank() == 1 && x.dims().last() == Some(&b.elem_count()) {
        x.contiguous()?.apply_op2(&b.contiguous()?, BiasAdd)
    } else {
        x.broadcast_add(b)
    }
}

// ---------------------------------------------------------------- norms

/// LayerNorm over the last dim (`eps`), weight and bias.
struct LayerNorm {
    eps: f64,
}

/// A row's mean and `1 / sqrt(var + eps)` (biased variance), in f64.
fn moments<T: Real>(row: &[T], eps: f64) -> (f64, f64) {
    let n = row.len() as f64;
    let mean = row.iter().map(|x| x.f()).sum::<f64>() / n;
    let var = row.iter().map(|x| (x.f() - mean).powi(2)).sum::<f64>() / n;
    (mean, 1.0 / (var + eps).sqrt())
}

impl LayerNorm {
    fn fwd<T: Real>(&self, x: &[T], w: &[T], b: &[T]) -> Vec<T> {
        let n = w.len();
        let mut out = vec![T::of(0.0); x.len()];
        par_rows(&mut out, n, |r0, o| {
            for (o, row) in o.chunks_exact_mut(n).zip(x[r0 * n..].chunks_exact(n)) {
                let (mean, rstd) = moments(row, self.eps);
                for (((o, &x), &w), &b) in o.iter_mut().zip(row).zip(w).zip(b) {
                    *o = T::of((x.f() - mean) * rstd * w.f() + b.f());
                }
            }
        });
        out
    }

    /// `(dx, dw, db)`, in one pass over the rows (each row's moments
    /// once).
    fn bwd_rows<T: Real>(&self, x: &[T], w: &[T], g: &[T]) -> (Vec<T>, Vec<T>, Vec<T>) {
        let n = w.len();
        let mut dx = vec![T::of(0.0); x.len()];
        let mut sums = par_rows_summing(&mut dx, n, 2, |r0, d, acc| {
            for (k, d) in d.chunks_exact_mut(n).enumerate() {
                let r = r0 + k;
                let (xr, gr) = (&x[r * n..(r + 1) * n], &g[r * n..(r + 1) * n]);
                let (mean, rstd) = moments(xr, self.eps);
                let (mut s1, mut s2) = (0f64, 0f64);
                for j in 0..n {
                    let dxh = gr[j].f() * w[j].f();
                    s1 += dxh;
                    s2 += dxh * (xr[j].f() - mean) * rstd;
                    acc[0][j] += gr[j].f() * (xr[j].f() - mean) * rstd;
                    acc[1][j] += gr[j].f();
                }
                let (m1, m2) = (s1 / n as f64, s2 / n as f64);
                for j in 0..n {
                    let xhat = (xr[j].f() - mean) * rstd;
                    d[j] = T::of(rstd * (gr[j].f() * w[j].f() - m1 - xhat * m2));
                }
            }
        });
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
    fn rstd<T: Real>(&self, row: &[T]) -> f64 {
        let ms = row.iter().map(|x| x.f() * x.f()).sum::<f64>() / row.len() as f64;
        1.0 / (ms + self.eps).sqrt()
    }

    fn fwd_rows<T: Real>(&self, x: &[T], w: &[T]) -> Vec<T> {
        let n = w.len();
        let mut out = vec![T::of(0.0); x.len()];
        par_rows(&mut out, n, |r0, o| {
            for (o, row) in o.chunks_exact_mut(n).zip(x[r0 * n..].chunks_exact(n)) {
                let rstd = self.rstd(row);
                for ((o, &x), &w) in o.iter_mut().zip(row).zip(w) {
                    *o = T::of(x.f() * rstd * w.f());
                }
            }
        });
        out
    }

    /// `(dx, dw)`, in one pass over the rows.
    fn bwd_rows<T: Real>(&self, x: &[T], w: &[T], g: &[T]) -> (Vec<T>, Vec<T>) {
        let n = w.len();
        let mut dx = vec![T::of(0.0); x.len()];
        let mut sums = par_rows_summing(&mut dx, n, 1, |r0, d, acc| {
            for (k, d) in d.chunks_exact_mut(n).enumerate() {
                let r = r0 + k;
                let (xr, gr) = (&x[r * n..(r + 1) * n], &g[r * n..(r + 1) * n]);
                let rstd = self.rstd(xr);
                let s: f64 = (0..n)
                    .map(|j| gr[j].f() * w[j].f() * xr[j].f() * rstd)
                    .sum();
                let m = s / n as f64;
                for j in 0..n {
                    let xhat = xr[j].f() * rstd;
                    d[j] = T::of(rstd * (gr[j].f() * w[j].f() - xhat * m));
                    acc[0][j] += gr[j].f() * xr[j].f() * rstd;
                }
            }
        });
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

// ---------------------------------------------------------------- softmax

/// `softmax(scale · s + causal mask)` over the last dim of scores
/// `s [.., t, t]`, query `i` seeing keys `j ≤ i` (within `window`, see
/// [`ops::causal_mask_window`]); masked probabilities are exactly 0.
struct CausalSoftmax {
    scale: f64,
    window: Option<usize>,
}

impl CausalSoftmax {
    /// The keys row `i` sees: `lo..=i`.
    fn lo(&self, i: usize) -> usize {
        match self.window {
            Some(w) if w > 0 => (i + 1).saturating_sub(w),
            _ => 0,
        }
    }

    fn fwd<T: Real>(&self, s: &[T], t: usize) -> Vec<T> {
        let mut out = vec![T::of(0.0); s.len()];
        par_rows(&mut out, t, |r0, o| {
            for (k, (o, row)) in o
                .chunks_exact_mut(t)
                .zip(s[r0 * t..].chunks_exact(t))
                .enumerate()
            {
                let i = (r0 + k) % t;
                let lo = self.lo(i);
                let mut max = f64::NEG_INFINITY;
                for x in &row[lo..=i] {
                    max = max.max(self.scale * x.f());
                }
                let mut sum = 0f64;
                for (o, x) in o[lo..=i].iter_mut().zip(&row[lo..=i]) {
                    let e = T::exp_in(self.scale * x.f() - max);
                    sum += e;
                    *o = T::of(e);
                }
                for o in &mut o[lo..=i] {
                    *o = T::of(o.f() / sum);
                }
            }
        });
        out
    }

    /// `d s = scale · y ⊙ (g − Σ g ⊙ y)` per row.
    fn bwd_rows<T: Real>(&self, y: &[T], g: &[T], t: usize) -> Vec<T> {
        let mut ds = vec![T::of(0.0); y.len()];
        par_rows(&mut ds, t, |r0, d| {
            for (k, d) in d.chunks_exact_mut(t).enumerate() {
                let r = r0 + k;
                let (yr, gr) = (&y[r * t..(r + 1) * t], &g[r * t..(r + 1) * t]);
                let i = r % t;
                let lo = self.lo(i);
                let dot: f64 = (lo..=i).map(|j| gr[j].f() * yr[j].f()).sum();
                for j in lo..=i {
                    d[j] = T::of(self.scale * yr[j].f() * (gr[j].f() - dot));
                }
            }
        });
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

// ---------------------------------------------------------------- GELU

/// GELU, tanh approximation (`gelu_new`).
struct GeluTanh;

const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
const GELU_C: f64 = 0.044715;

/// `tanh` of the GELU argument `sqrt(2/pi) (x + 0.044715 x^3)`, in `T`'s
/// precision (as candle's `tanh` of the primitive composition).
fn gelu_th<T: Real>(x: f64) -> f64 {
    T::tanh_in(SQRT_2_OVER_PI * (x + GELU_C * x * x * x))
}

impl GeluTanh {
    fn fwd<T: Real>(x: &[T]) -> Vec<T> {
        let mut out = vec![T::of(0.0); x.len()];
        par_elems(&mut out, |at, o| {
            for (o, &x) in o.iter_mut().zip(&x[at..]) {
                let x = x.f();
                *o = T::of(0.5 * x * (1.0 + gelu_th::<T>(x)));
            }
        });
        out
    }

    fn bwd_elems<T: Real>(x: &[T], g: &[T]) -> Vec<T> {
        let mut out = vec![T::of(0.0); x.len()];
        par_elems(&mut out, |at, o| {
            for ((o, &x), &g) in o.iter_mut().zip(&x[at..]).zip(&g[at..]) {
                let x = x.f();
                let th = gelu_th::<T>(x);
                let du = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_C * x * x);
                *o = T::of(g.f() * (0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * du));
            }
        });
        out
    }
}

impl CustomOp1 for GeluTanh {
    fn name(&self) -> &'static str {
        "tz-gelu-tanh"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let out = match s {
            CpuStorage::F32(_) => f32::storage(Self::fwd(elems::<f32>(s, l)?)),
            CpuStorage::F64(_) => f64::storage(Self::fwd(elems::<f64>(s, l)?)),
            _ => return Err(candle_core::Error::Msg("gelu: dtype".into())),
        };
        Ok((out, l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, g: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let dx = match x.dtype() {
            DType::F32 => with_elems::<f32, _>(x, |xs| {
                with_elems::<f32, _>(g, |gs| f32::tensor(Self::bwd_elems(xs, gs), x.shape()))
            })?,
            _ => with_elems::<f64, _>(x, |xs| {
                with_elems::<f64, _>(g, |gs| f64::tensor(Self::bwd_elems(xs, gs), x.shape()))
            })?,
        };
        Ok(Some(dx))
    }
}

/// GELU, tanh approximation (fused when it can be; else
/// [`ops::gelu_tanh`]).
pub fn gelu_tanh(x: &Tensor) -> candle_core::Result<Tensor> {
    if fusable(&[x]) && x.elem_count() > 0 {
        x.contiguous()?.apply_op1(GeluTanh)
    } else {
        ops::gelu_tanh(x)
    }
}

// ---------------------------------------------------------------- SwiGLU

/// `silu(a) · b` (Llama's MLP gate), `silu(a) = a / (1 + e^{-a})`.
struct SwiGlu;

impl SwiGlu {
    /// `(silu(a), sigmoid(a))` in `T`'s precision for the exponential.
    #[inline(always)]
    fn silu<T: Real>(a: f64) -> (f64, f64) {
        let s = 1.0 / (1.0 + T::exp_in(-a));
        (a * s, s)
    }

    /// `(da, db)`, interleaved per element then split (one pass).
    fn bwd_elems<T: Real>(a: &[T], b: &[T], g: &[T]) -> (Vec<T>, Vec<T>) {
        let mut both = vec![T::of(0.0); 2 * a.len()];
        par_elems(&mut both, |at, o| {
            let first = at / 2;
            for (k, pair) in o.chunks_exact_mut(2).enumerate() {
                let i = first + k;
                let x = a[i].f();
                let (silu, s) = Self::silu::<T>(x);
                pair[0] = T::of(g[i].f() * b[i].f() * (s + x * s * (1.0 - s)));
                pair[1] = T::of(g[i].f() * silu);
            }
        });
        let da = both.iter().step_by(2).copied().collect();
        let db = both.iter().skip(1).step_by(2).copied().collect();
        (da, db)
    }
}

impl Forward2 for SwiGlu {
    fn run<T: Real>(&self, a: &[T], b: &[T]) -> Vec<T> {
        let mut out = vec![T::of(0.0); a.len()];
        par_elems(&mut out, |at, o| {
            for ((o, &a), &b) in o.iter_mut().zip(&a[at..]).zip(&b[at..]) {
                *o = T::of(Self::silu::<T>(a.f()).0 * b.f());
            }
        });
        out
    }
}

impl CustomOp2 for SwiGlu {
    fn name(&self) -> &'static str {
        "tz-swiglu"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        if l1.shape() != l2.shape() {
            return Err(candle_core::Error::Msg("swiglu: shapes differ".into()));
        }
        cpu_fwd2(self, "swiglu", (s1, l1), (s2, l2))
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        fn run<T: Real>(
            a: &Tensor,
            b: &Tensor,
            g: &Tensor,
        ) -> candle_core::Result<(Tensor, Tensor)> {
            with_elems3::<T, _>(a, b, g, |xa, xb, xg| {
                let (da, db) = SwiGlu::bwd_elems(xa, xb, xg);
                Ok((T::tensor(da, a.shape())?, T::tensor(db, b.shape())?))
            })
        }
        let (da, db) = match a.dtype() {
            DType::F32 => run::<f32>(a, b, g)?,
            _ => run::<f64>(a, b, g)?,
        };
        Ok((Some(da), Some(db)))
    }
}

/// `silu(a) · b` (fused when it can be; else candle's `silu` and `mul`).
pub fn swiglu(a: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    if fusable(&[a, b]) && a.shape() == b.shape() && a.elem_count() > 0 {
        a.contiguous()?.apply_op2(&b.contiguous()?, SwiGlu)
    } else {
        a.silu()?.mul(b)
    }
}

// ---------------------------------------------------------------- GQA

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

// ---------------------------------------------------------------- upstream

/// A unit's backward objective `⟨y, g⟩` with `g` constant: its only use is
/// its gradient with respect to `y`, which is `g` (times the incoming
/// scalar, exactly 1 at the root). The forward returns 0 instead of the
/// inner product nobody reads, and the backward hands `g` on without the
/// two full-size products (`y · g` forward, `1 · g` backward) of
/// `sum(y * g)`.
struct Inject {
    g: Tensor,
}

impl CustomOp1 for Inject {
    fn name(&self) -> &'static str {
        "tz-inject-upstream"
    }

    fn cpu_fwd(&self, s: &CpuStorage, _l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let out = match s {
            CpuStorage::F32(_) => f32::storage(vec![0.0]),
            CpuStorage::F64(_) => f64::storage(vec![0.0]),
            _ => return Err(candle_core::Error::Msg("inject: dtype".into())),
        };
        Ok((out, Shape::from(())))
    }

    fn bwd(
        &self,
        _y: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let k = grad.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        if k == 1.0 {
            Ok(Some(self.g.clone()))
        } else {
            Ok(Some(self.g.affine(k, 0.0)?))
        }
    }
}

/// The scalar whose gradient with respect to `y` is `g` (fused when it can
/// be; else `sum(y * g)`, whose value is the inner product).
pub fn upstream_objective(y: &Tensor, g: &Tensor) -> candle_core::Result<Tensor> {
    if fusable(&[y, g]) && y.shape() == g.shape() {
        y.apply_op1(Inject {
            g: g.detach().contiguous()?,
        })
    } else {
        y.mul(&g.detach())?.sum_all()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;
    use candle_core::{Device, Var};

    fn rand(shape: &[usize], seed: u64, dtype: DType) -> Tensor {
        let n: usize = shape.iter().product();
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let v: Vec<f64> = (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 11) as f64 / (1u64 << 53) as f64 * 4.0 - 2.0
            })
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
    }

    fn max_rel(a: &Tensor, b: &Tensor) -> f64 {
        let a: Vec<f64> = a
            .flatten_all()
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap()
            .to_vec1()
            .unwrap();
        let b: Vec<f64> = b
            .flatten_all()
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(a.len(), b.len());
        let scale = b.iter().fold(0f64, |m, x| m.max(x.abs())).max(1e-3);
        a.iter()
            .zip(&b)
            .map(|(x, y)| (x - y).abs() / scale)
            .fold(0.0, f64::max)
    }

    /// Values and the gradients of `sum(f(args) · r)` (a random `r`), fused
    /// against the primitive composition: in f64, of the same args; for
    /// f32 args, against the primitive composition in f64 of the same
    /// values (the f32 composition itself loses digits to cancellation,
    /// e.g. an RMSNorm of one element, where the fused op keeps them).
    fn check(
        what: &str,
        args: &[Tensor],
        fused: impl Fn(&[Tensor]) -> Tensor,
        reference: impl Fn(&[Tensor]) -> Tensor,
    ) {
        let tol = if args[0].dtype() == DType::F64 {
            1e-12
        } else {
            2e-6
        };
        let grads = |args: &[Tensor], f: &dyn Fn(&[Tensor]) -> Tensor| {
            let vars: Vec<Var> = args.iter().map(|a| Var::from_tensor(a).unwrap()).collect();
            let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
            let y = f(&ts);
            let r = rand(y.dims(), 99, y.dtype());
            let g = y.mul(&r).unwrap().sum_all().unwrap().backward().unwrap();
            let gs: Vec<Tensor> = vars
                .iter()
                .map(|v| g.get(v.as_tensor()).unwrap().clone())
                .collect();
            (y, gs)
        };
        let up: Vec<Tensor> = args
            .iter()
            .map(|a| a.to_dtype(DType::F64).unwrap())
            .collect();
        let (yf, gf) = grads(args, &fused);
        let (yr, gr) = grads(&up, &reference);
        let e = max_rel(&yf, &yr);
        assert!(e < tol, "{what}: forward {e:e}");
        for (k, (a, b)) in gf.iter().zip(&gr).enumerate() {
            let e = max_rel(a, b);
            assert!(e < tol, "{what}: gradient of argument {k} {e:e}");
        }
    }

    /// Rows of awkward lengths: 1, odd, a prime, one past a SIMD width.
    const ROWS: [usize; 5] = [1, 7, 17, 33, 192];

    #[test]
    fn fused_ops_match_the_primitive_composition() {
        for dtype in [DType::F64, DType::F32] {
            for (k, &n) in ROWS.iter().enumerate() {
                let seed = k as u64 * 10;
                let x = rand(&[2, 3, n], seed, dtype);
                let w = rand(&[n], seed + 1, dtype);
                let b = rand(&[n], seed + 2, dtype);
                check(
                    &format!("bias {dtype:?} {n}"),
                    &[x.clone(), b.clone()],
                    |a| bias_add(&a[0], &a[1]).unwrap(),
                    |a| a[0].broadcast_add(&a[1]).unwrap(),
                );
                check(
                    &format!("layer norm {dtype:?} {n}"),
                    &[x.clone(), w.clone(), b.clone()],
                    |a| layer_norm(&a[0], &a[1], &a[2], 1e-5).unwrap(),
                    |a| ops::layer_norm(&a[0], &a[1], &a[2], 1e-5).unwrap(),
                );
                check(
                    &format!("rms norm {dtype:?} {n}"),
                    &[x.clone(), w.clone()],
                    |a| rms_norm(&a[0], &a[1], 1e-6).unwrap(),
                    |a| ops::rms_norm(&a[0], &a[1], 1e-6).unwrap(),
                );
                check(
                    &format!("swiglu {dtype:?} {n}"),
                    &[x.clone(), rand(&[2, 3, n], seed + 4, dtype)],
                    |a| swiglu(&a[0], &a[1]).unwrap(),
                    |a| a[0].silu().unwrap().mul(&a[1]).unwrap(),
                );
                for n_rep in [2, 3] {
                    check(
                        &format!("repeat_kv {dtype:?} {n} x{n_rep}"),
                        &[rand(&[2, 3, 5, n], seed + 5, dtype)],
                        |a| repeat_kv(&a[0], n_rep).unwrap(),
                        |a| ops::repeat_kv(&a[0], n_rep).unwrap(),
                    );
                }
                check(
                    &format!("gelu {dtype:?} {n}"),
                    std::slice::from_ref(&x),
                    |a| gelu_tanh(&a[0]).unwrap(),
                    |a| ops::gelu_tanh(&a[0]).unwrap(),
                );
                for window in [None, Some(1), Some(3)] {
                    let s = rand(&[2, 2, n, n], seed + 3, dtype);
                    let reference = |a: &[Tensor]| {
                        let att = a[0].affine(0.37, 0.0).unwrap();
                        let mask =
                            ops::causal_mask_window(n, window, DType::F64, &Device::Cpu).unwrap();
                        ops::softmax_last(&att.broadcast_add(&mask).unwrap()).unwrap()
                    };
                    check(
                        &format!("softmax {dtype:?} {n} {window:?}"),
                        &[s],
                        |a| causal_softmax(&a[0], 0.37, window).unwrap(),
                        reference,
                    );
                }
            }
        }
    }

    #[test]
    fn the_upstream_objective_passes_g_on_exactly() {
        for dtype in [DType::F32, DType::F64] {
            let y = Var::from_tensor(&rand(&[3, 5, 7], 1, dtype)).unwrap();
            let g = rand(&[3, 5, 7], 2, dtype);
            let w = Var::from_tensor(&rand(&[7], 3, dtype)).unwrap();
            // Through an op, so the gradient flows on: d/dw of <y * w, g>.
            let yw = y.as_tensor().broadcast_mul(w.as_tensor()).unwrap();
            let fused = upstream_objective(&yw, &g).unwrap().backward().unwrap();
            let prim = yw.mul(&g).unwrap().sum_all().unwrap().backward().unwrap();
            for v in [&y, &w] {
                let (a, b) = (
                    fused.get(v.as_tensor()).unwrap(),
                    prim.get(v.as_tensor()).unwrap(),
                );
                assert_eq!(max_rel(a, b), 0.0, "{dtype:?}");
            }
        }
    }

    #[test]
    fn other_dtypes_take_the_primitive_path() {
        let x = rand(&[2, 5], 1, DType::BF16);
        let b = rand(&[5], 2, DType::BF16);
        let y = bias_add(&x, &b).unwrap();
        let r = x.broadcast_add(&b).unwrap();
        assert_eq!(max_rel(&y, &r), 0.0);
        assert!(!fusable(&[&x, &b]));
        // Mixed dtypes are not fused either.
        assert!(!fusable(&[
            &rand(&[2], 1, DType::F32),
            &rand(&[2], 1, DType::F64)
        ]));
    }
}
