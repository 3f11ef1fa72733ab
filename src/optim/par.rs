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
//! * No allocation: the queue is the tile itself, split in place. Threads
//!   are scoped (`std::thread::scope`), spawned per call; the caller's thread
//!   works too.

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
    let workers = threads.min(work.numel().div_ceil(WORK_CHUNK_NUMEL)).max(1);
    if workers == 1 {
        f(work);
        return;
    }
    let queue = Mutex::new(Some(work));
    let next = || -> Option<W> {
        // A poisoned lock means a worker panicked; stop claiming work and
        // let the scope propagate that panic.
        let mut rest = queue.lock().ok()?;
        let w = rest.take()?;
        if w.numel() <= WORK_CHUNK_NUMEL {
            Some(w)
        } else {
            let (head, tail) = w.split_at(WORK_CHUNK_NUMEL);
            *rest = Some(tail);
            Some(head)
        }
    };
    let run = || {
        while let Some(chunk) = next() {
            f(chunk);
        }
    };
    std::thread::scope(|s| {
        for _ in 1..workers {
            s.spawn(run);
        }
        run();
    });
}
