//! Host-side copies into and out of pinned staging memory, split over
//! threads when they are long.
//!
//! An upload first copies its elements into a pinned staging buffer on
//! the calling thread (the engine's), and a download copies them out of
//! one: the copy engine reads and writes only page-locked memory. One
//! core's `memcpy` moves on the order of 10 GB/s, while a PCIe Gen5 x16
//! link carries about 50, so a one-thread fill would cap the whole tier's
//! host-to-device rate at the fill's. A copy of at least
//! [`PARALLEL_MIN_BYTES`] is therefore split into equal contiguous chunks,
//! one per scoped thread (the caller copies the first), at most
//! [`MAX_THREADS`] and at most the cores this process may use.
//!
//! Measured on the 2-core development VM
//! (`cargo run --release -p tierzero-gpu --example host_copy`): 256 MiB
//! between faulted pages, one thread 8.1-9.0 GB/s, two 12.7-18.5; at 16
//! MiB the split ran from 1.6 to 11.6 GB/s against one thread's 4.7-8.7
//! (the second core is shared with everything else); `to_vec` into a
//! fresh 256 MiB allocation is page-fault bound, 1.5 GB/s either way (a
//! trainer's heap settings keep such blocks mapped and reused, see
//! `tierzero::engine::host::heap`).
//!
//! The main crate's param store builds its long param tensors from their
//! stored bytes through it too (`tierzero::engine::params::store::cpu_tensor`):
//! the other copy on a cpu-tier param's way to the device.
//!
//! The bytes are the same whichever way they are copied: each element is
//! written once, from the same element of the source.

use std::sync::OnceLock;

/// Copies shorter than this stay on the calling thread: spawning costs
/// tens of microseconds a thread.
pub const PARALLEL_MIN_BYTES: usize = 8 << 20;

/// The most threads one copy uses.
pub const MAX_THREADS: usize = 8;

/// Threads for a copy of `bytes` on `cores` cores: 1 below
/// [`PARALLEL_MIN_BYTES`], then one per half of it, within [`MAX_THREADS`]
/// and `cores`.
pub fn threads_for(bytes: usize, cores: usize) -> usize {
    if bytes < PARALLEL_MIN_BYTES {
        return 1;
    }
    (bytes / (PARALLEL_MIN_BYTES / 2))
        .min(MAX_THREADS)
        .min(cores)
        .max(1)
}

/// The cores this process may use (read once).
fn cores() -> usize {
    static CORES: OnceLock<usize> = OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// `dst.copy_from_slice(src)`, over [`threads_for`] threads. The lengths
/// must match, as for `copy_from_slice`.
pub fn copy<T: Copy + Send + Sync>(dst: &mut [T], src: &[T]) {
    copy_with(dst, src, threads_for(std::mem::size_of_val(src), cores()));
}

/// [`copy`] over exactly `threads` threads (at least one).
fn copy_with<T: Copy + Send + Sync>(dst: &mut [T], src: &[T], threads: usize) {
    assert_eq!(dst.len(), src.len(), "host copy of unequal lengths");
    split(dst, src, threads, <[T]>::copy_from_slice);
}

/// `src.to_vec()`, over [`threads_for`] threads: one pass, no zeroing
/// first.
pub fn to_vec<T: Copy + Send + Sync>(src: &[T]) -> Vec<T> {
    to_vec_with(src, threads_for(std::mem::size_of_val(src), cores()))
}

/// [`to_vec`] over exactly `threads` threads (at least one).
fn to_vec_with<T: Copy + Send + Sync>(src: &[T], threads: usize) -> Vec<T> {
    if threads <= 1 {
        return src.to_vec();
    }
    let mut out: Vec<T> = Vec::with_capacity(src.len());
    let slots = out.spare_capacity_mut().get_mut(..src.len());
    // `with_capacity(n)` leaves at least `n` spare slots.
    let Some(slots) = slots else {
        return src.to_vec();
    };
    split(slots, src, threads, |d, c| {
        for (d, c) in d.iter_mut().zip(c) {
            d.write(*c);
        }
    });
    // SAFETY: `split` wrote each of the first `src.len()` slots from the
    // element of `src` at its index (its chunks cover both slices exactly,
    // pairwise), and its scope joined every thread before it returned: a
    // thread that panicked would have propagated here before this line.
    unsafe { out.set_len(src.len()) };
    out
}

/// Runs `f` on equal contiguous chunks of `dst` and `src` (of equal
/// lengths), one chunk per scoped thread, the caller taking the first.
fn split<D: Send, S: Sync>(dst: &mut [D], src: &[S], threads: usize, f: fn(&mut [D], &[S])) {
    if threads <= 1 || src.len() < 2 {
        f(dst, src);
        return;
    }
    let chunk = src.len().div_ceil(threads);
    std::thread::scope(|s| {
        let mut pairs = dst.chunks_mut(chunk).zip(src.chunks(chunk));
        let first = pairs.next();
        for (d, c) in pairs {
            s.spawn(move || f(d, c));
        }
        if let Some((d, c)) = first {
            f(d, c);
        }
    });
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    #[test]
    fn short_copies_stay_on_one_thread_and_long_ones_split_within_the_caps() {
        assert_eq!(threads_for(0, 16), 1);
        assert_eq!(threads_for(PARALLEL_MIN_BYTES - 1, 16), 1);
        assert_eq!(threads_for(PARALLEL_MIN_BYTES, 16), 2);
        assert_eq!(threads_for(PARALLEL_MIN_BYTES * 3, 16), 6);
        assert_eq!(threads_for(1 << 30, 16), MAX_THREADS);
        assert_eq!(threads_for(1 << 30, 3), 3);
        assert_eq!(threads_for(1 << 30, 1), 1);
        assert_eq!(threads_for(1 << 30, 0), 1);
    }

    #[test]
    fn a_split_copy_writes_every_element_from_its_own() {
        // Awkward lengths: chunks that do not divide evenly, fewer
        // elements than threads, a single element.
        for len in [0usize, 1, 2, 3, 7, 8, 9, 1000, 65_537] {
            let src: Vec<f32> = (0..len).map(|i| i as f32 * 0.5 - 3.0).collect();
            for threads in [1, 2, 3, 5, 8] {
                let mut dst = vec![f32::NAN; len];
                copy_with(&mut dst, &src, threads);
                let same = dst
                    .iter()
                    .zip(&src)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "len {len}, {threads} threads");
                let v = to_vec_with(&src, threads);
                assert_eq!(v.len(), len);
                let same = v.iter().zip(&src).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "to_vec: len {len}, {threads} threads");
            }
        }
    }

    #[test]
    fn a_long_copy_is_the_same_bits_as_one_thread_s() {
        let len = PARALLEL_MIN_BYTES / 2 + 13; // 2-byte elements: above the line
        let src: Vec<half::bf16> = (0..len)
            .map(|i| half::bf16::from_f32((i % 977) as f32 - 488.0))
            .collect();
        assert!(threads_for(std::mem::size_of_val(src.as_slice()), 4) > 1);
        let out = to_vec(&src);
        assert_eq!(out, src);
        let mut dst = vec![half::bf16::ZERO; len];
        copy(&mut dst, &src);
        assert_eq!(dst, src);
    }
}
