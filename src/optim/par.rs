//! Work sharing across threads: a tile is handed out in fixed chunks of
//! [`WORK_CHUNK_NUMEL`] elements from a shared queue.
//!
//! Design:
//! * Chunk boundaries are multiples of [`WORK_CHUNK_NUMEL`] from the start
//!   of the tile, independent of the thread count, and the kernels are
//!   elementwise with a scalar path bitwise equal to a SIMD lane, so *which*
//!   thread runs a chunk cannot change a bit of the result.
//! * Chunks are claimed dynamically (a mutex holding the unclaimed rest of
//!   the tile; one lock per chunk of ~0.1-0.3 ms of work) rather than split
//!   statically: on a shared machine a descheduled thread would otherwise
//!   hold the whole step up, and the optimizer shares the CPU with the I/O
//!   and copy threads of the offload pipeline.
//! * No allocation per chunk: the queue is the tiles themselves, split in
//!   place. Threads are scoped (`std::thread::scope`), spawned per call
//!   (once for a whole list of tiles, [`for_each_chunk_many`]); the
//!   caller's thread works too.

use std::sync::Mutex;

/// Elements per claimed chunk (a multiple of every SIMD width and of
/// `SPLIT_ALIGN_NUMEL`).
pub const WORK_CHUNK_NUMEL: usize = 1 << 18;
const _: () = assert!(WORK_CHUNK_NUMEL.is_multiple_of(super::SPLIT_ALIGN_NUMEL));

/// Work that can be cut into a prefix and the rest.
pub(crate) trait Split: Sized + Send {
    fn numel(&self) -> usize;
    fn split_at(self, mid: usize) -> (Self, Self);
}

/// Runs `f` over `work` in chunks of [`WORK_CHUNK_NUMEL`] on up to
/// `threads` threads (the caller's included).
pub(crate) fn for_each_chunk<W: Split>(work: W, threads: usize, f: impl Fn(W) + Sync) {
    for_each_chunk_many(vec![work], threads, |_, w| f(w));
}

/// Runs `f(i, chunk)` over every `works[i]`, cut into chunks of
/// [`WORK_CHUNK_NUMEL`] from each work's own start, on up to `threads`
/// threads (the caller's included), spawned once for the whole list.
/// Threads are spawned per call, so a caller with many small tiles (the
/// Python `AdamW` steps one tile per param) hands them over in one call:
/// on the development VM a spawn and join cost about 0.24 ms, as long as
/// one core takes to step about 200K parameters
/// (`scripts/probe_adam_calls.py`: 50M params in 1 call 28.9 ms, in 10
/// calls 31.3 ms, at 2 threads; 56 ms in 1 call at 1 thread).
pub(crate) fn for_each_chunk_many<W: Split>(
    works: Vec<W>,
    threads: usize,
    f: impl Fn(usize, W) + Sync,
) {
    let chunks: usize = works
        .iter()
        .map(|w| w.numel().div_ceil(WORK_CHUNK_NUMEL))
        .sum();
    let workers = threads.min(chunks).max(1);
    if workers == 1 {
        for (i, w) in works.into_iter().enumerate() {
            f(i, w);
        }
        return;
    }
    // The unclaimed rest: works in order, the first possibly cut already.
    let queue: Mutex<std::collections::VecDeque<(usize, W)>> =
        Mutex::new(works.into_iter().enumerate().collect());
    let next = || -> Option<(usize, W)> {
        // A poisoned lock means a worker panicked; stop claiming work and
        // let the scope propagate that panic.
        let mut rest = queue.lock().ok()?;
        let (i, w) = rest.pop_front()?;
        if w.numel() <= WORK_CHUNK_NUMEL {
            Some((i, w))
        } else {
            let (head, tail) = w.split_at(WORK_CHUNK_NUMEL);
            rest.push_front((i, tail));
            Some((i, head))
        }
    };
    let run = || {
        while let Some((i, chunk)) = next() {
            f(i, chunk);
        }
    };
    std::thread::scope(|s| {
        for _ in 1..workers {
            s.spawn(run);
        }
        run();
    });
}
