//! glibc malloc settings for a process that streams swap buffers beside
//! compute threads.
//!
//! # Why
//!
//! glibc serves an allocation above `M_MMAP_THRESHOLD` (128 KiB at start,
//! raised on the fly up to 32 MiB) with its own `mmap`, and `munmap`s it
//! on free; it also returns the heap's free top to the kernel above
//! `M_TRIM_THRESHOLD`. A training step allocates and frees many such
//! blocks every unit (activations, gradients, parameter bytes), so every
//! step pays the page faults of fresh mappings, and every `munmap` of a
//! multi-threaded process sends TLB shoot-downs to the cores running its
//! other threads (here the I/O ring threads and the optimizer thread),
//! while faults and unmaps serialise on the process's `mmap_lock`. On the
//! 2-core development machine the compute of an offloaded step ran up to
//! 30% slower than the same compute alone; with both thresholds raised
//! (the tunables below, set through `GLIBC_TUNABLES`) the offloaded step
//! took 0.86× and 0.93× the time in two side-by-side runs, while compute
//! alone and I/O alone did not move (`examples/overlap`; the figures are in
//! tierzero's `docs/decisions/host-heap.md`). Raising only one of the two made it slower: setting
//! either turns off glibc's dynamic adjustment, so the other stays at its
//! small default.
//!
//! # One arena
//!
//! glibc gives each thread that allocates its own arena (up to 8 per
//! core), and memory freed into one arena serves only that arena's later
//! allocations. With the heap kept mapped, each arena keeps its own high
//! water mark: a tensor a compute thread allocates one step and the main
//! thread the next is kept twice. Which thread allocates what depends on
//! rayon's work stealing, so the peak resident memory of the same run
//! varied from run to run: 16 layers of `tests/memory_flat.rs`'s GPT-2,
//! two runs at a time on the 2-core machine, 229–233 MiB in six runs of
//! eight and 319–320 MiB in two (and the 4-layer run 172–175 or 213–218).
//! With `M_ARENA_MAX` 1 every thread shares the main arena: 207–211 MiB
//! (150–157 MiB at 4 layers) in eight runs of eight. The large blocks
//! are few (one per op), so the shared lock costs nothing measurable:
//! GPT-2 stage 0 on 2 compute threads ran 6,707, 6,643 and 6,512 tok/s
//! against 6,715, 6,476 and 6,644 with per-thread arenas, alternating,
//! at 137–140 MiB peak instead of 167–168.
//!
//! # What it costs
//!
//! Freed memory below the thresholds stays in the process (it is reused
//! by the next step's allocations of the same sizes), so resident memory
//! stays near its peak instead of falling between steps. The peak itself
//! does not grow from the thresholds: the same blocks are live at the
//! same time, from the one arena (a heap never trimmed may place some
//! later blocks above its free top: 3% more on tierzero's measurement,
//! its `docs/decisions/host-heap.md`). The settings are never undone: with trimming off (tierzero
//! turns it off, see its `docs/decisions/host-heap.md`), the heap keeps
//! its peak for the rest of the process, after the work that made it is
//! over too.
//!
//! # Who decides
//!
//! The settings are process-wide. [`keep_heap_mapped`] leaves them alone
//! when `GLIBC_TUNABLES` already sets any `glibc.malloc.*` tunable (the
//! user's choice wins), and does nothing on a C library other than glibc.

/// What [`keep_heap_mapped`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MallocTuning {
    /// Both thresholds and the arena cap set.
    Applied {
        /// `M_MMAP_THRESHOLD`.
        mmap_threshold_bytes: usize,
        /// `M_TRIM_THRESHOLD`; `usize::MAX`: never trimmed.
        trim_threshold_bytes: usize,
        /// `M_ARENA_MAX`.
        arena_max: usize,
    },
    /// `GLIBC_TUNABLES` sets malloc tunables: left as the user chose.
    UserTunables,
    /// Not glibc: nothing to do.
    NotGlibc,
    /// glibc refused a value (`mallopt` returned 0); the settings are
    /// glibc's own or partly set.
    Refused,
}

impl std::fmt::Display for MallocTuning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MallocTuning::Applied {
                mmap_threshold_bytes,
                trim_threshold_bytes,
                arena_max,
            } => write!(
                f,
                "glibc heap kept mapped (M_MMAP_THRESHOLD {} MiB, M_TRIM_THRESHOLD {}, \
                 M_ARENA_MAX {arena_max})",
                mmap_threshold_bytes >> 20,
                if *trim_threshold_bytes == usize::MAX {
                    "off: the heap's top is never returned".to_owned()
                } else {
                    format!("{} MiB", trim_threshold_bytes >> 20)
                }
            ),
            MallocTuning::UserTunables => f.write_str("glibc malloc as GLIBC_TUNABLES sets it"),
            MallocTuning::NotGlibc => f.write_str("not glibc: malloc left as it is"),
            MallocTuning::Refused => f.write_str("glibc refused the malloc thresholds"),
        }
    }
}

/// Whether a `GLIBC_TUNABLES` value sets any malloc tunable.
fn sets_malloc(tunables: &str) -> bool {
    tunables
        .split(':')
        .any(|t| t.trim_start().starts_with("glibc.malloc."))
}

/// Raises glibc's `M_MMAP_THRESHOLD` and `M_TRIM_THRESHOLD` and caps
/// `M_ARENA_MAX` (see the module docs), unless `GLIBC_TUNABLES` sets
/// malloc tunables. Values above `i32::MAX` are clamped to it (`mallopt`
/// takes an `int`), but for the trim threshold, where they turn trimming
/// off (`mallopt`'s -1: the heap's free top is never returned). Arenas threads already have are kept; the cap stops
/// new ones, so call it before starting threads.
pub fn keep_heap_mapped(
    mmap_threshold_bytes: usize,
    trim_threshold_bytes: usize,
    arena_max: usize,
) -> MallocTuning {
    if std::env::var("GLIBC_TUNABLES").is_ok_and(|v| sets_malloc(&v)) {
        return MallocTuning::UserTunables;
    }
    set_thresholds(mmap_threshold_bytes, trim_threshold_bytes, arena_max)
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn set_thresholds(
    mmap_threshold_bytes: usize,
    trim_threshold_bytes: usize,
    arena_max: usize,
) -> MallocTuning {
    let clamp = |b: usize| libc::c_int::try_from(b).unwrap_or(libc::c_int::MAX);
    let mmap = clamp(mmap_threshold_bytes);
    // -1: never trim (mallopt(3)); an `int` cannot say more than 2 GiB.
    let trim = libc::c_int::try_from(trim_threshold_bytes).unwrap_or(-1);
    let arenas = clamp(arena_max.max(1));
    // SAFETY: `mallopt` only changes glibc's allocator parameters under its
    // own arena lock; it takes two plain integers and touches no memory of
    // ours, so any value is memory-safe (glibc refuses ones it cannot use
    // by returning 0).
    let ok = unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, mmap) == 1
            && libc::mallopt(libc::M_TRIM_THRESHOLD, trim) == 1
            && libc::mallopt(libc::M_ARENA_MAX, arenas) == 1
    };
    if ok {
        MallocTuning::Applied {
            mmap_threshold_bytes: usize::try_from(mmap).unwrap_or(usize::MAX),
            trim_threshold_bytes: usize::try_from(trim).unwrap_or(usize::MAX),
            arena_max: usize::try_from(arenas).unwrap_or(usize::MAX),
        }
    } else {
        MallocTuning::Refused
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn set_thresholds(
    _mmap_threshold_bytes: usize,
    _trim_threshold_bytes: usize,
    _arena_max: usize,
) -> MallocTuning {
    MallocTuning::NotGlibc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_tunables_are_recognised_anywhere_in_the_list() {
        assert!(sets_malloc("glibc.malloc.trim_threshold=1"));
        assert!(sets_malloc(
            "glibc.cpu.hwcaps=-AVX512F:glibc.malloc.arena_max=2"
        ));
        assert!(!sets_malloc("glibc.cpu.hwcaps=-AVX512F"));
        assert!(!sets_malloc(""));
    }

    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn glibc_takes_the_thresholds_and_clamps_huge_ones() {
        let want = MallocTuning::Applied {
            mmap_threshold_bytes: 256 << 20,
            trim_threshold_bytes: 1 << 30,
            arena_max: 1,
        };
        assert_eq!(set_thresholds(256 << 20, 1 << 30, 1), want);
        // Zero would mean glibc's default (8 per core): raised to 1.
        assert_eq!(set_thresholds(256 << 20, 1 << 30, 0), want);
        // Above i32::MAX: clamped, not wrapped.
        match set_thresholds(usize::MAX, 1 << 30, 1) {
            MallocTuning::Applied {
                mmap_threshold_bytes,
                ..
            } => assert_eq!(mmap_threshold_bytes, i32::MAX as usize),
            MallocTuning::Refused => {} // glibc may refuse so high a threshold
            other => panic!("{other:?}"),
        }
        // A trim threshold above i32::MAX: trimming off (-1), said so.
        let off = set_thresholds(256 << 20, usize::MAX, 1);
        assert_eq!(
            off,
            MallocTuning::Applied {
                mmap_threshold_bytes: 256 << 20,
                trim_threshold_bytes: usize::MAX,
                arena_max: 1,
            }
        );
        let said = off.to_string();
        assert!(said.contains("M_TRIM_THRESHOLD off"), "{said}");
        assert!(want.to_string().contains("M_TRIM_THRESHOLD 1024 MiB"));
        assert_eq!(set_thresholds(256 << 20, 1 << 30, 1), want);
    }
}
