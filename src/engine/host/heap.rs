//! The process's malloc settings while a trainer runs.
//!
//! A trainer raises glibc's mmap threshold, turns trimming off, and shares one
//! arena among all threads, once per process
//! ([`tierzero_swap::keep_heap_mapped`], whose docs give the mechanism):
//! without it, the compute of an offloaded step on the 2-core development
//! machine ran up to 30% slower than the same compute alone, because each
//! unit's large blocks were fresh `mmap`s (page faults) freed by `munmap`
//! (TLB shoot-downs to the I/O and optimizer threads' cores). Side by side
//! (`scripts/overlap_ab.sh`, `examples/overlap` at `MICRO=3`), the
//! offloaded step took 0.86× and 0.93× the time with the thresholds
//! raised; compute alone and I/O alone did not move.
//!
//! Like `tierzero.compute_threads` ([`crate::engine::host::threads`]) it is process-wide:
//! the first trainer built with [`crate::engine::TrainerOptions::keep_heap_mapped`]
//! (the default) applies it, and `GLIBC_TUNABLES` with any `glibc.malloc.*`
//! tunable leaves malloc as the user set it. The `tierzero` binary applies
//! it first thing in `main`, before any thread starts: `M_ARENA_MAX` only
//! stops arenas not yet made, and glibc hands the arenas threads made
//! before the cap round-robin to the threads that come after, so one
//! early thread's arena would again split the heap in two (the signal
//! thread's did, and the 16-layer run of `tests/memory_flat.rs` still
//! peaked at 294–300 MiB in three runs of four). Embedded in a process
//! whose threads already have arenas (PyTorch's), the cap still stops
//! new ones. Embedders who manage malloc
//! themselves turn the option off.

use std::sync::OnceLock;

use tierzero_swap::MallocTuning;

/// `M_MMAP_THRESHOLD`: blocks below this come from the heap.
pub const MMAP_THRESHOLD_BYTES: usize = 256 << 20;
/// `M_TRIM_THRESHOLD`: free heap top kept before returning it; `usize::MAX`
/// is never (`mallopt`'s -1). It was 1 GiB: a step that frees more than
/// that at the heap's top (the fp32 gradient sums of a model of more than
/// 268M params with the optimizer state in host memory, 4 bytes a param)
/// gave it back to the kernel, and the next step's sums faulted every
/// page in again. `scripts/sim_offload_ab.sh`'s 311M Llama (1.25 GB of
/// sums), steps 2-4: 75K-400K minor faults a step with 1 GiB (290K-400K
/// in steps 3-4), 0-76K with
/// trimming off, median train_s 19.5 s against 21.3 s, peak RSS 3% higher; the command and the
/// figures are in `docs/decisions/host-heap.md`.
pub const TRIM_THRESHOLD_BYTES: usize = usize::MAX;
/// `M_ARENA_MAX`: one arena for every thread, so the memory the heap keeps
/// is one high-water mark, not one per thread that happened to allocate
/// (`tierzero_swap::keep_heap_mapped`'s docs give the figures).
pub const ARENA_MAX: usize = 1;

static APPLIED: OnceLock<MallocTuning> = OnceLock::new();

/// Lets `v` (holding `bytes`) go on a thread of its own when it holds at
/// least [`MMAP_THRESHOLD_BYTES`], else here. A block that large is a
/// mapping of its own, and its `munmap` frees every page on the thread
/// that drops it: the optimizer's spare values of `scripts/sim_offload_ab.sh`'s
/// 311M Llama in one sub-group (594 MiB of bf16) took 51 ms of the compute
/// thread as a backward began (`strace -f -T -e trace=munmap`); DeepSpeed's
/// default `sub_group_size` of 1e9 makes 2 GB of them, and 2 GiB of
/// faulted pages took 415-441 ms to unmap on the development VM
/// (`scripts/munmap_cost.py`). A smaller
/// block goes back to the heap, which keeps it mapped: nothing to wait
/// for. Should no thread start, it is dropped here. A new thread inherits
/// its creator's CPUs (the compute CPUs, from the step's thread), so it
/// moves to `helper_cpus` first when the placement has them
/// ([`crate::engine::host::threads::Placement::helper_cpus`]), as every
/// helper thread does.
pub fn free_off_thread<T: Send + 'static>(
    v: T,
    bytes: usize,
    helper_cpus: Option<std::sync::Arc<[usize]>>,
) {
    if bytes < MMAP_THRESHOLD_BYTES {
        drop(v);
        return;
    }
    // A failed spawn drops the closure, and `v` with it, here.
    let _ = std::thread::Builder::new()
        .name("tz-free".into())
        .spawn(move || {
            tierzero_swap::affinity::place_current_thread(helper_cpus.as_deref(), "tz-free");
            drop(v);
        });
}

/// Applies the settings once per process; later calls return the first
/// outcome.
pub fn keep_heap_mapped() -> MallocTuning {
    *APPLIED.get_or_init(|| {
        tierzero_swap::keep_heap_mapped(MMAP_THRESHOLD_BYTES, TRIM_THRESHOLD_BYTES, ARENA_MAX)
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a failure is a panic

    use std::sync::mpsc::{channel, Sender};
    use std::thread::ThreadId;
    use std::time::Duration;

    /// Says which thread dropped it.
    struct Probe(Sender<ThreadId>);

    impl Drop for Probe {
        fn drop(&mut self) {
            let _ = self.0.send(std::thread::current().id());
        }
    }

    /// A block below the mmap threshold is freed where it is let go; one
    /// at it or above, on another thread.
    #[test]
    fn large_blocks_are_freed_off_the_calling_thread() {
        let here = std::thread::current().id();
        let (tx, rx) = channel();
        super::free_off_thread(Probe(tx.clone()), super::MMAP_THRESHOLD_BYTES - 1, None);
        assert_eq!(rx.try_recv().unwrap(), here, "small: dropped at once, here");
        super::free_off_thread(Probe(tx), super::MMAP_THRESHOLD_BYTES, None);
        let by = rx.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_ne!(by, here, "large: dropped on a thread of its own");
    }
}
