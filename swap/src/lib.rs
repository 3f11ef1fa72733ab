//! # tierzero-swap
//!
//! Moves bytes between pinned host memory and NVMe, fast and checked. It
//! knows nothing about tensors: callers allocate [`Extent`]s in a
//! [`SwapSpace`], take [`Buffer`]s from a [`PinnedArena`], and submit
//! [`Request`]s to an [`Engine`].
//!
//! ## Pieces
//! - `arena`: one mmap'd, `mlock`ed allocation split into fixed-size
//!   aligned buffers, with an explicit byte budget checked against
//!   `RLIMIT_MEMLOCK` before anything is mapped.
//! - `space` and `alloc`: a few large preallocated files per NVMe path,
//!   extents placed by a first-fit allocator, striped over paths.
//! - `engine`: validation, tickets, completions; `ring` (io_uring) and
//!   `portable` (`pread`/`pwrite` threads) run the transfers.
//! - `direct`: a region of a caller's file written past the page cache
//!   from memory the caller fills chunk by chunk (checkpoints of state
//!   held in host memory).
//! - `fileio`: positional I/O on the caller's files into the caller's
//!   memory, with bounce buffers where it is unaligned (DeepNVMe-style
//!   handles: the Python `tierzero.aio`).
//! - `lock`: one process per swap directory (`flock` on `tierzero/lock`).
//! - `fault`, `stats`, `bench`: fault injection, counters, measurement.
//! - `malloc`: glibc's mmap and trim thresholds raised for a process whose
//!   compute threads allocate beside the I/O threads (see its docs).
//!
//! ## Alignment
//! Every swap file is opened with `O_DIRECT` (unless the file system refuses
//! and the policy allows buffered I/O). O_DIRECT needs the buffer address,
//! the file offset and the length to be multiples of the device's logical
//! block size; we use `max(4096, logical block size)` everywhere. Buffers
//! are aligned by construction; extents are allocated in aligned units; and
//! a request whose offset or length is not aligned is refused at submission
//! with [`SwapError::Misaligned`], before it reaches the kernel.
//!
//! ## Buffer ownership while I/O is in flight
//! A [`Buffer`] is moved into the request and comes back in the
//! [`Completion`], so the type system prevents touching (or freeing) memory
//! the kernel may still be writing. If the caller drops the [`Ticket`], the
//! worker still holds the buffer until its last piece has completed, then
//! drops it, which returns it to the pool. Likewise the [`Extent`] is held
//! by the request, so its range cannot be freed and reallocated mid-flight.
//! Dropping the [`Engine`] drains every in-flight request first.
//!
//! ## The memlock limit
//! Pinned (page-locked) memory counts against `RLIMIT_MEMLOCK` unless the
//! process has `CAP_IPC_LOCK`. Default limits are small (8 MiB here), while
//! a swap arena is typically gigabytes. [`PinnedArena::new`] compares the
//! budget with the limit first and fails with [`SwapError::MemlockTooLow`],
//! which carries the numbers and the fix. Note that for unprivileged users
//! io_uring also accounts registered buffers against the same limit, so
//! registration may fail where `mlock` succeeded: the ring then falls back
//! to unregistered reads and writes and logs a warning.
//!
//! ## Every completion is checked
//! A transfer that moved fewer bytes than asked is finished by resubmitting
//! the rest; one that hits end of file fails with [`SwapError::ShortIo`];
//! an errno fails with [`SwapError::Io`] naming the operation, path, offset
//! and length. A failed write poisons the space: all later operations fail
//! fast with [`SwapError::Poisoned`] instead of reading stale bytes later.

pub mod affinity;
pub mod align;
pub mod alloc;
pub mod arena;
pub mod bench;
pub mod direct;
pub mod engine;
pub mod error;
pub mod fault;
pub mod fileio;
pub mod lock;
pub mod malloc;
pub mod mapped;
mod portable;
pub mod process;
mod ring;
pub mod shared;
pub mod space;
pub mod stats;

pub use align::Alignment;
pub use arena::{ArenaConfig, BufIdx, Buffer, HostRegistrar, LockPolicy, MemlockInfo, PinnedArena};
pub use direct::{read_direct, AlignedBytes, ChunkReader, DirectWriter};
pub use engine::{
    wait_all, ActiveBackend, BackendKind, Completion, Engine, EngineConfig, Request, Ticket,
    TicketId,
};
pub use error::{IoOp, Result, SwapError};
pub use fault::{FaultInjector, FaultKind, FaultRule};
pub use malloc::{keep_heap_mapped, MallocTuning};
pub use mapped::MappedFile;
pub use shared::{ReadPin, SharedBuffer, WriteGuard};
pub use space::{CopyReport, DirectIo, Extent, ExtentId, FileIdx, SpaceConfig, SwapSpace};
pub use stats::{BusyClock, StatsSnapshot};
