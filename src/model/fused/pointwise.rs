//! Row- and element-wise ops: the bias add, GELU (tanh), SwiGLU, and the
//! injection of a unit's upstream gradient.

use super::*;

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
