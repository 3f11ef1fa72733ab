//! The pinned, aligned buffer arena.
//!
//! One anonymous mapping holds every I/O buffer. It is split into
//! `count` buffers of `buffer_bytes` each (a multiple of the O_DIRECT
//! alignment), advised to transparent huge pages (see below), locked
//! with `mlock` so the pages never move or swap, and
//! registered with each io_uring ring (`IORING_REGISTER_BUFFERS`, one iovec
//! per buffer, so a buffer's index is its registered index) when every
//! buffer is within io_uring's 1 GiB limit for one registered buffer
//! (larger ones are read and written unregistered).
//!
//! ## Huge pages
//! `MADV_HUGEPAGE` before the lock: with THP in `madvise` mode (Debian's
//! default) the arena is then backed by 2 MiB folios, so a 1 MiB transfer
//! is one or two physically contiguous segments instead of 256 pages. The
//! block layer splits a request at the device's `max_segments` (254 on the
//! development VM's virtio disk, so a 1 MiB request of 4 KiB pages became
//! two), and builds and completes far fewer segments. Measured on that VM,
//! `tierzero bench-io --path /work/bio --size 2GiB --block-size 1M
//! --queue-depth 32`, 3 alternating runs each: reads 2.03-2.07 GB/s
//! against 1.20-1.35 without the advice, writes 2.66-2.85 against
//! 1.93-1.98. For caller memory (`fileio`, the Python `aio_handle`'s locked
//! tensors) the same advice cut the CPU time per GB about 5x
//! (docs/decisions/python-package.md). It is advice: with THP `never` the
//! arena has ordinary pages and works the same.
//!
//! ## Budget
//! The arena's size is a byte budget that the caller takes from config.
//! Before mapping anything we compare it with `RLIMIT_MEMLOCK` (unless the
//! process holds `CAP_IPC_LOCK`) and fail with the numbers and the fix, not
//! with an OOM later.
//!
//! ## Ownership
//! A [`Buffer`] is handed out by value and goes back to the free list when
//! dropped. Whoever holds it has exclusive access to its bytes; the I/O
//! engine takes buffers by value for the duration of a transfer and hands
//! them back in the completion, so a buffer the kernel may still write can
//! never be reused. Every `Buffer` holds an `Arc` of the arena, so the
//! mapping outlives every buffer and every in-flight operation.
//!
//! ## Host registration hook
//! [`HostRegistrar`] is called once with the whole mapping after it is
//! locked, and once before it is unmapped. The GPU build plugs CUDA's
//! `cuMemHostRegister` in there; callers of the arena do not change.

use std::ptr::NonNull;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::align::Alignment;
use crate::error::{Result, SwapError};

/// Index of a buffer in its arena; also its registered-buffer index in io_uring.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BufIdx(pub u32);

/// Registers the arena's memory with another subsystem (e.g. CUDA host
/// registration for fast, async H2D copies).
pub trait HostRegistrar: Send + Sync + std::fmt::Debug {
    /// Called once after the arena is mapped and locked.
    fn register(&self, addr: usize, len_bytes: usize) -> std::io::Result<()>;
    /// Called once before the arena is unmapped.
    fn unregister(&self, addr: usize, len_bytes: usize);
}

/// How strictly the arena must be page-locked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockPolicy {
    /// `mlock` must succeed; RLIMIT_MEMLOCK is checked first.
    Require,
    /// Try `mlock`; on failure, warn and continue unlocked.
    BestEffort,
    /// Do not lock (tests, or users who opt out with `pin_memory: false`).
    Off,
}

/// Settings for [`PinnedArena::new`].
#[derive(Debug, Clone)]
pub struct ArenaConfig {
    /// Total bytes the arena may take. The number of buffers is
    /// `budget_bytes / buffer_bytes` (rounded down).
    pub budget_bytes: u64,
    /// Size of each buffer; rounded up to `alignment`.
    pub buffer_bytes: u64,
    /// O_DIRECT alignment of the buffers.
    pub alignment: Alignment,
    /// Whether to `mlock`.
    pub lock: LockPolicy,
    /// Optional extra registration of the memory (CUDA host registration).
    pub registrar: Option<Arc<dyn HostRegistrar>>,
}

impl ArenaConfig {
    /// A config with `buffer_bytes`-sized buffers in `budget_bytes`, locked.
    pub fn new(budget_bytes: u64, buffer_bytes: u64) -> Self {
        ArenaConfig {
            budget_bytes,
            buffer_bytes,
            alignment: Alignment::new(4096),
            lock: LockPolicy::Require,
            registrar: None,
        }
    }
}

/// What `RLIMIT_MEMLOCK` and the process's capabilities allow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemlockInfo {
    /// The soft limit in bytes (`u64::MAX` for unlimited).
    pub limit_bytes: u64,
    /// Bytes this process has locked already (`VmLck`).
    pub locked_bytes: u64,
    /// Whether the process holds `CAP_IPC_LOCK`, which lifts the limit.
    pub has_ipc_lock: bool,
}

impl MemlockInfo {
    /// Reads the limit, the locked total and the capability for this process.
    pub fn current() -> Self {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes one rlimit struct through a valid pointer.
        let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) };
        let limit_bytes = if rc != 0 || lim.rlim_cur == libc::RLIM_INFINITY {
            u64::MAX
        } else {
            lim.rlim_cur
        };
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let locked_bytes = status
            .lines()
            .find_map(|l| l.strip_prefix("VmLck:"))
            .map_or(0, |v| {
                let kib: u64 = v.trim().trim_end_matches("kB").trim().parse().unwrap_or(0);
                kib * 1024
            });
        MemlockInfo {
            limit_bytes,
            locked_bytes,
            has_ipc_lock: crate::process::has_capability(&status, crate::process::CAP_IPC_LOCK),
        }
    }

    /// Fails with [`SwapError::MemlockTooLow`] if `bytes` more cannot be locked.
    pub fn check(&self, bytes: u64) -> Result<()> {
        if self.has_ipc_lock || self.limit_bytes == u64::MAX {
            return Ok(());
        }
        if self.locked_bytes.saturating_add(bytes) > self.limit_bytes {
            return Err(SwapError::MemlockTooLow {
                requested_bytes: bytes,
                limit_bytes: self.limit_bytes,
                locked_bytes: self.locked_bytes,
            });
        }
        Ok(())
    }
}

struct FreeList {
    free: Vec<BufIdx>,
}

/// A pinned region split into fixed-size aligned buffers.
pub struct PinnedArena {
    base: NonNull<u8>,
    map_bytes: usize,
    buffer_bytes: usize,
    count: usize,
    alignment: Alignment,
    locked: bool,
    registrar: Option<Arc<dyn HostRegistrar>>,
    free: Mutex<FreeList>,
    returned: Condvar,
    /// The whole mapping as returned by mmap (may start before `base`).
    unmap: (usize, usize),
}

impl std::fmt::Debug for PinnedArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedArena")
            .field("buffer_bytes", &self.buffer_bytes)
            .field("count", &self.count)
            .field("locked", &self.locked)
            .field("free", &self.free_count())
            .finish()
    }
}

// SAFETY: the mapping is owned by the arena and only reached through
// `Buffer`s, each of which has exclusive access to its own disjoint range;
// the free list is behind a mutex.
unsafe impl Send for PinnedArena {}
// SAFETY: see `Send`; shared references only touch the mutex-protected free
// list and immutable fields.
unsafe impl Sync for PinnedArena {}

impl PinnedArena {
    /// Maps, locks and splits the arena.
    pub fn new(config: ArenaConfig) -> Result<Arc<Self>> {
        let align = config.alignment;
        if config.buffer_bytes == 0 {
            return Err(SwapError::Config("buffer_bytes must be > 0".into()));
        }
        // Buffers over io_uring's 1 GiB registered-buffer limit are allowed:
        // the rings then do unregistered reads and writes into them
        // (`ring::registrable`), as DeepSpeed's libaio always does. ZeRO's
        // default `sub_group_size` of 1e9 elements makes 4 GB optimizer
        // buffers.
        let buffer_bytes = align.round_up(config.buffer_bytes);
        let count = (config.budget_bytes / buffer_bytes) as usize;
        if count == 0 {
            return Err(SwapError::Config(format!(
                "pinned budget of {} bytes is smaller than one buffer of {buffer_bytes} bytes",
                config.budget_bytes
            )));
        }
        if count > u32::MAX as usize {
            return Err(SwapError::Config(format!("{count} buffers is too many")));
        }
        let map_bytes_u64 = buffer_bytes * count as u64;
        if config.lock == LockPolicy::Require {
            MemlockInfo::current().check(map_bytes_u64)?;
        }
        let map_bytes = usize::try_from(map_bytes_u64).map_err(|_| {
            SwapError::Config(format!("arena of {map_bytes_u64} bytes is too large"))
        })?;
        // mmap gives page alignment; larger alignments over-map and skip ahead.
        let extra = if align.bytes() > page_bytes() {
            align.bytes() as usize
        } else {
            0
        };
        // SAFETY: an anonymous private mapping with no address hint; the
        // result is checked against MAP_FAILED before use.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_bytes + extra,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(SwapError::Setup {
                what: format!("mapping a pinned arena of {map_bytes} bytes"),
                source: std::io::Error::last_os_error(),
            });
        }
        let skip = if extra > 0 {
            (align.bytes() as usize - (raw as usize % align.bytes() as usize))
                % align.bytes() as usize
        } else {
            0
        };
        // SAFETY: skip < extra, so base stays inside the mapping.
        let base_ptr = unsafe { (raw as *mut u8).add(skip) };
        let Some(base) = NonNull::new(base_ptr) else {
            return Err(SwapError::Config("mmap returned null".into()));
        };
        let mut arena = PinnedArena {
            base,
            map_bytes,
            buffer_bytes: buffer_bytes as usize,
            count,
            alignment: align,
            locked: false,
            registrar: None,
            free: Mutex::new(FreeList {
                free: (0..count as u32).rev().map(BufIdx).collect(),
            }),
            returned: Condvar::new(),
            unmap: (raw as usize, map_bytes + extra),
        };
        // From here on, returning early drops `arena`, which unmaps.
        // Transparent huge pages where the system allows them (`madvise`
        // mode, the common default): a 1 MiB transfer then spans one or two
        // folios instead of 256 pages, so the kernel builds, maps and
        // completes far fewer segments per request, and page-locking the
        // arena faults 2 MiB at a time. Advice only: an error (THP off,
        // `never`) leaves ordinary pages, which work the same.
        // SAFETY: advice over our own live mapping; it changes no contents.
        let _ = unsafe { libc::madvise(base.as_ptr().cast(), map_bytes, libc::MADV_HUGEPAGE) };
        if config.lock != LockPolicy::Off {
            // SAFETY: locking pages of our own live mapping.
            let rc = unsafe { libc::mlock(base.as_ptr().cast(), map_bytes) };
            if rc != 0 {
                let err = std::io::Error::last_os_error();
                if config.lock == LockPolicy::Require {
                    let info = MemlockInfo::current();
                    return Err(
                        if err.raw_os_error() == Some(libc::ENOMEM)
                            || err.raw_os_error() == Some(libc::EPERM)
                        {
                            SwapError::MemlockTooLow {
                                requested_bytes: map_bytes_u64,
                                limit_bytes: info.limit_bytes,
                                locked_bytes: info.locked_bytes,
                            }
                        } else {
                            SwapError::Setup {
                                what: format!("mlock of {map_bytes} bytes"),
                                source: err,
                            }
                        },
                    );
                }
                tracing::warn!(bytes = map_bytes, error = %err, "could not mlock the pinned arena; continuing unlocked");
            } else {
                arena.locked = true;
            }
        } else {
            // Touch every page now so the first transfer does not fault.
            // SAFETY: writing zeros into our own mapping.
            unsafe { std::ptr::write_bytes(base.as_ptr(), 0, map_bytes) };
        }
        if let Some(reg) = &config.registrar {
            reg.register(base.as_ptr() as usize, map_bytes)
                .map_err(|source| SwapError::Setup {
                    what: "host registration of the pinned arena".into(),
                    source,
                })?;
            arena.registrar = Some(reg.clone());
        }
        Ok(Arc::new(arena))
    }

    /// What registered the mapping with another subsystem, if anything.
    pub fn registrar(&self) -> Option<&Arc<dyn HostRegistrar>> {
        self.registrar.as_ref()
    }

    /// Bytes in each buffer.
    pub fn buffer_bytes(&self) -> u64 {
        self.buffer_bytes as u64
    }

    /// Number of buffers.
    pub fn count(&self) -> usize {
        self.count
    }

    /// Total pinned bytes.
    pub fn total_bytes(&self) -> u64 {
        self.map_bytes as u64
    }

    /// Alignment of every buffer.
    pub fn alignment(&self) -> Alignment {
        self.alignment
    }

    /// Whether the memory is page-locked.
    pub fn is_locked(&self) -> bool {
        self.locked
    }

    /// Buffers currently free.
    pub fn free_count(&self) -> usize {
        self.lock_free().free.len()
    }

    /// `(address, length)` of every buffer, in index order (for registration).
    pub(crate) fn iovecs(&self) -> Vec<(usize, usize)> {
        (0..self.count)
            .map(|i| {
                (
                    self.base.as_ptr() as usize + i * self.buffer_bytes,
                    self.buffer_bytes,
                )
            })
            .collect()
    }

    fn lock_free(&self) -> MutexGuard<'_, FreeList> {
        // A panic while holding this lock cannot leave the list half-updated
        // (push/pop are atomic w.r.t. panics), so poisoning is ignored.
        self.free.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes one buffer, or fails with `PoolExhausted` at once.
    pub fn try_acquire(self: &Arc<Self>) -> Result<Buffer> {
        let mut v = self.try_acquire_n(1)?;
        v.pop().ok_or(SwapError::PoolExhausted {
            requested_buffers: 1,
            available_buffers: 0,
            buffer_bytes: self.buffer_bytes as u64,
        })
    }

    /// Takes `n` buffers all at once, or none (`PoolExhausted`).
    pub fn try_acquire_n(self: &Arc<Self>, n: usize) -> Result<Vec<Buffer>> {
        let mut free = self.lock_free();
        if free.free.len() < n {
            return Err(SwapError::PoolExhausted {
                requested_buffers: n,
                available_buffers: free.free.len(),
                buffer_bytes: self.buffer_bytes as u64,
            });
        }
        Ok(self.take(&mut free, n))
    }

    /// Pops `n` buffers off the free list (the caller checked there are `n`).
    fn take(self: &Arc<Self>, free: &mut FreeList, n: usize) -> Vec<Buffer> {
        let at = free.free.len().saturating_sub(n);
        free.free
            .drain(at..)
            .map(|idx| Buffer {
                arena: self.clone(),
                idx,
            })
            .collect()
    }

    /// Takes one buffer, waiting up to `timeout` for one to be returned.
    pub fn acquire_timeout(self: &Arc<Self>, timeout: Duration) -> Result<Buffer> {
        let mut v = self.acquire_n_timeout(1, timeout)?;
        v.pop().ok_or(SwapError::PoolExhausted {
            requested_buffers: 1,
            available_buffers: 0,
            buffer_bytes: self.buffer_bytes as u64,
        })
    }

    /// Takes `n` buffers at once, waiting up to `timeout`. Fails at once if
    /// `n` exceeds the arena (waiting could never succeed).
    pub fn acquire_n_timeout(self: &Arc<Self>, n: usize, timeout: Duration) -> Result<Vec<Buffer>> {
        if n > self.count {
            return Err(SwapError::PoolExhausted {
                requested_buffers: n,
                available_buffers: self.count,
                buffer_bytes: self.buffer_bytes as u64,
            });
        }
        let deadline = Instant::now() + timeout;
        let mut free = self.lock_free();
        while free.free.len() < n {
            let now = Instant::now();
            if now >= deadline {
                return Err(SwapError::PoolExhausted {
                    requested_buffers: n,
                    available_buffers: free.free.len(),
                    buffer_bytes: self.buffer_bytes as u64,
                });
            }
            free = self
                .returned
                .wait_timeout(free, deadline - now)
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
        Ok(self.take(&mut free, n))
    }

    /// Takes one buffer, waiting as long as it takes.
    pub fn acquire(self: &Arc<Self>) -> Result<Buffer> {
        self.acquire_timeout(Duration::from_secs(u64::MAX / 4))
    }

    fn release(&self, idx: BufIdx) {
        self.lock_free().free.push(idx);
        self.returned.notify_all();
    }

    fn ptr_of(&self, idx: BufIdx) -> *mut u8 {
        // SAFETY: idx < count (only the arena creates BufIdx values it hands
        // out), so the offset stays inside the mapping.
        unsafe { self.base.as_ptr().add(idx.0 as usize * self.buffer_bytes) }
    }
}

impl Drop for PinnedArena {
    fn drop(&mut self) {
        if let Some(reg) = &self.registrar {
            reg.unregister(self.base.as_ptr() as usize, self.map_bytes);
        }
        let (addr, len) = self.unmap;
        // SAFETY: every Buffer holds an Arc of the arena, so none is alive;
        // the mapping is ours and is unmapped exactly once.
        unsafe { libc::munmap(addr as *mut libc::c_void, len) };
    }
}

fn page_bytes() -> u64 {
    // SAFETY: sysconf has no memory-safety preconditions.
    let v = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if v > 0 {
        v as u64
    } else {
        4096
    }
}

/// An exclusively owned buffer of the arena. Returns to the pool on drop.
pub struct Buffer {
    arena: Arc<PinnedArena>,
    idx: BufIdx,
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffer")
            .field("idx", &self.idx)
            .field("bytes", &self.arena.buffer_bytes)
            .finish()
    }
}

impl Buffer {
    /// The buffer's index (and registered-buffer index).
    pub fn idx(&self) -> BufIdx {
        self.idx
    }

    /// Capacity in bytes.
    pub fn capacity_bytes(&self) -> u64 {
        self.arena.buffer_bytes as u64
    }

    /// The arena this buffer belongs to.
    pub fn arena(&self) -> &Arc<PinnedArena> {
        &self.arena
    }

    /// The buffer's bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the range [ptr, ptr+buffer_bytes) lies in the live mapping
        // (the Arc keeps it), and this Buffer is its only owner.
        unsafe { std::slice::from_raw_parts(self.arena.ptr_of(self.idx), self.arena.buffer_bytes) }
    }

    /// The buffer's bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`; `&mut self` makes the access exclusive.
        unsafe {
            std::slice::from_raw_parts_mut(self.arena.ptr_of(self.idx), self.arena.buffer_bytes)
        }
    }

    /// Raw pointer for the I/O backends. Only valid while `self` is alive.
    pub(crate) fn as_mut_ptr(&mut self) -> *mut u8 {
        self.arena.ptr_of(self.idx)
    }

    /// The bytes' address, from a shared reference: for an owner that
    /// orders readers and writers itself ([`crate::SharedBuffer`]) and must
    /// not make a `&mut Buffer` while others hold `&Buffer`. The bytes are
    /// in the arena's mapping, not in this value.
    pub(crate) fn bytes_ptr(&self) -> *mut u8 {
        self.arena.ptr_of(self.idx)
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        self.arena.release(self.idx);
    }
}
