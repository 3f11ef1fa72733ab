//! # Positional I/O on caller files into caller memory
//!
//! [`Engine`](crate::Engine) moves bytes between its own pinned
//! [`Buffer`]s and extents of its own swap files. This module serves the
//! other shape of I/O, the one DeepSpeed's DeepNVMe `aio_handle` exposes:
//! read or write `len` bytes of *someone else's memory* (a tensor) at
//! `file_offset` of *any file* named by the caller. The Python binding's
//! `tierzero.aio` is built on it; nothing here knows about tensors either.
//!
//! ## Pieces
//! - [`IoFile`]: a file opened twice, with `O_DIRECT` where the file system
//!   allows it and without, so that any offset and length can be served.
//! - [`HostMemory`]: the caller's bytes and the object that keeps them
//!   alive. Built from a `Vec` (safe) or from raw parts (`unsafe`: the
//!   caller promises the memory stays valid while its owner lives).
//! - [`FileIo`]: `threads` workers (DeepSpeed's `intra_op_parallelism`),
//!   each an io_uring ring (or, on the portable backend, a thread doing
//!   `pread`/`pwrite`). An op is cut into one contiguous part per worker at
//!   aligned file offsets; a part into pieces of at most `block_bytes`; up to
//!   `queue_depth` pieces are in flight per ring.
//!
//! ## Alignment: three ways to move a piece
//! O_DIRECT needs the file offset, the length and the memory address to be
//! multiples of the device's block size ([`Alignment`], at least 4096). A
//! part is cut so that only its first and last pieces can be partial blocks:
//! - **direct**: the piece's file range is whole blocks and its memory is
//!   aligned: the kernel moves the bytes straight into (out of) the
//!   caller's memory. Page-locked tensors from `new_cpu_locked_tensor` take
//!   this path, with no copy.
//! - **bounce**: whole blocks, but the memory is not aligned (a plain
//!   `torch.empty` tensor is 64-byte aligned): the piece goes through a
//!   pinned bounce buffer of the worker's own arena, copied in before a
//!   write and out after a read.
//! - **buffered**: a partial block at either end of an unaligned range, or
//!   a file system without O_DIRECT (tmpfs): the piece goes through the
//!   second, buffered descriptor, straight from the caller's memory. Linux
//!   keeps the page cache coherent with the direct writes of other blocks.
//!
//! [`FileIoCounters`] says how many bytes took each way.
//!
//! ## Ownership while I/O is in flight
//! The [`HostMemory`] is moved into the op and comes back in the
//! [`FileCompletion`]; until then only the workers touch it. Dropping the
//! [`FileTicket`] cancels nothing: the last worker to finish drops the
//! memory's owner after the kernel is done with it, so "a tensor dropped
//! before `wait()`" still receives its bytes and is freed only then. A
//! bounce buffer travels with its piece until the piece's last CQE.
//! Dropping the [`FileIo`] drains every op first.
//!
//! ## Every completion is checked
//! As in the engine: a short transfer is continued (through the buffered
//! descriptor if the rest is no longer aligned), a read that finds end of
//! file is [`SwapError::ShortIo`], an errno is [`SwapError::Io`] naming the
//! path, offset and length. A read past the end of the file is refused at
//! submission ([`SwapError::ReadPastEnd`]). A failed write poisons the
//! `FileIo`: every later submission fails with [`SwapError::Poisoned`].

use std::any::Any;
use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender, TryRecvError};
use io_uring::{opcode, types, IoUring};

use crate::align::Alignment;
use crate::arena::{ArenaConfig, Buffer, LockPolicy, PinnedArena};
use crate::engine::BackendKind;
use crate::error::{IoOp, Result, SwapError};
use crate::fault::FaultInjector;
use crate::space::DirectIo;

mod worker;
use worker::{build_ring, portable_worker, RingWorker};

/// Bounce buffers per worker: how many unaligned pieces one worker keeps
/// in flight.
pub const BOUNCE_BUFFERS_PER_WORKER: usize = 8;

/// The largest piece: a bigger `block_bytes` is accepted (DeepSpeed takes
/// any `int`) and served in pieces of this size. One SQE moves at most
/// `u32::MAX` bytes, and larger pieces gain nothing.
pub const MAX_PIECE_BYTES: u64 = 64 << 20;

/// The largest piece through a bounce buffer (and so the size of each of a
/// worker's [`BOUNCE_BUFFERS_PER_WORKER`] buffers): 32 MiB of pinned
/// memory per worker at most, whatever the block size.
pub const MAX_BOUNCE_PIECE_BYTES: u64 = 4 << 20;

/// Settings for [`FileIo::new`].
#[derive(Debug, Clone)]
pub struct FileIoConfig {
    /// io_uring, the portable threads, or io_uring with the threads as
    /// fallback.
    pub backend: BackendKind,
    /// Workers each op is split over (DeepSpeed's `intra_op_parallelism`).
    pub threads: usize,
    /// Pieces in flight per ring (DeepSpeed's `queue_depth`).
    pub queue_depth: u32,
    /// Largest piece (DeepSpeed's `block_size`), rounded up to the
    /// alignment, at most [`MAX_PIECE_BYTES`] (and
    /// [`MAX_BOUNCE_PIECE_BYTES`] through a bounce buffer).
    pub block_bytes: u64,
    /// One `io_uring_enter` per piece instead of one per batch.
    pub single_submit: bool,
    /// Refill the queue as pieces complete; `false`: issue a batch of up to
    /// `queue_depth` pieces and wait for all of it before the next.
    pub overlap_events: bool,
    /// Fault injection (tests).
    pub faults: Option<Arc<FaultInjector>>,
}

impl Default for FileIoConfig {
    fn default() -> Self {
        FileIoConfig {
            backend: BackendKind::Auto,
            threads: 1,
            queue_depth: 128,
            block_bytes: 1 << 20,
            single_submit: false,
            overlap_events: false,
            faults: None,
        }
    }
}

/// Read or write access to an [`IoFile`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// `O_RDONLY`.
    Read,
    /// `O_WRONLY | O_CREAT` (mode 0600, as DeepSpeed creates its files); the
    /// file is never truncated.
    Write,
}

/// A caller's file: an O_DIRECT descriptor where possible, and a buffered one.
#[derive(Debug)]
pub struct IoFile {
    path: PathBuf,
    direct: Option<File>,
    buffered: File,
    alignment: Alignment,
    /// Serialises [`IoFile::grow_to`].
    grow: Mutex<()>,
}

fn open_with(path: &Path, access: Access, direct: bool) -> std::io::Result<File> {
    let mut o = OpenOptions::new();
    match access {
        Access::Read => o.read(true),
        Access::Write => o.write(true).create(true).mode(0o600),
    };
    let mut flags = libc::O_CLOEXEC;
    if direct {
        flags |= libc::O_DIRECT;
    }
    o.custom_flags(flags).open(path)
}

impl IoFile {
    /// Opens `path`. With [`DirectIo::Auto`] a file system that refuses
    /// O_DIRECT (`EINVAL`, as tmpfs does) is served buffered;
    /// [`DirectIo::Require`] fails instead.
    pub fn open(path: &Path, access: Access, direct_io: DirectIo) -> Result<Arc<Self>> {
        let setup = |source: std::io::Error| SwapError::Setup {
            what: format!(
                "opening {} for {}",
                path.display(),
                match access {
                    Access::Read => "reading",
                    Access::Write => "writing",
                }
            ),
            source,
        };
        let buffered = open_with(path, access, false).map_err(setup)?;
        let direct = match direct_io {
            DirectIo::Off => None,
            DirectIo::Auto | DirectIo::Require => match open_with(path, access, true) {
                Ok(f) => Some(f),
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    if direct_io == DirectIo::Require {
                        return Err(SwapError::DirectIoUnsupported {
                            path: path.to_path_buf(),
                        });
                    }
                    None
                }
                Err(e) => return Err(setup(e)),
            },
        };
        Ok(Arc::new(IoFile {
            path: path.to_path_buf(),
            direct,
            buffered,
            alignment: Alignment::for_path(path),
            grow: Mutex::new(()),
        }))
    }

    /// A file the caller already has open as `fd` (which is not taken over:
    /// it is reopened through `/proc/self/fd`, so its offset and flags are
    /// left alone). The path in errors is what `/proc/self/fd/<fd>` points
    /// at.
    pub fn from_fd(fd: RawFd, access: Access, direct_io: DirectIo) -> Result<Arc<Self>> {
        let proc = PathBuf::from(format!("/proc/self/fd/{fd}"));
        let target = std::fs::read_link(&proc).map_err(|source| SwapError::Setup {
            what: format!("file descriptor {fd} is not open"),
            // The fd's own error, as a read(2) on it gives (EBADF), not
            // the /proc lookup's ENOENT.
            source: if source.kind() == std::io::ErrorKind::NotFound {
                std::io::Error::from_raw_os_error(libc::EBADF)
            } else {
                source
            },
        })?;
        // Reopened, the file takes the access this call asks for, not the
        // descriptor's: a read-only descriptor was written through. Its
        // own access mode (`/proc/self/fdinfo`'s `flags`, octal, the low
        // two bits) must allow the transfer, as a write(2) on it would.
        let fdinfo =
            std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}")).map_err(|source| {
                SwapError::Setup {
                    what: format!("reading the flags of file descriptor {fd}"),
                    source,
                }
            })?;
        let flags = fdinfo
            .lines()
            .find_map(|l| l.strip_prefix("flags:"))
            .and_then(|v| u32::from_str_radix(v.trim(), 8).ok());
        if let Some(flags) = flags {
            let mode = flags & libc::O_ACCMODE as u32;
            let (allowed, needs) = match access {
                Access::Read => (mode != libc::O_WRONLY as u32, "reading"),
                Access::Write => (mode != libc::O_RDONLY as u32, "writing"),
            };
            if !allowed {
                return Err(SwapError::Setup {
                    what: format!(
                        "file descriptor {fd} ({}) is not open for {needs}",
                        target.display()
                    ),
                    source: std::io::Error::from_raw_os_error(libc::EBADF),
                });
            }
        }
        // The alignment stays the one `open` found through the link (the
        // file's own device): the target's name may not resolve here (an
        // unlinked file's "... (deleted)", another mount namespace), and
        // its 4096-byte fallback would misalign a larger-block device.
        let mut f = IoFile::open(&proc, access, direct_io)?;
        if let Some(inner) = Arc::get_mut(&mut f) {
            inner.path = target;
        }
        Ok(f)
    }

    /// The path (for errors).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether whole blocks go through O_DIRECT.
    pub fn is_direct(&self) -> bool {
        self.direct.is_some()
    }

    /// The O_DIRECT alignment of the device holding the file.
    pub fn alignment(&self) -> Alignment {
        self.alignment
    }

    /// The file's current size.
    pub fn len_bytes(&self) -> Result<u64> {
        self.buffered
            .metadata()
            .map(|m| m.len())
            .map_err(|source| SwapError::Setup {
                what: format!("stat {}", self.path.display()),
                source,
            })
    }

    /// Makes the file reach `offset_bytes + len_bytes` before a write goes
    /// past its end. A write that extends a file cannot complete inline in
    /// io_uring (the file system takes the inode lock exclusively), so the
    /// kernel hands every such piece to a worker thread: measured here, a
    /// 1 GiB write into a fresh file took 0.18-0.36 CPU-s/GB against
    /// 0.07-0.12 into one of its final size. `fallocate` (mode 0) only ever
    /// grows the file, so ops in flight cannot shrink each other's ranges.
    /// Where the file system refuses it, nothing is done: the write grows
    /// the file itself (an `ftruncate` here could shrink it under a write
    /// through another `IoFile` of the same path, which this lock does
    /// not order). A failure costs only the fast path, not the write.
    fn grow_to(&self, offset_bytes: u64, len_bytes: u64) {
        let _held = self.grow.lock().unwrap_or_else(|e| e.into_inner());
        let end_bytes = offset_bytes.saturating_add(len_bytes);
        if self.len_bytes().is_ok_and(|l| l >= end_bytes) {
            return;
        }
        let (Ok(off), Ok(len)) = (
            libc::off_t::try_from(offset_bytes),
            libc::off_t::try_from(len_bytes),
        ) else {
            return;
        };
        // Only the range about to be written is allocated: a hole before
        // it stays a hole (a write at 8 GiB into an empty file must not
        // allocate 8 GiB).
        // SAFETY: fallocate on a descriptor this IoFile owns; no memory
        // is passed.
        let _ = unsafe { libc::fallocate(self.buffered.as_raw_fd(), 0, off, len) };
    }

    fn fd(&self, direct: bool) -> RawFd {
        match (&self.direct, direct) {
            (Some(f), true) => f.as_raw_fd(),
            _ => self.buffered.as_raw_fd(),
        }
    }
}

/// The caller's bytes, and what keeps them alive.
pub struct HostMemory {
    addr: usize,
    len_bytes: usize,
    owner: Box<dyn Any + Send>,
}

impl std::fmt::Debug for HostMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostMemory")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len_bytes", &self.len_bytes)
            .finish()
    }
}

impl HostMemory {
    /// `len_bytes` of `vec` from `offset_bytes` (which lets tests choose an
    /// aligned or an unaligned address). Moving a `Vec` does not move its
    /// heap buffer, so the address stays valid while the owner lives.
    ///
    /// # Panics
    /// If the range does not fit the vector (a caller bug, not input).
    pub fn from_vec(mut vec: Vec<u8>, offset_bytes: usize, len_bytes: usize) -> Self {
        assert!(
            offset_bytes
                .checked_add(len_bytes)
                .is_some_and(|end| end <= vec.len()),
            "HostMemory::from_vec: {offset_bytes}+{len_bytes} outside a vector of {} bytes",
            vec.len()
        );
        let addr = vec.as_mut_ptr() as usize + offset_bytes;
        HostMemory {
            addr,
            len_bytes,
            owner: Box::new(vec),
        }
    }

    /// Memory the caller vouches for.
    ///
    /// # Safety
    /// `[addr, addr + len_bytes)` must be valid for reads and writes for as
    /// long as `owner` is alive, and from submission until the completion
    /// (or, if the ticket is dropped, until `owner` is dropped) nothing else
    /// may write it, nor read it while a read op fills it.
    pub unsafe fn from_raw_parts(
        addr: *mut u8,
        len_bytes: usize,
        owner: Box<dyn Any + Send>,
    ) -> Self {
        HostMemory {
            addr: addr as usize,
            len_bytes,
            owner,
        }
    }

    /// Length in bytes.
    pub fn len_bytes(&self) -> usize {
        self.len_bytes
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len_bytes == 0
    }

    /// The address (for alignment checks).
    pub fn addr(&self) -> usize {
        self.addr
    }

    /// The bytes. Only between ops: no op may hold this memory.
    pub fn as_slice(&self) -> &[u8] {
        if self.len_bytes == 0 {
            return &[];
        }
        // SAFETY: the constructors guarantee the range is valid while the
        // owner (held by self) lives; `&self` outside an op means no worker
        // holds it (ops take the HostMemory by value).
        unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len_bytes) }
    }

    /// The owner, for the caller to take back (`downcast` a `Vec<u8>`).
    pub fn into_owner(self) -> Box<dyn Any + Send> {
        self.owner
    }
}

/// Bytes moved each way (see the module docs).
#[derive(Debug, Default)]
pub struct FileIoCounters {
    /// O_DIRECT straight into or out of the caller's memory.
    pub direct_bytes: AtomicU64,
    /// O_DIRECT through a bounce buffer (the caller's memory was unaligned).
    pub bounce_bytes: AtomicU64,
    /// Through the page cache (partial blocks, or no O_DIRECT).
    pub buffered_bytes: AtomicU64,
    /// Ops completed.
    pub ops: AtomicU64,
}

/// The outcome of an op; the memory always comes back.
#[derive(Debug)]
pub struct FileCompletion {
    /// Read or write.
    pub op: IoOp,
    /// The caller's memory (holding the data, after a successful read).
    pub memory: HostMemory,
    /// Whether every byte moved.
    pub result: Result<()>,
}

/// A handle on one op's completion.
#[derive(Debug)]
pub struct FileTicket {
    rx: Receiver<FileCompletion>,
}

impl FileTicket {
    /// Waits for the completion.
    pub fn wait(self) -> Result<FileCompletion> {
        self.rx.recv().map_err(|_| SwapError::Shutdown)
    }
    /// Whether the op has completed.
    pub fn is_done(&self) -> bool {
        !self.rx.is_empty()
    }
}

#[derive(Debug, Default)]
struct Poison {
    set: AtomicBool,
    /// The first failed write's message and OS error kind.
    cause: Mutex<Option<crate::space::PoisonCause>>,
}

#[derive(Debug)]
struct Shared {
    faults: Option<Arc<FaultInjector>>,
    counters: FileIoCounters,
    poison: Poison,
    block_bytes: u64,
}

/// One op, shared by its parts.
struct OpState {
    op: IoOp,
    file: Arc<IoFile>,
    mem_addr: usize,
    parts_left: AtomicUsize,
    error: Mutex<Option<SwapError>>,
    finish: Mutex<Option<(HostMemory, Sender<FileCompletion>)>>,
}

/// A contiguous share of an op, run by one worker.
struct Part {
    op: Arc<OpState>,
    file_offset_bytes: u64,
    mem_offset_bytes: u64,
    len_bytes: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Way {
    Direct,
    Bounce,
    Buffered,
}

/// One piece of a part.
struct PieceTask {
    part: usize,
    file_offset_bytes: u64,
    mem_offset_bytes: u64,
    len_bytes: u64,
    done_bytes: u64,
    way: Way,
    bounce: Option<Buffer>,
}

/// Cuts `[file_offset, file_offset + len)` so that only the first and the
/// last piece can be partial blocks; whole-block pieces are at most `block`.
fn cut_pieces(part: usize, p: &Part, align: Alignment, block: u64, direct: bool) -> Vec<PieceTask> {
    let mut out = Vec::new();
    let a = align.bytes();
    let mut file = p.file_offset_bytes;
    let mut mem = p.mem_offset_bytes;
    let end = p.file_offset_bytes + p.len_bytes;
    let mut push = |file: u64, mem: u64, len: u64, way: Way| {
        out.push(PieceTask {
            part,
            file_offset_bytes: file,
            mem_offset_bytes: mem,
            len_bytes: len,
            done_bytes: 0,
            way,
            bounce: None,
        })
    };
    if !direct {
        while file < end {
            let len = block.min(end - file);
            push(file, mem, len, Way::Buffered);
            file += len;
            mem += len;
        }
        return out;
    }
    if !align.is_aligned(file) {
        let len = (align.round_up(file) - file).min(end - file);
        push(file, mem, len, Way::Buffered);
        file += len;
        mem += len;
    }
    let whole_end = file + (end - file) / a * a;
    // Every whole-block piece starts at an aligned file offset, so their
    // memory addresses are all aligned or all not.
    let way = if align.is_aligned(p.op.mem_addr as u64 + mem) {
        Way::Direct
    } else {
        Way::Bounce
    };
    let most = match way {
        Way::Bounce => bounce_piece_bytes(align, block),
        _ => block,
    };
    while file < whole_end {
        let len = most.min(whole_end - file);
        push(file, mem, len, way);
        file += len;
        mem += len;
    }
    if file < end {
        push(file, mem, end - file, Way::Buffered);
    }
    out
}

/// What a piece's raw result means.
enum Outcome {
    Done,
    Again,
    Failed(SwapError),
}

impl Shared {
    fn check(&self, op: &OpState, piece: &mut PieceTask, raw: i64) -> Outcome {
        let remaining = piece.len_bytes - piece.done_bytes;
        let raw = match &self.faults {
            Some(f) => f.apply(op.op, raw, remaining),
            None => raw,
        };
        if raw == -(libc::EINTR as i64) || raw == -(libc::EAGAIN as i64) {
            return Outcome::Again;
        }
        if raw < 0 {
            let errno = i32::try_from(-raw).unwrap_or(libc::EIO);
            return Outcome::Failed(SwapError::Io {
                op: op.op,
                path: op.file.path.clone(),
                offset_bytes: piece.file_offset_bytes + piece.done_bytes,
                len_bytes: remaining,
                source: std::io::Error::from_raw_os_error(errno),
            });
        }
        let got = raw as u64;
        if got == 0 || got > remaining {
            return Outcome::Failed(SwapError::ShortIo {
                op: op.op,
                path: op.file.path.clone(),
                offset_bytes: piece.file_offset_bytes,
                expected_bytes: piece.len_bytes,
                got_bytes: piece.done_bytes + got.min(remaining),
            });
        }
        piece.done_bytes += got;
        if piece.done_bytes < piece.len_bytes {
            return Outcome::Again;
        }
        let counter = match piece.way {
            Way::Direct => &self.counters.direct_bytes,
            Way::Bounce => &self.counters.bounce_bytes,
            Way::Buffered => &self.counters.buffered_bytes,
        };
        counter.fetch_add(piece.len_bytes, Ordering::Relaxed);
        Outcome::Done
    }

    /// A part is done: the last part of an op finishes it.
    fn part_done(&self, op: &Arc<OpState>, error: Option<SwapError>) {
        if let Some(e) = error {
            let mut slot = op.error.lock().unwrap_or_else(|e| e.into_inner());
            if slot.is_none() {
                *slot = Some(e);
            }
        }
        if op.parts_left.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        let error = op.error.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let (IoOp::Write, Some(e)) = (op.op, &error) {
            self.poison(format!("{e}"), e);
        }
        self.counters.ops.fetch_add(1, Ordering::Relaxed);
        let finish = op.finish.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some((memory, reply)) = finish {
            let _ = reply.send(FileCompletion {
                op: op.op,
                memory,
                result: error.map_or(Ok(()), Err),
            });
        }
    }

    fn poison(&self, cause: String, failed: &SwapError) {
        let (io_kind, os_error) = (failed.io_kind(), failed.raw_os_error());
        let mut c = self.poison.cause.lock().unwrap_or_else(|e| e.into_inner());
        if c.is_none() {
            *c = Some((cause, io_kind, os_error));
        }
        self.poison.set.store(true, Ordering::Release);
    }
}

/// Where a piece's next transfer goes: descriptor, address, length, offset.
fn target(op: &OpState, piece: &mut PieceTask, align: Alignment) -> (RawFd, *mut u8, u32, u64) {
    let off = piece.file_offset_bytes + piece.done_bytes;
    let len = piece.len_bytes - piece.done_bytes;
    let ptr: *mut u8 = match piece.bounce.as_mut() {
        Some(b) => b.as_mut_ptr().wrapping_add(piece.done_bytes as usize),
        None => (op.mem_addr + (piece.mem_offset_bytes + piece.done_bytes) as usize) as *mut u8,
    };
    let direct = piece.way != Way::Buffered
        && align.is_aligned(off)
        && align.is_aligned(len)
        && align.is_aligned(ptr as u64);
    (op.file.fd(direct), ptr, len as u32, off)
}

/// Copies between a bounce buffer and the caller's memory.
fn bounce_copy(op: &OpState, piece: &mut PieceTask, into_bounce: bool) {
    let len = piece.len_bytes as usize;
    let mem = (op.mem_addr + piece.mem_offset_bytes as usize) as *mut u8;
    let Some(b) = piece.bounce.as_mut() else {
        return;
    };
    let bounce = &mut b.as_mut_slice()[..len];
    if into_bounce {
        // SAFETY: [mem, mem+len) lies inside the op's HostMemory (cut_pieces
        // stays inside the part, the part inside the op), valid while the op
        // holds it; this worker is the only one touching this piece's range.
        bounce.copy_from_slice(unsafe { std::slice::from_raw_parts(mem, len) });
    } else {
        // SAFETY: as above; a read op's memory is written only by the piece
        // that covers each range.
        unsafe { std::slice::from_raw_parts_mut(mem, len) }.copy_from_slice(bounce);
    }
}

/// The size of a bounce piece (and buffer) for pieces of at most `block`.
fn bounce_piece_bytes(align: Alignment, block: u64) -> u64 {
    align.round_up(block.min(MAX_BOUNCE_PIECE_BYTES))
}

/// Whether `arena`'s buffers can bounce pieces of at most `block` at `align`.
fn bounces(arena: &PinnedArena, align: Alignment, block: u64) -> bool {
    arena.buffer_bytes() >= bounce_piece_bytes(align, block) && arena.alignment() >= align
}

fn bounce_arena(align: Alignment, block: u64) -> Result<Arc<PinnedArena>> {
    let bytes = bounce_piece_bytes(align, block);
    PinnedArena::new(ArenaConfig {
        budget_bytes: bytes * BOUNCE_BUFFERS_PER_WORKER as u64,
        buffer_bytes: bytes,
        alignment: align,
        lock: LockPolicy::BestEffort,
        registrar: None,
    })
}

/// The I/O workers of one handle.
#[derive(Debug)]
pub struct FileIo {
    shared: Arc<Shared>,
    senders: Vec<Sender<Part>>,
    threads: Vec<JoinHandle<()>>,
    uring: bool,
    next: AtomicUsize,
    config: FileIoConfig,
}

impl FileIo {
    /// Starts the workers: `threads` io_uring rings, or `threads` portable
    /// threads where io_uring cannot be set up ([`BackendKind::Auto`]) or is
    /// not wanted.
    pub fn new(config: FileIoConfig) -> Result<Self> {
        if config.threads == 0 || config.queue_depth == 0 || config.block_bytes == 0 {
            return Err(SwapError::Config(format!(
                "file I/O needs at least one thread, a queue depth and a block size (got threads {}, queue_depth {}, block_bytes {})",
                config.threads, config.queue_depth, config.block_bytes
            )));
        }
        check_queue_depth(config.queue_depth)?;
        let shared = Arc::new(Shared {
            faults: config.faults.clone(),
            counters: FileIoCounters::default(),
            poison: Poison::default(),
            block_bytes: config.block_bytes.min(MAX_PIECE_BYTES),
        });
        let mut senders = Vec::new();
        let mut threads = Vec::new();
        let uring = config.backend != BackendKind::Portable;
        for idx in 0..config.threads {
            let (tx, rx) = crossbeam_channel::unbounded::<Part>();
            let (ready_tx, ready_rx) = crossbeam_channel::bounded::<Result<()>>(1);
            let shared2 = shared.clone();
            let cfg = config.clone();
            let want_uring = uring;
            let h = std::thread::Builder::new()
                .name(format!("tz-fio-{idx}"))
                .spawn(move || {
                    if want_uring {
                        match build_ring(cfg.queue_depth) {
                            Ok(ring) => {
                                let _ = ready_tx.send(Ok(()));
                                RingWorker::new(ring, shared2, &cfg).run(rx);
                            }
                            Err(e) => {
                                let _ = ready_tx.send(Err(e));
                            }
                        }
                    } else {
                        let _ = ready_tx.send(Ok(()));
                        portable_worker(&shared2, rx);
                    }
                })
                .map_err(|source| SwapError::Setup {
                    what: "spawning file I/O threads".into(),
                    source,
                })?;
            match ready_rx.recv().unwrap_or(Err(SwapError::Shutdown)) {
                Ok(()) => {
                    senders.push(tx);
                    threads.push(h);
                }
                Err(e) => {
                    let _ = h.join();
                    drop(tx);
                    if config.backend == BackendKind::Uring || idx > 0 {
                        drop(senders);
                        for t in threads {
                            let _ = t.join();
                        }
                        return Err(e);
                    }
                    // Auto: io_uring refused; every worker is portable.
                    return FileIo::new(FileIoConfig {
                        backend: BackendKind::Portable,
                        ..config
                    });
                }
            }
        }
        Ok(FileIo {
            shared,
            senders,
            threads,
            uring,
            next: AtomicUsize::new(0),
            config,
        })
    }

    /// Whether the workers are io_uring rings (else portable threads).
    pub fn is_uring(&self) -> bool {
        self.uring
    }

    /// The settings it runs with.
    pub fn config(&self) -> &FileIoConfig {
        &self.config
    }

    /// Bytes moved each way so far.
    pub fn counters(&self) -> &FileIoCounters {
        &self.shared.counters
    }

    /// Whether a failed write has poisoned it.
    pub fn is_poisoned(&self) -> bool {
        self.shared.poison.set.load(Ordering::Acquire)
    }

    /// Submits `op` of `memory.len_bytes()` bytes at `file_offset_bytes` of
    /// `file`. A read must lie inside the file ([`SwapError::ReadPastEnd`]
    /// otherwise); a write may extend it.
    pub fn submit(
        &self,
        op: IoOp,
        file: &Arc<IoFile>,
        file_offset_bytes: u64,
        memory: HostMemory,
    ) -> Result<FileTicket> {
        if self.is_poisoned() {
            let (cause, io_kind, os_error) = self
                .shared
                .poison
                .cause
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone()
                .unwrap_or_default();
            return Err(SwapError::Poisoned {
                op,
                cause,
                io_kind,
                os_error,
            });
        }
        let len = memory.len_bytes as u64;
        // Offsets past i64::MAX are no file's (the kernel takes loff_t),
        // and the cuts below add to the offset.
        if file_offset_bytes
            .checked_add(len)
            .is_none_or(|end| end > i64::MAX as u64)
        {
            return Err(SwapError::Config(format!(
                "{}: {len} bytes at offset {file_offset_bytes} end past the largest file offset \
                 (2^63 - 1)",
                file.path.display()
            )));
        }
        if op == IoOp::Read {
            let file_bytes = file.len_bytes()?;
            if file_offset_bytes.saturating_add(len) > file_bytes {
                return Err(SwapError::ReadPastEnd {
                    path: file.path.clone(),
                    offset_bytes: file_offset_bytes,
                    len_bytes: len,
                    file_bytes,
                });
            }
        }
        if op == IoOp::Write && len > 0 {
            file.grow_to(file_offset_bytes, len);
        }
        let (tx, rx) = crossbeam_channel::bounded(1);
        // Parts: one per worker, cut at aligned file offsets.
        let align = file.alignment;
        let workers = self.senders.len() as u64;
        let mut cuts = vec![file_offset_bytes];
        for k in 1..workers {
            let c = align
                .round_up(file_offset_bytes + len * k / workers)
                .min(file_offset_bytes + len);
            if c > *cuts.last().unwrap_or(&0) {
                cuts.push(c);
            }
        }
        cuts.push(file_offset_bytes + len);
        cuts.dedup();
        let nparts = cuts.len().saturating_sub(1);
        let state = Arc::new(OpState {
            op,
            file: file.clone(),
            mem_addr: memory.addr,
            parts_left: AtomicUsize::new(nparts.max(1)),
            error: Mutex::new(None),
            finish: Mutex::new(Some((memory, tx))),
        });
        if nparts == 0 {
            self.shared.part_done(&state, None);
            return Ok(FileTicket { rx });
        }
        let first = self.next.fetch_add(1, Ordering::Relaxed);
        for (k, w) in cuts.windows(2).enumerate() {
            let part = Part {
                op: state.clone(),
                file_offset_bytes: w[0],
                mem_offset_bytes: w[0] - file_offset_bytes,
                len_bytes: w[1] - w[0],
            };
            let worker = (first + k) % self.senders.len();
            if let Err(e) = self.senders[worker].send(part) {
                self.shared.part_done(&e.0.op, Some(SwapError::Shutdown));
            }
        }
        Ok(FileTicket { rx })
    }
}

impl Drop for FileIo {
    fn drop(&mut self) {
        self.senders.clear();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// The most submission entries a ring (the file I/O's, the engine's) is
/// built with, and so the deepest queue either takes.
pub const MAX_RING_ENTRIES: u32 = 4096;

/// Refuses a queue deeper than a ring holds: it would keep more in flight
/// than the ring's completions can hold, and each ring thread sizes its
/// slot table by it (the Python aio handle passed any u32: 2^32-1
/// aborted).
pub fn check_queue_depth(queue_depth: u32) -> Result<()> {
    if queue_depth > MAX_RING_ENTRIES {
        return Err(SwapError::Config(format!(
            "queue_depth {queue_depth} is more than a ring holds ({MAX_RING_ENTRIES}); give at most {MAX_RING_ENTRIES} (8 to 128 is typical)"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;
    use crate::fault::{FaultKind, FaultRule};

    fn pattern(n: usize, seed: u8) -> Vec<u8> {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    fn io(backend: BackendKind, threads: usize, overlap: bool, single: bool) -> FileIo {
        FileIo::new(FileIoConfig {
            backend,
            threads,
            queue_depth: 4,
            block_bytes: 8192,
            single_submit: single,
            overlap_events: overlap,
            faults: None,
        })
        .unwrap()
    }

    /// A queue deeper than a ring holds is refused at construction (it
    /// sized each ring thread's slot table by it: 2^32 - 1 aborted).
    #[test]
    fn a_queue_deeper_than_a_ring_is_refused() {
        let cfg = |queue_depth| FileIoConfig {
            backend: BackendKind::Portable,
            threads: 1,
            queue_depth,
            block_bytes: 8192,
            single_submit: false,
            overlap_events: true,
            faults: None,
        };
        assert!(FileIo::new(cfg(MAX_RING_ENTRIES)).is_ok());
        for qd in [MAX_RING_ENTRIES + 1, u32::MAX] {
            let e = FileIo::new(cfg(qd)).err().map(|e| e.to_string());
            assert!(
                e.as_deref()
                    .is_some_and(|e| e.contains("more than a ring holds")),
                "{qd}: {e:?}"
            );
        }
    }

    fn write_at(io: &FileIo, f: &Arc<IoFile>, off: u64, data: &[u8], mem_off: usize) {
        let mut v = vec![0u8; data.len() + mem_off];
        v[mem_off..].copy_from_slice(data);
        let c = io
            .submit(
                IoOp::Write,
                f,
                off,
                HostMemory::from_vec(v, mem_off, data.len()),
            )
            .unwrap()
            .wait()
            .unwrap();
        c.result.unwrap();
    }

    fn read_at(io: &FileIo, f: &Arc<IoFile>, off: u64, len: usize, mem_off: usize) -> Vec<u8> {
        let v = vec![0u8; len + mem_off];
        let c = io
            .submit(IoOp::Read, f, off, HostMemory::from_vec(v, mem_off, len))
            .unwrap()
            .wait()
            .unwrap();
        c.result.unwrap();
        c.memory.as_slice().to_vec()
    }

    /// Awkward sizes, offsets and memory alignments, every backend and mode,
    /// against `std::fs` as the reference.
    #[test]
    fn matches_std_fs_at_awkward_sizes() {
        let dir = tempfile::tempdir().unwrap();
        let mut k = 0u8;
        for backend in [BackendKind::Uring, BackendKind::Portable] {
            for (threads, overlap, single) in
                [(1, false, false), (2, true, false), (3, false, true)]
            {
                let io = io(backend, threads, overlap, single);
                for &(off, len, mem_off) in &[
                    (0u64, 0usize, 0usize),
                    (0, 1, 0),
                    (0, 4096, 0),
                    (4096, 3 * 8192 + 4096, 0),
                    (100, 5000, 3),
                    (4095, 70_001, 64),
                    (12_288, 8191, 0),
                ] {
                    k = k.wrapping_add(1);
                    let path = dir.path().join(format!("f{k}"));
                    // Every third file buffered only, as on a file system
                    // without O_DIRECT.
                    let policy = if k.is_multiple_of(3) {
                        DirectIo::Off
                    } else {
                        DirectIo::Auto
                    };
                    let w = IoFile::open(&path, Access::Write, policy).unwrap();
                    let data = pattern(len, k);
                    write_at(&io, &w, off, &data, mem_off);
                    let on_disk = std::fs::read(&path).unwrap();
                    assert_eq!(
                        on_disk.len() as u64,
                        off + len as u64,
                        "{backend:?} {off} {len}"
                    );
                    assert_eq!(&on_disk[off as usize..], &data[..]);
                    let r = IoFile::open(&path, Access::Read, policy).unwrap();
                    let mem_off2 = (mem_off + 1) % 7;
                    assert_eq!(
                        read_at(&io, &r, off, len, mem_off2),
                        data,
                        "{backend:?} {off} {len}"
                    );
                }
            }
        }
    }

    #[test]
    fn aligned_memory_is_zero_copy_and_unaligned_bounces() {
        let dir = tempfile::tempdir().unwrap();
        let io = io(BackendKind::Auto, 1, true, false);
        let path = dir.path().join("z");
        let f = IoFile::open(&path, Access::Write, DirectIo::Auto).unwrap();
        if !f.is_direct() {
            return; // no O_DIRECT where the temp dir lives: nothing to tell apart
        }
        // A Vec with room to find a 4096-aligned start.
        let v = vec![0u8; 3 * 4096];
        let skew = (4096 - (v.as_ptr() as usize % 4096)) % 4096;
        let c = io
            .submit(IoOp::Write, &f, 0, HostMemory::from_vec(v, skew, 8192))
            .unwrap()
            .wait()
            .unwrap();
        c.result.unwrap();
        assert_eq!(io.counters().direct_bytes.load(Ordering::Relaxed), 8192);
        assert_eq!(io.counters().bounce_bytes.load(Ordering::Relaxed), 0);
        let v = c.memory.into_owner().downcast::<Vec<u8>>().unwrap();
        let c = io
            .submit(IoOp::Write, &f, 0, HostMemory::from_vec(*v, skew + 1, 8192))
            .unwrap()
            .wait()
            .unwrap();
        c.result.unwrap();
        assert_eq!(io.counters().bounce_bytes.load(Ordering::Relaxed), 8192);
    }

    /// A write far past the end grows the file without filling the hole.
    #[test]
    fn write_past_the_end_keeps_the_hole() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sparse");
        let io = io(BackendKind::Auto, 1, false, false);
        let f = IoFile::open(&path, Access::Write, DirectIo::Auto).unwrap();
        let off = 1u64 << 32;
        write_at(&io, &f, off, &pattern(8192, 1), 0);
        let m = std::fs::metadata(&path).unwrap();
        assert_eq!(m.len(), off + 8192);
        assert!(
            m.blocks() * 512 < 1 << 20,
            "{} bytes allocated",
            m.blocks() * 512
        );
    }

    #[test]
    fn read_past_end_is_refused_with_the_numbers() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("short");
        std::fs::write(&path, vec![1u8; 1000]).unwrap();
        let io = io(BackendKind::Auto, 1, false, false);
        let f = IoFile::open(&path, Access::Read, DirectIo::Auto).unwrap();
        let e = io
            .submit(
                IoOp::Read,
                &f,
                10,
                HostMemory::from_vec(vec![0; 1000], 0, 1000),
            )
            .unwrap_err();
        assert!(
            matches!(
                e,
                SwapError::ReadPastEnd {
                    offset_bytes: 10,
                    len_bytes: 1000,
                    file_bytes: 1000,
                    ..
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn an_offset_past_the_largest_file_offset_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let io = io(BackendKind::Auto, 2, false, false);
        let f = IoFile::open(&path, Access::Write, DirectIo::Auto).unwrap();
        for offset in [u64::MAX - 10, i64::MAX as u64] {
            let e = io
                .submit(
                    IoOp::Write,
                    &f,
                    offset,
                    HostMemory::from_vec(vec![0; 4096], 0, 4096),
                )
                .unwrap_err();
            assert!(
                matches!(e, SwapError::Config(ref m) if m.contains("2^63")),
                "{e}"
            );
        }
        assert!(!io.is_poisoned());
    }

    #[test]
    fn injected_errors_name_the_piece_and_a_failed_write_poisons() {
        let dir = tempfile::tempdir().unwrap();
        for backend in [BackendKind::Uring, BackendKind::Portable] {
            let faults = Arc::new(FaultInjector::new(vec![FaultRule {
                nth: 2,
                op: Some(IoOp::Write),
                kind: FaultKind::Errno(libc::ENOSPC),
            }]));
            let io = FileIo::new(FileIoConfig {
                backend,
                block_bytes: 4096,
                faults: Some(faults),
                ..FileIoConfig::default()
            })
            .unwrap();
            let path = dir.path().join(format!("e{backend:?}"));
            let f = IoFile::open(&path, Access::Write, DirectIo::Auto).unwrap();
            let c = io
                .submit(
                    IoOp::Write,
                    &f,
                    0,
                    HostMemory::from_vec(vec![7; 3 * 4096], 0, 3 * 4096),
                )
                .unwrap()
                .wait()
                .unwrap();
            match c.result {
                Err(SwapError::Io {
                    source,
                    len_bytes: 4096,
                    ..
                }) => {
                    assert_eq!(source.raw_os_error(), Some(libc::ENOSPC))
                }
                other => panic!("{other:?}"),
            }
            assert!(io.is_poisoned());
            let e = io
                .submit(IoOp::Write, &f, 0, HostMemory::from_vec(vec![7; 10], 0, 10))
                .unwrap_err();
            // The failed write's kind travels with the poison: a full disk
            // is the user's, whichever later operation reports it.
            assert!(
                matches!(
                    e,
                    SwapError::Poisoned {
                        io_kind: Some(std::io::ErrorKind::StorageFull),
                        ..
                    }
                ),
                "{e:?}"
            );
            assert_eq!(e.io_kind(), Some(std::io::ErrorKind::StorageFull));
        }
    }

    #[test]
    fn short_transfers_are_finished() {
        let dir = tempfile::tempdir().unwrap();
        let faults = Arc::new(FaultInjector::new(vec![FaultRule {
            nth: 1,
            op: Some(IoOp::Read),
            kind: FaultKind::Short,
        }]));
        let io = FileIo::new(FileIoConfig {
            faults: Some(faults.clone()),
            block_bytes: 1 << 16,
            ..FileIoConfig::default()
        })
        .unwrap();
        let path = dir.path().join("s");
        let data = pattern(1 << 16, 3);
        std::fs::write(&path, &data).unwrap();
        let f = IoFile::open(&path, Access::Read, DirectIo::Auto).unwrap();
        assert_eq!(read_at(&io, &f, 0, data.len(), 0), data);
        assert_eq!(faults.injected(), 1);
    }

    /// The ticket dropped before the op is done: the bytes still land, and
    /// the memory's owner is dropped only after the kernel is done with it.
    #[test]
    fn dropped_ticket_still_lands() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d");
        let data = pattern(1 << 20, 9);
        {
            let io = io(BackendKind::Auto, 2, true, false);
            let f = IoFile::open(&path, Access::Write, DirectIo::Auto).unwrap();
            drop(
                io.submit(
                    IoOp::Write,
                    &f,
                    0,
                    HostMemory::from_vec(data.clone(), 0, data.len()),
                )
                .unwrap(),
            );
        }
        assert_eq!(std::fs::read(&path).unwrap(), data);
    }

    #[test]
    fn from_fd_refuses_a_transfer_its_descriptor_does_not_allow() {
        use std::os::fd::AsRawFd;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fd");
        std::fs::write(&path, [7u8; 4096]).unwrap();
        let ro = std::fs::File::open(&path).unwrap();
        let e = IoFile::from_fd(ro.as_raw_fd(), Access::Write, DirectIo::Auto).unwrap_err();
        assert!(e.to_string().contains("is not open for writing"), "{e}");
        assert_eq!(e.raw_os_error(), Some(libc::EBADF));
        IoFile::from_fd(ro.as_raw_fd(), Access::Read, DirectIo::Auto).unwrap();
        let wo = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        let e = IoFile::from_fd(wo.as_raw_fd(), Access::Read, DirectIo::Auto).unwrap_err();
        assert!(e.to_string().contains("is not open for reading"), "{e}");
        IoFile::from_fd(wo.as_raw_fd(), Access::Write, DirectIo::Auto).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), [7u8; 4096]);
        // A descriptor that is not open is EBADF, as read(2) says (it was
        // the /proc lookup's ENOENT).
        // (A number no test opens: a closed one may be reused at once by
        // another test's thread.)
        let e = IoFile::from_fd(1 << 20, Access::Write, DirectIo::Auto).unwrap_err();
        assert!(e.to_string().contains("is not open"), "{e}");
        assert_eq!(e.raw_os_error(), Some(libc::EBADF));
    }

    #[test]
    fn from_fd_reopens_without_touching_the_callers_offset() {
        use std::io::{Seek, SeekFrom, Write};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fd");
        let mut own = std::fs::OpenOptions::new()
            .create(true)
            .truncate(true)
            .write(true)
            .open(&path)
            .unwrap();
        own.write_all(b"abc").unwrap();
        let io = io(BackendKind::Auto, 1, false, false);
        let f = IoFile::from_fd(own.as_raw_fd(), Access::Write, DirectIo::Auto).unwrap();
        assert_eq!(f.path(), path.canonicalize().unwrap());
        write_at(&io, &f, 4096, &pattern(5000, 1), 0);
        assert_eq!(own.stream_position().unwrap(), 3);
        assert_eq!(own.seek(SeekFrom::End(0)).unwrap(), 4096 + 5000);
    }
}
