//! Fused CPU ops with a hand-written backward: the blocks' norms, bias
//! adds, masked softmax and GELU, each one pass forward and one backward
//! over contiguous rows instead of candle's chain of primitive ops.
//!
//! The ops: the linear (`x W + b`, [`linear`]; with GPT-2's GELU after it
//! in one op, [`linear_gelu_tanh`]), the whole causal attention
//! of a block's heads ([`attention`], [`attention_packed`]: see `sdpa`),
//! the rotary embedding with the split into heads ([`rope_heads`]), bias
//! add, LayerNorm, RMSNorm, the causal softmax (scale and mask folded
//! in), GELU (tanh), SwiGLU (`silu(a) · b`) and GQA's `repeat_kv`; and the
//! injection of a unit's upstream gradient. The linear and the attention
//! run their own matmuls through `matmul`, a bounds-checked wrapper of
//! gemm (the module's one `unsafe` call).
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
//! same run went from 0.28x PyTorch eager's tokens/s to 0.82x
//! (`scripts/compare_torch.py`), and the profile is the matmuls first.
//! The fused ops' share, alternating `scripts/compare_torch.py --arms tz
//! --rounds 1` with and without `TIERZERO_PRIMITIVE_OPS=1`: 9,316-9,624
//! tokens/s fused, 4,001-4,172 with the primitives.
//!
//! On session 7's VM, whose thread wake-ups are slower, the same build ran
//! at 0.42x (4,806 against 11,515 tokens/s). After the compute pool
//! (`crate::engine::host::threads::ComputePool`), the fused linear,
//! attention (`sdpa`) and rotary embedding, and the branch-free f32
//! exponential, `scripts/compare_torch.py --rounds 3 --arms torch,tz,tz_nvme`
//! gave 0.76x in memory and 0.71x with params and optimizer state on NVMe
//! (the NVMe step 1.07x the in-memory one); the Llama shape 0.62x. What is
//! left: gemm's own two-thread scaling (`scripts/compare_matmul.py`, a
//! `[1024, 192] x [192, 768]` product: gemm 140-144 GFLOP/s on one thread
//! and 219-226 on two, torch's MKL 151-152 and 266-277) and candle's
//! one-thread zero-and-add per graph node in backward.
//!
//! On session 8's VM (its speed rose by half during the session with no
//! change of code), after the element loops built for AVX2
//! (`crate::wide`), the softmax rows in f64 lanes, the gradient norm on
//! hardware FMA and gemm outputs that are not zeroed first, the same
//! command gave 0.78x in memory (11,629 against 14,996 tokens/s) and 0.70x
//! on NVMe (the NVMe step 1.10x the in-memory one), the Llama shape 0.71x.
//! The profile then: gemm 46%, the element loops 26% (largest: the
//! attention's backward with its softmax recomputed, and the LayerNorm
//! backward), candle's backprop add 5.7% and its zeroing 3.7%. Row sums in
//! 8 lanes for the norms gave the same bits and no speed; not kept.
//!
//! Session 9 read the element loops' machine code (`perf annotate`). Most
//! of them were still scalar, for two reasons:
//! * `exp_f32`'s `n as i32`, a saturating cast, compiled to a scalar
//!   convert and a NaN fix-up per lane. The exponent now comes from the
//!   rounding constant's bits, with the same result (`pointwise`'s tests);
//!   GELU, SwiGLU and the softmax vectorize.
//! * The lane sums indexed their inputs through a closure (`|j| x[j]`),
//!   which kept the bounds checks and compiled to 8 scalar adds.
//!   `sum_lanes` now takes fixed `LANES`-wide windows of its columns, and
//!   the norms' row sums and the softmax sum go through it. The order is
//!   the same, and so are the bits.
//!
//! Results:
//! * The element loops went from 26% of the samples to 14% (gemm 54%,
//!   candle's backprop add 8%, memset 6%).
//! * GPT-2 stage 0 ran 8-13% faster, with the same `weight_sha256`
//!   (`scripts/ab_train.sh`).
//! * `scripts/compare_torch.py --rounds 3` gave 0.82x in memory (10,083
//!   against 12,223 tokens/s) and 0.80x on NVMe. The NVMe step was 1.035x
//!   the in-memory one, after the param swap slots
//!   (`docs/decisions/param-swap-slots.md`).
//! * The Llama shape gave 0.77x, and 0.68x on NVMe.
//! * Then the fc linear and its GELU became one op ([`linear_gelu_tanh`]),
//!   one `[rows, 4h]` graph edge fewer a block. The same bits. Alternated
//!   over 7 rounds: median 10,012 tok/s against 9,850 (+1.6%, 6 rounds of
//!   7 faster), and peak RSS 4 MiB lower. `scripts/compare_torch.py
//!   --rounds 3 --arms torch,tz,tz_nvme` then gave 0.86x in memory
//!   (10,361 against 12,019 tokens/s) and 0.82x on NVMe (the NVMe step
//!   1.06x the in-memory one).
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
//! * Not an op of the model: [`add_grad_into`] (`accumulate`), the
//!   trainer's add of a gradient into the optimizer's fp32 sums, lives
//!   here for the pool helpers; it reads fp32, bf16 and fp16 as stored and
//!   has no primitive composition (it is one `+=` an element).
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
    /// `exp(x)` in this type's precision: f64's own; for f32 the
    /// branch-free [`pointwise::exp_f32`] (within 2 ulp of libm's `expf`,
    /// which candle's `exp` calls, and several times cheaper).
    fn exp_in(x: f64) -> f64;
}

macro_rules! real {
    ($t:ty, $variant:ident, $exp:expr) => {
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
                let f: fn($t) -> $t = $exp;
                f64::from(f(x as $t))
            }
        }
    };
}
real!(f32, F32, pointwise::exp_f32);
real!(f64, F64, f64::exp);

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

/// [`with_elems`] of an fp32 tensor, for the units on other executors.
pub(crate) fn with_f32<R>(
    t: &Tensor,
    f: impl FnOnce(&[f32]) -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    with_elems::<f32, _>(t, f)
}

/// A 16-bit tensor's contiguous elements (copied contiguous first if
/// need be), for the device tier's 2-byte uploads: `pick` takes them out
/// of the CPU storage of the right dtype.
fn with_16<T, R>(
    t: &Tensor,
    what: &str,
    pick: fn(&CpuStorage) -> Option<&[T]>,
    f: impl FnOnce(&[T]) -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    let all = match &*storage {
        Storage::Cpu(s) => pick(s),
        _ => None,
    }
    .ok_or_else(|| candle_core::Error::Msg(format!("{what} elements: not a {what} CPU tensor")))?;
    let (a, b) = layout
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg(format!("{what} elements: non-contiguous")))?;
    let v = all.get(a..b).ok_or_else(|| {
        candle_core::Error::Msg(format!("{what} elements: layout out of storage"))
    })?;
    f(v)
}

/// A bf16 tensor's contiguous elements ([`with_16`]).
pub(crate) fn with_bf16<R>(
    t: &Tensor,
    f: impl FnOnce(&[half::bf16]) -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    let pick: fn(&CpuStorage) -> Option<&[half::bf16]> = |s| match s {
        CpuStorage::BF16(v) => Some(v.as_slice()),
        _ => None,
    };
    with_16(t, "bf16", pick, f)
}

/// An fp16 tensor's contiguous elements ([`with_16`]).
pub(crate) fn with_f16<R>(
    t: &Tensor,
    f: impl FnOnce(&[half::f16]) -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    let pick: fn(&CpuStorage) -> Option<&[half::f16]> = |s| match s {
        CpuStorage::F16(v) => Some(v.as_slice()),
        _ => None,
    };
    with_16(t, "fp16", pick, f)
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
    let task = |r0: usize, chunk: &mut [T]| {
        crate::wide::run(
            #[inline(always)]
            || f(r0, chunk),
        )
    };
    if out.len() <= rows * n {
        task(0, out);
        return;
    }
    out.par_chunks_mut(n * rows)
        .enumerate()
        .for_each(|(b, chunk)| task(b * rows, chunk));
}

/// Partial results of the fused ops' row reductions: term `j` goes to lane
/// `j % LANES`, and the lanes combine in lane order. A fixed order whatever
/// the threads, and no chain of dependent adds, so the loops vectorize.
pub(super) const LANES: usize = 8;

/// `Σ term(cols[0][j], .., cols[K-1][j])` over the elements `j` of `K`
/// columns of one length (a shorter one panics), in f64, in [`LANES`]
/// interleaved partial sums: element `j` in lane `j % LANES`, the lanes
/// added in lane order.
///
/// The loop takes the columns [`LANES`] elements at a time as arrays: a
/// term given an index (`|j| x[j]`) kept its bounds checks and compiled to
/// scalar adds, which the fixed windows do not.
#[inline(always)]
fn sum_lanes<T: Real, const K: usize>(cols: [&[T]; K], term: impl Fn([f64; K]) -> f64) -> f64 {
    let n = cols.first().map_or(0, |c| c.len());
    let split: [(&[[T; LANES]], &[T]); K] = std::array::from_fn(|i| cols[i][..n].as_chunks());
    let mut acc = [0f64; LANES];
    for c in 0..n / LANES {
        let win: [&[T; LANES]; K] = std::array::from_fn(|i| &split[i].0[c]);
        for (k, a) in acc.iter_mut().enumerate() {
            *a += term(std::array::from_fn(|i| win[i][k].f()));
        }
    }
    for (k, a) in acc.iter_mut().enumerate().take(n % LANES) {
        *a += term(std::array::from_fn(|i| split[i].1[k].f()));
    }
    acc.iter().sum()
}

/// Elementwise over `len` elements: `f(range)` per task, in parallel when
/// there is more than one.
fn par_elems<T: Send>(out: &mut [T], f: impl Fn(usize, &mut [T]) + Sync + Send) {
    let task = |at: usize, chunk: &mut [T]| {
        crate::wide::run(
            #[inline(always)]
            || f(at, chunk),
        )
    };
    if out.len() <= TASK_ELEMS {
        task(0, out);
        return;
    }
    out.par_chunks_mut(TASK_ELEMS)
        .enumerate()
        .for_each(|(b, chunk)| task(b * TASK_ELEMS, chunk));
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
        crate::wide::run(
            #[inline(always)]
            || {
                for r in b * per..((b + 1) * per).min(rows) {
                    add(r, &mut acc);
                }
            },
        );
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
        crate::wide::run(
            #[inline(always)]
            || f(b * rows, chunk, &mut acc),
        );
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

mod accumulate;
mod attention;
mod linear;
mod matmul;
mod norm;
mod pointwise;
mod rope;
mod sdpa;

pub use accumulate::{
    add_grad_elems_into, add_grad_into, bf16_sums_to_f32, copy_bf16_elems_into,
    copy_bf16_grad_into, elems_to_f32, fill_zeros, grad_to_f32, set_grad_elems_into, set_grad_into,
    widen_elems_into, zeros_bf16, zeros_f32,
};
pub use attention::{causal_softmax, repeat_kv};
pub use linear::{count_hidden, linear, linear_gelu_tanh, WeightLayout};
pub use norm::{layer_norm, rms_norm};
pub use pointwise::{bias_add, gelu_tanh, swiglu, upstream_objective};
pub use rope::rope_heads;
pub use sdpa::{attention, attention_packed, split_packed};

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;
    use candle_core::{Device, Var};

    /// `n` deterministic values in [-1, 1) (xorshift of `seed`), the fused
    /// tests' and `matmul`'s inputs.
    pub(super) fn unit_values(n: usize, seed: u64) -> Vec<f64> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
            })
            .collect()
    }

    /// `sum_lanes` is its documented order (element `j` in lane `j %
    /// LANES`, lanes added in order) at sizes around the window, for one,
    /// two and three columns, bit for bit.
    #[test]
    fn sum_lanes_is_in_lane_order() {
        for n in [0, 1, 7, 8, 9, 15, 16, 17, 63, 192, 193] {
            let cols: Vec<Vec<f32>> = (0..3)
                .map(|s| {
                    unit_values(n, 40 + s)
                        .into_iter()
                        .map(|v| v as f32 * 1e3)
                        .collect()
                })
                .collect();
            let (a, b, c) = (&cols[0][..], &cols[1][..], &cols[2][..]);
            let want = |term: &dyn Fn(usize) -> f64| {
                let mut lanes = [0f64; LANES];
                for j in 0..n {
                    lanes[j % LANES] += term(j);
                }
                lanes.iter().sum::<f64>()
            };
            let f = |j: usize| f64::from(a[j]);
            assert_eq!(
                sum_lanes([a], |[x]| x).to_bits(),
                want(&f).to_bits(),
                "n={n}"
            );
            let f = |j: usize| f64::from(a[j]) * f64::from(b[j]);
            let got = sum_lanes([a, b], |[x, y]| x * y);
            assert_eq!(got.to_bits(), want(&f).to_bits(), "n={n}");
            let f = |j: usize| f64::from(a[j]) * f64::from(b[j]) - f64::from(c[j]);
            let got = sum_lanes([a, b, c], |[x, y, z]| x * y - z);
            assert_eq!(got.to_bits(), want(&f).to_bits(), "n={n}");
        }
    }

    /// A tensor of values in [-2, 2) (twice [`unit_values`]: exact).
    fn rand(shape: &[usize], seed: u64, dtype: DType) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f64> = unit_values(n, seed).into_iter().map(|v| 2.0 * v).collect();
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
        check_within(what, tol, args, fused, reference);
    }

    /// [`check`] within `tol` (relative to the largest reference value).
    fn check_within(
        what: &str,
        tol: f64,
        args: &[Tensor],
        fused: impl Fn(&[Tensor]) -> Tensor,
        reference: impl Fn(&[Tensor]) -> Tensor,
    ) {
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

    /// The backward's column sums (norm weights, biases) over more rows
    /// than one task takes: the blocks' partial sums combined, against the
    /// primitive composition (the tests above stay within one block).
    #[test]
    fn column_sums_over_several_blocks_match_the_primitive_composition() {
        for (k, n) in [7usize, 700].into_iter().enumerate() {
            let rows = 3 * rows_per_task(n) + 5;
            let seed = 100 + k as u64 * 10;
            let x = rand(&[1, rows, n], seed, DType::F64);
            let w = rand(&[n], seed + 1, DType::F64);
            let b = rand(&[n], seed + 2, DType::F64);
            check(
                &format!("bias {n} x {rows} rows"),
                &[x.clone(), b.clone()],
                |a| bias_add(&a[0], &a[1]).unwrap(),
                |a| a[0].broadcast_add(&a[1]).unwrap(),
            );
            check(
                &format!("layer norm {n} x {rows} rows"),
                &[x.clone(), w.clone(), b],
                |a| layer_norm(&a[0], &a[1], &a[2], 1e-5).unwrap(),
                |a| ops::layer_norm(&a[0], &a[1], &a[2], 1e-5).unwrap(),
            );
            check(
                &format!("rms norm {n} x {rows} rows"),
                &[x, w],
                |a| rms_norm(&a[0], &a[1], 1e-6).unwrap(),
                |a| ops::rms_norm(&a[0], &a[1], 1e-6).unwrap(),
            );
        }
    }

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
                for (window, scale) in [
                    (None, 0.37),
                    (Some(1), 0.37),
                    (Some(3), 0.37),
                    (None, -0.37),
                ] {
                    let s = rand(&[2, 2, n, n], seed + 3, dtype);
                    let reference = |a: &[Tensor]| {
                        let att = a[0].affine(scale, 0.0).unwrap();
                        let mask =
                            ops::causal_mask_window(n, window, DType::F64, &Device::Cpu).unwrap();
                        ops::softmax_last(&att.broadcast_add(&mask).unwrap()).unwrap()
                    };
                    check(
                        &format!("softmax {dtype:?} {n} {window:?} scale {scale}"),
                        &[s],
                        |a| causal_softmax(&a[0], scale, window).unwrap(),
                        reference,
                    );
                }
            }
        }
    }

    /// The attention's reference: [`ops::repeat_kv`], the scores, the
    /// primitive masked softmax, `p v`, and the heads merged to `[b, t, nh
    /// · d]` (`v` in `[b, nkv, t, d]`).
    fn attention_reference(q: &Tensor, k: &Tensor, v: &Tensor, window: Option<usize>) -> Tensor {
        let (b, nh, t, d) = q.dims4().unwrap();
        let n_rep = nh / k.dim(1).unwrap();
        let k = ops::repeat_kv(k, n_rep).unwrap();
        let v = ops::repeat_kv(v, n_rep).unwrap();
        let att = q.matmul(&k.t().unwrap()).unwrap();
        let att = att.affine(1.0 / (d as f64).sqrt(), 0.0).unwrap();
        let mask = ops::causal_mask_window(t, window, DType::F64, &Device::Cpu).unwrap();
        let p = ops::softmax_last(&att.broadcast_add(&mask).unwrap()).unwrap();
        let y = p.matmul(&v).unwrap();
        y.transpose(1, 2)
            .unwrap()
            .contiguous()
            .unwrap()
            .reshape((b, t, nh * d))
            .unwrap()
    }

    /// `[b, t, n · d]` rows to `[b, n, t, d]` heads.
    fn split_heads(x: &Tensor, n: usize) -> Tensor {
        let (b, t, w) = x.dims3().unwrap();
        x.reshape((b, t, n, w / n))
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .contiguous()
            .unwrap()
    }

    #[test]
    fn fused_attention_matches_the_primitive_composition() {
        // Sequence lengths and head dims of awkward sizes; 1, 2 and 3 query
        // heads per key/value head; windows none, 1 and 3; `v` as heads
        // and as its projection's rows.
        let mut seed = 500;
        for dtype in [DType::F64, DType::F32] {
            // f32 sums of up to 33 products against the f64 reference.
            let tol = if dtype == DType::F64 { 1e-12 } else { 1e-5 };
            for &(t, d) in &[(1, 1), (7, 5), (17, 8), (33, 3)] {
                for (nkv, n_rep) in [(2, 1), (1, 2), (2, 3)] {
                    for window in [None, Some(1), Some(3)] {
                        seed += 3;
                        let nh = nkv * n_rep;
                        let what =
                            format!("attention {dtype:?} t {t} d {d} {nkv}x{n_rep} {window:?}");
                        let scale = 1.0 / (d as f64).sqrt();
                        let args = [
                            rand(&[2, nh, t, d], seed, dtype),
                            rand(&[2, nkv, t, d], seed + 1, dtype),
                            rand(&[2, nkv, t, d], seed + 2, dtype),
                        ];
                        check_within(
                            &what,
                            tol,
                            &args,
                            |a| attention(&a[0], &a[1], &a[2], scale, window).unwrap(),
                            |a| attention_reference(&a[0], &a[1], &a[2], window),
                        );
                        let rows = [
                            args[0].clone(),
                            args[1].clone(),
                            rand(&[2, t, nkv * d], seed + 2, dtype),
                        ];
                        check_within(
                            &format!("{what}, v rows"),
                            tol,
                            &rows,
                            |a| attention(&a[0], &a[1], &a[2], scale, window).unwrap(),
                            |a| attention_reference(&a[0], &a[1], &split_heads(&a[2], nkv), window),
                        );
                        if n_rep == 1 {
                            // GPT-2's packed qkv.
                            let h = nh * d;
                            let qkv = rand(&[2, t, 3 * h], seed + 2, dtype);
                            check_within(
                                &format!("{what}, packed"),
                                tol,
                                &[qkv],
                                |a| attention_packed(&a[0], nh, scale, window).unwrap(),
                                |a| {
                                    let part =
                                        |i| split_heads(&a[0].narrow(2, i * h, h).unwrap(), nh);
                                    attention_reference(&part(0), &part(1), &part(2), window)
                                },
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn fused_rope_gives_the_compositions_bits() {
        for dtype in [DType::F64, DType::F32] {
            for &(t, n, d) in &[(1, 1, 2), (7, 3, 6), (17, 2, 16)] {
                let x = rand(&[2, t, n * d], 40 + t as u64, dtype);
                let (cos, sin) = ops::rope_tables(t, d, 10_000.0, dtype, &Device::Cpu).unwrap();
                let r = rand(&[2, n, t, d], 41, dtype);
                let run = |fused: bool| {
                    let v = Var::from_tensor(&x).unwrap();
                    let y = if fused {
                        rope_heads(v.as_tensor(), n, &cos, &sin).unwrap()
                    } else {
                        ops::apply_rope(&split_heads(v.as_tensor(), n), &cos, &sin).unwrap()
                    };
                    let g = y.mul(&r).unwrap().sum_all().unwrap().backward().unwrap();
                    (y, g.get(v.as_tensor()).unwrap().clone())
                };
                let ((yf, gf), (yc, gc)) = (run(true), run(false));
                assert_eq!(yf.dims(), &[2, n, t, d]);
                assert_eq!(max_rel(&yf, &yc), 0.0, "{dtype:?} {t} {n} {d}");
                assert_eq!(max_rel(&gf, &gc), 0.0, "{dtype:?} {t} {n} {d} gradient");
                // [b, t, n, d] in (after a per-head norm) is the same.
                let y4 = rope_heads(&x.reshape((2, t, n, d)).unwrap(), n, &cos, &sin).unwrap();
                assert_eq!(max_rel(&y4, &yc), 0.0);
            }
        }
        let x = rand(&[1, 3, 6], 1, DType::F32);
        let (cos, sin) = ops::rope_tables(3, 6, 10_000.0, DType::F32, &Device::Cpu).unwrap();
        assert!(rope_heads(&x, 4, &cos, &sin).is_err());
        assert!(rope_heads(&x, 2, &cos, &sin).is_err(), "d = 3 is odd");
    }

    /// The linear tests' sizes: leading dims of `x`, inputs, outputs.
    const LINEAR_SIZES: &[(&[usize], usize, usize)] = &[
        (&[1], 1, 1),
        (&[2, 3], 7, 5),
        (&[3, 11], 33, 17),
        (&[65], 192, 9),
    ];

    /// `x [lead.., n_in]`, `W` laid out as `layout` and a bias of `n_out`,
    /// of seeds `seed..seed + 3`; and `x`'s shape.
    fn linear_args(
        lead: &[usize],
        n_in: usize,
        n_out: usize,
        layout: WeightLayout,
        seed: u64,
        dtype: DType,
    ) -> (Vec<usize>, [Tensor; 3]) {
        let mut xs = lead.to_vec();
        xs.push(n_in);
        let ws = match layout {
            WeightLayout::InOut => [n_in, n_out],
            WeightLayout::OutIn => [n_out, n_in],
        };
        let args = [
            rand(&xs, seed, dtype),
            rand(&ws, seed + 1, dtype),
            rand(&[n_out], seed + 2, dtype),
        ];
        (xs, args)
    }

    #[test]
    fn fused_linear_matches_the_primitive_composition() {
        let mut seed = 900;
        for dtype in [DType::F64, DType::F32] {
            let tol = if dtype == DType::F64 { 1e-12 } else { 1e-5 };
            for &(lead, n_in, n_out) in LINEAR_SIZES {
                for layout in [WeightLayout::InOut, WeightLayout::OutIn] {
                    for bias in [false, true] {
                        seed += 3;
                        let (xs, [x, w, b]) = linear_args(lead, n_in, n_out, layout, seed, dtype);
                        let mut args = vec![x, w];
                        if bias {
                            args.push(b);
                        }
                        check_within(
                            &format!("linear {dtype:?} {xs:?} -> {n_out} {layout:?} bias {bias}"),
                            tol,
                            &args,
                            |a| linear(&a[0], &a[1], a.get(2), layout).unwrap(),
                            |a| {
                                let w = match layout {
                                    WeightLayout::InOut => a[1].clone(),
                                    WeightLayout::OutIn => a[1].t().unwrap(),
                                };
                                let y = a[0].broadcast_matmul(&w).unwrap();
                                match a.get(2) {
                                    Some(b) => y.broadcast_add(b).unwrap(),
                                    None => y,
                                }
                            },
                        );
                    }
                }
            }
        }
    }

    /// The bits of `f(args)` and of the gradients of `sum(f(args)²)` with
    /// respect to each arg, computed on a pool of `threads` threads.
    fn bits_on(
        threads: usize,
        args: &[&Tensor],
        f: impl Fn(&[Tensor]) -> Tensor + Send + Sync,
    ) -> Vec<Vec<u64>> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            let vars: Vec<Var> = args.iter().map(|t| Var::from_tensor(t).unwrap()).collect();
            let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
            let y = f(&ts);
            let g = y.sqr().unwrap().sum_all().unwrap().backward().unwrap();
            // As f64 (exact for f32).
            let bits = |t: &Tensor| {
                t.flatten_all()
                    .unwrap()
                    .to_dtype(DType::F64)
                    .unwrap()
                    .to_vec1::<f64>()
                    .unwrap()
                    .into_iter()
                    .map(f64::to_bits)
                    .collect::<Vec<_>>()
            };
            let mut all = vec![bits(&y)];
            all.extend(vars.iter().map(|v| bits(g.get(v.as_tensor()).unwrap())));
            all
        })
    }

    #[test]
    fn fused_linear_refuses_bad_shapes_and_ignores_the_thread_count() {
        let x = rand(&[4, 6], 1, DType::F32);
        assert!(linear(&x, &rand(&[5, 3], 2, DType::F32), None, WeightLayout::InOut).is_err());
        assert!(linear(&x, &rand(&[3, 5], 2, DType::F32), None, WeightLayout::OutIn).is_err());
        let w = rand(&[6, 3], 2, DType::F32);
        assert!(linear(
            &x,
            &w,
            Some(&rand(&[4], 3, DType::F32)),
            WeightLayout::InOut
        )
        .is_err());
        // Large enough for gemm to split: the same bits on 1 and 3 threads.
        let x = rand(&[256, 192], 4, DType::F32);
        let w = rand(&[768, 192], 5, DType::F32);
        let b = rand(&[768], 6, DType::F32);
        let op = |a: &[Tensor]| linear(&a[0], &a[1], Some(&a[2]), WeightLayout::OutIn).unwrap();
        assert_eq!(bits_on(1, &[&x, &w, &b], op), bits_on(3, &[&x, &w, &b], op));
    }

    /// The linear + GELU op gives the composition's bits (values and every
    /// gradient), in f32 and f64, both layouts, on 1 and 2 threads; it
    /// counts the pre-activation it keeps, and without a graph it keeps
    /// nothing.
    #[test]
    fn fused_linear_gelu_is_the_composition_bit_for_bit() {
        let mut seed = 1300;
        for dtype in [DType::F32, DType::F64] {
            for &(lead, n_in, n_out) in LINEAR_SIZES {
                for layout in [WeightLayout::InOut, WeightLayout::OutIn] {
                    seed += 3;
                    let (xs, [x, w, b]) = linear_args(lead, n_in, n_out, layout, seed, dtype);
                    for threads in [1, 2] {
                        let fused = bits_on(threads, &[&x, &w, &b], |a| {
                            linear_gelu_tanh(&a[0], &a[1], &a[2], layout).unwrap()
                        });
                        let composed = bits_on(threads, &[&x, &w, &b], |a| {
                            gelu_tanh(&linear(&a[0], &a[1], Some(&a[2]), layout).unwrap()).unwrap()
                        });
                        assert_eq!(fused, composed, "{dtype:?} {xs:?} -> {n_out} {layout:?}");
                    }
                    // The pre-activation's bytes, counted while a graph is
                    // recorded; none without one.
                    let rows: usize = lead.iter().product();
                    let elem = dtype.size_in_bytes() as u64;
                    let wv = Var::from_tensor(&w).unwrap();
                    let (y, hidden) =
                        count_hidden(|| linear_gelu_tanh(&x, wv.as_tensor(), &b, layout).unwrap());
                    assert_eq!(hidden, (rows * n_out) as u64 * elem);
                    drop(y);
                    let (_, hidden) =
                        count_hidden(|| linear_gelu_tanh(&x, &w, &b, layout).unwrap());
                    assert_eq!(hidden, 0);
                }
            }
        }
        // A bad bias is refused, as the linear refuses it.
        let x = rand(&[4, 6], 1, DType::F32);
        let w = Var::from_tensor(&rand(&[6, 3], 2, DType::F32)).unwrap();
        let b = rand(&[4], 3, DType::F32);
        assert!(linear_gelu_tanh(&x, w.as_tensor(), &b, WeightLayout::InOut).is_err());
    }

    #[test]
    fn fused_attention_refuses_bad_shapes_and_ignores_the_thread_count() {
        let q = rand(&[1, 3, 4, 2], 1, DType::F32);
        let k = rand(&[1, 2, 4, 2], 2, DType::F32);
        assert!(attention(&q, &k, &k, 1.0, None).is_err());
        let k = rand(&[1, 3, 5, 2], 2, DType::F32);
        assert!(attention(&q, &k, &k, 1.0, None).is_err());
        let k = rand(&[1, 3, 4, 2], 2, DType::F32);
        assert!(attention(&q, &k, &rand(&[1, 4, 5], 3, DType::F32), 1.0, None).is_err());
        assert!(attention_packed(&rand(&[1, 4, 10], 1, DType::F32), 3, 1.0, None).is_err());
        // The same bits from any number of threads (tasks are heads).
        let q = rand(&[2, 4, 9, 3], 3, DType::F32);
        let k = rand(&[2, 2, 9, 3], 4, DType::F32);
        let v = rand(&[2, 2, 9, 3], 5, DType::F32);
        let op = |a: &[Tensor]| attention(&a[0], &a[1], &a[2], 0.5, None).unwrap();
        assert_eq!(bits_on(1, &[&q, &k, &v], op), bits_on(3, &[&q, &k, &v], op));
    }

    /// [`bits_on`] 2 threads with the fused ops' loops built for `isa`
    /// (an index in [`crate::wide::ALL`]).
    fn bits_with(
        isa: usize,
        args: &[&Tensor],
        f: &(dyn Fn(&[Tensor]) -> Tensor + Sync),
    ) -> Vec<Vec<u64>> {
        crate::wide::with_test_choice(isa, || bits_on(2, args, f))
    }

    #[test]
    fn every_instruction_set_gives_the_same_bits() {
        type Op = Box<dyn Fn(&[Tensor]) -> Tensor + Sync>;
        let isas: Vec<usize> = (1..crate::wide::ALL.len())
            .filter(|&k| crate::wide::ALL[k].supported())
            .collect();
        for dtype in [DType::F32, DType::F64] {
            for (k, &n) in ROWS.iter().enumerate() {
                let seed = 700 + k as u64 * 10;
                // 3 x 37 rows: several tasks for the larger rows.
                let x = rand(&[3, 37, n], seed, dtype);
                let y = rand(&[3, 37, n], seed + 1, dtype);
                let w = rand(&[n], seed + 2, dtype);
                let b = rand(&[n], seed + 3, dtype);
                let s = rand(&[2, 3, n, n], seed + 4, dtype);
                let cases: Vec<(&str, Vec<Tensor>, Op)> = vec![
                    (
                        "bias",
                        vec![x.clone(), b.clone()],
                        Box::new(|a| bias_add(&a[0], &a[1]).unwrap()),
                    ),
                    (
                        "layer norm",
                        vec![x.clone(), w.clone(), b.clone()],
                        Box::new(|a| layer_norm(&a[0], &a[1], &a[2], 1e-5).unwrap()),
                    ),
                    (
                        "rms norm",
                        vec![x.clone(), w.clone()],
                        Box::new(|a| rms_norm(&a[0], &a[1], 1e-6).unwrap()),
                    ),
                    (
                        "gelu",
                        vec![x.clone()],
                        Box::new(|a| gelu_tanh(&a[0]).unwrap()),
                    ),
                    (
                        "swiglu",
                        vec![x.clone(), y.clone()],
                        Box::new(|a| swiglu(&a[0], &a[1]).unwrap()),
                    ),
                    (
                        "softmax",
                        vec![s.clone()],
                        Box::new(|a| causal_softmax(&a[0], 0.37, Some(5)).unwrap()),
                    ),
                    (
                        "attention",
                        vec![
                            rand(&[2, 4, n, 3], seed + 5, dtype),
                            rand(&[2, 2, n, 3], seed + 6, dtype),
                            rand(&[2, 2, n, 3], seed + 7, dtype),
                        ],
                        Box::new(|a| attention(&a[0], &a[1], &a[2], 0.5, None).unwrap()),
                    ),
                ];
                for (what, args, op) in &cases {
                    let args: Vec<&Tensor> = args.iter().collect();
                    let base = bits_with(0, &args, op.as_ref());
                    for &isa in &isas {
                        assert!(
                            base == bits_with(isa, &args, op.as_ref()),
                            "{what} {dtype:?} {n}: {:?} differs from the baseline build",
                            crate::wide::ALL[isa]
                        );
                    }
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
