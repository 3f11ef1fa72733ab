//! The one error type of `tierzero-swap`.
//!
//! Every variant carries the context a user needs to act without reading
//! our source: the operation, the file, the byte offset and the lengths
//! involved, and where there is one, the fix.

use std::fmt;
use std::path::PathBuf;

/// Which kind of transfer an operation was.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IoOp {
    /// A read from swap into a buffer.
    Read,
    /// A write from a buffer into swap.
    Write,
}

impl fmt::Display for IoOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            IoOp::Read => "read",
            IoOp::Write => "write",
        })
    }
}

/// Everything that can go wrong in the swap layer.
#[derive(Debug, thiserror::Error)]
pub enum SwapError {
    /// The kernel failed a transfer (EIO, ENOSPC, EFBIG, ...).
    #[error("{op} of {len_bytes} bytes at offset {offset_bytes} in {path} failed: {source}")]
    Io {
        op: IoOp,
        path: PathBuf,
        offset_bytes: u64,
        len_bytes: u64,
        #[source]
        source: std::io::Error,
    },

    /// A transfer moved fewer bytes than asked and could not be completed
    /// (a read hit end of file, i.e. the swap file was truncated).
    #[error("short {op} in {path} at offset {offset_bytes}: expected {expected_bytes} bytes, got {got_bytes} (was the swap file truncated or replaced?)")]
    ShortIo {
        op: IoOp,
        path: PathBuf,
        offset_bytes: u64,
        expected_bytes: u64,
        got_bytes: u64,
    },

    /// An offset, length or address is not a multiple of the O_DIRECT alignment.
    #[error(
        "{what} = {value} is not a multiple of the required alignment of {alignment_bytes} bytes"
    )]
    Misaligned {
        what: &'static str,
        value: u64,
        alignment_bytes: u64,
    },

    /// No free buffers in the pinned arena.
    #[error("pinned buffer pool exhausted: requested {requested_buffers} buffers of {buffer_bytes} bytes, {available_buffers} available (raise the pinned budget or lower buffer_count)")]
    PoolExhausted {
        requested_buffers: usize,
        available_buffers: usize,
        buffer_bytes: u64,
    },

    /// A write failed earlier; the contents of this swap space can no longer
    /// be trusted, so every later operation fails fast.
    #[error("swap space is poisoned by an earlier failed write ({cause}); refusing {op} to avoid using bad data")]
    Poisoned {
        op: IoOp,
        cause: String,
        /// The failed write's OS error kind, when it had one: a full disk
        /// or a file-size limit is the user's to fix, whichever later
        /// operation reports it.
        io_kind: Option<std::io::ErrorKind>,
        /// The failed write's OS error code, when it had one (`EIO`: the
        /// device's fault, which no `ErrorKind` names).
        os_error: Option<i32>,
    },

    /// `RLIMIT_MEMLOCK` is below the pinned budget.
    #[error("cannot pin {requested_bytes} bytes: RLIMIT_MEMLOCK is {limit_bytes} bytes ({locked_bytes} already locked). Fix: raise it (`ulimit -l unlimited`, `memlock` in /etc/security/limits.conf, `LimitMEMLOCK=infinity` for systemd, `--ulimit memlock=-1` for docker), or pin at most {headroom} bytes more", headroom = limit_bytes.saturating_sub(*locked_bytes))]
    MemlockTooLow {
        requested_bytes: u64,
        limit_bytes: u64,
        locked_bytes: u64,
    },

    /// Setting up memory, files or rings failed.
    #[error("{what}: {source}")]
    Setup {
        what: String,
        #[source]
        source: std::io::Error,
    },

    /// Invalid configuration passed to the swap layer.
    #[error("invalid swap configuration: {0}")]
    Config(String),

    /// The extent allocator has no room.
    #[error("swap space full: requested {requested_bytes} bytes in the swap space of {path}, {free_bytes} free in all, largest free range {largest_free_bytes} bytes (raise the swap capacity or add nvme paths)")]
    OutOfSpace {
        path: PathBuf,
        requested_bytes: u64,
        free_bytes: u64,
        largest_free_bytes: u64,
    },

    /// A swap file's preallocation does not fit the free space of its
    /// file system: found before it is allocated (`statvfs`), or by the
    /// allocation's `ENOSPC` (another process took the space meanwhile).
    #[error("the swap file {} needs {needed_bytes} bytes and its file system has {available_bytes} bytes free", path.display())]
    NoRoom {
        /// The swap file that was to be made.
        path: PathBuf,
        /// Its preallocated size.
        needed_bytes: u64,
        /// The file system's free space (`f_bavail`) when it was checked.
        available_bytes: u64,
    },

    /// A read of a caller's file would go past its end (`fileio`).
    #[error("read of {len_bytes} bytes at offset {offset_bytes} of {path} goes past its end: the file holds {file_bytes} bytes (offset + length must be at most the file size)")]
    ReadPastEnd {
        path: PathBuf,
        offset_bytes: u64,
        len_bytes: u64,
        file_bytes: u64,
    },

    /// A transfer does not fit the buffer or the extent.
    #[error("{op} of {len_bytes} bytes at offset {offset_bytes} does not fit: buffer holds {buffer_bytes} bytes, extent holds {extent_bytes} bytes")]
    OutOfBounds {
        op: IoOp,
        offset_bytes: u64,
        len_bytes: u64,
        buffer_bytes: u64,
        extent_bytes: u64,
    },

    /// Data read back does not match the checksum recorded when it was written.
    #[error("checksum mismatch in swap extent {extent} ({path} at offset {offset_bytes}): stored crc32c {expected:#010x}, read {got:#010x}")]
    ChecksumMismatch {
        extent: u64,
        path: PathBuf,
        offset_bytes: u64,
        expected: u32,
        got: u32,
    },

    /// The path cannot do O_DIRECT and the config requires it.
    #[error("{path} does not support O_DIRECT (tmpfs or a network filesystem?); use a directory on a local disk, or set tierzero.direct_io to \"auto\" to fall back to buffered I/O")]
    DirectIoUnsupported { path: PathBuf },

    /// Another process holds the swap directory's lock.
    #[error("{} is locked by another tierzero process ({}): two runs must not share an nvme_path; give this run its own nvme_path, or wait for that process to finish", path.display(), match holder_pid { Some(p) => format!("pid {p}"), None => "pid unknown".to_owned() })]
    Locked {
        /// The lock file (`<nvme_path>/tierzero/lock`).
        path: PathBuf,
        /// The pid the holder wrote into it, if readable.
        holder_pid: Option<u32>,
    },

    /// The engine's worker threads are gone.
    #[error("swap engine has shut down")]
    Shutdown,
}

impl SwapError {
    /// The OS error kind behind this error, if there is one (a poisoned
    /// space's: the failed write's).
    pub fn io_kind(&self) -> Option<std::io::ErrorKind> {
        match self {
            SwapError::Io { source, .. } | SwapError::Setup { source, .. } => Some(source.kind()),
            SwapError::Poisoned { io_kind, .. } => *io_kind,
            _ => None,
        }
    }

    /// The OS error code behind this error, if there is one.
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            SwapError::Io { source, .. } | SwapError::Setup { source, .. } => source.raw_os_error(),
            SwapError::Poisoned { os_error, .. } => *os_error,
            _ => None,
        }
    }
}

/// The result type of this crate.
pub type Result<T, E = SwapError> = std::result::Result<T, E>;
