//! Row- and element-wise ops: the bias add, GELU (tanh), SwiGLU, and the
//! injection of a unit's upstream gradient.

use super::*;

/// `x [.., n] + b [n]`.
struct BiasAdd;

impl Forward2 for BiasAdd {
    fn run<T: Real>(&self, x: &[T], b: &[T]) -> Vec<T> {
        let n = b.len();
        let mut out = vec![T::of(0.0); x.len()];
        par_rows(
            &mut out,
            n,
            #[inline(always)]
            |r0, o| {
                for (o, x) in o.chunks_exact_mut(n).zip(x[r0 * n..].chunks_exact(n)) {
                    for ((o, &x), &b) in o.iter_mut().zip(x).zip(b) {
                        *o = T::of(x.f() + b.f());
                    }
                }
            },
        );
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
pub(super) fn bias_grad<T: Real>(g: &[T], n: usize) -> Vec<T> {
    column_sums(
        g.len() / n,
        n,
        #[inline(always)]
        |r, acc| {
            for (a, g) in acc.iter_mut().zip(&g[r * n..(r + 1) * n]) {
                *a += g.f();
            }
        },
    )
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
pub(super) struct GeluTanh;

const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
const GELU_C: f64 = 0.044715;

/// `tanh` of the GELU argument `sqrt(2/pi) (x + 0.044715 x^3)`, in f64
/// (f32 has its own, [`tanh_f32`]).
fn gelu_th(x: f64) -> f64 {
    (SQRT_2_OVER_PI * (x + GELU_C * x * x * x)).tanh()
}

impl GeluTanh {
    fn fwd<T: Real + GeluKernel>(x: &[T]) -> Vec<T> {
        let mut out = vec![T::of(0.0); x.len()];
        par_elems(
            &mut out,
            #[inline(always)]
            |at, o| T::gelu(&x[at..at + o.len()], o),
        );
        out
    }

    fn bwd_elems<T: Real + GeluKernel>(x: &[T], g: &[T]) -> Vec<T> {
        let mut out = vec![T::of(0.0); x.len()];
        par_elems(
            &mut out,
            #[inline(always)]
            |at, o| {
                let n = o.len();
                T::gelu_grad(&x[at..at + n], &g[at..at + n], o);
            },
        );
        out
    }
}

/// GELU's element loops, per type: f64 in f64; f32 in f32 through
/// [`exp_f32`], a branch-free exponential the compiler vectorizes (libm's
/// `expf`, one call an element, was a tenth of a step's samples: the
/// forward and the backward each take one `tanh` an element).
trait GeluKernel: Sized {
    /// `o = gelu(x)`.
    fn gelu(x: &[Self], o: &mut [Self]);
    /// `o = g · gelu'(x)`.
    fn gelu_grad(x: &[Self], g: &[Self], o: &mut [Self]);
}

impl GeluKernel for f64 {
    #[inline(always)]
    fn gelu(x: &[f64], o: &mut [f64]) {
        for (o, &x) in o.iter_mut().zip(x) {
            *o = 0.5 * x * (1.0 + gelu_th(x));
        }
    }

    #[inline(always)]
    fn gelu_grad(x: &[f64], g: &[f64], o: &mut [f64]) {
        for ((o, &x), &g) in o.iter_mut().zip(x).zip(g) {
            let th = gelu_th(x);
            let du = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_C * x * x);
            *o = g * (0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * du);
        }
    }
}

/// `tanh(u)` in f32 as `1 - 2 / (e^{2u} + 1)` through [`exp_f32`].
#[inline(always)]
fn tanh_f32(u: f32) -> f32 {
    1.0 - 2.0 / (exp_f32(2.0 * u) + 1.0)
}

impl GeluKernel for f32 {
    #[inline(always)]
    fn gelu(x: &[f32], o: &mut [f32]) {
        let (a, c) = (SQRT_2_OVER_PI as f32, GELU_C as f32);
        for (o, &x) in o.iter_mut().zip(x) {
            let th = tanh_f32(a * (x + c * x * x * x));
            *o = 0.5 * x * (1.0 + th);
        }
    }

    #[inline(always)]
    fn gelu_grad(x: &[f32], g: &[f32], o: &mut [f32]) {
        let (a, c) = (SQRT_2_OVER_PI as f32, GELU_C as f32);
        for ((o, &x), &g) in o.iter_mut().zip(x).zip(g) {
            let th = tanh_f32(a * (x + c * x * x * x));
            let du = a * (1.0 + 3.0 * c * x * x);
            *o = g * (0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * du);
        }
    }
}

/// `e^x` in f32 without a branch or a call, so that loops over it
/// vectorize: `x = n ln 2 + r` (`n` rounded to nearest by the 1.5 · 2^23
/// trick, `ln 2` in two parts), Cephes' degree-6 polynomial for `e^r` on
/// `|r| ≤ ln 2 / 2`, and `2^n` built in the exponent bits. Within 2 ulp of
/// the exact value for `x` in [-87, 88] (`tests`); clamped outside, so
/// `e^x` saturates at about 1.6e38 above and 1.2e-38 below instead of
/// overflowing to infinity or going subnormal.
#[inline(always)]
pub(super) fn exp_f32(x: f32) -> f32 {
    let (t, e) = exp_f32_parts(x);
    // n = t - ROUND is in [-126, 127] after the clamp: a normal exponent.
    // `t`'s low mantissa bits hold n (ROUND's mantissa is 2^22, so `t`'s
    // bits are ROUND's plus n), and n + 127 is in [1, 254]: its 9 low bits,
    // shifted into the exponent field, are 2^n; the shift drops ROUND's
    // bits. This is the bits `(n as i32 + 127) << 23` gave, but `as i32`
    // (saturating, NaN to 0) compiled to a scalar convert and a fix-up per
    // lane, which kept every loop over `exp_f32` from vectorizing.
    e * f32::from_bits(t.to_bits().wrapping_add(127) << 23)
}

/// 1.5 · 2^23: adding it rounds an f32 of magnitude below 2^22 to an
/// integer.
const EXP_ROUND: f32 = 12_582_912.0;

/// [`exp_f32`]'s `(x log2 e + EXP_ROUND, e^r)`: the rounded exponent `n`
/// is the first minus [`EXP_ROUND`], and `e^x = e^r · 2^n`.
#[inline(always)]
fn exp_f32_parts(x: f32) -> (f32, f32) {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 355.0 / 512.0; // 0.693359375, exact in f32
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = x.clamp(-87.0, 88.0);
    let t = x * LOG2E + EXP_ROUND;
    let n = t - EXP_ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = 1.987_569_1e-4_f32;
    let p = p * r + 1.398_2e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 0.166_666_65;
    let p = p * r + 0.5;
    (t, p * r * r + r + 1.0)
}

impl CustomOp1 for GeluTanh {
    fn name(&self) -> &'static str {
        "tz-gelu-tanh"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let out = match s {
            CpuStorage::F32(_) => f32::storage(Self::fwd::<f32>(elems::<f32>(s, l)?)),
            CpuStorage::F64(_) => f64::storage(Self::fwd::<f64>(elems::<f64>(s, l)?)),
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
        par_elems(
            &mut both,
            #[inline(always)]
            |at, o| {
                let first = at / 2;
                for (k, pair) in o.chunks_exact_mut(2).enumerate() {
                    let i = first + k;
                    let x = a[i].f();
                    let (silu, s) = Self::silu::<T>(x);
                    pair[0] = T::of(g[i].f() * b[i].f() * (s + x * s * (1.0 - s)));
                    pair[1] = T::of(g[i].f() * silu);
                }
            },
        );
        let da = both.iter().step_by(2).copied().collect();
        let db = both.iter().skip(1).step_by(2).copied().collect();
        (da, db)
    }
}

impl Forward2 for SwiGlu {
    fn run<T: Real>(&self, a: &[T], b: &[T]) -> Vec<T> {
        let mut out = vec![T::of(0.0); a.len()];
        par_elems(
            &mut out,
            #[inline(always)]
            |at, o| {
                for ((o, &a), &b) in o.iter_mut().zip(&a[at..]).zip(&b[at..]) {
                    *o = T::of(Self::silu::<T>(a.f()).0 * b.f());
                }
            },
        );
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_f32_is_within_two_ulp_and_saturates() {
        let mut worst = 0f64;
        let steps = 400_000;
        for i in 0..=steps {
            let x = -87.0 + 175.0 * f64::from(i) / f64::from(steps);
            let x = x as f32;
            let got = f64::from(exp_f32(x));
            let want = f64::from(x).exp();
            // One ulp of the f32 result.
            let ulp = f64::from(f32::EPSILON) * 2f64.powi(want.log2().floor() as i32);
            worst = worst.max((got - want).abs() / ulp);
        }
        assert!(worst <= 2.0, "{worst} ulp");
        assert_eq!(exp_f32(0.0), 1.0);
        for (x, lo, hi) in [(1e4f32, 1e38f32, f32::MAX), (-1e4, 1e-38, 2e-38)] {
            let e = exp_f32(x);
            assert!(e.is_finite() && e >= lo && e <= hi, "{x}: {e}");
        }
        assert!(exp_f32(f32::NAN).is_nan());
        // The exponent from the rounding constant's bits gives what the
        // integer convert gave (the implementation before it): the same
        // bits at every input, the clamps and NaN too.
        let by_convert = |x: f32| {
            let (t, e) = exp_f32_parts(x);
            e * f32::from_bits((((t - EXP_ROUND) as i32 + 127) as u32) << 23)
        };
        let sweep = (-2_000_000..=2_000_000).map(|i| i as f32 * 5e-5);
        let edges = [
            -1e30f32,
            -87.5,
            -87.0,
            88.0,
            88.5,
            1e30,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ];
        for x in sweep.chain(edges) {
            assert_eq!(exp_f32(x).to_bits(), by_convert(x).to_bits(), "{x}");
        }
        // tanh through it, against f64's.
        for i in -2000..=2000 {
            let u = i as f32 / 100.0;
            let got = f64::from(tanh_f32(u));
            assert!(
                (got - f64::from(u).tanh()).abs() < 2e-7,
                "tanh({u}) = {got}"
            );
        }
    }
}
