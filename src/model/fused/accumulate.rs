//! A param's gradient added into the optimizer's fp32 accumulator, on the
//! current rayon pool ([`add_grad_into`]), or copied as it is into a bf16
//! one where each element gets one gradient a step
//! ([`copy_bf16_grad_into`]), and those accumulators made ([`zeros_f32`],
//! [`zeros_bf16`], or [`fill_zeros`] of a spare the trainer kept).
//!
//! # Why
//!
//! The trainer adds each unit's gradients into its sub-groups' fp32 sums
//! as backward goes. Until session 49 that was, per param, on the
//! trainer's one thread: the gradient widened to a new fp32 tensor
//! (candle's `to_dtype`), copied out to a new `Vec` (`to_vec1`), then
//! added (the one-rank reduce-scatter); and every sub-group's sum was a
//! new `vec![0.0; n]`, which the heap zeroes on one thread too. With the
//! compute on a GPU that host work was the step: the 850M-param Llama of
//! `scripts/gpu_check.sh`'s step 6h (H200, bf16, params and optimizer on
//! the CPU) left the GPU idle 241-392 ms between one 45M-param block's
//! backward and the next (793 ms at the first), idle 6.1 s of its 8 s
//! step in all (34 gaps, forward and backward),
//! the GPU busy 0.12 s of it (`scripts/timeline_gaps.py --top 20` on
//! `docs/gpu-runs/2026-12-04-h200/timeline-offload-llama.json`).
//!
//! The pool is the caller's: the trainer runs these on its host pool
//! (the compute pool, or a pool of its own when a device computes:
//! `crate::engine::host::threads::ComputePool::for_host_work`).
//!
//! Here each task reads the gradient's own elements (fp32, bf16 or fp16,
//! as it came down: a host tensor's, or, `*_elems_into`, where a device's
//! copy landed them) and adds them widened, in chunks of
//! [`TASK_ELEMS`] on the pool's threads: one pass over the gradient and
//! the sum, nothing allocated.
//!
//! # The same bits
//!
//! Each element is `acc += f32::from(g)`, the widening exact, as the old
//! path's `to_dtype` then `+=` was: which thread adds a chunk changes
//! nothing. A zeroed accumulator is `+0.0` everywhere, as `vec!` gave.

use super::*;
use crate::model::exec_units::HostElems;

/// Adds `grad`'s elements `offset..offset + acc.len()` (of its contiguous
/// layout, row-major), widened to fp32, into `acc`, in parallel: for a
/// caller holding a host tensor ([`add_grad_elems_into`] is the trainer's,
/// from the elements as they are stored).
/// fp32, bf16 and fp16 gradients are read as they are stored; another
/// dtype is converted to fp32 first.
pub fn add_grad_into(acc: &mut [f32], grad: &Tensor, offset: usize) -> candle_core::Result<()> {
    put_grad::<true>(acc, grad, offset)
}

/// [`add_grad_into`] onto zeros without reading `acc`: each element becomes
/// `+0.0 + widen(g)`, the bits [`add_grad_into`] gives on an `acc` of
/// `+0.0`s (a `-0.0` gradient element becomes `+0.0`, as it did), so what
/// `acc` held is never read. A sum's first gradient, into a spare whose
/// old values are stale: one write of the sum instead of a zero fill, then
/// a read and a write.
pub fn set_grad_into(acc: &mut [f32], grad: &Tensor, offset: usize) -> candle_core::Result<()> {
    put_grad::<false>(acc, grad, offset)
}

/// [`add_grad_into`] from a gradient's elements as they are stored
/// (`src`, flat): where a device's copy landed them, read with no host
/// tensor made of them.
pub fn add_grad_elems_into(
    acc: &mut [f32],
    src: HostElems<'_>,
    offset: usize,
) -> candle_core::Result<()> {
    put_elems::<true>(acc, src, offset)
}

/// [`set_grad_into`] from a gradient's elements as they are stored
/// ([`add_grad_elems_into`]'s).
pub fn set_grad_elems_into(
    acc: &mut [f32],
    src: HostElems<'_>,
    offset: usize,
) -> candle_core::Result<()> {
    put_elems::<false>(acc, src, offset)
}

/// `acc[i] = base + widen(g[offset + i])`, `base` being `acc[i]` when
/// `ADD` ([`add_grad_into`]) and `+0.0` otherwise ([`set_grad_into`]).
fn put_grad<const ADD: bool>(
    acc: &mut [f32],
    grad: &Tensor,
    offset: usize,
) -> candle_core::Result<()> {
    match grad.dtype() {
        DType::BF16 => with_bf16(grad, |g| put_elems::<ADD>(acc, HostElems::Bf16(g), offset)),
        DType::F16 => with_f16(grad, |g| put_elems::<ADD>(acc, HostElems::F16(g), offset)),
        DType::F32 => with_f32(grad, |g| put_elems::<ADD>(acc, HostElems::F32(g), offset)),
        _ => with_f32(&grad.to_dtype(DType::F32)?, |g| {
            put_elems::<ADD>(acc, HostElems::F32(g), offset)
        }),
    }
}

/// The elements `offset..offset + n` of a gradient of `len`, or the
/// error naming them.
fn elems_range(offset: usize, n: usize, len: usize) -> candle_core::Result<std::ops::Range<usize>> {
    offset
        .checked_add(n)
        .filter(|&e| e <= len)
        .map(|end| offset..end)
        .ok_or_else(|| {
            candle_core::Error::Msg(format!(
                "gradient elements {offset}..{} of a gradient of {len}",
                offset.saturating_add(n),
            ))
        })
}

/// [`put_grad`] over the elements as they are stored.
fn put_elems<const ADD: bool>(
    acc: &mut [f32],
    src: HostElems<'_>,
    offset: usize,
) -> candle_core::Result<()> {
    let r = elems_range(offset, acc.len(), src.len())?;
    match src {
        HostElems::Bf16(g) => put_widened::<ADD, _>(acc, &g[r], half::bf16::to_f32),
        HostElems::F16(g) => put_widened::<ADD, _>(acc, &g[r], half::f16::to_f32),
        HostElems::F32(g) => put_widened::<ADD, _>(acc, &g[r], |x| x),
    }
    Ok(())
}

/// `grad`'s elements widened to fp32, in its contiguous (row-major)
/// order, in parallel: what `to_dtype(F32)` then `to_vec1` gave, in one
/// pass (the fp32 a collective on the host, or a tied param's sum over
/// its units, starts from).
pub fn grad_to_f32(grad: &Tensor) -> candle_core::Result<Vec<f32>> {
    match grad.dtype() {
        DType::BF16 => with_bf16(grad, |g| Ok(elems_to_f32(HostElems::Bf16(g)))),
        DType::F16 => with_f16(grad, |g| Ok(elems_to_f32(HostElems::F16(g)))),
        DType::F32 => with_f32(grad, |g| Ok(elems_to_f32(HostElems::F32(g)))),
        _ => with_f32(&grad.to_dtype(DType::F32)?, |g| Ok(g.to_vec())),
    }
}

/// [`grad_to_f32`] from the elements as they are stored.
pub fn elems_to_f32(src: HostElems<'_>) -> Vec<f32> {
    let mut out = Vec::new();
    match src {
        HostElems::Bf16(g) => g.par_iter().map(|x| x.to_f32()).collect_into_vec(&mut out),
        HostElems::F16(g) => g.par_iter().map(|x| x.to_f32()).collect_into_vec(&mut out),
        HostElems::F32(g) => g.par_iter().copied().collect_into_vec(&mut out),
    }
    out
}

/// `dst[i] = widen(src[offset + i])`, exactly as [`elems_to_f32`] widens
/// (a `-0.0` stays `-0.0`: this is the gradient, not a sum of it), into
/// `dst` in place, in parallel on the current pool: a gradient's chunks
/// laid out for a collective without an fp32 copy of it first.
pub fn widen_elems_into(
    dst: &mut [f32],
    src: HostElems<'_>,
    offset: usize,
) -> candle_core::Result<()> {
    let r = elems_range(offset, dst.len(), src.len())?;
    fn widen<T: Copy + Sync>(dst: &mut [f32], g: &[T], f: impl Fn(T) -> f32 + Sync) {
        par_elems(
            dst,
            #[inline(always)]
            |at, chunk| {
                for (d, &x) in chunk.iter_mut().zip(&g[at..]) {
                    *d = f(x);
                }
            },
        );
    }
    match src {
        HostElems::Bf16(g) => widen(dst, &g[r], half::bf16::to_f32),
        HostElems::F16(g) => widen(dst, &g[r], half::f16::to_f32),
        HostElems::F32(g) => widen(dst, &g[r], |x| x),
    }
    Ok(())
}

/// `acc[i] = base + widen(g[i])` (see [`put_grad`]), in parallel chunks.
/// `0.0 + x` is not folded to `x` (it differs at `-0.0`), so the set is
/// the add onto a zero, without its read.
fn put_widened<const ADD: bool, T: Copy + Sync>(
    acc: &mut [f32],
    g: &[T],
    widen: impl Fn(T) -> f32 + Sync,
) {
    par_elems(
        acc,
        #[inline(always)]
        |at, chunk| {
            for (a, &x) in chunk.iter_mut().zip(&g[at..]) {
                *a = if ADD { *a } else { 0.0 } + widen(x);
            }
        },
    );
}

/// `grad`'s elements `offset..offset + dst.len()` copied into `dst`, in
/// parallel: a sub-group's bf16 gradients, each element of which gets
/// one gradient a step (the trainer's bf16 sums, see `GradSum` in
/// `engine/trainer/groups.rs`). `grad` must be bf16: any other dtype
/// would be rounded, which an fp32 sum does not do.
pub fn copy_bf16_grad_into(
    dst: &mut [half::bf16],
    grad: &Tensor,
    offset: usize,
) -> candle_core::Result<()> {
    if grad.dtype() != DType::BF16 {
        return Err(candle_core::Error::Msg(format!(
            "a {:?} gradient copied as bf16",
            grad.dtype()
        )));
    }
    with_bf16(grad, |g| copy_bf16_elems_into(dst, g, offset))
}

/// [`copy_bf16_grad_into`] from the elements as they are stored.
pub fn copy_bf16_elems_into(
    dst: &mut [half::bf16],
    src: &[half::bf16],
    offset: usize,
) -> candle_core::Result<()> {
    let r = elems_range(offset, dst.len(), src.len())?;
    let g = &src[r];
    par_elems(
        dst,
        #[inline(always)]
        |at, chunk| chunk.copy_from_slice(&g[at..at + chunk.len()]),
    );
    Ok(())
}

/// `+0.0 + widen(src[i])` each ([`crate::optim::bf16_as_sum`]): bf16
/// gradients as the fp32 sums they stand for (what [`set_grad_into`]
/// would have written), into a new vector (each element written once),
/// in parallel on the current pool.
pub fn bf16_sums_to_f32(src: &[half::bf16]) -> Vec<f32> {
    let mut out = Vec::new();
    src.par_iter()
        .map(|&x| crate::optim::bf16_as_sum(x))
        .collect_into_vec(&mut out);
    out
}

/// `v` set to `+0.0`, in parallel chunks (a spare sum made new: its pages
/// are in place, so this is a write at memory speed, not the page faults
/// of a new block).
pub fn fill_zeros<T: Copy + Default + Send>(v: &mut [T]) {
    par_elems(
        v,
        #[inline(always)]
        |_, chunk| chunk.fill(T::default()),
    );
}

/// `numel` fp32 zeros (`+0.0`), written in parallel: a reused heap block
/// is not zeroed on one thread first.
pub fn zeros_f32(numel: usize) -> Vec<f32> {
    if numel <= TASK_ELEMS {
        return vec![0f32; numel];
    }
    let mut v = Vec::new();
    rayon::iter::repeat_n(0f32, numel).collect_into_vec(&mut v);
    v
}

/// `numel` bf16 zeros (`+0.0`), written in parallel ([`zeros_f32`]'s).
pub fn zeros_bf16(numel: usize) -> Vec<half::bf16> {
    let mut v = Vec::new();
    rayon::iter::repeat_n(half::bf16::ZERO, numel).collect_into_vec(&mut v);
    v
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a failure is a panic

    use super::*;
    use candle_core::Device;

    /// Values with every case an add meets: signed zeros, subnormals,
    /// infinities, NaN, and ordinary numbers of both signs.
    fn values(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| match i % 11 {
                0 => -0.0,
                1 => 0.0,
                2 => f32::MIN_POSITIVE / 3.0,
                3 if i % 97 == 3 => f32::INFINITY,
                4 if i % 89 == 4 => f32::NAN,
                _ => ((i as f32) * 0.618_034).sin() * 3.7,
            })
            .collect()
    }

    /// The reference: widened one by one, added one by one.
    fn reference(acc: &[f32], g: &[f32]) -> Vec<f32> {
        acc.iter().zip(g).map(|(a, b)| *a + *b).collect()
    }

    #[test]
    fn adds_every_dtype_as_the_scalar_loop_does_at_awkward_sizes_and_offsets() {
        for (numel, offset, len) in [
            (1, 0, 1),
            (7, 3, 4),
            (TASK_ELEMS + 1, 0, TASK_ELEMS + 1),
            (3 * TASK_ELEMS + 17, 5, 2 * TASK_ELEMS + 3),
            (100_003, 99_000, 1003),
        ] {
            let g32 = values(numel);
            let acc0: Vec<f32> = values(len + 5)[5..].iter().map(|v| v * 0.5).collect();
            for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
                let t = Tensor::from_vec(g32.clone(), numel, &Device::Cpu)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap();
                let widened: Vec<f32> = t.to_dtype(DType::F32).unwrap().to_vec1().unwrap();
                let want = reference(&acc0, &widened[offset..offset + len]);
                let mut got = acc0.clone();
                add_grad_into(&mut got, &t, offset).unwrap();
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{dtype:?} {numel} {offset} {len}");
                let copied = grad_to_f32(&t).unwrap();
                assert_eq!(bits(&copied), bits(&widened), "{dtype:?} {numel}: the copy");
                // Set: the add onto +0.0s, whatever `acc` held (NaN too),
                // -0.0 in the gradient becoming +0.0 as the add makes it.
                let want = reference(&vec![0.0; len], &widened[offset..offset + len]);
                let mut set = vec![f32::NAN; len];
                set_grad_into(&mut set, &t, offset).unwrap();
                assert_eq!(bits(&set), bits(&want), "{dtype:?} {numel} {offset}: set");
                assert!(set.iter().all(|v| v.to_bits() != (-0f32).to_bits()));
                // Widened into place (a collective's chunk): the copy's
                // bits, -0.0 kept, whatever `dst` held. (Stored elements
                // are fp32, bf16 or fp16.)
                if dtype == DType::F64 {
                    continue;
                }
                let mut into = vec![f32::NAN; len];
                crate::model::exec_units::with_host_elems(&t, |e| {
                    Ok(widen_elems_into(&mut into, e, offset))
                })
                .unwrap()
                .unwrap();
                let want = &widened[offset..offset + len];
                assert_eq!(bits(&into), bits(want), "{dtype:?} {numel} {offset}: widen");
            }
        }
    }

    #[test]
    fn reads_a_gradient_in_its_row_major_order_when_it_is_not_contiguous() {
        let t = Tensor::arange(0f32, 12.0, &Device::Cpu)
            .unwrap()
            .reshape((3, 4))
            .unwrap()
            .t()
            .unwrap();
        let mut acc = vec![1f32; 12];
        add_grad_into(&mut acc, &t, 0).unwrap();
        let want: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(grad_to_f32(&t).unwrap(), want);
        let want: Vec<f32> = want.iter().map(|v| v + 1.0).collect();
        assert_eq!(acc, want);
    }

    #[test]
    fn a_range_past_the_gradient_is_an_error_not_a_panic() {
        let t = Tensor::zeros(10, DType::BF16, &Device::Cpu).unwrap();
        let mut acc = vec![0f32; 4];
        let e = add_grad_into(&mut acc, &t, 7).unwrap_err().to_string();
        assert!(e.contains("7..11 of a gradient of 10"), "{e}");
        assert!(add_grad_into(&mut acc, &t, usize::MAX).is_err());
        assert!(set_grad_into(&mut acc, &t, 7).is_err());
        let z = vec![half::bf16::ZERO; 10];
        assert!(widen_elems_into(&mut acc, HostElems::Bf16(&z), 7).is_err());
    }

    #[test]
    fn zeros_are_positive_zeros_of_the_length_asked() {
        for n in [0, 1, TASK_ELEMS + 3] {
            let z = zeros_f32(n);
            assert_eq!(z.len(), n);
            assert!(z.iter().all(|v| v.to_bits() == 0));
            let mut v = values(n);
            fill_zeros(&mut v);
            assert!(v.iter().all(|v| v.to_bits() == 0), "{n}");
        }
    }
}
