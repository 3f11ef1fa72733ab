//! The process's malloc settings while a trainer runs.
//!
//! A trainer raises glibc's mmap and trim thresholds once per process
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
//! tunable leaves malloc as the user set it. Embedders who manage malloc
//! themselves turn the option off.

use std::sync::OnceLock;

use tierzero_swap::MallocTuning;

/// `M_MMAP_THRESHOLD`: blocks below this come from the heap.
pub const MMAP_THRESHOLD_BYTES: usize = 256 << 20;
/// `M_TRIM_THRESHOLD`: free heap top kept before returning it.
pub const TRIM_THRESHOLD_BYTES: usize = 1 << 30;

static APPLIED: OnceLock<MallocTuning> = OnceLock::new();

/// Applies the settings once per process; later calls return the first
/// outcome.
pub fn keep_heap_mapped() -> MallocTuning {
    *APPLIED
        .get_or_init(|| tierzero_swap::keep_heap_mapped(MMAP_THRESHOLD_BYTES, TRIM_THRESHOLD_BYTES))
}
