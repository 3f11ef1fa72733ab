//! A bounds-checked GEMM on slices, for the fused ops that run their own
//! matmuls (the attention's per-head products, the fused linears).
//!
//! gemm's entry point takes raw pointers and strides. [`matmul`] and
//! [`matmul_split`] check every view against its slice first, so the one
//! `unsafe` call below can only touch elements of the slices it was given:
//! the output is a `&mut [T]` (exclusive, so it overlaps no input), the
//! inputs are shared slices, and nothing is kept after the call.
//!
//! [`matmul`] runs on the calling thread (`Parallelism::None`): the
//! attention splits its work over heads on rayon itself. [`matmul_split`]
//! lets gemm split the output's blocks over the current rayon pool, as
//! candle's own matmul does (the linears' large products); gemm splits
//! rows and columns of the output, never the inner dimension, so each
//! element is the same sum in the same order whatever the thread count
//! (the linear's tests check it).
#![allow(unsafe_code)]

use super::Real;

/// A strided matrix view: element `(i, j)` is `data[i · row_stride + j ·
/// col_stride]`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Mat<'a, T> {
    data: &'a [T],
    rows: usize,
    cols: usize,
    row_stride: usize,
    col_stride: usize,
}

impl<'a, T> Mat<'a, T> {
    /// `data` as a dense row-major `rows × cols` matrix.
    pub(super) fn rows(data: &'a [T], rows: usize, cols: usize) -> Self {
        Mat {
            data,
            rows,
            cols,
            row_stride: cols,
            col_stride: 1,
        }
    }

    /// `rows × cols` rows of `row_stride` elements from the start of
    /// `data` (a head's columns in a wider row).
    pub(super) fn strided(data: &'a [T], rows: usize, cols: usize, row_stride: usize) -> Self {
        Mat {
            data,
            rows,
            cols,
            row_stride,
            col_stride: 1,
        }
    }

    /// Rows of the view.
    pub(super) fn rows_len(&self) -> usize {
        self.rows
    }

    /// The transpose (no copy).
    pub(super) fn t(self) -> Self {
        Mat {
            data: self.data,
            rows: self.cols,
            cols: self.rows,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
        }
    }

    /// Whether every element the view names lies in its slice.
    fn in_bounds(&self) -> bool {
        if self.rows == 0 || self.cols == 0 {
            return true;
        }
        let last = (self.rows - 1)
            .checked_mul(self.row_stride)
            .zip((self.cols - 1).checked_mul(self.col_stride))
            .and_then(|(a, b)| a.checked_add(b));
        last.is_some_and(|l| l < self.data.len())
            && isize::try_from(self.row_stride).is_ok()
            && isize::try_from(self.col_stride).is_ok()
    }
}

/// Sizes that do not fit: a bug of the caller, reported as an error.
fn mismatch(what: &str) -> candle_core::Error {
    candle_core::Error::Msg(format!("fused matmul: {what}"))
}

/// `dst = scale · a · b` (`accumulate`: `dst += scale · a · b`), `dst`
/// dense row-major `a.rows × b.cols`, on the calling thread.
pub(super) fn matmul<T: Real>(
    dst: &mut [T],
    a: Mat<'_, T>,
    b: Mat<'_, T>,
    scale: T,
    accumulate: bool,
) -> candle_core::Result<()> {
    product(
        Dst::of(dst),
        a,
        b,
        scale,
        accumulate,
        gemm::Parallelism::None,
    )
}

/// `scale · a · b` into a new dense row-major `a.rows × b.cols` vector,
/// split by gemm over the current rayon pool's threads. The vector is not
/// zeroed first: gemm overwrites every element (zeroing a linear's output
/// and its gradients was 2–3% of a GPT-2 step, in `memset`).
pub(super) fn matmul_split<T: Real>(
    a: Mat<'_, T>,
    b: Mat<'_, T>,
    scale: T,
) -> candle_core::Result<Vec<T>> {
    let len = a
        .rows
        .checked_mul(b.cols)
        .ok_or_else(|| mismatch("output size"))?;
    let mut out: Vec<T> = Vec::with_capacity(len);
    let dst = Dst {
        ptr: out.as_mut_ptr(),
        len,
    };
    product(dst, a, b, scale, false, split())?;
    // SAFETY: `out` has capacity `len`; `product` returned Ok with m · n =
    // len and `accumulate` false, so every one of the `len` elements was
    // written before it returned: zeros for an empty inner dimension, else
    // by gemm (with `read_dst` false it overwrites the whole m × n output
    // without reading it).
    unsafe { out.set_len(len) };
    Ok(out)
}

/// gemm's parallelism for the current rayon pool.
fn split() -> gemm::Parallelism {
    let threads = rayon::current_num_threads();
    if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    }
}

/// The output of [`product`]: `len` elements at `ptr`, exclusively the
/// caller's (a `&mut [T]`, or a fresh vector's capacity, which is written
/// before it is read: only with `accumulate` false).
struct Dst<T> {
    ptr: *mut T,
    len: usize,
}

impl<T> Dst<T> {
    fn of(dst: &mut [T]) -> Self {
        Dst {
            ptr: dst.as_mut_ptr(),
            len: dst.len(),
        }
    }
}

fn product<T: Real>(
    dst: Dst<T>,
    a: Mat<'_, T>,
    b: Mat<'_, T>,
    scale: T,
    accumulate: bool,
    par: gemm::Parallelism,
) -> candle_core::Result<()> {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    if b.rows != k {
        return Err(mismatch("inner dims differ"));
    }
    if m.checked_mul(n) != Some(dst.len) {
        return Err(mismatch("output size"));
    }
    if !a.in_bounds() || !b.in_bounds() {
        return Err(mismatch("a view outside its slice"));
    }
    if dst.len == 0 {
        return Ok(());
    }
    if k == 0 {
        if !accumulate {
            for i in 0..dst.len {
                // SAFETY: `i < dst.len`, elements `Dst` says are the
                // caller's to write; `T` is `Copy`, so the write drops
                // nothing (the memory may be uninitialised).
                unsafe { dst.ptr.add(i).write(T::of(0.0)) };
            }
        }
        return Ok(());
    }
    let s = |x: usize| isize::try_from(x).map_err(|_| mismatch("stride"));
    let (dst_rs, a_rs, a_cs, b_rs, b_cs) = (
        s(n)?,
        s(a.row_stride)?,
        s(a.col_stride)?,
        s(b.row_stride)?,
        s(b.col_stride)?,
    );
    // SAFETY: `dst` names exactly m × n elements that are the caller's
    // alone (`Dst`), written row-major (row stride n, column stride 1),
    // and read only when `accumulate` (then they are an initialised
    // slice); `a` and `b` were checked above to name only elements of
    // their own slices (the last element (rows-1, cols-1) is in bounds and
    // strides are non-negative), and they cannot overlap `dst`, which is
    // borrowed mutably or freshly allocated. T is f32 or f64 (`Real`'s only
    // impls), both of which gemm supports. The call is synchronous (with
    // `Parallelism::Rayon` it returns once every split has run, and the
    // splits write disjoint blocks of `dst`) and keeps no pointer.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.ptr,
            1,
            dst_rs,
            accumulate,
            a.data.as_ptr(),
            a_cs,
            a_rs,
            b.data.as_ptr(),
            b_cs,
            b_rs,
            T::of(1.0),
            scale,
            false,
            false,
            false,
            par,
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::super::tests::unit_values as vals;
    use super::*;

    /// The scalar reference: f64, in index order.
    fn reference(a: &Mat<'_, f64>, b: &Mat<'_, f64>) -> Vec<f64> {
        let mut out = vec![0.0; a.rows * b.cols];
        for i in 0..a.rows {
            for j in 0..b.cols {
                let mut acc = 0.0;
                for p in 0..a.cols {
                    acc += a.data[i * a.row_stride + p * a.col_stride]
                        * b.data[p * b.row_stride + j * b.col_stride];
                }
                out[i * b.cols + j] = acc;
            }
        }
        out
    }

    #[test]
    fn matches_the_scalar_reference_at_awkward_sizes_and_transposes() {
        for &(m, k, n) in &[
            (1, 1, 1),
            (7, 3, 5),
            (17, 33, 1),
            (1, 129, 31),
            (48, 64, 48),
        ] {
            let a = vals(m * k, 1);
            let b = vals(k * n, 2);
            let at = vals(k * m, 3);
            let bt = vals(n * k, 4);
            let cases = [
                (Mat::rows(&a[..], m, k), Mat::rows(&b[..], k, n)),
                (Mat::rows(&at[..], k, m).t(), Mat::rows(&b[..], k, n)),
                (Mat::rows(&a[..], m, k), Mat::rows(&bt[..], n, k).t()),
                (Mat::rows(&at[..], k, m).t(), Mat::rows(&bt[..], n, k).t()),
            ];
            for (c, (x, y)) in cases.iter().enumerate() {
                let want = reference(x, y);
                let mut got = vec![0.5; m * n];
                matmul(&mut got, *x, *y, 1.0, false).unwrap();
                for (g, w) in got.iter().zip(&want) {
                    assert!((g - w).abs() < 1e-12, "{m}x{k}x{n} case {c}");
                }
                // Accumulating, scaled: dst + 0.5 · a · b.
                let mut acc = vec![0.25; m * n];
                matmul(&mut acc, *x, *y, 0.5, true).unwrap();
                for (g, w) in acc.iter().zip(&want) {
                    assert!((g - (0.25 + 0.5 * w)).abs() < 1e-12, "{m}x{k}x{n} case {c}");
                }
                // Into a new vector, split over 3 threads: the same bits
                // as on the calling thread.
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(3)
                    .build()
                    .unwrap();
                let split = pool.install(|| matmul_split(*x, *y, 1.0).unwrap());
                assert_eq!(split, got, "{m}x{k}x{n} case {c} split");
                // f32 too, within its rounding.
                let (x32, y32): (Vec<f32>, Vec<f32>) = (
                    x.data.iter().map(|&v| v as f32).collect(),
                    y.data.iter().map(|&v| v as f32).collect(),
                );
                let view = |m: &Mat<'_, f64>, d| Mat {
                    data: d,
                    rows: m.rows,
                    cols: m.cols,
                    row_stride: m.row_stride,
                    col_stride: m.col_stride,
                };
                let mut got32 = vec![0f32; m * n];
                matmul(&mut got32, view(x, &x32[..]), view(y, &y32[..]), 1.0, false).unwrap();
                for (g, w) in got32.iter().zip(&want) {
                    assert!(
                        (f64::from(*g) - w).abs() < 1e-5 * k as f64,
                        "{m}x{k}x{n} f32"
                    );
                }
            }
        }
    }

    #[test]
    fn an_empty_inner_dimension_gives_zeros() {
        let (a, b) = (vec![0.0f64; 0], vec![0.0f64; 0]);
        assert_eq!(
            matmul_split(Mat::rows(&a, 3, 0), Mat::rows(&b, 0, 2), 1.0).unwrap(),
            vec![0.0; 6]
        );
        let mut out = vec![7.0; 6];
        matmul(
            &mut out,
            Mat::rows(&a, 3, 0),
            Mat::rows(&b, 0, 2),
            1.0,
            false,
        )
        .unwrap();
        assert_eq!(out, vec![0.0; 6]);
        assert!(matmul_split(Mat::rows(&a, 3, 0), Mat::rows(&b, 1, 2), 1.0).is_err());
    }

    #[test]
    fn refuses_views_outside_their_slices_and_wrong_sizes() {
        let a = vec![1.0f64; 6];
        let b = vec![1.0f64; 6];
        let mut out = vec![0.0; 4];
        // 2x3 · 3x2 fits.
        matmul(
            &mut out,
            Mat::rows(&a, 2, 3),
            Mat::rows(&b, 3, 2),
            1.0,
            false,
        )
        .unwrap();
        assert_eq!(out, vec![3.0; 4]);
        // A view one row too long.
        assert!(matmul(
            &mut out,
            Mat::rows(&a[..5], 2, 3),
            Mat::rows(&b, 3, 2),
            1.0,
            false
        )
        .is_err());
        // Inner dims that differ, and an output of the wrong size.
        assert!(matmul(
            &mut out,
            Mat::rows(&a, 2, 3),
            Mat::rows(&b, 2, 3),
            1.0,
            false
        )
        .is_err());
        assert!(matmul(
            &mut out[..3],
            Mat::rows(&a, 2, 3),
            Mat::rows(&b, 3, 2),
            1.0,
            false
        )
        .is_err());
        // k = 0: zeros, or dst unchanged when accumulating.
        let empty = |z: &mut [f64], accumulate| {
            let (a0, b0) = (Mat::rows(&a[..0], 2, 0), Mat::rows(&b[..0], 0, 2));
            matmul(z, a0, b0, 1.0, accumulate).unwrap();
        };
        let mut z = vec![7.0; 4];
        empty(&mut z, true);
        assert_eq!(z, vec![7.0; 4]);
        empty(&mut z, false);
        assert_eq!(z, vec![0.0; 4]);
    }
}
